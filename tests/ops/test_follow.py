"""`draftline lead` and `draftline follow` on a stand-in pipeline: the real dvc.yaml's stages
(curate, generate@k, generate_eval, validate, validate_shard@k, extract@k, train_shard@k, train,
evaluate: names, order and which run per shard read from it by `pipeline_shape`) with trivial
commands and files, so the two-node protocol (real git origin, real DVC, moto's S3 server as the
remote) runs in seconds. The real stages are in test_two_nodes.py.
The stand-in's generation refuses to run on the training node (a marker file there), so a
follower that ever generated would fail. Both nodes clone a commit whose dvc.lock lists every
stage from an earlier run on other data, as a clone of main does.
The earlier run, and a lead finished before its follower starts, are made once per module;
each test works on copies of them (git origin, bucket) of its own."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.s3_server import S3Server
from helpers.tiny_pipeline import base_env, clone_node, run

from draftline.ops.retrying import FIRST_PAUSE_S
from draftline.runtime import pipeline_shape

SHARDS = 3

STEP = """\
import os, sys, time
stage, *rest = sys.argv[1:]
k = rest[0] if rest else None
def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").write(text)
if stage == "curate":
    lines = open("source.txt").read().split()
    for i in range({shards}):
        write(f"data/curated/shard-{{i}}.txt", lines[i] + "\\n")
    write("reports/curate.json", '{{"rows": %d}}\\n' % len(lines))
elif stage in ("generate", "generate_eval"):
    if os.path.exists(".training-node"):
        sys.exit("generation ran on the training node")
    time.sleep(float(os.environ.get("STEP_PACE_S", "0")))
    if stage == "generate":
        write(f"data/generated/shard-{{k}}.txt", open(f"data/curated/shard-{{k}}.txt").read() * 2)
    else:
        write("data/generated/eval.txt", "eval\\n")
elif stage == "validate_shard":
    text = open(f"data/generated/shard-{{k}}.txt").read()
    if "BAD" in text:
        sys.exit(f"shard {{k}}: empty responses (87% of rows)")
    write(f"data/validated/shard-{{k}}.txt", "passed\\n")
elif stage == "extract":
    write(f"data/extracted/shard-{{k}}.txt", open(f"data/generated/shard-{{k}}.txt").read().upper())
elif stage == "train_shard":
    write(f"models/chain/shard-{{k}}.txt", open(f"data/extracted/shard-{{k}}.txt").read())
elif stage == "validate":
    write("data/validated/all.txt", "passed\\n")
elif stage == "train":
    chain = sorted(c for c in os.listdir("models/chain") if c.endswith(".txt"))
    write("models/drafter.txt", "".join(open("models/chain/" + c).read() for c in chain))
elif stage == "evaluate":
    write("metrics/evaluate.json", '{{"tau": 2.0}}\\n')
"""

# What each stand-in stage reads and writes (`${item}`: its shard), beside step.py. The stage
# names, their order and which run once per shard are the real dvc.yaml's (`pipeline_shape`).
STAND_IN: dict[str, dict[str, list]] = {
    "curate": {
        "deps": ["source.txt"],
        "params": ["data.num_shards"],
        "outs": ["data/curated", {"reports/curate.json": {"cache": False}}],
    },
    "generate": {
        "deps": ["data/curated/shard-${item}.txt"],
        "outs": ["data/generated/shard-${item}.txt"],
    },
    "generate_eval": {"deps": ["data/curated"], "outs": ["data/generated/eval.txt"]},
    "validate": {"deps": ["data/generated"], "outs": ["data/validated/all.txt"]},
    "validate_shard": {
        "deps": ["data/generated/shard-${item}.txt"],
        "outs": ["data/validated/shard-${item}.txt"],
    },
    "extract": {
        "deps": ["data/generated/shard-${item}.txt", "data/validated/shard-${item}.txt"],
        "outs": ["data/extracted/shard-${item}.txt"],
    },
    "train_shard": {
        "deps": ["data/extracted/shard-${item}.txt"],
        "outs": ["models/chain/shard-${item}.txt"],
    },
    "train": {"deps": ["models/chain", "data/validated/all.txt"], "outs": ["models/drafter.txt"]},
    "evaluate": {
        "deps": ["models/drafter.txt"],
        "outs": [{"metrics/evaluate.json": {"cache": False}}],
    },
}


def stand_in_pipeline() -> str:
    """The stand-in's dvc.yaml: the real pipeline's stages, in its order, each a step.py call."""
    shape = pipeline_shape.read()
    assert set(STAND_IN) == set(shape.names), "give every stage of dvc.yaml a stand-in here"
    stages: dict[str, dict] = {}
    for stage in shape.stages:
        item = " ${item}" if stage.per_shard else ""
        spec = STAND_IN[stage.name]
        body = {
            "cmd": f"python step.py {stage.name}{item}",
            **spec,
            "deps": ["step.py", *spec["deps"]],
        }
        stages[stage.name] = (
            {"foreach": "${data.shard_ids}", "do": body} if stage.per_shard else body
        )
    return yaml.safe_dump({"stages": stages}, sort_keys=False)


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory, server: S3Server) -> Path:
    """The stand-in pipeline in a fresh repository after an earlier run on other data (every
    stage in dvc.lock), not yet committed: run once per module, each test commits a copy."""
    work = tmp_path_factory.mktemp("earlier") / "seed"
    work.mkdir()
    env = base_env(work.parent, server)
    run(["git", "init", "-q", "-b", "main"], work, env)
    run(["dvc", "init", "-q"], work, env)
    root = Path(__file__).resolve().parents[2]
    (work / ".dvc" / "config").write_text((root / ".dvc" / "config").read_text())
    (work / "step.py").write_text(STEP.format(shards=SHARDS))
    (work / "dvc.yaml").write_text(stand_in_pipeline())
    (work / "source.txt").write_text("old earlier data\n")
    params = {
        "data": {"num_shards": SHARDS, "shard_ids": list(range(SHARDS))},
        "model": {"target_id": "sha256:aaaa"},
        "hardware": {},
    }
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    (work / ".gitignore").write_text(".draftline/\nlogs/\n.training-node\n*.log\n")
    run(["dvc", "repro", "-q"], work, env)  # the earlier run: every stage in dvc.lock
    return work


def make_origin(tmp: Path, env: dict[str, str], earlier: Path, source: str) -> Path:
    """A bare origin whose commit carries a dvc.lock of an earlier run on other data (stale)."""
    work = tmp / "seed"
    run(["cp", "-a", str(earlier), str(work)], tmp, env)
    (work / "source.txt").write_text(source)
    run(["git", "add", "-A"], work, env)
    run(["git", "commit", "-qm", "pipeline, with an earlier run's dvc.lock"], work, env)
    origin = tmp / "origin.git"
    run(["git", "clone", "-q", "--bare", str(work), str(origin)], tmp, env)
    return origin


def new_bucket(server: S3Server) -> str:
    bucket = f"follow-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return bucket


def training_node(
    origin: Path, tmp: Path, env: dict[str, str], server: S3Server, bucket: str
) -> Path:
    train = clone_node(origin, tmp / "train", env, server, bucket)
    (train / ".training-node").write_text("")
    return train


def nodes(
    tmp: Path, server: S3Server, earlier: Path, source: str
) -> tuple[Path, Path, dict[str, str]]:
    env = base_env(tmp, server)
    bucket = new_bucket(server)
    origin = make_origin(tmp, env, earlier, source)
    gen = clone_node(origin, tmp / "gen", env, server, bucket)
    return gen, training_node(origin, tmp, env, server, bucket), env


def draftline(node: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`draftline ARGS --run r` in its own process group (so a kill takes its DVC too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "draftline", *args, "--run", "r"],
        cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


class Output:
    """A process's output read as it comes (so a test can wait for a line)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while text not in self.text:
            assert time.monotonic() < end, f"no {text!r} within {timeout} s:\n{self.text}"
            assert self.proc.poll() is None or text in self.text, f"ended:\n{self.text}"
            time.sleep(0.1)

    def wait_for_last(self, pattern: re.Pattern[str], timeout: float = 300) -> None:
        """Wait until the last line written matches `pattern` (the process is in that step)."""
        end = time.monotonic() + timeout
        while not (self.lines and pattern.search(self.lines[-1].rstrip())):
            waited = f"no {pattern.pattern!r} within {timeout} s"
            assert time.monotonic() < end, f"{waited}:\n{self.text}"
            assert self.proc.poll() is None, f"ended:\n{self.text}"
            time.sleep(0.05)

    def finish(self, timeout: float = 600) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.text}") from None
        self.reader.join(timeout=10)
        return rc


def kill(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def lock(node: Path) -> dict:
    return yaml.safe_load((node / "dvc.lock").read_text())["stages"]


@pytest.fixture(scope="module")
def led(
    tmp_path_factory: pytest.TempPathFactory, server: S3Server, earlier_run: Path
) -> tuple[Path, str]:
    """The origin and bucket of a run whose generating node finished `draftline lead` on
    "a b c": made once per module for the tests whose follower starts after the lead, which
    work on copies of both (`after_lead`)."""
    tmp = tmp_path_factory.mktemp("led")
    env, bucket = base_env(tmp, server), new_bucket(server)
    origin = make_origin(tmp, env, earlier_run, "a b c\n")
    gen = clone_node(origin, tmp / "gen", env, server, bucket)
    lead = draftline(gen, env, "lead")
    out, _ = lead.communicate(timeout=600)
    assert lead.returncode == 0, out
    return origin, bucket


def after_lead(led: tuple[Path, str], tmp: Path, server: S3Server) -> tuple[Path, dict[str, str]]:
    """The training node of a copy of `led`: its origin copied into `tmp` and its bucket's
    objects into a bucket of this test's own."""
    origin, bucket = led
    env = base_env(tmp, server)
    run(["cp", "-a", str(origin), str(tmp / "origin.git")], tmp, env)
    own, client = new_bucket(server), server.client()
    for key in server.keys(bucket):
        client.copy_object(Bucket=own, Key=key, CopySource={"Bucket": bucket, "Key": key})
    return training_node(tmp / "origin.git", tmp, env, server, own), env


def test_the_follower_trains_each_shard_as_it_arrives_and_never_generates(
    tmp_path: Path, server: S3Server, earlier_run: Path
) -> None:
    gen, train, env = nodes(tmp_path, server, earlier_run, "a b c\n")
    follow = draftline(train, env, "follow", "--poll-s", "0.5")
    lead = draftline(gen, {**env, "STEP_PACE_S": "4"}, "lead")
    lead_out, _ = lead.communicate(timeout=600)
    if lead.returncode:
        follow.kill()  # it would wait for shards that never come
    assert lead.returncode == 0, lead_out
    follow_out, _ = follow.communicate(timeout=600)
    assert follow.returncode == 0, follow_out
    assert "waiting for generate@" in follow_out  # it waited rather than generated
    # Shard 0's link trained before the last shard was generated: it followed.
    assert follow_out.index("train_shard@0: done") < follow_out.index(f"took generate@{SHARDS - 1}")
    assert (train / "models/drafter.txt").read_text() == "A\nA\nB\nB\nC\nC\n"
    # Every stage the generator ran is in the follower's lock as it was written there; the
    # commit's stale entries of the other stages never blocked it.
    theirs, ours = lock(gen), lock(train)
    ran = {"curate", "generate_eval", *(f"generate@{k}" for k in range(SHARDS))}
    assert ran <= set(theirs)
    assert all(ours[name] == theirs[name] for name in ran)
    assert "failed" not in follow_out, follow_out
    assert {"train", "evaluate", f"train_shard@{SHARDS - 1}"} <= set(ours)
    # The curate report travelled by git; the generator's branch is merged into the follower's.
    assert (train / "reports/curate.json").read_text() == '{"rows": 3}\n'
    run(["git", "fetch", "-q", "origin"], train, env)
    merged = ["git", "merge-base", "--is-ancestor", "origin/generate/r", "origin/train/r"]
    assert run(merged, train, env, check=False).returncode == 0


def test_a_shard_that_fails_validation_stops_the_follower_before_its_link(
    tmp_path: Path, server: S3Server, earlier_run: Path
) -> None:
    gen, train, env = nodes(tmp_path, server, earlier_run, "a BAD c\n")
    lead = draftline(gen, env, "lead")
    assert lead.wait(timeout=600) == 0
    follow = draftline(train, env, "follow", "--poll-s", "0.5")
    out, _ = follow.communicate(timeout=600)
    assert follow.returncode == 1, out
    assert "validate_shard@1 failed" in out and "empty responses" in out
    assert "train_shard@0: done" in out and "train_shard@1" not in out
    assert not (train / "models/chain/shard-1.txt").exists()


def test_a_follower_with_other_params_stops_naming_them(
    tmp_path: Path, server: S3Server, led: tuple[Path, str]
) -> None:
    train, env = after_lead(led, tmp_path, server)
    params = yaml.safe_load((train / "params.yaml").read_text())
    params["drafter"] = {"lr": 0.1}  # what it trains differs from what the generator planned
    params["hardware"] = {"name": "pro6000x4"}  # hardware may differ
    (train / "params.yaml").write_text(yaml.safe_dump(params))
    follow = draftline(train, env, "follow", "--poll-s", "0.5")
    out, _ = follow.communicate(timeout=600)
    assert follow.returncode == 1, out
    named = out.split("differs from this node's in ")[1].split(":")[0]
    assert named == "drafter.lr", out  # hardware differs too, and is allowed to
    assert not list((train / "data/generated").glob("*.txt"))  # .gitignore from the old run


def test_a_second_follower_is_refused_naming_the_first_until_it_takes_over(
    tmp_path: Path, server: S3Server, earlier_run: Path
) -> None:
    gen, train, env = nodes(tmp_path, server, earlier_run, "a b c\n")
    second = clone_node(tmp_path / "origin.git", tmp_path / "second", env, server, "unused")
    first = Output(draftline(train, env, "follow", "--poll-s", "0.5"))
    try:
        first.wait_for("waiting for curate", timeout=120)
        refused = draftline(second, env, "follow", "--poll-s", "0.5")
        out, _ = refused.communicate(timeout=120)
        assert refused.returncode == 1, out
        assert len(out.strip().splitlines()) == 1, out  # one line, no traceback
        assert "run r is followed by " in out and str(train.resolve()) in out, out
        assert "--take-over" in out
        # The first follower restarts (a crash): it is still the follower, not refused.
        kill(first.proc)
        first = Output(draftline(train, env, "follow", "--poll-s", "0.5"))
        first.wait_for("this node follows run r", timeout=120)
        # The first node is gone for good: the second takes the run over.
        kill(first.proc)
        taker = Output(draftline(second, env, "follow", "--poll-s", "0.5", "--take-over"))
        taker.wait_for(f"took run r over from {socket.gethostname()}:{train.resolve()}#", 120)
        kill(taker.proc)
    finally:
        if first.proc.poll() is None:
            kill(first.proc)


def test_a_lead_restarted_on_other_weights_stops_the_follower_at_its_next_look(
    tmp_path: Path, server: S3Server, earlier_run: Path
) -> None:
    gen, train, env = nodes(tmp_path, server, earlier_run, "a b c\n")
    lead = Output(draftline(gen, {**env, "STEP_PACE_S": "3"}, "lead"))
    follow = Output(draftline(train, env, "follow", "--poll-s", "0.5"))
    try:
        follow.wait_for("train_shard@0: done", timeout=300)
        # Killed inside a generation stage (dvc repro running the stand-in's paced step), as a
        # node lost mid-shard is: not inside the lead's own git commit or push, whose lock files
        # a kill -9 would leave behind for the restarted lead to trip on.
        lead.wait_for_last(re.compile(r"generate@\d: running$"), timeout=120)
        kill(lead.proc)
        params = yaml.safe_load((gen / "params.yaml").read_text())
        params["model"]["target_id"] = "sha256:bbbb"  # other weights
        (gen / "params.yaml").write_text(yaml.safe_dump(params))
        # Slow enough that the restarted lead generates nothing before the follower looks.
        lead = Output(draftline(gen, {**env, "STEP_PACE_S": "60"}, "lead"))
        try:
            assert follow.finish(timeout=120) == 1, follow.text
        except AssertionError as failed:
            raise AssertionError(f"{failed}\nthe restarted lead:\n{lead.text}") from None
        assert "differs from this node's in model.target_id" in follow.text
        assert "generate@2: generated" not in lead.text  # it stopped before any new shard
        took = [line for line in follow.text.splitlines() if "took generate@" in line]
        assert not any("generate@2" in line for line in took), follow.text
    finally:
        for proc in (lead.proc, follow.proc):
            if proc.poll() is None:
                kill(proc)


def test_the_follower_rides_out_an_s3_outage(
    tmp_path: Path, server: S3Server, led: tuple[Path, str]
) -> None:
    train, env = after_lead(led, tmp_path, server)
    follow = Output(draftline(train, env, "follow", "--poll-s", "0.5", "--retry-s", "120"))
    try:
        follow.wait_for("took curate", timeout=300)
        server.stop()
        follow.wait_for("retrying in", timeout=120)
        time.sleep(FIRST_PAUSE_S + 1)  # past the first retry: that one meets the outage too
        server.start()
        assert follow.finish(timeout=600) == 0, follow.text
    finally:
        if not server.running:
            server.start()
        if follow.proc.poll() is None:
            kill(follow.proc)
    assert (train / "models/drafter.txt").read_text() == "A\nA\nB\nB\nC\nC\n"


def test_an_outage_longer_than_the_budget_stops_in_one_line_naming_the_rerun(
    tmp_path: Path, server: S3Server, led: tuple[Path, str]
) -> None:
    train, env = after_lead(led, tmp_path, server)
    server.stop()
    try:
        follow = draftline(train, env, "follow", "--poll-s", "0.5", "--retry-s", "2")
        out, _ = follow.communicate(timeout=300)
    finally:
        server.start()
    assert follow.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert "kept failing for 2 s" in last and "rerun `draftline follow --run r`" in last, out
    assert "Traceback" not in out
