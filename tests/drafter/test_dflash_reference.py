"""The drafter equals z-lab's `DFlashDraftModel` (z-lab/dflash `dflash/model.py`), sliding layers
included, on the Qwen3.6 twin (models/tiny-qwen36: its shape, embedding, head and real hidden
states), loaded strictly from our exported checkpoint.

The reference below is that model's inference path rebuilt from transformers' own Qwen3 parts
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
`sliding_causal` our drafter does that, checked against the same reference with that window.
Our drafter runs every block of a sequence in one pass with `block_prefix_attention`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from draftline.drafter import dflash
from draftline.drafter.build import load_target_head, target_config
from draftline.drafter.dflash import DFlashConfig, DFlashDrafter
from draftline.drafter.evaluation import anchor_drafts
from draftline.drafter.export import export_drafter, load_drafter

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(1)

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


@pytest.fixture(scope="module")
def twin_case(tmp_path_factory):
    """A sliding-layout drafter for the twin, exported; the twin's features of one sequence."""
    from draftline.core.target import load_model

    head = load_target_head(TWIN).to("cpu", torch.float32)
    config = DFlashConfig.from_target(
        target_config(TWIN),
        num_hidden_layers=len(LAYOUT),
        block_size=BLOCK,
        mask_token_id=1534,
        target_layer_ids=LAYER_IDS,
        layer_types=LAYOUT,
        sliding_window=WINDOW,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, head)
    with torch.no_grad():  # norms start at 1: perturb them so a lost weight would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = export_drafter(drafter, tmp_path_factory.mktemp("twin") / "drafter", torch.float32)
    tokens = torch.randint(0, 1500, (TOKENS,), generator=torch.Generator().manual_seed(1))
    target = load_model(TWIN)
    with torch.no_grad():
        states = target(input_ids=tokens[None], output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in LAYER_IDS], dim=-1)[0].float()
    return load_drafter(folder, head), folder, features, tokens


def reference_block(model, head, features, tokens, anchor: int, mask_id: int) -> torch.Tensor:
    """z-lab's draft of the block at `anchor`: context features[:anchor], one call."""
    block = torch.full((BLOCK,), mask_id)
    block[0] = tokens[anchor]
    noise = nn.functional.embedding(block, head.embed_weight)[None]
    positions = torch.arange(anchor + BLOCK)[None]
    return model(positions, noise, features[None, :anchor])[0]


def test_exported_config_is_read_by_transformers_with_its_layout(twin_case):
    _, folder, _, _ = twin_case
    config = AutoConfig.from_pretrained(folder)
    assert config.layer_types == LAYOUT
    assert config.sliding_window == WINDOW and config.use_sliding_window is True


def causal_copy(drafter: DFlashDrafter, folder: Path) -> tuple[DFlashDrafter, Path]:
    """The same weights with causal sliding layers, exported and loaded back."""
    config = DFlashConfig(**{**drafter.config.__dict__, "sliding_causal": True})
    causal = DFlashDrafter(config, drafter.target)
    causal.load_state_dict(drafter.state_dict())
    out = export_drafter(causal, folder, torch.float32)
    return load_drafter(out, drafter.target), out


@pytest.mark.parametrize("queries_per_chunk", [8, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["zlab-bidirectional", "engines-causal"])
def test_drafter_equals_zlab_reference_with_sliding_layers_on_the_twin(
    twin_case, monkeypatch, tmp_path, queries_per_chunk, causal
):
    drafter, folder, features, tokens = twin_case
    if causal:
        drafter, folder = causal_copy(drafter, tmp_path / "causal")
        assert drafter.config.sliding_causal
        assert "is_causal" not in json.loads((folder / "config.json").read_text())
    else:
        assert json.loads((folder / "config.json").read_text())["is_causal"] is False
    monkeypatch.setattr(dflash, "QUERIES_PER_CHUNK", queries_per_chunk)
    reference = ReferenceDraftModel(AutoConfig.from_pretrained(folder))
    weights = {k: v.float() for k, v in drafter.state_dict().items()}
    reference.load_state_dict(weights, strict=True)  # every name and shape as z-lab's
    anchors = torch.tensor([3, 10, 17, 30, 31, 52, 70, TOKENS - BLOCK])
    mask_id = drafter.config.mask_token_id
    with torch.no_grad():
        batched = drafter(
            features[None], drafter.block_input_ids(tokens[anchors])[None], anchors[None]
        )[0]
        for j, a in enumerate(anchors.tolist()):
            want = reference_block(reference, drafter.target, features, tokens, a, mask_id)
            assert torch.allclose(batched[j], want, atol=2e-5, rtol=1e-4), a


def test_the_window_matters_and_evaluation_drafts_follow_it(twin_case):
    """Without the window the far blocks differ; evaluation's batched drafts are the
    per-block inference drafts (`draft_block`) under the same layout."""
    drafter, _, features, tokens = twin_case
    anchors = torch.tensor([5, 40, 80])
    full = DFlashDrafter(
        DFlashConfig(**{**drafter.config.__dict__, "layer_types": None, "sliding_window": None}),
        drafter.target,
    )
    full.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        ids = drafter.block_input_ids(tokens[anchors])[None]
        sliding, whole = (
            drafter(features[None], ids, anchors[None]),
            full(features[None], ids, anchors[None]),
        )
        drafts = anchor_drafts(drafter, features, tokens, anchors)
        one_by_one = [drafter.draft_block(features[:a], int(tokens[a])) for a in anchors]
    # Anchor 5 sees only positions 0..4, inside every window: the same either way.
    assert torch.allclose(sliding[0, 0], whole[0, 0], atol=1e-6)
    assert not torch.allclose(sliding[0, 2], whole[0, 2], atol=1e-3)
    assert torch.equal(drafts, torch.stack(one_by_one))


def test_causal_sliding_layers_differ_and_evaluation_drafts_follow_them(twin_case, tmp_path):
    drafter, _, features, tokens = twin_case
    causal, _ = causal_copy(drafter, tmp_path / "causal")
    anchors = torch.tensor([5, 40, 80])
    with torch.no_grad():
        ids = drafter.block_input_ids(tokens[anchors])[None]
        both = (
            drafter(features[None], ids, anchors[None]),
            causal(features[None], ids, anchors[None]),
        )
        drafts = anchor_drafts(causal, features, tokens, anchors)
        one_by_one = [causal.draft_block(features[:a], int(tokens[a])) for a in anchors]
    assert not torch.allclose(both[0], both[1], atol=1e-3)
    assert torch.equal(drafts, torch.stack(one_by_one))


def test_the_drafter_params_build_the_layout_that_training_and_evaluate_use():
    """train and evaluate build their drafter from params.drafter (`build_drafter`)."""
    from draftline.drafter.build import Hyperparameters, build_drafter

    params = {
        "num_hidden_layers": 3, "block_size": BLOCK, "gamma": 4.0, "max_anchors": 8,
        "global_batch_size": 2, "lr": 1e-3, "weight_decay": 0.0, "warmup_ratio": 0.0,
        "epochs": 1, "grad_clip": 1.0, "seed": 0, "layer_types": LAYOUT, "sliding_window": WINDOW,
    }  # fmt: skip
    model = {**TWIN, "mask_token_id": 1534, "target_layer_ids": LAYER_IDS}
    drafter = build_drafter(model, Hyperparameters.from_params(params))
    assert drafter.config.layer_types == LAYOUT and drafter.config.sliding_window == WINDOW
    windows = [layer.self_attn.sliding_window for layer in drafter.layers]
    assert windows == [WINDOW, WINDOW, None]
    full = build_drafter(model, Hyperparameters.from_params({**params, "layer_types": None}))
    assert [layer.self_attn.sliding_window for layer in full.layers] == [None] * 3
