"""The one definition of the loss mask and the completion statistics (draftline.core.loss_mask)."""

from __future__ import annotations

import pytest

from draftline.core.loss_mask import (
    SpecialIds,
    completion_stats,
    cut_at_end_of_turn,
    loss_mask,
    loss_mask_sum,
    prompt_opens_think,
    special_ids,
)

EOT, THINK, END = 2, 3, 4
IDS = SpecialIds(end_of_turn=EOT, think_start=THINK, think_end=END)


def test_thinking_completion_counts_think_and_answer_tokens():
    completion = [THINK, 10, 11, 12, END, 20, 21, EOT]
    stats = completion_stats(completion, IDS)
    assert stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens) == (3, 2)
    assert stats.loss_mask_sum == len(completion) == 8  # end-of-turn token supervised too


def test_unclosed_think_block_has_no_answer():
    stats = completion_stats([THINK, 10, 11, 12], IDS)  # truncated inside the thoughts
    assert not stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens, stats.loss_mask_sum) == (3, 0, 4)


def test_completion_without_think_block_is_all_answer():
    stats = completion_stats([30, 31, 32, EOT], IDS)
    assert not stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens, stats.loss_mask_sum) == (0, 3, 4)


def test_the_ok_failure_has_six_supervised_tokens_and_an_empty_think_block():
    # The seed disaster: "<think></think>OK.<|im_end|>"-like completions.
    stats = completion_stats([THINK, END, 40, 41, 42, EOT], IDS)
    assert stats.has_think_block and stats.think_tokens == 0
    assert stats.answer_tokens == 3 and stats.loss_mask_sum == 6


def test_error_rows_have_nothing_supervised():
    stats = completion_stats([], IDS)
    assert stats == type(stats)(False, 0, 0, 0)


def test_cut_keeps_the_first_end_of_turn_and_drops_the_rest():
    assert cut_at_end_of_turn([5, 6, EOT, 7, EOT, EOT], EOT) == ([5, 6, EOT], True)
    assert cut_at_end_of_turn([5, 6, 7], EOT) == ([5, 6, 7], False)


def test_mask_is_zero_over_prompt_and_one_over_completion():
    mask = loss_mask(3, [THINK, END, 9, EOT])
    assert mask == [0, 0, 0, 1, 1, 1, 1]
    assert sum(mask) == loss_mask_sum([THINK, END, 9, EOT])


def test_special_ids_come_from_the_tokenizer(tmp_path):
    from draftline.embedded import tiny_target

    tok = tiny_target.build_tokenizer(["hello world", "think about it"], 300)
    ids = special_ids(tok, "<|im_end|>")
    assert ids.end_of_turn == tok.convert_tokens_to_ids("<|im_end|>")
    assert ids.think_start == tok.convert_tokens_to_ids("<think>")
    assert ids.think_end == tok.convert_tokens_to_ids("</think>")
    with pytest.raises(ValueError, match="not in the target tokenizer"):
        special_ids(tok, "<|no_such_token|>")


# Qwen3.6 style: the chat template ends the prompt with `<think>\n`, so the completion starts
# inside the think block and holds no `<think>` of its own.
PROMPT_CLOSED = [7, 8, 9]  # ... <|im_start|>assistant\n  (Qwen3)
PROMPT_OPEN = [7, 8, 9, THINK, 10]  # ... <|im_start|>assistant\n<think>\n  (Qwen3.6)
PROMPT_OFF = [7, 8, 9, THINK, 10, END, 10]  # thinking off: an empty, closed think block


def test_prompt_opens_think_tells_the_template_styles_apart():
    assert not prompt_opens_think(PROMPT_CLOSED, IDS)
    assert prompt_opens_think(PROMPT_OPEN, IDS)
    assert not prompt_opens_think(PROMPT_OFF, IDS)
    # History turns' closed think blocks before an open one do not matter, nor do tokenizers
    # without think tags.
    assert prompt_opens_think([THINK, 1, END, 5, THINK, 6], IDS)
    assert not prompt_opens_think(PROMPT_OPEN, SpecialIds(EOT, None, None))


@pytest.mark.parametrize(
    ("prompt", "completion"),
    [
        (PROMPT_CLOSED, [THINK, 10, 11, 12, END, 20, 21, EOT]),
        (PROMPT_OPEN, [10, 11, 12, END, 20, 21, EOT]),
    ],
    ids=["think-in-completion", "think-in-prompt"],
)
def test_both_template_styles_count_the_same_thinking_reply(prompt, completion):
    stats = completion_stats(completion, IDS, think_open=prompt_opens_think(prompt, IDS))
    assert stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens) == (3, 2)
    # The mask is the completion in both styles: a <think> in the prompt is never supervised.
    mask = loss_mask(len(prompt), completion)
    assert sum(mask) == stats.loss_mask_sum == len(completion)
    assert mask[: len(prompt)] == [0] * len(prompt)


@pytest.mark.parametrize(
    ("prompt", "completion"),
    [(PROMPT_CLOSED, [THINK, 10, 11, 12]), (PROMPT_OPEN, [10, 11, 12])],
    ids=["think-in-completion", "think-in-prompt"],
)
def test_truncated_inside_the_think_block_in_both_styles(prompt, completion):
    stats = completion_stats(completion, IDS, think_open=prompt_opens_think(prompt, IDS))
    assert not stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens) == (3, 0)


def test_the_ok_reply_after_an_opened_think_is_no_think_block_and_no_answer():
    # `OK.<|im_end|>` written inside the think block the prompt opened.
    stats = completion_stats([40, 41, EOT], IDS, think_open=True)
    assert not stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens, stats.loss_mask_sum) == (2, 0, 3)


def test_thinking_off_prompt_makes_the_reply_all_answer():
    stats = completion_stats([30, 31, EOT], IDS, think_open=prompt_opens_think(PROMPT_OFF, IDS))
    assert not stats.has_think_block
    assert (stats.think_tokens, stats.answer_tokens) == (0, 2)
