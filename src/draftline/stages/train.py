"""Stages `train_shard@K` and `train`: extracted data -> DFlash drafter, metrics and plots.

`draftline train --shard K` is a link of the chain that follows generation: the first epoch's
steps over shard K, resumed from link K-1's state (`models/chain/shard-K-1/`), its own state
left in `models/chain/shard-K/` for the next (`draftline.drafter.step_plan`). Plain
`draftline train` trains the remaining epochs over every shard from the last link's state and
exports the drafter (`models/drafter/`) with metrics and plots. Without shards in the params
(no `data.shard_ids`: a run outside the pipeline), `--data` is one extraction folder and it
trains a whole run in one go. Which of these a call is (`training_mode`) follows from the
params and the stage's inputs alone, never from what happens to be on disk.

With a hardware profile of several processes per node it reruns itself as that many processes
(`distributed.run_in_local_processes`, rendezvous on loopback), laid out as the profile says
(`sharding: ddp | fsdp`, `activation_checkpointing`); under a torchrun the user started
(several nodes) it takes its rank from the environment.
A killed run resumes from `.draftline/train/checkpoint/` (working state, not a DVC output; a
torch.distributed.checkpoint folder, so on the same or another world size) and ends exactly
where an uninterrupted run would have.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draftline.core import target
from draftline.drafter.training_mode import TrainingMode
from draftline.runtime import distributed, hardware, params, run_log
from draftline.runtime.atomic import write_text

# What was trained and how well; timings, resume state and the batch split go to the run log.
RESULT_KEYS = (
    "steps", "num_sequences", "dropped_sequences", "global_batch_size", "first_loss",
    "final_loss", "final_accuracy", "final_accuracy_per_position",
    "final_selector_recall_top1", "final_selector_recall_topk",
)  # fmt: skip
# What `dvc exp show` compares (the rest is in reports/train.json), in its column order: the
# final loss comes right after evaluate's tau (dvc.yaml's top-level `metrics:` order); the
# selector's recall only for DFlash2 runs (the keys a record lacks are left out).
COMPARE_KEYS = (
    "final_loss",
    "final_accuracy",
    "final_selector_recall_top1",
    "final_selector_recall_topk",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="composed parameters")
    parser.add_argument(
        "--data", default="data/extracted", help="extracted packs (shard-K/ folders, or one)"
    )
    parser.add_argument(
        "--shard", type=int, default=None, help="train only this shard's link of the chain"
    )
    parser.add_argument("--chain", default="models/chain", help="the links' states (a folder)")
    parser.add_argument(
        "--curate-summary",
        default="data/curated/summary.json",
        help="curate's row counts: the planned rows that fix the step count",
    )
    parser.add_argument("--out", default="models/drafter", help="exported drafter folder")
    parser.add_argument(
        "--metrics", default="metrics/train.json", help="metrics file (metrics/train.json)"
    )
    run_log.add_arguments(parser, "train", throughput=True)
    parser.add_argument("--live", default="dvclive/train", help="dvclive folder (plots)")
    parser.add_argument("--plots", default="plots/train", help="folder of plot CSVs")
    parser.add_argument(
        "--checkpoint", default=".draftline/train/checkpoint", help="resume state (a folder)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=25, help="steps between checkpoints"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    p = params.load(args.params)
    target.require_model(p["model"])  # before torchrun starts workers that would each fail
    profile = hardware.resolve_profile(p["hardware"])
    relaunched = distributed.run_in_local_processes(
        hardware.Execution.of(profile).processes_per_node, ["draftline", "train", *_forwarded(args)]
    )
    if relaunched is not None:
        return relaunched

    from draftline.drafter.export import export_drafter
    from draftline.drafter.sharding import Layout
    from draftline.drafter.training import Hyperparameters, RunOptions, train

    execution = hardware.Execution.of(profile)
    execution.set_threads()
    hp = Hyperparameters.from_params(p["drafter"])
    options = RunOptions(
        device=execution.device,
        precision=execution.precision,
        micro_batch_size=execution.micro_batch_size,
        layout=Layout.of(profile),
        checkpoint_path=_working_checkpoint(Path(args.checkpoint), args.shard),
        checkpoint_every=args.checkpoint_every,
        live_dir=Path(args.live),
        progress=not args.no_progress,
    )
    mode = training_mode(args, p)
    try:
        result = train(mode, p["model"], hp, options)
        if mode.link is not None:
            if distributed.rank() == 0:
                print(
                    f"train: link {mode.link}: steps {result.resumed_from_step}.."
                    f"{result.extra['chain_steps']} of {result.extra['plan']['total_steps']} "
                    f"on {result.num_sequences} sequences; state in {mode.save_to}"
                )
        elif distributed.rank() == 0:
            export_drafter(result.drafter, args.out)
            record = {**metrics(result, hp, options, profile), **params.identity(p)}
            run_log.write(args, "train", record, RESULT_KEYS, COMPARE_KEYS, record["tokens_per_s"])
            write_accuracy_per_position(Path(args.plots), result.history)
            last = result.history[-1] if result.history else {}
            print(
                f"train: {result.steps} steps on {result.num_sequences} sequences "
                f"({result.dropped_sequences} dropped), final loss {last.get('loss', 0):.3f}, "
                f"accuracy {last.get('acc', 0):.3f}, {result.tokens_per_s:.0f} tokens/s; "
                f"drafter in {args.out}"
            )
    finally:
        distributed.close()
    return 0


def training_mode(args: argparse.Namespace, p: dict[str, Any]) -> TrainingMode:
    """What this call trains, from the params and the stage's inputs as dvc.yaml declares
    them (`--data`, `--chain`, `--curate-summary`): with shards in the params, link `--shard`
    of the chain or, without it, the steps after the chain; without shards, a whole run of
    the one folder `--data`."""
    from draftline.drafter.packs import shard_folder

    shard_ids = [int(k) for k in (p.get("data") or {}).get("shard_ids", [])]
    data, chain = Path(args.data), Path(args.chain)
    if not shard_ids:
        if args.shard is not None:
            raise SystemExit(f"train --shard {args.shard}: the params have no data.shard_ids")
        return TrainingMode.whole_run(data)
    if args.shard is None:
        shards = [shard_folder(data, k) for k in shard_ids]
        return TrainingMode.after_the_chain(shards, shard_folder(chain, shard_ids[-1]))
    k = args.shard
    if k not in shard_ids:
        raise SystemExit(f"train --shard {k}: not one of data.shard_ids {shard_ids}")
    folder, save_to = shard_folder(data, k), shard_folder(chain, k)
    position = shard_ids.index(k)
    if position == 0:  # the first link plans the run from curate's rows
        rows = planned_sequences(Path(args.curate_summary), p)
        return TrainingMode.chain_link(k, folder, save_to, planned_rows=rows)
    before = shard_folder(chain, shard_ids[position - 1])
    return TrainingMode.chain_link(k, folder, save_to, start_from=before)


def _working_checkpoint(path: Path, shard: int | None) -> Path:
    """A link's resume state beside the run's (`checkpoint-shard-K`), never inside it."""
    return path if shard is None else path.with_name(f"{path.name}-shard-{shard}")


def planned_sequences(summary: Path, p: dict[str, Any]) -> int:
    """The training sequences curate planned: what the step count is fixed from before any
    shard is generated. One per conversation, or one per turn the target will write when
    every turn is regenerated and trained on its own (extract.rows=turn)."""
    import json

    if not summary.is_file():
        raise SystemExit(f"{summary} not found: run curate first (dvc repro curate)")
    curated = json.loads(summary.read_text(encoding="utf-8"))
    per_turn = (p.get("extract") or {}).get("rows", "turn") == "turn"
    if per_turn and (p.get("data") or {}).get("regenerate_turns", "all") == "all":
        if "train_turns" not in curated:
            raise SystemExit(f"{summary} predates per-turn rows: rerun curate (dvc repro curate)")
        return int(curated["train_turns"])
    return int(curated["train_rows"])


def metrics(result: Any, hp: Any, options: Any, profile: dict[str, Any]) -> dict[str, Any]:
    from draftline.drafter.training import POSITION_PREFIX

    last = result.history[-1] if result.history else {}
    return {
        "steps": result.steps,
        "resumed_from_step": result.resumed_from_step,
        "num_sequences": result.num_sequences,
        "dropped_sequences": result.dropped_sequences,
        "final_loss": last.get("loss"),
        "final_accuracy": last.get("acc"),
        "final_accuracy_per_position": [
            last.get(f"{POSITION_PREFIX}{k}") for k in range(1, hp.block_size)
        ],
        "first_loss": result.history[0]["loss"] if result.history else None,
        "tokens_this_run": result.tokens_this_run,
        "seconds": round(result.seconds, 3),
        "tokens_per_s": result.tokens_per_s,
        "world_size": result.world_size,
        "micro_batch_size": options.micro_batch_size,
        "global_batch_size": hp.global_batch_size,
        "features": "online" if result.extra.get("online") else "offline",
        # DFlash2: its selector's last recall@1 and recall@top-k (`selector_objective`).
        **{f"final_{k}": v for k, v in last.items() if k.startswith("selector_recall")},
        **options.layout.describe(),
        **hardware.describe(profile),
    }


def write_accuracy_per_position(folder: Path, history: list[dict[str, float]]) -> None:
    """accuracy_per_position.csv: step, position, accuracy (one row per step and position).

    One long table rather than one file per position, so a single chart (template
    `lines_by_position`) draws every position whatever the block size.
    """
    from draftline.drafter.training import POSITION_PREFIX

    rows = ["step,position,accuracy"]
    for step, record in enumerate(history):
        for key, value in record.items():
            if key.startswith(POSITION_PREFIX):
                rows.append(f"{step},{key[len(POSITION_PREFIX) :]},{value:.6g}")
    write_text(folder / "accuracy_per_position.csv", "\n".join(rows) + "\n")


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = [
        f"--params={args.params}", f"--data={args.data}", f"--out={args.out}",
        f"--metrics={args.metrics}", f"--report={args.report}", f"--run-log={args.run_log}",
        f"--throughput={args.throughput}", f"--live={args.live}", f"--plots={args.plots}",
        f"--checkpoint={args.checkpoint}",
        f"--checkpoint-every={args.checkpoint_every}", f"--chain={args.chain}",
        f"--curate-summary={args.curate_summary}",
    ]  # fmt: skip
    if args.shard is not None:
        out.append(f"--shard={args.shard}")
    return [*out, "--no-progress"] if args.no_progress else out
