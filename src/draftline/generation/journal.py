"""Append-only journal of finished samples, so a killed shard resumes where it stopped.

One JSON object per line; the first line is a header with the identity of the run (what
decides the tokens: target id, engine, template, sampling). Every append is flushed and fsynced
before the call returns, so a sample reported finished survives `kill -9` and a node losing
power. A torn last line (the process died mid-write) is cut off when the journal is opened
again. The journal lives under `.draftline/journal/`, never inside a DVC output. It outlives the
shard's table: it is removed only once DVC has recorded that table (`release`), so a kill between
the table's rename and DVC's record costs no turn. A journal of another identity is never
resumed: it is moved, whole, into a folder named after it (`<journal>.set-aside-<hash>/`).

One process appends to a journal at a time: `lock` holds `<journal>.lock` (an `flock`, which
the kernel releases when the process ends, `kill -9` included). A generate stage working ahead
on the next shards takes theirs, and skips a shard another run holds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from draftline.generation.engines.base import Result

HEADER_KEY = "journal"


class Journal:
    def __init__(self, path: str | os.PathLike[str], identity: dict[str, Any]) -> None:
        self.path = Path(path)
        self.identity = identity
        self.discarded: Path | None = None  # where a journal of another run was moved
        self.wall_s = 0.0  # generation time recorded by previous runs
        self._file: Any = None
        self._lock: Any = None

    @property
    def lock_path(self) -> Path:
        return self.path.with_suffix(".lock")

    def lock(self, wait: bool = True) -> bool:
        """Hold the journal for this process until `close`; False when another process holds it
        and `wait` is False."""
        if self._lock is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.lock_path, "ab")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return False
        self._lock = handle
        return True

    def open(self) -> dict[str, Result]:
        """Read what a previous run finished (latest record per id) and open for appending.

        A journal written by a run with another identity (other target, engine, template or
        sampling) is set aside (`discarded` names where), never mixed in.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records, good_bytes, header = self._read()
        if header is not None and header.get("identity") != self.identity:
            self.discarded = self._set_aside(header.get("identity"))
            records, good_bytes, header = {}, 0, None
            self.wall_s = 0.0
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open across appends
        if self._file.tell() != good_bytes:
            self._file.truncate(good_bytes)  # drop a torn last line before appending
            self._file.seek(good_bytes)
        if header is None:
            self._write([{HEADER_KEY: 1, "identity": self.identity}])
        return records

    def append(self, results: Iterable[Result], wall_s: float | None = None) -> None:
        """Record finished samples; `wall_s` is the shard's generation time so far (all runs)."""
        self._write(
            {
                "id": r.id,
                "completion_ids": r.completion_ids,
                "finish_reason": r.finish_reason,
                "error": r.error,
                "wall_s": wall_s,
                # A turn capped by the context length: its cap, with it.
                **({"max_new_tokens": r.max_new_tokens} if r.max_new_tokens is not None else {}),
            }
            for r in results
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def _set_aside(self, identity: Any) -> Path:
        """Move this journal into `<journal>.set-aside-<hash of its identity>/`, kept for
        inspection (a second one of the same identity gets a numbered name there)."""
        short = hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()
        folder = self.path.with_name(f"{self.path.name}.set-aside-{short[:12]}")
        folder.mkdir(exist_ok=True)
        dest, n = folder / self.path.name, 0
        while dest.exists():
            n += 1
            dest = folder / f"{self.path.stem}.{n}{self.path.suffix}"
        os.replace(self.path, dest)
        return dest

    def remove(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)  # before the lock goes: no other run opens it half-gone
        self.close()

    def _write(self, objs: Iterable[dict[str, Any]]) -> None:
        data = b"".join(orjson.dumps(o) + b"\n" for o in objs)
        if not data:
            return
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def _read(self) -> tuple[dict[str, Result], int, dict[str, Any] | None]:
        if not self.path.exists():
            return {}, 0, None
        data = self.path.read_bytes()
        records: dict[str, Result] = {}
        header = None
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # torn last line
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                break  # a torn write followed by nothing valid: keep what came before
            good += len(line)
            if obj.get("wall_s"):
                self.wall_s = max(self.wall_s, float(obj["wall_s"]))
            if HEADER_KEY in obj:
                header = obj
                continue
            records[obj["id"]] = Result(
                id=obj["id"],
                completion_ids=list(obj["completion_ids"]),
                finish_reason=obj["finish_reason"],
                error=obj.get("error"),
                max_new_tokens=obj.get("max_new_tokens"),
            )
        return records, good, header
