"""`draftline plan`: the seed's arithmetic, flags, recommendations, measured metrics, the CLI."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from draftline import cli
from draftline.commands import plan as plan_cmd
from draftline.ops.plan import advice, build, figures, tables
from draftline.runtime import hardware, params

SEED = ["model=qwen3_6_27b", "data=sharegpt", "drafter=dflash_b16"]
# The seed run trained on offline features; the 27B's default is online.
SEED_OFFLINE = [*SEED, "extract.features=offline"]
# What the stages record of the run they measured (params.identity).
SEED_RUN = {"model": "Qwen/Qwen3.6-27B@main", "data": "sharegpt", "drafter": "dflash_b16"}
TINY_RUN = {"model": "models/tiny-target", "data": "sample", "drafter": "dflash_tiny"}
SEED_SIZES = {"samples": 914_000, "completion_tokens": 2_500, "prompt_tokens": 500}
KINDS = {"input", "measured", "estimate", "derived", "unknown"}
REPO_CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module")
def conf(repo_root: Path) -> Path:
    return repo_root / "conf"


@pytest.fixture(scope="module")
def seed_params(conf: Path) -> dict[str, Any]:
    """The seed run's target, trained offline (the 27B's default is online): the plan flags
    its features' storage."""
    return params.compose(SEED_OFFLINE, conf)


@pytest.fixture(scope="module")
def profiles(conf: Path) -> dict[str, dict[str, Any]]:
    return hardware.load_profiles(conf)


@pytest.fixture(scope="module")
def seed_plan(seed_params, profiles) -> dict[str, Any]:
    return build.build_plan(seed_params, profiles, {}, **SEED_SIZES)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def run_metrics(tmp_path: Path) -> Path:
    """Metrics of a small run of the production target on b200x8, as the stages write them."""
    root = tmp_path / "metrics"
    write_json(
        root / "curate.json", {**SEED_RUN, "rows_kept": 1000, "train_rows": 990, "eval_rows": 10}
    )
    write_json(
        root / "validate.json",
        {**SEED_RUN, "completion_tokens_mean": 800, "prompt_tokens_mean": 200},
    )
    shard = {"hardware_profile": "b200x8", **SEED_RUN, "samples": 500, "output_tokens": 400_000}
    write_json(root / "generate" / "shard-00000.json", {**shard, "wall_s": 100.0})
    write_json(root / "generate" / "shard-00001.json", {**shard, "wall_s": 300.0})
    # Another target's shard must not count: it would dominate the rate if it did.
    write_json(
        root / "generate" / "shard-00002.json",
        {**shard, "model": "Qwen/Qwen3-8B@main", "output_tokens": 10**9, "wall_s": 1.0},
    )
    common = {"hardware_profile": "b200x8", **SEED_RUN}
    write_json(
        root / "extract.json",
        {**common, "tokens_per_s": 5000.0, "bytes_per_token": 51200, "features": "offline"},
    )
    write_json(root / "train.json", {**common, "tokens_per_s": 4000.0, "features": "offline"})
    return root


# The seed's arithmetic: 914K conversations x 3 turns x ~2,500 output tokens at the profile's
# generate rate, every turn's prompt prefilled at its extract rate, over the schedule's measured
# utilisation (the seed node's 1,600 tok/s; B200 22,500).
SEED_PREFILL = 3 * 500 + 600 * 3 * 2  # turns x prompt + history x turns(turns - 1)
# Extracted and trained on per conversation (extract.rows turn, the default): one sequence per
# turn, its prompt (prefill / turns, 1,700) and completion (2,500), capped at max_length 3,072.
SEED_TURN_TOKENS = 3 * 3_072
SEED_TOKENS = 912_172 * SEED_TURN_TOKENS
UTILISATION = build.SCHEDULE_UTILISATION["work_ahead"][0]


def seed_generate_s(rate: float, extract_rate: float) -> float:
    return (914_000 * 3 * 2_500 / rate + 914_000 * SEED_PREFILL / extract_rate) / UTILISATION


def test_seed_generation_days_on_pro6000_and_b200(seed_plan):
    pro = seed_plan["profiles"]["pro6000x4"]["stages"]["generate"]
    assert pro["seconds"] == pytest.approx(seed_generate_s(1_600, 11_000))
    assert round(pro["days"], 1) == 55.3
    assert pro["over_limit"] is True
    b200 = seed_plan["profiles"]["b200x8"]["stages"]["generate"]
    low, high = b200["range_days"]
    assert (round(low, 2), round(high, 2)) == (3.23, 5.92)
    assert b200["days"] == pytest.approx(seed_generate_s(22_500, 100_000) / 86_400)
    assert round(b200["days"], 2) == 4.13
    assert b200["over_limit"] is False


def test_the_plan_assumes_the_served_precision_and_says_what_each_figure_is_for(
    seed_params, seed_plan, profiles, capsys
):
    """One source of truth: the precision `serve start` launches (model.serving.quantization)
    is the one the plan states; each profile's figure says its own (b200x8's estimate is for
    FP8, the seed node measured bf16, a floor for FP8)."""
    from draftline.generation.sglang_server import server_command

    served = seed_plan["model"]["served_precision"]
    assert served == {"value": "fp8", "source": "model.serving.quantization"}
    cmd = server_command(profiles["b200x8"], seed_params["model"], python="p")
    assert cmd[cmd.index("--quantization") + 1] == served["value"]
    b200, pro = (seed_plan["profiles"][n]["generate_precision"] for n in ("b200x8", "pro6000x4"))
    assert (b200["value"], b200["matches"]) == ("fp8", True)
    assert (pro["value"], pro["matches"]) == ("bf16", False)
    line = figures.precision_text(seed_plan, list(seed_plan["profiles"].values()))
    assert "generation time assumes fp8 weights" in line and "pro6000x4 bf16" in line
    bf16 = {**seed_params["model"], "serving": {**seed_params["model"]["serving"]}}
    bf16["serving"]["quantization"] = None
    plan = build.build_plan({**seed_params, "model": bf16}, profiles, {}, **SEED_SIZES)
    assert plan["model"]["served_precision"]["value"] == "bf16"
    assert plan["profiles"]["b200x8"]["generate_precision"]["matches"] is False


def test_generation_counts_turns_prefill_and_the_schedule(seed_params, seed_plan, profiles):
    """Per turn, prefill included, over the utilisation the scheduler measured, named."""
    gen = seed_plan["generation"]
    assert gen["turns"] == {"value": 3.0, "source": "conf/data/sharegpt.yaml estimate.turns",
                            "kind": "estimate"}  # fmt: skip
    assert gen["prefill_tokens"]["value"] == SEED_PREFILL == 5_100
    assert "history_tokens (600)" in gen["prefill_tokens"]["source"]
    b200 = seed_plan["profiles"]["b200x8"]["stages"]["generate"]
    assert b200["utilisation"]["value"] == UTILISATION >= 0.95
    assert "benchmarks/generation_schedule.py" in b200["utilisation"]["source"]
    assert b200["output_tokens"] == 914_000 * 3 * 2_500
    assert b200["prefill_s"] == pytest.approx(914_000 * SEED_PREFILL / 100_000)
    # A profile that does not work ahead has each shard's end idle: a lower utilisation.
    alone = {name: {k: v for k, v in p.items() if k != "work_ahead_shards"}
             for name, p in profiles.items()}  # fmt: skip
    slower = build.build_plan(seed_params, alone, {}, **SEED_SIZES)
    u = slower["profiles"]["b200x8"]["stages"]["generate"]["utilisation"]
    assert u["value"] == build.SCHEDULE_UTILISATION["alone"][0] < UTILISATION
    # The final answer only: one turn, one prompt.
    last = {**seed_params, "data": {**seed_params["data"], "regenerate_turns": "last"}}
    one = build.build_plan(last, profiles, {}, **SEED_SIZES)
    assert (one["generation"]["turns"]["value"], one["generation"]["prefill_tokens"]["value"]) == (
        1.0,
        500,
    )
    assert one["profiles"]["b200x8"]["stages"]["generate"]["seconds"] == pytest.approx(
        (914_000 * 2_500 / 22_500 + 914_000 * 500 / 100_000) / UTILISATION
    )


def test_seed_offline_features_are_about_430_tb(seed_params, seed_plan):
    assert figures.feature_bytes_per_token(seed_params["model"]) == 51_200
    inputs = seed_plan["inputs"]
    assert inputs["bytes_per_token"]["value"] == 51_200
    assert inputs["sequence_tokens"]["value"] == 3_000
    # Eval rows (data.eval_fraction 0.002) are generated but never extracted.
    assert inputs["train_samples"]["value"] == round(914_000 * 0.998)
    storage = seed_plan["storage"]
    assert storage["offline_features_tb"] == pytest.approx(SEED_TOKENS * 51_200 / 1e12)
    assert round(storage["offline_features_tb"]) == 430
    assert storage["online_token_packs_bytes"] == SEED_TOKENS * 5


def test_stage_times_costs_and_online_pays_the_target_forward(seed_plan, profiles):
    b200 = seed_plan["profiles"]["b200x8"]
    tokens = SEED_TOKENS
    assert b200["stages"]["extract"]["seconds"] == pytest.approx(tokens / 100_000)
    assert b200["stages"]["train_offline"]["seconds"] == pytest.approx(6 * tokens / 90_000)
    online = b200["stages"]["train_online"]["seconds"]
    assert online == pytest.approx(6 * tokens * (1 / 90_000 + 1 / 100_000))
    assert b200["throughput"]["train_online_tok_s"]["kind"] == "derived"
    total = b200["total"]["offline"]
    expected = sum(b200["stages"][k]["seconds"] for k in ("generate", "extract", "train_offline"))
    assert total["seconds"] == pytest.approx(expected)
    assert total["cost_usd"] == pytest.approx(
        expected / 3600 * profiles["b200x8"]["price_per_hour"]
    )
    assert b200["total"]["online"]["seconds"] == pytest.approx(
        b200["stages"]["generate"]["seconds"] + online
    )


def test_cpu_has_no_estimate_and_says_so(seed_plan):
    cpu = seed_plan["profiles"]["cpu"]
    assert all(cpu["stages"][k]["seconds"] is None for k in build.STAGES)
    assert cpu["total"]["offline"]["missing"] == ["generate", "extract", "train_offline"]
    assert cpu["total"]["offline"]["cost_usd"] is None
    assert cpu["throughput"]["generate_tok_s"]["kind"] == "unknown"
    assert "conf/hardware/cpu.yaml" in cpu["throughput"]["generate_tok_s"]["source"]


def test_every_figure_names_its_source(seed_plan):
    for figure in seed_plan["inputs"].values():
        if isinstance(figure, dict):
            assert figure["kind"] in KINDS and figure["source"]
    assert seed_plan["inputs"]["samples"]["kind"] == "input"
    for name, prof in seed_plan["profiles"].items():
        for figure in prof["throughput"].values():
            assert figure["kind"] in KINDS and figure["source"]
        if name != "cpu":
            assert prof["throughput"]["generate_tok_s"]["source"].startswith(
                f"conf/hardware/{name}.yaml throughput.generate_tok_s"
            )


# Flags and recommendations.


def test_storage_over_budget_flags_and_recommends_concrete_numbers(seed_plan):
    storage_flags = [f for f in seed_plan["flags"] if f["kind"] == "storage"]
    assert len(storage_flags) == 1 and "430.4 TB" in storage_flags[0]["message"]
    assert "9,216 tokens (turn rows)" in storage_flags[0]["message"]
    recs = {r["kind"]: r for r in seed_plan["recommendations"]}
    assert recs["online_features"]["override"] == "extract.features=online"
    assert recs["online_features"]["storage_bytes"] == SEED_TOKENS * 5
    # The largest subset and the longest max length that fit 20 TB, and not one more.
    per_sample = SEED_TURN_TOKENS * 51_200
    assert recs["subset"]["samples"] == 42_385
    assert 42_385 * per_sample <= 20e12 < 42_386 * per_sample
    # Three sequences per conversation (one per turn), each cut to the max length.
    assert recs["max_length"]["max_length"] == 142
    assert recs["max_length"]["override"] == "extract.max_length=142"
    assert 912_172 * 3 * 142 * 51_200 <= 20e12 < 912_172 * 3 * 143 * 51_200
    # 142 tokens do not even hold the 500-token mean prompt: the plan says it is no way out.
    assert recs["max_length"]["completion_tokens_kept"] == 0
    assert recs["max_length"]["usable"] is False
    assert "too short" in recs["max_length"]["message"]


def test_the_27b_trains_online_by_default_and_the_plan_recommends_nothing_set(conf, profiles):
    composed = params.compose(SEED, conf)
    assert composed["extract"]["features"] == "online"
    plan = build.build_plan(composed, profiles, {}, **SEED_SIZES)
    assert plan["features"] == "online" and plan["storage"]["over_budget"] is False
    assert not [f for f in plan["flags"] if f["kind"] == "storage"]
    kinds = {r["kind"] for r in plan["recommendations"]}
    assert not kinds & {"online_features", "subset", "max_length"}
    assert round(plan["storage"]["offline_features_tb"]) == 430  # still said, for comparison
    # No recommendation is an override the params already hold, whatever its kind.
    for rec in plan["recommendations"]:
        assert not advice.is_set(composed, rec.get("override")), rec
    assert advice.is_set(composed, "extract.features=online")
    assert advice.is_set(composed, "hardware.activation_checkpointing=false")
    assert not advice.is_set(composed, "extract.features=offline")


def test_max_length_recommendation_is_usable_when_the_budget_allows(seed_params, profiles):
    plan = build.build_plan(seed_params, profiles, {}, **SEED_SIZES, storage_budget_tb=100)
    rec = next(r for r in plan["recommendations"] if r["kind"] == "max_length")
    assert rec["max_length"] == math.floor(100e12 / (912_172 * 3 * 51_200))  # 713
    assert rec["completion_tokens_kept"] == 713 - 500
    assert rec["usable"] is True and "too short" not in rec["message"]


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        ("--samples=0", "must be a whole number > 0"),
        ("--samples=1.5", "invalid positive_int value"),
        ("--completion-tokens=-5", "must be > 0"),
        ("--storage-budget-tb=0", "must be > 0"),
    ],
)
def test_cli_rejects_meaningless_inputs(flag, error, capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["plan", *SEED, flag])
    assert err.value.code == 2
    assert error in capsys.readouterr().err


def test_time_flags_fire_per_stage_and_profile(seed_plan):
    timed = {(f["profile"], f["stage"]) for f in seed_plan["flags"] if f["kind"] == "time"}
    # pro6000x4: generation 55.3 d, extraction 8.9 d, offline training 58.4 d, online 111.5 d;
    # b200x8: online training 12.3 d (7-day limit; three sequences per conversation, turn rows).
    assert timed == {
        ("pro6000x4", "generate"),
        ("pro6000x4", "extract"),
        ("pro6000x4", "train_offline"),
        ("pro6000x4", "train_online"),
        ("b200x8", "train_online"),
    }
    recs = [r for r in seed_plan["recommendations"] if r["kind"] == "generate_time"]
    assert len(recs) == 1 and recs[0]["profile"] == "pro6000x4"
    # 7 days over the time each conversation takes on the PRO 6000.
    per_sample = seed_generate_s(1_600, 11_000) / 914_000
    assert recs[0]["samples"] == math.floor(7 * 86_400 / per_sample)
    assert "b200x8" in recs[0]["message"]
    epochs = {
        (r["profile"], r["stage"]): r["epochs"]
        for r in seed_plan["recommendations"]
        if r["kind"] == "train_time"
    }
    assert epochs == {
        ("pro6000x4", "train_offline"): 0,
        ("pro6000x4", "train_online"): 0,
        ("b200x8", "train_online"): 3,
    }


def test_flags_follow_the_limits(seed_params, profiles):
    loose = build.build_plan(
        seed_params, profiles, {}, **SEED_SIZES, storage_budget_tb=500, time_limit_days=120
    )
    assert loose["flags"] == [] and loose["recommendations"] == []
    assert loose["storage"]["over_budget"] is False
    # 55.3 days of generation: over a 55-day limit, within a 56-day one.
    at55 = build.build_plan(seed_params, profiles, {}, **SEED_SIZES, time_limit_days=55)
    at56 = build.build_plan(seed_params, profiles, {}, **SEED_SIZES, time_limit_days=56)
    assert at55["profiles"]["pro6000x4"]["stages"]["generate"]["over_limit"] is True
    assert at56["profiles"]["pro6000x4"]["stages"]["generate"]["over_limit"] is False


def test_small_subset_fits_everything(seed_params, profiles):
    plan = build.build_plan(
        seed_params, profiles, {}, samples=10_000, completion_tokens=2_500, prompt_tokens=500
    )
    assert plan["flags"] == [] and plan["recommendations"] == []
    assert plan["storage"]["offline_features_tb"] == pytest.approx(
        9_980 * SEED_TURN_TOKENS * 51_200 / 1e12
    )


def test_max_length_caps_the_feature_tokens(conf, profiles):
    composed = params.compose([*SEED, "extract.max_length=1024"], conf)
    plan = build.build_plan(composed, profiles, {}, **SEED_SIZES)
    assert plan["inputs"]["sequence_tokens"]["value"] == 1024
    # Each of the three turns' sequences capped.
    assert plan["storage"]["offline_features_bytes"] == 912_172 * 3 * 1024 * 51_200


def test_other_target_scales_the_estimates_by_parameters(conf, profiles):
    composed = params.compose(["model=qwen3_8b", "data=sharegpt", "drafter=dflash_b16"], conf)
    plan = build.build_plan(composed, profiles, {}, **SEED_SIZES)
    rate = plan["profiles"]["b200x8"]["throughput"]["generate_tok_s"]
    assert rate["value"] == pytest.approx(22_500 * 27e9 / 8.2e9)
    assert rate["low"] == pytest.approx(15_000 * 27e9 / 8.2e9)
    assert "scaled" in rate["source"] and "qwen3_6_27b" in rate["source"]
    # K 5 x H 4,096 x 2 B.
    assert plan["inputs"]["bytes_per_token"]["value"] == 40_960


def test_sizes_come_from_the_data_profile_when_not_given(seed_params, profiles):
    plan = build.build_plan(seed_params, profiles, {})
    assert plan["inputs"]["samples"]["value"] == 914_000
    assert plan["inputs"]["completion_tokens"]["value"] == 2_500
    assert plan["inputs"]["samples"]["source"] == "conf/data/sharegpt.yaml estimate.samples"
    assert plan["inputs"]["samples"]["kind"] == "estimate"


def test_no_sample_count_names_the_fix(conf, profiles):
    composed = params.compose([], conf)
    if (composed["data"].get("estimate") or {}).get("samples"):
        composed["data"]["estimate"]["samples"] = None
    with pytest.raises(SystemExit, match="--samples"):
        build.build_plan(composed, profiles, {})


# Measured metrics.


def test_measured_metrics_replace_estimates_for_their_profile(run_metrics, seed_params, profiles):
    metrics, notes = plan_cmd.read_metrics(run_metrics)
    assert notes == []
    plan = build.build_plan(seed_params, profiles, metrics)
    assert plan["notes"] == [
        f"ignored {(run_metrics / 'generate' / 'shard-00002.json').as_posix()}: measured on "
        "model=Qwen/Qwen3-8B@main data=sharegpt drafter=dflash_b16, not "
        "model=Qwen/Qwen3.6-27B@main data=sharegpt drafter=dflash_b16"
    ]
    inputs = plan["inputs"]
    assert (inputs["samples"]["value"], inputs["samples"]["kind"]) == (1000, "measured")
    assert inputs["train_samples"]["value"] == 990
    assert inputs["completion_tokens"]["value"] == 800
    assert inputs["prompt_tokens"]["value"] == 200
    assert inputs["sequence_tokens"]["value"] == 1000
    b200 = plan["profiles"]["b200x8"]
    gen = b200["throughput"]["generate_tok_s"]
    # 800,000 tokens in 400 s; the Qwen3-8B shard is ignored.
    assert (gen["value"], gen["kind"]) == (2000, "measured")
    assert "2 files" in gen["source"] and "shard-00000.json" in gen["source"]
    # A measured rate (output tokens over wall time) has prefill and idle slots in it; the
    # turns are the data profile's (the shards did not record theirs).
    assert b200["stages"]["generate"]["seconds"] == pytest.approx(1000 * 3 * 800 / 2000)
    assert b200["stages"]["generate"]["utilisation"] is None
    # Turn rows: 3 turns of a 1,400-token prompt (3 x 200 + 600 x 3 x 2 prefilled, / 3) + 800.
    tokens = 990 * 3 * (1_400 + 800)
    assert b200["stages"]["extract"]["seconds"] == pytest.approx(tokens / 5000)
    extract = b200["throughput"]["extract_tok_s"]
    assert (
        extract["source"] == f"{(run_metrics / 'extract.json').as_posix()} tokens_per_s (on b200x8)"
    )
    assert b200["stages"]["train_offline"]["seconds"] == pytest.approx(6 * tokens / 4000)
    online = b200["throughput"]["train_online_tok_s"]
    assert online["value"] == pytest.approx(1 / (1 / 4000 + 1 / 5000))
    assert "train measured, extract measured" in online["source"]
    # Measured on b200x8 only: the PRO 6000 keeps its own figures.
    pro = plan["profiles"]["pro6000x4"]["throughput"]
    assert (pro["generate_tok_s"]["value"], pro["generate_tok_s"]["kind"]) == (1600, "estimate")
    assert pro["extract_tok_s"]["kind"] == "estimate"


def test_metrics_without_profile_count_for_the_params_profile(tmp_path, conf, profiles):
    """The tiny CPU run: stages that do not record a profile ran on params' hardware (cpu)."""
    root = tmp_path / "metrics"
    # The documented short names (kept/train/eval) are read too.
    write_json(root / "curate.json", {**TINY_RUN, "kept": 40, "train": 36, "eval": 4})
    write_json(
        root / "generate" / "shard-00000.json",
        {
            **TINY_RUN,
            "samples": 36,
            "output_tokens": 3456,
            "prompt_tokens": 3600,
            "output_tok_s": 96.0,
        },
    )
    write_json(root / "train.json", {**TINY_RUN, "tokens_per_s": 1500.0, "features": "online"})
    metrics, _ = plan_cmd.read_metrics(root)
    composed = params.compose([], conf)
    plan = build.build_plan(composed, profiles, metrics)
    epochs = composed["drafter"]["epochs"]
    cpu = plan["profiles"]["cpu"]
    assert cpu["throughput"]["generate_tok_s"]["value"] == 96.0
    assert plan["inputs"]["completion_tokens"]["value"] == 96.0  # 3,456 / 36
    assert plan["inputs"]["prompt_tokens"]["value"] == 100.0  # 3,600 / 36
    turns = composed["data"]["estimate"]["turns"]
    assert cpu["stages"]["generate"]["seconds"] == pytest.approx(40 * turns * 96 / 96)
    assert cpu["throughput"]["train_online_tok_s"]["kind"] == "measured"
    # Turn rows, none capped: every turn's prompt (the prefill) and every completion.
    per_sample = plan["generation"]["prefill_tokens"]["value"] + turns * 96
    trained = epochs * 36 * per_sample
    assert cpu["stages"]["train_online"]["seconds"] == pytest.approx(trained / 1500)
    # Offline needs extraction, which nobody measured on a CPU.
    assert cpu["total"]["offline"]["seconds"] is None
    assert cpu["total"]["online"]["seconds"] == pytest.approx(40 * turns + trained / 1500)


def test_broken_or_partial_metrics_fall_back_with_notes(tmp_path, seed_params, profiles):
    root = tmp_path / "metrics"
    root.mkdir()
    (root / "curate.json").write_text("{not json", encoding="utf-8")
    write_json(root / "validate.json", [1, 2])
    write_json(root / "train.json", {"hardware_profile": "b200x8", "tokens_per_s": None})
    metrics, notes = plan_cmd.read_metrics(root)
    assert len(notes) == 2 and all(n.startswith("ignored") for n in notes)
    plan = build.build_plan(seed_params, profiles, metrics)
    assert plan["inputs"]["samples"]["kind"] == "estimate"
    assert plan["profiles"]["b200x8"]["throughput"]["train_tok_s"]["kind"] == "estimate"


# The command end to end.


def _main_json(capsys, *argv: str) -> dict[str, Any]:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_schema(capsys, conf, tmp_path):
    out = _main_json(
        capsys,
        *SEED,
        "--config-dir",
        str(conf),
        "--reports-dir",
        str(tmp_path / "none"),
        "--samples",
        "914000",
        "--completion-tokens",
        "2500",
        "--prompt-tokens",
        "500",
        "--storage-budget-tb",
        "150",
        "--time-limit-days",
        "20",
    )
    assert out["schema"] == "draftline.plan/1"
    assert set(out) >= {
        "model",
        "drafter",
        "inputs",
        "limits",
        "storage",
        "profiles",
        "flags",
        "recommendations",
        "notes",
    }
    assert out["limits"] == {"storage_budget_tb": 150.0, "time_limit_days": 20.0}
    assert out["model"] == {
        "name": "qwen3_6_27b",
        "ref": "Qwen/Qwen3.6-27B@main",
        "num_parameters": 27_000_000_000,
        "target_layers": 5,
        "hidden_size": 5120,
        "served_precision": {"value": "fp8", "source": "model.serving.quantization"},
    }
    assert set(out["profiles"]) == {"cpu", "vllm_cpu", "pro6000x4", "b200x8", "vllm_b200x8"}
    for prof in out["profiles"].values():
        assert set(prof["stages"]) == set(build.STAGES)
        assert set(prof["total"]) == {"offline", "online"}
        for stage in prof["stages"].values():
            assert set(stage) >= {"seconds", "days", "range_days", "over_limit", "source"}
        assert {"output_tokens", "prefill_tokens", "utilisation"} <= set(prof["stages"]["generate"])
    # Online features: no storage flag; only the PRO 6000's 55-day generation and its 58- and
    # 111-day training (turn rows) exceed 20 days; it fits a PRO 6000, the target sharded over
    # the node's GPUs.
    assert [(f["kind"], f["profile"], f["stage"]) for f in out["flags"]] == [
        ("time", "pro6000x4", "generate"),
        ("time", "pro6000x4", "train_offline"),
        ("time", "pro6000x4", "train_online"),
    ]
    assert out["generation"]["turns"]["value"] == 3.0
    assert out["profiles"]["cpu"]["memory"]["stages"] == {}
    assert out["profiles"]["vllm_cpu"]["memory"]["stages"] == {}
    for name in ("pro6000x4", "b200x8"):
        memory = out["profiles"][name]["memory"]
        assert set(memory["stages"]) == {"extract", "train_offline", "train_online"}
        assert memory["device_bytes"] > memory["usable_bytes"]
        assert memory["layout"]["sharding"] == "fsdp"
        assert memory["drafter"]["family"] == "dflash" and memory["drafter"]["train"] > 0
    assert not [r for r in out["recommendations"] if r["kind"] == "memory"]


def test_no_memory_skips_the_fake_tensor_runs(capsys, conf, tmp_path):
    out = _main_json(capsys, *SEED, "--config-dir", str(conf), "--no-memory")
    assert all("memory" not in p for p in out["profiles"].values())
    assert not [f for f in out["flags"] if f["kind"] == "memory"]


def test_memory_flags_and_fixes_name_the_profile_stage_and_override(seed_params, profiles):
    gib = 2**30
    fits = {"peak_bytes": 10 * gib, "resident": {}, "fits": True}
    memory = {
        "pro6000x4": {
            "device_bytes": 96 * gib,
            "usable_bytes": 91 * gib,
            "stages": {
                "extract": {
                    **fits, "peak_bytes": 99 * gib, "fits": False,
                    "fix": {"override": "hardware.extract_tokens_per_batch=16384",
                            "peak_bytes": 60 * gib},
                },
                "train_offline": {**fits, "peak_bytes": 120 * gib, "fits": False, "fix": None},
                "train_online": fits,
            },
        }
    }  # fmt: skip
    plan = build.build_plan(seed_params, profiles, {}, memory=memory)
    flags = [f for f in plan["flags"] if f["kind"] == "memory"]
    assert [f["stage"] for f in flags] == ["extract", "train_offline"]
    assert "needs 99.0 GiB per GPU, over the 91.0 GiB usable of 96.0 GiB" in flags[0]["message"]
    recs = [r for r in plan["recommendations"] if r["kind"] == "memory"]
    assert recs[0]["override"] == "hardware.extract_tokens_per_batch=16384"
    assert "(60.0 GiB per GPU)" in recs[0]["message"]
    assert recs[1]["override"] is None and "no smaller batch" in recs[1]["message"]


def test_cli_table_in_a_subprocess(repo_root, tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftline",
            "plan",
            *SEED_OFFLINE,
            "--samples",
            "914000",
            "--completion-tokens",
            "2500",
            "--prompt-tokens",
            "500",
            "--reports-dir",
            str(tmp_path / "none"),
        ],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "55.32 d !" in out  # pro6000x4 generation, over the limit
    assert "4.13 d (3.23–5.92)" in out  # b200x8 generation and its range
    # The one line that says how generation was counted and the utilisation it assumed.
    assert "Generation per turn: 3.00 turns per conversation" in out
    assert f"utilisation assumed: b200x8 {UTILISATION:.3f}" in out
    assert "benchmarks/generation_schedule.py" in out
    assert "430.4 TB" in out and "over budget" in out
    assert "FLAG" in out and "RECOMMEND" in out and "extract.features=online" in out
    # Online training fits the PRO 6000 too, the target sharded over its four GPUs.
    assert "Memory per GPU" in out and "fsdp x4" in out and "OOM" not in out
    # The CPU profiles have no figure for the 27B: named once, not columns of dashes.
    table = out.split("Wall time per stage", 1)[1].split("Generation per turn", 1)[0]
    header = table.splitlines()[2]
    assert "b200x8" in header and "pro6000x4" in header and "cpu" not in header
    assert "Not shown: cpu, vllm_b200x8, vllm_cpu: no throughput for this target" in table
    assert "cpu generate" not in out  # nor in the throughput lines


def _plan_cli(repo_root: Path, *args: str, columns: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "plan", *args],
        cwd=repo_root,
        env={**os.environ, "COLUMNS": str(columns)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    ("from_metrics", "columns"),
    [(False, 80), (True, 80), (False, 120)],
    ids=["plan", "from-metrics", "plan-120"],
)
def test_cli_tables_fit_80_columns_with_every_figure_whole(
    repo_root, tmp_path, run_metrics, from_metrics, columns, monkeypatch, capsys
):
    """In an 80- or 120-column terminal no line is longer and no figure is cut ("$5,1…"
    once): every time and cost of the JSON plan appears whole in the tables."""
    sizes = ["--samples", "914000", "--completion-tokens", "2500", "--prompt-tokens", "500"]
    args = [*SEED, *sizes, "--reports-dir", str(run_metrics if from_metrics else tmp_path)]
    if from_metrics:
        args.append("--from-metrics")
    out = _plan_cli(repo_root, *args, columns=columns)
    assert max(len(line) for line in out.splitlines()) <= columns, out
    assert "…" not in out, out
    # A throughput figure and its source stay on their row: the source wraps in its column.
    rates = [line for line in out.splitlines() if line.startswith(" b200x8 generate")]
    assert not from_metrics or not rates
    if rates:
        assert re.match(r" b200x8 generate +[\d,]+ \([\d,]+–[\d,]+\) +conf/hardware/", rates[0])
    # The same plan as JSON, in this process: the terminal's width does not reach JSON.
    monkeypatch.chdir(repo_root)
    result = _main_json(capsys, *args)
    plans = [result["planned"], result["measured"]] if from_metrics else [result]
    cells = set()
    for plan in plans:
        for profile in plan["profiles"].values():
            if all(s["seconds"] is None for s in profile["stages"].values()):
                continue  # no figure at all (CPU for the 27B): named under the table instead
            cells |= {tables.duration(s["seconds"]) for s in profile["stages"].values()}
            for mode in ("offline", "online"):
                cells.add(tables.money(profile["total"][mode]["cost_usd"]))
                cells.add(tables.duration(profile["total"][mode]["seconds"]))
    if not from_metrics:  # the Two-nodes table: b200x8 generating, pro6000x4 training
        (pair,) = result["two_nodes"]
        assert "Two nodes: generate on b200x8 (G), train on" in out
        for view in (pair[key] for key in tables.TWO_NODE_VIEWS):
            cells.add(tables.money(view["cost_usd"]))
            cells |= {tables.duration(view[k]) for k in ("seconds", "generate_busy_s")}
    assert len(cells) > 10
    for figure in cells:
        assert figure in out, figure
    if not from_metrics:
        assert "Memory per GPU" in out and "online: GPU free" in out


def test_from_metrics_puts_planned_and_measured_side_by_side(capsys, conf, run_metrics):
    out = _main_json(
        capsys,
        *SEED,
        "--config-dir",
        str(conf),
        "--reports-dir",
        str(run_metrics),
        "--from-metrics",
    )
    planned, measured = out["planned"], out["measured"]
    assert planned["inputs"]["samples"]["value"] == 914_000
    assert measured["inputs"]["samples"]["value"] == 1000
    assert planned["profiles"]["b200x8"]["throughput"]["generate_tok_s"]["value"] == 22_500
    assert measured["profiles"]["b200x8"]["throughput"]["generate_tok_s"]["value"] == 2000
    assert len(out["metrics_files"]) == 7  # curate, validate, extract, train, 3 shards
    assert (
        cli.main(
            [
                "plan",
                *SEED,
                "--config-dir",
                str(conf),
                "--reports-dir",
                str(run_metrics),
                "--from-metrics",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "planned" in table and "measured" in table and "2,000" in table and "22,500" in table


def test_from_metrics_without_a_run_names_the_fix(conf, tmp_path):
    with pytest.raises(SystemExit, match="run the pipeline first"):
        cli.main(
            [
                "plan",
                *SEED,
                "--config-dir",
                str(conf),
                "--reports-dir",
                str(tmp_path),
                "--from-metrics",
            ]
        )


def tiny_run_metrics(root: Path, identity: dict[str, Any]) -> None:
    """Metrics of a tiny CPU run, 1 s a stage, with the `identity` they record."""
    write_json(root / "curate.json", {**identity, "rows_kept": 40, "train_rows": 36})
    write_json(root / "validate.json", {**identity, "completion_tokens_mean": 90.0})
    rates = {"hardware_profile": "b200x8", **identity, "tokens_per_s": 1e9}
    write_json(root / "extract.json", rates)
    write_json(root / "train.json", rates)
    write_json(
        root / "generate" / "shard-0.json",
        {**rates, "samples": 40, "output_tokens": 3600, "wall_s": 1e-6},
    )


def test_plan_reads_params_yaml_and_never_another_runs_metrics(capsys, conf, tmp_path):
    """params.yaml recomposed for Qwen3-8B after a tiny run: `draftline plan` plans Qwen3-8B,
    with or without overrides, and uses none of the tiny run's figures (the regression: a
    total of 1 s and $0)."""
    root = tmp_path / "metrics"
    tiny_run_metrics(root, {})  # as the stages wrote them before they recorded the run
    run_params = tmp_path / "params.yaml"
    qwen = ["model=qwen3_8b", "data=sharegpt"]
    run_params.write_text(params.to_yaml(params.compose(qwen, conf), qwen), encoding="utf-8")
    # No memory figures: what is planned from which metrics is the question, not memory.
    argv = [
        "--config-dir", str(conf), "--reports-dir", str(root), "--params", str(run_params),
        "--no-memory",
    ]  # fmt: skip
    for plan in (_main_json(capsys, *argv), _main_json(capsys, *qwen, *argv)):
        assert (plan["model"]["name"], plan["data"]) == ("qwen3_8b", "sharegpt")
        assert plan["inputs"]["samples"]["value"] == 914_000
        b200 = plan["profiles"]["b200x8"]
        assert all(f["kind"] != "measured" for f in b200["throughput"].values())
        assert b200["total"]["offline"]["seconds"] > 3600
        # One note for the run, naming its five files.
        files = ["curate.json", "validate.json", "extract.json", "train.json"]
        files.append("generate/shard-0.json")
        assert plan["notes"] == [
            f"ignored 5 files ({', '.join((root / f).as_posix() for f in files)}): they do not "
            "record the model, data and drafter they were measured on (an older draftline wrote "
            "them); rerun their stages"
        ]


def test_measured_figures_need_the_same_model_data_and_drafter(capsys, conf, tmp_path):
    root = tmp_path / "metrics"
    tiny_run_metrics(root, TINY_RUN)
    # No memory figures: which metrics count is the question, not memory.
    argv = ["--config-dir", str(conf), "--reports-dir", str(root), "--no-memory"]
    tiny = _main_json(capsys, *argv, "model=tiny")
    assert tiny["inputs"]["samples"]["value"] == 40
    assert tiny["inputs"]["completion_tokens"]["value"] == 90.0
    assert tiny["profiles"]["b200x8"]["throughput"]["train_tok_s"]["kind"] == "measured"
    assert tiny["notes"] == []
    for other in ("model=qwen3_8b", "data=sharegpt", "drafter=dflash_b16"):
        plan = _main_json(capsys, *argv, other)
        assert plan["inputs"]["samples"]["kind"] == "estimate", other
        assert plan["profiles"]["b200x8"]["throughput"]["train_tok_s"]["kind"] == "estimate"
        [note] = plan["notes"]  # one run: one note
        assert note.startswith("ignored 5 files (") and note.count(root.as_posix()) == 5
        assert "measured on model=models/tiny-target data=sample drafter=dflash_tiny, not" in note


def test_reads_what_the_curate_and_generate_stages_write(tmp_path, seed_params, profiles):
    """Contract with the real metric builders (curation, generation): the keys plan reads."""
    from collections import Counter

    import numpy as np

    from draftline.data.curation import CurateResult
    from draftline.generation.shards import shard_metrics
    from draftline.runtime import atomic

    root = tmp_path / "metrics"
    curated = CurateResult(
        rows_read=12, shard_rows=[6, 5], eval_rows=1, prompt_tokens=np.full(12, 300, np.int32)
    )
    atomic.write_json(root / "curate.json", {**curated.metrics(), **SEED_RUN})
    rows = [
        {"num_prompt_tokens": 300, "num_completion_tokens": 1200, "finish_reason": "stop",
         "has_think_block": True, "loss_mask_sum": 1200}
        for _ in range(6)
    ]  # fmt: skip
    shard = shard_metrics(rows, Counter(stop=6), 6, 7200, 3.6)
    # What run_shard adds: every turn and every turn's prompt (9 turns over 6 conversations).
    shard.update({"wall_s": 3.6, **SEED_RUN, "hardware_profile": "b200x8", "turns": 9,
                  "turn_prompt_tokens": 9 * 250})  # fmt: skip
    atomic.write_json(root / "generate" / "shard-00000.json", shard)
    metrics, notes = plan_cmd.read_metrics(root)
    plan = build.build_plan(seed_params, profiles, metrics)
    assert notes == []
    inputs = plan["inputs"]
    assert (inputs["samples"]["value"], inputs["train_samples"]["value"]) == (12, 11)
    assert inputs["prompt_tokens"]["value"] == 300
    assert inputs["completion_tokens"]["value"] == 1200  # 7,200 / 6 from the shard
    assert plan["profiles"]["b200x8"]["throughput"]["generate_tok_s"]["value"] == 2000
    gen = plan["generation"]
    assert (gen["turns"]["value"], gen["turns"]["kind"]) == (1.5, "measured")
    assert (gen["prefill_tokens"]["value"], gen["prefill_tokens"]["kind"]) == (375, "measured")


def test_a_run_log_of_another_run_is_not_merged(capsys, conf, run_metrics, tmp_path):
    """logs/runs/ is this node's last run; metrics/ may come from git (another run): a run log
    adds timings to a metrics file only when both record the same model, data and drafter."""
    runs = tmp_path / "runs"
    write_json(runs / "curate.json", {**TINY_RUN, "rows_kept": 330, "seconds": 2.0})
    out = _main_json(
        capsys, *SEED, "--config-dir", str(conf), "--reports-dir", str(run_metrics),
        "--runs-dir", str(runs),
    )  # fmt: skip
    assert out["inputs"]["samples"]["value"] == 1000  # the metrics' own figure, not 330
    assert any("another run" in note for note in out["notes"])


def test_memory_rows_keep_their_order_whatever_order_the_figures_come_in():
    """A measured figure lists what is held in measuring order, one read back from the memory
    cache in sorted order: the printed rows must not move between the first run and the next."""
    from rich.console import Console

    def printed(resident: dict[str, int]) -> str:
        stage = {"peak_bytes": 2**33, "fits": True, "resident": resident}
        memory = {"device_bytes": 2**36, "layout": None, "stages": {"train_online": stage}}
        console = Console(width=80, record=True, file=io.StringIO())
        tables._print_memory(console, {"profiles": {"p": {"name": "p", "memory": memory}}})
        return console.export_text()

    fresh = {"target": 1, "drafter": 2, "target_head": 3, "optimizer": 4}
    cached = dict(sorted(fresh.items()))
    assert list(cached) != list(fresh)
    assert printed(fresh) == printed(cached)
    rows = [line.split("held: ")[1].split("│")[0].strip() for line in printed(cached).splitlines()
            if "held: " in line]  # fmt: skip
    assert rows == ["target", "drafter", "target head", "optimizer"]


def test_the_plan_shows_the_running_requests_sglang_gives_each_profile(seed_plan):
    """The profiles ask 512 / 256 running requests per engine; SGLang sizes the 27B's by its
    Gated DeltaNet state pool (generation/sglang_caps.py, checked equal to SGLang's own
    configurator by tests/engines/test_sglang_startup.py), and the client keeps that plus a
    short queue in flight, not the profile's max_in_flight."""
    b200, pro = seed_plan["profiles"]["b200x8"], seed_plan["profiles"]["pro6000x4"]
    assert (b200["running"]["per_engine"], b200["running"]["requested"]) == (46, 512)
    assert (pro["running"]["per_engine"], pro["running"]["requested"]) == (18, 256)
    assert b200["running"]["capped_by"] == pro["running"]["capped_by"] == "mamba state"
    assert b200["running"]["in_flight"] == 8 * (46 + 5) and pro["running"]["in_flight"] == 4 * 22
    assert seed_plan["profiles"]["cpu"]["running"] is None  # not an SGLang GPU node
    from rich.console import Console

    out = io.StringIO()
    tables.print_plan(Console(file=out, width=200), seed_plan)
    assert "Running requests b200x8: 46 per engine x 8" in out.getvalue()
    assert "below the 512 the profile asks" in out.getvalue()
