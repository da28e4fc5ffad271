"""Validation of one generated train shard (`draftline validate --shard K`): the whole run's
checks under the whole run's thresholds, read so that a shard's sampling noise alone never
stops training, while a shard of broken data always does.

Training can follow generation shard by shard: each shard is judged on its own before any
training stage consumes it, and the whole-run `validate` still judges every shard together at
the end. A shard runs the same GX suite as the whole run (`validation.run_suite`), with the
same `conf/quality` thresholds, and `row_count` held to the shard's own curated count
(`shard_rows` of data/curated/summary.json). Each kind of check is read as follows:

- Exact checks are judged as the whole run judges them: `row_count`, and `unique_ids` within
  the shard (an id repeated across two shards is the whole run's to catch).
- Share checks (a bound b on the share of "bad" rows: failed requests, too few supervised
  tokens, the most common supervised-token count, repeated completions, truncation, missing
  think blocks or answers, per turn and per conversation) are judged on a shard's n rows,
  whose measured share scatters around the data's own by about sqrt(b(1-b)/n): 0.046 for
  b = 0.20 on 74 rows (the embedded default's shards have 71 to 83). Read exactly, the bound
  would stop training on shards the whole run accepts (data whose share is 0.17 measures over
  0.20 on about one such shard in four), and a shard under 1/b rows could not hold one bad
  row (one failed request in 99 breaks max_error_share=0.01). So a share check that fails on a
  shard still passes it when the failure is within sampling noise: if the data's share were
  the bound itself, a count of bad rows at least this high would not be improbable (one-sided
  binomial tail P(X >= bad | n, b) >= ALPHA). A check that passes the exact bound is never
  touched, and nothing is skipped, whatever the shard's size: every failure read as noise is
  recorded in the verdict under `within_sampling_noise` with its rows, bad rows, bound and
  p-value. The seed's data (87% of replies "OK.", 6 supervised tokens) is nowhere near
  noise: on 74 rows its supervised-token share gives p < 1e-40, and it fails. The mode share
  is tested as one share, although it is the largest of many (the chosen count is the data's
  most common): that leans towards passing, which only the whole run's exact bound settles.
- Completion-length quantiles: a q-quantile under its low bound means more rows below it than
  the share q allows (above its high bound: more rows above it than 1 - q), judged as a share.
- A check with nothing to measure (no answered rows) fails, as in the whole run.

A shard too small to show anything (4 rows, all at one supervised-token count) passes with its
p-value recorded; the whole run's exact bounds still judge it before `extract`. The GX results
and Data Docs under the shard's report folder show the exact bounds; the verdict says which of
their failures were sampling noise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from draftline.quality import checks
from draftline.quality.check_parts import Check, CheckResult

# The p-value under which a failed share is the data's, not a small shard's noise. One shard
# judged on its dozen share checks stops by chance well under once in a thousand shards with
# data exactly at the bound (data inside the bounds: far less often).
ALPHA = 1e-3

# Share checks by expectation: whether the pandas measurement is the share of bad rows
# (`NotToBeInSet`: failed requests, the mode, truncation) or of good ones.
_BAD_SHARE = {"ExpectColumnValuesToNotBeInSet"}
_MOSTLY = _BAD_SHARE | {"ExpectColumnValuesToBeInSet", "ExpectColumnValuesToBeBetween"}
_UNIQUE_SHARE = "ExpectColumnProportionOfUniqueValuesToBeBetween"
_QUANTILES = "ExpectColumnQuantileValuesToBeBetween"


@dataclass(frozen=True)
class Noise:
    """A share check failed on a shard: how many of its rows were bad against its bound."""

    rows: int
    bad_rows: int
    bound: float  # the largest share of bad rows the check allows
    p_value: float  # P(X >= bad_rows) for X ~ Binomial(rows, bound)


@dataclass(frozen=True)
class ShardJudgement:
    passed: bool
    results: list[CheckResult]  # as the shard is judged: noise counts as passed
    noise: dict[str, Noise]  # the exact bound's failures that were within sampling noise


def judge(
    table: pd.DataFrame,
    quality: Mapping[str, Any],
    *,
    thinking: bool,
    expected_rows: int,
    results: Sequence[CheckResult],
) -> ShardJudgement:
    """Read the suite's `results` on one shard's `table` (see the module docstring)."""
    defined = {
        c.name: c
        for c in checks.define_checks(
            table, quality, thinking=thinking, expected_rows=expected_rows
        )
    }
    frames = checks.frames(table, thinking)
    judged: list[CheckResult] = []
    noise: dict[str, Noise] = {}
    for result in results:
        check = defined[result.name]
        found = None if result.passed else sampling_noise(check, frames[check.rows])
        if found is not None and found.p_value >= ALPHA:
            noise[result.name] = found
            result = dataclasses.replace(result, passed=True)
        judged.append(result)
    return ShardJudgement(all(r.passed for r in judged), judged, noise)


def sampling_noise(check: Check, rows: pd.DataFrame) -> Noise | None:
    """The bad rows of a share check that fails on `rows`, against its bound; None for an
    exact check, no rows to measure, or a failure the pandas measurement does not share (GX
    and pandas disagreeing is a bug, never noise)."""
    n = len(rows)
    if not n:
        return None
    measured = check.measure(rows)
    if measured is None or check.accept(measured):
        return None
    kwargs = check.kwargs
    if check.expectation == _QUANTILES and check.gx_part is not None:
        ranges = kwargs["quantile_ranges"]
        q = float(ranges["quantiles"][check.gx_part])
        low, high = (float(v) for v in ranges["value_ranges"][check.gx_part])
        values = rows[kwargs["column"]]
        if measured < low:
            bad, bound = int((values < low).sum()), q
        else:
            bad, bound = int((values > high).sum()), 1.0 - q
    elif check.expectation in _MOSTLY and "mostly" in kwargs:
        bound = 1.0 - float(kwargs["mostly"])
        share = round(measured * n)
        bad = share if check.expectation in _BAD_SHARE else n - share
    elif check.expectation == _UNIQUE_SHARE:
        bound = 1.0 - float(kwargs["min_value"])
        bad = n - round(measured * n)
    else:
        return None
    # Four significant digits: the verdict is a DVC output, identical on every node.
    return Noise(n, bad, round(bound, 6), float(f"{binomial_tail(bad, n, bound):.4g}"))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed term by term (in log space, no overflow)."""
    if k <= 0 or p >= 1.0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms: list[float] = []
    peak = 0.0
    for i in range(k, n + 1):
        term = math.exp(
            log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        )
        terms.append(term)
        peak = max(peak, term)
        if i > n * p and term <= 1e-17 * peak:  # past the mean the terms only shrink
            break
    return min(1.0, math.fsum(terms))


def verdict(
    shard: int, file: str, num_samples: int, judgement: ShardJudgement, suites: Sequence[str]
) -> dict[str, Any]:
    """The shard's verdict: deterministic (no time or run id), so a rerun changes no hash."""
    return {
        "passed": judgement.passed,
        "shard": shard,
        "file": file,
        "num_samples": num_samples,
        "suite": sorted(suites),
        "alpha": ALPHA,
        "failed_checks": [r.name for r in checks.failures(judgement.results)],
        "checks": {
            r.name: {"observed": r.observed, "bound": r.bound, "passed": r.passed}
            for r in judgement.results
        },
        "within_sampling_noise": {
            name: dataclasses.asdict(found) for name, found in judgement.noise.items()
        },
    }
