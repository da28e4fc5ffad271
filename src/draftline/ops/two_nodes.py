"""Two nodes on one run: one generates (`draftline lead`), the other trains on each shard as it
arrives (`draftline follow`), through the DVC remote and a shared git origin.

Who owns what: the generating node runs curate, generate@K and generate_eval; the training
node runs every other stage and never generation (it waits). Both read which is which, and in
what order, from their dvc.yaml (`runtime.pipeline_shape`). Each stage is run with DVC
(`dvc repro --single-item`), so `dvc.lock` records it as a sequential `dvc repro` would.

How they never fight over git: each node commits to its own branch of the origin,
`generate/RUN` and `train/RUN`. The follower reads the generator's `dvc.lock` from its
branch, copies the entries of the generator's stages into its own lock verbatim, takes their
git-tracked outputs from that branch and their cached outputs from the DVC remote, then runs
its own stages. Its lock is therefore a superset of the generator's; at the end it checks
that every generator entry is the same in both and records the generator's branch as merged
(`git merge -s ours`: the follower's tree already holds all of it). No textual merge of
`dvc.lock` ever happens.

Which entries: both nodes are clones of a commit whose `dvc.lock` may already list every stage
(an earlier run, another composition). Only the stages the generator ran in this run count,
and it says which in `RECORD` on its branch (rewritten at each start and after each stage, with
the params it runs on). The follower takes and compares those entries only, checks the
generator's params against its own at every look, so a restart on other weights stops it before
it trains a row of them, and claims the run first (`run_claim`): one follower per run. Every
call that reaches a remote rides out an outage for `retry_s` seconds (`retrying`).
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

from draftline.ops import run_claim
from draftline.ops.retrying import DEFAULT_BUDGET_S, run_retrying
from draftline.runtime import pipeline_shape

LOCK = "dvc.lock"
EVENTS = Path("logs/runs/two_nodes")  # per node: which stage ran when (JSON lines, untracked)
# On the generator's branch only: the stages it ran in this run (tracked, so that it travels
# with the lock it describes, in the same commit).
RECORD = "reports/lead.json"


class StageFailed(SystemExit):
    """A stage failed: the run stops, its output names why."""


def run(root: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if check and done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise StageFailed(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}")
    return done


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
    retry_s: float = DEFAULT_BUDGET_S  # how long a remote may stay unreachable

    @property
    def generate_branch(self) -> str:
        return f"generate/{self.run_name}"

    @property
    def train_branch(self) -> str:
        return f"train/{self.run_name}"

    @property
    def shape(self) -> pipeline_shape.PipelineShape:
        """The stages of this clone's dvc.yaml, which node runs which, in what order."""
        return pipeline_shape.read(self.root / "dvc.yaml")

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

    @property
    def rerun(self) -> str:
        return f"draftline {'lead' if self.role == 'generate' else 'follow'} --run {self.run_name}"

    def remote_call(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """A command that reaches a remote, retried through an outage; fails on a final no."""
        done = run_retrying(
            self.root, list(cmd), budget_s=self.retry_s, say=self.say, rerun=self.rerun
        )
        if done.returncode:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
            raise StageFailed(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}")
        return done

    def publish(
        self, stages: list[str], branch: str, message: str, extra: tuple[str, ...] = ()
    ) -> None:
        """Push the stages' cached outputs to the DVC remote, then commit the lock and their
        git-tracked outputs and push them to this node's branch."""
        if stages:
            self.remote_call("dvc", "push", *stages)
        paths = [LOCK, "params.yaml", *extra, *uncached_outs(self.root, stages)]
        present = [p for p in paths if (self.root / p).exists()]
        run(self.root, "git", "add", "--", *present)
        staged = run(self.root, "git", "diff", "--cached", "--quiet", check=False)
        if staged.returncode:
            run(self.root, "git", "commit", "-q", "-m", message)
        self.remote_call("git", "push", "-q", self.remote, f"HEAD:refs/heads/{branch}")


# ---------------------------------------------------------------------------------------------
# The generating node


def lead(node: Node, shard_ids: list[int]) -> int:
    """Run the generation stages in order, pushing each as it finishes: a node lost mid-run
    loses at most the shard in flight, which its journal resumes on the next `lead`.

    At each start the record of what ran is emptied and pushed with the params first, so a
    follower sees a restart on other params at once; a stage already recorded by DVC reruns in
    seconds and is listed again."""
    node.role = "generate"
    ran: list[str] = []
    write_record(node, ran)
    node.publish([], node.generate_branch, f"lead started ({node.run_name})", extra=(RECORD,))
    for name in node.shape.generation_stages(shard_ids):
        node.stage(name)
        ran.append(name)
        write_record(node, ran)
        node.publish(
            [name], node.generate_branch, f"{name}: generated ({node.run_name})", extra=(RECORD,)
        )
        node.say(f"{name}: pushed (outputs to the DVC remote, lock to {node.generate_branch})")
    node.say(f"generation done: every stage is on {node.generate_branch}; this node may go")
    return 0


def write_record(node: Node, ran: list[str]) -> None:
    record = {"run": node.run_name, "stages": ran}
    path = node.root / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def read_record(text: str | None) -> list[str]:
    """The stages the generator ran in this run, from its branch (none before it started)."""
    if not text:
        return []
    try:
        return [str(s) for s in json.loads(text).get("stages") or []]
    except (json.JSONDecodeError, AttributeError):
        return []


# ---------------------------------------------------------------------------------------------
# The training node


def follow(node: Node, shard_ids: list[int], poll_s: float = 30.0, take_over: bool = False) -> int:
    """Train on each shard as the generating node pushes it, until the drafter is evaluated.
    A rerun after a crash skips what DVC already recorded and resumes a link from its working
    checkpoint. Never runs a generation stage: it waits for it, saying what for."""
    node.role = "train"
    node.say(run_claim.claim(node.root, node.remote, node.run_name, take_over=take_over))
    shape = node.shape
    wanted = shape.generation_stages(shard_ids)
    adopted: set[str] = set()
    position = 0  # index of the next shard whose stages run here
    last_wait = ""
    while True:
        ref = _fetch(node)
        if ref is not None:
            check_params(node, ref)  # at every look: a restart on other params stops us here
            ran = read_record(_show(node, ref, RECORD))
            lock = read_lock(_show(node, ref, LOCK))
            new = [s for s in wanted if s in ran and s in lock and s not in adopted]
            if new:
                adopt(node, ref, lock, new)
                adopted.update(new)
        while position < len(shard_ids) and set(shape.generated_for(shard_ids[position])) <= (
            adopted
        ):
            shard = shard_ids[position]
            for name in shape.shard_stages(shard):
                node.stage(name)
            node.publish(
                shape.shard_stages(shard), node.train_branch, f"shard {shard}: trained its link"
            )
            position += 1
        if position == len(shard_ids) and set(wanted) <= adopted:
            for name in shape.final_stages:
                node.stage(name)
            node.publish(
                shape.final_stages, node.train_branch, "the drafter: trained and evaluated"
            )
            merge_generation(node, ref)
            node.say(f"done: the whole run is on {node.train_branch}")
            return 0
        waiting = next(s for s in wanted if s not in adopted)
        if waiting != last_wait:
            arrived = sum(1 for k in shard_ids if f"{pipeline_shape.GENERATE}@{k}" in adopted)
            node.say(
                f"waiting for {waiting} from {node.generate_branch} ({arrived} of "
                f"{len(shard_ids)} shards in; looking every {poll_s:g} s)"
            )
            last_wait = waiting
        time.sleep(poll_s)


def _fetch(node: Node) -> str | None:
    """Fetch the generator's branch; the ref to read it at, or None while it does not exist."""
    ref = f"refs/remotes/{node.remote}/{node.generate_branch}"
    done = run_retrying(
        node.root,
        ["git", "fetch", "-q", node.remote, f"+refs/heads/{node.generate_branch}:{ref}"],
        budget_s=node.retry_s, say=node.say, rerun=node.rerun,
    )  # fmt: skip
    if done.returncode == 0:
        return ref
    if "couldn't find remote ref" in done.stderr:
        return None  # the generator has not pushed yet
    raise StageFailed(f"cannot read {node.generate_branch}: {done.stderr.strip()[-500:]}")


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


def check_params(node: Node, ref: str) -> None:
    """Stop when the generator's params (all but hardware) differ from this node's."""
    theirs = _what(yaml.safe_load(_show(node, ref, "params.yaml") or "{}") or {})
    ours = _what(yaml.safe_load((node.root / "params.yaml").read_text(encoding="utf-8")) or {})
    if theirs != ours:
        differ = [k for k in sorted({*theirs, *ours}) if theirs.get(k) != ours.get(k)]
        raise StageFailed(
            f"the generating node's params.yaml differs from this node's in {', '.join(differ)}"
            ": compose the same model, data and drafter on both (only hardware may differ)"
        )


def adopt(node: Node, ref: str, lock: dict[str, Any], names: list[str]) -> None:
    """Take the generator's finished stages as they are: their lock entries, their git-tracked
    outputs from its branch, their cached outputs from the DVC remote; then check DVC sees
    them up to date here (same code, same params)."""
    from dvc.utils.serialize import modify_yaml

    with modify_yaml(node.root / LOCK) as data:
        data.setdefault("schema", "2.0")
        stages = data.setdefault("stages", {})
        for name in names:
            stages[name] = lock[name]
    tracked = [p for p in uncached_outs(node.root, names) if _show(node, ref, p) is not None]
    if tracked:
        run(node.root, "git", "checkout", ref, "--", *tracked)
    node.remote_call("dvc", "pull", "-q", *names)
    # What generation depends on (curate) reads raw sources that may live only on that node.
    upstream = {s.name for s in node.shape.before_generation}
    checkable = [n for n in names if n not in upstream]
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
    """Record the generator's branch as merged, once every entry it wrote in this run is the
    same here (entries the commit carried from earlier runs are no part of it)."""
    if ref is None:
        return
    ran = read_record(_show(node, ref, RECORD))
    theirs = read_lock(_show(node, ref, LOCK))
    ours = read_lock((node.root / LOCK).read_text(encoding="utf-8"))
    differ = [name for name in ran if ours.get(name) != theirs.get(name)]
    if differ:
        raise StageFailed(
            f"{', '.join(differ)} differ between {node.generate_branch} and this node's lock: "
            "not merged; compare the two branches' dvc.lock"
        )
    run(node.root, "git", "merge", "-q", "-s", "ours", "--no-edit", ref)
    node.remote_call("git", "push", "-q", node.remote, f"HEAD:refs/heads/{node.train_branch}")
