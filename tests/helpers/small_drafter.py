"""A small random DFlash drafter (2 layers, hidden 32, block 4) over a random target head: the
drafter model tests and the export tests build it alike."""

from __future__ import annotations

import torch

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead

VOCAB, HIDDEN, BLOCK = 50, 32, 4
SLIDING = ["sliding_attention", "full_attention"]  # a sliding layer, then a full one
WINDOW = 6  # inside the 40-token inputs, so the window cuts the context


def make_drafter(
    seed: int = 0, layers: int = 2, layer_types: list[str] | None = None, causal: bool = False
) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = DFlashConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        block_size=BLOCK,
        mask_token_id=VOCAB - 1,
        target_layer_ids=[0, 1, 2],
        num_target_layers=4,
        layer_types=layer_types,
        sliding_window=WINDOW if layer_types else None,
        sliding_causal=causal,
    )
    head = TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    return DFlashDrafter(config, head).eval()
