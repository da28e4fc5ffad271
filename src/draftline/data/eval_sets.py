"""Eval sets besides the held-out split: its sources, and benchmark prompt files the user supplies.

Per source: when the held-out split mixes input files (`data.sources`), tau is also reported for
each, named by file stem, so a drafter that is good on chat and poor on code shows it.

Benchmark prompt files: JSONL (or JSON/Parquet) files in `data/benchmarks/`, one eval set each,
named by file stem (`gsm8k.jsonl` -> `gsm8k`). Nothing is downloaded: the user puts the files
there. A row's prompt is the first of these fields it has:

- `messages` / `conversations` / `prompt` (the curate formats; cut after the last user turn);
- `question` (gsm8k), `problem` (math500), `instruction` (alpaca-style);
- `turns` (mt-bench: a list of user turns; the first is used, since later turns follow the
  target's own answers).

Rows are taken in file order, up to `evaluate.max_prompts` per file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftline.data.conversations import normalise
from draftline.data.input_files import Rejection, input_format, read_rows

BENCHMARKS_DIR = Path("data/benchmarks")
PROMPT_FIELDS = ("question", "problem", "instruction")


def benchmark_files(folder: Path = BENCHMARKS_DIR) -> dict[str, Path]:
    """Eval set name -> file, for every readable file in `folder` (none when it is absent)."""
    if not folder.is_dir():
        return {}
    files = sorted(p for p in folder.iterdir() if p.is_file() and input_format(p))
    names = [p.name.split(".")[0] for p in files]
    if len(set(names)) != len(names):
        twice = sorted(n for n, c in Counter(names).items() if c > 1)
        raise SystemExit(f"{folder}: two benchmark files are named {twice}: rename one")
    return dict(zip(names, files, strict=True))


def benchmark_messages(path: Path, max_prompts: int) -> list[list[dict[str, Any]]]:
    """The prompts of one benchmark file as chat messages, in file order."""
    prompts: list[list[dict[str, Any]]] = []
    for row in read_rows(path):
        if len(prompts) >= max_prompts:
            break
        messages = normalise(_as_prompt_row(row.value)) if row.error is None else row.error
        if not isinstance(messages, Rejection):
            prompts.append(messages)
    if not prompts:
        raise SystemExit(
            f"{path}: no usable prompt; a row needs messages, conversations, prompt, "
            f"{', '.join(PROMPT_FIELDS)} or turns (see docs/pipeline.md, 'Evaluation')"
        )
    return prompts


def _as_prompt_row(value: Any) -> Any:
    if not isinstance(value, dict) or {"messages", "conversations", "prompt"} & value.keys():
        return value
    for key in PROMPT_FIELDS:
        if isinstance(value.get(key), str):
            return {"prompt": value[key]}
    turns = value.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return {"prompt": turns[0]}
    return value


def source_names(sources: Sequence[str]) -> list[str]:
    """A short name per source file: its stem, or its path where two stems are equal."""
    stems = [Path(s).name.split(".")[0] for s in sources]
    counts = Counter(stems)
    return [stem if counts[stem] == 1 else src for stem, src in zip(stems, sources, strict=True)]
