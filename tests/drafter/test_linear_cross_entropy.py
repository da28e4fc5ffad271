"""The fused linear cross-entropy equals the plain loss (full logits, F.cross_entropy) in value,
hits and gradient, on the heads of the embedded targets, and never builds the full logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.largest_allocation import LargestAllocation

from draftline.drafter.build import load_target_head
from draftline.drafter.linear_cross_entropy import (
    chunked_linear_cross_entropy,
    liger_function,
    linear_cross_entropy,
    tokens_per_chunk,
)
from draftline.drafter.objective import block_loss, position_weights

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[2]


def target_head(name: str) -> torch.Tensor:
    """The lm_head of a committed embedded target (tiny-target: fp32, tied; twin: bf16)."""
    return load_target_head({"path": str(REPO_ROOT / "models" / name)}).lm_head_weight


def case(
    head: torch.Tensor, blocks: int = 24, block: int = 8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [1, N, B, H] at the head's scale, labels, DFlash weights with some zeros."""
    g = torch.Generator().manual_seed(seed)
    vocab, size = head.shape
    hidden = torch.randn(1, blocks, block, size, generator=g) * 2.0
    labels = torch.randint(0, vocab, (1, blocks, block), generator=g)
    weights = position_weights(block, 4.0).expand(1, blocks, block).clone()
    weights[0, -3:] = 0  # padding blocks
    weights[0, 2, 5:] = 0  # labels past the loss mask
    return hidden, labels, weights


def plain_loss(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full logits in the head's dtype, fp32 cross-entropy."""
    logits = F.linear(hidden.to(head.dtype), head).float().reshape(-1, head.shape[0])
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    return (ce * weights.reshape(-1)).sum(), logits.argmax(-1) == labels.reshape(-1)


@pytest.mark.parametrize("chunk", [None, 5, 64, 10_000])
def test_chunked_loss_equals_the_plain_loss_on_the_tiny_targets_head(chunk):
    head = target_head("tiny-target")
    hidden, labels, weights = case(head)
    leaf = hidden.clone().requires_grad_(True)
    parts = block_loss(leaf, head, labels, weights, tokens_per_chunk=chunk, kernel="torch")
    parts.weighted_ce.backward()
    plain = hidden.clone().requires_grad_(True)
    expected, hits = plain_loss(plain, head, labels, weights)
    expected.backward()
    assert torch.allclose(parts.weighted_ce, expected, rtol=1e-5)
    supervised = weights.reshape(-1) > 0
    hits_per_position = (hits & supervised).view(-1, labels.shape[-1]).sum(0).float()
    assert torch.equal(parts.correct, hits_per_position)
    assert torch.allclose(leaf.grad, plain.grad, rtol=1e-4, atol=1e-6)
    assert (leaf.grad[0, -3:] == 0).all()  # padding blocks get no gradient


def test_chunked_loss_equals_the_plain_loss_on_the_twins_bf16_head_under_autocast():
    """The twin's head is bf16 like the real target's: the matmul runs in bf16 both ways."""
    head = target_head("tiny-qwen36")
    assert head.dtype == torch.bfloat16
    hidden, labels, weights = case(head, blocks=12)
    leaf = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = block_loss(leaf, head, labels, weights, tokens_per_chunk=16, kernel="torch")
    parts.weighted_ce.backward()
    plain = hidden.clone().requires_grad_(True)
    expected, _ = plain_loss(plain, head, labels, weights)
    expected.backward()
    assert leaf.grad.dtype == torch.float32
    assert torch.allclose(parts.weighted_ce, expected, rtol=1e-5)
    # Both gradients go through a bf16 matmul; they agree to bf16's precision.
    assert torch.allclose(leaf.grad, plain.grad, rtol=2e-2, atol=1e-3 * plain.grad.abs().max())


def test_the_scaled_loss_gives_the_scaled_gradient_and_the_head_none():
    """Training backpropagates loss * world / total weight: the upstream factor carries through."""
    head = target_head("tiny-target").clone().requires_grad_(True)
    hidden, labels, weights = case(head.detach(), blocks=6)
    flat = hidden.reshape(-1, hidden.shape[-1]).requires_grad_(True)
    total, _ = chunked_linear_cross_entropy(flat, head, labels.reshape(-1), weights.reshape(-1), 7)
    (total * 0.25).backward()
    plain = hidden.reshape(-1, hidden.shape[-1]).clone().requires_grad_(True)
    (plain_loss(plain, head.detach(), labels, weights)[0] * 0.25).backward()
    assert torch.allclose(flat.grad, plain.grad, rtol=1e-4, atol=1e-7)
    assert head.grad is None


def test_a_batch_without_supervised_labels_has_zero_loss_and_gradient():
    head = target_head("tiny-target")
    hidden, labels, weights = case(head, blocks=4)
    leaf = hidden.clone().requires_grad_(True)
    parts = block_loss(leaf, head, labels, torch.zeros_like(weights), kernel="torch")
    parts.weighted_ce.backward()
    assert parts.weighted_ce == 0 and parts.counted.sum() == 0
    assert torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_no_tensor_the_size_of_the_full_logits_is_allocated():
    head = target_head("tiny-target")
    hidden, labels, weights = case(head, blocks=32)
    rows = labels.numel()
    leaf = hidden.clone().requires_grad_(True)
    chunk = 16
    with LargestAllocation() as seen:
        parts = block_loss(leaf, head, labels, weights, tokens_per_chunk=chunk, kernel="torch")
        parts.weighted_ce.backward()
    assert seen.largest[0] <= chunk * head.shape[0] * 4 < rows * head.shape[0] * 4, seen.largest


def test_chunks_are_sized_by_vocabulary_over_hidden():
    assert tokens_per_chunk(32768, 248320, 5120) == 1024  # 49 chunks at the production shape
    assert tokens_per_chunk(65536, 4096, 256) == 4096
    assert tokens_per_chunk(4096, 4096, 256) == 1024  # never below the minimum


def test_an_unknown_kernel_is_refused():
    head = target_head("tiny-target")
    hidden, labels, weights = case(head, blocks=4)
    with pytest.raises(ValueError, match="kernel"):
        linear_cross_entropy(hidden.reshape(-1, head.shape[1]), head, labels, weights, kernel="x")


@pytest.mark.skipif(
    not torch.cuda.is_available() or liger_function() is None,
    reason="Liger's fused linear cross-entropy is a Triton kernel: it needs a CUDA GPU and "
    "liger-kernel (extra [liger]); the chunked torch path is the one tested on CPU",
)
def test_liger_kernel_equals_the_plain_loss_and_the_torch_path():
    head = target_head("tiny-qwen36").cuda()
    hidden, labels, weights = (t.cuda() for t in case(head, blocks=64, block=16))
    results = {}
    for kernel in ("liger", "torch"):
        leaf = hidden.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the production path: bf16 head
            parts = block_loss(leaf, head, labels, weights, kernel=kernel)
        parts.weighted_ce.backward()
        results[kernel] = (parts.weighted_ce.detach(), parts.correct, leaf.grad)
    plain = hidden.clone().requires_grad_(True)
    expected, _ = plain_loss(plain, head, labels, weights)
    expected.backward()
    scale = plain.grad.abs().max()
    for loss, correct, grad in results.values():
        assert torch.allclose(loss, expected, rtol=1e-3)
        assert torch.allclose(grad, plain.grad, rtol=2e-2, atol=2e-3 * scale)
        assert (correct - results["torch"][1]).abs().sum() <= 2  # bf16 ties may flip
