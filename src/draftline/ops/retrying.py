"""Commands that reach a remote (git fetch/push, dvc pull/push), retried through an outage.

A node left alone for a day must not stop at the first network blip: a failed call is tried
again with a growing pause, for at most `budget_s` seconds from its first failure, each pause
printed. A refusal that no wait changes (a rejected push: someone else wrote the ref) fails at
once. Past the budget the caller stops, saying what to rerun; nothing is lost either way,
since every command retried here is idempotent.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_BUDGET_S = 1800.0  # half an hour: longer than a restart of an object store or a router
FIRST_PAUSE_S = 2.0
MAX_PAUSE_S = 60.0
# Answers no retry changes: git refusing a push, a ref or remote that does not exist.
FINAL = ("[rejected]", "non-fast-forward", "couldn't find remote ref", "does not appear to be")


class RemoteUnreachable(SystemExit):
    """The remote stayed unreachable for the whole budget: the run stops, nothing lost."""


def is_final(output: str) -> bool:
    return any(marker in output for marker in FINAL)


def run_retrying(
    root: Path,
    cmd: list[str],
    *,
    budget_s: float,
    say: Callable[[str], None],
    rerun: str,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in `root` until it succeeds, fails for good, or `budget_s` has passed since its
    first failure. Returns the last result (the caller decides what a final failure means);
    raises RemoteUnreachable, naming `rerun`, when the budget runs out."""
    pause = FIRST_PAUSE_S
    gives_up: float | None = None
    while True:
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        output = done.stdout + done.stderr
        if done.returncode == 0 or is_final(output):
            return done
        now = time.monotonic()
        gives_up = gives_up if gives_up is not None else now + budget_s
        reason = first_error(output)
        if now >= gives_up:
            raise RemoteUnreachable(
                f"`{' '.join(cmd[:2])}` kept failing for {budget_s:.0f} s ({reason}); nothing is "
                f"lost: rerun `{rerun}` once the remote answers"
            )
        wait = min(pause, gives_up - now)
        say(f"`{' '.join(cmd[:2])}` failed ({reason}); retrying in {wait:.0f} s "
            f"(gives up {gives_up - now:.0f} s from now)")  # fmt: skip
        time.sleep(wait)
        pause = min(pause * 2, MAX_PAUSE_S)


def first_error(output: str) -> str:
    """The line that says why, without the command's noise."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("ERROR", "error:", "fatal:")):
            return line[:200]
    return (lines[-1] if lines else "no output")[:200]
