"""Rebuild an embedded target: the tiny Qwen3 default (models/tiny-target) or the tiny Qwen3.6
twin (`--model tiny_qwen36`, models/tiny-qwen36).

Deterministic: the same software on the same kind of CPU writes byte-identical files (on another
CPU the weights differ within float rounding; tests/helpers/fixture_checks.py). Prints the build
time and the thinking-format rate on the bundled prompts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

# Model option -> (builder module, default output folder).
BUILDERS = {
    "tiny": ("draftline.embedded.tiny_target", "models/tiny-target"),
    "tiny_qwen36": ("draftline.embedded.tiny_qwen36", "models/tiny-qwen36"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", choices=sorted(BUILDERS), default="tiny", help="which embedded target"
    )
    parser.add_argument("--out", default=None, help="folder to write (default: the model's)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="generation budget for the rate check (default: model.max_new_tokens in "
        "conf/model/<model>.yaml)",
    )
    parser.add_argument("--no-rate", action="store_true", help="skip the thinking-format check")
    parser.add_argument(
        "--heads",
        type=int,
        default=None,
        help="tiny only: attention heads (key/value heads: half), head_dim = 64 / heads; "
        "2 gives head_dim 32, which vLLM's CPU attention runs (the default 4 gives 16)",
    )


def _profile(model: str) -> dict[str, Any]:
    path = Path("conf/model") / f"{model}.yaml"
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else {}


def run(args: argparse.Namespace) -> int:
    import importlib

    from draftline.core.target import load_model
    from draftline.embedded import sample_prompts, tiny_target

    module, default_out = BUILDERS[args.model]
    out = args.out or default_out
    if args.heads is not None:
        if args.model != "tiny":
            raise SystemExit("--heads is for --model tiny only")
        config = tiny_target.BuildConfig(
            num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2)
        )
        figures = tiny_target.build(out, config)
    else:
        figures = importlib.import_module(module).build(out)
    print(
        f"wrote {out}: {figures['num_parameters']:,} parameters, "
        f"vocab {figures['vocab_size']}, "
        f"loss {figures['first_loss']:.3f} -> {figures['final_loss']:.3f}, "
        f"build {figures['wall_s']:.1f} s wall / {figures['cpu_s']:.1f} s CPU"
    )
    if args.no_rate:
        return 0
    budget = args.max_new_tokens or int(_profile(args.model).get("max_new_tokens", 160))
    tokenizer = tiny_target.load_tokenizer_uncached(out)
    model = load_model({"path": out})
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
