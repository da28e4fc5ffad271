"""Time, storage and cost of a run on each hardware profile, before spending them.

Without overrides it plans params.yaml (what `dvc repro` would run); with overrides, conf/
composed with them. Examples: `draftline plan model=qwen3_6_27b data=sharegpt drafter=dflash_b16`;
`draftline plan model=qwen3_6_27b drafter=dflash_b16 --samples 914000 --completion-tokens 2500`;
`draftline plan --from-metrics` after a run puts the plan and the measured figures side by side.
Measured stage results under --reports-dir, with the run logs under --runs-dir, replace estimates
where they exist and were measured on the same target, data and drafter (docs/pipeline.md,
"Metrics read by `draftline plan`").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from draftline.drafter import memory_plan
from draftline.ops import planning
from draftline.runtime import hardware, params, run_log

METRIC_FILES = ("curate", "validate", "extract", "train")


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. model=qwen3_6_27b (default: --params)"
    )
    parser.add_argument("--config-dir", default="conf")
    parser.add_argument(
        "--reports-dir",
        default=str(run_log.REPORTS_DIR),
        help=f"stage results of a run ({run_log.REPORTS_DIR}: git-tracked, each with its identity)",
    )
    parser.add_argument(
        "--runs-dir",
        help=f"stage run logs (timings, hardware); default: {run_log.RUNS_DIR} beside the "
        "reports folder, i.e. of the same checkout",
    )
    parser.add_argument(
        "--params", default="params.yaml", help="params to plan when no overrides are given"
    )
    parser.add_argument(
        "--samples", type=positive_int, help="conversations to generate (overrides all)"
    )
    parser.add_argument("--completion-tokens", type=positive, help="mean completion tokens/sample")
    parser.add_argument("--prompt-tokens", type=positive, help="mean prompt tokens per sample")
    parser.add_argument(
        "--storage-budget-tb",
        type=positive,
        default=planning.DEFAULT_STORAGE_BUDGET_TB,
        help=f"flag offline features above this (default {planning.DEFAULT_STORAGE_BUDGET_TB:g})",
    )
    parser.add_argument(
        "--time-limit-days",
        type=positive,
        default=planning.DEFAULT_TIME_LIMIT_DAYS,
        help=f"flag stages longer than this (default {planning.DEFAULT_TIME_LIMIT_DAYS:g})",
    )
    parser.add_argument(
        "--from-metrics",
        action="store_true",
        help="show the estimate-only plan and the plan from measured metrics side by side",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the memory per GPU (measured on fake tensors: seconds per profile, "
        f"remembered under {memory_cache()})",
    )


def read_metrics(
    folder: str | Path, runs_dir: str | Path | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Parsed stage metrics under `folder` (missing files are skipped) and notes on bad ones.

    A stage's run log under `runs_dir` (logs/runs: timings, throughput, hardware) completes
    its metrics; generate shards have only a run log. Each stage records the model, data and
    drafter it ran on; planning uses a file only when they match the plan (params.yaml may have
    been recomposed since the run).
    """
    root = Path(folder)
    found: dict[str, Any] = {}
    notes: list[str] = []

    def load(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            notes.append(f"ignored {path}: {err}")
            return None
        if not isinstance(data, dict):
            notes.append(f"ignored {path}: not a JSON object")
            return None
        return {k: v for k, v in data.items() if v is not None}

    folders = [root] if runs_dir is None else [root, Path(runs_dir)]
    for name in METRIC_FILES:
        data: dict[str, Any] = {}
        for path in (base / f"{name}.json" for base in folders):
            if path.is_file() and (loaded := load(path)) is not None:
                if data and _identity(loaded) != _identity(data):
                    notes.append(f"ignored {path}: a run log of another run than {name}'s metrics")
                    continue
                data.update(loaded)
                found.setdefault("paths", {})[name] = path.as_posix()
        if data:
            found[name] = data
    shards = {}
    for base in folders:
        for path in sorted((base / "generate").glob("*.json")):
            if (data := load(path)) is not None:
                shards[path.as_posix()] = data
    if shards:
        found["generate"] = shards
    return found, notes


def _identity(record: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(record.get(k) for k in run_log.IDENTITY_KEYS)


def run(args: argparse.Namespace) -> int:
    if args.overrides:
        composed = params.compose(args.overrides, args.config_dir)
    else:
        composed = params.load(args.params)
    profiles = hardware.load_profiles(args.config_dir)
    # Beside the reports folder, kept relative when it is (notes name files as the user would).
    reports = Path(args.reports_dir)
    runs_dir = args.runs_dir or (reports if reports.name else reports.resolve()).parent / (
        run_log.RUNS_DIR
    )
    metrics, notes = read_metrics(args.reports_dir, runs_dir)
    if args.from_metrics and not metrics:
        raise SystemExit(
            f"no stage results under {args.reports_dir}/: run the pipeline first (dvc repro) "
            "or point --reports-dir at a run's reports"
        )
    memory = {} if args.no_memory else measure_memory(composed, profiles)
    options = {
        "memory": memory,
        "samples": args.samples,
        "completion_tokens": args.completion_tokens,
        "prompt_tokens": args.prompt_tokens,
        "storage_budget_tb": args.storage_budget_tb,
        "time_limit_days": args.time_limit_days,
    }
    plan = planning.build_plan(composed, profiles, metrics, **options)
    plan["notes"] = notes + plan["notes"]
    if args.from_metrics:
        planned = planning.build_plan(composed, profiles, {}, **options)
        result: dict[str, Any] = {
            "schema": planning.SCHEMA,
            "planned": planned,
            "measured": plan,
            "metrics_files": _metric_files(metrics, args.reports_dir),
        }
    else:
        result = plan
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    from rich.console import Console

    console = Console()
    if args.from_metrics:
        print_comparison(console, result["planned"], result["measured"])
    else:
        print_plan(console, plan)
    return 0


def memory_cache() -> Path:
    from draftline.drafter.memory import CACHE_DIR

    return CACHE_DIR


def measure_memory(
    composed: dict[str, Any], profiles: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Memory per GPU of every profile, with a status line on stderr while it is measured."""
    from rich.console import Console

    with Console(stderr=True).status("memory per GPU (fake tensors)") as status:

        def progress(what: str) -> None:
            status.update(f"memory per GPU (fake tensors): {what}")

        return {
            name: memory_plan.profile_memory(
                composed, {**profile, "name": name}, memory_cache(), progress
            )
            for name, profile in profiles.items()
        }


def _metric_files(metrics: dict[str, Any], folder: str) -> list[str]:
    files = [path for name, path in (metrics.get("paths") or {}).items() if name in METRIC_FILES]
    return files + sorted(metrics.get("generate") or {})


# Rendering (rich). Kept here: it is this command's presentation, the numbers live in planning.


def duration(seconds: float | None) -> str:
    """Days for long stages, smaller units for the short stages of a CPU run."""
    if seconds is None:
        return "—"
    if seconds >= planning.DAY_S:
        return f"{seconds / planning.DAY_S:,.2f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _stage_cell(info: dict[str, Any]) -> str:
    text = duration(info["seconds"])
    if info.get("range_days"):
        low, high = info["range_days"]
        text += f" ({low:.2f}–{high:.2f})"
    return f"[bold red]{text} ![/]" if info["over_limit"] else text


def _money(value: float | None) -> str:
    return "—" if value is None else f"${value:,.0f}"


def _rate(figure: dict[str, Any]) -> str:
    value = figure.get("value")
    if value is None:
        return "—"
    text = f"{value:,.0f}"
    if figure.get("low") is not None and figure.get("high") is not None:
        text += f" ({figure['low']:,.0f}–{figure['high']:,.0f})"
    return text


def _header(plan: dict[str, Any]) -> str:
    m = plan["model"]
    return (
        f"[bold]{m['name']}[/] ({m['ref']}), drafter {plan['drafter']['name']} x "
        f"{plan['drafter']['epochs']} epochs, data {plan['data']}, features {plan['features']}"
    )


def _input_rows(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
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

    console.print(_header(plan))
    inputs = Table(title="Inputs", title_justify="left")
    inputs.add_column("input", overflow="fold")
    inputs.add_column("value", justify="right", no_wrap=True)
    inputs.add_column("source", overflow="fold")
    for row in _input_rows(plan):
        inputs.add_row(*row)
    console.print(inputs)

    s = plan["storage"]
    over = " [bold red]over budget ![/]" if s["over_budget"] else ""
    console.print(
        f"Offline features: [bold]{s['offline_features_tb']:,.1f} TB[/] "
        f"(budget {s['budget_tb']:g} TB){over}; online token packs "
        f"{s['online_token_packs_bytes'] / 1e9:,.1f} GB"
    )
    limit = plan["limits"]["time_limit_days"]
    # Profiles with no figure for this target (CPU ones before a run there) would be columns of
    # dashes: they are named once instead.
    every = list(plan["profiles"].values())
    known = [p for p in every if any(s["seconds"] is not None for s in p["stages"].values())]
    unknown = [p["name"] for p in every if p not in known] if known else []
    profiles = known or every
    rows: list[tuple[str, list[str]]] = [("$/h", [f"{p['price_per_hour']:g}" for p in profiles])]
    rows += [
        (key.replace("_", " "), [_stage_cell(p["stages"][key]) for p in profiles])
        for key in planning.STAGES
    ]
    for mode in ("offline", "online"):
        rows.append((f"total {mode}", [duration(p["total"][mode]["seconds"]) for p in profiles]))
    for mode in ("offline", "online"):
        rows.append((f"cost {mode}", [_money(p["total"][mode]["cost_usd"]) for p in profiles]))
    console.print(
        _by_profile(f"Wall time per stage (! over the {limit:g}-day limit)", profiles, rows)
    )
    if unknown:
        console.print(
            f"[dim]Not shown: {', '.join(unknown)}: no throughput for this target "
            "(measured on a run there, or throughput.* in conf/hardware/)[/]"
        )
    console.print(generation_line(plan))

    console.print("[bold]Throughput[/] (tokens/s)")
    for p in profiles:
        for key, figure in p["throughput"].items():
            what = f"{p['name']} {key.removesuffix('_tok_s')}"
            console.print(f"  {what}: [bold]{_rate(figure)}[/] [dim]({figure['source']})[/]")
    _print_memory(console, plan)
    _print_advice(console, plan)


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
    for item in dict.fromkeys(k for h in held for k in h):
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


def _print_advice(console: Any, plan: dict[str, Any]) -> None:
    for flag in plan["flags"]:
        console.print(f"[bold red]FLAG[/] {flag['message']}")
    for rec in plan["recommendations"]:
        console.print(f"[bold green]RECOMMEND[/] {rec['message']}")
    for note in plan.get("notes") or []:
        console.print(f"[yellow]note[/] {note}")


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
    console.print(_header(measured))
    _print_with_sources(
        console,
        _figures_table("Inputs", "input"),
        [
            (label, plan_value, value, source)
            for (label, plan_value, _), (_, value, source) in zip(
                _input_rows(planned), _input_rows(measured), strict=True
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
            rows.append((label, _stacked(_rate(a)), _stacked(_rate(b)), b["source"]))
        for key in planning.STAGES:
            rows.append(
                (
                    f"{key.replace('_', ' ')} time",
                    _stacked(_stage_cell(p_plan["stages"][key])),
                    _stacked(_stage_cell(p_meas["stages"][key])),
                    p_meas["stages"][key]["source"],
                )
            )
        for mode in ("offline", "online"):
            a, b = p_plan["total"][mode], p_meas["total"][mode]
            rows.append((f"total {mode}", duration(a["seconds"]), duration(b["seconds"]), ""))
            rows.append((f"cost {mode}", _money(a["cost_usd"]), _money(b["cost_usd"]), ""))
        _print_with_sources(console, _figures_table(p_meas["name"], "figure"), rows)
    _print_advice(console, measured)
