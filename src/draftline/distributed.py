"""torch.distributed in a few helpers that also work without torchrun (one process).

Under torchrun (WORLD_SIZE > 1) `init` joins the group: NCCL when CUDA is available, else gloo
(CPU). Outside torchrun every helper is a no-op over a world of one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(backend: str | None = None) -> None:
    """Join the process group when launched by torchrun; idempotent."""
    if not launched_by_torchrun() or dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device(profile_device: str) -> torch.device:
    """This process's device: `cuda:<local rank>` on GPU profiles, else the CPU."""
    if profile_device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(
                "the hardware profile asks for CUDA but no GPU is visible: use hardware=cpu "
                "or hardware=auto"
            )
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _reduce(values: Sequence[float], op: dist.ReduceOp) -> list[float]:
    if not dist.is_initialized():
        return [float(v) for v in values]
    backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=backend_device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_sum(values: Sequence[float]) -> list[float]:
    return _reduce(values, dist.ReduceOp.SUM)


def all_max(value: float) -> float:
    return _reduce([value], dist.ReduceOp.MAX)[0]


def relaunch_command(nproc: int, module_args: Sequence[str]) -> list[str]:
    """The torchrun command that runs `python -m <module_args>` in `nproc` local processes."""
    import sys

    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", *module_args,
    ]  # fmt: skip


def run_under_torchrun(nproc: int, module_args: Sequence[str]) -> int | None:
    """When `nproc` > 1 and we are not yet under torchrun, rerun this command under it.

    Returns torchrun's exit code, or None when the caller should do the work itself (one
    process wanted, or already launched by torchrun, e.g. on several nodes by the user).
    """
    import subprocess

    if nproc <= 1 or launched_by_torchrun():
        return None
    return subprocess.call(relaunch_command(nproc, module_args))
