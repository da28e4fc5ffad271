"""Input files: finding them, and reading their rows as a stream.

Rows are stored as JSONL, JSON (an array, or an object holding one) or Parquet, each plain or
gzip. Reading streams (line by line, Parquet record batch by batch), so memory stays flat over
millions of rows. A line that does not parse becomes a row with a `Rejection`
(`malformed_json`). A file that cannot be read whole -- a gzip stream cut short, a corrupt
Parquet row group, a JSON document that ends early, no rows at all -- raises `InputFileError`
after the rows read before the break: its lost rows cannot be counted as rows (how many a cut
file held is not known), so it is never counted as one rejected row either. A text file in
UTF-16 or UTF-32 raises `EncodingError` before any row: each of its lines would be rejected.
"""

from __future__ import annotations

import gzip
import io
import shlex
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}

# Rows per batch as a file is read (a run of JSONL lines, a Parquet record batch).
ROW_BATCH_ROWS = 4096


class InputFileError(SystemExit):
    """An input file that cannot be read whole: where, how many rows came before the break, and
    how many it holds in all when the file says so (Parquet). A SystemExit, like the other
    errors in the user's inputs: uncaught, it ends the command with its one line."""

    kind = "cut short, corrupt or empty"

    def __init__(self, source: str, rows_read: int, detail: str, rows_total: int | None = None):
        self.source, self.rows_read, self.rows_total = source, rows_read, rows_total
        self.detail = " ".join(detail.split())  # one line, whatever the reader said
        super().__init__(self.message())

    def message(self) -> str:
        if self.rows_read == 0 and self.detail == EMPTY:
            return f"{self.source}: {EMPTY}: put conversations in it or take it out of data.sources"
        lost = (
            f", {self.rows_total - self.rows_read} of its {self.rows_total} rows lost"
            if self.rows_total is not None
            else ""
        )
        check = f" (`gzip -t {self.source}` tests it)" if self.source.endswith(".gz") else ""
        return (
            f"{self.source}: cut short or corrupt after {self.rows_read} rows{lost}: "
            f"{self.detail}; copy it again from where it came from{check}, or take it out of "
            "data.sources"
        )


class EncodingError(InputFileError):
    """A text input file in UTF-16 or UTF-32 (as Windows editors and PowerShell save them):
    JSON is read as UTF-8, and `iconv` converts it."""

    kind = "not UTF-8"

    def __init__(self, source: str, encoding: str):
        self.encoding = encoding
        super().__init__(source, 0, f"{encoding} text")

    def message(self) -> str:
        path, copy = shlex.quote(self.source), shlex.quote(self.source + ".utf8")
        convert = f"iconv -f {self.encoding} -t UTF-8"
        if self.source.endswith(".gz"):
            command = f"gunzip -c {path} | {convert} | gzip > {copy}"
        else:
            command = f"{convert} {path} > {copy}"
        return (
            f"{self.source}: {self.encoding} text, not UTF-8: convert it (`{command} && mv "
            f"{copy} {path}`), or take it out of data.sources"
        )


# Byte-order marks of the other Unicode encodings; UTF-32LE's starts with UTF-16LE's.
BYTE_ORDER_MARKS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def other_encoding(head: bytes) -> str | None:
    """The encoding of a text file that starts with `head`, when it is not UTF-8: a UTF-16 or
    UTF-32 byte-order mark, or JSON's opening `{` or `[` beside a NUL byte (UTF-16 without a
    mark; a NUL is never raw in JSON text)."""
    for mark, name in BYTE_ORDER_MARKS:
        if head.startswith(mark):
            return name
    if head[1:2] == b"\x00" and head[:1] in (b"{", b"["):
        return "UTF-16LE"
    if head[:1] == b"\x00" and head[1:2] in (b"{", b"["):
        return "UTF-16BE"
    return None


class BrokenInputFiles(SystemExit):
    """Every input file of a run that could not be read whole, one line each."""

    def __init__(self, errors: list[InputFileError]):
        self.errors = errors
        files = f"{len(errors)} input file{'s are' if len(errors) > 1 else ' is'}"
        head = f"{files} {', or '.join(dict.fromkeys(e.kind for e in errors))}"
        super().__init__("\n".join([f"{head}:"] + [f"  {e.message()}" for e in errors]))


EMPTY = "empty (no rows)"


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
            found = [p for p in sorted(path.rglob("*")) if p.is_file()]
            if not any(input_format(p) for p in found):
                others = f" ({len(found)} other files in it)" if found else ""
                raise SystemExit(
                    f"data.sources: {source} holds no input files{others}: put the "
                    "conversations there as .jsonl, .ndjson, .json or .parquet (optionally "
                    "gzip, .gz), or point data.sources at them"
                )
            for child in found:
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

    Exactly one of `texts` (the JSON text of each row: a JSONL line, or one row of a JSON
    document serialised again) or `arrow` (a Parquet record batch) holds the rows. Batches are
    cheap to slice and to send to another process; `values()` parses them there, and
    `rows()`/`raw_text()` give the same rows and raw texts wherever that happens.
    """

    source: str
    lines: Sequence[int]  # 1-based line (JSONL) or row number (JSON array, Parquet) of each row
    texts: list[bytes] | None = None
    arrow: Any = None

    def __len__(self) -> int:
        return len(self.lines)

    def slice(self, start: int, stop: int) -> RowBatch:
        if start == 0 and stop >= len(self):
            return self
        texts = self.texts[start:stop] if self.texts is not None else None
        arrow = self.arrow.slice(start, stop - start) if self.arrow is not None else None
        return RowBatch(self.source, self.lines[start:stop], texts, arrow)

    def values(self) -> Iterator[Any]:
        """Each row's parsed value, or the `Rejection` of a row that does not parse."""
        if self.texts is not None:
            loads = orjson.loads
            for text in self.texts:
                try:
                    yield loads(text)
                except orjson.JSONDecodeError as err:
                    yield Rejection("malformed_json", str(err))
        else:
            yield from self.arrow.to_pylist()

    def raw_text(self, index: int) -> str:
        """Row `index` as text, for rejected.parquet: the line as read, else the value as JSON."""
        if self.texts is not None:
            return self.texts[index].decode("utf-8", errors="replace")
        value = self.arrow.slice(index, 1).to_pylist()[0]
        return orjson.dumps(value, default=str).decode()

    def rows(self) -> Iterator[RawRow]:
        for index, (line, value) in enumerate(zip(self.lines, self.values(), strict=True)):
            if isinstance(value, Rejection):
                yield RawRow(self.source, line, raw=self.raw_text(index), error=value)
            elif self.texts is not None:
                yield RawRow(self.source, line, value=value, raw=self.raw_text(index))
            else:
                yield RawRow(self.source, line, value=value)


def read_files(paths: Iterable[Path], batch_rows: int = ROW_BATCH_ROWS) -> Iterator[RowBatch]:
    """The rows of every file, in order; then `BrokenInputFiles` naming each file that could
    not be read whole (cut short, corrupt, empty): a run never goes on without part of its
    input, and the user learns of every broken file at once."""
    broken: list[InputFileError] = []
    for path in paths:
        try:
            yield from read_batches(path, batch_rows)
        except InputFileError as err:
            broken.append(err)
    if broken:
        raise BrokenInputFiles(broken)


def read_rows(path: Path) -> Iterator[RawRow]:
    """Every row of one input file, in file order."""
    for batch in read_batches(path):
        yield from batch.rows()


def read_batches(path: Path, batch_rows: int = ROW_BATCH_ROWS) -> Iterator[RowBatch]:
    """The rows of one input file, in file order, in batches of at most `batch_rows` rows.

    A file that breaks part way (a truncated gzip stream, a corrupt Parquet row group) or holds
    no rows yields the rows read before the break, then raises `InputFileError`.
    """
    fmt = input_format(path)
    source = path.as_posix()
    if fmt == "jsonl":
        reader = _read_jsonl(path, source, batch_rows)
    elif fmt == "json":
        reader = _read_json(path, source, batch_rows)
    elif fmt == "parquet":
        reader = _read_parquet(path, source, batch_rows)
    else:
        raise ValueError(f"{path}: not an input file type")
    rows = 0
    for batch in reader:
        rows += len(batch)
        yield batch
    if rows == 0:
        raise InputFileError(source, 0, EMPTY)


def _read_jsonl(path: Path, source: str, batch_rows: int) -> Iterator[RowBatch]:
    lines: list[int] = []
    texts: list[bytes] = []
    number = 0
    rows = 0
    try:
        with _open_binary(path) as f:
            if encoding := other_encoding(f.peek(4)[:4]):  # type: ignore[attr-defined]
                raise EncodingError(source, encoding)
            for number, line in enumerate(f, start=1):
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    continue  # blank lines are not rows
                lines.append(number)
                texts.append(line)
                rows += 1
                if len(texts) >= batch_rows:
                    yield RowBatch(source, lines, texts)
                    lines, texts = [], []
    except READ_ERRORS as err:
        if texts:
            yield RowBatch(source, lines, texts)
        raise InputFileError(source, rows, f"unreadable after line {number}: {err}") from None
    if texts:
        yield RowBatch(source, lines, texts)


def _read_json(path: Path, source: str, batch_rows: int) -> Iterator[RowBatch]:
    try:
        with _open_binary(path) as f:
            data = f.read()
    except READ_ERRORS as err:
        raise InputFileError(source, 0, f"unreadable: {err}") from None
    if encoding := other_encoding(data[:4]):
        raise EncodingError(source, encoding)
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as err:  # one document: where it breaks, no row is known
        raise InputFileError(source, 0, f"not one JSON document: {err}") from None
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
    except Exception as err:  # noqa: BLE001 - any unreadable file is a broken file
        raise InputFileError(source, 0, f"not a Parquet file: {err}") from None
    number = 0
    total = parquet.metadata.num_rows
    for group in range(parquet.num_row_groups):  # a rotten row group: rows before it count
        try:
            for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group]):
                yield RowBatch(source, range(number + 1, number + batch.num_rows + 1), arrow=batch)
                number += batch.num_rows
        except Exception as err:  # noqa: BLE001 - a corrupt row group breaks the file
            raise InputFileError(source, number, f"unreadable from here: {err}", total) from None
