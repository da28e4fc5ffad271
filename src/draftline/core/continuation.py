"""The target's continuations of token-id prompts: left-padded batches through `generate`.

One implementation for every caller that runs the target on prompts (the local engine, evaluate,
the embedded builders' format check): prompts end where generation starts, so they are padded on
the left, and the new tokens are everything after the padded width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftline.core.loss_mask import cut_at_end_of_turn


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """`prompts` as one left-padded batch of ids and its attention mask."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def continue_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    sampling: dict[str, Any] | None = None,
) -> list[list[int]]:
    """New tokens of each prompt (not cut: `generate` pads finished rows). Greedy unless
    `sampling` gives temperature/top_p/top_k (seed torch's generator before calling)."""
    import torch

    ids, mask = pad_left(prompts, pad_id)
    device = next(model.parameters()).device
    options: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": stop_ids,
        "pad_token_id": pad_id,
    }
    if sampling:
        options.update(do_sample=True, **sampling)
    else:  # None overrides a sampling generation_config.json (the real target ships one)
        options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **options)
    return out[:, ids.shape[1] :].tolist()


def greedy_continuations(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    end_of_turn_id: int,
    batch_size: int = 16,
    pad_id: int | None = None,
) -> list[list[int]]:
    """Each prompt's greedy continuation, cut after the first end-of-turn token, in prompt order.

    Prompts are batched by length so padding stays small. `pad_id` defaults to the model's pad
    token, else the end-of-turn token (never attended to: the mask hides it).
    """
    if pad_id is None:
        pad_id = int(getattr(model.config, "pad_token_id", None) or end_of_turn_id)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, list[int]] = {}
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        new = continue_batch(
            model, [prompts[i] for i in batch], max_new_tokens, [end_of_turn_id], pad_id
        )
        for i, tokens in zip(batch, new, strict=True):
            out[i] = cut_at_end_of_turn(tokens, end_of_turn_id)[0]
    return [out[i] for i in range(len(prompts))]
