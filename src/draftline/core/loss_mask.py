"""The loss mask and the completion statistics: the one definition every stage uses.

A training sequence is `prompt_ids + completion_ids`. The mask is 0 over the prompt and 1 over
the whole completion span, the end-of-turn token included (the drafter must learn to end turns).
In a multi-turn conversation the prompt holds the target's earlier answers too; their spans
(`history_spans`) are supervised as well.
A completion is cut after its first end-of-turn token; anything an engine returns past it
(padding, a second turn) is not part of the sample.

Thinking format: `<think> ... </think> answer <|im_end|>`. Where the think block opens depends on
the chat template: Qwen3's model writes `<think>` itself (it is in the completion), Qwen3.5/3.6's
template puts `<think>\n` at the end of the generation prompt, so the completion starts inside the
block (`reasoning </think> answer <|im_end|>`). `prompt_opens_think` tells the two apart from the
prompt ids. `think_tokens` counts the tokens strictly between the two tags, `answer_tokens` the
tokens after `</think>` up to (excluding) the end-of-turn token. A completion outside any think
block is all answer. The loss mask is the completion span in both styles: the `<think>` that the
prompt holds is never drafted, so it is never supervised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from draftline.core import target

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

    def optional(token: str) -> int | None:
        try:
            return target.special_token_id(tokenizer, token)
        except ValueError:
            return None

    return SpecialIds(
        end_of_turn=target.special_token_id(tokenizer, end_of_turn_token),
        think_start=optional(THINK_START),
        think_end=optional(THINK_END),
    )


def cut_at_end_of_turn(ids: Sequence[int], end_of_turn: int) -> tuple[list[int], bool]:
    """`ids` up to and including the first end-of-turn token, and whether one was found."""
    return cut_at_stop(ids, (end_of_turn,))


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """`ids` up to and including the first stop token (end of turn or the model's EOS), and
    whether one was found: every engine's completion is stored this way."""
    out = [int(t) for t in ids]
    stops = set(stop_ids)
    for i, token in enumerate(out):
        if token in stops:
            return out[: i + 1], True
    return out, False


def loss_mask(
    num_prompt_tokens: int,
    completion_ids: Sequence[int],
    history_spans: Sequence[Sequence[int]] = (),
) -> list[int]:
    """0 for every prompt token, 1 for every completion token (end-of-turn included), and 1
    over `history_spans`: the [start, end) prompt positions of a conversation's earlier answers,
    written by the target too (`draftline.core.turn_prompts`)."""
    mask = [0] * num_prompt_tokens + [1] * len(completion_ids)
    for start, end in history_spans or ():
        mask[start:end] = [1] * (end - start)
    return mask


def loss_mask_sum(completion_ids: Sequence[int]) -> int:
    """Supervised tokens of a sample: the length of its completion span."""
    return len(completion_ids)


def prompt_opens_think(prompt_ids: Sequence[int], ids: SpecialIds) -> bool:
    """Whether the prompt ends inside a think block: its last `<think>` is not closed."""
    if ids.think_start is None:
        return False
    tokens = list(prompt_ids)
    opened = _rindex(tokens, ids.think_start)
    return opened is not None and ids.think_end not in tokens[opened + 1 :]


def generation_prompt_opens_think(
    tokenizer: Any, template_kwargs: dict, special: SpecialIds
) -> bool:
    """Whether the chat template opens `<think>` in the generation prompt (Qwen3.5/3.6 with
    thinking on) rather than leaving it to the model (Qwen3)."""
    probe = target.prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], template_kwargs)
    return prompt_opens_think(probe, special)


def completion_stats(
    completion_ids: Sequence[int], ids: SpecialIds, think_open: bool = False
) -> CompletionStats:
    """Think/answer token counts and the loss-mask sum of one completion.

    think_open: the prompt opened the think block (`prompt_opens_think`), so the completion
    starts inside it.
    """
    tokens = list(completion_ids)
    body = tokens[:-1] if tokens and tokens[-1] == ids.end_of_turn else tokens
    start = -1 if think_open else _index(body, ids.think_start)
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


def _rindex(tokens: list[int], token: int) -> int | None:
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == token:
            return i
    return None
