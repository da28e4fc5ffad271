"""`draftline serve start|stop|status`: SGLang command lines from the hardware profiles, and the
lifecycle of the servers it starts.

The command-line tests build the launch command from the committed profiles (conf/hardware) and
check every flag. The lifecycle tests run the real CLI in subprocesses, with one substitution:
SGLang needs a GPU and is not installed here, so `$DRAFTLINE_SGLANG_LAUNCHER` replaces `python -m
sglang_router.launch_server` with a stand-in launcher executable. It starts an extra "engine"
process in its process group (as the router does) and then becomes the SGLang stand-in
(tests/helpers/sglang_standin.py: a real HTTP server speaking SGLang's `/generate` and `/health`,
which accepts SGLang's flags and records the command line it got). Everything else is the code path
of a real node: the process group, the pid file, the log under logs/serve/, the wait for `/health`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers.generate_helpers import (
    STANDIN,
    StandIn,
    build_random_target,
    free_port,
    make_workdir,
    run_generate,
    sglang_hardware,
)
from helpers.serve_helpers import (
    PROFILES,
    REPO,
    STANDIN_IDS,
    TARGET,
    flags,
    is_running,
    pid_file,
    post_generate,
    serve,
    workdir,
)

from draftline.generation import server_process, sglang_server
from draftline.generation.sglang_server import ServeError, server_command, server_url

LAUNCHER = f"""#!{sys.executable}
# Stand-in for `python -m sglang_router.launch_server`: SGLang needs a GPU. It starts an "engine"
# process in its own process group, as the router does, then becomes the SGLang stand-in.
import os, subprocess, sys
engine_pid_file, *flags = sys.argv[1:]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(engine_pid_file, "w") as f:
    f.write(str(engine.pid))
os.execv(sys.executable, [sys.executable, {str(STANDIN)!r}, *flags])
"""


# Command lines from the profiles.


def test_cpu_profile_says_sglang_is_not_for_it():
    with pytest.raises(ServeError, match="SGLang is not for hardware profile 'cpu'") as info:
        server_command(PROFILES["cpu"], TARGET)
    assert "needs GPUs" in str(info.value) and "local engine" in str(info.value)
    assert "--hardware pro6000x4" in str(info.value)


def test_pro6000x4_router_over_four_data_parallel_engines():
    cmd = server_command(PROFILES["pro6000x4"], TARGET, python="/opt/sglang/bin/python")
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang_router.launch_server"]
    f = flags(cmd)
    assert f["--dp-size"] == "4" and f["--tp-size"] == "1"
    assert f["--model-path"] == "Qwen/Qwen3.6-27B" and f["--revision"] == "main"
    assert f["--host"] == "127.0.0.1" and f["--port"] == "30000"
    assert f["--quantization"] == "fp8" and "--kv-cache-dtype" not in f  # kv cache auto
    assert f["--mem-fraction-static"] == "0.85" and f["--context-length"] == "262144"
    assert f["--max-running-requests"] == "256"
    assert f["--speculative-algorithm"] == "NEXTN"  # MTP: the target's own MTP head
    assert (f["--speculative-num-steps"], f["--speculative-eagle-topk"]) == ("3", "1")
    assert f["--speculative-num-draft-tokens"] == "4"
    assert f["--enable-hierarchical-cache"] is True
    assert f["--skip-tokenizer-init"] is True  # token ids in and out
    # No-ops left out: a reasoning parser needs the tokenizer the server does not load, and
    # the hybrid layers' cache strategy is SGLang's own default (`auto`).
    assert "--reasoning-parser" not in f and not [a for a in f if a.startswith("--mamba")]


def test_b200x8_eight_engines_serve_what_the_model_says():
    cmd = server_command(PROFILES["b200x8"], TARGET, python="python3")
    assert cmd[:3] == ["python3", "-m", "sglang_router.launch_server"]
    f = flags(cmd)
    assert f["--dp-size"] == "8" and f["--tp-size"] == "1"
    # FP8 as on pro6000x4: precision is the model's choice, not the node's.
    assert f["--quantization"] == "fp8" and "--kv-cache-dtype" not in f
    assert f["--mem-fraction-static"] == "0.88" and f["--context-length"] == "262144"
    assert f["--max-running-requests"] == "512"
    assert f["--speculative-algorithm"] == "NEXTN"
    assert f["--speculative-num-steps"] == "3" and f["--speculative-num-draft-tokens"] == "4"
    assert f["--enable-hierarchical-cache"] is True
    assert f["--host"] == "127.0.0.1"
    # Flags appear once each, values right after them.
    assert len([a for a in cmd if a.startswith("--")]) == len(f)


@pytest.mark.parametrize("name", ("pro6000x4", "b200x8"))
def test_router_waits_longer_than_the_client_and_leaves_retries_to_it(name):
    """The router's request timeout is above the client's for the same answer (both from
    max_new_tokens at one request's decode rate), and only the client retries."""
    from draftline.generation import timeouts

    profile = PROFILES[name]
    f = flags(server_command(profile, TARGET, python="python3"))
    client = timeouts.client_timeout_s(profile, TARGET["max_new_tokens"])
    # One request's share of the node (low end of the range) decodes the longest answer twice.
    throughput = profile["throughput"]
    low = (throughput.get("generate_tok_s_range") or [throughput["generate_tok_s"]])[0]
    rate = low / profile["sglang"]["max_in_flight"]
    assert client >= 2 * TARGET["max_new_tokens"] / rate > 1800  # the router's old default
    assert int(f["--router-request-timeout-secs"]) > client
    assert f["--router-disable-retries"] is True
    # The client keeps the engines' caps plus a queue open, never more than max_in_flight: a
    # request's share of the node grows and its timeout shrinks, never above the router's.
    kept = profile["sglang"]["max_in_flight"] // 8
    shorter = timeouts.client_timeout_s(profile, TARGET["max_new_tokens"], in_flight=kept)
    assert timeouts.FLOOR_S <= shorter < client
    assert shorter >= min(client, 2 * TARGET["max_new_tokens"] / (low / kept))
    assert timeouts.client_timeout_s(profile, TARGET["max_new_tokens"], 20000, kept) == 20000
    single = {**profile, "sglang": {**profile["sglang"], "dp_size": 1}}
    assert "--router-request-timeout-secs" not in server_command(single, TARGET, python="p")


def test_host_cache_is_split_over_the_engines_of_the_node():
    """Each DP engine gets its share of the node's RAM (`--hicache-size`, GB per engine), never
    a pool sized as if it were alone; an explicit figure wins; doctor says which."""
    from draftline.generation import host_cache

    sg = dict(PROFILES["b200x8"]["sglang"])
    ram = 2_000 * 10**9  # a 2 TB B200 node
    assert host_cache.host_cache_gb(sg, ram) == 125  # 0.5 x 2,000 GB / 8 engines
    assert host_cache.host_cache_gb({**sg, "host_cache_gb_per_engine": 64}, ram) == 64
    assert host_cache.host_cache_gb({**sg, "hierarchical_cache": False}, ram) is None
    line = host_cache.describe(sg, ram)
    assert "--hicache-size 125 GB per engine, 1,000 GB in all" in line and "8 ranks" in line
    pro = dict(PROFILES["pro6000x4"]["sglang"])
    assert host_cache.host_cache_gb(pro, 256 * 10**9) == 32  # 0.5 x 256 GB / 4 engines
    f = flags(server_command(PROFILES["b200x8"], TARGET, python="python3"))
    assert int(f["--hicache-size"]) == host_cache.host_cache_gb(sg)  # this node's RAM
    from draftline.commands import doctor  # `draftline doctor` shows this node's figure

    (row,) = doctor._host_cache_rows({"hardware": PROFILES["b200x8"]})
    assert row[0] == "host cache (b200x8)" and row[1] is True
    assert (
        row[2] == host_cache.describe(sg) and f"--hicache-size {f['--hicache-size']} GB" in row[2]
    )
    assert doctor._host_cache_rows({"hardware": PROFILES["cpu"]}) == []


def test_served_context_length_is_the_models_and_a_profile_cannot_contradict_it():
    profile = PROFILES["b200x8"]
    other = {**profile, "sglang": {**profile["sglang"], "context_length": 16384}}
    with pytest.raises(ServeError, match="differs from the served"):
        server_command(other, TARGET, python="python3")
    deterministic = {**TARGET, "serving": {**TARGET["serving"], "deterministic_inference": True}}
    f = flags(server_command(profile, deterministic, python="python3"))
    assert f["--enable-deterministic-inference"] is True
    assert "--enable-deterministic-inference" not in server_command(profile, TARGET, python="p")


# What is served: a choice of the model, the same on every hardware profile.
WHAT_FLAGS = ("--quantization", "--kv-cache-dtype", "--speculative-algorithm",
              "--speculative-num-steps", "--speculative-eagle-topk",
              "--speculative-num-draft-tokens")  # fmt: skip
MODELS = ("qwen3_6_27b", "qwen3_8b", "tiny", "tiny_qwen36")
GPU_PROFILES = ("pro6000x4", "b200x8")


@pytest.mark.parametrize("model", MODELS)
def test_serve_dry_run_for_every_model_and_gpu_profile(model, tmp_path, capsys):
    """`draftline serve start --dry-run` for each model x profile: speculative decoding only for
    a target with an MTP head, no environment of the model's own, and the same served
    computation on every profile. (`.ci/engines` runs these command lines through SGLang's
    own parsers.)"""
    from draftline import cli
    from draftline.runtime import params

    printed = {}
    for profile in GPU_PROFILES:
        path = tmp_path / f"{profile}.yaml"
        composed = params.compose([f"model={model}", f"hardware={profile}"], REPO / "conf")
        path.write_text(params.to_yaml(composed), encoding="utf-8")
        assert cli.main(["serve", "start", "--dry-run", "--params", str(path)]) == 0
        printed[profile] = shlex.split(capsys.readouterr().out.strip())
    spec = yaml.safe_load((REPO / f"conf/model/{model}.yaml").read_text(encoding="utf-8"))
    for profile, words in printed.items():
        env = [w for w in words if "=" in w and not w.startswith("-")]
        f = flags(words)
        assert f["--dp-size"] == str(PROFILES[profile]["sglang"]["dp_size"])
        assert ("--speculative-algorithm" in f) == bool(spec["mtp"]), (model, profile)
        assert not env, (model, profile, env)
    what = {p: [(w, flags(ws).get(w)) for w in WHAT_FLAGS] for p, ws in printed.items()}
    assert what["pro6000x4"] == what["b200x8"]


def test_a_target_without_mtp_gets_no_speculative_decoding():
    plain = yaml.safe_load((REPO / "conf/model/qwen3_8b.yaml").read_text(encoding="utf-8"))
    f = flags(server_command(PROFILES["pro6000x4"], plain, python="py"))
    assert "--speculative-algorithm" not in f
    assert sglang_server.server_env(PROFILES["pro6000x4"], plain) == {}


def test_single_engine_profile_runs_sglang_directly_and_binds_loopback_by_default():
    profile = {
        "name": "one-gpu",
        "sglang": {
            "dp_size": 1,
            "tp_size": 2,
            "port": 31000,
            "extra_args": ["--log-level", "info"],
        },
    }
    cmd = server_command(profile, {"path": "/models/x", "revision": None}, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    f = flags(cmd)
    assert "--dp-size" not in f and "--revision" not in f and f["--tp-size"] == "2"
    assert f["--host"] == "127.0.0.1"  # the profile names no host: loopback, not every address
    assert cmd[-2:] == ["--log-level", "info"]
    assert server_url(profile) == "http://127.0.0.1:31000"


def test_host_and_port_when_told_otherwise():
    profile = PROFILES["pro6000x4"]
    f = flags(server_command(profile, TARGET, host="0.0.0.0", port=31234, python="py"))
    assert (f["--host"], f["--port"]) == ("0.0.0.0", "31234")
    # Clients on the node reach a server bound to every address through loopback.
    assert server_url(profile, "0.0.0.0", 31234) == "http://127.0.0.1:31234"
    assert server_url(profile, "10.0.0.5", 31234) == "http://10.0.0.5:31234"


def test_python_and_launcher_from_the_environment(monkeypatch):
    monkeypatch.setenv(sglang_server.PYTHON_ENV, "/envs/sglang/bin/python")
    assert server_command(PROFILES["b200x8"], TARGET)[:2] == ["/envs/sglang/bin/python", "-m"]
    monkeypatch.setenv(sglang_server.LAUNCHER_ENV, "apptainer exec sglang.sif python -m x")
    cmd = server_command(PROFILES["b200x8"], TARGET)
    assert cmd[:6] == ["apptainer", "exec", "sglang.sif", "python", "-m", "x"]
    assert cmd[6:8] == ["--model-path", "Qwen/Qwen3.6-27B"]


# The CLI in a working folder laid out like the repository.


@pytest.mark.parametrize("name", ["pro6000x4", "b200x8"])
def test_cli_dry_run_prints_the_profile_command(tmp_path, name):
    root = workdir(tmp_path, name)
    rc, out = serve(root, "start", "--dry-run", "--hardware", name)
    assert rc == 0, out
    printed = shlex.split(out.strip())
    # The environment the model needs (none for this one), then the command.
    assert printed == server_command(PROFILES[name], TARGET)
    assert not (root / "logs").exists()  # a dry run starts nothing


def test_cli_refuses_the_cpu_profile(tmp_path):
    rc, out = serve(workdir(tmp_path, "cpu"), "start")
    assert rc == 1 and "SGLang is not for hardware profile 'cpu'" in out


def test_start_without_sglang_names_the_fix_in_one_line(tmp_path):
    """SGLang is not installed in this environment (it needs a GPU): `serve start` says so and
    how to fix it, instead of the server dying with ModuleNotFoundError in its log."""
    assert importlib.util.find_spec("sglang") is None
    root = workdir(tmp_path, "pro6000x4")
    rc, out = serve(
        root, "start", env={"DRAFTLINE_SGLANG_LAUNCHER": "", "DRAFTLINE_SGLANG_PYTHON": ""}
    )
    assert rc == 1 and "ModuleNotFoundError" not in out and "Traceback" not in out
    assert out.strip().splitlines() == [
        f"serve start failed: sglang and sglang_router cannot be imported by this Python "
        f"({sys.executable}): pip install -e '.[sglang]' there, or set DRAFTLINE_SGLANG_PYTHON "
        "to the python of the environment that has SGLang (README: GPU node with SGLang)"
    ]
    assert not (root / "logs").exists()  # nothing was started


# Lifecycle with the stand-in launcher.


@pytest.fixture
def launcher(tmp_path) -> tuple[dict[str, str], Path, Path]:
    """Environment that makes `serve start` run the stand-in; the engine-pid and argv files."""
    script = tmp_path / "bin" / "sglang-standin-launcher"
    script.parent.mkdir()
    script.write_text(LAUNCHER, encoding="utf-8")
    script.chmod(0o755)
    engine_pid, argv = tmp_path / "engine.pid", tmp_path / "argv.json"
    command = [str(script), str(engine_pid), *STANDIN_IDS, "--argv-log", str(argv)]
    return {sglang_server.LAUNCHER_ENV: shlex.join(command)}, engine_pid, argv


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.05)
    return False


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_start_status_stop_lifecycle(tmp_path, launcher):
    env, engine_pid_file, argv_file = launcher
    root = workdir(tmp_path / "repo")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    rc, out = serve(root, "status")
    assert rc == 0 and "no server started" in out

    rc, out = serve(root, "start", "--port", str(port), "--timeout", "60", env=env)
    assert rc == 0, out
    state = pid_file(root, port)
    pid, engine = state["pid"], int(engine_pid_file.read_text())
    assert f"healthy at {url}, pid {pid}" in out
    # The server outlives the command that started it, in its own process group.
    assert answers(url) and is_running(pid) and is_running(engine)
    assert os.getpgid(pid) == pid == os.getpgid(engine) != os.getpgid(0)
    # It got the profile's flags, bound to loopback.
    got = flags(json.loads(argv_file.read_text()))
    assert (got["--host"], got["--port"], got["--dp-size"]) == ("127.0.0.1", str(port), "4")
    assert got["--speculative-algorithm"] == "NEXTN" and got["--enable-hierarchical-cache"]
    # Logs under logs/serve/, headed by the command line.
    log = root / "logs" / "serve" / f"sglang-{port}.log"
    assert state["log"] == f"logs/serve/sglang-{port}.log" and log.exists()
    assert shlex.join(state["command"]) in log.read_text()

    # Starting again finds the healthy server it started, and starts no second one.
    rc, out = serve(root, "start", "--port", str(port), env=env)
    assert rc == 0 and f"pid {pid}" in out

    rc, out = serve(root, "status")
    assert rc == 0 and f"{url}  pid {pid}  running, healthy  profile pro6000x4" in out

    # Frozen: still running, but not answering.
    os.killpg(pid, signal.SIGSTOP)
    try:
        rc, out = serve(root, "status")
        assert f"pid {pid}  running, not answering" in out
    finally:
        os.killpg(pid, signal.SIGCONT)

    rc, out = serve(root, "stop", "--port", str(port))
    assert rc == 0 and f"stopped {url} (pid {pid})" in out
    assert wait_gone(pid, 1) and wait_gone(engine, 1)  # the whole group, by the time stop returns
    assert not listening(port)
    assert not sglang_server.state_path(port, root).exists()
    rc, out = serve(root, "status")
    assert "no server started" in out


def test_the_router_counts_as_ready_only_when_every_engine_is(tmp_path, launcher):
    """sglang_router's `/health` answers before its engines have loaded (the stand-in models
    it): `serve start` returns only once every engine it logged answers its own `/health`, so
    a stage started then gets answers, not 503s."""
    env, _, _ = launcher
    root = workdir(tmp_path / "repo")
    port = free_port()
    slow = {sglang_server.LAUNCHER_ENV: env[sglang_server.LAUNCHER_ENV] + " --startup-delay 3"}
    rc, out = serve(root, "start", "--port", str(port), "--timeout", "60", env=slow)
    try:
        assert rc == 0, out
        url = f"http://127.0.0.1:{port}"
        log = root / "logs" / "serve" / f"sglang-{port}.log"
        engines = sglang_server.engine_urls(log, "127.0.0.1")
        assert len(engines) == 4 and all(answers(e) for e in engines)
        assert post_generate(url) == 200  # ready means served, right away
    finally:
        serve(root, "stop", "--port", str(port))
    # The hazard it waits out: the router alive and answering /health, no engine loaded yet.
    args = [sys.executable, str(STANDIN), "--port", str(port), "--dp-size", "2"]
    proc = subprocess.Popen([*args, "--startup-delay", "600"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(2)]
        assert all("Launching DP server process" in line for line in lines)
        deadline = time.monotonic() + 20
        while not answers(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert answers(f"http://127.0.0.1:{port}")  # the router's liveness
        assert post_generate(f"http://127.0.0.1:{port}") == 503
        engine_ports = [int(line.split(" on port ")[1].split()[0]) for line in lines]
        assert not any(answers(f"http://127.0.0.1:{p}") for p in engine_ports)
        missing = sglang_server.engines_missing(PROFILES["pro6000x4"])
        log = tmp_path / "router.log"
        log.write_text("".join(lines), encoding="utf-8")
        assert missing(log) == "0 of 4 engines healthy behind the router"  # 2 of 4 even logged
        # A stage finding this router up waits for its engines, and says so when they never come.
        two = {**PROFILES["pro6000x4"], "sglang": {**PROFILES["pro6000x4"]["sglang"]}}
        two["sglang"].update(dp_size=2, port=port)
        state = server_process.ServerState(proc.pid, "", port, [], "router.log", None, 0.0)
        state_file = sglang_server.state_path(port, tmp_path)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(state.__dict__), encoding="utf-8")
        with pytest.raises(ServeError, match="up but not ready: 0 of 2 engines healthy"):
            sglang_server.wait_for_engines(two, timeout_s=0.5, root=tmp_path)
    finally:
        proc.terminate()
        proc.wait(10)


def test_status_tells_a_dead_server_and_stop_ends_its_orphaned_engines(tmp_path, launcher):
    env, engine_pid_file, _ = launcher
    root = workdir(tmp_path / "repo")
    port = free_port()
    rc, out = serve(root, "start", "--port", str(port), "--timeout", "60", env=env)
    assert rc == 0, out
    pid, engine = pid_file(root, port)["pid"], int(engine_pid_file.read_text())

    os.kill(pid, signal.SIGKILL)  # the router dies; its engine lives on in the group
    assert wait_gone(pid)
    rc, out = serve(root, "status")
    assert f"pid {pid}  gone, not answering" in out
    assert is_running(engine)

    rc, out = serve(root, "stop", "--port", str(port))
    assert rc == 0 and f"stopped http://127.0.0.1:{port} (pid {pid})" in out
    assert wait_gone(engine, 1)
    assert not sglang_server.state_path(port, root).exists()


def test_start_failure_shows_the_log_tail_and_leaves_nothing(tmp_path):
    root = workdir(tmp_path / "repo")
    port = free_port()
    crash = [
        sys.executable, "-c",
        "import sys; print('loading Qwen/Qwen3.6-27B'); "
        "print('torch.OutOfMemoryError: CUDA out of memory', flush=True); sys.exit(3)",
    ]  # fmt: skip
    env = {sglang_server.LAUNCHER_ENV: shlex.join(crash)}
    rc, out = serve(root, "start", "--port", str(port), "--timeout", "60", env=env)
    assert rc == 1
    assert f"SGLang server on port {port} exited with code 3" in out
    assert f"Last lines of logs/serve/sglang-{port}.log" in out
    assert "torch.OutOfMemoryError: CUDA out of memory" in out
    assert not sglang_server.state_path(port, root).exists()
    rc, out = serve(root, "status")
    assert "no server started" in out


def test_start_timeout_stops_the_server_that_never_got_healthy(tmp_path, launcher):
    env, engine_pid_file, _ = launcher
    env = {
        sglang_server.LAUNCHER_ENV: env[sglang_server.LAUNCHER_ENV] + " --startup-delay 600"
    }  # /health answers 503 "loading" all along
    root = workdir(tmp_path / "repo")
    port = free_port()
    rc, out = serve(root, "start", "--port", str(port), "--timeout", "3", env=env)
    assert rc == 1
    # The router answers /health at once (its liveness); its engines never load.
    assert f"SGLang server on port {port} not ready after 3s: 0 of 4 engines healthy" in out
    assert f"Last lines of logs/serve/sglang-{port}.log" in out
    assert wait_gone(int(engine_pid_file.read_text()), 1) and not listening(port)
    assert not sglang_server.state_path(port, root).exists()


def test_a_foreign_server_on_the_port_is_never_stopped(tmp_path, launcher):
    env, _, _ = launcher
    root = workdir(tmp_path / "repo")
    with StandIn(tmp_path) as foreign:  # started by someone else, not by `serve start`
        rc, out = serve(root, "start", "--port", str(foreign.port), env=env)
        assert rc == 1 and "something draftline did not start already answers" in out
        rc, out = serve(root, "stop", "--all")
        assert rc == 0 and "nothing to stop" in out

        # A pid file whose pid now belongs to that other program (pid reuse after a reboot).
        assert foreign.proc is not None
        stale = {
            "pid": foreign.proc.pid, "url": foreign.url, "port": foreign.port,
            "command": ["python", "-m", "sglang_router.launch_server"], "log": "logs/x.log",
            "profile": "pro6000x4", "started_at": 0.0, "start_ticks": 1,
        }  # fmt: skip
        path = sglang_server.state_path(foreign.port, root)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(stale), encoding="utf-8")
        rc, out = serve(root, "status")
        assert f"pid {foreign.proc.pid}  gone" in out  # not ours, whatever answers there
        rc, out = serve(root, "stop", "--port", str(foreign.port))
        assert rc == 0 and f"already gone: {foreign.url}" in out
        assert foreign.proc.poll() is None and answers(foreign.url)
        assert not path.exists()


# The generate stage and the server.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_target(tmp_path_factory.mktemp("target"))


def test_generate_without_a_server_names_the_command_to_run(tmp_path, model_dir):
    port = free_port()
    make_workdir(tmp_path, model_dir, n=8, hardware=sglang_hardware(port))
    proc = run_generate(tmp_path, "--shard", "0")
    assert proc.returncode == 1
    assert f"no SGLang server answers /health at http://127.0.0.1:{port}" in proc.stderr
    assert "Start one with `draftline serve start` (hardware=test-sglang)" in proc.stderr
    assert "generate.autostart=true" in proc.stderr
    assert not (tmp_path / "logs").exists() and not listening(port)  # nothing was started


def test_generate_autostart_starts_a_server_that_outlives_the_stage(tmp_path, model_dir, launcher):
    env, engine_pid_file, argv_file = launcher
    port = free_port()
    ids = make_workdir(
        tmp_path,
        model_dir,
        n=24,
        hardware=sglang_hardware(port),
        generate={"autostart": True},
        max_new_tokens=64,
    )
    proc = run_generate(tmp_path, "--shard", "0", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"no SGLang server at http://127.0.0.1:{port}: starting one" in proc.stdout
    assert (tmp_path / "data/generated/train/shard-0.parquet").exists() and len(ids) == 24
    state = pid_file(tmp_path, port)
    assert answers(f"http://127.0.0.1:{port}") and is_running(state["pid"])  # outlived the stage
    assert flags(json.loads(argv_file.read_text()))["--host"] == "127.0.0.1"
    rc, out = serve(tmp_path, "stop")
    assert rc == 0 and f"stopped http://127.0.0.1:{port}" in out
    assert wait_gone(state["pid"], 1) and wait_gone(int(engine_pid_file.read_text()), 1)


# `draftline bench` against servers started by `draftline serve start`.


def bench_workdir(root: Path, port: int) -> Path:
    """The embedded target's profile, the held-out prompts and an exported drafter's config."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf")
    model = yaml.safe_load((REPO / "conf/model/tiny.yaml").read_text(encoding="utf-8"))
    model["path"] = str(REPO / "models/tiny-target")
    params = {
        "model": model, "hardware": sglang_hardware(port), "generate": {},
        "evaluate": {"max_new_tokens": 64, "max_prompts": 12, "temperature": 0.6, "top_p": 0.95,
                     "top_k": 20},
        "drafter": {"name": "dflash_tiny"}, "data": {"name": "sample"},
    }  # fmt: skip
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    prompts = [[1, 2, 3 + k, 40 + 3 * k] for k in range(20)]
    table = pa.table({"id": [f"e{k:02d}" for k in range(20)], "prompt_ids": prompts})
    (root / "data/generated").mkdir(parents=True)
    pq.write_table(table, root / "data/generated/eval.parquet")
    (root / "models/drafter").mkdir(parents=True)
    (root / "models/drafter/config.json").write_text(json.dumps({"block_size": 8}))
    return root


def test_bench_measures_acceptance_and_speedup_against_live_servers(tmp_path, monkeypatch, capsys):
    """Two servers from `draftline serve start`: one with the exported drafter (SGLang's DFLASH
    flags), one without speculation. The stand-in (tests/helpers/sglang_standin.py) reports
    `spec_verify_ct` as SGLang does when started with `--speculative-algorithm`, commits
    --accept-length tokens per verify step and spends --step-s per target forward. `draftline
    bench` runs in this process (the next test runs it as a subprocess)."""
    from draftline import cli

    spec_port, base_port = free_port(), free_port()
    root = bench_workdir(tmp_path / "repo", spec_port)
    argv = {name: tmp_path / f"{name}.argv" for name in ("spec", "base")}

    def launcher_env(name: str) -> dict[str, str]:
        command = [sys.executable, str(STANDIN), *STANDIN_IDS, "--accept-length", "3",
                   "--step-s", "0.002", "--argv-log", str(argv[name])]  # fmt: skip
        return {sglang_server.LAUNCHER_ENV: shlex.join(command)}

    try:
        rc, out = serve(root, "start", "--drafter", "models/drafter", "--port", str(spec_port),
                        env=launcher_env("spec"))  # fmt: skip
        assert rc == 0, out
        rc, out = serve(root, "start", "--no-speculation", "--port", str(base_port),
                        env=launcher_env("base"))  # fmt: skip
        assert rc == 0, out
        served = flags(json.loads(argv["spec"].read_text()))
        assert served["--speculative-algorithm"] == "DFLASH"
        assert served["--speculative-draft-model-path"] == "models/drafter"
        assert served["--speculative-num-draft-tokens"] == "8"  # the drafter's block size
        assert "--speculative-algorithm" not in flags(json.loads(argv["base"].read_text()))

        monkeypatch.chdir(root)
        bench = ["bench", "--concurrency", "4", "--baseline-url", f"http://127.0.0.1:{base_port}"]
        assert cli.main(bench) == 0
        assert "bench: acceptance length" in capsys.readouterr().out
        metrics = json.loads((root / "metrics/bench/bench.json").read_text())
        record = json.loads((root / "logs/runs/bench.json").read_text())
        assert record["requests"] == 12 and record["sampling"]["temperature"] == 0.6
        # Every answer took ceil(n / 3) verify steps: SGLang's ratio lies in (2, 3].
        assert metrics["acceptance_length"] == pytest.approx(
            record["completion_tokens"] / record["verify_steps"]
        )
        assert 2.0 < metrics["acceptance_length"] <= 3.0
        assert metrics["speedup"] == pytest.approx(
            metrics["output_tok_s"] / metrics["baseline_output_tok_s"]
        )
        # The identity is in the report, beside every result; the DVC metric compares runs.
        report = json.loads((root / "reports/bench.json").read_text())
        assert "model" not in metrics
        assert report["acceptance_length"] == metrics["acceptance_length"]
        assert (report["model"], report["drafter"]) == (str(REPO / "models/tiny-target"),
                                                        "dflash_tiny")  # fmt: skip

        # A server without the drafter has no speculative statistics: the fix is named.
        with pytest.raises(SystemExit) as failed:  # a message: exit status 1
            cli.main(["bench", "--url", f"http://127.0.0.1:{base_port}"])
        assert "draftline serve start --drafter models/drafter" in str(failed.value.code)
    finally:
        serve(root, "stop", "--all")


def test_bench_on_one_node_serves_the_drafter_then_the_baseline_never_both(tmp_path):
    """`bench --drafter`: each server takes all of a node's GPUs, so bench starts the drafter's,
    measures and stops it, then the baseline's, on the profile's one port. Some answers end on
    their first token, for which SGLang reports no `spec_verify_ct` (the stand-in leaves it
    out as SGLang does): they count for speed, not for acceptance, and abort nothing."""
    port = free_port()
    root = bench_workdir(tmp_path / "repo", port)
    command = [sys.executable, str(STANDIN), *STANDIN_IDS, "--accept-length", "3",
               "--step-s", "0.002", "--one-token-share", "0.3"]  # fmt: skip
    env = {**os.environ, sglang_server.LAUNCHER_ENV: shlex.join(command)}
    bench = [sys.executable, "-m", "draftline", "bench", "--concurrency", "4",
             "--drafter", "models/drafter"]  # fmt: skip
    done = subprocess.run(bench, cwd=root, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.index("starting the drafter server") < out.index("starting the baseline server")
    # One port, two launches in turn: the drafter's (DFLASH), then one without speculation.
    launches = (root / f"logs/serve/sglang-{port}.log").read_text().split("\n=== ")[1:]
    assert len(launches) == 2
    assert "--speculative-algorithm DFLASH" in launches[0]
    assert "--speculative-algorithm" not in launches[1]
    assert not server_process.read_states(root)  # both stopped
    record = json.loads((root / "logs/runs/bench.json").read_text())
    assert record["speedup"] == pytest.approx(
        record["output_tok_s"] / record["baseline_output_tok_s"]
    )
    # Answers without verify steps left out of acceptance only: still SGLang's ratio in (2, 3].
    assert record["completion_tokens"] > record["verify_steps"] * 2
    assert 2.0 < record["acceptance_length"] <= 3.0
