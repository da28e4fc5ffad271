"""One line of the salvage report: what is (not) safe, and the fix when it is not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    """`safe` decides the verdict; `label` tells a case apart in the report (WOULD BE LOST:
    only on this node; NEVER HERE: named by dvc.lock, never on this node)."""

    safe: bool
    what: str
    fix: str = ""
    label: str = ""


def format_finding(f: Finding) -> str:
    head = f.label or ("SAFE" if f.safe else "NOT SAFE")
    return f"{head:<9} {f.what}" + (f"\n          fix: {f.fix}" if f.fix else "")
