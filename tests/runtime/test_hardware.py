"""The typed view of a hardware profile that stages run with."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftline.runtime.hardware import Execution, load_profiles

CONF = Path(__file__).resolve().parents[2] / "conf"
PROFILES = load_profiles(CONF)


@pytest.mark.parametrize("name", sorted(n for n, p in PROFILES.items() if not p.get("detect")))
def test_every_profile_reads_into_its_execution_fields(name: str) -> None:
    profile = PROFILES[name]
    execution = Execution.of(profile)
    assert execution.name == name
    assert execution.device == profile["device"] and execution.precision == profile["precision"]
    assert execution.micro_batch_size == profile["micro_batch_size"]
    assert execution.processes_per_node == profile["processes_per_node"]
    assert execution.extract_tokens_per_batch == profile["extract_tokens_per_batch"]
    assert execution.local_batch_size == (profile.get("local") or {}).get("batch_size", 16)
    assert execution.on_gpu == str(profile["device"]).startswith("cuda")


def test_missing_fields_take_the_cpu_defaults() -> None:
    execution = Execution.of({"name": "bare"})
    assert (execution.device, execution.precision, execution.num_threads) == ("cpu", "fp32", None)
    assert (execution.micro_batch_size, execution.local_batch_size) == (1, 16)
    assert execution.extract_tokens_per_batch == 4096 and not execution.on_gpu
