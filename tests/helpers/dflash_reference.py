"""z-lab's `DFlashDraftModel` (z-lab/dflash `dflash/model.py`), the reference the drafter is
checked against (tests/drafter/test_dflash_reference.py, and test_dflash2_reference.py, which
adds DFlash2 to it), and the Qwen3.6 twin case both use (models/tiny-qwen36).

The reference is that model's inference path rebuilt from transformers' own Qwen3 parts
(`Qwen3RMSNorm`, `Qwen3MLP`, `Qwen3RotaryEmbedding`, `rotate_half`, `eager_attention_forward`):
one block per call, keys `[k_proj(context) ; k_proj(block)]` normalised by `k_norm`, rotary
positions 0..a+B-1 with the queries taking the last B, and the config read by transformers'
`Qwen3Config` from the exported `config.json`. z-lab runs attention with flash-attention, which
gets `sliding_window=W` for a `sliding_attention` layer (transformers passes a non-causal
window of (W-1, W-1) keys, aligned bottom-right: keys are the cached context 0..a-1 then the
block, so a query at position p sees keys at positions p-(W-1)..p+(W-1)); flash-attention does
not run on a CPU, so the reference spells that window out as a mask for the eager attention.
SGLang and vLLM serve the same checkpoint with causal sliding layers (SGLang's
`AttentionType.DECODER`, vLLM's default for `sliding_attention`: the window (W-1, 0)); with
`sliding_causal` the reference does that too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

TWIN = {"path": str(Path(__file__).resolve().parents[2] / "models" / "tiny-qwen36")}
LAYER_IDS = [1, 2, 3, 4, 5]  # conf/model/tiny_qwen36.yaml
LAYOUT = ["sliding_attention", "sliding_attention", "full_attention"]
WINDOW = 16  # well inside the 96-token sequence, so the window cuts the context
BLOCK = 8
TOKENS = 96


def flash_window_mask(
    queries: int, keys: int, window: int | None, causal: bool
) -> torch.Tensor | None:
    """flash-attention's window (W-1, W-1), or (W-1, 0) when causal, queries aligned to the
    last keys, as an additive mask (transformers applies it only when there are more keys than
    W; a causal layer is causal whatever the window)."""
    q = torch.arange(queries)[:, None] + keys - queries
    k = torch.arange(keys)[None, :]
    if window is None or keys <= window:
        window = keys + 1  # no window
    allowed = (q - k).abs() <= window - 1
    if causal:
        allowed &= k <= q
    elif window > keys:
        return None
    return torch.zeros(queries, keys).masked_fill(~allowed, float("-inf"))[None, None]


def apply_rotary_pos_emb(q, k, cos, sin):  # z-lab's: the queries take the last positions
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = q.size(-2)
    q_embed = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    return q_embed, k * cos + rotate_half(k) * sin


class ReferenceAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = heads // kv_heads
        self.scaling = self.head_dim**-0.5
        width = {"q_proj": heads, "k_proj": kv_heads, "v_proj": kv_heads}
        for name, count in width.items():
            linear = nn.Linear(config.hidden_size, count * self.head_dim, config.attention_bias)
            setattr(self, name, linear)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        # z-lab: non-causal everywhere; SGLang and vLLM: sliding layers causal.
        self.causal = sliding and getattr(config, "is_causal", True)

    def forward(self, hidden, target_hidden, cos, sin):
        bsz, q_len = hidden.shape[:-1]
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden)], dim=1)
        k = self.k_norm(k.view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = v.view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        mask = flash_window_mask(q_len, ctx_len + q_len, self.sliding_window, self.causal)
        out, _ = eager_attention_forward(self, q, k, v, mask, scaling=self.scaling)
        return self.o_proj(out.reshape(bsz, q_len, -1))


class ReferenceLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = ReferenceAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, target_hidden, cos, sin):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), target_hidden, cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class ReferenceDraftModel(nn.Module):
    """z-lab's DFlashDraftModel: the same modules under the same names."""

    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ReferenceLayer(config, i) for i in range(config.num_hidden_layers)
        )
        layer_ids = config.dflash_config["target_layer_ids"]
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, position_ids, noise_embedding, target_hidden):
        hidden = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, target_hidden, cos, sin)
        return self.norm(hidden)


def reference_block(model, head, features, tokens, anchor: int, mask_id: int) -> torch.Tensor:
    """z-lab's draft of the block at `anchor`: context features[:anchor], one call."""
    block = torch.full((BLOCK,), mask_id)
    block[0] = tokens[anchor]
    noise = nn.functional.embedding(block, head.embed_weight)[None]
    positions = torch.arange(anchor + BLOCK)[None]
    return model(positions, noise, features[None, :anchor])[0]
