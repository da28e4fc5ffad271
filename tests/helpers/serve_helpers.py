"""`draftline serve` run as a user runs it, in a working folder laid out like the repository: the
committed profiles and target, the SGLang stand-in's token ids, and what the tests read back
(the command line's flags, the pid file, a process's state, a `/generate` answer)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from draftline.generation import server_process, sglang_server
from draftline.runtime import hardware

REPO = Path(__file__).resolve().parents[2]
PROFILES = hardware.load_profiles(REPO / "conf")
TARGET = yaml.safe_load((REPO / "conf/model/qwen3_6_27b.yaml").read_text(encoding="utf-8"))
STANDIN_IDS = ["--think-start", "3", "--think-end", "4", "--vocab-low", "10", "--vocab-high", "300"]


def flags(command: list[str]) -> dict[str, str | bool]:
    """`--flag value` pairs and bare `--switch`es of a command line."""
    out: dict[str, str | bool] = {}
    for i, arg in enumerate(command):
        if arg.startswith("--"):
            nxt = command[i + 1] if i + 1 < len(command) else None
            out[arg] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


def workdir(root: Path, hardware_name: str = "pro6000x4") -> Path:
    """A folder with the project's conf/ and a params.yaml of TARGET on the named profile."""
    shutil.copytree(REPO / "conf", root / "conf")
    params = {"model": TARGET, "hardware": PROFILES[hardware_name], "generate": {}}
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return root


def serve(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
    """`draftline serve ARGS` in a subprocess: its exit code and its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "serve", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def pid_file(root: Path, port: int) -> dict:
    return json.loads(sglang_server.state_path(port, root).read_text(encoding="utf-8"))


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = server_process._stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def post_generate(url: str) -> int:
    """The HTTP status of one small `/generate` request."""
    body = json.dumps({"input_ids": [1, 7, 8, 2], "sampling_params": {"max_new_tokens": 8}})
    request = urllib.request.Request(
        f"{url}/generate", body.encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
