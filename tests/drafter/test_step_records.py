"""A step's statistics by name: each micro-batch's parts land in their own named sums, the named
sums are the one flat tensor the processes add up in a single all_reduce, and the step's record
is made from them."""

from __future__ import annotations

import pytest
import torch

from draftline.drafter.objective import LossParts
from draftline.drafter.selector_objective import SelectorParts
from draftline.drafter.step_records import StepSums, selector_record, step_record

BLOCK = 4
NAMES = (
    "weighted_ce", "tokens", "selector_ce", "correct", "counted", "selector_in_top_k",
    "selector_top1",
)  # fmt: skip


def parts(scale: float, selector: bool = True) -> LossParts:
    positions = torch.arange(BLOCK, dtype=torch.float32)
    chosen = None
    if selector:
        chosen = SelectorParts(
            torch.tensor(0.5 * scale), scale * positions, positions, 2 * positions + 1
        )
    return LossParts(torch.tensor(2.0 * scale), positions, 2 * positions + 1, chosen)


def test_the_named_sums_are_the_flat_tensor_each_once() -> None:
    """Every statistic is a view into `flat`, none overlapping and none left out: summing
    `flat` over the processes sums every named statistic."""
    sums = StepSums(BLOCK, "cpu")
    views = [getattr(sums, name) for name in NAMES]
    assert sum(v.numel() for v in views) == sums.flat.numel()
    for number, view in enumerate(views):
        view.fill_(number + 1)
    assert torch.equal(torch.cat(views), sums.flat)
    assert sorted(set(sums.flat.tolist())) == [float(n + 1) for n in range(len(NAMES))]


def test_micro_batches_add_into_their_named_sums() -> None:
    sums = StepSums(BLOCK, "cpu")
    sums.add(parts(1.0), num_tokens=10)
    sums.add(parts(2.0), num_tokens=5)
    positions = torch.arange(BLOCK, dtype=torch.float64)
    assert sums.weighted_ce.item() == 6.0 and sums.tokens.item() == 15
    assert sums.selector_ce.item() == 1.5
    assert torch.equal(sums.correct, 2 * positions)
    assert torch.equal(sums.counted, 2 * (2 * positions + 1))
    assert torch.equal(sums.selector_in_top_k, 3 * positions)
    assert torch.equal(sums.selector_top1, 2 * positions)
    sums.sum_over_processes()  # a world of one: unchanged
    assert sums.tokens.item() == 15


def test_the_record_is_made_from_the_named_sums() -> None:
    sums = StepSums(BLOCK, "cpu")
    sums.add(parts(1.0), num_tokens=10)
    total = torch.tensor(4.0)
    record = step_record(sums, total, lr=0.1, grad_norm=2.0)
    # correct [0, 1, 2, 3] of counted [1, 3, 5, 7]; position 0 (the given token) left out.
    assert record["loss"] == 0.5 and record["acc"] == pytest.approx(6 / 15)
    assert [record[f"acc_pos/{k}"] for k in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 5, 3 / 7])
    assert (record["lr"], record["grad_norm"]) == (0.1, 2.0)
    selector = selector_record(sums, total, alpha=0.25)
    assert selector["selector_loss"] == 0.125 and selector["selector_alpha"] == 0.25
    assert selector["selector_recall_topk"] == pytest.approx(6 / 16)
    assert selector["selector_recall_top1"] == pytest.approx(6 / 16)
