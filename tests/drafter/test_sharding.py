"""The online target as training holds it: cut after its last needed layer, and under FSDP2
sharded over the processes, it gives the whole target's features. Real gloo workers, a tiny
random Qwen3 target."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.dflash_data import make_target

from draftline.drafter.sharding import Layout
from draftline.runtime import distributed

pytestmark = pytest.mark.float_kernels

# Each worker computes the features of layers 0 and 2 of a 4-layer target twice: with the whole
# target as loaded, and with the target online training holds (cut, laid out by `layout`).
WORKER = """
import json, sys
import torch
from draftline.core.target import load_model
from draftline.drafter.features import needed_layers_only, target_layer_states
from draftline.drafter.sharding import Layout
from draftline.drafter.training_setup import load_online_target
from draftline.runtime import distributed

torch.set_num_threads(1)
distributed.init("gloo")
out, path, sharding = sys.argv[1:4]
model, ids = {"path": path, "revision": None}, [0, 2]
g = torch.Generator().manual_seed(0)
input_ids = torch.randint(0, 90, (2, 12), generator=g)
mask = torch.ones_like(input_ids)
mask[1, :3] = 0  # left padding
whole = load_model(model)
want = target_layer_states(whole, input_ids, ids, mask)
cut = sum(p.numel() for p in needed_layers_only(load_model(model), ids).parameters())
world = distributed.world_size()
target = load_online_target(model, ids, torch.device("cpu"), "fp32", Layout(sharding), world)
got = target_layer_states(target, input_ids, ids, mask)
real = mask.bool()[..., None].expand_as(got)
local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in target.parameters())
result = {
    "max_diff": float((got - want)[real].abs().max()), "layers": len(target.layers),
    "has_lm_head": hasattr(target, "lm_head"), "local": local, "cut": cut,
    "whole": sum(p.numel() for p in whole.parameters()), "world": world,
}
with open(f"{out}/rank{distributed.rank()}.json", "w") as f:
    json.dump(result, f)
distributed.close()
"""


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    (tmp_path / "online_target_worker.py").write_text(WORKER, encoding="utf-8")
    return "online_target_worker"


def test_the_sharded_online_target_gives_the_whole_targets_features(tmp_path, worker):
    target = make_target(tmp_path / "target")
    out = tmp_path / "out"
    out.mkdir()
    assert distributed.run_in_local_processes(2, [worker, str(out), str(target), "fsdp"]) == 0
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
        assert result["world"] == 2
        assert result["max_diff"] <= 1e-6, result
        # Cut after layer 2 (of 4), without the lm_head: fewer parameters than the whole,
        # and each process holds half of them (dim 0 split in two, padded).
        assert result["layers"] == 3 and not result["has_lm_head"]
        assert result["cut"] < result["whole"]
        assert result["cut"] / 2 <= result["local"] <= 0.55 * result["cut"], result


def test_a_profile_names_its_layout():
    assert Layout.of({"sharding": "fsdp", "activation_checkpointing": True}) == Layout("fsdp", True)
    assert Layout.of({}) == Layout("ddp", False)  # a profile without the keys: as before
    with pytest.raises(SystemExit, match="hardware.sharding='zero3'"):
        Layout.of({"sharding": "zero3"})
