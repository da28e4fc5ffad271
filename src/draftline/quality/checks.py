"""The quality checks of generated data: one definition for the `validate` stage and the online
guard in `generate`.

Each check is declared once, as a `Check`: a pandas measurement over the scalar columns of the
generated table (docs/pipeline.md), the bound it must meet, and the equivalent Great Expectations
expectation (class name and arguments, so this module never imports GX). `run_checks` evaluates
the measurements directly (fast, for the guard); `draftline.quality.validation` turns the same
`Check`s into a GX suite.

Rows are split in two: every row (ids, row count, failed requests) and the *answered* rows, whose
request did not fail (`finish_reason != "error"`): the completion checks judge only those, so a
failed request counts once, against the error bound, and not again as an empty completion.
Multi-turn conversations are also judged per turn and per conversation
(`draftline.quality.turns`): the scalar columns describe only their last turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

# The scalar columns the checks read (docs/pipeline.md, "Generated table").
COLUMNS = (
    "id",
    "num_completion_tokens",
    "finish_reason",
    "error",
    "has_think_block",
    "answer_tokens",
    "loss_mask_sum",
    "completion_hash",
)

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
    rows: Rows  # which rows it judges (a key of `frames`)
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


def completion_hash(completion_ids: Sequence[int] | np.ndarray) -> str:
    """Fingerprint of a completion: 16 hex chars of sha256 over its ids as little-endian int32.

    `generate` stores it as the scalar column `completion_hash`, so validation can count unique
    completions without reading the token lists.
    """
    data = np.asarray(completion_ids, dtype="<i4").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


# Finish reasons of a sample cut short: at max_new_tokens, or by a full context length.
TRUNCATED = ("length", "context")


def thinking_enabled(params: Mapping[str, Any]) -> bool:
    """Whether the target's chat template has thinking on (`model.chat_template_kwargs`)."""
    kwargs = (params.get("model") or {}).get("chat_template_kwargs") or {}
    return bool(kwargs.get("enable_thinking", False))


def answered_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Rows whose request did not fail: the ones that have a completion to judge."""
    return table[table["finish_reason"] != "error"]


def row_modes(table: pd.DataFrame, thinking: bool) -> pd.Series:
    """Per row, whether it was generated with thinking on: its `thinking` value, else the
    model's mode (`thinking`)."""
    if MODE_COLUMN not in table.columns:
        return pd.Series(thinking, index=table.index, dtype=bool)
    return table[MODE_COLUMN].astype("boolean").fillna(thinking).astype(bool)


def frames(table: pd.DataFrame, thinking: bool) -> dict[str, pd.DataFrame]:
    """The rows each kind of check judges (see `Rows`)."""
    from draftline.quality import turns  # it builds on this module: imported late, no cycle

    answered = answered_rows(table)
    mode = row_modes(answered, thinking)
    return {
        "all": table,
        "answered": answered,
        "thinking": answered[mode],
        "no_thinking": answered[~mode],
        **turns.frames(answered, thinking),
    }


def define_checks(
    table: pd.DataFrame,
    quality: Mapping[str, Any],
    *,
    thinking: bool,
    expected_rows: int | None = None,
) -> list[Check]:
    """The checks for this table under the thresholds of `conf/quality` (`params["quality"]`).

    `table` is needed only for data-dependent arguments (the most common supervised-token count)
    and the thinking modes it holds. The row-count check is defined only when `expected_rows` is
    given (validate knows the curated count; the online guard does not). The think-block check
    only for rows with thinking on. A table that mixes both modes (`data.thinking_share`) holds
    each to its own bounds: the think block for thinking rows only, and completion lengths per
    mode (`no_thinking_completion_length_quantiles` for the rows without thinking); the checks
    of the mode that is not the model's own carry its name as a suffix. Multi-turn tables add the
    per-turn and per-conversation checks of `draftline.quality.turns`.
    """
    from draftline.quality import turns

    q = Thresholds(quality)
    by_rows = frames(table, thinking)
    answered = by_rows["answered"]
    mixed = bool(len(by_rows["thinking"])) and bool(len(by_rows["no_thinking"]))
    checks: list[Check] = []

    if expected_rows is not None:
        checks.append(
            Check(
                name="row_count",
                description="every curated sample has a generated row (nothing lost silently)",
                bound=f"== {expected_rows} rows (the curated train count)",
                rows="all",
                measure=lambda t: float(len(t)),
                accept=lambda v, n=expected_rows: v == n,
                expectation="ExpectTableRowCountToEqual",
                kwargs={"value": int(expected_rows)},
                gx_observed=lambda r: _float(r.get("observed_value")),
            )
        )
    checks.append(
        Check(
            name="unique_ids",
            description="every sample id appears once",
            bound="== 0 rows with a repeated id",
            rows="all",
            measure=lambda t: float(t["id"].duplicated(keep=False).sum()),
            accept=lambda v: v == 0,
            expectation="ExpectColumnValuesToBeUnique",
            kwargs={"column": "id"},
            gx_observed=lambda r: _float(r.get("unexpected_count")),
        )
    )
    max_error = q.share("max_error_share")
    checks.append(
        Check(
            name="error_share",
            description="requests that failed after retries (finish_reason=error)",
            bound=f"<= {max_error:.2f} of samples",
            rows="all",
            measure=lambda t: share_of(t["finish_reason"] == "error"),
            accept=lambda v: v <= max_error,
            expectation="ExpectColumnValuesToNotBeInSet",
            kwargs={"column": "finish_reason", "value_set": ["error"], "mostly": 1 - max_error},
            gx_observed=_gx_unexpected_share,
        )
    )

    min_supervised = q.share("min_share_supervised")
    for kind, suffix in mode_rows(thinking, mixed):
        min_tokens = q.int("min_supervised_tokens", kind)
        checks.append(
            at_least_check(
                f"supervised_tokens_min{suffix}",
                f"answered samples with at least {min_tokens} supervised tokens "
                "(loss_mask_sum" + (f", {suffix[1:].replace('_', ' ')} rows)" if suffix else ")"),
                "answered samples",
                kind,
                "loss_mask_sum",
                min_tokens,
                min_supervised,
            )
        )
    mode = _mode(answered["loss_mask_sum"])
    max_mode = q.share("max_mode_share")
    checks.append(
        Check(
            name="supervised_tokens_mode_share",
            description="share of answered samples with the single most common supervised-token "
            f"count ({mode if mode is not None else 'none'})",
            bound=f"<= {max_mode:.2f} of answered samples",
            rows="answered",
            measure=lambda t: share_of(t["loss_mask_sum"] == mode),
            accept=lambda v: v <= max_mode,
            expectation="ExpectColumnValuesToNotBeInSet",
            kwargs={
                "column": "loss_mask_sum",
                "value_set": [] if mode is None else [mode],
                "mostly": 1 - max_mode,
            },
            gx_observed=_gx_unexpected_share,
        )
    )
    min_unique = q.share("min_unique_completion_share")
    checks.append(
        Check(
            name="unique_completions",
            description="share of answered samples whose completion is unique (completion_hash)",
            bound=f">= {min_unique:.2f} of answered samples",
            rows="answered",
            measure=lambda t: t["completion_hash"].nunique() / len(t),
            accept=lambda v: v >= min_unique,
            expectation="ExpectColumnProportionOfUniqueValuesToBeBetween",
            kwargs={"column": "completion_hash", "min_value": min_unique},
            gx_observed=lambda r: _float(r.get("observed_value")),
        )
    )
    max_truncated = q.share("max_truncated_share")
    checks.append(
        Check(
            name="truncated_share",
            description="answered samples cut off at max_new_tokens (finish_reason=length) or "
            "by a full context (finish_reason=context: a turn cut at what its prompt left of "
            "the context length, or no room left for the next turn)",
            bound=f"<= {max_truncated:.2f} of answered samples",
            rows="answered",
            measure=lambda t: share_of(t["finish_reason"].isin(TRUNCATED)),
            accept=lambda v: v <= max_truncated,
            expectation="ExpectColumnValuesToNotBeInSet",
            kwargs={
                "column": "finish_reason",
                "value_set": list(TRUNCATED),
                "mostly": 1 - max_truncated,
            },
            gx_observed=_gx_unexpected_share,
        )
    )
    if thinking or mixed:
        min_think = q.share("min_think_block_share")
        suffix = "" if thinking else "_thinking"
        checks.append(
            Check(
                name=f"think_block_share{suffix}",
                description="answered samples with a <think>...</think> block (thinking is on)",
                bound=f">= {min_think:.2f} of answered samples",
                rows="thinking" if mixed else "answered",
                measure=lambda t: share_of(t["has_think_block"].astype(bool)),
                accept=lambda v: v >= min_think,
                expectation="ExpectColumnValuesToBeInSet",
                kwargs={"column": "has_think_block", "value_set": [True], "mostly": min_think},
                gx_observed=gx_expected_share,
            )
        )
    min_answer = q.share("min_answer_share")
    after = "after </think> " if thinking or mixed else ""
    checks.append(
        Check(
            name="answer_share",
            description=f"answered samples with a non-empty answer {after}(answer_tokens >= 1)",
            bound=f">= {min_answer:.2f} of answered samples",
            rows="answered",
            measure=lambda t: share_of(t["answer_tokens"] >= 1),
            accept=lambda v: v >= min_answer,
            expectation="ExpectColumnValuesToBeBetween",
            kwargs={"column": "answer_tokens", "min_value": 1, "mostly": min_answer},
            gx_observed=gx_expected_share,
        )
    )
    for kind, suffix in mode_rows(thinking, mixed):
        checks += _length_checks(q.quantile_ranges(kind), kind, suffix)
    return checks + turns.define_checks(by_rows, q, thinking=thinking)


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


def _length_checks(
    ranges: list[tuple[float, tuple[float, float]]], rows: Rows, suffix: str
) -> list[Check]:
    """Completion-length quantiles of `rows`. One GX expectation for all of them (GX 1.24.1
    computes only the first of several quantile expectations on one column in a suite); each
    check reads its own part."""
    quantile_kwargs = {
        "column": "num_completion_tokens",
        "quantile_ranges": {
            "quantiles": [quantile for quantile, _ in ranges],
            "value_ranges": [[low, high] for _, (low, high) in ranges],
        },
    }
    mode = f", {suffix[1:].replace('_', ' ')} rows" if suffix else ""
    return [
        Check(
            name=f"completion_tokens_q{round(quantile * 100):02d}{suffix}",
            description=f"{quantile:g} quantile of completion length (num_completion_tokens{mode})",
            bound=f"between {low:g} and {high:g} tokens",
            rows=rows,
            measure=lambda t, q_=quantile: _quantile(t["num_completion_tokens"], q_),
            accept=lambda v, lo=low, hi=high: lo <= v <= hi,
            expectation="ExpectColumnQuantileValuesToBeBetween",
            kwargs=quantile_kwargs,
            gx_part=part,
            gx_observed=lambda r, i=part: _gx_quantile(r, i),
        )
        for part, (quantile, (low, high)) in enumerate(ranges)
    ]


def run_checks(
    table: pd.DataFrame,
    quality: Mapping[str, Any],
    *,
    thinking: bool,
    expected_rows: int | None = None,
) -> list[CheckResult]:
    """Evaluate every check on `table` (the scalar columns of COLUMNS, and the turn columns of
    `draftline.quality.turns.TURN_COLUMNS` when it has them) and return the results."""
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(
            f"generated table lacks column(s) {missing}: it must follow docs/pipeline.md "
            "('Generated table'); regenerate it with the current `draftline generate`"
        )
    checks = define_checks(table, quality, thinking=thinking, expected_rows=expected_rows)
    by_rows = frames(table, thinking)
    return [c.evaluate(by_rows[c.rows]) for c in checks]


def failures(results: Sequence[CheckResult]) -> list[CheckResult]:
    return [r for r in results if not r.passed]


def summarize(results: Sequence[CheckResult]) -> str:
    """One line per failed check, in plain words (for logs and error messages)."""
    return "\n".join(
        f"{r.name}: {r.description}: observed {format_observed(r.observed)}, required {r.bound}"
        for r in failures(results)
    )


def format_observed(value: float | None) -> str:
    if value is None:
        return "nothing to measure"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4f}"


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


def _mode(values: pd.Series) -> int | None:
    if not len(values):
        return None
    counts = values.value_counts()
    return int(counts.index[0])


def _quantile(values: pd.Series, q: float) -> float:
    # "nearest", as GX computes quantiles on pandas, so both give the same observed value.
    return float(values.quantile(q, interpolation="nearest"))


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gx_unexpected_share(result: dict[str, Any]) -> float | None:
    percent = result.get("unexpected_percent_nonmissing", result.get("unexpected_percent"))
    return None if percent is None else float(percent) / 100.0


def gx_expected_share(result: dict[str, Any]) -> float | None:
    share = _gx_unexpected_share(result)
    return None if share is None else 1.0 - share


def _gx_quantile(result: dict[str, Any], part: int) -> float | None:
    values = (result.get("observed_value") or {}).get("values") or []
    return float(values[part]) if part < len(values) else None
