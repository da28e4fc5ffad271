"""Regenerate one shard of curated conversations with the target: resumable, token-exact.

Every assistant turn is written by the target, in order (`draftline.generation.turns`); prompt
ids come from the target's own chat template with the earlier answers spliced in as the engine's
ids (`draftline.core.turn_prompts`), and completion ids are stored exactly as the engine returned
them. Every finished turn goes to the journal first, so a rerun after any kill generates only
what is missing, mid-conversation included; the shard's table is written once, complete and
sorted by id, under a temporary name and renamed into place. Failed conversations are kept as
`error` rows; the shard fails when their share passes `generate.max_error_share` (a failed turn
is generated again on the next run). Knows nothing of DVC.
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
from draftline.core.loss_mask import SpecialIds
from draftline.core.turn_prompts import regenerated_turns
from draftline.data.conversations import messages_from_records
from draftline.generation.engines.base import Engine, Request, Result, Sampling
from draftline.generation.guard import Guard
from draftline.generation.journal import Journal
from draftline.generation.turns import Conversation, conversation_row, split_key, turn_row
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
        ("history_spans", pa.list_(pa.list_(pa.int32()))),
        ("turns", pa.int32()),
        ("turn_finish_reasons", pa.list_(pa.string())),
        ("turn_loss_mask_sums", pa.list_(pa.int32())),
        ("turn_answer_tokens", pa.list_(pa.int32())),
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
    # Which assistant turns the target writes: "all" or "last" (`generate.regenerate_turns`).
    regenerate_turns: str = "all"

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "chat_template_kwargs": self.template_kwargs,
            "chat_template_sha256": self.chat_template_sha256,
            "sampling": self.sampling.as_dict(),
            "thinking_share": self.thinking_share,
            "regenerate_turns": self.regenerate_turns,
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


def labelled_row(row: dict[str, Any], tokenizer: Any, labels: dict[str, str]) -> dict[str, Any]:
    """A conversation's row with what is derived for reading and the run's labels."""
    return {
        **row,
        # For reading only: never tokenized again.
        "completion_text": tokenizer.decode(row["completion_ids"], skip_special_tokens=False),
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
    """Generate every turn of the shard's conversations not yet in the journal, in rounds (turn
    k of every conversation that needs one), then write the table and the run log."""
    from tqdm import tqdm

    conversations = {
        r["id"]: Conversation(
            r["id"],
            messages := messages_from_records(r["messages"]),
            regenerated_turns(messages, identity.regenerate_turns),
            identity.kwargs_for(r["id"]),
        )
        for r in read_curated(paths.curated)
    }
    labels = {
        "engine": engine.identity(),
        "model": identity.model,
        "sampling": orjson.dumps(identity.sampling.as_dict(), option=orjson.OPT_SORT_KEYS).decode(),
    }
    journal = Journal(paths.journal, identity.as_dict())
    journaled: dict[str, dict[int, Result]] = {}
    for key, result in journal.open().items():
        if (parts := split_key(key)) and parts[0] in conversations:
            journaled.setdefault(parts[0], {})[parts[1]] = result
    if journal.discarded:
        print(
            f"{paths.name}: journal of another model, chat template or sampling moved to "
            f"{journal.discarded}"
        )
    resumed_turns = 0
    for conversation_id, turns in journaled.items():
        conversation = conversations[conversation_id]
        conversation.resume(turns)
        resumed_turns += len(conversation.results)
        if guard:
            for k, result in enumerate(conversation.results):
                prompt = conversation.prompt(tokenizer, special, k).ids
                guard.observe(turn_row(prompt, result, special, conversation.thinking))
    resumed = sum(c.done() for c in conversations.values())

    started = time.monotonic()
    prior_wall = journal.wall_s
    generated_tokens = generated_turns = 0
    failed: dict[str, Result] = {}
    bar = tqdm(
        total=resumed_turns + sum(c.remaining_turns() for c in conversations.values()),
        initial=resumed_turns,
        desc=f"generate {paths.name}",
        unit="turn",
        disable=not progress,
        mininterval=1.0,
        dynamic_ncols=True,
    )

    def on_result(result: Result) -> None:
        nonlocal generated_tokens, generated_turns
        journal.append([result], wall_s=prior_wall + time.monotonic() - started)
        conversation_id, k = split_key(result.id) or (result.id, 0)
        conversation = conversations[conversation_id]
        if result.finish_reason == "error":
            failed[conversation_id] = result
        else:
            conversation.results.append(result)
        prompt = conversation.prompt(tokenizer, special, k).ids
        row = turn_row(prompt, result, special, conversation.thinking)
        generated_tokens += row["num_completion_tokens"]
        generated_turns += 1
        if conversation_id in failed or conversation.done():
            bar.total -= len(conversation.turns) - k - 1  # turns it will never have
        elapsed = max(time.monotonic() - started, 1e-9)
        bar.set_postfix_str(f"{generated_tokens / elapsed:,.0f} out tok/s", refresh=False)
        bar.update(1)
        if guard:
            guard.observe(row)

    try:
        while nexts := [
            c.next_request(tokenizer, special)
            for i, c in sorted(conversations.items())
            if i not in failed and not c.done()
        ]:
            pending = [r for r in nexts if isinstance(r, Request)]
            for unbuildable in (r for r in nexts if isinstance(r, Result)):
                failed[split_key(unbuildable.id)[0]] = unbuildable  # type: ignore[index]
            before = generated_turns
            engine.generate(pending, on_result)
            if generated_turns - before < len(pending):
                raise ShardFailed(
                    f"{paths.name}: the engine returned no result for "
                    f"{len(pending) - generated_turns + before} of {len(pending)} requests"
                )
    finally:
        bar.close()
        journal.close()
    run_wall = time.monotonic() - started

    ordered = [
        labelled_row(
            conversation_row(conversations[i], tokenizer, special, failed.get(i)), tokenizer, labels
        )
        for i in sorted(conversations)
    ]
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
    metrics = shard_metrics(ordered, reasons, len(ordered) - resumed, generated_tokens, run_wall)
    metrics.update(
        {
            "wall_s": round(prior_wall + run_wall, 3),
            "resumed_samples": resumed,
            "generated_turns": generated_turns,
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
