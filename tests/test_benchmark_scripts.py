"""The benchmark scripts run, and their built-in equality checks hold, on shapes small enough
for CI. Speed figures are not judged here (benchmarks report them); only the math and the
scripts' own pass/fail logic are."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The scripts' own default is 2 torch threads; the suite gives each test's process one core or
# less (tests/conftest.py), and more threads than that only spin.
THREADS = ["--threads", "1"]


def run_script(name: str, *args: str, out_flag: str = "--json", tmp_path: Path) -> dict:
    """Run benchmarks/<name>.py; it must exit 0 (its own checks pass) and write its JSON."""
    out = tmp_path / f"{name}.json"
    script = REPO / "benchmarks" / f"{name}.py"
    cmd = [sys.executable, str(script), *args, out_flag, str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text(encoding="utf-8"))


def test_blockwise_and_dense_training_attention_agree(tmp_path: Path) -> None:
    report = run_script(
        "train_attention",
        "--seq",
        "384",
        "--anchors",
        "48",
        "--block",
        "8",
        "--steps",
        "1",
        *THREADS,
        tmp_path=tmp_path,
    )
    assert report["outputs_equal"] is True
    assert report["equality"]["hidden_max_abs_diff"] < 1e-4
    assert report["equality"]["grad_max_rel_diff"] < 1e-3
    for run in report["runs"].values():
        assert run["tokens_per_s"] > 0 and run["peak_step_bytes"] > 0
        assert run["attention_tokens_per_s"] > 0 and run["peak_attention_bytes"] > 0


def test_extraction_equals_the_naive_reference(tmp_path: Path) -> None:
    report = run_script(
        "extract_vs_naive",
        "--sequences",
        "12",
        "--layers",
        "8",
        "--median-len",
        "48",
        "--max-len",
        "320",
        "--vocab",
        "4096",
        "--tokens-per-batch",
        "1024",
        *THREADS,
        tmp_path=tmp_path,
    )
    assert report["features_equal"] is True
    assert report["layer_ids"] == [1, 2, 3, 4, 5]  # round(1 + i*(L-4)/(K-1))
    ours, naive = report["runs"]["draftline"], report["runs"]["naive"]
    assert ours["tokens"] == naive["tokens"] > 0
    # Both keep K=5 layers per token: draftline as bf16, the naive one as the model's fp32.
    assert ours["feature_bytes"] * 2 == naive["feature_bytes"]


def test_gpu_check_smoke_on_cpu(tmp_path: Path) -> None:
    report = run_script("gpu_check", "--tiny", out_flag="--out", tmp_path=tmp_path)
    assert report["shape"] == "tiny"
    assert report["extraction"]["tokens"] >= 4000
    assert report["extraction"]["tokens_per_s"] > 0
    assert report["training"]["sequence_tokens_per_s"] > 0
    assert all(x == x for x in report["training"]["loss_first_last"])  # finite, not NaN
    # FLOPs counted by torch on the same work; the plan's fake-tensor peak for the same step.
    assert report["extraction"]["flops"] > 0 and report["training"]["flops"] > 0
    assert report["training"]["planned_peak_bytes"] > 0
    # The step as the GPU profiles train: FSDP2 (over a one-process group here), online features.
    assert report["training"]["sharding"] == "fsdp" and report["training"]["world_size"] == 1
    assert report["training"]["features"] == "online"
    assert report["target_layers"] == 8  # the tiny hybrid: 3 linear + 1 full attention, twice


def test_generation_schedule_smoke(tmp_path: Path) -> None:
    """The project's scheduler on a small simulated engine: every turn generated once in each
    schedule, the continuous one fuller than the old rounds, and the last line as documented."""
    out = tmp_path / "schedule.json"
    script = REPO / "benchmarks" / "generation_schedule.py"
    args = ["--slots", "32", "--shards", "3", "--conversations", "300", "--work-ahead-shards", "2"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--no-work-ahead", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    match = re.fullmatch(r"utilisation continuous=(\d\.\d{3}) rounds=(\d\.\d{3})", last)
    assert match, last
    report = json.loads(out.read_text(encoding="utf-8"))
    runs = {(r["schedule"], r["work_ahead_shards"]): r for r in report["runs"]}
    rounds, alone, ahead = runs[("rounds", 0)], runs[("continuous", 0)], runs[("continuous", 2)]
    assert (float(match[1]), float(match[2])) == (
        round(ahead["utilisation"], 3),
        round(rounds["utilisation"], 3),
    )
    # The same work in every schedule: only the wall time differs.
    assert rounds["turns"] == alone["turns"] == ahead["turns"] > 900
    assert rounds["output_tokens"] == ahead["output_tokens"]
    assert rounds["ideal_s"] == pytest.approx(ahead["ideal_s"])
    assert rounds["utilisation"] < alone["utilisation"] < ahead["utilisation"] <= 1.0
    assert ahead["utilisation"] > rounds["utilisation"] + 0.2
    # Stage 0 streamed all three shards; each rounds stage its own.
    assert ahead["streams"] == [[0, 1, 2]] and rounds["streams"] == [[0], [1], [2]]
    assert ahead["peak_submitted"] <= 32
