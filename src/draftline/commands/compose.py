"""Compose conf/ into params.yaml for a plain `dvc repro` (what `dvc exp run -S` does itself).

Examples: `draftline compose hardware=b200x8 model=qwen3_6_27b data=sharegpt drafter=dflash_b16`;
`draftline compose --check` fails when the committed params.yaml is not the default composition.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import yaml

from draftline import atomic, params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. hardware=b200x8")
    parser.add_argument("--output", default="params.yaml", help="file to write (params.yaml)")
    parser.add_argument("--config-dir", default="conf")
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 when the file differs from the composition",
    )


def run(args: argparse.Namespace) -> int:
    composed = params.compose(args.overrides, args.config_dir)
    text = params.to_yaml(composed)
    out = Path(args.output)
    if args.check:
        current = yaml.safe_load(out.read_text(encoding="utf-8")) if out.exists() else None
        if current == composed:
            print(f"{out} is up to date with {args.config_dir}/ {' '.join(args.overrides)}")
            return 0
        old = out.read_text(encoding="utf-8").splitlines() if out.exists() else []
        diff = difflib.unified_diff(old, text.splitlines(), str(out), "composed", lineterm="")
        sys.stdout.writelines(line + "\n" for line in diff)
        print(f"{out} is stale: run `draftline compose {' '.join(args.overrides)}` and commit it")
        return 1
    atomic.write_text(out, text)
    print(f"wrote {out}")
    return 0
