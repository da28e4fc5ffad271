"""The SGLang client against a stand-in server (tests/helpers/sglang_standin.py) in its own process.

SGLang needs a GPU and is not installed here; the stand-in speaks its native `/generate` and
`/health` protocol faithfully (request: input_ids, sampling_params, rid; answer: output_ids,
meta_info.finish_reason), and injects the faults a real cluster shows: 500s, 429s, dropped
connections, slow answers and a server that dies mid-shard.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
from helpers.generate_helpers import StandIn, free_port
from helpers.sglang_standin import build_parser, completion_for

from draftline.generation.engines.base import (
    CONTEXT_RESERVE,
    EngineUnavailable,
    Request,
    Result,
    Sampling,
)
from draftline.generation.engines.sglang import (
    ClientSettings,
    SGLangEngine,
    parse_response,
    resolve_endpoints,
)

EOT = 2
SAMPLING = Sampling(max_new_tokens=64)


def standin_opts() -> argparse.Namespace:
    return build_parser().parse_args(
        ["--think-start", "3", "--think-end", "4", "--vocab-low", "10", "--vocab-high", "300"]
    )


def reqs(n: int) -> list[Request]:
    return [Request(f"s{i:05d}", [1, 7 + i % 50, 8 + i % 13, 9 + i, 2]) for i in range(n)]


def engine(*urls: str, **kw) -> SGLangEngine:
    settings = {
        "max_in_flight": 16,
        "request_timeout_s": 10,
        "max_retries": 4,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.2,
        "health_timeout_s": 1.0,
        **kw,
    }
    return SGLangEngine(ClientSettings(endpoints=tuple(urls), **settings), SAMPLING, EOT)


def run(eng: SGLangEngine, requests: list[Request]) -> dict[str, Result]:
    out: dict[str, Result] = {}

    def on_result(r: Result) -> None:
        assert r.id not in out, "a sample was reported twice"
        out[r.id] = r

    eng.generate(requests, on_result)
    return out


def expected(request: Request) -> list[int]:
    params = {"max_new_tokens": SAMPLING.max_new_tokens, "stop_token_ids": [EOT]}
    return completion_for(request.prompt_ids, params, standin_opts())["output_ids"]


def test_completion_ids_are_exactly_what_the_server_returned(tmp_path):
    requests = reqs(50)
    with StandIn(tmp_path) as server:
        out = run(engine(server.url), requests)
        assert sorted(server.sample_ids()) == sorted(r.id for r in requests)  # one request each
    for r in requests:
        assert out[r.id].finish_reason == "stop"
        assert out[r.id].completion_ids == expected(r)
        assert out[r.id].completion_ids[-1] == EOT


def test_injected_500_429_and_dropped_connections_are_retried(tmp_path):
    requests = reqs(120)
    with StandIn(tmp_path, "--p500", "0.1", "--p429", "0.05", "--pdrop", "0.1", "--seed", "3") as s:
        eng = engine(s.url, max_retries=8)
        out = run(eng, requests)
        rids = s.rids()
    assert len(out) == 120
    assert all(
        r.finish_reason == "stop" and r.completion_ids == expected(q)
        for q, r in ((q, out[q.id]) for q in requests)
    )
    assert eng.retries > 10 and len(rids) == eng.requests_sent > 120
    assert len(set(rids)) == len(rids)  # every attempt has its own rid


def test_slow_answers_time_out_and_become_error_rows_not_losses(tmp_path):
    requests = reqs(6)
    with StandIn(tmp_path, "--delay", "1.5") as s:
        out = run(engine(s.url, request_timeout_s=0.3, max_retries=1), requests)
    assert sorted(out) == sorted(r.id for r in requests)
    for r in out.values():
        assert r.finish_reason == "error" and "within 0.3s" in r.error and r.completion_ids == []


def test_server_dying_mid_shard_stops_the_run_with_a_clear_error(tmp_path):
    requests = reqs(200)
    finished: list[Result] = []
    with StandIn(tmp_path, "--die-after", "60") as s:
        eng = engine(s.url, max_in_flight=4)
        with pytest.raises(EngineUnavailable, match="no SGLang endpoint answers"):
            eng.generate(requests, finished.append)
    assert 40 <= len(finished) <= 60
    by_id = {r.id: r for r in requests}
    assert all(
        f.finish_reason == "stop" and f.completion_ids == expected(by_id[f.id]) for f in finished
    )


def test_load_is_spread_over_endpoints_and_a_dead_one_is_avoided(tmp_path):
    requests = reqs(80)
    dead = f"http://127.0.0.1:{free_port()}"
    with StandIn(tmp_path) as a, StandIn(tmp_path) as b:
        out = run(engine(a.url, b.url, dead), requests)
        served_a, served_b = len(a.rids()), len(b.rids())
    assert all(r.finish_reason == "stop" for r in out.values()) and len(out) == 80
    assert served_a > 10 and served_b > 10


def test_endpoints_dying_mid_shard_leave_every_sample_done_exactly_once(tmp_path):
    """Two of three endpoints die mid-shard: their requests in flight and every later one go
    to the survivor, with few retries (a dead endpoint is not picked again at once)."""
    requests = reqs(200)
    fast = ("--delay", "0.01")
    with (
        StandIn(tmp_path, *fast) as alive,
        StandIn(tmp_path, *fast, "--die-after", "20") as dies,
        StandIn(tmp_path, *fast, "--die-after", "30") as dies_later,
    ):
        # A refused endpoint stays out for backoff_max_s: here longer than the whole run.
        eng = engine(alive.url, dies.url, dies_later.url, max_retries=2, backoff_max_s=5.0)
        out = run(eng, requests)  # `run` fails on a sample reported twice
        served = {r.rsplit("-", 1)[0] for s in (alive, dies, dies_later) for r in s.rids()}
        assert dies.proc.wait(5) != 0 and dies_later.proc.wait(5) != 0  # both died
    assert sorted(out) == sorted(r.id for r in requests) and served == set(out)
    assert all(
        out[q.id].finish_reason == "stop" and out[q.id].completion_ids == expected(q)
        for q in requests
    )
    assert eng.retries < 40  # about one per request in flight on a dying endpoint


def test_bounded_concurrency(tmp_path):
    requests = reqs(40)
    with StandIn(tmp_path, "--delay", "0.2") as s:
        eng = engine(s.url, max_in_flight=8)
        peak = 0
        t0 = time.monotonic()

        def on_result(r: Result) -> None:
            nonlocal peak
            peak = max(peak, sum(eng.in_flight.values()))

        eng.generate(requests, on_result)
        wall = time.monotonic() - t0
    assert peak <= 8
    assert wall >= 40 / 8 * 0.2 * 0.9  # never more than 8 at once
    assert wall < 40 * 0.2 / 2  # but many at once


def test_http_400_is_recorded_without_retrying(tmp_path):
    with StandIn(tmp_path) as s:
        out = run(engine(s.url), [Request("bad", []), *reqs(3)])  # SGLang rejects empty input
        assert s.sample_ids().count("bad") == 1
    assert out["bad"].finish_reason == "error" and "HTTP 400" in out["bad"].error
    assert sum(r.finish_reason == "stop" for r in out.values()) == 3


def test_parse_response_variants():
    ok = {
        "output_ids": [5, 6, EOT, 9],
        "meta_info": {"finish_reason": {"type": "stop", "matched": EOT}},
    }
    assert parse_response("a", ok, EOT).completion_ids == [5, 6, EOT]
    trimmed = {
        "output_ids": [5, 6],
        "meta_info": {"finish_reason": {"type": "stop", "matched": EOT}},
    }
    r = parse_response("a", trimmed, EOT)
    assert (r.finish_reason, r.completion_ids) == ("stop", [5, 6, EOT])
    length = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}
    assert parse_response("a", length, EOT).finish_reason == "length"
    abort = {"meta_info": {"finish_reason": {"type": "abort", "message": "too long"}}}
    r = parse_response("a", abort, EOT)
    assert r.finish_reason == "error" and "too long" in r.error


def test_endpoints_from_env_config_or_profile(monkeypatch):
    monkeypatch.delenv("DRAFTLINE_SGLANG_ENDPOINTS", raising=False)
    assert resolve_endpoints(None, "127.0.0.1", 30000) == ["http://127.0.0.1:30000"]
    assert resolve_endpoints(["node1:30000/", "http://r:1"], "h", 1) == [
        "http://node1:30000",
        "http://r:1",
    ]
    monkeypatch.setenv("DRAFTLINE_SGLANG_ENDPOINTS", "http://a:1, http://b:2")
    assert resolve_endpoints(["ignored:1"], "h", 1) == ["http://a:1", "http://b:2"]


class Chat:
    """A multi-turn conversation for the scheduler: each turn's prompt holds the answers."""

    def __init__(self, name: str, turns: int) -> None:
        self.id, self.turns, self.done = name, turns, 0
        self.order, self.group = (0, name), 0
        self.prompt = [1, 7 + len(name), 8 + turns, 2]

    def remaining_turns(self) -> int:
        return self.turns - self.done

    def next_request(self) -> Request:
        return Request(f"{self.id}#{self.done}", list(self.prompt))

    def answered(self, result: Result) -> None:
        assert result.finish_reason == "stop" and result.id == f"{self.id}#{self.done}"
        self.prompt += [*result.completion_ids, 1, 9 + self.done, 2]  # the next user turn
        self.done += 1


def server_in_flight(timing: str, prefix: str, limit: int) -> float:
    """Mean requests the server had open during a run (its requests: `prefix`) while at least
    `limit` conversations had turns left: from its first request to the answer that left fewer
    (after that no schedule can fill `limit` slots)."""
    rows = [line.split() for line in timing.splitlines()]
    spans = [(float(start), float(end)) for start, end, rid in rows if rid.startswith(prefix)]
    finished: dict[str, float] = {}  # conversation -> its last answer
    for _, end, rid in rows:
        if rid.startswith(prefix):
            conversation = rid.rsplit("#", 1)[0]
            finished[conversation] = max(finished.get(conversation, 0.0), float(end))
    begin, until = min(s for s, _ in spans), sorted(finished.values())[len(finished) - limit]
    covered = sum(max(0.0, min(end, until) - max(start, begin)) for start, end in spans)
    return covered / (until - begin)


def test_in_flight_requests_stay_at_the_limit_during_a_multi_turn_run(tmp_path):
    """Turns of 1-5-turn conversations answered in 50-300 ms (a function of the prompt): the
    continuous schedule keeps the server at the client's limit while any conversation is left
    to start, which the rounds schedule (turn k of every conversation, wait for all, then turn
    k+1) does not."""
    from draftline.generation.schedule import Scheduler

    limit, timing = 8, tmp_path / "timing.log"
    mean = {}
    with StandIn(tmp_path, "--delay", "0.05", "--delay-spread", "0.25",
                 "--timing-log", str(timing)) as s:  # fmt: skip
        for schedule in ("rounds", "continuous"):
            chats = [Chat(f"{schedule}-{i:02d}", 1 + i * 7 % 5) for i in range(32)]
            eng = engine(s.url, max_in_flight=limit)
            peak = 0

            def on_result(work: Chat, result: Result, eng=eng) -> None:
                nonlocal peak
                peak = max(peak, sum(eng.in_flight.values()))
                work.answered(result)

            scheduler = Scheduler(eng, on_result, schedule=schedule)
            scheduler.run(chats)
            eng.close()
            assert all(c.done == c.turns for c in chats)
            assert peak <= limit and scheduler.peak_in_flight <= (limit if schedule != "rounds"
                                                                   else 32)  # fmt: skip
            mean[schedule] = server_in_flight(timing.read_text(), f"{schedule}-", limit)
    # At the limit but for the moments between an answer and the next turn's arrival.
    assert mean["continuous"] >= 0.85 * limit, mean
    assert mean["rounds"] < mean["continuous"] - 0.5, mean


def test_priorities_are_sent_only_to_servers_that_schedule_by_them():
    request = Request("c#0", [1, 2, 3], priority=4)
    plain = json.loads(engine("http://127.0.0.1:1")._payload(request, 0))
    assert "priority" not in plain  # an older server would reject the field
    client = engine("http://127.0.0.1:1", priorities=True)
    ordered = json.loads(client._payload(request, 0))
    assert ordered["priority"] == 4 and ordered["rid"] == f"c#0-0@{client.run_tag}"


def test_a_turn_capped_to_its_room_in_the_context_is_served_where_the_full_ask_is_refused(
    tmp_path,
):
    """SGLang refuses `input + reserved draft slots + max_new_tokens > context_length` with
    HTTP 400, which nobody retries; the turn's cap (`Sampling.turn_cap`) asks for what is left."""
    sampling = Sampling(max_new_tokens=200, context_length=400)
    prompt = list(range(10, 210))  # 200 tokens
    cap = sampling.turn_cap(len(prompt))
    assert cap == 400 - CONTEXT_RESERVE - 200 < sampling.max_new_tokens
    args = ["--mode", "truncated", "--context-length", "400", "--speculative-algorithm", "NEXTN"]
    args += ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]
    with StandIn(tmp_path, *args) as s:
        settings = ClientSettings(endpoints=(s.url,), max_retries=1, backoff_base_s=0.01)
        out = run(
            SGLangEngine(settings, sampling, EOT),
            [Request("full", prompt), Request("capped", prompt, max_new_tokens=cap)],
        )
    assert out["full"].finish_reason == "error" and "context length" in (out["full"].error or "")
    assert out["capped"].finish_reason == "length" and len(out["capped"].completion_ids) == cap


def test_the_models_eos_stops_a_turn_and_is_stored_as_the_end_of_turn_is(tmp_path):
    """SGLang stops on the model's EOS whatever the request says (and `ignore_eos` would turn
    off the end-of-turn stop too): the client asks for both and keeps the stop token."""
    eos = 9
    with StandIn(tmp_path, "--mode", "eos", "--model-eos", str(eos)) as s:
        client = SGLangEngine(ClientSettings(endpoints=(s.url,)), SAMPLING, EOT, eos=eos)
        assert client.params["stop_token_ids"] == [EOT, eos]
        assert "ignore_eos" not in client.params
        r = run(client, reqs(1))["s00000"]
    assert r.finish_reason == "stop" and r.completion_ids[-1] == eos
    assert r.completion_ids.count(eos) == 1 and len(r.completion_ids) == 4


def test_a_sampled_turn_sends_its_own_seed_on_every_try():
    """`sampling_seed` (honoured under --enable-deterministic-inference) from the run's seed and
    the turn's id: a retry sends the same one; greedy requests send none."""
    sampled = Sampling(max_new_tokens=8, temperature=1.0, seed=5)
    client = SGLangEngine(ClientSettings(endpoints=("http://x",)), sampled, EOT)
    first = json.loads(client._payload(Request("c#1", [1]), attempt=0))["sampling_params"]
    retry = json.loads(client._payload(Request("c#1", [1]), attempt=3))["sampling_params"]
    other = json.loads(client._payload(Request("c#2", [1]), attempt=0))["sampling_params"]
    assert first["sampling_seed"] == retry["sampling_seed"] != other["sampling_seed"]
    assert first["sampling_seed"] == sampled.request_seed("c#1")
    greedy = SGLangEngine(ClientSettings(endpoints=("http://x",)), SAMPLING, EOT)
    assert (
        "sampling_seed"
        not in json.loads(greedy._payload(Request("c#1", [1]), 0))["sampling_params"]
    )


def test_request_ids_differ_between_runs_while_the_seed_stays_the_turns(tmp_path):
    """A resumed run asks the same turns again while an earlier run's request may still run in
    the server, which refuses a duplicate rid with HTTP 400: each client (each run) tags its
    rids, and the sampling seed stays a function of generate.seed and the turn id only."""
    sampled = Sampling(max_new_tokens=8, temperature=1.0, seed=5)
    first, second = (
        SGLangEngine(ClientSettings(endpoints=("http://x",)), sampled, EOT) for _ in range(2)
    )
    turn = Request("c#1", [1])
    one, two = (json.loads(c._payload(turn, attempt=0)) for c in (first, second))
    assert one["rid"] != two["rid"]
    assert one["rid"].startswith("c#1-0@") and two["rid"].startswith("c#1-0@")
    assert one["sampling_params"]["sampling_seed"] == two["sampling_params"]["sampling_seed"]
    assert one["sampling_params"]["sampling_seed"] == sampled.request_seed("c#1")
    # Against a server: two runs of the same turns never send the same rid twice.
    with StandIn(tmp_path) as s:
        for _ in range(2):
            run(engine(s.url), reqs(3))
        rids = s.rids()
    assert len(rids) == 6 and len(set(rids)) == 6
    assert sorted(s.sample_ids()) == sorted(r.id for r in reqs(3) * 2)


def test_a_nan_step_is_an_error_never_a_clean_stop(tmp_path):
    """SGLang ends a turn whose step had NaN logits as a stop (`"matched": "NaN happened"`,
    a stop token written where the token would be): the client records an error row."""
    nan = [1, 299, 2]  # the stand-in's marked prompt
    with StandIn(tmp_path, "--nan-token", "299") as s:
        out = run(engine(s.url), [Request("nan", nan), *reqs(2)])
        assert s.sample_ids().count("nan") == 1  # like an abort: recorded, not retried
    assert out["nan"].finish_reason == "error" and "NaN" in (out["nan"].error or "")
    assert out["nan"].completion_ids == []
    assert all(out[r.id].finish_reason == "stop" for r in reqs(2))
    # The answer itself ends on the stop token, as a clean stop would.
    answer = completion_for(nan, {"max_new_tokens": 64, "stop_token_ids": [EOT]}, nan_opts())
    assert answer["output_ids"][-1] == EOT and answer["reason"]["matched"] == "NaN happened"


def nan_opts() -> argparse.Namespace:
    return build_parser().parse_args(
        ["--vocab-low", "10", "--vocab-high", "300", "--nan-token", "299"]
    )
