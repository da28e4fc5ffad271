"""On the generating node: run curate and each generation stage, pushing each as it finishes.

After every stage, its outputs go to the DVC remote and `dvc.lock` (with its git-tracked
outputs) to the branch `generate/RUN` of the git origin, where `draftline follow` on the
training node picks them up. Rerun it after a crash: finished shards are skipped, the shard in
flight resumes from its journal. Start the servers first (`draftline serve start`).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from draftline.ops import two_nodes
from draftline.runtime import params
from draftline.runtime.arg_types import non_negative

EXAMPLES = """examples:
  draftline lead                          # run name: this branch's name
  draftline lead --run qwen36-sharegpt"""


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", help="name both nodes use: branches generate/RUN, train/RUN (default: branch)"
    )
    parser.add_argument("--remote", default="origin", help="git remote both nodes push to")
    parser.add_argument("--repo", default=".", help="repository root (default: .)")
    parser.add_argument(
        "--retry-s",
        type=non_negative,
        default=two_nodes.DEFAULT_BUDGET_S,
        help="how long the git or DVC remote may stay unreachable before the run stops "
        "(retried with growing pauses; default: %(default)g)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_common(parser)


def node_of(args: argparse.Namespace) -> two_nodes.Node:
    root = Path(args.repo)
    name = args.run
    if not name:
        done = subprocess.run(
            ["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=root, capture_output=True, text=True
        )
        name = done.stdout.strip()
        if done.returncode or name == "HEAD":
            raise SystemExit("no branch checked out here: name the run with --run NAME")
        name = name.split("/", 1)[1] if name.startswith(("generate/", "train/")) else name
    return two_nodes.Node(root=root, run_name=name, remote=args.remote, retry_s=args.retry_s)


def run(args: argparse.Namespace) -> int:
    node = node_of(args)
    shard_ids = [int(k) for k in params.load(Path(args.repo) / "params.yaml")["data"]["shard_ids"]]
    return two_nodes.lead(node, shard_ids)
