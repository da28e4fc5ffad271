"""`draftline plan`'s Two-nodes view: the flow shop, the pairs it picks, and its sequential
figures against the plan's own totals."""

from __future__ import annotations

import copy
import io
import random
from typing import Any

import pytest

from draftline import cli
from draftline.ops.plan import build, tables, topology
from draftline.runtime import hardware, params

SEED = ["model=qwen3_6_27b", "data=sharegpt", "drafter=dflash_b16"]
SEED_SIZES = {"samples": 914_000, "completion_tokens": 2_500, "prompt_tokens": 500}


def simulate(n: int, first: float, second: float) -> float:
    """Event by event: job k leaves machine 1 at (k + 1) x first, and machine 2 starts it once
    both it has arrived and machine 2 is free."""
    done = 0.0
    for k in range(n):
        done = max((k + 1) * first, done) + second
    return done


@pytest.mark.parametrize(
    ("n", "first", "second", "expected"),
    [
        (4, 3.0, 2.0, 14.0),  # machine 1 the bottleneck: 3 + 2 + 3 x 3
        (4, 2.0, 3.0, 14.0),  # machine 2 the bottleneck: 2 + 3 + 3 x 3
        (1, 5.0, 7.0, 12.0),  # one job: nothing overlaps
        (3, 2.0, 2.0, 8.0),
    ],
)
def test_flow_shop_end_by_hand(n, first, second, expected):
    assert topology.flow_shop_end(n, first, second) == expected
    assert simulate(n, first, second) == expected


def test_flow_shop_end_matches_a_simulation():
    rng = random.Random(0)
    for _ in range(200):
        n, a, b = rng.randint(1, 70), rng.uniform(0.1, 10), rng.uniform(0.1, 10)
        assert topology.flow_shop_end(n, a, b) == pytest.approx(simulate(n, a, b))


def fake_plan(features: str, epochs: int, g_stages: dict, t_stages: dict) -> dict[str, Any]:
    """A plan as `build.build_plan` shapes it, with round figures to check by hand."""

    def profile(stages: dict[str, float], price: float) -> dict[str, Any]:
        full = {s: {"seconds": stages.get(s)} for s in build.STAGES}
        parts = ("generate", "extract", "train_offline")
        if features == "online":
            parts = ("generate", "train_online")
        total = sum(stages.get(p, 0.0) for p in parts)
        mode = {"seconds": total, "cost_usd": total / 3600 * price}
        return {"price_per_hour": price, "stages": full, "total": {features: mode}}

    return {
        "features": features,
        "drafter": {"epochs": epochs},
        "profiles": {"gen": profile(g_stages, 36.0), "train": profile(t_stages, 18.0)},
    }


def test_generation_the_bottleneck_offline():
    # n = 4: g = 1,000 s; e = 200 s, t1 = 7,200 / 3 / 4 = 600 s; e + t1 = 800 < g.
    plan = fake_plan(
        "offline",
        3,
        {"generate": 4000.0, "extract": 1.0, "train_offline": 1.0},
        {"generate": 9e9, "extract": 800.0, "train_offline": 7200.0},
    )
    out = topology.two_nodes(plan, 4, "gen", "train")
    assert out["per_shard"] == {
        "generate_s": 1000.0,
        "extract_s": 200.0,
        "train_first_epoch_s": 600.0,
    }
    assert out["bottleneck"] == "generate"
    over = out["overlapped"]
    assert over["chain_s"] == 1000 + 800 + 3 * 1000
    assert over["remaining_train_s"] == 4800.0  # two of three epochs of 7,200 s
    assert over["seconds"] == 9600.0
    assert over["generate_busy_s"] == 4000.0 and over["train_busy_s"] == 8000.0
    # T waits for the first shard (1,000 s), then 200 s before each of the 3 others.
    assert over["train_idle_s"] == 1600.0 and over["train_idle_share"] == pytest.approx(1 / 6)
    # G for 4,000 s at $36/h, T for the whole 9,600 s at $18/h.
    assert over["cost_usd"] == pytest.approx(40.0 + 48.0)
    then = out["generate_then_train"]
    assert then["seconds"] == 4000 + 800 + 7200 and then["train_idle_s"] == 0.0
    assert then["cost_usd"] == pytest.approx(40.0 + 40.0)  # T rented when generation ends
    alone = out["generate_node_alone"]
    assert alone["seconds"] == 4002.0 and alone["train_busy_s"] is None


def test_training_the_bottleneck_online_ignores_extraction():
    # n = 4: g = 500 s; online, so e = 0 whatever the extract figure; t1 = 12,000 / 2 / 4.
    plan = fake_plan(
        "online",
        2,
        {"generate": 2000.0, "train_online": 1.0},
        {"generate": 9e9, "extract": 99_999.0, "train_online": 12_000.0},
    )
    out = topology.two_nodes(plan, 4, "gen", "train")
    assert out["bottleneck"] == "train"
    over = out["overlapped"]
    assert over["chain_s"] == 500 + 1500 + 3 * 1500
    assert over["seconds"] == 6500 + 6000
    assert over["generator_early_s"] == 6500 - 2000  # shards queue; G given back early
    assert over["train_idle_s"] == 500.0  # the first shard's wait only
    assert out["generate_then_train"]["seconds"] == 2000 + 12_000


def test_one_shard_overlaps_nothing():
    plan = fake_plan(
        "offline",
        6,
        {"generate": 3000.0, "extract": 1.0, "train_offline": 1.0},
        {"generate": 1.0, "extract": 500.0, "train_offline": 6000.0},
    )
    out = topology.two_nodes(plan, 1, "gen", "train")
    assert out["overlapped"]["seconds"] == out["generate_then_train"]["seconds"] == 9500.0
    # The same wall time, but T is held through generation: it costs that much more.
    extra = out["overlapped"]["cost_usd"] - out["generate_then_train"]["cost_usd"]
    assert extra == pytest.approx(3000 / 3600 * 18.0)


@pytest.fixture(scope="module")
def profiles(repo_root) -> dict[str, dict[str, Any]]:
    return hardware.load_profiles(repo_root / "conf")


@pytest.fixture(scope="module", params=["offline", "online"])
def seed(request, repo_root, profiles) -> tuple[dict[str, Any], dict[str, Any]]:
    composed = params.compose([*SEED, f"extract.features={request.param}"], repo_root / "conf")
    return composed, build.build_plan(composed, profiles, {}, **SEED_SIZES)


def test_the_sequential_figures_are_the_plans_totals(seed, profiles):
    composed, plan = seed
    topology.add_two_nodes(plan, composed, profiles)
    (pair,) = plan["two_nodes"]
    assert (pair["generate_on"], pair["train_on"]) == ("b200x8", "pro6000x4")
    assert pair["shards"] == composed["data"]["num_shards"] == 64
    b200, pro = plan["profiles"]["b200x8"], plan["profiles"]["pro6000x4"]
    features = plan["features"]
    alone = pair["generate_node_alone"]
    assert alone["seconds"] == b200["total"][features]["seconds"]
    assert alone["cost_usd"] == b200["total"][features]["cost_usd"]
    gen = b200["stages"]["generate"]["seconds"]
    train = pro["stages"][f"train_{features}"]["seconds"]
    extract = pro["stages"]["extract"]["seconds"] if features == "offline" else 0.0
    assert pair["generate_then_train"]["seconds"] == pytest.approx(gen + extract + train)
    over = pair["overlapped"]
    # Overlapping saves at most generation minus one shard of it; it never adds time.
    assert pair["generate_then_train"]["seconds"] - gen * (1 - 1 / 64) <= over["seconds"]
    assert over["seconds"] < pair["generate_then_train"]["seconds"]


def test_default_pair_is_the_fastest_generator_with_each_other_profile(seed, profiles):
    _, plan = seed
    assert topology.choose_pairs(plan, profiles) == [("b200x8", "pro6000x4")]
    assert topology.choose_pairs(plan, profiles, train_on="b200x8") == [("pro6000x4", "b200x8")]
    assert topology.choose_pairs(plan, profiles, generate_on="pro6000x4") == [
        ("pro6000x4", "b200x8")
    ]
    # Two nodes of one profile, when asked for.
    assert topology.choose_pairs(plan, profiles, "b200x8", "b200x8") == [("b200x8", "b200x8")]
    # Make the PRO 6000 the faster generator: it becomes the default generator.
    faster = copy.deepcopy(plan)
    faster["profiles"]["pro6000x4"]["stages"]["generate"]["seconds"] = 1.0
    assert topology.choose_pairs(faster, profiles) == [("pro6000x4", "b200x8")]
    # One GPU profile with figures: nothing to overlap, nothing shown.
    one = {k: v for k, v in profiles.items() if k != "pro6000x4"}
    assert topology.choose_pairs(plan, one) == []


def test_profiles_without_gpus_are_no_default_node(seed, profiles):
    """A CPU profile with figures (measured on a run there) is not offered as a second node."""
    _, plan = seed
    measured = copy.deepcopy(plan)
    for stage in measured["profiles"]["cpu"]["stages"].values():
        stage["seconds"] = 1.0
    assert topology.choose_pairs(measured, profiles) == [("b200x8", "pro6000x4")]
    cpus = {k: v for k, v in profiles.items() if not v.get("gpu")}
    assert topology.choose_pairs(measured, cpus) == []


@pytest.mark.parametrize(
    ("flag", "name", "error"),
    [
        ("--generate-on", "b300x8", "no such profile in conf/hardware/ (choose from b200x8, cpu,"),
        ("--train-on", "b300x8", "--train-on b300x8: no such profile"),
        ("--train-on", "cpu", "no online training figure for this target on cpu"),
        ("--generate-on", "vllm_cpu", "profiles with one: b200x8, pro6000x4"),
    ],
)
def test_cli_names_the_choices(repo_root, flag, name, error):
    conf = str(repo_root / "conf")
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", *SEED, "--config-dir", conf, "--no-memory", flag, name])
    message = str(exc.value.code)
    assert error in message and "\n" not in message


def test_the_table_fits_80_columns_and_says_who_waits(seed, profiles):
    from rich.console import Console

    composed, plan = seed
    topology.add_two_nodes(plan, composed, profiles)
    (pair,) = plan["two_nodes"]
    for width in (80, 120):
        console = Console(width=width, record=True, file=io.StringIO())
        tables.print_two_nodes(console, pair)
        out = console.export_text()
        assert max(len(line) for line in out.splitlines()) <= width, out
        assert "…" not in out
        for key in tables.TWO_NODE_VIEWS:
            assert tables.duration(pair[key]["seconds"]) in out
            assert tables.money(pair[key]["cost_usd"]) in out
        # The generator is 1.5 h a shard, the PRO 6000 2.3 h: T is the bottleneck.
        assert "shards queue" in out and "training is the bottleneck" in out
        assert "b200x8 generates a shard in 1.5 h" in " ".join(out.split())


def test_the_plan_beside_a_measured_one_keeps_the_pairs_it_has_figures_for(seed, profiles):
    """--from-metrics: the estimate-only plan shows the measured plan's pairs, less those whose
    profile has figures only from measurements there (a CPU run, say)."""
    composed, plan = seed
    pairs = [("b200x8", "pro6000x4"), ("b200x8", "cpu")]
    shown = topology.add_two_nodes(copy.deepcopy(plan), composed, profiles, pairs=pairs)
    assert [(p["generate_on"], p["train_on"]) for p in shown["two_nodes"]] == [pairs[0]]
