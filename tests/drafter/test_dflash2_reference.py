"""The DFlash2 drafter equals z-lab's `DFlash2DraftModel` (z-lab/dflash `dflash/model.py`, the
version with DFlash2), loaded strictly from our exported checkpoint, on the Qwen3.6 twin.

The reference is the DFlash one of tests/helpers/dflash_reference.py (transformers' Qwen3 parts, one
block per call) with z-lab's DFlash2 additions spelled out below under z-lab's names:
`GroupedDynamicCausalConv` around each layer's attention and MLP (`prepare` before the sublayer,
`finish` after it, as z-lab's `Qwen3DFlashDecoderLayer.forward`), `_grouped_dynamic_convolve`
over the block's positions, and `CandidateSelector.select`'s greedy walk over the lm_head's
top-k, with the codebooks as `nn.Embedding` (z-lab maps the checkpoint's
`candidate_selector.*_codebook` onto their `.weight` in `from_pretrained`; the test does the
same). The checkpoint's config is read by transformers' `Qwen3Config` and the DFlash2 fields
from its `dflash_config`, as z-lab's `_draft_value` reads them.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.dflash_reference import (
    BLOCK,
    LAYER_IDS,
    LAYOUT,
    TOKENS,
    TWIN,
    WINDOW,
    ReferenceDraftModel,
    ReferenceLayer,
    reference_block,
)
from torch import nn
from transformers import AutoConfig

from draftline.drafter.build import load_target_head, target_config
from draftline.drafter.dflash import DFlashConfig, DFlashDrafter
from draftline.drafter.dflash2 import DFlash2Layout, proposal_logits
from draftline.drafter.evaluation import anchor_drafts
from draftline.drafter.export import export_drafter, load_drafter

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(1)

LAYOUT2 = DFlash2Layout(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6)


def _grouped_dynamic_convolve(hidden, dynamic, base, group_size):  # z-lab's
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.view(batch, length, groups, group_size)
    dynamic = dynamic.view(batch, length, base.shape[0], groups, 1)
    output = torch.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        kernel = base[offset].view(1, 1, groups, group_size).to(hidden.dtype)
        output = output + kernel * values
        output = torch.addcmul(output, dynamic[:, :, offset], values)
    return output.view_as(hidden)


class GroupedDynamicCausalConv(nn.Module):  # z-lab's
    def __init__(self, hidden_size, kernel_size, group_size):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(self, hidden):
        groups = hidden.shape[-1] // self.group_size
        dynamic = self.kernel_projection(hidden).view(
            *hidden.shape[:-1], 2, self.kernel_size, groups
        )
        base = self.base_kernel[0]
        return (
            _grouped_dynamic_convolve(hidden, dynamic[..., 0, :, :], base, self.group_size),
            dynamic[..., 1, :, :],
        )

    def finish(self, hidden, dynamic):
        return _grouped_dynamic_convolve(hidden, dynamic, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):  # z-lab's, greedy (temperature 0)
    def __init__(self, config):
        super().__init__()
        rank = int(config.dflash_config["selector_rank"])
        self.top_k = int(config.dflash_config["selector_top_k"])
        self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, rank)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(self, hidden, logits, anchor_ids):
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        hidden = self.hidden_projection(hidden)
        predecessor, path = anchor_ids, []
        for position in range(hidden.shape[1]):
            scores = unary[:, position] + torch.einsum(
                "br,bkr->bk",
                self.predecessor_codebook(predecessor) * hidden[:, position],
                self.successor_codebook(candidates[:, position]),
            )
            index = torch.argmax(scores, dim=-1)
            predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1)


class ReferenceLayer2(ReferenceLayer):
    """z-lab's decoder layer with its DFlash2 convolutions."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        taps, group = (
            int(config.dflash_config[k]) for k in ("conv_kernel_size", "conv_group_size")
        )
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, taps, group)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, taps, group)

    def forward(self, hidden, target_hidden, cos, sin):
        residual = hidden
        hidden, kernel = self.attention_conv.prepare(self.input_layernorm(hidden))
        hidden = self.attention_conv.finish(self.self_attn(hidden, target_hidden, cos, sin), kernel)
        hidden = residual + hidden
        residual = hidden
        hidden, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return residual + self.mlp_conv.finish(self.mlp(hidden), kernel)


class ReferenceDraft2Model(ReferenceDraftModel):
    """z-lab's DFlash2DraftModel: the same modules under the same names."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(
            ReferenceLayer2(config, i) for i in range(config.num_hidden_layers)
        )
        self.candidate_selector = CandidateSelector(config)


def zlab_key_mapping(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """z-lab's `from_pretrained` key_mapping: the codebooks are Embedding weights there."""
    codebooks = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
    return {f"{k}.weight" if k in codebooks else k: v for k, v in weights.items()}


@pytest.fixture(scope="module")
def twin2(tmp_path_factory):
    """A DFlash2 drafter of the twin with every DFlash2 weight moved off its no-op start,
    exported in fp32; the twin's features of one sequence."""
    from draftline.core.target import load_model

    head = load_target_head(TWIN).to("cpu", torch.float32)
    config = DFlashConfig.from_target(
        target_config(TWIN), num_hidden_layers=len(LAYOUT), block_size=BLOCK,
        mask_token_id=1534, target_layer_ids=LAYER_IDS, layer_types=LAYOUT,
        sliding_window=WINDOW, sliding_causal=True, dflash2=LAYOUT2,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, head)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name or "conv" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "candidate_selector" in name:
                p.add_(torch.randn_like(p))  # transitions as large as the unary logits
    folder = export_drafter(drafter, tmp_path_factory.mktemp("twin2") / "drafter", torch.float32)
    tokens = torch.randint(0, 1500, (TOKENS,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = load_model(TWIN)(input_ids=tokens[None], output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in LAYER_IDS], dim=-1)[0].float()
    return load_drafter(folder, head), folder, features, tokens


def test_the_export_is_in_the_engines_dflash2_format(twin2):
    _, folder, _, _ = twin2
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"] == {
        "mask_token_id": 1534, "target_layer_ids": LAYER_IDS, "conv_kernel_size": 2,
        "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6,
    }  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.2.mlp_conv.base_kernel",
            "layers.0.attention_conv.kernel_projection.weight"} <= names  # fmt: skip
    assert not [n for n in names if "embed" in n or "lm_head" in n]


def test_drafter_equals_zlab_dflash2_reference_block_by_block(twin2):
    drafter, folder, features, tokens = twin2
    reference = ReferenceDraft2Model(AutoConfig.from_pretrained(folder))
    weights = {k: v.float() for k, v in drafter.state_dict().items()}
    reference.load_state_dict(zlab_key_mapping(weights), strict=True)
    anchors = torch.tensor([3, 10, 17, 30, 52, 70, TOKENS - BLOCK])
    head = drafter.target.lm_head_weight
    with torch.no_grad():
        batched = drafter(
            features[None], drafter.block_input_ids(tokens[anchors])[None], anchors[None]
        )[0]
        drafts = anchor_drafts(drafter, features, tokens, anchors)
        for j, a in enumerate(anchors.tolist()):
            mask_id = drafter.config.mask_token_id
            want = reference_block(reference, drafter.target, features, tokens, a, mask_id)
            assert torch.allclose(batched[j], want, atol=2e-5, rtol=1e-4), a
            walk = reference.candidate_selector.select(
                want[None, 1:], want[None, 1:] @ head.T, tokens[a : a + 1]
            )
            assert torch.equal(drafter.draft_block(features[:a], int(tokens[a])), walk[0]), a
            # Evaluation's batched drafts condition each output on the target's token before it;
            # while the walk's drafts are those tokens, both pick the same.
            agree = int((walk[0] == tokens[a + 1 : a + BLOCK]).long().cumprod(0).sum())
            assert torch.equal(drafts[j, : agree + 1], walk[0, : agree + 1]), a


def test_a_fresh_dflash2_drafts_as_dflash_with_the_same_weights(twin2):
    """The convolutions start as identities and the selector with B = 0: nothing changes until
    they are trained (so DFlash2 starts where DFlash starts)."""
    drafter, _, features, tokens = twin2
    config = drafter.config
    torch.manual_seed(3)
    fresh = DFlashDrafter(config, drafter.target)
    plain = DFlashDrafter(DFlashConfig(**{**config.__dict__, "dflash2": None}), drafter.target)
    plain.load_state_dict(fresh.state_dict(), strict=False)
    anchors = torch.tensor([5, 40, 80])
    with torch.no_grad():
        ids = fresh.block_input_ids(tokens[anchors])[None]
        assert torch.equal(
            fresh(features[None], ids, anchors[None]), plain(features[None], ids, anchors[None])
        )
        assert torch.equal(
            anchor_drafts(fresh, features, tokens, anchors),
            anchor_drafts(plain, features, tokens, anchors),
        )
    # ...and the trained-looking one does differ from its DFlash backbone.
    assert not torch.equal(anchor_drafts(drafter, features, tokens, anchors),
                           anchor_drafts(plain, features, tokens, anchors))  # fmt: skip


def test_proposal_logits_are_the_selector_scores_over_the_candidates(twin2):
    """What evaluation samples from: softmax over the top-k candidates of the selector's scores
    given the token before, zero elsewhere (the distribution the engines draw a draft from)."""
    drafter, _, features, tokens = twin2
    anchors = torch.tensor([12, 60])
    with torch.no_grad():
        hidden = drafter(
            features[None], drafter.block_input_ids(tokens[anchors])[None], anchors[None]
        )[0, :, 1:]
        previous = torch.stack([tokens[a : a + BLOCK - 1] for a in anchors.tolist()])
        logits = proposal_logits(drafter, hidden, previous)
        unary = drafter.logits(hidden)
    finite = torch.isfinite(logits)
    assert (finite.sum(-1) == LAYOUT2.selector_top_k).all()
    top = unary.topk(LAYOUT2.selector_top_k, dim=-1).indices
    assert torch.equal(finite, torch.zeros_like(finite).scatter(-1, top, True))
    assert not torch.allclose(logits[finite], unary[finite])  # the transitions are there
