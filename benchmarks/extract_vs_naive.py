"""Benchmark: draftline's feature extraction against a naive reference, same model, same data.

Both run on one random-initialised Qwen3 model (CPU, fp32, 2 threads) over the same
long-tailed sequence lengths (log-normal, cut to --max-len):

- draftline: `extraction.pack_features` as the extract stage calls it: sequences sorted by
  length, batched by a token budget, and a forward that stops after the last target layer
  (no later layers, no final norm, no lm_head), keeping only the K target layers.
- naive: batches of --naive-batch sequences in data order, padded to the longest, a full
  `model(..., output_hidden_states=True)` forward (every layer, the lm_head and its logits),
  the K layers picked from `hidden_states` afterwards.

Speed and peak memory are measured in one fresh subprocess each; the features of every token
are compared in this process (draftline stores bf16, so the naive fp32 features are compared
after the same cast).

    python benchmarks/extract_vs_naive.py [--sequences 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from peak_memory import peak_bytes, reset_peak, rss_bytes

from draftline.drafter.extraction import pack_features

CONTENDERS = ("draftline", "naive")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=96)
    p.add_argument("--median-len", type=int, default=192)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--naive-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """DFlash's spread of K target layers (REFERENCE §2): round(1 + i*(L-4)/(K-1))."""
    return [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


def make_model(args: argparse.Namespace) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(4096, args.max_len),
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).eval()


def make_rows(args: argparse.Namespace) -> list[list[int]]:
    """Token rows with long-tailed lengths (log-normal around --median-len), data order."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.exp(torch.randn(args.sequences, generator=gen) * 0.9) * args.median_len
    lengths = lengths.clamp(8, args.max_len).long().tolist()
    return [torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lengths]


def draftline_features(model: Any, rows: list[list[int]], args: argparse.Namespace) -> list:
    """Per-row features, computed as the extract stage does (sorted by length first)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    feats, _ = pack_features(
        model,
        [rows[i] for i in order],
        layer_ids(args.layers),
        args.tokens_per_batch,
        torch.device("cpu"),
    )
    out: list = [None] * len(rows)
    start = 0
    for i in order:
        out[i] = feats[start : start + len(rows[i])]
        start += len(rows[i])
    return out


@torch.no_grad()
def naive_features(model: Any, rows: list[list[int]], args: argparse.Namespace) -> list:
    """Padded fixed-size batches in data order, all layers and logits, then pick the K layers."""
    ids_k = layer_ids(args.layers)
    out = []
    for start in range(0, len(rows), args.naive_batch):
        batch = rows[start : start + args.naive_batch]
        width = max(len(r) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, : len(r)] = torch.tensor(r)
            mask[j, : len(r)] = 1
        result = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = torch.cat([result.hidden_states[i + 1] for i in ids_k], dim=-1)
        out.extend(states[j, : len(r)].clone() for j, r in enumerate(batch))
    return out


def run(name: str, model: Any, rows: list[list[int]], args: argparse.Namespace) -> list:
    fn = draftline_features if name == "draftline" else naive_features
    return fn(model, rows, args)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = make_model(args)
    rows = make_rows(args)
    before = rss_bytes()
    reset_peak()
    began = time.perf_counter()
    features = run(args.worker, model, rows, args)
    seconds = time.perf_counter() - began
    peak = peak_bytes()
    tokens = sum(len(r) for r in rows)
    return {
        "contender": args.worker,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "peak_bytes": peak - before,
        "feature_bytes": sum(f.numel() * f.element_size() for f in features),
    }


def compare(args: argparse.Namespace) -> dict[str, float]:
    """Largest difference between the contenders' features, relative to the features' scale."""
    torch.set_num_threads(args.threads)
    model = make_model(args)
    rows = make_rows(args)
    ours = draftline_features(model, rows, args)
    ref = naive_features(model, rows, args)
    pairs = list(zip(ours, ref, strict=True))
    diff = max(float((a.float() - b.to(torch.bfloat16).float()).abs().max()) for a, b in pairs)
    scale = max(float(b.abs().max()) for b in ref)
    shapes_equal = all(a.shape == b.shape for a, b in pairs)
    return {"max_abs_diff": diff, "scale": scale, "shapes_equal": float(shapes_equal)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    forwarded = [
        x
        for name, value in vars(args).items()
        if name not in ("json", "worker")
        for x in (f"--{name.replace('_', '-')}", str(value))
    ]
    runs = {}
    for name in CONTENDERS:
        cmd = [sys.executable, __file__, *forwarded, "--worker", name]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    equal = compare(args)
    # bf16 keeps 8 bits of mantissa: one rounding step is 2^-8 of the value.
    equal_ok = bool(equal["shapes_equal"]) and equal["max_abs_diff"] <= 2**-7 * equal["scale"]
    ours, ref = runs["draftline"], runs["naive"]
    report = {
        "case": {k: v for k, v in vars(args).items() if k not in ("json", "worker")},
        "layer_ids": layer_ids(args.layers),
        "runs": runs,
        "equality": equal,
        "features_equal": equal_ok,
        "tokens_per_s_ratio": ours["tokens_per_s"] / ref["tokens_per_s"],
        "peak_memory_ratio": ours["peak_bytes"] / ref["peak_bytes"],
    }
    print(f"{args.sequences} sequences, {ours['tokens']} tokens, layers {report['layer_ids']}")
    for name, r in runs.items():
        print(
            f"  {name:9s} {r['seconds']:7.2f} s  {r['tokens_per_s']:8.0f} tok/s  "
            f"peak +{r['peak_bytes'] / 2**20:8.1f} MiB"
        )
    print(
        f"draftline/naive: tokens/s x{report['tokens_per_s_ratio']:.2f}, "
        f"peak memory x{report['peak_memory_ratio']:.3f}"
    )
    print(
        f"features equal: {equal_ok} (max |diff| {equal['max_abs_diff']:.2e} "
        f"of scale {equal['scale']:.2e})"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if equal_ok else 1


if __name__ == "__main__":
    sys.exit(main())
