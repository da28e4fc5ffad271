"""The local (transformers) engine on a real tiny Qwen3 model, and the generate stage end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers.generate_helpers import build_random_target, conversations, make_workdir, run_generate

from draftline.core import target
from draftline.core.loss_mask import completion_stats, special_ids
from draftline.core.turn_prompts import regenerated_turns
from draftline.generation.engines.base import Request, Result, Sampling
from draftline.generation.engines.local import LocalEngine

pytestmark = pytest.mark.float_kernels

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    cfg = {"path": str(model_dir), "revision": None}
    tok = target.load_tokenizer(cfg)
    return cfg, tok, target.load_model(cfg)


def requests(tok, n: int) -> list[Request]:
    kwargs = {"enable_thinking": True}
    return [
        Request(f"{i:04d}", target.prompt_ids(tok, msgs, kwargs))
        for i, msgs in enumerate(conversations(n))
    ]


def collect(engine: LocalEngine, reqs: list[Request]) -> dict[str, Result]:
    out: dict[str, Result] = {}
    engine.generate(reqs, lambda r: out.__setitem__(r.id, r))
    return out


def test_every_request_gets_one_result_cut_at_end_of_turn(loaded):
    cfg, tok, lm = loaded
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    engine = LocalEngine(lm, Sampling(max_new_tokens=10), eot, tok.pad_token_id, batch_size=4)
    reqs = requests(tok, 10)
    out = collect(engine, reqs)
    assert sorted(out) == sorted(r.id for r in reqs)
    assert engine.calls == 3  # 10 prompts in batches of 4
    for r in out.values():
        assert r.finish_reason in ("stop", "length") and r.error is None
        if r.finish_reason == "length":
            assert len(r.completion_ids) == 10 and eot not in r.completion_ids
        else:
            assert r.completion_ids.index(eot) == len(r.completion_ids) - 1


def test_batched_and_padded_generation_matches_one_by_one(loaded):
    cfg, tok, lm = loaded
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    reqs = requests(tok, 6)  # different prompt lengths: left padding in the batch
    assert len({len(r.prompt_ids) for r in reqs}) > 1
    batched = collect(LocalEngine(lm, Sampling(8), eot, tok.pad_token_id, batch_size=6), reqs)
    single = collect(LocalEngine(lm, Sampling(8), eot, tok.pad_token_id, batch_size=1), reqs)
    assert {k: v.completion_ids for k, v in batched.items()} == {
        k: v.completion_ids for k, v in single.items()
    }


def test_stop_at_the_end_of_turn_token_keeps_it(loaded):
    cfg, tok, lm = loaded
    reqs = requests(tok, 3)
    probe = collect(LocalEngine(lm, Sampling(6), 10**6, tok.pad_token_id, batch_size=3), reqs)
    # Take a token the model writes as the "end of turn": generation must stop right after it.
    first = probe[reqs[0].id].completion_ids
    stop_token = first[2]
    out = collect(LocalEngine(lm, Sampling(6), stop_token, tok.pad_token_id, batch_size=3), reqs)
    r = out[reqs[0].id]
    cut = first[: first.index(stop_token) + 1]
    assert (
        r.finish_reason == "stop" and r.completion_ids == cut and r.completion_ids[-1] == stop_token
    )


def test_sampling_is_seeded(loaded):
    cfg, tok, lm = loaded
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    s = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    reqs = requests(tok, 4)
    a = collect(LocalEngine(lm, s, eot, tok.pad_token_id, batch_size=4), reqs)
    b = collect(LocalEngine(lm, s, eot, tok.pad_token_id, batch_size=4), reqs)
    assert {k: v.completion_ids for k, v in a.items()} == {
        k: v.completion_ids for k, v in b.items()
    }


def test_generate_stage_end_to_end_on_the_local_engine(tmp_path, model_dir):
    ids = make_workdir(tmp_path, model_dir, n=24, generate={"guard": False})
    proc = run_generate(tmp_path, "--shard", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids  # exactly the curated ids, sorted
    tok = target.load_tokenizer({"path": str(model_dir), "revision": None})
    special = special_ids(tok, "<|im_end|>")
    curated = {
        r["id"]: r
        for r in pq.read_table(tmp_path / "data/curated/train/shard-0.parquet").to_pylist()
    }
    kwargs = {"enable_thinking": True}
    for row in table:
        msgs = [dict(m) for m in curated[row["id"]]["messages"]]
        # The prompt of the last turn generated: the conversation up to it, each earlier answer
        # the target's own (where the row's history spans hold it), as the template renders it.
        history = msgs[: regenerated_turns(msgs)[row["turns"] - 1]]
        for (start, end), i in zip(row["history_spans"], regenerated_turns(msgs), strict=False):
            answer = tok.decode(row["prompt_ids"][start : end - 1], skip_special_tokens=False)
            history[i] = {"role": "assistant", "content": answer}
        if not row["history_spans"]:
            assert row["prompt_ids"] == target.prompt_ids(tok, history, kwargs)
        text = target.render_prompt(tok, history, kwargs)
        assert tok.decode(row["prompt_ids"], skip_special_tokens=False) == text
        assert row["num_prompt_tokens"] == len(row["prompt_ids"])
        assert row["num_completion_tokens"] == len(row["completion_ids"])
        # Every turn as the engine saw and wrote it: the last is the row's own sequence, the
        # first the conversation up to its first regenerated answer, rendered alone.
        assert len(row["turn_prompt_ids"]) == len(row["turn_completion_ids"]) == row["turns"]
        assert row["turn_prompt_ids"][-1] == row["prompt_ids"]
        assert row["turn_completion_ids"][-1] == row["completion_ids"]
        first = msgs[: regenerated_turns(msgs)[0]]
        assert row["turn_prompt_ids"][0] == target.prompt_ids(tok, first, kwargs)
        assert row["turn_prompt_tokens"] == [len(t) for t in row["turn_prompt_ids"]]
        assert row["turn_completion_tokens"] == [len(t) for t in row["turn_completion_ids"]]
        stats = completion_stats(row["completion_ids"], special)
        assert row["loss_mask_sum"] == stats.loss_mask_sum == len(row["completion_ids"])
        assert row["finish_reason"] in ("stop", "length")
        assert row["engine"].startswith("local:transformers-")
        assert json.loads(row["sampling"])["max_new_tokens"] == 12
    metrics = json.loads((tmp_path / "logs/runs/generate/shard-0.json").read_text())
    assert metrics["samples"] == 24 and metrics["errors"] == 0
    assert metrics["output_tokens"] == sum(r["num_completion_tokens"] for r in table)
    assert metrics["output_tok_s"] > 0 and metrics["hardware_profile"] == "cpu"
    # The journal stays until DVC records the table (`table_record.release_recorded`).
    assert (tmp_path / ".draftline/journal/generate/shard-0.jsonl").exists()
    throughput = json.loads((tmp_path / "reports/throughput.json").read_text())
    assert (
        throughput["generate"]["tokens_per_s"] > 0 and not (tmp_path / "metrics/generate").exists()
    )
    # The eval split goes through the same runner.
    proc = run_generate(tmp_path, "--eval")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pq.read_table(tmp_path / "data/generated/eval.parquet").num_rows == 6


def test_the_models_eos_ends_a_turn_as_the_end_of_turn_does(loaded):
    """One stop rule on every engine: the end-of-turn token or the model's EOS, kept in the
    ids (the SGLang stand-in and the vLLM client's tests hold the others to the same)."""
    cfg, tok, lm = loaded
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    reqs = requests(tok, 3)
    probe = collect(LocalEngine(lm, Sampling(6), 10**6, tok.pad_token_id, batch_size=3), reqs)
    first = probe[reqs[0].id].completion_ids
    eos = first[2]  # a token the model writes, taken as its EOS
    engine = LocalEngine(lm, Sampling(6), eot, tok.pad_token_id, batch_size=3, eos=eos)
    assert engine.stop_ids == [eot, eos]
    r = collect(engine, reqs)[reqs[0].id]
    assert r.finish_reason == "stop" and r.completion_ids == first[: first.index(eos) + 1]


def test_a_turn_capped_by_the_context_stops_at_its_cap_with_the_same_tokens(loaded):
    """A request's own cap (what its prompt leaves of the context) cuts it there, in a batch
    with uncapped requests: the first tokens are those of the uncapped run."""
    cfg, tok, lm = loaded
    reqs = requests(tok, 3)
    free = collect(LocalEngine(lm, Sampling(8), 10**6, tok.pad_token_id, batch_size=3), reqs)
    capped = [reqs[0], Request(reqs[1].id, reqs[1].prompt_ids, max_new_tokens=3), reqs[2]]
    out = collect(LocalEngine(lm, Sampling(8), 10**6, tok.pad_token_id, batch_size=3), capped)
    assert out[reqs[1].id].completion_ids == free[reqs[1].id].completion_ids[:3]
    assert out[reqs[1].id].finish_reason == "length"
    assert out[reqs[0].id].completion_ids == free[reqs[0].id].completion_ids  # untouched
