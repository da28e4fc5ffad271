"""Which git remote salvage pushes to: the one the checked-out branch tracks
(`branch.<name>.remote`), else origin, else the only remote.

Code, experiments and tags all go to that one remote: an experiment's ref is of use only in
the repository that holds its baseline commit, so splitting them leaves neither restorable.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftline.ops.salvage.finding import Finding


@dataclass(frozen=True)
class GitTarget:
    remote: str | None  # None: no remote, or several and none chosen (`why` says which)
    why: str  # how `remote` was chosen, or why there is none
    upstream: str | None = None  # the tracked branch on `remote` (refs/heads/...), if any
    others: tuple[str, ...] = ()  # the remotes salvage pushes nothing to
    fix: str = ""  # what to do when `remote` is None, before salvage runs again

    def describe(self) -> str:
        return f"{self.remote} ({self.why})"

    def push_args(self) -> list[str]:
        """`git push` arguments: the tracked branch, else HEAD under its name, tracked from now."""
        if self.upstream:
            return [str(self.remote), f"HEAD:{self.upstream}"]
        return ["-u", str(self.remote), "HEAD"]


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=False, env=env
    )


def git_target(root: Path) -> GitTarget:
    remotes = _git(root, "remote").stdout.split()
    branch = _git(root, "symbolic-ref", "--short", "-q", "HEAD").stdout.strip()
    tracked = upstream = ""
    if branch:
        tracked = _git(root, "config", f"branch.{branch}.remote").stdout.strip()
        upstream = _git(root, "config", f"branch.{branch}.merge").stdout.strip()
    who = f"branch {branch}" if branch else "the detached HEAD"
    if tracked in remotes:  # "." (a local branch) or a URL is no remote to name
        return _target(tracked, f"the upstream of {branch}", remotes, upstream or None)
    if "origin" in remotes:
        return _target("origin", f"{who} tracks no remote; origin by default", remotes)
    if len(remotes) == 1:
        return _target(remotes[0], f"{who} tracks no remote; the only one", remotes)
    if not remotes:
        return GitTarget(None, "no git remote", fix="`git remote add origin URL`")
    return GitTarget(
        None,
        f"{who} tracks none of the git remotes {', '.join(remotes)} and none is origin",
        others=tuple(remotes),
        fix="`git push -u <remote> HEAD` to the remote that should hold this run",
    )


def _target(remote: str, why: str, remotes: list[str], upstream: str | None = None) -> GitTarget:
    return GitTarget(remote, why, upstream, tuple(r for r in remotes if r != remote))


def remotes_finding(target: GitTarget) -> list[Finding]:
    """With several remotes: which one holds this run, and that the others get nothing."""
    if target.remote is None or not target.others:
        return []
    return [
        Finding(
            True,
            f"git remote {target.describe()} holds this run's commits, experiments and tags; "
            f"salvage pushes nothing to {', '.join(target.others)}",
        )
    ]
