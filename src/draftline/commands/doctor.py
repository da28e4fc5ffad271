"""Check this node before running the pipeline: Python, key packages, git/DVC state, params,
GPUs and the hardware profile `auto` would pick, free disk. Exits 1 when something must be fixed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from draftline import hardware, params

PACKAGES = [
    "dvc",
    "dvc-s3",
    "hydra-core",
    "torch",
    "transformers",
    "great-expectations",
    "pyarrow",
    "safetensors",
    "dvclive",
]
OPTIONAL = ["sglang", "sglang-router"]
MIN_FREE_GB = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-dir", default="conf")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def checks(config_dir: str = "conf") -> list[tuple[str, bool, str]]:
    """(what, ok, detail) rows; optional parts are reported but never fail."""
    rows: list[tuple[str, bool, str]] = []
    py_ok = sys.version_info >= (3, 10)
    rows.append(("python", py_ok, sys.version.split()[0] + ("" if py_ok else ": need >= 3.10")))
    for name in PACKAGES:
        ver = _version(name)
        rows.append((name, ver is not None, ver or f"missing: pip install -e . ({name})"))
    for name in OPTIONAL:
        ver = _version(name)
        rows.append(
            (
                name,
                True,
                ver or "not installed (only needed on GPU nodes: pip install -e '.[sglang]')",
            )
        )
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rows.append(
        ("git", git.returncode == 0, git.stdout.strip() or "not a git checkout with commits")
    )
    rows.append(
        (
            "dvc repo",
            Path(".dvc").is_dir(),
            "ok" if Path(".dvc").is_dir() else "no .dvc/: run in the repository root",
        )
    )
    rows.append(_params_row(config_dir))
    rows.extend(_hybrid_rows())
    gpus = hardware.detect_gpus()
    chosen = hardware.match_profile(gpus, hardware.load_profiles(config_dir))
    gpu_text = ", ".join(f"{g.name} ({g.memory_mib} MiB)" for g in gpus) or "none"
    rows.append(("gpus", True, f"{len(gpus)}: {gpu_text}"))
    rows.append(("hardware=auto picks", True, chosen))
    free_gb = shutil.disk_usage(".").free / 1e9
    rows.append(
        (
            "free disk",
            free_gb >= MIN_FREE_GB,
            f"{free_gb:.1f} GB" + ("" if free_gb >= MIN_FREE_GB else f" (< {MIN_FREE_GB} GB)"),
        )
    )
    return rows


def _hybrid_rows() -> list[tuple[str, bool, str]]:
    """A hybrid target (Gated DeltaNet layers) without the fast kernels runs a slow torch
    fallback: said, not failed (a CPU node has no use for GPU kernels)."""
    path = Path("params.yaml")
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    model = (loaded or {}).get("model") or {}
    if not model.get("hybrid"):
        return []
    from draftline.target import hybrid_kernels_missing

    missing = hybrid_kernels_missing()
    detail = (
        "fast kernels installed"
        if not missing
        else f"{', '.join(missing)} missing: the hybrid layers of {model.get('name')} run on "
        "the slow torch fallback; on GPU nodes pip install -e '.[hybrid]'"
    )
    return [("hybrid layers", True, detail)]


def _params_row(config_dir: str) -> tuple[str, bool, str]:
    path = Path("params.yaml")
    if not path.exists():
        return ("params.yaml", False, "missing: run `draftline compose`")
    current = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    expected = params.compose([], config_dir).keys()
    if current.keys() != expected:
        return (
            "params.yaml",
            False,
            "groups differ from conf/: run `draftline compose [overrides]`",
        )
    hw = (current.get("hardware") or {}).get("name")
    return ("params.yaml", True, f"model={current['model'].get('name')} hardware={hw}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rows = checks(args.config_dir)
    table = Table(title="draftline doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    for what, ok, detail in rows:
        table.add_row(what, "[green]ok[/]" if ok else "[red]FIX[/]", escape(detail))
    Console().print(table)
    return 0 if all(ok for _, ok, _ in rows) else 1
