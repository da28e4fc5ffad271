"""Atomic writers: what they write is readable and byte-identical from run to run."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftline.runtime.atomic import write_safetensors


def test_safetensors_files_are_byte_identical_and_readable(tmp_path: Path) -> None:
    # safetensors alone orders metadata keys at random: 20 writes give many different files.
    tensors = {"features": torch.randn(7, 5).to(torch.bfloat16), "ids": torch.arange(7)}
    metadata = {"ids": json.dumps(["a", "b"]), "fingerprint": "f" * 64, "format": "1", "x": "y"}
    paths = [tmp_path / f"pack-{n}.safetensors" for n in range(20)]
    for path in paths:
        write_safetensors(path, tensors, metadata)
    assert len({p.read_bytes() for p in paths}) == 1
    loaded = load_file(str(paths[0]))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with safe_open(str(paths[0]), framework="pt") as f:
        assert f.metadata() == metadata
    assert not list(tmp_path.glob(".*.tmp"))
