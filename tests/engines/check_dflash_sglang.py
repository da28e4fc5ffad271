"""SGLang's DFlash loader on an exported drafter, run with the engines' Python (.venv-engines).

stdin: {"drafter": folder}. stdout (last line): {"loaded", "skipped", "missing", "standins"}.

SGLang 0.5.23 builds `DFlashDraftModel` (sglang/srt/models/dflash.py) from the drafter's
config.json and loads its safetensors with `load_weights`, which silently skips any name it does
not resolve. Here that module's own source runs unchanged (`__init__`, the config parsing of
sglang/srt/speculative/dflash_utils.py, `load_weights` with its stacked q/k/v and gate/up
mapping and name aliases), on the config transformers' AutoConfig reads, as SGLang's loader
does. Its layer package does not import on CPU (see engine_source.py), so these names, and only
these, are stand-ins (the answer's `standins` lists those used) registering the parameters
SGLang's classes register, under the same attribute names and shapes (TP size 1):
QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ColumnParallelLinear,
ReplicatedLinear (`weight` [out, in], `bias`; their `weight_loader` checks a shard's shape, as
SGLang's does, and records it), RMSNorm/GemmaRMSNorm (`weight` [dim]), VocabParallelEmbedding
(`weight`), default_weight_loader (shape check, as SGLang's asserts), DraftParallelSpec and
DraftTPExecution (a class attribute). The rest is SGLang's own: RadixAttention, get_rope,
SiluAndMul and AttentionType import on CPU and are used as they are; get_rope_config is the
function from SGLang's source; the parallel context is SGLang's, set to TP size 1.
"""

from __future__ import annotations

import enum
import json
import sys
import types
from typing import Any

import torch
from engine_source import _real, function_from, load_module
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig

LOADS: list[tuple[int, Any]] = []


def record(param: nn.Parameter, weight: torch.Tensor, shard: Any, shape: tuple) -> None:
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(f"shape {tuple(weight.shape)} where {tuple(shape)} was expected")
    LOADS.append((id(param), shard))


def default_weight_loader(param: nn.Parameter, weight: torch.Tensor) -> None:
    record(param, weight, None, param.shape)


class Linear(nn.Module):
    """A TP-1 linear layer's parameters, shards along the output dim (`sizes` by shard id)."""

    def __init__(self, in_features: int, sizes: dict[Any, int], bias: bool) -> None:
        super().__init__()
        out = sum(sizes.values())
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._loader(sizes)  # type: ignore[attr-defined]
                param.shards = list(sizes)  # type: ignore[attr-defined]

    @staticmethod
    def _loader(sizes: dict[Any, int]):
        def load(param: nn.Parameter, weight: torch.Tensor, shard: Any = None) -> None:
            rows = param.shape[0] if shard is None else sizes[shard]
            record(param, weight, shard, (rows, *param.shape[1:]))

        return load


def qkv_linear(hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=False, **_):
    kv = total_num_kv_heads * head_size
    return Linear(hidden_size, {"q": total_num_heads * head_size, "k": kv, "v": kv}, bias)


def merged_linear(input_size, output_sizes, bias=False, **_):
    return Linear(input_size, dict(enumerate(output_sizes)), bias)


def plain_linear(input_size, output_size, bias=False, **_):
    return Linear(input_size, {None: output_size}, bias)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, **_: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)


class DraftParallelSpec:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class DraftTPExecution(enum.Enum):
    SINGLE_GROUP = "single_group"


STANDINS: dict[str, Any] = {
    "QKVParallelLinear": qkv_linear,
    "MergedColumnParallelLinear": merged_linear,
    "RowParallelLinear": plain_linear,
    "ColumnParallelLinear": plain_linear,
    "ReplicatedLinear": plain_linear,
    "RMSNorm": Norm,
    "GemmaRMSNorm": Norm,
    "VocabParallelEmbedding": Embedding,
    "default_weight_loader": default_weight_loader,
    "DraftParallelSpec": DraftParallelSpec,
    "DraftTPExecution": DraftTPExecution,
}


def main() -> None:
    folder = json.loads(sys.stdin.read())["drafter"]
    used: set[str] = set()
    # The real helpers the model file imports from modules that do not import on CPU.
    _real["sglang.srt.speculative.dflash_utils"] = load_module(
        "sglang.srt.speculative.dflash_utils", "sglang", {}, used
    )
    _real["sglang.srt.utils.hf_transformers_utils"] = types.SimpleNamespace(
        get_rope_config=function_from(
            "sglang.srt.utils.hf_transformers.common", "get_rope_config", {}
        )
    )
    dflash = load_module("sglang.srt.models.dflash", "sglang", STANDINS, used)
    config = AutoConfig.from_pretrained(folder)
    architecture = config.architectures[0]
    assert architecture in {c.__name__ for c in dflash.EntryClass}, architecture
    # One GPU, no tensor parallelism: the layout a single-rank drafter loads into.
    _real["sglang.srt.runtime_context"].get_parallel().override_permanently(tp_size=1)
    model = getattr(dflash, architecture)(config)
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    loaded: dict[str, list] = {}
    skipped = []
    for name, weight in load_file(f"{folder}/model.safetensors").items():
        before = len(LOADS)
        model.load_weights([(name, weight)])
        if len(LOADS) == before:
            skipped.append(name)
        for pid, shard in LOADS[before:]:
            loaded.setdefault(names[pid], []).append(shard)
    # A stacked parameter is loaded only when every shard is (q, k and v; gate and up).
    missing = sorted(
        n
        for n, p in params.items()
        if sorted(map(str, loaded.get(n, []))) != sorted(map(str, getattr(p, "shards", [None])))
    )
    # How SGLang reads the config: block size, per-layer window (-1: full) and attention kind.
    layers = [
        [layer.self_attn.sliding_window_size, layer.self_attn.attn_type.name]
        for layer in model.layers
    ]
    answer = {"architecture": architecture, "block_size": model.block_size, "layers": layers}
    answer |= {"loaded": sorted(loaded), "skipped": skipped}
    print(json.dumps({**answer, "missing": missing, "standins": sorted(used)}))


if __name__ == "__main__":
    main()
