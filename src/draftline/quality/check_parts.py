"""What every quality check is built from: the rows it judges, the `Check` and its result,
the thresholds of `conf/quality`, and the measures several checks share. `checks` declares the
single-turn checks with them, `turns` the multi-turn ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd

# Optional scalar column: the sample's thinking mode (`data.thinking_share`); without it every
# row has the model's mode.
MODE_COLUMN = "thinking"

# Which rows a check judges: every row, the answered ones, or the answered ones of one thinking
# mode (when a table mixes both, each mode is held to its own bounds); for multi-turn tables
# also every turn (of one mode) and every conversation (`draftline.quality.turns`).
Rows = Literal[
    "all",
    "answered",
    "thinking",
    "no_thinking",
    "turns",
    "turns_thinking",
    "turns_no_thinking",
    "conversations",
]


@dataclass(frozen=True)
class CheckResult:
    name: str  # e.g. "supervised_tokens_min"
    description: str  # plain words: what is required
    observed: float | None  # the measured statistic; None when there was nothing to measure
    bound: str  # plain words, e.g. ">= 0.90 of samples"
    passed: bool


@dataclass(frozen=True)
class Check:
    """One check: how to measure it with pandas and how GX expresses the same requirement."""

    name: str
    description: str
    bound: str
    rows: Rows  # which rows it judges (a key of `checks.frames`)
    measure: Callable[[pd.DataFrame], float | None]
    accept: Callable[[float], bool]
    expectation: str  # class name in great_expectations.expectations
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Checks with identical expectation and kwargs share one GX expectation; gx_part is this
    # check's index in its per-part results (quantiles), None when it has the whole result.
    gx_part: int | None = None
    # Reads the same statistic from a GX expectation result (`result` dict) as `measure` gives.
    gx_observed: Callable[[dict[str, Any]], float | None] = lambda r: None

    def evaluate(self, rows: pd.DataFrame) -> CheckResult:
        observed = self.measure(rows) if len(rows) or self.rows == "all" else None
        passed = observed is not None and bool(self.accept(observed))
        return CheckResult(self.name, self.description, observed, self.bound, passed)


def row_modes(table: pd.DataFrame, thinking: bool) -> pd.Series:
    """Per row, whether it was generated with thinking on: its `thinking` value, else the
    model's mode (`thinking`)."""
    if MODE_COLUMN not in table.columns:
        return pd.Series(thinking, index=table.index, dtype=bool)
    return table[MODE_COLUMN].astype("boolean").fillna(thinking).astype(bool)


def at_least_check(
    name: str,
    description: str,
    unit: str,
    rows: Rows,
    column: str,
    min_value: int,
    min_share: float,
) -> Check:
    """At least `min_share` of the rows have `column` >= `min_value`."""
    return Check(
        name=name,
        description=description,
        bound=f">= {min_share:.2f} of {unit}",
        rows=rows,
        measure=lambda t: share_of(t[column] >= min_value),
        accept=lambda v: v >= min_share,
        expectation="ExpectColumnValuesToBeBetween",
        kwargs={"column": column, "min_value": min_value, "mostly": min_share},
        gx_observed=gx_expected_share,
    )


def mode_rows(thinking: bool, mixed: bool) -> list[tuple[Rows, str]]:
    """(rows, name suffix) of the checks held per thinking mode: all answered rows under the
    model's mode, or each mode's rows when the table mixes them (the suffix names the mode that
    is not the model's own)."""
    if not mixed:
        return [("answered", "")]
    return [
        (kind, "" if (kind == "thinking") == thinking else f"_{kind}")
        for kind in ("thinking", "no_thinking")
    ]


class Thresholds:
    """Typed access to `params["quality"]` with errors that name the missing key."""

    def __init__(self, quality: Mapping[str, Any]) -> None:
        self._q = quality

    def _get(self, key: str) -> Any:
        if key not in self._q:
            raise KeyError(f"quality.{key} is missing: set it in conf/quality/ (see default.yaml)")
        return self._q[key]

    def share(self, key: str) -> float:
        value = float(self._get(key))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"quality.{key}={value} must be a share between 0 and 1")
        return value

    def int(self, key: str, rows: str = "answered") -> int:
        return int(self._get(self._for(key, rows)))

    def _for(self, key: str, rows: str) -> str:
        """The key that holds a bound for `rows`: rows without thinking take
        `no_thinking_<key>` when it is set."""
        if rows == "no_thinking" and self._q.get(f"no_thinking_{key}") is not None:
            return f"no_thinking_{key}"
        return key

    def quantile_ranges(self, rows: str = "answered") -> list[tuple[float, tuple[float, float]]]:
        key = self._for("completion_length_quantiles", rows)
        spec = self._get(key)
        quantiles, ranges = list(spec["quantiles"]), list(spec["ranges"])
        if len(quantiles) != len(ranges):
            raise ValueError(
                f"quality.{key}: quantiles and ranges differ in length "
                f"({len(quantiles)} vs {len(ranges)})"
            )
        return [
            (float(q), (float(lo), float(hi)))
            for q, (lo, hi) in zip(quantiles, ranges, strict=True)
        ]


def share_of(mask: pd.Series) -> float:
    return float(mask.mean()) if len(mask) else 0.0


def gx_unexpected_share(result: dict[str, Any]) -> float | None:
    percent = result.get("unexpected_percent_nonmissing", result.get("unexpected_percent"))
    return None if percent is None else float(percent) / 100.0


def gx_expected_share(result: dict[str, Any]) -> float | None:
    share = gx_unexpected_share(result)
    return None if share is None else 1.0 - share
