"""The `curate` stage on small synthetic inputs written in tmp_path, with the real tiny target
tokenizer (models/tiny-target): a cut input file, the reject-rate failure with what was wrong,
the report and metrics it writes, and byte-identical reruns."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml
from helpers.curate_helpers import BUDGET, THINKING, mixed_input, rejected_rows, write_rows

from draftline.stages import curate as stage


def write_params(root: Path, tiny_target_dir: Path, sources: list[Path], **data: Any) -> Path:
    params = {
        "model": {"path": str(tiny_target_dir), "revision": None,
                  "chat_template_kwargs": THINKING},
        "drafter": {"name": "dflash_tiny"},
        "data": {"name": "mixed", "sources": [str(s) for s in sources], "eval_fraction": 0.2,
                 "num_shards": 3,
                 "shard_ids": [0, 1, 2], "max_prompt_tokens": BUDGET, "max_reject_rate": 0.25,
                 "split_seed": "test", **data},
        "hardware": {"name": "cpu", "engine": "local", "precision": "fp32"},
    }  # fmt: skip
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def stage_args(params: Path, out: Path, metrics: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stage.add_arguments(parser)
    return parser.parse_args(
        [
            "--params",
            str(params),
            "--out",
            str(out),
            "--metrics",
            str(metrics),
            "--no-progress",
            "--run-log",
            str(metrics.with_suffix(".run.json")),
            "--report",
            str(metrics.with_suffix(".report.json")),
        ]  # fmt: skip
    )


def test_stage_fails_on_a_cut_file_in_its_lines(tmp_path, tiny_target_dir, capsys):
    folder = tmp_path / "in"
    write_rows(folder / "a.jsonl", [{"prompt": f"p {i}"} for i in range(40)], gz=True)
    data = (folder / "a.jsonl.gz").read_bytes()
    (folder / "a.jsonl.gz").write_bytes(data[: len(data) // 2])
    params = write_params(tmp_path, tiny_target_dir, [folder], max_reject_rate=0.9)
    out, metrics_path = tmp_path / "data" / "curated", tmp_path / "metrics" / "curate.json"
    assert stage.run(stage_args(params, out, metrics_path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "curate: FAILED: 1 input file is cut short, corrupt or empty:"
    assert err[1].startswith(f"  {folder / 'a.jsonl.gz'}: cut short or corrupt after ")
    assert len(err) == 2 and not out.exists() and not metrics_path.exists()


def test_stage_fails_over_the_reject_rate_saying_what_was_wrong(tmp_path, tiny_target_dir, capsys):
    mixed_input(tmp_path / "in", good=20, bad=15)
    params = write_params(tmp_path, tiny_target_dir, [tmp_path / "in"], max_reject_rate=0.25)
    out, metrics_path = tmp_path / "data" / "curated", tmp_path / "metrics" / "curate.json"
    assert stage.run(stage_args(params, out, metrics_path)) == 1
    err = capsys.readouterr().err
    assert "FAILED: 15 of 44 rows rejected (34.1%), over data.max_reject_rate=25.0%" in err
    # Tables and metrics are written anyway, so the rejected rows can be read.
    rejected = rejected_rows(out)
    assert len(rejected) == 15
    example = rejected[0]
    assert (
        f"malformed_json: 15 rows, e.g. {example['source']}:{example['line']}: "
        f"{example['detail']}\n      {example['raw']}" in err
    )
    assert f"{out}/rejected.parquet" in err and "data.max_reject_rate" in err
    # The report: results, then the run's identity (what `draftline plan` matches measured
    # figures on); the DVC metrics: the figures that compare runs.
    report = json.loads(metrics_path.with_suffix(".report.json").read_text())
    assert report["rows_rejected"] == 15
    assert set(report) == {*stage.RESULT_KEYS, "model", "data", "drafter"}
    metrics = json.loads(metrics_path.read_text())
    assert metrics == {k: report[k] for k in stage.COMPARE_KEYS}
    summary = json.loads((out / "summary.json").read_text())  # the details, cached with the data
    assert summary["rejected_by_reason"]["malformed_json"] == 15 and "shard_rows" in summary

    params = write_params(tmp_path, tiny_target_dir, [tmp_path / "in"], max_reject_rate=0.5)
    assert stage.run(stage_args(params, out, metrics_path)) == 0
    assert "FAILED" not in capsys.readouterr().err
    # The run it measured, for `draftline plan`.
    report = json.loads(metrics_path.with_suffix(".report.json").read_text())
    assert (report["model"], report["data"], report["drafter"]) == (
        str(tiny_target_dir),
        "mixed",
        "dflash_tiny",
    )


def test_two_runs_give_byte_identical_outputs(tmp_path, tiny_target_dir):
    mixed_input(tmp_path / "in", good=60, bad=5)
    params = write_params(tmp_path, tiny_target_dir, [tmp_path / "in"])
    outputs = []
    for name in ("one", "two"):
        out, metrics = tmp_path / name / "curated", tmp_path / name / "curate.json"
        assert stage.run(stage_args(params, out, metrics)) == 0
        outputs.append(out)
    files = sorted(p.relative_to(outputs[0]) for p in outputs[0].rglob("*") if p.is_file())
    assert [f.as_posix() for f in files] == [
        "eval.parquet", "rejected.parquet", "summary.json", "train/shard-0.parquet",
        "train/shard-1.parquet", "train/shard-2.parquet",
    ]  # fmt: skip
    for f in files:
        assert (outputs[0] / f).read_bytes() == (outputs[1] / f).read_bytes(), f
    assert (tmp_path / "one" / "curate.json").read_bytes() == (
        tmp_path / "two" / "curate.json"
    ).read_bytes()
    # Curated tables are sorted by id; every row is in the shard its id says.
    for shard in range(3):
        table = pq.read_table(outputs[0] / "train" / f"shard-{shard}.parquet")
        ids = table.column("id").to_pylist()
        assert ids == sorted(ids) and set(table.column("shard").to_pylist()) <= {shard}
