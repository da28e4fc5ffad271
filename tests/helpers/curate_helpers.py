"""Curate's inputs written as a user's files would be (every container, gzip), and its rejected
rows read back: the curate library's tests (tests/data/test_curation.py) and the stage's
(tests/stages/test_curate.py) share them."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

BUDGET = 256
THINKING = {"enable_thinking": True}


def write_rows(path: Path, rows: list[Any], gz: bool = False) -> Path:
    """Rows as the file's suffix says (.jsonl/.json/.parquet); str rows are JSONL lines as-is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    elif path.suffix == ".json":
        data = json.dumps(rows).encode()
    else:
        # Every row gets every column (null where it has none), as in a file of mixed rows.
        keys = list(dict.fromkeys(k for r in rows for k in r))
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), sink)
        data = sink.getvalue().to_pybytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path


def rejected_rows(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "rejected.parquet").to_pylist()


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def mixed_input(folder: Path, good: int, bad: int) -> None:
    rng = random.Random(0)
    rows: list[Any] = []
    for i in range(good):
        turns = [{"from": "human", "value": f"Question {i}: {rng.random():.6f}?"}]
        if i % 3 == 0:
            turns += [{"from": "gpt", "value": "<think>\nok\n</think>\n\nSure."},
                      {"from": "human", "value": "Again, in Français ✓"}]  # fmt: skip
        rows.append({"conversations": turns})
    for i in range(bad):
        rows.insert(rng.randrange(len(rows) + 1), f'{{"broken": {i}')
    write_rows(folder / "a.jsonl", rows[: len(rows) // 2])
    write_rows(folder / "b.jsonl", rows[len(rows) // 2 :], gz=True)
    write_rows(
        folder / "c.parquet", [{"messages": [msg("user", f"parquet {i}")]} for i in range(9)]
    )
