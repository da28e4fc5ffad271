"""Hardware profiles: detect the node's GPUs and resolve `hardware=auto` to a concrete profile.

Profiles say how to run (engine, parallelism, precision, micro-batch), never what is computed,
so resolving `auto` on the node that runs a stage keeps one committed params.yaml valid everywhere.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class GPUInfo:
    name: str
    memory_mib: int


def detect_gpus() -> list[GPUInfo]:
    """GPUs visible to this process: from nvidia-smi when present, else torch.cuda."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            gpus = []
            for line in out.strip().splitlines():
                name, mem = (part.strip() for part in line.rsplit(",", 1))
                gpus.append(GPUInfo(name=name, memory_mib=int(float(mem))))
            return gpus
        except (subprocess.SubprocessError, ValueError, OSError):
            pass
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [
        GPUInfo(
            name=torch.cuda.get_device_name(i),
            memory_mib=torch.cuda.get_device_properties(i).total_memory // 2**20,
        )
        for i in range(torch.cuda.device_count())
    ]


def load_profiles(config_dir: str | Path = "conf") -> dict[str, dict[str, Any]]:
    folder = Path(config_dir) / "hardware"
    profiles = {}
    for path in sorted(folder.glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not data.get("detect"):
            profiles[path.stem] = data
    return profiles


def match_profile(gpus: list[GPUInfo], profiles: dict[str, dict[str, Any]]) -> str:
    """The profile whose GPU name matches and whose GPU count is the largest that fits, else cpu."""
    best, best_count = "cpu", 0
    for name, profile in profiles.items():
        gpu = profile.get("gpu")
        if not gpu:
            continue
        matching = [g for g in gpus if gpu["name"].lower() in g.name.lower()]
        if len(matching) >= int(gpu["count"]) > best_count:
            best, best_count = name, int(gpu["count"])
    return best


def resolve_profile(hardware: dict[str, Any], config_dir: str | Path = "conf") -> dict[str, Any]:
    """A concrete profile: `hardware` itself, or for `auto` the profile matching this node.

    The result carries `resolved_from` and the detected GPUs so stages can record them.
    """
    if not hardware.get("detect"):
        return {**hardware, "resolved_from": hardware.get("name")}
    gpus = detect_gpus()
    profiles = load_profiles(config_dir)
    chosen = match_profile(gpus, profiles)
    return {
        **profiles[chosen],
        "resolved_from": "auto",
        "detected_gpus": [asdict(g) for g in gpus],
    }


def describe(profile: dict[str, Any]) -> dict[str, Any]:
    """The few facts about the profile a stage records in its metrics."""
    return {
        "hardware_profile": profile.get("name"),
        "hardware_resolved_from": profile.get("resolved_from"),
        "engine": profile.get("engine"),
        "precision": profile.get("precision"),
    }
