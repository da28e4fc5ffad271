"""The DFlash training objective (paper appendix A.1), from token ids and the loss mask.

Per sequence: anchors drawn at random among supervised positions (loss mask 1), up to
`max_anchors`, sorted; each anchor a starts a block `[x_a, MASK x (B-1)]` at positions
a..a+B-1. Labels are same-position: block output k predicts x_{a+k} (never shifted by one);
output 0 is the given anchor and gets no loss. Output k weighs exp(-(k-1)/gamma), times 0 where
a+k is outside the sequence or outside the loss mask; the loss is the weighted cross-entropy
divided by the sum of the weights. Sequences with fewer than 2B supervised tokens are dropped.

Anchors are seeded per (seed, epoch, sample id), so they do not depend on how many processes
share the batch or on which one draws them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from draftline.drafter.linear_cross_entropy import linear_cross_entropy
from draftline.drafter.selector_objective import SelectorParts


def keeps_sequence(loss_mask: torch.Tensor, block_size: int) -> bool:
    """Whether a sequence has the 2B supervised tokens the objective needs."""
    return int(loss_mask.sum()) >= 2 * block_size


def anchor_generator(seed: int, epoch: int, sample_id: str) -> torch.Generator:
    """A generator seeded by the sample itself, not by the process that handles it."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{sample_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Sorted random anchor positions among supervised positions that have a next token."""
    supervised = loss_mask.bool().clone()
    supervised[-1] = False  # an anchor on the last token would have nothing to predict
    candidates = supervised.nonzero().flatten()
    n = min(max_anchors, candidates.numel())
    chosen = torch.randperm(candidates.numel(), generator=generator)[:n]
    return candidates[chosen].sort().values


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] loss weight per block position: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels [N, B] and loss weights [N, B] of the blocks at `anchors`."""
    t = input_ids.shape[0]
    positions = anchors[:, None] + torch.arange(block_size)
    inside = positions < t
    safe = positions.clamp(max=t - 1)
    labels = input_ids[safe].long()
    # The mask is read at the label's own position (the same shift as the labels: none).
    supervised = loss_mask[safe].bool() & inside
    weights = position_weights(block_size, gamma)[None, :] * supervised
    return labels, weights


@dataclass
class SequenceBlocks:
    """One sequence with its anchors, block inputs, labels and weights."""

    sample_id: str
    input_ids: torch.Tensor  # [T] long
    anchors: torch.Tensor  # [N] long, sorted
    block_ids: torch.Tensor  # [N, B] long
    labels: torch.Tensor  # [N, B] long
    weights: torch.Tensor  # [N, B] float


def make_blocks(
    sample_id: str,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    block_size: int,
    gamma: float,
    max_anchors: int,
    mask_token_id: int,
    seed: int,
    epoch: int,
) -> SequenceBlocks:
    ids = input_ids.long()
    anchors = sample_anchors(loss_mask, max_anchors, anchor_generator(seed, epoch, sample_id))
    block_ids = torch.full((anchors.numel(), block_size), mask_token_id, dtype=torch.long)
    block_ids[:, 0] = ids[anchors]
    labels, weights = block_targets(ids, loss_mask, anchors, block_size, gamma)
    return SequenceBlocks(sample_id, ids, anchors, block_ids, labels, weights)


@dataclass
class MicroBatch:
    """Sequences padded to a common length and anchor count (padding has weight 0)."""

    input_ids: torch.Tensor  # [b, T] long (padding 0)
    attention_mask: torch.Tensor  # [b, T] long, 1 for real tokens
    anchors: torch.Tensor  # [b, N]
    block_ids: torch.Tensor  # [b, N, B]
    labels: torch.Tensor  # [b, N, B]
    weights: torch.Tensor  # [b, N, B]
    sample_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.anchors.to(device),
            self.block_ids.to(device),
            self.labels.to(device),
            self.weights.to(device),
            self.sample_ids,
        )


def collate(sequences: list[SequenceBlocks], mask_token_id: int) -> MicroBatch:
    b = len(sequences)
    t = max(s.input_ids.numel() for s in sequences)
    n = max(s.anchors.numel() for s in sequences)
    block = sequences[0].block_ids.shape[1]
    input_ids = torch.zeros(b, t, dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.long)
    # Padding blocks sit at anchor 0 (they see no context) and carry weight 0.
    anchors = torch.zeros(b, n, dtype=torch.long)
    block_ids = torch.full((b, n, block), mask_token_id, dtype=torch.long)
    labels = torch.zeros(b, n, block, dtype=torch.long)
    weights = torch.zeros(b, n, block)
    for i, s in enumerate(sequences):
        length, count = s.input_ids.numel(), s.anchors.numel()
        input_ids[i, :length] = s.input_ids
        attention_mask[i, :length] = 1
        anchors[i, :count] = s.anchors
        # Keep each row sorted: padding anchors repeat the last real one.
        if count and count < n:
            anchors[i, count:] = s.anchors[-1]
        block_ids[i, :count] = s.block_ids
        labels[i, :count] = s.labels
        weights[i, :count] = s.weights
    return MicroBatch(
        input_ids,
        attention_mask,
        anchors,
        block_ids,
        labels,
        weights,
        [s.sample_id for s in sequences],
    )


@dataclass
class LossParts:
    """Unnormalised pieces, summed over micro-batches and processes before dividing."""

    weighted_ce: torch.Tensor  # scalar, differentiable: sum of w * CE
    correct: torch.Tensor  # [B] greedy hits per block position (where weight > 0)
    counted: torch.Tensor  # [B] supervised outputs per block position
    selector: SelectorParts | None = None  # DFlash2's selector term (`selector_objective`)


def matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the lm_head matmul runs in: autocast's when it is on, else the input's.

    Under autocast the drafter's final RMSNorm returns fp32; casting the head to that would
    copy a vocab-sized matrix (4.7 GiB at vocab 248320 x hidden 5120) per chunk.
    """
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_chunk: int | None = None,
    kernel: str = "auto",
) -> LossParts:
    """Weighted CE over drafter outputs hidden [b, N, B, H] with labels/weights [b, N, B].

    The frozen lm_head and the CE are fused (`draftline.drafter.linear_cross_entropy`): the
    vocab-sized logits never exist for more than one chunk of tokens, in the forward or the
    backward (which recomputes them), and the head gets no gradient. The head is cast to the
    matmul dtype at most once (a no-op for a bf16 head under bf16 autocast). kernel: "auto"
    (Liger's fused kernel where it runs, else the chunked torch path), "torch" or "liger";
    tokens_per_chunk: rows per chunk of the torch path (None: sized by vocab / hidden).
    """
    lm_head_weight = lm_head_weight.detach().to(matmul_dtype(hidden))
    block = labels.shape[-1]
    flat_weights = weights.reshape(-1).float()
    total, hits = linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        lm_head_weight,
        labels.reshape(-1),
        flat_weights,
        kernel=kernel,
        chunk=tokens_per_chunk,
    )
    supervised = (flat_weights > 0).float()
    correct = (hits.float() * supervised).view(-1, block).sum(0)
    counted = supervised.view(-1, block).sum(0)
    return LossParts(total, correct, counted)
