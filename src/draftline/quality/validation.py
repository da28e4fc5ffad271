"""The Great Expectations suite of generated data, built from the checks of
`draftline.quality.checks`.

One suite per kind of rows a check judges: `draftline_all_rows` (every generated row: ids,
row count, failed requests) and `draftline_answered_rows` (rows whose request did not fail:
supervised tokens, repetition, truncation, think blocks, answers, lengths); in a thinking mix
one per mode, and for multi-turn conversations one over their turns (per mode in a mix) and one
over the conversations (`draftline.quality.turns`); a suite without checks or rows does not
run. Each runs through its own Checkpoint (GX takes one dataframe per checkpoint run), which
stores its results in the context; one Data Docs site is built from them once, after the last
(a docs action per checkpoint rebuilt the site each time: ~0.4 s of page rendering each). A
check passes only when GX and the pandas measurement of `quality` agree it passes: the two are
the same definition, so a disagreement is a bug and fails safe.

`import great_expectations` takes seconds: it is imported only inside `run_suite`.
"""

from __future__ import annotations

import html
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from draftline.quality import checks, data_docs
from draftline.quality.check_parts import Check, CheckResult
from draftline.runtime import atomic

log = logging.getLogger(__name__)

SUITES = {
    "all": "draftline_all_rows",
    "answered": "draftline_answered_rows",
    "thinking": "draftline_thinking_rows",
    "no_thinking": "draftline_no_thinking_rows",
    "turns": "draftline_turn_rows",
    "turns_thinking": "draftline_thinking_turn_rows",
    "turns_no_thinking": "draftline_no_thinking_turn_rows",
    "conversations": "draftline_conversation_rows",
}
DOCS_SITE = "draftline"


@dataclass(frozen=True)
class SuiteOutcome:
    passed: bool
    results: list[CheckResult]  # one per check, in definition order
    results_path: Path  # GX results JSON
    docs_index: Path  # Data Docs index.html


def run_suite(
    table: pd.DataFrame,
    quality_cfg: Mapping[str, Any],
    *,
    thinking: bool,
    expected_rows: int | None,
    report_dir: str | os.PathLike[str],
) -> SuiteOutcome:
    """Validate `table` with GX; write `results.json` and `data_docs/` under `report_dir`."""
    defined = checks.define_checks(
        table, quality_cfg, thinking=thinking, expected_rows=expected_rows
    )
    frames = checks.frames(table, thinking)
    report = Path(report_dir)
    docs_dir = report / "data_docs"
    gx_results: dict[str, dict[str, Any]] = {}
    gx_raw: list[dict[str, Any]] = []
    with atomic.atomic_path(docs_dir) as tmp_docs:
        tmp_docs.mkdir(parents=True)
        context = _context(tmp_docs)
        for rows, suite_name in SUITES.items():
            selected = [c for c in defined if c.rows == rows]
            if not selected or not len(frames[rows]):
                continue  # nothing to judge: those checks fail below with "nothing to measure"
            outcome = _run_checkpoint(context, suite_name, selected, frames[rows])
            for result in outcome.run_results.values():
                gx_raw.append(
                    {
                        "suite": suite_name,
                        "success": bool(result.success),
                        "validation_result": result.to_json_dict(),
                    }
                )
            gx_results.update(_results_by_check(outcome))
        context.build_data_docs(site_names=[DOCS_SITE])
        data_docs.make_offline(tmp_docs)
    results = [_merge(c, c.evaluate(frames[c.rows]), gx_results.get(c.name)) for c in defined]
    passed = all(r.passed for r in results)
    results_path = report / "results.json"
    atomic.write_json(
        results_path,
        {
            "passed": passed,
            "checks": [asdict(r) for r in results],
            "great_expectations": _plain(gx_raw),
        },
    )
    return SuiteOutcome(passed, results, results_path, docs_dir / "index.html")


def _context(docs_dir: Path) -> Any:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # no calls home from a pipeline
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    _drop_default_docs_site(context)
    context.add_data_docs_site(
        site_name=DOCS_SITE,
        site_config={
            "class_name": "SiteBuilder",
            "store_backend": {
                "class_name": "TupleFilesystemStoreBackend",
                "base_directory": str(docs_dir.resolve()),
            },
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    return context


def _drop_default_docs_site(context: Any) -> None:
    """An ephemeral context makes an empty temporary folder for its own docs site: remove both,
    so that every run does not leave a folder behind in /tmp."""
    sites = context.variables.data_docs_sites or {}
    site = sites.get("local_site") or {}
    folder = Path((site.get("store_backend") or {}).get("base_directory") or "")
    if "local_site" in sites:
        context.delete_data_docs_site("local_site")
    if (
        folder.is_dir()
        and folder.parent == Path(tempfile.gettempdir())
        and not any(folder.iterdir())
    ):
        folder.rmdir()


def _run_checkpoint(
    context: Any, suite_name: str, checks: Sequence[Check], frame: pd.DataFrame
) -> Any:
    import great_expectations as gx
    import great_expectations.expectations as gxe

    suite = context.suites.add(gx.ExpectationSuite(name=suite_name))
    for group in _expectation_groups(checks):
        first = group[0]
        expectation_class = getattr(gxe, first.expectation)
        suite.add_expectation(
            expectation_class(
                **first.kwargs,
                # GX puts descriptions into Data Docs as raw HTML: "<think>" would vanish.
                description=html.escape(
                    "; ".join(f"{c.name}: {c.description}, required {c.bound}" for c in group)
                ),
                meta={"checks": [c.name for c in group]},
            )
        )
    asset = context.data_sources.add_pandas(f"{suite_name}_source").add_dataframe_asset("generated")
    batch = asset.add_batch_definition_whole_dataframe("all_shards")
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name=suite_name, data=batch, suite=suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name=suite_name,
            validation_definitions=[definition],
            result_format="SUMMARY",
        )
    )
    return checkpoint.run(batch_parameters={"dataframe": frame})


def _expectation_groups(checks: Sequence[Check]) -> list[list[Check]]:
    """Checks that declare the same expectation and arguments share one GX expectation."""
    groups: dict[str, list[Check]] = {}
    for check in checks:
        key = json.dumps([check.expectation, check.kwargs], sort_keys=True)
        groups.setdefault(key, []).append(check)
    return list(groups.values())


def _results_by_check(outcome: Any) -> dict[str, dict[str, Any]]:
    """Map each check name to the GX result of its expectation: {"success", "result"}."""
    found: dict[str, dict[str, Any]] = {}
    for validation in outcome.run_results.values():
        for result in validation.results:
            names = (result.expectation_config.meta or {}).get("checks") or []
            info = result.exception_info or {}
            if info.get("raised_exception"):
                log.error("GX expectation for %s raised: %s", names, info.get("exception_message"))
            for name in names:
                found[name] = {"success": bool(result.success), "result": dict(result.result or {})}
    return found


def _merge(check: Check, measured: CheckResult, gx: dict[str, Any] | None) -> CheckResult:
    if gx is None:  # not run by GX: nothing to judge (no rows)
        return measured
    gx_success = gx["success"]
    if check.gx_part is not None:  # a shared expectation: this check's own part decides
        details = gx["result"].get("details") or {}
        gx_success = bool((details.get("success_details") or [False])[check.gx_part])
    observed = check.gx_observed(gx["result"])
    if observed is None:
        observed = measured.observed
    passed = gx_success and measured.passed
    if gx_success != measured.passed:
        log.warning(
            "check %s: GX says %s, pandas says %s (observed %s vs %s); counted as failed",
            check.name,
            gx_success,
            measured.passed,
            observed,
            measured.observed,
        )
    return CheckResult(check.name, check.description, observed, check.bound, passed)


def _plain(value: Any) -> Any:
    """GX result dicts hold numpy scalars and bools: make them plain JSON."""
    return json.loads(
        json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    )


def failure_table(results: Sequence[CheckResult]) -> Any:
    """A rich Table of the failed checks: name, requirement, observed value, bound."""
    from rich.table import Table

    failed = checks.failures(results)
    table = Table(title="validate: failed expectations", show_lines=False)
    # A check's name is what a user greps a log for: never cut short in a narrow terminal or log.
    names = max((len(r.name) for r in failed), default=5)
    table.add_column("check", style="bold red", no_wrap=True, min_width=names)
    table.add_column("what is required")
    table.add_column("observed", justify="right")
    table.add_column("bound")
    for r in failed:
        table.add_row(r.name, r.description, checks.format_observed(r.observed), r.bound)
    return table
