"""The real sglang-router 0.3.2 in front of SGLang workers, as draftline starts, waits for, uses
and stops it.

Real: the router, its Rust binary from the engines' environment, run as
`python -m sglang_router.launch_router --worker-urls ...` (connect mode) with the `--router-*`
settings `serve start` gives it (`sglang_server.server_command`), and as
`python -m sglang_router.launch_server` itself (its parsing, its DP engine processes each in a
process group of its own, its router over them); draftline's readiness check, its SGLang client,
the generate stage that journals, and `serve start|stop`.
Standing in: the SGLang workers, which need a GPU: the SGLang stand-in
(tests/helpers/sglang_standin.py) run as single engines. It answers what the router asks of a
worker (`/health`, `/server_info`, `/model_info`, `/generate`). Under `launch_server` it takes the
place of SGLang's HTTP server (`sglang.srt.entrypoints.http_server.launch_server`) in each engine
process the launcher spawns, and starts a "scheduler" child in the engine's group, as SGLang's
engine does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from helpers.generate_helpers import (
    STANDIN,
    StandIn,
    build_random_target,
    free_port,
    make_workdir,
    run_generate,
    wait_healthy,
)

from draftline.generation import server_process, sglang_server
from draftline.generation.engines.base import Request, Result, Sampling
from draftline.generation.engines.sglang import ClientSettings, SGLangEngine

pytestmark = pytest.mark.engines

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
EOT = 2


def profile(port: int, dp: int = 2, **sglang: Any) -> dict[str, Any]:
    """A GPU node's profile with `dp` engines behind the router on `port`."""
    settings = {"host": "127.0.0.1", "port": port, "max_in_flight": 8, "dp_size": dp, **sglang}
    return {"name": "test-router", "engine": "sglang", "device": "cuda", "sglang": settings}


def router_flags(model_dir: Path, generate: dict[str, Any]) -> list[str]:
    """The router settings `serve start` launches with, spelled as `launch_router` takes them
    (without the `router-` prefix `launch_server` gives them)."""
    command = sglang_server.server_command(
        profile(30000), {"path": str(model_dir)}, python="python", generate=generate
    )
    out: list[str] = []
    for i, arg in enumerate(command):
        if arg.startswith("--router-"):
            out.append("--" + arg.removeprefix("--router-"))
            if i + 1 < len(command) and not command[i + 1].startswith("--"):
                out.append(command[i + 1])
    return out


def with_flag(flags: list[str], flag: str, value: str) -> list[str]:
    i = flags.index(flag)
    return [*flags[: i + 1], value, *flags[i + 2 :]]


class Router:
    """`python -m sglang_router.launch_router` in connect mode, in a process group of its own."""

    def __init__(self, python: Path, tmp: Path, workers: list[str], flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"router-{self.port}.log"
        self.args = [
            str(python), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-port", str(free_port()),  # its exporter's default, 29000, may be taken
            "--worker-urls", *workers, *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Router:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(lambda: server_process.healthy(self.url), "the router's liveness", self.proc)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def workers(self) -> dict[str, bool]:
        """The workers the router has registered: URL -> healthy."""
        return {w["url"]: w["is_healthy"] for w in get(f"{self.url}/workers")[1]["workers"]}


def wait_for(
    check: Callable[[], Any],
    what: str,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 180.0,
) -> Any:
    """Poll `check` until it returns something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert proc is None or proc.poll() is None, f"exited while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g}s"
        time.sleep(0.2)
    return value


def get(request: str | urllib.request.Request) -> tuple[int, Any]:
    """HTTP status and JSON body of a request (a GET of a URL), errors included."""
    try:
        with DIRECT.open(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def post(url: str, rid: str, ids: tuple[int, ...] = (1, 7, 8, 2)) -> tuple[int, Any]:
    """SGLang's `/generate` through the router, as draftline's client sends it."""
    body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 8}, "rid": rid}
    headers = {"Content-Type": "application/json"}
    return get(urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), headers))


def is_running(pid: int) -> bool:
    fields = server_process._stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def launch(worker: StandIn, wait: bool = True) -> StandIn:
    """Start a stand-in worker, its output to a file next to its log; `wait`: until its
    `/health` answers (not while it is loading)."""
    with open(worker.log.with_suffix(".out"), "ab") as out:
        worker.proc = subprocess.Popen(worker.args, stdout=out, stderr=subprocess.STDOUT)
    if wait:
        wait_healthy(worker.url)
    return worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny target with its tokenizer: the router loads the tokenizer of the path a worker
    serves (`/model_info`) from this folder, never from the hub."""
    return build_random_target(tmp_path_factory.mktemp("target"))


@pytest.fixture
def worker(tmp_path, model_dir) -> Iterator[Callable[..., StandIn]]:
    """Stand-in workers serving `model_dir` (not started: `launch`), stopped after the test."""
    made: list[StandIn] = []

    def make(*args: str) -> StandIn:
        made.append(StandIn(tmp_path, "--model-path", str(model_dir), *args))
        return made[-1]

    yield make
    for w in made:
        w.stop()


def test_the_router_serves_once_every_worker_is_registered_and_draftline_waits_for_it(
    engine_python, tmp_path, model_dir, worker
):
    """The router is alive at once but refuses `/generate` until it has registered a worker,
    and says "ready" as soon as one of two is: draftline's check (`router_missing`, what
    `serve start` and a stage's wait ask) holds out until both are."""
    a, b = worker(), worker("--startup-delay", "2")  # b loads for 2 s: /health 503
    flags = router_flags(model_dir, {"request_timeout_s": 20000})
    # draftline's timeout formula, above the client's 20,000 s, is a value the router takes.
    assert int(flags[flags.index("--request-timeout-secs") + 1]) > 20000
    with Router(engine_python, tmp_path, [a.url, b.url], flags) as router:
        # Alive, no worker up yet: not ready, and a request is refused, not queued.
        assert get(f"{router.url}/readiness") == (
            503,
            {"status": "not ready", "reason": "insufficient healthy workers"},
        )
        status, body = post(router.url, "early")
        assert status == 503 and body["error"]["code"] == "no_available_workers"
        assert "HTTP 503" in (sglang_server.router_missing(router.url, 2) or "")
        launch(a, wait=False)
        wait_for(lambda: router.workers() == {a.url: True}, "worker a registered")
        # One of two registered: the router says ready, draftline does not.
        assert get(f"{router.url}/readiness") == (
            200,
            {"status": "ready", "healthy_workers": 1, "total_workers": 1},
        )
        assert sglang_server.router_missing(router.url, 2) == (
            "router /readiness: 1 of 1 workers healthy, 2 engines launched"
        )
        launch(b, wait=False)
        wait_for(lambda: sglang_server.router_missing(router.url, 2) is None, "draftline's ready")
        assert router.workers() == {a.url: True, b.url: True}
        assert post(router.url, "after")[0] == 200
        served = a.rids() + b.rids()
    assert served == ["after"]  # the refused request reached no worker


def test_a_worker_slower_than_the_routers_timeout_gets_one_attempt_and_its_answer(
    engine_python, tmp_path, model_dir, worker
):
    """Past `--request-timeout-secs` the router answers HTTP 500 `call_upstream_request_error`
    (no 504), which draftline's client retries; with retries disabled, as `serve start` asks,
    each try reaches the worker once (the router would otherwise try 5 times). The router
    forwards what the client sends (it re-encodes the body, adding fields of its own): the
    turn's priority and seed, and the sampling parameters."""
    bodies = tmp_path / "bodies.jsonl"
    slow = launch(worker("--delay", "5", "--body-log", str(bodies)))
    flags = with_flag(router_flags(model_dir, {}), "--request-timeout-secs", "1")
    assert "--disable-retries" in flags
    with Router(engine_python, tmp_path, [slow.url], flags) as router:
        wait_for(lambda: router.workers() == {slow.url: True}, "the worker registered")
        status, body = post(router.url, "slow-1")
        assert status == 500 and body["error"]["code"] == "call_upstream_request_error"
        assert slow.rids() == ["slow-1"]
        # draftline's client, waiting longer than the router: two tries, one attempt each.
        settings = ClientSettings(
            endpoints=(router.url,),
            request_timeout_s=30,
            max_retries=1,
            backoff_base_s=0.01,
            priorities=True,
        )
        results: list[Result] = []
        client = SGLangEngine(settings, Sampling(max_new_tokens=8, temperature=0.7), EOT)
        turn = Request("turn", [1, 7, 8, 2], priority=3)
        client.generate([turn], results.append)
        assert [r.finish_reason for r in results] == ["error"]
        assert "HTTP 500" in results[0].error and "call_upstream_request_error" in results[0].error
        tries = slow.rids()[1:]
        assert [t.split("@")[0] for t in tries] == ["turn-0", "turn-1"]
    forwarded = [json.loads(line) for line in bodies.read_text().splitlines()][1:]
    assert len(forwarded) == 2
    for attempt, body in enumerate(forwarded):
        sent = json.loads(client._payload(turn, attempt))  # what the client sent
        assert {k: body.get(k) for k in sent} == sent and sent["priority"] == 3
        assert "sampling_seed" in sent["sampling_params"]


def journal_records(root: Path) -> list[dict[str, Any]]:
    path = root / ".draftline/journal/generate/shard-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


SYSTEM = "You answer questions about lists, sums and sorting. " * 6


def shared_prefix_conversations(n: int) -> list[list[dict[str, str]]]:
    """`n` conversations opening with the same long system message (most of each prompt), a
    third of them with an earlier exchange (two turns to write)."""
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"question {i}: why sort {i % 5} lists?"}]
        if i % 3 == 2:
            turns[:0] = [
                {"role": "user", "content": f"first {i}"},
                {"role": "assistant", "content": "ok"},
            ]
        out.append([{"role": "system", "content": SYSTEM}, *turns])
    return out


def test_a_worker_killed_mid_request_loses_and_repeats_nothing(
    engine_python, tmp_path, model_dir, worker
):
    """One of two workers dies abruptly in the middle of a request (the stand-in's
    `--die-after`), one request at a time. The router's cache-aware routing sends every prompt
    to the worker holding their shared prefix (the system message, primed there through the
    router before the other worker joins), and a retried turn back to it, dead or not, until its
    circuit breaker opens: with the settings `serve start` gives the router, before the client's
    last try, which reaches the other worker. Every turn is journaled once, the table holds
    every curated id once, and no row is an error."""
    from transformers import AutoTokenizer

    dies, lives = launch(worker("--die-after", "3")), worker()
    generate = {"max_retries": 3, "backoff_base_s": 0.05, "backoff_max_s": 0.5}
    flags = router_flags(model_dir, generate)
    assert flags[flags.index("--cb-failure-threshold") + 1] == "3"  # the client tries 4 times
    prefix = AutoTokenizer.from_pretrained(model_dir)(
        f"<|im_start|>system\n{SYSTEM}", add_special_tokens=False
    )["input_ids"]
    with Router(engine_python, tmp_path, [dies.url, lives.url], flags) as router:
        wait_for(lambda: router.workers() == {dies.url: True}, "the first worker registered")
        assert post(router.url, "prime", tuple(prefix))[0] == 200
        launch(lives)
        wait_for(lambda: len(router.workers()) == 2, "both workers registered")
        ids = make_workdir(
            tmp_path / "run", model_dir, messages=shared_prefix_conversations(12),
            hardware=profile(router.port, max_in_flight=1), generate=generate,
            max_new_tokens=64,
        )  # fmt: skip
        proc = run_generate(tmp_path / "run", "--shard", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert dies.proc is not None and dies.proc.wait(5) != 0  # it died, mid-request
    tries = {"dies": dies.rids(), "lives": lives.rids()}
    # It answered the priming request and two turns, and died with the third.
    assert len(tries["dies"]) == 4
    turn = tries["dies"][3].split("@")[0].rsplit("-", 1)[0]
    assert [t for t in tries["lives"] if t.startswith(f"{turn}-")] == [
        t for t in tries["lives"] if t.startswith(f"{turn}-3@")
    ]  # its last try, on the other worker
    # The router tried nothing on its own: every try of the client reached one worker once.
    assert max(Counter(tries["dies"] + tries["lives"]).values()) == 1
    table = pq.read_table(tmp_path / "run/data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids
    assert {r["finish_reason"] for r in table} == {"stop"}
    records = [r for r in journal_records(tmp_path / "run") if "id" in r]
    assert all(r["finish_reason"] != "error" for r in records)
    keys = [r["id"] for r in records]
    assert len(keys) == len(set(keys)) == sum(r["turns"] for r in table)


# `sglang_router.launch_server` as it is, with SGLang's HTTP server standing in: spawned engine
# processes run this file again as `__mp_main__` before they unpickle their target, so the
# stand-in is in place when `run_server` imports SGLang's server.
LAUNCHER = f"""
import os, shlex, subprocess, sys, types
sys.path.insert(0, {str(STANDIN.parent)!r})

def serve_engine(server_args):
    import sglang_standin
    # A "scheduler" child in the engine's process group, as SGLang's engine starts its own.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    flags = os.environ.get("STANDIN_ENGINE_FLAGS", "").replace(
        "{{rank}}", os.environ["SGLANG_DP_RANK"]
    )
    sglang_standin.main(["--host", server_args.host, "--port", str(server_args.port),
                         "--model-path", server_args.model_path, *shlex.split(flags)])

server = types.ModuleType("sglang.srt.entrypoints.http_server")
server.launch_server = serve_engine
sys.modules[server.__name__] = server

if __name__ == "__main__":
    from sglang_router.launch_server import main
    main()
"""


def test_serve_start_generate_and_stop_through_sglang_routers_own_launcher(
    engine_python, tmp_path, model_dir
):
    """`serve start` runs `sglang_router.launch_server` (two DP engines, loading for 2 s, and
    the router over them) and returns once the router serves both; the generate stage then
    sends no request the router refuses; `serve stop` leaves no process of it behind, the
    engines' own process groups and their schedulers included."""
    launcher = tmp_path / "launch_server.py"
    launcher.write_text(LAUNCHER, encoding="utf-8")
    port, root = free_port(), tmp_path / "run"
    rids = tmp_path / "engine-{rank}.rids"
    standin = f"--startup-delay 2 --think-start 3 --think-end 4 --vocab-low 10 --vocab-high 300 --log {rids}"  # noqa: E501
    extra = ["--router-prometheus-port", str(free_port()),
             "--router-dp-worker-base-port", str(free_port())]  # fmt: skip
    hardware = profile(port, extra_args=extra, env={"STANDIN_ENGINE_FLAGS": standin})
    ids = make_workdir(root, model_dir, n=24, hardware=hardware, max_new_tokens=64)
    env = {sglang_server.LAUNCHER_ENV: shlex.join([str(engine_python), str(launcher)])}
    started = subprocess.run(
        [sys.executable, "-m", "draftline", "serve", "start", "--timeout", "300"],
        cwd=root, capture_output=True, text=True, timeout=400, env={**os.environ, **env},
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr  # else it stopped it all
    assert "engines: 2" in started.stdout
    state = server_process.read_states(root)[0]
    try:
        url = f"http://127.0.0.1:{port}"
        # Ready as draftline returned: the router has both engines, by its own account.
        assert get(f"{url}/readiness") == (
            200,
            {"status": "ready", "healthy_workers": 2, "total_workers": 2},
        )
        engines = [pid for pid, _ in state.processes if os.getpgid(pid) == pid != state.pid]
        assert len(engines) == 2  # each DP engine leads a process group of its own
        proc = run_generate(root, "--shard", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        table = pq.read_table(root / "data/generated/train/shard-0.parquet").to_pylist()
        assert [r["id"] for r in table] == ids and {r["finish_reason"] for r in table} == {"stop"}
        # Every turn reached an engine once: nothing refused, failed or tried again.
        served = [r for k in (0, 1) for r in Path(str(rids).format(rank=k)).read_text().split()]
        assert len(served) == len(set(served)) == sum(r["turns"] for r in table)
        router_log = re.sub(r"\x1b\[[0-9;]*m", "", Path(root / state.log).read_text())
        generated = re.findall(r"uri=/generate .*status_code=(\d+)", router_log)
        assert generated and set(generated) == {"200"}  # none refused or failed
    finally:
        tree = server_process.tree(state)
        stopped = subprocess.run(
            [sys.executable, "-m", "draftline", "serve", "stop", "--grace", "60"],
            cwd=root, capture_output=True, text=True, timeout=200,
        )  # fmt: skip
    # The launcher with the router in it, multiprocessing's resource tracker, both engines and
    # their schedulers: 6 processes, all ended within the grace period.
    assert stopped.returncode == 0, stopped.stdout
    assert "6 processes, 6 ended on SIGTERM" in stopped.stdout, stopped.stdout
    assert len(tree) == 6 and set(engines) < set(tree)
    assert not [pid for pid in tree if is_running(pid)]
    assert not server_process.healthy(f"http://127.0.0.1:{port}")
