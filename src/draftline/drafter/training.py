"""Training loop of the DFlash drafter: data, optimisation, distribution, checkpoints, metrics.

- Data: the packs of `data/extracted/shard-K/` (docs/pipeline.md); sequences with fewer than
  2B supervised tokens are dropped. Offline packs carry the target features; online packs do
  not and the frozen target computes them per micro-batch (`draftline.drafter.features`).
- Steps: fixed from the planned rows; the first epoch reads shard by shard, so a chain of
  stages can train on each shard as soon as it is generated, and the rest reads every shard
  (`draftline.drafter.step_plan`). The caller's `TrainingMode` says which part a call trains:
  a whole run, one link of the chain (its state saved for the next), or the steps after the
  chain (`draftline.drafter.training_mode`); `training_setup` builds what the loop needs.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from draftline.drafter import checkpoints, sharding
from draftline.drafter.build import Hyperparameters
from draftline.drafter.dflash import DFlashDrafter
from draftline.drafter.objective import (
    LossParts,
    MicroBatch,
    block_loss,
    collate,
    make_blocks,
)
from draftline.drafter.selector_objective import SelectorObjective, selector_loss
from draftline.drafter.step_records import (  # noqa: F401 (POSITION_PREFIX: the stage's)
    POSITION_PREFIX,
    Metrics,
    StepSums,
    selector_record,
    step_record,
)
from draftline.drafter.training_mode import TrainingMode
from draftline.drafter.training_setup import RunOptions, Setup, World, set_up
from draftline.runtime import distributed

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


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


def train(
    mode: TrainingMode, model: dict[str, Any], hp: Hyperparameters, run: RunOptions
) -> TrainResult:
    """Train the part of a drafter's run that `mode` names (resuming from
    `run.checkpoint_path` when it holds that part's state)."""
    s = set_up(mode, model, hp, run)
    start_step, tokens_before = s.progress.step, s.progress.tokens
    metrics = Metrics(run.live_dir, s.progress.history, s.world.is_main)
    bar = tqdm(
        total=s.call.steps.stop,
        initial=start_step,
        desc=f"train ({mode.describe()})" if mode.link is not None else "train",
        unit="step",
        disable=not (run.progress and s.world.is_main),
    )
    try:
        for step in range(start_step, s.call.steps.stop):
            record = _train_step(s, step)
            s.progress.history.append(record)
            metrics.log(step, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}")
            _checkpoint_when_due(s, step + 1)
        if mode.save_to is not None:
            _leave_link_state(s, mode.save_to)
    finally:
        bar.close()
        metrics.close()
    plan = s.call.run_plan
    return TrainResult(
        drafter=_whole(s.drafter, s.head, s.world) if mode.link is None else s.drafter,
        steps=plan.total_steps if mode.link is None else len(s.call.steps),
        history=s.progress.history,
        tokens=s.progress.tokens,
        seconds=s.progress.seconds,
        tokens_this_run=s.progress.tokens - tokens_before,
        num_sequences=len(s.data),
        dropped_sequences=s.data.dropped,
        world_size=s.world.size,
        resumed_from_step=start_step,
        extra={"chain_steps": plan.chain_steps, "online": s.data.online, "plan": plan.state()},
    )


def _train_step(s: Setup, step: int) -> dict[str, float]:
    """One optimizer step over `step`'s global batch: its record (loss, accuracy, lr, ...);
    the progress counters move on by its tokens and time."""
    hp = s.hp
    began = time.perf_counter()
    micro = _micro_batches(s, step)
    # The normaliser is the weight of the whole global batch, known before any forward.
    total_weight = distributed.all_sum_tensor(
        torch.tensor(sum(float(mb.weights.sum()) for _, mb in micro), device=s.device)
    )
    alpha = hp.selector.weight(step, s.call.run_plan.total_steps) if hp.selector else 0.0
    sums = _accumulate_gradients(s, micro, total_weight, alpha)
    grad_norm = torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), hp.grad_clip)
    lr = s.schedule.get_last_lr()[0]
    s.optimizer.step()
    s.schedule.step()
    s.optimizer.zero_grad(set_to_none=True)
    sums.sum_over_processes()
    s.progress.seconds += time.perf_counter() - began
    s.progress.tokens += int(sums.tokens)
    record = step_record(sums, total_weight, lr, sharding.local_float(grad_norm))
    if hp.selector is not None:
        record.update(selector_record(sums, total_weight, alpha))
    return record


def _accumulate_gradients(
    s: Setup,
    micro: list[tuple[list[int], MicroBatch]],
    total_weight: torch.Tensor,
    alpha: float,
) -> StepSums:
    """Forward and backward over this process's micro-batches (gradients synchronised on the
    last); their statistics, summed here only."""
    device, hp = s.device, s.hp
    sums = StepSums(hp.block_size, device)
    for number, (share, mb) in enumerate(micro):
        mb = mb.to(device)
        features = _features(s, share, mb)
        with (
            sharding.gradient_sync(s.trained, number == len(micro) - 1),
            autocast(device.type, s.options.precision),
        ):
            parts = step_loss(
                s.trained, s.head.lm_head_weight, features, mb, hp.selector, s.drafter
            )
            loss = parts.weighted_ce
            if parts.selector is not None:  # in the graph even at alpha 0 (DDP, FSDP)
                loss = loss + alpha * parts.selector.weighted_ce
            # DDP and FSDP average gradients over processes; the sum is what we want.
            (loss * s.world.size / total_weight).backward()
        sums.add(parts, mb.num_tokens)
    return sums


def split_global_batch(batch: list[int], world: World, micro: int) -> list[list[int]]:
    """This process's micro-batches of one global batch (contiguous share of it)."""
    share = len(batch) // world.size
    mine = batch[world.rank * share : (world.rank + 1) * share]
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


def _micro_batches(s: Setup, step: int) -> list[tuple[list[int], MicroBatch]]:
    """This process's micro-batches of `step`: the sequences of each, and their blocks with
    anchors seeded per sample and epoch."""
    hp, mask_id = s.hp, s.drafter.config.mask_token_id
    epoch, batch = s.call.batch(step)
    micro = []
    for share in split_global_batch(batch, s.world, s.options.micro_batch_size):
        blocks = []
        for i in share:
            sample_id, ids, loss_mask = s.data.tokens(i)
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
    return micro


def _checkpoint_when_due(s: Setup, done: int) -> None:
    """The working checkpoint, every few steps and after the call's last."""
    path, every = s.options.checkpoint_path, s.options.checkpoint_every
    if path is not None and (done % every == 0 or done == s.call.steps.stop):
        checkpoints.save(path, s.drafter, s.optimizer, s.state(done, s.fingerprint))


def _leave_link_state(s: Setup, save_to: Path) -> None:
    """The link's state, the next call's start (its stage's output, stored by its hash).
    Without the wall-time counters, so the same training writes the same bytes; the last call
    measures its own tokens per second."""
    state = s.state(s.call.steps.stop, s.chain_fingerprint)
    state.pop("seconds"), state.pop("tokens")
    checkpoints.save(save_to, s.drafter, s.optimizer, state)
    if s.options.checkpoint_path is not None:
        checkpoints.remove(s.options.checkpoint_path)  # the output holds the same state


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


def _features(s: Setup, share: list[int], mb: MicroBatch) -> torch.Tensor:
    """[b, T, K*H] context features: read from the packs, or computed by the frozen target."""
    if s.target_lm is not None:
        from draftline.drafter.features import target_layer_states

        states = target_layer_states(s.target_lm, mb.input_ids, s.layer_ids, mb.attention_mask)
        # Rounded like offline features, so online and offline training see the same inputs.
        return states.to(torch.bfloat16)
    b, t = mb.input_ids.shape
    width = len(s.layer_ids) * int(s.data.index["hidden_size"])
    out = torch.zeros(b, t, width, dtype=torch.bfloat16)
    for row, i in enumerate(share):
        feats = s.data.features(i)
        out[row, : feats.shape[0]] = feats
    return out.to(s.device)
