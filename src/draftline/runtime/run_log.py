"""Where a stage run puts what it measured about itself, apart from its results.

Three places, by who reads them:
- `metrics/<stage>.json`, the DVC metrics: only the figures that compare runs (sizes, losses,
  tau), so `dvc exp show` shows them first and a handful per stage.
- `reports/<stage>.json` (git-tracked, not listed by DVC): every result of the run and what it
  ran on (model, data, drafter), which `draftline plan` checks before using a figure.
Both are identical when a stage reruns on the same inputs, so a rerun dirties no tracked file.
- `logs/runs/<stage>.json` (git-ignored; `draftline salvage` copies it, `draftline plan` reads
  it): the whole record with timings, hardware, world size and resume state, which differ on
  every run. Tokens per second, the one timing worth comparing across hardware, also goes to
  `reports/throughput.json`, the only tracked file a rerun changes.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from draftline.runtime import atomic

RUNS_DIR = Path("logs/runs")
REPORTS_DIR = Path("reports")
# What the run computed on (`draftline.runtime.params.identity`): kept with the results, so
# `draftline plan` uses a file's figures only for the same target, data and drafter.
IDENTITY_KEYS = ("model", "data", "drafter")
# Reports also name the drafter family of a run of another family than DFlash (only those
# records hold it, `params.identity`; the drafter profile name already tells runs apart).
REPORT_IDENTITY_KEYS = (*IDENTITY_KEYS, "drafter_family")
THROUGHPUT_PATH = REPORTS_DIR / "throughput.json"


def results(record: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The result keys of a full stage record, in the order given, then its identity."""
    return {k: record[k] for k in (*keys, *REPORT_IDENTITY_KEYS) if k in record}


def compared(record: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The keys of a record that compare runs, in the order given, and below them in sorted
    order (no identity: the params of the run say what it ran on). `dvc exp show` lists a
    metrics file's keys in the file's order, so the order given is the order of its columns."""
    return {k: _sorted_below(record[k]) for k in keys if k in record}


def _sorted_below(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_below(value[k]) for k in sorted(value)}
    return value


def add_arguments(parser: argparse.ArgumentParser, stage: str, throughput: bool = False) -> None:
    """--report and --run-log (and --throughput for stages that measure tokens per second)."""
    report = REPORTS_DIR / f"{stage}.json"
    parser.add_argument("--report", default=str(report), help=f"every result ({report})")
    default = RUNS_DIR / f"{stage}.json"
    parser.add_argument("--run-log", default=str(default), help=f"run record ({default})")
    if throughput:
        parser.add_argument(
            "--throughput", default=str(THROUGHPUT_PATH), help=f"tokens/s ({THROUGHPUT_PATH})"
        )


def write(
    args: argparse.Namespace,
    stage: str,
    record: dict[str, Any],
    result_keys: Iterable[str],
    compare_keys: Iterable[str],
    tokens_per_s: float | None = None,
) -> None:
    """The figures that compare runs to --metrics, the results and identity to --report, the
    full record to --run-log, tokens/s to --throughput."""
    if args.metrics:  # None: a part of a stage (one shard) whose figures compare no runs
        atomic.write_json(args.metrics, compared(record, compare_keys), sort_keys=False)
    atomic.write_json(args.report, results(record, result_keys))
    if tokens_per_s is None and "tokens_per_s" in record:
        record = {**record, **_earlier_rate(args.run_log, record)}
    atomic.write_json(args.run_log, record)
    if getattr(args, "throughput", None):
        record_throughput(args.throughput, stage, tokens_per_s, record)


def _earlier_rate(run_log: str | Path, record: dict[str, Any]) -> dict[str, Any]:
    """The rate the last run log measured, for a run that measured none (every output reused),
    when it ran on the same target, data, drafter and hardware: `draftline plan` reads rates
    from run logs, and a rerun that did no work must not make a measured stage unknown."""
    try:
        earlier = json.loads(Path(run_log).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    same = all(earlier.get(k) == record.get(k) for k in (*IDENTITY_KEYS, "hardware_profile"))
    rate = number_at(earlier, "tokens_per_s")
    if not same or rate is None:
        return {}
    return {
        "tokens_per_s": rate,
        "tokens_per_s_from": earlier.get("tokens_per_s_from", "an earlier run"),
    }


def record_throughput(
    path: str | Path, stage: str, tokens_per_s: float | None, record: dict[str, Any]
) -> None:
    """Set `stage`'s entry of the throughput file, keeping the other stages' entries. A run
    that measured nothing (`tokens_per_s` None: every output reused) keeps the last figure."""
    path = Path(path)
    current: dict[str, Any] = {}
    if path.is_file():
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            current = {}  # a torn or hand-edited file: start it again
    if tokens_per_s is None and stage in current:
        return
    current[stage] = {
        "tokens_per_s": None if tokens_per_s is None else round(float(tokens_per_s), 1),
        "hardware": record.get("hardware_profile"),
    }
    atomic.write_json(path, dict(sorted(current.items())))


def number_at(data: dict[str, Any] | None, *paths: str) -> float | None:
    """The first numeric value at any of the dotted `paths` (e.g. "completion_tokens.mean")."""
    for path in paths:
        node: Any = data
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            return float(node)
    return None


def generation_rate(shards: list[dict[str, Any]]) -> float | None:
    """Whole-node output tok/s over the shards' wall time.

    Shards run one after another against all of a node's engines, so wall times add up. This
    run's own tokens and time (`generated_output_tokens` / `run_wall_s`) come first: a resumed
    shard's earlier part may have run on another node. Then totals, then the shards' rates.
    """
    for tokens_key, wall_key in (
        ("generated_output_tokens", "run_wall_s"),
        ("output_tokens", "wall_s"),
    ):
        pairs = [(number_at(m, tokens_key), number_at(m, wall_key)) for m in shards]
        if pairs and all(tok is not None and wall for tok, wall in pairs):
            tokens, wall = sum(tok for tok, _ in pairs), sum(wall for _, wall in pairs)
            if tokens:
                return tokens / wall
    weighted = [
        (number_at(m, "output_tokens") or 0, number_at(m, "output_tok_s"))
        for m in shards
        if number_at(m, "output_tok_s")
    ]
    weight = sum(w for w, _ in weighted)
    if weight:
        return sum(w * r for w, r in weighted) / weight
    rates = [r for _, r in weighted]
    return sum(rates) / len(rates) if rates else None
