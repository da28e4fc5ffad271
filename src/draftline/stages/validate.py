"""Stage `validate`: every generated train shard -> GX verdict, reports, metrics and plots.

Reads only the scalar columns of `data/generated/train/shard-K.parquet` (never the token
lists), for every shard in `data.shard_ids`; a missing shard fails the stage (a fresh clone
with `dvc repro --allow-missing` would otherwise validate a partial folder). The expected row
count comes from `data/curated/summary.json`.

On success writes `data/validated/verdict.json`, which `extract` depends on. On failure prints
the failed expectations, removes any stale verdict and exits 1: DVC records nothing for a
failed stage, and no verdict file exists that a later stage (or a person) could mistake for a
pass. Reports, metrics and plots are written either way, so the failure can be read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.quality import checks
from draftline.quality.report import validate_metrics, write_plots
from draftline.quality.shards import expected_rows, read_scalar_columns, shard_paths
from draftline.runtime import atomic, run_log
from draftline.runtime import params as params_mod

GENERATED_DIR = "data/generated/train"
CURATE_SUMMARY = "data/curated/summary.json"
VERDICT_PATH = "data/validated/verdict.json"
METRICS_PATH = "metrics/validate.json"
PLOTS_DIR = "plots/validate"
REPORT_DIR = "reports/validate"
SUMMARY_NAME = "summary.json"
RESULT_KEYS = (
    "passed", "num_samples", "num_answered", "failed_checks", "finish_reasons",
    "completion_tokens_mean", "completion_tokens_p50", "completion_tokens_p90",
    "completion_tokens_max", "completion_tokens_total", "supervised_tokens_mean",
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


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    verdict_path = Path(args.verdict)
    verdict_path.unlink(missing_ok=True)  # a failure below must not leave an old pass behind

    p = params_mod.load(args.params)
    shard_ids = [int(k) for k in p["data"]["shard_ids"]]
    expected = expected_rows(Path(args.curate_summary), shard_ids)
    paths = shard_paths(Path(args.generated), shard_ids)
    table = read_scalar_columns(paths, progress=not args.no_progress)

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
