"""Salvage saves every experiment and a commit a fresh clone reproduces.

The embedded default (the session's shared `dvc repro`) on a node with a bare git origin and a
moto S3 bucket; two short `dvc exp run -S drafter...` experiments (the last one applied to the
workspace, as `dvc exp run` does). Salvage pushes their refs and outputs and commits the
workspace's params.yaml with its dvc.lock; a second clone restores each experiment's drafter
and the salvaged workspace without running a stage. Real git, DVC and S3 endpoint; slow
(two short trainings), so everything shares one node.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.embedded_run import copy_run, embedded_default
from helpers.s3_server import S3Server
from helpers.tiny_pipeline import base_env, run, salvage

pytestmark = pytest.mark.xdist_group("embedded-default")
# Two short trainings: one epoch at two learning rates, each evaluated on 8 held-out prompts of
# 32 new tokens. Only the training chain and evaluate rerun: a drafter setting that reaches the
# data stages (drafter.max_length cuts extract's sequences and what validate judges) would rerun
# the four validate and extract shards too: ~45 s of CPU for nothing salvage sees.
SHORT = ["drafter.epochs=1", "evaluate.max_prompts=8", "evaluate.max_new_tokens=32"]
EXPERIMENTS = {"ep-one": SHORT, "ep-two": [*SHORT, "drafter.lr=0.001"]}
DRAFTER = "models/drafter"


def point_at(repo: Path, env: dict[str, str], server: S3Server, bucket: str) -> None:
    run(["dvc", "remote", "modify", "--local", "s3", "url", f"s3://{bucket}/dvc"], repo, env)
    run(["dvc", "remote", "modify", "--local", "s3", "endpointurl", server.endpoint], repo, env)


@pytest.fixture(scope="module")
def story(tmp_path_factory, server: S3Server) -> dict:
    shared = embedded_default(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("experiments")
    env = base_env(tmp, server)
    bucket = f"exp-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    node = copy_run(shared, tmp / "node")
    point_at(node, env, server, bucket)
    run(["git", "add", "-A"], node, env)
    run(["git", "commit", "-qm", "workspace run"], node, env)
    for name, overrides in EXPERIMENTS.items():
        sets = [arg for o in overrides for arg in ("-S", o)]
        run(["dvc", "exp", "run", "-n", name, *sets], node, env, timeout=1800)
    refs = run(["git", "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps/"], node,
               env).stdout.split("\n")  # fmt: skip
    locks = {
        ref.rsplit("/", 1)[1]: run(["git", "show", f"{sha}:dvc.lock"], node, env).stdout
        for sha, ref in (line.split(" ") for line in refs if line)
    }

    no_origin = salvage(node, env, "--dry-run")  # no git remote yet: experiments cannot leave
    origin = tmp / "origin.git"
    run(["git", "init", "-q", "--bare", str(origin)], tmp, env)
    run(["git", "remote", "add", "origin", str(origin)], node, env)
    dry = salvage(node, env, "--dry-run")
    done = salvage(node, env, timeout=900)
    return {"tmp": tmp, "env": env, "node": node, "origin": origin, "bucket": bucket,
            "locks": locks, "no_origin": no_origin, "dry": dry, "done": done}  # fmt: skip


def test_experiments_unsaved_without_a_git_remote_are_not_safe(story: dict) -> None:
    out = story["no_origin"].stdout
    assert story["no_origin"].returncode == 1, out
    assert "2 experiments (ep-one, ep-two) exist only on this node: no git remote" in out
    assert "git remote add origin URL" in out and "VERDICT (dry run" in out
    dry = story["dry"].stdout
    assert "experiment ep-one" in dry and "WOULD BE LOST" in dry and story["dry"].returncode == 1


def test_salvage_pushes_every_experiment_and_a_consistent_commit(story: dict) -> None:
    done, node, env = story["done"], story["node"], story["env"]
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for name in EXPERIMENTS:
        assert f"SAFE      experiment {name} (" in out
    assert "params.yaml holds the params dvc.lock recorded" in out
    # dvc exp run rewrote params.yaml (ep-two's): committed with the lock it was run with.
    committed = run(["git", "show", "HEAD:params.yaml"], node, env).stdout
    assert yaml.safe_load(committed)["drafter"]["lr"] == 0.001
    assert run(["git", "status", "--porcelain"], node, env).stdout == ""
    notes = run(["git", "show", "--stat", "HEAD"], node, env).stdout
    assert "salvage.json" in notes and "params.yaml" in notes


def test_a_second_clone_restores_every_experiment_without_running(story: dict, server) -> None:
    tmp, env = story["tmp"], story["env"]
    clone = tmp / "clone"
    run(["git", "clone", "-q", str(story["origin"]), str(clone)], tmp, env)
    point_at(clone, env, server, story["bucket"])
    restored = []
    for name in EXPERIMENTS:
        run(["dvc", "exp", "pull", "origin", name], clone, env, timeout=600)
        run(["dvc", "exp", "apply", name], clone, env)
        run(["dvc", "pull"], clone, env, timeout=600)
        status = run(["dvc", "status"], clone, env).stdout
        dry = run(["dvc", "repro", "--dry"], clone, env).stdout
        lock = (clone / "dvc.lock").read_text()
        assert lock == story["locks"][name]
        assert "up to date" in status and "Running stage" not in dry, status + dry
        drafter = yaml.safe_load((clone / "params.yaml").read_text())["drafter"]
        assert drafter["lr"] == (0.001 if name == "ep-two" else 3.0e-3)
        assert (clone / DRAFTER).is_dir()
        restored.append(name)
    # The salvaged workspace itself: the commit on origin's branch.
    run(["git", "checkout", "-q", "--", "."], clone, env)
    run(["dvc", "checkout"], clone, env)
    assert "Running stage" not in run(["dvc", "repro", "--dry"], clone, env).stdout
    print(f"experiments restored on a second clone: {len(restored)} of {len(EXPERIMENTS)}")
    assert restored == list(EXPERIMENTS)
    shutil.rmtree(clone)
