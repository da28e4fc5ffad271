"""Export: the DFlash checkpoint folder (config.json + safetensors) loads back and drafts alike.

The serving engines (SGLang `--speculative-algorithm DFLASH`, vLLM, the reference
implementation) build the draft layers as Qwen3 decoder layers from `config.json` and take the
embedding and lm_head from the target. Without a GPU to run them, the format is checked against
transformers' own Qwen3 built from the exported config: every draft-layer weight must have the
name and shape that model gives it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.small_drafter import BLOCK, HIDDEN, SLIDING, VOCAB, WINDOW
from helpers.small_drafter import make_drafter as make_model_drafter
from safetensors import safe_open
from transformers import AutoConfig, Qwen3Model

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter
from draftline.drafter.export import export_drafter, load_drafter

pytestmark = pytest.mark.float_kernels

torch.set_num_threads(1)

LAYERS = 2
TARGET_LAYER_IDS = [0, 1, 2]  # those of helpers.small_drafter.make_drafter
# config.json fields that SGLang, vLLM and the reference read (sgl-project/sglang's and vLLM's
# DFlash loaders, z-lab/dflash `dflash/model.py`).
REQUIRED_FIELDS = (
    "architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "layer_types", "rope_theta", "vocab_size", "rms_norm_eps",
)  # fmt: skip


def make_drafter(seed: int = 0) -> DFlashDrafter:
    drafter = make_model_drafter(seed, layers=LAYERS)
    with torch.no_grad():  # norms start at 1: perturb them so a lost weight would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return drafter


def drafts(drafter: DFlashDrafter) -> torch.Tensor:
    """Block hidden states for two sequences of four anchors each."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 40, len(TARGET_LAYER_IDS) * HIDDEN, generator=g)
    anchors = torch.tensor([[3, 10, 20, 30], [0, 6, 7, 35]])
    anchor_ids = torch.randint(0, VOCAB - 1, (2, 4), generator=g)
    with torch.no_grad():
        return drafter(feats, drafter.block_input_ids(anchor_ids), anchors)


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_fp32_export_loads_back_with_identical_outputs(tmp_path: Path) -> None:
    drafter = make_drafter()
    folder = export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    loaded = load_drafter(folder, drafter.target)
    assert torch.equal(drafts(loaded), drafts(drafter))


def test_bf16_export_is_the_drafter_with_bf16_weights(tmp_path: Path) -> None:
    drafter = make_drafter()
    folder = export_drafter(drafter, tmp_path / "drafter")
    assert {t.dtype for t in saved_tensors(folder).values()} == {torch.bfloat16}
    rounded = make_drafter()
    rounded.load_state_dict(
        {k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()}
    )
    loaded = load_drafter(folder, drafter.target)
    assert torch.equal(drafts(loaded), drafts(rounded))
    # ... and close to the fp32 drafter it came from.
    assert torch.allclose(drafts(loaded), drafts(drafter), atol=0.05, rtol=0.05)


def test_config_has_the_dflash_fields(tmp_path: Path) -> None:
    folder = export_drafter(make_drafter(), tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    missing = [f for f in REQUIRED_FIELDS if f not in config]
    assert not missing, missing
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == BLOCK
    assert config["dflash_config"] == {
        "mask_token_id": VOCAB - 1,
        "target_layer_ids": TARGET_LAYER_IDS,
    }
    assert config["layer_types"] == ["full_attention"] * LAYERS
    assert config["dtype"] == "bfloat16"


def test_weights_have_the_names_and_shapes_of_qwen3_layers(tmp_path: Path) -> None:
    folder = export_drafter(make_drafter(), tmp_path / "drafter")
    saved = saved_tensors(folder)
    assert not [n for n in saved if "embed" in n or "lm_head" in n]
    k = len(TARGET_LAYER_IDS)
    assert saved.pop("fc.weight").shape == (HIDDEN, k * HIDDEN)
    assert saved.pop("hidden_norm.weight").shape == (HIDDEN,)
    # transformers' Qwen3 built from the exported config.json: its decoder layers and final
    # norm are what the engines instantiate for the drafter.
    reference = Qwen3Model(AutoConfig.from_pretrained(folder)).state_dict()
    expected = {
        name: tuple(t.shape) for name, t in reference.items() if not name.startswith("embed")
    }
    assert {name: tuple(t.shape) for name, t in saved.items()} == expected


def test_loading_a_checkpoint_with_a_missing_weight_fails(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    drafter = make_drafter()
    folder = export_drafter(drafter, tmp_path / "drafter")
    saved = saved_tensors(folder)
    del saved["layers.1.self_attn.k_norm.weight"]
    save_file(saved, str(folder / "model.safetensors"))
    with pytest.raises(RuntimeError, match="k_norm"):
        load_drafter(folder, drafter.target)


def test_sliding_layout_is_exported_and_read_back(tmp_path: Path) -> None:
    """`layer_types`, `use_sliding_window` and `sliding_window` as SpecForge's Qwen3.6-27B
    config writes them; transformers' Qwen3 builds the same layers from it."""
    drafter = make_model_drafter(0, layers=LAYERS, layer_types=SLIDING)
    folder = export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == SLIDING and config["sliding_window"] == WINDOW
    assert config["use_sliding_window"] is True and config["max_window_layers"] == LAYERS
    assert config["is_causal"] is False  # bidirectional sliding layers: vLLM reads this
    assert AutoConfig.from_pretrained(folder).layer_types == SLIDING
    loaded = load_drafter(folder, drafter.target)
    assert loaded.config == drafter.config
    assert torch.equal(drafts(loaded), drafts(drafter))
    # A full-attention export says so, whatever window a config once carried.
    full = json.loads(
        (export_drafter(make_drafter(), tmp_path / "full") / "config.json").read_text()
    )
    assert (full["use_sliding_window"], full["sliding_window"]) == (False, None)


def test_the_qwen36_profile_exports_the_published_layout() -> None:
    """conf/ composed for Qwen3.6-27B with dflash_b16 gives the layout of SpecForge's
    configs/qwen3.6-27b-dflash.json: 4 sliding layers then 1 full, window 2048."""
    from draftline.drafter.build import Hyperparameters
    from draftline.runtime.params import compose

    conf = Path(__file__).resolve().parents[2] / "conf"
    params = compose(["model=qwen3_6_27b", "drafter=dflash_b16"], conf)
    hp = Hyperparameters.from_params(params["drafter"])
    config = DFlashConfig.from_target(
        params["model"]["config"],
        num_hidden_layers=hp.num_hidden_layers,
        block_size=hp.block_size,
        mask_token_id=params["model"]["mask_token_id"],
        target_layer_ids=params["model"]["target_layer_ids"],
        **hp.shape(),
    ).to_json_dict()
    assert config["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert (config["sliding_window"], config["use_sliding_window"]) == (2048, True)
    assert (config["num_hidden_layers"], config["max_window_layers"]) == (5, 5)
    # Causal sliding layers, as SGLang and vLLM serve this config: nothing to override.
    assert hp.sliding_causal is True and "is_causal" not in config
    # Targets whose profile names no layout keep full attention everywhere.
    qwen3 = compose(["model=qwen3_8b", "drafter=dflash_b16"], conf)["drafter"]
    assert qwen3["layer_types"] is None and qwen3["sliding_window"] is None
