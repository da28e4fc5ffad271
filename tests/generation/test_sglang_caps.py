"""sglang_caps: the weights it counts against real checkpoints and transformers' own models, the
state and KV sizes against their definitions, and the caps of the production profiles.
SGLang's own configurator is checked against every figure in tests/engines/
test_sglang_startup.py (engines environment); these run on CPU alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.engine_helpers import tiny_drafter_config
from safetensors import safe_open

from draftline.drafter.dflash import DFlashDrafter, TargetHead
from draftline.drafter.memory import transformers_config
from draftline.generation import sglang_caps
from draftline.runtime import params

REPO = Path(__file__).resolve().parents[2]
TWIN = REPO / "models/tiny-qwen36"


def compose(*overrides: str) -> dict:
    return params.compose(list(overrides), REPO / "conf")


def checkpoint_params(folder: Path) -> dict[str, int]:
    """Parameter count per tensor of a safetensors checkpoint (headers only)."""
    counts = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                counts[key] = int(torch.Size(f.get_slice(key).get_shape()).numel())
    return counts


def test_weights_match_the_tiny_qwen36_checkpoint():
    """The twin's own safetensors (text model, vision tower, MTP head, all bf16): the count
    covers every tensor of each part."""
    config = json.loads((TWIN / "config.json").read_text())
    counts = checkpoint_params(TWIN)
    mtp = sum(n for k, n in counts.items() if k.startswith("mtp."))
    visual = sum(n for k, n in counts.items() if ".visual." in k)
    assert sglang_caps.served_weight_bytes(config, None) == 2 * (sum(counts.values()) - mtp)
    assert sglang_caps.draft_weight_bytes(config, "NEXTN", None) == 2 * mtp
    assert sglang_caps._vision_params(config["vision_config"]) == visual
    # FP8 halves the linear layers' bytes only: embedding, head, norms and vision stay 16-bit.
    fp8 = sglang_caps.served_weight_bytes(config, "fp8")
    assert 2 * visual < fp8 < sglang_caps.served_weight_bytes(config, None)


@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_6_27b"])
def test_text_weights_match_transformers(model):
    """The text model's parameters as transformers builds it (meta device) from the profile."""
    text = compose(f"model={model}")["model"]["config"]
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_config(transformers_config(text))
    params_ = sum(p.numel() for p in {id(p): p for p in lm.parameters()}.values())
    assert sglang_caps.served_weight_bytes(text, None) == 2 * params_


def test_dflash_drafter_weights_match_draftline_s_drafter():
    config = tiny_drafter_config(
        num_hidden_layers=3, intermediate_size=96, vocab_size=128, mask_token_id=127
    )
    head = TargetHead(torch.zeros(128, 64), torch.zeros(128, 64))
    drafter = DFlashDrafter(config, head)
    own = sum(t.numel() for n, t in drafter.state_dict().items() if "embed" not in n)
    own -= sum(t.numel() for n, t in drafter.state_dict().items() if "lm_head" in n)
    assert sglang_caps.dflash_params(config.to_json_dict()) == own


def test_state_and_kv_bytes_of_qwen3_6_27b():
    """48 Gated DeltaNet layers x (conv: 3 steps of q, k, v (2x2048 + 6144) in bf16; state:
    48 heads x 128 x 128 in fp32); 16 full-attention layers x 4 kv heads x (K + V) x 256."""
    config = sglang_caps.checkpoint_config(compose("model=qwen3_6_27b")["model"])
    assert sglang_caps.state_bytes_per_slot(config) == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)
    assert sglang_caps.state_bytes_per_slot(config) == 153_944_064
    assert sglang_caps.kv_bytes_per_token(config, "NEXTN") == 16 * 4 * 2 * 256 * 2
    drafter = {"num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 5}
    assert sglang_caps.kv_bytes_per_token(config, "DFLASH", drafter) == 65536 + 8 * 2 * 128 * 5 * 2


def test_checkpoint_config_of_a_hub_target_has_the_checkpoint_s_shape():
    model = compose("model=qwen3_6_27b")["model"]
    config = sglang_caps.checkpoint_config(model)
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["full_attention_interval"] == 4
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert config["vision_config"]["out_hidden_size"] == model["config"]["hidden_size"]
    local = sglang_caps.checkpoint_config(compose("model=tiny_qwen36")["model"])
    assert local == json.loads((TWIN / "config.json").read_text())


def b16_drafter(model: dict) -> dict:
    """The config.json shape of a `dflash_b16` drafter of the 27B (5 layers, 32/8/128)."""
    return {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 5,
        "block_size": 16,
        "dflash_config": {"target_layer_ids": model["target_layer_ids"]},
    }


@pytest.mark.parametrize(
    ("hardware", "mode", "cap"),
    [
        ("b200x8", "own", 46),
        ("b200x8", "dflash", 19),
        ("b200x8", "none", 85),
        ("pro6000x4", "own", 18),
        ("pro6000x4", "dflash", 7),
        ("pro6000x4", "own bf16", 10),
    ],
)
def test_qwen3_6_27b_caps(hardware, mode, cap):
    """The figures SGLang 0.5.23's configurator sizes for these profiles (the engines test
    runs it): the Gated DeltaNet state pool, 5 slots of 154 MB per running request, caps them
    far below the profiles' 512 / 256."""
    model = compose("model=qwen3_6_27b")["model"]
    if mode.endswith("bf16"):
        model = {**model, "serving": {**model["serving"], "quantization": None}}
    node = compose(f"hardware={hardware}")["hardware"]
    if mode == "dflash":
        caps = sglang_caps.profile_caps(model, node, drafter=b16_drafter(model))
    else:
        caps = sglang_caps.profile_caps(model, node, None if mode == "none" else "model")
    assert caps.max_running_requests == cap
    assert caps.capped_by == "mamba state"
    assert caps.mamba_slots_per_request == 5
    assert caps.max_running_requests == caps.max_mamba_cache_size // 5


def test_a_dense_target_gets_what_the_profile_asks():
    model = compose("model=qwen3_8b")["model"]
    node = compose("hardware=b200x8")["hardware"]
    caps = sglang_caps.profile_caps(model, node)
    assert (caps.max_running_requests, caps.capped_by) == (512, "requested")
    assert caps.max_mamba_cache_size is None
    assert caps.max_total_num_tokens % 64 == 0  # trtllm_mha pages by 64 on B200


def test_without_the_radix_cache_the_requested_slots_leave_nothing():
    """Deterministic inference on flashinfer (radix cache off): one state slot per requested
    running request plus 4 intermediate states each, 256 of them, does not fit an RTX PRO
    6000: SGLang refuses to start, and so does the estimate."""
    model = compose("model=qwen3_6_27b")["model"]
    config = sglang_caps.checkpoint_config(model)
    with pytest.raises(ValueError, match="no GPU memory for the KV cache"):
        sglang_caps.engine_caps(
            config,
            gpu_memory_mib=97887,
            mem_fraction_static=0.85,
            max_running_requests=256,
            context_length=262144,
            settings=sglang_caps.Settings(page_size=1, radix_cache=False),
            quantization="fp8",
            algorithm="NEXTN",
            num_draft_tokens=4,
        )


def test_resolved_settings():
    assert sglang_caps.resolved_settings("B200", hybrid=False, algorithm=None).page_size == 64
    assert sglang_caps.resolved_settings("B200", hybrid=True, algorithm="NEXTN").page_size == 64
    assert sglang_caps.resolved_settings("B200", hybrid=True, algorithm=None).page_size == 1
    assert (
        sglang_caps.resolved_settings("RTX PRO 6000", hybrid=False, algorithm=None).page_size == 1
    )
