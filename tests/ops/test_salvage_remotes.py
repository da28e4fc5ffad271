"""Where salvage's git pushes go and what they may carry: real git (bare remotes in tmp
dirs), real `dvc repro` / `dvc exp run` subprocesses and a real S3 endpoint (moto).

Code, experiments and tags go to the remote the branch tracks, which the report names; no
other remote gets anything. A run log's secret reaches no pushed file, and an experiment name
or an unpushed commit message in the shape of a secret stops every git push of the run.
"""

from __future__ import annotations

import json
import random
import string
import subprocess
from pathlib import Path

import pytest
from helpers.s3_server import S3Server
from helpers.tiny_pipeline import (
    base_env,
    clone_node,
    copy_node,
    make_origin,
    run,
    salvage,
)


def _random(n: int) -> str:
    rng = random.SystemRandom()
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, server: S3Server) -> Path:
    """A clone of origin with `prepare` run; `dvc exp run` without Hydra (no conf/ here).
    Built once per module."""
    tmp = tmp_path_factory.mktemp("prepared")
    env = base_env(tmp, server)
    node = clone_node(make_origin(tmp, env), tmp / "node", env, server, "unused")
    run(["dvc", "config", "--local", "hydra.enabled", "false"], node, env)
    run(["dvc", "repro", "prepare"], node, env)
    return node


@pytest.fixture
def node(
    prepared: Path, tmp_path: Path, env: dict[str, str], server: S3Server, bucket: str
) -> Path:
    """A copy of `prepared` and its origin in this test's folder, on its own bucket."""
    return copy_node(prepared, tmp_path, env, server, bucket)


def refs(repo: Path, env: dict[str, str]) -> dict[str, str]:
    """ref -> object of a bare repository."""
    out = run(["git", "ls-remote", str(repo)], repo.parent, env).stdout
    return {ref: sha for sha, ref in (line.split("\t") for line in out.splitlines())}


def every_object(repo: Path) -> str:
    """The text of every object of a repository: what a clone of it can read."""
    done = subprocess.run(
        ["git", "cat-file", "--batch-all-objects", "--batch"], cwd=repo, capture_output=True,
        check=True,
    )  # fmt: skip
    return done.stdout.decode("utf-8", errors="replace")


def exp_ref(node: Path, env: dict[str, str], name: str) -> tuple[str, str]:
    out = run(["git", "for-each-ref", "--format=%(refname) %(objectname)", "refs/exps/"],
              node, env).stdout  # fmt: skip
    ref, sha = next(line.split() for line in out.splitlines() if line.split()[0].endswith(name))
    return ref, sha


def test_code_experiments_and_tags_go_to_the_remote_the_branch_tracks(
    node: Path, env: dict[str, str], tmp_path: Path, bucket: str
) -> None:
    """main tracks `lab`, origin is there too: the commit, the experiment's ref and the tag go
    to lab, the report names lab, and origin is left exactly as it was."""
    origin, lab = tmp_path / "origin.git", tmp_path / "lab.git"
    run(["git", "init", "-q", "--bare", str(lab)], tmp_path, env)
    run(["git", "remote", "add", "lab", str(lab)], node, env)
    run(["git", "push", "-q", "-u", "lab", "main"], node, env)
    run(["git", "commit", "-q", "--allow-empty", "-m", "lab-only change"], node, env)
    run(["git", "tag", "-a", "lab-v1", "-m", "first lab run"], node, env)
    run(["dvc", "exp", "run", "-n", "lab-exp", "prepare"], node, env)
    ref, exp_sha = exp_ref(node, env, "lab-exp")
    origin_before = refs(origin, env)

    dry = salvage(node, env, "--dry-run")
    assert "SAFE      git: the salvage commit would be pushed to lab (the upstream of main)" in (
        dry.stdout
    )
    done = salvage(node, env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    head = run(["git", "rev-parse", "HEAD"], node, env).stdout.strip()
    lines = out.splitlines()
    assert (
        "SAFE      git remote lab (the upstream of main) holds this run's commits, experiments "
        "and tags; salvage pushes nothing to origin" in lines
    )
    assert f"SAFE      git: {head[:7]} with tags lab-v1 pushed to lab (the upstream of main)" in (
        lines
    )
    assert (
        f"SAFE      experiment lab-exp ({exp_sha[:7]}): ref in lab, outputs in s3://{bucket}/dvc"
        in lines
    )
    assert "pushed to origin" not in out and "ref in origin" not in out

    held = refs(lab, env)
    assert held["refs/heads/main"] == head and held[ref] == exp_sha
    assert "refs/tags/lab-v1" in held
    subject = run(["git", "--git-dir", str(lab), "log", "-1", "--format=%s", "main"], tmp_path,
                  env).stdout  # fmt: skip
    assert subject.startswith("salvage: dvc.lock and notes from")
    assert refs(origin, env) == origin_before


def test_with_several_remotes_and_none_tracked_salvage_pushes_nowhere_until_told(
    node: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """Remotes `a` and `b`, main tracks neither, none is origin: nothing is pushed and the fix
    is named; with `a` the only remote, the push goes there and main tracks it from then on."""
    a, b = tmp_path / "origin.git", tmp_path / "b.git"
    run(["git", "init", "-q", "--bare", str(b)], tmp_path, env)
    run(["git", "remote", "rename", "origin", "a"], node, env)
    run(["git", "branch", "--unset-upstream"], node, env)
    run(["git", "remote", "add", "b", str(b)], node, env)
    before = refs(a, env)

    done = salvage(node, env)
    assert done.returncode == 1, done.stdout + done.stderr
    rev = run(["git", "rev-parse", "--short", "HEAD"], node, env).stdout.strip()
    lines = done.stdout.splitlines()
    assert (
        f"NOT SAFE  branch main tracks none of the git remotes a, b and none is origin: commit "
        f"{rev} is only on this node" in lines
    )
    assert "`git push -u <remote> HEAD` to the remote that should hold this run" in done.stdout
    assert refs(a, env) == before and refs(b, env) == {}

    run(["git", "remote", "remove", "b"], node, env)
    again = salvage(node, env)
    assert again.returncode == 0, again.stdout + again.stderr
    head = run(["git", "rev-parse", "HEAD"], node, env).stdout.strip()
    assert (
        f"SAFE      git: {head[:7]} pushed to a (branch main tracks no remote; the only one)"
        in again.stdout.splitlines()
    )
    assert refs(a, env)["refs/heads/main"] == head
    assert run(["git", "config", "branch.main.remote"], node, env).stdout.strip() == "a"


def test_a_run_log_token_reaches_no_pushed_file(
    node: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """`"auth_header": "Token <hex>"` in logs/runs/*.json and a token in a report's free text:
    salvage.json keeps the other fields, and no object of origin holds either token."""
    token, other = _random(8).lower() + "9f8e7d6c5b4a39281706f5e4d3c2b1a0", _random(32)
    runs = node / "logs" / "runs"
    runs.mkdir(parents=True)
    (runs / "train.json").write_text(
        json.dumps({"stage": "train", "auth_header": f"Token {token}", "loss": 1.25})
    )
    (node / "reports").mkdir()  # a stage's output in the project: git does not track it
    (node / ".git" / "info" / "exclude").write_text("reports/\n")
    (node / "reports" / "serve.json").write_text(
        json.dumps({"note": f"endpoint answered with Token {other}", "tokens_per_s": 812.5})
    )
    done = salvage(node, env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out

    pushed = every_object(tmp_path / "origin.git")
    clone = tmp_path / "check"
    run(["git", "clone", "-q", str(tmp_path / "origin.git"), str(clone)], tmp_path, env)
    notes = json.loads(next(clone.glob("notes/salvage/*/salvage.json")).read_text())
    assert notes["metrics"]["logs/runs/train.json"] == {
        "stage": "train", "auth_header": "***", "loss": 1.25,
    }  # fmt: skip
    assert notes["metrics"]["reports/serve.json"] == {
        "note": "endpoint answered with Token ***", "tokens_per_s": 812.5,
    }  # fmt: skip
    for secret in (token, other):
        assert secret not in pushed and secret not in out


def test_a_secret_experiment_name_stops_the_push_and_the_fix_it_names_works(
    node: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """`sk-live-...` as an experiment name would be a ref on the remote: nothing is pushed,
    one finding names the experiment by its commit, and renaming it as told makes it SAFE."""
    origin = tmp_path / "origin.git"
    name = f"sk-live-{_random(28)}"
    run(["dvc", "exp", "run", "-n", name, "prepare"], node, env)
    _, exp_sha = exp_ref(node, env, name)
    before = refs(origin, env)

    done = salvage(node, env)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    found = [line for line in out.splitlines() if "has a secret in its name" in line]
    assert found == [
        f"NOT SAFE  experiment *** (commit {exp_sha[:7]}) has a secret in its name: salvage "
        "pushes nothing to git remote origin"
    ]
    assert (
        f"dvc exp rename <its name> <new name>` (`git for-each-ref --points-at {exp_sha[:7]}" in out
    )
    assert "the git push to origin is stopped" in out and "VERDICT: NOT SAFE" in out
    assert refs(origin, env) == before
    assert name not in out and name not in every_object(origin)
    assert all(name not in p.read_text() for p in (node / "notes").rglob("*") if p.is_file())

    points = [
        "git",
        "for-each-ref",
        "--points-at",
        exp_sha[:7],
        "--format=%(refname)",
        "refs/exps/",
    ]
    run(["dvc", "exp", "rename", run(points, node, env).stdout.strip(), "ep-renamed"], node, env)
    again = salvage(node, env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"SAFE      experiment ep-renamed ({exp_sha[:7]}): ref in origin" in again.stdout
    assert exp_sha in refs(origin, env).values() and name not in every_object(origin)


def test_a_secret_in_an_unpushed_commit_message_stops_the_push(
    node: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """Two local commits whose messages hold an `hf_` and a `ghp_` token: one finding each,
    by short sha and redacted subject; origin gets nothing, the output no token."""
    origin = tmp_path / "origin.git"
    hf, gh = f"hf_{_random(34)}", f"ghp_{_random(36)}"
    shas = []
    for message in (f"upload with {hf}", f"ci: clone with {gh} for now"):
        run(["git", "commit", "-q", "--allow-empty", "-m", message], node, env)
        shas.append(run(["git", "rev-parse", "--short", "HEAD"], node, env).stdout.strip())
    before = refs(origin, env)

    done = salvage(node, env)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    found = [line for line in out.splitlines() if "has a secret in its message" in line]
    assert found == [
        f'NOT SAFE  commit {shas[1]} ("ci: clone with *** for now") has a secret in its message: '
        "salvage pushes nothing to git remote origin",
        f'NOT SAFE  commit {shas[0]} ("upload with ***") has a secret in its message: salvage '
        "pushes nothing to git remote origin",
    ]
    assert f"`git rebase -i {shas[0]}^` and mark it `reword`" in out
    assert "the git push to origin is stopped" in out
    assert refs(origin, env) == before
    pushed = every_object(origin)
    for secret in (hf, gh):
        assert secret not in out and secret not in pushed
