"""The quality checks (draftline.quality.checks) on pandas tables: the definitions the online guard
and the validate stage share. The GX side is tested in tests/stages/test_validate.py."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import yaml
from helpers.generated_samples import (
    failed_requests,
    mixed_modes,
    samples_frame,
    seed_pathology,
    truncated,
)

from draftline.quality import checks
from draftline.runtime import params


@pytest.fixture(scope="module")
def default_quality(repo_root):
    return yaml.safe_load((repo_root / "conf" / "quality" / "default.yaml").read_text())


def results_by_name(table, quality_cfg, thinking=True, expected_rows=None):
    results = checks.run_checks(table, quality_cfg, thinking=thinking, expected_rows=expected_rows)
    return {r.name: r for r in results}


def failed_names(table, quality_cfg, **kwargs):
    return {n for n, r in results_by_name(table, quality_cfg, **kwargs).items() if not r.passed}


def test_healthy_table_passes_every_check(default_quality):
    table = samples_frame(400)
    results = results_by_name(table, default_quality, expected_rows=400)
    assert set(results) == {
        "row_count",
        "unique_ids",
        "error_share",
        "supervised_tokens_min",
        "supervised_tokens_mode_share",
        "unique_completions",
        "truncated_share",
        "think_block_share",
        "answer_share",
        "completion_tokens_q10",
        "completion_tokens_q50",
        "completion_tokens_q90",
    }
    assert all(r.passed for r in results.values()), checks.summarize(list(results.values()))
    assert results["supervised_tokens_min"].observed == 1.0
    assert results["row_count"].observed == 400


def test_seed_pathology_fails_on_supervised_tokens(default_quality):
    table = seed_pathology(samples_frame(400), share=0.87)
    results = results_by_name(table, default_quality)
    failed = {n for n, r in results.items() if not r.passed}
    assert {"supervised_tokens_min", "supervised_tokens_mode_share"} <= failed
    assert results["supervised_tokens_mode_share"].observed == pytest.approx(0.87, abs=0.005)
    assert "(6)" in results["supervised_tokens_mode_share"].description
    assert results["supervised_tokens_min"].observed == pytest.approx(0.13, abs=0.005)
    # 87% identical "OK." answers: far from unique.
    assert "unique_completions" in failed
    text = checks.summarize(list(results.values()))
    assert "supervised_tokens_min" in text and ">= 0.90 of answered samples" in text


def test_mode_share_alone_catches_a_spike_above_the_minimum(default_quality):
    # Every sample has >= 16 supervised tokens, but 30% have exactly 20: a template artefact.
    table = samples_frame(400)
    table.loc[table.index[:120], "loss_mask_sum"] = 20
    assert failed_names(table, default_quality) == {"supervised_tokens_mode_share"}


def test_truncation_heavy_data_fails(default_quality):
    table = truncated(samples_frame(400), share=0.3)
    results = results_by_name(table, default_quality)
    assert not results["truncated_share"].passed
    assert results["truncated_share"].observed == pytest.approx(0.3)
    # Cut off mid-thought: no closing think block, no answer.
    assert not results["think_block_share"].passed
    assert not results["answer_share"].passed


def test_little_truncation_passes(default_quality):
    table = truncated(samples_frame(400), share=0.02)
    assert failed_names(table, default_quality) == set()


def test_duplicate_ids_fail(default_quality):
    table = samples_frame(400)
    table.loc[table.index[:3], "id"] = table["id"].iloc[3:6].to_numpy()
    results = results_by_name(table, default_quality)
    assert not results["unique_ids"].passed
    assert results["unique_ids"].observed == 6  # every row of a repeated id counts


def test_missing_rows_fail_the_row_count(default_quality):
    table = samples_frame(400).iloc[:-3]
    results = results_by_name(table, default_quality, expected_rows=400)
    assert not results["row_count"].passed
    assert results["row_count"].observed == 397
    assert "400" in results["row_count"].bound
    # Without an expected count (the online guard), there is no row-count check.
    assert "row_count" not in results_by_name(table, default_quality)


def test_error_rows_count_once_against_the_error_bound(default_quality):
    table = failed_requests(samples_frame(400), share=0.05)
    results = results_by_name(table, default_quality, expected_rows=400)
    assert not results["error_share"].passed
    assert results["error_share"].observed == pytest.approx(0.05)
    # The completion checks judge answered rows only: the empty error rows do not count there.
    assert results["supervised_tokens_min"].observed == 1.0
    assert results["row_count"].passed  # error rows stay in the table: nothing is lost
    small = failed_requests(samples_frame(400), share=0.005)
    assert failed_names(small, default_quality, expected_rows=400) == set()


def test_think_block_is_checked_only_with_thinking_on(default_quality):
    table = samples_frame(400)
    table["has_think_block"] = False
    assert failed_names(table, default_quality, thinking=True) == {"think_block_share"}
    results = results_by_name(table, default_quality, thinking=False)
    assert "think_block_share" not in results
    assert all(r.passed for r in results.values())


def test_empty_answers_fail(default_quality):
    table = samples_frame(400)
    table.loc[table.index[:100], "answer_tokens"] = 0
    result = results_by_name(table, default_quality)["answer_share"]
    assert not result.passed and result.observed == pytest.approx(0.75)
    assert "after </think>" in result.description


def test_repeated_completions_fail(default_quality):
    table = samples_frame(400)
    table.loc[table.index[:200], "completion_hash"] = "0" * 16
    result = results_by_name(table, default_quality)["unique_completions"]
    assert not result.passed
    assert result.observed == pytest.approx(201 / 400)


def test_completion_length_quantiles_use_nearest_rank(default_quality):
    table = samples_frame(10)
    table["num_completion_tokens"] = np.arange(1, 11)
    table["loss_mask_sum"] = 100  # keep the other checks out of the way
    results = results_by_name(table, default_quality)
    # pandas "nearest", as GX computes it: q10 of 1..10 is the value at position 0.9 -> 2.
    assert results["completion_tokens_q10"].observed == 2
    assert not results["completion_tokens_q10"].passed  # below the default 8
    assert results["completion_tokens_q50"].observed == 5
    assert not results["completion_tokens_q50"].passed  # below the default 16


def test_no_answered_rows_fail_with_nothing_to_measure(default_quality):
    table = failed_requests(samples_frame(50), share=1.0)
    results = results_by_name(table, default_quality)
    assert results["supervised_tokens_min"].observed is None
    assert not results["supervised_tokens_min"].passed
    assert "nothing to measure" in checks.summarize(list(results.values()))


def test_thresholds_come_from_the_config(default_quality):
    table = samples_frame(400)
    stricter = default_quality | {"min_supervised_tokens": 60}
    assert "supervised_tokens_min" in failed_names(table, stricter)
    without = {k: v for k, v in default_quality.items() if k != "max_mode_share"}
    with pytest.raises(KeyError, match="quality.max_mode_share"):
        checks.run_checks(table, without, thinking=True)
    with pytest.raises(ValueError, match="between 0 and 1"):
        checks.run_checks(table, default_quality | {"max_error_share": 5}, thinking=True)


def test_missing_columns_name_the_contract(default_quality):
    table = samples_frame(20).drop(columns=["completion_hash"])
    with pytest.raises(ValueError, match="completion_hash.*docs/pipeline.md"):
        checks.run_checks(table, default_quality, thinking=True)


def test_per_model_overrides_merge_over_the_quality_file(repo_root):
    conf = repo_root / "conf"
    tiny = params.compose([], conf)
    big = params.compose(["model=qwen3_6_27b"], conf)
    override = yaml.safe_load((conf / "quality" / "model" / "qwen3_6_27b.yaml").read_text())
    assert big["quality"]["min_supervised_tokens"] == override["min_supervised_tokens"]
    assert big["quality"]["min_supervised_tokens"] != tiny["quality"]["min_supervised_tokens"]
    # Keys the model file does not set keep the quality file's value.
    default = yaml.safe_load((conf / "quality" / "default.yaml").read_text())
    assert big["quality"]["max_mode_share"] == default["max_mode_share"]
    # The tiny target has its own file too.
    tiny_override = yaml.safe_load((conf / "quality" / "model" / "tiny.yaml").read_text())
    assert tiny["quality"]["max_mode_share"] == tiny_override["max_mode_share"]
    # A command-line override wins over both.
    cli = params.compose(["model=qwen3_6_27b", "quality.min_supervised_tokens=3"], conf)
    assert cli["quality"]["min_supervised_tokens"] == 3


def test_completion_hash_is_sha256_of_int32_ids():
    ids = [151644, 77091, 198, 2]
    expected = hashlib.sha256(np.array(ids, dtype="<i4").tobytes()).hexdigest()[:16]
    assert checks.completion_hash(ids) == expected
    assert checks.completion_hash(np.array(ids, dtype=np.int64)) == expected
    assert checks.completion_hash(ids[:-1]) != expected


def test_thinking_enabled_reads_the_model_template_kwargs():
    assert checks.thinking_enabled({"model": {"chat_template_kwargs": {"enable_thinking": True}}})
    assert not checks.thinking_enabled({"model": {"chat_template_kwargs": {}}})
    assert not checks.thinking_enabled({"model": {}})


def test_a_thinking_mix_holds_each_mode_to_its_own_checks(default_quality):
    """Rows generated with thinking off have no think block, and that is right for them: the
    think-block check judges the thinking rows only, and completion lengths are checked per
    mode (the non-thinking rows' checks carry the suffix)."""
    table = mixed_modes(samples_frame(400))
    results = results_by_name(table, default_quality)
    assert all(r.passed for r in results.values()), checks.summarize(list(results.values()))
    assert results["think_block_share"].observed == 1.0  # over the 240 thinking rows
    assert {"completion_tokens_q50", "completion_tokens_q50_no_thinking"} <= set(results)
    # Without the column the same rows would fail: 40% have no think block.
    assert "think_block_share" in failed_names(table.drop(columns="thinking"), default_quality)


def test_the_seed_pathology_in_the_non_thinking_rows_fails_their_own_checks(default_quality):
    table = mixed_modes(samples_frame(400), share_off=0.5)
    off = table.index[table["thinking"] == False]  # noqa: E712
    table.loc[off] = seed_pathology(table.loc[off], share=1.0).assign(thinking=False)
    failed = failed_names(table, default_quality)
    assert "completion_tokens_q50_no_thinking" in failed
    assert "completion_tokens_q50" not in failed  # the thinking rows are fine
    assert "think_block_share" not in failed


def test_non_thinking_rows_take_their_own_length_bounds(default_quality):
    quality = {
        **default_quality,
        "no_thinking_completion_length_quantiles": {
            "quantiles": [0.5], "ranges": [[1000, 2000]],
        },
    }  # fmt: skip
    failed = failed_names(mixed_modes(samples_frame(400)), quality)
    assert failed == {"completion_tokens_q50_no_thinking"}


def test_short_non_thinking_replies_fail_their_own_supervised_check_unless_bounded(
    default_quality,
):
    """Replies without thinking are short: in a mix they fail `supervised_tokens_min_no_thinking`
    (not the thinking rows' check) until `no_thinking_min_supervised_tokens` says what is enough."""
    table = mixed_modes(samples_frame(400), share_off=0.5)
    off = table["thinking"] == False  # noqa: E712
    table.loc[off, "loss_mask_sum"] = 10
    failed = failed_names(table, default_quality)
    assert "supervised_tokens_min_no_thinking" in failed
    assert "supervised_tokens_min" not in failed
    bounded = {**default_quality, "no_thinking_min_supervised_tokens": 8}
    assert "supervised_tokens_min_no_thinking" not in failed_names(table, bounded)
