"""SGLang servers started from the hardware profile and the model's `serving` block: command
lines, environment, start, stop, status.

One server per port. `start` launches it in its own process group (so it outlives the shard
stage that started it), logs to `logs/serve/sglang-<port>.log`, records a pid file under
`.draftline/serve/` and waits for `GET /health`; when the server does not come up it is stopped
and the log tail is shown. `stop` ends only a process group that `start` recorded, after
checking the process is still the one it launched.

With `sglang.dp_size > 1` the launcher is `python -m sglang_router.launch_server --dp-size N`
(a router in front of N engines on one port), else `python -m sglang.launch_server`. The Python
that runs SGLang may live in its own environment: `$DRAFTLINE_SGLANG_PYTHON` names it.
`$DRAFTLINE_SGLANG_LAUNCHER` replaces `python -m <module>` altogether with another command
(split like a shell line; the flags follow it): a wrapper that enters a container or another
environment, or, in the tests, a stand-in server (SGLang needs a GPU).

A process is "the one start launched" when its pid has the start time recorded at launch
(`/proc/<pid>/stat`), so a pid reused by another program is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline.runtime import atomic

PYTHON_ENV = "DRAFTLINE_SGLANG_PYTHON"
LAUNCHER_ENV = "DRAFTLINE_SGLANG_LAUNCHER"
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
    # Start time of the process in clock ticks since boot (/proc/<pid>/stat field 22).
    start_ticks: int | None = None


def sglang_settings(profile: dict[str, Any]) -> dict[str, Any]:
    sg = profile.get("sglang")
    if not sg:
        raise ServeError(
            f"SGLang is not for hardware profile {profile.get('name')!r}: it has no sglang "
            f"section (engine {profile.get('engine')!r}) and SGLang needs GPUs. Without GPUs "
            "generate runs the local engine and needs no server; on a GPU node use "
            "--hardware pro6000x4, --hardware b200x8 or --hardware auto"
        )
    return sg


def bind_host(profile: dict[str, Any], host: str | None = None) -> str:
    return str(host or sglang_settings(profile).get("host") or "127.0.0.1")


def bind_port(profile: dict[str, Any], port: int | None = None) -> int:
    return int(port or sglang_settings(profile).get("port") or 30000)


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
    launcher = os.environ.get(LAUNCHER_ENV, "").strip()
    if launcher and python is None:
        cmd = shlex.split(launcher)
    else:
        cmd = [python or os.environ.get(PYTHON_ENV) or sys.executable, "-m", module]
    cmd += ["--model-path", str(model["path"])]
    if model.get("revision"):
        cmd += ["--revision", str(model["revision"])]
    cmd += ["--host", bind_host(profile, host)]
    cmd += ["--port", str(bind_port(profile, port))]
    cmd += ["--tp-size", str(int(sg.get("tp_size") or 1))]
    if dp > 1:
        cmd += ["--dp-size", str(dp)]
    serving = model.get("serving") or {}
    if serving.get("quantization"):
        cmd += ["--quantization", str(serving["quantization"])]
    if serving.get("kv_cache_dtype") and serving["kv_cache_dtype"] != "auto":
        cmd += ["--kv-cache-dtype", str(serving["kv_cache_dtype"])]
    if sg.get("mem_fraction_static"):
        cmd += ["--mem-fraction-static", str(sg["mem_fraction_static"])]
    if sg.get("context_length"):
        cmd += ["--context-length", str(int(sg["context_length"]))]
    if sg.get("max_running_requests"):
        cmd += ["--max-running-requests", str(int(sg["max_running_requests"]))]
    spec = serving.get("speculative") or {}
    if spec.get("algorithm"):
        cmd += ["--speculative-algorithm", str(spec["algorithm"])]
        if spec.get("draft_model_path"):
            cmd += ["--speculative-draft-model-path", str(spec["draft_model_path"])]
        for key, flag in (
            ("num_steps", "--speculative-num-steps"),
            ("eagle_topk", "--speculative-eagle-topk"),
            ("num_draft_tokens", "--speculative-num-draft-tokens"),
        ):
            if spec.get(key) is not None:
                cmd += [flag, str(int(spec[key]))]
    if model.get("hybrid") and serving.get("mamba_scheduler_strategy"):
        cmd += ["--mamba-scheduler-strategy", str(serving["mamba_scheduler_strategy"])]
    if sg.get("hierarchical_cache"):
        cmd += ["--enable-hierarchical-cache"]
    if serving.get("reasoning_parser"):
        cmd += ["--reasoning-parser", str(serving["reasoning_parser"])]
    # We send and receive token ids only: the server needs no tokenizer of its own.
    if sg.get("skip_tokenizer_init", True):
        cmd += ["--skip-tokenizer-init"]
    cmd += [str(a) for a in sg.get("extra_args") or []]
    return cmd


def with_speculation(
    model: dict[str, Any], drafter: str | Path | None = None, off: bool = False
) -> dict[str, Any]:
    """The model served with another speculative decoding: the exported DFlash drafter at
    `drafter` (SGLang's DFLASH, drafting its block size), or none at all (`off`: the baseline a
    speed-up is measured against). Without either, the model's own (`serving.speculative`)."""
    if drafter is None and not off:
        return model
    speculative = None
    if drafter is not None:
        config = Path(drafter) / "config.json"
        if not config.is_file():
            raise ServeError(f"no exported drafter in {drafter}: run `dvc repro train` first")
        block = json.loads(config.read_text(encoding="utf-8"))["block_size"]
        speculative = {
            "algorithm": "DFLASH",
            "draft_model_path": str(drafter),
            "num_draft_tokens": int(block),
        }
    return {**model, "serving": {**(model.get("serving") or {}), "speculative": speculative}}


def server_env(profile: dict[str, Any], model: dict[str, Any]) -> dict[str, str]:
    """Environment the server needs beyond this process's: the node's (`sglang.env`), then the
    model's (`serving.env`, e.g. SGLANG_ENABLE_SPEC_V2 for MTP on a hybrid model)."""
    node = sglang_settings(profile).get("env") or {}
    served = (model.get("serving") or {}).get("env") or {}
    return {str(k): str(v) for k, v in {**node, **served}.items()}


def serving_identity(model: dict[str, Any]) -> str:
    """What the server computes, as recorded with every generated sample (sorted JSON)."""
    return json.dumps(model.get("serving") or {}, sort_keys=True, separators=(",", ":"))


def server_url(profile: dict[str, Any], host: str | None = None, port: int | None = None) -> str:
    """Where clients on this node reach the server (loopback when it binds every address)."""
    bound = bind_host(profile, host)
    reach = "127.0.0.1" if bound in ("0.0.0.0", "", "::", "[::]") else bound
    if ":" in reach and not reach.startswith("["):
        reach = f"[{reach}]"
    return f"http://{reach}:{bind_port(profile, port)}"


# Health checks go straight to the server, never through an http_proxy of the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with _DIRECT.open(f"{url}/health", timeout=timeout_s) as resp:
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
    """The recorded process still runs and is still the one `start` launched."""
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

    Only while the group is still the one `start` made: the leader is alive, or gone while its
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
    """Start one server and wait until `/health` answers; return its recorded state.

    A healthy server this module started earlier on the port is returned as it is. When the
    server exits or is not healthy within `timeout_s`, it is stopped and the error shows the
    last lines of its log.
    """
    command = server_command(profile, model, host=host, port=port)
    env = {**server_env(profile, model), **(env or {})}
    port = bind_port(profile, port)
    url = server_url(profile, host, port)
    for state in read_states(root):
        if state.port == port and alive(state):
            if healthy(state.url):
                return state
            raise ServeError(
                f"a server started earlier on port {port} (pid {state.pid}) is not healthy: "
                f"`draftline serve stop --port {port}`, see {state.log}"
            )
    if healthy(url):
        raise ServeError(
            f"something draftline did not start already answers at {url}: use it through "
            "generate.endpoints / $DRAFTLINE_SGLANG_ENDPOINTS, or start on another --port"
        )
    log = root / LOG_DIR / f"sglang-{port}.log"
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
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: outlives us, stopped as a whole
            )
        except OSError as exc:
            raise ServeError(f"cannot run the SGLang launcher {command[0]!r}: {exc}") from exc
    state = ServerState(
        pid=proc.pid,
        url=url,
        port=port,
        command=command,
        log=str(log),
        profile=profile.get("name"),
        started_at=time.time(),
        start_ticks=start_ticks(proc.pid),
    )
    atomic.write_json(state_path(port, root), state.__dict__)
    code: int | None = None
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Exit first: a foreign server on the port must not pass for ours.
            code = proc.poll()
            if code is not None:
                break
            if healthy(url, timeout_s=2.0):
                return state
            time.sleep(0.25)
    except BaseException:  # interrupted while waiting: leave no half-started server behind
        _terminate(state, proc)
        state_path(port, root).unlink(missing_ok=True)
        raise
    _terminate(state, proc)
    state_path(port, root).unlink(missing_ok=True)
    why = f"exited with code {code}" if code is not None else f"not healthy after {timeout_s:g}s"
    raise ServeError(
        f"SGLang server on port {port} {why} (stopped). Command: {shlex.join(command)}\n"
        f"Last lines of {log}:\n{log_tail(log)}"
    )


def stop(state: ServerState, root: Path = Path("."), timeout_s: float = 60.0) -> bool:
    """Stop a server `start` recorded; True when a live process of it was stopped.

    Only that server's process group is signalled, and only while `alive`/`group_members` say
    it is still the one `start` launched; the pid file is removed either way.
    """
    was_alive = bool(group_members(state))
    if was_alive:
        _terminate(state, None, timeout_s)
    state_path(state.port, root).unlink(missing_ok=True)
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
