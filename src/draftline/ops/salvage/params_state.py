"""Whether the salvage commit reproduces: params.yaml as dvc.lock recorded it, and as `draftline
compose` writes it.

A fresh clone runs `dvc repro --pull`: a stage whose params in params.yaml differ from those
dvc.lock recorded is run again instead of restored. `dvc exp run -S` rewrites params.yaml
itself (Hydra composition in DVC), so the file may also differ from `draftline compose` of
conf/: committed with the lock it matches, the run still reproduces; the note says how to
bring conf/ along.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draftline.ops import redaction
from draftline.ops.salvage.finding import Finding
from draftline.ops.salvage.remote_outputs import locked_stages


def params_findings(root: Path) -> list[Finding]:
    if not (root / "params.yaml").is_file():
        return []
    return _lock_matches(root) + _composed(root)


def _lock_matches(root: Path) -> list[Finding]:
    """Stages of dvc.lock whose params differ in params.yaml (`dvc status`)."""
    finished = locked_stages(root)
    if not finished:
        return []
    done = subprocess.run(
        ["dvc", "status", "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    try:
        status = json.loads(done.stdout or "{}")
    except ValueError:
        why = redaction.redact_text((done.stderr or done.stdout).strip())[-300:]
        return [Finding(False, f"`dvc status` failed: {why}", "fix it and run salvage again")]
    changed: dict[str, list[str]] = {}
    for stage, changes in status.items():
        if stage not in finished:
            continue
        for change in changes if isinstance(changes, list) else []:
            deps = change.get("changed deps", {}) if isinstance(change, dict) else {}
            params = deps.get("params.yaml") if isinstance(deps, dict) else None
            if isinstance(params, dict):
                changed.setdefault(stage, []).extend(sorted(params))
    if not changed:
        return [Finding(True, "params.yaml holds the params dvc.lock recorded")]
    shown = "; ".join(f"{stage}: {', '.join(keys)}" for stage, keys in sorted(changed.items()))
    return [
        Finding(
            False,
            f"params.yaml differs from what dvc.lock recorded ({shown}): a fresh clone would "
            "rerun these stages instead of restoring them",
            f"`dvc repro {' '.join(sorted(changed))}` to record them with these params, or "
            "`git checkout params.yaml` to go back to the recorded ones; then salvage again",
        )
    ]


def _composed(root: Path) -> list[Finding]:
    """`draftline compose --check`: params.yaml is conf/ composed with its recorded overrides."""
    if not (root / "conf").is_dir():
        return []
    done = subprocess.run(
        [sys.executable, "-m", "draftline", "compose", "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode == 0:
        return [Finding(True, "params.yaml passes `draftline compose --check`")]
    changed = [
        line[1:].split(":")[0].strip()
        for line in done.stdout.splitlines()
        if line.startswith("-") and not line.startswith("---") and ":" in line
    ]
    return [
        Finding(
            True,
            "params.yaml is not `draftline compose` of conf/ with the overrides it records "
            f"(changed: {', '.join(changed[:8]) or 'see `draftline compose --check`'}), e.g. "
            "written by `dvc exp run -S`; it is committed as it is, with the dvc.lock it was "
            "run with, so a clone reproduces this run",
            "to make conf/ reproduce it too: `draftline compose <the same overrides>` and commit",
            label="NOTE",
        )
    ]
