"""Memory per GPU of each hardware profile, for `draftline plan`: extract, offline training and
online training, measured on fake tensors (`draftline.drafter.memory`) in the profile's training
layout (`sharding` over its processes, `activation_checkpointing`), with the change that makes a
stage fit when it does not (a smaller micro-batch or token budget, which split the same work
differently, or offline features).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftline.drafter import memory
from draftline.drafter.build import Hyperparameters
from draftline.drafter.dflash import DFlashConfig
from draftline.drafter.flops import flops_per_token
from draftline.drafter.sharding import Layout

GIB = 2**30
# Left free on the GPU for the CUDA context, the allocator's fragmentation and NCCL buffers.
HEADROOM = 0.05
STAGES = ("extract", "train_offline", "train_online")


def device_bytes(profile: dict[str, Any]) -> int | None:
    gpu = profile.get("gpu") or {}
    return int(gpu["memory_mib"]) * 2**20 if gpu.get("memory_mib") else None


def profile_memory(
    params: dict[str, Any],
    profile: dict[str, Any],
    cache_dir: Path | None = memory.CACHE_DIR,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Peak per GPU of each stage on `profile`, whether it fits, and what to change if not.

    A profile without a GPU (cpu) is not planned: it runs on host memory, which is the node's.
    """
    limit = device_bytes(profile)
    if limit is None:
        return {"device_bytes": None, "stages": {}, "source": "no GPU: host memory"}
    model = params["model"]
    hp = Hyperparameters.from_params(params["drafter"])
    max_length = int(params["extract"]["max_length"])
    precision = str(profile.get("precision") or "bf16")
    micro = int(profile.get("micro_batch_size") or 1)
    tokens = int(profile.get("extract_tokens_per_batch") or max_length)
    usable = limit * (1 - HEADROOM)
    config = memory.text_config(model)
    layout = Layout.of(profile)
    world = int(profile.get("processes_per_node") or 1)

    def measure(stage: str, size: int) -> memory.Peak:
        # What the figure depends on, no more: extraction runs the target alone, so one figure
        # serves every drafter (and layout) planned on the same target and sizes.
        key = {
            "stage": stage, "size": size, "config": config, "layers": model["target_layer_ids"],
            "max_length": max_length, "precision": precision,
            **({} if stage == "extract" else {
                "drafter": hp.identity(), "layout": layout.describe(), "world": world,
            }),
        }  # fmt: skip
        if progress:
            progress(f"{profile.get('name')}: {stage.replace('_', ' ')} at {size}")
        if stage == "extract":
            work = lambda: memory.extract_peak(model, max_length, size, precision)  # noqa: E731
        else:
            online = stage == "train_online"
            work = lambda: memory.train_step_peak(  # noqa: E731
                model, hp, max_length, size, precision, online, layout=layout, world_size=world
            )
        return memory.cached(work, key, cache_dir)

    stages: dict[str, Any] = {}
    for stage, size in (("extract", tokens), ("train_offline", micro), ("train_online", micro)):
        peak = measure(stage, size)
        fits = peak.peak_bytes <= usable
        entry = {"peak_bytes": peak.peak_bytes, "resident": peak.resident, "fits": fits}
        if not fits:
            entry["fix"] = _smaller(stage, size, usable, measure)
        stages[stage] = entry
    online = stages["train_online"]
    if not online["fits"] and not online["fix"] and stages["train_offline"]["fits"]:
        online["fix"] = {
            "override": "extract.features=offline",
            "peak_bytes": stages["train_offline"]["peak_bytes"],
            "why": "the target does not fit beside the drafter: extract features first",
        }
    return {
        "device_bytes": limit,
        "usable_bytes": int(usable),
        "precision": precision,
        "layout": {**layout.describe(), "processes": world},
        "stages": stages,
        # FLOPs per drafter output token of a step (the family's: DFlash2 adds its parts).
        "drafter": flops_per_token(drafter_config(model, hp, config), max_length // 2),
        "source": "fake-tensor run of the project's extract and training step "
        f"({precision}, micro-batch {micro}, {tokens} tokens per extract batch, "
        f"training {describe_layout(layout, world)})",
    }


def drafter_config(
    model: dict[str, Any], hp: Hyperparameters, config: dict[str, Any]
) -> DFlashConfig:
    """The drafter's architecture for the target (`build.build_drafter`'s, without weights)."""
    return DFlashConfig.from_target(
        config,
        num_hidden_layers=hp.num_hidden_layers,
        block_size=hp.block_size,
        mask_token_id=0,  # any id: the cost does not depend on it
        target_layer_ids=[int(i) for i in model["target_layer_ids"]],
        dflash2=hp.dflash2,
        **hp.shape(),
    )


def describe_layout(layout: Layout, world: int) -> str:
    """E.g. `fsdp over 4 GPUs, activation checkpointing`."""
    words = f"{layout.sharding} over {world} GPU{'s' if world > 1 else ''}"
    return words + (", activation checkpointing" if layout.activation_checkpointing else "")


def _smaller(
    stage: str, size: int, usable: float, measure: Callable[[str, int], memory.Peak]
) -> dict[str, Any] | None:
    """The largest halved micro-batch (or extract token budget) that fits, if any does."""
    key = "hardware.extract_tokens_per_batch" if stage == "extract" else "hardware.micro_batch_size"
    floor = 1024 if stage == "extract" else 1
    smaller = size // 2
    while smaller >= floor:
        peak = measure(stage, smaller)
        if peak.peak_bytes <= usable:
            return {"override": f"{key}={smaller}", "peak_bytes": peak.peak_bytes}
        smaller //= 2
    return None
