"""SGLang servers started from the hardware profile and the model's `serving` block: command
lines, environment, the engines behind a router, start.

What every engine's start shares is `server_launch`'s; one server per port, launched,
health-checked, recorded and stopped by `draftline.generation.server_process` (logs in
`logs/serve/sglang-<port>.log`, pid file `.draftline/serve/sglang-<port>.json`).

With `sglang.dp_size > 1` the launcher is `python -m sglang_router.launch_server --dp-size N`
(a router in front of N engines on one port), else `python -m sglang.launch_server`. The Python
that runs SGLang may live in its own environment: `$DRAFTLINE_SGLANG_PYTHON` names it.
`$DRAFTLINE_SGLANG_LAUNCHER` replaces `python -m <module>` altogether with another command
(split like a shell line; the flags follow it): a wrapper that enters a container or another
environment, or, in the tests, a stand-in server (SGLang needs a GPU).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

from draftline.generation import host_cache, timeouts
from draftline.generation.server_launch import (
    ServerKind,
    checkpoint_flags,
    extra_flags,
    modules_missing,
    precision_flags,
)
from draftline.generation.server_process import (
    _DIRECT,
    ServeError,
    ServerState,
    alive,
    healthy,
    reach_url,
    read_states,
)
from draftline.generation.startup_watch import CEILING, StartupWatch

PYTHON_ENV = "DRAFTLINE_SGLANG_PYTHON"
LAUNCHER_ENV = "DRAFTLINE_SGLANG_LAUNCHER"
# The attention SGLang runs deterministically with the radix cache on every GPU generation.
DETERMINISTIC_ATTENTION = "triton"
PRIORITY_FLAGS = ["--enable-priority-scheduling", "--disable-priority-preemption"]
DEFAULT_SERVE_TIMEOUT_S = 1800.0  # generate.serve_timeout_s when a run does not say

SGLANG = ServerKind(
    "sglang",
    default_port=30000,
    python_env=PYTHON_ENV,
    without_section=" and SGLang needs GPUs. Without GPUs generate runs the local engine and "
    "needs no server; on a GPU node use --hardware pro6000x4, --hardware b200x8 or --hardware auto",
)
# The profile's section, the server's address and pid file, its Python (`server_launch`).
sglang_settings = SGLANG.settings
bind_host = SGLANG.bind_host
bind_port = SGLANG.bind_port
server_url = SGLANG.server_url
state_path = SGLANG.state_path
engine_python = SGLANG.engine_python


def missing_engine(profile: dict[str, Any]) -> str | None:
    """Why the profile's SGLang cannot start from this node's Python, with the fix; None when
    its modules import (or `$DRAFTLINE_SGLANG_LAUNCHER` replaces the Python command)."""
    if os.environ.get(LAUNCHER_ENV, "").strip():
        return None
    modules = (
        ["sglang", "sglang_router"]
        if int(sglang_settings(profile).get("dp_size") or 1) > 1
        else ["sglang"]
    )
    python = engine_python()
    missing = modules_missing(python, modules)
    if not missing:
        return None
    where = f"${PYTHON_ENV}={python}" if python != sys.executable else f"this Python ({python})"
    return (
        f"{' and '.join(missing)} cannot be imported by {where}: pip install -e '.[sglang]' "
        f"there, or set {PYTHON_ENV} to the python of the environment that has SGLang "
        "(README: GPU node with SGLang)"
    )


def server_command(
    profile: dict[str, Any],
    model: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    python: str | None = None,
    generate: dict[str, Any] | None = None,
) -> list[str]:
    """The SGLang launch command for this profile and target, flags in a stable order.
    `generate`: the run's `generate` section, whose client timeout the router's must exceed
    and whose `serve_timeout_s` sets how long the router waits for its engines to register."""
    sg = sglang_settings(profile)
    dp = int(sg.get("dp_size") or 1)
    module = "sglang_router.launch_server" if dp > 1 else "sglang.launch_server"
    launcher = os.environ.get(LAUNCHER_ENV, "").strip()
    if launcher and python is None:
        cmd = shlex.split(launcher)
    else:
        cmd = [engine_python(python), "-m", module]
    cmd += checkpoint_flags(model, "--model-path")
    cmd += SGLANG.address_flags(profile, host, port)
    cmd += ["--tp-size", str(int(sg.get("tp_size") or 1))]
    if dp > 1:
        cmd += ["--dp-size", str(dp)]
    cmd += precision_flags(model)
    serving = model.get("serving") or {}
    if sg.get("mem_fraction_static"):
        cmd += ["--mem-fraction-static", str(sg["mem_fraction_static"])]
    context = context_length(profile, model)
    if context:
        cmd += ["--context-length", str(context)]
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
        if spec.get("draft_model_path") and (
            serving.get("quantization") or serving.get("checkpoint")
        ):
            # SGLang quantizes a draft model as it does the target unless told otherwise
            # (0.5.23, arg_groups/serving_hook.py): serve the drafter as it was trained, beside
            # a pre-quantized checkpoint too, whose quantization SGLang detects on loading.
            cmd += ["--speculative-draft-model-quantization", "unquant"]
    # A hybrid target needs no flag: `--mamba-radix-cache-strategy` defaults to `auto`, which
    # picks extra_buffer for Qwen3.5/3.6 (SGLang 0.5.23, arg_groups/overrides.py).
    if sg.get("hierarchical_cache"):
        cmd += ["--enable-hierarchical-cache"]
        host_gb = host_cache.host_cache_gb(sg)
        if host_gb:
            cmd += ["--hicache-size", str(host_gb)]
    if serving.get("deterministic_inference"):
        cmd += ["--enable-deterministic-inference"]
        if "--attention-backend" not in (sg.get("extra_args") or []):
            cmd += ["--attention-backend", DETERMINISTIC_ATTENTION]
    # The client sends each turn's priority (its conversation's turns left) and SGLang serves
    # higher values first from its own queue, without preempting running requests for them
    # (a preempted request loses its decode progress). SGLang 0.5.23: arg_groups/fields/schedule.py.
    cmd += PRIORITY_FLAGS
    if dp > 1:
        # The router waits longer than the client does for the same answer, and leaves the
        # retrying to the client (which retries on another endpoint and journals): retries of
        # both would multiply, and a retried answer starts from scratch.
        gen = generate or {}
        max_new = int(gen.get("max_new_tokens") or model.get("max_new_tokens") or 0)
        router_s = timeouts.router_timeout_s(profile, max_new, gen.get("request_timeout_s"))
        cmd += ["--router-request-timeout-secs", str(router_s)]
        cmd += ["--router-disable-retries"]
        # The router's cache-aware routing sends a retried turn back to the engine holding its
        # prefix, dead or not, until that engine's circuit breaker opens: after 10 failures by
        # default (sglang-router 0.3.2), so a turn lost alone with a dead engine spent every
        # try there. Opened before the client's last try, that try reaches another engine.
        cmd += ["--router-cb-failure-threshold", str(router_breaker_failures(gen))]
        # The router drops engines not registered within its startup timeout (1800 s by
        # default): as long as `serve start` may wait for a first start (`startup_watch`).
        serve_s = float(gen.get("serve_timeout_s") or DEFAULT_SERVE_TIMEOUT_S)
        cmd += ["--router-worker-startup-timeout-secs", str(math.ceil(serve_s * CEILING))]
    # We send and receive token ids only: the server needs no tokenizer of its own (nor a
    # reasoning parser, which SGLang builds only with a tokenizer).
    if sg.get("skip_tokenizer_init", True):
        cmd += ["--skip-tokenizer-init"]
    cmd += extra_flags(sg)
    return cmd


def router_breaker_failures(generate: dict[str, Any]) -> int:
    """Failed requests after which the router stops sending to an engine (its circuit
    breaker): 3, or the client's retries when fewer, so a lost turn's last try goes elsewhere."""
    return max(1, min(3, int(generate.get("max_retries", 5))))


def deterministic_note(profile: dict[str, Any], model: dict[str, Any]) -> str | None:
    """The line `serve start` prints when the model is served deterministically (None
    otherwise). SGLang 0.5.23 left to itself does not start the 27B that way on either GPU
    profile: on B200 the Qwen3.5 defaults pick trtllm_mha, which deterministic inference
    refuses; on the RTX PRO 6000 it falls back to flashinfer and turns the radix cache off,
    which the hierarchical cache refuses (and without which the state pool holds every
    requested request's slots). Triton attention is deterministic with the radix cache
    (arg_groups/choices.py RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND), so both caches
    stay; tests/engines/test_sglang_startup.py runs SGLang's own resolution on it."""
    if not (model.get("serving") or {}).get("deterministic_inference"):
        return None
    if "--attention-backend" in (sglang_settings(profile).get("extra_args") or []):
        return "model.serving.deterministic_inference: the attention backend of sglang.extra_args"
    return (
        f"model.serving.deterministic_inference: {DETERMINISTIC_ATTENTION} attention "
        "(batch-invariant, radix and hierarchical caches kept), slower than the GPU's own "
        "kernels: measure it with `draftline calibrate`"
    )


def context_length(profile: dict[str, Any], model: dict[str, Any]) -> int | None:
    """The context length served: the model's (`serving.context_length`, which every engine
    caps each turn to), else the profile's own `sglang.context_length`, else the model's."""
    served = (model.get("serving") or {}).get("context_length")
    node = sglang_settings(profile).get("context_length")
    if served and node and int(node) != int(served):
        raise ServeError(
            f"hardware.sglang.context_length={node} differs from the served "
            f"model.serving.context_length={served}, which the clients cap every turn to: "
            "drop the profile's"
        )
    value = served or node
    return int(value) if value else None


def server_env(profile: dict[str, Any], model: dict[str, Any]) -> dict[str, str]:
    """Environment the server needs beyond this process's: the node's (`sglang.env`), then the
    model's (`serving.env`)."""
    return SGLANG.server_env(profile, model)


# sglang_router 0.3.2 (`launch_server.py`) starts the DP engines, logging one line each to the
# server's log ("Launching DP server process <i> on port <port>"), and answers `/health` as soon
# as the router itself runs, before any engine has loaded (`/health` is its liveness probe).
ENGINE_LAUNCHED = re.compile(r"Launching DP server process (\d+) on port (\d+)")


def engine_urls(log: str | Path, host: str) -> list[str]:
    """The URLs of the DP engines the router's last launch logged to `log`, in rank order."""
    try:
        text = Path(log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    last = text.rsplit("\n=== ", 1)[-1]  # `launch` heads each start with `=== <time> <cmd>`
    ports = {int(rank): int(port) for rank, port in ENGINE_LAUNCHED.findall(last)}
    return [reach_url(host, ports[rank]) for rank in sorted(ports)]


def engines_missing(
    profile: dict[str, Any], host: str | None = None, port: int | None = None
) -> Any:
    """`launch`'s readiness check for this profile: with a router in front of DP engines, what
    is missing until every engine it launched answers its own `/health` and the router's
    `/readiness` counts them all healthy (None once both hold)."""
    dp = int(sglang_settings(profile).get("dp_size") or 1)
    if dp <= 1:
        return None
    bound = bind_host(profile, host)
    router = server_url(profile, host, port)

    def missing(log: Path) -> str | None:
        engines = engine_urls(log, bound)
        up = sum(healthy(url, timeout_s=2.0) for url in engines)
        if len(engines) != dp or up != dp:
            return f"{up} of {dp} engines healthy behind the router"
        return router_missing(router, dp)

    return missing


def router_missing(url: str, dp: int) -> str | None:
    """Why the router at `url` does not serve all `dp` engines yet, or None. It registers its
    workers in a job of its own after they answer, and its `/readiness` says ready once one is
    healthy: every engine must be among `healthy_workers` (sglang-router 0.3.2)."""
    try:
        with _DIRECT.open(f"{url}/readiness", timeout=2.0) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # a router without the route: the engines' /health is all there is
            return None
        return f"router /readiness: HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError):
        return "the router's /readiness does not answer"
    body = body if isinstance(body, dict) else {}
    healthy_n, total = body.get("healthy_workers"), body.get("total_workers")
    if body.get("status") == "ready" and healthy_n == total == dp:
        return None
    return f"router /readiness: {healthy_n} of {total} workers healthy, {dp} engines launched"


def server_limits(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """One engine's limits as it reports them: the running-request cap its scheduler settled on
    (SGLang 0.5.23's `/server_info`: `internal_states[].effective_max_running_requests_per_dp`,
    below `--max-running-requests` when memory or CUDA graphs allow fewer; else the configured
    `max_running_requests`) and its KV pool in tokens (`max_total_num_tokens`)."""
    info: Any = None
    for route in ("/server_info", "/get_server_info"):  # the second: SGLang before 0.5.23
        try:
            with _DIRECT.open(f"{url}{route}", timeout=timeout_s) as resp:
                info = json.loads(resp.read())
            break
        except (urllib.error.URLError, OSError, ValueError):
            continue
    if not isinstance(info, dict):
        return {"url": url}
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    running = [s.get("effective_max_running_requests_per_dp") for s in states]
    if running and all(isinstance(r, int) for r in running):
        cap = sum(running)
    else:
        cap = info.get("max_running_requests")
    return {
        "url": url,
        "max_running_requests": cap if isinstance(cap, int) else None,
        "max_total_num_tokens": info.get("max_total_num_tokens"),
    }


def engine_limits(profile: dict[str, Any], host: str | None = None, port: int | None = None) -> Any:
    """`launch`'s `limits` for this profile: each engine's (`server_limits`), behind a router
    every DP engine it logged, else the server itself."""
    dp = int(sglang_settings(profile).get("dp_size") or 1)

    def limits(log: Path) -> list[dict[str, Any]]:
        urls = engine_urls(log, bind_host(profile, host)) if dp > 1 else []
        return [server_limits(u) for u in urls or [server_url(profile, host, port)]]

    return limits


def describe_limits(state: ServerState) -> str | None:
    """The line `serve start` prints about the engines' real limits (None when unknown)."""
    caps = [e.get("max_running_requests") for e in state.engines]
    if not caps or not all(isinstance(c, int) for c in caps):
        return None
    tokens = [e.get("max_total_num_tokens") for e in state.engines]
    pools = f", KV pools of {min(tokens):,}-{max(tokens):,} tokens" if all(tokens) else ""
    running = "/".join(map(str, sorted(set(caps))))
    return f"engines: {len(caps)}, running at most {running} requests each{pools}"


def recorded_limits(profile: dict[str, Any], root: Path = Path(".")) -> list[dict[str, Any]]:
    """The limits `serve start` recorded for the profile's own server on this node, if it runs."""
    port = bind_port(profile)
    for state in read_states(root):
        if state.port == port and state.kind == "sglang" and alive(state):
            return state.engines
    return []


def wait_for_engines(profile: dict[str, Any], timeout_s: float, root: Path = Path(".")) -> None:
    """Before a stage talks to the router `serve start` launched on this node: wait until
    every engine behind it answers and the router serves them all (its `/health` alone says
    nothing about them). As long as `serve start` waits (`startup_watch`): `timeout_s`, and
    past it while the server's log shows progress, printing its latest line now and then."""
    missing = engines_missing(profile)
    port = bind_port(profile)
    state = next((s for s in read_states(root) if s.port == port and s.kind == "sglang"), None)
    if missing is None or state is None:
        return
    watch = StartupWatch(root / state.log, timeout_s, f"the SGLang router at {state.url}")
    while (why := missing(root / state.log)) is not None:
        if watch.expired():
            raise ServeError(
                f"the router at {state.url} is up but not ready: {why} ({watch.waited()}); "
                f"{watch.hint()}"
            )
        watch.poll()
        time.sleep(1.0)


def start(
    profile: dict[str, Any],
    model: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    timeout_s: float = 1800.0,
    root: Path = Path("."),
    env: dict[str, str] | None = None,
    generate: dict[str, Any] | None = None,
) -> ServerState:
    """Start one SGLang server and wait until it and, behind a router, every DP engine answers
    `/health` and the router's `/readiness` counts them all (`server_process.launch`); the
    state records each engine's limits. A Python without SGLang fails first, naming the fix
    (not in the server's log). `generate` as for `server_command`."""
    if message := missing_engine(profile):
        raise ServeError(message)
    if note := deterministic_note(profile, model):
        print(note, file=sys.stderr)
    # The router waits for its engines as long as this start does (`server_command`).
    generate = {**(generate or {}), "serve_timeout_s": timeout_s}
    return SGLANG.start(
        profile,
        server_command(profile, model, host=host, port=port, generate=generate),
        {**server_env(profile, model), **(env or {})},
        host=host,
        port=port,
        timeout_s=timeout_s,
        root=root,
        ready=engines_missing(profile, host, port),
        limits=engine_limits(profile, host, port),
    )
