"""One line of the salvage report: what is (not) safe, and the fix when it is not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    safe: bool
    what: str
    fix: str = ""


def format_finding(f: Finding) -> str:
    head = "SAFE     " if f.safe else "NOT SAFE "
    return f"{head} {f.what}" + (f"\n          fix: {f.fix}" if f.fix else "")
