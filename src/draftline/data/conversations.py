"""Raw conversations: finding input files, reading their rows, normalising rows to chat messages.

Rows are ShareGPT (`conversations`: from/value), OpenAI-style (`messages`: role/content, with
assistant `tool_calls` and `tool` turns) or prompt rows (`prompt`, optional `system`), stored as
JSONL, JSON (an array, or an object holding one) or Parquet, each plain or gzip. Reading streams
(line by line, Parquet record batch by batch), so memory stays flat over millions of rows. A row
that cannot be used becomes a `Rejection` with a reason from `REASONS`; nothing here raises on
bad data.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

# Rejection reasons, in the order the checks run (docs/pipeline.md).
REASONS = (
    "malformed_json",
    "unknown_format",
    "unknown_role",
    "empty_turn",
    "broken_alternation",
    "no_user_turn",
    "duplicate",
    "template_rejects",
    "prompt_too_long",
)

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}

USER_ROLES = frozenset({"user", "human"})
ASSISTANT_ROLES = frozenset(
    {"assistant", "gpt", "chatgpt", "bard", "model", "bing", "claude", "ai", "bot"}
)
SYSTEM_ROLES = frozenset({"system"})
# Tool results: `function`/`observation` (ShareGPT-style data), `ipython` (Llama 3.1).
TOOL_ROLES = frozenset({"tool", "function", "observation", "ipython"})
# A ShareGPT turn whose value is the assistant's tool call(s) as JSON.
CALL_ROLE = "function_call"

# Raw text kept for a rejected whole file (a JSON document that does not parse) is capped.
MAX_RAW_FILE_CHARS = 65536
# Rows per batch as a file is read (a run of JSONL lines, a Parquet record batch).
ROW_BATCH_ROWS = 4096

# {"role", "content"}, plus "tool_calls" (a non-empty list) only on an assistant that calls tools:
# a message without calls has exactly those two keys, so its canonical JSON (and id) is as it was.
Message = dict[str, Any]


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


def normalise(value: Any) -> list[Message] | Rejection:
    """The row's prompt as messages, or why it cannot be one.

    Roles become system/user/assistant/tool; content is stripped of surrounding whitespace; an
    empty system prompt is dropped; assistant tool calls are kept (`_tool_calls`); the
    conversation is cut after its last user or tool turn (the target regenerates what follows).
    The kept prefix must be: optional system, then a user turn, then turns in an order a chat
    can take (`_order_error`), with no empty turn but an assistant turn that only calls tools.
    """
    if not isinstance(value, dict):
        return Rejection("unknown_format", f"row is a JSON {_json_type(value)}, not an object")
    # A null key counts as absent: a Parquet file of mixed rows has every column in every row.
    if value.get("conversations") is not None:
        turns, role_key, content_key = value["conversations"], "from", "value"
    elif value.get("messages") is not None:
        turns, role_key, content_key = value["messages"], "role", "content"
    elif value.get("prompt") is not None:
        turns = [{"role": "user", "content": value["prompt"]}]
        role_key, content_key = "role", "content"
    else:
        keys = ", ".join(sorted(map(str, value.keys()))[:8]) or "none"
        return Rejection(
            "unknown_format", f"no 'conversations', 'messages' or 'prompt' value (keys: {keys})"
        )
    if not isinstance(turns, list):
        return Rejection("unknown_format", f"turns are a JSON {_json_type(turns)}, not an array")

    messages: list[Message] = []
    system = value.get("system")
    if system is not None:
        if not isinstance(system, str):
            return Rejection("unknown_format", f"'system' is a JSON {_json_type(system)}")
        if system.strip():
            messages.append({"role": "system", "content": system.strip()})
    for index, turn in enumerate(turns):
        message = _message(index, turn, role_key, content_key)
        if isinstance(message, Rejection):
            return message
        if message["role"] == "system" and not message["content"] and not messages:
            continue  # an empty system prompt says nothing
        messages.append(message)

    if all(m["role"] != "user" for m in messages):
        return Rejection("no_user_turn", f"{len(messages)} turns, none from the user")
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    messages = messages[: last + 1]
    for index, message in enumerate(messages):
        if not message["content"] and "tool_calls" not in message:
            return Rejection("empty_turn", f"turn {index} ({message['role']}) is empty")
    error = _order_error(messages)
    if error is not None:
        return Rejection("broken_alternation", error)
    return messages


def _message(index: int, turn: Any, role_key: str, content_key: str) -> Message | Rejection:
    """One turn as a message (tool calls included), or why it cannot be one."""
    if not isinstance(turn, dict):
        return Rejection("unknown_format", f"turn {index} is a JSON {_json_type(turn)}")
    # Accept either key pair in either format: datasets mix them.
    role_raw = turn.get(role_key, turn.get("role", turn.get("from")))
    content_raw = turn.get(content_key, turn.get("content", turn.get("value")))
    role = _role(role_raw)
    if role is None:
        return Rejection("unknown_role", f"turn {index}: role {role_raw!r}")
    if role == CALL_ROLE:
        calls = _tool_calls(_parsed(content_raw))
        if isinstance(calls, str):
            return Rejection("unknown_format", f"turn {index} ({CALL_ROLE}): {calls}")
        return {"role": "assistant", "content": "", "tool_calls": calls}
    content = _content(content_raw)
    if content is None:
        return Rejection(
            "unknown_format", f"turn {index}: content is a JSON {_json_type(content_raw)}"
        )
    message: Message = {"role": role, "content": content}
    # Null or [] is no call: a Parquet file of mixed turns has the key on every turn.
    if turn.get("tool_calls"):
        if role != "assistant":
            return Rejection("unknown_format", f"turn {index}: tool_calls on a {role} turn")
        calls = _tool_calls(turn["tool_calls"])
        if isinstance(calls, str):
            return Rejection("unknown_format", f"turn {index}: {calls}")
        message["tool_calls"] = calls
    return message


def _parsed(value: Any) -> Any:
    """A JSON text parsed (ShareGPT stores calls as text), anything else as it is."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _tool_calls(value: Any) -> list[dict[str, Any]] | str:
    """Tool calls in the OpenAI form, or what is wrong with them.

    Takes a list of calls or one call, each `{"type": "function", "function": {name, arguments},
    "id"?}` or flat `{name, arguments}` (ShareGPT-style); gives `{"type": "function",
    "function": {"name", "arguments"}}` plus `id` when the call had one.
    """
    calls = value if isinstance(value, list) else [value]
    if not calls:
        return "no tool call"
    result = []
    for number, raw in enumerate(calls):
        call = _tool_call(raw)
        if isinstance(call, str):
            return f"tool call {number}: {call}"
        result.append(call)
    return result


def _tool_call(raw: Any) -> dict[str, Any] | str:
    if not isinstance(raw, dict):
        return f"a JSON {_json_type(raw)}, not an object"
    if raw.get("type") not in (None, "function"):
        return f"type {raw['type']!r}, not 'function'"
    function = raw["function"] if raw.get("function") is not None else raw
    if not isinstance(function, dict):
        return f"function is a JSON {_json_type(function)}"
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"name {name!r}"
    arguments = _arguments(function.get("arguments"))
    if arguments is None:
        return f"arguments are a JSON {_json_type(function.get('arguments'))}"
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": name.strip(), "arguments": arguments},
    }
    if isinstance(raw.get("id"), str) and raw["id"]:
        call["id"] = raw["id"]
    return call


def _arguments(value: Any) -> Any:
    """Call arguments: an object (a JSON text of one is parsed, so templates that `tojson` them
    render them once), other text as it is, absent as {}; None when they are neither."""
    if value is None:
        return {}
    if isinstance(value, str):
        parsed = _parsed(value)
        return parsed if isinstance(parsed, dict) else value
    if not isinstance(value, dict):
        return None
    try:
        # Through JSON and back: memory then holds exactly what the Parquet column reads back.
        return orjson.loads(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return None


def _order_error(messages: list[Message]) -> str | None:
    """Why the turns are in an order no chat takes, or None: after an optional system prompt,
    user first; the assistant answers a user or a tool; tools answer a call (or run after
    another tool); the user speaks after the assistant."""
    start = 1 if messages[0]["role"] == "system" else 0
    previous: Message | None = None
    for index in range(start, len(messages)):
        role = messages[index]["role"]
        expected = _next_roles(previous)
        if role not in expected:
            roles = ",".join(m["role"] for m in messages)
            return f"turn {index} is {role}, expected {' or '.join(expected)} (roles: {roles})"
        previous = messages[index]
    return None


def _next_roles(previous: Message | None) -> tuple[str, ...]:
    if previous is None:
        return ("user",)
    if previous["role"] == "user":
        return ("assistant",)
    if previous["role"] == "tool":
        return ("assistant", "tool")
    return ("user", "tool") if "tool_calls" in previous else ("user",)


def _role(value: Any) -> str | None:
    """system/user/assistant/tool, CALL_ROLE for a ShareGPT call turn, None when unknown."""
    if not isinstance(value, str):
        return None
    role = value.strip().lower()
    if role in USER_ROLES:
        return "user"
    if role in ASSISTANT_ROLES:
        return "assistant"
    if role in SYSTEM_ROLES:
        return "system"
    if role in TOOL_ROLES:
        return "tool"
    if role == CALL_ROLE:
        return CALL_ROLE
    return None


def _content(value: Any) -> str | None:
    """Text of a message: a string, or OpenAI-style text parts joined; None when not text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value).strip()
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def canonical_json(value: Any) -> bytes:
    """The canonical JSON the id hashes (of messages) and the table stores (of tool calls):
    sorted keys, no whitespace, UTF-8."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def uses_tools(messages: list[Message]) -> bool:
    """Whether a conversation has tool turns or calls (not every chat template renders them)."""
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def messages_to_records(messages: list[Message]) -> list[dict[str, str | None]]:
    """Messages as the curated table stores them: `tool_calls` as canonical JSON text, or null."""
    return [
        {
            "role": m["role"],
            "content": m["content"],
            "tool_calls": canonical_json(m["tool_calls"]).decode() if "tool_calls" in m else None,
        }
        for m in messages
    ]


def messages_from_records(records: Iterable[dict[str, Any]]) -> list[Message]:
    """Messages read back from the curated table's `messages` column (a row's list of structs),
    in the form they had when normalised: `tool_calls` parsed, and absent where null."""
    messages: list[Message] = []
    for record in records:
        message: Message = {"role": record["role"], "content": record["content"]}
        if record.get("tool_calls") is not None:
            message["tool_calls"] = orjson.loads(record["tool_calls"])
        messages.append(message)
    return messages
