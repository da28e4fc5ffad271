"""Time, storage and cost of a run on each hardware profile, before spending them.

Without overrides it plans params.yaml (what `dvc repro` would run); with overrides, conf/
composed with them. Measured stage results under --reports-dir, with the run logs under
--runs-dir, replace estimates where they exist and were measured on the same target, data and
drafter (docs/pipeline.md, "Results read by `draftline plan`"). Examples:

  draftline plan model=qwen3_6_27b data=sharegpt drafter=dflash_b16
  draftline plan model=qwen3_6_27b drafter=dflash_b16 --samples 914000 --completion-tokens 2500
  draftline plan --from-metrics      # after a run: the plan and the measured figures side by side
  draftline plan --generate-on b200x8 --train-on pro6000x4   # one node trains while one generates

With two GPU profiles or more, a "Two nodes" table shows one profile generating while another
trains each shard once it is pushed, beside the sequential runs (by default the fastest
generator and each other profile; draftline.ops.plan.topology says how it is counted).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from draftline.drafter import memory_plan
from draftline.ops.plan import build, topology
from draftline.ops.plan.comparison import print_comparison
from draftline.ops.plan.tables import print_plan
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
    parser.add_argument("--config-dir", default="conf", help="the Hydra tree to compose (conf)")
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
        default=build.DEFAULT_STORAGE_BUDGET_TB,
        help=f"flag offline features above this (default {build.DEFAULT_STORAGE_BUDGET_TB:g})",
    )
    parser.add_argument(
        "--time-limit-days",
        type=positive,
        default=build.DEFAULT_TIME_LIMIT_DAYS,
        help=f"flag stages longer than this (default {build.DEFAULT_TIME_LIMIT_DAYS:g})",
    )
    parser.add_argument(
        "--from-metrics",
        action="store_true",
        help="show the estimate-only plan and the plan from measured metrics side by side",
    )
    parser.add_argument(
        "--generate-on",
        metavar="PROFILE",
        help="Two nodes: the profile that generates (default: the fastest at it)",
    )
    parser.add_argument(
        "--train-on",
        metavar="PROFILE",
        help="Two nodes: the profile that trains while it generates (default: each other one)",
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
    plan = build.build_plan(composed, profiles, metrics, **options)
    topology.add_two_nodes(plan, composed, profiles, args.generate_on, args.train_on)
    plan["notes"] = notes + plan["notes"]
    if args.from_metrics:
        planned = build.build_plan(composed, profiles, {}, **options)
        pairs = [(p["generate_on"], p["train_on"]) for p in plan["two_nodes"]]
        topology.add_two_nodes(planned, composed, profiles, pairs=pairs)
        result: dict[str, Any] = {
            "schema": build.SCHEMA,
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
    """Memory per GPU of every profile, with progress on stderr while it is measured (a status
    line on a terminal, a line per measurement otherwise: the first run takes minutes)."""
    import logging

    from rich.console import Console

    # Measuring on fake tensors runs the hybrid layers' reference torch code on this machine,
    # so transformers warns that causal-conv1d and flash-linear-attention are missing ("much
    # slower"). Neither speed nor this machine's kernels is what the plan reports: silenced
    # here; `draftline doctor` checks the kernels on the node that runs the stages.
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    console = Console(stderr=True)
    title = f"memory per GPU (fake tensors; remembered in {memory_cache()})"
    with console.status(title) as status:

        def progress(what: str) -> None:
            if console.is_terminal:
                status.update(f"{title}: {what}")
            else:
                console.print(f"plan: measuring {what}", highlight=False)

        return {
            name: memory_plan.profile_memory(
                composed, {**profile, "name": name}, memory_cache(), progress
            )
            for name, profile in profiles.items()
        }


def _metric_files(metrics: dict[str, Any], folder: str) -> list[str]:
    files = [path for name, path in (metrics.get("paths") or {}).items() if name in METRIC_FILES]
    return files + sorted(metrics.get("generate") or {})
