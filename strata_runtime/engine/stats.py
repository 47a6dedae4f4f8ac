"""What the windows did: each recent window, and running totals for the status page and summaries."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class WindowStat:
    """One window (or one pipelined round's share of it)."""

    kind: str
    rows: int
    ms: float
    proposals: int
    accepted: int
    slots: tuple[int, ...]
    on_device: bool = False
    """A speculative window decided on the device, GPU or CPU (`strata_runtime.engine.device_spec`)."""
    paused: bool = False
    """A decode window without proposals because its slots' drafting is paused (drafts seldom hold)."""
    tokens: int = 0
    """Tokens it emitted (none for a window run past its requests' end)."""
    caught_up: int = 0
    """Rows the drafting heads read in catch-up passes for it (`strata_runtime.engine.job.Job.caught_up`):
    head work its time may hold."""
    draft_ms: float = 0.0
    """Host wall time drafting its proposals before its launch: before ``ms`` starts, but between two
    deliveries where nothing ran ahead of it."""
    finish_ms: float = 0.0
    """Host wall time finishing it (reading its tokens, verifying, committing), part of ``ms``."""
    forced: int = 0
    """Tokens a request's grammar forced, read in it as proposals (not among ``proposals``)."""
    rates: tuple[float, ...] | None = None
    """A solo window whose depth the adaptive choice decided: the expected tokens a millisecond of each depth
    0, 1, ... when it was chosen (`strata_runtime.engine.job.Job.rates`); None otherwise."""


def window_name(w: WindowStat) -> str:
    """``solo 2`` for a solo window with 2 proposals, else the window's kind (``serial``, ``batch-mtp``,
    ``prefill``, ...)."""
    return f"solo {w.rows - 1}" if w.kind == "solo" else w.kind


class WindowStats:
    """The last ``keep`` windows and totals over every window since the engine started."""

    def __init__(self, keep: int = 1024) -> None:
        self.recent: deque[WindowStat] = deque(maxlen=keep)
        self.named: dict[str, list[float]] = {}
        """Per `window_name`: windows, milliseconds and tokens, summed; the totals' views by kind."""
        self.counts: dict[str, Any] = {
            "windows": 0,
            "rows": 0,
            "tokens": 0,
            "proposals": 0,
            "accepted": 0,
            "ms": 0.0,
            "discarded_rows": 0,
            "decided_on_device": 0,
            "drafting_paused": 0,
            "silent_probes": 0,
            "silent_probes_held": 0,
            "forced": 0,
        }

    @property
    def totals(self) -> dict[str, Any]:
        """The counters, and the windows by kind: ``by_name`` (`window_name`: windows, ms and tokens),
        ``windows_by_kind`` and ``ms_by_kind`` (solo windows as one kind), and ``solo_by_proposals``."""
        out = dict(self.counts)
        named = {name: list(v) for name, v in self.named.items()}
        out["by_name"] = {
            name: {"windows": n, "ms": ms, "tokens": tok} for name, (n, ms, tok) in named.items()
        }
        windows: dict[str, int] = {}
        ms: dict[str, float] = {}
        for name, (n, m, _) in named.items():
            kind = name.split()[0]
            windows[kind] = windows.get(kind, 0) + int(n)
            ms[kind] = ms.get(kind, 0.0) + m
        out["windows_by_kind"], out["ms_by_kind"] = windows, ms
        out["solo_by_proposals"] = {
            name.removeprefix("solo "): int(v[0]) for name, v in named.items() if name.startswith("solo ")
        }
        return out

    def record(self, window: WindowStat, discarded: int = 0) -> None:
        """Count one window; ``discarded`` of its rows were run past their request's end (windows queued
        ahead of a stop) and kept nothing."""
        self.recent.append(window)
        t = self.counts
        t["windows"] += 1
        t["rows"] += window.rows
        t["discarded_rows"] += discarded
        t["tokens"] += window.tokens
        t["proposals"] += window.proposals
        t["accepted"] += window.accepted
        t["ms"] += window.ms
        t["decided_on_device"] += window.on_device
        t["drafting_paused"] += window.paused
        t["forced"] += window.forced
        each = self.named.setdefault(window_name(window), [0, 0.0, 0])
        each[0] += 1
        each[1] += window.ms
        each[2] += window.tokens

    def silent_probe(self, held: bool) -> None:
        """Count a silent probe (`strata_runtime.engine.speculative.DraftGauge.silent`) and whether its
        proposal held."""
        self.counts["silent_probes"] += 1
        self.counts["silent_probes_held"] += held

    def last(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` windows as JSON-ready dictionaries."""
        return [asdict(w) for w in list(self.recent)[-n:]]

    @property
    def acceptance(self) -> float | None:
        """Accepted proposals over proposals made, or None before any was made."""
        made = self.counts["proposals"]
        return None if not made else float(self.counts["accepted"] / made)

    def summary(self) -> str:
        t = self.totals
        rate = f"{t['accepted']}/{t['proposals']} proposals accepted"
        if t["proposals"]:
            rate += f" ({100 * t['accepted'] / t['proposals']:.1f}%)"
        per = t["ms"] / t["windows"] if t["windows"] else 0.0
        line = f"{t['windows']} windows, {t['rows']} rows, {t['tokens']} tokens, {rate}"
        line += f", {per:.2f} ms per window"
        if t["decided_on_device"]:
            line += f", {t['decided_on_device']} speculative windows decided on the device"
        if t["drafting_paused"]:
            line += f", {t['drafting_paused']} windows without proposals while drafting paused"
        if t["silent_probes"]:
            line += f" ({t['silent_probes']} silent probes, {t['silent_probes_held']} held)"
        by = t["solo_by_proposals"]
        if len(by) > 1:
            line += ", solo windows by proposals " + ", ".join(f"{d}: {by[d]}" for d in sorted(by, key=int))
        if t["forced"]:
            line += f", {t['forced']} tokens a grammar forced read as proposals"
        if t["discarded_rows"]:
            line += f", {t['discarded_rows']} rows run ahead past a stop and discarded"
        return line
