"""The multi-turn checks (draftline.quality.turns): every turn of a regenerated conversation and
whether it was written to its end, with pandas and the real Great Expectations suite, and through
the `validate` stage over shards that carry the turn columns (docs/pipeline.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers.generated_samples import (
    mixed_modes,
    samples_frame,
    truncated,
    write_generated,
)
from helpers.validate_stage import NUM_SHARDS, run_stage

from draftline.generation.guard import Guard
from draftline.quality import checks, shards, validation
from draftline.quality.check_parts import CheckResult

TURN_CHECKS = {"turn_supervised_tokens_min", "turn_answer_nonempty", "conversation_complete"}
EARLIER_SUPERVISED = 40  # supervised tokens of each earlier turn (healthy)
EARLIER_ANSWER = 12  # answer tokens of each earlier turn (healthy)


@pytest.fixture(scope="module")
def default_quality(repo_root):
    return yaml.safe_load((repo_root / "conf" / "quality" / "default.yaml").read_text())


def multi_turn(
    frame: pd.DataFrame, share: float = 0.5, turns: int = 3, *, empty_middle: bool = False
) -> pd.DataFrame:
    """`frame` with its first `share` of rows as conversations of `turns` assistant turns: the
    row's scalar columns are the last turn, the earlier ones healthy, or with `empty_middle` every
    turn between the first and the last answered empty. The other rows stay one-turn."""
    out = frame.copy()
    count = np.where(np.arange(len(out)) < round(share * len(out)), turns, 1)
    middle = 0 if empty_middle else EARLIER_ANSWER
    out["turns"] = count.astype(np.int32)
    out["turn_finish_reasons"] = [
        ["stop"] * (k - 1) + [reason] for k, reason in zip(count, out["finish_reason"], strict=True)
    ]
    out["turn_loss_mask_sums"] = [
        [EARLIER_SUPERVISED] * (k - 1) + [int(v)]
        for k, v in zip(count, out["loss_mask_sum"], strict=True)
    ]
    out["turn_answer_tokens"] = [
        ([EARLIER_ANSWER] + [middle] * (k - 2) if k > 1 else []) + [int(v)]
        for k, v in zip(count, out["answer_tokens"], strict=True)
    ]
    return out


def results_by_name(table, quality_cfg, thinking=True):
    return {r.name: r for r in checks.run_checks(table, quality_cfg, thinking=thinking)}


def failed_names(table, quality_cfg, **kwargs):
    return {n for n, r in results_by_name(table, quality_cfg, **kwargs).items() if not r.passed}


def assert_gx_agrees(table, quality_cfg, report_dir: Path) -> dict[str, CheckResult]:
    """Run the real GX suites on `table`: every check has GX's verdict and observed value equal
    to pandas'. Returns the GX side by name."""
    frame = table.drop(columns=["completion_ids"])
    outcome = validation.run_suite(
        frame, quality_cfg, thinking=True, expected_rows=len(frame), report_dir=report_dir
    )
    measured = checks.run_checks(frame, quality_cfg, thinking=True, expected_rows=len(frame))
    assert [r.name for r in outcome.results] == [r.name for r in measured]
    for gx_side, pandas_side in zip(outcome.results, measured, strict=True):
        assert gx_side.passed == pandas_side.passed, gx_side.name
        assert gx_side.observed == pytest.approx(pandas_side.observed), gx_side.name
    # Every multi-turn check ran as a GX expectation (none judged by pandas alone).
    runs = json.loads(outcome.results_path.read_text())["great_expectations"]
    expectations = [e for run in runs for e in run["validation_result"]["results"]]
    judged = {n for e in expectations for n in e["expectation_config"]["meta"]["checks"]}
    assert {r.name for r in measured} == judged
    return {r.name: r for r in outcome.results}


def test_healthy_multi_turn_rows_pass_every_check(default_quality):
    table = multi_turn(samples_frame(400))
    results = results_by_name(table, default_quality)
    assert set(results) >= TURN_CHECKS
    assert all(r.passed for r in results.values()), checks.summarize(list(results.values()))
    assert results["conversation_complete"].observed == 1.0
    assert results["turn_answer_nonempty"].observed == 1.0
    frames = checks.frames(table, thinking=True)
    assert len(frames["conversations"]) == 200 and len(frames["turns"]) == 600
    first = frames["turns"][frames["turns"]["id"] == table["id"].iloc[0]]
    assert list(first["turn_index"]) == [0, 1, 2]
    assert list(first["turn_loss_mask_sum"]) == [40, 40, int(table["loss_mask_sum"].iloc[0])]


def test_single_turn_tables_have_no_multi_turn_checks(default_quality):
    plain = samples_frame(200)  # no turn columns: a guard window, or an older table
    one_turn = multi_turn(plain, share=0.0)  # regenerate_turns: last, or one-turn data
    old_shards = plain.assign(
        turns=None, turn_finish_reasons=None, turn_loss_mask_sums=None, turn_answer_tokens=None
    )  # read from shards written before multi-turn generation
    for table in (plain, one_turn, old_shards):
        results = results_by_name(table, default_quality)
        assert not {n for n in results if n.startswith(("turn_", "conversation_"))}
        assert all(r.passed for r in results.values())
    # Multi-turn rows that all failed (error rows) are not answered: nothing to judge per turn.
    errors = multi_turn(plain).assign(finish_reason="error")
    assert not TURN_CHECKS & set(results_by_name(errors, default_quality))


def test_the_guard_window_of_turn_rows_runs_the_checks(default_quality):
    """The guard sees one row per turn, without the turn columns: its checks run as before."""
    guard = Guard(default_quality, thinking=True, max_new_tokens=96, check_every=1)
    for row in samples_frame(80).to_dict("records"):
        guard.observe(row)  # would raise GuardAbort on a failed check
    assert guard.seen == 80


def test_empty_middle_turns_fail_turn_answer_nonempty_in_pandas_and_gx(default_quality, tmp_path):
    """The seed's pathology mid-conversation: every last turn is healthy (the scalar checks pass)
    but one turn in three of the 3-turn conversations answered nothing."""
    table = multi_turn(samples_frame(300), share=0.5, empty_middle=True)
    results = results_by_name(table, default_quality)
    assert {n for n, r in results.items() if not r.passed} == {"turn_answer_nonempty"}
    assert results["turn_answer_nonempty"].observed == pytest.approx(300 / 450)
    assert "turn_answer_nonempty" in checks.summarize(list(results.values()))
    gx = assert_gx_agrees(table, default_quality, tmp_path)
    assert not gx["turn_answer_nonempty"].passed
    assert gx["turn_answer_nonempty"].observed == pytest.approx(300 / 450)


def test_cut_conversations_fail_conversation_complete(default_quality, tmp_path):
    """10 of 100 three-turn conversations end with a turn cut at max_new_tokens: too few to fail
    the truncation bound over all 300 rows, but a tenth of the conversations are cut short."""
    table = multi_turn(truncated(samples_frame(300), share=10 / 300), share=1 / 3)
    results = results_by_name(table, default_quality)
    assert {n for n, r in results.items() if not r.passed} == {"conversation_complete"}
    assert results["conversation_complete"].observed == pytest.approx(0.9)
    assert results["truncated_share"].passed
    gx = assert_gx_agrees(table, default_quality, tmp_path)
    assert not gx["conversation_complete"].passed
    assert gx["conversation_complete"].observed == pytest.approx(0.9)


def test_a_thinking_mix_holds_each_mode_of_turns_to_its_own_bound(default_quality, tmp_path):
    """Turns generated with thinking off are short: in a mix they fail their own check
    (`turn_supervised_tokens_min_no_thinking`) until `no_thinking_min_supervised_tokens` allows
    them, and the thinking turns keep theirs."""
    table = multi_turn(mixed_modes(samples_frame(300), share_off=0.5), share=1.0)
    off = table["thinking"] == False  # noqa: E712
    table.loc[off, "turn_loss_mask_sums"] = pd.Series(
        [[10] * (len(v) - 1) + [v[-1]] for v in table.loc[off, "turn_loss_mask_sums"]],
        index=table.index[off],
    )
    failed = failed_names(table, default_quality)
    assert failed == {"turn_supervised_tokens_min_no_thinking"}
    bounded = {**default_quality, "no_thinking_min_supervised_tokens": 8}
    gx = assert_gx_agrees(table, bounded, tmp_path)
    assert {"turn_supervised_tokens_min", "turn_supervised_tokens_min_no_thinking"} <= set(gx)
    assert all(r.passed for r in gx.values()), checks.summarize(list(gx.values()))


def write_turn_columns(root: Path, frame: pd.DataFrame) -> None:
    """Add the turn columns of `frame` to the generated shards write_generated wrote."""
    by_id = frame.set_index("id")
    types = {
        "turns": pa.int32(),
        "turn_finish_reasons": pa.list_(pa.string()),
        "turn_loss_mask_sums": pa.list_(pa.int32()),
        "turn_answer_tokens": pa.list_(pa.int32()),
    }
    for path in sorted((root / "data" / "generated" / "train").glob("shard-*.parquet")):
        table = pq.read_table(path)
        rows = by_id.loc[table.column("id").to_pylist()]
        for name, dtype in types.items():
            table = table.append_column(name, pa.array(list(rows[name]), dtype))
        pq.write_table(table, path)


def test_validate_reads_the_turn_columns_and_runs_their_suites(workdir):
    frame = multi_turn(samples_frame(300), share=0.5)
    write_generated(workdir, frame, NUM_SHARDS)
    write_turn_columns(workdir, frame)
    rc, summary = run_stage(workdir)
    assert rc == 0, summary["failed_checks"]
    assert set(summary["checks"]) >= TURN_CHECKS
    assert (summary["num_multi_turn"], summary["num_multi_turn_turns"]) == (150, 450)
    gx_runs = json.loads((workdir / "reports/validate/results.json").read_text())
    assert {run["suite"] for run in gx_runs["great_expectations"]} == {
        validation.SUITES[rows] for rows in ("all", "answered", "turns", "conversations")
    }
    verdict = json.loads((workdir / "data/validated/verdict.json").read_text())
    assert set(verdict["checks"]) >= TURN_CHECKS


def test_validate_fails_empty_middle_turns_naming_the_check(workdir):
    frame = multi_turn(samples_frame(300), share=0.5, empty_middle=True)
    write_generated(workdir, frame, NUM_SHARDS)
    write_turn_columns(workdir, frame)
    rc, summary = run_stage(workdir)
    assert rc == 1
    assert summary["failed_checks"] == ["turn_answer_nonempty"]
    assert summary["checks"]["turn_answer_nonempty"]["observed"] == pytest.approx(300 / 450)
    assert not (workdir / "data/validated/verdict.json").exists()


def test_shards_without_turn_columns_read_as_null(workdir):
    write_generated(workdir, samples_frame(300), NUM_SHARDS)
    paths = shards.shard_paths(Path("data/generated/train"), list(range(NUM_SHARDS)))
    table = shards.read_scalar_columns(paths, progress=False)
    assert table["turns"].isna().all() and table["turn_answer_tokens"].isna().all()
    rc, summary = run_stage(workdir)
    assert rc == 0, summary["failed_checks"]
    assert not TURN_CHECKS & set(summary["checks"]) and summary["num_multi_turn"] == 0
