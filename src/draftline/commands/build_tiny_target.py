"""Rebuild the embedded tiny target (tokenizer + Qwen3 model) in models/tiny-target.

Deterministic: the same software on the same kind of CPU writes byte-identical files. Prints the
build time and the thinking-format rate on the bundled prompts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

TINY_CONF = Path("conf/model/tiny.yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="models/tiny-target", help="folder to write")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"generation budget for the rate check (default: model.max_new_tokens in {TINY_CONF})",
    )
    parser.add_argument("--no-rate", action="store_true", help="skip the thinking-format check")


def _default_max_new_tokens() -> int:
    if TINY_CONF.exists():
        return int(yaml.safe_load(TINY_CONF.read_text(encoding="utf-8"))["max_new_tokens"])
    return 160


def run(args: argparse.Namespace) -> int:
    from draftline import sample_prompts, tiny_target
    from draftline.target import load_model

    figures = tiny_target.build(args.out)
    print(
        f"wrote {args.out}: {figures['num_parameters']:,} parameters, "
        f"vocab {figures['vocab_size']}, "
        f"loss {figures['first_loss']:.3f} -> {figures['final_loss']:.3f}, "
        f"build {figures['wall_s']:.1f} s wall / {figures['cpu_s']:.1f} s CPU"
    )
    if args.no_rate:
        return 0
    budget = args.max_new_tokens or _default_max_new_tokens()
    model_cfg = {"path": args.out}
    tokenizer = tiny_target.load_tokenizer_uncached(args.out)
    model = load_model(model_cfg)
    prompts = sample_prompts.valid_prompts()
    rate = tiny_target.thinking_format_rate(model, tokenizer, prompts, budget)
    print(
        f"thinking-format rate on {len(prompts)} bundled prompts "
        f"(greedy, {budget} new tokens): {rate:.3f}"
    )
    if rate < 0.9:
        print("warning: below the required 0.9")
        return 1
    return 0
