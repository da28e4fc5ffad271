"""Refuse to run a stage on inputs that DVC did not restore (the `--allow-missing` hazard).

`dvc repro --allow-missing` skips every stage whose only change is missing data, and does not
pull the outputs of the stages it skips. In a fresh clone the finished upstream stages are
skipped; with `--pull`, DVC pulls only the inputs of the stages it runs that do not exist at
all. A folder that holds outputs of several stages (`validate` reads every `generate@K` from
`data/generated/train`) exists as soon as one of them ran here, so the stage after them would
run on a partial folder. So before a stage command started by DVC does anything else, every
declared dependency that is an output of an upstream stage (the same path, a file or folder
inside that output, or a folder holding outputs of several stages) must exist and hash to what
`dvc.lock` recorded for that stage. Otherwise the stage exits 1 naming the fix:
`dvc pull <upstream stages>` or `dvc repro --pull`.

Hashes come from DVC itself with its state database, so files DVC has just hashed are not read
again. Only stages run by DVC are checked ($DVC_STAGE is set); `DRAFTLINE_INPUT_GUARD=0` turns
the check off for one run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_SWITCH = "DRAFTLINE_INPUT_GUARD"
RESUME = "dvc repro --pull"


@dataclass(frozen=True)
class Problem:
    """One input that the stage must not read as it is."""

    path: str  # workspace path, relative to the repository root
    upstream: str  # the stage whose output it is
    why: str  # "missing", "not in dvc.lock" or "does not match dvc.lock"


def check_from_env() -> None:
    """The hook for stage entry points: check the stage DVC is running, or do nothing."""
    stage = os.environ.get("DVC_STAGE")
    if not stage or os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no"):
        return
    root = Path(os.environ.get("DVC_ROOT") or ".")
    problems = check_stage(root, stage)
    if problems:
        raise SystemExit(refusal(stage, problems))


def check_stage(root: Path, stage_name: str) -> list[Problem]:
    """Problems with the upstream outputs that stage `stage_name` depends on."""
    from dvc.repo import Repo

    # $DVC_STAGE is `name` for dvc.yaml at the root, else `path/to/dvc.yaml:name`.
    where, _, name = stage_name.rpartition(":")
    dvcfile = (root / (where or "dvc.yaml")).resolve()
    with Repo(str(root)) as repo:
        graph = repo.index.graph
        found = [s for s in graph if s.name == name and Path(s.path).resolve() == dvcfile]
        if not found:
            print(f"{stage_name}: not a stage of {dvcfile}: inputs not checked", file=sys.stderr)
            return []
        upstream = list(graph.successors(found[0]))
        problems: list[Problem] = []
        seen: set[tuple[str, str]] = set()
        for dep in found[0].deps:
            for parent in upstream:
                for out in parent.outs:
                    key = (str(dep), str(out))
                    if key in seen:
                        continue
                    seen.add(key)
                    problem = _check(repo, dep, _address(parent, root), out)
                    if problem is not None:
                        problems.append(problem)
    return problems


def _address(stage: Any, root: Path) -> str:
    """How `dvc` names the stage from the repository root (`name` or `dir/dvc.yaml:name`)."""
    dvcfile = os.path.relpath(stage.path, root.resolve())
    return stage.name if dvcfile == "dvc.yaml" else f"{dvcfile}:{stage.name}"


def _check(repo: Any, dep: Any, upstream: str, out: Any) -> Problem | None:
    dep_path, out_path = str(dep.fs_path), str(out.fs_path)
    if dep_path == out_path or _inside(out_path, dep_path):
        # The dependency is that output, or a folder holding it: check the whole output.
        rel = os.path.relpath(out_path, repo.root_dir)
        if not out.hash_info:
            return Problem(rel, upstream, "not in dvc.lock")
        if not out.fs.exists(out_path):
            return Problem(rel, upstream, "missing")
        if _current_hash(repo, out, out_path) != out.hash_info.value:
            return Problem(rel, upstream, "does not match dvc.lock")
        return None
    if _inside(dep_path, out_path):
        # A file or folder inside a directory output: compare with its manifest entry.
        rel = os.path.relpath(dep_path, repo.root_dir)
        if not out.hash_info:
            return Problem(rel, upstream, "not in dvc.lock")
        if not out.fs.exists(dep_path):
            return Problem(rel, upstream, "missing")
        recorded = out.get_obj(filter_info=dep_path)
        if recorded is None:  # manifest not in the local cache: existence is all we can tell
            return None
        if _current_hash(repo, out, dep_path) != recorded.hash_info.value:
            return Problem(rel, upstream, "does not match dvc.lock")
    return None


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def _current_hash(repo: Any, out: Any, path: str) -> str | None:
    """DVC's hash of `path` as `out` would record it, without writing to the cache."""
    from dvc_data.hashfile.build import build

    odb = out.cache if out.use_cache else out.local_cache
    _, _, obj = build(odb, path, out.fs, out.hash_name, ignore=out.dvcignore, dry_run=True)
    return obj.hash_info.value if obj.hash_info else None


def refusal(stage: str, problems: list[Problem]) -> str:
    """The message a refused stage exits with: what is wrong and the commands that fix it."""
    lines = [f"{stage}: refusing to run on inputs that do not match dvc.lock:"]
    lines += [f"  {p.path} (output of {p.upstream}): {p.why}" for p in problems]

    def owners(why: str) -> str:
        return " ".join(sorted({p.upstream for p in problems if p.why == why}))

    if missing := owners("missing"):
        lines.append(
            f"fix: `dvc pull {missing}`, or `{RESUME}`, which pulls every finished stage; "
            "never `--allow-missing` on a fresh clone: it skips the stages whose outputs are "
            "missing, and this stage would run without them"
        )
    if changed := owners("does not match dvc.lock"):
        lines.append(
            f"fix: `dvc checkout --force {changed}` (or `dvc pull --force {changed}`) restores "
            f"what dvc.lock recorded; plain `dvc repro` reruns {changed} if the change is wanted"
        )
    if unfinished := owners("not in dvc.lock"):
        lines.append(f"fix: run the upstream stages first: `dvc repro {unfinished}`")
    return "\n".join(lines)
