"""Per-slot KV cache of one stage (or of the MTP layer), with rewind.

Each slot's KV is a run of positions [0, length). A window writes its rows' keys and values at their
positions, and must start exactly at the slot's current length: a window that would skip or overlap
positions is refused. So after a verify that rejects some rows, the only way to go on is `rewind`, which
is what makes a skipped rollback impossible rather than silently wrong.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from ..backend import Array, Device, cupy_module, pinned_empty
from ..layout import Segment


class KVError(RuntimeError):
    """A window that does not continue a slot's KV where it ends."""


class KVCache:
    """Keys and values [layers, slots, K, T, D] on one device, and each slot's length."""

    def __init__(
        self,
        device: Device,
        layers: int,
        slots: int,
        kv_heads: int,
        context: int,
        head_dim: int,
        dtype: DTypeLike,
        arrays: tuple[Array, Array] | None = None,
    ) -> None:
        """``arrays`` (optional): preallocated keys and values of the same shape, e.g. views of a cache
        shared by several drafters so that one kernel launch can index all of them by slot."""
        self.device, self.context = device, context
        shape = (layers, slots, kv_heads, context, head_dim)
        if arrays is None:
            arrays = (device.zeros(shape, dtype), device.zeros(shape, dtype))
        elif tuple(arrays[0].shape) != shape or tuple(arrays[1].shape) != shape:
            raise ValueError(f"KV arrays of shape {arrays[0].shape} given for a cache of shape {shape}")
        self.k, self.v = arrays  # [Ls, S, K, T, D] each
        self.lengths = np.zeros(slots, dtype=np.int64)
        self._layers = layers

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def begin(self, segments: tuple[Segment, ...]) -> None:
        """Check that every segment continues its slot's KV, then count its rows as written."""
        for s in segments:
            if s.pos != self.lengths[s.slot]:
                raise KVError(
                    f"slot {s.slot}: a window starts at position {s.pos} but its KV holds "
                    f"{int(self.lengths[s.slot])} positions (rewind before re-writing)"
                )
            if s.pos + s.n > self.context:
                raise KVError(
                    f"slot {s.slot}: positions up to {s.pos + s.n} exceed the context {self.context}"
                )
        for s in segments:
            self.lengths[s.slot] = s.pos + s.n

    def write(self, layer: int, seg: Segment, keys: Array, values: Array) -> tuple[Array, Array]:
        """Store a segment's keys/values [n, K, D] and return the slot's keys/values [K, pos + n, D]."""
        end = seg.pos + seg.n
        self.k[layer, seg.slot, :, seg.pos : end] = keys.transpose(1, 0, 2)  # [K, n, D]
        self.v[layer, seg.slot, :, seg.pos : end] = values.transpose(1, 0, 2)  # [K, n, D]
        return self.k[layer, seg.slot, :, :end], self.v[layer, seg.slot, :, :end]

    def claim(self, slot: int, source: KVCache, src: int, n: int) -> None:
        """Count positions [0, n) of ``source``'s slot ``src`` as empty slot ``slot``'s (prefix reuse across
        slots); `copy_rows` copies them."""
        self.fill(slot, n, int(source.lengths[src]), f"slot {src}")

    def fill(self, slot: int, n: int, held: int, lender: str) -> None:
        """Count positions [0, n) of a prefix that ``lender`` holds ``held`` positions of (another slot, or
        the host's prefix store) as empty slot ``slot``'s; the caller copies them."""
        if self.lengths[slot] != 0:
            have = int(self.lengths[slot])
            raise KVError(f"slot {slot}: a prefix is copied only into an empty slot, it holds {have}")
        if not 0 <= n <= held:
            raise KVError(f"{lender}: cannot lend {n} positions, it holds {held}")
        self.lengths[slot] = n

    def copy_rows(self, source: KVCache, src: int, slot: int, n: int) -> None:
        """Copy positions [0, n) of ``source``'s slot ``src`` into slot ``slot``, every layer, on the current
        stream."""
        self.k[:, slot, :, :n] = source.k[:, src, :, :n]
        self.v[:, slot, :, :n] = source.v[:, src, :, :n]

    def save_rows(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of positions [0, n) of ``slot``, every layer: keys and values [layers, K, n, D]. On a
        GPU they are pinned and queued on the current stream (they hold the rows once it has passed this
        point; the host does not wait), one copy per layer and head, each a contiguous run of the cache."""
        shape = (self._layers, self.k.shape[2], n, self.k.shape[4])
        if not self.device.is_cuda:
            return np.array(self.k[:, slot, :, :n]), np.array(self.v[:, slot, :, :n])
        stream = cupy_module().cuda.get_current_stream()
        out = pinned_empty(shape, self.k.dtype), pinned_empty(shape, self.v.dtype)
        for cache, host in zip((self.k, self.v), out, strict=True):
            for layer in range(shape[0]):
                for head in range(shape[1]):
                    cache[layer, slot, head, :n].get(stream=stream, out=host[layer, head], blocking=False)
        return out

    def load_rows(self, slot: int, keys: np.ndarray, values: np.ndarray, n: int) -> None:
        """Copy positions [0, n) of host copies from `save_rows` into ``slot`` (whose length the caller
        counted), on the current stream; on a GPU the host copies must be pinned and outlive the copy."""
        if not self.device.is_cuda:
            self.k[:, slot, :, :n] = keys[:, :, :n]
            self.v[:, slot, :, :n] = values[:, :, :n]
            return
        stream = cupy_module().cuda.get_current_stream()
        for cache, host in ((self.k, keys), (self.v, values)):
            for layer in range(host.shape[0]):
                for head in range(host.shape[1]):
                    cache[layer, slot, head, :n].set(host[layer, head, :n], stream=stream)

    def rewind(self, slot: int, length: int) -> None:
        """Forget positions [length, ...) of ``slot``: rejected rows, or the whole slot on release."""
        if not 0 <= length <= self.lengths[slot]:
            raise KVError(f"slot {slot}: cannot rewind to {length}, it holds {int(self.lengths[slot])}")
        self.lengths[slot] = length
