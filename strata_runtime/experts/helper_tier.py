"""The second tier of an expert cache: expert slots on other devices (helper GPUs or the peer device).

A stage whose experts overflow its VRAM gets, from the plan, a share of each helper GPU's experts (or of
the peer device's). Here those shares are pools of slots on their devices, [n, 2I, H] gate/up and [n, H, I]
down, numbered 0..S-1 across the devices in the plan's order. A stage's kernels read them where they are,
over the peer link (peer access is checked at start); on virtual CPU devices they are NumPy arrays
"on" the helper ``cpu:N``. Which expert a slot holds is `Residency`'s business; this class only holds the
arrays and copies into them.

Letters: S helper slots (of all the stage's helper devices), I expert width, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import Device

Array = Any
"""A NumPy or CuPy array (the device's array module decides)."""


class HelperOutOfMemory(MemoryError):
    """A helper device has no room for the slots the plan gives it."""

    def __init__(self, device: Device, slots: int, nbytes: int, exc: BaseException) -> None:
        super().__init__(f"{slots} expert slots ({nbytes / (1 << 20):.1f} MiB) on {device}: {exc}")
        self.device = device


class HelperTier:
    """Expert slots on helper devices, as one run of slot numbers."""

    def __init__(
        self,
        parts: Sequence[tuple[Device, int]],
        gate_up_shape: tuple[int, ...],
        down_shape: tuple[int, ...],
        dtype: Any,
    ) -> None:
        """``parts``: (device, slots) for each helper device, in the plan's order (devices with 0 are
        left out); ``gate_up_shape`` [2I, H] and ``down_shape`` [H, I]: one expert's."""
        self.pools: list[tuple[Device, Array, Array]] = []
        for device, n in parts:
            if n <= 0:
                continue
            nbytes = n * int(np.prod(gate_up_shape) + np.prod(down_shape)) * np.dtype(dtype).itemsize
            try:
                gate_up = device.empty((n, *gate_up_shape), dtype)  # [n, 2I, H]
                down = device.empty((n, *down_shape), dtype)  # [n, H, I]
            except MemoryError as exc:  # CuPy's OutOfMemoryError is one
                raise HelperOutOfMemory(device, n, nbytes, exc) from exc
            self.pools.append((device, gate_up, down))
        self._where = [(i, k) for i, (_, gu, _) in enumerate(self.pools) for k in range(len(gu))]
        """Slot number -> (pool, index in the pool)."""

    def __len__(self) -> int:
        return len(self._where)

    @property
    def devices(self) -> list[Device]:
        return [device for device, _, _ in self.pools]

    def sizes(self) -> list[tuple[Device, int]]:
        """(device, slots) of each pool."""
        return [(device, len(gu)) for device, gu, _ in self.pools]

    def device_of(self, slot: int) -> Device:
        return self.pools[self._where[slot][0]][0]

    def slot(self, slot: int) -> tuple[Array, Array]:
        """The arrays of helper slot ``slot`` on its own device: gate/up [2I, H] and down [H, I]."""
        i, k = self._where[slot]
        _, gate_up, down = self.pools[i]
        return gate_up[k], down[k]

    def load(self, slot: int, gate_up: np.ndarray, down: np.ndarray) -> None:
        """Copy an expert's host weights into ``slot`` now (at start, and in the array path's upkeep)."""
        device = self.device_of(slot)
        with device.use():
            for dst, src in zip(self.slot(slot), (gate_up, down), strict=True):
                if device.is_cuda:
                    dst.set(src)  # straight from host memory: no temporary beyond the plan's budget
                else:
                    dst[...] = src

    @property
    def nbytes(self) -> int:
        return sum(int(gu.nbytes + dn.nbytes) for _, gu, dn in self.pools)
