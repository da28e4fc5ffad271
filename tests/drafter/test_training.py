"""Training: it learns, the world size and the layout (DDP, FSDP2, activation checkpointing;
offline features, or online with the frozen target sharded) do not change the result, a killed
run resumes, on the same or another world size.

Real runs: `draftline train` in subprocesses (two gloo processes for the distributed cases, two
torchrun launches for two nodes), a real SIGKILL for the interruption, a tiny random Qwen3
target. Loss curves of different world sizes or layouts agree within 1e-5 (relative, float
summation order); a run resumed on its own world size and layout ends bit for bit where the
uninterrupted one ends.
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
from typing import Any

import pytest
import torch
import yaml
from helpers.dflash_data import generated_sequences, make_target, model_params, write_packs

from draftline.drafter import checkpoints
from draftline.drafter.training import Hyperparameters, RunOptions, train
from draftline.drafter.training_mode import TrainingMode

# One xdist worker for the module: its runs (module fixtures, per family) are shared by several
# tests and would otherwise run again on each worker that gets one of them.
pytestmark = [pytest.mark.float_kernels, pytest.mark.xdist_group("training")]

torch.set_num_threads(1)

DRAFTER = {
    "name": "test", "num_hidden_layers": 1, "block_size": 4, "gamma": 4.0, "max_anchors": 12,
    "max_length": 64, "global_batch_size": 8, "lr": 1e-2, "weight_decay": 0.0,
    "warmup_ratio": 0.1, "epochs": 5, "grad_clip": 1.0, "seed": 0,
}  # fmt: skip
# Each family's drafter params: DFlash2 adds its convolutions and selector (hidden 32: 4
# groups of 8 channels), the selector's term in the loss from the first step.
FAMILIES = {
    "dflash": DRAFTER,
    "dflash2": {
        **DRAFTER, "family": "dflash2", "conv_kernel_size": 2, "conv_group_size": 8,
        "selector_rank": 8, "selector_top_k": 4, "selector_loss": "strict_topk",
        "selector_alpha": 1.0, "selector_warmup_ratio": 0.0, "selector_ramp_ratio": 0.0,
        "selector_stop_gradient": False,
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=["dflash", pytest.param("dflash2", marks=pytest.mark.slow)])
def family(request) -> str:
    """Every multi-process, resumed and rerun case below, for each drafter family. DFlash2's
    (minutes of process start-ups) run in .ci/run (marker `slow`, under generic kernels with
    the other float-kernel tests); both families train in-process in every run."""
    return request.param


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    target = make_target(root / "target")
    # Four sequences with fewer than 2B supervised tokens: the objective drops them.
    sequences = generated_sequences(target, 60) + generated_sequences(target, 4, 9, new_tokens=5)
    write_packs(root / "data", target, sequences)
    return root


# Across world sizes and layouts the sums run in another order: relative loss difference
# (measured: at most 1.9e-7 over the 35 steps).
TOLERANCE = 1e-5
# Steps between checkpoints of the runs that are killed (the others write only the last one:
# checkpoints cost far more than these tiny steps).
KILLED_EVERY = 4


def write_params(
    root: Path,
    name: str,
    processes: int,
    micro: int,
    sharding: str = "ddp",
    recompute=False,
    family: str = "dflash",
) -> Path:
    hardware = {
        "name": f"test{processes}", "device": "cpu", "precision": "fp32", "engine": "local",
        "processes_per_node": processes, "micro_batch_size": micro, "num_threads": 1,
        "sharding": sharding, "activation_checkpointing": recompute,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": model_params(root / "target"),
                "drafter": FAMILIES[family],
                "hardware": hardware,
            }
        )
    )
    return path


def stage_command(
    root: Path,
    name: str,
    processes: int,
    micro: int,
    sharding: str = "ddp",
    recompute: bool = False,
    every: int = 1000,
    family: str = "dflash",
) -> list[str]:
    run = root / name
    params = write_params(root, name, processes, micro, sharding, recompute, family)
    return [
        sys.executable, "-m", "draftline", "train", "--no-progress",
        f"--params={params}", f"--data={root / 'data'}",
        f"--out={run / 'drafter'}", f"--metrics={run / 'metrics.json'}",
        f"--report={run / 'report.json'}",
        f"--run-log={run / 'train.json'}", f"--throughput={run / 'throughput.json'}",
        f"--live={run / 'live'}", f"--plots={run / 'plots'}",
        f"--checkpoint={run / 'checkpoint'}",
        f"--checkpoint-every={every}",
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_stage(root: Path, name: str, processes: int, micro: int, **layout: Any) -> Path:
    """Run the stage to its end; `layout`: stage_command's sharding, recompute, every,
    family."""
    cmd = stage_command(root, name, processes, micro, **layout)
    done = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / name


def loss_curve(run: Path) -> list[tuple[int, float]]:
    with open(run / "live" / "plots" / "metrics" / "loss.tsv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def assert_same_curve(got: Path, want: Path, tolerance: float) -> None:
    a, b = loss_curve(got), loss_curve(want)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(len(b)))
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert abs(x - y) <= tolerance * max(1.0, abs(y)), (x, y)


def assert_same_drafter(got: Path, want: Path, tolerance: float | None = None) -> None:
    """The exported weights: equal (tolerance None) or within `tolerance`, absolute, plus one
    bf16 rounding step (the export's dtype: master weights 1e-7 apart can round to neighbouring
    bf16 values; measured once on a DFlash2 FSDP run, one k_proj element one step apart)."""
    from safetensors.torch import load_file

    a = load_file(str(got / "drafter" / "model.safetensors"))
    b = load_file(str(want / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in b:
        if tolerance is None:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], atol=tolerance, rtol=2**-7, msg=name)


def checkpoint_step(run: Path) -> int:
    found = checkpoints.read_progress(run / "checkpoint")
    return -1 if found is None else int(found[1]["step"])


@pytest.fixture(scope="module")
def single_run(workdir, family) -> Path:
    return run_stage(workdir, f"single-{family}", processes=1, micro=4, family=family)


@pytest.fixture(scope="module")
def fsdp_run(workdir, family) -> Path:
    """Two processes, FSDP2, activation checkpointing: what the GPU profiles run."""
    layout = {"sharding": "fsdp", "recompute": True, "family": family}
    return run_stage(workdir, f"fsdp-{family}", processes=2, micro=2, **layout)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_lowers_the_loss_and_raises_accuracy(workdir, family):
    hp = Hyperparameters.from_params({**FAMILIES[family], "epochs": 12})
    options = RunOptions(progress=False)
    mode = TrainingMode.whole_run(workdir / "data")
    result = train(mode, model_params(workdir / "target"), hp, options)
    assert result.dropped_sequences == 4  # the four with < 2B supervised tokens
    assert result.num_sequences == 60 and result.steps == 7 * 12
    first, last = result.history[:5], result.history[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss") - 1.0
    assert mean(last, "acc") > mean(first, "acc") + 0.3
    assert mean(last, "acc_pos/1") > mean(last, "acc_pos/3")  # earlier positions are easier
    if family == "dflash2":  # the selector learns to put the target's token first, within
        # the candidates it has (its loss, normalised like the CE, grows with them)
        assert mean(last, "selector_recall_top1") > mean(first, "selector_recall_top1") + 0.2
        assert mean(last, "selector_recall_topk") >= mean(last, "selector_recall_top1")


def test_a_chain_of_links_trains_what_a_whole_run_over_its_shards_trains(workdir, tmp_path):
    """The modes compose: link 0 (a fresh plan of the planned rows), link 1 (from link 0's
    state) and the steps after the chain (from link 1's) end bit for bit where one whole run
    over the same two shards, planned from the same rows, ends."""
    target = workdir / "target"
    shards = [tmp_path / "extracted" / f"shard-{k}" for k in (0, 1)]
    write_packs(shards[0], target, generated_sequences(target, 20, seed=1))
    write_packs(shards[1], target, generated_sequences(target, 27, seed=2))
    model, hp = model_params(target), Hyperparameters.from_params({**DRAFTER, "epochs": 3})
    options, rows = RunOptions(progress=False), 47
    whole = train(TrainingMode.whole_run(shards, planned_rows=rows), model, hp, options)

    links = [tmp_path / "chain" / f"shard-{k}" for k in (0, 1)]
    first = TrainingMode.chain_link(0, shards[0], links[0], planned_rows=rows)
    second = TrainingMode.chain_link(1, shards[1], links[1], start_from=links[0])
    assert [train(m, model, hp, options).steps for m in (first, second)] == [2, 3]
    after = train(TrainingMode.after_the_chain(shards, links[1]), model, hp, options)
    assert after.steps == whole.steps == 3 * (rows // 8) and after.resumed_from_step == 5
    assert after.history == whole.history
    got, want = after.drafter.state_dict(), whole.drafter.state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_two_ddp_processes_give_the_same_loss_curve_as_one(workdir, single_run, family):
    double = run_stage(workdir, f"double-{family}", processes=2, micro=2, family=family)
    assert_same_curve(double, single_run, TOLERANCE)
    import json

    metrics = json.loads((double / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 8
    assert metrics["sharding"] == "ddp"


def test_two_fsdp_processes_give_the_same_loss_curve_and_drafter_as_one(single_run, fsdp_run):
    import json

    assert_same_curve(fsdp_run, single_run, TOLERANCE)
    assert_same_drafter(fsdp_run, single_run, tolerance=1e-4)
    metrics = json.loads((fsdp_run / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["sharding"] == "fsdp"
    assert metrics["activation_checkpointing"] is True
    # The checkpoint holds each process's shards, not one whole copy per process.
    assert len(list((fsdp_run / "checkpoint").glob("*.distcp"))) == 2


@pytest.fixture(scope="module")
def online_root(tmp_path_factory) -> Path:
    """Token packs without features, of a 5-layer target: training cuts it after layer 3."""
    root = tmp_path_factory.mktemp("online")
    target = make_target(root / "target", layers=5)
    write_packs(root / "data", target, generated_sequences(target, 32), offline=False)
    return root


def test_online_fsdp_with_the_sharded_target_gives_the_same_loss_curve_as_one(online_root, family):
    """Online features: the frozen target (cut, and sharded by FSDP2 beside the drafter over
    two processes) computes them inside the step; one process holds it whole."""
    one = run_stage(online_root, f"one-{family}", processes=1, micro=4, family=family)
    layout = {"sharding": "fsdp", "family": family}
    two = run_stage(online_root, f"fsdp-{family}", processes=2, micro=2, **layout)
    assert_same_curve(two, one, TOLERANCE)
    import json

    metrics = json.loads((two / "train.json").read_text())
    assert metrics["features"] == "online" and metrics["sharding"] == "fsdp"


def test_two_nodes_give_the_same_loss_curve_as_one_process(workdir, single_run, family):
    """Two torchrun launches, as on two machines (`--nnodes 2 --node-rank 0/1`), one process
    each, the drafter sharded over them (FSDP2), the global batch of the single-process run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes_run = f"nodes-{family}"
    stage = stage_command(workdir, nodes_run, processes=1, micro=4, sharding="fsdp", family=family)
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
    assert_same_curve(workdir / nodes_run, single_run, TOLERANCE)
    import json

    metrics = json.loads((workdir / nodes_run / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 8


def kill_after_a_checkpoint(command: list[str], run: Path) -> int:
    """Start the stage, SIGKILL it and all its workers (as when a node goes away) once a
    checkpoint is in place; the step of the checkpoint left behind."""
    proc = subprocess.Popen(
        command, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoint_step(run) >= KILLED_EVERY:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = checkpoint_step(run)
    assert KILLED_EVERY <= killed_at < 35 and not (run / "drafter").exists()
    shutil.rmtree(run / "live")  # DVC deletes a stage's plots before it reruns the stage
    return killed_at


def test_killed_run_resumes_and_matches_the_uninterrupted_one(workdir, single_run, family):
    name = f"killed-{family}"
    run = workdir / name
    command = stage_command(workdir, name, 1, micro=4, every=KILLED_EVERY, family=family)
    killed_at = kill_after_a_checkpoint(command, run)
    run_stage(workdir, name, processes=1, micro=4, every=KILLED_EVERY, family=family)
    import json

    assert json.loads((run / "train.json").read_text())["resumed_from_step"] >= killed_at
    assert_same_curve(run, single_run, 1e-6)
    assert_same_drafter(run, single_run)


def test_killed_fsdp_run_resumes_on_the_same_and_on_another_world_size(
    workdir, single_run, fsdp_run, family
):
    """Killed with its two processes mid-run, the FSDP run resumes from its sharded
    checkpoint: on two processes it ends bit for bit where the uninterrupted FSDP run ends; on
    one process (the shards read back whole) where the one-process run ends, within TOLERANCE."""
    import json

    name, to_one = f"fsdp_killed-{family}", f"fsdp_to_one-{family}"
    run = workdir / name
    layout = {"sharding": "fsdp", "recompute": True, "every": KILLED_EVERY, "family": family}
    killed_at = kill_after_a_checkpoint(stage_command(workdir, name, 2, 2, **layout), run)
    shutil.copytree(run, workdir / to_one)
    run_stage(workdir, name, processes=2, micro=2, **layout)
    assert json.loads((run / "train.json").read_text())["resumed_from_step"] >= killed_at
    assert_same_curve(run, fsdp_run, 1e-6)
    assert_same_drafter(run, fsdp_run)

    one = run_stage(workdir, to_one, processes=1, micro=4, family=family)
    metrics = json.loads((one / "train.json").read_text())
    assert metrics["resumed_from_step"] >= killed_at and metrics["world_size"] == 1
    assert_same_curve(one, single_run, TOLERANCE)
    assert_same_drafter(one, single_run, tolerance=1e-4)


def test_rerun_after_the_last_checkpoint_rewrites_plots_and_metrics(workdir, single_run, family):
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
    run_stage(workdir, f"single-{family}", processes=1, micro=4, family=family)
    after = json.loads((single_run / "train.json").read_text())
    assert loss_curve(single_run) == curve
    assert (single_run / "plots" / "accuracy_per_position.csv").read_text() == per_position
    assert after["resumed_from_step"] == after["steps"] == before["steps"]
    assert after["tokens_this_run"] == 0
    assert after["tokens_per_s"] == before["tokens_per_s"] > 0
    assert after["final_loss"] == before["final_loss"]


def test_a_checkpoint_of_other_weights_in_the_same_folder_is_not_resumed() -> None:
    """The run's fingerprint names `model.target_id`: same path, other weights, other run."""
    from types import SimpleNamespace

    from draftline.drafter.training_setup import run_fingerprint

    hp = Hyperparameters.from_params(DRAFTER)
    data = SimpleNamespace(fingerprint="index-sha")
    model = {"path": "models/tiny-target", "revision": None, "target_layer_ids": [1]}
    before = run_fingerprint({**model, "target_id": "sha256:aaaa"}, hp, data)  # type: ignore[arg-type]
    after = run_fingerprint({**model, "target_id": "sha256:bbbb"}, hp, data)  # type: ignore[arg-type]
    assert before != after
    assert before == run_fingerprint({**model, "target_id": "sha256:aaaa"}, hp, data)  # type: ignore[arg-type]
