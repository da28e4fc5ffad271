"""Compose conf/ into params.yaml for a plain `dvc repro` (what `dvc exp run -S` does itself).

Examples: `draftline compose hardware=b200x8 model=qwen3_6_27b data=sharegpt drafter=dflash_b16`;
`draftline compose --check` fails when params.yaml is not conf/ composed with the overrides it
was written with (its first line, `# draftline compose ...`); `--output -` prints the result.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import sys
from pathlib import Path

from draftline.runtime import atomic, params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. hardware=b200x8")
    parser.add_argument(
        "--output", default="params.yaml", help="file to write (params.yaml); - for stdout"
    )
    parser.add_argument("--config-dir", default="conf", help="the Hydra tree (conf)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 when the file differs from the composition (with the "
        "overrides given, else those recorded in the file)",
    )


def run(args: argparse.Namespace) -> int:
    if args.check:
        return check(Path(args.output), args.config_dir, args.overrides or None)
    composed = params.compose(args.overrides, args.config_dir)
    params.check_model_path(composed)
    text = params.to_yaml(composed, args.overrides)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        # /dev/stdout, a FIFO or a link: write through it; a rename would replace it.
        with out.open("w", encoding="utf-8") as f:
            f.write(text)
        return 0
    atomic.write_text(out, text)
    print(f"wrote {out}")
    return 0


def check(out: Path, config_dir: str, overrides: list[str] | None) -> int:
    if str(out) == "-":
        raise SystemExit("compose --check compares a file: pass --output FILE (not -)")
    current, used, composed = params.is_current(out, config_dir, overrides)
    command = " ".join(["draftline compose", *([shlex.join(used)] if used else [])])
    if current:
        print(f"{out} is up to date with `{command}`")
        return 0
    old = out.read_text(encoding="utf-8").splitlines() if out.exists() else []
    new = params.to_yaml(composed, used).splitlines()
    diff = difflib.unified_diff(old, new, str(out), "composed", lineterm="")
    sys.stdout.writelines(line + "\n" for line in diff)
    print(f"{out} is stale: run `{command}` and commit it")
    return 1
