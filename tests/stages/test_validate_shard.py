"""`draftline validate --shard K`: one generated train shard judged alone, with the real Great
Expectations suite, so training can follow generation shard by shard. Shards are written as
parquet files in a temporary folder (the table of docs/pipeline.md), as in test_validate.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.generated_samples import (
    failed_requests,
    samples_frame,
    seed_pathology,
    write_generated,
)
from helpers.validate_stage import NUM_SHARDS, run_stage, stage_args

from draftline.quality import checks, shard_gate
from draftline.quality.check_parts import Check
from draftline.stages import validate as stage

WHOLE_RUN_OUTPUTS = (
    "data/validated/verdict.json",
    "metrics/validate.json",
    "reports/validate.json",
    "reports/validate/summary.json",
    "plots/validate",
)


def shard_verdict(root: Path, shard: int) -> Path:
    return root / "data" / "validated" / "shards" / f"shard-{shard}.json"


def with_bad_rows(frame: pd.DataFrame, bad: pd.DataFrame, shard: int, count: int) -> pd.DataFrame:
    """`frame` with the first `count` rows of generated shard `shard` (write_generated deals
    rows round-robin) taken from `bad`."""
    out = frame.copy()
    rows = out.index[shard::NUM_SHARDS][:count]
    out.loc[rows] = bad.loc[rows]
    return out


def test_a_good_shard_passes_and_writes_only_its_verdict(workdir):
    write_generated(workdir, samples_frame(300), NUM_SHARDS)
    assert stage.run(stage_args(shard=1)) == 0

    path = shard_verdict(workdir, 1)
    verdict = json.loads(path.read_text())
    assert verdict["passed"] is True and verdict["failed_checks"] == []
    assert (verdict["shard"], verdict["num_samples"]) == (1, 100)
    assert verdict["file"] == "shard-1.parquet"
    assert verdict["checks"]["row_count"]["bound"] == "== 100 rows (the curated train count)"
    assert verdict["within_sampling_noise"] == {}
    # The whole run's checks, every one of them, on the shard.
    whole = checks.run_checks(samples_frame(300), stage_quality(), thinking=True, expected_rows=300)
    assert list(verdict["checks"]) == sorted(r.name for r in whole)
    # GX results and Data Docs beside the whole run's, in the folder no DVC output holds.
    report = workdir / "reports" / "validate" / "shards" / "shard-1"
    assert (report / "data_docs" / "index.html").is_file()
    assert json.loads((report / "results.json").read_text())["passed"] is True
    # The whole run's outputs are not the shard's to write.
    assert [p for p in WHOLE_RUN_OUTPUTS if (workdir / p).exists()] == []
    assert not shard_verdict(workdir, 0).exists()

    # Deterministic: a rerun writes the same bytes, so it changes no DVC hash.
    first = path.read_bytes()
    assert stage.run(stage_args(shard=1)) == 0
    assert path.read_bytes() == first


def test_a_mostly_empty_shard_fails_naming_the_check_and_leaves_no_verdict(workdir):
    """The seed's data (87% of replies "OK.", 6 supervised tokens) in shard 2 only, through the
    real command: shard 2 fails and keeps no verdict, not even an old one; shard 0 passes."""
    frame = samples_frame(300)
    write_generated(
        workdir, with_bad_rows(frame, seed_pathology(frame, share=1.0), 2, 87), NUM_SHARDS
    )
    stale = shard_verdict(workdir, 2)
    stale.parent.mkdir(parents=True)
    stale.write_text('{"passed": true}')  # an old pass must not survive a failed run

    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "validate", "--shard", "2", "--no-progress"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "validate shard 2: FAILED" in proc.stderr
    for name in ("supervised_tokens_min", "supervised_tokens_mode_share", "unique_completions"):
        assert name in proc.stderr
    assert ">= 0.90 of answered samples" in proc.stderr  # the bound in plain words
    assert not stale.exists()

    # The decision is kept beside GX's results, so the failure can be read.
    report = workdir / "reports" / "validate" / "shards" / "shard-2" / "summary.json"
    summary = json.loads(report.read_text())
    assert summary["passed"] is False
    assert {"supervised_tokens_min", "supervised_tokens_mode_share"} <= set(
        summary["failed_checks"]
    )
    assert summary["checks"]["supervised_tokens_mode_share"]["observed"] == pytest.approx(0.87)
    assert summary["within_sampling_noise"] == {}  # 87 of 100: nowhere near noise
    assert [p for p in WHOLE_RUN_OUTPUTS if (workdir / p).exists()] == []

    assert stage.run(stage_args(shard=0)) == 0
    assert json.loads(shard_verdict(workdir, 0).read_text())["passed"] is True


def test_a_failure_within_sampling_noise_passes_and_is_recorded(workdir):
    """Two failed requests in a shard of 100 (2% > max_error_share=0.01) are noise: the whole
    run (2 of 300) accepts the same data, so the shard passes, saying so; ten in 100 are not."""
    frame = samples_frame(300)
    errors = failed_requests(frame, share=1.0)
    write_generated(workdir, with_bad_rows(frame, errors, 0, 2), NUM_SHARDS)
    assert stage.run(stage_args(shard=0)) == 0
    verdict = json.loads(shard_verdict(workdir, 0).read_text())
    assert verdict["checks"]["error_share"] == {
        "observed": 0.02,
        "bound": "<= 0.01 of samples",
        "passed": True,
    }
    noise = verdict["within_sampling_noise"]["error_share"]
    assert (noise["rows"], noise["bad_rows"], noise["bound"]) == (100, 2, 0.01)
    assert noise["p_value"] == pytest.approx(1 - 0.99**100 - 100 * 0.01 * 0.99**99, rel=1e-3)
    rc, whole = run_stage(workdir)
    assert rc == 0 and whole["checks"]["error_share"]["observed"] == pytest.approx(2 / 300)

    write_generated(workdir, with_bad_rows(frame, errors, 0, 10), NUM_SHARDS)
    assert stage.run(stage_args(shard=0)) == 1
    assert not shard_verdict(workdir, 0).exists()
    summary = json.loads(
        (workdir / "reports" / "validate" / "shards" / "shard-0" / "summary.json").read_text()
    )
    assert summary["failed_checks"] == ["error_share"]


@pytest.mark.parametrize(("empty", "passed"), [(12, True), (87, False)])
def test_quantile_and_share_checks_are_judged_against_sampling_noise(empty, passed):
    """Without GX: 12 of 100 replies of 6 tokens put the 0.1 quantile under its low bound of 8
    and the supervised share under 0.90, both within noise of the bounds; 87 of 100 do not."""
    frame = samples_frame(100)
    table = seed_pathology(frame, share=empty / 100).drop(columns=["completion_ids"])
    quality = stage_quality()
    results = checks.run_checks(table, quality, thinking=True, expected_rows=100)
    exact = {r.name for r in checks.failures(results)}
    assert {"completion_tokens_q10", "supervised_tokens_min"} <= exact

    judged = shard_gate.judge(table, quality, thinking=True, expected_rows=100, results=results)
    assert judged.passed is passed
    q10 = shard_gate.sampling_noise(
        next(c for c in define(table, quality) if c.name == "completion_tokens_q10"), table
    )
    assert q10 is not None and (q10.rows, q10.bad_rows, q10.bound) == (100, empty, 0.1)
    if passed:
        assert exact == set(judged.noise)
        assert judged.noise["completion_tokens_q10"].p_value >= shard_gate.ALPHA
    else:
        assert {"completion_tokens_q10", "supervised_tokens_min"} <= {
            r.name for r in checks.failures(judged.results)
        }
        assert q10.p_value < 1e-40


def test_exact_checks_are_never_noise():
    """A repeated id or a lost row fails a shard of any size."""
    table = samples_frame(20).drop(columns=["completion_ids"])
    table.loc[table.index[0], "id"] = table["id"].iloc[1]
    quality = stage_quality()
    results = checks.run_checks(table, quality, thinking=True, expected_rows=21)
    judged = shard_gate.judge(table, quality, thinking=True, expected_rows=21, results=results)
    assert {r.name for r in checks.failures(judged.results)} == {"unique_ids", "row_count"}
    assert judged.noise == {}


def test_binomial_tail_is_the_exact_sum():
    def exact(k: int, n: int, p: float) -> float:
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(max(k, 0), n + 1))

    for k, n, p in [(0, 10, 0.3), (1, 1, 0.5), (2, 100, 0.01), (15, 74, 0.2), (60, 74, 0.1)]:
        assert shard_gate.binomial_tail(k, n, p) == pytest.approx(exact(k, n, p), rel=1e-9)
    assert shard_gate.binomial_tail(11, 10, 0.5) == 0.0
    assert shard_gate.binomial_tail(3, 10, 0.0) == 0.0
    assert shard_gate.binomial_tail(3, 10, 1.0) == 1.0
    # A shard of 100,000 rows: tiny tails stay finite and positive, large ones near 1.
    assert 0.0 < shard_gate.binomial_tail(1_200, 100_000, 0.01) < 1e-9
    assert shard_gate.binomial_tail(900, 100_000, 0.01) > 0.99


def test_a_shard_curate_does_not_know_or_a_missing_file_stops(workdir):
    paths = write_generated(workdir, samples_frame(300), NUM_SHARDS)
    with pytest.raises(SystemExit, match=r"has shards \[0, 1, 2\], not 7"):
        stage.run(stage_args(shard=7))
    paths[1].unlink()
    with pytest.raises(SystemExit, match=r"shard-1.parquet.*dvc repro generate@1"):
        stage.run(stage_args(shard=1))
    assert not shard_verdict(workdir, 1).exists()


def define(table: pd.DataFrame, quality: dict) -> list[Check]:
    return checks.define_checks(table, quality, thinking=True, expected_rows=len(table))


def stage_quality() -> dict:
    conf = Path(__file__).resolve().parents[2] / "conf" / "quality" / "default.yaml"
    return yaml.safe_load(conf.read_text())
