"""The hierarchical cache's host pool per SGLang engine, from the memory this node lets it use.

With `--enable-hierarchical-cache` every engine sizes its pinned host pool as if it were alone
on the node (SGLang 0.5.23: 2x its device pool, capped at `--hicache-host-memory-fraction` 0.8
of the free RAM divided by the ranks of its own launch, which is 1 for each DP engine that
`sglang_router.launch_server` starts): eight engines would ask for eight times what the node
has. `--hicache-size` (GB, 1e9 bytes, per engine rank) turns that off; this module gives it.

The memory is the smaller of physical RAM and this process's cgroup limit, as SGLang bounds
its host pools (mem_cache/host_memory.py): in a container with a memory limit, a pool sized
from the host's RAM is refused by SGLang at startup, or, pinned, gets the container OOM-killed.
The engines run in the cgroup of the `serve start` that launches them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

GB = 10**9
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1: anything this large is no limit.
UNLIMITED_ABOVE = 1 << 62
# The files that limit a cgroup's memory, by filesystem: v2 (SGLang honours both), v1.
LIMIT_FILES = {"cgroup2": ("memory.max", "memory.high"), "cgroup": ("memory.limit_in_bytes",)}


@dataclass(frozen=True)
class Memory:
    """The memory the engines of this node may use, and what bounds it."""

    bytes: int
    source: str  # "RAM", or the cgroup file that bounds it below RAM


def node_ram_bytes() -> int | None:
    """This node's physical memory, or None where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_limit(root: Path = Path("/")) -> tuple[int, str] | None:
    """This process's tightest cgroup memory limit and the file that sets it, or None.

    The cgroup the process is in (`/proc/self/cgroup`: v2's `0::<path>`, v1's `memory`
    controller), found under its mount (`/proc/self/mountinfo`), and every cgroup above it up
    to the mount: v2's `memory.max` and `memory.high` (SGLang honours both), v1's
    `memory.limit_in_bytes`. `root` stands for `/` (tests pass a folder laid out like it)."""
    try:
        groups = (root / "proc/self/cgroup").read_text(encoding="utf-8")
        mounts = (root / "proc/self/mountinfo").read_text(encoding="utf-8")
    except OSError:
        return None
    member: dict[str, PurePosixPath] = {}
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if not parts[1]:
            member["cgroup2"] = PurePosixPath(parts[2])
        elif "memory" in parts[1].split(","):
            member["cgroup"] = PurePosixPath(parts[2])
    tightest: tuple[int, str] | None = None
    for line in mounts.splitlines():
        before, _, after = line.partition(" - ")
        fields, kind = before.split(), after.split()
        if len(fields) < 5 or len(kind) < 3 or kind[0] not in member:
            continue
        if kind[0] == "cgroup" and "memory" not in kind[2].split(","):
            continue
        mount_root, mount = PurePosixPath(fields[3]), PurePosixPath(fields[4])
        path = member[kind[0]]
        # Inside a cgroup namespace the path is relative to the namespace's root already.
        inner = path.relative_to(mount_root) if path.is_relative_to(mount_root) else path
        top = root / mount.relative_to("/")
        folder = top / inner.relative_to("/") if inner.is_absolute() else top / inner
        if not folder.is_dir():
            folder = top  # a container that shows its own cgroup at the mount
        while True:
            for name in LIMIT_FILES[kind[0]]:
                value = _read_limit(folder / name)
                if value is not None and (tightest is None or value < tightest[0]):
                    shown = PurePosixPath("/") / (folder / name).relative_to(root).as_posix()
                    tightest = (value, str(shown))
            if folder == top or top not in folder.parents:
                break
            folder = folder.parent
    return tightest


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": no limit
        return None
    value = int(text)
    return value if value < UNLIMITED_ABOVE else None


def node_memory(ram_bytes: int | None = None, root: Path = Path("/")) -> Memory | None:
    """The smaller of physical RAM (`ram_bytes`, else this node's) and the cgroup limit
    (read under `root`); None when neither is known."""
    ram = node_ram_bytes() if ram_bytes is None else ram_bytes
    limit = cgroup_limit(root)
    if limit is not None and (not ram or limit[0] < ram):
        return Memory(limit[0], f"cgroup {limit[1]}")
    return Memory(ram, "RAM") if ram else None


def _memory(ram_bytes: int | None, root: Path | None) -> Memory | None:
    """`ram_bytes` alone: a node of that RAM without a cgroup limit (`root` None); else
    `node_memory` read under `root` (this node's `/` when both are None)."""
    if ram_bytes is not None and root is None:
        return Memory(ram_bytes, "RAM") if ram_bytes else None
    return node_memory(ram_bytes, root or Path("/"))


def host_cache_gb(
    sg: dict[str, Any], ram_bytes: int | None = None, root: Path | None = None
) -> int | None:
    """GB of host pool per engine rank for the profile's `sglang` section: its
    `host_cache_gb_per_engine`, else `host_cache_share_of_ram` (default 0.5) of the memory the
    node lets its engines use (`node_memory`) split over `dp_size x tp_size` ranks; None
    without the hierarchical cache or a known memory. `ram_bytes`/`root` as for `_memory`."""
    if not sg.get("hierarchical_cache"):
        return None
    if sg.get("host_cache_gb_per_engine"):
        return int(sg["host_cache_gb_per_engine"])
    memory = _memory(ram_bytes, root)
    if memory is None:
        return None
    share = float(sg.get("host_cache_share_of_ram") or 0.5)
    ranks = int(sg.get("dp_size") or 1) * int(sg.get("tp_size") or 1)
    return max(1, int(share * memory.bytes / ranks // GB))


def describe(sg: dict[str, Any], ram_bytes: int | None = None, root: Path | None = None) -> str:
    """One line for `draftline doctor`: the figure this node would launch with, and which
    bound it comes from (RAM, or the cgroup limit below it)."""
    if not sg.get("hierarchical_cache"):
        return "hierarchical cache off"
    size = host_cache_gb(sg, ram_bytes, root)
    ranks = int(sg.get("dp_size") or 1) * int(sg.get("tp_size") or 1)
    if size is None:
        return "node RAM unknown: each engine sizes its own pool (set host_cache_gb_per_engine)"
    if sg.get("host_cache_gb_per_engine"):
        why = "host_cache_gb_per_engine"
    else:
        memory = _memory(ram_bytes, root)
        assert memory is not None  # host_cache_gb found it
        share = float(sg.get("host_cache_share_of_ram") or 0.5)
        bound = "RAM" if memory.source == "RAM" else f"the {memory.source} limit, below RAM"
        why = f"{share:g} of {memory.bytes / GB:,.0f} GB ({bound}) / {ranks} ranks"
    return f"--hicache-size {size} GB per engine, {size * ranks:,} GB in all ({why})"
