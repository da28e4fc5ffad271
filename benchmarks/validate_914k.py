"""Benchmark: `draftline validate` on a seed-sized generated dataset.

Writes 914,000 synthetic generated samples (the table of docs/pipeline.md with real int32 token
lists: ~2,500 completion tokens and ~300 prompt tokens per sample on average, thinking on,
a few truncated and failed rows) as 16 shard files, then runs `draftline validate` on them in a
subprocess pinned to 2 cores and reports its wall time, CPU time and peak RSS against the
budget (60 s, 3 GB) and against a reference measured in the same run: reading the same scalar
columns with pyarrow alone.

Writing is not timed. It needs about 7.5 GB free under --dir (checked first) and a few minutes;
the folder is removed at the end unless --keep. completion_text holds a short excerpt (the
column exists, with realistic row structure, but not 9 GB of text): validate never reads it.

    python benchmarks/validate_914k.py [--samples 914000] [--shards 16] [--dir /tmp/...] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from tqdm import tqdm

from draftline.quality import checks
from draftline.runtime import atomic, params

REPO = Path(__file__).resolve().parents[1]
VOCAB = 248320  # Qwen3.6-27B
END_OF_TURN = 248046
MAX_NEW_TOKENS = 8192
BYTES_PER_SAMPLE = 8_000  # measured: ~2,800 tokens at ~2.8 bytes each after zstd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=914_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/draftline-bench-validate"))
    parser.add_argument("--keep", action="store_true", help="keep the dataset afterwards")
    parser.add_argument("--reuse", action="store_true", help="reuse a dataset already in --dir")
    args = parser.parse_args()

    root: Path = args.dir
    folder = root / "data" / "generated" / "train"
    if not (args.reuse and folder.is_dir()):
        need = args.samples * BYTES_PER_SAMPLE
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        if free < 1.5 * need:
            raise SystemExit(f"need ~{need / 1e9:.1f} GB free under {root}, have {free / 1e9:.1f}")
        write_dataset(root, args.samples, args.shards)
    write_params(root, args.shards)
    on_disk = sum(p.stat().st_size for p in folder.glob("shard-*.parquet"))
    print(f"dataset: {args.samples} samples in {args.shards} shards, {on_disk / 1e9:.2f} GB")

    reference = time_reference_read(folder)
    run = time_validate(root)
    metrics = json.loads((root / "metrics" / "validate.json").read_text())
    print(
        f"validate: rc={run['rc']} passed={metrics['passed']} "
        f"completion_tokens_mean={metrics['completion_tokens_mean']} "
        f"total={metrics['completion_tokens_total'] / 1e9:.2f}G tokens"
    )
    print(
        f"validate: wall {run['wall_s']:.1f} s, CPU {run['cpu_s']:.1f} s, "
        f"peak RSS {run['rss_gb']:.2f} GB (budget 60 s, 3 GB on 2 cores: "
        f"{run['wall_s'] / 60:.2f}x and {run['rss_gb'] / 3:.2f}x of budget)"
    )
    print(
        f"reference (pyarrow read of the same scalar columns): {reference:.2f} s; "
        f"validate / reference = {run['wall_s'] / reference:.1f}x"
    )
    if not args.keep:
        shutil.rmtree(root)
    ok = run["rc"] == 0 and run["wall_s"] <= 60 and run["rss_gb"] <= 3
    print("within budget" if ok else "OVER BUDGET or failed")
    return 0 if ok else 1


def write_dataset(root: Path, samples: int, shards: int) -> None:
    folder = root / "data" / "generated" / "train"
    rng = np.random.default_rng(914)
    sizes = [len(part) for part in np.array_split(np.arange(samples), shards)]
    for k in tqdm(range(shards), desc="write shards", unit="shard"):
        table = synthetic_shard(rng, sizes[k])
        # Scalar columns encoded as the pipeline's writer does (dictionary + zstd); the token
        # lists without dictionary encoding, which makes writing 5x faster (validate never
        # reads them).
        scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
        with atomic.atomic_path(folder / f"shard-{k}.parquet") as tmp:
            pq.write_table(table, tmp, compression="zstd", use_dictionary=scalar)
    metrics = {"train_rows": samples, "shard_rows": {f"{k:05d}": n for k, n in enumerate(sizes)}}
    atomic.write_json(root / "metrics" / "curate.json", metrics)


def synthetic_shard(rng: np.random.Generator, n: int) -> pa.Table:
    """n samples: lognormal lengths (mean ~2,500), truncated at 8192, 0.2% failed requests."""
    lengths = np.minimum(rng.lognormal(np.log(2000), 0.65, n).astype(np.int64) + 8, MAX_NEW_TOKENS)
    failed = rng.random(n) < 0.002
    lengths[failed] = 0
    truncated = lengths >= MAX_NEW_TOKENS
    offsets, values = token_ids(rng, lengths)
    values[offsets[1:][(~truncated) & (lengths > 0)] - 1] = END_OF_TURN
    completion = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    hashes = [checks.completion_hash(values[offsets[i] : offsets[i + 1]]) for i in range(n)]

    think = (lengths * rng.uniform(0.5, 0.9, n)).astype(np.int64)
    answer = np.where(truncated | failed, 0, np.maximum(lengths - think - 3, 0))
    prompt_lengths = rng.lognormal(np.log(250), 0.6, n).astype(np.int64) + 12
    finish = np.where(failed, "error", np.where(truncated, "length", "stop"))
    ids = np.sort(rng.integers(0, 2**63, n, dtype=np.int64))
    return pa.table(
        {
            "id": pa.array([f"{i:016x}" for i in ids], pa.string()),
            "prompt_ids": token_lists(rng, prompt_lengths),
            "completion_ids": completion,
            "num_prompt_tokens": pa.array(prompt_lengths, pa.int32()),
            "num_completion_tokens": pa.array(lengths, pa.int32()),
            "finish_reason": pa.array(finish, pa.string()),
            "error": pa.array(np.where(failed, "HTTP 503 after 5 retries", None), pa.string()),
            "has_think_block": pa.array(~failed & ~truncated, pa.bool_()),
            "think_tokens": pa.array(think, pa.int32()),
            "answer_tokens": pa.array(answer, pa.int32()),
            "loss_mask_sum": pa.array(lengths, pa.int32()),
            "completion_hash": pa.array(hashes, pa.string()),
            "completion_text": pa.array([f"<think>\nsample {i}" for i in range(n)], pa.string()),
            "engine": pa.array(["sglang"] * n, pa.string()),
            "model": pa.array(["Qwen/Qwen3.6-27B@main"] * n, pa.string()),
            "sampling": pa.array(['{"temperature": 0.6, "top_p": 0.95}'] * n, pa.string()),
        }
    )


def token_ids(rng: np.random.Generator, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and values of list<int32> token lists, straight from numpy (no Python lists)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return offsets, rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)


def token_lists(rng: np.random.Generator, lengths: np.ndarray) -> pa.ListArray:
    offsets, values = token_ids(rng, lengths)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def write_params(root: Path, shards: int) -> None:
    composed = params.compose(["model=qwen3_6_27b", f"data.num_shards={shards}"], REPO / "conf")
    (root / "params.yaml").write_text(yaml.safe_dump(composed))


def time_reference_read(folder: Path) -> float:
    start = time.perf_counter()
    for path in sorted(folder.glob("shard-*.parquet")):
        pq.read_table(path, columns=list(checks.COLUMNS)).to_pandas()
    return time.perf_counter() - start


# Runs the command and prints its CPU seconds and peak RSS. A small launcher, because a child
# forked from this (large) process would count this process's pages in its peak RSS.
LAUNCHER = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"RUSAGE {rc} {u.ru_utime + u.ru_stime} {u.ru_maxrss}", file=sys.stderr)
"""


def time_validate(root: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "draftline", "validate", "--no-progress"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0,1", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *cmd], cwd=root, env=env, stderr=subprocess.PIPE, text=True
    )
    wall = time.perf_counter() - start
    lines = proc.stderr.splitlines()
    sys.stderr.write("".join(line + "\n" for line in lines if not line.startswith("RUSAGE")))
    _, rc, cpu, maxrss_kb = next(line for line in lines if line.startswith("RUSAGE")).split()
    return {
        "rc": int(rc),
        "wall_s": wall,
        "cpu_s": float(cpu),
        "rss_gb": int(maxrss_kb) * 1024 / 1e9,
    }


if __name__ == "__main__":
    raise SystemExit(main())
