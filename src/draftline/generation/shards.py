"""Regenerate one shard of curated conversations with the target: resumable, token-exact.

Every assistant turn is written by the target, in order (`draftline.generation.turns`); prompt
ids come from the target's own chat template with the earlier answers spliced in as the engine's
ids (`draftline.core.turn_prompts`), and completion ids are stored exactly as the engine returned
them. The scheduler (`draftline.generation.schedule`) keeps the engine full: a conversation's
next turn is submitted the moment its last one is journaled. Every finished turn goes to the
journal first, so a rerun after any kill generates only what is missing, mid-conversation
included; the shard's table is written once, complete and sorted by id, under a temporary name
and renamed into place. The journal stays after that: DVC deletes a table it has not recorded
before it reruns the stage, so the journal is what rebuilds it (with no engine call) until
`table_record.release_recorded` finds the table recorded by DVC. Failed conversations are kept
as `error` rows; the shard fails when their share passes `generate.max_error_share` (a failed
turn is generated again on the next run).

Working ahead (`ahead`): the conversations of the following shards join the same stream, so the
end of this shard does not leave the engine idle; their results go to their own journals (never
to their outputs), and their own stages later resume from those journals, generating only what
is still missing: their tables are the same bytes as if they had run alone. Knows nothing of DVC.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from draftline.core.loss_mask import SpecialIds
from draftline.core.turn_prompts import regenerated_turns
from draftline.data.conversations import messages_from_records
from draftline.data.curation import shard_file_name
from draftline.generation.engines.base import Engine, NoResult, Request, Result
from draftline.generation.guard import Guard
from draftline.generation.journal import Journal
from draftline.generation.schedule import Scheduler
from draftline.generation.table_record import Identity, ShardPaths, mark_current
from draftline.generation.turns import Conversation, conversation_row, split_key, turn_row
from draftline.runtime import atomic, run_log

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
        # Every turn as the engine saw and wrote it (training rows per turn: extract.rows).
        ("turn_prompt_ids", pa.list_(pa.list_(pa.int32()))),
        ("turn_completion_ids", pa.list_(pa.list_(pa.int32()))),
        ("turn_prompt_tokens", pa.list_(pa.int32())),
        ("turn_completion_tokens", pa.list_(pa.int32())),
        ("completion_text", pa.string()),
        ("engine", pa.string()),
        ("model", pa.string()),
        ("sampling", pa.string()),
    ]
)


class ShardFailed(RuntimeError):
    """The shard cannot be written (too many errors): the journal keeps what finished."""


JOURNAL_DIR = Path(".draftline/journal/generate")


def shard_paths(shard: int | None) -> ShardPaths:
    """The files of train shard `shard`, or of the eval split (None)."""
    if shard is None:
        return ShardPaths(
            name="eval",
            curated=Path("data/curated/eval.parquet"),
            output=Path("data/generated/eval.parquet"),
            run_log=run_log.RUNS_DIR / "generate/eval.json",
            journal=JOURNAL_DIR / "eval.jsonl",
        )
    return ShardPaths(
        name=f"shard-{shard}",
        curated=Path(f"data/curated/train/{shard_file_name(shard)}"),
        output=Path(f"data/generated/train/{shard_file_name(shard)}"),
        run_log=run_log.RUNS_DIR / f"generate/shard-{shard}.json",
        journal=JOURNAL_DIR / f"shard-{shard}.jsonl",
    )


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


@dataclass
class _Shard:
    """A shard in a stream: its conversations, journal and counts for this run."""

    paths: ShardPaths
    position: int  # 0: the stage's own shard; 1, 2, ...: the shards it works ahead on
    conversations: dict[str, Conversation]
    journal: Journal
    prior_wall: float  # generation time earlier runs recorded in the journal
    resumed_turns: int
    resumed: int  # conversations complete before this run
    failed: dict[str, Result] = field(default_factory=dict)
    generated_turns: int = 0
    generated_tokens: int = 0

    @property
    def own(self) -> bool:
        return self.position == 0

    def remaining_turns(self) -> int:
        return sum(
            c.remaining_turns() for i, c in self.conversations.items() if i not in self.failed
        )


class _Turns:
    """A conversation of a shard as the scheduler's `Work`."""

    __slots__ = ("shard", "conversation", "order", "group", "_tokenizer", "_special", "_lost")

    def __init__(
        self,
        shard: _Shard,
        conversation: Conversation,
        tokenizer: Any,
        special: SpecialIds,
        lost: Any,
    ) -> None:
        self.shard = shard
        self.conversation: Conversation | None = conversation
        self.order = (shard.position, conversation.id)
        self.group = shard.paths.name
        self._tokenizer = tokenizer
        self._special = special
        self._lost = lost

    def remaining_turns(self) -> int:
        c = self.conversation
        return 0 if c is None or c.id in self.shard.failed else c.remaining_turns()

    def next_request(self) -> Request | None:
        assert self.conversation is not None
        asked = self.conversation.next_request(self._tokenizer, self._special)
        if isinstance(asked, Result):  # its prompt cannot be built: the conversation fails
            self.shard.failed[self.conversation.id] = asked
            self._lost(self, split_key(asked.id)[1] - 1)  # type: ignore[index]
            return None
        if asked is None:  # no room left in the context: closed after its last turn
            self._lost(self, len(self.conversation.results) - 1)
        return asked


def _open_shard(
    paths: ShardPaths,
    position: int,
    identity: Identity,
    tokenizer: Any,
    special: SpecialIds,
    guard: Guard | None,
) -> _Shard | None:
    """A shard with its journal locked and resumed; None for a shard worked ahead on whose
    journal another run holds (the stage's own shard waits for it)."""
    journal = Journal(paths.journal, identity.as_dict())
    if not journal.lock(wait=False):
        if position:
            return None
        print(f"{paths.name}: another generate run holds {paths.journal}; waiting for it")
        journal.lock(wait=True)
    try:
        conversations = {
            r["id"]: Conversation(
                r["id"],
                messages := messages_from_records(r["messages"]),
                regenerated_turns(messages, identity.regenerate_turns),
                identity.kwargs_for(r["id"]),
                sampling=identity.sampling,
            )
            for r in read_curated(paths.curated)
        }
        journaled: dict[str, dict[int, Result]] = {}
        for key, result in journal.open().items():
            if (parts := split_key(key)) and parts[0] in conversations:
                journaled.setdefault(parts[0], {})[parts[1]] = result
    except BaseException:
        journal.close()
        raise
    if journal.discarded:
        print(
            f"{paths.name}: journal of another identity (weights, engine, chat template or "
            f"sampling) set aside, not resumed: {journal.discarded}"
        )
    resumed_turns = 0
    for conversation_id, turns in journaled.items():
        conversation = conversations[conversation_id]
        conversation.resume(turns)
        resumed_turns += len(conversation.results)
        if guard and not position:
            for k, result in enumerate(conversation.results):
                prompt = conversation.prompt(tokenizer, special, k).ids
                guard.observe(turn_row(prompt, result, special, conversation.thinking))
    resumed = sum(c.done() for c in conversations.values())
    if position:  # its own stage writes its rows: keep only what is still to generate
        conversations = {i: c for i, c in conversations.items() if not c.done()}
    return _Shard(paths, position, conversations, journal, journal.wall_s, resumed_turns, resumed)


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
    ahead: Sequence[ShardPaths] | Callable[[], Sequence[ShardPaths]] = (),
    schedule: str = "continuous",
) -> dict[str, Any]:
    """Generate every turn of the shard's conversations not yet in the journal, then write the
    table and the run log. With turns left and `ahead` shards (or a function giving them,
    called only then), their turns join the stream (`draftline.generation.schedule`) and are
    journaled in their own journals; a shard whose journal another run holds is left out."""
    from tqdm import tqdm

    labels = {
        "engine": engine.identity(),
        "model": identity.model,
        "sampling": orjson.dumps(identity.sampling.as_dict(), option=orjson.OPT_SORT_KEYS).decode(),
    }
    own = _open_shard(paths, 0, identity, tokenizer, special, guard)
    assert own is not None
    shards = [own]
    bar: Any = None
    try:
        if own.remaining_turns():
            for position, ahead_paths in enumerate(ahead() if callable(ahead) else ahead, 1):
                try:
                    shard = _open_shard(ahead_paths, position, identity, tokenizer, special, guard)
                except (SystemExit, Exception) as exc:  # its own stage will say what is wrong
                    print(f"{ahead_paths.name}: not working ahead on it: {exc}")
                    continue
                if shard is None:
                    print(f"{ahead_paths.name}: another generate run holds its journal; not "
                          "working ahead on it")  # fmt: skip
                else:
                    shards.append(shard)
        more = f" +{len(shards) - 1} ahead" if len(shards) > 1 else ""
        started = time.monotonic()
        bar = tqdm(
            total=sum(s.resumed_turns + s.remaining_turns() for s in shards),
            initial=sum(s.resumed_turns for s in shards),
            desc=f"generate {paths.name}{more}",
            unit="turn",
            disable=not progress,
            mininterval=1.0,
            dynamic_ncols=True,
        )

        def shard_wall(shard: _Shard) -> float:
            """The shard's generation time so far, all runs: the stage's own shard has this
            run's time but what went to the shards worked ahead on."""
            if not shard.own:
                return shard.prior_wall + scheduler.attributed_s(shard.paths.name)
            others = sum(scheduler.attributed_s(s.paths.name) for s in shards[1:])
            return shard.prior_wall + time.monotonic() - started - others

        def lost(work: _Turns, last: int) -> None:
            """The conversation ends after turn `last`: the bar loses the turns it never has."""
            assert work.conversation is not None
            bar.total -= len(work.conversation.turns) - last - 1
            if not work.shard.own:  # its own stage rebuilds it from the journal: free it
                del work.shard.conversations[work.conversation.id]
                work.conversation = None

        def on_result(work: _Turns, result: Result) -> None:
            shard, conversation = work.shard, work.conversation
            assert conversation is not None
            result = conversation.take(result)
            shard.journal.append([result], wall_s=shard_wall(shard))
            conversation_id, k = split_key(result.id) or (result.id, 0)
            if result.finish_reason == "error":
                shard.failed[conversation_id] = result
            else:
                conversation.results.append(result)
            prompt = conversation.prompt(tokenizer, special, k).ids
            row = turn_row(prompt, result, special, conversation.thinking)
            shard.generated_tokens += row["num_completion_tokens"]
            shard.generated_turns += 1
            if conversation_id in shard.failed or conversation.done():
                lost(work, k)
            elapsed = max(time.monotonic() - started, 1e-9)
            tokens = sum(s.generated_tokens for s in shards)
            bar.set_postfix_str(f"{tokens / elapsed:,.0f} out tok/s", refresh=False)
            bar.update(1)
            if guard:
                guard.observe(row)

        scheduler = Scheduler(engine, on_result, schedule=schedule)  # type: ignore[arg-type]
        try:
            scheduler.run(
                _Turns(s, c, tokenizer, special, lost)
                for s in shards
                for i, c in sorted(s.conversations.items())
                if i not in s.failed
            )
        except NoResult as exc:
            raise ShardFailed(f"{paths.name}: {exc}") from exc
    finally:
        if bar is not None:
            bar.close()
        for shard in shards:
            shard.journal.close()
    run_wall = time.monotonic() - started

    conversations, failed = own.conversations, own.failed
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
    tokens = sum(s.generated_tokens for s in shards)  # the node's work: own and worked ahead
    metrics = shard_metrics(ordered, reasons, len(ordered) - own.resumed, tokens, run_wall)
    ahead_s = sum(scheduler.attributed_s(s.paths.name) for s in shards[1:])
    metrics.update(
        {
            "wall_s": round(own.prior_wall + run_wall - ahead_s, 3),
            "resumed_samples": own.resumed,
            # Turns read back from the journal: with the generated ones, every turn once.
            "resumed_turns": own.resumed_turns,
            "generated_turns": own.generated_turns,
            "turns": sum(r["turns"] for r in ordered),
            # Every turn's prompt (what the engine prefilled): `draftline plan` reads it.
            "turn_prompt_tokens": sum(
                len(conversations[i].prompt(tokenizer, special, k).ids)
                for i in conversations
                for k in range(len(conversations[i].results))
            ),
            "schedule": schedule,
            "mean_in_flight": round(scheduler.mean_in_flight(), 2),
            "max_in_flight": scheduler.limit,
            "work_ahead": {
                s.paths.name: {
                    "turns": s.generated_turns,
                    "output_tokens": s.generated_tokens,
                    "wall_s": round(scheduler.attributed_s(s.paths.name), 3),
                    "turns_left": s.remaining_turns(),
                }
                for s in shards[1:]
            },
            **(extra_metrics or {}),
            "engine_identity": labels["engine"],
            "model": identity.model,
            "target_id": identity.target_id,
            "journal_set_aside": str(own.journal.discarded) if own.journal.discarded else None,
        }
    )
    atomic.write_json(paths.run_log, metrics)
    mark_current(paths, identity)
    # The journal stays: until DVC records the table, a kill makes DVC delete it (see top).
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
        "finish_reasons": {k: reasons.get(k, 0) for k in ("stop", "length", "context", "error")},
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
