"""Calibration's generate part: turns of sampled curated conversations through the engine
`draftline generate` builds (`make_engine`), with the production scheduler and its in-flight
cap, until the part's time is spent: steady-state output tok/s, the turns' lengths, the
engine's prefix-cache hits. The generated turns stay in memory, handed to the extract and
train parts as sequences, and are dropped.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from draftline.ops.calibration import CURATED_TRAIN, PartSkipped, Say, TimeBar, distribution


class _Sampled:
    """A sampled conversation as the scheduler's `Work`, with no turn asked after `deadline`
    (the turns in flight then still finish)."""

    __slots__ = ("conversation", "order", "group", "failed", "_tokenizer", "_special", "_end")

    def __init__(self, conversation: Any, tokenizer: Any, special: Any, deadline: float) -> None:
        self.conversation = conversation
        self.order = (0, conversation.id)
        self.group = "calibrate"
        self.failed = False
        self._tokenizer, self._special, self._end = tokenizer, special, deadline

    def remaining_turns(self) -> int:
        if self.failed or time.monotonic() >= self._end:
            return 0
        return self.conversation.remaining_turns()

    def next_request(self) -> Any:
        from draftline.generation.engines.base import Result

        if time.monotonic() >= self._end:
            return None
        asked = self.conversation.next_request(self._tokenizer, self._special)
        if isinstance(asked, Result):  # its prompt cannot be built: left out of the sample
            self.failed = True
            return None
        return asked


class _Timed:
    """The engine, with the time and output tokens of each collection of results (the
    scheduler's `results()` calls), for a rate over whole batches."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_in_flight = engine.max_in_flight
        self.started = time.monotonic()
        self.collected: list[tuple[float, int]] = []  # (time, output tokens) per collection

    def submit(self, requests: Any) -> None:
        self.engine.submit(requests)

    def results(self) -> list[Any]:
        finished = self.engine.results()
        tokens = sum(len(r.completion_ids) for r in finished if r.finish_reason != "error")
        self.collected.append((time.monotonic(), tokens))
        return finished


def sample_conversations(
    p: dict[str, Any], identity: Any, count: int, folder: Path = CURATED_TRAIN
) -> list[Any]:
    """Up to `count` curated train conversations, drawn at random (seeded) over the shards."""
    import pyarrow.parquet as pq

    from draftline.core.turn_prompts import regenerated_turns
    from draftline.data.conversations import messages_from_records
    from draftline.generation.turns import Conversation

    shards = sorted(folder.glob("shard-*.parquet"))
    if not shards:
        raise PartSkipped(f"no curated shards under {folder}/: run `dvc repro curate` first")
    rows = [r for s in shards for r in pq.read_table(s, columns=["id", "messages"]).to_pylist()]
    rows = random.Random(0).sample(rows, min(count, len(rows)))
    conversations = []
    for r in rows:
        messages = messages_from_records(r["messages"])
        conversations.append(
            Conversation(
                r["id"],
                messages,
                regenerated_turns(messages, identity.regenerate_turns),
                identity.kwargs_for(r["id"]),
                sampling=identity.sampling,
            )
        )
    return conversations


def measure_generation(
    p: dict[str, Any], profile: dict[str, Any], budget_s: float, say: Say, progress: bool
) -> tuple[dict[str, Any], list[list[int]]]:
    """Generate turns of sampled conversations for `budget_s` seconds: the figures, and every
    generated turn's sequence (prompt + completion ids) for the extract and train parts."""
    from draftline.core import target
    from draftline.core.loss_mask import special_ids
    from draftline.generation.engines.choose import make_engine, sampling_from
    from draftline.generation.schedule import Scheduler
    from draftline.generation.table_record import Identity
    from draftline.generation.turns import turn_row

    model, gen, data = p["model"], p["generate"], p.get("data") or {}
    sampling = sampling_from(gen, model)
    tokenizer = target.load_tokenizer(model)
    special = special_ids(tokenizer, str(model.get("end_of_turn_token", "<|im_end|>")))
    identity = Identity(
        model=target.model_ref(model),
        template_kwargs=dict(model.get("chat_template_kwargs") or {}),
        sampling=sampling,
        thinking_share=float(data.get("thinking_share", 1.0)),
        regenerate_turns=str(data.get("regenerate_turns", "all")),
    )
    began = time.monotonic()
    engine = make_engine(p, profile, sampling, tokenizer, special.end_of_turn)
    setup_s = time.monotonic() - began
    say(f"generate: engine {engine.identity()} ready in {setup_s:.0f} s")
    try:
        # Enough conversations to keep the engine full for the whole budget.
        conversations = sample_conversations(p, identity, max(64, 8 * engine.max_in_flight))
        bar = TimeBar("generate", budget_s, progress)
        deadline = time.monotonic() + budget_s
        turns: list[dict[str, Any]] = []
        reasons: Counter[str] = Counter()
        sequences: list[list[int]] = []
        cache = PrefixCache()

        def on_result(work: _Sampled, result: Any) -> None:
            conversation = work.conversation
            k = len(conversation.results)
            result = conversation.take(result)
            reasons[result.finish_reason] += 1
            cache.add(result)
            if result.finish_reason == "error":
                work.failed = True
                return
            conversation.results.append(result)
            prompt = conversation.prompt(tokenizer, special, k).ids
            row = turn_row(prompt, result, special, conversation.thinking)
            turns.append({**row, "turn": k})
            sequences.append(prompt + row["completion_ids"])
            bar.add(row["num_completion_tokens"])

        timed = _Timed(engine)
        scheduler = Scheduler(
            timed,  # type: ignore[arg-type]
            on_result,  # type: ignore[arg-type]
            schedule=str(profile.get("generation_schedule") or "continuous"),
        )
        try:
            works = [_Sampled(c, tokenizer, special, deadline) for c in conversations]
            timed.started = time.monotonic()
            scheduler.run(works)
        finally:
            bar.close()
        figures = generation_figures(turns, timed, conversations)
        figures.update(
            {
                "engine": engine.identity(),
                "engine_setup_s": round(setup_s, 1),
                "budget_s": round(budget_s, 1),
                "running_cap": scheduler.limit,
                "mean_in_flight": round(scheduler.mean_in_flight(), 2),
                "peak_in_flight": scheduler.peak_in_flight,
                "finish_reasons": dict(reasons),
                "prefix_cache": cache.figures(),
                "sampled_conversations": len(conversations),
            }
        )
    finally:
        engine.close()
    return figures, sequences


class PrefixCache:
    """Prompt tokens the engine served from its prefix cache, over the turns that say (SGLang's
    `meta_info.cached_tokens`; vLLM's `usage.prompt_tokens_details` when it is started with
    `--enable-prompt-tokens-details`): a multi-turn conversation's later turns should find
    their history cached, and a low share means the engine evicts it between turns."""

    def __init__(self) -> None:
        self.turns = self.prompt_tokens = self.cached_tokens = 0

    def add(self, result: Any) -> None:
        if result.prompt_tokens is None or result.cached_tokens is None:
            return
        self.turns += 1
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens

    def figures(self) -> dict[str, Any] | str:
        if not self.turns:
            return "not reported by this engine"
        return {
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_share": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
        }


def generation_figures(
    turns: list[dict[str, Any]], timed: _Timed, conversations: list[Any]
) -> dict[str, Any]:
    """Steady-state output tok/s (the collections after the first: the first carries the
    engine's warm-up) and the lengths of the turns, their distributions."""
    if not turns:
        raise PartSkipped("no turn finished within the budget: give it more --minutes")
    collected = timed.collected
    if len(collected) >= 2 and collected[-1][0] > collected[0][0]:
        tokens = sum(n for _, n in collected[1:])
        rate = tokens / (collected[-1][0] - collected[0][0])
        warm = f"steady state: {len(collected) - 1} collections after the first"
    else:  # one collection only: from the first submission, warm-up included
        rate = collected[0][1] / (collected[0][0] - timed.started)
        warm = "one collection only: warm-up included"
    asked = [len(c.turns) for c in conversations]
    finished = [c for c in conversations if c.done()]
    return {
        "output_tok_s": round(rate, 2),
        "steady_state": warm,
        "turns_generated": len(turns),
        "output_tokens": sum(t["num_completion_tokens"] for t in turns),
        "completion_tokens": distribution([t["num_completion_tokens"] for t in turns]),
        "think_tokens": distribution([t["think_tokens"] for t in turns]),
        "answer_tokens": distribution([t["answer_tokens"] for t in turns]),
        "turn_prompt_tokens": distribution([t["num_prompt_tokens"] for t in turns]),
        "first_prompt_tokens": distribution(
            [t["num_prompt_tokens"] for t in turns if t["turn"] == 0]
        ),
        # The turns generate is asked for per conversation (the curated structure), and those
        # written where a conversation finished (a cut turn ends it early).
        "turns_per_conversation": distribution(asked),
        "turns_per_finished_conversation": distribution([len(c.results) for c in finished]),
    }
