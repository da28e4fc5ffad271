"""Exact prompt-token counts for curation's budget, fast.

Token counts are those of `draftline.core.target.prompt_ids` (the chat template with the
generation prompt, then the tokenizer). Two fast paths give the same numbers sooner, each used
only where it provably equals the slow one: `prompt_formatter.Qwen3PromptFormatter` renders
Qwen3-style prompts without jinja (for templates checked line by line), and
`byte_level_counter.ByteLevelTokenCounter` counts byte-level BPE tokens per pre-tokenized piece
with a cache instead of encoding whole texts. Everything else goes through the chat template and
the tokenizer. A prompt far over the budget is counted from a prefix only. A conversation the
chat template refuses (it raises on it, e.g. a `tool` turn the template has no branch for)
becomes a `template_rejects` rejection, not an error.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

from draftline.data.byte_level_counter import ByteLevelTokenCounter
from draftline.data.conversations import Message, uses_tools
from draftline.data.input_files import Rejection
from draftline.data.prompt_formatter import Qwen3PromptFormatter


class PromptTokenCounter:
    """Token counts of prompts rendered with the target's chat template (+ generation prompt).

    Counts equal `len(draftline.core.target.prompt_ids(...))`. Prompts far over the budget are only
    partly tokenized: the rendered text is cut at a space between two letters (a pre-tokenizer
    boundary, so the prefix's tokens are a prefix of the full text's tokens); when that prefix
    alone is over budget, its count is a lower bound and the row is rejected without tokenizing
    the rest. Counts at or under the budget are always exact.

    `fast=False` turns both fast paths off (rendering with jinja, counting with `encode_batch`);
    with `fast=True` each is used only when `verified` accepts it for this tokenizer, and the
    formatter only for conversations without tool turns or calls.
    """

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any] | None,
        max_tokens: int,
        prefix_chars_per_token: int = 8,
        fast: bool = True,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise SystemExit(
                "curate needs a fast (Rust) tokenizer for the target: the model folder must hold "
                "tokenizer.json"
            )
        self.tokenizer = tokenizer
        # The tokenizer pickled, in a copy sent to a worker that renders with the formatter.
        self._tokenizer_pickle: bytes | None = None
        self.template_kwargs = dict(template_kwargs or {})
        self.max_tokens = max_tokens
        backend = tokenizer.backend_tokenizer
        if backend.truncation is not None or backend.padding is not None:
            # transformers encodes prompts without truncation or padding; so must we.
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        self.backend = backend
        added = [t["content"] for t in json.loads(backend.to_str()).get("added_tokens") or []]
        # Cutting is safe only where no added token spans a space (it would be cut in two).
        cut_safe = not any(any(c.isspace() for c in token) for token in added)
        self.prefix_chars = max_tokens * prefix_chars_per_token if cut_safe else None
        self.formatter: Qwen3PromptFormatter | None = None
        self.fast_counter: ByteLevelTokenCounter | None = None
        if fast:
            self.formatter = Qwen3PromptFormatter.verified(
                tokenizer, self._apply_template, self.template_kwargs
            )
            if not getattr(tokenizer, "split_special_tokens", False):
                self.fast_counter = ByteLevelTokenCounter.verified(backend)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.formatter is not None:
            # Only jinja rendering needs the tokenizer (and transformers): a worker loads it on
            # the first conversation the formatter leaves to jinja, most never do.
            state["tokenizer"] = None
            state["_tokenizer_pickle"] = self._tokenizer_pickle or pickle.dumps(self.tokenizer)
        return state

    def _template_tokenizer(self) -> Any:
        if self.tokenizer is None:
            assert self._tokenizer_pickle is not None
            self.tokenizer = pickle.loads(self._tokenizer_pickle)
        return self.tokenizer

    def _apply_template(self, conversations: list[list[Message]]) -> list[str]:
        """Prompts rendered by the chat template; raises what the template raises."""
        if not conversations:
            return []
        texts = self._template_tokenizer().apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return list(texts)

    def _render_jinja(self, conversations: list[list[Message]]) -> list[str | Rejection]:
        try:
            return list(self._apply_template(conversations))
        except Exception:  # noqa: BLE001 - one conversation fails the batch; find which below
            return [self._render_one(c) for c in conversations]

    def _render_one(self, messages: list[Message]) -> str | Rejection:
        try:
            return self._apply_template([messages])[0]
        except Exception as err:  # noqa: BLE001 - what the template raises is its verdict
            return Rejection("template_rejects", str(err) or type(err).__name__)

    def render(self, conversations: list[list[Message]]) -> list[str | Rejection]:
        """Prompts as the chat template renders them (each conversation ends in a user or tool
        turn), or `template_rejects` for a conversation the template raises on."""
        formatter = self.formatter
        if formatter is None:
            return self._render_jinja(conversations)
        # The formatter knows system/user/assistant text only: tools go through the template.
        tools = [uses_tools(c) for c in conversations]
        texts: list[str | Rejection] = [
            "" if t else formatter.render(c) for c, t in zip(conversations, tools, strict=True)
        ]
        slow = [i for i, t in enumerate(tools) if t]
        for i, text in zip(slow, self._render_jinja([conversations[i] for i in slow]), strict=True):
            texts[i] = text
        return texts

    def count(self, conversations: list[list[Message]]) -> list[tuple[int, bool] | Rejection]:
        """(tokens, exact) per conversation, or the template's rejection; exact is False only
        for a lower bound over budget."""
        rendered = self.render(conversations)
        counts = iter(self._count_texts([t for t in rendered if isinstance(t, str)]))
        return [next(counts) if isinstance(t, str) else t for t in rendered]

    def _count_texts(self, texts: list[str]) -> list[tuple[int, bool]]:
        pieces = [_cut_at_word_boundary(t, self.prefix_chars) for t in texts]
        counts = self.lengths(pieces)
        result = [(n, True) for n in counts]
        recount = []
        for i, (text, piece, n) in enumerate(zip(texts, pieces, counts, strict=True)):
            if len(piece) < len(text):
                if n > self.max_tokens:
                    result[i] = (n, False)
                else:
                    recount.append(i)
        if recount:
            for i, n in zip(recount, self.lengths([texts[i] for i in recount]), strict=True):
                result[i] = (n, True)
        return result

    def lengths(self, texts: list[str]) -> list[int]:
        """Exact token counts of texts (no special tokens added)."""
        if self.fast_counter is None:
            return self._encode_lengths(texts)
        counts = [self.fast_counter.count(t) for t in texts]
        slow = [i for i, n in enumerate(counts) if n is None]
        if slow:
            for i, n in zip(slow, self._encode_lengths([texts[i] for i in slow]), strict=True):
                counts[i] = n
        return counts  # type: ignore[return-value]

    def _encode_lengths(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [len(e) for e in encode(texts, add_special_tokens=False)]


def _cut_at_word_boundary(text: str, limit: int | None) -> str:
    """`text` cut before a space that sits between two letters, at or before `limit` chars.

    Returns `text` itself when it is short enough, `limit` is None or no such space is near the
    limit.
    """
    if limit is None or len(text) <= limit:
        return text
    pos = limit
    floor = limit // 2
    while pos > floor:
        pos = text.rfind(" ", floor, pos)
        if pos <= 0:
            break
        if text[pos - 1].isalpha() and text[pos + 1].isalpha():
            return text[:pos]
    return text
