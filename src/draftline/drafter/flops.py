"""FLOPs per drafter output token of a training step, per family (the plan prints them beside
the memory figures): what a block token costs in the drafter, its frozen lm_head and, for
DFlash2, its convolutions and selector. Analytic (2 FLOPs per multiply-add of the matmuls;
elementwise work and the per-sequence context projections, `fc` and the context keys/values,
which do not grow with the anchors, are left out).

A training step runs a trained matmul 3 times (forward, and the gradients of its input and of
its weight), the frozen lm_head twice (forward and the gradient of the hidden states) and the
selector's top-k logits once (no gradient goes through the choice of candidates).
"""

from __future__ import annotations

from typing import Any

from draftline.drafter.dflash import SLIDING, DFlashConfig


def flops_per_token(config: DFlashConfig, context_keys: int) -> dict[str, Any]:
    """{"family", "forward", "train"}: FLOPs per block token, each query seeing
    `context_keys` context keys on average (fewer on a sliding layer: its window)."""
    h, heads, kv, d = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    trained = 0
    for kind in config.layer_types or []:
        keys = (
            min(context_keys, config.sliding_window or context_keys)
            if kind == SLIDING
            else context_keys
        )
        keys += config.block_size
        trained += 2 * h * d * (2 * heads + 2 * kv)  # q, k, v, o projections
        trained += 2 * 3 * h * config.intermediate_size  # SwiGLU MLP
        trained += 2 * 2 * heads * d * keys  # scores and weighted values
    frozen = 2 * h * config.vocab_size  # the target's lm_head (CE)
    once = 0
    if config.dflash2 is not None:
        layout = config.dflash2
        groups = h // layout.conv_group_size
        per_conv = (
            2 * h * 2 * layout.conv_kernel_size * groups + 2 * 2 * layout.conv_kernel_size * h
        )
        trained += 2 * per_conv * config.num_hidden_layers  # around attention and MLP
        k, r = layout.selector_top_k, layout.selector_rank
        trained += (
            2 * k * h + 2 * h * r + 2 * k * r
        )  # unary of the candidates, projection, transitions
        once += 2 * h * config.vocab_size  # the top-k's full logits
    return {
        "family": config.family,
        "forward": trained + frozen + once,
        "train": 3 * trained + 2 * frozen + once,
    }
