"""A training run's resume state, written with `torch.distributed.checkpoint` (DCP).

A checkpoint is a folder: the drafter's and the optimizer's state as DCP writes them (each
process its own shards under FSDP, the replicated tensors once under DDP), and `progress.pt`
(step, history, schedule, token and time counters, the run's fingerprint) from the main
process. DCP reshards on load, so a run killed on one world size or layout resumes on another.

The folder is written under a temporary name and renamed into place once every process has
finished its part: a kill -9 at any moment leaves the previous checkpoint whole (the previous
one is moved aside first and is read if the new one never arrived). With several nodes the
folder must be on storage every node sees, as every process writes its own shards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftline.runtime import distributed

PROGRESS_FILE = "progress.pt"


def _aside(path: Path) -> Path:
    return path.parent / f".{path.name}.previous"


def _staging(path: Path, step: int) -> Path:
    return path.parent / f".{path.name}.step{step}.tmp"


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group that it assumes one process:
    exactly what a single-process run means, so not worth a line per checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any]
) -> None:
    """Write the checkpoint of `progress["step"]`; every process calls it."""
    import torch.distributed.checkpoint as dcp

    main = distributed.rank() == 0
    staging = _staging(path, int(progress["step"]))
    if main:
        shutil.rmtree(staging, ignore_errors=True)  # a torn attempt of an earlier run
        staging.parent.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    with _single_process_quiet():
        dcp.save(_state(model, optimizer), checkpoint_id=str(staging))
    distributed.barrier()
    if main:
        _fixed_save_id(staging, f"{progress.get('fingerprint')}-{progress['step']}")
        with open(staging / PROGRESS_FILE, "wb") as f:
            torch.save(progress, f)
            f.flush()
            os.fsync(f.fileno())
        aside = _aside(path)
        shutil.rmtree(aside, ignore_errors=True)
        if path.exists():
            os.replace(path, aside)
        os.replace(staging, path)
        shutil.rmtree(aside, ignore_errors=True)
    distributed.barrier()


def _fixed_save_id(folder: Path, save_id: str) -> None:
    """DCP stamps a random uuid (`save_id`) and the folder it wrote (a temporary name) into the
    folder's `.metadata`: replaced by an id derived from what was saved and no folder, so the
    same state is the same bytes (a link's state is a DVC
    output, hashed and compared across nodes). DCP reads and writes that file with pickle."""
    import pickle

    path = folder / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 (DCP's own file, just written here)
    if metadata.storage_meta is not None:
        metadata.storage_meta.save_id = save_id
        metadata.storage_meta.checkpoint_id = None
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())


def read_progress(path: Path | None) -> tuple[Path, dict[str, Any]] | None:
    """(folder, progress) of the checkpoint at `path`, or of the one set aside while a newer
    one was being put in place; None when there is none."""
    if path is None:
        return None
    for folder in (path, _aside(path)):
        file = folder / PROGRESS_FILE
        if file.is_file():
            return folder, torch.load(file, map_location="cpu", weights_only=False)
    return None


def load(
    path: Path | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    fingerprint: str,
) -> dict[str, Any] | None:
    """Restore model and optimizer from the checkpoint at `path` when it belongs to this run
    (same fingerprint) and return its progress; None (nothing restored) otherwise. Every
    process calls it, after the model is laid out (sharded or wrapped) for this run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    found = read_progress(path)
    if found is None:
        return None
    folder, progress = found
    if progress.get("fingerprint") != fingerprint:
        if distributed.rank() == 0:
            print(f"{folder}: belongs to other params or data, starting afresh")
        return None
    state = _state(model, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    return progress


def remove(path: Path) -> None:
    """Delete the checkpoint at `path` and any copy set aside or staged beside it (main
    process), once its state is kept elsewhere."""
    if distributed.rank() == 0:
        for leftover in [path, _aside(path), *path.parent.glob(f".{path.name}.step*.tmp")]:
            shutil.rmtree(leftover, ignore_errors=True)
    distributed.barrier()
