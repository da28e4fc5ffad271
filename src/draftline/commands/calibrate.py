"""Measure this node's generate, extract and train throughput in a few minutes, after curate,
for `draftline plan` to use instead of the conf/ estimates of its hardware profile.

  draftline calibrate --minutes 10
  draftline calibrate --minutes 2 --stages extract,train

generate: the engine `draftline generate` would use (the profile's servers, started by
`draftline serve start`; the local engine on a CPU) on a sample of curated conversations, every
turn, with the production scheduler: steady-state output tok/s, turn lengths (think, answer),
turns per conversation, finish reasons, the engine's in-flight cap. extract: the target forward
over the generated sequences. train: the training step as configured (features, drafter family,
block, anchors, layout). The budget is split half to generate, a quarter to each of the others;
a part that cannot run says why and the others go on.

Writes logs/calibration/<profile>.json only (git-ignored; no DVC output, journal or dvc.lock is
touched, and the generated turns are dropped). `draftline doctor` says when it is stale.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from draftline.ops import calibration, calibration_generate, calibration_measure
from draftline.runtime import atomic, distributed, hardware, params


def stages(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in calibration.PARTS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"{','.join(unknown) or 'none'}: choose from {','.join(calibration.PARTS)}"
        )
    return [s for s in calibration.PARTS if s in chosen]  # generate feeds the others


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    parser.add_argument(
        "--stages",
        type=stages,
        default=list(calibration.PARTS),
        help="parts to measure (default generate,extract,train)",
    )
    parser.add_argument("--params", default="params.yaml", help="composed parameters")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=calibration.CALIBRATION_DIR,
        help=f"where <profile>.json goes (default {calibration.CALIBRATION_DIR})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    # A worker of a multi-process calibration (`in_processes`): its input and output folder.
    parser.add_argument("--worker-dir", type=Path, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise SystemExit("calibrate: --minutes must be > 0")
    p = params.load(args.params)
    profile = hardware.resolve_profile(p["hardware"])
    if args.worker_dir is not None:
        return run_worker(args.worker_dir, p, profile, not args.no_progress)
    budget = calibration.split_budget(args.minutes, args.stages)
    progress = not args.no_progress
    say(
        f"profile {profile.get('name')}, {args.minutes:g} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in budget.items())
    )
    parts: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    sequences: list[list[int]] = []
    if "generate" in args.stages:
        try:
            parts["generate"], sequences = calibration_generate.measure_generation(
                p, profile, budget["generate"], say, progress
            )
            say(summary("generate", parts["generate"]))
        except (calibration.PartSkipped, SystemExit, Exception) as exc:
            skipped["generate"] = one_line(exc)
            say(f"generate not measured: {skipped['generate']}")
    later = {k: v for k, v in budget.items() if k != "generate"}
    processes = hardware.Execution.of(profile).processes_per_node
    if later and processes > 1 and not distributed.launched_by_torchrun():
        measured, failed = in_processes(processes, args, later, sequences)
    else:
        measured, failed = measure_parts(p, profile, later, sequences, progress, keep_going=True)
    parts.update(measured)
    skipped.update(failed)
    if not parts:
        say("nothing measured; nothing written")
        return 1
    engine = (parts.get("generate") or {}).get("engine")
    record = {
        "schema": calibration.SCHEMA,
        **calibration.key_of(p, profile, engine),
        "minutes": args.minutes,
        "parts": parts,
        "skipped": skipped,
        "figures": calibration.plan_figures(parts),
    }
    path = calibration.calibration_path(str(profile.get("name")), args.out_dir)
    atomic.write_json(path, record)
    say(f"wrote {path}; `draftline plan` now uses it for {profile.get('name')}")
    return 0


def say(line: str) -> None:
    print(f"calibrate: {line}", flush=True)


def first_process() -> bool:
    """The worker that speaks and writes (each part closes its process group: the
    environment, not the group, says which this is)."""
    return os.environ.get("RANK", "0") == "0"


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def measure_parts(
    p: dict[str, Any], profile: dict[str, Any], budget: dict[str, float],
    sequences: list[list[int]], progress: bool, keep_going: bool,
) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """The extract and train parts in this process (one of several under `in_processes`).
    `keep_going`: a part that fails says why in one line and the next runs; a worker instead
    stops at once, as its peers would otherwise wait in a collective."""
    first = first_process()
    parts: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    measures = {
        "extract": calibration_measure.measure_extraction,
        "train": calibration_measure.measure_training,
    }
    try:
        for part, seconds in budget.items():
            try:
                parts[part] = measures[part](p, profile, sequences, seconds, progress and first)
            except calibration.PartSkipped as exc:
                skipped[part] = one_line(exc)
            except (SystemExit, Exception) as exc:
                if not keep_going:
                    raise
                skipped[part] = one_line(exc)
            if first:
                say(
                    summary(part, parts[part])
                    if part in parts
                    else f"{part} not measured: {skipped[part]}"
                )
    finally:
        # One process group for both parts: joining a second over the same store races (a
        # rank passes the new group's barrier on the old group's keys while its peer waits).
        distributed.close()
    return parts, skipped


def in_processes(
    processes: int, args: argparse.Namespace, budget: dict[str, float], sequences: list[list[int]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The extract and train parts over the profile's processes, as their stages run: this
    command again as that many workers (`distributed.run_in_local_processes`), handed the
    generated sequences and the budget through a temporary folder outside the project."""
    with tempfile.TemporaryDirectory(prefix="draftline-calibrate-") as folder:
        work = Path(folder)
        (work / "input.json").write_text(json.dumps({"budget": budget, "sequences": sequences}))
        say(f"{', '.join(budget)} over {processes} processes")
        argv = ["draftline", "calibrate", "--params", args.params, "--worker-dir", folder]
        code = distributed.run_in_local_processes(
            processes, argv + (["--no-progress"] if args.no_progress else [])
        )
        result = work / "parts.json"
        if code != 0 or not result.exists():
            why = f"the {processes} worker processes failed (exit {code}; their output above)"
            return {}, dict.fromkeys(budget, why)
        done = json.loads(result.read_text())
        return done["parts"], done["skipped"]


def run_worker(folder: Path, p: dict[str, Any], profile: dict[str, Any], progress: bool) -> int:
    """One worker of `in_processes`: measure, and the first writes what the node measured."""
    given = json.loads((folder / "input.json").read_text())
    parts, skipped = measure_parts(
        p, profile, given["budget"], given["sequences"], progress, keep_going=False
    )
    if first_process():
        atomic.write_json(folder / "parts.json", {"parts": parts, "skipped": skipped})
    return 0


def summary(part: str, figures: dict[str, Any]) -> str:
    """One line per part: its rate and what it was measured over."""
    gib = figures.get("peak_gpu_bytes")
    memory = f", peak GPU {gib / 2**30:.1f} GiB" if gib else ""
    mfu = f", MFU {figures['mfu']:.1%}" if figures.get("mfu") is not None else ""
    if part == "generate":
        lengths = figures["completion_tokens"] or {}
        turns = figures["turns_per_conversation"] or {}
        rate = figures["output_tok_s"]
        cache = figures.get("prefix_cache")
        cached = (
            f", prefix cache {cache['hit_share']:.0%} of prompt tokens"
            if isinstance(cache, dict)
            else ""
        )
        return (
            f"generate: {'n/a' if rate is None else f'{rate:,.1f}'} out tok/s "
            f"({figures['steady_state']}), {figures['turns_generated']} turns, completion "
            f"mean {lengths.get('mean', 0):,.0f} (p90 {lengths.get('p90', 0):,.0f}), "
            f"{turns.get('mean', 0):.2f} turns/conversation, cap {figures['running_cap']} "
            f"in flight (mean {figures['mean_in_flight']}), finish {figures['finish_reasons']}"
            f"{cached}"
        )
    if part == "extract":
        return (
            f"extract: {figures['tokens_per_s']:,.0f} tok/s over {figures['tokens']:,} tokens "
            f"({figures['sequences_from']}){mfu}{memory}"
        )
    return (
        f"train: {figures['tokens_per_s']:,.0f} seq tok/s, {figures['steps']} steps, "
        f"{figures['features']} features, {figures['sharding']} over {figures['world_size']}, "
        f"{figures['precision']}{mfu}{memory}"
    )
