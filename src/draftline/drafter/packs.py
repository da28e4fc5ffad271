"""The extracted token packs (`data/extracted/`): the index, one pack's tensors, and the
sequences training reads from them. Written by `draftline.drafter.extraction`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftline.drafter.objective import keeps_sequence

INDEX_NAME = "index.json"


def read_index(folder: str | Path) -> dict[str, Any]:
    """The index of a complete extraction folder; a clear error when it is incomplete."""
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        raise SystemExit(f"{path} not found: the extraction is missing or incomplete; run extract")
    return json.loads(path.read_text(encoding="utf-8"))


def load_pack(path: str | Path) -> dict[str, Any]:
    """All tensors of a pack plus its `ids` (list of sample ids)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        data: dict[str, Any] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        data["ids"] = json.loads((f.metadata() or {})["ids"])
    return data


class ExtractedData:
    """Sequences of `data/extracted/`: token ids, loss masks, and offline features on demand."""

    def __init__(self, folder: str | Path, block_size: int) -> None:
        self.folder = Path(folder)
        index_path = self.folder / INDEX_NAME
        if not index_path.exists():
            raise SystemExit(f"{index_path} not found: run the extract stage (dvc repro extract)")
        self.index = json.loads(index_path.read_text(encoding="utf-8"))
        self.online = self.index["features"] == "online"
        self.fingerprint = hashlib.sha256(index_path.read_bytes()).hexdigest()
        self.items: list[tuple[str, str, int, int]] = []  # (sample id, pack, start, end)
        self._tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dropped = 0
        for shard in self.index["shards"]:
            pack = str(self.folder / shard["file"])
            with safe_open(pack, framework="pt") as f:
                ids = json.loads((f.metadata() or {}).get("ids", "[]"))
                input_ids, loss_mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
                offsets = f.get_tensor("offsets").tolist()
            self._tokens[pack] = (input_ids, loss_mask)
            if len(ids) != len(offsets) - 1:
                raise SystemExit(f"{pack}: {len(ids)} ids for {len(offsets) - 1} sequences")
            for i, sample_id in enumerate(ids):
                start, end = offsets[i], offsets[i + 1]
                if keeps_sequence(loss_mask[start:end], block_size):
                    self.items.append((sample_id, pack, start, end))
                else:
                    self.dropped += 1

    def __len__(self) -> int:
        return len(self.items)

    def tokens(self, i: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        sample_id, pack, start, end = self.items[i]
        input_ids, loss_mask = self._tokens[pack]
        return sample_id, input_ids[start:end].long(), loss_mask[start:end].bool()

    def features(self, i: int) -> torch.Tensor:
        """[T, K*H] bf16 features of sequence i, read from disk (only that slice)."""
        _, pack, start, end = self.items[i]
        with safe_open(pack, framework="pt") as f:
            return f.get_slice("features")[start:end]
