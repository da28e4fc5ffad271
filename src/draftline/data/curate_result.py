"""What a curate run did: counts per shard and reject reason, prompt lengths, the files read;
the figures of its metrics and of `data/curated/summary.json`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from draftline.data.conversations import REASONS

EXAMPLE_RAW_CHARS = 300  # of a rejected row, in messages and examples


@dataclass
class CurateResult:
    """What a run did: counts for metrics, and an example row per reject reason for messages."""

    rows_read: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    shard_rows: list[int] = field(default_factory=list)
    # Assistant turns the target writes per shard with data.regenerate_turns=all: training
    # sequences of the `turn` layout (extract.rows), which fix the step count before generation.
    shard_turns: list[int] = field(default_factory=list)
    eval_rows: int = 0
    prompt_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    examples: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: int = 0
    files_skipped: list[str] = field(default_factory=list)
    workers: int = 0

    @property
    def rows_rejected(self) -> int:
        return sum(self.rejected.values())

    @property
    def rows_kept(self) -> int:
        return self.rows_read - self.rows_rejected

    @property
    def reject_rate(self) -> float:
        return self.rows_rejected / self.rows_read if self.rows_read else 0.0

    def metrics(self) -> dict[str, Any]:
        tokens = self.prompt_tokens
        quantiles = {}
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            quantiles[name] = (
                int(np.quantile(tokens, q, method="inverted_cdf")) if len(tokens) else 0
            )
        quantiles["max"] = int(tokens.max()) if len(tokens) else 0
        quantiles["mean"] = round(float(tokens.mean()), 2) if len(tokens) else 0.0
        return {
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rows_rejected": self.rows_rejected,
            "reject_rate": round(self.reject_rate, 6),
            "rejected_by_reason": {r: self.rejected.get(r, 0) for r in REASONS},
            "train_rows": sum(self.shard_rows),
            "train_turns": sum(self.shard_turns),
            "eval_rows": self.eval_rows,
            "shard_rows": {f"{k:05d}": n for k, n in enumerate(self.shard_rows)},
            "shard_rows_min": min(self.shard_rows, default=0),
            "shard_rows_max": max(self.shard_rows, default=0),
            "prompt_tokens": quantiles,
            "files_read": self.files,
            "files_skipped": len(self.files_skipped),
        }

    def reject_summary(self, top: int = 3) -> str:
        """Top reasons with counts and one example each, for the threshold failure message."""
        lines = []
        for reason, count in self.rejected.most_common(top):
            ex = self.examples[reason]
            raw = ex["raw"][:EXAMPLE_RAW_CHARS]
            lines.append(
                f"  {reason}: {count} rows, e.g. {ex['source']}:{ex['line']}: {ex['detail']}\n"
                f"      {raw}"
            )
        return "\n".join(lines)
