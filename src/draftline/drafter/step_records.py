"""What each training step records (loss, accuracy per block position, DFlash2's selector)
and where it goes: dvclive's step series on the main process."""

from __future__ import annotations

from pathlib import Path

import torch

from draftline.drafter.objective import LossParts

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


def add_parts(sums: torch.Tensor, parts: LossParts, block: int) -> None:
    """sums: [loss, tokens, -, selector loss, then B each of: greedy hits, supervised outputs,
    selector top-k recall, selector top-1 recall]."""
    sums[4 : 4 + block] += parts.correct.double()
    sums[4 + block : 4 + 2 * block] += parts.counted.double()
    if parts.selector is not None:
        sums[3] += parts.selector.weighted_ce.detach().double()
        sums[4 + 2 * block : 4 + 3 * block] += parts.selector.in_top_k.double()
        sums[4 + 3 * block :] += parts.selector.top1.double()


def selector_record(
    sums: torch.Tensor, total_weight: torch.Tensor, block: int, alpha: float
) -> dict[str, float]:
    """DFlash2's selector: its loss, and how often the gold token is among the candidates
    (recall@top-k, the selector's ceiling) and is the one it scores best (recall@1)."""
    counted = sums[4 + block : 4 + 2 * block].sum().clamp(min=1)
    return {
        "selector_loss": float(sums[3] / total_weight),
        "selector_alpha": alpha,
        "selector_recall_topk": float(sums[4 + 2 * block : 4 + 3 * block].sum() / counted),
        "selector_recall_top1": float(sums[4 + 3 * block :].sum() / counted),
    }


def step_record(
    sums: torch.Tensor, total_weight: torch.Tensor, block: int, lr: float, grad_norm: float
) -> dict[str, float]:
    correct, counted = sums[4 : 4 + block], sums[4 + block : 4 + 2 * block]
    record = {
        "loss": float(sums[0] / total_weight),
        "acc": float(correct[1:].sum() / counted[1:].sum().clamp(min=1)),
        "lr": lr,
        "grad_norm": grad_norm,
    }
    for k in range(1, block):
        record[f"{POSITION_PREFIX}{k}"] = float(correct[k] / counted[k].clamp(min=1))
    return record
