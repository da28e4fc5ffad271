"""Rebuild the bundled prompt set, data/sample/conversations.jsonl, byte for byte.

The conversations come from the project's own templates
(`draftline.embedded.sample_prompts`), with a few deliberately bad rows per curate reject reason.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="data/sample", help="folder to write")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from draftline.embedded import sample_prompts
    from draftline.runtime import atomic

    rows = sample_prompts.build_rows()
    path = Path(args.out) / sample_prompts.FILE_NAME
    with atomic.atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in tqdm(rows, desc="write", unit="row"):
            f.write(row.line + "\n")
    reasons = Counter(row.expected_reason for row in rows if row.expected_reason)
    bad = sum(reasons.values())
    print(
        f"wrote {path}: {len(rows)} rows, {len(rows) - bad} valid, "
        f"{bad} bad ({bad / len(rows):.1%})"
    )
    print("bad rows by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    return 0
