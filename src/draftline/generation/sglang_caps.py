"""How many requests one SGLang 0.5.23 engine runs at once, computed as SGLang computes it.

Pure arithmetic from the model profile's config, the served precision and speculation, and the
hardware profile (GPU memory, `sglang.mem_fraction_static`, `sglang.max_running_requests`).
Each step is SGLang's, in the 0.5.23 wheel (`sglang/srt/...`):

1. Free memory before loading: the GPU's (`distributed/bootstrap.py`
   `measure_pre_model_load_memory`, GiB); after loading, less the target's and the draft's
   weights at the served precision (`served_weight_bytes`, `draft_weight_bytes`).
2. The KV budget (`mem_cache/kv_cache_configurator.py` `_profile_available_bytes`): free after
   loading, less `pre * (1 - mem_fraction_static)`, less the multimodal embedding cache of a
   vision-language checkpoint (`mm_runtime_reservation_gb`: `SGLANG_VLM_CACHE_SIZE_MB`, 100).
3. Hybrid (Gated DeltaNet) targets (`_handle_max_mamba_cache`): `mamba_full_memory_ratio`
   (0.9) of it over 1.9 goes to the state pool. One slot holds every linear layer's conv state
   (bf16) and recurrent state (fp32) (`configs/mamba_utils.py` `mamba_cache_per_req`); each
   running request takes `_calculate_mamba_ratio` slots: 3, plus 2 tracking slots with the
   extra buffer and the overlap scheduler (`mem_cache/allocation_sizing.py`
   `get_mamba_tracking_slots`). With speculation the pool also keeps D intermediate states
   per admitted request (D = draft tokens) and is solved jointly:
   `K = (budget - slot * (1 + D)) // (slot * (1 + D / ratio))`. Without the radix cache
   (deterministic inference on flashinfer) one slot per request: K is
   `--max-running-requests` itself. The pool (K + 1 slots) and the intermediate states leave
   the rest to the KV pool; nothing left is SGLang's startup error.
4. The KV pool (`model_executor/pool_configurator.py` `DefaultPoolConfigurator`): bytes per
   token are the full-attention layers' K and V, plus a DFLASH drafter's own per layer
   (`speculative/dflash_utils.py`); an MTP head (NEXTN) adds nothing there (its pool is its
   own). Tokens are floored to the page size (64 with trtllm_mha on B200, else 1).
5. The cap (`resolve_max_num_reqs`): the requested running requests, at most half the KV
   tokens, and for hybrid targets at most K // ratio (SGLang logs "max_running_requests is
   capped to").

Not modelled (each named where it applies): the CUDA context and NCCL buffers (a few hundred MB
on a real node; the figure here assumes none), the FP8 scales (bytes per tensor), and the
post-capture KV resize (`SGLANG_ENABLE_POST_CAPTURE_KV_SIZING`, off by default), which can grow
the KV pool after CUDA graph capture, never the state pool. tests/engines/test_sglang_startup.py
checks every figure against SGLang's own configurator run on the same inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
# Compute capability of each hardware profile's GPU (`gpu.name`): what SGLang's platform
# probes read (`utils/common.py` `is_sm100_supported`, `is_sm120_supported`).
GPU_CAPABILITY = {"B200": (10, 0), "RTX PRO 6000": (12, 0)}
# What a checkpoint's config.json holds beyond the profile's text config (`config:`), by hub
# id: the vision tower and multimodal token ids of Qwen3.5/3.6-27B (its config.json).
CHECKPOINT_EXTRAS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3.6-27B": {
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "out_hidden_size": 5120,
            "deepstack_visual_indexes": [],
            "hidden_act": "gelu_pytorch_tanh",
        },
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": {"mtp_num_hidden_layers": 1},
    },
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration"}
VLM_CACHE_GIB = 100 / 1024  # SGLANG_VLM_CACHE_SIZE_MB
MAMBA_FULL_MEMORY_RATIO = 0.9  # --mamba-full-memory-ratio's fallback


def checkpoint_config(model: dict[str, Any]) -> dict[str, Any]:
    """The target's config.json: read from a local folder, else the profile's text config
    (`config:`) in the checkpoint's shape (a vision-language checkpoint nests it as
    `text_config`)."""
    path = Path(str(model["path"]))
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    text = dict(model["config"])
    text.setdefault("dtype", "bfloat16")
    extras = CHECKPOINT_EXTRAS.get(str(model["path"]), {})
    text.update(extras.get("text_config", {}))
    arch = ARCHITECTURES[str(model["architecture"])]
    if arch.endswith("ForConditionalGeneration"):
        top = {k: v for k, v in extras.items() if k != "text_config"}
        return {
            "architectures": [arch],
            "model_type": model["architecture"],
            "text_config": text,
            "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
            "dtype": text["dtype"],
            **top,
        }
    return {"architectures": [arch], **text}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def _layer_types(text: dict[str, Any]) -> list[str]:
    if text.get("layer_types"):
        return list(text["layer_types"])
    n, every = int(text["num_hidden_layers"]), text.get("full_attention_interval")
    if not every:
        return ["full_attention"] * n
    return ["full_attention" if (i + 1) % int(every) == 0 else "linear_attention" for i in range(n)]


def _attention(text: dict[str, Any], gated: bool) -> tuple[int, int]:
    """(linear weights, other weights) of one full-attention block."""
    h, heads, kv = int(text["hidden_size"]), int(text["num_attention_heads"]), _kv_heads(text)
    d = _head_dim(text)
    q = h * heads * d * (2 if gated else 1)  # a gated query carries its gate
    return q + 2 * h * kv * d + heads * d * h, 2 * d


def _gated_deltanet(text: dict[str, Any]) -> tuple[int, int]:
    """(linear weights, other weights) of one Gated DeltaNet block (models/qwen3_5.py)."""
    h = int(text["hidden_size"])
    key = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    values, vdim = int(text["linear_num_value_heads"]), int(text["linear_value_head_dim"])
    value = values * vdim
    linear = h * (2 * key + 2 * value) + h * 2 * values + value * h  # qkvz, ba, out
    conv = (2 * key + value) * int(text["linear_conv_kernel_dim"])
    return linear, conv + 2 * values + vdim  # conv1d, A_log, dt_bias, norm


def _gated(text: dict[str, Any]) -> bool:
    """Qwen3.5/3.6's full attention gates its output: the query projection is twice as wide."""
    return str(text.get("model_type", "")).startswith("qwen3_5")


def _head_dim(text: dict[str, Any]) -> int:
    return int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))


def _kv_heads(text: dict[str, Any]) -> int:
    return int(text.get("num_key_value_heads") or text["num_attention_heads"])


def _decoder_layer(text: dict[str, Any], kind: str, gated: bool) -> tuple[int, int]:
    """(linear weights, other weights) of one decoder layer: its mixer, MLP and two norms."""
    h, mlp = int(text["hidden_size"]), 3 * int(text["hidden_size"]) * int(text["intermediate_size"])
    linear, other = _gated_deltanet(text) if kind == "linear_attention" else _attention(text, gated)
    return linear + mlp, other + 2 * h


def _vision_params(vision: dict[str, Any] | None) -> int:
    """Parameters of a Qwen3-VL style vision tower (patch embed, blocks, merger)."""
    if not vision:
        return 0
    v, inter = int(vision["hidden_size"]), int(vision["intermediate_size"])
    out = int(vision["out_hidden_size"])
    merged = v * int(vision["spatial_merge_size"]) ** 2
    patch = int(vision["in_channels"]) * int(vision["temporal_patch_size"])
    patch = patch * int(vision["patch_size"]) ** 2 * v + v
    # qkv and proj, the MLP's two layers (with biases), two LayerNorms
    block = (v * 3 * v + 3 * v) + (v * v + v) + 2 * (v * inter) + inter + v + 4 * v
    merger = 2 * v + merged * merged + merged + merged * out + out  # LayerNorm, two layers
    return (
        patch + int(vision["num_position_embeddings"]) * v + int(vision["depth"]) * block + merger
    )


def served_weight_bytes(config: dict[str, Any], quantization: str | None) -> int:
    """The target's weights on the GPU as SGLang loads them: with `--quantization fp8` every
    linear layer of the text model in FP8 (1 byte, `layers/quantization/fp8.py`), the
    embedding, lm_head, norms, convolutions and the vision tower (built unquantized,
    `models/qwen3_vl.py`) in the checkpoint's 16-bit dtype."""
    text = text_config(config)
    gated = _gated(text)
    linear = other = 0
    for kind in _layer_types(text):
        a, b = _decoder_layer(text, kind, gated)
        linear, other = linear + a, other + b
    vocab, h = int(text["vocab_size"]), int(text["hidden_size"])
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    other += vocab * h * (1 if tied else 2) + h + _vision_params(config.get("vision_config"))
    return linear * (1 if quantization == "fp8" else 2) + other * 2


def mtp_layers(config: dict[str, Any]) -> int:
    return int(text_config(config).get("mtp_num_hidden_layers") or 1)


def draft_weight_bytes(
    config: dict[str, Any],
    algorithm: str | None,
    quantization: str | None,
    drafter: dict[str, Any] | None = None,
) -> int:
    """The draft worker's weights: the MTP head (NEXTN, quantized with the target; its `fc` a
    plain bf16 Linear, its embedding and lm_head the target's, `models/qwen3_5_mtp.py`), or the
    DFLASH drafter's own layers in bf16 (`--speculative-draft-model-quantization unquant`)."""
    if algorithm in (None, "NONE"):
        return 0
    if algorithm == "DFLASH":
        if drafter is None:
            raise ValueError("DFLASH needs the drafter's config.json")
        return 2 * dflash_params(drafter)
    text = text_config(config)
    h = int(text["hidden_size"])
    linear, other = _decoder_layer(text, "full_attention", _gated(text))
    n = mtp_layers(config)
    return n * linear * (1 if quantization == "fp8" else 2) + 2 * (n * other + 2 * h * h + 3 * h)


def dflash_params(drafter: dict[str, Any]) -> int:
    """Parameters of a DFlash drafter checkpoint (its config.json): fc, norms, layers."""
    h, inter = int(drafter["hidden_size"]), int(drafter["intermediate_size"])
    heads, kv, d = int(drafter["num_attention_heads"]), _kv_heads(drafter), _head_dim(drafter)
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d
    layer = attention + 3 * h * inter + 2 * h
    targets = len(drafter["dflash_config"]["target_layer_ids"])
    return targets * h * h + h + int(drafter["num_hidden_layers"]) * layer + h


def state_bytes_per_slot(config: dict[str, Any]) -> int:
    """One mamba state slot: every Gated DeltaNet layer's conv state (bf16, kernel - 1 steps
    of q, k and v) and recurrent state (fp32, value heads x value dim x key dim)."""
    text = text_config(config)
    linear = sum(t == "linear_attention" for t in _layer_types(text))
    key = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    values = int(text["linear_num_value_heads"])
    vdim, kdim = int(text["linear_value_head_dim"]), int(text["linear_key_head_dim"])
    conv = (2 * key + values * vdim) * (int(text["linear_conv_kernel_dim"]) - 1) * 2
    return linear * (conv + values * vdim * kdim * 4)


def kv_bytes_per_token(
    config: dict[str, Any], algorithm: str | None, drafter: dict[str, Any] | None = None
) -> int:
    """The target pool's bytes per token: K and V of every full-attention layer in the 16-bit
    model dtype, plus a DFLASH drafter's own K and V per layer (`scale_kv_cell_size_per_token_
    for_dflash`). An MTP head (NEXTN without a draft path) adds nothing here: SGLang sizes its
    private pool off the target config, which has no MTP layer count
    (`model_runner_components/spec_aux_hidden_state.py`)."""
    text = text_config(config)
    full = sum(t == "full_attention" for t in _layer_types(text))
    cell = _kv_heads(text) * 2 * _head_dim(text) * full * 2
    if algorithm == "DFLASH" and drafter is not None:
        cell += (
            int(drafter["num_key_value_heads"])
            * 2
            * _head_dim(drafter)
            * 2
            * int(drafter["num_hidden_layers"])
        )
    return cell


@dataclass(frozen=True)
class Settings:
    """What SGLang resolves, for draftline's command lines, that the sizing reads."""

    page_size: int
    radix_cache: bool = True
    extra_buffer: bool = True  # hybrid targets: `--mamba-radix-cache-strategy auto`
    overlap: bool = True


def resolved_settings(gpu_name: str, hybrid: bool, algorithm: str | None) -> Settings:
    """SGLang 0.5.23's choices for draftline's command lines (no attention backend named):
    on B200 (SM100) trtllm_mha, which pages by 64, for dense targets, and for Qwen3.5/3.6
    only with speculation (else triton, page 1: `arg_groups/model_overrides/qwen3_5.py`);
    elsewhere flashinfer, page 1. Hybrid targets get the extra buffer and the overlap
    scheduler. tests/engines/test_sglang_startup.py checks each against SGLang's resolution."""
    sm100 = GPU_CAPABILITY.get(gpu_name, (0, 0))[0] == 10
    trtllm = sm100 and (not hybrid or algorithm is not None)
    return Settings(page_size=64 if trtllm else 1)


@dataclass(frozen=True)
class Caps:
    """One engine's limits as SGLang sizes them at startup."""

    max_running_requests: int
    max_total_num_tokens: int
    capped_by: str  # "mamba state", "kv cache" or "requested"
    max_mamba_cache_size: int | None
    mamba_slots_per_request: int | None
    state_bytes_per_slot: int | None
    weight_bytes: int
    draft_weight_bytes: int


def engine_caps(
    config: dict[str, Any],
    *,
    gpu_memory_mib: int,
    mem_fraction_static: float,
    max_running_requests: int | None,
    context_length: int,
    settings: Settings,
    quantization: str | None = None,
    algorithm: str | None = None,
    num_draft_tokens: int | None = None,
    drafter: dict[str, Any] | None = None,
) -> Caps:
    """The running-request cap and KV tokens of one engine (tp 1): steps 1-5 above."""
    weights = served_weight_bytes(config, quantization)
    draft = draft_weight_bytes(config, algorithm, quantization, drafter)
    total = gpu_memory_mib * (1 << 20)
    pre = total / GIB
    available = (total - weights - draft) / GIB
    multimodal = str(config.get("architectures", [""])[0]).endswith("ForConditionalGeneration")
    rest = available - pre * (1 - mem_fraction_static) - (VLM_CACHE_GIB if multimodal else 0)
    slots = ratio = per_slot = None
    if "linear_attention" in _layer_types(text_config(config)):
        per_slot = state_bytes_per_slot(config)
        ratio = _slots_per_request(settings)
        draft_tokens = num_draft_tokens if algorithm is not None else None
        slots, rest = _state_pool(rest, per_slot, ratio, max_running_requests, draft_tokens)
    if rest <= 0:  # SGLang's startup error (`_profile_available_bytes`)
        raise ValueError(
            "Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={mem_fraction_static}"
        )
    tokens = int(rest * GIB) // kv_bytes_per_token(config, algorithm, drafter)
    tokens = tokens // settings.page_size * settings.page_size
    if max_running_requests is not None:
        cap = min(max(1, max_running_requests), tokens // 2)
        capped_by = "requested" if cap == max_running_requests else "kv cache"
    else:
        estimated = max(min(int(tokens / context_length * 512), 4096), 2048)
        cap, capped_by = min(estimated, tokens // 2), "kv cache"
    if slots is not None and ratio is not None and slots // ratio < cap:
        cap, capped_by = slots // ratio, "mamba state"
    return Caps(cap, tokens, capped_by, slots, ratio, per_slot, weights, draft)


def _slots_per_request(settings: Settings) -> int:
    """`_calculate_mamba_ratio`: 3, plus the extra buffer's tracking slots (2 with the
    overlap scheduler); 1 without the radix cache."""
    if not settings.radix_cache:
        return 1
    return 3 + ((2 if settings.overlap else 1) if settings.extra_buffer else 0)


def _state_pool(
    rest: float, per_slot: int, ratio: int, requested: int | None, draft_tokens: int | None
) -> tuple[int, float]:
    """(state slots, GiB left for the KV pool): `_handle_max_mamba_cache`'s arithmetic."""
    if ratio == 1 and requested is not None:  # no radix cache: the requested slots
        slots = max(1, requested)
        if draft_tokens:
            rest -= per_slot * (slots + 1) * draft_tokens / GIB
    elif draft_tokens:
        budget = rest * MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO) * GIB
        d = draft_tokens
        slots = int((budget - per_slot * (1 + d)) // (per_slot * (1 + d / ratio)))
        admitted = min(max(1, requested or 0), slots // ratio)
        rest -= per_slot * (admitted + 1) * d / GIB
    else:
        budget = rest * MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO) * GIB
        slots = int((budget - per_slot) // per_slot)
    if slots <= 0:
        raise ValueError(f"no GPU memory left for the hybrid state pool ({slots} slots)")
    return slots, rest - (slots + 1) * per_slot / GIB


def profile_caps(
    model: dict[str, Any],
    hardware: dict[str, Any],
    speculative: dict[str, Any] | None | str = "model",
    drafter: dict[str, Any] | None = None,
) -> Caps:
    """One engine of `hardware` serving `model` as draftline launches it: with the model's
    own speculation (`serving.speculative`), none (`speculative=None`), or a DFLASH drafter
    (`drafter`: its config.json; drafting its block size)."""
    serving = model.get("serving") or {}
    if drafter is not None:
        speculative = {"algorithm": "DFLASH", "num_draft_tokens": int(drafter["block_size"])}
    elif speculative == "model":
        speculative = serving.get("speculative")
    spec = speculative if isinstance(speculative, dict) else {}
    algorithm = spec.get("algorithm")
    config = checkpoint_config(model)
    sglang = hardware["sglang"]
    if not sglang.get("mem_fraction_static"):
        raise ValueError("SGLang's own mem_fraction_static heuristic is not modelled: set it")
    text = text_config(config)
    hybrid = "linear_attention" in _layer_types(text)
    context = serving.get("context_length") or text.get("max_position_embeddings")
    return engine_caps(
        config,
        gpu_memory_mib=int(hardware["gpu"]["memory_mib"]),
        mem_fraction_static=float(sglang["mem_fraction_static"]),
        max_running_requests=sglang.get("max_running_requests"),
        context_length=int(context),
        settings=resolved_settings(str(hardware["gpu"]["name"]), hybrid, algorithm),
        quantization=serving.get("quantization"),
        algorithm=algorithm,
        num_draft_tokens=spec.get("num_draft_tokens"),
        drafter=drafter,
    )


def node_running(model: dict[str, Any], hardware: dict[str, Any]) -> dict[str, Any] | None:
    """What one node of an SGLang GPU profile runs at once serving `model` as `serve start`
    launches it (the model's own speculation): the cap per engine, the engines, and what the
    client keeps in flight over them (`in_flight_for`: each cap plus a short queue, at most
    `sglang.max_in_flight`). None for a profile that is not an SGLang GPU node; a profile
    the arithmetic cannot size gives {"error": ...}."""
    from draftline.generation.engines.sglang import in_flight_for

    sg = hardware.get("sglang") or {}
    gpu = hardware.get("gpu") or {}
    if hardware.get("engine") != "sglang" or not sg or not gpu.get("memory_mib"):
        return None
    try:
        caps = profile_caps(model, hardware)
    except (KeyError, ValueError, TypeError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    engines = int(sg.get("dp_size") or 1)
    requested = sg.get("max_running_requests")
    cap = caps.max_running_requests
    limit = int(sg.get("max_in_flight") or engines * cap)
    return {
        "per_engine": cap,
        "requested": requested,
        "capped_by": caps.capped_by,
        "kv_tokens": caps.max_total_num_tokens,
        "engines": engines,
        "running": engines * cap,
        "in_flight": in_flight_for([cap] * engines, limit),
        "source": "computed as SGLang 0.5.23 sizes it at start (generation/sglang_caps.py)",
    }


def describe_running(running: dict[str, Any]) -> str:
    """One line for `draftline plan` and `doctor`."""
    if "error" in running:
        return f"not computed: {running['error']}"
    asked = running["requested"]
    bound = {
        "mamba state": "the Gated DeltaNet state pool",
        "kv cache": "the KV cache",
        "requested": "the profile's sglang.max_running_requests",
    }[running["capped_by"]]
    below = (
        f", below the {asked} the profile asks" if asked and asked > running["per_engine"] else ""
    )
    return (
        f"{running['per_engine']} per engine x {running['engines']} (bound by {bound}{below}): "
        f"{running['running']} running, {running['in_flight']} kept in flight; "
        f"{running['source']}"
    )
