"""The training objective of DFlash2's candidate selector (`draftline.drafter.dflash2`).

The public DFlash2 code specifies inference only; each trainer adds its own selector term to the
DFlash cross-entropy (`draftline.drafter.objective`). Here, at every supervised block output k
(k >= 1, weight w_k of the DFlash objective), with the target's token before it as predecessor
(teacher forcing: along an accepted block those are the drafts the walk conditions on):

- `strict_topk` (SpecForge's released objective): cross-entropy of the selector's scores over
  the top-k unary candidates, against the gold token; outputs whose gold token is not among
  the candidates add nothing (nothing the selector can pick would be accepted).
- `gold_insertion` (SpecForge's earlier variant): the same, but a missing gold token replaces
  the last candidate, so every output trains the selector.
- `none`: no selector term (the selector stays at its no-op start, B = 0).

The term is w_k * CE summed like the DFlash CE and divided by the same total weight, scaled by
`alpha`, which is 0 for the first `warmup_ratio` of the steps and rises linearly over the next
`ramp_ratio` (SpecForge's schedule). `stop_gradient`: the term trains the selector only, not the
drafter's hidden states (nor, through them, the rest of the drafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftline.drafter.dflash2 import top_candidates, unary_logits

LOSSES = ("strict_topk", "gold_insertion", "none")


@dataclass(frozen=True)
class SelectorObjective:
    """`drafter.selector_*` params (DFlash2 profiles)."""

    loss: str = "strict_topk"
    alpha: float = 1.0
    warmup_ratio: float = 0.0
    ramp_ratio: float = 0.0
    stop_gradient: bool = False

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise SystemExit(f"drafter.selector_loss={self.loss!r}: one of {', '.join(LOSSES)}")

    def weight(self, step: int, total_steps: int) -> float:
        """alpha at optimizer step `step` of `total_steps`: 0, linear ramp, then alpha."""
        if self.loss == "none":
            return 0.0
        warmup, ramp = self.warmup_ratio * total_steps, self.ramp_ratio * total_steps
        if step < warmup:
            return 0.0
        if ramp <= 0 or step >= warmup + ramp:
            return self.alpha
        return self.alpha * (step - warmup) / ramp


@dataclass
class SelectorParts:
    """Unnormalised pieces, summed over micro-batches and processes like `LossParts`."""

    weighted_ce: torch.Tensor  # scalar, differentiable: sum of w * selector CE
    in_top_k: torch.Tensor  # [B] outputs whose gold token is a candidate (recall@top-k)
    top1: torch.Tensor  # [B] outputs whose best-scored candidate is the gold token (recall@1)
    counted: torch.Tensor  # [B] supervised outputs


def selector_loss(
    drafter: Any,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    objective: SelectorObjective,
) -> SelectorParts:
    """The selector term over drafter outputs hidden [b, N, B, H] with the DFlash objective's
    labels and weights [b, N, B] (label 0 of a block is its anchor token)."""
    # Every output k >= 1, weight 0 where unsupervised: static shapes (the memory plan runs this
    # on fake tensors, which carry no values to select by).
    block, size = labels.shape[-1], hidden.shape[-1]
    head = drafter.target.lm_head_weight
    h = hidden[..., 1:, :].reshape(-1, size)
    gold, previous = labels[..., 1:].reshape(-1), labels[..., :-1].reshape(-1)
    w = weights[..., 1:].reshape(-1).float()
    if objective.stop_gradient:
        h = h.detach()
    candidates = top_candidates(h, head, drafter.candidate_selector.top_k)
    present = (candidates == gold[:, None]).any(-1)
    if objective.loss == "gold_insertion":
        last = torch.where(present, candidates[:, -1], gold)
        candidates = torch.cat([candidates[:, :-1], last[:, None]], dim=-1)
    scores = drafter.candidate_selector(h, candidates, unary_logits(h, head, candidates), previous)
    hit = candidates == gold[:, None]
    ce = torch.logsumexp(scores, -1) - (scores * hit).sum(-1)
    weighted = (w * torch.where(hit.any(-1), ce, torch.zeros_like(ce))).sum()
    # An inserted gold token is no candidate at inference: recall@1 counts real ones only.
    top1 = present & (candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0] == gold)
    supervised = (w > 0).float()

    def per_position(values: torch.Tensor) -> torch.Tensor:
        """[B] sums over the supervised outputs of each block position (0 for the anchor)."""
        sums = (values.float().detach() * supervised).view(-1, block - 1).sum(0)
        return torch.cat([sums.new_zeros(1), sums])

    return SelectorParts(
        weighted, per_position(present), per_position(top1), per_position(supervised)
    )
