"""Training: it learns, the world size does not change the result, a killed run resumes.

Real runs: `draftline train` in subprocesses (under torchrun with two gloo processes for the
distributed case), a real SIGKILL for the interruption, a tiny random Qwen3 target.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.dflash_data import generated_sequences, make_target, model_params, write_packs

from draftline.drafter.training import Hyperparameters, RunOptions, train

pytestmark = pytest.mark.float_kernels

torch.set_num_threads(1)

DRAFTER = {
    "name": "test", "num_hidden_layers": 1, "block_size": 4, "gamma": 4.0, "max_anchors": 12,
    "max_length": 64, "global_batch_size": 8, "lr": 1e-2, "weight_decay": 0.0,
    "warmup_ratio": 0.1, "epochs": 5, "grad_clip": 1.0, "seed": 0,
}  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    target = make_target(root / "target")
    # Four sequences with fewer than 2B supervised tokens: the objective drops them.
    sequences = generated_sequences(target, 60) + generated_sequences(target, 4, 9, new_tokens=5)
    write_packs(root / "data", target, sequences)
    return root


def write_params(root: Path, name: str, processes: int, micro: int) -> Path:
    hardware = {
        "name": f"test{processes}", "device": "cpu", "precision": "fp32", "engine": "local",
        "processes_per_node": processes, "micro_batch_size": micro, "num_threads": 1,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {"model": model_params(root / "target"), "drafter": DRAFTER, "hardware": hardware}
        )
    )
    return path


def stage_command(root: Path, name: str, processes: int, micro: int) -> list[str]:
    run = root / name
    return [
        sys.executable, "-m", "draftline", "train", "--no-progress",
        f"--params={write_params(root, name, processes, micro)}", f"--data={root / 'data'}",
        f"--out={run / 'drafter'}", f"--metrics={run / 'metrics.json'}",
        f"--run-log={run / 'train.json'}", f"--throughput={run / 'throughput.json'}",
        f"--live={run / 'live'}", f"--plots={run / 'plots'}",
        f"--checkpoint={run / 'checkpoint.pt'}",
        "--checkpoint-every=1",
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_stage(root: Path, name: str, processes: int, micro: int) -> Path:
    cmd = stage_command(root, name, processes, micro)
    done = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / name


def loss_curve(run: Path) -> list[tuple[int, float]]:
    with open(run / "live" / "plots" / "metrics" / "loss.tsv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [(int(r["step"]), float(r["loss"])) for r in rows]


@pytest.fixture(scope="module")
def single_run(workdir) -> Path:
    return run_stage(workdir, "single", processes=1, micro=4)


def test_training_lowers_the_loss_and_raises_accuracy(workdir):
    hp = Hyperparameters.from_params({**DRAFTER, "epochs": 12})
    options = RunOptions(progress=False)
    result = train(workdir / "data", model_params(workdir / "target"), hp, options)
    assert result.dropped_sequences == 4  # the four with < 2B supervised tokens
    assert result.num_sequences == 60 and result.steps == 7 * 12
    first, last = result.history[:5], result.history[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss") - 1.0
    assert mean(last, "acc") > mean(first, "acc") + 0.3
    assert mean(last, "acc_pos/1") > mean(last, "acc_pos/3")  # earlier positions are easier


def test_two_processes_give_the_same_loss_curve_as_one(workdir, single_run):
    double = run_stage(workdir, "double", processes=2, micro=2)
    one, two = loss_curve(single_run), loss_curve(double)
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(len(one)))
    for (_, a), (_, b) in zip(one, two, strict=True):
        assert abs(a - b) < 1e-3 * max(1.0, abs(a))
    import json

    metrics = json.loads((double / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 8


def test_two_nodes_give_the_same_loss_curve_as_one_process(workdir, single_run):
    """Two torchrun launches, as on two machines (`--nnodes 2 --node-rank 0/1`), one process
    each, the global batch of the single-process run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stage = stage_command(workdir, "nodes", processes=1, micro=4)
    nodes = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                f"--node-rank={rank}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                f"--master-port={port}", *stage[1:],
            ],
            env={**environment(), "GLOO_SOCKET_IFNAME": "lo"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    for node in nodes:
        output, _ = node.communicate(timeout=600)
        assert node.returncode == 0, output
    one, two = loss_curve(single_run), loss_curve(workdir / "nodes")
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(len(one)))
    for (_, a), (_, b) in zip(one, two, strict=True):
        assert abs(a - b) < 1e-3 * max(1.0, abs(a))
    import json

    metrics = json.loads((workdir / "nodes" / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 8


def test_killed_run_resumes_and_matches_the_uninterrupted_one(workdir, single_run):
    from safetensors.torch import load_file

    run = workdir / "killed"
    proc = subprocess.Popen(
        stage_command(workdir, "killed", processes=1, micro=4),
        env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    checkpoint = run / "checkpoint.pt"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoint.exists() and torch.load(checkpoint, weights_only=False)["step"] >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(checkpoint, weights_only=False)["step"]
    assert 3 <= killed_at < 35 and not (run / "drafter").exists()
    shutil.rmtree(run / "live")  # DVC deletes a stage's plots before it reruns the stage
    run_stage(workdir, "killed", processes=1, micro=4)
    import json

    assert json.loads((run / "train.json").read_text())["resumed_from_step"] >= killed_at
    resumed, reference = loss_curve(run), loss_curve(single_run)
    assert [s for s, _ in resumed] == [s for s, _ in reference]
    for (_, a), (_, b) in zip(resumed, reference, strict=True):
        assert abs(a - b) < 1e-6 * max(1.0, abs(a))
    got = load_file(str(run / "drafter" / "model.safetensors"))
    want = load_file(str(single_run / "drafter" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_rerun_after_the_last_checkpoint_rewrites_plots_and_metrics(workdir, single_run):
    """DVC reruns a finished train stage when an input's bytes change but not its content: the
    checkpoint is complete, so no step runs, and the plots and throughput still come out whole."""
    import json

    before = json.loads((single_run / "train.json").read_text())
    curve = loss_curve(single_run)
    per_position = (single_run / "plots" / "accuracy_per_position.csv").read_text()
    assert per_position.count("\n") == 1 + before["steps"] * (DRAFTER["block_size"] - 1)
    shutil.rmtree(single_run / "live")
    shutil.rmtree(single_run / "plots")
    (single_run / "train.json").unlink()
    run_stage(workdir, "single", processes=1, micro=4)
    after = json.loads((single_run / "train.json").read_text())
    assert loss_curve(single_run) == curve
    assert (single_run / "plots" / "accuracy_per_position.csv").read_text() == per_position
    assert after["resumed_from_step"] == after["steps"] == before["steps"]
    assert after["tokens_this_run"] == 0
    assert after["tokens_per_s"] == before["tokens_per_s"] > 0
    assert after["final_loss"] == before["final_loss"]
