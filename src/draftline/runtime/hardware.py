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


def nvidia_smi(*query: str, timeout_s: float = 20.0) -> str | None:
    """`nvidia-smi <query> --format=csv,noheader,nounits`'s output, or None on a node without
    it or where it fails (one place for every GPU query: the profile match, `serve stop`'s
    check that the GPUs are free)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def detect_gpus() -> list[GPUInfo]:
    """GPUs visible to this process: from nvidia-smi when present, else torch.cuda."""
    out = nvidia_smi("--query-gpu=name,memory.total")
    if out is not None:
        try:
            gpus = []
            for line in out.strip().splitlines():
                name, mem = (part.strip() for part in line.rsplit(",", 1))
                gpus.append(GPUInfo(name=name, memory_mib=int(float(mem))))
            return gpus
        except ValueError:
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


# Per-node settings a user may override under hardware=auto (conf/hardware/auto.yaml).
AUTO_KNOBS = (
    "micro_batch_size",
    "activation_checkpointing",
    "extract_tokens_per_batch",
    "num_threads",
    "work_ahead_shards",
    "price_per_hour",
)


def resolve_profile(hardware: dict[str, Any], config_dir: str | Path = "conf") -> dict[str, Any]:
    """A concrete profile: `hardware` itself, or for `auto` the profile matching this node.

    The result carries `resolved_from` and the detected GPUs so stages can record them.
    """
    if not hardware.get("detect"):
        return {**hardware, "resolved_from": hardware.get("name")}
    gpus = detect_gpus()
    profiles = load_profiles(config_dir)
    chosen = match_profile(gpus, profiles)
    # auto.yaml's knobs are null ("the chosen profile's"); a value the user set wins.
    knobs = {k: v for k, v in hardware.items() if k in AUTO_KNOBS and v is not None}
    return {
        **profiles[chosen],
        **knobs,
        "resolved_from": "auto",
        "detected_gpus": [asdict(g) for g in gpus],
    }


@dataclass(frozen=True)
class Execution:
    """How a stage executes on this node: the fields of a resolved profile that stages read,
    typed, with the defaults of a CPU (the rest of the profile is for servers and planning)."""

    name: str = "cpu"
    device: str = "cpu"
    precision: str = "fp32"
    num_threads: int | None = None  # torch intra-op threads; None lets torch decide
    processes_per_node: int = 1
    micro_batch_size: int = 1  # training sequences per device and step
    local_batch_size: int = 16  # prompts per generate() batch of the local engine
    extract_tokens_per_batch: int = 4096  # tokens per target forward when extracting features

    @classmethod
    def of(cls, profile: dict[str, Any]) -> Execution:
        def number(key: str, default: int) -> int:
            value = profile.get(key)
            return default if value is None else int(value)

        threads = profile.get("num_threads")
        return cls(
            name=str(profile.get("name") or "cpu"),
            device=str(profile.get("device") or "cpu"),
            precision=str(profile.get("precision") or "fp32"),
            num_threads=None if threads is None else int(threads),
            processes_per_node=number("processes_per_node", 1),
            micro_batch_size=number("micro_batch_size", 1),
            local_batch_size=int((profile.get("local") or {}).get("batch_size") or 16),
            extract_tokens_per_batch=number("extract_tokens_per_batch", 4096),
        )

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def set_threads(self) -> None:
        """Apply num_threads to torch (nothing when the profile leaves it to torch)."""
        if self.num_threads:
            import torch

            torch.set_num_threads(self.num_threads)


def describe(profile: dict[str, Any]) -> dict[str, Any]:
    """The few facts about the profile a stage records in its metrics."""
    return {
        "hardware_profile": profile.get("name"),
        "hardware_resolved_from": profile.get("resolved_from"),
        "engine": profile.get("engine"),
        "precision": profile.get("precision"),
    }
