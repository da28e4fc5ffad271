"""Start, stop or show the inference servers of this node (from the hardware profile): SGLang,
or vLLM for a profile with `engine: vllm` (e.g. `--hardware vllm_cpu`).

  draftline serve start [--hardware b200x8] [--host 0.0.0.0] [--port 30000] [--dry-run]
  draftline serve start --drafter models/drafter --port 30001   # the trained drafter (DFLASH)
  draftline serve start --no-speculation --port 30002           # the baseline of `bench`
  draftline serve start --hardware vllm_cpu [--drafter models/drafter]  # vLLM (dflash)
  draftline serve status
  draftline serve stop [--port 30000 | --all] [--grace 180]

Servers bind 127.0.0.1 unless --host says otherwise, log to logs/serve/, and outlive the
generate stages that use them; `stop` ends only servers that `start` started, every process of
them (DP engines in process groups of their own included): SIGTERM, SIGKILL after --grace
seconds, and it returns once none is left and, on a GPU node, says whether any still holds a
GPU (exit code 1 when one does, or a process survived SIGKILL).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from draftline.generation import server_launch, server_process, sglang_server, vllm_server
from draftline.generation.server_process import STOP_GRACE_S, ServeError, display
from draftline.runtime import hardware, params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["start", "stop", "status"], help="start, stop or list the servers"
    )
    parser.add_argument("--params", default="params.yaml", help="composed params (model, hardware)")
    parser.add_argument(
        "--hardware", default=None, help="profile name in conf/hardware (default: params.yaml's)"
    )
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: the profile's)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for readiness, longer while the log shows progress "
        "(default: generate.serve_timeout_s)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command, start nothing")
    parser.add_argument("--all", action="store_true", help="stop: every server start started")
    parser.add_argument(
        "--grace",
        type=float,
        default=STOP_GRACE_S,
        help="stop: seconds between SIGTERM and SIGKILL (SGLang shuts down gracefully)",
    )
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument(
        "--drafter", default=None, help="serve with this exported DFlash drafter (DFLASH)"
    )
    spec.add_argument(
        "--no-speculation", action="store_true", help="serve without speculative decoding"
    )


def profile_for(p: dict[str, Any], name: str | None) -> dict[str, Any]:
    if name is None:
        return hardware.resolve_profile(p["hardware"])
    profiles = hardware.load_profiles()
    if name == "auto":
        return hardware.resolve_profile({"detect": True})
    if name not in profiles:
        raise SystemExit(f"no hardware profile {name!r}: choose one of {', '.join(profiles)}")
    return {**profiles[name], "resolved_from": name}


def run(args: argparse.Namespace) -> int:
    if args.action == "status":
        return _status()
    if args.action == "stop":
        return _stop(args)
    p = params.load(args.params)
    profile = profile_for(p, args.hardware)
    server = vllm_server if profile.get("engine") == "vllm" else sglang_server
    try:
        model = server_launch.with_speculation(p["model"], args.drafter, args.no_speculation)
        generate = p.get("generate") or {}
        if args.timeout:  # the router waits for its engines as long as the start does
            generate = {**generate, "serve_timeout_s": args.timeout}
        # SGLang's router times requests out after the client does, with its overrides.
        options = {"generate": generate} if server is sglang_server else {}
        where = {"host": args.host, "port": args.port}
        command = server.server_command(profile, model, **where, **options)
        if args.dry_run:
            if server is sglang_server and (
                note := sglang_server.deterministic_note(profile, model)
            ):
                print(note, file=sys.stderr)  # stdout stays the command line alone
            env = server.server_env(profile, model)
            print(shlex.join([f"{k}={v}" for k, v in sorted(env.items())] + command))
            return 0
        timeout = args.timeout or float(generate.get("serve_timeout_s", 1800))
        state = server.start(profile, model, timeout_s=timeout, **where, **options)
    except ServeError as exc:
        print(f"serve start failed: {exc}")
        return 1
    print(
        f"{display(state.kind)} ({profile.get('name')}) healthy at {state.url}, pid {state.pid}, "
        f"log {state.log}"
    )
    if caps := sglang_server.describe_limits(state):
        print(caps)
    return 0


def _status() -> int:
    states = server_process.read_states(Path("."))
    if not states:
        print("no server started by `draftline serve start` on this node")
        return 0
    for s in states:
        up = server_process.alive(s)
        health = "healthy" if up and server_process.healthy(s.url) else "not answering"
        print(
            f"{s.url}  pid {s.pid}  {'running' if up else 'gone'}, {health}  "
            f"profile {s.profile}  log {s.log}  {display(s.kind)}"
        )
    return 0


def _stop(args: argparse.Namespace) -> int:
    states = server_process.read_states(Path("."))
    if not args.all:
        if args.port is None and len(states) > 1:
            ports = ", ".join(str(s.port) for s in states)
            print(f"several servers are running (ports {ports}): pass --port or --all")
            return 1
        if args.port is not None:
            states = [s for s in states if s.port == args.port]
    if not states:
        print("nothing to stop: no server started by `draftline serve start` matches")
        return 0
    clean = True
    for s in states:
        stopped = server_process.stop(s, grace_s=args.grace)
        verb = "stopped" if stopped else "already gone:"
        print(f"{verb} {s.url} (pid {s.pid}): {stopped.summary()}")
        clean = clean and stopped.clean
    return 0 if clean else 1
