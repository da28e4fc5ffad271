"""The salvage notes committed with the run: copied logs (secrets redacted), stage metrics,
journal progress."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from draftline.ops import node_snapshot, redaction, remote
from draftline.ops.salvage.finding import Finding, format_finding
from draftline.runtime import atomic

LOG_SOURCES = ("logs", ".draftline")
LOG_SUFFIXES = (".log", ".txt", ".out", ".err")
MAX_LOG_BYTES = 2 * 2**20  # the tail of each log is kept: the end is where it went wrong
MAX_LOGS_BYTES = 20 * 2**20
RESUME_COMMAND = "dvc repro --pull"
HAZARD = (
    "never add --allow-missing: it does not pull the stages it skips, so the stages after them "
    "would see folders without the finished shards (their input guard refuses to run)"
)


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
            atomic.write_text(dest / "logs" / rel, redaction.redact_text(text, secrets))
            budget -= keep
            copied.append(str(rel))
    return copied


def gather_metrics(root: Path) -> dict[str, Any]:
    """Every stage metrics file, report and run log (`metrics/**/*.json`, `reports/*.json`,
    `logs/runs/**/*.json`)."""
    found: dict[str, Any] = {}
    paths = [
        *(root / "metrics").rglob("*.json"),
        *(root / "reports").glob("*.json"),
        *(root / "logs" / "runs").rglob("*.json"),
    ]
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
    """Every secret this node knows, longest first: the environment's values and their parts
    (`redaction.secret_values`), and the credentials in DVC's config (`.dvc/config.local`)."""
    return redaction.secret_values(extra=remote.config_secrets(root))


def write_notes(
    dest: Path,
    snap: dict[str, Any],
    findings: list[Finding],
    extra: dict[str, Any],
    secrets: list[str],
) -> None:
    """NOTES.md, node.json and salvage.json, every string scrubbed: they are committed."""
    atomic.write_json(dest / "node.json", redaction.redact_data(snap, secrets))
    salvage_json = {"findings": [asdict(f) for f in findings], **extra}
    atomic.write_json(dest / "salvage.json", redaction.redact_data(salvage_json, secrets))
    lines = [f"# Salvage of {snap['host']} at {snap['time_utc']}", ""]
    lines += [format_finding(f) for f in findings] + [""]
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
    atomic.write_text(dest / "NOTES.md", redaction.redact_text("\n".join(lines), secrets))
