"""Peak device memory of extraction and of a training step, measured by running the project's
own code on fake tensors: the target's transformers model with `target_layer_states`, the DFlash
drafter with its loss, backward and AdamW. Fake tensors have shapes and dtypes but no data, so
a 27B target is planned on a laptop in seconds, from the same modules the stages run.

Two shortcuts keep it fast; each leaves the peak unchanged:
- The target's weights are counted on the meta device at full size, but its forward runs on a
  copy only as deep as the target layers need (one period of its layer types, and one layer per
  captured state). A forward without gradients frees each layer's activations before the next
  one, so the peak is one layer's working set plus the captured states, which the short copy
  captures too.
- Anchors carry no values under fake tensors: every chunk of blocks attends to the whole
  context (`dflash.context_span`), the worst case, so a planned peak is never below the real one.

The attention is measured with the kernels a GPU runs (fused, key/value heads repeated for the
query heads: see `dflash.block_prefix_attention`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from draftline.drafter import dflash, objective
from draftline.drafter.build import Hyperparameters
from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.features import target_layer_states
from draftline.drafter.objective import block_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Figures already measured, by their inputs and the measuring code (git-ignored working state).
CACHE_DIR = Path(os.environ.get("DRAFTLINE_MEMORY_CACHE", ".draftline/cache/memory"))


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive under this mode, and their peak.

    Every tensor an op returns is counted once per storage (views share it) until the storage
    is freed. `resident` adds bytes held outside the mode (the target's weights). torch's own
    MemTracker does more, from a private package; a peak needs only this.
    """

    def __init__(self, resident: int = 0) -> None:
        super().__init__()
        self.now = self.peak = resident
        self._alive: dict[int, weakref.finalize] = {}

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._alive:
            return
        size = storage.nbytes()

        def freed(key: int = key, size: int = size) -> None:
            self._alive.pop(key, None)
            self.now -= size

        self._alive[key] = weakref.finalize(storage, freed)
        self.now += size
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out


@contextmanager
def fake_tensors() -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        yield


@dataclass(frozen=True)
class Peak:
    """A stage's peak on one device, and the part of it held throughout (weights, optimizer)."""

    peak_bytes: int
    resident: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def text_config(model: dict[str, Any]) -> dict[str, Any]:
    """The target's text config: config.json when the weights are local, else the profile's
    `config:` block (so a plan needs no download)."""
    path = Path(str(model["path"])) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text(encoding="utf-8"))
        return dict(config.get("text_config") or config)
    if model.get("config"):
        return dict(model["config"])
    raise SystemExit(
        f"no config for model {model.get('name')}: {model['path']} is not a local folder and "
        f"conf/model/{model.get('name')}.yaml has no `config:` block (its config.json's text "
        "config); add one, or download the weights"
    )


def transformers_config(config: dict[str, Any], num_layers: int | None = None) -> Any:
    """transformers' config of the target's text model, optionally cut to its first layers."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    made = AutoConfig.for_model(**fields)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
        types = getattr(made, "layer_types", None)
        if types:
            fields["layer_types"] = list(types)[:num_layers]
        made = AutoConfig.for_model(**fields)
    made.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
    return made


def _causal_lm(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return lm.requires_grad_(False).eval()


def target_weight_bytes(config: dict[str, Any], precision: str) -> int:
    """The target's text model (what `core.target.load_model` loads), counted on the meta
    device: every parameter and buffer once (tied weights once)."""
    with torch.device("meta"):
        lm = _causal_lm(transformers_config(config), DTYPES[precision])
    tensors = {id(t): t for t in (*lm.parameters(), *lm.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def shallow_depth(config: dict[str, Any], num_states: int) -> int:
    """Layers the short copy needs: one period of the layer types, and one per captured state."""
    full = transformers_config(config)
    types = list(getattr(full, "layer_types", None) or ["full_attention"])
    period = next(
        p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types))
    )
    return min(int(full.num_hidden_layers), max(period, num_states))


def _shallow_target(config: dict[str, Any], num_states: int, precision: str) -> torch.nn.Module:
    return _causal_lm(
        transformers_config(config, shallow_depth(config, num_states)), DTYPES[precision]
    )


def _tokens(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(rows, length, dtype=torch.long)
    return ids, torch.ones(rows, length, dtype=torch.long)


def extract_peak(
    model: dict[str, Any],
    max_length: int,
    tokens_per_batch: int,
    precision: str,
    shallow: bool = True,
) -> Peak:
    """The largest extraction batch: as many max-length rows as the token budget holds.

    shallow=False runs the whole target instead of the short copy (slow at full size; tests
    use it to check the shortcut).
    """
    config = text_config(model)
    rows = max(1, tokens_per_batch // max_length)
    with (
        fake_tensors(),
        _target(model, config, precision, shallow) as (target, layers, weights),
        LiveBytes(resident=weights) as live,
    ):
        ids, mask = _tokens(rows, max_length)
        target_layer_states(target(), ids, layers, attention_mask=mask)
    return Peak(live.peak, {"target": weights})


@contextmanager
def _target(
    model: dict[str, Any], config: dict[str, Any], precision: str, shallow: bool
) -> Iterator[tuple[Callable[[], torch.nn.Module], list[int], int]]:
    """(make the target, the layers to capture, its weight bytes) for a measurement.

    Shallow: the weights are counted on the meta device and the short copy is built before
    the measurement starts (it is not counted). Whole: the target is built inside the
    measurement, which counts its weights itself (bytes 0 here).
    """
    ids = [int(i) for i in model["target_layer_ids"]]
    if shallow:
        weights = target_weight_bytes(config, precision)
        short = _shallow_target(config, len(ids), precision)
        yield (lambda: short), list(range(len(ids))), weights
    else:
        yield (lambda: _causal_lm(transformers_config(config), DTYPES[precision])), ids, 0


def _drafter(model: dict[str, Any], hp: Hyperparameters, config: dict[str, Any]) -> DFlashDrafter:
    """The drafter `build.build_drafter` makes, on a fake embedding and head."""
    dconfig = DFlashConfig.from_target(
        config,
        num_hidden_layers=hp.num_hidden_layers,
        block_size=hp.block_size,
        mask_token_id=int(config["vocab_size"]) - 1,  # any id: memory does not depend on it
        target_layer_ids=[int(i) for i in model["target_layer_ids"]],
        **hp.shape(),
    )
    vocab, hidden = dconfig.vocab_size, dconfig.hidden_size
    head = TargetHead(
        torch.empty(vocab, hidden, dtype=torch.bfloat16),
        torch.empty(vocab, hidden, dtype=torch.bfloat16),
    )
    return DFlashDrafter(dconfig, head)


def _bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Bytes of distinct storages (a tied embedding and head count once)."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def train_step_peak(
    model: dict[str, Any],
    hp: Hyperparameters,
    max_length: int,
    micro_batch: int,
    precision: str,
    online: bool,
    gpu: bool = True,
    shallow: bool = True,
) -> Peak:
    """One training step at steady state (optimizer state already there), on one device.

    The step is `drafter.training.train`'s: features (read, or computed by the frozen target
    when `online`), the drafter under autocast, the block loss, backward, AdamW. Every sequence
    is `max_length` tokens with `drafter.max_anchors` blocks.
    """
    from draftline.drafter.training import autocast

    config = text_config(model)
    k = len(model["target_layer_ids"])
    b, t, n, s = micro_batch, max_length, hp.max_anchors, hp.block_size
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_tensors())
        make_target, layers, weights = (
            stack.enter_context(_target(model, config, precision, shallow))
            if online
            else (None, [], 0)
        )
        with LiveBytes(resident=weights) as live:
            target = make_target() if make_target is not None else None
            target_bytes = live.now if not shallow else weights
            drafter = _drafter(model, hp, config)
            drafter.expand_kv_heads = gpu
            params = list(drafter.parameters())
            # foreach: AdamW's default for CUDA tensors (its temporaries are whole-model sized).
            optimizer = torch.optim.AdamW(params, lr=hp.lr, foreach=gpu)
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()  # creates the optimizer state, as every step after the first has it
            optimizer.zero_grad(set_to_none=True)
            resident = {
                "drafter": _bytes(params),
                "target_head": _bytes([drafter.target.embed_weight, drafter.target.lm_head_weight]),
                "optimizer": _bytes(
                    x for state in optimizer.state.values() for x in state.values() if x.dim()
                ),
            }
            live.peak = live.now
            ids, mask = _tokens(b, t)
            if target is not None:
                features = target_layer_states(target, ids, layers, mask).to(torch.bfloat16)
            else:
                features = torch.empty(b, t, k * int(config["hidden_size"]), dtype=torch.bfloat16)
            blocks = torch.zeros(b, n, s, dtype=torch.long)
            anchors = torch.zeros(b, n, dtype=torch.long)
            loss_weights = torch.empty(b, n, s)
            with autocast("cpu", precision):
                hidden = drafter(features, blocks, anchors)
                parts = block_loss(hidden, drafter.target.lm_head_weight, blocks, loss_weights)
                parts.weighted_ce.backward()
            torch.nn.utils.clip_grad_norm_(params, hp.grad_clip, foreach=gpu)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if online:
        resident = {"target": target_bytes, **resident}
    return Peak(live.peak, resident)


def _source_hash() -> str:
    """The code the figures come from: a cached figure is stale once any of it changes."""
    digest = hashlib.sha256(torch.__version__.encode())
    for module in (dflash, objective, inspect.getmodule(_source_hash)):
        digest.update(inspect.getsource(module).encode())  # type: ignore[arg-type]
    return digest.hexdigest()[:16]


def cached(work: Callable[[], Peak], key: dict[str, Any], cache_dir: Path | None) -> Peak:
    """`work()`, remembered under `cache_dir` by its inputs and the measuring code."""
    if cache_dir is None:
        return work()
    text = json.dumps({**key, "code": _source_hash()}, sort_keys=True, default=str)
    path = cache_dir / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        try:
            return Peak(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError):
            pass  # a torn or older file: measure again
    peak = work()
    from draftline.runtime import atomic

    atomic.write_json(path, peak.as_dict())
    return peak
