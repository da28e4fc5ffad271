"""Training sequences of a generated row: one per turn (each generated token supervised once,
in its own turn's context) or one per conversation; cuts from the prompt's start, counted."""

from __future__ import annotations

import pytest

from draftline.core.training_rows import Yield, row_sequences, supervised_tokens, window


def conversation(turns: list[tuple[int, int, str]], spans: list[list[int]] | None = None) -> dict:
    """A generated row whose turns have (prompt tokens, completion tokens, finish reason); the
    row's own columns describe its last turn."""
    last_prompt, last_completion, last_reason = turns[-1]
    return {
        "id": "c",
        "num_prompt_tokens": last_prompt,
        "num_completion_tokens": last_completion,
        "finish_reason": last_reason,
        "turn_prompt_tokens": [p for p, _, _ in turns],
        "turn_completion_tokens": [c for _, c, _ in turns],
        "turn_finish_reasons": [r for _, _, r in turns],
        "history_spans": spans or [],
    }


def test_the_window_cuts_the_prompt_start_and_keeps_the_completion_whole():
    assert window(10, 5, 100) == (0, 15)
    assert window(98, 5, 100) == (3, 103)  # 3 prompt tokens cut, completion whole
    assert window(10, 150, 100) == (9, 109)  # one prompt token kept, the completion's end cut
    assert window(0, 150, 100) == (0, 100)


def test_turn_rows_supervise_every_generated_token_once():
    # Turn 0 wrote 400 tokens (reasoning and answer); turn 1's prompt shows only its 40-token
    # answer (the template drops the reasoning), and turn 1 wrote 300.
    row = conversation([(20, 400, "stop"), (80, 300, "stop")], spans=[[30, 70]])
    turn, conv = Yield(), Yield()
    seqs = turn.add_row(row, "turn", 4096)
    assert [(s.turn, s.prompt_tokens, s.completion_tokens) for s in seqs] == [
        (0, 20, 400),
        (1, 80, 300),
    ]
    assert (turn.generated, turn.supervised, turn.share) == (700, 700, 1.0)
    assert turn.sequence_tokens == 800  # the prompts go through the forward too
    [whole] = conv.add_row(row, "conversation", 4096)
    assert whole.turn is None and supervised_tokens(whole, row["history_spans"]) == 340
    assert (conv.generated, conv.supervised) == (700, 340)
    assert conv.share == pytest.approx(340 / 700)


def test_a_failed_later_turn_keeps_the_earlier_turns_in_turn_rows_only():
    row = conversation([(20, 50, "stop"), (90, 0, "error")])
    assert [s.turn for s in row_sequences(row, "turn", 4096)] == [0]
    assert row_sequences(row, "conversation", 4096) == []


def test_cuts_are_counted_never_silent():
    row = conversation([(20, 50, "stop"), (3000, 200, "stop")])
    y = Yield()
    y.add_row(row, "turn", 1024)
    assert (y.cut_sequences, y.prompt_tokens_cut, y.completion_tokens_cut) == (1, 2176, 0)
    assert y.supervised == y.generated == 250  # the completion was kept whole
    y.add_row(conversation([(10, 2000, "length")]), "turn", 1024)
    assert y.completion_tokens_cut == 2000 - 1023 and y.supervised == 250 + 1023


def test_rows_without_turn_columns_are_one_sequence_in_either_layout():
    row = {"id": "x", "num_prompt_tokens": 12, "num_completion_tokens": 30, "finish_reason": "stop"}
    assert [(s.turn, s.num_tokens) for s in row_sequences(row, "turn", 4096)] == [(None, 42)]
    assert row_sequences(row, "turn", 4096) == row_sequences(row, "conversation", 4096)


def test_rows_without_turn_columns_count_their_earlier_answers_in_either_layout():
    # Extract masks the earlier answers of such a row whatever the layout: the yield says so.
    row = {"id": "x", "num_prompt_tokens": 80, "num_completion_tokens": 30,
           "finish_reason": "stop", "history_spans": [[10, 25], [40, 60]]}  # fmt: skip
    for layout in ("turn", "conversation"):
        y = Yield()
        y.add_row(row, layout, 4096)
        assert (y.generated, y.supervised, y.share) == (65, 65, 1.0), layout
    cut = Yield()
    cut.add_row(row, "turn", 70)  # window [40, 110): the first answer cut, the second kept
    assert (cut.generated, cut.supervised) == (65, 30 + 20)


def test_an_unknown_layout_names_the_key():
    with pytest.raises(ValueError, match="extract.rows"):
        row_sequences(conversation([(1, 1, "stop")]), "turns", 10)
