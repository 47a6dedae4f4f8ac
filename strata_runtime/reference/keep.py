"""A cache that keeps its misses: the admission rule, and ``moe_admit``'s NumPy twin.

Where an expert cache keeps the experts its kernels read from host memory (``experts.keep_misses``), each
rebalance queues the least used experts in VRAM as victims, and before a layer's expert kernels the admission
gives each expert the window reads from host memory the slot of the next usable victim; the expert kernels
write its weights there as they read them, and the layer's next admission points the tables at the slot.
`admit` is the rule over a table of slots (what `strata_runtime.experts.cache.Residency` keeps), `moe_admit`
the kernel's steps over a GPU stage's tables (`strata_runtime.cuda.experts.Keep`), which the CUDA kernel is
compared to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

LOOKED_AT = 64
"""Queued victims one admission looks at, at most: the kernel loads them all at once."""


@dataclass
class Victims:
    """The slots a cache that keeps its misses gives up next, lowest score first: ``slot[i]`` held the expert
    ``key[i]`` (layer * E + expert) when the queue was made. ``taken``: the entries used or passed over."""

    slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """[K] int32."""
    key: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """[K] int32."""
    taken: int = 0


def admit(
    slot_of: np.ndarray, j: int, routed: np.ndarray, queue: Victims
) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Keep layer ``j``'s experts in ``routed`` (a window's routing, any order, repeats allowed) that hold no
    slot in ``slot_of`` [L, E] (-1), each in the slot of the next usable victim of ``queue``.

    Of the next `LOOKED_AT` entries from ``queue.taken``, an entry is usable when its expert still holds its
    slot (windows since the queue was made may have evicted it) and is not one of this window's experts of
    layer ``j`` (the kernels are about to read it there). The missing experts, in id order, take the usable
    entries in queue order; ``taken`` moves past the last one used, or past every entry looked at when too
    few were usable. Updates ``slot_of`` (a victim: -1; a newcomer: its slot) and ``taken``; returns the
    moves, (slot, evicted (layer, expert), newcomer (layer, expert))."""
    experts = slot_of.shape[1]
    routed = np.unique(np.asarray(routed, np.int64))
    missing = routed[slot_of[j, routed] == -1]
    lo = queue.taken
    hi = min(lo + LOOKED_AT, len(queue.slot))
    if not len(missing) or lo >= hi:
        return []
    slot, key = queue.slot[lo:hi].astype(np.int64), queue.key[lo:hi].astype(np.int64)
    kj, ke = key // experts, key % experts
    usable = np.flatnonzero((slot_of[kj, ke] == slot) & ~((kj == j) & np.isin(ke, routed)))
    n = min(len(missing), len(usable))
    moves = []
    for e, u in zip(missing[:n].tolist(), usable[:n].tolist(), strict=True):
        evicted = (int(kj[u]), int(ke[u]))
        slot_of[evicted] = -1
        slot_of[j, e] = slot[u]
        moves.append((int(slot[u]), evicted, (j, e)))
    queue.taken = lo + int(usable[n - 1]) + 1 if n == len(missing) else hi
    return moves


def held(code: np.ndarray, fill: np.ndarray) -> np.ndarray:
    """[L, E] the VRAM slot of each expert, -1 where none, from a GPU stage's tier codes and ``fill``: an
    expert being written into a slot holds it already."""
    return np.where(fill >= 0, fill, np.maximum(code, -1)).astype(np.int32)


def moe_admit(keep: Any, idx: np.ndarray) -> None:
    """``moe_admit`` of layer ``keep.layer`` (a `strata_runtime.cuda.experts.Keep`, its owner's tables as
    NumPy arrays) before expert kernels that read the window routed to ``idx`` [R, k]: commit the experts
    the layer's last window kept (their tables point at their slots), then `admit` over the slots the
    tables and ``fill`` give, each victim sent back to host memory and each newcomer's ``fill`` set."""
    o, j = keep.owner, keep.layer
    row = o.fill[j]
    kept = np.flatnonzero(row >= 0)
    o.gate_up[j, kept] = o.slot_gate_up[row[kept]]
    o.down[j, kept] = o.slot_down[row[kept]]
    o.slot_of[j, kept] = row[kept]
    row[kept] = -1
    taken, count = (int(v) for v in o.queue)
    queue = Victims(np.asarray(o.victims[:count]), np.asarray(o.victim_keys[:count]), taken)
    moves = admit(held(np.asarray(o.slot_of), np.asarray(o.fill)), j, np.asarray(idx).reshape(-1), queue)
    for slot, evicted, (_, e) in moves:
        o.gate_up[evicted] = o.host_gate_up[evicted]
        o.down[evicted] = o.host_down[evicted]
        o.slot_of[evicted] = -1
        o.fill[evicted] = -1
        o.fill[j, e] = slot
    o.queue[0] = queue.taken
    o.misses[j, 2] += len(moves)
