"""The timed extract and train parts of a calibration (`draftline calibrate`), shared with
`benchmarks/gpu_check.py`: the target forward as extraction runs it (`pack_features`) and the
training step as `draftline train` lays it out (`drafter.sharding`, `training.step_loss`), each
warmed up once, then timed until a step count or a time budget is reached. Tokens are the
tokens actually processed over the timed wall time; FLOPs are counted by torch's
FlopCounterMode on one untimed pass of the same work, MFU only where the GPU's peak is known.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from draftline.drafter import sharding
from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.extraction import pack_features
from draftline.drafter.features import needed_layers_only, target_layer_states
from draftline.drafter.objective import MicroBatch, position_weights
from draftline.drafter.selector_objective import SelectorObjective
from draftline.drafter.sharding import Layout
from draftline.drafter.training import autocast, step_loss
from draftline.runtime import distributed

# Dense bf16 tensor-core peaks (vendor datasheets, without sparsity), TFLOP/s.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "B200": 2250.0,
    "RTX PRO 6000": 503.8,
    "A100": 312.0,
}

# Called after each timed batch or step with the tokens it processed.
Progress = Callable[[int], None]


def peak_flops(device: torch.device, override: float | None = None) -> tuple[float | None, str]:
    """The device's dense bf16 peak in FLOP/s and where it comes from (None on a CPU)."""
    if override:
        return override * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "CPU: no peak table"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.lower() in name.lower():
            return tflops * 1e12, f"{key} dense bf16 datasheet peak"
    return None, f"unknown GPU {name!r}: pass --peak-tflops"


def counted_flops(work: Callable[[], Any]) -> float:
    """FLOPs torch counts (matmuls, attention) while `work()` runs once."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        work()
    return float(counter.get_total_flops())


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_mfu(part: dict[str, Any], peak: float | None, gpus: int = 1) -> dict[str, Any]:
    """Achieved TFLOP/s and MFU (None without a peak or without counted FLOPs)."""
    flops, seconds = part.get("flops"), part["seconds"]
    part["achieved_tflops"] = flops / seconds / 1e12 if flops and seconds else None
    part["mfu"] = flops / seconds / (peak * gpus) if flops and seconds and peak else None
    return part


def time_extraction(
    model: Any,
    rows: list[list[int]],
    layer_ids: Sequence[int],
    tokens_per_batch: int,
    device: torch.device,
    *,
    budget_s: float | None = None,
    count_flops: bool = True,
    on_batch: Progress | None = None,
) -> dict[str, Any]:
    """Features of `rows` (sorted by length, as a pack is) through `pack_features`, after one
    warm-up batch of the longest rows. With `budget_s`, passes over the rows repeat until it
    is spent (at least one pass), so a short budget still times whole batches."""
    rows = sorted(rows, key=len)
    pack_features(model, rows[-4:], layer_ids, tokens_per_batch, device)  # warm-up
    synchronize(device)
    reset_peak(device)
    tokens = padded = passes = 0
    began = time.perf_counter()
    while True:
        feats, pad = pack_features(model, rows, layer_ids, tokens_per_batch, device, on_batch)
        synchronize(device)
        tokens += sum(len(r) for r in rows)
        padded += pad
        passes += 1
        if budget_s is None or time.perf_counter() - began >= budget_s:
            break
    seconds = time.perf_counter() - began
    flops = None
    if count_flops:
        flops = passes * counted_flops(
            lambda: pack_features(model, rows, layer_ids, tokens_per_batch, device)
        )
    return {
        "sequences": len(rows) * passes,
        "tokens": tokens,
        "padded_tokens": padded,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "flops": flops,
        "feature_bytes_per_token": feats.element_size() * feats.shape[-1],
        "peak_gpu_bytes": peak_bytes(device),
    }


def join_world(device: torch.device) -> tuple[int, int]:
    """(rank, world size): torchrun's group when launched by it, else a one-process group on
    loopback, so the sharded layout runs its real collectives either way."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if distributed.launched_by_torchrun():
        distributed.init(backend)
    elif not dist.is_initialized():
        with socket.socket() as s:
            s.bind((distributed.LOOPBACK, 0))
            port = s.getsockname()[1]
        address = f"tcp://{distributed.LOOPBACK}:{port}"
        dist.init_process_group(backend, init_method=address, rank=0, world_size=1)
    return distributed.rank(), distributed.world_size()


def random_batch(
    config: DFlashConfig, lengths: Sequence[int], anchors: int, gamma: float, seed: int
) -> MicroBatch:
    """A micro-batch of `lengths` sequences (padded to the longest) of random tokens, with up
    to `anchors` anchors each: the shape of a training micro-batch, not its data."""
    s, vocab = config.block_size, int(config.vocab_size)
    b, t = len(lengths), max(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (b, t), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    n = max(1, min(anchors, t - s))
    picks = [torch.randperm(max(1, t - s), generator=gen)[:n].sort().values for _ in range(b)]
    positions = torch.stack(picks)
    block_ids = torch.full((b, n, s), config.mask_token_id)
    block_ids[..., 0] = ids.gather(1, positions)
    spans = (positions[..., None] + torch.arange(s)).clamp(max=t - 1).flatten(1)
    labels = ids.gather(1, spans).view(b, n, s)
    weights = position_weights(s, gamma).expand(b, n, s).contiguous()
    weights = weights * mask.gather(1, spans).view(b, n, s)  # no loss on padding
    return MicroBatch(ids, mask, positions, block_ids, labels, weights, sample_ids=[])


def time_training(
    model: Any,
    config: DFlashConfig,
    head: TargetHead,
    batch: MicroBatch,
    *,
    features: str,
    layout: Layout,
    device: torch.device,
    precision: str = "bf16",
    steps: int | None = None,
    budget_s: float | None = None,
    warmup_steps: int = 2,
    selector: SelectorObjective | None = None,
    lr: float = 6e-4,
    count_flops: bool = True,
    on_step: Progress | None = None,
) -> dict[str, Any]:
    """The training step laid out as a profile trains: FSDP2 over the drafter and, online, over
    the frozen target cut after its last needed layer (`ddp` for the other layout), features
    computed by that target in the step (`online`) or once beforehand (`offline`), the run's
    autocast, `step_loss`, backward, clipping, AdamW. Timed for `steps` steps, or until
    `budget_s` is spent (at least one step). `model` loses its lm_head (the drafter reads its
    own copy, `head`) and, offline, moves to the CPU."""
    rank, world = join_world(device)
    layer_ids = list(config.target_layer_ids)
    online = features == "online"
    model.lm_head = torch.nn.Identity()
    target = needed_layers_only(model, layer_ids)
    batch = batch.to(device)
    feats_offline = None
    if not online:
        feats_offline = target_layer_states(
            target, batch.input_ids, layer_ids, batch.attention_mask
        ).to(torch.bfloat16)
        target = None
        model.to("cpu")  # offline training holds no target on the device
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, head).to(device)
    if layout.sharding == "fsdp":  # also over one process: the same code as on N
        mesh = sharding.mesh(device, world)
        if target is not None:
            sharding.shard_target(target, mesh)
        if layout.activation_checkpointing:
            sharding.checkpoint_layers(drafter.layers)
        trained = sharding.shard_drafter(drafter, mesh)
    else:
        trained = sharding.lay_out(drafter, layout, world, device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, foreach=device.type == "cuda")
    total_weight = float(batch.weights.sum()) * world

    def step() -> float:
        feats = feats_offline
        if target is not None:
            feats = target_layer_states(target, batch.input_ids, layer_ids, batch.attention_mask)
            feats = feats.to(torch.bfloat16)
        with autocast(device.type, precision):
            parts = step_loss(trained, head.lm_head_weight, feats, batch, selector, drafter)
            loss = parts.weighted_ce
            if parts.selector is not None:  # its full weight: the step's cost, not its value
                loss = loss + parts.selector.weighted_ce
            loss = loss * world / total_weight
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()) / world

    for _ in range(warmup_steps):
        step()
    synchronize(device)
    reset_peak(device)
    sequence_tokens = int(batch.attention_mask.sum())
    block_tokens = int(batch.block_ids.numel())
    losses: list[float] = []
    began = time.perf_counter()
    while True:
        losses.append(step())
        if on_step:
            on_step(sequence_tokens * world)
        # The slowest rank's clock: every rank stops after the same step (FSDP's collectives
        # hang when one rank takes a step the others don't).
        elapsed = distributed.all_max(time.perf_counter() - began)
        if steps is not None and len(losses) >= steps:
            break
        if steps is None and (budget_s is None or elapsed >= budget_s):
            break
    synchronize(device)
    seconds = distributed.all_max(time.perf_counter() - began)
    peak = peak_bytes(device)
    flops = None
    if count_flops:
        flops = distributed.all_sum([counted_flops(step) * len(losses)])[0]
    return {
        "sharding": layout.sharding,
        "activation_checkpointing": layout.activation_checkpointing,
        "features": features,
        "precision": precision,
        "world_size": world,
        "rank": rank,
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()) * world,
        "steps": len(losses),
        "seconds": seconds,
        "sequence_tokens_per_s": world * sequence_tokens * len(losses) / seconds,
        "block_tokens_per_s": world * block_tokens * len(losses) / seconds,
        "flops": flops,
        "loss_first_last": [losses[0], losses[-1]],
        "peak_gpu_bytes": peak,
        "peak_gpu_bytes_max": None if peak is None else int(distributed.all_max(peak)),
    }
