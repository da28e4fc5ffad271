"""Regenerate one shard of curated prompts with the target: resumable, token-exact.

Prompt ids come from the target's own chat template (`draftline.core.target.prompt_ids`); completion
ids are stored exactly as the engine returned them. Every finished sample goes to the journal
first, so a rerun after any kill generates only what is missing; the shard's table is written
once, complete and sorted by id, under a temporary name and renamed into place. Failed samples
are kept as `error` rows; the shard fails when their share passes `generate.max_error_share`
(a failed sample is generated again on the next run). Knows nothing of DVC.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from draftline.core import target
from draftline.core.loss_mask import SpecialIds, completion_stats, prompt_opens_think
from draftline.generation.engines.base import Engine, Request, Result, Sampling
from draftline.generation.guard import Guard
from draftline.generation.journal import Journal
from draftline.quality.checks import completion_hash
from draftline.runtime import atomic

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("num_prompt_tokens", pa.int32()),
        ("num_completion_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
        ("has_think_block", pa.bool_()),
        ("think_tokens", pa.int32()),
        ("answer_tokens", pa.int32()),
        ("loss_mask_sum", pa.int32()),
        ("completion_hash", pa.string()),
        ("thinking", pa.bool_()),
        ("completion_text", pa.string()),
        ("engine", pa.string()),
        ("model", pa.string()),
        ("sampling", pa.string()),
    ]
)


class ShardFailed(RuntimeError):
    """The shard cannot be written (too many errors): the journal keeps what finished."""


@dataclass(frozen=True)
class ShardPaths:
    name: str  # "shard-3", "eval": for messages and the progress bar
    curated: Path
    output: Path
    run_log: Path  # the shard's record (counts, timings, hardware): logs/runs/, not a DVC metric
    journal: Path


@dataclass(frozen=True)
class Identity:
    """What decides a sample's tokens; a journal of another identity is not resumed from."""

    model: str
    template_kwargs: dict[str, Any]
    sampling: Sampling
    # The template itself, so fixing a broken one never resumes the samples it produced.
    chat_template_sha256: str = ""
    # Share of samples generated with thinking on (`data.thinking_share`; the rest off).
    thinking_share: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "chat_template_kwargs": self.template_kwargs,
            "chat_template_sha256": self.chat_template_sha256,
            "sampling": self.sampling.as_dict(),
            "thinking_share": self.thinking_share,
        }

    def kwargs_for(self, sample_id: str) -> dict[str, Any]:
        """The chat-template kwargs this sample is rendered with (its thinking mode)."""
        return target.sample_template_kwargs(self.template_kwargs, sample_id, self.thinking_share)


def read_curated(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise SystemExit(f"{path} not found: run the curate stage first (`dvc repro curate`)")
    rows = pq.read_table(path, columns=["id", "messages"]).to_pylist()
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: duplicate ids; the curated table is corrupt, rerun curate")
    return rows


def build_row(
    sample_id: str,
    prompt: list[int],
    result: Result,
    special: SpecialIds,
    tokenizer: Any,
    labels: dict[str, str],
    thinking: bool = False,
) -> dict[str, Any]:
    """One generated row; `thinking`: the sample's template had thinking on."""
    ids = [int(t) for t in result.completion_ids]
    stats = completion_stats(ids, special, think_open=prompt_opens_think(prompt, special))
    return {
        "id": sample_id,
        "prompt_ids": prompt,
        "completion_ids": ids,
        "num_prompt_tokens": len(prompt),
        "num_completion_tokens": len(ids),
        "finish_reason": result.finish_reason,
        "error": result.error,
        "has_think_block": stats.has_think_block,
        "think_tokens": stats.think_tokens,
        "answer_tokens": stats.answer_tokens,
        "loss_mask_sum": stats.loss_mask_sum,
        "completion_hash": completion_hash(ids),
        "thinking": thinking,
        # For reading only: never tokenized again.
        "completion_text": tokenizer.decode(ids, skip_special_tokens=False),
        **labels,
    }


def run_shard(
    paths: ShardPaths,
    engine: Engine,
    tokenizer: Any,
    identity: Identity,
    special: SpecialIds,
    guard: Guard | None,
    *,
    max_error_share: float,
    extra_metrics: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate every curated sample of the shard not yet in the journal; write table + metrics."""
    from tqdm import tqdm

    curated = read_curated(paths.curated)
    kwargs = {r["id"]: identity.kwargs_for(r["id"]) for r in curated}
    prompts = {
        r["id"]: target.prompt_ids(tokenizer, _messages(r["messages"]), kwargs[r["id"]])
        for r in curated
    }
    modes = {i: bool(k.get("enable_thinking", False)) for i, k in kwargs.items()}
    labels = {
        "engine": engine.identity(),
        "model": identity.model,
        "sampling": orjson.dumps(identity.sampling.as_dict(), option=orjson.OPT_SORT_KEYS).decode(),
    }
    journal = Journal(paths.journal, identity.as_dict())
    finished = {
        i: r for i, r in journal.open().items() if i in prompts and r.finish_reason != "error"
    }
    if journal.discarded:
        print(
            f"{paths.name}: journal of another model, chat template or sampling moved to "
            f"{journal.discarded}"
        )
    rows: dict[str, dict[str, Any]] = {}
    for sample_id, result in finished.items():
        rows[sample_id] = build_row(
            sample_id, prompts[sample_id], result, special, tokenizer, labels, modes[sample_id]
        )
        if guard:
            guard.observe(rows[sample_id])
    pending = [Request(i, prompts[i]) for i in sorted(prompts) if i not in finished]

    started = time.monotonic()
    prior_wall = journal.wall_s
    generated_tokens = 0
    bar = tqdm(
        total=len(prompts),
        initial=len(finished),
        desc=f"generate {paths.name}",
        unit="sample",
        disable=not progress,
        mininterval=1.0,
        dynamic_ncols=True,
    )

    def on_result(result: Result) -> None:
        nonlocal generated_tokens
        journal.append([result], wall_s=prior_wall + time.monotonic() - started)
        row = build_row(
            result.id, prompts[result.id], result, special, tokenizer, labels, modes[result.id]
        )
        rows[result.id] = row
        generated_tokens += row["num_completion_tokens"]
        elapsed = max(time.monotonic() - started, 1e-9)
        bar.set_postfix_str(f"{generated_tokens / elapsed:,.0f} out tok/s", refresh=False)
        bar.update(1)
        if guard:
            guard.observe(row)

    try:
        engine.generate(pending, on_result)
    finally:
        bar.close()
        journal.close()
    run_wall = time.monotonic() - started

    missing = sorted(set(prompts) - set(rows))
    if missing:
        raise ShardFailed(f"{paths.name}: the engine returned no result for {len(missing)} ids")
    ordered = [rows[i] for i in sorted(rows)]
    reasons = Counter(r["finish_reason"] for r in ordered)
    errors = reasons.get("error", 0)
    if errors > max_error_share * len(ordered):
        example = next(r["error"] for r in ordered if r["finish_reason"] == "error")
        raise ShardFailed(
            f"{paths.name}: {errors} of {len(ordered)} samples failed "
            f"(> generate.max_error_share={max_error_share}); e.g. {example}. "
            "Finished samples are journaled; fix the engine and rerun to retry only the failures."
        )

    atomic.write_parquet(paths.output, pa.Table.from_pylist(ordered, schema=SCHEMA))
    metrics = shard_metrics(ordered, reasons, len(pending), generated_tokens, run_wall)
    metrics.update(
        {
            "wall_s": round(prior_wall + run_wall, 3),
            "resumed_samples": len(finished),
            **(extra_metrics or {}),
            "engine_identity": labels["engine"],
            "model": identity.model,
        }
    )
    atomic.write_json(paths.run_log, metrics)
    journal.remove()  # the output is in place: nothing left to resume
    return metrics


def shard_metrics(
    rows: Sequence[dict[str, Any]],
    reasons: Counter[str],
    generated: int,
    generated_tokens: int,
    run_wall: float,
) -> dict[str, Any]:
    n = len(rows)
    answered = [r for r in rows if r["finish_reason"] != "error"]
    output_tokens = sum(r["num_completion_tokens"] for r in rows)
    return {
        "samples": n,
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in rows),
        "output_tokens": output_tokens,
        "generated_samples": generated,
        "generated_output_tokens": generated_tokens,
        "run_wall_s": round(run_wall, 3),
        "output_tok_s": round(generated_tokens / run_wall, 2) if generated and run_wall else None,
        "errors": reasons.get("error", 0),
        "error_share": round(reasons.get("error", 0) / n, 6) if n else 0.0,
        "finish_reasons": {k: reasons.get(k, 0) for k in ("stop", "length", "error")},
        "mean_output_tokens": round(output_tokens / n, 2) if n else 0.0,
        "think_block_share": (
            round(sum(r["has_think_block"] for r in answered) / len(answered), 4)
            if answered
            else 0.0
        ),
        "loss_mask_sum_mean": (
            round(sum(r["loss_mask_sum"] for r in answered) / len(answered), 2) if answered else 0.0
        ),
    }


def _messages(messages: Any) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]
