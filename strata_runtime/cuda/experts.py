"""The expert cache on a GPU: the address tables the expert kernels read, and the cache's upkeep.

The expert kernels find expert ``e`` of a layer through two device tables of addresses (gate/up and down).
An address is a VRAM slot of the stage's pool, a helper slot on another GPU (the helper tier, which the
kernel reads over the peer link), or the expert's pinned, mapped host copy, which the kernel then reads over
the host link: a miss costs its bytes over that link and nothing else, with no host round trip and no change
to the graphs. The kernels also count each layer's routing (assignments per expert) and its misses into
device counters: a third table, ``slot_of``, gives each expert's tier code (a VRAM slot s >= 0, -1 for host
memory, -2 - h for helper slot h), and the kernels count [misses, of which helper reads] per layer: the decode
expert kernels and, for prompt chunks through the prefill path, the routing kernel.

The upkeep runs between windows, on the stream the stage computes on, without waiting for the GPU:

* every ``policy.every`` windows the counters are copied to pinned host memory and cleared, behind the
  window that filled them; a later call, once that copy has landed (an event query, never a wait), hands
  them to the `Residency`, and it may decide swaps;
* only that call, made on the stage's own stream, moves experts. A prompt chunk's counts are the exception
  to "never a wait": the window after the chunk that is not one itself (`before_window`: a decode window,
  or a short prompt's graph windows) waits on the host for them and hands them over first, so that the
  rebalance they bring is queued before it. Otherwise the windows queued ahead while the chunk still ran
  would read the request's experts from host memory while the rebalance copies the same experts in;
* the MTP head's windows run on another stream of the last GPU, so its layer's experts keep their first
  slots (`Residency.fixed`), and its counts on the device may race with a read and be lost: statistics,
  never a result;
* a swap is applied in three stream-ordered steps: the tables first stop pointing at the slots being
  reused (their old experts, and every expert on its way into a slot, are read from host memory from then
  on), a copy stream then loads the new experts into those slots once every window queued before has
  finished reading them, and the compute stream waits for those copies before the tables point the new
  experts at their slots. Windows queued in between read every expert whole, from one place or the other.
  The copies into VRAM come first, those from a helper slot over the peer link; then the copies from host
  memory into helper slots, which may overwrite a helper slot a VRAM copy has just read.

Where the cache keeps its misses (`Policy.keep_misses`, the default), a rebalance copies nothing: it uploads
a queue of victims (`Residency.victims`), and ``moe_admit``, run before each layer's expert kernels, gives
each expert the window reads from host memory a victim's slot (``fill``), which the expert kernels write as
they read it; the layer's next admission points the tables at the slot (`Keep`). The tables then change on
the device, so the counters' read also brings back the tier codes, ``fill`` and the queue's use, and the
host takes them as what VRAM holds (`Residency.learn`) before it ranks the next queue. It never uploads
whole tables while windows may admit: a restore first waits for the stream and learns the device's tables.
The state exists whatever the policy, so that benchmark arms sharing the cache may keep or swap; swapping,
the queue stays empty and the admission keeps nothing.

Letters: L sparse layers of the stage, E experts, C slots, S helper slots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import Array, cupy_module
from ..experts.cache import HELPER, Reads, Snapshot, Swap
from ..experts.host import host_empty
from ..experts.store import ExpertStore
from ..reference.keep import held


def addresses(stacked: Array) -> np.ndarray:
    """The address [E] (uint64, as a host array) of each item of a stacked [E, ...] array: a CuPy array's
    device address, a (pinned, mapped) host array's host address, which the GPU shares under UVA."""
    data = stacked.data
    base = data.ptr if hasattr(data, "ptr") else stacked.ctypes.data
    return np.uint64(base) + np.uint64(stacked.strides[0]) * np.arange(stacked.shape[0], dtype=np.uint64)


def resident_experts(gate_up: Array, down: Array, xp: Any) -> LayerExperts:
    """One layer's experts held whole on the device as stacked [E, 2I, H] and [E, H, I] arrays (``xp``:
    their array module)."""
    return LayerExperts(
        xp.asarray(addresses(gate_up)), xp.asarray(addresses(down)), lambda e: (gate_up[e], down[e])
    )


@dataclass
class LayerExperts:
    """What one layer's expert kernels read: address tables and, under a cache, its counters."""

    gate_up: Array
    """[E] uint64: where each expert's gate/up [2I, H] is."""
    down: Array
    """[E] uint64: where each expert's down [H, I] is."""
    weights: Callable[[int], tuple[Array, Array]]
    """Expert e's (gate/up, down) arrays wherever they are now: what the kernels' NumPy reference reads."""
    slot_of: Array | None = None
    """[E] int32: each expert's tier code: its VRAM slot, -1 for host memory, -2 - h for helper slot h
    (None: no cache)."""
    counts: Array | None = None
    """[E] fp32: assignments per expert since the last read."""
    misses: Array | None = None
    """[3] fp32: assignments not read from VRAM since the last read, of those the helper tier's, and the
    experts kept (`Keep`)."""
    keep: Keep | None = None
    """Where the cache keeps its misses (`Policy.keep_misses`): what ``moe_admit`` and the expert kernels
    read for it (None: it does not)."""


@dataclass
class Keep:
    """What a layer's kernels read where the cache keeps its misses (the rule of
    `strata_runtime.reference.keep.admit`)."""

    state: Array
    """[13] uint64: the stage's tables, queue and counters as ``moe_admit`` reads them (`KEEP_STATE`)."""
    layer: int
    """The layer's index in the stage's tables."""
    fill: Array
    """[E] int32, the layer's row of the stage's ``fill`` [L, E]: the slot each expert is being written into
    (-1: none)."""
    slot_gate_up: Array
    """[C] uint64: every slot's gate/up address."""
    slot_down: Array
    """[C] uint64: every slot's down address."""
    owner: CudaExperts

    def slot(self, s: int) -> tuple[Array, Array]:
        """Slot ``s``'s (gate/up, down) arrays, where the kernels' NumPy reference writes a kept expert."""
        store = self.owner.store
        assert store.pool_gate_up is not None and store.pool_down is not None
        return store.pool_gate_up[s], store.pool_down[s]


@dataclass
class ExpertSlice:
    """Consecutive layers of a `CudaExperts` (the stage's main layers, or the MTP head's layer): what one
    `strata_runtime.cuda.layers.LayerStack` reads."""

    owner: CudaExperts
    first: int
    """The store's index of the slice's first layer."""
    layers: list[LayerExperts]

    @property
    def store(self) -> ExpertStore:
        return self.owner.store


class CudaExperts:
    """A stage's `ExpertStore` as the expert kernels on its GPU see it, kept in step with the cache."""

    def __init__(self, store: ExpertStore, device_id: int) -> None:
        cp = cupy_module()
        self.store, self.device_id = store, device_id
        n_layers, n_exp = len(store), store.n_experts
        with cp.cuda.Device(device_id):
            if not store.cached:
                self.layers = [
                    resident_experts(gu, dn, cp)
                    for gu, dn in zip(store.layer_gate_up, store.layer_down, strict=True)
                ]
                return
            assert store.pool_gate_up is not None and store.pool_down is not None
            # Addresses of every expert's host copy [L, E], of every slot [C] and every helper slot [S].
            self._host_gu = np.stack([addresses(a) for a in store.host_gate_up])
            self._host_dn = np.stack([addresses(a) for a in store.host_down])
            self._slot_gu, self._slot_dn = addresses(store.pool_gate_up), addresses(store.pool_down)
            pools = store.helper.pools
            self._helper_gu = np.concatenate([addresses(gu) for _, gu, _ in pools] or [_NO_ADDRESSES])
            self._helper_dn = np.concatenate([addresses(dn) for _, _, dn in pools] or [_NO_ADDRESSES])
            self._arrays: dict[int, Array] | None = None
            self.gate_up = cp.zeros((n_layers, n_exp), cp.uint64)
            self.down = cp.zeros((n_layers, n_exp), cp.uint64)
            self.slot_of = cp.zeros((n_layers, n_exp), cp.int32)
            self.counts = cp.zeros((n_layers, n_exp), cp.float32)
            self.misses = cp.zeros((n_layers, 3), cp.float32)
            self._keep_state(n_layers, n_exp)
            fixed = store.residency.fixed
            self.layers = [
                LayerExperts(
                    self.gate_up[j],
                    self.down[j],
                    functools.partial(self._at, j),
                    self.slot_of[j],
                    self.counts[j],
                    self.misses[j],
                    None if j in fixed else self._keep(j),
                )
                for j in range(n_layers)
            ]
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
            # Pinned buffers: tables going up (two sets, so a new upload never overwrites one in flight)
            # and counters coming down.
            self._tables = [_pinned_tables(n_layers, n_exp) for _ in range(2)]
            self._table_done: list[Any] = [None, None]
            self._turn = 0
            self._read = (_pinned((n_layers, n_exp), np.float32), _pinned((n_layers, 3), np.float32))
            self._read_done: Any = None
            self._read_windows = 0
            self._read_prompt = False
            """Whether the read in flight holds a prompt chunk's counts (its hand-over rebalances)."""
            self._windows = 0
            self._read_soon = False
            self._upload(self._table_arrays(pending=()), cp.cuda.get_current_stream())
            cp.cuda.get_current_stream().synchronize()

    @property
    def keeping(self) -> bool:
        """Whether the cache keeps its misses now (`Keep`; benchmark arms sharing the cache may differ): the
        tables then change on the device. Otherwise the queue of victims stays empty, and the admission
        before each layer's expert kernels keeps nothing."""
        policy = self.store.residency.policy
        return self.store.cached and policy.keep_misses and policy.adapt

    def _keep_state(self, n_layers: int, n_exp: int) -> None:
        """The device state of keeping misses (`Keep`), whatever the policy now: host addresses and slot
        addresses on the device, ``fill`` [L, E], the queue of victims and the pointers ``moe_admit``
        reads."""
        cp = cupy_module()
        most = max(self.store.slots, 1)  # a queue holds residents: as long as any arm's policy makes it
        self.host_gate_up, self.host_down = cp.asarray(self._host_gu), cp.asarray(self._host_dn)
        self.slot_gate_up, self.slot_down = cp.asarray(self._slot_gu), cp.asarray(self._slot_dn)
        self.fill = cp.full((n_layers, n_exp), -1, cp.int32)
        self.victims = cp.zeros(most, cp.int32)
        self.victim_keys = cp.zeros(most, cp.int32)
        self.queue = cp.zeros(2, cp.int32)  # taken, count
        fields = {
            "KS_GU": self.gate_up,
            "KS_DN": self.down,
            "KS_CODE": self.slot_of,
            "KS_HOST_GU": self.host_gate_up,
            "KS_HOST_DN": self.host_down,
            "KS_SLOT_GU": self.slot_gate_up,
            "KS_SLOT_DN": self.slot_down,
            "KS_FILL": self.fill,
            "KS_VICTIMS": self.victims,
            "KS_KEYS": self.victim_keys,
            "KS_QUEUE": self.queue,
            "KS_COUNTERS": self.misses,
        }
        assert tuple(fields) == KEEP_STATE[:-1]
        self.keep_state = cp.asarray(np.array([a.data.ptr for a in fields.values()] + [n_exp], np.uint64))
        # Pinned buffers for the queue going up (two sets, as the tables) and the tables coming down.
        self._queues = [(_pinned((most,), np.int32), _pinned((most,), np.int32), _pinned((2,), np.int32))]
        self._queues.append(tuple(_pinned(b.shape, np.int32) for b in self._queues[0]))  # type: ignore[arg-type]
        self._queue_done: list[Any] = [None, None]
        self._queue_turn = 0
        self._read_tables = (
            _pinned((n_layers, n_exp), np.int32),
            _pinned((n_layers, n_exp), np.int32),
            _pinned((2,), np.int32),
        )

    def _keep(self, j: int) -> Keep:
        return Keep(self.keep_state, j, self.fill[j], self.slot_gate_up, self.slot_down, self)

    def _at(self, j: int, e: int) -> tuple[Array, Array]:
        """The arrays at the addresses the device tables give expert ``e`` of layer ``j`` now (a VRAM slot,
        a helper slot or host memory): what the kernels' NumPy reference reads, so that a wrong address
        shows as a wrong result. It reads the tables back, so it serves the reference only."""
        if self._arrays is None:
            store, helper = self.store, self.store.helper
            assert store.pool_gate_up is not None and store.pool_down is not None
            held = [(store.pool_gate_up[c], store.pool_down[c]) for c in range(store.slots)]
            held += [helper.slot(h) for h in range(len(helper))]
            held += [store.host_weights(j, e) for j in range(len(store)) for e in range(store.n_experts)]
            self._arrays = {int(addresses(a[None])[0]): a for pair in held for a in pair}
        return self._arrays[int(self.gate_up[j, e])], self._arrays[int(self.down[j, e])]

    def view(self, first: int, count: int) -> ExpertSlice:
        """Layers [first, first + count) of the store."""
        return ExpertSlice(self, first, self.layers[first : first + count])

    # ---- tables ------------------------------------------------------------------------------------

    def _table_arrays(
        self, pending: tuple[tuple[int, int], ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tables for the residency's slots now, with the experts in ``pending`` still read from host
        memory: addresses [L, E] (gate/up, down) and tier codes [L, E]."""
        residency = self.store.residency
        slots, helper = residency.slot_of.copy(), residency.helper_of.copy()
        for j, e in pending:
            slots[j, e] = helper[j, e] = -1
        in_vram, in_helper = slots >= 0, helper >= 0
        s, h = np.maximum(slots, 0), np.maximum(helper, 0)
        gu = np.where(
            in_vram, _pick(self._slot_gu, s), np.where(in_helper, _pick(self._helper_gu, h), self._host_gu)
        )
        dn = np.where(
            in_vram, _pick(self._slot_dn, s), np.where(in_helper, _pick(self._helper_dn, h), self._host_dn)
        )
        code = np.where(in_vram, slots, np.where(in_helper, -2 - helper, -1))
        return gu.astype(np.uint64), dn.astype(np.uint64), code.astype(np.int32)

    def _upload(self, tables: tuple[np.ndarray, np.ndarray, np.ndarray], stream: Any) -> None:
        """Copy the tables to the device on ``stream``, through pinned memory (never a host wait)."""
        i = self._turn
        self._turn ^= 1
        if self._table_done[i] is not None:
            self._table_done[i].synchronize()  # the upload two turns ago: long finished in practice
        host = self._tables[i]
        for dst, src in zip(host, tables, strict=True):
            dst[...] = src
        for dev, src in zip((self.gate_up, self.down, self.slot_of), host, strict=True):
            dev.set(src, stream=stream)
        done = cupy_module().cuda.Event(disable_timing=True)
        done.record(stream)
        self._table_done[i] = done

    # ---- between windows ---------------------------------------------------------------------------

    def after_window(self, prompt: bool = False) -> list[Swap]:
        """Account one window of this stage and keep the cache in step; call right after the stage's work
        is queued, on its stream. ``prompt``: the window was a prompt chunk through the prefill path, whose
        thousands of assignments the cache should learn before the windows after it: its counters are
        read at once (or as soon as the read in flight has landed), and their hand-over rebalances the
        cache. After a rebalance that left a backlog (`Residency.backlog`) they are read every window too,
        so the rest of its swaps follow at once; and so they are while the cache keeps its misses, so that
        the host sees how much of the queue of victims the windows have taken and brings a new one once
        they have taken half (`strata_runtime.experts.cache.QUEUE_REFRESH`), not only every ``every``
        windows. Returns the swaps started now."""
        if not self.store.cached:
            return []
        stream = cupy_module().cuda.get_current_stream()
        self._windows += 1
        self._read_soon |= prompt
        swaps: list[Swap] = []
        if self._read_done is not None and self._read_done.done:
            swaps = self._hand_over(stream)
        residency = self.store.residency
        if self._read_done is None and (
            self._read_soon or residency.backlog or self.keeping or self._windows >= residency.policy.every
        ):
            self._queue_read(stream)
        return swaps

    def before_window(self) -> list[Swap]:
        """Before queueing a window that is not a prompt chunk through the prefill path, on the stage's
        stream: when a prompt chunk's counts are not yet handed over (read in flight, or still on the device
        behind another read), wait for them and hand them over now, so that the rebalance they bring is
        queued ahead of this window, which then waits for its copies instead of reading the request's
        experts from host memory beside them. Returns the swaps started now."""
        if not self.store.cached:
            return []
        if not (self._read_soon or (self._read_done is not None and self._read_prompt)):
            return []
        return self._hand_over_now(cupy_module().cuda.get_current_stream(), self._read_soon)

    def settle(self) -> list[Swap]:
        """Hand the cache every assignment the kernels have counted, waiting for the GPU: for when the stage
        is idle (what the cache has served is then exact in its statistics). Returns the swaps started."""
        if not self.store.cached or (self._read_done is None and not self._windows):
            return []
        cp = cupy_module()
        with cp.cuda.Device(self.device_id):
            cp.cuda.Device(self.device_id).synchronize()  # the counts of every stream's windows are in
            return self._hand_over_now(cp.cuda.get_current_stream(), self._windows > 0)

    def _hand_over_now(self, stream: Any, counters: bool) -> list[Swap]:
        """Wait for the read in flight and hand it over; then, with ``counters``, read the counters behind
        the work queued on ``stream``, wait for them and hand them over too. Returns the swaps started."""
        swaps: list[Swap] = []
        if self._read_done is not None:
            self._read_done.synchronize()
            swaps += self._hand_over(stream)
        if counters:
            self._queue_read(stream)
            assert self._read_done is not None
            self._read_done.synchronize()
            swaps += self._hand_over(stream)
        return swaps

    def _queue_read(self, stream: Any) -> None:
        """Copy the counters to pinned memory behind the work queued on ``stream`` and clear them."""
        self._read_windows, self._read_prompt = self._windows, self._read_soon
        self._windows, self._read_soon = 0, False
        counts, misses = self._read
        self.counts.get(stream=stream, out=counts, blocking=False)
        self.misses.get(stream=stream, out=misses, blocking=False)
        if self.keeping:  # what the admissions have made of the tables
            code, fill, queue = self._read_tables
            self.slot_of.get(stream=stream, out=code, blocking=False)
            self.fill.get(stream=stream, out=fill, blocking=False)
            self.queue.get(stream=stream, out=queue, blocking=False)
        self.counts.fill(0)
        self.misses.fill(0)
        self._read_done = cupy_module().cuda.Event(disable_timing=True)
        self._read_done.record(stream)

    def _hand_over(self, stream: Any) -> list[Swap]:
        """Give the landed read to the cache, which may decide swaps; start them on ``stream``."""
        counts, misses = self._read
        away, helper, kept = (int(n) for n in misses.sum(axis=0))
        windows, self._read_done = self._read_windows, None
        reads = Reads(helper, away - helper)
        if self.keeping:
            residency = self.store.residency
            queue = residency.queue
            code, fill, (taken, count) = self._read_tables
            residency.learn(held(code, fill), kept, taken, count)
            self.store.decide(counts.astype(np.float64), windows, reads, self._read_prompt)
            if residency.queue is not queue:
                self._upload_queue(stream)
            return []
        swaps = self.store.decide(counts.astype(np.float64), windows, reads, self._read_prompt)
        if swaps:
            self.apply(swaps, stream)
        return swaps

    def _upload_queue(self, stream: Any) -> None:
        """Copy the cache's queue of victims to the device on ``stream``, through pinned memory: the
        admissions of the windows queued after it take from it."""
        i = self._queue_turn
        self._queue_turn ^= 1
        if self._queue_done[i] is not None:
            self._queue_done[i].synchronize()  # the upload two turns ago
        queue = self.store.residency.queue
        slots, keys, meta = self._queues[i]
        n = len(queue.slot)
        slots[:n], keys[:n], meta[...] = queue.slot, queue.key, (queue.taken, n)
        self.victims[:n].set(slots[:n], stream=stream)
        self.victim_keys[:n].set(keys[:n], stream=stream)
        self.queue.set(meta, stream=stream)
        done = cupy_module().cuda.Event(disable_timing=True)
        done.record(stream)
        self._queue_done[i] = done

    def learn_now(self) -> None:
        """Wait for the stage's stream and take what the admissions have made of the tables (the host's
        tables lag the device's where the cache keeps its misses): for code that reads the host's tables."""
        if not self.keeping:
            return
        cupy_module().cuda.get_current_stream().synchronize()
        self._learn()

    def _learn(self) -> None:
        """Take the device's tables as what VRAM holds (`Residency.learn`), once the work that changes them
        has finished."""
        self.store.residency.learn(held(self.slot_of.get(), self.fill.get()))

    def recall(self, scores: np.ndarray, stream: Any) -> list[Swap]:
        """`ExpertStore.recall`: the rebalance's experts loaded on ``stream`` (the stage's, so that the
        windows queued after it read the new tables), or, where the cache keeps its misses, its new queue.
        Returns the swaps started."""
        if not self.store.cached:
            return []
        queue = self.store.residency.queue
        swaps = self.store.recall(scores, load=False)
        if self.keeping and self.store.residency.queue is not queue:
            self._upload_queue(stream)
        if swaps:
            self.apply(swaps, stream)
        return swaps

    def restore(self, snap: Snapshot) -> None:
        """Bring the cache back to ``snap`` and wait for it (a benchmark's arms each start from the same
        contents); counts not yet handed to the cache are dropped."""
        cp = cupy_module()
        with cp.cuda.Device(self.device_id):
            stream = cp.cuda.get_current_stream()
            stream.synchronize()
            if self.store.cached:  # the device's tables, with the experts being kept in their slots
                self._learn()
                self.fill.fill(-1)
                self.queue.fill(0)
                self._upload(self._table_arrays(pending=()), stream)
            swaps = self.store.restore(snap)
            if self.store.cached:
                self._read_done, self._windows, self._read_soon = None, 0, False
                self.counts.fill(0)
                self.misses.fill(0)
                if swaps:
                    self.apply(swaps, stream)
            stream.synchronize()

    def apply(self, swaps: list[Swap], stream: Any) -> None:
        """Load the swaps' experts into their slots, ordered on ``stream`` as the module docstring says."""
        cp = cupy_module()
        moving = tuple(s.loaded for s in swaps) + tuple(
            s.evicted for s in swaps if s.source >= 0 and s.evicted
        )
        self._upload(self._table_arrays(pending=moving), stream)  # evicted and loaded: host
        tables_ready = cp.cuda.Event(disable_timing=True)
        tables_ready.record(stream)
        copies = self.copy_stream
        copies.wait_event(tables_ready)
        for s in swaps:  # into VRAM first: they read helper slots
            if s.tier != HELPER:
                self._into_vram(s, copies)
        for s in swaps:
            if s.tier == HELPER:
                self._into_helper(s.slot, s.loaded, copies)
            elif s.source >= 0 and s.evicted is not None:  # an exchange: the evicted expert's new place
                self._into_helper(s.source, s.evicted, copies)
        loaded_ready = cp.cuda.Event(disable_timing=True)
        loaded_ready.record(copies)
        stream.wait_event(loaded_ready)
        self._upload(self._table_arrays(pending=()), stream)

    def _into_vram(self, swap: Swap, copies: Any) -> None:
        """Queue a VRAM slot's new expert on ``copies``: from host memory, or from its helper slot over
        the peer link."""
        store = self.store
        assert store.pool_gate_up is not None and store.pool_down is not None
        slots = (store.pool_gate_up[swap.slot], store.pool_down[swap.slot])
        if swap.source < 0:
            for dst, src in zip(slots, store.host_weights(*swap.loaded), strict=True):
                dst.set(src, stream=copies)
            return
        runtime = cupy_module().cuda.runtime
        helper = store.helper.device_of(swap.source).index
        for dst, src in zip(slots, store.helper.slot(swap.source), strict=True):
            runtime.memcpyPeerAsync(
                dst.data.ptr, self.device_id, src.data.ptr, helper, src.nbytes, copies.ptr
            )

    def _into_helper(self, slot: int, expert: tuple[int, int], copies: Any) -> None:
        """Queue a copy of ``expert``'s host weights into helper slot ``slot`` on ``copies``, a stream of
        this GPU, so that it is ordered with the windows reading the slot (a copy, unlike a kernel, may
        target another device's memory from any stream; the driver finds the devices from the addresses).
        It crosses the helper GPU's host link."""
        runtime = cupy_module().cuda.runtime
        for dst, src in zip(self.store.helper.slot(slot), self.store.host_weights(*expert), strict=True):
            runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, runtime.memcpyDefault, copies.ptr)


_NO_ADDRESSES = np.zeros(0, np.uint64)


def _pick(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``table[index]``, or zeros where ``table`` is empty (a tier with no slots: ``np.where`` masks them)."""
    return table[index] if table.size else np.zeros(index.shape, np.uint64)


KEEP_STATE = (
    "KS_GU",
    "KS_DN",
    "KS_CODE",
    "KS_HOST_GU",
    "KS_HOST_DN",
    "KS_SLOT_GU",
    "KS_SLOT_DN",
    "KS_FILL",
    "KS_VICTIMS",
    "KS_KEYS",
    "KS_QUEUE",
    "KS_COUNTERS",
    "KS_E",
)
"""The fields of ``moe_admit``'s state, in the order of experts.cuh's ``KeepState``."""


def _pinned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return host_empty(shape, dtype, pinned=True)


def _pinned_tables(n_layers: int, n_exp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        _pinned((n_layers, n_exp), np.uint64),
        _pinned((n_layers, n_exp), np.uint64),
        _pinned((n_layers, n_exp), np.int32),
    )
