"""The extracted token packs (`data/extracted/`): the index, one pack's tensors, and the
sequences training reads from them. Written by `draftline.drafter.extraction`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
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


def shard_folder(root: str | Path, shard: int) -> Path:
    """Where `extract --shard K` writes shard K's packs: `data/extracted/shard-K/`."""
    return Path(root) / f"shard-{shard}"


class ExtractedData:
    """Sequences of one or more extraction folders (`data/extracted/shard-K/`), in the order
    given: token ids, loss masks, and offline features on demand. `offsets[j]` is the index of
    folder j's first sequence, so a shard's sequences keep their place whatever else is read."""

    def __init__(self, folders: str | Path | Sequence[str | Path], block_size: int) -> None:
        self.folders = (
            [Path(folders)] if isinstance(folders, (str, Path)) else list(map(Path, folders))
        )
        if not self.folders:
            raise SystemExit("no extraction folder to train on: run the extract stages first")
        self.items: list[tuple[str, str, int, int]] = []  # (sample id, pack, start, end)
        self._tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dropped = 0
        self.offsets: list[int] = []
        digest = hashlib.sha256()
        indexes = []
        for folder in self.folders:
            index_path = folder / INDEX_NAME
            if not index_path.exists():
                raise SystemExit(
                    f"{index_path} not found: run the extract stage of that shard "
                    f"(dvc repro extract@{folder.name.removeprefix('shard-')})"
                )
            digest.update(index_path.read_bytes())
            indexes.append(json.loads(index_path.read_text(encoding="utf-8")))
            self.offsets.append(len(self.items))
            self._read_folder(folder, indexes[-1], block_size)
        modes = {index["features"] for index in indexes}
        if len(modes) > 1:
            raise SystemExit(
                f"extraction folders mix feature modes {sorted(modes)}: rerun extract with one "
                "extract.features for every shard"
            )
        self.index = indexes[0]
        self.online = self.index["features"] == "online"
        self.fingerprint = digest.hexdigest()

    def _read_folder(self, folder: Path, index: dict[str, Any], block_size: int) -> None:
        for shard in index["shards"]:
            pack = str(folder / shard["file"])
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

    def sizes(self) -> list[int]:
        """Usable sequences per folder."""
        ends = [*self.offsets[1:], len(self.items)]
        return [end - start for start, end in zip(self.offsets, ends, strict=True)]

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
