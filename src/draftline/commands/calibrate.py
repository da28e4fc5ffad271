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
from pathlib import Path
from typing import Any

from draftline.ops import calibration
from draftline.runtime import atomic, hardware, params


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


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise SystemExit("calibrate: --minutes must be > 0")
    p = params.load(args.params)
    profile = hardware.resolve_profile(p["hardware"])
    budget = calibration.split_budget(args.minutes, args.stages)
    progress = not args.no_progress

    def say(line: str) -> None:
        print(f"calibrate: {line}", flush=True)

    say(
        f"profile {profile.get('name')}, {args.minutes:g} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in budget.items())
    )
    parts: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    sequences: list[list[int]] = []
    for part in args.stages:
        try:
            if part == "generate":
                parts[part], sequences = calibration.measure_generation(
                    p, profile, budget[part], say, progress
                )
            elif part == "extract":
                parts[part] = calibration.measure_extraction(
                    p, profile, sequences, budget[part], progress
                )
            else:
                parts[part] = calibration.measure_training(
                    p, profile, sequences, budget[part], progress
                )
        except (calibration.PartSkipped, SystemExit, Exception) as exc:
            # One line and on to the next part: a missing server must not cost the others.
            skipped[part] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            say(f"{part} not measured: {skipped[part]}")
            continue
        say(summary(part, parts[part]))
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


def summary(part: str, figures: dict[str, Any]) -> str:
    """One line per part: its rate and what it was measured over."""
    gib = figures.get("peak_gpu_bytes")
    memory = f", peak GPU {gib / 2**30:.1f} GiB" if gib else ""
    mfu = f", MFU {figures['mfu']:.1%}" if figures.get("mfu") is not None else ""
    if part == "generate":
        lengths = figures["completion_tokens"] or {}
        turns = figures["turns_per_conversation"] or {}
        rate = figures["output_tok_s"]
        return (
            f"generate: {'n/a' if rate is None else f'{rate:,.1f}'} out tok/s "
            f"({figures['steady_state']}), {figures['turns_generated']} turns, completion "
            f"mean {lengths.get('mean', 0):,.0f} (p90 {lengths.get('p90', 0):,.0f}), "
            f"{turns.get('mean', 0):.2f} turns/conversation, cap {figures['running_cap']} "
            f"in flight (mean {figures['mean_in_flight']}), finish {figures['finish_reasons']}"
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
