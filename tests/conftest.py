"""Shared test setup. Tests run on a 2-core machine: keep torch to few threads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Torch threads per process: at most 2, and the cores shared among pytest-xdist's workers
# (oversubscribed threads spin, not work). A value the caller set is kept; the one set here
# for the controller is recomputed in each worker, which inherits it.
if os.environ.get("DRAFTLINE_TEST_THREADS") == os.environ.get("OMP_NUM_THREADS", "unset"):
    os.environ.pop("OMP_NUM_THREADS", None)
if "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, min(2, (os.cpu_count() or 1) // _workers)))
    os.environ["DRAFTLINE_TEST_THREADS"] = os.environ["OMP_NUM_THREADS"]
# Workers that share the cores also share them with the 2-thread builds and stages: OpenMP's
# threads then spin at every barrier while their partner is descheduled. Measured on 2 cores, a
# 60-step build of the tiny target (same weights either way): 13.7 s alone, 128.7 s beside one
# busy thread with the default wait policy, 22.3 s with PASSIVE (18.7 s alone).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One memory-figure cache for the whole run (subprocesses included), outside the checkout.
os.environ.setdefault("DRAFTLINE_MEMORY_CACHE", tempfile.mkdtemp(prefix="draftline-memory-"))

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """The committed embedded target (models/tiny-target)."""
    path = REPO_ROOT / "models" / "tiny-target"
    assert (path / "config.json").exists(), (
        "models/tiny-target is missing: draftline build-tiny-target"
    )
    return path


def pytest_report_header() -> str:
    """Which float kernels this run uses (.ci/run reruns some tests under generic ones)."""
    import torch

    env = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
    chosen = ", ".join(f"{k}={os.environ[k]}" for k in env if k in os.environ) or "defaults"
    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()} ({chosen})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that share a pipeline run (an xdist group each) go first: they are the longest
    chains, so they start at once on their workers while the other tests fill the rest."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Whether the session's run of the embedded default trains the committed schedule: only
    when a selected test compares it with the committed run (tests/helpers/embedded_run.py).
    Each xdist worker collects the same selection, so every worker decides the same."""
    # Imported here: helpers.embedded_run copies os.environ as this module leaves it.
    from helpers.embedded_run import COMMITTED_SCHEDULE, COMMITTED_SCHEDULE_SELECTED

    selected = any(item.get_closest_marker(COMMITTED_SCHEDULE) for item in session.items)
    session.config.stash[COMMITTED_SCHEDULE_SELECTED] = selected


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME of its own and no AWS settings from this machine, so credential lookups (DVC's
    config, botocore) run for real on what the test sets up."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return home
