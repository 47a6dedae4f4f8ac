"""Host memory for the expert tier: pinned and mapped on GPU machines, plain NumPy otherwise.

On a machine with CUDA, the host tier is page-locked memory allocated portable and mapped. Under unified
virtual addressing (every 64-bit CUDA platform) its device address equals its host address, so a kernel on
any GPU can read an expert that holds no VRAM slot straight over the host link, and the copy engines move it
into a slot at the link's full rate (pageable memory reaches a fraction of it). Without a GPU the tier is an
ordinary NumPy array: the virtual CPU devices read it like any other.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np

from ..backend import cupy_module


class PinnedBuffer:
    """One page-locked, mapped host allocation; freed when the last array viewing it is gone."""

    def __init__(self, nbytes: int) -> None:
        cp = cupy_module()
        rt = cp.cuda.runtime
        self.nbytes = nbytes
        self.ptr = int(rt.hostAlloc(max(nbytes, 1), rt.hostAllocPortable | rt.hostAllocMapped))

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            # At interpreter shutdown CuPy may be gone: the process is going away with its memory.
            with contextlib.suppress(Exception):
                cupy_module().cuda.runtime.freeHost(ptr)


def _as_numpy(buf: PinnedBuffer, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    raw = (ctypes.c_byte * buf.nbytes).from_address(buf.ptr)
    arr: np.ndarray = np.frombuffer(memoryview(raw), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
    # Keep the allocation alive as long as any view of it: NumPy holds ``raw``, and ``raw`` holds ``buf``.
    raw._owner = buf  # type: ignore[attr-defined]
    return arr


def host_empty(shape: tuple[int, ...], dtype: Any, pinned: bool) -> np.ndarray:
    """An uninitialised host array: pinned and mapped when ``pinned`` (needs CuPy), else ordinary."""
    if not pinned:
        return np.empty(shape, dtype=dtype)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return _as_numpy(PinnedBuffer(nbytes), shape, dtype)


def device_view(arr: Any, device_id: int) -> Any:
    """A CuPy array on ``device_id`` over the same bytes as ``arr``, no copy: pinned, mapped host memory (a
    NumPy array; every read crosses the host link), or another GPU's array (the helper tier; every read
    crosses the peer link, which must be enabled)."""
    cp = cupy_module()
    ptr = arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr
    mem = cp.cuda.UnownedMemory(ptr, arr.nbytes, arr, device_id)
    return cp.ndarray(arr.shape, arr.dtype, cp.cuda.MemoryPointer(mem, 0), strides=arr.strides)
