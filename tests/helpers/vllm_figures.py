"""The figures the `vllm` tests measure, gathered in logs/vllm/figures.json (.ci/vllm prints it
and starts each run without it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIGURES = Path(__file__).resolve().parents[2] / "logs" / "vllm" / "figures.json"


def record(**figures: Any) -> None:
    """Add figures to logs/vllm/figures.json."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    known = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    FIGURES.write_text(json.dumps({**known, **figures}, indent=2, sort_keys=True) + "\n")
