"""The whole pipeline through real `dvc` subprocesses, in a throwaway copy of this repository.

Every stage runs on the embedded default (tiny target, bundled prompts) on CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.embedded_run import (
    BIN,
    ENV,
    ROOT,
    SharedRun,
    committed_schedule,
    copy_project,
    copy_run,
    embedded_default,
    qwen36_twin,
    ran_stages,
    run,
)

# The tests that read the session's run of the embedded default (or change it and restore it)
# run on one xdist worker, one after the other; the twin's likewise.
EMBEDDED = pytest.mark.xdist_group("embedded-default")

# Every stage of the pipeline on 4 shards: per shard, generation, validation, extraction and
# the training link; then the whole-run gate, the rest of training and evaluate.
ALL_STAGES = {
    "curate", "generate_eval", "validate", "train", "evaluate",
    *(f"{stage}@{k}" for stage in ("generate", "validate_shard", "extract", "train_shard")
      for k in range(4)),
}  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    shared = embedded_default(tmp_path_factory)
    return shared.repo, shared.stdout


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    return embedded_default(tmp_path_factory)


@pytest.fixture(scope="module")
def committed_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    return committed_schedule(tmp_path_factory)


@EMBEDDED
def test_repro_runs_every_stage_and_a_second_run_does_nothing(finished):
    """Slow for the first embedded test (minutes): the session's one `dvc repro` of the
    embedded default (2 epochs), which the other tests here and in test_salvage_experiments
    read."""
    repo, out = finished
    assert set(ran_stages(out)) == ALL_STAGES
    verdict = json.loads((repo / "metrics/validate.json").read_text())
    assert verdict["passed"] is True
    ev = json.loads((repo / "reports/evaluate.json").read_text())
    assert ev["tau"] >= 1.0 and ev["tau_untrained"] >= 1.0
    assert (repo / "models/drafter/config.json").is_file()
    again = run(["dvc", "repro"], repo)
    assert ran_stages(again.stdout) == []


@EMBEDDED
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


@EMBEDDED
def test_exp_show_lists_stage_metrics(finished):
    repo, _ = finished
    shown = run(["dvc", "exp", "show", "--json"], repo).stdout
    assert "train_rows" in shown and "tau" in shown


# Metric columns of `dvc exp show` on the embedded default: what compares runs, and nothing
# else (they were 291 of 416 columns with 4 shards: per-shard generate files, per-position rates,
# timings, hardware; then 62: every result, identities, tokens/s). Every other result is in
# reports/<stage>.json, timings in logs/runs/.
COMPARED = {
    "metrics/curate.json": {"train_rows", "eval_rows", "reject_rate"},
    "metrics/validate.json": {
        "passed", "num_samples", "completion_tokens_mean", "supervised_tokens_mean"
    },
    "metrics/train.json": {"final_loss", "final_accuracy"},
    "metrics/evaluate.json": {"tau", "tau_sampled"},
    # bench's folder (a metric before bench ever runs): DVC lists its empty placeholder.
    "metrics/bench/.gitkeep": set(),
}  # fmt: skip


def leaves(data: object, prefix: str = "") -> list[str]:
    if isinstance(data, dict):
        return [leaf for k, v in data.items() for leaf in leaves(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def tracked_outputs(repo: Path) -> dict[str, bytes]:
    """Bytes of every file git would track from a run (metrics, reports, plots, dvclive); GX's
    data docs (reports/validate/, ignored by git) carry run ids and times."""
    return {
        str(p.relative_to(repo)): p.read_bytes()
        for top in ("metrics", "reports", "plots", "dvclive")
        for p in sorted((repo / top).rglob("*"))
        if p.is_file() and not p.relative_to(repo).is_relative_to("reports/validate")
    }


@EMBEDDED
def test_exp_show_is_narrow_and_a_rerun_changes_no_result(finished):
    repo, _ = finished
    rows = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
    metrics = rows[0]["data"]["metrics"]
    assert {path: set(leaves(m["data"])) for path, m in metrics.items()} == COMPARED
    header = run(["dvc", "exp", "show", "--csv"], repo).stdout.splitlines()[0].split(",")
    # The metrics come first, after the experiment's name and dates, each under its own name,
    # in dvc.yaml's `metrics:` order and each file's key order: tau, tau_sampled and the final
    # loss lead (the first 8 columns of a plain `dvc exp show`), then the data stages' figures.
    assert header[:8] == ["Experiment", "rev", "typ", "Created", "parent", "tau", "tau_sampled",
                          "final_loss"], header  # fmt: skip
    assert header[8 : 5 + 11] == [
        "final_accuracy", "eval_rows", "reject_rate", "train_rows", "completion_tokens_mean",
        "num_samples", "passed", "supervised_tokens_mean",
    ], header  # fmt: skip
    # Every result and what it ran on are kept beside them, tracked; timings outside git.
    report = json.loads((repo / "reports/curate.json").read_text())
    assert {"rows_read", "rows_kept", "model", "data", "drafter"} <= set(report)
    assert json.loads((repo / "reports/throughput.json").read_text())["train"]["tokens_per_s"]
    assert (repo / "logs/runs/train.json").is_file()

    # The stages computed in floats rerun here, on the same machine (one extraction stands for
    # the four: the same code on another shard); the data stages (curate, generate, validate)
    # are compared with the committed dvc.lock, made on another machine and run, by
    # test_the_data_stages_give_the_committed_bytes.
    before, lock = tracked_outputs(repo), (repo / "dvc.lock").read_bytes()
    stages = ["validate", "extract@0", "evaluate"]
    rerun = ran_stages(run(["dvc", "repro", "-f", "-s", *stages], repo).stdout)
    assert sorted(rerun) == sorted(stages), rerun
    after = tracked_outputs(repo)
    # Not even an output hash moves (GX's report, with its run ids, is not a DVC output).
    assert (repo / "dvc.lock").read_bytes() == lock
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    assert changed <= {"reports/throughput.json"}  # the one measured figure: extract tok/s
    assert json.loads(run(["dvc", "status", "--json"], repo).stdout) == {}


@EMBEDDED
def test_readme_compare_recipes_run_and_fit_a_terminal(finished):
    repo, _ = finished
    section = (ROOT / "README.md").read_text().split("## Compare runs", 1)[1]
    block = section.split("```")[1]
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("dvc ")]
    assert len(commands) == 2
    header = run([*commands[0], "--csv"], repo).stdout.splitlines()[0].split(",")
    assert {"tau", "tau_sampled", "final_loss", "train_rows", "drafter.name",
            "hardware.name"} <= set(header)  # fmt: skip
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


@EMBEDDED
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


@EMBEDDED
def test_plan_uses_the_runs_own_metrics_and_not_for_another_target(finished):
    """Every stage records the model, data and drafter it ran on: `draftline plan` (params.yaml)
    takes the run's measured figures, and a plan for another target takes none of them. No
    memory figures (tests/ops/test_plan.py and tests/drafter/test_memory.py hold those): each
    profile's takes seconds on fake tensors."""
    repo, _ = finished
    plan = json.loads(run(["draftline", "plan", "--json", "--no-memory"], repo).stdout)
    assert plan["notes"] == []
    assert plan["inputs"]["samples"]["kind"] == "measured"
    cpu = plan["profiles"]["cpu"]["throughput"]
    assert {cpu[k]["kind"] for k in ("generate_tok_s", "extract_tok_s", "train_tok_s")} == {
        "measured"
    }
    other = json.loads(
        run(["draftline", "plan", "model=qwen3_8b", "--json", "--no-memory"], repo).stdout
    )
    assert other["inputs"]["samples"]["kind"] == "estimate"
    # One note for the run, naming its files: curate, validate, extract, train; the eval shard
    # and each train shard.
    [note] = other["notes"]
    files = 4 + 1 + len(yaml.safe_load((repo / "params.yaml").read_text())["data"]["shard_ids"])
    assert note.startswith(f"ignored {files} files (") and "not model=Qwen/Qwen3-8B" in note


@EMBEDDED
def test_exp_run_with_another_hardware_profile_composes_and_reruns_nothing(finished_run, tmp_path):
    """`dvc exp run -S hardware=b200x8` composes params.yaml through DVC's Hydra integration;
    every stage is cached (hardware is no stage's param), and the experiment lists the metrics."""
    repo = copy_run(finished_run, tmp_path / "exp")
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
            curate["train_rows"]
            == json.loads((repo / "metrics/curate.json").read_text())["train_rows"]
        )
        assert "metrics/evaluate.json" in data["metrics"]
    finally:
        run(["git", "checkout", "params.yaml"], repo)


def test_six_new_tokens_stop_the_pipeline_at_validate(tmp_path):
    """The seed's pathology end to end: tiny answers pass generation (guard off, as when the
    guard's window is not yet full) and validate refuses them; extract never runs. A pipeline
    of its own up to validate, since its generate params differ: on one shard, as the pathology
    shows in any shard and each shard's generate costs its own target load."""
    repo = copy_project(tmp_path)
    overrides = ["generate.max_new_tokens=6", "generate.guard=false", "data.num_shards=1"]
    run(["draftline", "compose", *overrides], repo)
    done = run(["dvc", "repro"], repo, check=False)
    assert done.returncode != 0
    stages = ran_stages(done.stdout)
    assert "validate" in stages, stages
    assert not [s for s in stages if s.startswith(("extract", "train"))], stages
    metrics = json.loads((repo / "metrics/validate.json").read_text())
    assert metrics["passed"] is False and metrics["completion_tokens_mean"] <= 6, metrics
    assert not (repo / "data/validated/verdict.json").exists()
    assert not (repo / "data/extracted").exists()


@EMBEDDED
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
        assert {"curate", "generate@0", "generate_eval", "extract@0", "train", "evaluate"} <= stale
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


# Stages whose outputs are bit-exact on any machine (no float arithmetic decides them, or, for
# generate, greedy decoding with a given engine identity); the float stages after them are
# deterministic per machine only.
BIT_EXACT_STAGES = ("curate", "generate@0", "generate@1", "generate@2", "generate@3",
                    "generate_eval", "validate")  # fmt: skip
# How far the trained tau may move between machines (README, "Reproducibility"). Measured: 3.539
# (AVX-512) vs 3.499 (AVX2) on the embedded default.
TAU_BOUND = 0.25


def out_hashes(stages: dict, stage: str) -> dict[str, str]:
    return {o["path"]: o["md5"] for o in stages[stage].get("outs") or []}


@EMBEDDED
@pytest.mark.float_kernels
def test_the_data_stages_give_the_committed_bytes(finished_run):
    """This session's run against the committed dvc.lock (made by `dvc repro` on the machine
    that committed it): the data stages are bit-exact, whatever the drafter's schedule. .ci/run
    reruns it under torch's generic float kernels and MKL's processor-independent path, as a
    processor without AVX2/AVX-512 rounds; on another CPU the default run is that test itself.
    A failure after a code change that changes the data means dvc.lock is stale: `dvc repro`
    and commit it."""
    committed = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    session = yaml.safe_load(finished_run.lock.read_text())["stages"]
    for stage in BIT_EXACT_STAGES:
        assert out_hashes(session, stage) == out_hashes(committed, stage), stage


@EMBEDDED
@pytest.mark.float_kernels
@pytest.mark.slow
def test_another_processor_gives_tau_within_the_bound(committed_run):
    """The committed schedule's tau (metrics/evaluate.json) within TAU_BOUND of this session's
    run on the same schedule (the committed 20 epochs, trained over the 2-epoch run's data
    stages): minutes of training, so in `.ci/run`'s float-kernel step (under generic kernels,
    the other-processor case) or `pytest -m slow`, not in the README's test command."""
    params = yaml.safe_load((committed_run.repo / "params.yaml").read_text())
    assert params["drafter"] == yaml.safe_load((ROOT / "params.yaml").read_text())["drafter"]
    tau = json.loads((ROOT / "metrics/evaluate.json").read_text())["tau"]
    here = json.loads((committed_run.repo / "metrics/evaluate.json").read_text())["tau"]
    assert abs(here - tau) <= TAU_BOUND, (tau, here)


# The Qwen3.6 twin (models/tiny-qwen36): the production target's layout in miniature, end to end.
# Its whole pipeline takes minutes of CPU beside the embedded default's, which runs the same
# stages: .ci/run runs it (marker `slow`); the README's test command does not.


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    shared = qwen36_twin(tmp_path_factory)
    return shared.repo, shared.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("qwen36-twin")
def test_the_qwen36_twin_runs_every_stage_and_the_drafter_learns(twin):
    """Slow for the first twin test (~2.5 min): the twin's one `dvc repro` of the session, which
    the other twin tests read. Online features, as the 27B trains: the twin runs inside
    training, and the drafter learns from it."""
    repo, out = twin
    assert set(ran_stages(out)) == ALL_STAGES
    assert json.loads((repo / "logs/runs/train.json").read_text())["features"] == "online"
    assert json.loads((repo / "metrics/validate.json").read_text())["passed"] is True
    ev = json.loads((repo / "reports/evaluate.json").read_text())  # every result of evaluate
    assert ev["tau"] >= 1.5 * ev["tau_untrained"], ev
    config = json.loads((repo / "models/drafter/config.json").read_text())
    mask = yaml.safe_load((repo / "conf/model/tiny_qwen36.yaml").read_text())["mask_token_id"]
    assert config["dflash_config"]["mask_token_id"] == mask
    block = config["block_size"]
    assert 1.0 <= ev["tau_sampled_untrained"] < ev["tau_sampled"] <= block, ev
    shown = run(["dvc", "exp", "show", "--json"], repo).stdout
    assert '"tau"' in shown and "tau_sampled" in shown and "final_loss" in shown


def ok_answers(repo: Path) -> list[tuple[Path, pd.DataFrame]]:
    """The twin's generated shards with every answer replaced by `OK.<|im_end|>` (the seed's
    pathology), the columns recomputed by the library as `generate` computes them."""
    from transformers import AutoTokenizer

    from draftline.core.loss_mask import completion_stats, prompt_opens_think, special_ids
    from draftline.quality.checks import completion_hash

    tokenizer = AutoTokenizer.from_pretrained(repo / "models/tiny-qwen36")
    special = special_ids(tokenizer, "<|im_end|>")
    ok = tokenizer("OK.", add_special_tokens=False)["input_ids"] + [special.end_of_turn]
    frames = []
    for shard in sorted((repo / "data/generated/train").glob("shard-*.parquet")):
        frame = pd.read_parquet(shard)
        stats = [
            completion_stats(ok, special, think_open=prompt_opens_think(p, special))
            for p in frame["prompt_ids"]
        ]
        frame["completion_ids"] = [ok] * len(frame)
        frame["num_completion_tokens"] = len(ok)
        frame["finish_reason"] = "stop"
        frame["has_think_block"] = [s.has_think_block for s in stats]
        frame["think_tokens"] = [s.think_tokens for s in stats]
        frame["answer_tokens"] = [s.answer_tokens for s in stats]
        frame["loss_mask_sum"] = [s.loss_mask_sum for s in stats]
        frame["completion_hash"] = completion_hash(ok)
        frame["completion_text"] = "OK.<|im_end|>"
        # Every turn of a multi-turn conversation answered so too.
        per_turn = list(zip(stats, frame["turns"], strict=True))
        frame["turn_finish_reasons"] = [["stop"] * n for _, n in per_turn]
        frame["turn_answer_tokens"] = [[s.answer_tokens] * n for s, n in per_turn]
        frame["turn_loss_mask_sums"] = [[s.loss_mask_sum] * n for s, n in per_turn]
        frames.append((shard, frame))
    return frames


@pytest.mark.slow
@pytest.mark.xdist_group("qwen36-twin")
def test_the_twins_shards_with_ok_answers_fail_validate_and_trip_the_guard(twin, tmp_path):
    from draftline.generation.guard import Guard, GuardAbort
    from draftline.quality.checks import COLUMNS

    repo, _ = twin
    bad = copy_project(tmp_path / "bad")
    shutil.copytree(repo / "data/curated", bad / "data/curated")
    shutil.copytree(repo / "metrics", bad / "metrics", dirs_exist_ok=True)
    (bad / "data/generated/train").mkdir(parents=True)
    frames = ok_answers(repo)
    for shard, frame in frames:
        frame.to_parquet(bad / "data/generated/train" / shard.name)
    run(["draftline", "compose", "model=tiny_qwen36"], bad)
    done = run(["draftline", "validate", "--no-progress"], bad, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "supervised_tokens_min" in done.stderr and "think_block_share" in done.stderr
    assert "turn_answer_nonempty" in done.stderr  # the empty replies mid-conversation too
    assert json.loads((bad / "metrics/validate.json").read_text())["passed"] is False

    params = yaml.safe_load((bad / "params.yaml").read_text())
    guard = Guard(params["quality"], thinking=True, max_new_tokens=128, think_in_prompt=True)
    with pytest.raises(GuardAbort, match="without closing the <think> block the prompt opened"):
        for record in frames[0][1].to_dict("records"):
            guard.observe({k: record[k] for k in (*COLUMNS, "think_tokens")})


def test_every_file_dvclive_writes_is_a_declared_output_of_train(tmp_path, repo_root):
    """An undeclared file is neither pushed by DVC nor committed by salvage: dvclive's summary
    `metrics.json` left every fresh run NOT SAFE. Train's own dvclive call, in a scratch dir."""
    from draftline.drafter.training import Metrics
    from draftline.stages import train as train_stage

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


@EMBEDDED
def test_salvage_after_a_fresh_repro_is_safe(finished_run, tmp_path):
    """Every file a fresh `dvc repro` writes is an output: DVC pushes it or salvage commits it
    (dvclive's summary `dvclive/train/metrics.json` once was neither: NOT SAFE forever)."""
    repo = copy_run(finished_run, tmp_path / "node")
    origin = tmp_path / "origin.git"
    run(["git", "init", "-q", "--bare", str(origin)], tmp_path)
    run(["git", "remote", "add", "origin", str(origin)], repo)
    remote_dir = str(tmp_path / "dvc-remote")
    run(["dvc", "remote", "modify", "--local", "local", "url", remote_dir], repo)
    done = run(["draftline", "salvage", "--remote", "local"], repo, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: SAFE" in done.stdout
    assert run(["git", "status", "--porcelain"], repo).stdout == ""


@EMBEDDED
def test_bench_results_are_listed_by_exp_show_beside_tau(finished, tmp_path):
    """`draftline bench` after a run, against two SGLang stand-ins (SGLang needs a GPU;
    tests/helpers/sglang_standin.py speaks its protocol and, started with
    `--speculative-algorithm`, reports `spec_verify_ct` as SGLang does): its acceptance length
    and speed-up are DVC metrics, in `dvc exp show` beside greedy and sampled tau."""
    from helpers.generate_helpers import StandIn

    repo, _ = finished
    drafted = ("--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", "8",
               "--accept-length", "4", "--step-s", "0.001")  # fmt: skip
    try:
        with (
            StandIn(tmp_path, *drafted) as spec,
            StandIn(tmp_path, "--step-s", "0.001") as base,
        ):
            run(["draftline", "bench", "--url", spec.url, "--baseline-url", base.url], repo)
        rows = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
        metrics = rows[0]["data"]["metrics"]
        bench = metrics["metrics/bench/bench.json"]["data"]
        assert 3.0 < bench["acceptance_length"] <= 4.0 and bench["speedup"] > 0
        assert {"tau", "tau_sampled"} <= set(metrics["metrics/evaluate.json"]["data"])
    finally:
        (repo / "metrics/bench/bench.json").unlink(missing_ok=True)


@EMBEDDED
def test_benchmark_files_and_sources_are_eval_sets_with_their_own_metrics(finished, tmp_path):
    """User-supplied benchmark prompt files (gsm8k- and mt-bench-style JSONL in data/benchmarks/,
    nothing downloaded) make evaluate rerun alone and report tau per file in `dvc exp show`; a
    held-out split of two input files reports tau per source, one of two thinking modes tau per
    mode. On the same run, multi-turn conversations were regenerated turn by turn into one
    sequence each."""
    repo, _ = finished
    copy = tmp_path / "benchmarks"
    shutil.copytree(repo, copy, symlinks=True)
    rows = pd.concat(
        pd.read_parquet(p) for p in sorted((copy / "data/generated/train").glob("*.parquet"))
    )
    multi = rows[rows["turns"] > 1]
    assert len(multi) > 20 and (multi["history_spans"].map(len) == multi["turns"] - 1).all()

    questions = ["How many items are in this list: lemon, yogurt, bread?",
                 "Say the opposite of hot.", "What colour is a banana?"]  # fmt: skip
    bench = copy / "data/benchmarks"
    (bench / "gsm8k.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n" for q in questions)
    )
    (bench / "mt_bench.jsonl").write_text(
        "".join(
            json.dumps({"question_id": i, "turns": [q, "Shorter."]}) + "\n"
            for i, q in enumerate(questions)
        )  # fmt: skip
    )
    done = run(["dvc", "repro"], copy)
    assert ran_stages(done.stdout) == ["evaluate"]
    shown = json.loads(run(["dvc", "exp", "show", "--json"], copy).stdout)
    evaluated = shown[0]["data"]["metrics"]["metrics/evaluate.json"]["data"]
    assert set(evaluated["benchmarks"]) == {"gsm8k", "mt_bench"}
    for figures in evaluated["benchmarks"].values():
        assert figures["num_prompts"] == 3 and figures["tau"] >= 1.0 and figures["tau_sampled"]
    assert "tau_source" not in evaluated  # one input file: nothing to split

    # Two input files in the held-out split (the curated eval table's `source`) and a thinking
    # mix in it, in one evaluate (each a load of the target): per-source and per-mode tau in
    # `dvc exp show`. Only the rows' labels change here (a real mix regenerates every stage:
    # data.thinking_share), which is all evaluate groups by; tau itself stays the run's.
    curated = pd.read_parquet(copy / "data/curated/eval.parquet")
    curated["source"] = [f"data/{'code' if i % 2 else 'chat'}/set.{i % 2}.jsonl"
                         for i in range(len(curated))]  # fmt: skip
    two_sources = tmp_path / "eval_two_sources.parquet"
    curated.to_parquet(two_sources)
    held_out = pd.read_parquet(copy / "data/generated/eval.parquet")
    held_out["thinking"] = [i % 2 == 0 for i in range(len(held_out))]
    mixed = tmp_path / "eval_mixed.parquet"
    held_out.to_parquet(mixed)
    run(["draftline", "evaluate", "--curated-eval", str(two_sources), "--eval", str(mixed)], copy)
    shown = json.loads(run(["dvc", "exp", "show", "--json"], copy).stdout)
    split = shown[0]["data"]["metrics"]["metrics/evaluate.json"]["data"]
    assert set(split["tau_source"]) == {"data/chat/set.0.jsonl", "data/code/set.1.jsonl"}
    assert {"tau_thinking", "tau_no_thinking"} <= set(split)
    assert split["tau"] == evaluated["tau"]
