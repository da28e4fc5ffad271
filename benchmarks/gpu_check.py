"""GPU check: extraction and drafter-training throughput, MFU and peak memory on one GPU.

A random-initialised target (bf16; no download) and the `dflash_b16` drafter (5 layers, block
16, 512 anchors) of its shape. `--shape qwen3.6-slice` (default) is Qwen3.6-27B at full width
(hidden 5120, vocab 248320, gated attention 24/4 x 256, Gated DeltaNet 16/48 x 128,
intermediate 17408; the text config of conf/model/qwen3_6_27b.yaml) cut to --layers hybrid
layers (3 linear-attention then 1 full-attention, repeated), with its drafter's shape (32/8 x 128,
17408); `--shape qwen3-8b` is Qwen3-8B whole.

1. extraction: `extraction.pack_features` (length-sorted token-budget batches, forward cut
   after the last target layer, features copied to host as bf16) over long-tailed lengths;
   tokens/s, MFU of the target forward and peak GPU memory.
2. training: the training step as `draftline train` lays it out on a GPU profile
   (`draftline.drafter.sharding`: FSDP2 over the drafter and, online, over the frozen target
   cut after its last needed layer; --sharding ddp for the other layout), features computed by
   that target inside the step (--features online, the default) or precomputed (offline), bf16
   autocast, `training.step_loss` (the fused chunked loss), backward, clipping, AdamW, on
   --train-seq-len sequences; sequence tokens/s, MFU and peak GPU memory, beside the peak
   `draftline plan` predicts for the same step and layout on fake tensors
   (`draftline.drafter.memory`). On one GPU, FSDP2 runs over a one-process group (the same
   code: hooks, all-gathers, sharded optimizer; nothing to split); under torchrun over N GPUs
   each process holds 1/N and the figures are per GPU, summed for tokens/s and FLOPs.

FLOPs are counted by torch's FlopCounterMode on an untimed pass of the same work (matmuls and
attention, whatever kernels run); MFU is them over the GPU's dense bf16 peak (table below, or
--peak-tflops). Without flash-linear-attention the DeltaNet layers run a slow torch fallback:
the report says so. `--tiny` runs the same code on a tiny hybrid shape on CPU, as a smoke test.

    python benchmarks/gpu_check.py [--out gpu_check.json]          # one H200: under 10 minutes
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py            # the sharded step on 4 GPUs
    python benchmarks/gpu_check.py --tiny                          # CPU smoke (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from draftline.core.target import hybrid_kernels_missing
from draftline.drafter import sharding
from draftline.drafter.dflash import DFlashConfig, TargetHead
from draftline.drafter.sharding import Layout
from draftline.ops.calibration_parts import (
    add_mfu,
    peak_flops,
    random_batch,
    time_extraction,
    time_training,
)
from draftline.runtime import distributed

CONF_MODELS = Path(__file__).resolve().parents[1] / "conf" / "model"


def profile_config(model: str) -> dict[str, Any]:
    """A model profile's text config (`config:` in conf/model/<model>.yaml)."""
    return dict(yaml.safe_load((CONF_MODELS / f"{model}.yaml").read_text())["config"])


def shape_of(name: str, layers: int) -> dict[str, Any]:
    """The target's text config, its target layers and the drafter's attention/MLP shape."""
    if name == "qwen3-8b":
        config = profile_config("qwen3_8b")
        return {"config": config, "target_layer_ids": [1, 9, 17, 25, 33], "drafter": {}}
    if name == "qwen3.6-slice":
        config = {**profile_config("qwen3_6_27b"), "num_hidden_layers": layers}
        # Spread over the slice like the real ids [1, 16, 31, 46, 61] over 64 layers.
        ids = sorted({min(layers - 1, round(1 + i * (layers - 2) / 4)) for i in range(5)})
        drafter = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 17408}  # fmt: skip
        return {"config": config, "target_layer_ids": ids, "drafter": drafter}
    if name == "tiny":
        config = {
            **profile_config("qwen3_6_27b"), "hidden_size": 64, "intermediate_size": 192,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 1024,
        }  # fmt: skip
        drafter = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "intermediate_size": 192}  # fmt: skip
        return {"config": config, "target_layer_ids": [1, 2, 3, 4, 5], "drafter": drafter}
    raise SystemExit(f"unknown --shape {name!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test)")
    p.add_argument("--shape", choices=("qwen3.6-slice", "qwen3-8b"), default="qwen3.6-slice")
    p.add_argument("--layers", type=int, default=8, help="layers of the qwen3.6 slice")
    p.add_argument("--extract-tokens", type=int, default=400_000, help="tokens to extract")
    p.add_argument("--tokens-per-batch", type=int, default=32768)
    p.add_argument("--train-seq-len", type=int, default=3072)
    p.add_argument("--train-batch", type=int, default=4, help="sequences per step")
    p.add_argument("--train-steps", type=int, default=12, help="timed steps after 2 warm-up")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--sharding", choices=sharding.SHARDINGS, default="fsdp")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute drafter layers"
    )
    p.add_argument("--features", choices=("online", "offline"), default="online")
    p.add_argument("--peak-tflops", type=float, help="override the GPU's bf16 peak")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.extract_tokens = min(args.extract_tokens, 4000)
        args.tokens_per_batch = min(args.tokens_per_batch, 1024)
        args.train_seq_len = min(args.train_seq_len, 256)
        args.train_batch, args.train_steps = min(args.train_batch, 2), min(args.train_steps, 2)
        args.anchors, args.block = min(args.anchors, 16), min(args.block, 8)
        args.drafter_layers = min(args.drafter_layers, 1)
    return args


def make_target(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape["config"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the run dtype: no fp32 copy of the weights
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def long_tailed_rows(total_tokens: int, vocab: int, max_len: int) -> list[list[int]]:
    """Log-normal lengths (median ~1/8 of max_len), sorted as the extract stage sorts a pack."""
    gen = torch.Generator().manual_seed(1)
    rows: list[list[int]] = []
    count = 0
    while count < total_tokens:
        n = int(
            min(max_len, max(16, float(torch.exp(torch.randn(1, generator=gen)) * max_len / 8)))
        )
        rows.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
        count += n
    return sorted(rows, key=len)


def check_extraction(model: Any, shape: dict[str, Any], args: argparse.Namespace, device) -> dict:
    rows = long_tailed_rows(
        args.extract_tokens, shape["config"]["vocab_size"], 4096 if not args.tiny else 256
    )
    layers = shape["target_layer_ids"]
    return time_extraction(model, rows, layers, args.tokens_per_batch, device)


def check_training(model: Any, shape: dict[str, Any], args: argparse.Namespace, device) -> dict:
    """The training step laid out as a GPU profile trains (see the module docstring)."""
    vocab = int(shape["config"]["vocab_size"])
    config = DFlashConfig.from_target(
        shape["config"],
        num_hidden_layers=args.drafter_layers,
        block_size=args.block,
        mask_token_id=vocab - 1,
        target_layer_ids=list(shape["target_layer_ids"]),
        **shape["drafter"],
    )
    head = TargetHead.from_model(model)
    head = TargetHead(head.embed_weight.clone(), head.lm_head_weight.clone())  # kept whole
    seed = 2 + int(os.environ.get("RANK", "0"))
    batch = random_batch(config, [args.train_seq_len] * args.train_batch, args.anchors, 7.0, seed)
    result = time_training(
        model, config, head, batch, features=args.features,
        layout=Layout(args.sharding, args.activation_checkpointing), device=device,
        precision="bf16", steps=args.train_steps,
    )  # fmt: skip
    result["drafter_config"] = config  # for the plan, which runs once the process group is gone
    return result


def planned_train_peak(
    shape: dict[str, Any],
    config: DFlashConfig,
    args: argparse.Namespace,
    layout: Layout,
    world: int,
) -> int:
    """What `draftline plan` predicts for this step per GPU (same layout, world size and
    features, bf16) on fake tensors, over a fake process group (no real one may exist)."""
    from draftline.drafter import memory
    from draftline.drafter.build import Hyperparameters

    hp = Hyperparameters(
        num_hidden_layers=args.drafter_layers, block_size=args.block, gamma=7.0,
        max_anchors=args.anchors, global_batch_size=args.train_batch, lr=6e-4,
        weight_decay=0.0, warmup_ratio=0.0, epochs=1, grad_clip=1.0, seed=0,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
    )  # fmt: skip
    model = {"name": "gpu_check", "path": "-", "config": shape["config"],
             "target_layer_ids": shape["target_layer_ids"]}  # fmt: skip
    peak = memory.train_step_peak(
        model, hp, args.train_seq_len, args.train_batch, "bf16",
        online=args.features == "online", layout=layout, world_size=world,
        shard_one_process=layout.sharding == "fsdp",
    )  # fmt: skip
    return peak.peak_bytes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        raise SystemExit("no CUDA GPU visible: run on a GPU node, or pass --tiny for a CPU smoke")
    # cuda:<local rank> under torchrun (one GPU per process), else the one GPU or the CPU.
    device = distributed.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    shape_name = "tiny" if args.tiny else args.shape
    shape = shape_of(shape_name, args.layers)
    peak, peak_source = peak_flops(device, args.peak_tflops)
    began = time.perf_counter()
    model = make_target(shape, device, dtype)
    setup_s = time.perf_counter() - began
    extraction = check_extraction(model, shape, args, device)
    try:
        training = check_training(model, shape, args, device)
    finally:
        distributed.close()
    layout = Layout(training["sharding"], training["activation_checkpointing"])
    training["planned_peak_bytes"] = planned_train_peak(
        shape, training.pop("drafter_config"), args, layout, training["world_size"]
    )
    # Extraction ran on each GPU alone; training's FLOPs are every GPU's together.
    add_mfu(extraction, peak)
    add_mfu(training, peak, training["world_size"])
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": shape_name,
        "target_layers": shape["config"]["num_hidden_layers"],
        "hybrid_kernels_missing": hybrid_kernels_missing(),
        "peak_flops": peak,
        "peak_source": peak_source,
        "setup_s": setup_s,
        "extraction": extraction,
        "training": training,
        "total_s": time.perf_counter() - began,
    }
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the figures are already the world's (rank 0 reports them)
    mfu = lambda p: f"{p['mfu']:.1%}" if p["mfu"] is not None else "n/a"  # noqa: E731
    print(f"{report['device']} ({report['shape']}, torch {report['torch']}; peak: {peak_source})")
    print(
        f"  extraction: {extraction['tokens_per_s']:,.0f} tok/s over {extraction['tokens']:,} "
        f"tokens, {extraction['achieved_tflops']:.1f} TFLOP/s, MFU {mfu(extraction)}"
    )
    print(
        f"  training ({training['sharding']} over {training['world_size']}, "
        f"{training['features']} features"
        f"{', activation checkpointing' if training['activation_checkpointing'] else ''}): "
        f"{training['sequence_tokens_per_s']:,.0f} seq tok/s "
        f"({training['block_tokens_per_s']:,.0f} block tok/s), "
        f"{training['achieved_tflops']:.1f} TFLOP/s, MFU {mfu(training)}"
    )
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:.1f} GiB"  # noqa: E731
    print(
        f"  peak GPU memory: extraction {gib(extraction['peak_gpu_bytes'])}, training "
        f"{gib(training['peak_gpu_bytes'])} (planned {gib(training['planned_peak_bytes'])}"
        f"{', ratio ' + ratio if (ratio := _ratio(training)) else ''})"
    )
    if report["hybrid_kernels_missing"]:
        missing = ", ".join(report["hybrid_kernels_missing"])
        print(f"  DeltaNet layers on the torch fallback ({missing} not installed)")
    print(f"  total {report['total_s']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _ratio(training: dict[str, Any]) -> str:
    """Measured peak over the planned one, e.g. `0.93x`; empty without a measurement."""
    measured, planned = training["peak_gpu_bytes"], training["planned_peak_bytes"]
    return f"{measured / planned:.2f}x" if measured and planned else ""


if __name__ == "__main__":
    sys.exit(main())
