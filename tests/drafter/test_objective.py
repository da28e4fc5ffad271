"""The training objective: anchors, same-position labels, decay weights, masks, dropping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.largest_allocation import LargestAllocation

from draftline.drafter.objective import (
    anchor_generator,
    block_loss,
    block_targets,
    collate,
    keeps_sequence,
    make_blocks,
    position_weights,
    sample_anchors,
)

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(1)


def mask_of(t: int, supervised: list[range]) -> torch.Tensor:
    m = torch.zeros(t, dtype=torch.uint8)
    for r in supervised:
        m[r.start : r.stop] = 1
    return m


def test_anchors_are_sorted_distinct_supervised_and_seeded_per_sample():
    mask = mask_of(60, [range(10, 30), range(40, 60)])
    anchors = sample_anchors(mask, 16, anchor_generator(0, 0, "abc"))
    assert anchors.numel() == 16
    assert torch.equal(anchors, anchors.sort().values) and anchors.unique().numel() == 16
    assert bool(mask[anchors].all()) and int(anchors.max()) < 59  # never the last token
    again = sample_anchors(mask, 16, anchor_generator(0, 0, "abc"))
    assert torch.equal(anchors, again)
    assert not torch.equal(anchors, sample_anchors(mask, 16, anchor_generator(0, 1, "abc")))
    assert not torch.equal(anchors, sample_anchors(mask, 16, anchor_generator(0, 0, "abd")))
    # Fewer candidates than max_anchors: all of them.
    few = sample_anchors(mask_of(20, [range(5, 9)]), 64, anchor_generator(0, 0, "x"))
    assert few.tolist() == [5, 6, 7, 8]


def test_decay_weights():
    w = position_weights(16, 7.0)
    assert w[0] == 0.0 and w[1] == 1.0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


def test_labels_are_same_position_and_weights_follow_the_loss_mask():
    t, block = 30, 4
    ids = torch.arange(100, 100 + t)
    mask = mask_of(t, [range(5, 15), range(20, 30)])
    anchors = torch.tensor([5, 12, 27])
    labels, weights = block_targets(ids, mask, anchors, block, 4.0)
    decay = position_weights(block, 4.0)
    # Output k predicts the token at anchor + k, never anchor + k + 1.
    assert labels[0].tolist() == [105, 106, 107, 108]
    assert torch.allclose(weights[0], decay)
    # Block at 12: positions 15, 16 are outside the loss mask.
    assert labels[1].tolist() == [112, 113, 114, 115]
    assert torch.allclose(weights[1], decay * torch.tensor([0, 1, 1, 0]))
    # Block at 27: position 30 is past the end.
    assert torch.allclose(weights[2], decay * torch.tensor([0, 1, 1, 0]))
    assert (weights[:, 0] == 0).all()


def test_short_sequences_are_dropped_at_two_blocks_of_supervision():
    assert keeps_sequence(mask_of(40, [range(8, 24)]), 8)  # exactly 2B
    assert not keeps_sequence(mask_of(40, [range(8, 23)]), 8)


def test_make_blocks_and_collate_pad_with_zero_weight():
    ids = torch.arange(50) % 40
    long = make_blocks(
        "a", ids, mask_of(50, [range(10, 50)]), block_size=4, gamma=4.0, max_anchors=8,
        mask_token_id=99, seed=0, epoch=0,
    )  # fmt: skip
    short = make_blocks(
        "b", ids[:20], mask_of(20, [range(10, 20)]), block_size=4, gamma=4.0, max_anchors=3,
        mask_token_id=99, seed=0, epoch=0,
    )  # fmt: skip
    assert torch.equal(long.block_ids[:, 0], ids[long.anchors])
    assert (long.block_ids[:, 1:] == 99).all()
    mb = collate([long, short], mask_token_id=99)
    assert mb.input_ids.shape == (2, 50) and mb.anchors.shape == (2, 8)
    assert mb.attention_mask[1].sum() == 20 and mb.num_tokens == 70
    assert (mb.weights[1, 3:] == 0).all()
    assert torch.equal(mb.anchors[1], mb.anchors[1].sort().values)


def test_block_loss_is_weighted_cross_entropy_with_per_position_accuracy(monkeypatch):
    torch.manual_seed(0)
    b, n, s, h, v = 2, 5, 4, 8, 11
    hidden = torch.randn(b, n, s, h, requires_grad=True)
    head = torch.randn(v, h)
    labels = torch.randint(0, v, (b, n, s))
    weights = position_weights(s, 4.0).expand(b, n, s).clone()
    weights[1, 3:] = 0
    parts = block_loss(hidden, head, labels, weights, tokens_per_chunk=7)
    logits = hidden @ head.T
    ce = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), reduction="none")
    expected = (ce * weights.reshape(-1)).sum()
    assert torch.allclose(parts.weighted_ce, expected, atol=1e-5)
    hits = (logits.argmax(-1) == labels) & (weights > 0)
    assert torch.equal(parts.correct, hits.sum((0, 1)).float())
    assert torch.equal(parts.counted, (weights > 0).sum((0, 1)).float())
    assert parts.counted[0] == 0  # output 0 is never scored
    parts.weighted_ce.backward()
    chunked = hidden.grad.clone()
    hidden.grad = None
    expected.backward()
    assert torch.allclose(chunked, hidden.grad, atol=1e-5)


def test_block_loss_under_bf16_autocast_makes_no_copy_of_the_head():
    """A bf16 head stays bf16: the matmul runs in the autocast dtype and only each logits chunk
    becomes fp32 (at vocab 248320 x hidden 5120 an fp32 copy of the head is 4.7 GiB)."""
    torch.manual_seed(0)
    vocab, hidden_size, tokens, chunk = 2048, 256, 96, 32
    head = (torch.randn(vocab, hidden_size) * 0.02).to(torch.bfloat16)
    # fp32 hidden states, as the drafter's final RMSNorm returns them under autocast.
    hidden = torch.randn(1, tokens // 4, 4, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens // 4, 4))
    weights = position_weights(4, 4.0).expand(1, tokens // 4, 4).contiguous()
    with LargestAllocation() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        parts = block_loss(hidden, head, labels, weights, tokens_per_chunk=chunk)
        parts.weighted_ce.backward()
    logits_chunk = chunk * vocab * 4
    assert seen.largest[0] <= logits_chunk < head.numel() * 2, seen.largest
    # The same loss as fp32 logits of the bf16 matmul.
    logits = F.linear(hidden.detach().bfloat16(), head).float().reshape(-1, vocab)
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    expected = (ce * weights.reshape(-1)).sum()
    assert torch.allclose(parts.weighted_ce, expected, rtol=1e-3)
    assert hidden.grad is not None and hidden.grad.dtype == torch.float32
