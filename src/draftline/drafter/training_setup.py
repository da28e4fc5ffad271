"""Everything a training call builds before its first step (`draftline.drafter.training`): the
process group, the packs, the call's steps, the frozen target (online features), the drafter
laid out for the world, its optimiser and schedule, and the state it goes on from.

Which state that is follows from the call's `TrainingMode` and the run's identity: a working
checkpoint of this very call (a killed run), else the state the previous link left, else a
fresh start. Identities are fingerprints of params and bytes, never paths: the same weights
elsewhere resume the same run.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftline.drafter import checkpoints, sharding
from draftline.drafter.build import Hyperparameters, build_drafter, load_target_head
from draftline.drafter.dflash import DFlashDrafter
from draftline.drafter.packs import ExtractedData
from draftline.drafter.sharding import Layout
from draftline.drafter.step_plan import CallSteps, StepPlan
from draftline.drafter.training_mode import TrainingMode
from draftline.runtime import distributed


@dataclass
class RunOptions:
    """How it runs: device, precision and micro-batch from the hardware profile; files."""

    device: str = "cpu"
    precision: str = "fp32"
    micro_batch_size: int = 4
    layout: Layout = field(default_factory=Layout)  # sharding, activation checkpointing
    checkpoint_path: Path | None = None  # a folder (`draftline.drafter.checkpoints`)
    checkpoint_every: int = 50
    live_dir: Path | None = None
    progress: bool = True


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: str) -> World:
    """Join the torchrun process group when launched by torchrun, else a world of one."""
    distributed.init("nccl" if device.startswith("cuda") else "gloo")
    return World(distributed.rank(), distributed.world_size(), distributed.local_rank())


def cosine_with_warmup(total_steps: int, warmup_ratio: float) -> Any:
    warmup = max(1, math.ceil(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def chain_fingerprint(model: dict[str, Any], hp: Hyperparameters) -> str:
    """What a run's states belong to, whatever data each link read: a changed param or target
    (`target_id`: other weights in the same folder, whose features online training computes)
    never resumes one. Paths are left out: the same weights elsewhere resume the same run."""
    names = ("target_id", "target_layer_ids", "mask_token_id")
    keys = {k: model.get(k) for k in names}
    text = json.dumps({"model": keys, "hp": hp.identity()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_fingerprint(model: dict[str, Any], hp: Hyperparameters, data: ExtractedData) -> str:
    """What a working checkpoint belongs to: the run and the packs it reads."""
    text = f"{chain_fingerprint(model, hp)}|{data.fingerprint}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def working_fingerprint(
    model: dict[str, Any],
    hp: Hyperparameters,
    data: ExtractedData,
    mode: TrainingMode,
    start_id: str,
) -> str:
    """What a working checkpoint belongs to: this run on these packs, this call's part of it,
    from this very start state (its bytes: a chain retrained by other code is another start)."""
    text = f"{run_fingerprint(model, hp, data)}|{mode.describe()}|{start_id}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_online_target(
    model: dict[str, Any],
    layer_ids: list[int],
    device: torch.device,
    precision: str,
    layout: Layout,
    world_size: int,
) -> nn.Module:
    """The frozen target that computes features online: in the run's precision, straight onto
    its device, cut after its last needed layer, and sharded per layer under FSDP."""
    from draftline.core.target import load_model
    from draftline.drafter.features import needed_layers_only

    target = needed_layers_only(load_model(model, device=str(device), dtype=precision), layer_ids)
    if layout.sharding == "fsdp" and world_size > 1:
        sharding.shard_target(target, sharding.mesh(device, world_size))
    return target


@dataclass
class Progress:
    """Where the call stands: the next step, the records so far and the counters (over every
    call that led here: a resumed run adds to its checkpoint's)."""

    step: int
    history: list[dict[str, float]]
    tokens: int = 0
    seconds: float = 0.0  # step time


@dataclass
class Setup:
    """What the loop works with; `progress` moves on as it trains."""

    mode: TrainingMode
    hp: Hyperparameters
    options: RunOptions
    world: World
    device: torch.device
    data: ExtractedData
    call: CallSteps  # the steps this call trains, and what each reads
    layer_ids: list[int]  # the target layers whose states are the features
    target_lm: nn.Module | None  # the frozen target, when the features are computed online
    head: Any  # the target's embedding and lm_head (`load_target_head`)
    drafter: DFlashDrafter
    trained: nn.Module  # what the loop calls: the drafter, DDP's wrapper, or it sharded
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    chain_fingerprint: str  # a link's state is this run's
    fingerprint: str  # the working checkpoint is this very call's
    progress: Progress

    def state(self, step: int, fingerprint: str) -> dict[str, Any]:
        """A checkpoint's progress at `step` (its key order is part of the saved bytes)."""
        p = self.progress
        return {
            "fingerprint": fingerprint, "step": step, "schedule": self.schedule.state_dict(),
            "history": p.history, "tokens": p.tokens, "seconds": p.seconds,
            "plan": self.call.run_plan.state(), "world_size": self.world.size,
            **self.options.layout.describe(),
        }  # fmt: skip


def set_up(
    mode: TrainingMode, model: dict[str, Any], hp: Hyperparameters, run: RunOptions
) -> Setup:
    """Everything `mode`'s call needs before its first step, in this order: the states it
    reads are checked before the models are built, the target is sharded before the drafter."""
    world = init_world(run.device)
    device = distributed.device(run.device)
    data = ExtractedData(list(mode.folders), hp.block_size)
    if hp.global_batch_size % world.size:
        raise SystemExit(
            f"drafter.global_batch_size={hp.global_batch_size} does not split over "
            f"{world.size} processes: choose a multiple of the world size"
        )
    chain_fp = chain_fingerprint(model, hp)
    start, start_id = _start_plan(mode, hp, len(data), chain_fp)
    call = CallSteps.of(mode, start, data.sizes(), data.offsets)

    layer_ids = [int(i) for i in model["target_layer_ids"]]
    target_lm = None
    if data.online:  # first: the whole target is on the device only until it is sharded
        target_lm = load_online_target(
            model, layer_ids, device, run.precision, run.layout, world.size
        )
    head = load_target_head(model).to(device)
    drafter = build_drafter(model, hp, head).to(device)
    trained = sharding.lay_out(drafter, run.layout, world.size, device)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(call.run_plan.total_steps, hp.warmup_ratio)
    )
    fingerprint = working_fingerprint(model, hp, data, mode, start_id)
    setup = Setup(
        mode, hp, run, world, device, data, call, layer_ids, target_lm, head, drafter,
        trained, optimizer, schedule, chain_fp, fingerprint, Progress(call.steps.start, []),
    )  # fmt: skip
    _go_on_from_saved_state(setup, run.checkpoint_path)
    return setup


def _start_plan(
    mode: TrainingMode, hp: Hyperparameters, usable: int, chain_fp: str
) -> tuple[StepPlan, str]:
    """The plan the call starts from and the identity of its start: the previous link's plan
    and the hash of its state, or a fresh plan of the planned rows (`usable`: the loaded
    sequences, when none are planned)."""
    if mode.start_from is None:
        rows = mode.planned_rows if mode.planned_rows is not None else usable
        return StepPlan.planned(rows, hp.epochs, hp.global_batch_size, hp.seed), "fresh"
    found = checkpoints.read_progress(mode.start_from)
    if found is None:
        raise SystemExit(
            f"{mode.start_from}: no training state there: the link before has not run; "
            "train it first"
        )
    folder, progress = found
    if progress.get("fingerprint") != chain_fp:
        raise SystemExit(
            f"{mode.start_from}: a state of another run (other drafter params or "
            "target): rerun the chain from its first link"
        )
    start_id = hashlib.sha256((folder / checkpoints.PROGRESS_FILE).read_bytes()).hexdigest()
    return StepPlan.from_state(progress["plan"]), start_id


def _go_on_from_saved_state(setup: Setup, checkpoint_path: Path | None) -> None:
    """Load this call's working checkpoint (a killed run), else the previous link's state,
    into the drafter, optimiser, schedule and progress; a fresh start loads nothing."""
    s = setup
    state = checkpoints.load(checkpoint_path, s.drafter, s.optimizer, s.fingerprint)
    if state is None and s.mode.start_from is not None:
        state = checkpoints.load(s.mode.start_from, s.drafter, s.optimizer, s.chain_fingerprint)
        if state is None:
            raise SystemExit(
                f"{s.mode.start_from}: not a state of this run (other drafter params or "
                "target): rerun the chain from its first link"
            )
    if state is not None:
        s.schedule.load_state_dict(state["schedule"])
        s.progress = Progress(
            int(state["step"]),
            list(state["history"]),
            int(state.get("tokens", 0)),
            float(state.get("seconds", 0.0)),
        )
