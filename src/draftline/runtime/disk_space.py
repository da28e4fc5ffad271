"""Free space before a stage writes large outputs: one line naming the size and the fix, not a
full disk halfway through (a half-written pack or table, and a traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path


def human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def free_bytes(folder: str | Path) -> int:
    """Free bytes on the disk that holds `folder` (its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def require_free(folder: str | Path, needed: float, what: str, fix: str) -> None:
    """Exit with one line when `what` needs more than the disk of `folder` has free."""
    free = free_bytes(folder)
    if needed > free:
        raise SystemExit(
            f"{what} needs about {human(needed)} in {folder}, and its disk has {human(free)} "
            f"free: {fix}"
        )
