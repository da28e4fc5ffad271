"""A first start (the weights downloaded, kernels compiled) may take longer than `--timeout`:
`serve start` keeps waiting while the server's log shows progress, prints the latest line now
and then, and still gives up on a silent log or at the ceiling, naming the log and the flag.

The server is a stand-in for SGLang/vLLM's first start (they need a GPU): a real process that
writes the phases such a start logs to its log, slowly (tqdm's carriage-return updates
included), then answers `/health`, or never does. Everything else is `server_process.launch`
as `serve start` runs it: the process group, the log, the wait, the stop. The timeouts are
seconds instead of minutes; the rule is the same fractions of them.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from helpers.generate_helpers import free_port

from draftline.generation import server_process, startup_watch
from draftline.generation.server_process import ServeError, launch

FIRST_START = r'''
import http.server, sys, threading, time
port, mode = int(sys.argv[1]), sys.argv[2]

def say(text, end="\n"):
    sys.stdout.write(text + end)
    sys.stdout.flush()

def slow_phases(seconds):
    """Lines every 0.05 s for `seconds`, as a first start logs them."""
    start, k = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        k += 1
        if k % 20 == 0:
            say(f"Downloading model-{k // 20:05d}-of-00011.safetensors")
        elif k % 7 == 0:  # tqdm in a file: carriage returns, the line ends at the bar's end
            say(f"Loading safetensors checkpoint shards: {k % 8}/8", end="\r")
        else:
            say(f"Capturing CUDA graphs (bs={k})")
        time.sleep(0.05)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if ready.is_set() else 503)
        self.end_headers()
    def log_message(self, *args):  # the access line a server logs for each poll
        say('INFO:     127.0.0.1 - "GET /health HTTP/1.1" 503')

ready = threading.Event()
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
if mode == "ready-after":
    slow_phases(float(sys.argv[3]))
    say("The server is fired up and ready to roll!")
    ready.set()
elif mode == "stall-after":
    slow_phases(float(sys.argv[3]))
elif mode == "forever":
    slow_phases(10**6)
time.sleep(10**6)
'''

TIMEOUT_S = 1.5  # a silence of 0.5 s ends the wait past it, and 6 s in all


@pytest.fixture
def first_start(tmp_path, monkeypatch, capsys):
    """launch(*mode) of the stand-in on a free port; progress reported every 0.3 s."""
    script = tmp_path / "first_start.py"
    script.write_text(FIRST_START, encoding="utf-8")
    monkeypatch.setattr(startup_watch, "REPORT_EVERY_S", 0.3)
    started: list[server_process.ServerState] = []

    def run(*mode: str) -> server_process.ServerState:
        port = free_port()
        command = [sys.executable, str(script), str(port), *mode]
        state = launch(
            "sglang", command, {}, port=port, url=f"http://127.0.0.1:{port}",
            profile="test", timeout_s=TIMEOUT_S, root=tmp_path,
        )  # fmt: skip
        started.append(state)
        return state

    yield run
    for state in started:
        server_process.stop(state, tmp_path, grace_s=5)


def test_a_start_past_the_timeout_goes_on_while_the_log_shows_progress(first_start, capsys):
    state = first_start("ready-after", "4")  # well past the 1.5 s timeout, never silent
    assert server_process.healthy(state.url)
    err = capsys.readouterr().err
    assert "SGLang on port" in err and "not ready after 1.5s, but its log shows progress" in err
    progress = [line for line in err.splitlines() if re.search(r"on port \d+: \d+s, ", line)]
    assert progress, err  # the latest phase now and then
    phases = ("Downloading model-", "Loading safetensors checkpoint shards", "Capturing CUDA")
    assert all(any(p in line for p in phases) for line in progress), progress
    assert not any("GET /health" in line for line in progress)  # its own polls are no phase


def test_a_silent_log_past_the_timeout_ends_the_wait(first_start, tmp_path):
    with pytest.raises(ServeError) as info:
        first_start("stall-after", "2.5")
    first, *_ = str(info.value).splitlines()
    assert "not ready after" in first and "its log has shown nothing new for 0.5s" in first
    assert "/health does not answer (stopped)" in first
    assert "see " in first and "logs/serve/sglang-" in first
    assert "raise --timeout (generate.serve_timeout_s)" in first
    assert not list((tmp_path / ".draftline/serve").glob("*.json"))  # stopped, unrecorded


def test_polls_alone_are_no_progress(first_start):
    """A server that logs nothing but the access lines of the wait's own health polls ends at
    the timeout itself."""
    with pytest.raises(ServeError, match=r"not ready after 1\.5s: /health does not answer"):
        first_start("silent")


def test_a_log_that_never_ends_stops_at_the_ceiling(first_start):
    with pytest.raises(ServeError) as info:
        first_start("forever")
    assert "4x --timeout, the most a start may take" in str(info.value)


def test_the_watch_reads_lines_carriage_returns_and_skips_its_polls(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("=== header written before the start\n", encoding="utf-8")
    said: list[str] = []
    watch = startup_watch.StartupWatch(log, 1800, "SGLang on port 1", said.append)
    with log.open("a", encoding="utf-8") as f:
        f.write("Fetching 11 files:  9%\rFetching 11 files: 18%\r")
        f.write('INFO: 127.0.0.1 - "GET /health HTTP/1.1" 503\nstarted processing request')
    watch.poll()
    assert watch.phase == "Fetching 11 files: 18%"  # the last whole update
    with log.open("a", encoding="utf-8") as f:
        f.write(" method=GET uri=/readiness\n")  # the rest of the router's line: a poll
    watch.poll()
    assert watch.phase == "Fetching 11 files: 18%" and not said  # nothing due yet
    assert watch.waited() == "after 1800s" and not watch.expired()  # 600 s to go before it


def test_the_router_waits_for_its_engines_as_long_as_the_start(tmp_path, monkeypatch, capsys):
    """sglang-router drops engines not registered within its startup timeout (1800 s by
    default): `serve start` raises it to the ceiling of its own wait, `--timeout` included."""
    from draftline import cli
    from draftline.generation.sglang_server import server_command
    from draftline.runtime import hardware, params

    repo = Path(__file__).resolve().parents[2]
    profile = hardware.load_profiles(repo / "conf")["b200x8"]
    model = {"path": "Qwen/Qwen3.6-27B", "revision": "main", "serving": {}}
    words = server_command(profile, model, python="p", generate={"serve_timeout_s": 1800})
    assert words[words.index("--router-worker-startup-timeout-secs") + 1] == "7200"
    composed = params.compose(["model=qwen3_6_27b", "hardware=b200x8"], repo / "conf")
    path = tmp_path / "params.yaml"
    path.write_text(params.to_yaml(composed), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["serve", "start", "--dry-run", "--timeout", "600"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[printed.index("--router-worker-startup-timeout-secs") + 1] == "2400"
