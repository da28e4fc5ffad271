"""Shared test setup. Tests run on a 2-core machine: keep torch to few threads."""

from __future__ import annotations

import atexit
import os
import shutil
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
# One memory-figure cache for the whole run (subprocesses and xdist workers inherit it), outside
# the checkout, made by the process that starts the run and removed when it ends.
if "DRAFTLINE_MEMORY_CACHE" not in os.environ:
    os.environ["DRAFTLINE_MEMORY_CACHE"] = tempfile.mkdtemp(prefix="draftline-memory-")
    atexit.register(shutil.rmtree, os.environ["DRAFTLINE_MEMORY_CACHE"], ignore_errors=True)

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


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which float kernels this run uses (.ci/run reruns some tests under generic ones), and how
    to run a file named on the command line whose tests the default marker filter leaves out."""
    import torch

    env = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
    chosen = ", ".join(f"{k}={os.environ[k]}" for k in env if k in os.environ) or "defaults"
    lines = [f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()} ({chosen})"]
    return lines + deselected_file_hints(config)


# Markers the default run (pyproject's addopts) leaves out, and how each is run.
DESELECTED_MARKERS = {
    "two_nodes": "-m two_nodes -n 0",
    "vllm": "-m vllm (in .venv-vllm: bash .ci/vllm test)",
    "engines": "-m engines (in .venv-engines: bash .ci/engines test)",
    "rebuild": "-m rebuild",
    "slow": "-m slow",
}


def deselected_file_hints(config: pytest.Config) -> list[str]:
    """One line per file named on the command line whose module is marked with a marker the
    current `-m` leaves out: a plain `pytest FILE` would otherwise select nothing, silently."""
    expression = config.option.markexpr or ""
    lines = []
    for arg in config.args:
        path = Path(arg.split("::")[0])
        files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        for file in files:
            if not file.is_file():
                continue
            text = file.read_text(encoding="utf-8", errors="replace")
            for marker, how in DESELECTED_MARKERS.items():
                module_wide = f"pytestmark = pytest.mark.{marker}" in text
                if module_wide and f"not {marker}" in expression:
                    lines.append(
                        f"{file} is marked {marker}, which -m '{expression}' leaves out: "
                        f"run it with `pytest {how} {file}`"
                    )
    return lines


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that share a pipeline run (an xdist group each) go first: they are the longest
    chains, so they start at once on their workers while the other tests fill the rest."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary folder with params.yaml, the `validate` stage's working directory (the
    validate stage's tests and the quality tests that run it)."""
    # Imported here: the validate stage loads Great Expectations, which most tests never need.
    from helpers.generated_samples import write_params
    from helpers.validate_stage import NUM_SHARDS

    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, NUM_SHARDS)
    return tmp_path


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
