"""Training loop of the DFlash drafter: data, optimisation, distribution, checkpoints, metrics.

- Data: the packs of `data/extracted/` (docs/pipeline.md); sequences with fewer than 2B
  supervised tokens are dropped. Offline packs carry the target features; online packs do not
  and the frozen target computes them per micro-batch (`draftline.drafter.features`).
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
  size, resumes from it and ends where an uninterrupted run would have.
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
from draftline.runtime import distributed

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
POSITION_PREFIX = "acc_pos/"  # history keys acc_pos/1 .. acc_pos/B-1: accuracy per position


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


def run_fingerprint(model: dict[str, Any], hp: Hyperparameters, data: ExtractedData) -> str:
    """What a checkpoint belongs to: a changed param, dataset or target (`target_id`: other
    weights in the same folder, whose features online training computes) never resumes it."""
    names = ("path", "revision", "target_id", "target_layer_ids", "mask_token_id")
    keys = {k: model.get(k) for k in names}
    text = json.dumps(
        {"model": keys, "hp": hp.identity(), "data": data.fingerprint}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """dvclive on the main process (`Live(dir, dvcyaml=False)`: dvc.yaml declares the plots).

    A resumed run rewrites the plots from the checkpoint's history: DVC deletes a stage's plots
    before it reruns the stage, and rows logged after the checkpoint are redone anyway.
    """

    def __init__(
        self, live_dir: Path | None, history: list[dict[str, float]], enabled: bool
    ) -> None:
        self.live = None
        if live_dir is None or not enabled:
            return
        from dvclive import Live

        self.live = Live(str(live_dir), dvcyaml=False, save_dvc_exp=False)
        for step, record in enumerate(history):
            self.log(step, record)

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.live is None:
            return
        self.live.step = step
        for name, value in values.items():
            if not name.startswith(POSITION_PREFIX):  # charted from one table (stages/train.py)
                self.live.log_metric(name, value)

    def close(self) -> None:
        if self.live is not None:
            self.live.end()


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


def train(
    data_dir: str | Path,
    model: dict[str, Any],
    hp: Hyperparameters,
    run: RunOptions,
) -> TrainResult:
    """Train a drafter on `data_dir` (resuming from `run.checkpoint_path` when it exists)."""
    world = init_world(run.device)
    device = distributed.device(run.device)
    data = ExtractedData(data_dir, hp.block_size)
    if hp.global_batch_size % world.size:
        raise SystemExit(
            f"drafter.global_batch_size={hp.global_batch_size} does not split over "
            f"{world.size} processes: choose a multiple of the world size"
        )
    steps_per_epoch = len(data) // hp.global_batch_size
    if steps_per_epoch == 0:
        raise SystemExit(
            f"{len(data)} usable sequences (dropped {data.dropped} with < 2B supervised tokens) "
            f"are fewer than drafter.global_batch_size={hp.global_batch_size}: lower it or add data"
        )
    total_steps = steps_per_epoch * hp.epochs

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
        optimizer, cosine_with_warmup(total_steps, hp.warmup_ratio)
    )
    fingerprint = run_fingerprint(model, hp, data)
    state = checkpoints.load(run.checkpoint_path, drafter, optimizer, fingerprint)
    start_step, history, tokens, seconds = 0, [], 0, 0.0
    if state is not None:
        schedule.load_state_dict(state["schedule"])
        start_step, history = int(state["step"]), list(state["history"])
        tokens, seconds = int(state.get("tokens", 0)), float(state.get("seconds", 0.0))

    metrics = Metrics(run.live_dir, history, world.is_main)
    bar = tqdm(
        total=total_steps,
        initial=start_step,
        desc="train",
        unit="step",
        disable=not (run.progress and world.is_main),
    )
    tokens_before = tokens
    mask_id = drafter.config.mask_token_id
    try:
        for step in range(start_step, total_steps):
            began = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            order = torch.randperm(
                len(data), generator=torch.Generator().manual_seed(hp.seed * 1_000_003 + epoch)
            ).tolist()
            batch = order[index * hp.global_batch_size : (index + 1) * hp.global_batch_size]
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
            alpha = hp.selector.weight(step, total_steps) if hp.selector else 0.0
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
                _add_parts(sums, parts, hp.block_size)
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), hp.grad_clip)
            lr = schedule.get_last_lr()[0]
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            distributed.all_sum_tensor(sums)
            seconds += time.perf_counter() - began
            tokens += int(sums[1])
            record = _step_record(
                sums, total_weight, hp.block_size, lr, sharding.local_float(grad_norm)
            )
            if hp.selector is not None:
                record.update(_selector_record(sums, total_weight, hp.block_size, alpha))
            history.append(record)
            metrics.log(step, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}")
            done = step + 1
            if run.checkpoint_path is not None and (
                done % run.checkpoint_every == 0 or done == total_steps
            ):
                progress = {
                    "fingerprint": fingerprint, "step": done, "schedule": schedule.state_dict(),
                    "history": history, "tokens": tokens, "seconds": seconds,
                    "world_size": world.size, **run.layout.describe(),
                }  # fmt: skip
                checkpoints.save(run.checkpoint_path, drafter, optimizer, progress)
    finally:
        bar.close()
        metrics.close()
    return TrainResult(
        drafter=_whole(drafter, head, world),
        steps=total_steps,
        history=history,
        tokens=tokens,
        seconds=seconds,
        tokens_this_run=tokens - tokens_before,
        num_sequences=len(data),
        dropped_sequences=data.dropped,
        world_size=world.size,
        resumed_from_step=start_step,
        extra={"steps_per_epoch": steps_per_epoch, "online": data.online},
    )


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


def _add_parts(sums: torch.Tensor, parts: LossParts, block: int) -> None:
    """sums: [loss, tokens, -, selector loss, then B each of: greedy hits, supervised outputs,
    selector top-k recall, selector top-1 recall]."""
    sums[4 : 4 + block] += parts.correct.double()
    sums[4 + block : 4 + 2 * block] += parts.counted.double()
    if parts.selector is not None:
        sums[3] += parts.selector.weighted_ce.detach().double()
        sums[4 + 2 * block : 4 + 3 * block] += parts.selector.in_top_k.double()
        sums[4 + 3 * block :] += parts.selector.top1.double()


def _selector_record(
    sums: torch.Tensor, total_weight: torch.Tensor, block: int, alpha: float
) -> dict[str, float]:
    """DFlash2's selector: its loss, and how often the gold token is among the candidates
    (recall@top-k, the selector's ceiling) and is the one it scores best (recall@1)."""
    counted = sums[4 + block : 4 + 2 * block].sum().clamp(min=1)
    return {
        "selector_loss": float(sums[3] / total_weight),
        "selector_alpha": alpha,
        "selector_recall_topk": float(sums[4 + 2 * block : 4 + 3 * block].sum() / counted),
        "selector_recall_top1": float(sums[4 + 3 * block :].sum() / counted),
    }


def _step_record(
    sums: torch.Tensor, total_weight: torch.Tensor, block: int, lr: float, grad_norm: float
) -> dict[str, float]:
    correct, counted = sums[4 : 4 + block], sums[4 + block : 4 + 2 * block]
    record = {
        "loss": float(sums[0] / total_weight),
        "acc": float(correct[1:].sum() / counted[1:].sum().clamp(min=1)),
        "lr": lr,
        "grad_norm": grad_norm,
    }
    for k in range(1, block):
        record[f"{POSITION_PREFIX}{k}"] = float(correct[k] / counted[k].clamp(min=1))
    return record
