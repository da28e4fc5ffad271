"""Curation's scratch state, kept small so memory never holds a Python object per input row:
the ids seen so far (for first-occurrence dedup) and per-destination spill files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa


class SeenIds:
    """Ids seen so far and where each first appeared, as plain ints (about 100 bytes a row)."""

    def __init__(self) -> None:
        self.where: dict[int, int] = {}  # id -> source index << 40 | line
        self.sources: list[str] = []
        self.source_index: dict[str, int] = {}

    def first(self, conv_id: str, source: str, line: int) -> str | None:
        """`source:line` of the first row with this id, or None (and remember this row)."""
        key = int(conv_id, 16)
        packed = self.where.get(key)
        if packed is not None:
            return f"{self.sources[packed >> 40]}:{packed & (2**40 - 1)}"
        index = self.source_index.get(source)
        if index is None:
            index = self.source_index[source] = len(self.sources)
            self.sources.append(source)
        self.where[key] = index << 40 | line
        return None


class Spill:
    """Per-destination scratch files (Arrow IPC streams), appended chunk by chunk."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.writers: dict[Any, tuple[Any, Any]] = {}
        self.options = pa.ipc.IpcWriteOptions(compression="lz4")

    def path(self, dest: Any) -> Path:
        return self.folder / f"{dest}.arrows"

    def write(self, dest: Any, table: pa.Table) -> None:
        if dest not in self.writers:
            sink = pa.OSFile(str(self.path(dest)), "wb")
            self.writers[dest] = (pa.ipc.new_stream(sink, table.schema, options=self.options), sink)
        self.writers[dest][0].write_table(table)

    def close(self) -> None:
        for writer, sink in self.writers.values():
            writer.close()
            sink.close()
        self.writers.clear()
