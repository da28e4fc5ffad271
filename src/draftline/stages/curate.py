"""Stage `curate`: raw conversations -> data/curated/ (train shards, eval, rejected) + metrics.

Reads `data.*` and the target tokenizer (`model.*`) from params.yaml. Fails (exit 1) when more
than `data.max_reject_rate` of the rows are rejected or no row is left to train on, after
writing the tables and metrics so the rejected rows can be read; and, writing nothing, when an
input file cannot be read whole (cut short, corrupt, empty, not UTF-8) or a source holds no
input files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from draftline.core.target import load_tokenizer
from draftline.data.curation import CurateResult, CurateSettings, curate
from draftline.data.input_files import BrokenInputFiles
from draftline.data.prompt_tokens import PromptTokenCounter
from draftline.runtime import params as params_mod
from draftline.runtime import run_log
from draftline.runtime.atomic import write_json
from draftline.runtime.hardware import describe, resolve_profile

OUT_DIR = "data/curated"
METRICS_PATH = "metrics/curate.json"
SUMMARY_NAME = "summary.json"  # in the output folder: rows per shard (validate), reject reasons
# What `dvc exp show` compares; the rest (per shard, per reason, lengths) is in the summary.
RESULT_KEYS = ("rows_read", "rows_kept", "rows_rejected", "reject_rate", "train_rows", "eval_rows")
# What `dvc exp show` compares (the rest is in reports/curate.json).
COMPARE_KEYS = ("eval_rows", "reject_rate", "train_rows")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--out", default=OUT_DIR, help=f"output folder (default {OUT_DIR})")
    parser.add_argument("--metrics", default=METRICS_PATH, help=f"metrics file ({METRICS_PATH})")
    run_log.add_arguments(parser, "curate")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    params = params_mod.load(args.params)
    data, model = params["data"], params["model"]
    sources = [str(s) for s in data["sources"]]
    if len(sources) > 1:
        # dvc.yaml can only name the first source as a dependency (DVC cannot interpolate a list
        # into deps): edits inside the others would not rerun this stage.
        print(
            f"curate: warning: only {sources[0]} is a DVC dependency; put all sources under one "
            "folder so that changes to any of them rerun curate",
            file=sys.stderr,
        )
    settings = CurateSettings(
        max_prompt_tokens=int(data["max_prompt_tokens"]),
        eval_fraction=float(data["eval_fraction"]),
        num_shards=int(data["num_shards"]),
        split_seed=str(data["split_seed"]),
    )
    counter = PromptTokenCounter(
        load_tokenizer(model), model.get("chat_template_kwargs"), settings.max_prompt_tokens
    )
    try:
        result = curate(sources, args.out, counter, settings, progress=not args.no_progress)
    except BrokenInputFiles as err:
        print(f"curate: FAILED: {err}", file=sys.stderr)
        return 1

    metrics = result.metrics()
    # Cached with the curated tables, so a new node that pulls curate has the shard sizes too.
    write_json(Path(args.out) / SUMMARY_NAME, metrics)
    record = {
        **metrics,
        **describe(resolve_profile(params.get("hardware") or {})),
        **params_mod.identity(params),
    }
    run_log.write(args, "curate", record, RESULT_KEYS, COMPARE_KEYS)

    print(
        f"curate: {result.rows_read} rows read, {result.rows_kept} kept "
        f"({metrics['train_rows']} train in {settings.num_shards} shards, "
        f"{result.eval_rows} eval), {result.rows_rejected} rejected -> {args.out}",
        file=sys.stderr,
    )
    for path in result.files_skipped:
        print(f"curate: skipped {path} (not .jsonl/.ndjson/.json/.parquet)", file=sys.stderr)
    max_rate = float(data["max_reject_rate"])
    if result.reject_rate > max_rate:
        print(
            f"curate: FAILED: {result.rows_rejected} of {result.rows_read} rows rejected "
            f"({result.reject_rate:.1%}), over data.max_reject_rate={max_rate:.1%}. "
            f"Top reasons:\n{result.reject_summary()}\n"
            f"All rejected rows, with reasons and raw text: {args.out}/rejected.parquet. "
            "Fix the inputs (data.sources), raise data.max_prompt_tokens if prompts are too "
            "long, or raise data.max_reject_rate if this share is expected.",
            file=sys.stderr,
        )
        return 1
    if no_training := nothing_to_train(result, data, args.out):
        print(f"curate: FAILED: {no_training}", file=sys.stderr)
        return 1
    return 0


def nothing_to_train(result: CurateResult, data: dict[str, Any], out: str) -> str | None:
    """Why no row is left to train on, naming the key to change; None when some are."""
    if sum(result.shard_rows):
        return None
    if not result.rows_read:
        return (
            f"0 rows read from data.sources={data['sources']}: point it at files or folders of "
            "conversations (`draftline compose 'data.sources=[data/my-set]'`)"
        )
    if not result.rows_kept:
        return (
            f"all {result.rows_read} rows were rejected (reasons in {out}/rejected.parquet): fix "
            "the files in data.sources, or raise data.max_prompt_tokens if prompts are too long"
        )
    return (
        f"0 training rows: all {result.rows_kept} kept rows went to eval (data.eval_fraction="
        f"{data['eval_fraction']}); lower it (`draftline compose data.eval_fraction=0.1`) or add "
        "conversations to data.sources"
    )
