"""Calibration: the generate, extract and train figures of this node, measured in minutes on a
sample of the curated data, for `draftline plan` to use instead of conf/ estimates.

Each part runs the code its stage runs: generation through the engine `draftline generate`
builds (`make_engine`), with the production scheduler and its in-flight cap, every turn of a
sample of curated conversations, until its time is spent; extraction and training through
`ops.calibration_parts` on the target and drafter params.yaml names, over the sequences the
generation part produced (prompt + completion of each turn, capped at extract.max_length).

Nothing is written but the result, `logs/calibration/<profile>.json` (git-ignored, outside every
DVC output and journal): the generated turns stay in memory and are dropped, so a kill leaves
nothing a later run or salvage would pick up. The result is keyed by what decides its figures
(target id, data, drafter, features, profile, engine and package versions); `stale_reasons`
says why one no longer applies.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from draftline.runtime.params import identity as run_identity

CALIBRATION_DIR = Path("logs/calibration")
CURATED_TRAIN = Path("data/curated/train")
SCHEMA = "draftline.calibration/1"
PARTS = ("generate", "extract", "train")
# Share of the time budget per part: generation is the long stage and the slowest to settle.
SHARES = {"generate": 0.5, "extract": 0.25, "train": 0.25}
VERSIONED = ("draftline", "torch", "transformers", "sglang", "vllm")

Say = Callable[[str], None]


class PartSkipped(Exception):
    """A part cannot run here; the message says why in one line."""


def calibration_path(profile: str, folder: Path = CALIBRATION_DIR) -> Path:
    return folder / f"{profile}.json"


def split_budget(minutes: float, parts: Sequence[str]) -> dict[str, float]:
    """Seconds per part: `SHARES` of the budget, over the parts asked for."""
    total = sum(SHARES[p] for p in parts)
    return {p: minutes * 60.0 * SHARES[p] / total for p in parts}


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def key_of(p: dict[str, Any], profile: dict[str, Any], engine: str | None) -> dict[str, Any]:
    """What decides a calibration's figures: a change to any of them makes it stale."""
    drafter = p.get("drafter") or {}
    return {
        **run_identity(p),
        "target_id": (p.get("model") or {}).get("target_id"),
        "drafter_family": drafter.get("family") or "dflash",
        "block_size": drafter.get("block_size"),
        "max_anchors": drafter.get("max_anchors"),
        "features": str((p.get("extract") or {}).get("features", "offline")),
        "hardware_profile": profile.get("name"),
        "engine": engine,
        "versions": versions(),
        "date": date.today().isoformat(),
    }


def read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def stale_reasons(record: dict[str, Any], p: dict[str, Any]) -> list[str]:
    """Why a calibration no longer describes params.yaml on this node: another target, data,
    drafter or features, or other package versions than it was measured with."""
    now = key_of(p, {}, None)
    reasons = [
        f"{k} {record.get(k)!r} -> {now[k]!r}"
        for k in ("model", "target_id", "data", "drafter", "drafter_family", "features")
        if record.get(k) != now[k]
    ]
    was = record.get("versions") or {}
    reasons += [
        f"{name} {was.get(name)} -> {now['versions'].get(name)}"
        for name in sorted(set(was) | set(now["versions"]))
        if was.get(name) != now["versions"].get(name)
    ]
    return reasons


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {
        "mean": round(statistics.fmean(ordered), 2),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": float(ordered[-1]),
        "count": len(ordered),
    }


class TimeBar:
    """A progress bar over a part's time budget: elapsed seconds, its ETA, and a rate."""

    def __init__(self, what: str, budget_s: float, enabled: bool) -> None:
        from tqdm import tqdm

        self.began = time.monotonic()
        self.budget_s = budget_s
        self.tokens = 0
        self.bar = tqdm(
            total=round(budget_s),
            desc=f"calibrate {what}",
            unit="s",
            disable=not enabled,
            mininterval=1.0,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
            "[ETA {remaining}{postfix}]",
        )

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        elapsed = time.monotonic() - self.began
        self.bar.n = min(self.bar.total, round(elapsed))
        self.bar.set_postfix_str(f"{self.tokens / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def plan_figures(parts: dict[str, Any]) -> dict[str, Any]:
    """The figures `draftline plan` reads, from the parts that ran."""
    gen, ext, tr = (parts.get(k) or {} for k in PARTS)
    figures: dict[str, Any] = {
        "generate_tok_s": gen.get("output_tok_s"),
        "extract_tok_s": ext.get("tokens_per_s"),
        "extract_world_size": ext.get("world_size"),
        "train_world_size": tr.get("world_size"),
        "completion_tokens": (gen.get("completion_tokens") or {}).get("mean"),
        "prompt_tokens": (gen.get("first_prompt_tokens") or {}).get("mean"),
        "turns": (gen.get("turns_per_conversation") or {}).get("mean"),
        "turn_prompt_tokens": (gen.get("turn_prompt_tokens") or {}).get("mean"),
    }
    key = "train_online_tok_s" if tr.get("features") == "online" else "train_tok_s"
    figures[key] = tr.get("tokens_per_s")
    return {k: v for k, v in figures.items() if v is not None}
