"""What DFlash2 adds to the DFlash drafter (`draftline.drafter.dflash`), and nothing else.

Two parts, both inert until trained (a fresh DFlash2 drafts greedily exactly as a DFlash with
the same weights), under the parameter names of z-lab/dflash `dflash/model.py` and of the
`DFlash2DraftModel` architecture SGLang and vLLM serve (vLLM's class `DFlash2Qwen3ForCausalLM`,
speculative method `dflash`); `dflash_config` adds conv_kernel_size, conv_group_size,
selector_rank and selector_top_k:

- Grouped dynamic convolutions (`GroupedDynamicConv`): each decoder layer's attention and MLP
  are wrapped by a causal convolution of `conv_kernel_size` taps along the block's positions
  (never across blocks: position k sees positions k-taps+1..k of its own block). Its
  coefficients are a learned base kernel per channel (`base_kernel` [2, taps, H]: the input
  side, then the output side; identity at start) plus a dynamic part computed from the
  sublayer's input, one value per group of `conv_group_size` channels (`kernel_projection`,
  zero at start). The input is convolved before the sublayer, its output after.
- The candidate selector (`CandidateSelector`): block output k's top-`selector_top_k` tokens
  under the target's lm_head (the unary logits) are rescored by a low-rank transition from the
  token before it (the anchor for k = 1): score(c) = unary(c) + <A[prev] * P h_k, B[c]>, with A,
  B [vocab, rank] codebooks and P [rank, H]. Decoding walks the block greedily: each output
  takes its best candidate given the one taken before. B starts at zero, so the fresh
  selector keeps the unary order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("dflash", "dflash2")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# Rows of hidden states whose vocabulary logits exist at once when taking the top-k.
ROWS_PER_CHUNK = 1024


@dataclass(frozen=True)
class DFlash2Layout:
    """The four `dflash_config` fields a DFlash2 checkpoint adds to DFlash's."""

    conv_kernel_size: int  # causal taps of each convolution (<= block size)
    conv_group_size: int  # channels that share one dynamic coefficient (divides hidden size)
    selector_rank: int  # rank of the transition codebooks
    selector_top_k: int  # candidates per block output

    def check(self, hidden_size: int, block_size: int, vocab_size: int) -> None:
        if not 0 < self.conv_kernel_size <= block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size}: 1..{block_size}")
        if self.conv_group_size <= 0 or hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide {hidden_size}")
        if self.selector_rank <= 0 or not 0 < self.selector_top_k <= vocab_size:
            raise ValueError(f"selector rank {self.selector_rank}, top_k {self.selector_top_k}")

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, dflash_config: dict[str, Any]) -> DFlash2Layout | None:
        """The layout a `dflash_config` names, or None (a DFlash checkpoint)."""
        if not dflash_config.get("selector_rank"):
            return None
        return cls(**{name: int(dflash_config[name]) for name in cls.__dataclass_fields__})


def grouped_convolve(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Causal convolution along the block: x [..., S, H], dynamic [..., S, taps, groups] (one
    coefficient per output position, tap and group), base [taps, H]. Output position k is
    sum_t (base[t] + dynamic[k, t]) * x[k - t], with x before the block's start taken as 0."""
    blocks = x.unflatten(-1, (x.shape[-1] // group_size, group_size))  # [..., S, G, g]
    out = torch.zeros_like(blocks)
    for tap in range(base.shape[0]):
        shifted = blocks if tap == 0 else F.pad(blocks[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))
        kernel = base[tap].view(blocks.shape[-2:]).to(x.dtype) + dynamic[..., tap, :, None]
        out = out + kernel * shifted
    return out.flatten(-2)


class GroupedDynamicConv(nn.Module):
    """The convolution around one sublayer: `prepare` convolves its input and returns the
    output side's dynamic kernel, computed from the same input; `finish` convolves its output."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity: tap 0 weighs 1, no dynamic part."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        convolved = grouped_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size)
        return convolved, dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_convolve(y, dynamic, self.base_kernel[1], self.group_size)


def wrap(conv: GroupedDynamicConv | None, sublayer: nn.Module, x: torch.Tensor, *args: Any):
    """sublayer(x, *args), inside `conv` when there is one (DFlash2), as is when not (DFlash)."""
    if conv is None:
        return sublayer(x, *args)
    x, dynamic = conv.prepare(x)
    return conv.finish(sublayer(x, *args), dynamic)


class CandidateSelector(nn.Module):
    """Low-rank transition scores over each block output's top-k unary candidates."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """A and P random, B zero: no transition until B learns (SpecForge's init)."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.zeros_(self.successor_codebook)

    def forward(
        self,
        hidden: torch.Tensor,
        candidates: torch.Tensor,
        unary: torch.Tensor,
        predecessors: torch.Tensor,
    ) -> torch.Tensor:
        """[..., K] scores of `candidates` [..., K] (unary logits `unary`) after the tokens
        `predecessors` [...], for the block outputs `hidden` [..., H]."""
        state = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)
        transition = (state[..., None, :] * self.successor_codebook[candidates]).sum(-1)
        return unary.float() + transition.float()


def attach(layers: nn.ModuleList, config: Any) -> CandidateSelector | None:
    """DFlash2's parts on a drafter of `config` (a `DFlashConfig`): a convolution around each
    decoder layer's attention and MLP, and the candidate selector, returned; none for DFlash."""
    layout = config.dflash2
    if layout is None:
        return None
    for layer in layers:
        for name in ("attention_conv", "mlp_conv"):
            conv = GroupedDynamicConv(
                config.hidden_size, layout.conv_kernel_size, layout.conv_group_size
            )
            setattr(layer, name, conv)
    return CandidateSelector(
        config.hidden_size, config.vocab_size, layout.selector_rank, layout.selector_top_k
    )


def reset_parameters(drafter: nn.Module) -> None:
    """DFlash2's parts back to their no-op start (after the drafter initialised its linears)."""
    for module in drafter.modules():
        if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
            module.reset_parameters()


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Autocast's dtype when it is on (the head is not copied to fp32 to meet the final norm's
    fp32 output), else the hidden states' (as `objective.matmul_dtype`)."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


@torch.no_grad()
def top_candidates(hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [..., k] of the k largest unary logits of each row of `hidden` [..., H], in chunks
    of rows so that the vocabulary-sized logits stay bounded."""
    dtype = _matmul_dtype(hidden)
    flat, head = hidden.reshape(-1, hidden.shape[-1]).to(dtype), lm_head_weight.to(dtype)
    ids = [
        F.linear(flat[i : i + ROWS_PER_CHUNK], head).topk(k, dim=-1).indices
        for i in range(0, flat.shape[0], ROWS_PER_CHUNK)
    ]
    return torch.cat(ids).view(*hidden.shape[:-1], k)


class _CandidateLogits(torch.autograd.Function):
    """h . W[c] for K candidates per row, in chunks of rows; the backward gathers the head's
    rows again instead of keeping them ([rows, K, H] would be 4.7 GiB for a 27B step)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, head: torch.Tensor, ids: torch.Tensor):
        ctx.save_for_backward(head, ids)
        ctx.dtype = hidden.dtype
        out = hidden.new_empty(ids.shape, dtype=head.dtype)
        for i in range(0, ids.shape[0], ROWS_PER_CHUNK):
            rows = slice(i, i + ROWS_PER_CHUNK)
            out[rows] = (head[ids[rows]] @ hidden[rows, :, None].to(head.dtype))[..., 0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        head, ids = ctx.saved_tensors
        grad_hidden = grad.new_empty(ids.shape[0], head.shape[1], dtype=ctx.dtype)
        for i in range(0, ids.shape[0], ROWS_PER_CHUNK):
            rows = slice(i, i + ROWS_PER_CHUNK)
            grad_hidden[rows] = (grad[rows, None, :].to(head.dtype) @ head[ids[rows]])[:, 0]
        return grad_hidden, None, None


def unary_logits(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """[..., K] the candidates' logits h . W[c], differentiable in `hidden`: the head's rows
    are gathered, never the whole vocabulary's logits."""
    head = lm_head_weight.detach().to(_matmul_dtype(hidden))
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = candidates.reshape(-1, candidates.shape[-1])
    return _CandidateLogits.apply(flat, head, ids).view(candidates.shape)


def candidate_scores(
    drafter: Any, hidden: torch.Tensor, predecessors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates [..., K], selector scores [..., K]) of block outputs `hidden` [..., H] given
    the token before each (`predecessors` [...])."""
    selector, head = drafter.candidate_selector, drafter.target.lm_head_weight
    candidates = top_candidates(hidden, head, selector.top_k)
    unary = unary_logits(hidden, head, candidates)
    return candidates, selector(hidden, candidates, unary, predecessors)


@torch.no_grad()
def greedy_drafts(drafter: Any, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [n, S-1] from block outputs 1..S-1 `hidden` [n, S-1, H] of blocks whose
    anchors hold `anchor_ids` [n]: the lm_head's argmax (DFlash), or the selector's walk
    (DFlash2: each output's best candidate given the draft before it)."""
    if drafter.candidate_selector is None:
        return drafter.logits(hidden).argmax(-1)
    previous, drafts = anchor_ids, []
    for k in range(hidden.shape[1]):
        candidates, scores = candidate_scores(drafter, hidden[:, k], previous)
        previous = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
        drafts.append(previous)
    return torch.stack(drafts, dim=1)


@torch.no_grad()
def proposal_logits(drafter: Any, hidden: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
    """Logits [..., vocab] the drafter proposes from at block outputs `hidden` [..., H] when the
    tokens before them are `predecessors` [...]: the lm_head's (DFlash); the selector's scores
    on the top-k candidates and -inf elsewhere (DFlash2). Along a block whose earlier drafts were
    accepted, the predecessors are the target's own tokens, so its argmax is the greedy walk's
    draft and its softmax the distribution a sampling server draws the draft from."""
    if drafter.candidate_selector is None:
        return drafter.logits(hidden)
    candidates, scores = candidate_scores(drafter, hidden, predecessors)
    vocab = drafter.target.lm_head_weight.shape[0]
    out = torch.full((*hidden.shape[:-1], vocab), float("-inf"), device=hidden.device)
    return out.scatter(-1, candidates, scores)
