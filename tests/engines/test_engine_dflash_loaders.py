"""The exported drafter through the pinned engines' own DFlash loaders: SGLang's (which silently
skips a name it does not know, so a renamed parameter would serve a random drafter) and
vLLM's (which raises). Every exported tensor must reach a parameter, every parameter of the
engine's model must be loaded (or come from the target), and the engines must read the config
as exported: block size, sliding windows, causal sliding layers. Drafters: dflash_tiny's
layout and dflash_b16's for Qwen3.6-27B (4 sliding + 1 full layers), exported by draftline's
export; a copy with `fc.weight` renamed must fail. check_dflash_sglang.py and
check_dflash_vllm.py say which engine code runs and what stands in for what."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.engine_helpers import CHECKS, export_tiny_drafter, run_in_engines
from safetensors.torch import load_file, save_file

from draftline.drafter.dflash import FULL, SLIDING

pytestmark = pytest.mark.engines

WINDOW = 16
SHAPES = {
    "dflash_tiny": {},
    "dflash_b16_sliding": dict(
        num_hidden_layers=5,
        block_size=16,
        layer_types=[SLIDING] * 4 + [FULL],
        sliding_window=WINDOW,
        sliding_causal=True,
    ),
}
# The names SGLang's model file imports from modules that do not import on CPU, each replaced
# by a stand-in registering the same parameters (check_dflash_sglang.py); anything else is real.
SGLANG_STANDINS = {
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelLinear",
    "ReplicatedLinear",
    "RMSNorm",
    "GemmaRMSNorm",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "DraftParallelSpec",
    "DraftTPExecution",
}


def sglang(engine_python: Path, drafter: Path) -> dict:
    return run_in_engines(
        engine_python, CHECKS / "check_dflash_sglang.py", {"drafter": str(drafter)}
    )


def vllm(engine_python: Path, drafter: Path) -> dict:
    return run_in_engines(engine_python, CHECKS / "check_dflash_vllm.py", {"drafter": str(drafter)})


def problems(sglang_answer: dict, vllm_answer: dict) -> list[str]:
    """What either engine would do wrong with the drafter: names skipped, parameters left
    unloaded, a loader error."""
    found = [f"SGLang skips {n}" for n in sglang_answer["skipped"]]
    found += [f"SGLang never loads {n}" for n in sglang_answer["missing"]]
    if "error" in vllm_answer:
        return [*found, f"vLLM refuses: {vllm_answer['error'][:300]}"]
    return found + [f"vLLM never loads {n}" for n in vllm_answer["missing"]]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def drafter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param) / "drafter"
    return export_tiny_drafter(folder, **SHAPES[request.param])


def test_engines_load_every_exported_tensor(engine_python: Path, drafter: Path) -> None:
    config = json.loads((drafter / "config.json").read_text())
    exported = load_file(drafter / "model.safetensors")
    sg, vl = sglang(engine_python, drafter), vllm(engine_python, drafter)
    assert problems(sg, vl) == []
    assert set(sg["standins"]) <= SGLANG_STANDINS, sg["standins"]
    # Every exported tensor reached one of the engine's parameters (q/k/v and gate/up stacked).
    assert len(sg["loaded"]) == len(exported) - 3 * len(config["layer_types"]), sg["loaded"]
    assert {n.removeprefix("model.") for n in vl["loaded"]} == set(sg["loaded"])
    assert {n.removeprefix("model.") for n in vl["shared"]} <= {
        "embed_tokens.weight",
        "lm_head.weight",
        "mask_embedding",
    }
    # The config as the engines read it: SGLang's window is HF's minus the query itself.
    assert sg["block_size"] == config["block_size"]
    sliding = [kind == SLIDING for kind in config["layer_types"]]
    assert sg["layers"] == [[WINDOW - 1, "DECODER"] if s else [-1, "ENCODER_ONLY"] for s in sliding]
    assert vl["layers"] == [[WINDOW, True] if s else [None, False] for s in sliding]


def test_a_renamed_parameter_fails(engine_python: Path, exported_drafter: Path, tmp_path) -> None:
    renamed = tmp_path / "renamed"
    shutil.copytree(exported_drafter, renamed)
    weights = load_file(renamed / "model.safetensors")
    weights["fuse.weight"] = weights.pop("fc.weight")
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    sg, vl = sglang(engine_python, renamed), vllm(engine_python, renamed)
    assert sg["skipped"] == ["fuse.weight"] and sg["missing"] == ["fc.weight"]
    assert "fuse" in vl["error"]
    assert problems(sg, vl)
