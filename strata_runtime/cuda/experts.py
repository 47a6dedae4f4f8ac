"""The expert cache on a GPU: the address tables the expert kernels read, and the cache's upkeep.

The expert kernels find expert ``e`` of a layer through two device tables of addresses (gate/up and down).
An address is either a VRAM slot of the stage's pool or the expert's pinned, mapped host copy, which the
kernel then reads over the host link: a miss costs its bytes over that link and nothing else, with no host
round trip and no change to the graphs. The kernels also count each layer's routing (assignments per expert)
and its misses into device counters.

The upkeep runs between windows, on the stream the stage computes on, without waiting for the GPU:

* every ``policy.every`` windows the counters are copied to pinned host memory and cleared, behind the
  window that filled them; a later call, once that copy has landed (an event query, never a wait), hands
  them to the `Residency`, with what prefill chunks counted on the host meanwhile, and it may decide swaps;
* only that call, made on the stage's own stream, moves experts. The MTP head's windows run on another
  stream of the last GPU, so its layer's experts keep their first slots (`Residency.fixed`), and its
  counts on the device may race with a read and be lost: statistics, never a result;
* a swap is applied in three stream-ordered steps: the tables first stop pointing at the slots being
  reused (their old experts are read from host memory from then on), a copy stream then loads the new
  experts into those slots once every window queued before has finished reading them, and the compute
  stream waits for those copies before the tables point the new experts at their slots. Windows queued in
  between read every expert whole, from one place or the other.

Letters: L sparse layers of the stage, E experts, C slots.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import Array, cupy_module
from ..experts.cache import Snapshot, Swap
from ..experts.host import host_empty
from ..experts.store import ExpertStore


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
    """[E] int32: each expert's slot, -1 when it is read from host memory (None: no cache)."""
    counts: Array | None = None
    """[E] fp32: assignments per expert since the last read."""
    misses: Array | None = None
    """[1] fp32: assignments read from host memory since the last read."""


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
            # Addresses of every expert's host copy [L, E], and of every slot [C].
            self._host_gu = np.stack([addresses(a) for a in store.host_gate_up])
            self._host_dn = np.stack([addresses(a) for a in store.host_down])
            self._slot_gu, self._slot_dn = addresses(store.pool_gate_up), addresses(store.pool_down)
            self.gate_up = cp.zeros((n_layers, n_exp), cp.uint64)
            self.down = cp.zeros((n_layers, n_exp), cp.uint64)
            self.slot_of = cp.zeros((n_layers, n_exp), cp.int32)
            self.counts = cp.zeros((n_layers, n_exp), cp.float32)
            self.misses = cp.zeros(n_layers, cp.float32)
            self.layers = [
                LayerExperts(
                    self.gate_up[j],
                    self.down[j],
                    functools.partial(self._at, j),
                    self.slot_of[j],
                    self.counts[j],
                    self.misses[j : j + 1],
                )
                for j in range(n_layers)
            ]
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
            self._lock = threading.Lock()
            self._pending = np.zeros((n_layers, n_exp), np.float64)
            self._pending_misses = 0
            # Pinned buffers: tables going up (two sets, so a new upload never overwrites one in flight)
            # and counters coming down.
            self._tables = [_pinned_tables(n_layers, n_exp) for _ in range(2)]
            self._table_done: list[Any] = [None, None]
            self._turn = 0
            self._read = (_pinned((n_layers, n_exp), np.float32), _pinned((n_layers,), np.float32))
            self._read_done: Any = None
            self._read_windows = 0
            self._windows = 0
            self._upload(
                self._table_arrays(store.residency.slot_of, pending=()), cp.cuda.get_current_stream()
            )
            cp.cuda.get_current_stream().synchronize()

    def _at(self, j: int, e: int) -> tuple[Array, Array]:
        """The arrays at the addresses the tables give expert ``e`` of layer ``j``: a slot or host memory."""
        store = self.store
        return store.weights(j, e) if store.resident(j, e) else store.host_weights(j, e)

    def view(self, first: int, count: int) -> ExpertSlice:
        """Layers [first, first + count) of the store."""
        return ExpertSlice(self, first, self.layers[first : first + count])

    # ---- tables ------------------------------------------------------------------------------------

    def _table_arrays(
        self, slot_of: np.ndarray, pending: tuple[tuple[int, int], ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tables for ``slot_of`` [L, E], with the experts in ``pending`` still read from host memory."""
        slots = slot_of.copy()
        for j, e in pending:
            slots[j, e] = -1
        resident = slots >= 0
        gu = np.where(resident, self._slot_gu[np.maximum(slots, 0)], self._host_gu)
        dn = np.where(resident, self._slot_dn[np.maximum(slots, 0)], self._host_dn)
        return gu.astype(np.uint64), dn.astype(np.uint64), slots.astype(np.int32)

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

    def after_window(self) -> list[Swap]:
        """Account one window of this stage and keep the cache in step; call right after the stage's work
        is queued, on its stream. Returns the swaps started now."""
        if not self.store.cached:
            return []
        cp = cupy_module()
        stream = cp.cuda.get_current_stream()
        self._windows += 1
        swaps: list[Swap] = []
        with self._lock:
            pending, self._pending = self._pending, np.zeros_like(self._pending)
            pending_misses, self._pending_misses = self._pending_misses, 0
        if self._read_done is not None and self._read_done.done:
            counts, misses = self._read
            pending += counts
            pending_misses += int(misses.sum())
            windows, self._read_done = self._read_windows, None
        elif pending.any():
            windows = 1
        else:
            windows = 0
        if windows:
            swaps = self.store.decide(pending, windows, pending_misses)
            if swaps:
                self.apply(swaps, stream)
        if self._read_done is None and self._windows >= self.store.residency.policy.every:
            self._read_windows, self._windows = self._windows, 0
            counts, misses = self._read
            self.counts.get(stream=stream, out=counts, blocking=False)
            self.misses.get(stream=stream, out=misses, blocking=False)
            self.counts.fill(0)
            self.misses.fill(0)
            self._read_done = cp.cuda.Event(disable_timing=True)
            self._read_done.record(stream)
        return swaps

    def record(self, counts: np.ndarray, misses: int) -> None:
        """Routing counted on the host (a prefill chunk's, on any thread and stream), for the next
        `after_window` to account: only that one, on the stage's own stream, decides and moves experts."""
        if not self.store.cached:
            return
        with self._lock:
            self._pending += counts
            self._pending_misses += misses

    def restore(self, snap: Snapshot) -> None:
        """Bring the cache back to ``snap`` and wait for it (a benchmark's arms each start from the same
        contents); pending counts are dropped."""
        cp = cupy_module()
        with cp.cuda.Device(self.device_id):
            stream = cp.cuda.get_current_stream()
            stream.synchronize()
            swaps = self.store.restore(snap)
            if self.store.cached:
                with self._lock:
                    self._pending[...] = 0
                    self._pending_misses = 0
                self._read_done, self._windows = None, 0
                self.counts.fill(0)
                self.misses.fill(0)
                if swaps:
                    self.apply(swaps, stream)
            stream.synchronize()

    def apply(self, swaps: list[Swap], stream: Any) -> None:
        """Load the swaps' experts into their slots, ordered on ``stream`` as the module docstring says."""
        cp = cupy_module()
        store, slot_of = self.store, self.store.residency.slot_of
        loaded = tuple(s.loaded for s in swaps)
        self._upload(self._table_arrays(slot_of, pending=loaded), stream)  # evicted and loaded: host
        tables_ready = cp.cuda.Event(disable_timing=True)
        tables_ready.record(stream)
        copies = self.copy_stream
        copies.wait_event(tables_ready)
        assert store.pool_gate_up is not None and store.pool_down is not None
        for s in swaps:
            j, e = s.loaded
            store.pool_gate_up[s.slot].set(store.host_gate_up[j][e], stream=copies)
            store.pool_down[s.slot].set(store.host_down[j][e], stream=copies)
        loaded_ready = cp.cuda.Event(disable_timing=True)
        loaded_ready.record(copies)
        stream.wait_event(loaded_ready)
        self._upload(self._table_arrays(slot_of, pending=()), stream)


def _pinned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return host_empty(shape, dtype, pinned=True)


def _pinned_tables(n_layers: int, n_exp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        _pinned((n_layers, n_exp), np.uint64),
        _pinned((n_layers, n_exp), np.uint64),
        _pinned((n_layers, n_exp), np.int32),
    )
