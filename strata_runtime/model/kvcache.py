"""Per-slot KV cache of one stage (or of the MTP layer), with rewind.

Each slot's KV is a run of positions [0, length). A window writes its rows' keys and values at their
positions, and must start exactly at the slot's current length: a window that would skip or overlap
positions is refused. So after a verify that rejects some rows, the only way to go on is `rewind`, which
is what makes a skipped rollback impossible rather than silently wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import DTypeLike

from ..backend import Array, Device, cupy_module
from ..experts.host import host_empty
from ..layout import Segment

MAX_PITCH = 2**31 - 1
"""The widest row pitch, in bytes, that a CUDA 2D copy takes (``cudaDevAttrMaxPitch`` on current GPUs)."""


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

    def save_rows(self, slot: int, into: HostRows, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copy runs of ``slot``'s positions into host rows ``into`` (the prefix store's): each run ``(at,
        pos, count)`` copies positions [pos, pos + count) of every layer and KV head to [at, at + count). On
        a GPU queued on the current stream, the host does not wait (see `HostRows`)."""
        for at, pos, count in runs:
            if self.device.is_cuda:
                _copy_run(self.k, slot, into.keys, at, pos, count, to_host=True)
                _copy_run(self.v, slot, into.values, at, pos, count, to_host=True)
            else:
                into.keys[:, :, at : at + count] = self.k[:, slot, :, pos : pos + count]
                into.values[:, :, at : at + count] = self.v[:, slot, :, pos : pos + count]

    def load_rows(self, slot: int, source: HostRows, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copy runs of host rows ``source`` back into ``slot`` (whose length the caller counted), the
        reverse of `save_rows`, on the current stream."""
        for at, pos, count in runs:
            if self.device.is_cuda:
                _copy_run(self.k, slot, source.keys, at, pos, count, to_host=False)
                _copy_run(self.v, slot, source.values, at, pos, count, to_host=False)
            else:
                self.k[:, slot, :, pos : pos + count] = source.keys[:, :, at : at + count]
                self.v[:, slot, :, pos : pos + count] = source.values[:, :, at : at + count]

    def rewind(self, slot: int, length: int) -> None:
        """Forget positions [length, ...) of ``slot``: rejected rows, or the whole slot on release."""
        if not 0 <= length <= self.lengths[slot]:
            raise KVError(f"slot {slot}: cannot rewind to {length}, it holds {int(self.lengths[slot])}")
        self.lengths[slot] = length


class HostRows:
    """Host memory for ``positions`` positions of a KV cache's every layer and KV head, keys and values
    [layers, K, positions, D] each (the prefix store's, allocated once): page-locked on a GPU, so that copies
    into and out of it are queued without the host waiting, and so that it is never taken back while a
    copy runs (it lives as long as the engine)."""

    def __init__(self, kv: KVCache, positions: int) -> None:
        layers, _, kv_heads, _, head_dim = kv.k.shape
        shape = (int(layers), int(kv_heads), positions, int(head_dim))
        pinned = kv.device.is_cuda
        self.keys = host_empty(shape, kv.k.dtype, pinned, kv.device.index)
        self.values = host_empty(shape, kv.v.dtype, pinned, kv.device.index)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def rows(self, runs: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values [layers, K, n, D] that ``runs`` (`KVCache.save_rows`'s) hold, in order of
        position: a copy, to read what was stored."""
        parts = [(self.keys[:, :, at : at + n], self.values[:, :, at : at + n]) for at, _, n in runs]
        return np.concatenate([k for k, _ in parts], axis=2), np.concatenate([v for _, v in parts], axis=2)


def _copy_run(
    cache: Array, slot: int, host: np.ndarray, at: int, pos: int, count: int, to_host: bool
) -> None:
    """Queue on the current stream the copy between positions [pos, pos + count) of ``slot`` in a device
    cache [layers, slots, K, T, D] and positions [at, at + count) of host rows [layers, K, C, D]: one strided
    copy per KV head (a row per layer), or per layer (a row per head) where a layer's pitch is too wide for
    one, whichever takes fewer copies."""
    rt = cupy_module().cuda.runtime
    layers, slots, kv_heads, context, head_dim = (int(d) for d in cache.shape)
    inside = 0 <= slot < slots and min(pos, at) >= 0 and pos + count <= context
    if not inside or at + count > host.shape[2]:
        # The copy goes through raw addresses: nothing else would stop it writing past either array.
        raise ValueError(
            f"a copy of positions [{pos}, {pos + count}) of slot {slot} to [{at}, {at + count}) falls "
            f"outside the cache ({slots} slots of {context}) or the host rows ({host.shape[2]})"
        )
    item = cache.dtype.itemsize
    s_layer, s_slot, s_head, s_pos, s_dim = (int(x) for x in cache.strides)
    h_layer, h_head, h_pos, _ = (int(x) for x in host.strides)
    if s_dim != item or s_pos != head_dim * item or h_pos != head_dim * item:
        raise ValueError("a KV cache's positions must each be one contiguous run of a head's dimensions")
    width = count * head_dim * item
    dev = int(cache.data.ptr) + slot * s_slot + pos * s_pos
    mem = int(host.ctypes.data) + at * h_pos
    by_head = (kv_heads, layers, s_head, h_head, s_layer, h_layer)  # copies, rows, step, step, pitch, pitch
    by_layer = (layers, kv_heads, s_layer, h_layer, s_head, h_head)
    shapes = [c for c in (by_head, by_layer) if max(c[4], c[5]) <= MAX_PITCH]
    copies, rows, d_step, h_step, d_pitch, h_pitch = min(shapes, key=lambda c: c[0])
    stream = cupy_module().cuda.get_current_stream().ptr
    for j in range(copies):
        d, h = dev + j * d_step, mem + j * h_step
        if to_host:
            rt.memcpy2DAsync(h, h_pitch, d, d_pitch, width, rows, rt.memcpyDefault, stream)
        else:
            rt.memcpy2DAsync(d, d_pitch, h, h_pitch, width, rows, rt.memcpyDefault, stream)
