"""Evaluate by context length: the held-out prompts (every generated turn of a conversation,
or the row's last-turn prompt in tables without per-turn prompts), the context-length bucket
edges, and tau per bucket in the stage's report."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from helpers.evaluation_helpers import LAYER_IDS, MASK_ID, B, make_drafter, save_word_tokenizer
from helpers.tiny_qwen3 import END_OF_TURN, VOCAB, tiny_qwen3

from draftline.drafter.evaluation import Cycle, TauReport, evaluate_drafter, target_logits
from draftline.drafter.features import target_layer_states
from draftline.stages.evaluate import (
    bucket_lines,
    held_out_rows,
    length_edges,
    tau_by_context_length,
)

OLD_SCHEMA = pa.schema(
    [("id", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("thinking", pa.bool_())]
)
TURN_SCHEMA = OLD_SCHEMA.append(pa.field("turn_finish_reasons", pa.list_(pa.string()))).append(
    pa.field("turn_prompt_ids", pa.list_(pa.list_(pa.int32())))
)


def write_table(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_edges_are_the_terciles_of_the_prompt_lengths():
    lengths = list(range(1, 10))
    assert length_edges(lengths) == [4, 7]  # short 1-3, medium 4-6, long 7-9
    random.Random(0).shuffle(lengths)
    assert length_edges(lengths) == [4, 7]  # the same prompts in any order: the same edges
    assert length_edges([10, 20, 30, 40, 50, 60]) == [30, 50]


def test_few_prompts_or_lengths_give_fewer_buckets():
    assert length_edges([3, 8, 1, 9, 4]) == [8]  # under 6 prompts: the median alone
    assert length_edges([1, 2, 3]) == []  # under 4: one bucket
    assert length_edges([5, 5, 5, 5, 9, 9]) == [9]  # two distinct lengths: two buckets
    assert length_edges([7] * 10) == []


def cycles(*committed: int) -> list[Cycle]:
    return [Cycle(committed=c, accepted=c - 1, verifiable=7) for c in committed]


def test_tau_per_bucket_is_the_tau_of_its_prompts():
    per_prompt = [cycles(4), cycles(1, 3), cycles(8), cycles(2), cycles(6, 6), cycles(1)]
    sampled = [[3.0], [1.0], [5.0], [2.0], [4.0], [1.0]]
    lengths = [10, 500, 40, 90, 700, 12]  # short: 10, 12; medium: 40, 90; long: 500, 700
    report = TauReport(8, per_prompt, sampled)
    by_length = tau_by_context_length(report, lengths)
    assert by_length["edges"] == [40, 500]
    buckets = by_length["buckets"]
    assert list(buckets) == ["short", "medium", "long"]
    assert buckets["short"] == {
        "num_prompts": 2, "min_prompt_tokens": 10, "max_prompt_tokens": 12,
        "tau": report.subset([0, 5]).tau, "tau_sampled": report.subset([0, 5]).tau_sampled,
    }  # fmt: skip
    assert buckets["medium"]["tau"] == report.subset([2, 3]).tau == 5.0
    assert buckets["long"]["tau"] == report.subset([1, 4]).tau == 4.0
    assert buckets["long"]["max_prompt_tokens"] == 700
    # Without sampled figures, no tau_sampled; one line per bucket for the stage's output.
    greedy = tau_by_context_length(TauReport(8, per_prompt), lengths)
    assert all("tau_sampled" not in b for b in greedy["buckets"].values())
    lines = bucket_lines(by_length)
    assert len(lines) == 3 and lines[2].startswith("tau at long context (500-700 prompt tokens")


def test_a_table_without_turn_prompts_gives_each_rows_last_turn_prompt(tmp_path):
    rows = [
        {"id": "c", "prompt_ids": [7, 8], "thinking": True},
        {"id": "a", "prompt_ids": [1, 2, 3], "thinking": False},
        {"id": "b", "prompt_ids": [], "thinking": False},  # no prompt: left out
        {"id": "d", "prompt_ids": [9], "thinking": True},
    ]
    path = write_table(tmp_path / "eval.parquet", rows, OLD_SCHEMA)
    held = held_out_rows(path, 2)
    assert [(r["id"], r["prompt_ids"], r["thinking"]) for r in held] == [
        ("a", [1, 2, 3], False),
        ("c", [7, 8], True),
    ]
    assert all(r["source"] is None for r in held)


def test_every_turn_is_a_prompt_whole_conversations_first(tmp_path):
    rows = [
        {"id": "b", "prompt_ids": [5, 6, 7, 8], "thinking": True,
         "turn_finish_reasons": ["stop", "stop", "error"],
         "turn_prompt_ids": [[5], [5, 6, 7], [5, 6, 7, 8]]},
        {"id": "a", "prompt_ids": [1, 2, 3, 4], "thinking": False,
         "turn_finish_reasons": ["stop", "length"],
         "turn_prompt_ids": [[1, 2], [1, 2, 3, 4]]},
        # A row from a shard written before per-turn prompts: its last turn's prompt.
        {"id": "c", "prompt_ids": [9, 9], "thinking": False,
         "turn_finish_reasons": None, "turn_prompt_ids": None},
    ]  # fmt: skip
    path = write_table(tmp_path / "eval.parquet", rows, TURN_SCHEMA)
    curated = tmp_path / "curated.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "source": ["x.jsonl", "y.jsonl", "x.jsonl"]}),
                   curated)  # fmt: skip
    held = held_out_rows(path, 10, curated)
    # Turn k of conversation a is `a#k`; b's failed turn is left out.
    assert [(r["id"], r["prompt_ids"]) for r in held] == [
        ("a#0", [1, 2]), ("a#1", [1, 2, 3, 4]), ("b#0", [5]), ("b#1", [5, 6, 7]), ("c", [9, 9]),
    ]  # fmt: skip
    assert [r["thinking"] for r in held] == [False, False, True, True, False]
    assert [r["source"] for r in held] == ["x.jsonl", "x.jsonl", "y.jsonl", "y.jsonl", "x.jsonl"]
    # The cap keeps later turns: whole conversations in id order, the same on every read.
    assert [r["id"] for r in held_out_rows(path, 3)] == ["a#0", "a#1", "b#0"]
    assert held_out_rows(path, 3) == held_out_rows(path, 3)


@pytest.mark.float_kernels
def test_evaluate_stage_reports_tau_per_context_length(tmp_path, capsys):
    from draftline.cli import main
    from draftline.drafter.export import export_drafter

    target = tiny_qwen3(num_layers=6)
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    save_word_tokenizer(target_dir)
    g = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()

    # Three conversations; each turn's prompt holds the turns before it.
    rows = []
    for name, sizes in (("a", (4, 5, 5)), ("b", (5, 5)), ("c", (6, 6))):
        turns = [tokens(n) for n in sizes]
        prompts = [sum(turns[: k + 1], []) for k in range(len(turns))]
        rows.append(
            {
                "id": name,
                "prompt_ids": prompts[-1],
                "thinking": False,
                "turn_finish_reasons": ["stop"] * len(prompts),
                "turn_prompt_ids": prompts,
            }
        )
    eval_file = write_table(tmp_path / "eval.parquet", rows, TURN_SCHEMA)
    export_drafter(make_drafter(target, seed=1), tmp_path / "drafter")
    params = {
        "model": {"path": str(target_dir), "revision": None, "target_layer_ids": LAYER_IDS,
                  "mask_token": "<|MASK|>", "mask_token_id": MASK_ID,
                  "end_of_turn_token": "<|im_end|>"},
        "drafter": {"num_hidden_layers": 2, "block_size": B, "gamma": 4.0, "max_anchors": 8,
                    "global_batch_size": 2, "lr": 1e-3, "weight_decay": 0.0,
                    "warmup_ratio": 0.0, "epochs": 1, "grad_clip": 1.0, "seed": 0},
        "evaluate": {"max_new_tokens": 8, "max_prompts": 6, "temperature": 0.0},
        "hardware": {"name": "cpu", "engine": "local", "device": "cpu", "precision": "fp32",
                     "local": {"batch_size": 4}, "extract_tokens_per_batch": 64},
    }  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    code = main([
        "evaluate", f"--params={tmp_path / 'params.yaml'}", f"--eval={eval_file}",
        f"--drafter={tmp_path / 'drafter'}", f"--metrics={tmp_path / 'metrics.json'}",
        f"--plots={tmp_path / 'plots'}", f"--run-log={tmp_path / 'run.json'}",
        f"--report={tmp_path / 'report.json'}",
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    # The 6 prompts (a: 4, 9, 14 tokens; b: 5, 10; c: 6, the cap) in three buckets of two.
    assert report["num_prompts"] == 6
    by_length = report["tau_by_context_length"]
    assert by_length["edges"] == [6, 10]
    assert [b["num_prompts"] for b in by_length["buckets"].values()] == [2, 2, 2]
    assert "tau_by_context_length" not in json.loads((tmp_path / "metrics.json").read_text())
    # The long bucket's tau is the trained drafter's on those two prompts alone.
    from draftline.core.continuation import greedy_continuations

    long_prompts = [rows[0]["turn_prompt_ids"][2], rows[1]["turn_prompt_ids"][1]]
    conts = greedy_continuations(target, long_prompts, 8, END_OF_TURN, batch_size=1)
    seqs = [(p + c, len(p)) for p, c in zip(long_prompts, conts, strict=True)]
    feats = [
        target_layer_states(target, torch.tensor([s]), LAYER_IDS)[0].to(torch.bfloat16)
        for s, _ in seqs
    ]
    logits = [target_logits(target, s, start) for s, start in seqs]
    alone = evaluate_drafter(make_drafter(target, seed=1), seqs, feats, logits)
    assert by_length["buckets"]["long"]["tau"] == pytest.approx(alone.tau)
    out = capsys.readouterr().out
    assert out.count("evaluate: tau at ") == 3 and "long context (10-14 prompt tokens" in out
