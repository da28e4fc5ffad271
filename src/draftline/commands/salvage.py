"""Save everything before this node shuts down, and say whether it is safe to.

Snapshots the node into notes/salvage/, gathers logs and metrics, runs `dvc push --run-cache`,
verifies that the remote holds every object dvc.lock names, pushes every experiment (`dvc exp
push`: refs and outputs), commits dvc.lock with its params.yaml and the notes (and pushes git),
then prints what is SAFE and what is NOT SAFE. Exit status 1 when anything is not safe.
`--dry-run` prints the plan, runs every check that writes nothing (remote, experiments, git)
and gives the verdict it would (exit status 1 when NOT SAFE).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.ops.salvage import checklist as salvage
from draftline.runtime import arg_types


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote", "-r", help="DVC remote to push to (default: core.remote, s3)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and the verdict of every check that writes nothing",
    )
    parser.add_argument(
        "--deep",
        action="store_true",
        help="verify by downloading and hashing every object (default: S3 ETag/size)",
    )
    parser.add_argument(
        "--stop-servers", action="store_true", help="run `draftline serve stop` at the end"
    )
    parser.add_argument("--no-commit", action="store_true", help="do not git commit the notes")
    parser.add_argument("--no-push-git", action="store_true", help="commit but do not git push")
    parser.add_argument(
        "--min-free-mib",
        type=arg_types.non_negative,
        default=salvage.DEFAULT_MIN_FREE / 2**20,
        help="report the disk as full below this much free space (MiB)",
    )
    parser.add_argument("--repo", default=".", help="repository root (default: .)")


def run(args: argparse.Namespace) -> int:
    opts = salvage.Options(
        root=Path(args.repo),
        remote=args.remote,
        dry_run=args.dry_run,
        deep=args.deep,
        stop_servers=args.stop_servers,
        commit=not args.no_commit,
        push_git=not args.no_push_git,
        min_free_bytes=int(args.min_free_mib * 2**20),
    )
    return salvage.salvage(opts)
