"""A snapshot of this node -- hardware, drivers, software versions, git state -- secrets redacted.

Written into the salvage notes so that a later node can rebuild the same stack. Every field is
best effort: a missing tool gives `null` plus the reason, never an exception. The environment
is recorded by allow-list (`redaction.redact_env`): values of the variables known safe, names
only of every other one.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftline.ops.redaction import redact_env, redact_urls


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 20) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def gpu_info() -> dict[str, Any]:
    query = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
            "--format=csv,noheader,nounits",
        ]
    )
    if query is None:
        return {"gpus": [], "driver": None, "cuda_driver": None, "note": "nvidia-smi not available"}
    gpus = []
    driver = None
    for line in query.splitlines():
        index, name, mem, driver, bus = (part.strip() for part in line.split(","))
        gpus.append({"index": int(index), "name": name, "memory_mib": int(float(mem)), "bus": bus})
    header = _run(["nvidia-smi"]) or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return {"gpus": gpus, "driver": driver, "cuda_driver": cuda.group(1) if cuda else None}


def cuda_toolkit() -> str | None:
    out = _run(["nvcc", "--version"])
    found = re.search(r"release ([\d.]+)", out or "")
    return found.group(1) if found else None


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"model": model, "logical_cores": os.cpu_count(), "machine": platform.machine()}


def memory_info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": vm.total, "available_bytes": vm.available}


def disk_info() -> list[dict[str, Any]]:
    import psutil

    disks = []
    for part in psutil.disk_partitions(all=False):
        try:
            usage = psutil.disk_usage(part.mountpoint)
        except OSError:
            continue
        disks.append(
            {
                "device": part.device,
                "mountpoint": part.mountpoint,
                "fstype": part.fstype,
                "total_bytes": usage.total,
                "free_bytes": usage.free,
            }
        )
    return disks


def package_versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = dist.version
    return dict(sorted(found.items()))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_info() -> dict[str, Any]:
    """torch's version and build CUDA, read from its files: importing torch takes seconds."""
    version = _version("torch")
    info: dict[str, Any] = {"version": version, "cuda": None}
    spec = importlib.util.find_spec("torch")
    if version is None or spec is None or not spec.submodule_search_locations:
        return info
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    if version_py.exists():
        found = re.search(r"^cuda[^=]*=\s*['\"]([^'\"]+)['\"]", version_py.read_text(), re.M)
        info["cuda"] = found.group(1) if found else None
    return info


def sglang_info() -> dict[str, Any]:
    """SGLang may live in its own environment: report this one's and any launcher on PATH."""
    return {
        "version": _version("sglang"),
        "router": _version("sglang-router"),
        "on_path": shutil.which("sglang"),
    }


def git_info(root: Path) -> dict[str, Any]:
    revision = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if revision is None:
        return {"revision": None, "note": "not a git repository or no commit yet"}
    status = _run(["git", "status", "--porcelain"], cwd=root) or ""
    remotes = _run(["git", "remote", "-v"], cwd=root) or ""
    return {
        "revision": revision,
        "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=root),
        "dirty": bool(status),
        "changes": status.splitlines(),
        "remotes": sorted({redact_urls(line) for line in remotes.splitlines()}),
    }


def take_snapshot(root: str | Path = ".") -> dict[str, Any]:
    """Everything a later node needs to know about this one; secrets redacted."""
    root = Path(root)
    gpu = gpu_info()
    return {
        "host": socket.gethostname(),
        "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "gpu": gpu,
        "cuda_toolkit": cuda_toolkit(),
        "cpu": cpu_info(),
        "memory": memory_info(),
        "disks": disk_info(),
        "torch": torch_info(),
        "sglang": sglang_info(),
        "git": git_info(root),
        "packages": package_versions(),
        "environment": redact_env(),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def to_markdown(snap: Mapping[str, Any]) -> str:
    """A short human summary; the full snapshot goes next to it as JSON."""
    gpu = snap["gpu"]
    gpus = (
        "\n".join(f"- GPU {g['index']}: {g['name']}, {g['memory_mib']} MiB" for g in gpu["gpus"])
        or "- none visible"
    )
    disks = "\n".join(
        f"- {d['mountpoint']} ({d['fstype']}): {_gib(d['free_bytes'])} free of "
        f"{_gib(d['total_bytes'])}"
        for d in snap["disks"]
    )
    git = snap["git"]
    torch = snap["torch"]
    return (
        f"## Node {snap['host']} at {snap['time_utc']}\n\n"
        f"- OS: {snap['os']}\n"
        f"- CPU: {snap['cpu']['model']} ({snap['cpu']['logical_cores']} logical cores)\n"
        f"- RAM: {_gib(snap['memory']['total_bytes'])}\n"
        f"- NVIDIA driver: {gpu.get('driver')}, CUDA (driver): {gpu.get('cuda_driver')}, "
        f"CUDA toolkit: {snap['cuda_toolkit']}\n"
        f"- Python {snap['python']}, torch {torch.get('version')} (CUDA {torch.get('cuda')}), "
        f"SGLang {snap['sglang'].get('version')}\n"
        f"- git: {git.get('revision')} on {git.get('branch')}"
        f"{' (dirty)' if git.get('dirty') else ''}\n\n"
        f"### GPUs\n\n{gpus}\n\n### Disks\n\n{disks}\n"
    )
