"""Extraction: generated shards -> training-ready token packs (+ target features when offline).

The plan is made from the shards' length columns alone, before any forward: each generated
row gives its sequences by `extract.rows` (`draftline.core.training_rows`: one per turn by
default, its own prompt and whole completion), each cut to `max_length` from its prompt's start;
within each generated shard they are sorted by length and cut into packs of about
`pack_tokens` tokens. The plan depends only on the data
and the stage params, never on the world size, so every pack is the same whether one process or
eight write it. Ranks take disjoint packs (pack p goes to rank p % world_size).

Each pack is one safetensors file written atomically, with a fingerprint of its plan in its
metadata: a rerun skips packs whose fingerprint matches and redoes the rest, so a killed run
resumes where it stopped. `index.json` is written last, after every pack is verified.
Layout: docs/pipeline.md, "Extracted data".
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from draftline.core.loss_mask import loss_mask
from draftline.core.training_rows import LENGTH_COLUMNS, SequenceSpan, Yield, check_layout
from draftline.drafter.features import target_layer_states
from draftline.drafter.packs import INDEX_NAME
from draftline.runtime import disk_space, distributed
from draftline.runtime.atomic import write_json, write_safetensors

FORMAT_VERSION = 1
FEATURE_MODES = ("offline", "online")


@dataclass(frozen=True)
class ExtractSettings:
    """What is extracted (stage params); `tokens_per_batch` only says how (hardware)."""

    features: str
    max_length: int
    target_layer_ids: list[int]
    model_ref: str
    hidden_size: int
    pack_tokens: int
    tokens_per_batch: int
    # The weights the features come from (`core.target.weights_id`): a pack of other weights
    # in the same folder is redone, never resumed.
    weights_id: str = ""
    rows: str = "turn"  # training sequences per generated row (`core.training_rows`)

    def __post_init__(self) -> None:
        if self.features not in FEATURE_MODES:
            raise ValueError(
                f"extract.features must be one of {FEATURE_MODES}, not {self.features!r}"
            )
        if self.max_length < 2 or self.pack_tokens < 1 or self.tokens_per_batch < 1:
            raise ValueError("max_length, pack_tokens and tokens_per_batch must be positive")
        check_layout(self.rows)


@dataclass(frozen=True)
class PlannedSequence:
    id: str  # the row's id, `<row id>#<turn>` for a turn's sequence
    row: int  # row in its shard file
    span: SequenceSpan  # which turn, and the window kept of it

    @property
    def num_tokens(self) -> int:
        return self.span.num_tokens


@dataclass
class PackPlan:
    index: int
    shard_file: Path
    sequences: list[PlannedSequence]

    @property
    def file(self) -> str:
        return f"pack-{self.index:05d}.safetensors"

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


@dataclass
class Plan:
    packs: list[PackPlan]
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    yields: Yield = field(default_factory=Yield)  # generated vs supervised tokens, cuts


def plan_packs(
    shard_files: Sequence[Path], max_length: int, pack_tokens: int, rows: str = "turn"
) -> Plan:
    """Which sequences go into which pack, from the length columns only.

    Dropped rows are counted by reason: rows that give no sequence because their request
    failed (`error`) or they wrote nothing (`no_supervised_tokens`); a conversation whose later
    turn failed still gives its earlier turns in the `turn` layout.
    """
    plan = Plan(packs=[], dropped={"error": 0, "no_supervised_tokens": 0})
    for shard_file in sorted(shard_files):
        names = set(pq.read_schema(shard_file).names)
        columns = [c for c in LENGTH_COLUMNS if c in names]
        if rows == "conversation" and "history_spans" in names:
            columns.append("history_spans")  # supervised earlier answers count in the yield
        table = pq.read_table(shard_file, columns=columns).to_pylist()
        kept: list[PlannedSequence] = []
        for row, rec in enumerate(table):
            seqs = plan.yields.add_row(rec, rows, max_length)
            if not seqs:
                reason = "error" if rec["finish_reason"] == "error" else "no_supervised_tokens"
                plan.dropped[reason] += 1
                continue
            for seq in seqs:
                name = str(rec["id"]) if seq.turn is None else f"{rec['id']}#{seq.turn}"
                kept.append(PlannedSequence(id=name, row=row, span=seq))
        plan.truncated = plan.yields.cut_sequences
        # Length-sorted packs make batches of similar lengths: little padding in the forward.
        kept.sort(key=lambda s: (s.num_tokens, s.id))
        current: list[PlannedSequence] = []
        for seq in kept:
            if current and sum(s.num_tokens for s in current) + seq.num_tokens > pack_tokens:
                plan.packs.append(PackPlan(len(plan.packs), Path(shard_file), current))
                current = []
            current.append(seq)
        if current:
            plan.packs.append(PackPlan(len(plan.packs), Path(shard_file), current))
    return plan


def fingerprint(pack: PackPlan, settings: ExtractSettings) -> str:
    """Identity of a pack's content: its sequences and every setting that changes its bytes."""
    what = {
        "format": FORMAT_VERSION,
        "features": settings.features,
        "max_length": settings.max_length,
        "target_layer_ids": settings.target_layer_ids if settings.features == "offline" else None,
        "model": settings.model_ref,
        "weights": settings.weights_id if settings.features == "offline" else None,
        "rows": settings.rows,
        "sequences": [[s.id, s.span.start, s.num_tokens] for s in pack.sequences],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def pack_is_complete(path: Path, expected_fingerprint: str) -> bool:
    """True when `path` is a readable pack whose fingerprint is the expected one."""
    from safetensors import safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("fingerprint") == expected_fingerprint
    except Exception:  # unreadable header: redo the pack
        return False


def token_rows(pack: PackPlan, table: dict[str, list]) -> list[tuple[list, list]]:
    """(input_ids, loss_mask) of each sequence of the pack, from its shard's token columns: a
    turn's own prompt and completion, or the conversation's last with its earlier answers."""
    rows = []
    for seq in pack.sequences:
        row_id, turn = table["id"][seq.row], seq.span.turn
        if seq.id != (row_id if turn is None else f"{row_id}#{turn}"):
            raise RuntimeError(
                f"{pack.shard_file} changed while extracting (row {seq.row} is no longer "
                f"{seq.id}): rerun the extract stage"
            )
        if turn is None:
            prompt, completion = table["prompt_ids"][seq.row], table["completion_ids"][seq.row]
            spans = table["history_spans"][seq.row] if "history_spans" in table else ()
        else:
            prompt = table["turn_prompt_ids"][seq.row][turn]
            completion = table["turn_completion_ids"][seq.row][turn]
            spans = ()  # earlier answers are supervised in their own turns' sequences
        start, end = seq.span.start, seq.span.end
        ids = (list(prompt) + list(completion))[start:end]
        mask = loss_mask(len(prompt), completion, spans or ())[start:end]
        rows.append((ids, mask))
    return rows


def length_batches(lengths: Sequence[int], tokens_per_batch: int) -> Iterator[list[int]]:
    """Consecutive index groups whose padded size (count x longest) fits the token budget.

    Lengths are sorted inside a pack, so consecutive groups are length buckets. A sequence
    longer than the budget gets a batch of its own.
    """
    batch: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if batch and (len(batch) + 1) * max(longest, n) > tokens_per_batch:
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    if batch:
        yield batch


def pack_features(
    model: Any,
    rows: list[list[int]],
    layer_ids: Sequence[int],
    tokens_per_batch: int,
    device: torch.device,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, int]:
    """Target features of every token of `rows`, concatenated ([T, K*H] bf16 on CPU).

    Returns the features and the padded token count the forwards processed.
    """
    out: list[torch.Tensor] = []
    padded = 0
    for batch in length_batches([len(r) for r in rows], tokens_per_batch):
        longest = max(len(rows[i]) for i in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for j, i in enumerate(batch):
            ids[j, : len(rows[i])] = torch.tensor(rows[i])
            mask[j, : len(rows[i])] = 1
        states = target_layer_states(
            model, ids.to(device), layer_ids, attention_mask=mask.to(device)
        )
        states = states.to("cpu", torch.bfloat16)
        out.extend(states[j, : len(rows[i])] for j, i in enumerate(batch))
        padded += ids.numel()
        if on_batch:
            on_batch(int(mask.sum()))
    return torch.cat(out), padded


def write_pack(
    path: Path,
    pack: PackPlan,
    rows: list[tuple[list, list]],
    features: torch.Tensor | None,
    fp: str,
) -> int:
    """Write one pack atomically; returns its size in bytes."""
    lengths = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.int64)
    tensors = {
        "input_ids": torch.tensor([t for ids, _ in rows for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for _, mask in rows for m in mask], dtype=torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    if features is not None:
        tensors["features"] = features.contiguous()
    metadata = {
        "ids": json.dumps([s.id for s in pack.sequences]),
        "fingerprint": fp,
        "format": str(FORMAT_VERSION),
    }
    write_safetensors(path, tensors, metadata)
    return path.stat().st_size


@dataclass
class ExtractResult:
    index: dict[str, Any]
    tokens_this_run: int
    padded_tokens_this_run: int
    packs_written: int
    packs_skipped: int
    seconds: float
    dropped: dict[str, int]
    truncated: int
    bytes_written: int
    yields: dict[str, Any] = field(default_factory=dict)  # `Yield.summary()` of the plan


def clean_output(out_dir: Path, plan: Plan) -> None:
    """Before a run: drop the index (the folder is incomplete until the end), temporaries of a
    killed run, and packs that are not in the current plan."""
    (out_dir / INDEX_NAME).unlink(missing_ok=True)
    wanted = {p.file for p in plan.packs}
    for path in out_dir.iterdir():
        if (
            path.name.startswith(".")
            and path.name.endswith(".tmp")
            or (path.suffix == ".safetensors" and path.name not in wanted)
        ):
            path.unlink()


# Bytes per token of a pack beyond its features: token id and loss mask (int32 + uint8).
PACK_BYTES_PER_TOKEN = 5


def require_space(
    out_dir: Path, todo: Sequence[PackPlan], settings: ExtractSettings, world: int
) -> None:
    """The packs left to write (this rank's share times the ranks) must fit the disk."""
    per_token = PACK_BYTES_PER_TOKEN
    if settings.features == "offline":
        per_token += len(settings.target_layer_ids) * settings.hidden_size * 2  # bf16
    needed = sum(p.num_tokens for p in todo) * per_token * world
    fix = "free space or put data/extracted on a bigger disk (a link), and rerun"
    if settings.features == "offline":
        fix += (
            "; or train with online features (extract.features=online: token packs only, "
            f"about {disk_space.human(needed * PACK_BYTES_PER_TOKEN / per_token)})"
        )
    disk_space.require_free(out_dir, needed, f"extract ({settings.features} features)", fix)


def extract(
    shard_files: Sequence[Path],
    out_dir: Path,
    settings: ExtractSettings,
    model_loader: Callable[[], Any] | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> ExtractResult:
    """Write the packs of this rank, then (rank 0) the index. Works with or without torchrun.

    `model_loader` returns the target (needed only when `settings.features == "offline"`).
    """
    from tqdm import tqdm

    start = time.perf_counter()
    rank, world = distributed.rank(), distributed.world_size()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not shard_files:
        raise SystemExit("extract: no generated shards found: run the generate stages first")
    plan = plan_packs(shard_files, settings.max_length, settings.pack_tokens, settings.rows)
    if not plan.packs:
        raise SystemExit(
            f"extract: no usable sequence in {len(shard_files)} shards (dropped: {plan.dropped})"
        )
    if rank == 0:
        clean_output(out_dir, plan)
    distributed.barrier()

    mine = [p for p in plan.packs if p.index % world == rank]
    todo = [p for p in mine if not pack_is_complete(out_dir / p.file, fingerprint(p, settings))]
    require_space(out_dir, todo, settings, world)
    model = None
    if todo and settings.features == "offline":
        if model_loader is None:
            raise ValueError("offline extraction needs the target: pass model_loader")
        model = model_loader()
        if int(model.config.hidden_size) != settings.hidden_size:
            raise SystemExit(
                f"extract: the target's hidden size is {model.config.hidden_size}, params say "
                f"{settings.hidden_size}: fix model.hidden_size in conf/model/"
            )
    device = torch.device(device)

    tokens = padded = 0
    bar = tqdm(
        total=sum(p.num_tokens for p in todo),
        unit="tok",
        unit_scale=True,
        desc=f"extract (rank {rank})",
        disable=not progress,
        position=rank,
    )
    table: dict[str, list] = {}
    table_file: Path | None = None
    for pack in todo:
        if pack.shard_file != table_file:  # packs of a shard are consecutive: read it once
            names = pq.read_schema(pack.shard_file).names
            cols = ["id", "prompt_ids", "completion_ids"]
            if settings.rows == "turn" and "turn_prompt_ids" in names:
                cols += ["turn_prompt_ids", "turn_completion_ids"]
            if "history_spans" in names:
                cols.append("history_spans")  # shards written before multi-turn have none
            table = pq.read_table(pack.shard_file, columns=cols).to_pydict()
            table_file = pack.shard_file
        rows = token_rows(pack, table)
        features = None
        if model is not None:
            features, pack_padded = pack_features(
                model,
                [ids for ids, _ in rows],
                settings.target_layer_ids,
                settings.tokens_per_batch,
                device,
                on_batch=bar.update,
            )
            padded += pack_padded
        else:
            bar.update(pack.num_tokens)
            padded += pack.num_tokens
        write_pack(out_dir / pack.file, pack, rows, features, fingerprint(pack, settings))
        tokens += pack.num_tokens
    bar.close()

    totals = distributed.all_sum([tokens, padded, len(todo)])
    distributed.barrier()
    seconds = distributed.all_max(time.perf_counter() - start)
    index: dict[str, Any] = {}
    bytes_written = 0
    if rank == 0:
        index = write_index(out_dir, plan, settings)
        bytes_written = sum((out_dir / s["file"]).stat().st_size for s in index["shards"])
        bytes_written += (out_dir / INDEX_NAME).stat().st_size
    distributed.barrier()
    return ExtractResult(
        index=index,
        tokens_this_run=int(totals[0]),
        padded_tokens_this_run=int(totals[1]),
        packs_written=int(totals[2]),
        packs_skipped=len(plan.packs) - int(totals[2]),
        seconds=seconds,
        dropped=plan.dropped,
        truncated=plan.truncated,
        bytes_written=bytes_written,
        yields=plan.yields.summary(),
    )


def write_index(out_dir: Path, plan: Plan, settings: ExtractSettings) -> dict[str, Any]:
    """Verify every pack, then write `index.json` (its presence means the folder is complete)."""
    from safetensors import safe_open

    shards = []
    for pack in plan.packs:
        path = out_dir / pack.file
        if not pack_is_complete(path, fingerprint(pack, settings)):
            raise RuntimeError(f"{path} is missing or stale after extraction: rerun extract")
        with safe_open(str(path), framework="pt") as f:
            mask = f.get_tensor("loss_mask")
            if settings.features == "offline":
                width = f.get_slice("features").get_shape()[1]
                if width != settings.hidden_size * len(settings.target_layer_ids):
                    raise RuntimeError(
                        f"{path}: features are {width} wide, not K*H = "
                        f"{len(settings.target_layer_ids)}*{settings.hidden_size}: "
                        "model.hidden_size does not match the target"
                    )
        shards.append(
            {
                "file": pack.file,
                "num_sequences": len(pack.sequences),
                "num_tokens": pack.num_tokens,
                "num_supervised_tokens": int(mask.sum()),
                "source": pack.shard_file.name,
            }
        )
    index = {
        "format": FORMAT_VERSION,
        "features": settings.features,
        "rows": settings.rows,
        "num_sequences": sum(s["num_sequences"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_supervised_tokens": sum(s["num_supervised_tokens"] for s in shards),
        "max_length": settings.max_length,
        "target_layer_ids": list(settings.target_layer_ids),
        "hidden_size": settings.hidden_size,
        "feature_dtype": "bfloat16" if settings.features == "offline" else None,
        "model": settings.model_ref,
        "shards": shards,
    }
    write_json(out_dir / INDEX_NAME, index)
    return index


# Reading, for training and tests.
