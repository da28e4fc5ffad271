"""Input files: finding them, and reading their rows as a stream.

Rows are stored as JSONL, JSON (an array, or an object holding one) or Parquet, each plain or
gzip. Reading streams (line by line, Parquet record batch by batch), so memory stays flat over
millions of rows. A file or line that cannot be read becomes a row with a `Rejection`
(`malformed_json`, `unknown_format`); nothing here raises on bad data.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}

# Raw text kept for a rejected whole file (a JSON document that does not parse) is capped.
MAX_RAW_FILE_CHARS = 65536
# Rows per batch as a file is read (a run of JSONL lines, a Parquet record batch).
ROW_BATCH_ROWS = 4096


class Rejection(NamedTuple):
    reason: str
    detail: str


@dataclass(frozen=True)
class RawRow:
    """One input row: where it came from, and either its parsed value or why it did not parse."""

    source: str
    line: int  # 1-based line (JSONL) or row number (JSON array, Parquet)
    value: Any = None
    raw: str | None = None  # the text as read, when the reader had it (JSONL)
    error: Rejection | None = None

    def raw_text(self) -> str:
        if self.raw is not None:
            return self.raw
        return orjson.dumps(self.value, default=str).decode()


def input_format(path: Path) -> str | None:
    """`jsonl`, `json` or `parquet` from the file name (a trailing `.gz` is allowed), else None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return SUFFIX_FORMATS.get(suffixes[-1]) if suffixes else None


def list_input_files(sources: list[str]) -> tuple[list[Path], list[Path]]:
    """Input files of `sources` (files, or folders scanned recursively in sorted order).

    Returns (files to read, files skipped in folders because their type is not an input type).
    A missing source or a named file of an unknown type is a configuration error.
    """
    files: list[Path] = []
    skipped: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            for child in sorted(p for p in path.rglob("*") if p.is_file()):
                (files if input_format(child) else skipped).append(child)
        elif path.is_file():
            if input_format(path) is None:
                raise SystemExit(
                    f"data.sources: {source} is not a .jsonl, .ndjson, .json or .parquet file "
                    "(optionally .gz); rename it or point data.sources at a folder"
                )
            files.append(path)
        else:
            raise SystemExit(
                f"data.sources: {source} does not exist (run from the repository root, or set "
                f"data.sources, e.g. `draftline compose 'data.sources=[path/to/files]'`)"
            )
    return files, skipped


def _open_binary(path: Path) -> io.BufferedIOBase:
    # gzip by content, not by name: a mislabelled file still reads.
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


# What a broken file raises while it is read (a truncated or corrupt gzip stream, an I/O error).
READ_ERRORS = (OSError, EOFError, zlib.error)


@dataclass(frozen=True)
class RowBatch:
    """Consecutive rows of one file, read but not yet parsed.

    Exactly one of `texts` (the JSON text of each row: a JSONL line, or one row of a JSON document
    serialised again), `arrow` (a Parquet record batch) or `failed` (rows that could not be read
    at all, each already a rejection) holds the rows. Batches are cheap to slice and to send to
    another process; `values()` parses them there, and `rows()`/`raw_text()` give the same rows
    and raw texts wherever that happens.
    """

    source: str
    lines: Sequence[int]  # 1-based line (JSONL) or row number (JSON array, Parquet) of each row
    texts: list[bytes] | None = None
    arrow: Any = None
    failed: list[RawRow] | None = None

    def __len__(self) -> int:
        return len(self.lines)

    def slice(self, start: int, stop: int) -> RowBatch:
        if start == 0 and stop >= len(self):
            return self
        texts = self.texts[start:stop] if self.texts is not None else None
        arrow = self.arrow.slice(start, stop - start) if self.arrow is not None else None
        failed = self.failed[start:stop] if self.failed is not None else None
        return RowBatch(self.source, self.lines[start:stop], texts, arrow, failed)

    def values(self) -> Iterator[Any]:
        """Each row's parsed value, or the `Rejection` of a row that does not parse."""
        if self.texts is not None:
            loads = orjson.loads
            for text in self.texts:
                try:
                    yield loads(text)
                except orjson.JSONDecodeError as err:
                    yield Rejection("malformed_json", str(err))
        elif self.arrow is not None:
            yield from self.arrow.to_pylist()
        else:
            for row in self.failed or ():
                yield row.error

    def raw_text(self, index: int) -> str:
        """Row `index` as text, for rejected.parquet: the line as read, else the value as JSON."""
        if self.texts is not None:
            return self.texts[index].decode("utf-8", errors="replace")
        if self.arrow is not None:
            value = self.arrow.slice(index, 1).to_pylist()[0]
            return orjson.dumps(value, default=str).decode()
        assert self.failed is not None
        return self.failed[index].raw_text()

    def rows(self) -> Iterator[RawRow]:
        for index, (line, value) in enumerate(zip(self.lines, self.values(), strict=True)):
            if isinstance(value, Rejection):
                yield RawRow(self.source, line, raw=self.raw_text(index), error=value)
            elif self.texts is not None:
                yield RawRow(self.source, line, value=value, raw=self.raw_text(index))
            else:
                yield RawRow(self.source, line, value=value)


def read_rows(path: Path) -> Iterator[RawRow]:
    """Every row of one input file, in file order."""
    for batch in read_batches(path):
        yield from batch.rows()


def read_batches(path: Path, batch_rows: int = ROW_BATCH_ROWS) -> Iterator[RowBatch]:
    """The rows of one input file, in file order, in batches of at most `batch_rows` rows.

    A file that breaks part way (a truncated gzip stream, a corrupt Parquet row group) keeps the
    rows read before the break, and the rest becomes one rejected row: reading never raises on
    bad data.
    """
    fmt = input_format(path)
    source = path.as_posix()
    if fmt == "jsonl":
        yield from _read_jsonl(path, source, batch_rows)
    elif fmt == "json":
        yield from _read_json(path, source, batch_rows)
    elif fmt == "parquet":
        yield from _read_parquet(path, source, batch_rows)
    else:
        raise ValueError(f"{path}: not an input file type")


def _failed(source: str, line: int, reason: str, detail: str, raw: str = "") -> RowBatch:
    row = RawRow(source, line, raw=raw, error=Rejection(reason, detail))
    return RowBatch(source, [line], failed=[row])


def _read_jsonl(path: Path, source: str, batch_rows: int) -> Iterator[RowBatch]:
    lines: list[int] = []
    texts: list[bytes] = []
    number = 0
    try:
        with _open_binary(path) as f:
            for number, line in enumerate(f, start=1):
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    continue  # blank lines are not rows
                lines.append(number)
                texts.append(line)
                if len(texts) >= batch_rows:
                    yield RowBatch(source, lines, texts)
                    lines, texts = [], []
    except READ_ERRORS as err:
        if texts:
            yield RowBatch(source, lines, texts)
        yield _failed(source, number + 1, "unknown_format", f"unreadable after this line: {err}")
        return
    if texts:
        yield RowBatch(source, lines, texts)


def _read_json(path: Path, source: str, batch_rows: int) -> Iterator[RowBatch]:
    try:
        with _open_binary(path) as f:
            data = f.read()
    except READ_ERRORS as err:
        yield _failed(source, 1, "unknown_format", f"unreadable: {err}")
        return
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raw = data[: MAX_RAW_FILE_CHARS * 4].decode("utf-8", errors="replace")[:MAX_RAW_FILE_CHARS]
        line = getattr(err, "lineno", 1) or 1
        yield _failed(source, line, "malformed_json", f"file: {err}", raw)
        return
    del data
    rows = _json_rows(value)
    if rows is None:  # one record, or an object that holds no array of rows
        rows = [value]
    # Each row is serialised again, so that it parses, and reads as raw text, like a JSONL line
    # (orjson gives back the same value, and the same text `RawRow.raw_text` would give).
    dumps = orjson.dumps
    for start in range(0, len(rows), batch_rows):
        part = rows[start : start + batch_rows]
        numbers = range(start + 1, start + len(part) + 1)
        yield RowBatch(source, numbers, [dumps(row) for row in part])


def _json_rows(value: Any) -> list[Any] | None:
    """The rows of a JSON document: the array itself, or the one array an object holds."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict) and not (value.keys() & {"conversations", "messages", "prompt"}):
        arrays = [v for v in value.values() if isinstance(v, list)]
        if len(arrays) == 1:
            return arrays[0]
    return None


def _read_parquet(path: Path, source: str, batch_rows: int) -> Iterator[RowBatch]:
    import pyarrow.parquet as pq

    try:
        with _open_binary(path) as f:
            # Parquet needs random access; a gzip stream is read into memory first.
            handle: Any = io.BytesIO(f.read()) if isinstance(f, gzip.GzipFile) else path
        parquet = pq.ParquetFile(handle)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one rejected row
        yield _failed(source, 1, "unknown_format", f"unreadable: {err}")
        return
    number = 0
    batches = parquet.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:  # noqa: BLE001 - a corrupt row group ends the file, counted
            yield _failed(source, number + 1, "unknown_format", f"unreadable from here: {err}")
            return
        yield RowBatch(source, range(number + 1, number + batch.num_rows + 1), arrow=batch)
        number += batch.num_rows
