"""The yield gate: supervised tokens of the training sequences over every token generated, judged
by the real GX suite in the `validate` stage before anything is extracted. Multi-turn thinking
conversations whose earlier turns wrote long reasoning pass it with one sequence per turn and
fail it with one sequence per conversation (the reasoning of earlier turns never trained on)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers.generated_samples import samples_frame, write_generated
from helpers.validate_stage import NUM_SHARDS, run_stage

REASONING = 400  # tokens each earlier turn wrote (reasoning and answer)
SHOWN = 12  # of them, what the next prompt shows as history (the answer: no reasoning)


def write_multi_turn(root: Path) -> None:
    """Every row a 3-turn conversation; its scalar columns are the last turn."""
    frame = samples_frame(300)
    write_generated(root, frame, NUM_SHARDS)
    for path in sorted((root / "data/generated/train").glob("shard-*.parquet")):
        table = pq.read_table(path)
        last = table.column("num_completion_tokens").to_pylist()
        prompt = table.column("num_prompt_tokens").to_pylist()
        reasons = table.column("finish_reason").to_pylist()
        masks = table.column("loss_mask_sum").to_pylist()
        answers = table.column("answer_tokens").to_pylist()
        columns = {
            "turn_loss_mask_sums": (
                [[REASONING, REASONING, m] for m in masks],
                pa.list_(pa.int32()),
            ),
            "turn_answer_tokens": ([[SHOWN, SHOWN, a] for a in answers], pa.list_(pa.int32())),
            "turns": ([3] * len(last), pa.int32()),
            "turn_finish_reasons": ([["stop", "stop", r] for r in reasons], pa.list_(pa.string())),
            "turn_prompt_tokens": (
                [[p - 2 * SHOWN, p - SHOWN, p] for p in prompt],
                pa.list_(pa.int32()),
            ),
            "turn_completion_tokens": (
                [[REASONING, REASONING, n] for n in last],
                pa.list_(pa.int32()),
            ),
            "history_spans": (
                [[[0, SHOWN], [SHOWN, 2 * SHOWN]] for _ in last],
                pa.list_(pa.list_(pa.int32())),
            ),
        }
        for name, (values, dtype) in columns.items():
            table = table.append_column(name, pa.array(values, dtype))
        pq.write_table(table, path)


def with_rows(root: Path, rows: str, max_length: int = 8192) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["extract"] = {"rows": rows, "max_length": max_length}
    (root / "params.yaml").write_text(yaml.safe_dump(params))


def test_per_turn_rows_keep_every_generated_token_and_pass(workdir):
    write_multi_turn(workdir)
    with_rows(workdir, "turn")
    rc, summary = run_stage(workdir)
    assert rc == 0, summary["failed_checks"]
    assert summary["checks"]["yield"] == {"observed": 1.0, "passed": True}
    assert summary["yield"] == 1.0
    assert summary["generated_tokens_total"] == summary["supervised_tokens_total"]


def test_conversation_rows_lose_earlier_reasoning_and_fail_naming_the_yield(workdir):
    write_multi_turn(workdir)
    with_rows(workdir, "conversation")
    rc, summary = run_stage(workdir)
    assert rc == 1 and summary["failed_checks"] == ["yield"]
    generated, supervised = summary["generated_tokens_total"], summary["supervised_tokens_total"]
    assert supervised < 0.5 * generated
    assert summary["checks"]["yield"]["observed"] == pytest.approx(supervised / generated)
    # GX measured the same ratio as pandas (it reads the sum of untrained tokens).
    gx = json.loads((workdir / "reports/validate/results.json").read_text())
    [check] = [c for c in gx["checks"] if c["name"] == "yield"]
    assert check["observed"] == pytest.approx(supervised / generated)
    assert not (workdir / "data/validated/verdict.json").exists()


def test_cuts_to_max_length_count_against_the_yield(workdir):
    write_multi_turn(workdir)
    with_rows(workdir, "turn", max_length=256)  # every 400-token turn loses its end
    rc, summary = run_stage(workdir)
    assert rc == 1 and "yield" in summary["failed_checks"]
    assert summary["sequence_tokens_max"] > 256  # what max_length would have to hold
