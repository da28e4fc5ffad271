"""How long `serve start` waits for a server to be ready, read from the server's log.

A start gets `timeout_s` (`serve start --timeout`, `generate.serve_timeout_s`: 1800 s). A first
start takes longer: it downloads the weights (52 GB for Qwen3.6-27B) and compiles kernels, and
SGLang and vLLM log each phase (downloading, loading shards, capturing CUDA graphs). So past
`timeout_s` the wait goes on while the log shows progress, a new line within the last
`STALL_SHARE` of `timeout_s` (600 s), up to `CEILING` times `timeout_s` in all (2 h); it ends
at the first silence that long, or at the ceiling. One knob moves all three: `--timeout`.

Progress is any new log line (tqdm's carriage-return updates count each) except the lines the
waiting itself causes: requests to the routes draftline polls (`/health`, `/readiness`,
`/server_info`). While waiting, a line on stderr every `REPORT_EVERY_S` gives the latest one.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

STALL_SHARE = 1 / 3  # of timeout_s: the longest silence past it
CEILING = 4  # x timeout_s: the longest wait, whatever the log shows
REPORT_EVERY_S = 30.0
# Log lines about the requests the wait itself sends: no progress of the server's.
POLLED = re.compile(r"/(health|readiness|server_info|get_server_info)\b")
PHASE_CHARS = 160


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StartupWatch:
    """The wait of one start: feed it the log (`poll`), ask whether it is over (`expired`)."""

    def __init__(
        self,
        log: Path,
        timeout_s: float,
        label: str,
        say: Callable[[str], None] = _stderr,
    ) -> None:
        self.log, self.timeout_s, self.label, self.say = Path(log), float(timeout_s), label, say
        self.started = self.last_progress = self.reported_at = time.monotonic()
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.phase: str | None = None
        self.reported: str | None = None
        self.extended = False

    @property
    def stall_s(self) -> float:
        return self.timeout_s * STALL_SHARE

    @property
    def ceiling_s(self) -> float:
        return self.timeout_s * CEILING

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def poll(self) -> None:
        """Read what the log gained; report the latest phase now and then."""
        try:
            with self.log.open("rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            new = b""
        # Up to the last line end (or carriage return): a line being written waits its turn.
        cut = max(new.rfind(b"\n"), new.rfind(b"\r")) + 1
        self.offset += cut
        lines = re.split(r"[\r\n]+", new[:cut].decode("utf-8", errors="replace"))
        progress = [line.strip() for line in lines if line.strip() and not POLLED.search(line)]
        now = time.monotonic()
        if progress:
            self.last_progress, self.phase = now, progress[-1][:PHASE_CHARS]
        if self.phase != self.reported and now - self.reported_at >= REPORT_EVERY_S:
            self.say(f"{self.label}: {self.elapsed():.0f}s, {self.phase}")
            self.reported, self.reported_at = self.phase, now

    def expired(self) -> bool:
        """Past `timeout_s` with a silent log, or past the ceiling."""
        elapsed = self.elapsed()
        if elapsed < self.timeout_s:
            return False
        if elapsed >= self.ceiling_s or time.monotonic() - self.last_progress >= self.stall_s:
            return True
        if not self.extended:
            self.extended = True
            self.say(
                f"{self.label}: not ready after {self.timeout_s:g}s, but its log shows progress: "
                f"waiting while it does (a silence of {self.stall_s:g}s ends it, and "
                f"{self.ceiling_s:g}s in all)"
            )
        return False

    def waited(self) -> str:
        """How long the wait went, and what ended it: "after 1800s", or past the timeout
        "after 2410s (its log has shown nothing new for 600s)"."""
        if not self.extended:
            return f"after {self.timeout_s:g}s"
        if self.elapsed() >= self.ceiling_s:
            return f"after {self.elapsed():.0f}s ({CEILING}x --timeout, the most a start may take)"
        return f"after {self.elapsed():.0f}s (its log has shown nothing new for {self.stall_s:g}s)"

    def hint(self) -> str:
        """The log to read and the flag to raise."""
        return (
            f"see {self.log}; a first start downloads the weights and compiles kernels: raise "
            "--timeout (generate.serve_timeout_s) if it needs longer"
        )
