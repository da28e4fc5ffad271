"""Helpers of the `engines` tests (tests/engines/conftest.py says what they check)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.export import export_drafter

REPO = Path(__file__).resolve().parents[2]
CHECKS = REPO / "tests" / "engines"  # the check scripts, run in the engines' environment


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


def capture_cli(argv: list[str]) -> str:
    """What `draftline <argv>` prints (it must succeed)."""
    import contextlib
    import io

    from draftline import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return buf.getvalue()


def dry_run(
    tmp: Path, model: str, hardware: str, *mode: str, overrides: tuple[str, ...] = ()
) -> list[str]:
    """The command `draftline serve start --dry-run` prints, without its environment."""
    import shlex

    from draftline.runtime import params

    suffix = re.sub(r"[^\w.=-]+", "_", "".join(overrides))  # an override may hold a hub id
    path = tmp / f"{model}-{hardware}{suffix}.yaml"
    if not path.exists():
        composed = params.compose(
            [f"model={model}", f"hardware={hardware}", *overrides], REPO / "conf"
        )
        path.write_text(params.to_yaml(composed), encoding="utf-8")
    out = capture_cli(["serve", "start", "--dry-run", "--params", str(path), *mode])
    words = shlex.split(out.strip().splitlines()[-1])
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)
    return words


@functools.cache
def profile(group: str, name: str) -> dict[str, Any]:
    """A model or hardware profile as composed (interpolations resolved; do not modify it)."""
    from draftline.runtime import params

    return params.compose([f"{group}={name}"], REPO / "conf")[group]


def write_drafter_config(folder: Path, model: dict[str, Any], drafter: str = "dflash_b16") -> Path:
    """The config.json draftline's export writes for a drafter of `model` trained under the
    `drafter` profile (shape and layout from the target's config, no weights: SGLang's
    startup reads only the config)."""
    from draftline.drafter.build import Hyperparameters, mask_token_id
    from draftline.generation import sglang_caps
    from draftline.runtime import params

    hp = Hyperparameters.from_params(
        params.compose([f"model={model['name']}", f"drafter={drafter}"], REPO / "conf")["drafter"]
    )
    config = DFlashConfig.from_target(
        sglang_caps.text_config(sglang_caps.checkpoint_config(model)),
        num_hidden_layers=hp.num_hidden_layers,
        block_size=hp.block_size,
        mask_token_id=mask_token_id(model),
        target_layer_ids=[int(i) for i in model["target_layer_ids"]],
        dflash2=hp.dflash2,
        **hp.shape(),
    )
    folder.mkdir(parents=True, exist_ok=True)
    body = {**config.to_json_dict(), "dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return folder
