"""Which routed experts of a stage hold a VRAM slot, and how that follows the routing.

A stage whose routed experts do not all fit in VRAM keeps every one of them in host memory and ``slots`` of
them in a VRAM cache. `Residency` is the cache's bookkeeping, with no arrays of weights in it: the table
``slot_of[j, e]`` (the slot holding expert ``e`` of the stage's ``j``-th layer, or -1), the owner of each
slot, and the adaptive policy that decides what the slots hold.

The policy, after the engine this project models (its adaptive tier nearly doubled decode speed on two 20 GB
cards: 89.2 against 45.2 tok/s), is frequency with decay:

* every window adds its routing counts to a score per expert, after multiplying the scores by ``decay``
  (0.7) per window, so a score is a recent-use frequency with a half-life of about two windows;
* every ``every`` windows (4), the highest-scoring missing experts replace the lowest-scoring resident ones,
  one for one, while the newcomer's score beats the evicted one's by ``margin``, at most ``max_swaps`` a time
  (each swap copies one expert over the host link, which misses also use).

The cache is one pool for all the stage's layers, so a layer whose routing is spread wide gets more slots than
one whose routing repeats. It starts with the slots spread evenly over the layers (experts in id order); the
first windows (the prompt's chunks, which route thousands of rows) then fill it with what the request uses.
Swapping changes where an expert's product is computed, never its value: the policy cannot change any token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Policy:
    """How the cache adapts (``adapt=False`` freezes it at its initial contents)."""

    decay: float = 0.7
    """Each window multiplies every score by this before adding its own routing counts."""
    every: int = 4
    """Windows between rebalances."""
    margin: float = 1.0
    """A missing expert replaces a resident one only when its score is higher by at least this."""
    max_swaps: int = 32
    """Swaps per rebalance at most."""
    adapt: bool = True


@dataclass(frozen=True)
class Swap:
    """Load ``loaded`` = (layer, expert) into ``slot``, evicting ``evicted`` (None: the slot was empty)."""

    slot: int
    evicted: tuple[int, int] | None
    loaded: tuple[int, int]


@dataclass
class CacheStats:
    """What the cache served since the engine started (assignments are (row, chosen expert) pairs)."""

    hits: int = 0
    """Assignments whose expert was in a VRAM slot."""
    misses: int = 0
    """Assignments whose expert was read from host memory."""
    swaps: int = 0
    windows: int = 0
    miss_bytes: int = 0
    """Expert weights read over the host link by misses."""
    swap_bytes: int = 0
    """Expert weights copied over the host link into slots."""

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return None if total == 0 else self.hits / total

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "swaps": self.swaps,
            "windows": self.windows,
            "miss_bytes": self.miss_bytes,
            "swap_bytes": self.swap_bytes,
        }


def even_fill(layers: int, experts: int, slots: int) -> np.ndarray:
    """Initial contents: ``slots`` spread as evenly as possible over the layers, each layer's experts in id
    order, as a table [L, E] of slot numbers (-1 where not resident)."""
    if not 0 <= slots <= layers * experts:
        raise ValueError(f"{slots} slots for {layers} layers of {experts} experts")
    table = np.full((layers, experts), -1, np.int32)
    per_layer = [slots // layers + (1 if j < slots % layers else 0) for j in range(layers)]
    slot = 0
    for j, n in enumerate(per_layer):
        table[j, :n] = np.arange(slot, slot + n, dtype=np.int32)
        slot += n
    return table


@dataclass
class Residency:
    """The slot table of one stage's expert cache and the adaptive policy over it."""

    layers: int
    experts: int
    slots: int
    expert_bytes: int = 0
    """Bytes of one expert's weights (gate, up and down), for the traffic figures."""
    policy: Policy = field(default_factory=Policy)
    fixed: frozenset[int] = frozenset()
    """Layers whose experts never move (the MTP head's: its windows run on another stream, which the
    swaps are not ordered with); they keep their initial slots."""
    slot_of: np.ndarray = field(init=False)
    """[L, E] int32: the slot of each (layer, expert), -1 when it lives only in host memory."""
    owner: np.ndarray = field(init=False)
    """[C, 2] int32: the (layer, expert) each slot holds."""
    scores: np.ndarray = field(init=False)
    """[L, E] float64: decayed routing counts."""
    stats: CacheStats = field(init=False, default_factory=CacheStats)
    _since: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.slot_of = even_fill(self.layers, self.experts, self.slots)
        self.owner = np.full((self.slots, 2), -1, np.int32)
        j, e = np.nonzero(self.slot_of >= 0)
        self.owner[self.slot_of[j, e]] = np.stack([j, e], axis=1)
        self.scores = np.zeros((self.layers, self.experts), np.float64)

    @property
    def complete(self) -> bool:
        """Every expert holds a slot (no host tier, nothing to adapt)."""
        return self.slots >= self.layers * self.experts

    def resident(self, layer: int, expert: int) -> bool:
        return bool(self.slot_of[layer, expert] >= 0)

    def observe(self, counts: np.ndarray, windows: int = 1, misses: int | None = None) -> None:
        """Add the routing counts [L, E] (assignments per expert) of ``windows`` windows, decaying the older
        scores once per window. ``misses``: the assignments that were served from host memory, as counted
        where they ran (default: those whose expert holds no slot now)."""
        total = int(counts.sum())
        if misses is None:
            misses = int(counts[self.slot_of < 0].sum())
        self.stats.hits += total - misses
        self.stats.misses += misses
        self.stats.miss_bytes += misses * self.expert_bytes
        self.stats.windows += windows
        if self.complete:
            return
        self.scores *= self.policy.decay**windows
        self.scores += counts
        self._since += windows

    def due(self) -> bool:
        """Whether a rebalance is due (the policy adapts and ``every`` windows have passed)."""
        return self.policy.adapt and not self.complete and self._since >= self.policy.every

    def rebalance(self) -> list[Swap]:
        """Decide and record this rebalance's swaps (the caller copies the weights, in the order given)."""
        self._since = 0
        if not self.policy.adapt or self.complete or self.slots == 0:
            return []
        flat = self.scores.reshape(-1)
        table = self.slot_of.reshape(-1)
        layer_of = np.repeat(np.arange(self.layers), self.experts)  # [L E]
        movable = ~np.isin(layer_of, sorted(self.fixed))
        missing = np.flatnonzero((table < 0) & (flat > 0) & movable)
        if missing.size == 0:
            return []
        present = np.flatnonzero((table >= 0) & movable)
        # Best newcomers first, weakest residents first; ties go to the lower (layer, expert) index.
        missing = missing[np.lexsort((missing, -flat[missing]))]
        present = present[np.lexsort((present, flat[present]))]
        swaps: list[Swap] = []
        for new, old in zip(missing, present, strict=False):
            if len(swaps) >= self.policy.max_swaps or flat[new] < flat[old] + self.policy.margin:
                break
            slot = int(table[old])
            lo, eo = divmod(int(old), self.experts)
            ln, en = divmod(int(new), self.experts)
            self.slot_of[lo, eo] = -1
            self.slot_of[ln, en] = slot
            self.owner[slot] = (ln, en)
            swaps.append(Swap(slot, (lo, eo), (ln, en)))
        self.stats.swaps += len(swaps)
        self.stats.swap_bytes += len(swaps) * self.expert_bytes
        return swaps


@dataclass(frozen=True)
class Snapshot:
    """What a cache holds and has learned at one moment: which experts are resident, and their scores."""

    resident: np.ndarray
    """[L, E] bool."""
    scores: np.ndarray
    """[L, E] float64."""


def snapshot(r: Residency) -> Snapshot:
    return Snapshot(r.slot_of >= 0, r.scores.copy())


def restore(r: Residency, snap: Snapshot) -> list[Swap]:
    """Make ``r`` hold the experts ``snap`` held and know what it knew (the slots may be others: they decide
    nothing). Returns the swaps that move the weights; the caller loads them as any swaps."""
    now = r.slot_of >= 0
    leave = np.argwhere(now & ~snap.resident)  # [n, 2] resident now, not then
    come = np.argwhere(snap.resident & ~now)  # [n, 2]
    assert len(leave) == len(come), "a snapshot of another cache"
    swaps = []
    for (lo, eo), (ln, en) in zip(leave.tolist(), come.tolist(), strict=True):
        slot = int(r.slot_of[lo, eo])
        r.slot_of[lo, eo] = -1
        r.slot_of[ln, en] = slot
        r.owner[slot] = (ln, en)
        swaps.append(Swap(slot, (lo, eo), (ln, en)))
    r.scores[...] = snap.scores
    r._since = 0
    return swaps
