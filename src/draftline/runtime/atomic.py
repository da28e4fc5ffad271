"""Atomic file writes: every output goes to a temporary name in its folder, then is renamed.

A reader (or DVC) never sees a half-written file under its final name, whatever kills us.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it onto `path`.

    Works for files and folders. On an exception the temporary is removed and `path` is untouched.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.unlink()
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike[str], data: Any, sort_keys: bool = True) -> None:
    """Write JSON with sorted keys so reruns give byte-identical files (`sort_keys=False`: in
    the order `data` has, for a caller that orders it itself)."""
    text = json.dumps(data, indent=2, sort_keys=sort_keys, default=_jsonable)
    write_text(path, text + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_parquet(path: str | os.PathLike[str], table: Any) -> None:
    """Write a pyarrow Table deterministically (fixed compression, no pandas metadata drift)."""
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", write_statistics=True)


def write_safetensors(
    path: str | os.PathLike[str], tensors: dict[str, Any], metadata: dict[str, str]
) -> None:
    """Write tensors with safetensors, atomically and byte-identical across runs.

    safetensors keeps `metadata` in a hash map, so its keys land in the header in a different
    order in each process: the same tensors would hash differently to DVC on every run. The
    header is rewritten in place with sorted keys; it keeps its length (the padding is spaces,
    as safetensors pads), so the data offsets stay valid.
    """
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        _sort_safetensors_header(tmp)
        tmp.chmod(0o644)  # like any other output file, not the temporary's 0600


def _sort_safetensors_header(path: Path) -> None:
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(canonical) > size:  # only if serde's escaping were shorter than Python's
            raise RuntimeError(f"{path}: sorted safetensors header does not fit ({size} bytes)")
        f.seek(8)
        f.write(canonical.ljust(size, b" "))
