"""The whole pipeline through real `dvc` subprocesses, in a throwaway copy of this repository.

Every stage runs on the embedded default (tiny target, bundled prompts) on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# Outputs of an earlier run in the source checkout must not leak into the copy.
NOT_COPIED = ("dvc.lock", "metrics/", "plots/", "dvclive/")
ENV = {
    **os.environ,
    "DVC_NO_ANALYTICS": "1",
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
}  # fmt: skip
BIN = Path(sys.executable).parent


def run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0]
    done = subprocess.run([exe, *cmd[1:]], cwd=cwd, env=ENV, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def copy_project(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
        text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    for rel in listed:
        if rel.startswith(NOT_COPIED) or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    run(["git", "init", "-q"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "copy"], dest)
    return dest


def ran_stages(out: str) -> list[str]:
    return [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    repo = copy_project(tmp_path_factory.mktemp("pipeline"))
    done = run(["dvc", "repro"], repo)
    return repo, done.stdout


def test_repro_runs_every_stage_and_a_second_run_does_nothing(finished):
    repo, out = finished
    assert set(ran_stages(out)) == {
        "curate", "generate@0", "generate@1", "generate@2", "generate@3", "generate_eval",
        "validate", "extract", "train", "evaluate",
    }  # fmt: skip
    verdict = json.loads((repo / "metrics/validate.json").read_text())
    assert verdict["passed"] is True
    ev = json.loads((repo / "metrics/evaluate.json").read_text())
    assert ev["tau"] >= 1.0 and ev["tau_untrained"] >= 1.0
    assert (repo / "models/drafter/config.json").is_file()
    again = run(["dvc", "repro"], repo)
    assert ran_stages(again.stdout) == []


def test_no_stage_depends_on_hardware_so_switching_profile_invalidates_nothing(finished):
    repo, _ = finished
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    for name, stage in lock["stages"].items():
        for params in (stage.get("params") or {}).values():
            assert not any(key.startswith("hardware") for key in params), name
    for profile in ("b200x8", "pro6000x4"):
        run(["draftline", "compose", f"hardware={profile}"], repo)
        status = run(["dvc", "status"], repo)
        assert "up to date" in status.stdout, (profile, status.stdout)
    run(["draftline", "compose"], repo)


def test_exp_show_lists_stage_metrics(finished):
    repo, _ = finished
    shown = run(["dvc", "exp", "show", "--json"], repo).stdout
    assert "rows_kept" in shown and "tau" in shown


def test_plan_uses_the_runs_own_metrics_and_not_for_another_target(finished):
    """Every stage records the model, data and drafter it ran on: `draftline plan` (params.yaml)
    takes the run's measured figures, and a plan for another target takes none of them."""
    repo, _ = finished
    plan = json.loads(run(["draftline", "plan", "--json"], repo).stdout)
    assert plan["notes"] == []
    assert plan["inputs"]["samples"]["kind"] == "measured"
    cpu = plan["profiles"]["cpu"]["throughput"]
    assert {cpu[k]["kind"] for k in ("generate_tok_s", "extract_tok_s", "train_tok_s")} == {
        "measured"
    }
    other = json.loads(run(["draftline", "plan", "model=qwen3_8b", "--json"], repo).stdout)
    assert other["inputs"]["samples"]["kind"] == "estimate"
    assert len(other["notes"]) == 4 + 1 + len(
        yaml.safe_load((repo / "params.yaml").read_text())["data"]["shard_ids"]
    )  # curate, validate, extract, train; the eval shard and each train shard


def test_exp_run_with_another_hardware_profile_composes_and_reruns_nothing(finished):
    """`dvc exp run -S hardware=b200x8` composes params.yaml through DVC's Hydra integration;
    every stage is cached (hardware is no stage's param), and the experiment lists the metrics."""
    repo, _ = finished
    try:
        done = run(["dvc", "exp", "run", "-S", "hardware=b200x8", "--name", "b200"], repo)
        assert ran_stages(done.stdout) == []
        params = yaml.safe_load((repo / "params.yaml").read_text())
        assert params["hardware"]["name"] == "b200x8"
        assert params["hardware"]["sglang"]["dp_size"] == 8
        rows = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
        exps = {
            rev["name"]: rev["data"]
            for row in rows
            for exp in row.get("experiments") or []
            for rev in exp["revs"]
        }
        data = exps["b200"]
        assert data["params"]["params.yaml"]["data"]["hardware"]["name"] == "b200x8"
        curate = data["metrics"]["metrics/curate.json"]["data"]
        assert (
            curate["rows_kept"]
            == json.loads((repo / "metrics/curate.json").read_text())["rows_kept"]
        )
        assert "metrics/evaluate.json" in data["metrics"]
    finally:
        run(["git", "checkout", "params.yaml"], repo)


def test_six_new_tokens_stop_the_pipeline_at_validate(tmp_path):
    """The seed's pathology end to end: tiny answers pass generation (guard off, as when the
    guard's window is not yet full) and validate refuses them; extract never runs."""
    repo = copy_project(tmp_path)
    run(["draftline", "compose", "generate.max_new_tokens=6", "generate.guard=false"], repo)
    done = run(["dvc", "repro"], repo, check=False)
    assert done.returncode != 0
    stages = ran_stages(done.stdout)
    assert "validate" in stages and "extract" not in stages and "train" not in stages
    metrics = json.loads((repo / "metrics/validate.json").read_text())
    assert metrics["passed"] is False
    assert not (repo / "data/validated/verdict.json").exists()
    assert not (repo / "data/extracted").exists()


# The Qwen3.6 twin (models/tiny-qwen36): the production target's layout in miniature, end to end.
ALL_STAGES = {
    "curate", "generate@0", "generate@1", "generate@2", "generate@3", "generate_eval",
    "validate", "extract", "train", "evaluate",
}  # fmt: skip


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    repo = copy_project(tmp_path_factory.mktemp("twin"))
    run(["draftline", "compose", "model=tiny_qwen36"], repo)
    done = run(["dvc", "repro"], repo)
    return repo, done.stdout


def test_the_qwen36_twin_runs_every_stage_and_the_drafter_learns(twin):
    repo, out = twin
    assert set(ran_stages(out)) == ALL_STAGES
    assert json.loads((repo / "metrics/validate.json").read_text())["passed"] is True
    ev = json.loads((repo / "metrics/evaluate.json").read_text())
    assert ev["tau"] >= 1.5 * ev["tau_untrained"], ev
    config = json.loads((repo / "models/drafter/config.json").read_text())
    mask = yaml.safe_load((repo / "conf/model/tiny_qwen36.yaml").read_text())["mask_token_id"]
    assert config["dflash_config"]["mask_token_id"] == mask
    shown = run(["dvc", "exp", "show", "--json"], repo).stdout
    assert "tau_ratio" in shown


def test_every_file_dvclive_writes_is_a_declared_output_of_train(tmp_path, repo_root):
    """An undeclared file is neither pushed by DVC nor committed by salvage: dvclive's summary
    `metrics.json` left every fresh run NOT SAFE. Train's own dvclive call, in a scratch dir."""
    from draftline.stages import train as train_stage
    from draftline.training import Metrics

    parser = argparse.ArgumentParser()
    train_stage.add_arguments(parser)
    live = parser.parse_args([]).live  # where `draftline train` (the stage's cmd) writes
    Metrics(tmp_path / live, [{"loss": 1.0, "acc_pos/1": 0.5}], enabled=True).close()
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert f"{live}/metrics.json" in written

    stage = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]["train"]
    declared = [
        next(iter(out)) if isinstance(out, dict) else out
        for kind in ("outs", "metrics", "plots")
        for out in stage.get(kind) or []
    ]
    for path in written:
        assert any(path == out or path.startswith(out + "/") for out in declared), path


def test_salvage_after_a_fresh_repro_is_safe(finished, tmp_path):
    """Every file a fresh `dvc repro` writes is an output: DVC pushes it or salvage commits it
    (dvclive's summary `dvclive/train/metrics.json` once was neither: NOT SAFE forever)."""
    repo, _ = finished
    origin = tmp_path / "origin.git"
    run(["git", "init", "-q", "--bare", str(origin)], tmp_path)
    run(["git", "remote", "add", "origin", str(origin)], repo)
    remote_dir = str(tmp_path / "dvc-remote")
    run(["dvc", "remote", "modify", "--local", "local", "url", remote_dir], repo)
    done = run(["draftline", "salvage", "--remote", "local"], repo, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: SAFE" in done.stdout
    assert run(["git", "status", "--porcelain"], repo).stdout == ""
