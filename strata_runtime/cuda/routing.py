"""Calibrated routing on a device: the launcher of ``routing.cu``, and one device's copy of the slots' tables.

`route_bias` biases router logits at each row's intended experts. It has the arguments of its NumPy twin,
`strata_runtime.reference.routing.route_bias`, on CuPy arrays of one device; it allocates nothing and reads
nothing back, so it can be captured in a CUDA graph (the rows' positions and slots are device arrays the
graph reads at replay). It is compiled without fast math: its comparisons and its one add must round as
NumPy's do, so that both choose the same experts bit for bit.

`DeviceRouting` holds every slot's request tables (`strata_runtime.experts.routing.RoutingTables`) on one
device, refreshes a slot's copy when the engine admits a request there, and gives each MoE layer its
`RowBias`, the step the decode graphs and the prefill path run before the top-k. On a virtual CPU device it
holds NumPy copies and runs the twin, so the CPU tests run the layer steps with routing on the references.

CuPy is imported only when a kernel is built or tables are copied to a GPU, so this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

from ..backend import Array, Device, cupy_module
from ..experts.routing import RoutingTables
from ..reference import routing as twin
from .compile import KernelCache, source

_SOURCE = source("routing.cu")
EXACT_OPTIONS = ("-std=c++17",)
"""No fast math: with it, comparisons flush subnormal CDF entries to zero and could pick another expert."""
KERNEL = "route_bias"
WARP = 32

RowBias = Callable[[Array, Array, Array], None]
"""One MoE layer's bias step: (router logits [R, E] fp32, positions [R] int32, slots [R] int32) -> None,
adding B at each row's intended experts in place."""


@cache
def routing_kernels_for(device_id: int) -> KernelCache:
    """The compiled ``route_bias`` of CUDA device ``device_id`` (prepare it before capturing a graph)."""
    with cupy_module().cuda.Device(device_id):
        return KernelCache(_SOURCE, EXACT_OPTIONS)


def route_bias(
    logits: Array,
    pos: Array,
    slot: Array,
    cdf: Array,
    seeds: Array,
    layer: int,
    p_stay: float,
    top_k: int,
    bias: float,
    lookback: int,
) -> None:
    """logits [R, E] fp32 += B at each row's intended experts, in place (the contract of the twin).

    pos, slot: [R] int32, the rows' positions and slots; cdf: [S, L, E] fp32 and seeds: [S] uint64, every
    slot's request tables; ``layer`` is the model layer (an index into L). All on one GPU."""
    rows, n_exp = twin.check_args(logits, pos, slot, cdf, seeds, layer, top_k)
    if rows == 0:
        return
    device = logits.device.id
    for name, a in (("pos", pos), ("slot", slot), ("cdf", cdf), ("seeds", seeds)):
        if a.device.id != device:
            raise ValueError(f"route_bias: {name} is on device {a.device.id}, logits on device {device}")
    with cupy_module().cuda.Device(device):
        routing_kernels_for(device).fn(KERNEL)(
            (rows,),
            (WARP,),
            (
                logits,
                pos,
                slot,
                cdf,
                seeds,
                np.int32(n_exp),
                np.int32(cdf.shape[1]),
                np.int32(layer),
                np.float32(p_stay),
                np.int32(top_k),
                np.float32(bias),
                np.int32(lookback),
            ),
        )


class DeviceRouting:
    """Every slot's request tables on one device (cdf [S, L, E] fp32, seeds [S] uint64), from host tables:
    the kernel reads them on a GPU, the twin on a virtual CPU device."""

    def __init__(self, tables: RoutingTables, device: Device) -> None:
        self.tables, self.device = tables, device
        self.cdf = device.asarray(tables.cdf)  # [S, L, E]
        self.seeds = device.asarray(tables.seeds)  # [S]
        self._launch = route_bias if device.is_cuda else twin.route_bias
        if device.is_cuda:
            with device.use():  # compiled now, never inside a capture, and loaded in this device's context
                routing_kernels_for(device.index).prepare([KERNEL])

    def rows(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of ``slot``'s host tables as they are now (after `RoutingTables.admit`), for `put`."""
        return self.tables.cdf[slot].copy(), self.tables.seeds[slot : slot + 1].copy()

    def put(self, slot: int, rows: tuple[np.ndarray, np.ndarray]) -> None:
        """Queue the copy of ``rows`` (`rows`) into ``slot``'s tables on the current stream: windows queued
        after it on that stream read them. Never inside a capture."""
        cdf, seeds = rows
        with self.device.use():
            self.cdf[slot] = self.device.asarray(cdf)
            self.seeds[slot : slot + 1] = self.device.asarray(seeds)

    def load(self, slot: int) -> None:
        """Copy ``slot``'s tables from the host tables (after `RoutingTables.admit`) and wait for the copy,
        so a graph replayed on any stream afterwards reads the new tables; never call it inside a capture.
        An engine queues `put` on each stage's stream instead (`Executor.admit`)."""
        self.put(slot, self.rows(slot))
        self.device.synchronize()

    def apply(self, logits: Array, layer: int, pos: Array, slot: Array) -> None:
        """Bias router logits [R, E] (fp32, on this device) of rows at pos/slot [R] (int32) at model layer
        ``layer``; capturable."""
        self._launch(logits, pos, slot, self.cdf, self.seeds, layer, *self.tables.model.layer_args(layer))

    def layer(self, layer: int) -> RowBias:
        """The bias step of model layer ``layer``."""

        def bias(logits: Array, pos: Array, slot: Array) -> None:
            self.apply(logits, layer, pos, slot)

        return bias
