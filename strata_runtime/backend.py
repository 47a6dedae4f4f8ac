"""Devices and their array modules: CuPy for ``cuda:N``, NumPy for a virtual ``cpu:N``.

Model code is written once against ``device.xp``. A virtual CPU device runs exactly the same code on
NumPy, which makes it the reference path and keeps CI and laptops working. CuPy is optional: it is imported
only when a ``cuda`` device is asked for, and whichever CuPy wheel is installed (``cupy-cuda12x``,
``cupy-cuda13x``, ...) is accepted.
"""

from __future__ import annotations

import contextlib
import importlib
import re
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

    def synchronize(self) -> None:
        if self.is_cuda:
            with self.use():
                cupy_module().cuda.get_current_stream().synchronize()


def transfer(arr: Array, src: Device, dst: Device) -> Array:
    """Move hidden rows from ``src`` to ``dst``.

    Between two GPUs, CuPy copies device-to-device (a peer copy when the cards allow it, otherwise staged
    by the driver); between CPU devices it is a plain copy so that no stage can alias another's buffers.
    """
    if src == dst:
        return arr
    if src.is_cuda and dst.is_cuda:
        with dst.use():
            return arr.copy()  # CuPy copies an array held on another device onto the current one
    if dst.is_cuda:
        return dst.asarray(np.asarray(arr))
    if src.is_cuda:
        return src.to_host(arr)
    return np.array(arr, copy=True)


def enable_peer_access(devices: list[Device]) -> None:
    """Let every pair of GPUs copy directly to each other where the hardware allows it."""
    cuda = [d for d in devices if d.is_cuda]
    if len(cuda) < 2:
        return
    cp = cupy_module()
    for a in cuda:
        for b in cuda:
            if a.index == b.index or not cp.cuda.runtime.deviceCanAccessPeer(a.index, b.index):
                continue
            with a.use(), contextlib.suppress(cp.cuda.runtime.CUDARuntimeError):  # already enabled
                cp.cuda.runtime.deviceEnablePeerAccess(b.index)
