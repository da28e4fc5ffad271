"""What validate reports beside the verdict: the metrics (every observed statistic, flat enough
for `dvc exp show`) and the CSV plots of supervised tokens and completion lengths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from draftline.quality import checks, turns
from draftline.quality.check_parts import CheckResult
from draftline.runtime import atomic


def validate_metrics(
    table: pd.DataFrame, results: list[CheckResult], passed: bool
) -> dict[str, Any]:
    """Verdict and every observed statistic, flat enough for `dvc exp show`."""
    answered = checks.answered_rows(table)
    lengths = answered["num_completion_tokens"].to_numpy(dtype=np.float64)
    supervised = answered["loss_mask_sum"].to_numpy(dtype=np.float64)
    multi = turns.multi_turn_rows(answered)  # what the per-turn checks' shares are of
    metrics: dict[str, Any] = {
        "passed": passed,
        "num_samples": len(table),
        "num_answered": len(answered),
        "num_multi_turn": len(multi),
        "num_multi_turn_turns": int(multi["turns"].sum()) if len(multi) else 0,
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
    if "generated_tokens" in table.columns:
        metrics.update(training_yield(table))
    return metrics


def training_yield(table: pd.DataFrame) -> dict[str, Any]:
    """What the training sequences keep of what was generated, and how long they are before
    any cut (the longest of each row): the lengths extract.max_length has to hold."""
    generated = int(table["generated_tokens"].sum())
    supervised = generated - int(table["untrained_tokens"].sum())
    longest = table["sequence_tokens"].to_numpy(dtype=np.float64)
    out: dict[str, Any] = {
        "generated_tokens_total": generated,
        "supervised_tokens_total": supervised,
        "yield": _round(supervised / generated) if generated else None,
    }
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        value = np.quantile(longest, q, method="nearest") if len(longest) else None
        out[f"sequence_tokens_{name}"] = None if value is None else int(value)
    out["sequence_tokens_max"] = int(longest.max()) if len(longest) else None
    return out


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
