"""The largest tensor a block of code allocates, seen op by op (tests that a computation never
builds a full copy of something large, e.g. a model's whole logits or an fp32 copy of its head)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op allocates (outputs that are views of inputs excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                size = t.untyped_storage().nbytes()
                if size > self.largest[0]:
                    self.largest = (size, f"{func}: {t.dtype} {tuple(t.shape)}")
        return out
