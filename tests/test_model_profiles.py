"""Model profiles (conf/model/*.yaml) state facts, not guesses: what can be checked here is.

The embedded targets' profiles are checked against their files (config.json, tokenizer,
generation_config.json). The production profiles are checked for consistency (target layers by
the DFlash formula, the layer mix, the drafter an export would write for SGLang and vLLM); their
sources are named in each file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftline.drafter.dflash import DFlashConfig
from draftline.generation.engines.base import stop_ids

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
PROFILES = sorted(p.stem for p in CONF.glob("*.yaml"))
EMBEDDED = {"tiny": "models/tiny-target", "tiny_qwen36": "models/tiny-qwen36"}


def profile(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", PROFILES)
def test_target_layers_follow_the_dflash_formula(name: str) -> None:
    p = profile(name)
    layers, k = p["num_hidden_layers"], len(p["target_layer_ids"])
    assert p["target_layer_ids"] == [round(1 + i * (layers - 4) / (k - 1)) for i in range(k)]
    assert len(set(p["target_layer_ids"])) == k  # distinct layers
    assert layers % len(p["layer_types_pattern"]) == 0
    assert p["hybrid"] == ("linear_attention" in p["layer_types_pattern"])


@pytest.mark.parametrize("name", PROFILES)
def test_serving_follows_the_architecture(name: str) -> None:
    """Speculative decoding only with an MTP head to draft with; what is served is the
    model's, never hardware's. No flag or variable that SGLang 0.5.23 removed or never reads
    (`--mamba-scheduler-strategy`, SGLANG_ENABLE_SPEC_V2, a reasoning parser without a
    tokenizer): the serving block is part of every sample's identity."""
    spec = profile(name)
    serving = spec["serving"]
    assert bool(serving.get("speculative")) == bool(spec["mtp"]), name
    assert not {"mamba_scheduler_strategy", "reasoning_parser"} & set(serving), name
    assert not serving.get("env"), name


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_profiles_match_their_files(name: str, repo_root: Path) -> None:
    from transformers import AutoTokenizer

    p = profile(name)
    folder = repo_root / EMBEDDED[name]
    assert p["path"] == EMBEDDED[name]
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    assert text["num_hidden_layers"] == p["num_hidden_layers"]
    assert text["hidden_size"] == p["hidden_size"]
    assert text["vocab_size"] == p["vocab_size"]
    assert text["eos_token_id"] == p["eos_token_id"]
    assert config["model_type"] == p["architecture"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.convert_tokens_to_ids(p["end_of_turn_token"]) == p["end_of_turn_token_id"]
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == p["think_token_ids"]
    # Declared, so no stage loads the tokenizer only to look it up.
    assert tok.convert_tokens_to_ids(p["mask_token"]) == p["mask_token_id"]
    generation = json.loads((folder / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    stops = stop_ids(p["end_of_turn_token_id"], p["eos_token_id"])
    assert sorted(stops) == sorted(eos if isinstance(eos, list) else [eos])
    if generation.get("do_sample"):
        for key in ("temperature", "top_p", "top_k"):
            assert p["sampling"][key] == generation[key], key
    else:
        assert p["sampling"]["temperature"] == 0.0


# The ids a production target's generation must stop on: Qwen3-8B's generation_config.json
# (eos_token_id [151645, 151643]); Qwen3.6-27B's end of turn and config.json's eos (248044).
PRODUCTION_STOPS = {"qwen3_8b": {151645, 151643}, "qwen3_6_27b": {248046, 248044}}


@pytest.mark.parametrize("name", sorted(PRODUCTION_STOPS))
def test_production_targets_stop_at_end_of_turn_and_end_of_text(name: str) -> None:
    """Every engine is asked to stop on `stop_ids`; the local engine stops on nothing else, so a
    missing EOS would let a turn run on to max_new_tokens."""
    p = profile(name)
    assert set(stop_ids(p["end_of_turn_token_id"], p["eos_token_id"])) == PRODUCTION_STOPS[name]


def production_text_config(p: dict, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The text config keys DFlashConfig reads, from the profile's facts."""
    return {
        "hidden_size": p["hidden_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 17408,
        "vocab_size": p["vocab_size"],
        "rope_parameters": {"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144,
    }


def test_qwen36_drafter_export_satisfies_sglang_and_vllm() -> None:
    """The exported config.json for Qwen3.6-27B: the public drafters' shape (32/8/128), the mask
    id SGLang and vLLM read from dflash_config (248070; the tokenizer has no <|MASK|>), a head
    size every FlashAttention/FlashInfer build takes, target layers inside the target."""
    p = profile("qwen3_6_27b")
    config = DFlashConfig.from_target(
        production_text_config(p, heads=24, kv_heads=4, head_dim=256),
        num_hidden_layers=5,
        block_size=16,
        mask_token_id=p["mask_token_id"],
        target_layer_ids=p["target_layer_ids"],
        **p["dflash"],
    ).to_json_dict()
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 248070,
        "target_layer_ids": [1, 16, 31, 46, 61],
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (32, 8)
    assert config["head_dim"] == 128 and config["intermediate_size"] == 17408
    assert config["head_dim"] % 8 == 0 and config["head_dim"] in (64, 128, 256, 512)
    assert config["hidden_size"] == 5120 and config["vocab_size"] == 248320
    assert max(config["dflash_config"]["target_layer_ids"]) < config["num_target_layers"] - 1
    assert len(config["layer_types"]) == config["num_hidden_layers"]
    assert config["rope_theta"] == 10_000_000.0


def test_a_derived_drafter_shape_copies_the_target() -> None:
    p = profile("qwen3_8b")
    config = DFlashConfig.from_target(
        production_text_config(p, heads=32, kv_heads=8, head_dim=128),
        num_hidden_layers=5,
        block_size=16,
        mask_token_id=p["mask_token_id"],
        target_layer_ids=p["target_layer_ids"],
        **p["dflash"],
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        DFlashConfig.from_target(
            production_text_config(p, 32, 8, 128),
            num_hidden_layers=5,
            block_size=16,
            mask_token_id=1,
            target_layer_ids=p["target_layer_ids"],
            num_attention_heads=12,
            num_key_value_heads=8,
        )


def test_doctor_says_when_hybrid_layers_run_on_the_slow_fallback(monkeypatch) -> None:
    from draftline.commands import doctor
    from draftline.core import target

    hybrid = {"model": profile("qwen3_6_27b")}
    monkeypatch.setattr(target, "hybrid_kernels_missing", lambda: ["causal-conv1d"])
    [(what, ok, detail)] = doctor._hybrid_rows(hybrid)
    assert what == "hybrid layers" and ok  # said, never failed: CPU nodes have no use for them
    assert "causal-conv1d missing" in detail and "slow torch fallback" in detail
    assert "pip install -e '.[hybrid]'" in detail
    monkeypatch.setattr(target, "hybrid_kernels_missing", lambda: [])
    assert doctor._hybrid_rows(hybrid) == [("hybrid layers", True, "fast kernels installed")]
    assert doctor._hybrid_rows({"model": profile("qwen3_8b")}) == []


PRODUCTION = sorted(set(PROFILES) - set(EMBEDDED))


@pytest.mark.parametrize("name", PRODUCTION)
def test_production_text_config_agrees_with_the_profile(name: str) -> None:
    """The `config:` block `draftline plan` builds the target from (without a download) says
    what the profile says: layers, width, vocabulary, layer mix, and the parameter count
    (counted from transformers' own model on the meta device, within 2%)."""
    from draftline.drafter import memory

    p = profile(name)
    config = memory.transformers_config(p["config"])
    assert config.num_hidden_layers == p["num_hidden_layers"]
    assert config.hidden_size == p["hidden_size"]
    assert config.vocab_size == p["vocab_size"]
    assert not config.tie_word_embeddings
    types = list(getattr(config, "layer_types", None) or ["full_attention"])
    pattern = p["layer_types_pattern"]
    assert types == pattern * (len(types) // len(pattern)), types[:8]
    parameters = memory.target_weight_bytes(p["config"], "bf16") / 2
    assert parameters == pytest.approx(p["num_parameters"], rel=0.02), parameters
