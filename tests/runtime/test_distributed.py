"""Several processes on one node: their rendezvous listens on loopback only, and the first
worker to fail stops the others. Real worker processes joined over gloo (CPU)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from draftline.runtime import distributed

# Each worker joins the group, sums its rank over it, and lists the addresses that listen on
# the rendezvous port (from the kernel's socket tables, whatever process owns them).
PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
from draftline.runtime import distributed

distributed.init("gloo")
port = int(os.environ["MASTER_PORT"])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.rsplit(":", 1)
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            listening.append(address)
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
result = {"world": dist.get_world_size(), "sum": total.item(), "listening": listening}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({**result, "master": os.environ["MASTER_ADDR"]}, f)
distributed.close()
"""

FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(120)
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Writes a module the workers can `python -m`."""
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))

    def write(name: str, text: str) -> str:
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
        return name

    return write


def test_local_workers_rendezvous_on_loopback_only(tmp_path: Path, module) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert distributed.run_in_local_processes(2, [module("probe", PROBE), str(out)]) == 0
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
        assert result["world"] == 2 and result["sum"] == 3.0
        assert result["master"] == "127.0.0.1"
        assert result["listening"] == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or [::]


def test_one_worker_failing_stops_the_others(module) -> None:
    began = time.monotonic()
    assert distributed.run_in_local_processes(2, [module("fails", FAILS)]) == 3
    assert time.monotonic() - began < 60  # rank 0 would sleep 120 s unless stopped


def test_one_process_or_an_existing_worker_does_the_work_itself(monkeypatch) -> None:
    assert distributed.run_in_local_processes(1, ["unused"]) is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed.run_in_local_processes(2, ["unused"]) is None
