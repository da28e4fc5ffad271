"""The multi-turn checks of `validate`: every turn of a regenerated conversation, and whether
each conversation was written to its end.

The generated table has one row per conversation: its scalar columns describe the last turn
generated, the `turn_*` lists every turn in order (docs/pipeline.md). The checks of
`draftline.quality.checks` judge those scalar columns, so an empty reply in the middle of a
conversation (the seed's `OK.<|im_end|>`, now in the history every later turn trains on) would
pass them. Here the lists are exploded into one row per turn (frame "turns"), and each answered
multi-turn row says whether every turn ended `stop` (frame "conversations": a turn cut at
max_new_tokens ends the conversation early, so its later turns were never written).

The checks exist only when some answered row has `turns > 1`: single-turn tables, the guard's
window (one row per turn, without the turn columns) and shards written before multi-turn
generation (null turn columns) have none. A conversation cut at its first turn is a one-turn
row: `truncated_share` counts it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from draftline.quality.check_parts import (
    Check,
    Rows,
    Thresholds,
    at_least_check,
    gx_expected_share,
    mode_rows,
    row_modes,
    share_of,
)

# The turn columns of the generated table these checks read (docs/pipeline.md).
TURN_COLUMNS = ("turns", "turn_finish_reasons", "turn_loss_mask_sums", "turn_answer_tokens")

# Per-turn list column -> its column in the "turns" frame (one value per row there).
_EXPLODED = {
    "turn_finish_reasons": "turn_finish_reason",
    "turn_loss_mask_sums": "turn_loss_mask_sum",
    "turn_answer_tokens": "turn_answer_tokens",
}

# The per-turn frame of each kind of rows `check_parts.mode_rows` gives.
_TURN_ROWS: dict[Rows, Rows] = {
    "answered": "turns",
    "thinking": "turns_thinking",
    "no_thinking": "turns_no_thinking",
}


def multi_turn_rows(answered: pd.DataFrame) -> pd.DataFrame:
    """The answered rows with more than one turn (none when the table has no turn columns)."""
    if not set(TURN_COLUMNS) <= set(answered.columns):
        return answered.iloc[:0].assign(**{c: [] for c in TURN_COLUMNS})
    turns = pd.to_numeric(answered["turns"]).fillna(1)  # null: a shard from before multi-turn
    return answered[turns.to_numpy() > 1]


def frames(answered: pd.DataFrame, thinking: bool) -> dict[str, pd.DataFrame]:
    """The multi-turn frames of `checks.frames`: "conversations" (one row per answered multi-turn
    row, with `all_turns_stopped`) and "turns" (one row per turn of those, with `turn_index`),
    also split by thinking mode as the answered rows are."""
    multi = multi_turn_rows(answered)
    mode = row_modes(multi, thinking)
    # A conversation closed for a full context has every written turn `stop` but not all turns.
    stopped = [
        last != "context" and all(reason == "stop" for reason in reasons)
        for last, reasons in zip(multi["finish_reason"], multi[TURN_COLUMNS[1]], strict=True)
    ]
    conversations = pd.DataFrame(
        {
            "id": multi["id"].to_numpy(),
            "thinking": mode.to_numpy(dtype=bool),
            "turns": multi["turns"].to_numpy(dtype="int64"),
            "all_turns_stopped": np.array(stopped, dtype=bool),
        }
    )
    # Only the columns the checks read go to GX: no list columns in its frames.
    lists = multi[list(_EXPLODED)].assign(id=multi["id"], thinking=mode)
    turns = lists.explode(list(_EXPLODED)).rename(columns=_EXPLODED)
    turns["turn_index"] = turns.groupby(level=0).cumcount()
    turns = turns.reset_index(drop=True).astype(
        {
            "thinking": bool,
            "turn_finish_reason": str,
            "turn_loss_mask_sum": "int64",
            "turn_answer_tokens": "int64",
        }
    )[["id", "turn_index", "thinking", *_EXPLODED.values()]]
    return {
        "conversations": conversations,
        "turns": turns,
        "turns_thinking": turns[turns["thinking"]],
        "turns_no_thinking": turns[~turns["thinking"]],
    }


def define_checks(
    by_rows: Mapping[str, pd.DataFrame], q: Thresholds, *, thinking: bool
) -> list[Check]:
    """The per-turn and per-conversation checks; none without an answered multi-turn row.

    Supervised tokens per turn are held to each thinking mode's bound when the turns mix modes,
    as `checks.define_checks` holds the answered rows (the suffix names the other mode)."""
    if not len(by_rows["conversations"]):
        return []
    mixed = bool(len(by_rows["turns_thinking"])) and bool(len(by_rows["turns_no_thinking"]))
    checks: list[Check] = []
    min_supervised = q.share("min_share_supervised")
    for kind, suffix in mode_rows(thinking, mixed):
        min_tokens = q.int("min_supervised_tokens", kind)
        mode = f", {suffix[1:].replace('_', ' ')} rows" if suffix else ""
        checks.append(
            at_least_check(
                f"turn_supervised_tokens_min{suffix}",
                f"turns of multi-turn conversations with at least {min_tokens} "
                f"supervised tokens (turn_loss_mask_sums{mode})",
                "turns",
                _TURN_ROWS[kind],
                "turn_loss_mask_sum",
                min_tokens,
                min_supervised,
            )
        )
    min_answer = q.share("min_answer_share")
    after = "after </think> " if thinking or mixed else ""
    checks.append(
        Check(
            name="turn_answer_nonempty",
            description="turns of multi-turn conversations with a non-empty answer "
            f"{after}(turn_answer_tokens >= 1): an empty reply mid-conversation is in the "
            "history of every later turn",
            bound=f">= {min_answer:.2f} of turns",
            rows="turns",
            measure=lambda t: share_of(t["turn_answer_tokens"] >= 1),
            accept=lambda v: v >= min_answer,
            expectation="ExpectColumnValuesToBeBetween",
            kwargs={"column": "turn_answer_tokens", "min_value": 1, "mostly": min_answer},
            gx_observed=gx_expected_share,
        )
    )
    min_complete = q.share("min_complete_conversation_share")
    checks.append(
        Check(
            name="conversation_complete",
            description="answered multi-turn conversations whose every turn ended with stop "
            "(all_turns_stopped; a turn cut at max_new_tokens or a full context ends the "
            "conversation early)",
            bound=f">= {min_complete:.2f} of multi-turn conversations",
            rows="conversations",
            measure=lambda t: share_of(t["all_turns_stopped"]),
            accept=lambda v: v >= min_complete,
            expectation="ExpectColumnValuesToBeInSet",
            kwargs={"column": "all_turns_stopped", "value_set": [True], "mostly": min_complete},
            gx_observed=gx_expected_share,
        )
    )
    return checks
