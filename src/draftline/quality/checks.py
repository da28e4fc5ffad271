"""The quality checks of generated data: one definition for the `validate` stage and the online
guard in `generate`.

Each check is declared once, as a `Check` (`draftline.quality.check_parts`): a pandas
measurement over the scalar columns of the generated table (docs/pipeline.md), the bound it must
meet, and the equivalent Great Expectations expectation (class name and arguments, so this module
never imports GX). `run_checks` evaluates the measurements directly (fast, for the guard);
`draftline.quality.validation` turns the same `Check`s into a GX suite.

Rows are split in two: every row (ids, row count, failed requests) and the *answered* rows, whose
request did not fail (`finish_reason != "error"`): the completion checks judge only those, so a
failed request counts once, against the error bound, and not again as an empty completion.
Multi-turn conversations are also judged per turn and per conversation
(`draftline.quality.turns`): the scalar columns describe only their last turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from draftline.quality import turns
from draftline.quality.check_parts import (
    Check,
    CheckResult,
    Rows,
    Thresholds,
    at_least_check,
    gx_expected_share,
    gx_unexpected_share,
    mode_rows,
    row_modes,
    share_of,
)

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


def frames(table: pd.DataFrame, thinking: bool) -> dict[str, pd.DataFrame]:
    """The rows each kind of check judges (see `Rows`)."""
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
            gx_observed=gx_unexpected_share,
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
            gx_observed=gx_unexpected_share,
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
            gx_observed=gx_unexpected_share,
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
    if "untrained_tokens" in table.columns:
        checks.append(_yield_check(table, q.share("min_yield")))
    return checks + turns.define_checks(by_rows, q, thinking=thinking)


def _yield_check(table: pd.DataFrame, min_yield: float) -> Check:
    """Supervised / generated tokens over the run (`draftline.core.training_rows`), as GX
    says it: the tokens no sequence supervises sum to at most (1 - min_yield) of all generated
    (a ratio of sums, which no per-row expectation states)."""
    generated = int(table["generated_tokens"].sum())

    def measure(t: pd.DataFrame) -> float:
        made = int(t["generated_tokens"].sum())
        return 1.0 - int(t["untrained_tokens"].sum()) / made if made else 1.0

    return Check(
        name="yield",
        description="supervised tokens of the training sequences (extract.rows, cut to "
        "extract.max_length) over every token generated, all turns and reasoning included",
        bound=f">= {min_yield:.2f} of generated tokens",
        rows="all",
        measure=measure,
        accept=lambda v: v >= min_yield - 1e-12,
        expectation="ExpectColumnSumToBeBetween",
        kwargs={"column": "untrained_tokens", "max_value": (1.0 - min_yield) * generated},
        gx_observed=lambda r: (
            1.0 - float(r["observed_value"]) / generated
            if generated and r.get("observed_value") is not None
            else None
        ),
    )


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


def _gx_quantile(result: dict[str, Any], part: int) -> float | None:
    values = (result.get("observed_value") or {}).get("values") or []
    return float(values[part]) if part < len(values) else None
