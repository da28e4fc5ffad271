"""Peak resident memory of a piece of work inside the current process (Linux).

The kernel keeps a high-water mark of resident memory (VmHWM); writing 5 to clear_refs resets
it to the current size, so the mark afterwards is the peak of what ran since. Benchmarks run
each contender in a fresh subprocess and measure it with this, so neither inherits the other's
allocator state.
"""

from __future__ import annotations

import resource


def rss_bytes() -> int:
    """Current resident size."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Restart the high-water mark at the current resident size."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def peak_bytes() -> int:
    """Resident high-water mark since the last `reset_peak` (or process start)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: peak memory needs Linux")
