"""Argument types that several commands share, kept apart from `_common` so that a command that reads no
profile does not import the resolver."""

from __future__ import annotations

import argparse
import math


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def positive_seconds(text: str) -> float:
    """A finite number of seconds above 0; ``nan`` and ``inf`` are usage errors (a bound that never ends)."""
    value = _seconds(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds above 0")
    return value


def seconds_or_off(text: str) -> float:
    """A finite number of seconds, 0 or above (0: off)."""
    value = _seconds(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds, 0 or above (0: off)")
    return value
