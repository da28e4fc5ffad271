"""`draftline doctor` on a node where SGLang is installed (here: the pinned engines'
environment, named by $DRAFTLINE_SGLANG_PYTHON, as on a node where SGLang has its own): the
command line `serve start` would launch goes through SGLang's own parser, and a flag it rejects
is named before anything is launched."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.engine_helpers import REPO, engine_env

from draftline.commands import doctor
from draftline.runtime import params

pytestmark = pytest.mark.engines


def rows_for(overrides: list[str]) -> dict[str, tuple[bool, str]]:
    composed = params.compose(overrides, REPO / "conf")
    return {what: (ok, detail) for what, ok, detail in doctor._engine_argv_rows(composed)}


def test_doctor_names_the_flag_sglang_rejects(engine_python: Path, monkeypatch):
    for key, value in engine_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DRAFTLINE_SGLANG_PYTHON", str(engine_python))
    model = ["model=qwen3_6_27b", "hardware=b200x8"]
    ok, detail = rows_for(model)["sglang command line"]
    assert ok, detail
    assert detail.startswith("sglang_router.launch_server") and "accepts" in detail
    removed = "hardware.sglang.extra_args=[--mamba-scheduler-strategy,extra_buffer]"
    ok, detail = rows_for([*model, removed])["sglang command line"]
    assert not ok
    assert "unrecognized arguments: --mamba-scheduler-strategy extra_buffer" in detail, detail
