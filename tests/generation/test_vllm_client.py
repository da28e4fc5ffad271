"""The vLLM engine's protocol and launch command, without vLLM: the request body, the reading of
`/v1/completions` answers, the `--speculative-config` of the exported drafter, the head_dim
check that refuses a target vLLM's CPU attention cannot run, and the Prometheus counters bench
reads. The real server runs in tests/vllm (the `vllm` marker, .ci/vllm)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from draftline.generation import bench, vllm_server
from draftline.generation.engines.base import Request, Sampling
from draftline.generation.engines.sglang import ClientSettings
from draftline.generation.engines.vllm import VLLMEngine, completion_params, parse_completion
from draftline.generation.server_process import ServeError
from draftline.runtime import hardware

REPO = Path(__file__).resolve().parents[2]
PROFILE = hardware.load_profiles(REPO / "conf")["vllm_cpu"]
EOT = 2
EOS = 3


def answer(token_ids: list[int] | None, finish: str, stop_reason: int | None = None) -> dict:
    return {
        "choices": [{"token_ids": token_ids, "finish_reason": finish, "stop_reason": stop_reason}]
    }


def test_the_request_stops_at_the_end_of_turn_or_eos_and_asks_for_ids() -> None:
    engine = VLLMEngine(ClientSettings(endpoints=("http://x",)), Sampling(32), EOT, eos=EOS)
    body = orjson.loads(engine._payload(Request("a", [1, 5, 6]), attempt=1))
    assert body["prompt"] == [1, 5, 6] and body["max_tokens"] == 32
    # The rule of every engine: end of turn or the model's EOS, never `ignore_eos`.
    assert body["stop_token_ids"] == [EOT, EOS] and "ignore_eos" not in body
    assert body["return_token_ids"] is True and body["temperature"] == 0.0
    # A turn whose prompt leaves less of the context than max_new_tokens asks for that much.
    capped = orjson.loads(engine._payload(Request("a", [1], max_new_tokens=5), attempt=0))
    assert capped["max_tokens"] == 5
    assert body["request_id"] == f"a-1@{engine.run_tag}" and "seed" not in body  # greedy: no seed
    sampled = VLLMEngine(ClientSettings(endpoints=("http://x",)), Sampling(8, 0.7, seed=3), EOT)
    one = orjson.loads(sampled._payload(Request("a", [1]), attempt=0))["seed"]
    again = orjson.loads(sampled._payload(Request("a", [1]), attempt=4))["seed"]
    other = orjson.loads(sampled._payload(Request("b", [1]), attempt=0))["seed"]
    assert one == again != other  # a retry draws as the first try did; samples differ


def test_an_answer_ending_on_eos_is_stored_with_it_as_every_engine_stores_it() -> None:
    eos = parse_completion("a", answer([7, EOS, 9], "stop", EOS), EOT, EOS)
    assert (eos.completion_ids, eos.finish_reason) == ([7, EOS], "stop")
    trimmed = parse_completion("a", answer([7], "stop", EOS), EOT, EOS)
    assert trimmed.completion_ids == [7, EOS] and trimmed.finish_reason == "stop"


def test_answers_are_read_as_ids_cut_after_the_end_of_turn() -> None:
    stop = parse_completion("a", answer([7, 8, EOT], "stop", EOT), EOT)
    assert (stop.completion_ids, stop.finish_reason, stop.error) == ([7, 8, EOT], "stop", None)
    # A version that leaves the matched stop token out still names it: it is put back.
    trimmed = parse_completion("a", answer([7, 8], "stop", EOT), EOT)
    assert trimmed.completion_ids == [7, 8, EOT] and trimmed.finish_reason == "stop"
    length = parse_completion("a", answer([7, 8, 9], "length"), EOT)
    assert length.finish_reason == "length" and length.completion_ids == [7, 8, 9]
    aborted = parse_completion("a", answer([7], "abort"), EOT)
    assert aborted.error and "abort" in aborted.error
    missing = parse_completion("a", answer(None, "stop"), EOT)
    assert missing.error and "token_ids" in missing.error


def test_launch_command_is_eager_fp32_and_serves_the_drafter_as_dflash(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 8}))
    from draftline.generation.server_launch import with_speculation

    model = with_speculation({"path": "models/x", "serving": {}}, drafter)
    cmd = vllm_server.server_command(PROFILE, model, port=31005, python="py")
    # vLLM's CPU build launches through its api_server (its `vllm serve` entry cannot find the
    # version of a package named `vllm`); a GPU node through `vllm serve` (cli.main).
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "models/x"]
    gpu = vllm_server.server_command({**PROFILE, "device": "cuda"}, model, python="py")
    assert gpu[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "models/x"]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=False))
    assert flags["--port"] == "31005"
    assert flags["--dtype"] == "float32" and "--enforce-eager" in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}
    plain = vllm_server.server_command(PROFILE, {"path": "models/x"}, python="py")
    assert "--speculative-config" not in plain
    env = vllm_server.server_env(PROFILE, model)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"


def test_a_target_whose_head_dim_vllm_cpu_cannot_run_is_refused_before_launch(
    tmp_path: Path, tiny_target_dir: Path
) -> None:
    with pytest.raises(ServeError, match="head_dim 16 is not one of 32, 64"):
        vllm_server.check_servable(PROFILE, {"path": str(tiny_target_dir)})
    config = json.loads((tiny_target_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_dim": 32}))
    vllm_server.check_servable(PROFILE, {"path": str(tmp_path)})  # servable: no error


def test_the_profile_composes_and_says_how_to_serve() -> None:
    text = yaml.safe_load((REPO / "conf/hardware/vllm_cpu.yaml").read_text())
    assert text["engine"] == "vllm" and text["device"] == "cpu"
    assert vllm_server.server_url(PROFILE) == "http://127.0.0.1:31000"


METRICS = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} %d
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 999
"""


def test_bench_reads_vllm_acceptance_from_its_counters() -> None:
    """A tiny HTTP server with vLLM's `/metrics` and `/v1/completions`: bench's acceptance
    length is 1 + accepted / drafts over the run (counters read before and after)."""
    counters = {"drafts": 10, "accepted": 5}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS % (counters["drafts"], counters["accepted"]))

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["return_token_ids"] and isinstance(body["prompt"], list)
        counters["drafts"] += 4  # four verify steps of this request
        counters["accepted"] += 8  # eight drafted tokens accepted
        return web.json_response({"usage": {"completion_tokens": 12}})

    async def main() -> bench.ServerRun:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", complete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                assert await bench.spec_counters(session, f"http://127.0.0.1:{port}") == {
                    "drafts": 10,
                    "accepted": 5,
                }
            return await bench._run(
                f"http://127.0.0.1:{port}",
                [[1, 2], [3, 4], [5]],
                completion_params(Sampling(16), EOT),
                2,
                "t",
                "vllm",
            )
        finally:
            await runner.cleanup()

    run = asyncio.run(main())
    assert run.verify_steps == 12 and run.accepted_tokens == 24 and run.completion_tokens == 36
    assert run.acceptance_length == pytest.approx(1 + 24 / 12)
