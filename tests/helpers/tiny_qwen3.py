"""Test inputs for extraction and evaluation: a random tiny Qwen3 and generated shards.

The model is a real transformers Qwen3ForCausalLM (random weights, fixed seed); the shards follow
the generated-table schema (`draftline.generation.shards.SCHEMA`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from draftline.generation.shards import SCHEMA
from draftline.quality.checks import completion_hash

VOCAB = 128
END_OF_TURN = 2

# The library's own schema of generated shards (it once drifted from a copy kept here).
GENERATED_SCHEMA = SCHEMA


def tiny_qwen3(num_layers: int = 6, hidden: int = 32, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def sample_id(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()[:16]


def generated_row(
    n: int, prompt: list[int], completion: list[int], finish_reason: str = "stop"
) -> dict[str, Any]:
    return {
        "id": sample_id(n),
        "prompt_ids": prompt,
        "completion_ids": completion,
        "num_prompt_tokens": len(prompt),
        "num_completion_tokens": len(completion),
        "finish_reason": finish_reason,
        "error": "engine failed" if finish_reason == "error" else None,
        "has_think_block": False,
        "think_tokens": 0,
        "answer_tokens": max(0, len(completion) - 1),
        "loss_mask_sum": len(completion),
        "completion_hash": completion_hash(completion),
        "completion_text": "",
        "engine": "local",
        "model": "tiny",
        "sampling": json.dumps({"temperature": 0.0}),
    }


def random_rows(start: int, count: int, seed: int, long_every: int = 5) -> list[dict[str, Any]]:
    """Rows with long-tailed lengths: mostly short, every `long_every`-th one long."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in range(start, start + count):
        p_len = int(torch.randint(3, 12, (1,), generator=g))
        c_len = (
            int(torch.randint(60, 120, (1,), generator=g))
            if n % long_every == 0
            else int(torch.randint(4, 24, (1,), generator=g))
        )
        prompt = torch.randint(3, VOCAB, (p_len,), generator=g).tolist()
        completion = torch.randint(3, VOCAB, (c_len - 1,), generator=g).tolist() + [END_OF_TURN]
        rows.append(generated_row(n, prompt, completion))
    return rows


def write_shard(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: r["id"])
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), path)
    return path
