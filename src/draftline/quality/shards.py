"""What validate reads: the scalar columns of every generated train shard and its per-turn lists
(never the token lists), and the row counts curate expected; a missing shard or column stops it,
naming the fix."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from draftline.core.training_rows import LENGTH_COLUMNS, row_sequences, row_yield
from draftline.quality import checks, turns
from draftline.quality.check_parts import MODE_COLUMN


def expected_rows(curate_summary: Path, shard_ids: list[int]) -> dict[int, int]:
    """Curated train rows per shard, from curate's metrics; the shards must match params."""
    per_shard = _curated_rows(curate_summary)
    if sorted(per_shard) != shard_ids:
        raise SystemExit(
            f"validate: {curate_summary} has shards {sorted(per_shard)} but params.yaml has "
            f"data.shard_ids={shard_ids}: run `dvc repro curate` with the current params"
        )
    return per_shard


def expected_shard_rows(curate_summary: Path, shard: int) -> int:
    """Curated train rows of one shard, from curate's metrics (`validate --shard`)."""
    per_shard = _curated_rows(curate_summary)
    if shard not in per_shard:
        raise SystemExit(
            f"validate: {curate_summary} has shards {sorted(per_shard)}, not {shard}: pick one "
            "of data.shard_ids, or run `dvc repro curate` with the current params"
        )
    return per_shard[shard]


def _curated_rows(curate_summary: Path) -> dict[int, int]:
    if not curate_summary.is_file():
        raise SystemExit(f"validate: {curate_summary} not found: run `dvc repro curate` first")
    data = json.loads(curate_summary.read_text(encoding="utf-8"))
    return {int(k): int(n) for k, n in (data.get("shard_rows") or {}).items()}


def shard_paths(folder: Path, shard_ids: list[int]) -> list[Path]:
    """Every expected shard file; exits naming the missing ones (never validates a partial set)."""
    paths = [folder / f"shard-{k}.parquet" for k in shard_ids]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        names = ", ".join(p.name for p in missing)
        stages = " ".join(
            f"generate@{k}" for k, p in zip(shard_ids, paths, strict=True) if p in missing
        )
        raise SystemExit(
            f"validate: {len(missing)} of {len(paths)} generated shards missing in {folder}: "
            f"{names}. Run `dvc repro {stages}` (or `dvc repro --pull` to fetch them; never "
            "`--allow-missing`, which would validate a partial folder)"
        )
    return paths


def read_scalar_columns(
    paths: list[Path], *, progress: bool = True, training: Mapping[str, Any] | None = None
) -> pd.DataFrame:
    """The scalar columns of checks.COLUMNS and the turn columns of turns.TURN_COLUMNS from every
    shard, plus `shard` (its index). With `training` (params' `extract`: `rows`, `max_length`),
    each row's `generated_tokens` (every turn, reasoning included) and `untrained_tokens` (those
    no training sequence supervises), from the length columns alone: the yield gate's inputs."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    # Shards written before multi-turn generation lack these: null, so no multi-turn checks.
    turn_types = {
        "turns": pa.int32(),
        "turn_finish_reasons": pa.list_(pa.string()),
        "turn_loss_mask_sums": pa.list_(pa.int32()),
        "turn_answer_tokens": pa.list_(pa.int32()),
    }
    columns = [*checks.COLUMNS, MODE_COLUMN, *turns.TURN_COLUMNS]
    tables = []
    for path in tqdm(paths, desc="validate: read", unit="shard", disable=not progress):
        names = set(pq.read_schema(path).names)
        wanted = [c for c in columns if c in names]
        missing = sorted(set(checks.COLUMNS) - names - {"completion_hash"})
        if missing:
            raise SystemExit(
                f"validate: {path} lacks column(s) {missing} of the generated table "
                "(docs/pipeline.md): regenerate it with `dvc repro generate@<shard>`"
            )
        table = pq.read_table(path, columns=wanted)
        if "completion_hash" not in names:
            print(
                f"validate: warning: {path} has no completion_hash column; hashing its "
                "completion_ids (slow: regenerate the shard to add the column)",
                file=sys.stderr,
            )
            table = table.append_column("completion_hash", _hash_completions(path))
        shard = int(path.stem.split("-")[1])
        table = table.append_column("shard", pa.array(np.full(len(table), shard, np.int32)))
        if MODE_COLUMN not in names:  # written before thinking modes: the model's mode
            table = table.append_column(MODE_COLUMN, pa.nulls(len(table), pa.bool_()))
        for name in turns.TURN_COLUMNS:
            if name not in names:
                table = table.append_column(name, pa.nulls(len(table), turn_types[name]))
        selected = table.select([*columns, "shard"])
        if training is not None:
            selected = _with_yield(selected, path, names, training)
        tables.append(selected)
    if not tables:
        return pd.DataFrame(columns=columns)
    return pa.concat_tables(tables).to_pandas()


def _with_yield(table: Any, path: Path, names: set[str], training: Mapping[str, Any]) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    layout, max_length = str(training.get("rows", "turn")), int(training["max_length"])
    wanted = [c for c in LENGTH_COLUMNS if c in names]
    if layout == "conversation" and "history_spans" in names:
        wanted.append("history_spans")
    generated, untrained, longest = [], [], []
    for row in pq.read_table(path, columns=wanted).to_pylist():
        made, supervised = row_yield(row, layout, max_length)
        generated.append(made)
        untrained.append(made - supervised)
        # The longest sequence the row gives before any cut: what max_length would have to hold.
        uncut = row_sequences(row, layout, max_length=2**62)
        longest.append(max((s.num_tokens for s in uncut), default=0))
    table = table.append_column("generated_tokens", pa.array(generated, pa.int64()))
    table = table.append_column("untrained_tokens", pa.array(untrained, pa.int64()))
    return table.append_column("sequence_tokens", pa.array(longest, pa.int64()))


def _hash_completions(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    hashes: list[str] = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096, columns=["completion_ids"]):
        lists = batch.column(0)
        offsets = lists.offsets.to_numpy()
        values = lists.values.to_numpy(zero_copy_only=False)
        for i in range(len(lists)):
            hashes.append(checks.completion_hash(values[offsets[i] : offsets[i + 1]]))
    return pa.array(hashes, pa.string())
