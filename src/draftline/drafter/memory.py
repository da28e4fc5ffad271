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

The training step is laid out as the profile trains it (`drafter.sharding`): under FSDP the
drafter and the online target are sharded over the profile's processes on a fake process group
(collectives that move no data, so one process plans every rank's share, all-gather and
reduce-scatter buffers included), with the profile's activation checkpointing, and the loss is
the loop's own call (`training.step_loss`).
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

from draftline.drafter import dflash, features, linear_cross_entropy, objective, sharding
from draftline.drafter.build import Hyperparameters
from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.features import needed_layers_only, target_layer_states
from draftline.drafter.objective import MicroBatch
from draftline.drafter.sharding import Layout

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
        self._size: dict[int, int] = {}

    def _count(self, tensor: torch.Tensor) -> None:
        self._track(tensor.untyped_storage())

    def _track(self, storage: Any) -> int:
        key = id(storage)
        if key in self._alive:
            return key
        size = storage.nbytes()

        def freed(key: int = key) -> None:
            self._alive.pop(key, None)
            self.now -= self._size.pop(key, 0)

        self._alive[key] = weakref.finalize(storage, freed)
        self._size[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        return key

    def _resized(self, storage: Any, size: int) -> None:
        """FSDP2 frees and re-allocates gathered parameters by resizing their storage."""
        key = self._track(storage)
        self.now += size - self._size[key]
        self._size[key] = size
        self.peak = max(self.peak, self.now)

    def __enter__(self) -> LiveBytes:
        original = torch.UntypedStorage.resize_
        live = self

        def resize_(storage: Any, size: int) -> Any:
            out = original(storage, size)
            live._resized(storage, int(size))
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

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


def target_weight_bytes(
    config: dict[str, Any],
    precision: str,
    layer_ids: list[int] | None = None,
    shards: int = 1,
) -> int:
    """The target's text model (what `core.target.load_model` loads), counted on the meta
    device: every parameter and buffer once (tied weights once). With `layer_ids`, what
    online training keeps of it (`features.needed_layers_only`); with `shards` > 1, one
    process's FSDP2 share of its parameters (dim 0 split evenly, padded) plus its buffers."""
    with torch.device("meta"):
        lm = _causal_lm(transformers_config(config), DTYPES[precision])
    model = needed_layers_only(lm, layer_ids) if layer_ids is not None else lm
    params = {id(t): t for t in model.parameters()}
    buffers = {id(t): t for t in model.buffers()}
    return sum(_share(t, shards) for t in params.values()) + sum(
        t.numel() * t.element_size() for t in buffers.values()
    )


def _share(tensor: torch.Tensor, shards: int) -> int:
    """Bytes of one process's FSDP2 shard of `tensor` (the whole tensor when shards == 1)."""
    if shards <= 1 or tensor.dim() == 0:
        return tensor.numel() * tensor.element_size()
    rows = -(-tensor.shape[0] // shards)
    return rows * (tensor.numel() // tensor.shape[0]) * tensor.element_size()


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
        dflash2=hp.dflash2,
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


@contextmanager
def process_group(layout: Layout, world_size: int, shard_one: bool = False) -> Iterator[Any]:
    """The device mesh the layout shards over: a fake process group of `world_size` ranks (this
    process is rank 0) under FSDP, none (None) under DDP or for one process (which training
    does not shard, unless `shard_one`)."""
    import torch.distributed as dist

    if layout.sharding != "fsdp" or world_size < (1 if shard_one else 2):
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("a process group already exists: plan memory outside training")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield sharding.mesh(torch.device("cpu"), world_size)  # outside fake tensors
    finally:
        dist.destroy_process_group()


def train_step_peak(
    model: dict[str, Any],
    hp: Hyperparameters,
    max_length: int,
    micro_batch: int,
    precision: str,
    online: bool,
    gpu: bool = True,
    shallow: bool = True,
    layout: Layout | None = None,
    world_size: int = 1,
    shard_one_process: bool = False,
) -> Peak:
    """One training step at steady state (optimizer state already there), on one device.

    The step is `drafter.training.train`'s: features (read, or computed by the frozen target
    when `online`, cut after its last needed layer), the drafter under autocast laid out as
    `layout` says over `world_size` processes, `training.step_loss`, backward, AdamW. Every
    sequence is `max_length` tokens with `drafter.max_anchors` blocks. The resident figures
    are one process's: its shards under FSDP. shard_one_process: FSDP2 over a world of one
    (what `benchmarks/gpu_check.py` runs on a single GPU), which training never does.
    """
    from draftline.drafter.training import autocast, step_loss

    layout = layout or Layout()
    config = text_config(model)
    k = len(model["target_layer_ids"])
    b, t, n, s = micro_batch, max_length, hp.max_anchors, hp.block_size
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(process_group(layout, world_size, shard_one_process))
        stack.enter_context(fake_tensors())
        # Built and laid out before the count starts; their bytes are counted explicitly.
        target, layers, target_bytes = None, [], 0
        if online:
            target, layers, target_bytes = _online_target(model, config, precision, shallow, mesh)
        drafter = _drafter(model, hp, config)
        drafter.expand_kv_heads = gpu
        trained = _lay_out(drafter, layout, mesh)
        params = list(drafter.parameters())
        # foreach: AdamW's default for CUDA tensors (its temporaries are whole-model sized).
        optimizer = torch.optim.AdamW(params, lr=hp.lr, foreach=gpu)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the optimizer state, as every step after the first has it
        optimizer.zero_grad(set_to_none=True)
        resident = {
            "drafter": _bytes(_local(p) for p in params),
            "target_head": _bytes([drafter.target.embed_weight, drafter.target.lm_head_weight]),
            "optimizer": _bytes(
                _local(x) for state in optimizer.state.values() for x in state.values() if x.dim()
            ),
        }
        if online:
            resident = {"target": target_bytes, **resident}
        live = stack.enter_context(LiveBytes(resident=sum(resident.values())))
        ids, mask = _tokens(b, t)
        if target is not None:
            features = target_layer_states(target, ids, layers, mask).to(torch.bfloat16)
        else:
            features = torch.empty(b, t, k * int(config["hidden_size"]), dtype=torch.bfloat16)
        blocks = torch.zeros(b, n, s, dtype=torch.long)
        batch = MicroBatch(
            sample_ids=[], input_ids=ids, attention_mask=mask, block_ids=blocks,
            anchors=torch.zeros(b, n, dtype=torch.long), labels=blocks,
            weights=torch.empty(b, n, s),
        )  # fmt: skip
        with autocast("cpu", precision):
            parts = step_loss(
                trained, drafter.target.lm_head_weight, features, batch, hp.selector, drafter
            )
            selector = parts.selector.weighted_ce if parts.selector is not None else 0.0
            (parts.weighted_ce + selector).backward()
        torch.nn.utils.clip_grad_norm_(params, hp.grad_clip, foreach=gpu)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return Peak(live.peak, resident)


def _online_target(
    model: dict[str, Any], config: dict[str, Any], precision: str, shallow: bool, mesh: Any
) -> tuple[torch.nn.Module, list[int], int]:
    """(the frozen target as online training holds it, the layers to capture, one process's
    bytes of its weights). Shallow: a short copy (cut and sharded like the real one) runs the
    forward, the weights are counted on the meta device at full depth."""
    ids = [int(i) for i in model["target_layer_ids"]]
    shards = 1 if mesh is None else mesh.size()
    if shallow:
        short = _shallow_target(config, len(ids), precision)
        layers = list(range(len(ids)))
        weights = target_weight_bytes(config, precision, ids, shards)
    else:
        short = _causal_lm(transformers_config(config), DTYPES[precision])
        layers, weights = ids, 0
    target = needed_layers_only(short, layers)
    if mesh is not None:
        sharding.shard_target(target, mesh)
    if not shallow:
        weights = _bytes(_local(p) for p in target.parameters())
        weights += _bytes(list(target.buffers()))
    return target, layers, weights


def _lay_out(drafter: DFlashDrafter, layout: Layout, mesh: Any) -> torch.nn.Module:
    """The drafter as training lays it out on this profile (DDP keeps it whole per process)."""
    if layout.activation_checkpointing:
        sharding.checkpoint_layers(drafter.layers)
    if mesh is not None:
        return sharding.shard_drafter(drafter, mesh)
    return drafter


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a (possibly sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _source_hash() -> str:
    """The code the figures come from: a cached figure is stale once any of it changes."""
    digest = hashlib.sha256(torch.__version__.encode())
    from draftline.drafter import training

    modules = (dflash, objective, linear_cross_entropy, features, sharding, training)
    for module in (*modules, inspect.getmodule(_source_hash)):
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
