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
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from draftline.quality import checks
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--generated", default=GENERATED_DIR, help="generated train shards")
    parser.add_argument("--curate-summary", default=CURATE_SUMMARY, help="curated row counts")
    parser.add_argument("--verdict", default=VERDICT_PATH, help="written only when passing")
    parser.add_argument("--metrics", default=METRICS_PATH)
    parser.add_argument("--plots", default=PLOTS_DIR)
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
    atomic.write_json(args.metrics, run_log.results(metrics, RESULT_KEYS))
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


def expected_rows(curate_summary: Path, shard_ids: list[int]) -> dict[int, int]:
    """Curated train rows per shard, from curate's metrics; the shards must match params."""
    if not curate_summary.is_file():
        raise SystemExit(f"validate: {curate_summary} not found: run `dvc repro curate` first")
    data = json.loads(curate_summary.read_text(encoding="utf-8"))
    per_shard = {int(k): int(n) for k, n in (data.get("shard_rows") or {}).items()}
    if sorted(per_shard) != shard_ids:
        raise SystemExit(
            f"validate: {curate_summary} has shards {sorted(per_shard)} but params.yaml has "
            f"data.shard_ids={shard_ids}: run `dvc repro curate` with the current params"
        )
    return per_shard


def shard_paths(folder: Path, shard_ids: list[int]) -> list[Path]:
    """Every expected shard file; exits naming the missing ones (never validates a partial set)."""
    paths = [folder / f"shard-{k}.parquet" for k in shard_ids]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        names = ", ".join(p.name for p in missing)
        stages = " ".join(
            f"generate@{k}" for k, p in zip(shard_ids, paths, strict=True) if p in missing
        )
        raise SystemExit(
            f"validate: {len(missing)} of {len(paths)} generated shards missing in {folder}: "
            f"{names}. Run `dvc repro {stages}` (or `dvc repro --pull` to fetch them; never "
            "`--allow-missing`, which would validate a partial folder)"
        )
    return paths


def read_scalar_columns(paths: list[Path], *, progress: bool = True) -> pd.DataFrame:
    """The scalar columns of checks.COLUMNS from every shard, plus `shard` (its index)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    tables = []
    for path in tqdm(paths, desc="validate: read", unit="shard", disable=not progress):
        names = set(pq.read_schema(path).names)
        wanted = [c for c in checks.COLUMNS if c in names]
        missing = sorted(set(checks.COLUMNS) - names - {"completion_hash"})
        if missing:
            raise SystemExit(
                f"validate: {path} lacks column(s) {missing} of the generated table "
                "(docs/pipeline.md): regenerate it with `dvc repro generate@<shard>`"
            )
        table = pq.read_table(path, columns=wanted)
        if "completion_hash" not in names:
            print(
                f"validate: warning: {path} has no completion_hash column; hashing its "
                "completion_ids (slow: regenerate the shard to add the column)",
                file=sys.stderr,
            )
            table = table.append_column("completion_hash", _hash_completions(path))
        shard = int(path.stem.split("-")[1])
        table = table.append_column("shard", pa.array(np.full(len(table), shard, np.int32)))
        tables.append(table.select([*checks.COLUMNS, "shard"]))
    return pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=checks.COLUMNS)


def _hash_completions(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    hashes: list[str] = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096, columns=["completion_ids"]):
        lists = batch.column(0)
        offsets = lists.offsets.to_numpy()
        values = lists.values.to_numpy(zero_copy_only=False)
        for i in range(len(lists)):
            hashes.append(checks.completion_hash(values[offsets[i] : offsets[i + 1]]))
    return pa.array(hashes, pa.string())


def validate_metrics(
    table: pd.DataFrame, results: list[checks.CheckResult], passed: bool
) -> dict[str, Any]:
    """Verdict and every observed statistic, flat enough for `dvc exp show`."""
    answered = checks.answered_rows(table)
    lengths = answered["num_completion_tokens"].to_numpy(dtype=np.float64)
    supervised = answered["loss_mask_sum"].to_numpy(dtype=np.float64)
    metrics: dict[str, Any] = {
        "passed": passed,
        "num_samples": len(table),
        "num_answered": len(answered),
        "failed_checks": [r.name for r in checks.failures(results)],
        "checks": {r.name: {"observed": r.observed, "passed": r.passed} for r in results},
        "finish_reasons": {k: int(v) for k, v in table["finish_reason"].value_counts().items()},
        "completion_tokens_mean": _round(lengths.mean()) if len(lengths) else None,
        "supervised_tokens_mean": _round(supervised.mean()) if len(supervised) else None,
        "completion_tokens_total": int(lengths.sum()),
    }
    for name, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        value = np.quantile(lengths, q, method="nearest") if len(lengths) else None
        metrics[f"completion_tokens_{name}"] = None if value is None else int(value)
    metrics["completion_tokens_max"] = int(lengths.max()) if len(lengths) else None
    return metrics


def write_plots(folder: Path, table: pd.DataFrame) -> None:
    """Supervised-token histogram and completion-length distribution (CSV for `dvc plots`)."""
    answered = checks.answered_rows(table)
    supervised = answered["loss_mask_sum"].to_numpy(dtype=np.int64)
    edges = histogram_edges(int(supervised.max()) if len(supervised) else 0)
    counts, _ = np.histogram(supervised, bins=edges)
    rows = ["supervised_tokens,samples,share"]
    total = max(len(supervised), 1)
    rows += [
        f"{int(lo)},{int(n)},{n / total:.6f}" for lo, n in zip(edges[:-1], counts, strict=True)
    ]
    atomic.write_text(folder / "supervised_tokens.csv", "\n".join(rows) + "\n")

    lengths = np.sort(answered["num_completion_tokens"].to_numpy(dtype=np.int64))
    rows = ["share_of_samples,completion_tokens"]
    if len(lengths):
        for pct in range(101):
            value = np.quantile(lengths, pct / 100, method="nearest")
            rows.append(f"{pct / 100:.2f},{int(value)}")
    atomic.write_text(folder / "completion_tokens.csv", "\n".join(rows) + "\n")


def histogram_edges(max_value: int) -> np.ndarray:
    """Bins one token wide up to 64 (a spike at 6 stays visible), then 48 log-spaced bins."""
    fine = np.arange(0, 65)
    if max_value < 64:
        return np.arange(0, max(max_value, 1) + 2)
    coarse = np.unique(np.geomspace(65, max_value + 1, 48).astype(np.int64))
    edges = np.unique(np.concatenate([fine, coarse, [max_value + 1]]))
    return edges


def _round(value: float) -> float:
    return round(float(value), 2)
