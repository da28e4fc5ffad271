"""Shared pieces of the generate tests: a random tiny Qwen3 target, curated shards, a working
folder with params.yaml, and the SGLang stand-in run as a real separate process."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

TESTS = Path(__file__).resolve().parent
STANDIN = TESTS / "sglang_standin.py"

QUALITY = {
    "min_supervised_tokens": 4,
    "min_share_supervised": 0.9,
    "max_mode_share": 0.5,
    "min_unique_completion_share": 0.5,
    "max_truncated_share": 0.05,
    "max_error_share": 0.05,
    "min_think_block_share": 0.9,
    "min_answer_share": 0.9,
    "completion_length_quantiles": {"quantiles": [0.5], "ranges": [[4, 100000]]},
    "guard": {"min_samples": 32, "window": 128},
}


def build_random_target(out_dir: Path) -> Path:
    """A random-weight tiny Qwen3 model with the project's tokenizer and Qwen3-format template,
    written to `out_dir`: a copy of the one this process built (the build is seeded, so every
    build is the same files; training its tokenizer took ~3 s per caller)."""
    shutil.copytree(_random_target(), out_dir, dirs_exist_ok=True)
    return out_dir


@cache
def _random_target() -> Path:
    import torch

    from draftline.embedded import sample_prompts, tiny_target

    torch.set_num_threads(1)
    examples = sample_prompts.training_prompts(0, 200)
    texts = [m["content"] for messages, _ in examples for m in messages]
    tokenizer = tiny_target.build_tokenizer(texts, 400)
    config = tiny_target.BuildConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    model = tiny_target.build_model(config, tokenizer)
    out_dir = Path(tempfile.mkdtemp(prefix="draftline-random-target-"))
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sum", "list", "sort", "why", "how"]
    out = []
    for i in range(n):
        text = " ".join(words[(i * 7 + k * (seed + 3)) % len(words)] for k in range(3 + i % 5))
        msgs = [{"role": "user", "content": f"question {i}: {text}?"}]
        if i % 4 == 3:
            msgs = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"first {i}"},
                {"role": "assistant", "content": "ok"},
                *msgs,
            ]
        out.append(msgs)
    return out


def multi_turn_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` conversations with 1 to 4 assistant turns for the target to write (the dataset's
    answers are replaced; the last user message is answered too)."""
    words = ["alpha", "beta", "gamma", "delta", "omega", "sum", "list", "sort", "why", "how"]
    out = []
    for i in range(n):
        turns = 1 + (i * 5 + seed) % 4
        msgs: list[dict[str, str]] = []
        for k in range(turns):
            text = " ".join(words[(i * 3 + k * 7 + j * (seed + 2)) % len(words)] for j in range(4))
            msgs.append({"role": "user", "content": f"s{seed} q{i}.{k}: {text}?"})
            if k < turns - 1:
                msgs.append({"role": "assistant", "content": f"answer {k}"})
        out.append(msgs)
    return out


def write_curated(
    path: Path,
    n: int,
    seed: int = 0,
    shard: int = 0,
    messages: list[list[dict[str, Any]]] | None = None,
) -> list[str]:
    """A curated shard in the docs/pipeline.md layout (of `messages`, or of `n` made-up
    conversations); returns its ids (sorted)."""
    import hashlib

    from draftline.runtime import atomic

    rows = []
    for msgs in messages if messages is not None else conversations(n, seed):
        digest = hashlib.sha256(json.dumps(msgs, sort_keys=True).encode()).hexdigest()[:16]
        rows.append(
            {
                "id": digest,
                "messages": msgs,
                "num_turns": len(msgs),
                "num_prompt_tokens": 0,
                "source": "test",
                "split": "train",
                "shard": shard,
            }
        )
    rows.sort(key=lambda r: r["id"])
    atomic.write_parquet(path, pa.Table.from_pylist(rows))
    return [r["id"] for r in rows]


def make_workdir(
    root: Path,
    model_dir: Path,
    *,
    n: int = 40,
    hardware: dict[str, Any] | None = None,
    generate: dict[str, Any] | None = None,
    quality: dict[str, Any] | None = None,
    max_new_tokens: int = 12,
    messages: list[list[dict[str, Any]]] | None = None,
    shards: int = 1,
    multi_turn: bool = False,
) -> list[str]:
    """A folder laid out like the repository for the generate stages of `shards` train shards
    (`messages` for shard 0, else `n` made-up conversations each: `multi_turn` ones with 1 to 4
    turns); returns shard 0's ids."""
    written = [
        write_curated(
            root / f"data/curated/train/shard-{k}.parquet",
            n,
            shard=k,
            messages=messages
            if messages is not None and k == 0
            else multi_turn_conversations(n, seed=k)
            if multi_turn
            else conversations(n, seed=k),
        )
        for k in range(shards)
    ]
    write_curated(root / "data/curated/eval.parquet", 6, seed=5, shard=-1)
    params = {
        "model": {
            "name": "random-tiny",
            "path": str(model_dir),
            "revision": None,
            "end_of_turn_token": "<|im_end|>",
            "chat_template_kwargs": {"enable_thinking": True},
            "max_new_tokens": max_new_tokens,
        },
        "data": {"name": "sample", "num_shards": shards, "shard_ids": list(range(shards))},
        "drafter": {"name": "dflash_tiny"},
        "hardware": hardware
        or {
            "name": "cpu",
            "engine": "local",
            "device": "cpu",
            "precision": "fp32",
            "num_threads": 1,
            "local": {"batch_size": 8},
            "sglang": None,
        },
        "quality": quality or QUALITY,
        "generate": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 0,
            "max_error_share": 0.05,
            "request_timeout_s": 30,
            "max_retries": 3,
            "backoff_base_s": 0.05,
            "backoff_max_s": 0.5,
            "guard": True,
            "endpoints": [],
            "autostart": False,
            "serve_timeout_s": 30,
            **(generate or {}),
        },
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return written[0]


def sglang_hardware(port: int, max_in_flight: int = 8) -> dict[str, Any]:
    return {
        "name": "test-sglang",
        "engine": "sglang",
        "device": "cuda",
        "precision": "bf16",
        "sglang": {"host": "127.0.0.1", "port": port, "max_in_flight": max_in_flight, "dp_size": 1},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"stand-in at {url} did not come up")


class StandIn:
    """The SGLang stand-in as a separate process on 127.0.0.1 (a real HTTP server)."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"standin-{self.port}.rids"
        self.args = [
            sys.executable,
            str(STANDIN),
            "--port",
            str(self.port),
            "--log",
            str(self.log),
            "--think-start",
            "3",
            "--think-end",
            "4",
            "--vocab-low",
            "10",
            "--vocab-high",
            "300",
            *args,
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> StandIn:
        self.start()
        return self

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_healthy(self.url)

    def rids(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def sample_ids(self) -> list[str]:
        """Conversation ids of the requests served, in order (one per turn requested)."""
        return [re.sub(r"#\d+$", "", r.rsplit("-", 1)[0]) for r in self.rids()]

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def generate_here(cwd: Path, *args: str) -> None:
    """The generate stage in this process (no interpreter to start: for reference runs)."""
    from draftline import cli

    before = os.getcwd()
    os.chdir(cwd)
    try:
        assert cli.main(["generate", "--no-progress", *args]) == 0
    finally:
        os.chdir(before)


def run_generate(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "draftline", "generate", "--no-progress", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
