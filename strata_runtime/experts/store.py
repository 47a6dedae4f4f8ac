"""Where one stage's routed experts live: VRAM slots, helper slots on another device, and host memory.

When every routed expert of a stage fits in VRAM (the plan says so), each layer keeps its experts as the
stacked checkpoint tensors ([E, 2I, H] gate/up and [E, H, I] down) and nothing moves. Otherwise the stage
holds the plan's number of expert slots in VRAM, one pool for all its layers ([C, 2I, H] and [C, H, I]), and
every routed expert in host memory (pinned and mapped into the GPU's address space, so a kernel can read an
expert that holds no slot straight over the host link). With helper GPUs (or a peer device) in the plan, it
also holds its share of their slots (`HelperTier`), read over the peer link. `Residency` decides what the
slots hold; this class moves the weights and answers "where is expert e of layer j now" for the array path
(an array) and for the CUDA kernels (device pointer tables, `strata_runtime.cuda.experts`).

Layers are the stage's sparse layers in order (``j`` indexes them, ``layer_ids[j]`` is the model's layer).
Letters: L sparse layers of the stage, E experts, C slots, I expert width, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import Device
from .cache import HELPER, HOST, VRAM, CacheStats, Policy, Reads, Residency, Snapshot, Swap, restore, snapshot
from .helper_tier import HelperTier
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
        helpers: Sequence[tuple[Device, int]] = (),
        whole: bool | None = None,
    ) -> None:
        """``gate_up[j]`` [E, 2I, H] and ``down[j]`` [E, H, I]: layer j's experts, on the device when
        ``slots`` is None (every expert resident), else in host memory (the host tier). ``slots``: the
        VRAM slots of the cache. ``fixed``: layers whose experts keep their first slots; ``whole``: whether
        those hold every expert in VRAM (`Residency.whole`; None: by `mtp_experts_whole`). ``helpers``:
        (device, slots) of the helper tier on each helper device (only under a cache; at most the experts
        VRAM cannot hold, the last devices' shares cut first)."""
        if len(gate_up) != len(layer_ids) or len(down) != len(layer_ids):
            raise ValueError("one gate_up and one down tensor per sparse layer")
        self.device, self.layer_ids = device, tuple(layer_ids)
        n_layers = len(layer_ids)
        n_exp = int(gate_up[0].shape[0]) if n_layers else 0
        self.n_experts = n_exp
        self.expert_bytes = int(gate_up[0][0].nbytes + down[0][0].nbytes) if n_layers and n_exp else 0
        self.cached = slots is not None and slots < n_layers * n_exp
        capacity = n_layers * n_exp if not self.cached else int(slots or 0)
        parts = _cut(helpers, n_layers * n_exp - capacity) if self.cached else []
        self._window = np.zeros((n_layers, n_exp), np.float64)
        """Assignments per expert counted by the array path in the current window."""
        self._reads = np.zeros(2, np.int64)
        """Of those, the helper tier's and host memory's (counted as they are read, under
        `Policy.keep_misses`, whose admissions change the tiers within the window)."""
        self._prompt = False
        """Whether the array path's current window holds a prompt chunk (`begin_window`)."""
        if not self.cached:
            self.residency = Residency(
                n_layers, n_exp, capacity, self.expert_bytes, policy or Policy(), fixed
            )
            self.host_gate_up: Sequence[Array] = ()
            self.host_down: Sequence[Array] = ()
            self.layer_gate_up, self.layer_down = list(gate_up), list(down)
            self.pool_gate_up = self.pool_down = None
            self.helper = HelperTier((), (), (), np.float32)
            return
        self.host_gate_up, self.host_down = list(gate_up), list(down)
        self.layer_gate_up = self.layer_down = []
        gu_shape, dn_shape = tuple(gate_up[0].shape[1:]), tuple(down[0].shape[1:])
        dtype = gate_up[0].dtype
        self.helper = HelperTier(parts, gu_shape, dn_shape, dtype)
        self.residency = Residency(
            n_layers, n_exp, capacity, self.expert_bytes, policy or Policy(), fixed, len(self.helper), whole
        )
        self.pool_gate_up = device.empty((capacity, *gu_shape), dtype)  # [C, 2I, H]
        self.pool_down = device.empty((capacity, *dn_shape), dtype)  # [C, H, I]
        table, helper = self.residency.slot_of, self.residency.helper_of
        for j, e in zip(*np.nonzero(table >= 0), strict=True):
            self._load(Swap(int(table[j, e]), None, (int(j), int(e))))
        for j, e in zip(*np.nonzero(helper >= 0), strict=True):
            self._load(Swap(int(helper[j, e]), None, (int(j), int(e)), HELPER))
        for d in (device, *self.helper.devices):
            d.synchronize()

    # ---- where an expert is ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.layer_ids)

    @property
    def stats(self) -> CacheStats:
        return self.residency.stats

    @property
    def slots(self) -> int:
        return self.residency.slots

    @property
    def helper_slots(self) -> int:
        return self.residency.helper_slots

    def resident(self, j: int, e: int) -> bool:
        """Whether the expert is in VRAM (always, without a cache)."""
        return not self.cached or self.residency.resident(j, e)

    def tier(self, j: int, e: int) -> int:
        """VRAM, HELPER or HOST: where expert ``e`` of layer ``j`` is read from now."""
        return self.residency.tier(j, e) if self.cached else VRAM

    def weights(self, j: int, e: int) -> tuple[Array, Array]:
        """Expert ``e`` of sparse layer ``j``: gate/up [2I, H] and down [H, I], wherever they are now (on a
        GPU, a helper-tier or host-tier expert comes as a view for this GPU of its peer or mapped host
        memory)."""
        if not self.cached:
            return self.layer_gate_up[j][e], self.layer_down[j][e]
        tier = self.residency.tier(j, e)
        gate_up, down = self.host_weights(j, e) if tier == HOST else self.slot_weights(j, e)
        if tier != VRAM and self.device.is_cuda:
            return device_view(gate_up, self.device.index), device_view(down, self.device.index)
        return gate_up, down

    def slot_weights(self, j: int, e: int) -> tuple[Array, Array]:
        """The slot holding a VRAM- or helper-tier expert, on its own device (cuBLAS reads a helper slot
        where it is, over the peer link)."""
        slot = int(self.residency.slot_of[j, e])
        if slot >= 0:
            assert self.pool_gate_up is not None and self.pool_down is not None
            return self.pool_gate_up[slot], self.pool_down[slot]
        helper = int(self.residency.helper_of[j, e])
        if helper < 0:
            raise KeyError(f"expert {e} of layer {j} holds no slot")
        return self.helper.slot(helper)

    def host_weights(self, j: int, e: int) -> tuple[Array, Array]:
        """The host tier's copy (host arrays; pinned and mapped on a GPU machine)."""
        return self.host_gate_up[j][e], self.host_down[j][e]

    # ---- the array path's window ---------------------------------------------------------------------

    def begin_window(self, prompt: bool = False) -> None:
        """Open one of the array path's windows; ``prompt``: it holds a prompt chunk, whose misses are not
        kept (as on a GPU, where prompt chunks go through the prefill path, which keeps nothing)."""
        self._prompt = prompt

    def count(self, j: int, experts: np.ndarray, assignments: np.ndarray) -> None:
        """Record layer ``j``'s routing in the current window, once the array path has read the experts'
        `weights` (``experts`` [n] distinct ids, ``assignments`` [n] rows each). Under a cache that keeps
        its misses (`Policy.keep_misses`) the experts a window that holds no prompt chunk read from host
        memory then take their queued slots (`Residency.admit`), loaded from the host copies just read."""
        experts, assignments = np.asarray(experts), np.asarray(assignments)
        self._window[j, experts] += assignments
        if not self.cached or not self.residency.policy.keep_misses:
            return
        tiers = self.residency.tiers(j)[experts]  # a layer's, not the whole table, in every layer's count
        self._reads += Reads(int(assignments[tiers == HELPER].sum()), int(assignments[tiers == HOST].sum()))
        if self._prompt:
            return
        for s in self.residency.admit(j, experts):
            self._load(s)

    def end_window(self, prompt: bool = False) -> list[Swap]:
        """Close the array path's window: account its routing and keep the cache in step (``prompt``: the
        window holds a prompt chunk, as `Residency.observe`)."""
        counts, self._window = self._window, np.zeros_like(self._window)
        reads, self._reads = self._reads, np.zeros(2, np.int64)
        if not counts.any():
            return []
        kept = self.cached and self.residency.policy.keep_misses
        return self.observe(counts, reads=Reads(*map(int, reads)) if kept else None, prompt=prompt)

    # ---- after a window ----------------------------------------------------------------------------

    def decide(
        self, counts: np.ndarray, windows: int = 1, reads: Reads | None = None, prompt: bool = False
    ) -> list[Swap]:
        """Account a window's routing counts [L, E]; when a rebalance is due, decide it (the slot tables
        change now; the caller moves the weights). ``reads`` and ``prompt``: as `Residency.observe`. Returns
        the swaps decided."""
        self.residency.observe(counts, windows, reads, prompt)
        return self.residency.rebalance() if self.residency.due() else []

    def observe(
        self, counts: np.ndarray, windows: int = 1, reads: Reads | None = None, prompt: bool = False
    ) -> list[Swap]:
        """`decide`, then load the new experts into their slots at once, in the order decided (the array
        path's upkeep)."""
        swaps = self.decide(counts, windows, reads, prompt)
        for s in swaps:
            self._load(s)
        return swaps

    def scores(self) -> np.ndarray | None:
        """A copy of the cache's scores [L, E] (what it has learned of the routing), for `recall`; None where
        there is nothing to learn (every expert resident, or ``experts.adapt = false``)."""
        r = self.residency
        return None if r.complete or not r.policy.adapt else r.scores.copy()

    def recall(self, scores: np.ndarray, load: bool = True) -> list[Swap]:
        """`Residency.recall` ``scores`` (from `scores`), then the rebalance it makes due: the slot tables
        change now, and with ``load`` the weights move at once (the array path's upkeep; on a GPU
        `strata_runtime.cuda.experts.CudaExperts.recall` moves them on the stage's stream)."""
        r = self.residency
        r.recall(scores)
        swaps = r.rebalance() if r.due() else []
        if load:
            for s in swaps:
                self._load(s)
        return swaps

    def snapshot(self) -> Snapshot:
        """What the cache holds and has learned now (`restore` brings it back)."""
        return snapshot(self.residency)

    def restore(self, snap: Snapshot) -> list[Swap]:
        """Hold and know again what ``snap`` did (the VRAM tier; a helper tier keeps what it holds): the
        slot table changes now; on the array path the weights move at once, on a GPU the caller moves them
        (`strata_runtime.cuda.experts.CudaExperts.restore`)."""
        swaps = restore(self.residency, snap)
        self._window[...] = 0
        if not self.device.is_cuda:
            for s in swaps:
                self._load(s)
        return swaps

    def _load(self, swap: Swap) -> None:
        """Copy the swap's expert into its slot: from the helper slot it leaves (on CPU devices; a GPU's
        array path copies between GPUs through the host copy, the same bytes), else from the host tier; then
        an exchange's evicted expert into that helper slot, from its host copy."""
        gu, dn = self.host_weights(*swap.loaded)
        if swap.tier == HELPER:
            self.helper.load(swap.slot, gu, dn)
            return
        if swap.source >= 0 and not self.device.is_cuda:
            gu, dn = self.helper.slot(swap.source)
        assert self.pool_gate_up is not None and self.pool_down is not None
        with self.device.use():
            self.pool_gate_up[swap.slot] = self.device.xp.asarray(gu)
            self.pool_down[swap.slot] = self.device.xp.asarray(dn)
        if swap.source >= 0:
            assert swap.evicted is not None
            self.helper.load(swap.source, *self.host_weights(*swap.evicted))

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
            "helper_slots": self.helper_slots,
            "helper_devices": {str(d): n for d, n in self.helper.sizes()},
            **self.stats.as_dict(),
        }


def _cut(parts: Sequence[tuple[Device, int]], most: int) -> list[tuple[Device, int]]:
    """``parts`` (device, slots) with at most ``most`` slots in all, the last ones cut first."""
    out = []
    for device, n in parts:
        n = max(0, min(n, most))
        most -= n
        out.append((device, n))
    return out
