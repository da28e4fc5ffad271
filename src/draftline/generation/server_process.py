"""Inference servers as processes of this node: launch, wait for health, record, stop.

Shared by the SGLang (`sglang_server`) and vLLM (`vllm_server`) launchers, which only build the
command line and environment. One server per port. `launch` starts the command in its own
process group (so it outlives the stage that started it), logs to `logs/serve/<kind>-<port>.log`,
records a pid file `.draftline/serve/<kind>-<port>.json` and waits for `GET /health`; when the
server does not come up it is stopped and the log tail is shown. `stop` ends only a process
group that `launch` recorded, after checking the process is still the one it launched.

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
from dataclasses import dataclass
from pathlib import Path

from draftline.runtime import atomic

STATE_DIR = Path(".draftline/serve")
LOG_DIR = Path("logs/serve")
# What each kind of server is called in messages.
DISPLAY = {"sglang": "SGLang", "vllm": "vLLM"}


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
) -> ServerState:
    """Start one server and wait until it is ready; return its recorded state.

    Ready: `/health` answers, and `ready(log)` (given the server's log) says nothing is
    missing (it returns what is, e.g. the engines a router still waits for, else None). A
    ready server launched earlier on the port is returned as it is. When the server exits or
    is not ready within `timeout_s`, it is stopped and the error shows the last lines of its
    log.
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Exit first: a foreign server on the port must not pass for ours.
            code = proc.poll()
            if code is not None:
                break
            why_not = missing(url)
            if why_not is None:
                return state
            time.sleep(0.25)
    except BaseException:  # interrupted while waiting: leave no half-started server behind
        _terminate(state, proc)
        state_path(port, root, kind).unlink(missing_ok=True)
        raise
    _terminate(state, proc)
    state_path(port, root, kind).unlink(missing_ok=True)
    why = (
        f"exited with code {code}"
        if code is not None
        else f"not ready after {timeout_s:g}s: {why_not}"
    )
    raise ServeError(
        f"{name} server on port {port} {why} (stopped). Command: {shlex.join(command)}\n"
        f"Last lines of {log}:\n{log_tail(log)}"
    )


def stop(state: ServerState, root: Path = Path("."), timeout_s: float = 60.0) -> bool:
    """Stop a server `launch` recorded; True when a live process of it was stopped.

    Only that server's process group is signalled, and only while `alive`/`group_members` say
    it is still the one `launch` started; the pid file is removed either way.
    """
    was_alive = bool(group_members(state))
    if was_alive:
        _terminate(state, None, timeout_s)
    state_path(state.port, root, state.kind).unlink(missing_ok=True)
    return was_alive


def _terminate(state: ServerState, proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group (router and engines), SIGKILL what outlives it."""
    if proc is None and not group_members(state):
        return
    try:
        os.killpg(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        if proc is not None:
            proc.wait(timeout=10)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()  # reap the leader so it does not linger as a zombie member
        if not group_members(state):
            break
        time.sleep(0.1)
    if group_members(state):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(state.pid, signal.SIGKILL)  # stragglers of the group, or a hung leader
    if proc is not None:
        proc.wait(timeout=10)
