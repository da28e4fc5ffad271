"""Pipeline runs shared by the whole test session.

A `dvc repro` of the embedded default takes minutes on 2 cores, so it runs once per session and
every test that only reads its outputs reuses it. Under pytest-xdist the first worker that asks
runs it and the others wait on a file lock, so it still runs once. Tests that change the run
(compose other params, push, commit, rerun stages) work on a copy (`copy_run`), and tests that
change nothing but the params file restore it; all of them sit in one xdist group, so none
sees another's temporary change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Outputs of an earlier run in the source checkout must not leak into the copy.
NOT_COPIED = ("dvc.lock", "metrics/", "plots/", "dvclive/")
ENV = {
    **os.environ,
    "DVC_NO_ANALYTICS": "1",
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
}  # fmt: skip


def run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0]
    done = subprocess.run([exe, *cmd[1:]], cwd=cwd, env=ENV, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def copy_project(dest: Path, as_committed: bool = False) -> Path:
    """This checkout's tracked and untracked (not ignored) files, as a fresh git repository;
    with `as_committed`, the earlier run's dvc.lock, metrics and plots too, as a clone has."""
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
        text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    for rel in listed:
        kept = rel.endswith(".gitkeep")  # folders declared in dvc.yaml (metrics/bench)
        left_out = rel.startswith(NOT_COPIED) and not kept and not as_committed
        if left_out or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    run(["git", "init", "-q"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "copy"], dest)
    return dest


def ran_stages(out: str) -> list[str]:
    return [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]


@dataclass(frozen=True)
class SharedRun:
    repo: Path
    stdout: str
    # dvc.lock and metrics/ as the run left them, safe to read from any worker while the tests
    # of the run's group rerun stages in it.
    snapshot: Path

    @property
    def lock(self) -> Path:
        return self.snapshot / "dvc.lock"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every xdist worker of this session sees (each has its own basetemp below)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    prepare: Callable[[Path], None],
    base: Callable[[], SharedRun] | None = None,
) -> SharedRun:
    """`dvc repro` in a copy of this project (or of the run `base` gives, its DVC cache
    included, so only what `prepare` changes runs again), once per session across workers.

    `prepare` composes what the run needs before it starts. A failed run is recorded too, so
    every test that needs it fails with the run's own output instead of running it again.
    """
    root = session_root(tmp_path_factory)
    source = base() if base else None  # before this run's lock: the base takes its own
    repo, record = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            shutil.rmtree(repo, ignore_errors=True)
            if source:
                copy_run(source, repo)
            else:
                copy_project(repo)
            prepare(repo)
            done = run(["dvc", "repro"], repo, check=False)
            result = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            if done.returncode == 0:
                snapshot = root / f"{name}.snapshot"
                shutil.rmtree(snapshot, ignore_errors=True)
                shutil.copytree(repo / "metrics", snapshot / "metrics")
                shutil.copy2(repo / "dvc.lock", snapshot / "dvc.lock")
            record.write_text(json.dumps(result), encoding="utf-8")
    result = json.loads(record.read_text(encoding="utf-8"))
    assert result["rc"] == 0, (
        f"dvc repro ({name}):\n{result['stdout'][-3000:]}\n" + result["stderr"][-3000:]
    )
    return SharedRun(repo, result["stdout"], root / f"{name}.snapshot")


def copy_run(run_: SharedRun, dest: Path) -> Path:
    """A private copy of a shared run (workspace, git history, DVC cache) to change freely."""
    shutil.copytree(run_.repo, dest, symlinks=True)
    return dest


# The session's run of the embedded default trains 2 epochs, not the committed 20: the first
# shard by shard in the links, the second over every shard in the last stage. Every stage runs
# the same code either way, the data stages' outputs are the committed ones byte for byte (no
# drafter setting reaches them), and the last stage trains 19 steps instead of 343: most of the
# run's minutes.
SHORT_EPOCHS = 2
SHORT_COMMIT = f"embedded default: {SHORT_EPOCHS} epochs"


def embedded_default(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """The embedded default as `dvc repro` runs it from a fresh clone, with the drafter's epochs
    set to SHORT_EPOCHS in conf/ and composed (so that `draftline compose` and `dvc exp run -S`
    in the run keep them) and committed (so that salvage finds no change to save)."""

    def short_schedule(repo: Path) -> None:
        defaults = yaml.safe_load((repo / "conf/config.yaml").read_text())["defaults"]
        name = next(d["drafter"] for d in defaults if isinstance(d, dict) and "drafter" in d)
        conf = repo / "conf/drafter" / f"{name}.yaml"
        text = conf.read_text(encoding="utf-8")
        short = re.sub(r"(?m)^epochs: \d+$", f"epochs: {SHORT_EPOCHS}", text)
        assert short != text, f"no `epochs:` line in {conf}"
        conf.write_text(short, encoding="utf-8")
        run(["draftline", "compose"], repo)
        run(["git", "commit", "-qam", SHORT_COMMIT], repo)

    return shared_run(tmp_path_factory, f"embedded-default-{SHORT_EPOCHS}-epochs", short_schedule)


def committed_schedule(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """The embedded default on its committed schedule (20 epochs), for the tests that compare
    this session's tau with the committed one: the 2-epoch run with its schedule commit
    reverted, so `dvc repro` trains and evaluates again over the data stages it already has.
    Its own fixture, whatever else the session selects."""

    def committed(repo: Path) -> None:
        subject = run(["git", "log", "-1", "--format=%s"], repo).stdout.strip()
        assert subject == SHORT_COMMIT, subject
        run(["git", "revert", "--no-edit", "HEAD"], repo)

    return shared_run(
        tmp_path_factory,
        "embedded-default",
        committed,
        base=lambda: embedded_default(tmp_path_factory),
    )


def qwen36_twin(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """The Qwen3.6 twin (models/tiny-qwen36) through every stage, with online features as the
    27B profile trains (the frozen twin, hybrid layers and VL checkpoint, runs inside every
    training step; the embedded default's run covers offline features). The drafter trains 4
    epochs, not the embedded default's 20: the twin's tests ask that it learns (tau at least
    1.5 x untrained; 20 epochs reach ~6.7), and every stage runs the same code either way."""

    def compose(repo: Path) -> None:
        overrides = ["model=tiny_qwen36", "extract.features=online", "drafter.epochs=4"]
        run(["draftline", "compose", *overrides], repo)

    return shared_run(tmp_path_factory, "qwen36-twin", compose)
