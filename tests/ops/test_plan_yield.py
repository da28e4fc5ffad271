"""`draftline plan`'s data yield: what each row layout (extract.rows) supervises, extracts and
trains on, and what a supervised token costs."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from draftline.ops.plan import build, data_yield, tables
from draftline.runtime import hardware, params

THE_27B = ["hardware=b200x8", "model=qwen3_6_27b", "data=sharegpt", "drafter=dflash_b16"]
SEED_RUN = {"model": "Qwen/Qwen3.6-27B@main", "data": "sharegpt", "drafter": "dflash_b16"}
# The sharegpt estimates: 3 turns of 2,500 completion tokens, a 500-token first prompt, 600
# tokens of history per earlier turn; 3,072 max_length; 912,172 conversations trained on.
TRAIN = 912_172


@pytest.fixture(scope="module")
def conf(repo_root: Path) -> Path:
    return repo_root / "conf"


@pytest.fixture(scope="module")
def profiles(conf: Path) -> dict[str, dict[str, Any]]:
    return hardware.load_profiles(conf)


def plan_for(conf: Path, profiles: dict[str, Any], *overrides: str, metrics=None) -> dict:
    composed = params.compose([*THE_27B, *overrides], conf)
    return build.build_plan(composed, profiles, metrics or {})


@pytest.fixture(scope="module")
def plan_27b(conf, profiles) -> dict[str, Any]:
    return plan_for(conf, profiles)


def test_the_27b_plan_has_both_layouts_and_their_yield(plan_27b):
    section = plan_27b["yield"]
    assert section["configured"] == "turn"
    turn, conv = section["layouts"]["turn"], section["layouts"]["conversation"]
    per_turn, per_conv = turn["per_conversation"], conv["per_conversation"]
    # Every generated token once: 3 x 2,500 of 3 x 2,500.
    assert per_turn["supervised_tokens"]["value"] == per_turn["generated_tokens"]["value"] == 7_500
    assert per_turn["yield"]["value"] > 0.95
    # The last turn (2,500) and the history the window leaves (3,072 - 2,500), of 7,500.
    assert per_conv["supervised_tokens"]["value"] == 3_072
    assert per_conv["yield"]["value"] < 0.5
    assert "upper bound" in per_conv["supervised_tokens"]["source"]
    for layout in (per_turn, per_conv):
        assert all(f["source"] and f["kind"] != "measured" for f in layout.values())
    assert turn["run"]["supervised_tokens"] == TRAIN * 7_500
    assert conv["run"]["supervised_tokens"] == TRAIN * 3_072


def test_per_turn_rows_repeat_each_prompt_through_the_target(plan_27b):
    """Three sequences of a 1,700-token mean prompt + 2,500, each capped at 3,072, against one
    sequence: the turn layout extracts and trains on three times the tokens, and the plan's
    stages and storage count the configured (turn) layout's."""
    turn, conv = (plan_27b["yield"]["layouts"][k]["run"] for k in ("turn", "conversation"))
    assert turn["extract_tokens"] == TRAIN * 3 * 3_072
    assert conv["extract_tokens"] == TRAIN * 3_072
    assert turn["train_tokens"] == 6 * turn["extract_tokens"] > conv["train_tokens"]
    assert plan_27b["storage"]["feature_tokens"] == turn["extract_tokens"]
    b200 = plan_27b["profiles"]["b200x8"]
    assert b200["stages"]["extract"]["seconds"] == pytest.approx(turn["extract_tokens"] / 100_000)


def test_a_supervised_token_costs_less_with_turn_rows_on_the_27b(plan_27b):
    """More tokens through the target, but 2.4 times the supervised tokens: cheaper per token on
    both GPU profiles, in the 27B's feature mode (online) and offline."""
    layouts = plan_27b["yield"]["layouts"]
    for name in ("b200x8", "pro6000x4"):
        turn, conv = (layouts[k]["profiles"][name] for k in ("turn", "conversation"))
        for mode in ("online", "offline"):
            assert turn[mode]["cost_usd"] > conv[mode]["cost_usd"]
            assert turn[mode]["usd_per_m_supervised"] < conv[mode]["usd_per_m_supervised"]
        # The configured layout's cost is the plan's own total.
        total = plan_27b["profiles"][name]["total"]["online"]
        assert turn["online"]["cost_usd"] == total["cost_usd"]
    b200 = layouts["turn"]["profiles"]["b200x8"]["online"]
    assert b200["usd_per_m_supervised"] == pytest.approx(b200["cost_usd"] / (TRAIN * 7_500 / 1e6))


def test_the_conversation_layout_plans_one_sequence(conf, profiles):
    plan = plan_for(conf, profiles, "extract.rows=conversation")
    assert plan["yield"]["configured"] == "conversation"
    assert plan["storage"]["feature_tokens"] == TRAIN * 3_072
    b200 = plan["profiles"]["b200x8"]
    assert b200["stages"]["extract"]["seconds"] == pytest.approx(TRAIN * 3_072 / 100_000)


def test_a_completion_longer_than_max_length_loses_its_end(conf, profiles):
    plan = plan_for(conf, profiles, "extract.max_length=1024")
    per_turn = plan["yield"]["layouts"]["turn"]["per_conversation"]
    assert per_turn["supervised_tokens"]["value"] == 3 * 1_023
    assert per_turn["forward_tokens"]["value"] == 3 * 1_024
    per_conv = plan["yield"]["layouts"]["conversation"]["per_conversation"]
    # The window holds the completion's start and one prompt token, counted as history: the
    # upper bound.
    assert per_conv["supervised_tokens"]["value"] == 1_024


def test_a_measured_yield_replaces_the_estimate_for_its_layout(conf, profiles):
    extract = {**SEED_RUN, "rows": "turn", "generated_tokens": 1_000, "yield": 0.9,
               "num_supervised_tokens": 900}  # fmt: skip
    plan = plan_for(conf, profiles, metrics={"extract": extract})
    per_turn = plan["yield"]["layouts"]["turn"]["per_conversation"]
    assert (per_turn["yield"]["value"], per_turn["yield"]["kind"]) == (0.9, "measured")
    assert "extract.json yield (rows: turn)" in per_turn["yield"]["source"]
    assert per_turn["supervised_tokens"]["value"] == pytest.approx(0.9 * 7_500)
    conv = plan["yield"]["layouts"]["conversation"]["per_conversation"]["yield"]
    assert conv["kind"] == "derived"
    # Another target's report is not used.
    other = {**extract, "model": "Qwen/Qwen3-8B@main"}
    plan = plan_for(conf, profiles, metrics={"extract": other})
    assert plan["yield"]["layouts"]["turn"]["per_conversation"]["yield"]["kind"] == "derived"


def test_the_printed_table_names_both_layouts_and_the_header_the_yield(plan_27b):
    from rich.console import Console

    console = Console(width=80, record=True, file=io.StringIO())
    tables.print_plan(console, plan_27b)
    out = console.export_text()
    assert "rows turn (yield 1.00)" in out
    table = out.split("Data yield", 1)[1].split("Generation per turn", 1)[0]
    assert "online features" in table
    lines = table.splitlines()
    turn = next(line for line in lines if "turn *" in line)
    conv = next(line for line in lines if "conversation " in line and "│" in line)
    assert "1.00" in turn and "6.84 B" in turn and "50.44 B" in turn
    assert "0.41" in conv and "2.80 B" in conv
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out


def test_the_layout_is_checked(conf, profiles):
    composed = params.compose(THE_27B, conf)
    composed["extract"]["rows"] = "document"
    with pytest.raises(ValueError, match="extract.rows must be one of"):
        data_yield.configured_layout(composed)
