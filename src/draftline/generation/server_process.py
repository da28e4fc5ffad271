"""Inference servers as processes of this node: launch, wait for health, record, stop.

Shared by the SGLang (`sglang_server`) and vLLM (`vllm_server`) launchers, which only build the
command line and environment (`server_launch` starts them). One server per port. `launch` starts
the command in its own process group (so it outlives the stage that started it), logs to
`logs/serve/<kind>-<port>.log`, records a pid file `.draftline/serve/<kind>-<port>.json` and
waits for `GET /health`; when the server does not come up it is stopped and the log tail is
shown. Once ready, the state also records every process of the server and, where the launcher
says how, each engine's limits.

`stop` ends every process the launcher started: its own process group, every descendant, and
the process groups those descendants made (`sglang_router.launch_server` starts each DP engine
in a group of its own), found before any is signalled, since engines outlive a launcher that
exits on SIGTERM. They get SIGTERM and a grace period (SGLang shuts down gracefully), then
SIGKILL, and `stop` returns only when none is left; on a node with `nvidia-smi` it then checks
that no process of the server still holds a GPU.

A process is "the one launch started" when its pid has the start time recorded at launch
(`/proc/<pid>/stat`), so a pid reused by another program is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from draftline.generation.startup_watch import StartupWatch
from draftline.runtime import atomic, hardware

STATE_DIR = Path(".draftline/serve")
LOG_DIR = Path("logs/serve")
# What each kind of server is called in messages.
DISPLAY = {"sglang": "SGLang", "vllm": "vLLM"}
# How long `stop` lets the server shut down after SIGTERM before SIGKILL: SGLang engines finish
# a graceful shutdown of their own (up to 180 s) before they free their GPUs.
STOP_GRACE_S = 180.0


class ServeError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerState:
    pid: int
    url: str
    port: int
    command: list[str]
    log: str
    profile: str | None
    started_at: float
    # Start time of the process in clock ticks since boot (/proc/<pid>/stat field 22).
    start_ticks: int | None = None
    kind: str = "sglang"  # which server: names its pid file and log
    # Every process of the server once it was ready, [pid, start ticks]: `stop` still finds
    # engines in groups of their own after their launcher died.
    processes: list[list[int]] = field(default_factory=list)
    # Each engine's limits as it reported them once ready (`launch`'s `limits`), e.g. SGLang's
    # {"url", "max_running_requests", "max_total_num_tokens"}.
    engines: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Stopped:
    """What `stop` did: processes found alive, ended by SIGTERM within the grace period, ended
    by SIGKILL after it, still alive after all that; what `nvidia-smi` lists afterwards (None:
    no GPU check on this node)."""

    found: int = 0
    ended: int = 0
    killed: int = 0
    left: list[int] = field(default_factory=list)
    gpu_ours: list[int] | None = None  # processes of the server still holding a GPU
    gpu_others: list[int] | None = None  # other processes on the GPUs

    def __bool__(self) -> bool:
        return self.found > 0

    def summary(self) -> str:
        if not self.found:
            return "no process left"
        words = [f"{self.found} process{'es' if self.found != 1 else ''}"]
        words.append(f"{self.ended} ended on SIGTERM")
        if self.killed:
            words.append(f"{self.killed} killed after the grace period")
        if self.left:
            words.append(f"STILL ALIVE: pids {', '.join(map(str, self.left))}")
        if self.gpu_ours:
            words.append(f"GPUs STILL HELD by pids {', '.join(map(str, self.gpu_ours))}")
        elif self.gpu_ours is not None:
            others = f" ({len(self.gpu_others or [])} other processes on them)"
            words.append("no GPU held by it" + (others if self.gpu_others else ""))
        return ", ".join(words)

    @property
    def clean(self) -> bool:
        return not self.left and not self.gpu_ours


def display(kind: str) -> str:
    return DISPLAY.get(kind, kind)


# Health checks go straight to the server, never through an http_proxy of the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with _DIRECT.open(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def reach_url(bound: str, port: int) -> str:
    """Where clients on this node reach a server bound to `bound` (loopback for every address)."""
    reach = "127.0.0.1" if bound in ("0.0.0.0", "", "::", "[::]") else bound
    if ":" in reach and not reach.startswith("["):
        reach = f"[{reach}]"
    return f"http://{reach}:{port}"


def state_path(port: int, root: Path = Path("."), kind: str = "sglang") -> Path:
    return root / STATE_DIR / f"{kind}-{port}.json"


def read_states(root: Path = Path(".")) -> list[ServerState]:
    """Every server recorded on this node, of any kind, by port."""
    folder = root / STATE_DIR
    states = []
    for path in sorted(folder.glob("*-*.json")) if folder.exists() else []:
        try:
            states.append(ServerState(**json.loads(path.read_text(encoding="utf-8"))))
        except (ValueError, TypeError):
            continue
    return sorted(states, key=lambda s: s.port)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def alive(state: ServerState) -> bool:
    """The recorded process still runs and is still the one `launch` started."""
    fields = _stat(state.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    if state.start_ticks is not None:
        return int(fields[19]) == state.start_ticks
    try:  # a state recorded without a start time: compare the command line
        raw = Path(f"/proc/{state.pid}/cmdline").read_bytes()
    except OSError:
        return False
    return [a.decode() for a in raw.split(b"\0") if a] == state.command


def group_members(state: ServerState) -> list[int]:
    """Live processes of the server's process group (its engines), the leader included.

    Only while the group is still the one `launch` made: the leader is alive, or gone while its
    group lives on (Linux hands out no pid that is still a process group's id, so such a
    group is the leader's own). A pid now held by another process means the group is gone.
    """
    leader = _stat(state.pid)
    if leader is not None and leader[0] not in ("Z", "X") and not alive(state):
        return []  # the pid belongs to another program now
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields and fields[0] not in ("Z", "X") and int(fields[2]) == state.pid:
            members.append(int(entry.name))
    return sorted(members)


@dataclass(frozen=True)
class _Proc:
    ppid: int
    pgid: int
    ticks: int


def _table() -> dict[int, _Proc]:
    """Every live (not zombie) process of this node."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] not in ("Z", "X"):
                table[int(entry.name)] = _Proc(int(fields[1]), int(fields[2]), int(fields[19]))
    return table


def _grow(ours: dict[int, int], table: dict[int, _Proc]) -> dict[int, int]:
    """`ours` (pid -> start ticks) still alive, with every descendant and every member of their
    process groups. A group of ours holds only processes of ours: the launcher runs in a session
    of its own, and a process can join a group of its own session only."""
    ours = {pid: t for pid, t in ours.items() if pid in table and table[pid].ticks == t}
    while True:
        groups = {table[pid].pgid for pid in ours}
        more = {
            pid: proc.ticks
            for pid, proc in table.items()
            if pid not in ours and (proc.ppid in ours or proc.pgid in groups)
        }
        if not more:
            return ours
        ours.update(more)


def tree(state: ServerState) -> dict[int, int]:
    """Live processes of the server, pid -> start ticks: the launcher's group (`group_members`),
    the processes recorded once it was ready, and all they started, in whatever group."""
    table = _table()
    seeds = {pid: table[pid].ticks for pid in group_members(state) if pid in table}
    seeds.update({pid: ticks for pid, ticks in state.processes})
    return _grow(seeds, table)


def _signal(ours: dict[int, int], sig: signal.Signals) -> None:
    """`sig` to every process of ours and to every process group they are in."""
    table = _table()
    live = [pid for pid, t in ours.items() if pid in table and table[pid].ticks == t]
    for pgid in {table[pid].pgid for pid in live}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(
    ours: dict[int, int], timeout_s: float, proc: subprocess.Popen | None
) -> dict[int, int]:
    """Wait until no process of ours (new children included) is alive; what still is."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None:
            proc.poll()  # reap the launcher we started, else it lingers as a zombie
        live = _grow(ours, _table())
        ours.update(live)
        if not live or time.monotonic() >= deadline:
            return live
        time.sleep(0.1)


def end_tree(
    state: ServerState, grace_s: float = STOP_GRACE_S, proc: subprocess.Popen | None = None
) -> Stopped:
    """SIGTERM every process of the server, SIGKILL what outlives `grace_s`, wait until none is
    left (or, for a process stuck in the kernel, 60 s more) and check the GPUs."""
    ours = tree(state)
    if not ours:
        if proc is not None:
            proc.wait(timeout=10)
        return Stopped()
    _signal(ours, signal.SIGTERM)
    live = _wait_gone(ours, grace_s, proc)
    seen = len(ours)  # with what they started while shutting down
    if live:
        _signal(live, signal.SIGKILL)
        left = _wait_gone(live, 60.0, proc)
    else:
        left = {}
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    ours_gpu, others_gpu = gpu_holders(set(ours))
    return Stopped(
        found=seen,
        ended=seen - len(live),
        killed=len(live) - len(left),
        left=sorted(left),
        gpu_ours=ours_gpu,
        gpu_others=others_gpu,
    )


def gpu_holders(pids: set[int], timeout_s: float = 30.0) -> tuple[list[int] | None, list[int]]:
    """Which of `pids`, and which other processes, `nvidia-smi` lists on the GPUs, waiting up to
    `timeout_s` for the driver to let go of processes that just ended; (None, []) on a node
    without `nvidia-smi` or where it fails."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = hardware.nvidia_smi("--query-compute-apps=pid", timeout_s=30.0)
        if out is None:
            return None, []
        listed = {int(word) for word in out.split() if word.strip().isdigit()}
        if not listed & pids or time.monotonic() >= deadline:
            return sorted(listed & pids), sorted(listed - pids)
        time.sleep(1.0)


def log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def launch(
    kind: str,
    command: list[str],
    env: dict[str, str],
    *,
    port: int,
    url: str,
    profile: str | None,
    timeout_s: float = 1800.0,
    root: Path = Path("."),
    ready: Callable[[Path], str | None] | None = None,
    limits: Callable[[Path], list[dict[str, Any]]] | None = None,
) -> ServerState:
    """Start one server and wait until it is ready; return its recorded state.

    Ready: `/health` answers, and `ready(log)` (given the server's log) says nothing is
    missing (it returns what is, e.g. the engines a router still waits for, else None). Once
    ready, the state records the server's processes and `limits(log)`, its engines' limits. A
    ready server launched earlier on the port is returned as it is.

    How long it waits (`startup_watch`): `timeout_s`, and past it as long as the server's log
    shows progress (a first start downloads the weights and compiles kernels): it ends at the
    first silence of a third of `timeout_s`, or at 4 x `timeout_s`; the latest log line is
    printed every 30 s meanwhile. When the server exits or the wait ends, it is stopped and the
    error names the log and the flag to raise, then shows the log's last lines.
    """
    name = display(kind)
    log = root / LOG_DIR / f"{kind}-{port}.log"

    def missing(at: str) -> str | None:
        if not healthy(at, timeout_s=2.0):
            return "/health does not answer"
        return ready(log) if ready else None

    for state in read_states(root):
        if state.port == port and alive(state):
            if state.kind != kind:
                raise ServeError(
                    f"a {display(state.kind)} server started earlier holds port {port} (pid "
                    f"{state.pid}): `draftline serve stop --port {port}`, or use another --port"
                )
            if missing(state.url) is None:
                return state
            raise ServeError(
                f"a server started earlier on port {port} (pid {state.pid}) is not ready "
                f"({missing(state.url)}): wait for it, or `draftline serve stop --port {port}`; "
                f"see {state.log}"
            )
    if healthy(url):
        raise ServeError(
            f"something draftline did not start already answers at {url}: use it through "
            "generate.endpoints or the engine's endpoints variable, or start on another --port"
        )
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode())
        out.flush()
        watch = StartupWatch(log, timeout_s, f"{name} on port {port}")
        try:
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=root,
                env={**os.environ, **env},
                start_new_session=True,  # its own process group: outlives us, stopped as a whole
            )
        except OSError as exc:
            raise ServeError(f"cannot run the {name} launcher {command[0]!r}: {exc}") from exc
    state = ServerState(
        pid=proc.pid,
        url=url,
        port=port,
        command=command,
        log=str(log),
        profile=profile,
        started_at=time.time(),
        start_ticks=start_ticks(proc.pid),
        kind=kind,
    )
    atomic.write_json(state_path(port, root, kind), state.__dict__)
    code: int | None = None
    why_not: str | None = "/health does not answer"
    try:
        while not watch.expired():
            # Exit first: a foreign server on the port must not pass for ours.
            code = proc.poll()
            if code is not None:
                break
            why_not = missing(url)
            if why_not is None:
                state = replace(
                    state,
                    processes=[[pid, ticks] for pid, ticks in sorted(tree(state).items())],
                    engines=limits(log) if limits else [],
                )
                atomic.write_json(state_path(port, root, kind), state.__dict__)
                return state
            watch.poll()
            time.sleep(0.25)
    except BaseException:  # interrupted while waiting: leave no half-started server behind
        end_tree(state, 30.0, proc)
        state_path(port, root, kind).unlink(missing_ok=True)
        raise
    end_tree(state, 30.0, proc)
    state_path(port, root, kind).unlink(missing_ok=True)
    why = (
        f"exited with code {code} (stopped)"
        if code is not None
        else f"not ready {watch.waited()}: {why_not} (stopped); {watch.hint()}"
    )
    raise ServeError(
        f"{name} server on port {port} {why}. Command: {shlex.join(command)}\n"
        f"Last lines of {log}:\n{log_tail(log)}"
    )


def stop(state: ServerState, root: Path = Path("."), grace_s: float = STOP_GRACE_S) -> Stopped:
    """Stop a server `launch` recorded: every process of it (`tree`), SIGTERM, then SIGKILL
    after `grace_s`, and wait until none is left (`end_tree`); the pid file is removed either
    way. Only processes `tree` vouches for are signalled, never a pid now held by another
    program."""
    stopped = end_tree(state, grace_s)
    state_path(state.port, root, state.kind).unlink(missing_ok=True)
    return stopped
