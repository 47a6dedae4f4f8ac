"""Step 7, the host-memory budget: the host tier of experts and the prefix store against the machine's RAM.

When a stage GPU cannot hold every routed expert of its layers, the runtime keeps every one of them in
pinned host memory and the VRAM cache holds copies of some, so that GPU's host tier is all its routed
experts' bytes; a GPU that holds them all needs none, and helper and idle GPUs add nothing. The tiers, the
prefix store (``memory.prefix_store_mib``, at most that much) and ``memory.host_reserve_mib`` must fit in
the host memory the engine may pin (``machine.host_ram_mib``, or probed); when that is unknown nothing is
checked, and the plan says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..schema.facts import ModelFacts
from ..schema.plan import MIB, GpuPlan, HostPlan, HostTier
from .ledger import Ledger


def host_tier(gpu: GpuPlan, expert_bytes: int) -> HostTier:
    """The experts one GPU keeps in pinned host memory: all of its stages' routed experts, or none."""
    streams = gpu.role == "stage" and gpu.experts_resident < gpu.experts_total
    experts = gpu.experts_total if streams else 0
    return HostTier(gpu=gpu.index, experts=experts, bytes=experts * expert_bytes)


def host_budget(model: ModelFacts, gpus: Sequence[GpuPlan], led: Ledger) -> HostPlan:
    """The host plan; the refusal ``host.ram-overflow`` goes in the ledger when the tiers do not fit."""
    tiers = tuple(host_tier(g, model.expert_bytes()) for g in gpus)
    experts = sum(t.bytes for t in tiers)
    store = led["memory.prefix_store_mib"] * MIB
    total = experts + store
    reserve = led["memory.host_reserve_mib"] * MIB
    ram_mib = led.get("machine.host_ram_mib", "host.ram-overflow")
    if ram_mib is None:
        return HostPlan(tiers=tiers, prefix_store=store, total=total, reserve=reserve, ram=None, free=None)
    ram = ram_mib * MIB
    probed = not led.user_set("machine.host_ram_mib")
    if total and total + reserve > ram:
        parts = []
        if experts:
            per_gpu = ", ".join(f"GPU {t.gpu} {t.bytes / MIB:.1f}" for t in tiers if t.bytes)
            parts.append(
                f"the experts that do not fit in VRAM need {experts / MIB:.1f} MiB of pinned host memory "
                f"({per_gpu})"
            )
        if store:
            parts.append(f"the prefix store may pin memory.prefix_store_mib = {store // MIB} MiB")
        have = (
            f"the host has {ram_mib} MiB available (probed from /proc/meminfo)"
            if probed
            else f"machine.host_ram_mib is {ram_mib} MiB"
        )
        fixes = ["add host memory", "lower memory.host_reserve_mib"]
        if store:
            fixes.append("lower memory.prefix_store_mib")
        if experts:
            fixes.append("keep every expert in VRAM (more GPUs, or a shorter memory.context)")
        led.refuse(
            "host.ram-overflow",
            "machine.probe" if probed else "machine.host_ram_mib",
            f"{' and '.join(parts)}, plus memory.host_reserve_mib = {reserve // MIB} MiB, "
            f"{(total + reserve) / MIB:.1f} MiB in all, but {have}; {', '.join(fixes[:-1])}, or {fixes[-1]}",
        )
    return HostPlan(
        tiers=tiers,
        prefix_store=store,
        total=total,
        reserve=reserve,
        ram=ram,
        ram_source="probe" if probed else "profile",
        free=max(ram - total - reserve, 0),
    )
