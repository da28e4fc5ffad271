"""The `validate` stage run in a temporary folder of generated shards (tests/stages/test_validate*
and the quality tests that run it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftline.stages import validate as stage

NUM_SHARDS = 3


def stage_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stage.add_arguments(parser)
    args = parser.parse_args(["--no-progress"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def run_stage(root: Path) -> tuple[int, dict]:
    """The stage's exit code and its full summary (reports/validate/summary.json), checked to
    hold what reports/validate.json and metrics/validate.json hold."""
    rc = stage.run(stage_args())
    summary = json.loads((root / "reports" / "validate" / "summary.json").read_text())
    report = json.loads((root / "reports" / "validate.json").read_text())
    keys = (*stage.RESULT_KEYS, "model", "data", "drafter")  # results, then the run's identity
    assert report == {k: summary[k] for k in keys if k in summary}  # yield: with extract params
    metrics = json.loads((root / "metrics" / "validate.json").read_text())
    assert metrics == {k: summary[k] for k in stage.COMPARE_KEYS}
    return rc, summary
