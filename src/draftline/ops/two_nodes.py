"""Two nodes on one run: one generates (`draftline lead`), the other trains on each shard as it
arrives (`draftline follow`), through the DVC remote and a shared git origin.

Who owns what: the generating node runs curate, generate@K and generate_eval; the training
node runs every other stage and never generation (it waits). Each stage is run with DVC
(`dvc repro --single-item`), so `dvc.lock` records it as a sequential `dvc repro` would.

How they never fight over git: each node commits to its own branch of the origin,
`generate/RUN` and `train/RUN`. The follower reads the generator's `dvc.lock` from its
branch, copies the entries of the generator's stages into its own lock verbatim, takes their
git-tracked outputs from that branch and their cached outputs from the DVC remote, then runs
its own stages. Its lock is therefore a superset of the generator's; at the end it checks
that every generator entry is the same in both and records the generator's branch as merged
(`git merge -s ours`: the follower's tree already holds all of it). No textual merge of
`dvc.lock` ever happens.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

LOCK = "dvc.lock"
EVENTS = Path("logs/runs/two_nodes")  # per node: which stage ran when (JSON lines, untracked)


class StageFailed(SystemExit):
    """A stage failed: the run stops, its output names why."""


def run(root: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if check and done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise StageFailed(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}")
    return done


def generation_stages(shard_ids: Iterable[int]) -> list[str]:
    """The generating node's stages, in the order it runs them."""
    return ["curate", *(f"generate@{k}" for k in shard_ids), "generate_eval"]


def shard_stages(shard: int) -> list[str]:
    """The training node's stages for one shard, in order."""
    return [f"validate_shard@{shard}", f"extract@{shard}", f"train_shard@{shard}"]


FINAL_STAGES = ["validate", "train", "evaluate"]


def uncached_outs(root: Path, stages: Iterable[str]) -> list[str]:
    """Outputs of `stages` that git tracks (cache: false), which travel by git, not DVC."""
    from dvc.repo import Repo

    wanted = set(stages)
    with Repo(str(root)) as repo:
        return [
            out.def_path
            for stage in repo.index.stages
            if stage.addressing in wanted
            for out in stage.outs
            if not out.use_cache
        ]


def read_lock(text: str | None) -> dict[str, Any]:
    return (yaml.safe_load(text) or {}).get("stages", {}) if text else {}


@dataclass
class Node:
    """One clone of the run: where it is, its branches and how it reports."""

    root: Path
    run_name: str
    out: Callable[[str], None] = print
    remote: str = "origin"
    role: str = "generate"

    @property
    def generate_branch(self) -> str:
        return f"generate/{self.run_name}"

    @property
    def train_branch(self) -> str:
        return f"train/{self.run_name}"

    def say(self, text: str) -> None:
        self.out(f"[{datetime.now(UTC):%H:%M:%S}] {text}")

    def stage(self, name: str) -> None:
        """Run one stage with DVC, recording when (a stage already up to date takes seconds)."""
        began = time.time()
        self.say(f"{name}: running")
        done = run(self.root, "dvc", "repro", "--single-item", name, check=False)
        ended = time.time()
        event = {"stage": name, "start": began, "end": ended, "rc": done.returncode}
        path = self.root / EVENTS / f"{self.role}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
        if done.returncode:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise StageFailed(f"{name} failed; the run stops here:\n{tail}")
        self.say(f"{name}: done in {ended - began:.0f} s")

    def publish(self, stages: list[str], branch: str, message: str) -> None:
        """Push the stages' cached outputs to the DVC remote, then commit the lock and their
        git-tracked outputs and push them to this node's branch."""
        run(self.root, "dvc", "push", *stages)
        paths = [LOCK, "params.yaml", *uncached_outs(self.root, stages)]
        present = [p for p in paths if (self.root / p).exists()]
        run(self.root, "git", "add", "--", *present)
        staged = run(self.root, "git", "diff", "--cached", "--quiet", check=False)
        if staged.returncode:
            run(self.root, "git", "commit", "-q", "-m", message)
        run(self.root, "git", "push", "-q", self.remote, f"HEAD:refs/heads/{branch}")


# ---------------------------------------------------------------------------------------------
# The generating node


def lead(node: Node, shard_ids: list[int]) -> int:
    """Run the generation stages in order, pushing each as it finishes: a node lost mid-run
    loses at most the shard in flight, which its journal resumes on the next `lead`."""
    node.role = "generate"
    for name in generation_stages(shard_ids):
        node.stage(name)
        node.publish([name], node.generate_branch, f"{name}: generated ({node.run_name})")
        node.say(f"{name}: pushed (outputs to the DVC remote, lock to {node.generate_branch})")
    node.say(f"generation done: every stage is on {node.generate_branch}; this node may go")
    return 0


# ---------------------------------------------------------------------------------------------
# The training node


def follow(node: Node, shard_ids: list[int], poll_s: float = 30.0) -> int:
    """Train on each shard as the generating node pushes it, until the drafter is evaluated.
    A rerun after a crash skips what DVC already recorded and resumes a link from its working
    checkpoint. Never runs a generation stage: it waits for it, saying what for."""
    node.role = "train"
    wanted = generation_stages(shard_ids)
    adopted: set[str] = set()
    position = 0  # index of the next shard whose stages run here
    last_wait = ""
    while True:
        ref = _fetch(node)
        if ref is not None:
            lock = read_lock(_show(node, ref, LOCK))
            new = [s for s in wanted if s in lock and s not in adopted]
            if new:
                adopt(node, ref, lock, new)
                adopted.update(new)
        while position < len(shard_ids) and {"curate", f"generate@{shard_ids[position]}"} <= (
            adopted
        ):
            shard = shard_ids[position]
            for name in shard_stages(shard):
                node.stage(name)
            node.publish(shard_stages(shard), node.train_branch, f"shard {shard}: trained its link")
            position += 1
        if position == len(shard_ids) and set(wanted) <= adopted:
            for name in FINAL_STAGES:
                node.stage(name)
            node.publish(FINAL_STAGES, node.train_branch, "the drafter: trained and evaluated")
            merge_generation(node, ref)
            node.say(f"done: the whole run is on {node.train_branch}")
            return 0
        waiting = next(s for s in wanted if s not in adopted)
        if waiting != last_wait:
            arrived = sum(1 for k in shard_ids if f"generate@{k}" in adopted)
            node.say(
                f"waiting for {waiting} from {node.generate_branch} ({arrived} of "
                f"{len(shard_ids)} shards in; looking every {poll_s:g} s)"
            )
            last_wait = waiting
        time.sleep(poll_s)


def _fetch(node: Node) -> str | None:
    """Fetch the generator's branch; the ref to read it at, or None while it does not exist."""
    ref = f"refs/remotes/{node.remote}/{node.generate_branch}"
    done = run(
        node.root,
        "git", "fetch", "-q", node.remote, f"+refs/heads/{node.generate_branch}:{ref}",
        check=False,
    )  # fmt: skip
    return ref if done.returncode == 0 else None


def _show(node: Node, ref: str, path: str) -> str | None:
    done = run(node.root, "git", "show", f"{ref}:{path}", check=False)
    return done.stdout if done.returncode == 0 else None


def _what(params: dict[str, Any]) -> dict[str, Any]:
    """Params that decide results, as dotted keys one level deep (`drafter.lr`): everything
    but the hardware profile (how, never what)."""
    return {
        f"{group}.{key}" if isinstance(values, dict) else group: value
        for group, values in params.items()
        if group != "hardware"
        for key, value in (values.items() if isinstance(values, dict) else [(None, values)])
    }


def adopt(node: Node, ref: str, lock: dict[str, Any], names: list[str]) -> None:
    """Take the generator's finished stages as they are: their lock entries, their git-tracked
    outputs from its branch, their cached outputs from the DVC remote; then check DVC sees
    them up to date here (same code, same params)."""
    theirs = _what(yaml.safe_load(_show(node, ref, "params.yaml") or "{}") or {})
    ours = _what(yaml.safe_load((node.root / "params.yaml").read_text(encoding="utf-8")) or {})
    if theirs != ours:
        differ = [k for k in sorted({*theirs, *ours}) if theirs.get(k) != ours.get(k)]
        raise StageFailed(
            f"the generating node's params.yaml differs from this node's in {', '.join(differ)}"
            ": compose the same model, data and drafter on both (only hardware may differ)"
        )
    from dvc.utils.serialize import modify_yaml

    with modify_yaml(node.root / LOCK) as data:
        data.setdefault("schema", "2.0")
        stages = data.setdefault("stages", {})
        for name in names:
            stages[name] = lock[name]
    tracked = [p for p in uncached_outs(node.root, names) if _show(node, ref, p) is not None]
    if tracked:
        run(node.root, "git", "checkout", ref, "--", *tracked)
    run(node.root, "dvc", "pull", "-q", *names)
    checkable = [n for n in names if n != "curate"]  # curate's raw sources may live only there
    if checkable:
        status = json.loads(
            run(node.root, "dvc", "status", "--json", *checkable).stdout.strip() or "{}"
        )
        if status:
            raise StageFailed(
                f"{', '.join(sorted(status))} differ here from what the generating node ran "
                f"({json.dumps(status)[:300]}): both nodes must run the same commit of the code"
            )
    node.say(f"took {', '.join(names)} from {node.generate_branch}")


def merge_generation(node: Node, ref: str | None) -> None:
    """Record the generator's branch as merged, once every entry it wrote is the same here."""
    if ref is None:
        return
    theirs = read_lock(_show(node, ref, LOCK))
    ours = read_lock((node.root / LOCK).read_text(encoding="utf-8"))
    differ = [name for name, entry in theirs.items() if ours.get(name) != entry]
    if differ:
        raise StageFailed(
            f"{', '.join(differ)} differ between {node.generate_branch} and this node's lock: "
            "not merged; compare the two branches' dvc.lock"
        )
    run(node.root, "git", "merge", "-q", "-s", "ours", "--no-edit", ref)
    run(node.root, "git", "push", "-q", node.remote, f"HEAD:refs/heads/{node.train_branch}")
