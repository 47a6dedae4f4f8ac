"""A gate: the reasons a feature cannot run, checked in order; the first failing one turns it off.

Steps 3 and 5 are gates. Each reason is a rule id, whether it fails, the sentence that says so, and the keys
whose values made it fail, so that `strata explain` shows the effect under the key that caused it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .ledger import Ledger


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason a feature cannot run."""

    rule: str
    fails: bool
    message: str
    because: tuple[str, ...] = ()
    """The keys whose values make it fail."""


def first_failing(led: Ledger, key: str, off: Any, reasons: Iterable[Reason]) -> None:
    """Check ``reasons`` in order; the first that fails sets feature ``key`` to ``off`` and says why."""
    for r in reasons:
        led.gate(key, r.rule)
        if r.fails:
            led.change(key, off, r.rule, r.message, because=r.because)
            return
