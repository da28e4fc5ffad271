"""The drafter model: shapes, the training attention mask, and its two formulations."""

from __future__ import annotations

import pytest
import torch
from helpers.small_drafter import BLOCK, HIDDEN, SLIDING, VOCAB, WINDOW, make_drafter

from draftline.drafter import dflash
from draftline.drafter.dflash import DFlashConfig

pytestmark = pytest.mark.float_kernels

torch.set_num_threads(1)


def inputs(seed: int = 1, t: int = 40):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, t, 3 * HIDDEN, generator=g)
    anchors = torch.tensor([[3, 10, 20, 30], [0, 6, 7, 35]])
    anchor_ids = torch.randint(0, VOCAB - 1, (2, 4), generator=g)
    return feats, anchor_ids, anchors


def test_shapes_and_block_inputs():
    drafter = make_drafter()
    feats, anchor_ids, anchors = inputs()
    block_ids = drafter.block_input_ids(anchor_ids)
    assert block_ids.shape == (2, 4, BLOCK)
    assert torch.equal(block_ids[..., 0], anchor_ids)
    assert (block_ids[..., 1:] == VOCAB - 1).all()
    hidden = drafter(feats, block_ids, anchors)
    assert hidden.shape == (2, 4, BLOCK, HIDDEN)
    assert drafter.logits(hidden).shape == (2, 4, BLOCK, VOCAB)
    names = set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.1.self_attn.k_norm.weight" in names
    assert not [n for n in names if "embed" in n or "lm_head" in n]


def test_block_sees_only_context_before_its_anchor_and_its_own_block():
    drafter = make_drafter()
    feats, anchor_ids, anchors = inputs()
    block_ids = drafter.block_input_ids(anchor_ids)
    with torch.no_grad():
        base = drafter(feats, block_ids, anchors)
        row, j, a = 0, 1, 10  # block 1 of row 0 has anchor 10

        after = feats.clone()
        after[row, a:] += torch.randn_like(after[row, a:])  # at and after the anchor
        out = drafter(after, block_ids, anchors)
        assert torch.allclose(out[row, j], base[row, j], atol=1e-5)
        assert not torch.allclose(out[row, 3], base[row, 3], atol=1e-3)  # anchor 30 sees it

        others = block_ids.clone()
        others[row, [0, 2, 3], 0] = (others[row, [0, 2, 3], 0] + 1) % (VOCAB - 1)
        out = drafter(feats, others, anchors)
        assert torch.allclose(out[row, j], base[row, j], atol=1e-5)

        before = feats.clone()
        before[row, a - 1] += 1.0  # the last context position the block may see
        out = drafter(before, block_ids, anchors)
        assert not torch.allclose(out[row, j], base[row, j], atol=1e-3)
        assert torch.allclose(out[row, 0], base[row, 0], atol=1e-5)  # anchor 3 does not

        own = block_ids.clone()
        own[row, j, 0] = (own[row, j, 0] + 1) % (VOCAB - 1)
        out = drafter(feats, own, anchors)
        assert not torch.allclose(out[row, j, 1:], base[row, j, 1:], atol=1e-3)


@pytest.mark.parametrize("layer_types, causal", [(None, False), (SLIDING, False), (SLIDING, True)])
@pytest.mark.parametrize("queries_per_chunk", [4, 8, 512])
def test_blockwise_attention_equals_dense_mask(monkeypatch, queries_per_chunk, layer_types, causal):
    monkeypatch.setattr(dflash, "QUERIES_PER_CHUNK", queries_per_chunk)
    feats, anchor_ids, anchors = inputs()
    results = []
    for implementation in ("blockwise", "dense"):
        drafter = make_drafter(layer_types=layer_types, causal=causal).train()
        drafter.attention_implementation = implementation
        x = feats.clone().requires_grad_(True)
        hidden = drafter(x, drafter.block_input_ids(anchor_ids), anchors)
        hidden.square().sum().backward()
        results.append((hidden.detach(), x.grad, drafter.fc.weight.grad))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_key_value_heads_repeated_for_the_cuda_kernels_give_the_same_attention():
    """On CUDA the keys/values are repeated per query head (SDPA's fused kernels would reject
    masked grouped-query attention); the math is unchanged, outputs and gradients included."""
    feats, anchor_ids, anchors = inputs()
    results = []
    for expand in (False, True):
        drafter = make_drafter().train()
        drafter.expand_kv_heads = expand
        x = feats.clone().requires_grad_(True)
        hidden = drafter(x, drafter.block_input_ids(anchor_ids), anchors)
        hidden.square().sum().backward()
        results.append((hidden.detach(), x.grad, drafter.layers[0].self_attn.k_proj.weight.grad))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_sliding_layer_sees_context_within_its_window_only():
    """Block at anchor 30, block size 4, window 6: its query at offset k sees context positions
    30 + k - 5 .. 29 in the sliding layer; the full layer after it sees all of 0..29."""
    feats, anchor_ids, anchors = inputs()
    row, j, a = 0, 3, 30
    for layers, seen_from in ((["sliding_attention"], a - WINDOW + 1), (SLIDING, 0)):
        drafter = make_drafter(layers=len(layers), layer_types=layers)
        with torch.no_grad():
            base = drafter(feats, drafter.block_input_ids(anchor_ids), anchors)
            for position, seen in ((seen_from - 1, False), (seen_from, True)):
                if position < 0:
                    continue
                moved = feats.clone()
                moved[row, position] += 1.0
                out = drafter(moved, drafter.block_input_ids(anchor_ids), anchors)
                assert torch.allclose(out[row, j], base[row, j], atol=1e-6) is not seen


def test_a_layout_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="layer_types"):
        make_drafter(layers=3, layer_types=SLIDING)
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig(**{**make_drafter().config.__dict__, "layer_types": SLIDING})


@pytest.mark.parametrize("layer_types, causal", [(None, False), (SLIDING, False), (SLIDING, True)])
def test_draft_block_matches_the_batched_training_pass(layer_types, causal):
    drafter = make_drafter(layer_types=layer_types, causal=causal)
    feats, anchor_ids, anchors = inputs()
    with torch.no_grad():
        logits = drafter.logits(drafter(feats, drafter.block_input_ids(anchor_ids), anchors))
        a = int(anchors[1, 3])
        draft = drafter.draft_block(feats[1, :a], int(anchor_ids[1, 3]))
    assert torch.equal(draft, logits[1, 3, 1:].argmax(-1))


def test_config_from_a_qwen3_target_and_json_round_trip():
    from transformers import Qwen3Config

    target = Qwen3Config(
        vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, rope_theta=5e5,
    ).to_dict()  # fmt: skip
    config = DFlashConfig.from_target(
        target, num_hidden_layers=2, block_size=8, mask_token_id=119, target_layer_ids=[1, 3, 5]
    )
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (48, 2, 8)
    assert config.rope_theta == 5e5 and config.num_target_layers == 6
    data = config.to_json_dict()
    assert data["dflash_config"] == {"mask_token_id": 119, "target_layer_ids": [1, 3, 5]}
    assert DFlashConfig.from_json_dict(data) == config
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_target(
            target, num_hidden_layers=2, block_size=8, mask_token_id=119, target_layer_ids=[6]
        )


def test_the_declared_shape_keys_reach_the_drafter_config():
    """The drafter's shape and layout keys, declared once (`config_schema`): the keys the
    schema takes under `model.dflash` and `drafter`, what the hyperparameters carry, and what
    the drafter's config is built with."""
    from transformers import Qwen3Config

    from draftline.drafter.build import Hyperparameters
    from draftline.runtime.config_schema import DRAFTER_LAYOUT_KEYS, DRAFTER_SHAPE_KEYS, SCHEMA

    keys = [*DRAFTER_SHAPE_KEYS, *DRAFTER_LAYOUT_KEYS]
    assert list(SCHEMA["model"]["dflash"]) == keys
    assert set(keys) <= set(SCHEMA["drafter"])
    chosen = {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "layer_types": SLIDING, "sliding_window": WINDOW,
        "sliding_causal": True,
    }  # fmt: skip
    assert list(chosen) == keys
    trained = dict(num_hidden_layers=2, block_size=BLOCK, gamma=4.0, max_anchors=8,
                   global_batch_size=2, lr=1e-3, weight_decay=0.0, warmup_ratio=0.0, epochs=1,
                   grad_clip=1.0, seed=0)  # fmt: skip
    hp = Hyperparameters.from_params({**trained, **chosen})
    assert hp.shape() == chosen
    target = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    ).to_dict()  # fmt: skip
    config = DFlashConfig.from_target(
        target, num_hidden_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1,
        target_layer_ids=[0, 1, 2], **hp.shape(),
    )  # fmt: skip
    assert {k: getattr(config, k) for k in keys} == chosen
