"""How many proposals a solo window drafts: the depth that gives the most tokens per second.

A solo window with d proposals takes the time of a (d + 1)-row window, drafting and deciding included, and
emits on average

    E(d) = 1 + h0 + h0·h1 + ... + h0·h1···h(d-1)

tokens, where h_j is the chance that proposal j holds once the proposals before it held. Both sides are
measured while the engine runs:

* each request's h_j (`strata_runtime.engine.speculative.DraftGauge.hold`), from the windows it verified,
  taken at the upper end of its score interval (`DraftGauge.optimistic_holds`): a chance measured on few
  windows may be higher than it looks, and a depth that is not drafted is never measured;
* the engine's time for a solo window of r rows (`WindowCosts`), from the solo windows it finished.

`best_depth` picks the d in 0..most with the highest E(d) / cost(d + 1). A row count not measured yet is
costed at the least it can take given the measured ones (`WindowCosts.cost`), which is optimistic: each
depth that might beat the one in use is tried, and measured, once; from then on the measurements decide.
A request starts at full depth (its h_j start at 1, and with nothing measured the deepest window wins).

The same measurements decide whether slots that decode together take batch-MTP windows (a token and one
proposal each, 2k rows for k slots) or serial ones (k rows): `batch_mtp_pays` weighs k(1 + h) tokens over
a 2k-row batch-MTP window's time against k tokens over a k-row serial window's, h being the slots' mean
chance that a proposal holds. Serial windows of k slots run first, until their time is measured: which
kind wins depends on the device (on an H200 a window of 2k rows took 1.28 to 1.6 times one of k rows, for k
= 1 to 4; on two virtual CPU devices the demo model's 4-row window about 1.6 times its 2-row one).

Greedy text and the sampled distribution do not depend on the depth: a window with fewer proposals emits
tokens from the target the same way.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

COST_KEPT = 15
"""Recent windows of each row count whose median is its time: robust to the one-off slow window (a kernel
compiled or a graph captured at its first launch, a host pause), and following slow drifts (the KV
grows)."""
COST_MEASURED = 3
"""Windows of a row count before its measured time replaces the estimate."""
DEPTH_SWITCH = 1.05
"""A run of windows at one depth changes depth only for at least 5% more expected tokens per second:
changing ends a chain of windows queued on the device, which costs a host round trip."""


PRIOR_WEIGHT = 1 / 32
"""Weight of each window's outcome in what earlier requests measured (`Holds` shared by the requests of one
kind): an average over about the last 32 windows."""


class Holds:
    """Per proposal position, the chance that a proposal held once those before it held: a plain mean over
    the first windows that reached the position, then an exponential average in which each new one weighs
    ``weight``. A request's `DraftGauge` keeps its own; the requests of one kind (greedy or sampled, with
    or without penalties) share one more, which a new request starts from instead of from 1, so that a
    stream of short requests does not pay the full depth's first windows, and the switch away from it, in
    every one of them."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.chance: list[float] = []
        self.reached: list[int] = []
        """Per position, the windows that reached it (every proposal before it held)."""

    def record(self, position: int, held: bool) -> None:
        if position == len(self.chance):
            self.chance.append(0.0)
            self.reached.append(0)
        self.reached[position] += 1
        w = max(1 / self.reached[position], self.weight)
        self.chance[position] = (1 - w) * self.chance[position] + w * held

    def known(self, position: int, least: int) -> float | None:
        """The chance at ``position`` once at least ``least`` windows reached it (None before)."""
        if position < len(self.reached) and self.reached[position] >= least:
            return self.chance[position]
        return None


class WindowCosts:
    """The engine's measured time of a solo window by its row count (milliseconds: the median of the last
    `COST_KEPT` windows), shared by every request of one kind."""

    def __init__(self) -> None:
        self.recent: dict[int, deque[float]] = {}
        self.ms: dict[int, float] = {}
        self.seen: dict[int, int] = {}

    def observe(self, rows: int, ms: float) -> None:
        recent = self.recent.setdefault(rows, deque(maxlen=COST_KEPT))
        recent.append(ms)
        self.seen[rows] = self.seen.get(rows, 0) + 1
        self.ms[rows] = statistics.median(recent)

    def measured(self, rows: int) -> bool:
        return self.seen.get(rows, 0) >= COST_MEASURED

    def cost(self, rows: int) -> float | None:
        """The time of a ``rows``-row window: measured, or else the least it can be given the measured row
        counts (None while none is measured). A wider window never takes less time than a narrower one,
        and a window's time per row falls as it widens, so an r-row window takes at least what any
        measured narrower one took, and at least r / r' of what any measured wider one (r' rows) took."""
        if self.measured(rows):
            return self.ms[rows]
        known = [r for r in self.ms if self.measured(r)]
        if not known:
            return None
        return max(self.ms[r] if r < rows else self.ms[r] * rows / r for r in known)


def expected_tokens(holds: Sequence[float], depth: int) -> float:
    """E(depth): the tokens a window with ``depth`` proposals emits on average, ``holds[j]`` being the
    chance that proposal j holds after the ones before it held."""
    total, reach = 1.0, 1.0
    for h in holds[:depth]:
        reach *= h
        total += reach
    return total


def value(holds: Sequence[float], costs: WindowCosts, depth: int) -> float | None:
    """Expected tokens per millisecond at ``depth`` (None while nothing is measured)."""
    cost = costs.cost(depth + 1)
    return None if cost is None else expected_tokens(holds, depth) / cost


def best_depth(holds: Sequence[float], costs: WindowCosts, most: int) -> int:
    """The depth in 0..most with the most expected tokens per second (``most`` while nothing is measured;
    the deeper one of a tie)."""
    values = [value(holds, costs, d) for d in range(most + 1)]
    if any(v is None for v in values):
        return most
    return max(range(most + 1), key=lambda d: (values[d], d))


def worth_switching(holds: Sequence[float], costs: WindowCosts, now: int, to: int) -> bool:
    """Whether windows at depth ``to`` beat the current ``now`` by `DEPTH_SWITCH` (yes while nothing is
    measured: `best_depth` then names the full depth, which is where a request starts)."""
    a, b = value(holds, costs, to), value(holds, costs, now)
    return a is None or b is None or a > DEPTH_SWITCH * b


def batch_mtp_pays(
    chances: Sequence[float], serial: WindowCosts, batch_mtp: WindowCosts, now_batch_mtp: bool
) -> bool | None:
    """Whether k slots whose proposals hold with ``chances`` get more tokens per second from a batch-MTP
    window (2k rows, k + sum(chances) tokens) than from a serial one (k rows, k tokens), by the measured
    times; the kind in use (``now_batch_mtp``) is kept unless the other beats it by `DEPTH_SWITCH`. None
    while no serial window of k rows is measured. A batch-MTP row count not measured yet is costed at the
    least it can take (`WindowCosts.cost`), so it is tried."""
    k = len(chances)
    if not serial.measured(k):
        return None
    t_serial = serial.ms[k]
    t_batch = batch_mtp.cost(2 * k)
    if t_batch is None:
        return True
    with_proposals, without = (k + sum(chances)) / t_batch, k / t_serial
    if now_batch_mtp:
        return DEPTH_SWITCH * with_proposals >= without
    return with_proposals > DEPTH_SWITCH * without
