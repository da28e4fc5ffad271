"""What the SGLang engines really run at once, and when a router really serves.

SGLang needs a GPU and is not installed here: these tests run against the stand-in
(tests/helpers/sglang_standin.py), which answers SGLang 0.5.23's `/server_info` (the running
cap its scheduler settled on, `--running-cap`, below the configured `--max-running-requests`)
and, as sglang-router 0.3.2's router, `/readiness` (not ready until it has registered its
engines, `--router-ready-delay` after they load; `/generate` answers 503 until then).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest
from helpers.generate_helpers import STANDIN, free_port
from helpers.serve_helpers import (
    PROFILES,
    STANDIN_IDS,
    TARGET,
    flags,
    pid_file,
    post_generate,
    serve,
    workdir,
)

from draftline.generation import server_process, sglang_server
from draftline.generation.engines import choose
from draftline.generation.engines.base import Request, Sampling
from draftline.generation.engines.sglang import in_flight_for


def test_in_flight_is_the_engines_caps_plus_a_short_queue_never_above_the_profile():
    assert in_flight_for([48] * 8, 4096) == 8 * (48 + 6)  # b200x8 when SGLang runs 48 each
    assert in_flight_for([16, 16], 1024) == 2 * (16 + 4)  # a queue of at least 4 per engine
    assert in_flight_for([512] * 8, 4096) == 4096  # never above the profile's figure


def test_client_sizes_from_recorded_caps_and_says_which(capsys):
    assert choose.sglang_in_flight([{"max_running_requests": 48}] * 4, 1024) == 216
    line = capsys.readouterr().out.strip()
    assert line.startswith("SGLang client: 216 requests in flight, from the servers' caps")
    assert "4 engines running at most 48 each" in line
    # One engine's cap unknown (an older server): the profile's figure, said so.
    assert choose.sglang_in_flight([{"max_running_requests": 48}, {"url": "x"}], 1024) == 1024
    line = capsys.readouterr().out.strip()
    assert line == "SGLang client: 1024 requests in flight (hardware.sglang.max_in_flight)"


def test_profiles_ask_sglang_to_schedule_by_priority_without_preemption():
    """SGLang 0.5.23 has `--enable-priority-scheduling` (higher values first by default) and
    `--disable-priority-preemption`; the client then sends each turn's priority."""
    for name in ("pro6000x4", "b200x8"):
        f = flags(sglang_server.server_command(PROFILES[name], TARGET, python="py"))
        assert f["--enable-priority-scheduling"] is True
        assert f["--disable-priority-preemption"] is True
        assert "--schedule-low-priority-values-first" not in f


def test_serve_start_waits_for_the_router_records_the_caps_and_generate_follows_them(
    tmp_path, monkeypatch, capsys
):
    """`serve start` returns only once the router's `/readiness` counts every engine (2 s
    after they load), records each engine's cap from `/server_info` (48, below the profile's
    256), and the client of a stage sizes what it keeps open from them."""
    root = workdir(tmp_path / "repo")
    port = free_port()
    argv = tmp_path / "argv.json"
    command = [sys.executable, str(STANDIN), *STANDIN_IDS, "--running-cap", "48",
               "--router-ready-delay", "2", "--argv-log", str(argv)]  # fmt: skip
    env = {sglang_server.LAUNCHER_ENV: shlex.join(command)}
    began = time.monotonic()
    rc, out = serve(root, "start", "--port", str(port), "--timeout", "60", env=env)
    try:
        assert rc == 0, out
        assert time.monotonic() - began >= 2.0
        url = f"http://127.0.0.1:{port}"
        assert post_generate(url) == 200  # served at once: no "No available workers"
        engines = pid_file(root, port)["engines"]
        assert len(engines) == 4  # pro6000x4: four DP engines behind the router
        assert all(e["max_running_requests"] == 48 for e in engines)
        assert all(e["max_total_num_tokens"] == 1_000_000 for e in engines)
        assert flags(json.loads(argv.read_text()))["--max-running-requests"] == "256"
        assert "engines: 4, running at most 48 requests each" in out

        monkeypatch.chdir(root)
        profile = {**PROFILES["pro6000x4"]}
        profile["sglang"] = {**profile["sglang"], "port": port}
        p = {"model": TARGET, "generate": {}}
        engine = choose.make_sglang_engine(p, profile, Sampling(max_new_tokens=16), 2)
        assert engine.max_in_flight == 4 * (48 + 6)
        assert engine.settings.priorities
        assert "SGLang client: 216 requests in flight, from the servers' caps" in (
            capsys.readouterr().out
        )
    finally:
        serve(root, "stop", "--port", str(port))


def test_a_stage_sends_nothing_before_the_router_is_ready(tmp_path, monkeypatch):
    """A router found up (its `/health` answers) whose engines are loaded but not registered
    yet: the stage waits for `/readiness`, and the router sees no `/generate` before it."""
    port = free_port()
    log, early = tmp_path / "router.log", tmp_path / "early.log"
    args = [sys.executable, str(STANDIN), *STANDIN_IDS, "--port", str(port), "--dp-size", "2",
            "--router-ready-delay", "3", "--early-log", str(early)]  # fmt: skip
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(args, stderr=out)
    try:
        state = server_process.ServerState(proc.pid, "", port, [], "router.log", None, 0.0)
        path = sglang_server.state_path(port, tmp_path)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(state.__dict__), encoding="utf-8")
        monkeypatch.chdir(tmp_path)
        profile = {**PROFILES["pro6000x4"]}
        profile["sglang"] = {**profile["sglang"], "port": port, "dp_size": 2}
        # The stand-in's start (its imports) takes seconds, more on a loaded machine: wait for
        # it, and say so when it never came, rather than test a router that is not there.
        deadline = time.monotonic() + 120
        while "process 1" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        assert "process 1" in log.read_text(), f"the stand-in never started:\n{log.read_text()}"
        p = {"model": TARGET, "generate": {}}
        engine = choose.make_sglang_engine(p, profile, Sampling(max_new_tokens=8), 2)
        results = []
        engine.generate([Request(f"s{i}", [1, 7, 8 + i]) for i in range(4)], results.append)
        assert [r.error for r in results] == [None] * 4
        assert not early.exists()  # nothing reached the router before it was ready
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("route", ["/server_info", "/get_server_info"])
def test_server_limits_reads_the_cap_the_scheduler_settled_on(tmp_path, route, monkeypatch):
    port = free_port()
    args = [sys.executable, str(STANDIN), "--port", str(port), "--max-running-requests", "512",
            "--running-cap", "40", "--max-total-num-tokens", "900000"]  # fmt: skip
    proc = subprocess.Popen(args)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while not server_process.healthy(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        if route == "/get_server_info":  # a server before 0.5.23: only the older route
            real_open = server_process._DIRECT.open

            def older(target, *a, **k):
                if str(target).endswith("/server_info"):
                    raise OSError("404")
                return real_open(target, *a, **k)

            monkeypatch.setattr(server_process._DIRECT, "open", older)
        assert sglang_server.server_limits(url) == {
            "url": url,
            "max_running_requests": 40,
            "max_total_num_tokens": 900000,
        }
    finally:
        proc.terminate()
        proc.wait(10)


def test_limits_unknown_when_the_server_does_not_say(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    assert sglang_server.server_limits(url, timeout_s=1) == {"url": url}
    state = server_process.ServerState(1, url, 1, [], "x", None, 0.0, engines=[{"url": url}])
    assert sglang_server.describe_limits(state) is None
