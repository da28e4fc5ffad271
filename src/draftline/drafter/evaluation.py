"""Offline greedy acceptance length tau of a drafter (DFlash paper, arXiv 2602.06036; the walk
of z-lab/dflash `dflash/model.py`).

For each held-out prompt: the target's greedy continuation x, one target forward for the
features H, then the chained walk. a = prompt length; repeat: draft the block [x_a, MASK...] from
context H[:a]; k = number of leading drafts equal to x[a+1..]; commit k + 1 (the target's bonus
token); a += k + 1. tau of a prompt is the mean commit per cycle; the report averages prompts.

Drafts of every anchor a sequence can visit come from one batched drafter pass (the training
mask: block j sees context before its anchor only), and the walk just reads them;
`walk_step_by_step` does the same walk with one drafter call per cycle, as the reference.

At the end of a continuation a cycle can verify only the tokens left: with r tokens after the
anchor, drafts beyond r are not judged and the commit is at most r.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Logit elements per drafter pass ([anchors, B, vocab] fp32): bounds memory for big vocabularies.
LOGITS_PER_PASS = 2**26


@dataclass(frozen=True)
class Cycle:
    """One draft-verify cycle: `accepted` leading drafts matched out of `verifiable`."""

    accepted: int
    verifiable: int
    committed: int


def judge(drafts: Sequence[int], continuation: Sequence[int]) -> Cycle:
    """Compare the drafts of one block with the true next tokens (`continuation`, x[a+1..])."""
    verifiable = min(len(drafts), len(continuation))
    accepted = 0
    while accepted < verifiable and int(drafts[accepted]) == int(continuation[accepted]):
        accepted += 1
    return Cycle(accepted, verifiable, min(accepted + 1, len(continuation)))


def chained_walk(
    tokens: Sequence[int], prompt_len: int, drafts_at: Callable[[int], Sequence[int]]
) -> list[Cycle]:
    """The cycles of one sequence; `drafts_at(a)` gives the B-1 drafts of the block at anchor a."""
    if not 0 < prompt_len <= len(tokens):
        raise ValueError(f"prompt length {prompt_len} outside a sequence of {len(tokens)} tokens")
    cycles: list[Cycle] = []
    a = prompt_len
    while a < len(tokens) - 1:
        cycle = judge(drafts_at(a), tokens[a + 1 :])
        cycles.append(cycle)
        a += cycle.committed
    return cycles


@torch.no_grad()
def anchor_drafts(
    drafter: Any, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Greedy drafts [N, B-1] of the blocks anchored at `anchors` (sorted), in few passes.

    features: [T, K*H] of the whole sequence; block j only sees positions < anchors[j].
    """
    block = drafter.config.block_size
    per_pass = max(1, LOGITS_PER_PASS // (block * drafter.config.vocab_size))
    device = drafter.fc.weight.device
    feats = features[None].to(device)
    out = []
    for start in range(0, len(anchors), per_pass):
        chunk = anchors[start : start + per_pass].to(device)
        block_ids = drafter.block_input_ids(tokens.to(device)[chunk])
        hidden = drafter(feats, block_ids[None], chunk[None])
        out.append(drafter.logits(hidden)[0, :, 1:].argmax(-1).cpu())
    return torch.cat(out) if out else torch.zeros(0, block - 1, dtype=torch.long)


def walk_batched(
    drafter: Any, features: torch.Tensor, tokens: Sequence[int], prompt_len: int
) -> list[Cycle]:
    """The chained walk over drafts of every anchor computed in one batched pass."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    anchors = torch.arange(prompt_len, max(prompt_len, len(ids) - 1))
    drafts = anchor_drafts(drafter, features, ids, anchors).tolist()
    return chained_walk(ids.tolist(), prompt_len, lambda a: drafts[a - prompt_len])


def walk_step_by_step(
    drafter: Any, features: torch.Tensor, tokens: Sequence[int], prompt_len: int
) -> list[Cycle]:
    """The reference walk: one drafter call per cycle on the context sliced to H[:a]."""
    device = drafter.fc.weight.device

    def drafts_at(a: int) -> list[int]:
        return drafter.draft_block(features[:a].to(device), int(tokens[a])).tolist()

    return chained_walk(list(tokens), prompt_len, drafts_at)


@dataclass
class TauReport:
    block_size: int
    cycles: list[list[Cycle]] = field(default_factory=list)  # per prompt

    def add(self, prompt_cycles: list[Cycle]) -> None:
        self.cycles.append(prompt_cycles)

    @property
    def tau(self) -> float:
        """Mean over prompts of the mean commit per cycle."""
        per_prompt = [sum(c.committed for c in cs) / len(cs) for cs in self.cycles if cs]
        return sum(per_prompt) / len(per_prompt) if per_prompt else 0.0

    def summary(self) -> dict[str, Any]:
        flat = [c for cs in self.cycles for c in cs]
        positions = range(1, self.block_size)
        # Acceptance at position i: share of cycles accepting draft i among those that accepted
        # drafts 1..i-1 and could verify i; reach: share accepting at least i drafts.
        acceptance, reach = {}, {}
        for i in positions:
            judged = [c for c in flat if c.verifiable >= i]
            tried = [c for c in judged if c.accepted >= i - 1]
            acceptance[str(i)] = _share(sum(c.accepted >= i for c in tried), len(tried))
            reach[str(i)] = _share(sum(c.accepted >= i for c in judged), len(judged))
        histogram = {
            str(n): sum(c.committed == n for c in flat) for n in range(1, self.block_size + 1)
        }
        return {
            "tau": self.tau,
            "tau_per_cycle": _share(sum(c.committed for c in flat), len(flat)),
            "num_prompts": len(self.cycles),
            "num_cycles": len(flat),
            "num_tokens": sum(c.committed for c in flat),
            "acceptance_rate": acceptance,
            "accepted_at_least": reach,
            "commit_histogram": histogram,
        }


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def evaluate_drafter(
    drafter: Any, sequences: Sequence[tuple[Sequence[int], int]], features: Sequence[torch.Tensor]
) -> TauReport:
    """tau over held-out sequences: (prompt + greedy continuation ids, prompt length) each."""
    report = TauReport(block_size=int(drafter.config.block_size))
    for (tokens, prompt_len), feats in zip(sequences, features, strict=True):
        report.add(walk_batched(drafter, feats, tokens, prompt_len))
    return report
