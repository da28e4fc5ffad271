"""Experiments (`dvc exp run`): their git refs and their outputs leave the node too.

An experiment lives in a git ref under `refs/exps/` and its outputs in the DVC cache: neither a
plain `git push` nor `dvc push` sends them. `dvc exp push <git remote> --all-commits -r <dvc
remote>` sends both; salvage then checks that the git remote holds every ref at its commit and
that the bucket holds every output each experiment's dvc.lock names. While one is not saved,
the verdict is NOT SAFE.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftline.ops import redaction
from draftline.ops.salvage.finding import Finding
from draftline.ops.salvage.git_target import GitTarget
from draftline.ops.salvage.remote_outputs import lock_outputs, verify_remote


@dataclass(frozen=True)
class Experiment:
    name: str
    ref: str  # refs/exps/<baseline>/<name>
    commit: str


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=False, env=env
    )


def experiments(root: Path) -> list[Experiment]:
    """Every experiment of this repository, of any baseline (DVC's running ones left out)."""
    done = _git(root, "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps/")
    found = []
    for line in done.stdout.splitlines():
        commit, ref = line.split(" ", 1)
        parts = ref.split("/")
        if len(parts) == 5 and parts[2] != "exec":  # refs/exps/ab/cdef.../name
            found.append(Experiment(parts[-1], ref, commit))
    return sorted(found, key=lambda e: e.name)


def remote_refs(root: Path, remote: str) -> dict[str, str] | None:
    """ref -> commit of the experiments the git remote holds; None when it cannot be read."""
    done = _git(root, "ls-remote", remote, "refs/exps/*")
    if done.returncode != 0:
        return None
    return {ref: commit for commit, ref in (line.split("\t") for line in done.stdout.splitlines())}


def push(root: Path, remote: str, dvc_remote: str) -> tuple[bool, str]:
    """`dvc exp push`: every experiment's ref to the git remote and its outputs to the bucket."""
    cmd = ["dvc", "exp", "push", remote, "--all-commits", "-r", dvc_remote]
    done = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    return done.returncode == 0, redaction.redact_text(done.stdout + done.stderr)


def check_experiments(
    root: Path,
    target: GitTarget,
    dvc_remote: str | None,
    where: str,
    write: bool,
    stopped: bool = False,
) -> tuple[list[Finding], list[dict[str, object]]]:
    """Push (when `write` and not `stopped` by a secret in what git would push) and verify
    every experiment; findings and a summary for the notes."""
    found = experiments(root)
    if not found:
        return [Finding(True, "experiments: none on this node (`dvc exp list -A`)")], []
    names = ", ".join(e.name for e in found)
    remote = target.remote
    if remote is None:
        push_all = f"`dvc exp push <git remote> --all-commits -r {dvc_remote or '<dvc remote>'}`"
        return [
            Finding(
                False,
                f"{len(found)} experiments ({names}) exist only on this node: no git remote to "
                "push their refs to" + (f" ({target.why})" if target.others else ""),
                f"{target.fix}, then `draftline salvage` again (it runs {push_all})",
            )
        ], [_summary(e, False, None) for e in found]
    findings: list[Finding] = []
    retry = f"`dvc exp push {remote} --all-commits -r {dvc_remote or '<dvc remote>'}`"
    if write and dvc_remote and not stopped:
        ok, output = push(root, remote, dvc_remote)
        if not ok:
            tail = " | ".join(output.strip().splitlines()[-3:])[:500]
            findings.append(Finding(False, f"{retry} failed: {tail}", "fix the cause, run again"))
    held = remote_refs(root, remote)
    summaries = []
    for exp in found:
        pushed = held is not None and held.get(exp.ref) == exp.commit
        missing = _missing_outputs(root, exp, dvc_remote) if dvc_remote else None
        summaries.append(_summary(exp, pushed, missing))
        if pushed and missing == []:
            findings.append(
                Finding(
                    True,
                    f"experiment {exp.name} ({exp.commit[:7]}): ref in {remote}, "
                    f"outputs in {where}",
                )  # fmt: skip
            )
            continue
        lacks = [] if pushed else [f"its ref is not in git remote {remote}"]
        if missing is None:
            lacks.append(f"its outputs could not be checked in {where or 'a DVC remote'}")
        elif missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if missing[5:] else ""
            )
            lacks.append(f"{len(missing)} outputs not in {where}: {shown}")
        if stopped:
            fix = "remove the secret named above, then `draftline salvage` again"
        elif write:
            fix = f"{retry} (or `dvc exp push {remote} {exp.name} -r ...`) and salvage again"
        else:
            fix = f"run `draftline salvage` (it runs {retry})"
        findings.append(
            Finding(
                False,
                f"experiment {exp.name} ({exp.commit[:7]}) is only on this node: "
                + "; ".join(lacks),
                fix,
                label="WOULD BE LOST",
            )
        )
    return findings, summaries


def _missing_outputs(root: Path, exp: Experiment, dvc_remote: str) -> list[str] | None:
    """Outputs of the experiment's dvc.lock the bucket lacks or holds corrupted."""
    text = _git(root, "show", f"{exp.commit}:dvc.lock")
    if text.returncode != 0:
        return None
    try:
        v = verify_remote(root, dvc_remote, outputs=lock_outputs(text.stdout, f"{exp.name}:"))
    except Exception:  # unreachable remote: reported as not checked
        return None
    return sorted({o.path for o in v.missing} | {o.path for o in v.nowhere} | {
        o.path for o, _ in v.corrupted})  # fmt: skip


def _summary(exp: Experiment, pushed: bool, missing: list[str] | None) -> dict[str, object]:
    return {
        "name": exp.name,
        "ref": exp.ref,
        "commit": exp.commit,
        "ref_pushed": pushed,
        "outputs_missing": missing,
        "restore": f"dvc exp pull origin {exp.name} && dvc exp apply {exp.name} && dvc pull",
    }
