"""The target model: loading its tokenizer and weights, and rendering prompts to token ids.

Prompts are rendered once, by the target tokenizer's own chat template with the generation
prompt and the model profile's template kwargs (e.g. enable_thinking); every stage uses this.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def model_ref(model: dict[str, Any]) -> str:
    """Identity of the target as recorded with outputs: path plus revision when pinned."""
    rev = model.get("revision")
    return f"{model['path']}@{rev}" if rev else str(model["path"])


@lru_cache(maxsize=4)
def _load_tokenizer(path: str, revision: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, revision=revision)


def load_tokenizer(model: dict[str, Any]) -> Any:
    return _load_tokenizer(str(model["path"]), model.get("revision"))


def load_model(model: dict[str, Any], device: str = "cpu", dtype: str = "fp32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    lm = AutoModelForCausalLM.from_pretrained(
        str(model["path"]), revision=model.get("revision"), dtype=torch_dtype
    )
    return lm.to(device).eval()


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict) -> list[int]:
    """Token ids of the rendered prompt (chat template + generation prompt), no extra specials."""
    text = render_prompt(tokenizer, messages, template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def special_token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"token {token!r} is not in the target tokenizer's vocabulary")
    return int(tid)
