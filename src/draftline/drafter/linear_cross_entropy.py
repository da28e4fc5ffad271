"""Weighted cross-entropy of a frozen linear head that never materialises the full logits.

`linear_cross_entropy(hidden [n, H], head [V, H], labels [n], weights [n])` returns the sum of
`weights * CE(hidden @ head.T, labels)` and the greedy hits per row, as if the [n, V] logits
had been built, without building them:

- the torch path (`ChunkedLinearCrossEntropy`, every device): rows go in chunks; a chunk's
  logits are computed in the head's dtype (the compute dtype: bf16 in production, so the head is
  never copied to fp32), promoted to fp32 for the softmax, reduced to the chunk's CE and hits
  and dropped. The backward recomputes each chunk's logits to form the gradient of the hidden
  states (from each row's log-sum-exp, kept: [n] floats); nothing vocabulary-sized is kept
  between the forward and the backward. Rows of weight 0 (block output 0, padding, unsupervised
  labels) are skipped: they add nothing to the loss or its gradient. The head gets no
  gradient: it is the target's, frozen.
- Liger's fused linear cross-entropy (Triton; pip `liger-kernel`, extra `[liger]`) where it runs:
  a CUDA device with a Liger that returns per-token losses with their gradient and the
  predicted tokens.

Both equal the plain loss, value and gradient (tests/drafter/test_linear_cross_entropy.py).
"""

from __future__ import annotations

import math
import re
from functools import cache
from importlib.metadata import version
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

# Chunks are sized so that one chunk's logits take about as much memory as the hidden states
# they come from (Liger's rule): ceil(V / H) chunks, at least this many rows each (on a CPU,
# chunks of 128-256 rows ran 2-4x slower per row than chunks of 1024 at vocab 4096).
MIN_TOKENS_PER_CHUNK = 1024
KERNELS = ("auto", "torch", "liger")
LIGER_RELEASE = (0, 8, 2)


def tokens_per_chunk(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: a power of two near rows / ceil(V / H), at least MIN_TOKENS_PER_CHUNK."""
    chunks = max(1, math.ceil(vocab / hidden))
    wanted = max(1, math.ceil(rows / chunks))
    return max(MIN_TOKENS_PER_CHUNK, 1 << (wanted - 1).bit_length())


def _chunk_logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """fp32 logits [c, V] of one chunk; the matmul runs in the head's dtype."""
    return torch.mm(hidden.to(head.dtype), head.t()).float()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of weights * CE(hidden @ head.T, labels) and hits, chunk by chunk (torch path)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        head: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(labels.shape, dtype=torch.bool, device=hidden.device)
        # Per row, for the backward's softmax: [n] floats, not [n, V].
        lse = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        # The dtypes are chosen here, not by autocast (the backward runs without it).
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, labels.numel(), chunk):
                rows = slice(start, start + chunk)
                logits = _chunk_logits(hidden[rows], head)
                target = logits.gather(1, labels[rows, None]).squeeze(1)
                hits[rows] = logits.argmax(-1) == labels[rows]
                # log-sum-exp in place: no second vocab-sized buffer.
                top = logits.amax(-1, keepdim=True)
                lse[rows] = logits.sub_(top).exp_().sum(-1).log_() + top.squeeze(1)
                total += ((lse[rows] - target) * weights[rows]).sum()
                del logits
        ctx.save_for_backward(hidden, head, labels, weights, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_total: torch.Tensor, _grad_hits: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        hidden, head, labels, weights, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        grad = torch.empty_like(hidden)
        scale = weights * grad_total.float()
        for start in range(0, labels.numel(), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            # d(w * CE)/d logits = w * (softmax - onehot), built in place in the chunk's logits.
            probs = _chunk_logits(hidden[rows], head).sub_(lse[rows, None]).exp_()
            probs[torch.arange(probs.shape[0], device=probs.device), labels[rows]] -= 1.0
            probs *= scale[rows, None]
            grad[rows] = torch.mm(probs.to(head.dtype), head).to(hidden.dtype)
            del probs
        return grad, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: (sum of weights * CE in fp32, hits [n] bool); rows of weight 0 skipped.

    Fake tensors (memory planning) carry no weights to look at: every row is then computed,
    the worst case, so a planned peak is never below the real one.
    """
    weights = weights.float()
    keep = None if is_fake(weights) else (weights > 0).nonzero().squeeze(1)
    if keep is not None and keep.numel() < labels.numel():
        kept_hidden = hidden.index_select(0, keep)
        total, kept_hits = ChunkedLinearCrossEntropy.apply(
            kept_hidden,
            head,
            labels.index_select(0, keep),
            weights.index_select(0, keep),
            chunk or tokens_per_chunk(keep.numel(), head.shape[0], head.shape[1]),
        )
        hits = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
        return total, hits.index_copy(0, keep, kept_hits)
    size = chunk or tokens_per_chunk(labels.numel(), head.shape[0], head.shape[1])
    return ChunkedLinearCrossEntropy.apply(hidden, head, labels, weights, size)


@cache
def liger_function() -> Any | None:
    """Liger's fused linear cross-entropy, if a release that weights per-token losses right is
    installed: before 0.8.2 the backward of reduction "none" scaled every row by one factor."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
    except ImportError:
        return None
    release = tuple(int(x) for x in re.findall(r"\d+", version("liger-kernel"))[:3])
    return LigerFusedLinearCrossEntropyFunction if release >= LIGER_RELEASE else None


def liger_runs(hidden: torch.Tensor) -> bool:
    """Whether the Liger kernel can take these tensors: CUDA, real (not fake) and installed."""
    return hidden.device.type == "cuda" and not is_fake(hidden) and liger_function() is not None


def liger_linear_cross_entropy(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Liger path: per-token CE (gradient folded per token in its backward), weighted here."""
    function = liger_function()
    if function is None:
        raise RuntimeError("kernel liger needs liger-kernel>=0.8.2: pip install 'draftline[liger]'")
    # forward(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
    # label_smoothing, reduction, softcap, return_z_loss, accum_dtype, use_token_scaling,
    # return_token_accuracy, return_predicted_tokens)
    loss, _z, _accuracy, predicted = function.apply(
        hidden.to(head.dtype), head, labels, None, None, -100, 0.0, 0.0, "none", None, False,
        None, False, False, True,
    )  # fmt: skip
    total = (loss.float() * weights.float()).sum()
    return total, predicted.detach() == labels


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    kernel: str = "auto",
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weights * CE(hidden @ head.T, labels) in fp32, greedy hits [n] bool).

    hidden [n, H] (any float dtype; its gradient comes back in it), head [V, H] frozen in the
    compute dtype, labels [n] long, weights [n]. kernel: "auto" (Liger where it runs, else
    torch), "torch" or "liger". chunk: rows per chunk of the torch path (None: by size).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    if kernel == "liger" or (kernel == "auto" and liger_runs(hidden)):
        return liger_linear_cross_entropy(hidden, head, labels, weights)
    return chunked_linear_cross_entropy(hidden, head, labels, weights, chunk)
