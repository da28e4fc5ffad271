"""Save everything before a node shuts down, and say plainly whether it is safe to.

The checklist, in order: look for work in flight and for a full disk or an unwritable cache,
snapshot the node, gather logs and stage metrics, `dvc push --run-cache`, verify that the
remote holds every object `dvc.lock` (and any `.dvc` file) names -- the entries of `.dir`
manifests included -- and every run-cache entry, optionally stop the servers, commit `dvc.lock`
and the notes (and push git when a git remote exists), then print what is safe and where and
what is NOT. Any step that fails becomes a NOT SAFE finding; nothing here raises past `salvage`.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from draftline.ops import node_snapshot, remote
from draftline.runtime import atomic, run_log

NOTES_DIR = Path("notes") / "salvage"
LOG_SOURCES = ("logs", ".draftline")
LOG_SUFFIXES = (".log", ".txt", ".out", ".err")
MAX_LOG_BYTES = 2 * 2**20  # the tail of each log is kept: the end is where it went wrong
MAX_LOGS_BYTES = 20 * 2**20
DEFAULT_MIN_FREE = 64 * 2**20
RESUME_COMMAND = "dvc repro --pull"
HAZARD = (
    "never add --allow-missing: it does not pull the stages it skips, so the stages after them "
    "would see folders without the finished shards (their input guard refuses to run)"
)


@dataclass
class Finding:
    safe: bool
    what: str
    fix: str = ""


@dataclass
class Options:
    root: Path
    remote: str | None = None
    dry_run: bool = False
    deep: bool = False
    stop_servers: bool = False
    commit: bool = True
    push_git: bool = True
    min_free_bytes: int = DEFAULT_MIN_FREE
    notes_dir: Path = NOTES_DIR


@dataclass(frozen=True)
class Expected:
    """One object the remote must hold: content hash, size when known, and who needs it."""

    oid: str
    size: int | None
    owner: str  # stage name or .dvc file
    path: str  # workspace path of the output (or file inside a directory output)


@dataclass
class Verification:
    remote_url: str
    checked: int = 0
    by_etag: int = 0
    by_parts: int = 0
    by_download: int = 0
    missing: list[Expected] = field(default_factory=list)
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
                f"({node_snapshot.redact_text(info['cmd'])}); its partial output is NOT saved",
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
        lines = sum(1 for _ in journal.open("rb"))
        findings.append(
            Finding(
                False,
                f"unfinished shard generate@{match.group(1)}: {lines} samples in "
                f"{journal.relative_to(root)} stay on this node (journals are not DVC outputs)",
                f"let `dvc repro generate@{match.group(1)}` finish, then salvage again",
            )
        )
    return findings


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
    return done.returncode == 0, node_snapshot.redact_text(done.stdout + done.stderr)


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


def verify_remote(root: Path, remote_name: str, deep: bool = False) -> Verification:
    """Check that the remote holds every recorded object with the right content.

    Content is checked by the S3 ETag where it is the MD5 of the object (single-part uploads,
    no SSE-KMS: DVC's oid is the same MD5); a multipart ETag by computing it from the local
    copy; else, and always with `deep`, by downloading and hashing. Never by size alone: a
    same-size corruption has the same size. Run-cache entries are compared with the local
    `.dvc/cache/runs`.
    """
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        rem = repo.cloud.get_remote(remote_name)
        fs, odb = rem.fs, rem.odb
        result = Verification(remote_url=str(repo.config["remote"][remote_name]["url"]))
        listing = _list(fs, odb.path)
        # `cache: false` outputs (metrics, plots) never go to a DVC remote: git carries them.
        in_git = set(uncached_outputs(root))
        todo = [o for o in recorded_outputs(root) if o.path not in in_git]
        while todo:
            obj = todo.pop()
            result.owners[obj.owner] = result.owners.get(obj.owner, 0) + 1
            path = odb.oid_to_path(obj.oid)
            result.checked += 1
            info = listing.get(path)
            if info is None:
                result.missing.append(obj)
                continue
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


def repair_remote(root: Path, remote_name: str, missing: Iterable[Expected]) -> list[Expected]:
    """Upload the missing objects the local cache holds intact; the ones uploaded.

    `dvc push` takes a folder whose `.dir` manifest is on the remote for complete, so an entry
    lost from it (a cut-short upload, a deleted object) is never pushed again by DVC.
    """
    from dvc.repo import Repo

    uploaded = []
    with Repo(str(root)) as repo:
        rem = repo.cloud.get_remote(remote_name)
        local_fs = repo.cache.local.fs
        for obj in missing:
            local = Path(repo.cache.local.oid_to_path(obj.oid))
            # Never replace a lost object with a corrupted one: the copy must hash to its oid.
            if not local.exists() or _md5_of(local_fs, str(local)) != obj.oid.removesuffix(".dir"):
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
    findings = []
    owners_bad = sorted({o.owner for o in v.missing} | {o.owner for o, _ in v.corrupted})
    owners_ok = sorted(set(v.owners) - set(owners_bad))
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
            )
        )
    for obj in v.missing[:20]:
        findings.append(
            Finding(
                False,
                f"missing in {where}: {obj.path} ({obj.owner}, object {obj.oid}), and not "
                "intact in the local cache either",
                f"re-run the stage (`dvc repro {obj.owner}`) or `dvc fetch` it from another "
                "remote, then run `draftline salvage` again",
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


# --- notes, logs, metrics ------------------------------------------------------------------


def gather_logs(root: Path, dest: Path, secrets: list[str]) -> list[str]:
    """Copy (the tail of) every log into the notes, secrets scrubbed."""
    copied: list[str] = []
    budget = MAX_LOGS_BYTES
    for source in LOG_SOURCES:
        base = root / source
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if not path.is_file() or path.suffix not in LOG_SUFFIXES or budget <= 0:
                continue
            if "journal" in path.relative_to(root).parts:
                continue
            size = path.stat().st_size
            keep = min(size, MAX_LOG_BYTES, budget)
            with path.open("rb") as f:
                f.seek(size - keep)
                text = f.read().decode("utf-8", errors="replace")
            if keep < size:
                text = f"[... first {size - keep} bytes left out ...]\n" + text
            rel = path.relative_to(root)
            atomic.write_text(dest / "logs" / rel, node_snapshot.redact_text(text, secrets))
            budget -= keep
            copied.append(str(rel))
    return copied


def gather_metrics(root: Path) -> dict[str, Any]:
    """Every stage metrics file and run log (`metrics/**/*.json`, `logs/runs/**/*.json`)."""
    found: dict[str, Any] = {}
    paths = [*(root / "metrics").rglob("*.json"), *(root / "logs" / "runs").rglob("*.json")]
    for path in sorted(paths):
        try:
            found[str(path.relative_to(root))] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            found[str(path.relative_to(root))] = {"unreadable": str(exc)}
    return found


def journal_progress(root: Path) -> dict[str, int]:
    folder = root / ".draftline" / "journal"
    return {
        str(p.relative_to(root)): sum(1 for _ in p.open("rb"))
        for p in sorted(folder.rglob("*.jsonl"))
    }


def known_secrets(root: Path) -> list[str]:
    """Every secret value this node knows: the environment's secret-looking values and the
    credentials in DVC's config (`.dvc/config.local`), longest first."""
    found = set(node_snapshot.secret_values()) | set(remote.config_secrets(root))
    return sorted(found, key=len, reverse=True)


def write_notes(
    dest: Path,
    snap: dict[str, Any],
    findings: list[Finding],
    extra: dict[str, Any],
    secrets: list[str],
) -> None:
    """NOTES.md, node.json and salvage.json, every string scrubbed: they are committed."""
    atomic.write_json(dest / "node.json", node_snapshot.redact_data(snap, secrets))
    salvage_json = {"findings": [asdict(f) for f in findings], **extra}
    atomic.write_json(dest / "salvage.json", node_snapshot.redact_data(salvage_json, secrets))
    lines = [f"# Salvage of {snap['host']} at {snap['time_utc']}", ""]
    lines += [_format(f) for f in findings] + [""]
    lines += [
        node_snapshot.to_markdown(snap),
        "## Resume on a new node",
        "",
        "```",
        "git clone <this repository> && cd <it>",
        RESUME_COMMAND,
        "```",
        "",
        f"{HAZARD}.",
        "",
    ]
    atomic.write_text(dest / "NOTES.md", node_snapshot.redact_text("\n".join(lines), secrets))


# --- git -----------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=False, env=env
    )


def git_changes(root: Path) -> list[str]:
    done = _git(root, "status", "--porcelain", "--untracked-files=all")
    return done.stdout.splitlines() if done.returncode == 0 else []


def _bookkeeping(change: str, uncached: Iterable[str] = ()) -> bool:
    """DVC's own files (the lock, `.dvc` pointers, the .gitignore files it maintains) and the
    `cache: false` outputs of finished stages (metrics, plots), which git carries, not DVC."""
    path = change[3:].strip().strip('"')
    name = Path(path).name
    if name in ("dvc.lock", ".gitignore") or name.endswith(".dvc"):
        return True
    return any(path == out or path.startswith(out.rstrip("/") + "/") for out in uncached)


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


def commit_and_push(root: Path, notes: Path, message: str, push: bool) -> list[Finding]:
    note_path = str(notes.relative_to(root))
    uncached = uncached_outputs(root)
    kept = [c[3:].strip().strip('"') for c in git_changes(root) if _bookkeeping(c, uncached)]
    paths = sorted({note_path, *kept})
    # -f for the notes: the copied logs keep their paths (logs/, .draftline/), which the
    # repository's .gitignore ignores, and they must reach the next node all the same.
    added = _git(root, "add", "-f", "--", note_path)
    if added.returncode == 0 and kept:
        added = _git(root, "add", "--", *kept)
    if added.returncode != 0:
        return [
            Finding(
                False,
                f"git add failed: {added.stderr.strip()[:300]}",
                "fix the repository (disk full? permissions?) and run again",
            )
        ]
    done = _git(root, "commit", "-m", message, "--", *paths)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip()[:300]
        return [
            Finding(
                False,
                f"git commit of dvc.lock and notes failed: {why}",
                "set `git config user.name/user.email` or free disk space, run again",
            )
        ]
    rev = _git(root, "rev-parse", "--short", "HEAD").stdout.strip()
    findings = [Finding(True, f"committed {', '.join(paths)} as {rev}")]
    if not push:
        return findings + [
            Finding(
                False,
                f"commit {rev} is only on this node (--no-push-git)",
                "git push it before shutting down",
            )
        ]
    remotes = _git(root, "remote").stdout.split()
    if not remotes:
        return findings + [
            Finding(
                False,
                f"no git remote: commit {rev} is only on this node",
                "`git remote add origin URL && git push -u origin HEAD`",
            )
        ]
    has_upstream = _git(root, "rev-parse", "--abbrev-ref", "@{u}").returncode == 0
    target = "origin" if "origin" in remotes else remotes[0]
    pushed = _git(root, "push") if has_upstream else _git(root, "push", "-u", target, "HEAD")
    if pushed.returncode != 0:
        why = node_snapshot.redact_text(pushed.stderr.strip())[:300]
        return findings + [
            Finding(
                False, f"git push failed: {why}", "push the commit by hand before shutting down"
            )
        ]
    return findings + [Finding(True, f"git: {rev} pushed to {target}")]


def uncommitted(root: Path) -> list[Finding]:
    changes = git_changes(root)
    if not changes:
        return [Finding(True, "git: no uncommitted changes")]
    shown = ", ".join(c[3:] for c in changes[:15]) + (" ..." if len(changes) > 15 else "")
    return [
        Finding(
            False,
            f"{len(changes)} uncommitted or untracked files, not saved: {shown}",
            "commit and push what you need (scripts, configs, patches), or delete it",
        )
    ]


# --- servers -------------------------------------------------------------------------------


def stop_servers(root: Path) -> list[Finding]:
    if importlib.util.find_spec("draftline.commands.serve") is None:
        return [Finding(True, "servers: `draftline serve` is not installed here, none to stop")]
    done = subprocess.run(
        [sys.executable, "-m", "draftline", "serve", "stop"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        why = node_snapshot.redact_text((done.stderr or done.stdout).strip())[-300:]
        return [
            Finding(
                False,
                f"`draftline serve stop` failed: {why}",
                "stop the servers by hand (`draftline serve status`)",
            )
        ]
    return [Finding(True, "servers stopped (`draftline serve stop`)")]


# --- the whole checklist -------------------------------------------------------------------


def _format(f: Finding) -> str:
    head = "SAFE     " if f.safe else "NOT SAFE "
    return f"{head} {f.what}" + (f"\n          fix: {f.fix}" if f.fix else "")


def plan(opts: Options, info: remote.RemoteInfo | None, notes: Path) -> list[str]:
    target = info.describe() if info else "(no usable remote)"
    steps = [
        "check for stages in flight (DVC rwlock), unfinished generation journals, free disk "
        "space and a writable DVC cache",
        f"snapshot this node into {notes}/NOTES.md and node.json (secrets redacted)",
        f"copy logs from {', '.join(s + '/' for s in LOG_SOURCES)} and metrics/**/*.json "
        f"into {notes}/",
        f"dvc push --run-cache -r {info.name if info else '?'}   -> {target}",
        "verify that the remote holds every object of dvc.lock and .dvc files "
        f"(.dir entries included) and the run-cache{' (download and hash)' if opts.deep else ''}",
    ]
    if opts.stop_servers:
        steps.append("draftline serve stop")
    if opts.commit:
        steps.append(
            "git commit dvc.lock, DVC's .gitignore/.dvc files, the cache: false outputs "
            f"(metrics, plots) of finished stages and {notes}/"
            + (" and git push" if opts.push_git else "")
        )
    steps.append("report SAFE / NOT SAFE; exit 1 when anything is NOT SAFE")
    return steps


def salvage(opts: Options, out: Callable[[str], None] = print) -> int:
    root = opts.root.resolve()
    if not (root / ".dvc").is_dir():
        out(f"{root} is not a DVC repository (no .dvc/): run salvage from the repository root")
        return 2
    now = dt.datetime.now(dt.timezone.utc)
    notes = root / opts.notes_dir / f"{now:%Y%m%dT%H%M%SZ}-{socket.gethostname()}"
    findings: list[Finding] = []
    secrets = known_secrets(root)

    info: remote.RemoteInfo | None = None
    credentials_ok = False
    try:
        info = remote.describe_remote(root, opts.remote)
        source = remote.credential_source(root, info)
    except remote.RemoteError as exc:
        findings.append(Finding(False, str(exc).split("\n", 1)[0], _fix_of(exc)))
    else:
        credentials_ok = True
        findings.append(Finding(True, f"remote {info.describe()}; credentials: {source}"))

    findings += stages_in_flight(root)
    findings += partial_journals(root, locked_stages(root))
    findings += disk_space([root, notes], opts.min_free_bytes)
    findings += cache_writable(_cache_dir(root))

    if opts.dry_run:
        out("draftline salvage --dry-run: the plan")
        for i, step in enumerate(plan(opts, info, notes.relative_to(root)), 1):
            out(f"  {i}. {step}")
        out("found so far (nothing was changed):")
        for f in findings:
            out(node_snapshot.redact_text(_format(f), secrets))
        return 0

    snap = _guard(findings, "node snapshot", lambda: node_snapshot.take_snapshot(root)) or {}
    logs = _guard(findings, "gathering logs", lambda: gather_logs(root, notes, secrets)) or []
    metrics = _guard(findings, "gathering metrics", lambda: gather_metrics(root)) or {}

    verification: Verification | None = None
    push_output = ""
    if info is not None and credentials_ok:
        try:
            remote.check_reachable(root, info)
        except remote.RemoteError as exc:
            findings.append(Finding(False, str(exc), "fix the remote, then run salvage again"))
        else:
            ok, push_output = dvc_push(root, info.name)
            if not ok:
                findings.append(
                    Finding(
                        False,
                        f"`dvc push --run-cache -r {info.name}` failed: "
                        + _last_lines(push_output),
                        "fix the cause above and run `draftline salvage` again",
                    )
                )
            verification = _guard(
                findings, "verifying the remote", lambda: verify_remote(root, info.name, opts.deep)
            )
            if verification is not None and verification.missing:
                verification = _repair(findings, root, info, verification, opts.deep)
            if verification is not None:
                findings += verification_findings(verification, info.url)

    if opts.stop_servers:
        findings += stop_servers(root)

    extra = {
        "logs": logs,
        "metrics": metrics,
        "journals": journal_progress(root),
        "push_output_tail": push_output[-4000:],
        "verification": _verification_summary(verification),
    }
    wrote = _guard(
        findings,
        f"writing notes to {notes.relative_to(root)}",
        lambda: write_notes(notes, snap, findings, extra, secrets) or True,
    )
    if wrote:
        findings.append(Finding(True, f"notes: {notes.relative_to(root)}/NOTES.md"))
        if opts.commit:
            host = socket.gethostname()
            message = f"salvage: dvc.lock and notes from {host} at {now:%Y-%m-%d %H:%M}Z"
            findings += commit_and_push(root, notes, message, opts.push_git)
    findings += uncommitted(root)

    for f in findings:
        out(node_snapshot.redact_text(_format(f), secrets))
    bad = [f for f in findings if not f.safe]
    out("")
    if bad:
        out(f"VERDICT: NOT SAFE to shut this node down ({len(bad)} problems above).")
        return 1
    out("VERDICT: SAFE to shut this node down.")
    out(f"On the next node: git clone, then `{RESUME_COMMAND}` ({HAZARD}).")
    return 0


def _repair(
    findings: list[Finding],
    root: Path,
    info: remote.RemoteInfo,
    verification: Verification,
    deep: bool,
) -> Verification | None:
    """Upload what the remote lacks and verify again; says what it repaired."""
    missing = verification.missing
    uploaded = _guard(
        findings, "repairing the remote", lambda: repair_remote(root, info.name, missing)
    )
    if not uploaded:
        return verification
    shown = ", ".join(f"{o.path} ({o.owner})" for o in uploaded[:10])
    more = f" and {len(uploaded) - 10} more" if len(uploaded) > 10 else ""
    findings.append(
        Finding(
            True,
            f"repaired {info.url}: uploaded {len(uploaded)} missing objects from the local cache "
            f"that `dvc push` did not send (it takes a folder whose .dir manifest is there for "
            f"complete): "
            f"{shown}{more}",
        )
    )
    return _guard(findings, "verifying the remote", lambda: verify_remote(root, info.name, deep))


def _guard(findings: list[Finding], what: str, step: Callable[[], Any]) -> Any:
    """Run one step; an exception becomes a NOT SAFE finding, with ENOSPC named as such."""
    try:
        return step()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            findings.append(
                Finding(
                    False,
                    f"disk full while {what}: {exc}",
                    "free space on that disk and run `draftline salvage` again",
                )
            )
        else:
            findings.append(Finding(False, f"{what} failed: {exc}", "fix it and run again"))
    except Exception as exc:  # a failed step is reported, never lost in a traceback
        text = node_snapshot.redact_text(f"{type(exc).__name__}: {exc}")[:400]
        findings.append(Finding(False, f"{what} failed: {text}", "fix it and run again"))
    return None


def _cache_dir(root: Path) -> Path:
    from dvc.config import Config

    configured = Config(dvc_dir=str(root / ".dvc")).get("cache", {}).get("dir")
    return Path(configured) if configured else root / ".dvc" / "cache"


def _fix_of(exc: Exception) -> str:
    parts = str(exc).split("\n", 1)
    return parts[1] if len(parts) > 1 else ""


def _last_lines(text: str, n: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])[:600] or "(no output)"


def _verification_summary(v: Verification | None) -> dict[str, Any] | None:
    if v is None:
        return None
    return {
        "remote": v.remote_url,
        "checked": v.checked,
        "by_etag": v.by_etag,
        "by_parts": v.by_parts,
        "by_download": v.by_download,
        "missing": [asdict(o) for o in v.missing],
        "corrupted": [{**asdict(o), "why": why} for o, why in v.corrupted],
        "run_cache_checked": v.runs_checked,
        "run_cache_missing": v.runs_missing,
    }
