"""Resuming on a new node: two clones of this project sharing one S3 endpoint (moto's
ThreadedMotoServer on 127.0.0.1), the real pipeline through real `dvc` subprocesses.

Node A runs curate and 2 of the 4 generate shards, then `draftline salvage` (push to S3,
commit dvc.lock and the stage metrics, push git to a bare origin). Node B is a fresh clone of
that origin and first makes the `--allow-missing` mistake: plain `--allow-missing` starts
generate@2 without its curated input, and `--pull --allow-missing` runs the two missing shards
(DVC pulls the inputs of stages it runs) and then starts validate on a folder without the
shards A finished; the input guard refuses both before they read anything. `dvc repro --pull`
then restores what A finished and runs only validate. No stage runs twice anywhere, and the
result equals one uninterrupted run: the committed dvc.lock and metrics of the embedded default
(what a fresh `dvc repro` records on any processor: tests/test_pipeline.py checks the session's
own run against them).

The story runs once (module fixture, about a minute on CPU) and its tests stay on one xdist
worker, so it is not run again on another; the tests read its record.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers.embedded_run import ROOT, copy_project, ran_stages
from helpers.s3_server import S3Server
from helpers.tiny_pipeline import base_env, clone_node, run, salvage

pytestmark = pytest.mark.xdist_group("new-node")

SHARDS = [f"generate@{k}" for k in range(4)]
# Outputs whose bytes do not depend on timing (reports/ hold GX run times): the ones an
# interrupted run must reproduce exactly.
DETERMINISTIC = (
    "data/curated",
    *(f"data/generated/train/shard-{k}.parquet" for k in range(4)),
    "data/validated/verdict.json",
)
# One generation batch per shard: hardware keys change how, never what (outputs are equal).
BATCH_SIZE = 96


@dataclass
class Story:
    tmp: Path
    env: dict[str, str]
    server: S3Server
    bucket: str
    origin: Path
    node_a: Path
    node_b: Path
    a_repro: subprocess.CompletedProcess[str]
    a_salvage: subprocess.CompletedProcess[str]
    b_allow_missing: subprocess.CompletedProcess[str]
    b_pull_allow_missing: subprocess.CompletedProcess[str]
    b_repro: subprocess.CompletedProcess[str]


def dvc(node: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run(["dvc", *args], node, env, check=False, timeout=900)


def output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def make_seed(tmp: Path) -> Path:
    """This project as a fresh git repository (no outputs of earlier runs), batch size raised."""
    seed = tmp / "seed"
    seed.mkdir()
    copy_project(seed)
    params = yaml.safe_load((seed / "params.yaml").read_text())
    params["hardware"]["local"] = {
        **(params["hardware"].get("local") or {}),
        "batch_size": BATCH_SIZE,
    }
    (seed / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "commit", "-qam", "batch size"], cwd=seed, check=True,
                   capture_output=True)  # fmt: skip
    return seed


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    """Slow (~1 min, once per module): node A runs curate and two generate shards and salvages
    them, node B clones, pulls and finishes the pipeline: the story every test here reads."""
    tmp = tmp_path_factory.mktemp("new-node")
    server = S3Server()
    server.start()
    try:
        bucket = f"new-node-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        env = base_env(tmp, server)
        seed = make_seed(tmp)
        origin = tmp / "origin.git"
        run(["git", "clone", "-q", "--bare", str(seed), str(origin)], tmp, env)

        node_a = clone_node(origin, tmp / "node-a", env, server, bucket)
        a_repro = dvc(node_a, env, "repro", "curate", "generate@0", "generate@1")
        assert a_repro.returncode == 0, output(a_repro)
        a_salvage = salvage(node_a, env, timeout=900)

        node_b = clone_node(origin, tmp / "node-b", env, server, bucket)
        b_allow_missing = dvc(node_b, env, "repro", "--allow-missing", "validate")
        b_pull_allow_missing = dvc(node_b, env, "repro", "--pull", "--allow-missing", "validate")
        b_repro = dvc(node_b, env, "repro", "--pull", "validate")
        shutil.rmtree(seed)
        yield Story(
            tmp, env, server, bucket, origin, node_a, node_b,
            a_repro, a_salvage, b_allow_missing, b_pull_allow_missing, b_repro,
        )  # fmt: skip
    finally:
        server.stop()


def lock_stages(node: Path) -> dict[str, dict]:
    return yaml.safe_load((node / "dvc.lock").read_text())["stages"]


def recorded_hashes(node: Path) -> dict[str, str]:
    """Workspace path -> md5 of every output dvc.lock records."""
    return {
        out["path"]: out["md5"]
        for stage in lock_stages(node).values()
        for out in stage.get("outs", [])
    }


def test_node_a_salvage_pushes_two_of_four_shards_and_commits_lock_and_metrics(
    story: Story,
) -> None:
    assert set(ran_stages(story.a_repro.stdout)) == {"curate", "generate@0", "generate@1"}
    out = output(story.a_salvage)
    assert story.a_salvage.returncode == 0, out
    assert "VERDICT: SAFE" in out
    assert "curate, generate@0, generate@1" in out
    keys = set(story.server.keys(story.bucket))
    for path in ("data/curated", "data/generated/train/shard-0.parquet",
                 "data/generated/train/shard-1.parquet"):  # fmt: skip
        md5 = recorded_hashes(story.node_a)[path]
        assert f"dvc/files/md5/{md5[:2]}/{md5[2:]}" in keys, path
    assert any(k.startswith("dvc/runs/") for k in keys)
    # What git carries reached origin: the lock and the cache: false metrics of finished stages.
    pushed = run(["git", "ls-tree", "-r", "--name-only", "HEAD"], story.origin, story.env).stdout
    for path in ("dvc.lock", "metrics/curate.json"):
        assert path in pushed.splitlines(), path
    lock = yaml.safe_load(run(["git", "show", "HEAD:dvc.lock"], story.origin, story.env).stdout)
    assert {"generate@0", "generate@1"} <= set(lock["stages"])
    assert "generate@2" not in lock["stages"]


def test_allow_missing_without_pull_fails_before_running_anything(story: Story) -> None:
    # DVC skips curate and the finished shards (outputs missing, nothing else changed) and
    # then cannot hash the curated input of generate@2 or generate@3 (whichever DVC reaches
    # first: the two are independent), which was never restored: nothing runs.
    done = story.b_allow_missing
    assert done.returncode != 0, output(done)
    assert ran_stages(done.stdout) == []
    assert re.search(r"data/curated/train/shard-[23]\.parquet", output(done)), output(done)


def test_pull_with_allow_missing_runs_the_missing_shards_and_refuses_a_partial_validate(
    story: Story,
) -> None:
    # With --pull, DVC pulls the inputs of the stages it runs (the two missing shards are real
    # work), but not the outputs of the stages it skips: validate would see 2 of 4 shards.
    done = story.b_pull_allow_missing
    out = output(done)
    assert done.returncode != 0, out
    ran = ran_stages(done.stdout)  # the two shards in DVC's graph order, then validate
    assert sorted(ran[:-1]) == ["generate@2", "generate@3"] and ran[-1] == "validate", ran
    assert "validate: refusing to run on inputs that do not match dvc.lock" in out
    for k in (0, 1):
        assert f"data/generated/train/shard-{k}.parquet (output of generate@{k}): missing" in out
    assert "`dvc pull generate@0 generate@1`" in out
    assert "checks on" not in out  # refused before the GX suite, not failed by it


def test_repro_pull_restores_what_a_finished_and_runs_only_the_rest(story: Story) -> None:
    out = output(story.b_repro)
    assert story.b_repro.returncode == 0, out
    assert ran_stages(story.b_repro.stdout) == ["validate"]
    for stage in ("curate", "generate@0", "generate@1"):
        assert f"Pulling data for stage: '{stage}'" in out, out
    # Across node A and node B every stage ran exactly once.
    runs = [
        *ran_stages(story.a_repro.stdout),
        *ran_stages(story.b_pull_allow_missing.stdout)[:-1],  # validate was refused there
        *ran_stages(story.b_repro.stdout),
    ]
    assert sorted(runs) == sorted(["curate", *SHARDS, "validate"])
    # The finished stages came from S3, not from a rerun (`runs` above); curate's metrics are
    # node A's, byte for byte (generate keeps no git-carried metrics, only logs/runs/).
    assert (story.node_b / "metrics/curate.json").read_bytes() == (
        story.node_a / "metrics/curate.json"
    ).read_bytes()
    assert set(lock_stages(story.node_b)) == {"curate", *SHARDS, "validate"}
    assert "up to date" in dvc(story.node_b, story.env, "status", "validate").stdout


def test_the_resumed_result_equals_one_uninterrupted_run(story: Story) -> None:
    """Node B's result against one uninterrupted `dvc repro` of the same project, as committed
    (another local batch size: hardware changes how, never what)."""
    resumed = recorded_hashes(story.node_b)
    uninterrupted = {
        out["path"]: out["md5"]
        for stage in yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"].values()
        for out in stage.get("outs", [])
    }
    for path in DETERMINISTIC:
        assert resumed[path] == uninterrupted[path], path
    shard_files = sorted(p.name for p in (story.node_b / "data/generated/train").iterdir())
    assert shard_files == [f"shard-{k}.parquet" for k in range(4)]
    b_metrics = json.loads((story.node_b / "metrics/validate.json").read_text())
    ref_metrics = json.loads((ROOT / "metrics/validate.json").read_text())
    assert b_metrics == ref_metrics
    assert b_metrics["num_samples"] == sum(
        json.loads((story.node_b / "data/curated/summary.json").read_text())["shard_rows"].values()
    )


def replace_tail(path: Path) -> bytes:
    """Overwrite the last bytes of `path` (a new file: it may be a link into the cache)."""
    recorded = path.read_bytes()
    path.unlink()
    path.write_bytes(recorded[:-100] + b"\0" * 100)
    return recorded


def test_changed_and_unfinished_inputs_are_refused_and_checkout_restores(story: Story) -> None:
    """On node A (curate and 2 of 4 shards done): a shard and a curated file edited."""
    node, env = story.node_a, story.env
    shard = node / "data/generated/train/shard-1.parquet"
    curated = node / "data/curated/train/shard-2.parquet"
    recorded = {shard: replace_tail(shard), curated: replace_tail(curated)}

    done = dvc(node, env, "repro", "--single-item", "validate")
    out = output(done)
    assert done.returncode != 0, out
    assert "Running stage 'validate'" in out  # DVC started it; the guard refused
    assert "validate: refusing to run" in out
    assert "data/generated/train/shard-1.parquet (output of generate@1): does not match" in out
    assert "`dvc checkout --force generate@1`" in out
    for k in (2, 3):
        assert f"data/generated/train/shard-{k}.parquet (output of generate@{k}): not in" in out
    assert "`dvc repro generate@2 generate@3`" in out
    assert not (node / "metrics/validate.json").exists()

    # A file inside a directory output is compared with that output's manifest entry.
    done = dvc(node, env, "repro", "--single-item", "generate@2")
    out = output(done)
    assert done.returncode != 0, out
    assert "data/curated/train/shard-2.parquet (output of curate): does not match" in out
    assert not (node / "data/generated/train/shard-2.parquet").exists()

    fixed = dvc(node, env, "checkout", "--force", "generate@1", "curate")
    assert fixed.returncode == 0, output(fixed)
    for path, content in recorded.items():
        assert path.read_bytes() == content
    status = dvc(node, env, "status", "curate", "generate@0", "generate@1")
    assert "up to date" in status.stdout, output(status)


def test_the_guard_checks_only_stages_dvc_runs_and_can_be_switched_off(
    story: Story, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftline.runtime import stage_inputs

    monkeypatch.setenv("DVC_ROOT", str(story.node_a))
    monkeypatch.setenv("DVC_STAGE", "validate")  # shards 2 and 3 are not in A's dvc.lock
    with pytest.raises(SystemExit, match="generate@2 generate@3"):
        stage_inputs.check_from_env()
    monkeypatch.setenv(stage_inputs.ENV_SWITCH, "0")
    stage_inputs.check_from_env()
    monkeypatch.delenv(stage_inputs.ENV_SWITCH)
    monkeypatch.delenv("DVC_STAGE")  # `draftline validate` typed by hand: not a DVC run
    stage_inputs.check_from_env()
