"""How `draftline plan --from-metrics` prints a plan: the planned figures (estimates only) beside
the measured ones (a run's metrics where they exist), each measured figure's source listed under
its table by number so the tables fit 80 columns."""

from __future__ import annotations

from typing import Any

from draftline.ops.plan.figures import STAGES
from draftline.ops.plan.tables import (
    duration,
    header,
    input_rows,
    money,
    print_advice,
    rate_cell,
    stage_cell,
)


def _figures_table(title: str, what: str) -> Any:
    """Planned and measured figures whole (never folded); where each measured figure comes from
    is listed under the table by its number, so the table fits 80 columns."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column(what, overflow="fold")
    table.add_column("planned", justify="right", no_wrap=True)
    table.add_column("measured", justify="right", no_wrap=True)
    table.add_column("src", justify="right", no_wrap=True)
    return table


def _stacked(cell: str) -> str:
    """A figure's range under the figure, so two figures side by side fit 80 columns."""
    return cell.replace(" (", "\n(", 1)


def _print_with_sources(console: Any, table: Any, rows: list[tuple[str, str, str, str]]) -> None:
    sources: list[str] = []
    for label, planned, measured, source in rows:
        ref = ""
        if source:
            sources.append(source)
            ref = f"[{len(sources)}]"
        table.add_row(label, planned, measured, ref)
    console.print(table)
    for i, source in enumerate(sources, 1):
        console.print(f"  \\[{i}] {source}", style="dim", highlight=False)


def print_comparison(console: Any, planned: dict[str, Any], measured: dict[str, Any]) -> None:
    """Planned (estimates only) and measured (metrics where they exist) side by side."""
    console.print(header(measured))
    _print_with_sources(
        console,
        _figures_table("Inputs", "input"),
        [
            (label, plan_value, value, source)
            for (label, plan_value, _), (_, value, source) in zip(
                input_rows(planned), input_rows(measured), strict=True
            )
        ],
    )
    for p_plan, p_meas in zip(
        planned["profiles"].values(), measured["profiles"].values(), strict=True
    ):
        rows = []
        for key in p_meas["throughput"]:
            a, b = p_plan["throughput"][key], p_meas["throughput"][key]
            label = key.replace("_tok_s", " tok/s").replace("_", " ")
            rows.append((label, _stacked(rate_cell(a)), _stacked(rate_cell(b)), b["source"]))
        for key in STAGES:
            rows.append(
                (
                    f"{key.replace('_', ' ')} time",
                    _stacked(stage_cell(p_plan["stages"][key])),
                    _stacked(stage_cell(p_meas["stages"][key])),
                    p_meas["stages"][key]["source"],
                )
            )
        for mode in ("offline", "online"):
            a, b = p_plan["total"][mode], p_meas["total"][mode]
            rows.append((f"total {mode}", duration(a["seconds"]), duration(b["seconds"]), ""))
            rows.append((f"cost {mode}", money(a["cost_usd"]), money(b["cost_usd"]), ""))
        _print_with_sources(console, _figures_table(p_meas["name"], "figure"), rows)
    print_advice(console, measured)
