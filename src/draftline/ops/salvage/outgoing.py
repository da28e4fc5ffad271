"""What salvage's git pushes would send, screened for secrets.

The notes are redacted, but a push also sends what no redactor may touch: the messages of the
commits the remote lacks (of the branch and of every experiment), experiment names (each a ref,
`refs/exps/.../<name>`) and the annotated tags `git push --follow-tags` takes along. Salvage
never rewrites history, so one of them in the shape of a secret (`redaction.holds_secret`)
stops every git push of the run, with a finding that names it by commit and redacted form.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from draftline.ops import redaction
from draftline.ops.salvage.experiments import experiments
from draftline.ops.salvage.finding import Finding

AGAIN = "then `draftline salvage` again (salvage never rewrites history)"


def _git(root: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(
        ["git", *args], cwd=root, input=stdin, capture_output=True, text=True, check=False, env=env
    )


def _remote_refs(root: Path, remote: str) -> dict[str, str] | None:
    """ref -> object of everything the remote holds; None when it cannot be read."""
    done = _git(root, "ls-remote", remote)
    if done.returncode != 0:
        return None
    return {ref: sha for sha, ref in (line.split("\t", 1) for line in done.stdout.splitlines())}


def _unpushed_messages(
    root: Path, tips: list[str], remote: str, held: dict[str, str] | None
) -> dict[str, str]:
    """short sha -> message of every commit reachable from `tips` that the remote lacks: git
    sends what lies beyond the remote's objects that are here."""
    if held is None:  # unreadable remote: what this repository last saw of it
        seen = _git(root, "for-each-ref", "--format=%(objectname)", f"refs/remotes/{remote}/")
        objects = seen.stdout.split()
    else:
        check = _git(root, "cat-file", "--batch-check", stdin="\n".join(held.values()) + "\n")
        found = (line.split() for line in check.stdout.splitlines())
        objects = [f[0] for f in found if len(f) == 3 and f[1] in ("commit", "tag")]
    revs = "\n".join([*tips, *(f"^{sha}" for sha in objects)]) + "\n"
    done = _git(root, "log", "-z", "--format=%h%n%B", "--stdin", stdin=revs)
    if done.returncode != 0:
        raise RuntimeError(f"git log of the unpushed commits failed: {done.stderr.strip()[:200]}")
    records = (r.split("\n", 1) for r in done.stdout.split("\0") if r.strip())
    return {r[0]: r[1] if len(r) > 1 else "" for r in records}


def _unpushed_tags(root: Path, held: dict[str, str] | None) -> dict[str, str]:
    """name -> message of the annotated tags on HEAD's history that the remote lacks."""
    done = _git(
        root, "for-each-ref", "--merged", "HEAD",
        "--format=%(refname)%00%(objecttype)%00%(contents)%1e", "refs/tags",
    )  # fmt: skip
    tags = {}
    for record in done.stdout.split("\x1e"):
        fields = record.strip("\n").split("\0")
        if len(fields) == 3 and fields[1] == "tag" and fields[0] not in (held or {}):
            tags[fields[0].removeprefix("refs/tags/")] = fields[2]
    return tags


def secrets_in_outgoing(root: Path, remote: str) -> list[Finding]:
    """One NOT SAFE finding per commit, experiment or tag a push would send with a secret."""
    held = _remote_refs(root, remote)
    exps = [e for e in experiments(root) if (held or {}).get(e.ref) != e.commit]
    found: list[Finding] = []
    stop = f"salvage pushes nothing to git remote {remote}"
    for exp in exps:
        if redaction.holds_secret(exp.name):
            found.append(
                Finding(
                    False,
                    f"experiment {_shown(exp.name)} (commit {exp.commit[:7]}) has a secret in "
                    f"its name: {stop}",
                    f"`dvc exp rename <its name> <new name>` (`git for-each-ref --points-at "
                    f"{exp.commit[:7]} refs/exps/` prints it), {AGAIN}",
                )
            )
    tips = ["HEAD", *(e.commit for e in exps)]
    for sha, message in _unpushed_messages(root, tips, remote, held).items():
        if redaction.holds_secret(message):
            subject = _shown(message.strip().split("\n", 1)[0])
            found.append(
                Finding(
                    False,
                    f'commit {sha} ("{subject}") has a secret in its message: {stop}',
                    f"reword it: `git commit --amend` if it is the last commit, else `git rebase "
                    f"-i {sha}^` and mark it `reword`; {AGAIN}",
                )
            )
    for name, message in _unpushed_tags(root, held).items():
        if redaction.holds_secret(name) or redaction.holds_secret(message):
            found.append(
                Finding(
                    False,
                    f"tag {_shown(name)} has a secret in its name or message: {stop}",
                    f"delete it (`git tag -d <name>`) or tag again with another message, {AGAIN}",
                )
            )
    return found


def _shown(text: str) -> str:
    return redaction.redact_patterns(text)[:80]
