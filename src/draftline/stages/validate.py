"""Stage `validate`: every generated train shard -> GX verdict, reports, metrics and plots.

Reads only the scalar columns of `data/generated/train/shard-K.parquet` (never the token
lists), for every shard in `data.shard_ids`; a missing shard fails the stage (a fresh clone
with `dvc repro --allow-missing` would otherwise validate a partial folder). The expected row
count comes from `data/curated/summary.json`.

On success writes `data/validated/verdict.json`, which `extract` depends on. On failure prints
the failed expectations, removes any stale verdict and exits 1: DVC records nothing for a
failed stage, and no verdict file exists that a later stage (or a person) could mistake for a
pass. Reports, metrics and plots are written either way, so the failure can be read.

`--shard K` (stage `validate_shard@K`) judges generated train shard K alone, so training can
follow generation shard by shard; how a shard is judged is `draftline.quality.shard_gate`. On
success it writes `data/validated/shards/shard-K.json`; on failure it prints the failed
expectations, removes any stale shard verdict and exits 1. GX results and Data Docs go under
`reports/validate/shards/shard-K/` (a report, not a DVC output, as for the whole run); the
whole run's metrics, plots and reports are left alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draftline.quality import checks
from draftline.quality.report import validate_metrics, write_plots
from draftline.quality.shards import (
    expected_rows,
    expected_shard_rows,
    read_scalar_columns,
    shard_paths,
)
from draftline.runtime import atomic, run_log
from draftline.runtime import params as params_mod

GENERATED_DIR = "data/generated/train"
CURATE_SUMMARY = "data/curated/summary.json"
VERDICT_PATH = "data/validated/verdict.json"
SHARD_VERDICTS = "data/validated/shards"
METRICS_PATH = "metrics/validate.json"
PLOTS_DIR = "plots/validate"
REPORT_DIR = "reports/validate"
SUMMARY_NAME = "summary.json"
RESULT_KEYS = (
    "passed", "num_samples", "num_answered", "failed_checks", "finish_reasons",
    "completion_tokens_mean", "completion_tokens_p50", "completion_tokens_p90",
    "completion_tokens_max", "completion_tokens_total", "supervised_tokens_mean",
    "generated_tokens_total", "supervised_tokens_total", "yield", "sequence_tokens_p50",
    "sequence_tokens_p90", "sequence_tokens_p99", "sequence_tokens_max",
)  # fmt: skip
# What `dvc exp show` compares (the rest is in reports/validate.json).
COMPARE_KEYS = ("passed", "num_samples", "completion_tokens_mean", "supervised_tokens_mean")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--generated", default=GENERATED_DIR, help="generated train shards")
    parser.add_argument("--curate-summary", default=CURATE_SUMMARY, help="curated row counts")
    parser.add_argument("--verdict", default=VERDICT_PATH, help="written only when passing")
    parser.add_argument("--metrics", default=METRICS_PATH, help=f"metrics file ({METRICS_PATH})")
    report = run_log.REPORTS_DIR / "validate.json"
    parser.add_argument("--report", default=str(report), help=f"every result ({report})")
    parser.add_argument("--plots", default=PLOTS_DIR, help=f"folder of plot CSVs ({PLOTS_DIR})")
    parser.add_argument("--reports", default=REPORT_DIR, help="GX results and Data Docs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--shard",
        type=int,
        default=None,
        metavar="K",
        help="validate generated train shard K alone (stage validate_shard@K)",
    )
    parser.add_argument(
        "--shard-verdicts",
        default=SHARD_VERDICTS,
        help=f"folder of shard verdicts, shard-K.json ({SHARD_VERDICTS})",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    if args.shard is not None:
        return run_shard(args, console)
    verdict_path = Path(args.verdict)
    verdict_path.unlink(missing_ok=True)  # a failure below must not leave an old pass behind

    p = params_mod.load(args.params)
    shard_ids = [int(k) for k in p["data"]["shard_ids"]]
    expected = expected_rows(Path(args.curate_summary), shard_ids)
    paths = shard_paths(Path(args.generated), shard_ids)
    table = read_scalar_columns(paths, progress=not args.no_progress, training=p.get("extract"))

    from draftline.quality import validation

    outcome = validation.run_suite(
        table,
        p["quality"],
        thinking=checks.thinking_enabled(p),
        expected_rows=sum(expected.values()),
        report_dir=args.reports,
    )
    shard_counts = table.groupby("shard", sort=True).size().to_dict() if len(table) else {}
    metrics = validate_metrics(table, outcome.results, outcome.passed)
    metrics["shards"] = {
        f"{k:05d}": {"curated": expected[k], "generated": int(shard_counts.get(k, 0))}
        for k in shard_ids
    }
    # Every check's observed value and the per-shard counts in the report (one column each in
    # `dvc exp show` would grow with the shard count); the figures that compare runs as metrics.
    metrics.update(params_mod.identity(p))
    atomic.write_json(Path(args.reports) / SUMMARY_NAME, metrics)
    atomic.write_json(args.metrics, run_log.compared(metrics, COMPARE_KEYS))
    atomic.write_json(args.report, run_log.results(metrics, RESULT_KEYS))
    write_plots(Path(args.plots), table)

    docs = outcome.docs_index
    if not outcome.passed:
        console.print(validation.failure_table(outcome.results))
        for k, counts in metrics["shards"].items():
            if counts["curated"] != counts["generated"]:
                console.print(
                    f"shard {k}: {counts['curated']} curated rows, {counts['generated']} generated"
                )
        failed = len(checks.failures(outcome.results))
        console.print(
            f"[bold red]validate: FAILED[/] {failed} of {len(outcome.results)} checks on "
            f"{len(table)} samples; nothing downstream will run. Results: "
            f"{outcome.results_path}, Data Docs: {docs}"
        )
        return 1
    atomic.write_json(
        verdict_path,
        {
            "passed": True,
            "num_samples": len(table),
            "suite": sorted(validation.SUITES.values()),
            "checks": [r.name for r in outcome.results],
            "shards": [
                {"file": path.name, "num_rows": int(shard_counts.get(k, 0))}
                for k, path in zip(shard_ids, paths, strict=True)
            ],
        },
    )
    console.print(
        f"[bold green]validate: passed[/] {len(outcome.results)} checks on {len(table)} samples "
        f"-> {verdict_path}; Data Docs: {docs}"
    )
    return 0


def run_shard(args: argparse.Namespace, console: Any) -> int:
    """`validate --shard K`: one shard's verdict (see the module docstring)."""
    from draftline.quality import shard_gate, validation

    shard = int(args.shard)
    verdict_path = Path(args.shard_verdicts) / f"shard-{shard}.json"
    verdict_path.unlink(missing_ok=True)  # a failure below must not leave an old pass behind

    p = params_mod.load(args.params)
    expected = expected_shard_rows(Path(args.curate_summary), shard)
    paths = shard_paths(Path(args.generated), [shard])
    table = read_scalar_columns(paths, progress=False, training=p.get("extract"))
    thinking = checks.thinking_enabled(p)
    report_dir = Path(args.reports) / "shards" / f"shard-{shard}"
    outcome = validation.run_suite(
        table, p["quality"], thinking=thinking, expected_rows=expected, report_dir=report_dir
    )
    judgement = shard_gate.judge(
        table, p["quality"], thinking=thinking, expected_rows=expected, results=outcome.results
    )
    verdict = shard_gate.verdict(
        shard, paths[0].name, len(table), judgement, validation.SUITES.values()
    )
    atomic.write_json(report_dir / SUMMARY_NAME, verdict)  # the decision beside GX's results

    where = f"Results: {report_dir / SUMMARY_NAME}, Data Docs: {outcome.docs_index}"
    if not judgement.passed:
        console.print(validation.failure_table(judgement.results))
        if len(table) != expected:
            console.print(f"shard {shard}: {expected} curated rows, {len(table)} generated")
        console.print(
            f"[bold red]validate shard {shard}: FAILED[/] {len(verdict['failed_checks'])} of "
            f"{len(judgement.results)} checks on {len(table)} samples; nothing trains on this "
            f"shard. {where}"
        )
        return 1
    atomic.write_json(verdict_path, verdict)
    noise = f" ({len(judgement.noise)} within sampling noise)" if judgement.noise else ""
    console.print(
        f"[bold green]validate shard {shard}: passed[/] {len(judgement.results)} checks{noise} "
        f"on {len(table)} samples -> {verdict_path}; {where}"
    )
    return 0
