"""Run logs and the throughput file: the figures that compare runs to metrics, every result
and the identity to reports, the whole record to logs/runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftline.runtime import run_log


def args_for(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        metrics=str(tmp_path / "metrics/extract.json"),
        report=str(tmp_path / "reports/extract.json"),
        run_log=str(tmp_path / "logs/runs/extract.json"),
        throughput=str(tmp_path / "reports/throughput.json"),
    )


def test_compared_figures_to_metrics_results_and_identity_to_the_report(tmp_path: Path):
    """The whole record goes to the run log."""
    args = args_for(tmp_path)
    record = {"num_tokens": 10, "num_packs": 2, "seconds": 2.5, "model": "m", "data": "d",
              "drafter": "x"}  # fmt: skip
    run_log.write(args, "extract", record, ("num_tokens", "num_packs"), ("num_tokens",), 4.0)
    assert json.loads(Path(args.metrics).read_text()) == {"num_tokens": 10}
    report = json.loads(Path(args.report).read_text())
    assert report == {"num_tokens": 10, "num_packs": 2, "model": "m", "data": "d", "drafter": "x"}
    assert json.loads(Path(args.run_log).read_text()) == record
    assert json.loads(Path(args.throughput).read_text())["extract"]["tokens_per_s"] == 4.0


def test_a_drafter_family_other_than_dflash_is_part_of_the_identity(tmp_path: Path):
    """DFlash2 runs say so in their report; DFlash runs' reports are as they were."""
    from draftline.runtime import params

    composed = {"model": {"path": "m", "revision": None}, "data": {"name": "d"}}
    dflash = params.identity({**composed, "drafter": {"name": "dflash_tiny"}})
    dflash2 = params.identity(
        {**composed, "drafter": {"name": "dflash2_tiny", "family": "dflash2"}}
    )
    assert "drafter_family" not in dflash and dflash2["drafter_family"] == "dflash2"
    args = args_for(tmp_path)
    run_log.write(args, "train", {"final_loss": 1.0, **dflash2}, ("final_loss",), (), None)
    assert json.loads(Path(args.report).read_text())["drafter_family"] == "dflash2"


def test_a_run_that_measured_nothing_keeps_the_last_throughput(tmp_path: Path):
    """A rerun that reused every pack measured no speed: the earlier figure stays (it once
    became 0.0 tok/s, which `draftline plan` would read as a stage that never ends)."""
    path = tmp_path / "throughput.json"
    run_log.record_throughput(path, "extract", 1234.5, {"hardware_profile": "cpu"})
    run_log.record_throughput(path, "train", 99.0, {"hardware_profile": "cpu"})
    run_log.record_throughput(path, "extract", None, {"hardware_profile": "cpu"})
    assert json.loads(path.read_text()) == {
        "extract": {"hardware": "cpu", "tokens_per_s": 1234.5},
        "train": {"hardware": "cpu", "tokens_per_s": 99.0},
    }
    run_log.record_throughput(path, "generate", None, {"hardware_profile": "cpu"})
    assert json.loads(path.read_text())["generate"]["tokens_per_s"] is None  # first: recorded


def test_a_run_log_that_measured_nothing_keeps_the_last_rate_of_the_same_run(tmp_path: Path):
    """`draftline plan` reads rates from run logs: an extract rerun that reused every pack once
    turned the measured extract rate into "unknown". The earlier rate stays, marked as such,
    only for the same target, data, drafter and hardware."""
    args = args_for(tmp_path)
    same = {"model": "m", "data": "d", "drafter": "x", "hardware_profile": "cpu"}
    run_log.write(args, "extract", {**same, "tokens_per_s": 500.0}, (), (), 500.0)
    run_log.write(args, "extract", {**same, "tokens_per_s": None, "seconds": 0.3}, (), ())
    kept = json.loads(Path(args.run_log).read_text())
    assert kept["tokens_per_s"] == 500.0 and kept["tokens_per_s_from"] == "an earlier run"
    assert kept["seconds"] == 0.3  # the rest of the record is this run's
    run_log.write(args, "extract", {**same, "tokens_per_s": None}, (), ())
    assert json.loads(Path(args.run_log).read_text())["tokens_per_s"] == 500.0
    other = {**same, "model": "other"}
    run_log.write(args, "extract", {**other, "tokens_per_s": None}, (), ())
    assert json.loads(Path(args.run_log).read_text())["tokens_per_s"] is None
