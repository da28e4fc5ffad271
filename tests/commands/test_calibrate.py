"""`draftline calibrate` on a copy of the embedded default after `dvc repro curate` (the local
engine): it leaves `dvc status` and git as they were, `draftline plan` then shows the cpu
profile's figures as measured, and a kill mid-calibration leaves nothing behind.

The budgets are a few seconds: every part measures at least one whole batch or step however
short its budget (the turns in flight when generate's budget ends still finish), and what is
checked here is what calibrate writes and leaves, not the figures' precision."""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from helpers.embedded_run import BIN, ENV, copy_project, run
from helpers.generate_helpers import StandIn, build_random_target, make_workdir, sglang_hardware

from draftline import cli

State = tuple[str, str, list[str]]


@pytest.fixture(scope="module")
def curated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_project(tmp_path_factory.mktemp("calibrate") / "repo")
    run(["dvc", "repro", "curate"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "curate"], repo)
    return repo


@pytest.fixture(scope="module")
def curated_state(curated: Path) -> State:
    """The project's state before any calibration: each test's calibration must leave it so."""
    return state(curated)


def state(repo: Path) -> State:
    """git status, dvc status and the working state (.draftline/) of the project."""
    git = run(["git", "status", "--porcelain", "--ignored"], repo).stdout
    dvc = run(["dvc", "status"], repo).stdout
    working = sorted(p.relative_to(repo).as_posix() for p in (repo / ".draftline").rglob("*"))
    return git, dvc, working


def without_logs(git_status: str) -> str:
    """git status less the ignored logs/ folder (calibrate writes there, git ignores it)."""
    return "\n".join(line for line in git_status.splitlines() if not line.endswith("logs/"))


def plan(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`draftline plan ARGS` in this process (tests/ops/test_plan.py runs the CLI as a
    subprocess too), in the current folder."""
    assert cli.main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_calibrate_changes_nothing_dvc_or_git_see_and_plan_shows_it(
    curated: Path,
    curated_state: State,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = curated_state
    done = run(["draftline", "calibrate", "--minutes", "0.02", "--no-progress"], curated)
    assert "calibrate: wrote logs/calibration/cpu.json" in done.stdout, done.stdout
    after = state(curated)
    assert without_logs(after[0]) == without_logs(before[0])
    assert after[1:] == before[1:]
    record = json.loads((curated / "logs/calibration/cpu.json").read_text())
    assert record["hardware_profile"] == "cpu" and record["engine"].startswith("local:")
    assert {"generate_tok_s", "extract_tok_s", "train_tok_s"} <= record["figures"].keys()

    monkeypatch.chdir(curated)
    profiles = json.loads(plan("--json", "--no-memory", capsys=capsys))["profiles"]
    cpu = profiles["cpu"]["throughput"]
    for key in ("generate_tok_s", "extract_tok_s", "train_tok_s"):
        assert cpu[key]["kind"] == "measured", cpu[key]
        assert cpu[key]["source"].startswith("measured by calibrate on "), cpu[key]
    table = plan("--no-memory", capsys=capsys)
    assert "Calibrated (tok/s: conf/ estimate vs measured)" in table


def test_a_kill_mid_calibration_leaves_nothing_behind(curated: Path, curated_state: State) -> None:
    (curated / "logs/calibration/cpu.json").unlink(missing_ok=True)
    before = curated_state
    proc = subprocess.Popen(
        [str(BIN / "draftline"), "calibrate", "--minutes", "5", "--no-progress"],
        cwd=curated, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # killed once the engine is generating
        if "engine" in line and "ready" in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not list((curated / "logs").glob("calibration/*")), "a kill left a calibration"
    assert state(curated) == before


def test_extract_and_train_run_over_the_profiles_processes(
    curated: Path, curated_state: State, tmp_path: Path
) -> None:
    """A profile of two processes per node (gloo on the CPU, as NCCL over a node's GPUs):
    both parts run as two workers of one process group, and the figures are the node's."""
    p = yaml.safe_load((curated / "params.yaml").read_text())
    p["hardware"].update(processes_per_node=2, sharding="fsdp")
    two = tmp_path / "two.yaml"  # outside the project: git and dvc see no change
    two.write_text(yaml.safe_dump(p))
    before = curated_state
    done = run(
        ["draftline", "calibrate", "--minutes", "0.02", "--stages", "extract,train",
         "--params", str(two), "--out-dir", str(tmp_path / "out"), "--no-progress"],
        curated,
    )  # fmt: skip
    assert "extract, train over 2 processes" in done.stdout, done.stdout
    record = json.loads((tmp_path / "out/cpu.json").read_text())
    extract, train = record["parts"]["extract"], record["parts"]["train"]
    assert extract["world_size"] == 2 and train["world_size"] == 2, record["parts"]
    assert train["sharding"] == "fsdp"
    # Each worker extracted its own share: the node's tokens are both shares' sum.
    assert extract["tokens"] > 0 and extract["tokens_per_s"] == pytest.approx(
        extract["tokens"] / extract["seconds"]
    )
    assert record["skipped"] == {}
    assert state(curated) == before
    assert not list(Path(tempfile.gettempdir()).glob("draftline-calibrate-*/parts.json"))


def test_generate_reports_the_engines_prefix_cache(tmp_path: Path) -> None:
    """The generate part through the SGLang client against the SGLang stand-in
    (tests/helpers/sglang_standin.py: SGLang needs a GPU), which reports `cached_tokens` as
    SGLang's radix cache would: a later turn finds its history cached."""
    model = build_random_target(tmp_path / "target")
    with StandIn(tmp_path, "--mode", "think") as server:
        make_workdir(tmp_path / "w", model, multi_turn=True, hardware=sglang_hardware(server.port))
        done = run(
            ["draftline", "calibrate", "--minutes", "0.05", "--stages", "generate",
             "--no-progress"],
            tmp_path / "w",
        )  # fmt: skip
    record = json.loads((tmp_path / "w/logs/calibration/test-sglang.json").read_text())
    cache = record["parts"]["generate"]["prefix_cache"]
    assert cache["turns"] == record["parts"]["generate"]["turns_generated"]
    assert 0 < cache["cached_tokens"] < cache["prompt_tokens"]
    assert "prefix cache" in done.stdout
