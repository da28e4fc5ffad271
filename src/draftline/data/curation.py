"""Curation: raw rows -> deduplicated, filtered, split and sharded prompt tables, with metrics.

Files are read in order and cut into chunks of rows. Each chunk is parsed, normalised
(`draftline.data.conversations`), given its id, split and shard, and token-counted, by a pool of
worker processes when the input is big (`CurateSettings.workers`) or in this process. Then, in
read order, each row is deduplicated against every id seen before (first occurrence wins),
dropped if the target's chat template refused it or it is over the token budget, and spilled
to a per-destination scratch file. At the end each destination (train shard k, eval, rejected)
is read back on its own, sorted by id and written atomically, so memory holds one shard at a
time and never a Python object per row of the whole input. Nothing depends on the chunk size
or the number of workers: the outputs are the same bytes either way.

Split and shard come from a hash of the id salted with `split_seed`: they depend on nothing
but the conversation itself, so adding rows never moves an existing one.

Token counts are those of `draftline.core.target.prompt_ids`, computed by
`draftline.data.prompt_tokens` (exact, with fast paths where they provably agree).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from draftline.data.conversations import (
    Message,
    canonical_json,
    messages_to_records,
    normalise,
    written_turns,
)
from draftline.data.curate_result import EXAMPLE_RAW_CHARS, CurateResult
from draftline.data.input_files import Rejection, RowBatch, list_input_files, read_files
from draftline.data.prompt_tokens import PromptTokenCounter
from draftline.data.scratch import SeenIds, Spill
from draftline.runtime.atomic import atomic_path, write_parquet

# The list item is named "element", as Parquet names it, so a table reads back as it was written.
# `tool_calls`: an assistant's calls as canonical JSON text, else null (one type for any calls);
# `conversations.messages_from_records` reads a row's messages back.
MESSAGE_TYPE = pa.list_(
    pa.field(
        "element",
        pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string())]),
    )
)
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
# `workers=None` starts a pool only for inputs at least this big: below it, starting the
# processes costs more than it saves.
PARALLEL_MIN_BYTES = 64 * 2**20
MAX_AUTO_WORKERS = 8


@dataclass(frozen=True)
class CurateSettings:
    max_prompt_tokens: int
    eval_fraction: float
    num_shards: int
    split_seed: str
    chunk_rows: int = 8192
    # Worker processes that parse, normalise and count: 0 runs everything in this process;
    # None uses one per CPU for inputs of at least PARALLEL_MIN_BYTES. Outputs do not change.
    workers: int | None = None


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


# ---------------------------------------------------------------------------------------------
# The stage.


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
    workers = _worker_count(settings.workers, files)
    result = CurateResult(
        shard_rows=[0] * settings.num_shards,
        shard_turns=[0] * settings.num_shards,
        files=len(files),
        files_skipped=[p.as_posix() for p in skipped],
        workers=workers,
    )
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-spill-", dir=out.parent))
    spill = Spill(scratch)
    seen = SeenIds()
    tokens: list[np.ndarray] = []
    pool = _start_pool(workers, counter, settings)
    try:
        bar = tqdm(desc="curate", unit=" rows", disable=not progress, mininterval=1.0)
        chunks = _chunks(files, settings.chunk_rows)
        for chunk, work in _worked_chunks(chunks, pool, workers, counter, settings):
            tokens.append(_keep_or_reject(chunk, work, settings, result, spill, seen))
            result.rows_read += sum(len(b) for b in chunk)
            bar.update(sum(len(b) for b in chunk))
        bar.close()
        spill.close()
        result.prompt_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
        with atomic_path(out) as tmp:
            (tmp / "train").mkdir(parents=True)
            jobs = [
                (spill.path(shard), tmp / "train" / shard_file_name(shard), True)
                for shard in range(settings.num_shards)
            ]
            jobs.append((spill.path("eval"), tmp / "eval.parquet", True))
            jobs.append((spill.path("rejected"), tmp / "rejected.parquet", False))
            if pool is None:
                for job in jobs:
                    _write_destination(job)
            else:
                list(pool.map(_write_destination, jobs))
    except BrokenProcessPool as err:
        pool = None  # nothing left to shut down
        raise RuntimeError(
            "curate: a worker process died. A script that calls curate() must start from an "
            "`if __name__ == '__main__':` block (workers are spawned and import it), or set "
            "CurateSettings(workers=0) to work in this process."
        ) from err
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            pool = None
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        spill.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def _worker_count(requested: int | None, files: list[Path]) -> int:
    if requested is not None:
        return max(0, requested)
    if sum(p.stat().st_size for p in files) < PARALLEL_MIN_BYTES:
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_AUTO_WORKERS) if cpus > 1 else 0


def _chunks(files: Iterable[Path], chunk_rows: int) -> Iterator[list[RowBatch]]:
    """Rows of all files in order, `chunk_rows` at a time (the last chunk may be shorter)."""
    chunk: list[RowBatch] = []
    size = 0
    for batch in read_files(files):
        start = 0
        while start < len(batch):
            take = min(len(batch) - start, chunk_rows - size)
            chunk.append(batch.slice(start, start + take))
            size += take
            start += take
            if size == chunk_rows:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


@dataclass
class _ChunkWork:
    """What a chunk's rows are, before deduplication: everything that needs no other chunk."""

    rejected: list[tuple[int, Rejection]]  # (row in chunk, why) for rows that do not normalise
    rows: list[int]  # row in chunk of each normalised row, in order
    table: pa.Table  # the normalised rows (CURATED_SCHEMA), in order
    # position in `rows` -> why, for rows the template refuses or that are over the token budget
    refused: dict[int, Rejection]


def _work_chunk(
    chunk: list[RowBatch], counter: PromptTokenCounter, settings: CurateSettings
) -> _ChunkWork:
    rejected: list[tuple[int, Rejection]] = []
    rows: list[int] = []
    messages: list[list[Message]] = []
    sources: list[str] = []
    index = 0
    for batch in chunk:
        for value in batch.values():
            outcome = value if isinstance(value, Rejection) else normalise(value)
            if isinstance(outcome, Rejection):
                rejected.append((index, outcome))
            else:
                rows.append(index)
                messages.append(outcome)
                sources.append(batch.source)
            index += 1
    ids = [conversation_id(m) for m in messages]
    counts = counter.count(messages)
    splits = [
        assign_split(i, settings.eval_fraction, settings.num_shards, settings.split_seed)
        for i in ids
    ]
    refused: dict[int, Rejection] = {}
    for position, count in enumerate(counts):
        refusal = _refusal(count, settings.max_prompt_tokens)
        if refusal is not None:
            refused[position] = refusal
    table = pa.Table.from_pydict(
        {
            "id": ids,
            "messages": [messages_to_records(m) for m in messages],
            "num_turns": [len(m) for m in messages],
            # A refused row's count is never kept: 0 stands in for the template's rejection.
            "num_prompt_tokens": [0 if isinstance(c, Rejection) else c[0] for c in counts],
            "source": sources,
            "split": [s for s, _ in splits],
            "shard": [k for _, k in splits],
        },
        schema=CURATED_SCHEMA,
    )
    return _ChunkWork(rejected, rows, table, refused)


def _refusal(count: tuple[int, bool] | Rejection, budget: int) -> Rejection | None:
    """Why a normalised row cannot be kept whatever else was read: the template refuses it, or
    its prompt is over the token budget."""
    if isinstance(count, Rejection):
        return count
    n, exact = count
    if n <= budget:
        return None
    bound = "" if exact else "at least "
    return Rejection("prompt_too_long", f"{bound}{n} tokens > data.max_prompt_tokens={budget}")


# Set in each worker process by `_init_worker`.
_WORKER: tuple[PromptTokenCounter, CurateSettings] | None = None


def _init_worker(counter: PromptTokenCounter, settings: CurateSettings) -> None:
    global _WORKER
    _WORKER = (counter, settings)


def _work_chunk_in_worker(chunk: list[RowBatch]) -> _ChunkWork:
    assert _WORKER is not None
    return _work_chunk(chunk, *_WORKER)


def _start_pool(
    workers: int, counter: PromptTokenCounter, settings: CurateSettings
) -> ProcessPoolExecutor | None:
    if workers <= 0:
        return None
    import multiprocessing

    # spawn, not fork: this process may already run threads (Arrow, the tokenizer's pool).
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(counter, settings),
    )


def _worked_chunks(
    chunks: Iterator[list[RowBatch]],
    pool: ProcessPoolExecutor | None,
    workers: int,
    counter: PromptTokenCounter,
    settings: CurateSettings,
) -> Iterator[tuple[list[RowBatch], _ChunkWork]]:
    """Each chunk with its work, in input order; a few chunks at a time in flight on the pool."""
    if pool is None:
        for chunk in chunks:
            yield chunk, _work_chunk(chunk, counter, settings)
        return
    in_flight: deque[tuple[list[RowBatch], Future[_ChunkWork]]] = deque()
    limit = 2 * workers + 1  # bounded, so memory holds a few chunks, not the whole input
    for chunk in chunks:
        in_flight.append((chunk, pool.submit(_work_chunk_in_worker, chunk)))
        if len(in_flight) >= limit:
            done, future = in_flight.popleft()
            yield done, future.result()
    while in_flight:
        done, future = in_flight.popleft()
        yield done, future.result()


def _keep_or_reject(
    chunk: list[RowBatch],
    work: _ChunkWork,
    settings: CurateSettings,
    result: CurateResult,
    spill: Spill,
    seen: SeenIds,
) -> np.ndarray:
    """Deduplicate one worked chunk and drop its refused rows, in row order, and spill it.

    Returns the prompt-token counts of the rows it kept.
    """
    starts = [0]
    for batch in chunk:
        starts.append(starts[-1] + len(batch))

    def locate(row: int) -> tuple[RowBatch, int]:
        b = bisect.bisect_right(starts, row) - 1
        return chunk[b], row - starts[b]

    rejected = list(work.rejected)
    ids = work.table.column("id").to_pylist()
    keep = np.ones(len(ids), dtype=bool)
    batch_index = 0
    for position, (row, conv_id) in enumerate(zip(work.rows, ids, strict=True)):
        while row >= starts[batch_index + 1]:
            batch_index += 1
        batch = chunk[batch_index]
        first = seen.first(conv_id, batch.source, batch.lines[row - starts[batch_index]])
        if first is not None:
            keep[position] = False
            rejected.append((row, Rejection("duplicate", f"id {conv_id}, first at {first}")))
        elif position in work.refused:
            keep[position] = False
            rejected.append((row, work.refused[position]))

    kept = work.table if keep.all() else work.table.filter(pa.array(keep))
    shards = kept.column("shard").to_numpy()
    if len(shards):
        order = np.argsort(shards, kind="stable")
        ordered = shards[order]
        for group in np.split(order, np.flatnonzero(np.diff(ordered)) + 1):
            shard = int(shards[group[0]])
            if shard < 0:
                result.eval_rows += len(group)
                spill.write("eval", kept.take(group))
            else:
                result.shard_rows[shard] += len(group)
                result.shard_turns[shard] += written_turns(kept.take(group))
                spill.write(shard, kept.take(group))

    if rejected:
        rejected.sort(key=lambda item: item[0])
        cols: dict[str, list[Any]] = {name: [] for name in REJECTED_SCHEMA.names}
        for row, rejection in rejected:
            batch, local = locate(row)
            raw = batch.raw_text(local)
            line = batch.lines[local]
            cols["source"].append(batch.source)
            cols["line"].append(line)
            cols["reason"].append(rejection.reason)
            cols["detail"].append(rejection.detail)
            cols["raw"].append(raw)
            result.rejected[rejection.reason] += 1
            if rejection.reason not in result.examples:
                result.examples[rejection.reason] = {
                    "source": batch.source,
                    "line": line,
                    "detail": rejection.detail,
                    "raw": raw[:EXAMPLE_RAW_CHARS],
                }
        spill.write("rejected", pa.Table.from_pydict(cols, schema=REJECTED_SCHEMA))
    return kept.column("num_prompt_tokens").to_numpy().astype(np.int32, copy=False)


def _write_destination(job: tuple[Path, Path, bool]) -> None:
    """Write one output file from its scratch file (sorted by id for curated tables)."""
    scratch, out, curated = job
    schema = CURATED_SCHEMA if curated else REJECTED_SCHEMA
    if scratch.exists():
        with pa.OSFile(str(scratch), "rb") as f:
            table = pa.ipc.open_stream(f).read_all()
    else:
        table = schema.empty_table()
    if curated:
        table = table.sort_by("id")
    write_parquet(out, table)
