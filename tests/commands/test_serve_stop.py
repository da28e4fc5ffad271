"""`draftline serve stop` ends every process the launcher started, its engines' own process
groups included, and returns only once none is left.

SGLang needs a GPU and is not installed here, so the launcher is a stand-in laid out the way
`python -m sglang_router.launch_server` (sglang-router 0.3.2) lays out its processes: it starts
N "engine" processes, each of which calls `os.setpgrp()` (a process group of its own, as the
router's `run_server` does) and starts a "scheduler" child in that group; then the launcher
becomes the SGLang stand-in (tests/helpers/sglang_standin.py), which exits at once on SIGTERM
without waiting for the engines. An engine shuts down "gracefully" on SIGTERM: it waits a few
seconds, ends its scheduler (which ignores SIGTERM, as only its engine ends it) and exits; one
told to may ignore SIGTERM entirely. The GPU check runs against a stand-in `nvidia-smi` on PATH.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from pathlib import Path

from helpers.generate_helpers import STANDIN, free_port
from helpers.serve_helpers import STANDIN_IDS, is_running, pid_file, serve, workdir

from draftline.generation import server_process, sglang_server

ENGINE = """
import os, signal, subprocess, sys, time
os.setpgrp()  # a process group of its own, as sglang_router's run_server does
pids, rank, graceful = sys.argv[1], sys.argv[2], float(sys.argv[3])
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
scheduler = subprocess.Popen([sys.executable, "-c", ignore])

def on_term(*_):
    if graceful < 0:  # ignores SIGTERM entirely
        return
    time.sleep(graceful)  # a graceful shutdown
    scheduler.kill()
    scheduler.wait()
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
with open(f"{pids}/scheduler-{rank}.pid", "w") as f:
    f.write(str(scheduler.pid))
with open(f"{pids}/engine-{rank}.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(1)
"""

LAUNCHER = f"""#!{sys.executable}
# Lays out processes as sglang_router.launch_server does, then becomes the SGLang stand-in.
import os, subprocess, sys
pids, graces, *flags = sys.argv[1:]
for rank, grace in enumerate(graces.split(",")):
    subprocess.Popen([sys.executable, "-c", {ENGINE!r}, pids, str(rank), grace])
os.execv(sys.executable, [sys.executable, {str(STANDIN)!r}, *flags])
"""


def start(tmp_path: Path, graces: list[float]) -> tuple[Path, int, dict, list[int]]:
    """`serve start` through the stand-in launcher with one engine per grace (-1: ignores
    SIGTERM); the working folder, port, pid file and every pid of the tree but the launcher."""
    script = tmp_path / "launcher"
    script.write_text(LAUNCHER, encoding="utf-8")
    script.chmod(0o755)
    pids = tmp_path / "pids"
    pids.mkdir()
    command = [str(script), str(pids), ",".join(map(str, graces)), *STANDIN_IDS]
    env = {sglang_server.LAUNCHER_ENV: shlex.join(command)}
    root = workdir(tmp_path / "repo")
    port = free_port()
    rc, out = serve(root, "start", "--port", str(port), "--timeout", "60", env=env)
    assert rc == 0, out
    deadline = time.monotonic() + 20
    while len(list(pids.glob("*.pid"))) < 2 * len(graces) and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = [int(p.read_text()) for p in sorted(pids.glob("*.pid"))]
    assert len(tree) == 2 * len(graces)
    return root, port, pid_file(root, port), tree


def test_stop_waits_out_the_engines_graceful_shutdown_in_their_own_groups(tmp_path):
    root, port, state, tree = start(tmp_path, [2.0, 2.0, 2.0])
    launcher = state["pid"]
    engines = [pid for pid in tree if os.getpgid(pid) == pid]
    # Laid out as sglang_router does: three engines, each leading a group of its own, none the
    # launcher's; every process recorded once the server was ready.
    assert len(engines) == 3 and os.getpgid(launcher) == launcher not in engines
    assert {pid for pid, _ in state["processes"]} >= {launcher, *engines}
    began = time.monotonic()
    rc, out = serve(root, "stop", "--port", str(port), "--grace", "30")
    took = time.monotonic() - began
    assert rc == 0, out
    assert f"(pid {launcher}): 7 processes, 7 ended on SIGTERM" in out
    assert "killed" not in out
    # The engines' shutdown was waited for, and nothing of the tree outlives `stop`.
    assert took >= 2.0
    assert not [pid for pid in [launcher, *tree] if is_running(pid)]
    assert not sglang_server.state_path(port, root).exists()


def test_stop_kills_an_engine_that_ignores_sigterm_after_the_grace_period(tmp_path):
    root, port, state, tree = start(tmp_path, [1.0, -1])
    rc, out = serve(root, "stop", "--port", str(port), "--grace", "3")
    assert rc == 0, out
    # The deaf engine and its scheduler are SIGKILLed through their group; the rest ended.
    assert "5 processes, 3 ended on SIGTERM, 2 killed after the grace period" in out
    assert not [pid for pid in [state["pid"], *tree] if is_running(pid)]


def test_stop_finds_engines_orphaned_by_a_dead_launcher(tmp_path):
    """The launcher died (its engines live on in their own groups, no longer its children):
    stop finds them from the processes recorded once the server was ready."""
    root, port, state, tree = start(tmp_path, [0.5, 0.5])
    os.kill(state["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_running(state["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(is_running(pid) for pid in tree)
    rc, out = serve(root, "stop", "--port", str(port), "--grace", "30")
    assert rc == 0 and "4 processes, 4 ended on SIGTERM" in out, out
    assert not [pid for pid in tree if is_running(pid)]


FAKE_SMI = """#!/bin/sh
# Stand-in for `nvidia-smi --query-compute-apps=pid --format=csv,noheader,nounits`: prints
# $SMI_PIDS, the first $SMI_HELD calls also $SMI_HELD_PID (a process the driver has not let go
# of yet).
n=$(cat "$SMI_COUNT" 2>/dev/null || echo 0); echo $((n + 1)) > "$SMI_COUNT"
[ "$n" -lt "$SMI_HELD" ] && echo "$SMI_HELD_PID"
for pid in $SMI_PIDS; do echo "$pid"; done
"""


def fake_smi(tmp_path: Path, others: str, held_pid: int = 0, held_calls: int = 0) -> dict:
    folder = tmp_path / "smi"
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(FAKE_SMI, encoding="utf-8")
    smi.chmod(0o755)
    return {
        "PATH": f"{folder}:{os.environ['PATH']}",
        "SMI_PIDS": others,
        "SMI_COUNT": str(folder / "count"),
        "SMI_HELD": str(held_calls),
        "SMI_HELD_PID": str(held_pid),
    }


def test_on_a_gpu_node_stop_says_no_process_of_the_server_holds_a_gpu(tmp_path):
    root, port, state, _ = start(tmp_path, [0.2])
    # nvidia-smi lists the launcher for two more calls (the driver letting go), and a process
    # that is not the server's all along.
    env = fake_smi(tmp_path, "4242", held_pid=state["pid"], held_calls=2)
    rc, out = serve(root, "stop", "--port", str(port), env=env)
    assert rc == 0, out
    assert "3 processes, 3 ended on SIGTERM, no GPU held by it (1 other processes on them)" in out
    assert int((tmp_path / "smi" / "count").read_text()) == 3  # waited for the driver


def test_a_gpu_still_held_is_reported(tmp_path, monkeypatch):
    """`nvidia-smi` still lists a process of the server: named, and `stop` fails."""
    env = fake_smi(tmp_path, "", held_pid=999_999, held_calls=100)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ours, others = server_process.gpu_holders({999_999}, timeout_s=1.0)
    assert (ours, others) == ([999_999], [])
    stopped = server_process.Stopped(found=3, ended=3, gpu_ours=ours, gpu_others=others)
    assert not stopped.clean and "GPUs STILL HELD by pids 999999" in stopped.summary()


def test_without_nvidia_smi_there_is_no_gpu_check(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    assert server_process.gpu_holders({1}) == (None, [])
    stopped = server_process.Stopped(found=2, ended=2)
    assert stopped.clean and stopped.summary() == "2 processes, 2 ended on SIGTERM"
