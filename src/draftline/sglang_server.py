"""SGLang servers started from the hardware profile: command lines, start, stop, status.

One server per port. `start` launches it in its own process group (so it outlives the shard
stage that started it), logs to `logs/serve/sglang-<port>.log`, records a pid file under
`.draftline/serve/` and waits for `GET /health`; when the server does not come up it is stopped
and the log tail is shown. `stop` ends only a process group that `start` recorded, after
checking the process is still the one it launched.

With `sglang.dp_size > 1` the launcher is `python -m sglang_router.launch_server --dp-size N`
(a router in front of N engines on one port), else `python -m sglang.launch_server`. The Python
that runs SGLang may live in its own environment: `$DRAFTLINE_SGLANG_PYTHON` names it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline import atomic

PYTHON_ENV = "DRAFTLINE_SGLANG_PYTHON"
STATE_DIR = Path(".draftline/serve")
LOG_DIR = Path("logs/serve")


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


def sglang_settings(profile: dict[str, Any]) -> dict[str, Any]:
    sg = profile.get("sglang")
    if not sg:
        raise ServeError(
            f"hardware profile {profile.get('name')!r} has no sglang section (engine "
            f"{profile.get('engine')!r}): use hardware=pro6000x4, hardware=b200x8 or hardware=auto "
            "on a GPU node"
        )
    return sg


def server_command(
    profile: dict[str, Any],
    model: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    python: str | None = None,
) -> list[str]:
    """The SGLang launch command for this profile and target, flags in a stable order."""
    sg = sglang_settings(profile)
    dp = int(sg.get("dp_size") or 1)
    module = "sglang_router.launch_server" if dp > 1 else "sglang.launch_server"
    cmd = [python or os.environ.get(PYTHON_ENV) or sys.executable, "-m", module]
    cmd += ["--model-path", str(model["path"])]
    if model.get("revision"):
        cmd += ["--revision", str(model["revision"])]
    cmd += ["--host", str(host or sg.get("host") or "127.0.0.1")]
    cmd += ["--port", str(port or sg.get("port") or 30000)]
    cmd += ["--tp-size", str(int(sg.get("tp_size") or 1))]
    if dp > 1:
        cmd += ["--dp-size", str(dp)]
    if sg.get("quantization"):
        cmd += ["--quantization", str(sg["quantization"])]
    if sg.get("kv_cache_dtype") and sg["kv_cache_dtype"] != "auto":
        cmd += ["--kv-cache-dtype", str(sg["kv_cache_dtype"])]
    if sg.get("mem_fraction_static"):
        cmd += ["--mem-fraction-static", str(sg["mem_fraction_static"])]
    if sg.get("context_length"):
        cmd += ["--context-length", str(int(sg["context_length"]))]
    if sg.get("max_running_requests"):
        cmd += ["--max-running-requests", str(int(sg["max_running_requests"]))]
    spec = sg.get("speculative") or {}
    if spec.get("algorithm"):
        cmd += ["--speculative-algorithm", str(spec["algorithm"])]
        for key, flag in (
            ("num_steps", "--speculative-num-steps"),
            ("eagle_topk", "--speculative-eagle-topk"),
            ("num_draft_tokens", "--speculative-num-draft-tokens"),
        ):
            if spec.get(key) is not None:
                cmd += [flag, str(int(spec[key]))]
    if sg.get("hierarchical_cache"):
        cmd += ["--enable-hierarchical-cache"]
    if sg.get("reasoning_parser"):
        cmd += ["--reasoning-parser", str(sg["reasoning_parser"])]
    # We send and receive token ids only: the server needs no tokenizer of its own.
    if sg.get("skip_tokenizer_init", True):
        cmd += ["--skip-tokenizer-init"]
    cmd += [str(a) for a in sg.get("extra_args") or []]
    return cmd


def server_url(profile: dict[str, Any], host: str | None = None, port: int | None = None) -> str:
    sg = sglang_settings(profile)
    return f"http://{host or sg.get('host') or '127.0.0.1'}:{port or sg.get('port') or 30000}"


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def state_path(port: int, root: Path = Path(".")) -> Path:
    return root / STATE_DIR / f"sglang-{port}.json"


def read_states(root: Path = Path(".")) -> list[ServerState]:
    folder = root / STATE_DIR
    states = []
    for path in sorted(folder.glob("sglang-*.json")) if folder.exists() else []:
        try:
            states.append(ServerState(**json.loads(path.read_text(encoding="utf-8"))))
        except (ValueError, TypeError):
            continue
    return states


def alive(state: ServerState) -> bool:
    """The recorded process still runs and is still the command `start` launched."""
    try:
        raw = Path(f"/proc/{state.pid}/cmdline").read_bytes()
        status = Path(f"/proc/{state.pid}/stat").read_text()
    except OSError:
        return False
    if status.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return [a.decode() for a in raw.split(b"\0") if a] == state.command


def log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def start(
    profile: dict[str, Any],
    model: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    timeout_s: float = 1800.0,
    root: Path = Path("."),
    env: dict[str, str] | None = None,
) -> ServerState:
    """Start one server and wait until `/health` answers; return its recorded state."""
    command = server_command(profile, model, host=host, port=port)
    port = int(command[command.index("--port") + 1])
    url = server_url(profile, host, port)
    for state in read_states(root):
        if state.port == port and alive(state):
            if healthy(state.url):
                return state
            raise ServeError(f"a server started earlier on port {port} (pid {state.pid}) is not "
                             f"healthy: `draftline serve stop --port {port}`, see {state.log}")
    if healthy(url):
        raise ServeError(
            f"something draftline did not start already answers at {url}: use it through "
            "generate.endpoints / $DRAFTLINE_SGLANG_ENDPOINTS, or start on another --port"
        )
    log = root / LOG_DIR / f"sglang-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=root,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: outlives us, stopped as a whole
        )
    state = ServerState(
        pid=proc.pid,
        url=url,
        port=port,
        command=command,
        log=str(log),
        profile=profile.get("name"),
        started_at=time.time(),
    )
    atomic.write_json(state_path(port, root), state.__dict__)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy(url, timeout_s=2.0):
            return state
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    code = proc.poll()
    _terminate(state, proc)
    state_path(port, root).unlink(missing_ok=True)
    why = f"exited with code {code}" if code is not None else f"not healthy after {timeout_s:g}s"
    raise ServeError(
        f"SGLang server on port {port} {why}. Command: {' '.join(command)}\n"
        f"Last lines of {log}:\n{log_tail(log)}"
    )


def stop(state: ServerState, root: Path = Path("."), timeout_s: float = 60.0) -> bool:
    """Stop a server `start` recorded; True when a live process was stopped."""
    was_alive = alive(state)
    if was_alive:
        _terminate(state, None, timeout_s)
    state_path(state.port, root).unlink(missing_ok=True)
    return was_alive


def _terminate(state: ServerState, proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group (router and engines), SIGKILL what outlives it."""
    try:
        os.killpg(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (proc.poll() is not None) if proc is not None else not alive(state):
            break
        time.sleep(0.2)
    try:
        os.killpg(state.pid, signal.SIGKILL)  # stragglers of the group, or a leader that hung
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait(timeout=10)
