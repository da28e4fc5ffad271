"""The `validate` stage with the real Great Expectations suite, over generated shards written as
parquet files in a temporary folder (the table of docs/pipeline.md, token lists included)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.generated_samples import (
    mixed_modes,
    samples_frame,
    seed_pathology,
    truncated,
    write_generated,
    write_params,
)
from helpers.validate_stage import NUM_SHARDS, run_stage, stage_args

from draftline.quality import checks, shards, validation
from draftline.stages import validate as stage


def test_healthy_data_passes_and_writes_every_output(workdir):
    write_generated(workdir, samples_frame(300), NUM_SHARDS)
    rc, metrics = run_stage(workdir)
    assert rc == 0, metrics["failed_checks"]

    verdict = json.loads((workdir / "data" / "validated" / "verdict.json").read_text())
    assert verdict["passed"] is True and verdict["num_samples"] == 300
    assert [s["file"] for s in verdict["shards"]] == [
        f"shard-{k}.parquet" for k in range(NUM_SHARDS)
    ]

    assert metrics["passed"] is True and metrics["failed_checks"] == []
    assert metrics["checks"]["supervised_tokens_min"] == {"observed": 1.0, "passed": True}
    assert 20 <= metrics["completion_tokens_mean"] <= 90
    assert metrics["completion_tokens_p10"] <= metrics["completion_tokens_p50"]
    assert metrics["shards"]["00000"] == {"curated": 100, "generated": 100}
    # The run it measured, for `draftline plan`.
    assert (metrics["model"], metrics["data"], metrics["drafter"]) == (
        "models/tiny-target",
        "sample",
        "dflash_tiny",
    )

    # GX results JSON: both suites ran and every expectation succeeded.
    results = json.loads((workdir / "reports" / "validate" / "results.json").read_text())
    gx_runs = results["great_expectations"]
    assert len(gx_runs) == 2 and all(run["success"] for run in gx_runs)
    # One thinking mode only: the per-mode suites have no checks of their own.
    assert {run["suite"] for run in gx_runs} == {
        validation.SUITES["all"],
        validation.SUITES["answered"],
    }
    expectations = [e for run in gx_runs for e in run["validation_result"]["results"]]
    checked = {n for e in expectations for n in e["expectation_config"]["meta"]["checks"]}
    assert checked == set(metrics["checks"])
    # Data Docs HTML at a stable path, with a page per validation run.
    docs = workdir / "reports" / "validate" / "data_docs"
    assert (docs / "index.html").is_file()
    pages = list((docs / "validations").rglob("*.html"))
    assert len(pages) == 2
    assert "supervised_tokens_min" in "".join(p.read_text() for p in pages)

    with open(workdir / "plots" / "validate" / "supervised_tokens.csv") as f:
        hist = list(csv.DictReader(f))
    assert sum(int(r["samples"]) for r in hist) == 300
    with open(workdir / "plots" / "validate" / "completion_tokens.csv") as f:
        cdf = list(csv.DictReader(f))
    assert len(cdf) == 101 and cdf[0]["share_of_samples"] == "0.00"


def test_seed_pathology_fails_naming_the_expectation(workdir):
    """The seed's data (87% answered "OK.", 6 supervised tokens) through the real command."""
    write_generated(workdir, seed_pathology(samples_frame(300), share=0.87), NUM_SHARDS)
    stale = workdir / "data" / "validated" / "verdict.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"passed": true}')  # an old pass must not survive a failed run

    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "validate", "--no-progress"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "supervised_tokens_min" in proc.stderr
    assert "supervised_tokens_mode_share" in proc.stderr
    assert ">= 0.90 of answered samples" in proc.stderr  # the bound in plain words
    assert "FAILED" in proc.stderr
    assert not stale.exists()

    metrics = json.loads((workdir / "reports" / "validate" / "summary.json").read_text())
    assert metrics["passed"] is False
    assert metrics["checks"]["supervised_tokens_mode_share"]["observed"] == pytest.approx(0.87)
    # The histogram shows the spike at 6.
    with open(workdir / "plots" / "validate" / "supervised_tokens.csv") as f:
        spike = {int(r["supervised_tokens"]): int(r["samples"]) for r in csv.DictReader(f)}
    assert spike[6] == 261
    # Reports are written on failure too, so the failure can be read.
    assert (workdir / "reports" / "validate" / "data_docs" / "index.html").is_file()


def test_truncation_heavy_data_fails(workdir):
    write_generated(workdir, truncated(samples_frame(300), share=0.25), NUM_SHARDS)
    rc, metrics = run_stage(workdir)
    assert rc == 1
    assert "truncated_share" in metrics["failed_checks"]
    assert metrics["checks"]["truncated_share"]["observed"] == pytest.approx(0.25)
    assert metrics["finish_reasons"] == {"stop": 225, "length": 75}
    assert not (workdir / "data" / "validated" / "verdict.json").exists()


def test_duplicate_ids_fail(workdir):
    frame = samples_frame(300)
    frame.loc[frame.index[0], "id"] = frame["id"].iloc[1]  # the same sample in two shards
    write_generated(workdir, frame, NUM_SHARDS)
    rc, metrics = run_stage(workdir)
    assert rc == 1
    assert metrics["failed_checks"] == ["unique_ids"]
    assert metrics["checks"]["unique_ids"]["observed"] == 2


def test_missing_rows_fail(workdir, capsys):
    frame = samples_frame(300)
    # Shard 1 lost two of its curated samples.
    write_generated(workdir, frame, NUM_SHARDS, curated_rows=[100, 102, 100])
    rc, metrics = run_stage(workdir)
    assert rc == 1
    assert metrics["failed_checks"] == ["row_count"]
    assert metrics["checks"]["row_count"]["observed"] == 300
    assert metrics["shards"]["00001"] == {"curated": 102, "generated": 100}
    assert "shard 00001: 102 curated rows, 100 generated" in capsys.readouterr().err


def test_missing_shard_file_fails_before_validating(workdir):
    paths = write_generated(workdir, samples_frame(300), NUM_SHARDS)
    paths[2].unlink()  # what `dvc repro --allow-missing` leaves in a fresh clone
    with pytest.raises(SystemExit, match=r"shard-2.parquet.*dvc repro generate@2"):
        stage.run(stage_args())
    assert not (workdir / "data" / "validated" / "verdict.json").exists()


def test_curate_metrics_must_match_the_shards(workdir):
    write_generated(workdir, samples_frame(300), NUM_SHARDS)
    write_params(workdir, NUM_SHARDS + 1)
    with pytest.raises(SystemExit, match="dvc repro curate"):
        stage.run(stage_args())


def test_shards_without_completion_hash_are_hashed_from_their_ids(workdir, capsys):
    write_generated(workdir, samples_frame(300), NUM_SHARDS, with_hash=False)
    table = shards.read_scalar_columns(shards.shard_paths(Path("data/generated/train"), [0, 1, 2]))
    assert "no completion_hash column" in capsys.readouterr().err
    expected = samples_frame(300).set_index("id")["completion_hash"]
    assert (table.set_index("id")["completion_hash"] == expected.loc[table["id"]]).all()


def test_gx_and_pandas_measure_the_same(tmp_path):
    """The two sides of the one definition agree on the observed value and the verdict."""
    import yaml

    cfg = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "conf/quality/default.yaml").read_text()
    )
    table = truncated(seed_pathology(samples_frame(300), share=0.5), share=0.1)
    table = table.drop(columns=["completion_ids"])
    outcome = validation.run_suite(
        table, cfg, thinking=True, expected_rows=310, report_dir=tmp_path
    )
    measured = checks.run_checks(table, cfg, thinking=True, expected_rows=310)
    assert [r.name for r in outcome.results] == [r.name for r in measured]
    for gx_side, pandas_side in zip(outcome.results, measured, strict=True):
        assert gx_side.passed == pandas_side.passed, gx_side.name
        assert gx_side.observed == pytest.approx(pandas_side.observed), gx_side.name
    assert not outcome.passed
    saved = json.loads(outcome.results_path.read_text())
    assert {c["name"] for c in saved["checks"] if not c["passed"]} == {
        r.name for r in checks.failures(measured)
    }


def test_a_thinking_mix_runs_a_gx_suite_per_mode_that_agrees_with_pandas(workdir):
    """Shards that mix thinking on and off (`data.thinking_share`): validate passes healthy
    data, with one GX suite per mode beside the all-rows and answered-rows suites, and GX and
    pandas agree on every check."""
    table = mixed_modes(samples_frame(300))
    write_generated(workdir, table, NUM_SHARDS)
    rc, metrics = run_stage(workdir)
    assert rc == 0, metrics["failed_checks"]
    assert "completion_tokens_q50_no_thinking" in metrics["checks"]
    gx_runs = json.loads((workdir / "reports/validate/results.json").read_text())
    assert {run["suite"] for run in gx_runs["great_expectations"]} == {
        validation.SUITES[rows] for rows in ("all", "answered", "thinking", "no_thinking")
    }  # one-turn rows: no turn or conversation suites
    frame = table.drop(columns=["completion_ids"])
    outcome = validation.run_suite(
        frame, stage_quality(), thinking=True, expected_rows=300, report_dir=workdir / "gx"
    )
    measured = checks.run_checks(frame, stage_quality(), thinking=True, expected_rows=300)
    for gx_side, pandas_side in zip(outcome.results, measured, strict=True):
        assert (gx_side.name, gx_side.passed) == (pandas_side.name, pandas_side.passed)
        assert gx_side.observed == pytest.approx(pandas_side.observed), gx_side.name


def stage_quality() -> dict:
    import yaml

    return yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "conf/quality/default.yaml").read_text()
    )


@pytest.fixture
def data_docs(workdir) -> Path:
    write_generated(workdir, samples_frame(300), NUM_SHARDS)
    rc, _ = run_stage(workdir)
    assert rc == 0
    return workdir / "reports" / "validate" / "data_docs"


REMOTE_ASSET = re.compile(
    r"<(?:script|link|img)\b[^>]*\b(?:src|href)\s*=\s*[\"']https?://|url\([\"']?https?://", re.I
)


def test_data_docs_need_no_network_and_show_think_escaped(data_docs):
    pages = sorted(data_docs.rglob("*.html"))
    assert len(pages) == 5  # index, two suites, two validation runs
    for page in pages:
        text = page.read_text()
        assert not REMOTE_ASSET.findall(text), (page, REMOTE_ASSET.findall(text))
        assert "static/styles/offline.css" in text
    assert (data_docs / "static" / "images" / "logo-long.png").stat().st_size > 0
    answered = next((data_docs / "validations").rglob("draftline_answered_rows*.html")).read_text()
    assert "with a &lt;think&gt;...&lt;/think&gt; block" in answered
    assert "<think>" not in answered


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)"
)
def test_data_docs_render_in_a_browser_without_network(data_docs, tmp_path):
    """Headless Chromium with every host unresolvable, as on an offline node: the validation
    page renders its checks, and the description shows "<think>" as text."""
    page = next((data_docs / "validations").rglob("draftline_answered_rows*.html"))
    done = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
            "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert "think_block_share" in dom and "supervised_tokens_min" in dom
    assert "&lt;think&gt;...&lt;/think&gt;" in dom  # a text node, not a swallowed element
    assert "<think>" not in dom
