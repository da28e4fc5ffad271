"""The drafter equals z-lab's `DFlashDraftModel` (z-lab/dflash `dflash/model.py`), sliding layers
included, on the Qwen3.6 twin (models/tiny-qwen36: its shape, embedding, head and real hidden
states), loaded strictly from our exported checkpoint.

The reference (tests/helpers/dflash_reference.py) is that model's inference path rebuilt from
transformers' own Qwen3 parts, flash-attention's sliding window spelled out as a mask for the
eager attention; SGLang and vLLM serve the same checkpoint with causal sliding layers, and with
`sliding_causal` our drafter does that, checked against the same reference with that window.
Our drafter runs every block of a sequence in one pass with `block_prefix_attention`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.dflash_reference import (
    BLOCK,
    LAYER_IDS,
    LAYOUT,
    TOKENS,
    TWIN,
    WINDOW,
    ReferenceDraftModel,
    reference_block,
)
from transformers import AutoConfig

from draftline.drafter import dflash
from draftline.drafter.build import load_target_head, target_config
from draftline.drafter.dflash import DFlashConfig, DFlashDrafter
from draftline.drafter.evaluation import anchor_drafts
from draftline.drafter.export import export_drafter, load_drafter

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(1)


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
