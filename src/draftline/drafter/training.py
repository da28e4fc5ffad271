"""Training loop of the DFlash drafter: data, optimisation, distribution, checkpoints, metrics.

- Data: the packs of `data/extracted/shard-K/` (docs/pipeline.md); sequences with fewer than
  2B supervised tokens are dropped. Offline packs carry the target features; online packs do
  not and the frozen target computes them per micro-batch (`draftline.drafter.features`).
- Steps: fixed from the planned rows; the first epoch reads shard by shard, so a chain of
  stages can train on each shard as soon as it is generated, and the rest reads every shard
  (`draftline.drafter.step_plan`). `Segment` says which part a call trains: a whole run, one
  link of the chain (its state saved for the next), or the steps after the chain.
- The global batch (`drafter.global_batch_size` sequences) is fixed; the hardware profile only
  splits it: micro-batch x accumulation x world size. Each step's loss is the weighted CE summed
  over the whole global batch divided by its total weight, so every split gives the same
  gradient (up to float summation order). Anchors are seeded per sample and epoch.
- AdamW, cosine schedule with linear warmup, gradient clipping; precision fp32 or bf16
  (autocast, fp32 master weights) from the hardware profile; DDP or FSDP2 through torchrun,
  with or without activation checkpointing, as the profile lays it out
  (`draftline.drafter.sharding`). Online, the frozen target is cut after its last needed layer
  and, under FSDP, sharded too.
- A checkpoint (model, optimiser, schedule, step; `draftline.drafter.checkpoints`) is written
  every few steps with torch.distributed.checkpoint; a rerun, on the same or another world
  size, resumes from it and ends where an uninterrupted run would have. A link's state, in
  the same format, is its stage's output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from draftline.drafter import checkpoints, sharding
from draftline.drafter.build import Hyperparameters, build_drafter, load_target_head
from draftline.drafter.dflash import DFlashDrafter
from draftline.drafter.objective import (
    LossParts,
    MicroBatch,
    block_loss,
    collate,
    make_blocks,
)
from draftline.drafter.packs import ExtractedData
from draftline.drafter.selector_objective import SelectorObjective, selector_loss
from draftline.drafter.sharding import Layout
from draftline.drafter.step_plan import StepPlan
from draftline.drafter.step_records import (  # noqa: F401 (POSITION_PREFIX: the stage's)
    POSITION_PREFIX,
    Metrics,
    add_parts,
    selector_record,
    step_record,
)
from draftline.runtime import distributed

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class RunOptions:
    """How it runs: device, precision and micro-batch from the hardware profile; files."""

    device: str = "cpu"
    precision: str = "fp32"
    micro_batch_size: int = 4
    layout: Layout = field(default_factory=Layout)  # sharding, activation checkpointing
    checkpoint_path: Path | None = None  # a folder (`draftline.drafter.checkpoints`)
    checkpoint_every: int = 50
    live_dir: Path | None = None
    progress: bool = True


@dataclass
class TrainResult:
    drafter: DFlashDrafter
    steps: int
    history: list[dict[str, float]]
    tokens: int  # over every run that led here (a resumed run adds to the checkpoint's)
    seconds: float  # step time, likewise
    num_sequences: int
    dropped_sequences: int
    world_size: int
    resumed_from_step: int
    tokens_this_run: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Distribution


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: str) -> World:
    """Join the torchrun process group when launched by torchrun, else a world of one."""
    distributed.init("nccl" if device.startswith("cuda") else "gloo")
    return World(distributed.rank(), distributed.world_size(), distributed.local_rank())


def split_global_batch(batch: list[int], world: World, micro: int) -> list[list[int]]:
    """This process's micro-batches of one global batch (contiguous share of it)."""
    share = len(batch) // world.size
    mine = batch[world.rank * share : (world.rank + 1) * share]
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


# ---------------------------------------------------------------------------------------------
# Schedule and checkpoints


def cosine_with_warmup(total_steps: int, warmup_ratio: float) -> Any:
    warmup = max(1, math.ceil(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def chain_fingerprint(model: dict[str, Any], hp: Hyperparameters) -> str:
    """What a run's states belong to, whatever data each link read: a changed param or target
    (`target_id`: other weights in the same folder, whose features online training computes)
    never resumes one. Paths are left out: the same weights elsewhere resume the same run."""
    names = ("target_id", "target_layer_ids", "mask_token_id")
    keys = {k: model.get(k) for k in names}
    text = json.dumps({"model": keys, "hp": hp.identity()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_fingerprint(model: dict[str, Any], hp: Hyperparameters, data: ExtractedData) -> str:
    """What a working checkpoint belongs to: the run and the packs it reads."""
    text = f"{chain_fingerprint(model, hp)}|{data.fingerprint}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# The loop


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    if precision not in PRECISIONS:
        raise SystemExit(f"hardware.precision={precision!r}: training supports fp32 or bf16")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def step_loss(
    trained: nn.Module,
    lm_head_weight: torch.Tensor,
    features: torch.Tensor,
    mb: MicroBatch,
    selector: SelectorObjective | None = None,
    drafter: DFlashDrafter | None = None,
) -> LossParts:
    """The drafter's forward and the objective on one micro-batch: the one place the loss is
    called, by the loop and by the memory plan (`draftline.drafter.memory`). DFlash2 adds its
    selector's term (`selector_objective`; `drafter`: the module that `trained` lays out)."""
    hidden = trained(features, mb.block_ids, mb.anchors)
    parts = block_loss(hidden, lm_head_weight, mb.labels, mb.weights)
    if selector is not None and drafter is not None:
        parts.selector = selector_loss(drafter, hidden, mb.labels, mb.weights, selector)
    return parts


def load_online_target(
    model: dict[str, Any],
    layer_ids: list[int],
    device: torch.device,
    precision: str,
    layout: Layout,
    world_size: int,
) -> nn.Module:
    """The frozen target that computes features online: in the run's precision, straight onto
    its device, cut after its last needed layer, and sharded per layer under FSDP."""
    from draftline.core.target import load_model
    from draftline.drafter.features import needed_layers_only

    target = needed_layers_only(load_model(model, device=str(device), dtype=precision), layer_ids)
    if layout.sharding == "fsdp" and world_size > 1:
        sharding.shard_target(target, sharding.mesh(device, world_size))
    return target


@dataclass
class Segment:
    """The part of the run one call trains (`draftline.drafter.step_plan`): every step (the
    default: the data's folders are the shards, in order), one chain link (the first epoch's
    steps over shard `link`; the data is that shard), or the steps after the chain (the data
    is every shard)."""

    link: int | None = None
    after_chain: bool = False
    start_from: Path | None = None  # the state the previous link left (links after the first)
    planned_rows: int | None = None  # fixes the step count; default: the usable sequences
    save_to: Path | None = None  # where a link leaves its state for the next stage

    def describe(self) -> str:
        if self.link is not None:
            return f"link {self.link}"
        return "after the chain" if self.after_chain else "whole run"


def train(
    data_dirs: str | Path | list[Path],
    model: dict[str, Any],
    hp: Hyperparameters,
    run: RunOptions,
    segment: Segment | None = None,
) -> TrainResult:
    """Train `segment` of a drafter's run on the packs of `data_dirs` (resuming from
    `run.checkpoint_path` when it holds this segment's state)."""
    segment = segment or Segment()
    world = init_world(run.device)
    device = distributed.device(run.device)
    data = ExtractedData(data_dirs, hp.block_size)
    if hp.global_batch_size % world.size:
        raise SystemExit(
            f"drafter.global_batch_size={hp.global_batch_size} does not split over "
            f"{world.size} processes: choose a multiple of the world size"
        )
    chain_fp = chain_fingerprint(model, hp)
    plan, loaded, steps, start = _plan(segment, data, hp, chain_fp)

    layer_ids = [int(i) for i in model["target_layer_ids"]]
    target_lm = None
    if data.online:  # first: the whole target is on the device only until it is sharded
        target_lm = load_online_target(
            model, layer_ids, device, run.precision, run.layout, world.size
        )
    head = load_target_head(model).to(device)
    drafter = build_drafter(model, hp, head).to(device)
    # The module the loop calls: the drafter, DDP's wrapper of it, or the drafter sharded.
    trained = sharding.lay_out(drafter, run.layout, world.size, device)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(plan.total_steps, hp.warmup_ratio)
    )
    # A working checkpoint resumes only this segment, from this very start state (its bytes: a
    # chain retrained by other code is another start), on this data.
    fingerprint = hashlib.sha256(
        f"{run_fingerprint(model, hp, data)}|{segment.describe()}|{start}".encode()
    ).hexdigest()[:16]
    state = checkpoints.load(run.checkpoint_path, drafter, optimizer, fingerprint)
    if state is None and segment.start_from is not None:
        state = checkpoints.load(segment.start_from, drafter, optimizer, chain_fp)
        if state is None:
            raise SystemExit(
                f"{segment.start_from}: not a state of this run (other drafter params or "
                "target): rerun the chain from its first link (dvc repro train_shard@0)"
            )
    start_step, history, tokens, seconds = steps.start, [], 0, 0.0
    if state is not None:
        schedule.load_state_dict(state["schedule"])
        start_step, history = int(state["step"]), list(state["history"])
        tokens, seconds = int(state.get("tokens", 0)), float(state.get("seconds", 0.0))

    def batch_of(step: int) -> tuple[int, list[int]]:
        """(epoch, indices into the loaded sequences) of `step`."""
        if step < plan.chain_steps:
            shard = plan.shard_of(step)
            base = data.offsets[loaded.index(shard)]
            return 0, [base + i for i in plan.link_batch(shard, step)]
        return plan.rest_batch(step)  # the loaded data is every shard, in order

    def progress(step: int, fp: str) -> dict[str, Any]:
        return {
            "fingerprint": fp, "step": step, "schedule": schedule.state_dict(),
            "history": history, "tokens": tokens, "seconds": seconds, "plan": plan.state(),
            "world_size": world.size, **run.layout.describe(),
        }  # fmt: skip

    metrics = Metrics(run.live_dir, history, world.is_main)
    bar = tqdm(
        total=steps.stop,
        initial=start_step,
        desc=f"train ({segment.describe()})" if segment.link is not None else "train",
        unit="step",
        disable=not (run.progress and world.is_main),
    )
    tokens_before = tokens
    mask_id = drafter.config.mask_token_id
    try:
        for step in range(start_step, steps.stop):
            began = time.perf_counter()
            epoch, batch = batch_of(step)
            shares = split_global_batch(batch, world, run.micro_batch_size)
            micro = []
            for share in shares:
                blocks = []
                for i in share:
                    sample_id, ids, loss_mask = data.tokens(i)
                    blocks.append(
                        make_blocks(
                            sample_id,
                            ids,
                            loss_mask,
                            block_size=hp.block_size,
                            gamma=hp.gamma,
                            max_anchors=hp.max_anchors,
                            mask_token_id=mask_id,
                            seed=hp.seed,
                            epoch=epoch,
                        )
                    )
                micro.append((share, collate(blocks, mask_id)))
            # The normaliser is the weight of the whole global batch, known before any forward.
            total_weight = distributed.all_sum_tensor(
                torch.tensor(sum(float(mb.weights.sum()) for _, mb in micro), device=device)
            )
            sums = torch.zeros(4 + 4 * hp.block_size, dtype=torch.float64, device=device)
            alpha = hp.selector.weight(step, plan.total_steps) if hp.selector else 0.0
            for number, (share, mb) in enumerate(micro):
                mb = mb.to(device)
                features = _features(data, share, mb, target_lm, layer_ids, device)
                with (
                    sharding.gradient_sync(trained, number == len(micro) - 1),
                    autocast(device.type, run.precision),
                ):
                    parts = step_loss(
                        trained, head.lm_head_weight, features, mb, hp.selector, drafter
                    )
                    loss = parts.weighted_ce
                    if parts.selector is not None:  # in the graph even at alpha 0 (DDP, FSDP)
                        loss = loss + alpha * parts.selector.weighted_ce
                    # DDP and FSDP average gradients over processes; the sum is what we want.
                    (loss * world.size / total_weight).backward()
                sums[0] += parts.weighted_ce.detach().double()
                sums[1] += mb.num_tokens
                add_parts(sums, parts, hp.block_size)
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), hp.grad_clip)
            lr = schedule.get_last_lr()[0]
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            distributed.all_sum_tensor(sums)
            seconds += time.perf_counter() - began
            tokens += int(sums[1])
            record = step_record(
                sums, total_weight, hp.block_size, lr, sharding.local_float(grad_norm)
            )
            if hp.selector is not None:
                record.update(selector_record(sums, total_weight, hp.block_size, alpha))
            history.append(record)
            metrics.log(step, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}")
            done = step + 1
            if run.checkpoint_path is not None and (
                done % run.checkpoint_every == 0 or done == steps.stop
            ):
                checkpoints.save(
                    run.checkpoint_path, drafter, optimizer, progress(done, fingerprint)
                )
        if segment.save_to is not None:
            # The link's state, the next stage's start (DVC caches and pushes it).
            # Without the wall-time counters, so the same training writes the same bytes (DVC
            # hashes it); the last stage measures its own tokens per second.
            state = progress(steps.stop, chain_fp)
            state.pop("seconds"), state.pop("tokens")
            checkpoints.save(segment.save_to, drafter, optimizer, state)
            if run.checkpoint_path is not None:
                checkpoints.remove(run.checkpoint_path)  # the output holds the same state
    finally:
        bar.close()
        metrics.close()
    return TrainResult(
        drafter=_whole(drafter, head, world) if segment.link is None else drafter,
        steps=plan.total_steps if segment.link is None else len(steps),
        history=history,
        tokens=tokens,
        seconds=seconds,
        tokens_this_run=tokens - tokens_before,
        num_sequences=len(data),
        dropped_sequences=data.dropped,
        world_size=world.size,
        resumed_from_step=start_step,
        extra={"chain_steps": plan.chain_steps, "online": data.online, "plan": plan.state()},
    )


def _plan(
    segment: Segment, data: ExtractedData, hp: Hyperparameters, chain_fp: str
) -> tuple[StepPlan, list[int], range, str]:
    """The run's step plan as this segment sees it, the shard of each loaded data folder, the
    steps the segment trains, and the identity of the state it starts from."""
    if segment.start_from is not None:
        found = checkpoints.read_progress(segment.start_from)
        if found is None:
            raise SystemExit(
                f"{segment.start_from}: no training state there: the previous link has not "
                "run (dvc repro train_shard@N, N the shard before)"
            )
        folder, progress = found
        if progress.get("fingerprint") != chain_fp:
            raise SystemExit(
                f"{segment.start_from}: a state of another run (other drafter params or "
                "target): rerun the chain from its first link (dvc repro train_shard@0)"
            )
        plan = StepPlan.from_state(progress["plan"])
        start = hashlib.sha256((folder / checkpoints.PROGRESS_FILE).read_bytes()).hexdigest()
    else:
        if segment.link not in (None, 0) or segment.after_chain:
            raise ValueError(f"{segment.describe()} needs the state the link before it left")
        rows = segment.planned_rows if segment.planned_rows is not None else len(data)
        plan = StepPlan.planned(rows, hp.epochs, hp.global_batch_size, hp.seed)
        start = "fresh"
    sizes = data.sizes()
    if segment.link is not None:
        steps = plan.add_shard(segment.link, len(data))
        return plan, [segment.link], steps, start
    if segment.after_chain:
        if plan.shard_sizes != sizes:
            raise SystemExit(
                f"the packs hold {sizes} usable sequences per shard, the chain trained on "
                f"{plan.shard_sizes}: a shard changed after its link trained on it; rerun "
                "its extract and the chain from there (dvc repro)"
            )
        return plan, list(range(len(sizes))), plan.rest_steps(), start
    for shard, usable in enumerate(sizes):
        plan.add_shard(shard, usable)
    return plan, list(range(len(sizes))), range(0, plan.total_steps), start


def _whole(drafter: DFlashDrafter, head: Any, world: World) -> DFlashDrafter:
    """The trained drafter as one plain module on the main process (FSDP's shards gathered:
    every process takes part); the others keep their shards."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(drafter, FSDPModule):
        return drafter
    state = sharding.full_state_dict(drafter)
    if not world.is_main:
        return drafter
    whole = DFlashDrafter(drafter.config, head.to("cpu"))
    whole.load_state_dict(state)
    return whole


def _features(
    data: ExtractedData,
    share: list[int],
    mb: MicroBatch,
    target_lm: Any,
    layer_ids: list[int],
    device: torch.device,
) -> torch.Tensor:
    """[b, T, K*H] context features: read from the packs, or computed by the frozen target."""
    if target_lm is not None:
        from draftline.drafter.features import target_layer_states

        states = target_layer_states(target_lm, mb.input_ids, layer_ids, mb.attention_mask)
        # Rounded like offline features, so online and offline training see the same inputs.
        return states.to(torch.bfloat16)
    b, t = mb.input_ids.shape
    width = len(layer_ids) * int(data.index["hidden_size"])
    out = torch.zeros(b, t, width, dtype=torch.bfloat16)
    for row, i in enumerate(share):
        feats = data.features(i)
        out[row, : feats.shape[0]] = feats
    return out.to(device)
