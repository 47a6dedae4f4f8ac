"""Host memory for the expert tier: pinned and mapped on GPU machines, plain NumPy otherwise.

On a machine with CUDA, the host tier is page-locked memory allocated portable and mapped. Under unified
virtual addressing (every 64-bit CUDA platform) its device address equals its host address, so a kernel on
any GPU can read an expert that holds no VRAM slot straight over the host link, and the copy engines move it
into a slot at the link's full rate (pageable memory reaches a fraction of it). Without a GPU the tier is an
ordinary NumPy array: the virtual CPU devices read it like any other.

On a machine of several NUMA nodes, the pinned pages of a GPU's host tier are placed on the node the GPU
hangs off (`near`): the expert kernels read a missing expert straight from them, many small reads in flight,
and a read that must first cross to the other socket's memory takes longer, so fewer bytes arrive per
microsecond than the copy engines, with their deeper queues, move from the same pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from pathlib import Path
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


def host_empty(shape: tuple[int, ...], dtype: Any, pinned: bool, near: int | None = None) -> np.ndarray:
    """An uninitialised host array: pinned and mapped when ``pinned`` (needs CuPy), else ordinary. ``near``:
    the GPU that reads it most, whose NUMA node the pinned pages are placed on (`gpu_cpus`)."""
    if not pinned:
        return np.empty(shape, dtype=dtype)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    with on_cpus(gpu_cpus(near) if near is not None else frozenset()):
        buf = PinnedBuffer(nbytes)  # the driver places the pages as it locks them, from the CPU it runs on
    return _as_numpy(buf, shape, dtype)


SYSFS = Path("/sys")


def cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux cpulist ("0-15,32-47")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


@functools.cache
def gpu_cpus(device_id: int) -> frozenset[int]:
    """The CPUs of the NUMA node GPU ``device_id`` hangs off, from Linux's sysfs; empty where the machine
    has one node, or the node is not known (another system, a virtual machine that hides it)."""
    try:
        bus = cupy_module().cuda.Device(device_id).pci_bus_id
    except (AttributeError, RuntimeError):  # a CuPy or a driver that cannot say: placed as before
        return frozenset()
    return node_cpus(bus)


def node_cpus(bus_id: str, sysfs: Path = SYSFS) -> frozenset[int]:
    """The CPUs of the NUMA node of PCI device ``bus_id`` ("0000:1B:00.0"); empty where the machine has one
    node or the device's is not known."""
    if len(list(sysfs.glob("devices/system/node/node[0-9]*"))) < 2:
        return frozenset()
    try:
        node = int((sysfs / "bus/pci/devices" / bus_id.lower() / "numa_node").read_text())
        return (
            cpu_list((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
            if node >= 0
            else frozenset()
        )
    except (OSError, ValueError):
        return frozenset()


@contextlib.contextmanager
def on_cpus(cpus: frozenset[int]) -> Iterator[None]:
    """Run the block with the calling thread on those of ``cpus`` it may use, so that the memory it
    allocates and touches is placed on their NUMA node; where it may use none of them (or none are given,
    or the system sets no affinity), where it was."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    allowed = cpus & before
    if not allowed or allowed == before:
        yield
        return
    os.sched_setaffinity(0, allowed)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def device_view(arr: Any, device_id: int) -> Any:
    """A CuPy array on ``device_id`` over the same bytes as ``arr``, no copy: pinned, mapped host memory (a
    NumPy array; every read crosses the host link), or another GPU's array (the helper tier; every read
    crosses the peer link, which must be enabled)."""
    cp = cupy_module()
    ptr = arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr
    mem = cp.cuda.UnownedMemory(ptr, arr.nbytes, arr, device_id)
    return cp.ndarray(arr.shape, arr.dtype, cp.cuda.MemoryPointer(mem, 0), strides=arr.strides)
