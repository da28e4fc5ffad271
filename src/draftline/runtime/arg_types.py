"""argparse types for bounded numbers: a bad value ends in argparse's one line naming the option
(`draftline follow: error: argument --poll-s: must be a number > 0, not -5`), not in a
traceback once the command has started."""

from __future__ import annotations

import argparse
import math


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def positive(text: str) -> float:
    """A finite number > 0 (a pause, a period)."""
    if (value := _number(text)) <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0 (a size, where 0 turns the check off)."""
    if (value := _number(text)) < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text}")
    return value
