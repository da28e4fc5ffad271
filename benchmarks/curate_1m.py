"""Benchmark: curate 1,000,000 synthetic conversations with the real tiny target tokenizer.

Generates the rows (not timed) into a temporary folder: ShareGPT, OpenAI-style and prompt rows,
in JSONL (plain and gzip), a JSON array and Parquet files, with ShareGPT-like lengths (log-normal
user and assistant turns, mostly single-turn, some long multi-turn) and a few percent of bad
rows of every kind. Then runs the real stage (`draftline curate`) in a child process and prints
its wall time, CPU time and peak RSS, next to a reference measured in the same run: a child
that only reads and JSON-parses every row. Targets: <= 300 s and <= 4 GiB peak.

    python benchmarks/curate_1m.py [--rows 1000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 300
TARGET_PEAK_GIB = 4.0

WORDS = (  # noqa: SIM905 - one long string reads better than a list literal
    "the of and to in is you that it for on are as with be this have from or one by word but not "
    "what all were we when your can said there use each which she do how their if will up other "
    "about out many then them these so some her would make like into time has look two more write "
    "go see number way could people than first water been call who its now find long down day did "
    "get come made may part over new sound take only little work know place year live back give "
    "most very after thing our just name good sentence man think say great where help through "
    "much before line right too mean old any same tell boy follow came want show also around form "
    "three small set put end does another well large must big even such because turn here why ask "
    "went men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn should "
    "python function error value list table model train data code file test server memory"
).split()


def build_corpus(rng: np.random.Generator, num_words: int) -> tuple[str, np.ndarray]:
    """One long text and the offsets of its word starts, to slice turns from."""
    picks = rng.integers(0, len(WORDS), size=num_words)
    words = [WORDS[i] for i in picks]
    # Sentence ends and paragraph breaks every so often, for realistic punctuation.
    for i in range(11, num_words, 13):
        words[i] += "."
    for i in range(97, num_words, 101):
        words[i] += "\n\n"
    text = " ".join(words)
    starts = np.zeros(num_words, dtype=np.int64)
    np.cumsum([len(w) + 1 for w in words[:-1]], out=starts[1:])
    return text, starts


class Generator:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.text, self.starts = build_corpus(self.rng, 4_000_000)

    def turn(self, median_chars: float, sigma: float, cap: int) -> str:
        n = int(min(cap, max(2, self.rng.lognormal(np.log(median_chars), sigma))))
        w = int(self.rng.integers(0, len(self.starts) - 1))
        start = int(self.starts[w])
        piece = self.text[start : start + n]
        cut = piece.rfind(" ")
        return piece[:cut] if cut > 0 else piece

    def conversation(self) -> list[tuple[str, str]]:
        """(role, text) turns: 1-6 exchanges, the last answer present in 70% of rows."""
        pairs = int(self.rng.choice([1, 2, 3, 4, 6], p=[0.65, 0.2, 0.1, 0.03, 0.02]))
        turns: list[tuple[str, str]] = []
        for _ in range(pairs):
            turns.append(("user", self.turn(200, 1.1, 30_000)))
            turns.append(("assistant", self.turn(700, 0.8, 20_000)))
        if self.rng.random() < 0.3:
            turns.pop()
        return turns


USER = {"sharegpt": "human", "openai": "user"}
ASSISTANT = {"sharegpt": "gpt", "openai": "assistant"}


def as_row(turns: list[tuple[str, str]], style: str, system: str | None) -> dict:
    if style == "prompt":
        row = {"prompt": turns[0][1]}
        if system:
            row["system"] = system
        return row
    role = {"user": USER[style], "assistant": ASSISTANT[style]}
    if style == "sharegpt":
        items = [{"from": role[r], "value": t} for r, t in turns]
        row = {"id": "x", "conversations": items}
        if system:
            row["system"] = system
        return row
    items = [{"role": role[r], "content": t} for r, t in turns]
    if system:
        items.insert(0, {"role": "system", "content": system})
    return {"messages": items}


def bad_line(gen: Generator, kind: int, previous: str | None) -> str:
    good = [("user", gen.turn(100, 0.5, 500)), ("assistant", gen.turn(100, 0.5, 500))]
    if kind == 0:
        return '{"conversations": [{"from": "human", "value": "unterminated'
    if kind == 1:
        return json.dumps({"conversations": [{"from": "narrator", "value": good[0][1]}]})
    if kind == 2:
        return json.dumps({"conversations": [{"from": "human", "value": "  "}]})
    if kind == 3:
        return json.dumps({"messages": [{"role": "user", "content": t} for _, t in good]})
    if kind == 4:
        return json.dumps({"conversations": [{"from": "gpt", "value": good[1][1]}]})
    if kind == 5:
        return json.dumps({"text": good[0][1]})
    if kind == 6 and previous is not None:
        return previous  # an exact duplicate of the row before
    return json.dumps({"prompt": gen.turn(60_000, 0.1, 80_000)})  # far over any budget


def generate(folder: Path, rows: int, seed: int = 0) -> dict[str, int]:
    """Write `rows` rows into `folder`; returns rows per file."""
    gen = Generator(seed)
    rng = gen.rng
    systems = [None] * 8 + ["You are a helpful assistant.", "Answer briefly and precisely."]
    # (name, share of rows, style of rows)
    plan = [
        ("sharegpt/part-000.jsonl", 0.25, "sharegpt"),
        ("sharegpt/part-001.jsonl.gz", 0.25, "sharegpt"),
        ("openai/chat-000.jsonl", 0.15, "openai"),
        ("openai/chat-001.json", 0.05, "openai"),
        ("prompts/prompts.jsonl.gz", 0.1, "prompt"),
        ("parquet/sharegpt-000.parquet", 0.12, "sharegpt"),
        ("parquet/openai-000.parquet", 0.08, "openai"),
    ]
    written: dict[str, int] = {}
    remaining = rows
    for index, (name, share, style) in enumerate(plan):
        n = remaining if index == len(plan) - 1 else int(rows * share)
        remaining -= n
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        previous = None
        for _ in range(n):
            if rng.random() < 0.04:
                line = bad_line(gen, int(rng.integers(0, 8)), previous)
            else:
                system = systems[int(rng.integers(0, len(systems)))]
                line = orjson.dumps(as_row(gen.conversation(), style, system)).decode()
            lines.append(line)
            previous = line
        if name.endswith(".parquet"):
            parsed = []
            for line in lines:
                try:
                    value = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # Parquet cannot hold a malformed line
                if isinstance(value, dict) and style == "sharegpt" and "conversations" in value:
                    parsed.append({"conversations": value["conversations"]})
                elif isinstance(value, dict) and "messages" in value:
                    parsed.append({"messages": value["messages"]})
            pq.write_table(pa.Table.from_pylist(parsed), path)
            n = len(parsed)
        elif name.endswith(".json"):
            # One malformed row would make the whole JSON document malformed: leave those out.
            values = [v for v in map(_parse_or_none, lines) if v is not None]
            path.write_bytes(orjson.dumps(values))
            n = len(values)
        elif name.endswith(".gz"):
            with gzip.open(path, "wt", compresslevel=1) as f:
                f.write("\n".join(lines) + "\n")
        else:
            path.write_text("\n".join(lines) + "\n")
        written[name] = n
    return written


def _parse_or_none(line: str) -> object:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


def read_only(folder: Path) -> int:
    """Reference work: read and JSON-parse every row, nothing else."""
    from draftline.data.conversations import list_input_files, read_rows

    files, _ = list_input_files([str(folder)])
    return sum(1 for path in files for _ in read_rows(path))


@dataclass
class ChildRun:
    wall: float  # s
    cpu: float  # s, the child and every process it started
    peak_gib: float  # largest sum of RSS over the child's process tree, sampled
    largest_gib: float  # largest RSS of any one process of the tree (ru_maxrss)
    load: tuple[float, float]  # 1-minute load average at start and at the end
    stderr: str


def _tree_rss(root: int) -> int:
    """Bytes resident in `root` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [root]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except OSError:
            continue
    return total


def run_child(argv: list[str], env: dict[str, str]) -> ChildRun:
    """Run a child process to the end, measuring its time and its process tree's memory."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.2):
            peak = max(peak, _tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    stop.set()
    sampler.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"child failed ({proc.returncode}):\n{stdout}\n{stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss (KiB on Linux) is the largest single process so far: the curate child runs last.
    largest = after.ru_maxrss / 2**20
    return ChildRun(
        wall, cpu, max(peak / 2**30, largest), largest, (load_start, os.getloadavg()[0]), stderr
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-target")
    parser.add_argument("--keep", type=Path, help="generate into this folder and keep it")
    parser.add_argument("--read-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read_only:
        print(read_only(args.read_only))
        return 0

    tiny = args.model.resolve()
    if not (tiny / "tokenizer.json").exists():
        sys.exit(f"{tiny} has no tokenizer.json: run `draftline build-tiny-target` first")
    work = args.keep or Path(tempfile.mkdtemp(prefix="curate-1m-"))
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "raw"
    try:
        if not raw.exists():
            t0 = time.perf_counter()
            written = generate(raw, args.rows)
            size = sum(p.stat().st_size for p in raw.rglob("*") if p.is_file())
            print(
                f"generated {sum(written.values()):,} rows in {len(written)} files, "
                f"{size / 2**20:,.0f} MiB on disk, in {time.perf_counter() - t0:.0f} s (not timed)"
            )
        params = {
            "model": {
                "path": str(tiny),
                "revision": None,
                "chat_template_kwargs": {"enable_thinking": True},
            },
            "data": {
                "sources": [str(raw)],
                "eval_fraction": 0.002,
                "num_shards": 64,
                "shard_ids": list(range(64)),
                "max_prompt_tokens": args.max_prompt_tokens,
                "max_reject_rate": 1.0,
                "split_seed": "draftline",
            },
            "hardware": {"name": "cpu", "engine": "local", "precision": "fp32"},
        }
        params_path = work / "params.yaml"
        params_path.write_text(json.dumps(params))  # JSON is YAML
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "HF_HUB_OFFLINE": "1"}

        ref = run_child([sys.executable, __file__, "--read-only", str(raw)], env)
        run = run_child(
            [
                sys.executable, "-m", "draftline", "curate", "--no-progress",
                "--params", str(params_path), "--out", str(work / "curated"),
                "--metrics", str(work / "curate.json"), "--report", str(work / "report.json"),
                "--run-log", str(work / "run.json"),
            ],
            env,
        )  # fmt: skip
        metrics = json.loads((work / "run.json").read_text())  # the full record
        print(run.stderr.strip().splitlines()[-1])
        print(
            f"rows read {metrics['rows_read']:,}, kept {metrics['rows_kept']:,}, "
            f"rejected {metrics['rows_rejected']:,} {metrics['rejected_by_reason']}"
        )
        print(f"prompt tokens of kept rows: {metrics['prompt_tokens']}")
        print(f"reference (read + parse only): wall {ref.wall:.1f} s, cpu {ref.cpu:.1f} s")
        print(
            f"curate: wall {run.wall:.1f} s (target <= {TARGET_SECONDS} s), cpu {run.cpu:.1f} s, "
            f"peak RSS {run.peak_gib:.2f} GiB over all its processes (target <= "
            f"{TARGET_PEAK_GIB} GiB; largest single process {run.largest_gib:.2f} GiB); "
            f"{metrics['rows_read'] / run.wall:,.0f} rows/s; wall ratio to reference "
            f"{run.wall / ref.wall:.1f}x, cpu ratio {run.cpu / ref.cpu:.1f}x"
        )
        print(
            f"machine: {os.cpu_count()} CPUs, 1-minute load average {run.load[0]:.2f} at the "
            f"start and {run.load[1]:.2f} at the end of the curate run"
        )
        ok = run.wall <= TARGET_SECONDS and run.peak_gib <= TARGET_PEAK_GIB
        print("PASS" if ok else "OVER TARGET")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
