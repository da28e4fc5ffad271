"""On the training node: train on each shard as the generating node pushes it.

Polls the generating node's git branch (`generate/RUN`), takes each finished generation stage
from it (lock entries by git, outputs from the DVC remote), runs validate_shard, extract and
the training link of each shard as it arrives, then the whole-run validation, the remaining
epochs and evaluate; pushes its own results after each shard (DVC remote, branch `train/RUN`).
Never generates. Rerun it after a crash: it resumes where DVC and the link's checkpoint left.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.commands.lead import add_common, node_of
from draftline.ops import two_nodes
from draftline.runtime import params
from draftline.runtime.arg_types import positive

EXAMPLES = """examples:
  draftline follow                        # run name: this branch's name
  draftline follow --run qwen36-sharegpt --poll-s 60
  draftline follow --run qwen36-sharegpt --take-over   # the first follower is gone for good"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_common(parser)
    parser.add_argument(
        "--poll-s", type=positive, default=30.0, help="seconds between looks at the branch"
    )
    parser.add_argument(
        "--take-over",
        action="store_true",
        help="follow the run even though another node claimed it (that node is gone for good)",
    )


def run(args: argparse.Namespace) -> int:
    node = node_of(args)
    shard_ids = [int(k) for k in params.load(Path(args.repo) / "params.yaml")["data"]["shard_ids"]]
    return two_nodes.follow(node, shard_ids, poll_s=args.poll_s, take_over=args.take_over)
