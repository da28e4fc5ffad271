"""Where a stage run puts what it measured about itself, apart from its results.

DVC metrics (`metrics/<stage>.json`) hold results that compare runs: counts, loss, accuracy,
tau. They are identical when a stage reruns on the same inputs, so `dvc exp show` stays narrow
and a rerun dirties no tracked file. Timings, hardware, world size and resume state differ on
every run: the whole record goes to `logs/runs/` (git-ignored; `draftline salvage` copies it,
`draftline plan` reads it), and tokens per second, the one figure worth comparing across
hardware, to `metrics/throughput.json`, the only metrics file a rerun changes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from draftline import atomic

RUNS_DIR = Path("logs/runs")
# What the run computed on (`draftline.params.identity`): kept with the results, so
# `draftline plan` uses a file's figures only for the same target, data and drafter.
IDENTITY_KEYS = ("model", "data", "drafter")
THROUGHPUT_PATH = Path("metrics/throughput.json")


def results(record: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The result keys of a full stage record, in the order given, then its identity."""
    return {k: record[k] for k in (*keys, *IDENTITY_KEYS) if k in record}


def add_arguments(parser: argparse.ArgumentParser, stage: str, throughput: bool = False) -> None:
    """--run-log (and --throughput for stages that measure tokens per second)."""
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
    tokens_per_s: float | None = None,
) -> None:
    """Results to --metrics, the full record to --run-log, tokens/s to --throughput."""
    atomic.write_json(args.metrics, results(record, result_keys))
    atomic.write_json(args.run_log, record)
    if getattr(args, "throughput", None):
        record_throughput(args.throughput, stage, tokens_per_s, record)


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
