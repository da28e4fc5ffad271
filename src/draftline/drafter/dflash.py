"""The DFlash drafter (block-diffusion drafting, arXiv 2602.06036), in one file.

A small stack of Qwen3-style decoder layers with the target's hidden size. It has no embedding
and no lm_head of its own: it uses the target's, frozen (`TargetHead`). Its context is the
hidden states of K target layers, concatenated per token, fused by `fc` (K*H -> H) and
`hidden_norm`, and fed to every layer as extra keys and values only. Queries come from the
block: `[anchor token, MASK x (B-1)]` at positions a..a+B-1. Each block attends bidirectionally
to its own B tokens and to context positions strictly before its anchor, never to other blocks;
a `sliding_attention` layer only to keys within `sliding_window` - 1 positions of the query.
Training runs many blocks per sequence in one pass (`DFlashDrafter.forward` takes N anchors);
inference is the same call with one block whose anchor is the context length.
DFlash2 (`dflash2` set) adds block convolutions and a candidate selector (`drafter.dflash2`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from draftline.drafter import dflash2
from draftline.drafter.dflash2 import DFlash2Layout, wrap
from draftline.drafter.qwen3_parts import RMSNorm, apply_rope, rope_cos_sin

# Queries per attention chunk in the block-wise attention: bounds the score matrix while
# keeping the SDPA calls large enough to be efficient.
QUERIES_PER_CHUNK = 512
FULL, SLIDING = "full_attention", "sliding_attention"
LAYERS = {FULL, SLIDING}
# DFlashConfig fields that config.json holds under the same name.
JSON_FIELDS = (
    "num_target_layers", "num_hidden_layers", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "attention_bias", "rms_norm_eps",
    "rope_theta", "max_position_embeddings", "vocab_size",
)  # fmt: skip


@dataclass
class DFlashConfig:
    """Architecture of the drafter; shapes other than the layer count come from the target."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    # Per layer "full_attention" (None: all) or "sliding_attention" over `sliding_window` keys;
    # sliding_causal: a sliding layer's block attends causally to itself (SGLang, vLLM,
    # SpecForge) rather than bidirectionally (z-lab/dflash model.py).
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    sliding_causal: bool = False
    dflash2: DFlash2Layout | None = None  # None: the DFlash family
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        kinds = self.layer_types = list(self.layer_types or [FULL] * self.num_hidden_layers)
        if len(kinds) != self.num_hidden_layers or set(kinds) - LAYERS:
            raise ValueError(f"layer_types {kinds}: {self.num_hidden_layers} of {sorted(LAYERS)}")
        if SLIDING in kinds and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        self.sliding_causal = bool(self.sliding_causal and SLIDING in kinds)
        if self.dflash2 is not None:
            self.dflash2.check(self.hidden_size, self.block_size, self.vocab_size)

    @property
    def family(self) -> str:
        return "dflash" if self.dflash2 is None else "dflash2"

    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any],
        *,
        num_hidden_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int],
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        sliding_causal: bool = False,
        dflash2: DFlash2Layout | None = None,
    ) -> DFlashConfig:
        """Drafter config from the target's (text) `config.json` dict and the drafter's choices.

        The attention and MLP shape default to the target's; a target whose public drafters use
        another shape (Qwen3.6-27B: 32/8/128, not its gated attention's 24/4/256) or another
        layout (4 sliding + 1 full attention layers) names it (model.dflash).
        """
        hidden = int(target_config["hidden_size"])
        heads = int(num_attention_heads or target_config["num_attention_heads"])
        if num_attention_heads is None:
            kv_heads = int(num_key_value_heads or target_config.get("num_key_value_heads", heads))
            dim = int(head_dim or target_config.get("head_dim") or hidden // heads)
        else:  # a chosen head count: nothing of the target's attention carries over
            kv_heads = int(num_key_value_heads or heads)
            dim = int(head_dim or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"drafter heads {heads} are not a multiple of kv heads {kv_heads}")
        num_target_layers = int(target_config["num_hidden_layers"])
        if bad := [i for i in target_layer_ids if not 0 <= i < num_target_layers]:
            raise ValueError(f"target_layer_ids {bad}: the target has {num_target_layers} layers")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=dim,
            intermediate_size=int(intermediate_size or target_config["intermediate_size"]),
            vocab_size=int(target_config["vocab_size"]),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(target_config),
            max_position_embeddings=int(target_config.get("max_position_embeddings", 40960)),
            attention_bias=bool(target_config.get("attention_bias", False)),
            layer_types=layer_types,
            sliding_window=sliding_window,
            sliding_causal=sliding_causal,
            dflash2=dflash2,
        )

    def to_json_dict(self) -> dict[str, Any]:
        """`config.json` in the DFlash(2) format that SGLang, vLLM and the references load."""
        sliding = SLIDING in (self.layer_types or [])
        return {
            "architectures": [dflash2.ARCHITECTURES[self.family]],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                **(self.dflash2.to_json() if self.dflash2 else {}),
            },
            **{name: getattr(self, name) for name in JSON_FIELDS},
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "rope_scaling": None,
            "layer_types": list(self.layer_types or []),
            "max_window_layers": self.num_hidden_layers,
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            **({"is_causal": False} if sliding and not self.sliding_causal else {}),
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            **self.extra,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        dflash = data.get("dflash_config") or {}
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        flat = {k: v for k, v in data.items() if k in known}
        flat["mask_token_id"] = int(dflash.get("mask_token_id", data.get("mask_token_id")))
        flat["target_layer_ids"] = list(
            dflash.get("target_layer_ids", data.get("target_layer_ids"))
        )
        flat["rope_theta"] = _rope_theta(data)
        if not data.get("use_sliding_window", True):  # transformers' Qwen3: no window at all
            flat["layer_types"], flat["sliding_window"] = None, None
        flat["sliding_causal"] = bool(data.get("is_causal", True))  # vLLM's reading
        flat["dflash2"] = DFlash2Layout.from_json(dflash)
        return cls(**flat)


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers 5 writes rope_parameters; older configs (and the DFlash format) rope_theta.
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0)))


@dataclass
class TargetHead:
    """The target's frozen token embedding and lm_head, used by the drafter, never owned by it:
    plain tensors, not parameters (not trained, not in the state dict, not synchronised)."""

    embed_weight: torch.Tensor  # [vocab, H]
    lm_head_weight: torch.Tensor  # [vocab, H]

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetHead:
        """From a loaded transformers causal LM (tied embeddings are shared, not copied)."""
        embed = model.get_input_embeddings().weight.detach()
        head = model.get_output_embeddings().weight.detach()
        return cls(embed_weight=embed, lm_head_weight=head)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TargetHead:
        return TargetHead(
            self.embed_weight.to(device=device, dtype=dtype),
            self.lm_head_weight.to(device=device, dtype=dtype),
        )


def context_span(
    chunk_anchors: torch.Tensor, context_len: int, sliding_window: int | None = None
) -> tuple[int, int]:
    """The context keys [start, end) a chunk of blocks needs: up to its largest anchor, from
    the first its earliest query sees (0 for full attention). Fake tensors (memory planning,
    `draftline.drafter.memory`) carry no values: the chunk then takes the whole context, the
    worst case, so a planned peak is never below the real one."""
    if is_fake(chunk_anchors) or not chunk_anchors.numel():
        return 0, context_len
    end = int(chunk_anchors.max().item())
    if sliding_window is None:
        return 0, end
    return max(0, min(end, int(chunk_anchors.min().item()) - sliding_window + 1)), end


def block_mask(
    anchors: torch.Tensor, context: torch.Tensor, size: int, window: int | None, causal: bool
) -> torch.Tensor:
    """[b, 1, g*S, C + g*S]: which keys each query of the blocks of S = `size` tokens at
    `anchors` [b, g] sees, of the context positions `context` [C] then each block's keys. Full
    attention: the context strictly before the anchor (`<`, never `<=`: the anchor's own state
    is not there at inference) and the whole own block, nothing of other blocks. Sliding
    (`window` W; z-lab/dflash: flash attention's non-causal window (W-1, W-1)): of those, keys
    within W-1 of the query position; `causal` (SGLang's and vLLM's sliding layers): and of
    its own block, no key after the query."""
    b, g = anchors.shape
    offset = torch.arange(size, device=anchors.device)
    query_anchor = anchors.repeat_interleave(size, dim=1)[..., None]  # [b, g*S, 1]
    sees_context = context < query_anchor
    block_of = torch.arange(g * size, device=anchors.device) // size
    sees_block = block_of[:, None] == block_of[None, :]
    if window is not None:
        query_position = query_anchor + offset.repeat(g)[:, None]
        sees_context = sees_context & (context > query_position - window)
        near = (offset[:, None] - offset[None, :]).abs() < window
        sees_block = sees_block & near.repeat(g, g)
        if causal:
            sees_block = sees_block & (offset[:, None] >= offset[None, :]).repeat(g, g)
    return torch.cat([sees_context, sees_block.expand(b, -1, -1)], dim=-1)[:, None]


def block_prefix_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    anchors: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    queries_per_chunk: int | None = None,
    expand_kv_heads: bool | None = None,
    dense: bool = False,
    causal: bool = False,
) -> torch.Tensor:
    """Each block attends to context keys before its anchor and to its own block's keys.

    q: [b, N, S, h, d]; k_block, v_block: [b, N, S, kvh, d]; k_ctx, v_ctx: [b, T, kvh, d];
    anchors: [b, N], sorted per row; sliding_window: None (full attention) or W, causal or not
    (`block_mask`).
    Returns [b, N, S, h, d]. Blocks go in chunks; a chunk's keys are the context its queries
    can see (`context_span`) plus its own blocks' keys, so the cost grows with anchors x
    context, not (anchors x S)^2. dense: one SDPA over [whole context ; all blocks] with a dense
    mask, the SpecForge-style formulation, the reference of tests and benchmarks.

    expand_kv_heads (default: on CUDA): repeat each key/value head for its query heads: SDPA's
    flash kernel takes no mask and its memory-efficient one no grouped-query heads, so masked
    grouped-query attention would run the math kernel (x2 of a production step's memory).
    """
    b, n, s, h, d = q.shape
    kvh, t = k_block.shape[3], k_ctx.shape[1]
    if expand_kv_heads is None:
        expand_kv_heads = q.device.type == "cuda"
    repeats = h // kvh if expand_kv_heads and h != kvh else 1
    blocks_per_chunk = n if dense else max(1, (queries_per_chunk or QUERIES_PER_CHUNK) // s)
    outputs = []
    for start in range(0, n, blocks_per_chunk):
        end = min(n, start + blocks_per_chunk)
        g = end - start
        chunk_anchors = anchors[:, start:end]
        first, last = (0, t) if dense else context_span(chunk_anchors, t, sliding_window)
        queries = q[:, start:end].reshape(b, g * s, h, d).transpose(1, 2)
        own = (b, g * s, kvh, d)
        keys = torch.cat([k_ctx[:, first:last], k_block[:, start:end].reshape(own)], 1)
        values = torch.cat([v_ctx[:, first:last], v_block[:, start:end].reshape(own)], 1)
        positions = torch.arange(first, last, device=q.device)
        mask = block_mask(chunk_anchors, positions, s, sliding_window, causal)
        if repeats > 1:
            keys = keys.repeat_interleave(repeats, dim=2)
            values = values.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(
            queries,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=keys.shape[2] != h,
        )
        outputs.append(out.transpose(1, 2).reshape(b, g, s, h, d))
    return torch.cat(outputs, dim=1)


ATTENTION_IMPLEMENTATIONS = {
    "blockwise": block_prefix_attention,
    "dense": partial(block_prefix_attention, dense=True),
}


@dataclass(frozen=True)
class BlockInputs:
    """What every layer's attention takes besides the block states."""

    context: torch.Tensor  # [b, T, H] fused context (keys/values only)
    rope_block: tuple[torch.Tensor, torch.Tensor]  # cos/sin at the block positions
    rope_context: tuple[torch.Tensor, torch.Tensor]  # cos/sin at the context positions
    anchors: torch.Tensor  # [b, N]
    attend: Callable[..., torch.Tensor] = block_prefix_attention


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [fused context ; block] and queries the block."""

    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        sliding = (config.layer_types or [])[layer] == SLIDING
        self.sliding_window = config.sliding_window if sliding else None
        self.causal = sliding and config.sliding_causal
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, blocks: BlockInputs) -> torch.Tensor:
        """x: [b, N, S, H] block states; keys/values also from `blocks.context`."""
        (b, n, s, _), context = x.shape, blocks.context
        t = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, n, s, self.num_heads, self.head_dim))
        k_block = self.k_norm(self.k_proj(x).view(b, n, s, self.num_kv_heads, self.head_dim))
        v_block = self.v_proj(x).view(b, n, s, self.num_kv_heads, self.head_dim)
        k_ctx = self.k_norm(self.k_proj(context).view(b, t, self.num_kv_heads, self.head_dim))
        v_ctx = self.v_proj(context).view(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, *blocks.rope_block)
        k_block = apply_rope(k_block, *blocks.rope_block)
        k_ctx = apply_rope(k_ctx, *blocks.rope_context)
        out = blocks.attend(
            q, k_block, v_block, k_ctx, v_ctx, blocks.anchors, self.scaling, self.sliding_window,
            causal=self.causal,
        )  # fmt: skip
        return self.o_proj(out.reshape(b, n, s, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    """Qwen3 SwiGLU MLP."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; the fused context enters attention as keys/values."""

    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None  # DFlash2's convolutions (dflash2.attach)

    def forward(self, x: torch.Tensor, blocks: BlockInputs) -> torch.Tensor:
        x = x + wrap(self.attention_conv, self.self_attn, self.input_layernorm(x), blocks)
        return x + wrap(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter: `fc` + `hidden_norm` over the K target layers, decoder layers, `norm`.

    Parameter names are those of the DFlash checkpoint format (see `draftline.drafter.export`).
    """

    def __init__(self, config: DFlashConfig, target: TargetHead) -> None:
        super().__init__()
        self.config, self.target = config, target
        k = len(config.target_layer_ids)
        self.fc = nn.Linear(k * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.candidate_selector = dflash2.attach(self.layers, config)  # None for DFlash
        self.attention_implementation = "blockwise"  # or "dense": same math, to check with
        # Key/value heads repeated for the query heads (None: on CUDA; `block_prefix_attention`);
        # memory planning sets it to measure a GPU's step on CPU.
        self.expand_kv_heads: bool | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Initialise like transformers' Qwen3: normal(0, 0.02) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        dflash2.reset_parameters(self)  # after the linears: DFlash2's parts start as no-ops

    def block_input_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[..., S] block ids `[anchor token, MASK x (S-1)]` for anchor tokens [...]."""
        shape = (*anchor_ids.shape, self.config.block_size)
        ids = torch.full(shape, self.config.mask_token_id, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return ids

    def forward(
        self, context_features: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Final hidden states of every block. context_features: [b, T, K*H], the K target
        layers' states for positions 0..T-1 (`target_layer_ids` order); position t is token t.
        block_ids: [b, N, S] long, `[token at anchor, MASK, ...]` (see `block_input_ids`).
        anchors: [b, N] long, sorted per row; block j sits at positions anchors[j] + 0..S-1 and
            sees context positions < anchors[j]. Padding blocks: any anchor, ignored by the loss.
        Returns [b, N, S, H]; `logits(...)` maps them to the vocabulary. Output k of a block
        predicts the token at anchor + k (k = 1..S-1; output 0 is the given anchor token).
        """
        t, s = context_features.shape[1], block_ids.shape[-1]
        context = self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))
        x = F.embedding(block_ids, self.target.embed_weight).to(context.dtype)
        c = self.config
        rope = partial(rope_cos_sin, head_dim=c.head_dim, theta=c.rope_theta, dtype=context.dtype)
        rope_block = rope(anchors[..., None] + torch.arange(s, device=anchors.device))
        cos, sin = rope(torch.arange(t, device=context.device))
        attend = ATTENTION_IMPLEMENTATIONS[self.attention_implementation]
        attend = partial(attend, expand_kv_heads=self.expand_kv_heads)
        blocks = BlockInputs(context, rope_block, (cos[None], sin[None]), anchors, attend)
        for layer in self.layers:
            x = layer(x, blocks)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen lm_head over hidden states, in the head's dtype (never copied)."""
        return F.linear(hidden.to(self.target.lm_head_weight.dtype), self.target.lm_head_weight)

    @torch.no_grad()
    def draft_block(self, context_features: torch.Tensor, anchor_id: int) -> torch.Tensor:
        """Greedy draft [S-1] of one block after a context of T positions; the anchor token
        sits at position T (the first token the target has not yet encoded)."""
        t = context_features.shape[-2]
        feats = context_features.reshape(1, t, -1)
        anchor = torch.tensor([[anchor_id]], device=feats.device)
        block = self.block_input_ids(anchor)
        hidden = self.forward(feats, block, torch.tensor([[t]], device=feats.device))
        return dflash2.greedy_drafts(self, hidden[0, :, 1:], anchor[0])[0]
