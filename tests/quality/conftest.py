from __future__ import annotations

import pytest
from helpers.generated_samples import write_params
from helpers.validate_stage import NUM_SHARDS


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A temporary folder with params.yaml, the stage's working directory."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, NUM_SHARDS)
    return tmp_path
