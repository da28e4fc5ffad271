"""How a training run lays the drafter and the frozen target over its processes.

The hardware profile chooses (`sharding: fsdp | ddp`, `activation_checkpointing: true | false`);
the training loop (`drafter.training`) and the memory plan (`drafter.memory`) both lay out their
modules through this file, so the plan measures the layout that trains.

- `ddp`: every process holds the whole drafter, its optimizer state and (online) the whole
  frozen target; gradients are all-reduced. The CPU profile's layout.
- `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`). The drafter is sharded per decoder
  layer and at its root (`fc`, norms), so parameters, gradients and AdamW states are split
  over the processes; the frozen target (online features) is sharded per decoder layer and at
  its root, parameters only (no gradients), each layer gathered for its forward and freed after.
  Parameters stay fp32 masters and the step runs under autocast, as with DDP, so both layouts
  compute the same thing (up to float summation order).
- Activation checkpointing recomputes each drafter layer's activations in the backward instead
  of keeping them (torch's composable `checkpoint`, which keeps parameter names, so checkpoints
  and the export are unchanged).

The target's embedding and lm_head the drafter reads (`TargetHead`) are plain frozen tensors,
never sharded: the loss needs the whole head every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SHARDINGS = ("ddp", "fsdp")


@dataclass(frozen=True)
class Layout:
    """The profile's training layout: `sharding` and `activation_checkpointing`."""

    sharding: str = "ddp"
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise SystemExit(
                f"hardware.sharding={self.sharding!r}: choose one of {', '.join(SHARDINGS)}"
            )

    @classmethod
    def of(cls, profile: dict[str, Any]) -> Layout:
        return cls(
            sharding=str(profile.get("sharding") or "ddp"),
            activation_checkpointing=bool(profile.get("activation_checkpointing") or False),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "sharding": self.sharding,
            "activation_checkpointing": self.activation_checkpointing,
        }


def mesh(device: torch.device, world_size: int) -> Any:
    """The one-dimensional device mesh of every process (the process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


def checkpoint_layers(layers: nn.ModuleList) -> None:
    """Recompute each layer's activations in the backward instead of keeping them."""
    from torch.distributed._composable import checkpoint

    for layer in layers:
        checkpoint(layer)


def shard_drafter(drafter: nn.Module, device_mesh: Any) -> nn.Module:
    """FSDP2 over the drafter: one unit per decoder layer, one for DFlash2's selector, one for
    the rest (`fc`, norms)."""
    from torch.distributed.fsdp import fully_shard

    for layer in drafter.layers:
        fully_shard(layer, mesh=device_mesh)
    if getattr(drafter, "candidate_selector", None) is not None:  # DFlash2: called after the
        fully_shard(drafter.candidate_selector, mesh=device_mesh)  # drafter's forward, alone
    fully_shard(drafter, mesh=device_mesh)
    return drafter


def shard_target(text_model: nn.Module, device_mesh: Any) -> nn.Module:
    """FSDP2 over the frozen target's text decoder: one unit per decoder layer (gathered for
    its forward, freed after), one for the rest (embedding, final norm). No gradients."""
    from torch.distributed.fsdp import fully_shard

    text_model.requires_grad_(False)
    for layer in text_model.layers:
        fully_shard(layer, mesh=device_mesh, reshard_after_forward=True)
    fully_shard(text_model, mesh=device_mesh, reshard_after_forward=True)
    return text_model


def lay_out(drafter: nn.Module, layout: Layout, world_size: int, device: torch.device) -> nn.Module:
    """The module the loop calls: the drafter itself (one process, or sharded in place by
    FSDP2) or its DDP wrapper. Activation checkpointing is applied first, whatever the layout."""
    if layout.activation_checkpointing:
        checkpoint_layers(drafter.layers)
    if world_size == 1:
        return drafter
    if layout.sharding == "fsdp":
        return shard_drafter(drafter, mesh(device, world_size))
    return nn.parallel.DistributedDataParallel(
        drafter, device_ids=[device.index] if device.type == "cuda" else None
    )


@contextlib.contextmanager
def gradient_sync(trained: nn.Module, sync: bool) -> Iterator[None]:
    """DDP: accumulate this backward's gradients locally unless `sync` (the last micro-batch),
    then all-reduce once. FSDP: reduce-scatter after every micro-batch, so a process only ever
    holds its 1/N of the gradients (accumulating whole ones would add a full fp32 copy of the
    drafter per GPU; the reduce-scatter is small beside a micro-batch's compute)."""
    if not sync and isinstance(trained, nn.parallel.DistributedDataParallel):
        with trained.no_sync():
            yield
    else:
        yield


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def local_float(value: torch.Tensor) -> float:
    """A scalar as a float, whether a plain tensor or a DTensor (FSDP's gradient norm)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)


def full_state_dict(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's whole state dict on CPU, on the main process (empty elsewhere). A
    collective under FSDP2: every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not _is_fsdp(drafter):
        return {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(drafter, options=options)
