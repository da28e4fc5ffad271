"""Curation: raw rows -> deduplicated, filtered, split and sharded prompt tables, with metrics.

Rows stream through in chunks: each chunk is normalised (`draftline.conversations`), given its
id, deduplicated against every id seen before (first occurrence wins), token-counted in one
batch with the target's fast tokenizer, and spilled to per-destination Parquet scratch files.
At the end each destination (train shard k, eval, rejected) is read back on its own, sorted by
id and written atomically, so memory holds one shard at a time and never a Python object per
row of the whole input.

Split and shard come from a hash of the id salted with `split_seed`: they depend on nothing
but the conversation itself, so adding rows never moves an existing one.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draftline.atomic import atomic_path, write_parquet
from draftline.conversations import (
    REASONS,
    Message,
    RawRow,
    Rejection,
    canonical_json,
    list_input_files,
    normalise,
    read_rows,
)

MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
CURATED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", MESSAGE_TYPE),
        ("num_turns", pa.int32()),
        ("num_prompt_tokens", pa.int32()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("shard", pa.int32()),
    ]
)
REJECTED_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("line", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("raw", pa.string()),
    ]
)
EXAMPLE_RAW_CHARS = 300


@dataclass(frozen=True)
class CurateSettings:
    max_prompt_tokens: int
    eval_fraction: float
    num_shards: int
    split_seed: str
    chunk_rows: int = 8192


def conversation_id(messages: list[Message]) -> str:
    """16 hex chars of the sha256 of the messages' canonical JSON."""
    return hashlib.sha256(canonical_json(messages)).hexdigest()[:16]


def assign_split(conv_id: str, eval_fraction: float, num_shards: int, seed: str) -> tuple[str, int]:
    """(`train`, shard) or (`eval`, -1), from the salted id hash alone.

    The first 8 bytes of the hash pick the split, the next 8 the shard, so eval membership and
    shard sizes are independent; raising eval_fraction only moves rows from train to eval.
    """
    digest = hashlib.sha256(f"{seed}\0{conv_id}".encode()).digest()
    if int.from_bytes(digest[:8], "big") < eval_fraction * 2**64:
        return "eval", -1
    return "train", int.from_bytes(digest[8:16], "big") % num_shards


class PromptTokenCounter:
    """Token counts of prompts rendered with the target's chat template (+ generation prompt).

    Counts equal `len(draftline.target.prompt_ids(...))`. Prompts far over the budget are only
    partly tokenized: the rendered text is cut at a space between two letters (a pre-tokenizer
    boundary, so the prefix's tokens are a prefix of the full text's tokens); when that prefix
    alone is over budget, its count is a lower bound and the row is rejected without tokenizing
    the rest. Counts at or under the budget are always exact.
    """

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any] | None,
        max_tokens: int,
        prefix_chars_per_token: int = 8,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise SystemExit(
                "curate needs a fast (Rust) tokenizer for the target: the model folder must hold "
                "tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.max_tokens = max_tokens
        self.prefix_chars = max_tokens * prefix_chars_per_token
        backend = tokenizer.backend_tokenizer
        self._encode = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def render(self, conversations: list[list[Message]]) -> list[str]:
        if not conversations:
            return []
        texts = self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return list(texts)

    def count(self, conversations: list[list[Message]]) -> list[tuple[int, bool]]:
        """(tokens, exact) per conversation; exact is False only for a lower bound over budget."""
        texts = self.render(conversations)
        pieces = [_cut_at_word_boundary(t, self.prefix_chars) for t in texts]
        counts = self._lengths([p for p in pieces])
        result = [(n, True) for n in counts]
        recount = []
        for i, (text, piece, n) in enumerate(zip(texts, pieces, counts, strict=True)):
            if len(piece) < len(text):
                if n > self.max_tokens:
                    result[i] = (n, False)
                else:
                    recount.append(i)
        if recount:
            for i, n in zip(recount, self._lengths([texts[i] for i in recount]), strict=True):
                result[i] = (n, True)
        return result

    def _lengths(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(e) for e in self._encode(texts, add_special_tokens=False)]


def _cut_at_word_boundary(text: str, limit: int) -> str:
    """`text` cut before a space that sits between two letters, at or before `limit` chars.

    Returns `text` itself when it is short enough or no such space is near the limit.
    """
    if len(text) <= limit:
        return text
    pos = limit
    floor = limit // 2
    while pos > floor:
        pos = text.rfind(" ", floor, pos)
        if pos <= 0:
            break
        if text[pos - 1].isalpha() and text[pos + 1].isalpha():
            return text[:pos]
    return text


@dataclass
class CurateResult:
    """What a run did: counts for metrics, and an example row per reject reason for messages."""

    rows_read: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    shard_rows: list[int] = field(default_factory=list)
    eval_rows: int = 0
    prompt_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    examples: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: int = 0
    files_skipped: list[str] = field(default_factory=list)

    @property
    def rows_rejected(self) -> int:
        return sum(self.rejected.values())

    @property
    def rows_kept(self) -> int:
        return self.rows_read - self.rows_rejected

    @property
    def reject_rate(self) -> float:
        return self.rows_rejected / self.rows_read if self.rows_read else 0.0

    def metrics(self) -> dict[str, Any]:
        tokens = self.prompt_tokens
        quantiles = {}
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            quantiles[name] = int(np.quantile(tokens, q, method="inverted_cdf")) if len(tokens) else 0
        quantiles["max"] = int(tokens.max()) if len(tokens) else 0
        quantiles["mean"] = round(float(tokens.mean()), 2) if len(tokens) else 0.0
        return {
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rows_rejected": self.rows_rejected,
            "reject_rate": round(self.reject_rate, 6),
            "rejected_by_reason": {r: self.rejected.get(r, 0) for r in REASONS},
            "train_rows": sum(self.shard_rows),
            "eval_rows": self.eval_rows,
            "shard_rows": {f"{k:05d}": n for k, n in enumerate(self.shard_rows)},
            "shard_rows_min": min(self.shard_rows, default=0),
            "shard_rows_max": max(self.shard_rows, default=0),
            "prompt_tokens": quantiles,
            "files_read": self.files,
            "files_skipped": len(self.files_skipped),
        }

    def reject_summary(self, top: int = 3) -> str:
        """Top reasons with counts and one example each, for the threshold failure message."""
        lines = []
        for reason, count in self.rejected.most_common(top):
            ex = self.examples[reason]
            raw = ex["raw"][:EXAMPLE_RAW_CHARS]
            lines.append(
                f"  {reason}: {count} rows, e.g. {ex['source']}:{ex['line']}: {ex['detail']}\n"
                f"      {raw}"
            )
        return "\n".join(lines)


def shard_file_name(shard: int) -> str:
    return f"shard-{shard}.parquet"


def curate(
    sources: list[str],
    out_dir: str | Path,
    counter: PromptTokenCounter,
    settings: CurateSettings,
    progress: bool = True,
) -> CurateResult:
    """Curate `sources` into `out_dir` (train/shard-K.parquet, eval.parquet, rejected.parquet).

    The folder is replaced as a whole, atomically, once everything is written.
    """
    from tqdm import tqdm

    files, skipped = list_input_files(sources)
    result = CurateResult(
        shard_rows=[0] * settings.num_shards,
        files=len(files),
        files_skipped=[p.as_posix() for p in skipped],
    )
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-spill-", dir=out.parent))
    spill = _Spill(scratch, settings.num_shards)
    seen = _SeenIds()
    tokens: list[np.ndarray] = []
    try:
        bar = tqdm(desc="curate", unit=" rows", disable=not progress, mininterval=1.0)
        rows = _all_rows(files)
        while chunk := list(islice(rows, settings.chunk_rows)):
            tokens.append(_curate_chunk(chunk, counter, settings, result, spill, seen))
            result.rows_read += len(chunk)
            bar.update(len(chunk))
        bar.close()
        spill.close()
        result.prompt_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
        with atomic_path(out) as tmp:
            (tmp / "train").mkdir(parents=True)
            for shard in range(settings.num_shards):
                table = _sorted_by_id(spill.read(shard))
                write_parquet(tmp / "train" / shard_file_name(shard), table)
            write_parquet(tmp / "eval.parquet", _sorted_by_id(spill.read("eval")))
            write_parquet(tmp / "rejected.parquet", spill.read("rejected"))
    finally:
        spill.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def _all_rows(files: Iterable[Path]) -> Iterator[RawRow]:
    for path in files:
        yield from read_rows(path)


def _curate_chunk(
    chunk: list[RawRow],
    counter: PromptTokenCounter,
    settings: CurateSettings,
    result: CurateResult,
    spill: _Spill,
    seen: _SeenIds,
) -> np.ndarray:
    """Process one chunk; returns the prompt-token counts of the rows it kept."""
    rejected: list[tuple[RawRow, Rejection]] = []
    pending: list[tuple[RawRow, list[Message], str]] = []
    for row in chunk:
        outcome = row.error or normalise(row.value)
        if isinstance(outcome, Rejection):
            rejected.append((row, outcome))
            continue
        conv_id = conversation_id(outcome)
        first = seen.first(conv_id, row)
        if first is not None:
            rejected.append((row, Rejection("duplicate", f"id {conv_id}, first at {first}")))
            continue
        pending.append((row, outcome, conv_id))

    counts = counter.count([messages for _, messages, _ in pending])
    kept: dict[Any, dict[str, list[Any]]] = {}
    kept_tokens: list[int] = []
    for (row, messages, conv_id), (n, exact) in zip(pending, counts, strict=True):
        if n > settings.max_prompt_tokens:
            bound = "" if exact else "at least "
            rejected.append(
                (
                    row,
                    Rejection(
                        "prompt_too_long",
                        f"{bound}{n} tokens > data.max_prompt_tokens={settings.max_prompt_tokens}",
                    ),
                )
            )
            continue
        split, shard = assign_split(
            conv_id, settings.eval_fraction, settings.num_shards, settings.split_seed
        )
        dest = "eval" if split == "eval" else shard
        cols = kept.setdefault(dest, {name: [] for name in CURATED_SCHEMA.names})
        cols["id"].append(conv_id)
        cols["messages"].append(messages)
        cols["num_turns"].append(len(messages))
        cols["num_prompt_tokens"].append(n)
        cols["source"].append(row.source)
        cols["split"].append(split)
        cols["shard"].append(shard)
        kept_tokens.append(n)
        if split == "eval":
            result.eval_rows += 1
        else:
            result.shard_rows[shard] += 1

    for dest, cols in kept.items():
        spill.write(dest, pa.Table.from_pydict(cols, schema=CURATED_SCHEMA))
    if rejected:
        rejected.sort(key=lambda item: (item[0].source, item[0].line))
        cols = {name: [] for name in REJECTED_SCHEMA.names}
        for row, rejection in rejected:
            raw = row.raw_text()
            cols["source"].append(row.source)
            cols["line"].append(row.line)
            cols["reason"].append(rejection.reason)
            cols["detail"].append(rejection.detail)
            cols["raw"].append(raw)
            result.rejected[rejection.reason] += 1
            if rejection.reason not in result.examples:
                result.examples[rejection.reason] = {
                    "source": row.source,
                    "line": row.line,
                    "detail": rejection.detail,
                    "raw": raw[:EXAMPLE_RAW_CHARS],
                }
        spill.write("rejected", pa.Table.from_pydict(cols, schema=REJECTED_SCHEMA))
    return np.asarray(kept_tokens, dtype=np.int32)


def _sorted_by_id(table: pa.Table) -> pa.Table:
    return table.sort_by("id")


class _SeenIds:
    """Ids seen so far and where each first appeared, as plain ints (about 100 bytes a row)."""

    def __init__(self) -> None:
        self.where: dict[int, int] = {}  # id -> source index << 40 | line
        self.sources: list[str] = []
        self.source_index: dict[str, int] = {}

    def first(self, conv_id: str, row: RawRow) -> str | None:
        """`source:line` of the first row with this id, or None (and remember this row)."""
        key = int(conv_id, 16)
        packed = self.where.get(key)
        if packed is not None:
            return f"{self.sources[packed >> 40]}:{packed & (2**40 - 1)}"
        index = self.source_index.get(row.source)
        if index is None:
            index = self.source_index[row.source] = len(self.sources)
            self.sources.append(row.source)
        self.where[key] = index << 40 | row.line
        return None


class _Spill:
    """Per-destination scratch Parquet files, appended chunk by chunk, read back one at a time."""

    def __init__(self, folder: Path, num_shards: int) -> None:
        self.folder = folder
        self.writers: dict[Any, pq.ParquetWriter] = {}
        self.schemas: dict[Any, pa.Schema] = {"rejected": REJECTED_SCHEMA}

    def _path(self, dest: Any) -> Path:
        return self.folder / f"{dest}.parquet"

    def write(self, dest: Any, table: pa.Table) -> None:
        writer = self.writers.get(dest)
        if writer is None:
            # lz4 is cheap to write and read; these files live for one run only.
            writer = pq.ParquetWriter(self._path(dest), table.schema, compression="lz4")
            self.writers[dest] = writer
        writer.write_table(table)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()

    def read(self, dest: Any) -> pa.Table:
        path = self._path(dest)
        if not path.exists():
            schema = REJECTED_SCHEMA if dest == "rejected" else CURATED_SCHEMA
            return schema.empty_table()
        return pq.read_table(path)
