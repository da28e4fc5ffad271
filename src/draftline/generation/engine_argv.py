"""Check the command line `draftline serve start` would launch with the installed engine's own
argument parser, before anything is launched (`draftline doctor`).

The engine may live in another environment than draftline: its Python is `$DRAFTLINE_SGLANG_PYTHON`
/ `$DRAFTLINE_VLLM_PYTHON`, else this Python when it can import the engine. That Python runs
`engine_argv_check.py` (shipped beside this module, importing nothing of draftline) on the
command lines, as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CHECKER = Path(__file__).with_name("engine_argv_check.py")
# kind -> (variable naming its Python, module that must import, extra to install)
ENGINES = {
    "sglang": ("DRAFTLINE_SGLANG_PYTHON", "sglang", "sglang"),
    "vllm": ("DRAFTLINE_VLLM_PYTHON", "vllm", "vllm-gpu"),
}


class NotInstalled(RuntimeError):
    pass


def engine_python(kind: str, extra: str | None = None) -> str:
    """The Python that runs the engine; `NotInstalled` (with the fix: install `extra`, by
    default the engine's GPU extra) when there is none."""
    variable, module, default_extra = ENGINES[kind]
    extra = extra or default_extra
    named = os.environ.get(variable)
    if named:
        if not Path(named).exists():
            raise NotInstalled(f"${variable} names {named}, which does not exist")
        return named
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.origin not in (None, "namespace"):  # not a bare folder
        return sys.executable
    raise NotInstalled(
        f"{module} is not installed in this Python and ${variable} is not set: install it in an "
        f"environment of its own (`python3 -m venv /opt/{kind} && /opt/{kind}/bin/pip install "
        f"-e '.[{extra}]'`), then `export {variable}=/opt/{kind}/bin/python`"
    )


def check_commands(
    python: str, commands: list[list[str]], timeout_s: float = 600.0
) -> list[dict[str, Any]]:
    """Each command line through its launcher's parser: `{"ok", "module", "error"}` each."""
    proc = subprocess.run(
        [python, str(CHECKER)],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{python} {CHECKER.name} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
