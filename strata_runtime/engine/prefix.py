"""Prefix reuse: a free slot keeps its last request's KV, and a new request that begins the same way reads
only the rest of its prompt (``memory.prefix_reuse``).

A chat client sends the whole conversation again each turn, and an agent sends the same long instructions
with every call. Both begin with tokens some slot has already read. When a request finishes, its slot keeps
the KV of the tokens it read: the prompt and the generated tokens that were fed back, nothing past a stop.
A new request takes the free slot whose kept tokens share the longest prefix with its prompt, rewinds that
slot's KV to the shared part and reads its prompt from there. Where another slot holds a longer shared
prefix (a busy slot serving a request that began the same way, or a free slot that a busier group owns),
the new request's slot copies that prefix's KV from it instead (`Prefixes.best`): two clients that send
the same long system prompt at once read it once.

What a slot may keep, and what a request may take, follow from what the KV and the drafting head hold:

* Position i of a stage's KV depends on the tokens [0, i] only, so the shared prefix is the same whichever
  request wrote it.
* The MTP head's position i reads the model's row i and the token *after* it, so the drafter keeps one
  position fewer than the stages: the next request reads the last shared token again, and the drafter gets
  that row from it.
* The prompt's last token is always read: its logits choose the first token.
* Calibrated synthetic routing draws each request's routing tables from its whole prompt
  (`strata_runtime.experts.routing`), so a KV is reused only by a request whose tables are the same.
* A request's ``cache_salt`` must be the kept request's: parties that share a server each send their own,
  and none can learn from the reuse (its usage's ``cached_tokens``, its time to the first token) what
  another's prompts began with.
* A request that asks for the prompt's log-probabilities reads its whole prompt: they come from its rows.

A request that arrives while a busy slot is still reading a prompt that shares at least `WAIT_LEAST` more
tokens with its own than any other slot holds waits at the head of the queue until that slot holds them,
then copies them (`worth_waiting`): a burst of requests with one long system prompt reads it once, where
reading it side by side would take as long for the first and longer for the rest. A waiting request keeps
one free slot for itself; requests behind it that need not wait take the others.

A copy follows the same rules, over what the other slot holds for certain: a busy slot's tokens that its
KV and drafter have read and that no rejected draft can rewind (the prompt's rows and the confirmed
tokens), a free slot's kept tokens, and of its drafter only the KV, never rows not yet read.

A slot keeps only its last request's tokens: when a request takes a free slot whose kept prefix it does not
reuse, that prefix would be lost, and a conversation whose slot another client took would read its whole
history again at its next turn. With ``memory.prefix_store_mib`` such a prefix is first copied into host
memory (`PrefixStore`: at least `STORE_LEAST` tokens that no other slot or stored prefix holds), and a
request whose prompt begins with a stored prefix that shares more than any slot copies it back into its
slot instead of reading it. The least recently used stored prefix makes room first.

This module decides; `strata_runtime.engine.scheduler.Engine` rewinds or copies the KV.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strata_cfg.schema.plan import PREFIX_STORE_PAGE


@dataclass(frozen=True)
class Kept:
    """What a free slot's KV holds from its last request."""

    tokens: tuple[int, ...]
    """The tokens at positions [0, len) of every stage's KV."""
    drafted: int | None
    """Positions the slot's drafter holds (its KV and deferred rows), at most ``len(tokens) - 1``; None
    where the slot has no drafter."""
    key: Hashable
    """What else a request must share to reuse it: the routing key the KV was written under
    (`strata_runtime.model.Model.routing_key`) and the kept request's cache salt."""
    freed: int
    """When it was freed (the engine's release counter): the least recently used is replaced first."""


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + 256] == b[i : i + 256]:  # a tuple slice compares in C: long runs go fast
        i += 256
    end = min(i + 256, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def reusable(kept: Kept | None, prompt: Sequence[int], key: Hashable) -> int:
    """Positions of ``kept`` a request with this prompt (and `Kept.key`) keeps: the shared prefix, less the
    prompt's last token, and less one more where a drafter needs the token after its last row."""
    if kept is None or kept.key != key or not prompt:
        return 0
    shared = shared_prefix(kept.tokens, prompt)
    n = min(shared, len(prompt) - 1)
    if kept.drafted is not None:  # its last row's token must be shared too
        n = min(n, shared - 1, kept.drafted)
    return max(n, 0)


def choose_slot(
    free: Sequence[int],
    kept: Sequence[Kept | None],
    prompt: Sequence[int],
    key: Hashable,
    load: Callable[[int], int],
    spare: bool = False,
) -> tuple[int, int]:
    """The free slot a request takes, and the positions it reuses there.

    Slots are ranked by ``load`` (the busy slots of the slot's group: pipelined groups stay balanced, and
    with one group every slot ties), then, with ``spare`` (the request may copy a prefix from another
    slot instead), a slot whose kept tokens the request would not cut short by `STORE_LEAST` or more
    before one it would (an empty slot, one whose kept tokens the prompt continues, or one that keeps
    little), then by the positions reused, then by the oldest release (a slot that never served comes
    first), then by id."""

    def cuts(k: Kept | None) -> bool:
        if k is None:
            return False
        shared = shared_prefix(k.tokens, prompt) if k.key == key else 0
        return len(k.tokens) - shared >= STORE_LEAST

    def rank(i: int) -> tuple[int, int, int, int, int]:
        k = kept[i]
        return (load(i), int(spare and cuts(k)), -reusable(k, prompt, key), -1 if k is None else k.freed, i)

    best = min(free, key=rank)
    return best, reusable(kept[best], prompt, key)


WAIT_LEAST = 64
"""Prompt tokens a request must gain by waiting for a busy slot still reading them (`worth_waiting`): below
it, the request reads them itself rather than queue behind that slot's prompt."""


def best_donor(donors: Mapping[int, Kept], prompt: Sequence[int], key: Hashable) -> tuple[int | None, int]:
    """The slot whose held tokens (``donors``: slot -> what it holds for certain) a request with this prompt
    and key reuses the most positions of, and those positions; (None, 0) where none shares any. Ties go to
    the lowest slot."""
    best, most = None, 0
    for slot in sorted(donors):
        n = reusable(donors[slot], prompt, key)
        if n > most:
            best, most = slot, n
    return best, most


def worth_waiting(
    reading: Mapping[int, Kept],
    held: Mapping[int, Kept],
    prompt: Sequence[int],
    key: Hashable,
    now: int,
) -> bool:
    """Whether a request should wait: the busy slot still reading the prompt that would lend it the most
    (``reading``: slot -> `Kept` of the whole prompt it reads) would lend at least `WAIT_LEAST` more than
    the ``now`` positions the other slots lend, and does not hold them yet (``held``: slot -> what it holds
    for certain now)."""
    slot, later = best_donor(reading, prompt, key)
    if slot is None or later < now + WAIT_LEAST:
        return False
    return reusable(held.get(slot), prompt, key) < later


class Prefixes:
    """Every slot's kept tokens while it is free, and what reuse saved since the engine started."""

    def __init__(self, slots: int, on: bool) -> None:
        self.on = on
        """``memory.prefix_reuse``: off, a released slot keeps nothing."""
        self.kept: list[Kept | None] = [None] * slots
        self._releases = 0
        self.requests = 0
        """Requests that reused a kept prefix."""
        self.tokens = 0
        """Prompt tokens those requests did not read again."""
        self.copies = 0
        """Requests among them whose prefix was copied from another slot."""
        self.restores = 0
        """Requests among them whose prefix was copied back from the host's store (`PrefixStore`)."""

    def best(
        self,
        free: Sequence[int],
        prompt: Sequence[int],
        key: Hashable,
        load: Callable[[int], int],
        whole: bool = False,
        donors: Mapping[int, Kept] | None = None,
    ) -> tuple[int, int, int | None]:
        """The free slot a request takes (`choose_slot`), the positions it reuses, and the slot it copies
        them from (None: its own kept tokens); nothing changes until `take`. ``donors``: what the other
        slots hold for certain (slot -> `Kept`), of which the one sharing the most (`best_donor`) is copied
        where it shares more than the chosen slot's own; ``whole``: the request reads its whole prompt (it
        asks for the prompt's log-probabilities)."""
        prompt = () if whole else prompt
        slot, reuse = choose_slot(free, self.kept, prompt, key, load, spare=donors is not None)
        donor, copied = best_donor({i: k for i, k in (donors or {}).items() if i != slot}, prompt, key)
        return (slot, copied, donor) if copied > reuse else (slot, reuse, None)

    def take(self, slot: int, reuse: int, source: int | None, restored: bool = False) -> None:
        """A request took ``slot`` as `best` chose, reusing ``reuse`` positions (copied from ``source``, or
        from the host's store where ``restored``): counted, and the slot keeps nothing of its own any more."""
        self.copies += source is not None
        self.restores += restored
        self.kept[slot] = None
        if reuse:
            self.requests += 1
            self.tokens += reuse

    def keep(self, slot: int, tokens: tuple[int, ...], drafted: int | None, key: Hashable) -> None:
        """A released slot's KV holds ``tokens`` (and its drafter ``drafted`` positions)."""
        self._releases += 1
        self.kept[slot] = Kept(tokens, drafted, key, self._releases) if tokens else None

    @property
    def totals(self) -> dict[str, int]:
        return {
            "prefix_requests": self.requests,
            "prefix_tokens": self.tokens,
            "prefix_copies": self.copies,
            "prefix_restores": self.restores,
        }


STORE_LEAST = 64
"""Positions worth keeping: a prefix is stored where it holds this many that no slot or stored prefix
holds (`PrefixStore.worth_storing`) and copied back where it lends this many more than the slots; a
request takes another free slot rather than cut a slot's kept tokens short by this many (`choose_slot`).
Below it, reading them again costs about what the copies would."""


PAGE = PREFIX_STORE_PAGE
"""Positions in one page of the prefix store's host memory (the plan's `PREFIX_STORE_PAGE`): a stored
prefix holds whole pages, the last one partly filled."""


def pages_for(n: int) -> int:
    """Pages that hold ``n`` positions."""
    return -(-n // PAGE)


def page_runs(pages: Sequence[int], n: int) -> list[tuple[int, int, int]]:
    """The copies that move positions [0, n) of a prefix into or out of its ``pages`` (in order of position):
    (first position in the store's memory, first position of the prefix, positions), one for each run of
    consecutive pages."""
    runs: list[tuple[int, int, int]] = []
    for j, page in enumerate(pages[: pages_for(n)]):
        at, pos, count = page * PAGE, j * PAGE, min(PAGE, n - j * PAGE)
        if runs and runs[-1][0] + runs[-1][2] == at:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + count)
        else:
            runs.append((at, pos, count))
    return runs


@dataclass(eq=False)
class Stored:
    """One prefix in the host's store: what it holds (as a slot's `Kept`, ``freed`` its last use), and the
    pages of the store's memory that hold its KV (`page_runs`). Equal only to itself."""

    kept: Kept
    pages: tuple[int, ...]
    experts: list[Any] | None = None
    """What each stage's expert cache had learned of the routing when the prefix's slot was released (the
    executor's `expert_scores`), brought back when a request copies the prefix back; None without an expert
    cache that adapts, or with ``experts.recall_stored = false``."""


class PrefixStore:
    """Prefixes that no slot holds any more, in host memory (``memory.prefix_store_mib``): ``pages`` pages of
    `PAGE` positions, ``page_bytes`` each (every stage's KV and a drafter's), allocated once, the least
    recently used prefix dropped first to make room. Which pages a prefix takes is decided here; the
    executor copies into and out of them."""

    def __init__(self, pages: int, page_bytes: int) -> None:
        self.pages, self.page_bytes = pages, page_bytes
        self.entries: list[Stored] = []
        self._free = list(range(pages))
        self._uses = 0
        self.saved = 0
        """Prefixes stored since the engine started."""
        self.dropped = 0
        """Stored prefixes dropped to make room, or because a longer one holds them."""

    @property
    def on(self) -> bool:
        return self.pages > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the store's memory its prefixes hold (whole pages)."""
        return sum(len(e.pages) for e in self.entries) * self.page_bytes

    def best(self, prompt: Sequence[int], key: Hashable) -> tuple[Stored | None, int]:
        """The stored prefix a request with this prompt reuses the most positions of (`reusable`), and those
        positions; (None, 0) where none shares any. Ties go to the most recently used."""
        best, most = None, 0
        for e in sorted(self.entries, key=lambda e: -e.kept.freed):
            n = reusable(e.kept, prompt, key)
            if n > most:
                best, most = e, n
        return best, most

    def worth_storing(self, kept: Kept, held: Mapping[int, Kept]) -> bool:
        """Whether a slot's kept prefix, about to be lost, should be stored: it holds at least `STORE_LEAST`
        positions more than any other slot (``held``: slot -> what it holds) or stored prefix would lend a
        request that sent exactly its tokens and one more."""
        if not self.on:
            return False
        probe = (*kept.tokens, -1)
        own = reusable(kept, probe, kept.key)
        others = [reusable(k, probe, kept.key) for k in (*held.values(), *(e.kept for e in self.entries))]
        return own >= max(others, default=0) + STORE_LEAST

    def store(self, kept: Kept, spare: Stored | None = None) -> tuple[Stored | None, list[Stored]]:
        """Store ``kept`` in pages of its own, after making room: the stored prefixes it holds whole, then the
        least recently used, are dropped (returned second), never ``spare`` (a request is copying it back).
        (None, []) where it would not fit so: larger than the store, or than what ``spare`` leaves."""
        need = pages_for(len(kept.tokens))
        if need + (len(spare.pages) if spare is not None else 0) > self.pages:
            return None, []
        out = [e for e in self.entries if e is not spare and e.kept.key == kept.key and _holds(kept, e.kept)]
        rest = [e for e in self.entries if e is not spare and e not in out]
        rest.sort(key=lambda e: e.kept.freed)
        free = len(self._free) + sum(len(e.pages) for e in out)
        while free < need:
            e = rest.pop(0)
            free += len(e.pages)
            out.append(e)
        self.entries = [e for e in self.entries if e not in out]
        for e in out:
            self._free.extend(e.pages)
        self.dropped += len(out)
        self._uses += 1
        entry = Stored(Kept(kept.tokens, kept.drafted, kept.key, self._uses), self._take(need))
        self.entries.append(entry)
        self.saved += 1
        return entry, out

    def _take(self, count: int) -> tuple[int, ...]:
        """``count`` free pages: the first run of that many consecutive ones where there is one (a prefix in
        one run moves in one copy a KV head), else the lowest free pages."""
        self._free.sort()
        free, start = self._free, 0
        for j in range(len(free)):
            if j > 0 and free[j] != free[j - 1] + 1:
                start = j
            if j - start + 1 == count:
                taken = free[start : j + 1]
                break
        else:
            taken = free[:count]
        gone = set(taken)
        self._free = [p for p in free if p not in gone]
        return tuple(taken)

    def used(self, entry: Stored) -> None:
        """A request copied ``entry`` back: it is the most recently used."""
        self._uses += 1
        entry.kept = Kept(entry.kept.tokens, entry.kept.drafted, entry.kept.key, self._uses)

    def clear(self) -> None:
        """Forget every stored prefix."""
        for e in self.entries:
            self._free.extend(e.pages)
        self.entries = []

    @property
    def totals(self) -> dict[str, int]:
        return {
            "prefix_store_saved": self.saved,
            "prefix_store_dropped": self.dropped,
            "prefix_store_entries": len(self.entries),
            "prefix_store_bytes": self.nbytes,
        }


def _holds(outer: Kept, inner: Kept) -> bool:
    """Whether ``outer`` holds everything ``inner`` does: its tokens begin with ``inner``'s, and its drafter
    holds at least as many positions."""
    if len(inner.tokens) > len(outer.tokens) or outer.tokens[: len(inner.tokens)] != inner.tokens:
        return False
    return inner.drafted is None or (outer.drafted is not None and outer.drafted >= inner.drafted)
