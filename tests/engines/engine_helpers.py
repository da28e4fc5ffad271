"""Helpers of the `engines` tests (tests/engines/conftest.py says what they check)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.export import export_drafter

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def engines_python() -> Path:
    return Path(os.environ.get("DRAFTLINE_ENGINES_PYTHON") or REPO / ".venv-engines/bin/python")


def engine_env() -> dict[str, str]:
    """The engines' subprocess: vLLM's CPU platform (its CUDA platform needs a GPU to be
    detected; the parser is the same). Not HF_HUB_OFFLINE (nor TRANSFORMERS_OFFLINE): under
    it vLLM resolves a hub id to its cached folder, and the targets are not on this machine;
    nothing here downloads."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    return {
        **env,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
    }


def run_in_engines(python: Path, script: Path, payload: Any, timeout: float = 600) -> Any:
    """Run `script` with the engines' Python, `payload` as JSON on stdin; its JSON answer."""
    proc = subprocess.run(
        [str(python), str(script)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=engine_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_drafter_config(**shape: Any) -> DFlashConfig:
    base: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        block_size=8,
        mask_token_id=255,
        target_layer_ids=[1, 2, 3],
        num_target_layers=5,
    )
    return DFlashConfig(**{**base, **shape})


def export_tiny_drafter(folder: Path, **shape: Any) -> Path:
    """A drafter exported by draftline's own export (random weights, the real format)."""
    torch.manual_seed(0)
    config = tiny_drafter_config(**shape)
    head = TargetHead(
        torch.randn(config.vocab_size, config.hidden_size),
        torch.randn(config.vocab_size, config.hidden_size),
    )
    return export_drafter(DFlashDrafter(config, head), folder)
