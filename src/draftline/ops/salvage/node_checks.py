"""Before saving: work still in flight, a full disk, an unwritable DVC cache."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from draftline.ops import redaction
from draftline.ops.salvage.finding import Finding

# --- in flight, disk, cache ----------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stages_in_flight(root: Path) -> list[Finding]:
    """Outputs that a live `dvc repro` is writing now (DVC's rwlock), i.e. a shard in flight."""
    rwlock = root / ".dvc" / "tmp" / "rwlock"
    if not rwlock.exists():
        return []
    try:
        data = json.loads(rwlock.read_text(encoding="utf-8") or "{}")
    except (OSError, json.JSONDecodeError):
        return []
    findings = []
    for path, info in sorted((data.get("write") or {}).items()):
        if not _alive(int(info["pid"])):
            continue
        rel = os.path.relpath(path, root)
        findings.append(
            Finding(
                False,
                f"in flight: {rel} is being written by pid {info['pid']} "
                f"({redaction.redact_text(info['cmd'])}); its partial output is NOT saved",
                "wait for the stage to finish and run `draftline salvage` again, "
                "or accept re-running that stage on the next node",
            )
        )
    return findings


def partial_journals(root: Path, finished: set[str]) -> list[Finding]:
    """Generation journals of shards whose stage is not in dvc.lock: progress DVC cannot push."""
    folder = root / ".draftline" / "journal" / "generate"
    findings = []
    for journal in sorted(folder.glob("shard-*.jsonl")):
        match = re.fullmatch(r"shard-0*(\d+)\.jsonl", journal.name)
        if not match or f"generate@{match.group(1)}" in finished:
            continue
        # One record per finished turn; the header line names the run, not a turn.
        turns = sum(not line.startswith(b'{"journal"') for line in journal.open("rb"))
        shard = int(match.group(1))
        if _table_written(root, shard):  # killed after its table, before DVC recorded it
            findings.append(
                Finding(
                    False,
                    f"generate@{shard}: its table is complete in the workspace (from "
                    f"{journal.relative_to(root)}, {turns} turns) but DVC has not recorded it",
                    f"`dvc commit -f generate@{shard}` (seconds, nothing generated), then "
                    "`draftline salvage` again",
                )
            )
            continue
        findings.append(
            Finding(
                False,
                f"unfinished shard generate@{match.group(1)}: {turns} finished turns in "
                f"{journal.relative_to(root)} stay on this node (journals are not DVC outputs)",
                f"let `dvc repro generate@{match.group(1)}` finish, then salvage again",
            )
        )
    return findings


def _table_written(root: Path, shard: int) -> bool:
    from draftline.generation.shards import shard_paths
    from draftline.generation.table_record import table_of_journal

    paths = shard_paths(shard)
    return table_of_journal(
        replace(
            paths,
            curated=root / paths.curated,
            output=root / paths.output,
            journal=root / paths.journal,
        )
    )


def disk_space(paths: Iterable[Path], min_free: int) -> list[Finding]:
    """A disk below `min_free` where the repository or the notes live."""
    findings = []
    seen: set[int] = set()
    for path in paths:
        while not path.exists():
            path = path.parent
        if path.stat().st_dev in seen:
            continue
        seen.add(path.stat().st_dev)
        free = shutil.disk_usage(path).free
        if free < min_free:
            findings.append(
                Finding(
                    False,
                    f"disk full: {free / 2**20:.1f} MiB free at {path} (salvage wants "
                    f"{min_free / 2**20:.0f} MiB for notes, git and DVC state)",
                    "free space on that disk (old logs, `dvc gc -w` of unused cache) and rerun",
                )
            )
    return findings


def cache_writable(cache_dir: Path) -> list[Finding]:
    """Probe with a real write: permission bits lie to root and on read-only mounts."""
    probe_dir = cache_dir if cache_dir.exists() else cache_dir.parent
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".draftline-probe-"):
            pass
    except OSError as exc:
        reason = "disk full" if exc.errno == errno.ENOSPC else os.strerror(exc.errno or 0)
        return [
            Finding(
                False,
                f"DVC cache {cache_dir} is not writable ({reason}): a stage that finishes now "
                "cannot be recorded, and `dvc pull` cannot restore into it",
                "make it writable, or move the cache to a writable disk with "
                "`dvc cache dir --local /path/on/big/disk` and `dvc checkout`",
            )
        ]
    return []
