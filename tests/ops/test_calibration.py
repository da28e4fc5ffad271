"""Calibration records and how the plan uses them: the budget split, staleness, the
steady-state rate, and the plan's figures, sources and estimate-vs-measured table."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from draftline.ops import calibration, calibration_generate
from draftline.ops.plan import build
from draftline.ops.plan.figures import calibration_of, profile_throughput, resolve_inputs
from draftline.ops.plan.tables import print_plan
from draftline.runtime import hardware, params

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def composed() -> dict:
    return params.compose([], ROOT / "conf")


def record(p: dict, **figures: float) -> dict:
    key = calibration.key_of(p, {"name": "cpu"}, "local:test")
    key["date"] = "2026-01-02"
    return {"schema": calibration.SCHEMA, **key, "figures": figures, "path": "cal/cpu.json"}


def test_the_budget_is_split_over_the_parts_asked_for() -> None:
    assert calibration.split_budget(1, ["generate", "extract", "train"]) == {
        "generate": 30.0, "extract": 15.0, "train": 15.0,
    }  # fmt: skip
    assert calibration.split_budget(2, ["extract", "train"]) == {"extract": 60.0, "train": 60.0}


def test_a_calibration_is_stale_for_another_drafter_or_versions(composed: dict) -> None:
    fresh = record(composed)
    assert calibration.stale_reasons(fresh, composed) == []
    other = copy.deepcopy(composed)
    other["drafter"]["name"] = "another"
    assert any(r.startswith("drafter ") for r in calibration.stale_reasons(fresh, other))
    old = {**fresh, "versions": {**fresh["versions"], "torch": "0.0.1"}}
    assert any(r.startswith("torch 0.0.1") for r in calibration.stale_reasons(old, composed))


class _Timed:
    def __init__(self, started: float, collected: list[tuple[float, int]]) -> None:
        self.started, self.collected = started, collected


def _turn(k: int, n: int) -> dict:
    return {"turn": k, "num_completion_tokens": n, "num_prompt_tokens": 10, "think_tokens": 1,
            "answer_tokens": n - 1}  # fmt: skip


def test_the_rate_leaves_out_the_first_collection() -> None:
    timed = _Timed(0.0, [(10.0, 1000), (12.0, 100), (14.0, 100)])  # 10 s of warm-up first
    figures = calibration_generate.generation_figures([_turn(0, 50), _turn(1, 60)], timed, [])
    assert figures["output_tok_s"] == 50.0  # 200 tokens over 4 s
    assert figures["completion_tokens"]["mean"] == 55.0
    alone = calibration_generate.generation_figures([_turn(0, 50)], _Timed(0.0, [(5.0, 50)]), [])
    assert alone["output_tok_s"] == 10.0 and "warm-up included" in alone["steady_state"]


def test_no_turn_in_the_budget_skips_the_part() -> None:
    with pytest.raises(calibration.PartSkipped):
        calibration_generate.generation_figures([], _Timed(0.0, []), [])


def test_plan_uses_a_calibration_of_this_run_only(composed: dict) -> None:
    profiles = hardware.load_profiles(ROOT / "conf")
    cal = record(composed, generate_tok_s=40.0, extract_tok_s=5000.0, train_tok_s=300.0,
                 completion_tokens=57.0, prompt_tokens=33.0)  # fmt: skip
    metrics = {"calibration": {"cpu": cal}, "curate": {}}
    rates = profile_throughput("cpu", profiles["cpu"], composed, metrics)
    assert rates["generate"].value == 40.0 and rates["generate"].measured
    assert rates["train"].source.startswith("measured by calibrate on 2026-01-02")
    assert rates["generate"].estimate is None  # the cpu profile has no estimate
    inputs = resolve_inputs(composed, metrics)
    assert inputs.completion_tokens.value == 57.0 and inputs.prompt_tokens.value == 33.0
    # Another drafter, or an estimate-only plan (no metrics): not used.
    other = copy.deepcopy(composed)
    other["drafter"]["name"] = "another"
    assert calibration_of("cpu", other, metrics) is None
    assert calibration_of("cpu", composed, {}) is None


def test_plan_prints_estimate_beside_measured(composed: dict) -> None:
    profiles = hardware.load_profiles(ROOT / "conf")
    measured = record(composed, generate_tok_s=1e9, extract_tok_s=1e9, train_tok_s=1e9)
    metrics = {"calibration": {"b200x8": measured}, "curate": {}}
    plan = build.build_plan(composed, profiles, metrics)
    b200 = plan["profiles"]["b200x8"]["throughput"]["generate_tok_s"]
    assert b200["kind"] == "measured" and b200["estimate"] > 0
    console = Console(file=io.StringIO(), width=100)
    print_plan(console, plan)
    text = console.file.getvalue()
    assert "Calibrated (tok/s: conf/ estimate vs measured)" in text
    assert "b200x8 generate" in text and "Δ days" in text
    json.dumps(plan)  # still JSON


def test_the_plans_turns_and_prefill_come_from_the_calibration(composed: dict) -> None:
    """The turns per conversation and every turn's prompt that calibrate measured replace the
    data profile's estimates (the generate run logs of a real run would still come first)."""
    cal = record(composed, turns=2.5, turn_prompt_tokens=40.0, prompt_tokens=30.0)
    metrics = {"calibration": {"cpu": cal}, "curate": {}}
    inputs = resolve_inputs(composed, metrics)
    gen = build.generation_work(composed, metrics, inputs)
    assert gen.turns.value == 2.5 and gen.turns.measured
    assert gen.turns.source.startswith("measured by calibrate on 2026-01-02")
    assert gen.prefill_tokens.value == 2.5 * 40.0 and gen.prefill_tokens.measured
    estimated = build.generation_work(composed, {"curate": {}}, inputs)
    assert not estimated.turns.measured


def test_the_prefix_cache_share_counts_the_turns_whose_engine_reports_it() -> None:
    from draftline.generation.engines.sglang import parse_response
    from draftline.generation.engines.vllm import parse_completion

    sglang = parse_response(
        "a", {"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
              "prompt_tokens": 100, "cached_tokens": 60}}, 2,
    )  # fmt: skip
    vllm = parse_completion(
        "b", {"choices": [{"token_ids": [5, 2], "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 40}}}, 2,
    )  # fmt: skip
    silent = parse_completion("c", {"choices": [{"token_ids": [2], "finish_reason": "stop"}]}, 2)
    assert (sglang.prompt_tokens, sglang.cached_tokens) == (100, 60)
    assert (vllm.prompt_tokens, vllm.cached_tokens) == (50, 40)
    assert silent.cached_tokens is None
    cache = calibration_generate.PrefixCache()
    assert cache.figures() == "not reported by this engine"
    for result in (sglang, vllm, silent):
        cache.add(result)
    assert cache.figures() == {
        "turns": 2, "prompt_tokens": 150, "cached_tokens": 100, "hit_share": round(100 / 150, 4)
    }  # fmt: skip
