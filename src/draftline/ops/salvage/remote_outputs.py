"""What the remote must hold (every output dvc.lock and `.dvc` files name, `.dir` entries and
the run cache included): push it, verify it by content, repair what is missing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from draftline.ops import redaction
from draftline.ops.salvage.finding import Finding
from draftline.runtime import run_log


@dataclass(frozen=True)
class Expected:
    """One object the remote must hold: content hash, size when known, and who needs it."""

    oid: str
    size: int | None
    owner: str  # stage name or .dvc file
    path: str  # workspace path of the output (or file inside a directory output)


@dataclass
class Verification:
    """What the remote holds of what dvc.lock names, told apart by where each object is:
    in the remote (SAFE), only on this node (`missing`: WOULD BE LOST), or never on this
    node (`never_here` when the remote has it, `nowhere` when it does not either: another
    node's output that it did not push; shutting this node down loses nothing of it)."""

    remote_url: str
    checked: int = 0
    by_etag: int = 0
    by_parts: int = 0
    by_download: int = 0
    missing: list[Expected] = field(default_factory=list)
    never_here: list[Expected] = field(default_factory=list)
    nowhere: list[Expected] = field(default_factory=list)
    cached: set[str] = field(default_factory=set)  # oids of `missing` the local cache holds
    # oids of `missing` whose workspace copy is intact (`dvc commit -f` saves them)
    in_workspace: set[str] = field(default_factory=set)
    corrupted: list[tuple[Expected, str]] = field(default_factory=list)
    runs_checked: int = 0
    runs_missing: list[str] = field(default_factory=list)
    owners: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.corrupted or self.runs_missing)


# --- what dvc.lock names -------------------------------------------------------------------


def _outs_of(entry: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield from entry.get("outs") or []


def _expected(out: dict[str, Any], owner: str) -> Expected:
    # The size recorded for a directory is its contents', not the manifest's.
    size = None if str(out["md5"]).endswith(".dir") else out.get("size")
    return Expected(str(out["md5"]), size, owner, str(out["path"]))


def recorded_outputs(root: Path) -> list[Expected]:
    """Outputs recorded in dvc.lock and in `.dvc` files (not yet expanded: `.dir` stays one)."""
    found: list[Expected] = []
    lock = root / "dvc.lock"
    if lock.exists():
        data = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
        for stage, entry in (data.get("stages") or {}).items():
            for out in _outs_of(entry):
                if out.get("md5"):
                    found.append(_expected(out, stage))
    for dvcfile in sorted(root.rglob("*.dvc")):
        if ".dvc" in dvcfile.relative_to(root).parts[:-1] or not dvcfile.is_file():
            continue
        data = yaml.safe_load(dvcfile.read_text(encoding="utf-8")) or {}
        owner = str(dvcfile.relative_to(root))
        for out in _outs_of(data):
            if out.get("md5"):
                found.append(_expected(out, owner))
    return found


def locked_stages(root: Path) -> set[str]:
    lock = root / "dvc.lock"
    if not lock.exists():
        return set()
    return set((yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages") or {})


def uncached_outputs(root: Path) -> list[str]:
    """Paths of the `cache: false` outputs (metrics, plots) of the stages in dvc.lock.

    `dvc push` never sends them: without a commit, a new node would miss e.g. the metrics a
    downstream stage depends on, and rerun the finished stage that wrote them.
    """
    finished = locked_stages(root)
    if not finished:
        return []
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            outs = sorted(
                os.path.relpath(str(out.fs_path), repo.root_dir)
                for stage in repo.index.stages
                if stage.addressing in finished
                for out in stage.outs
                if not out.use_cache
            )
        # Written by generate, extract and train, so no stage's output (DVC forbids a shared
        # one): a top-level metric of dvc.yaml, which git carries like the stages' metrics.
        return [*outs, run_log.THROUGHPUT_PATH.as_posix()]
    except Exception:  # an unreadable dvc.yaml: `uncommitted` then lists those files NOT SAFE
        return []


# --- push and verify -----------------------------------------------------------------------


def dvc_push(root: Path, remote_name: str) -> tuple[bool, str]:
    """`dvc push --run-cache`; a terminal sees DVC's progress bars, otherwise output is kept."""
    cmd = ["dvc", "push", "--run-cache", "-r", remote_name]
    if sys.stdout.isatty():
        done = subprocess.run(cmd, cwd=root, check=False)
        return done.returncode == 0, ""
    done = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    return done.returncode == 0, redaction.redact_text(done.stdout + done.stderr)


def _list(fs: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """Every object under `prefix` with its info (one listing, not one request per object)."""
    try:
        listed = fs.fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    if isinstance(listed, dict):
        return {str(k): v for k, v in listed.items()}
    return {str(p): fs.info(p) for p in listed}


def _md5_of(fs: Any, path: str) -> str:
    digest = hashlib.md5()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _dir_entries(
    obj: Expected, local_cache: Any, fs: Any, odb: Any, listing: dict[str, Any]
) -> list[Expected] | None:
    """Entries of a `.dir` manifest, read from the local cache or else from the remote."""
    local = Path(local_cache.oid_to_path(obj.oid))
    try:
        if local.exists():
            text = local.read_text(encoding="utf-8")
        elif odb.oid_to_path(obj.oid) in listing:
            with fs.open(odb.oid_to_path(obj.oid), "rb") as f:
                text = f.read().decode("utf-8")
        else:
            return None
        entries = json.loads(text)
    except (OSError, ValueError):
        return None
    out = []
    for entry in entries:
        oid = entry["md5"]
        size = None
        cached = Path(local_cache.oid_to_path(oid))
        if cached.exists():
            size = cached.stat().st_size
        out.append(Expected(oid, size, obj.owner, f"{obj.path}/{entry['relpath']}"))
    return out


def lock_outputs(text: str, owner_prefix: str = "") -> list[Expected]:
    """The outputs a dvc.lock text records (an experiment's, read from its git commit)."""
    data = yaml.safe_load(text) or {}
    return [
        _expected(out, owner_prefix + stage)
        for stage, entry in (data.get("stages") or {}).items()
        for out in _outs_of(entry)
        if out.get("md5")
    ]


def verify_remote(
    root: Path, remote_name: str, deep: bool = False, outputs: list[Expected] | None = None
) -> Verification:
    """Check that the remote holds every recorded object with the right content.

    Content is checked by the S3 ETag where it is the MD5 of the object (single-part uploads,
    no SSE-KMS: DVC's oid is the same MD5); a multipart ETag by computing it from the local
    copy; else, and always with `deep`, by downloading and hashing. Never by size alone: a
    same-size corruption has the same size. Run-cache entries are compared with the local
    `.dvc/cache/runs`. `outputs`: what to check instead of the workspace's dvc.lock.
    """
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        rem = repo.cloud.get_remote(remote_name)
        fs, odb = rem.fs, rem.odb
        result = Verification(remote_url=str(repo.config["remote"][remote_name]["url"]))
        listing = _list(fs, odb.path)
        # `cache: false` outputs (metrics, plots) never go to a DVC remote: git carries them.
        in_git = set(uncached_outputs(root))
        recorded = recorded_outputs(root) if outputs is None else outputs
        todo = [o for o in recorded if o.path not in in_git]
        while todo:
            obj = todo.pop()
            result.owners[obj.owner] = result.owners.get(obj.owner, 0) + 1
            path = odb.oid_to_path(obj.oid)
            result.checked += 1
            info = listing.get(path)
            here = (root / obj.path).exists() or Path(
                repo.cache.local.oid_to_path(obj.oid)
            ).exists()
            if info is None:
                (result.missing if here else result.nowhere).append(obj)
                if _intact(Path(repo.cache.local.oid_to_path(obj.oid)), obj.oid):
                    result.cached.add(obj.oid)
                elif _intact(root / obj.path, obj.oid):
                    result.in_workspace.add(obj.oid)
                continue
            if not here:
                result.never_here.append(obj)
            if obj.oid.endswith(".dir"):
                entries = _dir_entries(obj, repo.cache.local, fs, odb, listing)
                if entries is None:
                    result.corrupted.append((obj, "directory manifest unreadable"))
                    continue
                todo.extend(entries)
            problem = _content_problem(obj, info, fs, path, deep, repo.cache.local, result)
            if problem:
                result.corrupted.append((obj, problem))
        _verify_run_cache(Path(repo.cache.legacy.path) / "runs", fs, rem.path, result)
    return result


def _intact(local: Path, oid: str) -> bool:
    """Whether the local cache holds `oid` with its content (hashed: a cache file can rot)."""
    if not local.is_file():
        return False
    digest = hashlib.md5()
    with local.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest() == oid.removesuffix(".dir")


def repair_remote(root: Path, remote_name: str, missing: Iterable[Expected]) -> list[Expected]:
    """Upload the missing objects the local cache holds intact; the ones uploaded.

    `dvc push` takes a folder whose `.dir` manifest is on the remote for complete, so an entry
    lost from it (a cut-short upload, a deleted object) is never pushed again by DVC.
    """
    from dvc.repo import Repo

    uploaded = []
    with Repo(str(root)) as repo:
        rem = repo.cloud.get_remote(remote_name)
        for obj in missing:
            local = Path(repo.cache.local.oid_to_path(obj.oid))
            # Never replace a lost object with a corrupted one: the copy must hash to its oid.
            if not _intact(local, obj.oid):
                continue
            rem.fs.put_file(str(local), rem.odb.oid_to_path(obj.oid))
            uploaded.append(obj)
    return uploaded


def _content_problem(
    obj: Expected,
    info: dict[str, Any],
    fs: Any,
    path: str,
    deep: bool,
    local_cache: Any,
    result: Verification,
) -> str:
    """Why the remote copy of `obj` is not its content, or "" when it is."""
    want = obj.oid.removesuffix(".dir")
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    # A local folder remote is cheap to read; elsewhere hash only when nothing else can tell.
    if not deep and fs.protocol != "local":
        if re.fullmatch(r"[0-9a-f]{32}", etag):
            result.by_etag += 1
            return "" if etag == want else f"ETag (content MD5) {etag} != {want}"
        multipart = re.fullmatch(r"[0-9a-f]{32}-(\d+)", etag)
        local = Path(local_cache.oid_to_path(obj.oid))
        if multipart and local.exists():
            size = int(info.get("size") or 0)
            ours = _local_multipart_etag(local, want, _part_size(fs, path, int(multipart[1]), size))
            if ours is not None:  # else the local copy is no good: download instead
                result.by_parts += 1
                return "" if ours == etag else f"multipart ETag {etag} != {ours} of the local copy"
    result.by_download += 1
    got = _md5_of(fs, path)
    return "" if got == want else f"content MD5 {got} != {want}"


def _part_size(fs: Any, path: str, parts: int, size: int) -> int | None:
    """The size of every part but the last, from S3 (HEAD of part 1); None when unknown."""
    if parts == 1:
        return size
    try:
        bucket, key, _ = fs.fs.split_path(path)
        return int(
            fs.fs.call_s3("head_object", Bucket=bucket, Key=key, PartNumber=1)["ContentLength"]
        )
    except Exception:  # a store without part numbers: the caller downloads instead
        return None


def _local_multipart_etag(local: Path, want: str, part_size: int | None) -> str | None:
    """The ETag of `local` uploaded in parts of `part_size` (the MD5 of the parts' MD5s, then
    the number of parts), or None when the part size is unknown or `local` is not `want`."""
    if not part_size:
        return None
    whole, part, filled, digests = hashlib.md5(), hashlib.md5(), 0, b""
    with local.open("rb") as f:
        while block := f.read(min(2**20, part_size - filled)):
            whole.update(block)
            part.update(block)
            filled += len(block)
            if filled == part_size:
                digests, part, filled = digests + part.digest(), hashlib.md5(), 0
    if filled:
        digests += part.digest()
    if whole.hexdigest() != want:
        return None
    return f"{hashlib.md5(digests).hexdigest()}-{len(digests) // 16}"


def _verify_run_cache(local_runs: Path, fs: Any, remote_root: str, result: Verification) -> None:
    if not local_runs.exists():
        return
    listing = _list(fs, fs.join(remote_root, "runs"))
    for entry in sorted(p for p in local_runs.rglob("*") if p.is_file()):
        rel = entry.relative_to(local_runs).as_posix()
        result.runs_checked += 1
        info = listing.get(fs.join(remote_root, "runs", *rel.split("/")))
        etag = str((info or {}).get("ETag") or "").strip('"')
        local_md5 = hashlib.md5(entry.read_bytes()).hexdigest()
        if info is None or (etag and re.fullmatch(r"[0-9a-f]{32}", etag) and etag != local_md5):
            result.runs_missing.append(rel)


def verification_findings(v: Verification, where: str) -> list[Finding]:
    """SAFE for what the remote holds, WOULD BE LOST for what only this node holds, NEVER
    HERE for what dvc.lock names but this node never had (in the remote or not)."""
    findings = []
    owners_bad = sorted({o.owner for o in v.missing} | {o.owner for o, _ in v.corrupted})
    owners_away = {o.owner for o in v.never_here} | {o.owner for o in v.nowhere}
    owners_ok = sorted(set(v.owners) - set(owners_bad) - owners_away)
    how = (
        f"{v.by_etag} by ETag=MD5, {v.by_parts} by multipart ETag of the local copy, "
        f"{v.by_download} downloaded and hashed"
    )
    if owners_ok:
        findings.append(
            Finding(
                True,
                f"{len(owners_ok)} finished stages/files in {where}: "
                f"{', '.join(owners_ok)} ({v.checked} objects checked: {how})",
            )
        )
    if owners_bad:
        findings.append(
            Finding(
                False,
                f"{len(owners_bad)} stages/files not intact in {where}: {', '.join(owners_bad)} "
                f"({v.checked} objects checked: {how})",
                label="WOULD BE LOST" if v.missing and not v.corrupted else "",
            )
        )
    findings += _never_here_findings(v, where, set(owners_bad))
    for obj in v.missing[:20]:
        if obj.oid in v.cached:
            where_here, fix = "in its DVC cache", "run `draftline salvage`: it pushes it"
        elif obj.oid in v.in_workspace:  # seconds: hash it back into the cache, then push
            where_here = "intact in its workspace, not in its cache"
            fix = f"`dvc commit -f {obj.owner}`, then `draftline salvage` again (it pushes it)"
        else:
            where_here = "in its workspace, not intact there nor in its cache"
            fix = (
                f"re-run the stage (`dvc repro {obj.owner}`) or `dvc fetch` it from another "
                "remote, then run `draftline salvage` again"
            )
        findings.append(
            Finding(
                False,
                f"missing in {where}: {obj.path} ({obj.owner}, object {obj.oid}), only on this "
                f"node ({where_here})",
                fix,
                label="WOULD BE LOST",
            )
        )
    for obj, why in v.corrupted[:20]:
        findings.append(
            Finding(
                False,
                f"corrupted in {where}: {obj.path} ({obj.owner}): {why}",
                "delete the object from the remote and run `draftline salvage` again "
                "(dvc push skips objects that already exist)",
            )
        )
    if len(v.missing) + len(v.corrupted) > 40:
        findings.append(
            Finding(
                False,
                f"... {len(v.missing)} missing and {len(v.corrupted)} corrupted objects in all",
            )
        )
    if v.runs_missing:
        findings.append(
            Finding(
                False,
                f"run-cache: {len(v.runs_missing)} of {v.runs_checked} entries not in {where}",
                "run `draftline salvage` again",
            )
        )
    elif v.runs_checked:
        findings.append(Finding(True, f"run-cache: {v.runs_checked} entries in {where}"))
    return findings


def _never_here_findings(v: Verification, where: str, bad: set[str]) -> list[Finding]:
    """Outputs dvc.lock names that this node never had: nothing of them is lost with it."""
    nowhere = sorted({o.owner for o in v.nowhere} - bad)
    in_remote = sorted({o.owner for o in v.never_here} - bad - set(nowhere))
    findings = []
    if in_remote:
        findings.append(
            Finding(
                True,
                f"{len(in_remote)} stages/files named by dvc.lock never ran on this node; "
                f"their outputs are in {where}: {', '.join(in_remote)}",
                label="NEVER HERE",
            )
        )
    if nowhere:
        paths = sorted({o.path for o in v.nowhere if o.owner in nowhere})
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        findings.append(
            Finding(
                True,
                f"{len(nowhere)} stages/files named by dvc.lock were never on this node and are "
                f"not (all) in {where} either: {', '.join(nowhere)} ({shown}); shutting this "
                "node down loses nothing of them",
                "on the node that ran them, run `draftline salvage`; or rerun them "
                f"(`dvc repro {' '.join(nowhere)}`)",
                label="NEVER HERE",
            )
        )
    return findings
