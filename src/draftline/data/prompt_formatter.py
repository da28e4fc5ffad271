"""Qwen3-style prompts rendered without jinja, for curation's token counts (jinja is ~10x
slower). Used only for a chat template checked line by line (`CHECKED_TEMPLATES`) that renders
every probe exactly as the formatter does, and only for conversations without tools; everything
else goes through the chat template.
"""

from __future__ import annotations

import hashlib
from typing import Any

from draftline.data.conversations import Message

# sha256 of the chat templates `Qwen3PromptFormatter` has been checked against, line by line.
# The formatter is used for no other template: a probe can show a difference, never equality.
CHECKED_TEMPLATES = {
    # models/tiny-target (draftline.embedded.tiny_target.CHAT_TEMPLATE): for a conversation that
    # ends in a user turn, `last_query_index` is that turn, so every assistant turn takes the `else`
    # branch (answer only, think block dropped) and the generation prompt follows.
    "b90ba154c4716c24cb5e15aeb3c526407783d16b547ce22ecc0fa99c018ad026": "tiny-target",
}


class Qwen3PromptFormatter:
    """The Qwen3-style chat template for prompts, in plain Python (jinja is ~10x slower).

    Only for normalised conversations without tool turns or calls (optional system first, then
    user and assistant alternating, ending in a user turn) with the generation prompt added:
    there every assistant turn comes before the last user turn, so the template shows only its
    answer (the text after the last `</think>`, leading newlines dropped) and never a think
    block.
    """

    def __init__(self, enable_thinking: Any = None) -> None:
        self.generation = "<|im_start|>assistant\n"
        if enable_thinking is False:  # jinja: `enable_thinking is false`
            self.generation += "<think>\n\n</think>\n\n"

    def render(self, messages: list[Message]) -> str:
        parts = []
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "assistant" and "</think>" in content:
                content = content.split("</think>")[-1].lstrip("\n")
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        parts.append(self.generation)
        return "".join(parts)

    @classmethod
    def verified(
        cls, tokenizer: Any, render_jinja: Any, template_kwargs: dict[str, Any]
    ) -> Qwen3PromptFormatter | None:
        """A formatter when the target's template is a checked one and renders every probe so."""
        if set(template_kwargs) - {"enable_thinking"}:
            return None
        try:
            template = tokenizer.get_chat_template()
        except Exception:  # noqa: BLE001 - no template, or several and none chosen
            return None
        if not isinstance(template, str):
            return None
        if hashlib.sha256(template.encode()).hexdigest() not in CHECKED_TEMPLATES:
            return None
        formatter = cls(template_kwargs.get("enable_thinking"))
        try:
            expected = render_jinja(FORMAT_PROBES)
        except Exception:  # noqa: BLE001 - a template that fails on a probe is not this one
            return None
        if [formatter.render(c) for c in FORMAT_PROBES] != expected:
            return None
        return formatter


FORMAT_PROBES: list[list[Message]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Add 2 and 2."},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\nFour."},
        {"role": "user", "content": "And 3?"},
    ],
    [
        {"role": "system", "content": "Système: réponds en français. 答えて"},
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "plain answer"},
        {"role": "user", "content": "<think> in a user turn </think> stays"},
        {"role": "assistant", "content": "x</think>\n\ny</think>\nz"},
        {"role": "user", "content": "<|im_start|>user\nodd"},
        {"role": "assistant", "content": "<think>never closed"},
        {"role": "user", "content": "<tool_response>\nlast\n</tool_response>"},
    ],
]
