"""The whole pipeline through real `dvc` subprocesses, in a throwaway copy of this repository.

Every stage runs on the embedded default (tiny target, bundled prompts) on CPU.
"""

from __future__ import annotations

import json
import os
import shlex
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


# Metric columns of `dvc exp show`: five stages of about ten results each and three tokens/s
# figures. They must not grow with data.num_shards or the block size (they were 291 of 416
# columns with 4 shards: per-shard generate files, per-position rates, timings, hardware).
MAX_METRIC_COLUMNS = 60
RUN_FACTS = ("seconds", "wall", "hardware_", "engine", "precision", "world_size", "this_run")


def leaves(data: object, prefix: str = "") -> list[str]:
    if isinstance(data, dict):
        return [leaf for k, v in data.items() for leaf in leaves(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def tracked_outputs(repo: Path) -> dict[str, bytes]:
    """Bytes of every file git would track from a run (metrics, plots, dvclive)."""
    return {
        str(p.relative_to(repo)): p.read_bytes()
        for top in ("metrics", "plots", "dvclive")
        for p in sorted((repo / top).rglob("*"))
        if p.is_file()
    }


def test_exp_show_is_narrow_and_a_rerun_changes_no_result(finished):
    repo, _ = finished
    rows = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
    metrics = rows[0]["data"]["metrics"]
    columns = [f"{path}:{c}" for path, m in metrics.items() for c in leaves(m["data"])]
    assert len(columns) < MAX_METRIC_COLUMNS, columns
    assert not [c for c in columns if any(fact in c for fact in RUN_FACTS)]
    assert "metrics/throughput.json:train.tokens_per_s" in columns
    assert "metrics/evaluate.json:tau" in columns
    assert (repo / "logs/runs/train.json").is_file()  # the timings are kept, outside git

    before = tracked_outputs(repo)
    stages = ["curate", "generate@0", "validate", "extract", "evaluate"]
    assert ran_stages(run(["dvc", "repro", "-f", "-s", *stages], repo).stdout) == stages
    after = tracked_outputs(repo)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    assert changed <= {"metrics/throughput.json"}  # the one measured figure: generate tok/s
    assert json.loads(run(["dvc", "status", "--json"], repo).stdout) == {}


def test_readme_compare_recipes_run_and_fit_a_terminal(finished):
    repo, _ = finished
    section = (ROOT / "README.md").read_text().split("## Compare runs", 1)[1]
    block = section.split("```")[1]
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("dvc ")]
    assert len(commands) == 2
    header = run([*commands[0], "--csv"], repo).stdout.splitlines()[0].split(",")
    assert {"tau", "final_loss", "rows_kept", "train.tokens_per_s", "hardware.name"} <= set(header)
    assert len(header) <= 10, header
    for command in commands:
        run(command, repo)
    # Its natural width (rich does not squeeze it on a 200-column terminal) fits 120 columns.
    wide = subprocess.run(
        [str(BIN / "dvc"), *commands[0][1:]], cwd=repo, env={**ENV, "COLUMNS": "200"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert max(len(line) for line in wide.splitlines()) <= 120, wide


PLOT_IDS = {
    "train_loss", "train_accuracy", "train_accuracy_per_position", "train_lr", "train_grad_norm",
    "validate_supervised_tokens", "validate_completion_length", "evaluate_acceptance",
    "evaluate_tau_histogram",
}  # fmt: skip
HISTOGRAMS = {"validate_supervised_tokens", "evaluate_tau_histogram"}


def test_plots_are_titled_with_named_axes(finished):
    repo, _ = finished
    shown = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)
    assert not shown.get("errors"), shown.get("errors")
    charts = shown["data"]
    assert set(charts) == PLOT_IDS
    for plot_id, (chart,) in charts.items():
        spec = chart["content"]
        title = spec["title"]["text"] if isinstance(spec["title"], dict) else spec["title"]
        assert title and title != plot_id and "/" not in title, plot_id
        for axis in ("x", "y"):
            label = spec["encoding"][axis]["title"]
            # Real words, not a column name such as "3", "y" or "dvc_inferred_y_value".
            assert len(label.split()) >= 2, (plot_id, axis, label)
        mark = spec["mark"]["type"] if isinstance(spec["mark"], dict) else spec["mark"]
        assert (mark == "bar") == (plot_id in HISTOGRAMS), (plot_id, mark)
        assert spec["data"]["values"], plot_id
    per_position = charts["train_accuracy_per_position"][0]["content"]
    positions = {row["position"] for row in per_position["data"]["values"]}
    assert positions == {str(k) for k in range(1, 8)}  # block size 8: positions 1..7, one chart


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


def test_target_is_keyed_by_its_files_not_its_path(finished, tmp_path):
    """The same weights in another folder rerun nothing; one changed weight byte reruns all."""
    repo, _ = finished
    elsewhere = tmp_path / "tiny-target-copy"
    shutil.copytree(repo / "models/tiny-target", elsewhere)
    try:
        run(["draftline", "compose", f"model.path={elsewhere}"], repo)
        assert yaml.safe_load((repo / "params.yaml").read_text())["model"]["path"] == str(elsewhere)
        assert json.loads(run(["dvc", "status", "--json"], repo).stdout) == {}
        weights = elsewhere / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1  # the last byte belongs to a tensor, not to the header
        weights.write_bytes(bytes(data))
        run(["draftline", "compose", f"model.path={elsewhere}"], repo)
        stale = set(json.loads(run(["dvc", "status", "--json"], repo).stdout))
        assert {"curate", "generate@0", "generate_eval", "extract", "train", "evaluate"} <= stale
    finally:
        run(["draftline", "compose"], repo)


def test_exp_run_with_another_shard_count_derives_the_shard_ids(tmp_path):
    """`-S data.num_shards=8` composes shard_ids [0..7] with it: curate writes 8 shards (before,
    params held 8 shards and 4 ids, and curate failed after DVC had deleted its outputs)."""
    repo = copy_project(tmp_path)
    run(["dvc", "exp", "run", "-S", "data.num_shards=8", "curate"], repo)
    assert yaml.safe_load((repo / "params.yaml").read_text())["data"]["shard_ids"] == list(range(8))
    shards = sorted(p.name for p in (repo / "data/curated/train").iterdir())
    assert shards == [f"shard-{k}.parquet" for k in range(8)]
