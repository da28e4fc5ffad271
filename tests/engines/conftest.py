"""The `engines` tests: what draftline sends to SGLang and vLLM, run through the pinned engines'
own code (parsers, request models, DFlash loaders) in their environment, `.venv-engines`
(`bash .ci/engines` builds it; selected without it, they fail naming that step, as the `vllm`
tests do without vLLM). Our code runs here; the engines' code runs in a subprocess of that
environment's Python ($DRAFTLINE_ENGINES_PYTHON names another one). No GPU is needed: what
the parser and request checks import loads on CPU (vLLM only logs that its CUDA extension
`vllm._C` is missing); what would need one is left out and said so where it is. The DFlash
loader checks stand in for the few layer classes that cannot be built on CPU and name each
(check_dflash_sglang.py, check_dflash_vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.engine_helpers import engines_python, export_tiny_drafter


@pytest.fixture(scope="session")
def engine_python() -> Path:
    python = engines_python()
    if not python.exists():
        # As tests/vllm does without vLLM: an engines test that did not run must never look
        # like one that passed or was merely skipped.
        pytest.fail(
            f"no engines environment at {python}: the `engines` tests run in .ci/engines "
            "(`bash .ci/engines install` builds .venv-engines)",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="session")
def exported_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny_drafter(tmp_path_factory.mktemp("engines") / "drafter")
