"""The loss mask and the completion statistics: the one definition every stage uses.

A training sequence is `prompt_ids + completion_ids`. The mask is 0 over the prompt and 1 over
the whole completion span, the end-of-turn token included (the drafter must learn to end turns).
A completion is cut after its first end-of-turn token; anything an engine returns past it
(padding, a second turn) is not part of the sample.

Thinking format (Qwen3): `<think> ... </think> answer <|im_end|>`. `think_tokens` counts the
tokens strictly between the two tags, `answer_tokens` the tokens after `</think>` up to
(excluding) the end-of-turn token. A completion without a think block is all answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the statistics need: end of turn and the think tags (None when absent)."""

    end_of_turn: int
    think_start: int | None
    think_end: int | None


@dataclass(frozen=True)
class CompletionStats:
    has_think_block: bool
    think_tokens: int
    answer_tokens: int
    loss_mask_sum: int


def special_ids(tokenizer: Any, end_of_turn_token: str) -> SpecialIds:
    """Look the special tokens up in the target tokenizer; the end-of-turn token must exist."""
    from draftline.target import special_token_id

    def optional(token: str) -> int | None:
        try:
            return special_token_id(tokenizer, token)
        except ValueError:
            return None

    return SpecialIds(
        end_of_turn=special_token_id(tokenizer, end_of_turn_token),
        think_start=optional(THINK_START),
        think_end=optional(THINK_END),
    )


def cut_at_end_of_turn(ids: Sequence[int], end_of_turn: int) -> tuple[list[int], bool]:
    """`ids` up to and including the first end-of-turn token, and whether one was found."""
    out = [int(t) for t in ids]
    try:
        return out[: out.index(end_of_turn) + 1], True
    except ValueError:
        return out, False


def loss_mask(num_prompt_tokens: int, completion_ids: Sequence[int]) -> list[int]:
    """0 for every prompt token, 1 for every completion token (end-of-turn included)."""
    return [0] * num_prompt_tokens + [1] * len(completion_ids)


def loss_mask_sum(completion_ids: Sequence[int]) -> int:
    """Supervised tokens of a sample: the length of its completion span."""
    return len(completion_ids)


def completion_stats(completion_ids: Sequence[int], ids: SpecialIds) -> CompletionStats:
    """Think/answer token counts and the loss-mask sum of one completion."""
    tokens = list(completion_ids)
    body = tokens[:-1] if tokens and tokens[-1] == ids.end_of_turn else tokens
    start = _index(body, ids.think_start)
    end = _index(body, ids.think_end, after=start) if start is not None else None
    if start is not None and end is not None:
        think, answer = end - start - 1, len(body) - end - 1
        has_block = True
    elif start is not None:  # opened, never closed: the whole rest is thinking, no answer
        think, answer, has_block = len(body) - start - 1, 0, False
    else:
        think, answer, has_block = 0, len(body), False
    return CompletionStats(
        has_think_block=has_block,
        think_tokens=think,
        answer_tokens=answer,
        loss_mask_sum=loss_mask_sum(tokens),
    )


def _index(tokens: list[int], token: int | None, after: int | None = None) -> int | None:
    if token is None:
        return None
    begin = 0 if after is None else after + 1
    try:
        return tokens.index(token, begin)
    except ValueError:
        return None
