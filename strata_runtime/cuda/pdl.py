"""Programmatic dependent launch: a kernel that may start while the kernel before it is finishing.

A decode step is hundreds of small dependent kernels; between two of them the GPU drains one grid before it
starts the next, so each boundary leaves the memory system idle for a few microseconds. Launched with the
driver's programmatic-stream-serialization attribute (Hopper and later), a kernel starts as soon as every
block of the kernel before it has started, issues its weight loads, and waits (``griddepcontrol.wait`` in
kernels.cu) for that kernel to complete before it reads what it wrote. Inside a CUDA graph the capture keeps
the same programmatic edges.

CuPy launches without launch attributes, so `PdlKernel` calls ``cuLaunchKernelEx`` from the driver library
itself, with the same (grid, block, args) a CuPy kernel takes. `available` says whether this process can
(a driver of CUDA 12.3 or later that exports it, a device of compute capability 9.0 or later, and
``STRATA_PDL`` not ``0``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np

from ..backend import cupy_module

PROGRAMMATIC_STREAM_SERIALIZATION = 6
"""CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION in cuda.h."""
MIN_DRIVER = 12030
"""The oldest driver (CUDA 12.3) whose graph capture keeps programmatic launches."""


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_SCALARS: dict[np.dtype[Any], type[ctypes._SimpleCData[Any]]] = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
}


@functools.cache
def _driver() -> Any:
    """The driver library's cuLaunchKernelEx, or None where it is not exported."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    params = ctypes.POINTER(ctypes.c_void_p)
    launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, params, ctypes.c_void_p]
    return launch


@functools.cache
def available(device_id: int) -> bool:
    """Whether kernels on GPU ``device_id`` launch with PDL: the driver (CUDA 12.3 or later) exports
    cuLaunchKernelEx, the device is compute capability 9.0 or later, and the environment does not set
    ``STRATA_PDL=0``."""
    if os.environ.get("STRATA_PDL", "1") == "0" or _driver() is None:
        return False
    cp = cupy_module()
    if int(cp.cuda.runtime.driverGetVersion()) < MIN_DRIVER:
        return False
    major = cp.cuda.runtime.getDeviceProperties(device_id)["major"]
    return int(major) >= 9


def _arg(value: Any) -> ctypes._SimpleCData[Any]:
    """One kernel argument as the C value the kernel takes: a device pointer or a fixed-size scalar."""
    data = getattr(value, "data", None)
    if data is not None and hasattr(data, "ptr"):  # a CuPy array
        return ctypes.c_void_p(int(data.ptr))
    if isinstance(value, np.generic) and value.dtype in _SCALARS:
        return _SCALARS[value.dtype](value.item())
    raise TypeError(f"a PDL kernel argument must be a CuPy array or a sized NumPy scalar, not {type(value)}")


class PdlKernel:
    """A compiled kernel launched with the programmatic-stream-serialization attribute on the current stream;
    called as a CuPy kernel is: ``kernel(grid, block, args, shared_mem=bytes)``."""

    def __init__(self, kernel: Any) -> None:
        function = getattr(kernel, "kernel", kernel)  # a CuPy RawKernel holds its driver function
        self._ptr = ctypes.c_void_p(int(function.ptr))
        self._attr = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value[0] = 1

    def __call__(
        self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], shared_mem: int = 0
    ) -> None:
        g, b = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
        stream = cupy_module().cuda.get_current_stream().ptr
        config = _Config(*g, *b, shared_mem, ctypes.c_void_p(stream), ctypes.pointer(self._attr), 1)
        values = [_arg(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        status = _driver()(ctypes.byref(config), self._ptr, params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
