"""vLLM's DFlash loader on an exported drafter, run with the engines' Python (.venv-engines).

stdin: {"drafter": folder}. stdout (last line): {"error"} when vLLM's loader raises, else
{"loaded", "missing", "shared"}.

vLLM 0.34.0's own `DFlashQwen3ForCausalLM` (model_executor/models/qwen3_dflash.py) is built
from the drafter's config.json (read by transformers' AutoConfig, as vLLM does) with vLLM's own
layers at tensor parallel size 1 (a one-process gloo group), and its own `load_weights`
(name mapping, stacked q/k/v and gate/up, AutoWeightsLoader, which raises on a name it does not
know) loads the exported safetensors. A parameter still NaN afterwards was not loaded. What is
not the server's own: VllmConfig is assembled field by field from its defaults (its
`__post_init__` runs the CPU platform check, which wants triton-cpu), the model and draft
configs are namespaces carrying only the attributes the model reads, and `Attention` (the
KV-cache and kernel layer, no checkpoint parameters; its backend selection needs a device) is a
module without parameters. `embed_tokens`, `lm_head` and `mask_embedding` come from the target
at serve time (vLLM shares them unless the checkpoint ships its own), so they are `shared`.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import types

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig
from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models import qwen3_dflash

SHARED = ("embed_tokens.", "lm_head.", "mask_embedding")


class Attention(nn.Module):
    """vLLM's Attention holds no checkpoint parameters; its backend needs a device."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()


def default_config() -> VllmConfig:
    """A VllmConfig of its fields' defaults, without `__post_init__`'s platform check."""
    config = object.__new__(VllmConfig)
    for field in dataclasses.fields(VllmConfig):
        value = field.default
        if field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        elif getattr(value, "default_factory", None) is not None:  # pydantic Field(...)
            value = value.default_factory()
        elif hasattr(value, "default"):
            value = value.default
        object.__setattr__(config, field.name, value)
    config.compilation_config.mode = CompilationMode.NONE
    config.compilation_config.custom_ops = ["none"]
    return config


def vllm_config(folder: str) -> VllmConfig:
    hf = AutoConfig.from_pretrained(folder)
    config = default_config()
    draft = types.SimpleNamespace(hf_config=hf, quantization=None, model=folder, revision=None)
    speculative = types.SimpleNamespace(
        draft_model_config=draft, method="dflash", eagle_aux_hidden_state_layer_ids=None
    )
    target = types.SimpleNamespace(
        dtype=torch.float32,
        head_dtype=torch.float32,
        is_moe=False,
        is_mm_prefix_lm=False,
        get_total_num_hidden_layers=lambda: hf.num_target_layers,
        get_vocab_size=lambda: hf.vocab_size,
    )
    object.__setattr__(config, "speculative_config", speculative)
    object.__setattr__(config, "model_config", target)
    return config


def main() -> None:
    folder = json.loads(sys.stdin.read())["drafter"]
    config = vllm_config(folder)
    qwen3_dflash.Attention = Attention
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        model = qwen3_dflash.DFlashQwen3ForCausalLM(vllm_config=config)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for param in params.values():
                param.fill_(float("nan"))
        try:
            model.load_weights(load_file(f"{folder}/model.safetensors").items())
        except (ValueError, KeyError, AssertionError) as error:
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
            return
    unloaded = sorted(n for n, p in params.items() if p.isnan().any())
    shared = [n for n in unloaded if n.removeprefix("model.").startswith(SHARED)]
    loaded = sorted(set(params) - set(unloaded))
    missing = [n for n in unloaded if n not in shared]
    # How vLLM reads the config: per-layer window (None: full) and causality.
    layers = [
        [layer.self_attn.sliding_window, layer.self_attn.causal] for layer in model.model.layers
    ]
    answer = {"layers": layers, "loaded": loaded, "missing": missing, "shared": shared}
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
