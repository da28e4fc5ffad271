"""A training state written twice is the same bytes: a chain link's state is a DVC output, and a
node that trained it must record the hash a sequential run records. It still loads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from draftline.drafter import checkpoints


def trained_pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_the_same_state_in_two_places_is_the_same_bytes_and_loads(tmp_path: Path) -> None:
    model, optimizer = trained_pair()
    progress = {"fingerprint": "run", "step": 3, "history": [{"loss": 1.5}]}
    first, second = tmp_path / "a" / "state", tmp_path / "b" / "elsewhere"
    checkpoints.save(first, model, optimizer, progress)
    checkpoints.save(second, model, optimizer, progress)
    assert file_hashes(first) == file_hashes(second)
    assert set(file_hashes(first)) == {".metadata", "__0_0.distcp", checkpoints.PROGRESS_FILE}

    fresh = torch.nn.Linear(4, 4)
    loaded = checkpoints.load(second, fresh, torch.optim.AdamW(fresh.parameters()), "run")
    assert loaded is not None and loaded["step"] == 3
    assert torch.equal(fresh.weight, model.weight)
    checkpoints.remove(second)
    assert not second.exists() and checkpoints.read_progress(second) is None
