"""Devices and their array modules: CuPy for ``cuda:N``, NumPy for a virtual ``cpu:N``.

Model code is written once against ``device.xp``. A virtual CPU device runs exactly the same code on
NumPy, which makes it the reference path and keeps CI and laptops working. CuPy is optional: it is imported
only when a ``cuda`` device is asked for, and whichever CuPy wheel is installed (``cupy-cuda12x``,
``cupy-cuda13x``, ...) is accepted.

Copies that feed a GPU or read it back go through page-locked (pinned) host memory (`upload`,
`upload_into`, `download`): a copy from ordinary pageable memory makes the host wait for the stream first,
which would serialise stages that are meant to overlap. A pinned buffer must outlive its copy: it is held by
the list a `holding` block names (a window in flight holds its own), or else until an event after the copy.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import re
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
from numpy.typing import DTypeLike

_NAME_RE = re.compile(r"^(cuda|cpu):(\d+)$")
Array = Any
"""A NumPy or CuPy array. CuPy ships no type stubs, so array-valued names are typed with this alias: it says
"an array on some device" where a plain Any would say nothing."""
DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16}
"""Array dtypes the runtime computes in. bfloat16 has no NumPy/CuPy dtype; checkpoints in it are converted."""


class DeviceError(RuntimeError):
    """A device that does not exist or cannot be used."""


def cupy_module() -> ModuleType:
    """The installed CuPy, or a clear error saying how to get one."""
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise DeviceError(
            "a cuda device was asked for but CuPy is not installed; install the extra "
            "`pip install 'strata-cfg[cuda]'` (or any cupy-cudaXXx wheel matching the driver)"
        ) from exc


@dataclass(frozen=True)
class Device:
    """One device of a plan: ``cuda:N`` (CuPy) or a virtual ``cpu:N`` (NumPy)."""

    kind: Literal["cuda", "cpu"]
    index: int

    @classmethod
    def parse(cls, name: str) -> Device:
        m = _NAME_RE.match(name)
        if m is None:
            raise DeviceError(f"not a device name: {name!r} (expected cuda:N or cpu:N)")
        return cls(m.group(1), int(m.group(2)))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def xp(self) -> ModuleType:
        """The array module: ``cupy`` or ``numpy``."""
        return cupy_module() if self.is_cuda else np

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Make this the current device (a no-op for virtual CPU devices)."""
        if self.is_cuda:
            with cupy_module().cuda.Device(self.index):
                yield
        else:
            yield

    def check(self) -> None:
        """Refuse a cuda device that is not there."""
        if self.is_cuda:
            cp = cupy_module()
            count = cp.cuda.runtime.getDeviceCount()
            if self.index >= count:
                raise DeviceError(f"{self} does not exist: this machine has {count} CUDA device(s)")

    # ---- allocation and transfer -------------------------------------------------------------------

    def zeros(self, shape: tuple[int, ...], dtype: DTypeLike) -> Array:
        with self.use():
            return self.xp.zeros(shape, dtype=dtype)

    def empty(self, shape: tuple[int, ...], dtype: DTypeLike) -> Array:
        with self.use():
            return self.xp.empty(shape, dtype=dtype)

    def asarray(self, host: np.ndarray, dtype: DTypeLike | None = None) -> Array:
        """Copy a host array onto this device (converting its dtype on the device side when asked)."""
        if not self.is_cuda:  # a fresh array: never a view of a memory-mapped file or of another stage's data
            return np.array(host, dtype=dtype or host.dtype, copy=True)
        with self.use():
            out = self.xp.asarray(host)
            if dtype is not None and out.dtype != dtype:
                out = out.astype(dtype)
            return out

    def upload(self, host: np.ndarray) -> Array:
        """A new array on this device holding ``host``: on a GPU queued on the current stream through pinned
        memory (see `upload_into`); on a CPU device a copy."""
        host = np.ascontiguousarray(host)
        if not self.is_cuda:
            return np.array(host, copy=True)
        with self.use():
            out = self.xp.empty(host.shape, host.dtype)
            upload_into(out, host)
            return out

    def to_host(self, arr: Array) -> np.ndarray:
        """A NumPy copy (or view, on a CPU device) of a device array."""
        if self.is_cuda:
            with self.use():
                return np.asarray(arr.get())
        return np.asarray(arr)

    def limit_memory(self, limit: int | None) -> None:
        """Hold at most ``limit`` bytes of device memory in this process's pool (a GPU of the plan's size
        on a bigger card); an allocation past it fails as if the card were full. None or CPU: no limit."""
        if self.is_cuda and limit is not None:
            with self.use():
                cupy_module().get_default_memory_pool().set_limit(size=limit)

    def memory_used(self) -> int | None:
        """Bytes in use on this device by this process's memory pool (None on CPU devices)."""
        if not self.is_cuda:
            return None
        cp = cupy_module()
        with self.use():
            return int(cp.get_default_memory_pool().used_bytes())

    def release_memory(self) -> None:
        """Give the device memory this process's pool holds unused back to the driver, once the work queued
        on the device is done (a no-op on CPU devices), so that another process can take it."""
        if self.is_cuda:
            cp = cupy_module()
            with self.use():
                cp.cuda.Device(self.index).synchronize()
                cp.get_default_memory_pool().free_all_blocks()

    def memory_free(self) -> tuple[int, int] | None:
        """(free, total) bytes of this GPU as its driver counts them, every process's use taken off (None on
        CPU devices)."""
        if not self.is_cuda:
            return None
        with self.use():
            free, total = cupy_module().cuda.runtime.memGetInfo()
        return int(free), int(total)

    def synchronize(self) -> None:
        if self.is_cuda:
            with self.use():
                cupy_module().cuda.get_current_stream().synchronize()

    def wait_idle(self) -> None:
        """Block until everything queued on any stream of this device has run (a no-op on CPU devices);
        raises the error a kernel left on the device, where one did."""
        if self.is_cuda:
            cupy_module().cuda.Device(self.index).synchronize()


def transfer(arr: Array, src: Device, dst: Device) -> Array:
    """Move hidden rows from ``src`` to ``dst``, ordered after the work queued on ``src``'s current stream.

    Between two GPUs this is a peer copy on ``dst``'s current stream; ``src``'s current stream then waits for
    it, so ``arr``'s memory can be reused there as soon as the caller lets go of it. Between CPU devices it is
    a plain copy, so that no stage can alias another's buffers.
    """
    if src == dst:
        return arr
    if src.is_cuda and dst.is_cuda:
        cp = cupy_module()
        with src.use():
            ready = cp.cuda.get_current_stream().record()
        with dst.use():
            stream = cp.cuda.get_current_stream()
            stream.wait_event(ready)
            out = peer_copy(arr, src, dst)
            copied = stream.record()
        with src.use():
            cp.cuda.get_current_stream().wait_event(copied)
        return out
    if dst.is_cuda:
        return dst.upload(np.asarray(arr))
    if src.is_cuda:
        return src.to_host(arr)
    return np.array(arr, copy=True)


def peer_copy(arr: Array, src: Device, dst: Device) -> Array:
    """A copy of GPU array ``arr`` (C-contiguous, on ``src``) made on ``dst``, on ``dst``'s current stream.

    ``dst`` must be the current device. The copy goes straight over the link when peer access is enabled
    (`enable_peer_access`), through the host otherwise. The caller orders it after the writes to ``arr`` and
    keeps ``arr`` alive until it has run.
    """
    cp = cupy_module()
    if not arr.flags.c_contiguous:
        raise ValueError(f"a peer copy needs a C-contiguous array, not one of strides {arr.strides}")
    out = cp.empty(arr.shape, arr.dtype)
    if arr.nbytes:
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyPeerAsync(
            out.data.ptr, dst.index, arr.data.ptr, src.index, arr.nbytes, stream.ptr
        )
    return out


PEER_ACCESS_ALREADY_ENABLED = 704
"""cudaErrorPeerAccessAlreadyEnabled: what enabling a pair that is already enabled answers."""


def enable_peer_access(devices: list[Device]) -> list[str]:
    """Let every pair of GPUs copy directly to each other where the hardware allows it; one line per pair.

    A pair counts as enabled only when asking again answers "already enabled" (`peer_access_enabled`), so
    the lines say what the driver holds, not what was asked for.
    """
    cuda = [d for d in dict.fromkeys(devices) if d.is_cuda]
    if len(cuda) < 2:
        return []
    cp = cupy_module()
    lines = []
    for a in cuda:
        for b in cuda:
            if a.index == b.index:
                continue
            if not cp.cuda.runtime.deviceCanAccessPeer(a.index, b.index):
                lines.append(f"peer access {a} -> {b}: not supported (copies go through the host)")
                continue
            with a.use(), contextlib.suppress(cp.cuda.runtime.CUDARuntimeError):  # already enabled
                cp.cuda.runtime.deviceEnablePeerAccess(b.index)
            state = "enabled" if peer_access_enabled(a, b) else "NOT enabled (copies go through the host)"
            lines.append(f"peer access {a} -> {b}: {state}")
    return lines


def peer_access_enabled(a: Device, b: Device) -> bool:
    """Whether ``a`` can read ``b``'s memory directly now: enabling it again must answer "already enabled".

    (If it was not enabled, this call enables it and answers False; call it again to see it hold.)
    """
    cp = cupy_module()
    with a.use():
        try:
            cp.cuda.runtime.deviceEnablePeerAccess(b.index)
        except cp.cuda.runtime.CUDARuntimeError as exc:
            return getattr(exc, "status", None) == PEER_ACCESS_ALREADY_ENABLED
    return False


_DEVICE_LOCKS: dict[int, threading.Lock] = {}
_DEVICE_LOCKS_GUARD = threading.Lock()


def device_lock(index: int) -> threading.Lock:
    """The lock that keeps GPU ``index``'s CUDA graph captures and pool releases apart: freeing memory
    synchronises the device, which must not happen while another thread captures a graph on it."""
    with _DEVICE_LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(index, threading.Lock())


# ---- pinned staging ----------------------------------------------------------------------------------

_HOLDER: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("strata_holder", default=None)


@contextlib.contextmanager
def holding(keep: list[Any]) -> Iterator[None]:
    """Pinned buffers that copies queue in this block (on this thread) are held in ``keep``, whose owner
    lets go of them only after those copies have run (a window in flight: once it is finished)."""
    token = _HOLDER.set(keep)
    try:
        yield
    finally:
        _HOLDER.reset(token)


class _Watched:
    """Pinned buffers queued outside any `holding` block, each kept until an event after its copy is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: deque[tuple[Any, Any]] = deque()

    def hold(self, event: Any, buffer: Any) -> None:
        with self._lock:
            while self._held and self._held[0][0].done:
                self._held.popleft()
            self._held.append((event, buffer))

    def __len__(self) -> int:
        return len(self._held)


WATCHED = _Watched()


def _hold(buffer: Any) -> None:
    """Keep ``buffer`` until the copy just queued on the current stream has run."""
    keep = _HOLDER.get()
    if keep is not None:
        keep.append(buffer)
    else:
        WATCHED.hold(cupy_module().cuda.get_current_stream().record(), buffer)


def pinned_empty(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """A page-locked host array (CuPy's pinned pool), for copies the host does not wait for."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mem = cupy_module().cuda.alloc_pinned_memory(max(count * dt.itemsize, 1))
    return np.frombuffer(mem, dt, count).reshape(shape)


def upload_into(dst: Array, host: np.ndarray) -> None:
    """Copy ``host`` into GPU array ``dst`` on the current stream through a pinned buffer: the host does not
    wait, and the copy is ordered with the stream's other work on ``dst``."""
    staged = pinned_empty(tuple(dst.shape), dst.dtype)
    staged[...] = host
    dst.set(staged, stream=cupy_module().cuda.get_current_stream())
    _hold(staged)


def download(arr: Array) -> np.ndarray:
    """Queue a copy of GPU array ``arr`` into a new pinned host array on the current stream and return that
    array. It holds the values once the stream has passed this point; the host does not wait here."""
    cp = cupy_module()
    arr = cp.ascontiguousarray(arr)
    out = pinned_empty(tuple(arr.shape), arr.dtype)
    arr.get(stream=cp.cuda.get_current_stream(), out=out, blocking=False)
    _hold(out)
    return out
