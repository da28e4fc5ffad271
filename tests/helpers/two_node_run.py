"""Two nodes on one machine: a bare git origin, a moto S3 server on 127.0.0.1 as the DVC remote,
and clones of this project as the generating node (`draftline lead`), the training node
(`draftline follow`) and a sequential reference (`dvc repro`), which the test runs beside the two
nodes and the benchmark after them (it times each). Shared by the two-node test and
benchmarks/train_while_generate.py.

The run is the embedded default with a shorter training (SMALL), so the whole pipeline takes
minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers.embedded_run import copy_project
from helpers.s3_server import S3Server
from helpers.tiny_pipeline import base_env, clone_node, run

BIN = Path(sys.executable).parent
# The embedded default with fewer epochs and held-out prompts: the same stages, minutes less.
SMALL = ["drafter.epochs=3", "evaluate.max_prompts=8"]
RUN = "tiny"


def make_origin(tmp: Path, env: dict[str, str]) -> Path:
    """A bare origin holding this project with SMALL composed into params.yaml, and the
    committed run's dvc.lock as main has it (its training entries are of the committed
    composition: stale here, as after any `draftline compose`)."""
    seed = copy_project(tmp / "seed", as_committed=True)
    run([str(BIN / "draftline"), "compose", *SMALL], seed, env)
    run(["git", "add", "-A"], seed, env)
    run(["git", "commit", "-qm", "small run"], seed, env)
    origin = tmp / "origin.git"
    run(["git", "clone", "-q", "--bare", str(seed), str(origin)], tmp, env)
    return origin


def setup(tmp: Path, server: S3Server) -> tuple[Path, dict[str, str], str]:
    """(origin, environment, bucket) of a fresh two-node run."""
    env = base_env(tmp, server)
    bucket = f"two-nodes-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return make_origin(tmp, env), env, bucket


def clone(origin: Path, dest: Path, env: dict[str, str], server: S3Server, bucket: str) -> Path:
    return clone_node(origin, dest, env, server, bucket)


def start(node: Path, env: dict[str, str], *args: str, log: str) -> subprocess.Popen[bytes]:
    """`draftline ARGS` in its own process group (so kill -9 takes its children too)."""
    return spawn(node, env, [str(BIN / "draftline"), *args], log)


def spawn(node: Path, env: dict[str, str], cmd: list[str], log: str) -> subprocess.Popen[bytes]:
    """`cmd` in the node, in a process group of its own, its output appended to `log`."""
    with (node / log).open("ab") as out:
        return subprocess.Popen(
            cmd,
            cwd=node,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def kill(proc: subprocess.Popen[bytes]) -> None:
    """kill -9 the whole process group, and wait until every process of it is gone (a DVC
    still dying would hold its stage locks against the restart)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process group {proc.pid} still alive 60 s after SIGKILL")


def wait_for(
    node: Path, log: str, text: str, proc: subprocess.Popen[bytes], timeout: float
) -> None:
    """Until `text` appears in the node's log (fails if the process ends first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        path = node / log
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"ended ({proc.returncode}) before {text!r}:\n{tail(node, log)}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} within {timeout:.0f} s:\n{tail(node, log)}")


def wait_for_either(
    watched: list[tuple[Path, str, subprocess.Popen[bytes]]], text: str, timeout: float
) -> None:
    """Until `text` appears in the log of any of the (node, log, process) watched; fails when
    one fails or all have ended."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for node, log, proc in watched:
            path = node / log
            if path.exists() and text in path.read_text(errors="replace"):
                return
            if proc.poll():
                raise AssertionError(f"ended ({proc.returncode}):\n{tail(node, log)}")
        if all(proc.poll() is not None for _, _, proc in watched):
            raise AssertionError(f"all ended before {text!r}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} within {timeout:.0f} s")


def finish(proc: subprocess.Popen[bytes], node: Path, log: str, timeout: float) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise AssertionError(f"still running after {timeout:.0f} s:\n{tail(node, log)}") from None
    assert rc == 0, f"exit {rc}:\n{tail(node, log)}"


def tail(node: Path, log: str, lines: int = 40) -> str:
    path = node / log
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
    )


def events(node: Path, role: str) -> list[dict]:
    path = node / "logs" / "runs" / "two_nodes" / f"{role}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def digest(folder: Path) -> str:
    """sha256 over the relative names and bytes of a folder's files."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def lock_stages(node: Path) -> dict:
    import yaml

    return yaml.safe_load((node / "dvc.lock").read_text())["stages"]


def sequential(origin: Path, dest: Path, env: dict[str, str], server: S3Server, bucket: str):
    """The reference: one clone, plain `dvc repro`; (node, wall seconds)."""
    node = clone(origin, dest, env, server, bucket)
    began = time.monotonic()
    run(["dvc", "repro"], node, env, timeout=1800)
    return node, time.monotonic() - began


def start_sequential(
    origin: Path, dest: Path, env: dict[str, str], server: S3Server, bucket: str, log: str
) -> tuple[Path, subprocess.Popen[bytes]]:
    """The same reference started in the background: (node, its `dvc repro`)."""
    node = clone(origin, dest, env, server, bucket)
    return node, spawn(node, env, [str(BIN / "dvc"), "repro"], log)


def one_core_each(env: dict[str, str]) -> dict[str, str]:
    """The environment for nodes that share this machine's cores: one torch thread each, and
    OpenMP threads that sleep rather than spin while they wait (nodes on their own machines
    would each have all of theirs). The drafter's bytes do not depend on the thread count."""
    return {**env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def wait_for_lines(
    node: Path, path: str, proc: subprocess.Popen[bytes], timeout: float, lines: int = 8
) -> None:
    """Until the file at `path` holds `lines` lines (a shard's journal, part written)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        file = node / path
        if file.is_file() and len(file.read_bytes().splitlines()) >= lines:
            return
        if proc.poll() is not None:
            raise AssertionError(f"ended ({proc.returncode}) before {path} had {lines} lines")
        time.sleep(0.05)
    raise AssertionError(f"{path} had not {lines} lines within {timeout:.0f} s")
