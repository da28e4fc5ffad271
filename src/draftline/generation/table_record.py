"""A shard's files and identity, and what its table was written from, kept beside its journal
(working state, not a DVC output): a stage working ahead tells a current table from one another
run left (`needs_generating`), and a journal is removed only once DVC has recorded and cached the
table it wrote (`release_recorded`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline.core import target
from draftline.generation.engines.base import Sampling
from draftline.generation.journal import Journal
from draftline.runtime import atomic


@dataclass(frozen=True)
class ShardPaths:
    name: str  # "shard-3", "eval": for messages and the progress bar
    curated: Path
    output: Path
    run_log: Path  # the shard's record (counts, timings, hardware): logs/runs/, not a DVC metric
    journal: Path


@dataclass(frozen=True)
class Identity:
    """What decides a sample's tokens; a journal of another identity is not resumed from."""

    model: str  # path@revision, a label only: the same weights in another folder resume
    template_kwargs: dict[str, Any]
    sampling: Sampling
    # The template itself, so fixing a broken one never resumes the samples it produced.
    chat_template_sha256: str = ""
    # Share of samples generated with thinking on (`data.thinking_share`; the rest off).
    thinking_share: float = 1.0
    # Which assistant turns the target writes: "all" or "last" (`generate.regenerate_turns`).
    regenerate_turns: str = "all"
    # The weights (`core.target.weights_id`: a hash of the folder's files, or the hub commit),
    # and the engine with what it computes (`Engine.identity()`, served settings included).
    target_id: str = ""
    engine: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "target_id": self.target_id,
            "engine": self.engine,
            "chat_template_kwargs": self.template_kwargs,
            "chat_template_sha256": self.chat_template_sha256,
            "sampling": self.sampling.as_dict(),
            "thinking_share": self.thinking_share,
            "regenerate_turns": self.regenerate_turns,
        }

    def kwargs_for(self, sample_id: str) -> dict[str, Any]:
        """The chat-template kwargs this sample is rendered with (its thinking mode)."""
        return target.sample_template_kwargs(self.template_kwargs, sample_id, self.thinking_share)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _md5(path: Path) -> str:
    """DVC's hash of a file output (`md5` in dvc.lock)."""
    digest = hashlib.md5()  # noqa: S324 - DVC's content address, not a security hash
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _marker(paths: ShardPaths) -> Path:
    return paths.journal.with_suffix(".done.json")


def _read_record(paths: ShardPaths) -> dict | None:
    """The shard's table record, or None when it is missing or unreadable."""
    try:
        record = json.loads(_marker(paths).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def mark_current(paths: ShardPaths, identity: Identity) -> None:
    """Record what the table now in place was generated from (working state beside the
    journal), so a stage working ahead can tell a current table from one left by another run."""
    atomic.write_json(
        _marker(paths),
        {
            "identity": identity.as_dict(),
            "curated_sha256": _digest(paths.curated),
            "table_bytes": paths.output.stat().st_size,
            "table_sha256": _digest(paths.output),
            "table_md5": _md5(paths.output),
            # The journal the table was built from: grown since, it holds newer work.
            "journal_bytes": paths.journal.stat().st_size if paths.journal.exists() else None,
        },
    )


def _locked_md5(entries: list[dict[str, Any]] | None, path: Path) -> str | None:
    """The md5 a dvc.lock entry's `deps` or `outs` records for `path`."""
    for item in entries or []:
        if str(item.get("path")) == path.as_posix():
            return str(item.get("md5"))
    return None


def release_recorded(
    paths: ShardPaths, entry: dict[str, Any] | None, cached: Callable[[str], bool]
) -> bool:
    """Remove the shard's journal once DVC holds the table it wrote: `entry` (the stage's
    dvc.lock entry) names the table's md5 and the md5 of the curated shard in place, and DVC's
    cache holds that object (`cached`). Otherwise DVC reruns the stage, and the journal is what
    rebuilds the table. A journal another run holds is kept."""
    if entry is None or not paths.journal.exists():
        return False
    table_md5 = _locked_md5(entry.get("outs"), paths.output)
    record = _read_record(paths)
    if (
        table_md5 is None
        or record is None
        or record.get("table_md5") != table_md5
        or record.get("journal_bytes") != paths.journal.stat().st_size
    ):
        return False
    # A fresh clone's dvc.lock already names the bytes a deterministic run writes, with nothing
    # cached: DVC reruns the stage until its cache holds them.
    if not cached(table_md5):
        return False
    # DVC also reruns a stage whose curated input is not the one its entry records.
    if not paths.curated.is_file() or _locked_md5(entry.get("deps"), paths.curated) != _md5(
        paths.curated
    ):
        return False
    journal = Journal(paths.journal, {})
    if not journal.lock(wait=False):
        return False
    journal.remove()
    return True


def needs_generating(paths: ShardPaths, identity: Identity) -> bool:
    """Whether a shard is worth working ahead on: it has no table, or one this draftline wrote
    from another identity or another curated shard (so its stage will run again). A table
    without a record (an older draftline's, or checked out by DVC) is taken as current."""
    if not paths.curated.exists():
        return False  # curate has not written it: nothing to generate yet
    if not paths.output.exists():
        return True
    record = _read_record(paths)
    if (
        record is None
        or record.get("table_bytes") != paths.output.stat().st_size
        or record.get("table_sha256") != _digest(paths.output)
    ):
        return False  # not the table the record describes: nothing known about it
    return record.get("identity") != identity.as_dict() or (
        record.get("curated_sha256") != _digest(paths.curated)
    )


def table_of_journal(paths: ShardPaths) -> bool:
    """Whether the table in place is the one the shard's journal, as it is now, wrote from the
    curated shard in place: finished work that only waits for DVC to record it."""
    record = _read_record(paths)
    return (
        record is not None
        and paths.output.is_file()
        and paths.curated.is_file()
        and paths.journal.is_file()
        and record.get("journal_bytes") == paths.journal.stat().st_size
        and record.get("table_sha256") == _digest(paths.output)
        and record.get("curated_sha256") == _digest(paths.curated)
    )
