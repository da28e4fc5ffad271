"""One conversation being regenerated turn by turn, and its row in the generated table.

A conversation's assistant turns (`draftline.core.turn_prompts.regenerated_turns`) are generated
in order: turn k's prompt holds the target's answers to turns 0..k-1, so turn k is requested only
once turn k-1 is back. Each turn's result is journaled under `<id>#<k>`; after a kill the
conversation resumes at its first turn without a result. A turn that does not end its turn
(`length`, `context`) or fails (`error`) ends the conversation: the next turn would build on a
cut answer.

No turn is refused for length: with a context length (`Sampling.context_length`) each turn asks
for at most what its prompt leaves of it (`Request.max_new_tokens`); a turn cut at that cap ends
`context`, and a conversation whose next prompt leaves no room at all is closed there: its row
is its last turn with `finish_reason: context` (validate counts it as cut short).

The row holds every turn as generated: `turn_prompt_ids[k]` is the prompt the engine received
for turn k and `turn_completion_ids[k]` what it wrote (reasoning included), the training
sequences of the default layout (`draftline.core.training_rows`). Its own columns are the
last turn: its prompt (every earlier answer in it, as the template shows history; where,
`history_spans`) and its completion, the sequence of the `conversation` layout; the other
`turn_*` columns describe each turn for validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from draftline.core.loss_mask import SpecialIds, completion_stats, prompt_opens_think
from draftline.core.turn_prompts import TurnPrompt, TurnPromptError, turn_prompt
from draftline.generation.engines.base import Request, Result, Sampling
from draftline.quality.checks import completion_hash

TURN_SEPARATOR = "#"
# A conversation ended because the context length was full (a turn cut at its cap, or no room
# left for the next turn).
CONTEXT_FULL = "context"


def turn_key(conversation_id: str, turn: int) -> str:
    """The request and journal id of a conversation's turn."""
    return f"{conversation_id}{TURN_SEPARATOR}{turn}"


def split_key(key: str) -> tuple[str, int] | None:
    conversation_id, sep, turn = key.rpartition(TURN_SEPARATOR)
    return (conversation_id, int(turn)) if sep and turn.isdigit() else None


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, Any]]  # the curated conversation: ends in a user or tool turn
    turns: list[int]  # message index of each assistant turn the target writes, in order
    template_kwargs: dict[str, Any]
    results: list[Result] = field(default_factory=list)  # one per finished turn, in order
    prompts: list[TurnPrompt] = field(default_factory=list)  # the prompt of each requested turn
    # The turns' limits (max_new_tokens, context length); the default caps nothing.
    sampling: Sampling | None = None
    # Closed before its last turn because the next prompt left no room in the context.
    closed: bool = False

    @property
    def thinking(self) -> bool:
        return bool(self.template_kwargs.get("enable_thinking", False))

    def done(self) -> bool:
        if self.closed or (self.results and self.results[-1].finish_reason != "stop"):
            return True
        return len(self.results) == len(self.turns)

    def take(self, result: Result) -> Result:
        """The result as recorded: with the turn's cap when the context left less than
        `max_new_tokens`, and a turn that used all of it ends `context`, not `length`."""
        if self.sampling is None or result.finish_reason == "error":
            return result
        cap = self.sampling.turn_cap(len(self.prompts[len(self.results)].ids))
        if cap >= self.sampling.max_new_tokens:
            return result
        reason = CONTEXT_FULL if result.finish_reason == "length" else result.finish_reason
        return replace(result, finish_reason=reason, max_new_tokens=cap)

    def remaining_turns(self) -> int:
        return 0 if self.done() else len(self.turns) - len(self.results)

    def resume(self, journaled: dict[int, Result]) -> None:
        """Take the journaled turns 0, 1, ... up to the first missing or failed one (a failed
        turn is generated again)."""
        k = 0
        while k < len(self.turns) and k in journaled and journaled[k].finish_reason != "error":
            self.results.append(journaled[k])
            if journaled[k].finish_reason != "stop":
                break
            k += 1

    def prompt(self, tokenizer: Any, special: SpecialIds, turn: int) -> TurnPrompt:
        """The prompt of turn `turn`, built from the ids of the answers before it (cached)."""
        while len(self.prompts) <= turn:
            k = len(self.prompts)
            answers = {self.turns[j]: self.results[j].completion_ids for j in range(k)}
            history = self.messages[: self.turns[k]]
            self.prompts.append(
                turn_prompt(tokenizer, history, answers, self.template_kwargs, special)
            )
        return self.prompts[turn]

    def next_request(self, tokenizer: Any, special: SpecialIds) -> Request | Result | None:
        """The next turn's request, capped to what its prompt leaves of the context; an error
        result when its prompt cannot be built; None when it leaves no room (the conversation
        is closed: `closed`)."""
        k = len(self.results)
        try:
            ids = self.prompt(tokenizer, special, k).ids
        except TurnPromptError as error:
            return Result(turn_key(self.id, k), [], "error", f"turn {k}: {error}")
        if self.sampling is None:
            return Request(turn_key(self.id, k), ids)
        cap = self.sampling.turn_cap(len(ids))
        if cap < 1 and not k:  # nothing to close on: the first prompt alone is too long
            message = f"prompt of {len(ids)} tokens fills context_length"
            return Result(turn_key(self.id, k), [], "error", f"turn 0: {message}")
        if cap < 1:
            self.closed = True
            return None
        capped = cap < self.sampling.max_new_tokens
        return Request(turn_key(self.id, k), ids, max_new_tokens=cap if capped else None)


def turn_row(
    prompt: list[int], result: Result, special: SpecialIds, thinking: bool
) -> dict[str, Any]:
    """One turn as generated, in the generated table's columns (the guard watches every turn)."""
    ids = [int(t) for t in result.completion_ids]
    stats = completion_stats(ids, special, think_open=prompt_opens_think(prompt, special))
    return {
        "id": result.id,
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
    }


def conversation_row(
    conversation: Conversation, tokenizer: Any, special: SpecialIds, failed: Result | None = None
) -> dict[str, Any]:
    """The conversation's training sequence and per-turn columns (without the labels).

    `failed`: the result of a turn that errored, which makes the row an error row.
    """
    last = len(conversation.results) - (0 if failed else 1)
    try:
        prompt = conversation.prompt(tokenizer, special, last)
    except TurnPromptError:  # the failure was building this prompt: the row has none
        prompt = TurnPrompt([], [])
    result = failed or conversation.results[last]
    turns = [
        turn_row(conversation.prompt(tokenizer, special, k).ids, r, special, conversation.thinking)
        for k, r in enumerate(conversation.results)
    ]
    if failed:
        turns.append(turn_row(prompt.ids, failed, special, conversation.thinking))
    row = turn_row(prompt.ids, result, special, conversation.thinking)
    if conversation.closed and not failed:  # its next turn had no room: cut short, counted
        row["finish_reason"] = CONTEXT_FULL
    row.update(
        {
            "id": conversation.id,
            "history_spans": [list(span) for span in prompt.spans],
            "turns": len(turns),
            "turn_finish_reasons": [t["finish_reason"] for t in turns],
            "turn_loss_mask_sums": [t["loss_mask_sum"] for t in turns],
            "turn_answer_tokens": [t["answer_tokens"] for t in turns],
            "turn_prompt_ids": [t["prompt_ids"] for t in turns],
            "turn_completion_ids": [t["completion_ids"] for t in turns],
            "turn_prompt_tokens": [t["num_prompt_tokens"] for t in turns],
            "turn_completion_tokens": [t["num_completion_tokens"] for t in turns],
        }
    )
    return row
