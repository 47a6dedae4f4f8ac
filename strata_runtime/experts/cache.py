"""Which routed experts of a stage hold a VRAM slot or a helper slot, and how that follows the routing.

A stage whose routed experts do not all fit in VRAM keeps every one of them in host memory and ``slots`` of
them in a VRAM cache. With a helper GPU or a peer device in the plan it also has ``helper_slots`` on that
device: a second tier, which the stage's kernels read over peer-to-peer, between VRAM and host memory. An
expert is in at most one of the two tiers of slots. `Residency` is the cache's bookkeeping, with no arrays
of weights in it: the tables ``slot_of[j, e]`` and ``helper_of[j, e]`` (the VRAM slot and the helper slot
holding expert ``e`` of the stage's ``j``-th layer, or -1), the owner of each slot, and the adaptive policy
that decides what the slots hold.

The policy, after the engine this project models (its adaptive tier nearly doubled decode speed on two 20 GB
cards: 89.2 against 45.2 tok/s), is frequency with decay:

* every window adds its routing counts to a score per expert, after multiplying the scores by ``decay``
  (0.9) per window, so a score is a recent-use frequency with a half-life of about seven windows;
* every ``every`` windows (4), and after a prompt chunk, the highest-scoring missing experts replace the
  lowest-scoring resident ones, one for one, while the newcomer's score beats the evicted one's by
  ``margin`` (3 uses: each swap copies one expert over the host link, which misses also use, so a swap
  must save more reads than it costs), at most ``max_swaps`` (512) a time.

A new request routes to experts of its own, and its prompt chunk shows which: the rebalance right after it
moves them in at once, where a cap of 32 swaps every four windows left the cache learning the request
through most of its decode (docs/RUNTIME.md, "How the cache's policy was chosen", has the simulation).

With a helper tier the same rule runs twice per rebalance, one tier after the other, over the same scores:
first into VRAM from everything VRAM lacks (a newcomer held by the helper tier trades places with the
evicted expert: it comes over the peer link, and the evicted expert is copied into its helper slot from
host memory, over the helper GPU's own host link; a newcomer from host memory sends the evicted expert back
to host memory), then into the helper tier from what only host memory holds, sparing the experts the
first pass just moved there. So the experts ranked highest are in VRAM, the next ones in the helper tier,
the rest in host memory, each move paid for by a margin, and both tiers stay full.

By default the cache keeps its misses instead (`Policy.keep_misses`): a miss has crossed the host link once
the kernels read it, so they write it into a slot on its way. Every ``every`` windows (and after a prompt
chunk) a rebalance then ranks a queue of the ``max_swaps`` weakest residents (`victims`), and each expert a
window reads from host memory takes the next usable one's slot (`Residency.admit`, the rule of
`strata_runtime.reference.keep.admit`), in a decode window as it runs. Nothing is copied, no window waits,
and the scores decay more slowly by default (0.95, the plan's ``KEEP_SCORE_DECAY``): they rank the queue.

The cache is one pool for all the stage's layers, so a layer whose routing is spread wide gets more slots than
one whose routing repeats. It starts with the slots spread evenly over the layers (experts in id order, the
helper tier with the experts VRAM does not hold, in the same order); the first windows (the prompt's chunks,
which route thousands of rows) then fill it with what the request uses. The MTP head's layer, which cannot
adapt, holds all its experts where that costs at most an eighth of the slots (`Residency.whole`).
Swapping changes where an expert's product is computed, never its value: the policy cannot change any token.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from strata_cfg.schema.facts import mtp_experts_whole
from strata_cfg.schema.windows import PREFILL_EXPERT_TILE_ROWS

from ..reference.keep import Victims, admit

if TYPE_CHECKING:
    from strata_cfg.schema.plan import ExpertsPlan

VRAM, HELPER, HOST = 0, 1, 2
"""An expert's tier: a VRAM slot, a helper slot on another device, or host memory only."""

QUEUE_REFRESH = 0.5
"""Share of a queue of victims (`Policy.keep_misses`) the windows have taken when the next rebalance, a new
queue, becomes due after one window: a GPU's new queue reaches the windows a few after its decision, and
the windows in between keep nothing once the queue they hold is used up. Two streams on the 24 GiB profile
take about a hundred victims a window, a queue of 512 in five (`scripts/cache_policy_sim.py --lag 2`: 60.5
experts over the host link a token renewing a used-up queue, 55.4 renewing it at half; 53.8 at half with no
lag)."""


@dataclass(frozen=True)
class Policy:
    """How the cache adapts (``adapt=False`` freezes it at its initial contents)."""

    decay: float = 0.9
    """Each window multiplies every score by this before adding its own routing counts."""
    every: int = 4
    """Windows between rebalances (a prompt chunk brings one at once)."""
    margin: float = 3.0
    """A missing expert replaces a resident one only when its score is higher by at least this."""
    max_swaps: int = 512
    """Swaps per tier and rebalance at most."""
    adapt: bool = True
    after_prompt: bool = True
    """Whether a prompt chunk's counts bring a rebalance at once."""
    keep_misses: bool = False
    """Whether the cache keeps the experts the kernels read from host memory instead of swapping
    (`Residency.admit`): a rebalance then copies nothing; it queues the ``max_swaps`` lowest-scored
    residents (`Victims`), and each expert a window reads from host memory takes the next queued slot,
    written as it is read."""

    @classmethod
    def of(cls, plan: ExpertsPlan) -> Policy:
        """The policy a launch plan's experts section sets (``experts.score_decay`` and the rest)."""
        return cls(
            decay=plan.score_decay,
            every=plan.rebalance_every,
            margin=plan.swap_margin,
            max_swaps=plan.max_swaps,
            adapt=plan.adapt,
            keep_misses=plan.keep_misses,
        )


@dataclass(frozen=True)
class Swap:
    """Load ``loaded`` = (layer, expert) into ``slot`` of tier ``tier`` (VRAM or HELPER), evicting ``evicted``
    (None: the slot was empty). ``source``: the helper slot ``loaded`` comes from (over the peer link), -1
    for its host copy. A VRAM swap with a source is an exchange: ``evicted`` then takes that helper slot,
    copied from its host copy once ``loaded`` has left it. No helper swap of the same rebalance writes a
    slot an exchange wrote."""

    slot: int
    evicted: tuple[int, int] | None
    loaded: tuple[int, int]
    tier: int = VRAM
    source: int = -1


class Reads(NamedTuple):
    """Assignments of some windows that VRAM did not serve: read from a helper slot, or from host memory."""

    helper: int = 0
    host: int = 0


@dataclass
class CacheStats:
    """What the cache served since the engine started (assignments are (row, chosen expert) pairs)."""

    hits: int = 0
    """Assignments whose expert was in a VRAM slot."""
    misses: int = 0
    """Assignments whose expert was not in VRAM: read from the helper tier or from host memory."""
    helper_hits: int = 0
    """Of the misses, those read from a helper slot (over the peer link)."""
    swaps: int = 0
    """Swaps into a VRAM slot or a helper slot (an exchange between the two counts once)."""
    helper_swaps: int = 0
    """Of the swaps, those into a helper slot from host memory."""
    windows: int = 0
    miss_bytes: int = 0
    """Expert weights read over the host link by misses: a decode window's miss reads its expert whole, a
    prompt chunk reads an expert held in host memory once for each tile of up to
    `PREFILL_EXPERT_TILE_ROWS` of its rows routed to it."""
    prompt_hits: int = 0
    """Of the hits, those of prompt chunks (the hand-overs marked as a prompt's)."""
    prompt_misses: int = 0
    """Of the misses, those of prompt chunks."""
    prompt_miss_bytes: int = 0
    """Of ``miss_bytes``, those of prompt chunks."""
    late_reads: int = 0
    """Decode windows' assignments the kernels read from host memory beyond those the cache's tables, as the
    host holds them at the hand-over, send there: mostly experts a rebalance has already decided to bring
    in, read by the windows queued ahead before its copies landed (a GPU's counters only; 0 where the
    reads are not counted apart from the tables)."""
    kept: int = 0
    """Experts kept in a VRAM slot as the kernels read them from host memory (`Policy.keep_misses`): each
    took the slot of a queued victim, with no copy of its own."""
    swap_bytes: int = 0
    """Expert weights copied from host memory into slots of either tier (the helper tier's over its own
    GPU's host link)."""
    helper_bytes: int = 0
    """Expert weights read over the peer link by helper hits."""
    peer_swap_bytes: int = 0
    """Expert weights copied over the peer link, from helper slots into VRAM slots (exchanges)."""

    @property
    def hit_rate(self) -> float | None:
        """The share of assignments served from VRAM."""
        total = self.hits + self.misses
        return None if total == 0 else self.hits / total

    @property
    def host_reads(self) -> int:
        """Assignments read from host memory."""
        return self.misses - self.helper_hits

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "helper_hits": self.helper_hits,
            "host_reads": self.host_reads,
            "swaps": self.swaps,
            "helper_swaps": self.helper_swaps,
            "windows": self.windows,
            "miss_bytes": self.miss_bytes,
            "prompt_hits": self.prompt_hits,
            "prompt_misses": self.prompt_misses,
            "prompt_miss_bytes": self.prompt_miss_bytes,
            "late_reads": self.late_reads,
            "kept": self.kept,
            "swap_bytes": self.swap_bytes,
            "helper_bytes": self.helper_bytes,
            "peer_swap_bytes": self.peer_swap_bytes,
            "peer_bytes": self.helper_bytes + self.peer_swap_bytes,
        }


def even_fill(layers: int, experts: int, slots: int, whole: Collection[int] = ()) -> np.ndarray:
    """Initial contents: every expert of the layers in ``whole``, then the remaining slots spread as evenly
    as possible over the other layers, each layer's experts in id order, as a table [L, E] of slot numbers
    (-1 where not resident)."""
    if not 0 <= slots <= layers * experts:
        raise ValueError(f"{slots} slots for {layers} layers of {experts} experts")
    whole = sorted(set(whole))
    if len(whole) * experts > slots:
        raise ValueError(f"{slots} slots cannot hold the {len(whole) * experts} experts of layers {whole}")
    table = np.full((layers, experts), -1, np.int32)
    rest = [j for j in range(layers) if j not in whole]
    spread = slots - len(whole) * experts
    per_layer = dict.fromkeys(whole, experts)
    if rest:
        each, extra = divmod(spread, len(rest))
        per_layer |= {j: each + (1 if i < extra else 0) for i, j in enumerate(rest)}
    slot = 0
    for j in range(layers):
        n = per_layer.get(j, 0)
        table[j, :n] = np.arange(slot, slot + n, dtype=np.int32)
        slot += n
    return table


def helper_fill(slot_of: np.ndarray, slots: int) -> np.ndarray:
    """Initial helper tier: ``slots`` given round-robin over the layers to the experts ``slot_of`` [L, E]
    leaves out of VRAM, each layer's in id order, starting at the first layer `even_fill` gave no extra VRAM
    slot (so both tiers together stay spread evenly). A table [L, E] of helper slots (-1: none)."""
    layers, experts = slot_of.shape
    free = [list(np.flatnonzero(slot_of[j] < 0)) for j in range(layers)]
    if not 0 <= slots <= sum(len(f) for f in free):
        raise ValueError(f"{slots} helper slots for {sum(len(f) for f in free)} experts outside VRAM")
    table = np.full((layers, experts), -1, np.int32)
    j = int((slot_of >= 0).sum()) % layers if layers else 0
    for h in range(slots):
        while not free[j]:
            j = (j + 1) % layers
        table[j, free[j].pop(0)] = h
        j = (j + 1) % layers
    return table


def _owners(table: np.ndarray, slots: int) -> np.ndarray:
    """[slots, 2] int32: the (layer, expert) each slot of ``table`` [L, E] holds, (-1, -1) when free."""
    owner = np.full((slots, 2), -1, np.int32)
    j, e = np.nonzero(table >= 0)
    owner[table[j, e]] = np.stack([j, e], axis=1)
    return owner


@dataclass
class Residency:
    """The slot tables of one stage's expert cache (VRAM and helper tiers) and the policy over them."""

    layers: int
    experts: int
    slots: int
    expert_bytes: int = 0
    """Bytes of one expert's weights (gate, up and down), for the traffic figures."""
    policy: Policy = field(default_factory=Policy)
    fixed: frozenset[int] = frozenset()
    """Layers whose experts never move (the MTP head's: its windows run on another stream, which the
    swaps are not ordered with); they keep their initial slots in both tiers (`whole`)."""
    helper_slots: int = 0
    """Slots of the second tier, on helper or peer devices (0: none)."""
    whole: bool | None = None
    """Whether the ``fixed`` layers start with, and so keep, every expert in VRAM, as the plan decides (the
    GPU's ``experts_whole``, rule ``experts.mtp-whole``); None: by the same rule here
    (`strata_cfg.schema.facts.mtp_experts_whole` over this cache's slots). Otherwise they get an even share
    like any layer's: the experts of the lowest ids, whatever they route to."""
    slot_of: np.ndarray = field(init=False)
    """[L, E] int32: the VRAM slot of each (layer, expert), -1 when it holds none."""
    owner: np.ndarray = field(init=False)
    """[C, 2] int32: the (layer, expert) each VRAM slot holds."""
    helper_of: np.ndarray = field(init=False)
    """[L, E] int32: the helper slot of each (layer, expert), -1 when it holds none."""
    helper_owner: np.ndarray = field(init=False)
    """[S, 2] int32: the (layer, expert) each helper slot holds."""
    scores: np.ndarray = field(init=False)
    """[L, E] float64: decayed routing counts."""
    stats: CacheStats = field(init=False, default_factory=CacheStats)
    queue: Victims = field(init=False, default_factory=Victims)
    """Under `Policy.keep_misses`: the residents the kept misses evict next (`victims`, made at each
    rebalance)."""
    backlog: bool = field(init=False, default=False)
    """Whether the last rebalance stopped at ``max_swaps`` in a tier with more swaps that would pay, or the
    windows since took half its queue of victims (`Policy.keep_misses`, `QUEUE_REFRESH`): the next one is
    then due after one window, not ``every``, so a large rebalance (a new request's prompt) lands over
    several windows, at most ``max_swaps`` a tier each, instead of one pause for all of it, and misses go
    on being kept."""
    _since: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        fixed = [j for j in self.fixed if 0 <= j < self.layers]
        whole = self.whole
        if whole is None:
            whole = not self.complete and mtp_experts_whole(len(fixed) * self.experts, self.slots)
        whole = whole and len(fixed) * self.experts <= self.slots  # a stage's share of a GPU may hold fewer
        self.slot_of = even_fill(self.layers, self.experts, self.slots, fixed if whole else ())
        self.owner = _owners(self.slot_of, self.slots)
        self.helper_of = helper_fill(self.slot_of, self.helper_slots)
        self.helper_owner = _owners(self.helper_of, self.helper_slots)
        self.scores = np.zeros((self.layers, self.experts), np.float64)

    @property
    def complete(self) -> bool:
        """Every expert holds a VRAM slot (no other tier, nothing to adapt)."""
        return self.slots >= self.layers * self.experts

    def resident(self, layer: int, expert: int) -> bool:
        """Whether the expert holds a VRAM slot."""
        return bool(self.slot_of[layer, expert] >= 0)

    def tier(self, layer: int, expert: int) -> int:
        """VRAM, HELPER or HOST: where the expert is read from now."""
        if self.slot_of[layer, expert] >= 0:
            return VRAM
        return HELPER if self.helper_of[layer, expert] >= 0 else HOST

    def tiers(self, layer: int | None = None) -> np.ndarray:
        """[L, E] int8: every expert's tier; [E], layer ``layer``'s alone."""
        rows = slice(None) if layer is None else layer
        out = np.full(self.slot_of[rows].shape, HOST, np.int8)
        out[self.helper_of[rows] >= 0] = HELPER
        out[self.slot_of[rows] >= 0] = VRAM
        return out

    def observe(
        self, counts: np.ndarray, windows: int = 1, reads: Reads | None = None, prompt: bool = False
    ) -> None:
        """Add the routing counts [L, E] (assignments per expert) of ``windows`` windows, decaying the older
        scores once per window. ``reads``: the assignments served by the helper tier and by host memory, as
        counted where they ran (default: by where each expert is now). ``prompt``: the windows hold a prompt
        chunk, whose thousands of assignments show what the request uses: a rebalance is due at once. Its
        assignments count in the statistics' prompt figures too, and its bytes by tiles (`CacheStats`): an
        expert its rows share crosses a link once a tile, where a decode window's miss reads it whole (a
        hand-over that holds decode windows beside a prompt chunk is counted as a prompt's)."""
        total = int(counts.sum())
        tiers = self.tiers()
        held = Reads(int(counts[tiers == HELPER].sum()), int(counts[tiers == HOST].sum()))
        if reads is None:
            reads = held
        elif not prompt and not self.policy.keep_misses:  # kept misses change the tiers within a window
            self.stats.late_reads += max(0, reads.host - held.host)
        s, eb = self.stats, self.expert_bytes
        s.hits += total - reads.helper - reads.host
        s.misses += reads.helper + reads.host
        s.helper_hits += reads.helper
        if prompt:
            tiles = np.ceil(counts / PREFILL_EXPERT_TILE_ROWS)
            host_bytes = int(tiles[tiers == HOST].sum()) * eb
            s.prompt_hits += total - reads.helper - reads.host
            s.prompt_misses += reads.helper + reads.host
            s.prompt_miss_bytes += host_bytes
            s.miss_bytes += host_bytes
            s.helper_bytes += int(tiles[tiers == HELPER].sum()) * eb
        else:
            s.miss_bytes += reads.host * eb
            s.helper_bytes += reads.helper * eb
        s.windows += windows
        if self.complete:
            return
        self.scores *= self.policy.decay**windows
        self.scores += counts
        self._since += windows
        if prompt and self.policy.after_prompt:
            self._since = max(self._since, self.policy.every)

    def recall(self, scores: np.ndarray) -> None:
        """Add ``scores`` [L, E] (another moment's `scores`: what a conversation's windows had taught the
        cache when its slot was released), decaying the present ones as one window does, and make a
        rebalance due at once, as a prompt chunk does: a conversation copied back from the host's prefix
        store (docs/RUNTIME.md, "The prefix store") is not read again, so without this the cache would learn
        what it routes to only from its new tokens. Nothing is served, so the statistics do not change."""
        if self.complete or not self.policy.adapt:
            return
        self.scores *= self.policy.decay
        self.scores += scores
        self._since = max(self._since, self.policy.every)

    def due(self) -> bool:
        """Whether a rebalance is due: the policy adapts and ``every`` windows have passed, or one window
        since a rebalance that left a `backlog`."""
        if not self.policy.adapt or self.complete:
            return False
        return self._since >= (1 if self.backlog else self.policy.every)

    def rebalance(self) -> list[Swap]:
        """Decide and record this rebalance's swaps, VRAM's first (the caller copies the weights, in the
        order given)."""
        self._since = 0
        self.backlog = False
        if not self.policy.adapt or self.complete:
            return []
        if self.policy.keep_misses:
            self.queue = self.victims()
            return []
        layer_of = np.repeat(np.arange(self.layers), self.experts)  # [L E]
        movable = ~np.isin(layer_of, sorted(self.fixed))
        into_vram = self._into_vram(movable)
        exchanged = {sw.source for sw in into_vram if sw.source >= 0}
        swaps = into_vram + self._into_helper(movable & ~np.isin(self.helper_of.reshape(-1), list(exchanged)))
        s = self.stats
        s.swaps += len(swaps)
        s.helper_swaps += sum(sw.tier == HELPER for sw in swaps)
        s.swap_bytes += len(swaps) * self.expert_bytes  # an exchange's evicted expert: into its helper slot
        s.peer_swap_bytes += sum(sw.source >= 0 for sw in swaps) * self.expert_bytes
        return swaps

    def victims(self) -> Victims:
        """The ``policy.max_swaps`` lowest-scored residents of VRAM outside the ``fixed`` layers, weakest
        first (ties to the lower (layer, expert)): the slots the next misses take (`Residency.admit`)."""
        table = self.slot_of.reshape(-1)
        layer_of = np.repeat(np.arange(self.layers), self.experts)
        held = np.flatnonzero((table >= 0) & ~np.isin(layer_of, sorted(self.fixed)))
        key = _weakest_first(self.scores.reshape(-1), held)[: self.policy.max_swaps]
        return Victims(table[key].astype(np.int32), key.astype(np.int32))

    def admit(self, j: int, routed: np.ndarray) -> list[Swap]:
        """`strata_runtime.reference.keep.admit` (the rule the GPU's admission kernel runs) over this cache's
        tables and queue (``policy.keep_misses``; otherwise nothing), its moves as swaps with no copy of
        their own: the caller writes each newcomer into its slot (the array path copies it from host memory,
        which its read of the miss has just crossed)."""
        if not self.policy.keep_misses or not self.policy.adapt or self.complete or j in self.fixed:
            return []
        swaps = [Swap(*move) for move in admit(self.slot_of, j, routed, self.queue)]
        for sw in swaps:
            self.owner[sw.slot] = sw.loaded
        self.stats.kept += len(swaps)
        self.backlog |= refresh_due(self.queue.taken, len(self.queue.slot))
        return swaps

    def learn(self, slot_of: np.ndarray, kept: int = 0, taken: int = 0, queued: int = 0) -> None:
        """Take ``slot_of`` [L, E] (slot or -1) as what VRAM holds: a GPU's admissions change its tables
        where the host does not see them, and it reads them back with the counters. ``kept``: the
        admissions since the last read, as the device counted them; ``taken`` of ``queued``: how far they
        had gone through the device's queue (a `backlog` from `QUEUE_REFRESH` on)."""
        self.slot_of[...] = slot_of
        self.owner = _owners(self.slot_of, self.slots)
        self.stats.kept += kept
        self.backlog |= refresh_due(taken, queued)

    def _into_vram(self, movable: np.ndarray) -> list[Swap]:
        """The best experts VRAM lacks (from the helper tier or host memory) for its weakest residents."""
        table = self.slot_of.reshape(-1)
        swaps = []
        for loaded, evicted in self._trades((table < 0) & movable, (table >= 0) & movable):
            slot, source = int(self.slot_of[evicted]), int(self.helper_of[loaded])
            if source >= 0:  # an exchange: the evicted expert takes the newcomer's helper slot
                self.helper_of[loaded] = -1
                self.helper_of[evicted] = source
                self.helper_owner[source] = evicted
            self.slot_of[evicted] = -1
            self.slot_of[loaded] = slot
            self.owner[slot] = loaded
            swaps.append(Swap(slot, evicted, loaded, VRAM, source))
        return swaps

    def _into_helper(self, movable: np.ndarray) -> list[Swap]:
        """The best experts only host memory holds, for the weakest (movable) residents of the helper tier."""
        table, helper = self.slot_of.reshape(-1), self.helper_of.reshape(-1)
        swaps = []
        for loaded, evicted in self._trades((table < 0) & (helper < 0) & movable, (helper >= 0) & movable):
            slot = int(self.helper_of[evicted])
            self.helper_of[evicted] = -1
            self.helper_of[loaded] = slot
            self.helper_owner[slot] = loaded
            swaps.append(Swap(slot, evicted, loaded, HELPER))
        return swaps

    def _trades(
        self, missing: np.ndarray, present: np.ndarray
    ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """One pass of the policy over masks [L E] of candidates and residents: (newcomer, evicted) pairs,
        best newcomers (with a positive score) for the weakest residents, while the newcomer's score beats
        the evicted one's by the margin, at most ``max_swaps``."""
        flat = self.scores.reshape(-1)
        new = _best_first(flat, np.flatnonzero(missing & (flat > 0)))
        old = _weakest_first(flat, np.flatnonzero(present))
        cap, margin = self.policy.max_swaps, self.policy.margin
        pairs = []
        for n, o in zip(new[:cap], old, strict=False):
            if flat[n] < flat[o] + margin:
                break
            pairs.append((self._key(n), self._key(o)))
        if (
            len(pairs) == cap
            and len(new) > cap
            and len(old) > cap
            and flat[new[cap]] >= flat[old[cap]] + margin
        ):
            self.backlog = True  # the next pair would have paid too
        return pairs

    def _key(self, flat_index: int) -> tuple[int, int]:
        j, e = divmod(int(flat_index), self.experts)
        return j, e


def refresh_due(taken: int, queued: int) -> bool:
    """Whether windows that have taken ``taken`` of a queue of ``queued`` victims should get a new one after
    the next window (`QUEUE_REFRESH`)."""
    return queued > 0 and taken >= QUEUE_REFRESH * queued


def _best_first(scores: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``idx`` by descending score; ties go to the lower (layer, expert) index."""
    return idx[np.lexsort((idx, -scores[idx]))]


def _weakest_first(scores: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``idx`` by ascending score; ties go to the lower (layer, expert) index."""
    return idx[np.lexsort((idx, scores[idx]))]


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
    r.backlog = False
    r.queue = Victims()
    return swaps
