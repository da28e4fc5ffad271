"""Committing and pushing what git must carry (dvc.lock with the params.yaml it was run with,
metrics, notes) and finding what is not committed."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from draftline.ops import redaction
from draftline.ops.salvage.finding import Finding
from draftline.ops.salvage.git_target import GitTarget
from draftline.ops.salvage.remote_outputs import uncached_outputs

# --- git -----------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=False, env=env
    )


def git_changes(root: Path) -> list[str]:
    done = _git(root, "status", "--porcelain", "--untracked-files=all")
    return done.stdout.splitlines() if done.returncode == 0 else []


def _bookkeeping(change: str, uncached: Iterable[str] = ()) -> bool:
    """DVC's own files (the lock, `.dvc` pointers, the .gitignore files it maintains), the
    params.yaml the lock was run with (`dvc exp run -S` rewrites it: without it a clone reruns
    instead of restoring) and the `cache: false` outputs of finished stages (metrics, plots),
    which git carries, not DVC."""
    path = change[3:].strip().strip('"')
    name = Path(path).name
    if name in ("dvc.lock", ".gitignore") or name.endswith(".dvc") or path == "params.yaml":
        return True
    return any(path == out or path.startswith(out.rstrip("/") + "/") for out in uncached)


def to_commit(root: Path) -> list[str]:
    """The changed files salvage commits (besides its notes)."""
    uncached = uncached_outputs(root)
    return [c[3:].strip().strip('"') for c in git_changes(root) if _bookkeeping(c, uncached)]


def commit_and_push(
    root: Path, notes: Path, message: str, target: GitTarget | None, stopped: bool = False
) -> list[Finding]:
    """Commit the notes and what git carries, and push them (and annotated tags) to `target`;
    `target` None: commit only (--no-push-git); `stopped`: a secret in what git would push,
    named in its own finding, holds the push back."""
    note_path = str(notes.relative_to(root))
    kept = to_commit(root)
    paths = sorted({note_path, *kept})
    # -f for the notes: the copied logs keep their paths (logs/, .draftline/), which the
    # repository's .gitignore ignores, and they must reach the next node all the same.
    added = _git(root, "add", "-f", "--", note_path)
    if added.returncode == 0 and kept:
        added = _git(root, "add", "--", *kept)
    if added.returncode != 0:
        return [
            Finding(
                False,
                f"git add failed: {added.stderr.strip()[:300]}",
                "fix the repository (disk full? permissions?) and run again",
            )
        ]
    done = _git(root, "commit", "-m", message, "--", *paths)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip()[:300]
        return [
            Finding(
                False,
                f"git commit of dvc.lock and notes failed: {why}",
                "set `git config user.name/user.email` or free disk space, run again",
            )
        ]
    rev = _git(root, "rev-parse", "--short", "HEAD").stdout.strip()
    findings = [Finding(True, f"committed {', '.join(paths)} as {rev}")]
    if target is None:
        return findings + [
            Finding(
                False,
                f"commit {rev} is only on this node (--no-push-git)",
                "git push it before shutting down",
            )
        ]
    if target.remote is None:
        return findings + [
            Finding(
                False,
                f"{target.why}: commit {rev} is only on this node",
                f"{target.fix}, then `draftline salvage` again",
            )
        ]
    if stopped:
        return findings + [
            Finding(
                False,
                f"commit {rev} is only on this node: the git push to {target.remote} is stopped",
                "remove the secret named above, then `draftline salvage` again",
            )
        ]
    pushed = _git(root, "push", "--porcelain", "--follow-tags", *target.push_args())
    if pushed.returncode != 0:
        # --porcelain reports a rejected ref (`!`, and why) on stdout, git's error on stderr.
        rejected = [
            line.replace("\t", " ") for line in pushed.stdout.splitlines() if line[:1] == "!"
        ]
        why = redaction.redact_text(" | ".join([*rejected, pushed.stderr.strip()]))[:300]
        return findings + [
            Finding(
                False,
                f"git push to {target.remote} failed: {why}",
                "push the commit by hand before shutting down",
            )
        ]
    tags = _pushed_tags(pushed.stdout)
    also = f" with tags {', '.join(tags)}" if tags else ""
    return findings + [Finding(True, f"git: {rev}{also} pushed to {target.describe()}")]


def _pushed_tags(porcelain: str) -> list[str]:
    """The tags `git push --porcelain` reports sent (flag `*` new, `+` forced)."""
    return [
        fields[1].split(":", 1)[0].removeprefix("refs/tags/")
        for fields in (line.split("\t") for line in porcelain.splitlines())
        if len(fields) >= 2 and fields[0] in ("*", "+") and fields[1].startswith("refs/tags/")
    ]


def no_git_remote(target: GitTarget, stopped: bool = False) -> list[Finding]:
    """For a dry run: where the salvage commit would go."""
    if stopped:
        return [
            Finding(
                False,
                f"git: the salvage commit would stay on this node: the push to {target.remote} "
                "is stopped",
                "remove the secret named above, then run `draftline salvage`",
            )
        ]
    if target.remote is not None:
        return [Finding(True, f"git: the salvage commit would be pushed to {target.describe()}")]
    return [
        Finding(
            False,
            f"{target.why}: the salvage commit would stay on this node",
            f"{target.fix}, then run `draftline salvage`",
        )
    ]


def uncommitted(root: Path, committing: Iterable[str] = ()) -> list[Finding]:
    """Changes git would not carry off this node, but those salvage commits (`committing`)."""
    skip = set(committing)
    changes = [c for c in git_changes(root) if c[3:].strip().strip('"') not in skip]
    if not changes:
        return [Finding(True, "git: no uncommitted changes")]
    tracked = [c[3:] for c in changes if not c.startswith("??")]
    untracked = [c[3:] for c in changes if c.startswith("??")]
    findings = []
    if tracked:  # tracked files are the project's: committing them is the only fix offered
        findings.append(
            Finding(
                False,
                f"{len(tracked)} changed tracked files, not saved: {_shown(tracked)}",
                f"`git add {' '.join(tracked[:15])} && git commit && git push`",
            )
        )
    if untracked:
        findings.append(
            Finding(
                False,
                f"{len(untracked)} untracked files, not saved: {_shown(untracked)}",
                "commit and push what you need (scripts, configs, patches); ignore or delete "
                "the rest",
            )
        )
    return findings


def _shown(paths: list[str]) -> str:
    return ", ".join(paths[:15]) + (" ..." if len(paths) > 15 else "")
