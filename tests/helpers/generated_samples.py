"""Synthetic generated data for the quality and validate tests: the scalar columns of the
generated table (docs/pipeline.md), healthy by default, and the pathologies validation must
catch. Token ids are random but consistent with the scalar columns (lengths, hashes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from draftline.quality import checks

MAX_NEW_TOKENS = 96
END_OF_TURN = 2
OK_COMPLETION = [1, 3, 4, 5, 6, END_OF_TURN]  # the seed's "OK.<|im_end|>"-like answer: 6 tokens


def healthy_completions(n: int, seed: int = 0) -> list[np.ndarray]:
    """Thinking completions of 20..90 tokens, each ending in the end-of-turn token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 91, n)
    return [np.append(rng.integers(10, 1000, k - 1), END_OF_TURN).astype(np.int32) for k in lengths]


def samples_frame(n: int = 400, seed: int = 0) -> pd.DataFrame:
    """A healthy table: every sample answered, with a think block and an answer."""
    completions = healthy_completions(n, seed)
    lengths = np.array([len(c) for c in completions], dtype=np.int32)
    think = (lengths * 2) // 3
    return pd.DataFrame(
        {
            "id": [f"{i:016x}" for i in range(n)],
            "num_prompt_tokens": np.full(n, 40, np.int32),
            "num_completion_tokens": lengths,
            "finish_reason": ["stop"] * n,
            "error": [None] * n,
            "has_think_block": np.ones(n, bool),
            "think_tokens": think,
            "answer_tokens": lengths - think - 3,  # minus <think>, </think>, end of turn
            "loss_mask_sum": lengths,
            "completion_hash": [checks.completion_hash(c) for c in completions],
            "completion_ids": completions,
        }
    )


def seed_pathology(frame: pd.DataFrame, share: float = 0.87) -> pd.DataFrame:
    """The seed's data: `share` of samples answered just "OK." (6 supervised tokens)."""
    out = frame.copy()
    rows = out.index[: int(round(share * len(out)))]
    ok = np.array(OK_COMPLETION, np.int32)
    out.loc[rows, "num_completion_tokens"] = len(ok)
    out.loc[rows, "loss_mask_sum"] = len(ok)
    out.loc[rows, "has_think_block"] = False
    out.loc[rows, "think_tokens"] = 0
    out.loc[rows, "answer_tokens"] = len(ok) - 1
    out.loc[rows, "completion_hash"] = checks.completion_hash(ok)
    chosen = set(rows)
    out["completion_ids"] = [ok if i in chosen else c for i, c in enumerate(out["completion_ids"])]
    return out


def mixed_modes(frame: pd.DataFrame, share_off: float = 0.4) -> pd.DataFrame:
    """`frame` with the first `share_off` of rows generated with thinking off: no think block,
    the whole completion is the answer (as `completion_stats` counts it)."""
    out = frame.copy()
    off = out.index[: int(round(share_off * len(out)))]
    out["thinking"] = True
    out.loc[off, "thinking"] = False
    out.loc[off, "has_think_block"] = False
    out.loc[off, "think_tokens"] = 0
    out.loc[off, "answer_tokens"] = out.loc[off, "num_completion_tokens"] - 1
    return out


def truncated(frame: pd.DataFrame, share: float) -> pd.DataFrame:
    """`share` of samples cut off at max_new_tokens while still thinking."""
    out = frame.copy()
    rows = out.index[: int(round(share * len(out)))]
    out.loc[rows, "finish_reason"] = "length"
    out.loc[rows, "num_completion_tokens"] = MAX_NEW_TOKENS
    out.loc[rows, "loss_mask_sum"] = MAX_NEW_TOKENS
    out.loc[rows, "has_think_block"] = False
    out.loc[rows, "think_tokens"] = MAX_NEW_TOKENS - 1
    out.loc[rows, "answer_tokens"] = 0
    return out


def failed_requests(frame: pd.DataFrame, share: float) -> pd.DataFrame:
    """`share` of samples whose request failed: recorded as error rows with no completion."""
    out = frame.copy()
    rows = out.index[len(out) - int(round(share * len(out))) :]
    out.loc[rows, "finish_reason"] = "error"
    out.loc[rows, "error"] = "HTTP 503 after 5 retries"
    for column in ("num_completion_tokens", "think_tokens", "answer_tokens", "loss_mask_sum"):
        out.loc[rows, column] = 0
    out.loc[rows, "has_think_block"] = False
    empty = np.zeros(0, np.int32)
    out.loc[rows, "completion_hash"] = checks.completion_hash(empty)
    chosen = set(rows)
    out["completion_ids"] = [
        empty if i in chosen else c for i, c in enumerate(out["completion_ids"])
    ]
    return out


def write_generated(
    root: Path,
    frame: pd.DataFrame,
    num_shards: int,
    *,
    curated_rows: list[int] | None = None,
    with_hash: bool = True,
) -> list[Path]:
    """Write `frame` as the generated train shards under `root` (round-robin by row), and the
    curate summary and params.yaml validate reads. `curated_rows` defaults to the shard sizes."""
    folder = root / "data" / "generated" / "train"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    sizes = []
    for k in range(num_shards):
        part = frame.iloc[k::num_shards].sort_values("id")
        sizes.append(len(part))
        paths.append(folder / f"shard-{k}.parquet")
        pq.write_table(_arrow(part, with_hash), paths[-1])
    metrics = root / "data" / "curated" / "summary.json"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    rows = curated_rows if curated_rows is not None else sizes
    metrics.write_text(json.dumps({"train_rows": sum(rows), "shard_rows": _by_shard(rows)}))
    return paths


def write_params(
    root: Path, num_shards: int, *, thinking: bool = True, **quality_overrides
) -> None:
    import yaml

    conf = Path(__file__).resolve().parents[2] / "conf" / "quality" / "default.yaml"
    quality_cfg = yaml.safe_load(conf.read_text()) | quality_overrides
    params = {
        "model": {
            "path": "models/tiny-target",
            "chat_template_kwargs": {"enable_thinking": thinking},
        },
        "data": {"name": "sample", "num_shards": num_shards, "shard_ids": list(range(num_shards))},
        "drafter": {"name": "dflash_tiny"},
        "quality": quality_cfg,
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))


def _by_shard(rows: list[int]) -> dict[str, int]:
    return {f"{k:05d}": n for k, n in enumerate(rows)}


def _arrow(part: pd.DataFrame, with_hash: bool) -> pa.Table:
    n = len(part)
    columns = {
        "id": pa.array(part["id"], pa.string()),
        "prompt_ids": pa.array([np.arange(40, dtype=np.int32)] * n, pa.list_(pa.int32())),
        "completion_ids": pa.array(list(part["completion_ids"]), pa.list_(pa.int32())),
        "num_prompt_tokens": pa.array(part["num_prompt_tokens"], pa.int32()),
        "num_completion_tokens": pa.array(part["num_completion_tokens"], pa.int32()),
        "finish_reason": pa.array(part["finish_reason"], pa.string()),
        "error": pa.array(part["error"], pa.string()),
        "has_think_block": pa.array(part["has_think_block"], pa.bool_()),
        "think_tokens": pa.array(part["think_tokens"], pa.int32()),
        "answer_tokens": pa.array(part["answer_tokens"], pa.int32()),
        "loss_mask_sum": pa.array(part["loss_mask_sum"], pa.int32()),
        "completion_text": pa.array(["..."] * n, pa.string()),
        "engine": pa.array(["local"] * n, pa.string()),
        "model": pa.array(["models/tiny-target"] * n, pa.string()),
        "sampling": pa.array(['{"temperature": 0.0}'] * n, pa.string()),
    }
    if with_hash:
        columns["completion_hash"] = pa.array(part["completion_hash"], pa.string())
    if "thinking" in part.columns:
        columns["thinking"] = pa.array(part["thinking"], pa.bool_())
    return pa.table(columns)
