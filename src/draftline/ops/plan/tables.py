"""How `draftline plan` prints a plan: rich tables that fit 80 columns with every figure whole,
sources wrapped in their own column, rows in a fixed order. The numbers are `build`'s; the cells
(a duration, a cost, a rate) are shared with `comparison`, the planned-vs-measured view."""

from __future__ import annotations

import textwrap
from typing import Any

from draftline.drafter import memory_plan
from draftline.generation import sglang_caps
from draftline.ops.plan import data_yield
from draftline.ops.plan.figures import DAY_S, STAGES, precision_text


def duration(seconds: float | None) -> str:
    """Days for long stages, smaller units for the short stages of a CPU run."""
    if seconds is None:
        return "—"
    if seconds >= DAY_S:
        return f"{seconds / DAY_S:,.2f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def stage_cell(info: dict[str, Any]) -> str:
    text = duration(info["seconds"])
    if info.get("range_days"):
        low, high = info["range_days"]
        text += f" ({low:.2f}–{high:.2f})"
    return f"[bold red]{text} ![/]" if info["over_limit"] else text


def money(value: float | None) -> str:
    return "—" if value is None else f"${value:,.0f}"


def rate_cell(figure: dict[str, Any]) -> str:
    value = figure.get("value")
    if value is None:
        return "—"
    text = f"{value:,.0f}"
    if figure.get("low") is not None and figure.get("high") is not None:
        text += f" ({figure['low']:,.0f}–{figure['high']:,.0f})"
    return text


def header(plan: dict[str, Any]) -> str:
    m = plan["model"]
    rows = plan["yield"]["configured"]
    share = plan["yield"]["layouts"][rows]["per_conversation"]["yield"]["value"]
    return (
        f"[bold]{m['name']}[/] ({m['ref']}), drafter {plan['drafter']['name']} x "
        f"{plan['drafter']['epochs']} epochs, data {plan['data']}, features {plan['features']}, "
        f"rows {rows} (yield {share:.2f})"
    )


def input_rows(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
    labels = {
        "samples": "samples (generate)",
        "train_samples": "samples (extract/train)",
        "prompt_tokens": "prompt tokens / sample",
        "completion_tokens": "completion tokens / sample",
        "sequence_tokens": "sequence tokens / sample",
        "bytes_per_token": "feature bytes / token",
    }
    return [
        (label, f"{plan['inputs'][key]['value']:,.0f}", plan["inputs"][key]["source"])
        for key, label in labels.items()
    ]


def print_plan(console: Any, plan: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(header(plan))
    inputs = Table(title="Inputs", title_justify="left")
    inputs.add_column("input", overflow="fold")
    inputs.add_column("value", justify="right", no_wrap=True)
    inputs.add_column("source", overflow="fold")
    for row in input_rows(plan):
        inputs.add_row(*row)
    console.print(inputs)

    console.print(storage_line(plan))
    limit = plan["limits"]["time_limit_days"]
    # Profiles with no figure for this target (CPU ones before a run there) would be columns of
    # dashes: they are named once instead.
    every = list(plan["profiles"].values())
    known = [p for p in every if any(s["seconds"] is not None for s in p["stages"].values())]
    unknown = [p["name"] for p in every if p not in known] if known else []
    profiles = known or every
    rows: list[tuple[str, list[str]]] = [("$/h", [f"{p['price_per_hour']:g}" for p in profiles])]
    rows += [
        (key.replace("_", " "), [stage_cell(p["stages"][key]) for p in profiles]) for key in STAGES
    ]
    for mode in ("offline", "online"):
        rows.append((f"total {mode}", [duration(p["total"][mode]["seconds"]) for p in profiles]))
    for mode in ("offline", "online"):
        rows.append((f"cost {mode}", [money(p["total"][mode]["cost_usd"]) for p in profiles]))
    console.print(
        _by_profile(f"Wall time per stage (! over the {limit:g}-day limit)", profiles, rows)
    )
    if unknown:
        console.print(
            f"[dim]Not shown: {', '.join(unknown)}: no throughput for this target "
            "(measured on a run there, or throughput.* in conf/hardware/)[/]"
        )
    console.print(data_yield.yield_table(plan, profiles))
    for line in data_yield.yield_sources(plan):
        console.print(line, style="dim", highlight=False)
    console.print(generation_line(plan))
    console.print(f"[bold]Serving precision[/]: {precision_text(plan, profiles)}")
    for p in profiles:
        if p.get("running"):
            line = sglang_caps.describe_running(p["running"])
            console.print(f"[bold]Running requests[/] {p['name']}: {line}", highlight=False)
    for pair in plan.get("two_nodes") or []:
        print_two_nodes(console, pair)

    console.print(_throughput_grid(profiles))
    _print_calibrated(console, profiles)
    _print_memory(console, plan)
    print_advice(console, plan)


def storage_line(plan: dict[str, Any]) -> str:
    """The storage of the feature mode planned first, the other mode's for comparison."""
    s = plan["storage"]
    packs = f"{s['online_token_packs_bytes'] / 1e9:,.1f} GB"
    if plan["features"] == "online":
        return (
            f"Online features: token packs [bold]{packs}[/]; offline features would take "
            f"{s['offline_features_tb']:,.1f} TB (budget {s['budget_tb']:g} TB)"
        )
    over = " [bold red]over budget ![/]" if s["over_budget"] else ""
    return (
        f"Offline features: [bold]{s['offline_features_tb']:,.1f} TB[/] "
        f"(budget {s['budget_tb']:g} TB){over}; online token packs {packs}"
    )


def _throughput_grid(profiles: list[dict[str, Any]]) -> Any:
    """Tokens per second per profile and stage, each source wrapped in its own column, so the
    lines break cleanly at any width (a figure never splits)."""
    from rich.table import Table

    grid = Table(title="Throughput (tokens/s)", title_justify="left", box=None, padding=(0, 1))
    grid.add_column("", no_wrap=True)
    grid.add_column("", justify="right", no_wrap=True)
    grid.add_column("", style="dim", overflow="fold", ratio=1)
    grid.show_header = False
    for p in profiles:
        for key, figure in p["throughput"].items():
            what = f"{p['name']} {key.removesuffix('_tok_s')}"
            grid.add_row(what, f"[bold]{rate_cell(figure)}[/]", figure["source"])
    return grid


CALIBRATED_STAGES = {
    "generate_tok_s": "generate",
    "extract_tok_s": "extract",
    "train_tok_s": "train_offline",
    "train_online_tok_s": "train_online",
}


def _print_calibrated(console: Any, profiles: list[dict[str, Any]]) -> None:
    """Each figure `draftline calibrate` measured beside the conf/ estimate it replaces, with
    the stage's time and cost at each (a stage's time taken as tokens / rate)."""
    from rich.table import Table

    rows = []
    for p in profiles:
        for key, stage in CALIBRATED_STAGES.items():
            figure = p["throughput"][key]
            seconds = p["stages"][stage]["seconds"]
            if not figure["source"].startswith("measured by calibrate") or seconds is None:
                continue
            was = figure.get("estimate")
            before = seconds * figure["value"] / was if was else None
            change = None if before is None else (seconds - before) / DAY_S
            dollars = None if change is None else change * 24 * p["price_per_hour"]
            rows.append((
                f"{p['name']} {stage.replace('_', ' ')}",
                "none" if was is None else f"{was:,.0f}",
                f"{figure['value']:,.0f}",
                f"{duration(before)} → {duration(seconds)}",
                "—" if change is None else f"{change:+,.2f} d",
                "—" if dollars is None else f"{'+' if dollars >= 0 else '-'}${abs(dollars):,.0f}",
            ))  # fmt: skip
    if not rows:
        return
    table = Table(title="Calibrated (tok/s: conf/ estimate vs measured)", title_justify="left")
    for name in ("stage", "estimate", "measured", "time", "Δ days", "Δ $"):
        table.add_column(name, justify="left" if name == "stage" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def generation_line(plan: dict[str, Any]) -> str:
    """How generation was counted: turns, prefill and the schedule's utilisation assumed."""
    g = plan["generation"]
    assumed = {
        p["name"]: p["stages"]["generate"]["utilisation"]
        for p in plan["profiles"].values()
        if p["stages"]["generate"].get("utilisation")
    }
    text = (
        f"[bold]Generation[/] per turn: {g['turns']['value']:.2f} turns per conversation "
        f"[dim]({g['turns']['source']})[/], {g['prefill_tokens']['value']:,.0f} prompt tokens "
        "prefilled each"
    )
    if assumed:
        figures = ", ".join(f"{name} {u['value']:.3f}" for name, u in assumed.items())
        sources = dict.fromkeys(u["source"] for u in assumed.values())
        text += f"; utilisation assumed: {figures} [dim]({'; '.join(sources)})[/]"
    return text


def _by_profile(
    title: str, profiles: list[dict[str, Any]], rows: list[tuple[str, list[str]]]
) -> Any:
    """One column per profile, one row per figure: fits 80 columns with the three profiles,
    and a figure never folds or loses digits (labels wrap first)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("", overflow="fold")
    for p in profiles:
        table.add_column(p["name"], justify="right", no_wrap=True)
    for label, cells in rows:
        table.add_row(label, *cells)
    return table


TWO_NODE_VIEWS = {
    "overlapped": "overlapped",
    "generate_node_alone": "G alone",
    "generate_then_train": "G then T",
}


def print_two_nodes(console: Any, pair: dict[str, Any]) -> None:
    """Generate on one profile (G) while another trains (T), beside both sequential runs; one
    column per view, so the figures stay whole in 80 columns."""
    from rich.table import Table

    g, t = pair["generate_on"], pair["train_on"]
    table = Table(
        title=f"Two nodes: generate on {g} (G), train on {t} (T), {pair['shards']} shards",
        title_justify="left",
    )
    table.add_column("", overflow="fold")
    for label in TWO_NODE_VIEWS.values():
        table.add_column(label, justify="right", no_wrap=True)
    views = [pair[key] for key in TWO_NODE_VIEWS]

    def idle(v: dict[str, Any]) -> str:
        if v["train_idle_s"] is None:
            return "—"
        if not v["train_idle_s"]:
            return "none"
        share = v["train_idle_s"] / v["seconds"]
        return f"{duration(v['train_idle_s'])} ({f'{share:.0%}' if share >= 0.005 else '<1%'})"

    waits = "T waits" if pair["bottleneck"] == "generate" else "shards queue"
    rows = [
        ("wall time", [duration(v["seconds"]) for v in views]),
        ("cost", [money(v["cost_usd"]) for v in views]),
        ("G busy", [duration(v["generate_busy_s"]) for v in views]),
        ("T busy", [duration(v["train_busy_s"]) for v in views]),
        ("T idle", [idle(v) for v in views]),
        ("who waits", [waits, "—", "T after G"]),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    console.print(table)
    # Wrapped here, where a figure's no-break space holds it whole ("2.3" then "h" on the next
    # line otherwise: rich breaks at any space).
    for line in textwrap.wrap(two_nodes_line(pair), console.width):
        console.print(line.replace(NBSP, " "), highlight=False)


NBSP = "\u00a0"


def _whole(seconds: float) -> str:
    return duration(seconds).replace(" ", NBSP)


def two_nodes_line(pair: dict[str, Any]) -> str:
    """Which node waits for which in the overlapped run, and how it compares (each figure held
    together by a no-break space)."""
    g, t, shard = pair["generate_on"], pair["train_on"], pair["per_shard"]
    over = pair["overlapped"]
    gen_s, work_s = shard["generate_s"], shard["extract_s"] + shard["train_first_epoch_s"]
    work = "extracts and trains" if shard["extract_s"] else "trains"
    per_shard = (
        f"{g} generates a shard in {_whole(gen_s)}, {t} {work} its first epoch on it in "
        f"{_whole(work_s)}"
    )
    if pair["bottleneck"] == "generate":
        text = (
            f"Overlapped: generation is the bottleneck ({per_shard}): {t} waits for each shard, "
            f"idle {over['train_idle_share']:.0%} of the wall time (the first shard's wait "
            "included)"
        )
    else:
        text = (
            f"Overlapped: training is the bottleneck ({per_shard}): shards queue up and {g} is "
            f"given back {_whole(over['generator_early_s'])} before the first epoch ends"
        )
    remaining = pair["epochs"] - 1
    if remaining:
        text += (
            f"; then {t} trains the {remaining} other epochs over all shards in "
            f"{_whole(over['remaining_train_s'])}"
        )
    ratios = (
        f"{over['seconds'] / pair[key]['seconds']:.2f}x that of {TWO_NODE_VIEWS[key]}"
        for key in ("generate_node_alone", "generate_then_train")
    )
    return f"{text}. Overlapped wall time: {', '.join(ratios)}."


def _memory_cell(info: dict[str, Any] | None) -> str:
    if not info:
        return "-"
    cell = f"{info['peak_bytes'] / 2**30:,.1f}"
    return cell if info["fits"] else f"[bold red]{cell} OOM[/]"


def _layout_cell(layout: dict[str, Any] | None) -> str:
    """E.g. `fsdp x4` (`+ac` with activation checkpointing); `-` when not planned."""
    if not layout:
        return "-"
    cell = f"{layout['sharding']} x{layout['processes']}"
    return cell + (" +ac" if layout.get("activation_checkpointing") else "")


HELD_ORDER = ("target", "drafter", "target_head", "optimizer")


def _print_memory(console: Any, plan: dict[str, Any]) -> None:
    rows = [p for p in plan["profiles"].values() if (p.get("memory") or {}).get("device_bytes")]
    if not rows:
        return
    table_rows: list[tuple[str, list[str]]] = [
        ("GPU GiB", [f"{p['memory']['device_bytes'] / 2**30:,.1f}" for p in rows]),
        ("training layout", [_layout_cell(p["memory"].get("layout")) for p in rows]),
    ]
    for key in memory_plan.STAGES:
        cells = [_memory_cell(p["memory"]["stages"].get(key)) for p in rows]
        table_rows.append((key.replace("_", " "), cells))
    held = [p["memory"]["stages"].get("train_online", {}).get("resident") or {} for p in rows]
    # A fixed order: a figure read back from the memory cache has its keys sorted, a fresh one
    # has them in the order they were measured, and rows must not move between runs.
    items = {k for h in held for k in h}
    for item in sorted(items, key=lambda k: (HELD_ORDER.index(k) if k in HELD_ORDER else 9, k)):
        cells = [f"{h[item] / 2**30:,.1f}" if item in h else "—" for h in held]
        table_rows.append((f"  held: {item.replace('_', ' ')}", cells))
    free = [1 - p["memory"]["stages"]["train_online"]["peak_bytes"] / p["memory"]["device_bytes"]
            for p in rows if "train_online" in p["memory"]["stages"]]  # fmt: skip
    if len(free) == len(rows):
        table_rows.append(("online: GPU free", [f"{f:.0%}" for f in free]))
    drafters = [p["memory"].get("drafter") or {} for p in rows]
    if all(drafters):  # the family's cost per drafter output token of a training step
        cells = [f"{d['family']} {d['train'] / 1e9:,.1f}" for d in drafters]
        table_rows.append(("drafter GFLOP/token", cells))
    table = _by_profile(
        "Memory per GPU, GiB (fake-tensor run of the project's code; 5% kept free)",
        rows,
        table_rows,
    )
    console.print(table)


def print_advice(console: Any, plan: dict[str, Any]) -> None:
    for flag in plan["flags"]:
        console.print(f"[bold red]FLAG[/] {flag['message']}")
    for rec in plan["recommendations"]:
        console.print(f"[bold green]RECOMMEND[/] {rec['message']}")
    for note in plan.get("notes") or []:
        console.print(f"[yellow]note[/] {note}")
