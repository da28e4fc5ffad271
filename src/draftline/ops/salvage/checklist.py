"""Save everything before a node shuts down, and say plainly whether it is safe to.

The checklist, in order: look for work in flight and for a full disk or an unwritable cache,
snapshot the node, gather logs and stage metrics, `dvc push --run-cache`, verify that the
remote holds every object `dvc.lock` (and any `.dvc` file) names -- the entries of `.dir`
manifests included -- and every run-cache entry, push every experiment (`dvc exp push`: refs and
outputs) and verify it, optionally stop the servers, commit `dvc.lock` with its params.yaml
and the notes (every finding in them) and push git, then print what is safe and where and what
is NOT. Every git push goes to the remote the branch tracks (`git_target`), and none happens
while what it would send holds a secret (`outgoing`). `--dry-run` runs every check that
writes nothing and gives the verdict it would.
Any step that fails becomes a NOT SAFE finding; nothing here raises past `salvage`.
"""

from __future__ import annotations

import datetime as dt
import errno
import importlib.util
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftline.ops import node_snapshot, redaction, remote
from draftline.ops.salvage.experiments import check_experiments
from draftline.ops.salvage.finding import Finding, format_finding
from draftline.ops.salvage.git_state import commit_and_push, no_git_remote, to_commit, uncommitted
from draftline.ops.salvage.git_target import GitTarget, git_target, remotes_finding
from draftline.ops.salvage.node_checks import (
    cache_writable,
    disk_space,
    partial_journals,
    stages_in_flight,
)
from draftline.ops.salvage.notes import (
    HAZARD,
    LOG_SOURCES,
    RESUME_COMMAND,
    gather_logs,
    gather_metrics,
    journal_progress,
    known_secrets,
    write_notes,
)
from draftline.ops.salvage.outgoing import secrets_in_outgoing
from draftline.ops.salvage.params_state import params_findings
from draftline.ops.salvage.remote_outputs import (
    Verification,
    dvc_push,
    locked_stages,
    repair_remote,
    verification_findings,
    verify_remote,
)

NOTES_DIR = Path("notes") / "salvage"
DEFAULT_MIN_FREE = 64 * 2**20


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
        why = redaction.redact_text((done.stderr or done.stdout).strip())[-300:]
        return [
            Finding(
                False,
                f"`draftline serve stop` failed: {why}",
                "stop the servers by hand (`draftline serve status`)",
            )
        ]
    return [Finding(True, "servers stopped (`draftline serve stop`)")]


# --- the whole checklist -------------------------------------------------------------------


def plan(opts: Options, info: remote.RemoteInfo | None, notes: Path) -> list[str]:
    target = info.describe() if info else "(no usable remote)"
    steps = [
        "check for stages in flight (DVC rwlock), unfinished generation journals, free disk "
        "space and a writable DVC cache",
        f"snapshot this node into {notes}/NOTES.md and node.json (secrets redacted)",
        f"copy logs from {', '.join(s + '/' for s in LOG_SOURCES)}, metrics/**/*.json and "
        f"reports/*.json into {notes}/",
        "one signed HEAD request on the bucket: are the credentials accepted, is the bucket "
        "there; what the remote holds already (SAFE / WOULD BE LOST / NEVER HERE)",
        f"dvc push --run-cache -r {info.name if info else '?'}   -> {target}",
        "verify that the remote holds every object of dvc.lock and .dvc files "
        f"(.dir entries included) and the run-cache{' (download and hash)' if opts.deep else ''}",
        f"dvc exp push <git remote> --all-commits -r {info.name if info else '?'}: every "
        "experiment's ref and outputs; verify both",
    ]
    if opts.stop_servers:
        steps.append("draftline serve stop")
    if opts.commit:
        steps.append(
            "git commit dvc.lock, params.yaml, DVC's .gitignore/.dvc files, the cache: false "
            f"outputs (metrics, plots) of finished stages and {notes}/"
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
    remote_ok = False
    try:
        info = remote.describe_remote(root, opts.remote)
        source = remote.credential_source(root, info)
        answer = remote.check_access(root, info)  # one authenticated request, read-only
    except remote.RemoteError as exc:
        findings.append(Finding(False, str(exc).split("\n", 1)[0], _fix_of(exc)))
    else:
        remote_ok = True
        findings.append(Finding(True, f"remote {info.describe()}; credentials: {source}; {answer}"))

    findings += stages_in_flight(root)
    findings += partial_journals(root, locked_stages(root))
    findings += disk_space([root, notes], opts.min_free_bytes)
    findings += cache_writable(_cache_dir(root))
    target = git_target(root)
    findings += remotes_finding(target)
    stopped = _screen(findings, root, target)

    if opts.dry_run:
        out("draftline salvage --dry-run: the plan")
        for i, step in enumerate(plan(opts, info, notes.relative_to(root)), 1):
            out(f"  {i}. {step}")
        if info is not None and remote_ok:  # what a shutdown now would lose, before the push
            now = _guard(
                findings, "reading the remote", lambda: verify_remote(root, info.name, False)
            )
            if now is not None:
                findings += verification_findings(now, info.url)
        info_ok = info if remote_ok else None
        findings += _experiments(findings, root, info_ok, target, False, stopped)[0]
        findings += params_findings(root)
        if opts.commit and opts.push_git:
            findings += no_git_remote(target, stopped)
        findings += uncommitted(root, to_commit(root))
        out("found (nothing was changed):")
        return _verdict(findings, secrets, out, "VERDICT (dry run, nothing changed):")

    snap = _guard(findings, "node snapshot", lambda: node_snapshot.take_snapshot(root)) or {}
    logs = _guard(findings, "gathering logs", lambda: gather_logs(root, notes, secrets)) or []
    metrics = _guard(findings, "gathering metrics", lambda: gather_metrics(root)) or {}

    verification: Verification | None = None
    push_output = ""
    if info is not None and remote_ok:
        ok, push_output = dvc_push(root, info.name)
        if not ok:
            findings.append(
                Finding(
                    False,
                    f"`dvc push --run-cache -r {info.name}` failed: " + _last_lines(push_output),
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

    found, experiments = _experiments(
        findings, root, info if remote_ok else None, target, True, stopped
    )
    findings += found

    if opts.stop_servers:
        findings += stop_servers(root)
    findings += params_findings(root)
    # Before the notes, so they hold it; what the commit itself carries is not "uncommitted".
    committing = to_commit(root) if opts.commit else []
    findings += uncommitted(root, committing)

    extra = {
        "logs": logs,
        "metrics": metrics,
        "journals": journal_progress(root),
        "push_output_tail": push_output[-4000:],
        "verification": _verification_summary(verification),
        "experiments": experiments,
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
            push_to = target if opts.push_git else None
            findings += commit_and_push(root, notes, message, push_to, stopped)
    elif committing:
        findings.append(
            Finding(
                False,
                f"nothing committed (no notes): {', '.join(committing)} stay uncommitted here",
                "fix the cause above and run `draftline salvage` again",
            )
        )
    return _verdict(findings, secrets, out, "VERDICT:")


def _experiments(
    findings: list[Finding],
    root: Path,
    info: remote.RemoteInfo | None,
    target: GitTarget,
    write: bool,
    stopped: bool = False,
) -> tuple[list[Finding], list[dict[str, Any]]]:
    where = info.url if info else ""
    checked = _guard(
        findings,
        "saving experiments",
        lambda: check_experiments(root, target, info.name if info else None, where, write, stopped),
    )
    return checked or ([], [])


def _screen(findings: list[Finding], root: Path, target: GitTarget) -> bool:
    """Whether to stop every git push of this run: what it would send holds a secret, or
    could not be read (each a NOT SAFE finding)."""
    if target.remote is None:
        return False
    remote_name = target.remote
    found = _guard(
        findings, "reading what git would push", lambda: secrets_in_outgoing(root, remote_name)
    )
    if found is None:
        return True
    findings += found
    return bool(found)


def _verdict(
    findings: list[Finding], secrets: list[str], out: Callable[[str], None], head: str
) -> int:
    """Print every finding and the verdict; 1 when anything is NOT SAFE."""
    for f in findings:
        out(redaction.redact_text(format_finding(f), secrets))
    bad = [f for f in findings if not f.safe]
    out("")
    if bad:
        out(f"{head} NOT SAFE to shut this node down ({len(bad)} problems above).")
        return 1
    out(f"{head} SAFE to shut this node down.")
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
        text = redaction.redact_text(f"{type(exc).__name__}: {exc}")[:400]
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
        "never_here_in_remote": [asdict(o) for o in v.never_here],
        "never_here_nor_in_remote": [asdict(o) for o in v.nowhere],
        "run_cache_checked": v.runs_checked,
        "run_cache_missing": v.runs_missing,
    }
