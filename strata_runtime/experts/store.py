"""Where one stage's routed experts live: VRAM slots, and host memory behind them.

When every routed expert of a stage fits in VRAM (the plan says so), each layer keeps its experts as the
stacked checkpoint tensors ([E, 2I, H] gate/up and [E, H, I] down) and nothing moves. Otherwise the stage
holds the plan's number of expert slots in VRAM, one pool for all its layers ([C, 2I, H] and [C, H, I]), and
every routed expert in host memory (pinned and mapped into the GPU's address space, so a kernel can read an
expert that holds no slot straight over the host link). `Residency` decides what the slots hold; this class
moves the weights and answers "where is expert e of layer j now" for the array path (an array) and for the
CUDA kernels (device pointer tables, `strata_runtime.cuda.experts`).

Layers are the stage's sparse layers in order (``j`` indexes them, ``layer_ids[j]`` is the model's layer).
Letters: L sparse layers of the stage, E experts, C slots, I expert width, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import Device
from .cache import CacheStats, Policy, Residency, Snapshot, Swap, restore, snapshot
from .host import device_view

Array = Any
"""A NumPy or CuPy array (the device's array module decides)."""


class ExpertStore:
    """One stage's routed experts: stacked per layer (all resident), or a slot pool over host memory."""

    def __init__(
        self,
        device: Device,
        layer_ids: Sequence[int],
        gate_up: Sequence[Array],
        down: Sequence[Array],
        slots: int | None,
        policy: Policy | None = None,
        fixed: frozenset[int] = frozenset(),
    ) -> None:
        """``gate_up[j]`` [E, 2I, H] and ``down[j]`` [E, H, I]: layer j's experts, on the device when
        ``slots`` is None (every expert resident), else in host memory (the host tier). ``slots``: the
        VRAM slots of the cache. ``fixed``: layers whose experts keep their first slots."""
        if len(gate_up) != len(layer_ids) or len(down) != len(layer_ids):
            raise ValueError("one gate_up and one down tensor per sparse layer")
        self.device, self.layer_ids = device, tuple(layer_ids)
        n_layers = len(layer_ids)
        n_exp = int(gate_up[0].shape[0]) if n_layers else 0
        self.n_experts = n_exp
        self.expert_bytes = int(gate_up[0][0].nbytes + down[0][0].nbytes) if n_layers and n_exp else 0
        self.cached = slots is not None and slots < n_layers * n_exp
        capacity = n_layers * n_exp if not self.cached else int(slots or 0)
        self.residency = Residency(n_layers, n_exp, capacity, self.expert_bytes, policy or Policy(), fixed)
        self._window = np.zeros((n_layers, n_exp), np.float64)
        """Assignments per expert counted by the array path in the current window."""
        if not self.cached:
            self.host_gate_up: Sequence[Array] = ()
            self.host_down: Sequence[Array] = ()
            self.layer_gate_up, self.layer_down = list(gate_up), list(down)
            self.pool_gate_up = self.pool_down = None
            return
        self.host_gate_up, self.host_down = list(gate_up), list(down)
        self.layer_gate_up = self.layer_down = []
        gu_shape, dn_shape = tuple(gate_up[0].shape[1:]), tuple(down[0].shape[1:])
        dtype = gate_up[0].dtype
        self.pool_gate_up = device.empty((capacity, *gu_shape), dtype)  # [C, 2I, H]
        self.pool_down = device.empty((capacity, *dn_shape), dtype)  # [C, H, I]
        table = self.residency.slot_of
        for j, e in zip(*np.nonzero(table >= 0), strict=True):
            self._load(int(table[j, e]), int(j), int(e))
        device.synchronize()

    # ---- where an expert is ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.layer_ids)

    @property
    def stats(self) -> CacheStats:
        return self.residency.stats

    @property
    def slots(self) -> int:
        return self.residency.slots

    def resident(self, j: int, e: int) -> bool:
        return not self.cached or self.residency.resident(j, e)

    def weights(self, j: int, e: int) -> tuple[Array, Array]:
        """Expert ``e`` of sparse layer ``j``: gate/up [2I, H] and down [H, I], wherever they are now (a
        host-tier expert on a GPU comes as a device view of its mapped host memory)."""
        if not self.cached:
            return self.layer_gate_up[j][e], self.layer_down[j][e]
        slot = int(self.residency.slot_of[j, e])
        if slot >= 0:
            assert self.pool_gate_up is not None and self.pool_down is not None
            return self.pool_gate_up[slot], self.pool_down[slot]
        gate_up, down = self.host_weights(j, e)
        if self.device.is_cuda:
            return device_view(gate_up, self.device.index), device_view(down, self.device.index)
        return gate_up, down

    def host_weights(self, j: int, e: int) -> tuple[Array, Array]:
        """The host tier's copy (host arrays; pinned and mapped on a GPU machine)."""
        return self.host_gate_up[j][e], self.host_down[j][e]

    # ---- the array path's window ---------------------------------------------------------------------

    def count(self, j: int, experts: np.ndarray, assignments: np.ndarray) -> None:
        """Record a layer's routing in the current window (the array path reads `weights` meanwhile)."""
        self._window[j, experts] += assignments

    def end_window(self) -> list[Swap]:
        """Close the array path's window: account its routing and keep the cache in step."""
        counts, self._window = self._window, np.zeros_like(self._window)
        if not counts.any():
            return []
        return self.observe(counts)

    # ---- after a window ----------------------------------------------------------------------------

    def decide(self, counts: np.ndarray, windows: int = 1, misses: int | None = None) -> list[Swap]:
        """Account a window's routing counts [L, E]; when a rebalance is due, decide it (the slot table
        changes now; the caller moves the weights). Returns the swaps decided."""
        self.residency.observe(counts, windows, misses)
        return self.residency.rebalance() if self.residency.due() else []

    def observe(self, counts: np.ndarray, windows: int = 1, misses: int | None = None) -> list[Swap]:
        """`decide`, then load the new experts into their slots at once (the array path's upkeep)."""
        swaps = self.decide(counts, windows, misses)
        for s in swaps:
            self._load(s.slot, *s.loaded)
        return swaps

    def snapshot(self) -> Snapshot:
        """What the cache holds and has learned now (`restore` brings it back)."""
        return snapshot(self.residency)

    def restore(self, snap: Snapshot) -> list[Swap]:
        """Hold and know again what ``snap`` did: the slot table changes now; on the array path the weights
        move at once, on a GPU the caller moves them (`strata_runtime.cuda.experts.CudaExperts.restore`)."""
        swaps = restore(self.residency, snap)
        self._window[...] = 0
        if not self.device.is_cuda:
            for s in swaps:
                self._load(s.slot, *s.loaded)
        return swaps

    def _load(self, slot: int, j: int, e: int) -> None:
        """Copy expert ``e`` of layer ``j`` from the host tier into ``slot``."""
        assert self.pool_gate_up is not None and self.pool_down is not None
        gu, dn = self.host_gate_up[j][e], self.host_down[j][e]
        with self.device.use():
            self.pool_gate_up[slot] = self.device.xp.asarray(gu)
            self.pool_down[slot] = self.device.xp.asarray(dn)

    @property
    def host_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.host_gate_up, *self.host_down))

    @property
    def vram_bytes(self) -> int:
        if self.cached:
            assert self.pool_gate_up is not None and self.pool_down is not None
            return int(self.pool_gate_up.nbytes + self.pool_down.nbytes)
        return sum(int(a.nbytes) for a in (*self.layer_gate_up, *self.layer_down))

    def describe(self) -> dict[str, Any]:
        """Occupancy and traffic, for the engine's stats."""
        return {
            "device": str(self.device),
            "layers": list(self.layer_ids),
            "experts": len(self.layer_ids) * self.n_experts,
            "slots": self.slots,
            "cached": self.cached,
            "expert_bytes": self.expert_bytes,
            "host_bytes": self.host_bytes,
            **self.stats.as_dict(),
        }
