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

Acceptance at a sampling temperature (speculative sampling, Leviathan et al. 2023, Chen et al.
2023, as SGLang verifies): at anchor a the drafter proposes token j of the block from its
distribution q_j (temperature, top-k, top-p applied, as the server applies them) and the target,
whose distribution there is p_j, accepts it with probability min(1, p_j(x)/q_j(x)); the first
rejection ends the cycle, which commits one token more than it accepted. Draft j is accepted,
given the ones before it, with probability alpha_j = sum_x min(p_j(x), q_j(x)), so

    E[commit at a] = 1 + sum_{k=1..K} prod_{j<=k} alpha_j,   K = min(B-1, r-1)

(r: tokens left after the anchor, as above). p_j is the target's distribution at position a+j
given the held-out continuation (teacher forcing; the accepted drafts are the target's own
tokens, so that prefix is the one the server would extend), q_j the drafter's from the context
before a. `tau_sampled` averages E over every anchor of a prompt, then over prompts. At
temperature 0 both are one-hot and E is the greedy commit at a.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draftline.drafter.dflash2 import proposal_logits

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
def anchor_logits(
    drafter: Any, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(anchors, drafter logits [n, B-1, vocab]) of the blocks at `anchors` (sorted), in
    chunks that bound the logits' memory. DFlash2: the selector's, each output given the
    sequence's token before it (`dflash2.proposal_logits`).

    features: [T, K*H] of the whole sequence; block j only sees positions < anchors[j].
    """
    block = drafter.config.block_size
    per_pass = max(1, LOGITS_PER_PASS // (block * drafter.config.vocab_size))
    device = drafter.fc.weight.device
    feats, ids = features[None].to(device), tokens.to(device)
    for start in range(0, len(anchors), per_pass):
        chunk = anchors[start : start + per_pass].to(device)
        block_ids = drafter.block_input_ids(ids[chunk])
        hidden = drafter(feats, block_ids[None], chunk[None])[0, :, 1:]
        before = chunk[:, None] + torch.arange(block - 1, device=device)
        yield chunk, proposal_logits(drafter, hidden, ids[before.clamp(max=len(ids) - 1)]).float()


def anchor_drafts(
    drafter: Any, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Greedy drafts [N, B-1] of the blocks anchored at `anchors` (sorted)."""
    chunks = anchor_logits(drafter, features, tokens, anchors)
    out = [logits.argmax(-1).cpu() for _, logits in chunks]
    block = drafter.config.block_size
    return torch.cat(out) if out else torch.zeros(0, block - 1, dtype=torch.long)


@dataclass(frozen=True)
class Sampling:
    """What the server samples with: temperature (0: greedy), top-p, top-k (<= 0: all)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1


def sampling_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution a token is drawn from: logits / temperature, softmax, then the top-k
    and top-p (smallest set reaching p) cuts, renormalised; one-hot argmax at temperature 0."""
    if sampling.temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if 0 < sampling.top_k < probs.shape[-1]:
        kth = probs.topk(sampling.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
        ordered = torch.where(before < sampling.top_p * ordered.sum(-1, keepdim=True), ordered, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return probs / probs.sum(-1, keepdim=True)


def expected_commit(alpha: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """E[commit] per anchor: 1 + sum_{k<=K} prod_{j<=k} alpha_j, K = min(B-1, left-1).

    alpha: [n, B-1] acceptance probability of each draft given the ones before it; left: [n]
    tokens after each anchor.
    """
    reach = alpha.cumprod(-1)
    k = torch.arange(1, alpha.shape[-1] + 1, device=alpha.device)
    counted = k[None, :] <= (left[:, None] - 1)
    return 1 + (reach * counted).sum(-1)


@torch.no_grad()
def target_logits(target: Any, tokens: Sequence[int], start: int) -> torch.Tensor:
    """The target's logits [len - start, vocab] at positions start.. of `tokens` (row i predicts
    token start + i + 1), in one forward."""
    device = next(target.parameters()).device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device)[None]
    out = target(input_ids=ids, logits_to_keep=len(tokens) - start, use_cache=False)
    return out.logits[0].float()


def scored_anchors(
    drafter: Any,
    features: torch.Tensor,
    tokens: Sequence[int],
    prompt_len: int,
    logits: torch.Tensor | None = None,
    sampling: Sampling | None = None,
) -> tuple[list[list[int]], list[float]]:
    """Greedy drafts [B-1] and, given the target's `logits` (`target_logits(target, tokens,
    prompt_len)`) and a `sampling`, the expected commit (see the module docstring) at every
    anchor of the continuation, from one drafter pass over the anchors."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    anchors = torch.arange(prompt_len, max(prompt_len, len(ids) - 1))
    drafts: list[list[int]] = []
    commits: list[float] = []
    for chunk, draft_logits in anchor_logits(drafter, features, ids, anchors):
        drafts.extend(draft_logits.argmax(-1).cpu().tolist())
        if logits is None or sampling is None:
            continue
        width = draft_logits.shape[1]
        # Draft j of the block at anchor a is verified by the target's row for position a+j-1.
        rows = chunk[:, None] - prompt_len + torch.arange(width, device=chunk.device)[None]
        rows = rows.clamp(max=logits.shape[0] - 1).to(logits.device)
        p = sampling_distribution(logits[rows], sampling)
        q = sampling_distribution(draft_logits.to(logits.device), sampling)
        alpha = torch.minimum(p, q).sum(-1)
        left = (len(ids) - 1 - chunk).to(logits.device)
        commits.extend(expected_commit(alpha, left).tolist())
    return drafts, commits


def sampled_commits(
    drafter: Any,
    features: torch.Tensor,
    tokens: Sequence[int],
    prompt_len: int,
    logits: torch.Tensor,
    sampling: Sampling,
) -> list[float]:
    """Expected commit at every anchor of the continuation under speculative sampling."""
    return scored_anchors(drafter, features, tokens, prompt_len, logits, sampling)[1]


def walk_batched(
    drafter: Any, features: torch.Tensor, tokens: Sequence[int], prompt_len: int
) -> list[Cycle]:
    """The chained walk over drafts of every anchor computed in one batched pass."""
    drafts = scored_anchors(drafter, features, tokens, prompt_len)[0]
    return chained_walk(list(tokens), prompt_len, lambda a: drafts[a - prompt_len])


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
    sampled: list[list[float]] = field(default_factory=list)  # per prompt: E[commit] per anchor

    def add(self, prompt_cycles: list[Cycle], sampled: list[float] | None = None) -> None:
        self.cycles.append(prompt_cycles)
        if sampled is not None:
            self.sampled.append(sampled)

    def subset(self, indices: Sequence[int]) -> TauReport:
        """The report of some of the prompts (one thinking mode, one source)."""
        sampled = [self.sampled[i] for i in indices] if self.sampled else []
        return TauReport(self.block_size, [self.cycles[i] for i in indices], sampled)

    @property
    def tau_sampled(self) -> float | None:
        """Mean over prompts of the mean expected commit per anchor (None: not measured)."""
        per_prompt = [sum(c) / len(c) for c in self.sampled if c]
        return sum(per_prompt) / len(per_prompt) if per_prompt else None

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
            "tau_sampled": self.tau_sampled,
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
    drafter: Any,
    sequences: Sequence[tuple[Sequence[int], int]],
    features: Sequence[torch.Tensor],
    logits: Sequence[torch.Tensor] | None = None,
    sampling: Sampling | None = None,
) -> TauReport:
    """tau over held-out sequences: (prompt + greedy continuation ids, prompt length) each; with
    the target's `logits` of each (`target_logits`) and a `sampling`, also tau_sampled."""
    report = TauReport(block_size=int(drafter.config.block_size))
    sampled = logits is not None and sampling is not None
    for i, ((tokens, prompt_len), feats) in enumerate(zip(sequences, features, strict=True)):
        target = logits[i] if logits is not None else None
        drafts, commits = scored_anchors(drafter, feats, tokens, prompt_len, target, sampling)
        cycles = chained_walk(list(tokens), prompt_len, lambda a: drafts[a - prompt_len])  # noqa: B023
        report.add(cycles, commits if sampled else None)
    return report
