"""Benchmark: the drafter's training step against the dense step, the same math.

One training step (drafter forward, weighted block loss, backward) on one sequence of
--seq tokens with --anchors blocks of --block tokens, CPU, 2 threads, run twice in the same
invocation:

- blockwise, draftline's step: `block_prefix_attention` (each chunk of blocks sees the context
  up to its largest anchor plus its own blocks) and `block_loss`, the lm_head fused with the
  weighted CE chunk by chunk (`draftline.drafter.linear_cross_entropy`, torch path);
- dense, the SpecForge-style step: `dense_block_attention` (one SDPA over [context ; all blocks]
  with a dense [N*B, T + N*B] mask) and the plain loss (the full [N*B, vocab] logits, then
  F.cross_entropy).

The outputs, loss and gradients are compared in this process; speed is measured here too, the
formulations alternating round after round so that the machine's load hits both alike; peak
memory is measured in one fresh subprocess per formulation so neither inherits the other's
allocations.

    python benchmarks/train_attention.py [--seq 2048] [--anchors 256] [--block 16] [--json out]

Reports, for the whole training step, for one layer's attention alone (forward and backward on
random queries, keys and values of the same shapes) and for the loss alone (forward and
backward from random hidden states): sequence tokens per second, peak RSS above the resident
size before a run (after a warm-up run), and the ratios blockwise / dense.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peak_memory import peak_bytes, reset_peak, rss_bytes

from draftline.drafter.dflash import (
    ATTENTION_IMPLEMENTATIONS,
    DFlashConfig,
    DFlashDrafter,
    TargetHead,
)
from draftline.drafter.objective import LossParts, block_loss, position_weights

IMPLEMENTATIONS = ("blockwise", "dense")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    # A narrow Qwen3-style drafter layer: attention dominates, as it does at seq 2048.
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="timed rounds after one warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--worker", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_case(args: argparse.Namespace) -> tuple[DFlashDrafter, dict[str, torch.Tensor]]:
    """A seeded drafter and one micro-batch: features, blocks, sorted anchors, labels, weights."""
    torch.manual_seed(0)
    k = 5
    config = DFlashConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate_size=3 * args.hidden,
        vocab_size=args.vocab,
        block_size=args.block,
        mask_token_id=args.vocab - 1,
        target_layer_ids=list(range(k)),
        num_target_layers=k + 3,
    )
    head = TargetHead(
        torch.randn(args.vocab, args.hidden) * 0.02, torch.randn(args.vocab, args.hidden) * 0.02
    )
    drafter = DFlashDrafter(config, head)
    b, t, n, s = args.batch, args.seq, args.anchors, args.block
    anchors = torch.stack([torch.randperm(t - s)[:n].sort().values + 1 for _ in range(b)])
    block_ids = torch.randint(0, args.vocab - 1, (b, n, s))
    block_ids[..., 1:] = config.mask_token_id
    case = {
        "features": torch.randn(b, t, k * args.hidden),
        "block_ids": block_ids,
        "anchors": anchors,
        "labels": torch.randint(0, args.vocab - 1, (b, n, s)),
        "weights": position_weights(s, 7.0).expand(b, n, s).contiguous(),
    }
    return drafter, case


def plain_loss(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> LossParts:
    """The loss the plain way: the full logits [b, N, B, vocab], then the weighted CE."""
    logits = F.linear(hidden, head.to(hidden.dtype))
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    supervised = (weights > 0).float()
    hits = (logits.detach().argmax(-1) == labels).float() * supervised
    block = labels.shape[-1]
    return LossParts(
        (ce * weights.flatten()).sum(),
        hits.view(-1, block).sum(0),
        supervised.view(-1, block).sum(0),
    )


LOSSES = {"blockwise": block_loss, "dense": plain_loss}


def train_step(
    drafter: DFlashDrafter, case: dict[str, torch.Tensor], impl: str
) -> tuple[torch.Tensor, float]:
    """Forward, loss, backward; returns the drafter's final hidden states (detached) and the
    loss."""
    drafter.attention_implementation = impl
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(case["features"], case["block_ids"], case["anchors"])
    parts = LOSSES[impl](hidden, drafter.target.lm_head_weight, case["labels"], case["weights"])
    loss = parts.weighted_ce / case["weights"].sum()
    loss.backward()
    return hidden.detach(), float(loss.detach())


def attention_inputs(
    drafter: DFlashDrafter, case: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Random queries, keys and values of one drafter layer's attention on the case's shapes."""
    config = drafter.config
    b, n, s = case["block_ids"].shape
    t = case["features"].shape[1]
    h, kvh, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = [(b, n, s, h, d), (b, n, s, kvh, d), (b, n, s, kvh, d), (b, t, kvh, d), (b, t, kvh, d)]
    return tuple(torch.randn(shape, requires_grad=True) for shape in shapes)


def attention_step(
    attend: Any, inputs: tuple[torch.Tensor, ...], anchors: torch.Tensor, scale: float
) -> None:
    """The attention alone, forward and backward."""
    attend(*inputs, anchors, scale).square().sum().backward()


def loss_inputs(drafter: DFlashDrafter, case: dict[str, torch.Tensor]) -> torch.Tensor:
    """Random drafter outputs [b, N, B, H] at the case's shapes, for the loss alone."""
    b, n, s = case["block_ids"].shape
    return torch.randn(b, n, s, drafter.config.hidden_size, requires_grad=True)


def loss_step(
    loss: Any, drafter: DFlashDrafter, hidden: torch.Tensor, case: dict[str, torch.Tensor]
) -> None:
    """The loss alone, forward and backward."""
    hidden.grad = None
    parts = loss(hidden, drafter.target.lm_head_weight, case["labels"], case["weights"])
    parts.weighted_ce.backward()


def peak_after_warm_up(work: Any) -> int:
    """Peak memory of one run of `work` after a warm-up, above the resident size before it.

    The warm-up is not in the peak: it holds one-off allocations (thread pools, kernels).
    """
    work()
    before = rss_bytes()
    reset_peak()
    work()
    return peak_bytes() - before


def worker(args: argparse.Namespace) -> dict[str, int]:
    """Peak memory of one formulation, measured in this (fresh) process."""
    torch.set_num_threads(args.threads)
    drafter, case = make_case(args)
    attend = ATTENTION_IMPLEMENTATIONS[args.worker]
    inputs = attention_inputs(drafter, case)
    hidden = loss_inputs(drafter, case)
    scale = drafter.config.head_dim**-0.5
    return {
        "peak_step_bytes": peak_after_warm_up(lambda: train_step(drafter, case, args.worker)),
        "peak_attention_bytes": peak_after_warm_up(
            lambda: attention_step(attend, inputs, case["anchors"], scale)
        ),
        "peak_loss_bytes": peak_after_warm_up(
            lambda: loss_step(LOSSES[args.worker], drafter, hidden, case)
        ),
    }


def timings(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median seconds per formulation of a training step and of the attention alone.

    The formulations alternate in one process, round after round (the first is a warm-up),
    so a change in the machine's load hits both alike.
    """
    torch.set_num_threads(args.threads)
    drafter, case = make_case(args)
    inputs = attention_inputs(drafter, case)
    hidden = loss_inputs(drafter, case)
    scale = drafter.config.head_dim**-0.5
    times: dict[str, dict[str, list[float]]] = {
        impl: {"step_s": [], "attention_s": [], "loss_s": []} for impl in IMPLEMENTATIONS
    }
    for round_ in range(args.steps + 1):
        for impl in IMPLEMENTATIONS:
            attend = ATTENTION_IMPLEMENTATIONS[impl]
            work = {
                "step_s": partial(train_step, drafter, case, impl),
                "attention_s": partial(attention_step, attend, inputs, case["anchors"], scale),
                "loss_s": partial(loss_step, LOSSES[impl], drafter, hidden, case),
            }
            for name, run in work.items():
                began = time.perf_counter()
                run()
                if round_:
                    times[impl][name].append(time.perf_counter() - began)
    return {
        impl: {name: statistics.median(values) for name, values in runs.items()}
        for impl, runs in times.items()
    }


def compare_outputs(args: argparse.Namespace) -> dict[str, float]:
    """Max differences between the formulations' outputs and gradients on the same case."""
    torch.set_num_threads(args.threads)
    drafter, case = make_case(args)
    out = {}
    losses = {}
    grads = {}
    for impl in IMPLEMENTATIONS:
        out[impl], losses[impl] = train_step(drafter, case, impl)
        grads[impl] = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    block, dense = grads["blockwise"], grads["dense"]
    grad_rel = max(float((block[n] - dense[n]).abs().max() / dense[n].abs().max()) for n in dense)
    return {
        "hidden_max_abs_diff": float((out["blockwise"] - out["dense"]).abs().max()),
        "hidden_max_abs": float(out["dense"].abs().max()),
        "loss_rel_diff": abs(losses["blockwise"] - losses["dense"]) / abs(losses["dense"]),
        "grad_max_rel_diff": grad_rel,
    }


def run_worker(argv: list[str], impl: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *argv, "--worker", impl]
    # A fixed mmap threshold: glibc hands every large block back to the kernel when it is
    # freed, so resident memory follows the tensors alive instead of malloc's cache.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    case_options = ("seq", "anchors", "block", "batch", "hidden", "heads", "kv_heads", "layers")
    forwarded = [
        x
        for name in (*case_options, "vocab", "steps", "threads")
        for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
    ]
    equal = compare_outputs(args)
    tokens = args.batch * args.seq
    runs = {}
    for impl, seconds in timings(args).items():
        runs[impl] = {
            "implementation": impl,
            **seconds,
            "tokens_per_s": tokens / seconds["step_s"],
            "attention_tokens_per_s": tokens / seconds["attention_s"],
            "loss_tokens_per_s": tokens / seconds["loss_s"],
            **run_worker(forwarded, impl),
        }
    block, dense = runs["blockwise"], runs["dense"]
    report = {
        "case": {k: getattr(args, k) for k in ("seq", "anchors", "block", "batch", "hidden")},
        "equality": equal,
        "outputs_equal": equal["hidden_max_abs_diff"] <= 1e-4 * max(1.0, equal["hidden_max_abs"])
        and equal["loss_rel_diff"] <= 1e-5
        and equal["grad_max_rel_diff"] <= 1e-3,
        "runs": runs,
        "tokens_per_s_ratio": block["tokens_per_s"] / dense["tokens_per_s"],
        "peak_memory_ratio": block["peak_step_bytes"] / dense["peak_step_bytes"],
        "attention_tokens_per_s_ratio": block["attention_tokens_per_s"]
        / dense["attention_tokens_per_s"],
        "attention_peak_memory_ratio": block["peak_attention_bytes"]
        / dense["peak_attention_bytes"],
        "loss_tokens_per_s_ratio": block["loss_tokens_per_s"] / dense["loss_tokens_per_s"],
        "loss_peak_memory_ratio": block["peak_loss_bytes"] / dense["peak_loss_bytes"],
    }
    print(f"case: {report['case']}")
    for impl, r in runs.items():
        print(
            f"  {impl:9s} step {r['step_s']:7.3f} s  {r['tokens_per_s']:9.0f} tok/s  "
            f"peak +{r['peak_step_bytes'] / 2**20:8.1f} MiB | attention alone "
            f"{r['attention_s']:7.3f} s  peak +{r['peak_attention_bytes'] / 2**20:8.1f} MiB | "
            f"loss alone {r['loss_s']:7.3f} s  peak +{r['peak_loss_bytes'] / 2**20:8.1f} MiB"
        )
    print(
        f"blockwise/dense: training step tokens/s x{report['tokens_per_s_ratio']:.2f}, "
        f"peak memory x{report['peak_memory_ratio']:.3f}; attention alone tokens/s "
        f"x{report['attention_tokens_per_s_ratio']:.2f}, peak memory "
        f"x{report['attention_peak_memory_ratio']:.3f}; loss alone tokens/s "
        f"x{report['loss_tokens_per_s_ratio']:.2f}, peak memory "
        f"x{report['loss_peak_memory_ratio']:.3f}"
    )
    print(
        f"outputs equal: {report['outputs_equal']} (hidden max |diff| "
        f"{equal['hidden_max_abs_diff']:.2e}, loss rel diff {equal['loss_rel_diff']:.2e}, "
        f"grads max rel diff {equal['grad_max_rel_diff']:.2e})"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if report["outputs_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
