"""Which training sequences a generated row gives, which tokens each keeps, and the yield.

A generated row is one conversation: every turn the target wrote, each with the prompt the
engine received for it (`turn_prompt_ids`, `turn_completion_ids`) and, as its own columns, the
last turn's prompt with the earlier answers as the chat template shows them (`prompt_ids`,
`history_spans`). Two layouts turn it into training sequences (`extract.rows`):

- `turn` (the default): one sequence per generated turn, its own prompt and its whole
  completion, reasoning included. Every generated token is supervised once, in the context the
  server saw when it wrote it. The turns cannot share one sequence: Qwen3/3.6 templates drop an
  answer's reasoning from later prompts, so turn k's context is not a prefix of turn k+1's; the
  price is that each turn's prompt goes through the target's forward again (`draftline plan`
  counts it).
- `conversation`: one sequence per conversation, the last turn's prompt and completion, with the
  earlier answers supervised where the template shows them: their reasoning, written by the
  target and paid for, is never trained on.

A sequence longer than `max_length` is cut from its prompt's start, so the completion is kept
whole; a completion longer than `max_length - 1` keeps one prompt token and loses its end. Both
cuts are counted (`SequenceSpan.prompt_cut`, `completion_cut`), never silent.

The yield of a run is supervised tokens over generated tokens (every turn, reasoning included);
validate gates it (`quality.min_yield`) before anything is extracted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROW_LAYOUTS = ("turn", "conversation")
# The length columns of the generated table the plan reads (never the token lists).
LENGTH_COLUMNS = (
    "id", "num_prompt_tokens", "num_completion_tokens", "finish_reason",
    "turn_prompt_tokens", "turn_completion_tokens", "turn_finish_reasons",
)  # fmt: skip


@dataclass(frozen=True)
class SequenceSpan:
    """One training sequence of a row: positions [start, end) of prompt + completion."""

    turn: int | None  # the turn it holds (`turn` layout), None for the whole conversation
    prompt_tokens: int
    completion_tokens: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def prompt_cut(self) -> int:
        """Prompt tokens cut from the start."""
        return self.start

    @property
    def completion_cut(self) -> int:
        """Completion tokens cut from the end (only when the completion alone is too long)."""
        return self.prompt_tokens + self.completion_tokens - self.end

    def kept_completion(self) -> int:
        return self.end - self.prompt_tokens


def window(prompt_tokens: int, completion_tokens: int, max_length: int) -> tuple[int, int]:
    """[start, end) of the tokens kept: cut from the prompt's start, at least one prompt token
    kept (the first completion token is predicted from it)."""
    total = prompt_tokens + completion_tokens
    if total <= max_length:
        return 0, total
    start = min(total - max_length, max(prompt_tokens - 1, 0))
    return start, start + max_length


def check_layout(layout: str) -> str:
    if layout not in ROW_LAYOUTS:
        raise ValueError(f"extract.rows must be one of {ROW_LAYOUTS}, not {layout!r}")
    return layout


def has_turns(row: Mapping[str, Any]) -> bool:
    """Whether the row carries each turn's lengths (tables written before them do not)."""
    return row.get("turn_prompt_tokens") is not None


def row_sequences(row: Mapping[str, Any], layout: str, max_length: int) -> list[SequenceSpan]:
    """The training sequences of one generated row, from its length columns.

    `turn`: one per turn that ended without error and wrote a token (a conversation whose later
    turn failed keeps its earlier turns). `conversation`: the row's own sequence unless it
    failed or its last completion is empty. A row without turn columns is its own sequence in
    either layout."""
    if check_layout(layout) == "turn" and has_turns(row):
        out = []
        turns = zip(
            row["turn_prompt_tokens"],
            row["turn_completion_tokens"],
            row["turn_finish_reasons"],
            strict=True,
        )
        for k, (prompt, completion, reason) in enumerate(turns):
            if reason == "error" or not completion:
                continue
            out.append(SequenceSpan(k, prompt, completion, *window(prompt, completion, max_length)))
        return out
    if row["finish_reason"] == "error" or not row["num_completion_tokens"]:
        return []
    prompt, completion = int(row["num_prompt_tokens"]), int(row["num_completion_tokens"])
    return [SequenceSpan(None, prompt, completion, *window(prompt, completion, max_length))]


def generated_tokens(row: Mapping[str, Any]) -> int:
    """Tokens the target wrote for the row: every turn's completion, reasoning included. A row
    written before the turn columns records only its last completion and the earlier answers
    as the prompt shows them (`history_spans`): their sum, a lower bound (the earlier turns'
    reasoning went unrecorded)."""
    if has_turns(row):
        return sum(int(n) for n in row["turn_completion_tokens"])
    shown = sum(end - start for start, end in row.get("history_spans") or ())
    return int(row["num_completion_tokens"] or 0) + shown


def supervised_tokens(seq: SequenceSpan, history_spans: Sequence[Sequence[int]] = ()) -> int:
    """Supervised tokens the sequence keeps: its completion's and, for a conversation, the
    earlier answers' (`history_spans`) inside the kept window."""
    inside = sum(
        max(0, min(end, seq.end) - max(start, seq.start)) for start, end in history_spans or ()
    )
    return seq.kept_completion() + inside


def row_yield(row: Mapping[str, Any], layout: str, max_length: int) -> tuple[int, int]:
    """(generated, supervised) tokens of one row under the layout."""
    y = Yield()
    y.add_row(row, layout, max_length)
    return y.generated, y.supervised


@dataclass
class Yield:
    """What a set of rows gives training under a layout: the sums the reports print."""

    rows: int = 0
    sequences: int = 0
    generated: int = 0
    supervised: int = 0
    sequence_tokens: int = 0  # tokens through the target's forward (prompts included)
    cut_sequences: int = 0
    prompt_tokens_cut: int = 0
    completion_tokens_cut: int = 0

    def add_row(self, row: Mapping[str, Any], layout: str, max_length: int) -> list[SequenceSpan]:
        seqs = row_sequences(row, layout, max_length)
        # The earlier answers count where the row is one whole-conversation sequence: the
        # `conversation` layout, or a row written before the turn columns (either layout).
        whole = layout == "conversation" or not has_turns(row)
        spans = row.get("history_spans") if whole else ()
        self.rows += 1
        self.generated += generated_tokens(row)
        for seq in seqs:
            self.sequences += 1
            self.supervised += supervised_tokens(seq, spans or ())
            self.sequence_tokens += seq.num_tokens
            self.cut_sequences += int(seq.prompt_cut > 0 or seq.completion_cut > 0)
            self.prompt_tokens_cut += seq.prompt_cut
            self.completion_tokens_cut += seq.completion_cut
        return seqs

    @property
    def share(self) -> float:
        """Supervised / generated tokens (1.0 when nothing was generated: nothing was lost)."""
        return self.supervised / self.generated if self.generated else 1.0

    def summary(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "sequences": self.sequences,
            "generated_tokens": self.generated,
            "supervised_tokens": self.supervised,
            "yield": round(self.share, 6),
            "sequence_tokens": self.sequence_tokens,
            "cut_sequences": self.cut_sequences,
            "prompt_tokens_cut": self.prompt_tokens_cut,
            "completion_tokens_cut": self.completion_tokens_cut,
        }
