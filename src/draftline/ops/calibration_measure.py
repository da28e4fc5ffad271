"""Calibration's extract and train parts: the target forward as extraction runs it and the
training step as configured, over the sequences the generate part produced (or random tokens
at the data profile's lengths), each process of the profile measuring its share as the
stages run (`draftline calibrate` starts them); `calibration_parts` times the work.
"""

from __future__ import annotations

import random
from typing import Any

from draftline.ops.calibration import PartSkipped, TimeBar


def training_sequences(
    sequences: list[list[int]], p: dict[str, Any]
) -> tuple[list[list[int]], str]:
    """The generated turns capped at extract.max_length; without any, random tokens at the
    lengths the data profile estimates (said in the source)."""
    max_length = int((p.get("extract") or {}).get("max_length") or p["drafter"]["max_length"])
    if sequences:
        return [s[:max_length] for s in sequences], "the generated turns of this calibration"
    estimate = (p.get("data") or {}).get("estimate") or {}
    length = int(estimate.get("prompt_tokens", 0) + estimate.get("completion_tokens", 0))
    if length <= 0:
        raise PartSkipped("no generated turns and no data.estimate lengths to shape sequences")
    vocab = int(p["model"]["vocab_size"])
    gen = random.Random(1)
    rows = [[gen.randrange(vocab) for _ in range(min(length, max_length))] for _ in range(64)]
    return rows, f"random tokens at data.estimate's {length} tokens (generate did not run)"


def _device(profile: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    from draftline.runtime import distributed, hardware

    execution = hardware.Execution.of(profile)
    if execution.on_gpu and not torch.cuda.is_available():
        raise PartSkipped(f"profile {execution.name} wants {execution.device}; no GPU visible")
    execution.set_threads()
    device = distributed.device(execution.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return execution, device


def measure_extraction(
    p: dict[str, Any], profile: dict[str, Any], sequences: list[list[int]], budget_s: float,
    progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """The target forward as extraction runs it, over the measured sequences."""
    from draftline.core.target import load_model
    from draftline.ops import calibration_parts as parts

    execution, device = _device(profile)
    rows, source = training_sequences(sequences, p)
    # As the stage does: each process extracts its share of the sequences with a whole target.
    rank, world = parts.join_world(device)
    rows = (rows * -(-world // len(rows)))[rank::world]  # a share of at least one each
    model = load_model(p["model"], device=str(device), dtype=execution.precision)
    layer_ids = [int(i) for i in p["model"]["target_layer_ids"]]
    bar = TimeBar("extract", budget_s, progress and rank == 0)
    try:
        result = parts.time_extraction(
            model, rows, layer_ids, execution.extract_tokens_per_batch, device,
            budget_s=budget_s, on_batch=bar.add,
        )  # fmt: skip
        result = node_extraction(result, world)
    finally:
        bar.close()
    peak, peak_source = parts.peak_flops(device)
    parts.add_mfu(result, peak, world)
    return {**result, "sequences_from": source, "peak_source": peak_source}


def node_extraction(result: dict[str, Any], world: int) -> dict[str, Any]:
    """One process's extraction figures as the node's: tokens summed over the processes, over
    the slowest one's seconds."""
    from draftline.runtime import distributed

    summed = ("sequences", "tokens", "padded_tokens", "flops")
    totals = distributed.all_sum([result[k] or 0 for k in summed])
    seconds = distributed.all_max(result["seconds"])
    node = {**result, **{k: int(v) for k, v in zip(summed, totals, strict=True)}}
    if result["flops"] is None:
        node["flops"] = None
    peak = result["peak_gpu_bytes"]
    return {
        **node,
        "seconds": seconds,
        "tokens_per_s": node["tokens"] / seconds,
        "peak_gpu_bytes_max": None if peak is None else int(distributed.all_max(peak)),
        "world_size": world,
    }


def measure_training(
    p: dict[str, Any], profile: dict[str, Any], sequences: list[list[int]], budget_s: float,
    progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """The training step as configured (features, family, block, anchors, layout, precision,
    micro-batch), on a micro-batch drawn across the measured lengths."""
    from draftline.core.target import load_model
    from draftline.drafter.build import Hyperparameters, drafter_config
    from draftline.drafter.dflash import TargetHead
    from draftline.drafter.sharding import Layout
    from draftline.ops import calibration_parts as parts

    execution, device = _device(profile)
    hp = Hyperparameters.from_params(p["drafter"])
    rows, source = training_sequences(sequences, p)
    rows = sorted((r for r in rows if len(r) > hp.block_size + 1), key=len)
    if not rows:
        raise PartSkipped(f"no sequence longer than the block ({hp.block_size} tokens)")
    micro = min(execution.micro_batch_size, len(rows))
    # Spread over the sorted lengths: a micro-batch of the distribution, not of its tail.
    lengths = [len(rows[round(i * (len(rows) - 1) / max(1, micro - 1))]) for i in range(micro)]
    model_cfg = p["model"]
    config = drafter_config(model_cfg, hp)
    model = load_model(model_cfg, device=str(device), dtype=execution.precision)
    head = TargetHead.from_model(model)
    head = TargetHead(head.embed_weight.clone(), head.lm_head_weight.clone())  # kept whole
    batch = parts.random_batch(config, lengths, hp.max_anchors, hp.gamma, hp.seed)
    features = str((p.get("extract") or {}).get("features", "offline"))
    bar = TimeBar("train", budget_s, progress)
    try:
        result = parts.time_training(
            model, config, head, batch, features=features, layout=Layout.of(profile),
            device=device, precision=execution.precision, budget_s=budget_s, warmup_steps=1,
            selector=hp.selector, lr=hp.lr, on_step=bar.add,
        )  # fmt: skip
    finally:
        bar.close()
    peak, peak_source = parts.peak_flops(device)
    parts.add_mfu(result, peak, result["world_size"])
    result["tokens_per_s"] = result["sequence_tokens_per_s"]
    return {**result, "micro_batch_lengths": lengths, "sequences_from": source,
            "peak_source": peak_source}  # fmt: skip
