"""Run server command lines through the engines' own argument parsers, without starting them.

Executed by the Python of the engine's environment (not imported by draftline: the engine and
draftline may live in different environments), as `<engine python> engine_argv_check.py`, with
a JSON list of command lines on stdin, each `[python, "-m", <module>, *args]` as
`sglang_server.server_command` / `vllm_server.server_command` build them. Prints one JSON
list: `{"ok": bool, "module": ..., "error": <the parser's message>}` per command line.

Each launcher's own entry code parses, and is stopped right after its parsing:
- `sglang.launch_server`: `prepare_server_args(args)`, what its `__main__` calls (argparse with
  `ServerArgs.add_cli_args`, then `ServerArgs.from_cli_args`). Resolution (`resolve_once`) is
  not run: it loads the target's config from the hub and probes the GPU platform.
- `sglang_router.launch_server`: its `main()` itself (`ServerArgs` and `RouterArgs` on one
  strict parser, then both `from_cli_args`), stopped where it starts looking for free ports.
- `vllm.entrypoints.cli.main`: its `main()` itself (the `vllm serve` parser, then
  `validate_parsed_serve_args`), stopped where the subcommand would start the server; then
  `AsyncEngineArgs.from_cli_args` on the parsed namespace (run without HF_HUB_OFFLINE: under
  it vLLM resolves a hub id to its cached folder, and the target need not be here).
- `vllm.entrypoints.openai.api_server` (vLLM's CPU build): its entry's `main()` (the same serve
  parser and validation), stopped where it hands the parsed args to the server.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback


class Parsed(Exception):
    """Raised where a launcher would start serving: its parsing is done."""


def _sglang(args: list[str]) -> None:
    from sglang.srt.server_args import prepare_server_args

    prepare_server_args(args)


def _sglang_router(args: list[str]) -> None:
    import sglang_router.launch_server as launcher

    def stop(*_a, **_k):
        raise Parsed

    launcher.find_available_ports = stop  # the first step after parsing
    launcher.mp.set_start_method = lambda *_a, **_k: None  # once per process is allowed
    sys.argv = ["sglang_router.launch_server", *args]
    launcher.main()


def _vllm(args: list[str]) -> None:
    import vllm.entrypoints.cli.main as cli
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs

    def stop(parsed) -> None:
        if getattr(parsed, "model_tag", None) is not None:  # the first step of the real `cmd`
            parsed.model = parsed.model_tag
        AsyncEngineArgs.from_cli_args(parsed)
        raise Parsed

    serve.ServeSubcommand.cmd = staticmethod(stop)
    sys.argv = ["vllm", *args]
    cli.main()


def _vllm_api_server(args: list[str]) -> None:
    """`python -m vllm.entrypoints.openai.api_server` (what vLLM's CPU build runs): its entry
    parses, validates, then hands the args to the server, stopped there."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server import entry

    def stop(parsed) -> None:
        AsyncEngineArgs.from_cli_args(parsed)
        raise Parsed

    entry.run_server = stop  # called with the parsed args before uvloop runs anything
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    entry.main()


CHECKS = {
    "sglang.launch_server": _sglang,
    "sglang_router.launch_server": _sglang_router,
    "vllm.entrypoints.cli.main": _vllm,
    "vllm.entrypoints.openai.api_server": _vllm_api_server,
}


def check(command: list[str]) -> dict[str, object]:
    """Parse one command line with its launcher's code; never raises."""
    if len(command) < 3 or command[1] != "-m" or command[2] not in CHECKS:
        return {"ok": False, "module": None, "error": f"not a known launcher: {command[:3]}"}
    module, args = command[2], command[3:]
    err = io.StringIO()
    argv = sys.argv
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            CHECKS[module](args)
    except Parsed:
        return {"ok": True, "module": module, "error": None}
    except SystemExit as exc:  # argparse's error(): the message is on stderr
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        message = lines[-1] if lines else err.getvalue().strip()[-2000:]
        return {"ok": False, "module": module, "error": message or f"exit {exc.code}"}
    except Exception as exc:
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {"ok": False, "module": module, "error": detail}
    finally:
        sys.argv = argv
    if module == "sglang.launch_server":
        return {"ok": True, "module": module, "error": None}
    return {"ok": False, "module": module, "error": "the launcher returned without parsing"}


def main() -> int:
    commands = json.load(sys.stdin)
    print(json.dumps([check([str(a) for a in c]) for c in commands]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
