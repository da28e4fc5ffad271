"""What each training step records (loss, accuracy per block position, DFlash2's selector):
the sums it gathers over micro-batches and processes (`StepSums`), the record made of them,
and where that goes: dvclive's step series on the main process."""

from __future__ import annotations

from pathlib import Path

import torch

from draftline.drafter.objective import LossParts
from draftline.runtime import distributed

POSITION_PREFIX = "acc_pos/"  # history keys acc_pos/1 .. acc_pos/B-1: accuracy per position


class Metrics:
    """dvclive on the main process (`Live(dir, dvcyaml=False)`: dvc.yaml declares the plots).

    A resumed run rewrites the plots from the checkpoint's history: DVC deletes a stage's plots
    before it reruns the stage, and rows logged after the checkpoint are redone anyway.
    """

    def __init__(
        self, live_dir: Path | None, history: list[dict[str, float]], enabled: bool
    ) -> None:
        self.live = None
        if live_dir is None or not enabled:
            return
        from dvclive import Live

        self.live = Live(str(live_dir), dvcyaml=False, save_dvc_exp=False)
        for step, record in enumerate(history):
            self.log(step, record)

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.live is None:
            return
        self.live.step = step
        for name, value in values.items():
            if not name.startswith(POSITION_PREFIX):  # charted from one table (stages/train.py)
                self.live.log_metric(name, value)

    def close(self) -> None:
        if self.live is not None:
            self.live.end()


class StepSums:
    """One step's statistics, summed over its micro-batches and then over every process.

    Named views into one flat float64 tensor: the processes add theirs with a single
    all_reduce per step (one collective, not one per statistic, on the step's critical path).
    """

    def __init__(self, block: int, device: torch.device | str) -> None:
        self.block = block
        self.flat = torch.zeros(3 + 4 * block, dtype=torch.float64, device=device)
        views = self.flat.split([1, 1, 1, block, block, block, block])  # views: no copies
        self.weighted_ce, self.tokens, self.selector_ce = views[:3]  # [1] each
        # [B] each, per block position: greedy hits, supervised outputs, and DFlash2's
        # selector: the gold token among its top-k candidates, and its top-1.
        self.correct, self.counted, self.selector_in_top_k, self.selector_top1 = views[3:]

    def add(self, parts: LossParts, num_tokens: int) -> None:
        """One micro-batch's parts (`num_tokens`: its real tokens)."""
        self.weighted_ce += parts.weighted_ce.detach().double()
        self.tokens += num_tokens
        self.correct += parts.correct.double()
        self.counted += parts.counted.double()
        if parts.selector is not None:
            self.selector_ce += parts.selector.weighted_ce.detach().double()
            self.selector_in_top_k += parts.selector.in_top_k.double()
            self.selector_top1 += parts.selector.top1.double()

    def sum_over_processes(self) -> None:
        distributed.all_sum_tensor(self.flat)  # in place: the views see the sums


def selector_record(sums: StepSums, total_weight: torch.Tensor, alpha: float) -> dict[str, float]:
    """DFlash2's selector: its loss, and how often the gold token is among the candidates
    (recall@top-k, the selector's ceiling) and is the one it scores best (recall@1)."""
    counted = sums.counted.sum().clamp(min=1)
    return {
        "selector_loss": float(sums.selector_ce / total_weight),
        "selector_alpha": alpha,
        "selector_recall_topk": float(sums.selector_in_top_k.sum() / counted),
        "selector_recall_top1": float(sums.selector_top1.sum() / counted),
    }


def step_record(
    sums: StepSums, total_weight: torch.Tensor, lr: float, grad_norm: float
) -> dict[str, float]:
    """Loss, accuracy (positions 1..B-1: position 0 is the given token), lr, gradient norm,
    and accuracy per position."""
    correct, counted = sums.correct, sums.counted
    record = {
        "loss": float(sums.weighted_ce / total_weight),
        "acc": float(correct[1:].sum() / counted[1:].sum().clamp(min=1)),
        "lr": lr,
        "grad_norm": grad_norm,
    }
    for k in range(1, sums.block):
        record[f"{POSITION_PREFIX}{k}"] = float(correct[k] / counted[k].clamp(min=1))
    return record
