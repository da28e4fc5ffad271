"""The hierarchical cache's host pool per SGLang engine, from the node's RAM.

With `--enable-hierarchical-cache` every engine sizes its pinned host pool as if it were alone
on the node (SGLang 0.5.23: 2x its device pool, capped at `--hicache-host-memory-fraction` 0.8
of the free RAM divided by the ranks of its own launch, which is 1 for each DP engine that
`sglang_router.launch_server` starts): eight engines would ask for eight times what the node
has. `--hicache-size` (GB, 1e9 bytes, per engine rank) turns that off; this module gives it.
"""

from __future__ import annotations

import os
from typing import Any

GB = 10**9


def node_ram_bytes() -> int | None:
    """This node's physical memory, or None where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def host_cache_gb(sg: dict[str, Any], ram_bytes: int | None = None) -> int | None:
    """GB of host pool per engine rank for the profile's `sglang` section: its
    `host_cache_gb_per_engine`, else `host_cache_share_of_ram` (default 0.5) of this node's RAM
    split over `dp_size x tp_size` ranks; None without the hierarchical cache or a known RAM."""
    if not sg.get("hierarchical_cache"):
        return None
    if sg.get("host_cache_gb_per_engine"):
        return int(sg["host_cache_gb_per_engine"])
    ram = node_ram_bytes() if ram_bytes is None else ram_bytes
    if not ram:
        return None
    share = float(sg.get("host_cache_share_of_ram") or 0.5)
    ranks = int(sg.get("dp_size") or 1) * int(sg.get("tp_size") or 1)
    return max(1, int(share * ram / ranks // GB))


def describe(sg: dict[str, Any], ram_bytes: int | None = None) -> str:
    """One line for `draftline doctor`: the figure this node would launch with, and why."""
    if not sg.get("hierarchical_cache"):
        return "hierarchical cache off"
    size = host_cache_gb(sg, ram_bytes)
    ranks = int(sg.get("dp_size") or 1) * int(sg.get("tp_size") or 1)
    if size is None:
        return "node RAM unknown: each engine sizes its own pool (set host_cache_gb_per_engine)"
    if sg.get("host_cache_gb_per_engine"):
        why = "host_cache_gb_per_engine"
    else:
        ram = node_ram_bytes() if ram_bytes is None else ram_bytes
        share = float(sg.get("host_cache_share_of_ram") or 0.5)
        why = f"{share:g} of {ram / GB:,.0f} GB RAM / {ranks} ranks"
    return f"--hicache-size {size} GB per engine, {size * ranks:,} GB in all ({why})"
