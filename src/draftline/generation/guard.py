"""Online fail-fast guard: the quality checks over a rolling window of finished samples.

The seed run generated 914K samples of which 87% were `OK.<|im_end|>` and nobody noticed for
days. The guard applies the same checks as `validate` (`draftline.quality.checks`) to the last
`quality.guard.window` finished samples, from `quality.guard.min_samples` on, and aborts the
shard with the likely cause as soon as one fails, within the first few hundred samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import pandas as pd

from draftline.quality import checks as quality_checks
from draftline.quality.check_parts import MODE_COLUMN

# Checks that say nothing about a window of journaled samples: ids are unique by construction.
SKIPPED = {"unique_ids", "row_count"}


class GuardAbort(RuntimeError):
    """The window of finished samples fails a quality check: stop before wasting the node."""


class Guard:
    def __init__(
        self,
        quality: Mapping[str, Any],
        *,
        thinking: bool,
        max_new_tokens: int,
        check_every: int | None = None,
        think_in_prompt: bool = False,
    ) -> None:
        """think_in_prompt: the chat template opens `<think>` in the generation prompt
        (Qwen3.5/3.6), so a reply starts inside the think block (`loss_mask.prompt_opens_think`).
        """
        guard = quality.get("guard") or {}
        self.quality = quality
        self.thinking = thinking
        self.think_in_prompt = think_in_prompt
        self.max_new_tokens = max_new_tokens
        self.min_samples = int(guard.get("min_samples", 64))
        self.window: deque[dict[str, Any]] = deque(maxlen=int(guard.get("window", 256)))
        self.check_every = check_every or max(1, min(16, self.min_samples // 4))
        self.seen = 0

    def observe(self, row: Mapping[str, Any]) -> None:
        """Add one finished sample (the scalar columns of the generated table); may abort."""
        keys = (*quality_checks.COLUMNS, "think_tokens", MODE_COLUMN)
        self.window.append({k: row[k] for k in keys if k in row})
        self.seen += 1
        if len(self.window) >= self.min_samples and self.seen % self.check_every == 0:
            self.check()

    def check(self) -> None:
        table = pd.DataFrame(list(self.window))
        results = quality_checks.run_checks(table, self.quality, thinking=self.thinking)
        failed = [r for r in results if not r.passed and r.name not in SKIPPED]
        if not failed:
            return
        lines = "\n".join(
            f"  {r.name}: {r.description}: observed "
            f"{quality_checks.format_observed(r.observed)}, required {r.bound}"
            for r in failed
        )
        raise GuardAbort(
            f"generation guard: the last {len(table)} finished samples (of {self.seen}) fail "
            f"quality checks:\n{lines}\nLikely cause: {self.likely_cause(table, failed)}\n"
            "Finished samples are kept in the journal; fix the cause and rerun the stage "
            "(a changed model or sampling starts the shard afresh)."
        )

    def likely_cause(self, table: pd.DataFrame, failed: list[Any]) -> str:
        names = {r.name for r in failed}
        answered = table[table["finish_reason"] != "error"]
        if "error_share" in names and len(answered) < len(table) / 2:
            return "most requests fail: the engine or server is broken (see its log under logs/)"
        # A mix whose non-thinking rows fail their own checks while the thinking rows pass
        # theirs (checks over all rows, such as the mode share, may fail with them).
        per_mode = {n for n in names if n.startswith(("supervised_tokens_min", "completion_tok"))}
        if any(n.endswith("_no_thinking") for n in names) and all(
            n.endswith("_no_thinking") for n in per_mode | (names & {"think_block_share"})
        ):
            return (
                "the samples generated with thinking off (data.thinking_share) fail their own "
                "checks: this target answers briefly or not at all without thinking; raise "
                "data.thinking_share, or set the quality.no_thinking_* bounds for its replies"
            )
        truncated = float((answered["finish_reason"] == "length").mean()) if len(answered) else 0
        unclosed = (
            float(((~answered["has_think_block"]) & (answered["think_tokens"] > 0)).mean())
            if len(answered)
            else 0.0
        )
        full = float((answered["finish_reason"] == "context").mean()) if len(answered) else 0
        if "truncated_share" in names and full >= truncated:
            return (
                f"{full:.0%} of turns were cut by a full context: conversations outgrow "
                "model.serving.context_length (each turn's prompt holds every earlier answer); "
                "raise it toward the model's maximum, or regenerate only the last turn "
                "(data.regenerate_turns=last)"
            )
        if "truncated_share" in names or truncated > 0.5:
            return (
                f"{truncated:.0%} of responses hit max_new_tokens={self.max_new_tokens}"
                + (f" ({unclosed:.0%} inside an unclosed <think>)" if unclosed else "")
                + ": max_new_tokens is too small for this model (raise generate.max_new_tokens"
                " / model.max_new_tokens), or the model loops because the chat template is wrong"
            )
        empty = names & {"supervised_tokens_min", "supervised_tokens_mode_share", "answer_share"}
        if self.thinking and self.think_in_prompt and "think_block_share" in names and empty:
            return (
                "responses are (near-)empty and end the turn without closing the <think> block "
                "the prompt opened, like `OK.<|im_end|>`: the model does not think in this "
                "template (the chat template or its kwargs are not the target's own, or the "
                "prompt was rendered without the generation prompt)"
            )
        if self.thinking and "think_block_share" in names:
            return (
                "thinking is on but responses carry no <think>...</think> block: thinking is "
                "disabled somewhere (model.chat_template_kwargs.enable_thinking does not reach "
                "the template) or the chat template is not the model's own (wrong template)"
            )
        if empty or any(n.startswith("completion_tokens_q") for n in names):
            return (
                "responses are (near-)empty, like `OK.<|im_end|>`: the chat template is wrong "
                "(not the target's own, or the prompt is rendered without the generation "
                "prompt)" + ("" if self.thinking else ", or thinking is disabled")
            )
        if "unique_completions" in names:
            return "many identical completions: the prompts collapse to one rendering (template)"
        return "see the failed checks above"
