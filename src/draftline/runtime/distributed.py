"""torch.distributed in a few helpers that also work without torchrun (one process).

Under torchrun or `run_in_local_processes` (WORLD_SIZE > 1) `init` joins the group: NCCL when
CUDA is available, else gloo (CPU). Outside them every helper is a no-op over a world of one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


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


def all_sum_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over every process, in place (on its own device); as is in one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_max(value: float) -> float:
    return _reduce([value], dist.ReduceOp.MAX)[0]


def local_worker_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The torchrun variables of local worker `rank`, joined to a store on 127.0.0.1:`port`."""
    return {
        "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
        "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        # Rank 0 joins the launcher's store instead of opening one on every interface.
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip


def run_in_local_processes(nproc: int, module_args: Sequence[str]) -> int | None:
    """When `nproc` > 1 and this is not yet a worker, rerun `python -m <module_args>` as
    `nproc` workers of one node; the first to fail stops the others. Returns their exit code,
    or None when the caller should do the work itself (one process wanted, or already a
    worker, e.g. of a torchrun the user started on several nodes).

    Not torchrun: its rendezvous store listens on every interface, even with --standalone or a
    loopback endpoint. Here the store listens on a socket bound to 127.0.0.1, and gloo and
    NCCL connect over loopback unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise.
    """
    if nproc <= 1 or launched_by_torchrun():
        return None
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen()
    port = listener.getsockname()[1]
    # The store takes the bound socket over (and closes it when it goes).
    store = dist.TCPStore(
        LOOPBACK, port, is_master=True, master_listen_fd=listener.detach(), wait_for_workers=False
    )
    # Defaults the environment may override; one thread each, as torchrun sets.
    defaults = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", *module_args],
            env={**defaults, **os.environ, **local_worker_env(rank, nproc, port)},
        )
        for rank in range(nproc)
    ]
    try:
        return _wait_all(workers)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
                worker.wait()
        del store


def _wait_all(workers: list[subprocess.Popen]) -> int:
    """0 once every worker succeeded, else the exit status of the first to fail."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        while True:
            codes = [w.poll() for w in workers]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by a signal
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
