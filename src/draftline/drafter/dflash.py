"""The DFlash drafter (block-diffusion drafting, arXiv 2602.06036), in one file.

A small stack of Qwen3-style decoder layers with the target's hidden size. It has no embedding
and no lm_head of its own: it uses the target's, frozen (`TargetHead`). Its context is the
hidden states of K target layers, concatenated per token, fused by `fc` (K*H -> H) and
`hidden_norm`, and fed to every layer as extra keys and values only. Queries come from the
block: `[anchor token, MASK x (B-1)]` at positions a..a+B-1. Each block attends bidirectionally
to its own B tokens and to context positions strictly before its anchor, never to other blocks.

Training runs many blocks per sequence in one pass (`DFlashDrafter.forward` takes N anchors);
inference is the same call with one block whose anchor is the context length.
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

# Queries per attention chunk in the block-wise attention: bounds the score matrix while
# keeping the SDPA calls large enough to be efficient.
QUERIES_PER_CHUNK = 512


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
    extra: dict[str, Any] = field(default_factory=dict)

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
    ) -> DFlashConfig:
        """Drafter config from the target's (text) `config.json` dict and the drafter's choices.

        The attention and MLP shape default to the target's; a target whose public drafters use
        another shape (Qwen3.6-27B: 32/8/128, not its gated attention's 24/4/256) names it.
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
        bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's {num_target_layers} layers: "
                "fix model.target_layer_ids"
            )
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
        )

    def to_json_dict(self) -> dict[str, Any]:
        """`config.json` in the DFlash format that SGLang, vLLM and the reference load."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_window_layers": self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "dtype": "bfloat16",
            **self.extra,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        dflash = data.get("dflash_config") or {}
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        flat = {k: v for k, v in data.items() if k in known}
        flat["mask_token_id"] = int(dflash.get("mask_token_id", data.get("mask_token_id")))
        layer_ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        flat["target_layer_ids"] = list(layer_ids)
        flat["rope_theta"] = _rope_theta(data)
        return cls(**flat)


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers 5 writes rope_parameters; older configs (and the DFlash format) rope_theta.
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0)))


@dataclass
class TargetHead:
    """The target's frozen token embedding and lm_head, used by the drafter, never owned by it.

    Plain tensors, not parameters: they are not trained, not in the drafter's state dict or
    checkpoint, and not synchronised by DDP.
    """

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


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale by a learned weight, back to the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin for integer positions of any shape: [..., head_dim]."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos/sin: [..., head_dim] broadcast over heads."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def context_span(chunk_anchors: torch.Tensor, context_len: int) -> int:
    """How many context keys a chunk of blocks needs: up to its largest anchor.

    Fake tensors (memory planning, `draftline.drafter.memory`) carry no values: the chunk then
    takes the whole context, the worst case, so a planned peak is never below the real one.
    """
    if not chunk_anchors.numel():
        return 0
    if is_fake(chunk_anchors):
        return context_len
    return int(chunk_anchors.max().item())


def block_prefix_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    anchors: torch.Tensor,
    scale: float,
    queries_per_chunk: int | None = None,
    expand_kv_heads: bool | None = None,
) -> torch.Tensor:
    """Each block attends to context keys before its anchor and to its own block's keys.

    q: [b, N, S, h, d]; k_block, v_block: [b, N, S, kvh, d]; k_ctx, v_ctx: [b, T, kvh, d];
    anchors: [b, N], sorted per row. Returns [b, N, S, h, d].

    Blocks go in chunks; a chunk's keys are the context up to its largest anchor plus the
    chunk's own block keys, so the cost grows with anchors x context, not (anchors x S)^2.

    expand_kv_heads (default: on CUDA): repeat each key/value head for its query heads. On
    CUDA, SDPA's flash kernel takes no mask and its memory-efficient kernel no grouped-query
    heads, so masked grouped-query attention would fall back to the math kernel, which keeps
    every chunk's fp32 probabilities for the backward (x2 of a production step's memory).
    """
    b, n, s, h, d = q.shape
    kvh = k_block.shape[3]
    if expand_kv_heads is None:
        expand_kv_heads = q.device.type == "cuda"
    repeats = h // kvh if expand_kv_heads and h != kvh else 1
    blocks_per_chunk = max(1, (queries_per_chunk or QUERIES_PER_CHUNK) // s)
    positions = torch.arange(k_ctx.shape[1], device=q.device)
    outputs = []
    for start in range(0, n, blocks_per_chunk):
        end = min(n, start + blocks_per_chunk)
        g = end - start
        chunk_anchors = anchors[:, start:end]
        span = context_span(chunk_anchors, k_ctx.shape[1])
        queries = q[:, start:end].reshape(b, g * s, h, d).transpose(1, 2)
        keys = torch.cat([k_ctx[:, :span], k_block[:, start:end].reshape(b, g * s, kvh, d)], 1)
        values = torch.cat([v_ctx[:, :span], v_block[:, start:end].reshape(b, g * s, kvh, d)], 1)
        # Context strictly before the anchor (`<`, never `<=`: the anchor's own state is not
        # available at inference), and the whole own block, nothing of the other blocks.
        sees_context = positions[:span] < chunk_anchors[..., None]  # [b, g, span]
        sees_context = sees_context.repeat_interleave(s, dim=1)  # [b, g*s, span]
        block_of = torch.arange(g * s, device=q.device) // s
        sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
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


def dense_block_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    anchors: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention as one SDPA over [context ; all blocks] with a dense mask.

    The formulation of SpecForge-style training; kept as the reference that tests and
    `benchmarks/train_attention.py` compare `block_prefix_attention` with.
    """
    b, n, s, h, d = q.shape
    kvh = k_block.shape[3]
    t = k_ctx.shape[1]
    queries = q.reshape(b, n * s, h, d).transpose(1, 2)
    keys = torch.cat([k_ctx, k_block.reshape(b, n * s, kvh, d)], 1).transpose(1, 2)
    values = torch.cat([v_ctx, v_block.reshape(b, n * s, kvh, d)], 1).transpose(1, 2)
    query_anchor = anchors.repeat_interleave(s, dim=1)  # [b, n*s]
    sees_context = torch.arange(t, device=q.device)[None, None, :] < query_anchor[..., None]
    block_of = torch.arange(n * s, device=q.device) // s
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=h != kvh
    )
    return out.transpose(1, 2).reshape(b, n, s, h, d)


ATTENTION_IMPLEMENTATIONS = {"blockwise": block_prefix_attention, "dense": dense_block_attention}


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

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
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
        b, n, s, _ = x.shape
        context = blocks.context
        t = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, n, s, self.num_heads, self.head_dim))
        k_block = self.k_norm(self.k_proj(x).view(b, n, s, self.num_kv_heads, self.head_dim))
        v_block = self.v_proj(x).view(b, n, s, self.num_kv_heads, self.head_dim)
        k_ctx = self.k_norm(self.k_proj(context).view(b, t, self.num_kv_heads, self.head_dim))
        v_ctx = self.v_proj(context).view(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, *blocks.rope_block)
        k_block = apply_rope(k_block, *blocks.rope_block)
        k_ctx = apply_rope(k_ctx, *blocks.rope_context)
        out = blocks.attend(q, k_block, v_block, k_ctx, v_ctx, blocks.anchors, self.scaling)
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

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, blocks: BlockInputs) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), blocks)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter: `fc` + `hidden_norm` over the K target layers, decoder layers, `norm`.

    Parameter names are those of the DFlash checkpoint format (see `draftline.drafter.export`).
    """

    def __init__(self, config: DFlashConfig, target: TargetHead) -> None:
        super().__init__()
        self.config = config
        self.target = target
        k = len(config.target_layer_ids)
        self.fc = nn.Linear(k * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # "blockwise" (default) or "dense": the same math, used to check and benchmark.
        self.attention_implementation = "blockwise"
        # Key/value heads repeated for the query heads: None is on CUDA only (see
        # `block_prefix_attention`); memory planning sets it to measure a GPU's step on CPU.
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

    def block_input_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[..., S] block ids `[anchor token, MASK x (S-1)]` for anchor tokens [...]."""
        shape = (*anchor_ids.shape, self.config.block_size)
        ids = torch.full(shape, self.config.mask_token_id, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return ids

    def forward(
        self,
        context_features: torch.Tensor,
        block_ids: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states of every block.

        context_features: [b, T, K*H], the K target layers' states for positions 0..T-1
            (`target_layer_ids` order); position t is token t.
        block_ids: [b, N, S] long, `[token at anchor, MASK, ...]` (see `block_input_ids`).
        anchors: [b, N] long, sorted per row; block j sits at positions anchors[j] + 0..S-1 and
            sees context positions < anchors[j]. Padding blocks: any anchor, ignored by the loss.
        Returns [b, N, S, H]; `logits(...)` maps them to the vocabulary. Output k of a block
        predicts the token at anchor + k (k = 1..S-1; output 0 is the given anchor token).
        """
        b, t, _ = context_features.shape
        s = block_ids.shape[-1]
        context = self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))
        x = F.embedding(block_ids, self.target.embed_weight).to(context.dtype)
        c = self.config
        rope = partial(rope_cos_sin, head_dim=c.head_dim, theta=c.rope_theta, dtype=context.dtype)
        rope_block = rope(anchors[..., None] + torch.arange(s, device=anchors.device))
        cos, sin = rope(torch.arange(t, device=context.device))
        blocks = BlockInputs(context, rope_block, (cos[None], sin[None]), anchors, self._attend())
        for layer in self.layers:
            x = layer(x, blocks)
        return self.norm(x)

    def _attend(self) -> Callable[..., torch.Tensor]:
        attend = ATTENTION_IMPLEMENTATIONS[self.attention_implementation]
        if attend is block_prefix_attention:
            return partial(attend, expand_kv_heads=self.expand_kv_heads)
        return attend

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen lm_head over drafter hidden states."""
        return F.linear(hidden, self.target.lm_head_weight.to(hidden.dtype))

    @torch.no_grad()
    def draft_block(self, context_features: torch.Tensor, anchor_id: int) -> torch.Tensor:
        """Greedy draft of one block after a context of T positions: [S-1] token ids.

        The anchor token sits at position T (the first token the target has not yet encoded).
        """
        t = context_features.shape[-2]
        feats = context_features.reshape(1, t, -1)
        anchor = torch.tensor([[anchor_id]], device=feats.device)
        block = self.block_input_ids(anchor)
        hidden = self.forward(feats, block, torch.tensor([[t]], device=feats.device))
        return self.logits(hidden[0, 0, 1:]).argmax(-1)
