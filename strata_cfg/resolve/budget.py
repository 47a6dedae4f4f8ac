"""Step 7, the VRAM budget: every GPU's bytes by purpose, adding up exactly to its total.

On a stage GPU: weights, KV, drafters (last stage only), workspace and reserve come first; the routed experts
take what remains (all of them if they fit, else as many as fit, as an expert cache), and the rest is free.
Helper and peer GPUs hold the experts the stages could not, after their reserve. Idle GPUs are all free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ..schema.facts import GpuFacts, MachineFacts, ModelFacts, mtp_experts_whole
from ..schema.plan import KEEP_SCORE_DECAY, Budget, GpuPlan
from . import sizes
from .ledger import Ledger
from .placement import Sizing, StageNeed, stage_need
from .sizes import StageShape

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class PlacedStage:
    shape: StageShape
    gpu: int


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _breakdown(need: StageNeed, reserve: int) -> str:
    return (
        f"weights {_mib(need.weights)} + kv {_mib(need.kv)} + drafters {_mib(need.drafters)} + "
        f"workspace {_mib(need.workspace)} + reserve {_mib(reserve)} MiB"
    )


def _sum_needs(needs: Sequence[StageNeed]) -> StageNeed:
    parts: dict[str, int] = {}
    for n in needs:
        for name, b in n.workspace_parts:
            parts[name] = parts.get(name, 0) + b
    return StageNeed(
        weights=sum(n.weights for n in needs),
        kv=sum(n.kv for n in needs),
        drafters=sum(n.drafters for n in needs),
        experts=sum(n.experts for n in needs),
        workspace_parts=tuple(parts.items()),
    )


def _stage_gpu(
    model: ModelFacts,
    gpu: GpuFacts,
    device: str,
    placed: Sequence[tuple[int, PlacedStage]],
    sz: Sizing,
    led: Ledger,
    *,
    first_gpu: bool,
) -> GpuPlan | None:
    """A stage GPU's budget, or None (with the refusal in the ledger) when it does not fit. Its workspace
    keeps the prefill graphs' temporaries only where every expert of its stages stays in VRAM: under an
    expert cache its stages launch their chunks (`strata_cfg.resolve.prompt_windows.prefill_graphs_gate`)."""
    total = gpu.vram_mib * MIB
    reserve = sz.reserve_first if first_gpu else sz.reserve_later
    eb = model.expert_bytes()
    need = _sum_needs([stage_need(model, p.shape, sz) for _, p in placed])
    holds = need.experts  # the experts VRAM holds: all of them, unless a cache holds fewer
    if sz.cache is not None:
        holds = sz.cache
    elif eb:
        holds = (total - (need.weights + need.kv + need.drafters + need.workspace + reserve)) // eb
    if need.experts > holds and sz.prefill_graph_rows:
        sz = replace(sz, prefill_graph_rows=0)
        need = _sum_needs([stage_need(model, p.shape, sz) for _, p in placed])
    fixed = need.weights + need.kv + need.drafters + need.workspace + reserve
    avail = total - fixed
    label = f"GPU {gpu.index} ({gpu.name}, {gpu.vram_mib} MiB)"
    resident = need.experts
    if avail < 0:
        led.refuse(
            "budget.overflow",
            "memory",
            f"{label} is {_mib(-avail)} MiB short before any expert: {_breakdown(need, reserve)} "
            f"= {_mib(fixed)} MiB, plus {need.experts} experts of {_mib(eb)} MiB; lower memory.context, "
            "batch.slots or memory.vram_reserve_mib, or move layers to another GPU",
        )
        return None
    if sz.cache is not None:
        resident = min(sz.cache, need.experts)
        if resident * eb > avail:
            led.refuse(
                "budget.overflow",
                "experts.cache",
                f"{label}: experts.cache = {sz.cache} needs {_mib(resident * eb)} MiB but only "
                f"{_mib(avail)} MiB is left after {_breakdown(need, reserve)}",
            )
            return None
    elif need.experts * eb > avail:
        resident = avail // eb if eb else need.experts
        smallest = sizes.min_cache_experts(model, need.experts)
        if resident < smallest:
            led.refuse(
                "experts.cache-too-small",
                "memory",
                f"{label} has room for {resident} experts after {_breakdown(need, reserve)}, fewer than the "
                f"{smallest} one window can route to in a layer; lower memory.context or batch.slots, or "
                "move layers to another GPU",
            )
            return None
    experts = resident * eb
    mtp = model.mtp_layers * model.num_experts if sz.with_mtp and any(p.shape.last for _, p in placed) else 0
    whole = mtp if resident < need.experts and mtp_experts_whole(mtp, resident) else 0
    budget = Budget(
        total=total,
        weights=need.weights,
        kv=need.kv,
        drafters=need.drafters,
        workspace=need.workspace,
        workspace_parts=dict(need.workspace_parts),
        reserve=reserve,
        experts=experts,
        free=total - fixed - experts,
    )
    return GpuPlan(
        index=gpu.index,
        device=device,
        name=gpu.name,
        role="stage",
        stages=tuple(i for i, _ in placed),
        budget=budget,
        experts_total=need.experts,
        experts_resident=resident,
        experts_whole=whole,
    )


def _off_stage_gpu(
    gpu: GpuFacts,
    device: str,
    role: Literal["helper", "idle"],
    *,
    holds: int = 0,
    expert_bytes: int = 0,
    reserve: int = 0,
) -> GpuPlan:
    """A GPU that holds no stage: an expert helper caching ``holds`` experts, or an idle one."""
    total = gpu.vram_mib * MIB
    experts = holds * expert_bytes
    return GpuPlan(
        index=gpu.index,
        device=device,
        name=gpu.name,
        role=role,
        budget=Budget(
            total=total,
            weights=0,
            kv=0,
            drafters=0,
            workspace=0,
            reserve=reserve,
            experts=experts,
            free=total - reserve - experts,
        ),
        experts_total=holds,
        experts_resident=holds,
    )


def gpu_budgets(
    model: ModelFacts,
    machine: MachineFacts,
    placed: Sequence[PlacedStage],
    sz: Sizing,
    led: Ledger,
) -> list[GpuPlan] | None:
    """Every GPU of the machine with its budget, in device order; None when a GPU does not fit (the
    refusal is in the ledger)."""
    helpers = list(led["experts.helper_devices"])
    peer = led["experts.peer_device"]
    if peer is not None:
        helpers.append(peer)
    plans = stage_gpu_budgets(model, machine, placed, sz, led)
    if plans is None:
        return None
    overflow = sum(p.experts_total - p.experts_resident for p in plans.values())
    eb = model.expert_bytes()
    for gpu in machine.gpus:
        if gpu.index in plans:
            continue
        device = machine.device_name(gpu.index)
        if gpu.index in helpers:
            reserve = min(sz.reserve_later, gpu.vram_mib * MIB)
            holds = min(overflow, (gpu.vram_mib * MIB - reserve) // eb) if eb else 0
            overflow -= holds
            plans[gpu.index] = _off_stage_gpu(
                gpu, device, "helper", holds=holds, expert_bytes=eb, reserve=reserve
            )
        else:
            plans[gpu.index] = _off_stage_gpu(gpu, device, "idle")
    return [plans[g.index] for g in machine.gpus]


def stage_gpu_budgets(
    model: ModelFacts, machine: MachineFacts, placed: Sequence[PlacedStage], sz: Sizing, led: Ledger
) -> dict[int, GpuPlan] | None:
    """The budget of each GPU that holds a stage, by GPU index; None when one does not fit (the refusal is
    in the ledger)."""
    first_gpu = placed[0].gpu if placed else -1
    plans: dict[int, GpuPlan] = {}
    refused = False
    for gpu in machine.gpus:
        mine = [(i, p) for i, p in enumerate(placed) if p.gpu == gpu.index]
        if mine:
            device = machine.device_name(gpu.index)
            plan = _stage_gpu(model, gpu, device, mine, sz, led, first_gpu=gpu.index == first_gpu)
            if plan is None:
                refused = True
            else:
                plans[gpu.index] = plan
    return None if refused else plans


KEEP_MIN_SLOTS = 2.0
"""Slots a layer, in units of the experts one token routes to (``num_experts_per_tok``), below which a cache
that keeps every miss churns: each window's misses take most of a layer's slots, evicting experts the next
windows route to again, where a cache that swaps keeps its most used ones. In the cache simulation of the
Qwen3-30B-A3B shape (calibrated routing, new queues landing two windows late as on a GPU), keeping and
swapping break even at 1.5 to 2 times top-k slots a layer for one stream and at 2.5 to 2.8 for two, with
64, 128 and 256 experts a layer (``scripts/cache_policy_sim.py --break-even``). The engine's array path
breaks even at 2 times top-k for one request (``tests/test_rt_expert_cache_engine.py``). The line is one
stream's: at or above it keeping moves less for one stream in every shape simulated, and two streams
decoding together move up to 8% more under it in the 30B shape (17% with 64 experts of top-4) until they
break even. It does not follow ``batch.slots``: raising it for servers of several slots, which often decode
one request at a time, would make one stream move more (14-18% in the 30B shape) than it saves two
(docs/RUNTIME.md)."""


def keep_slots_per_layer(g: GpuPlan, experts_per_layer: int) -> float:
    """A cached GPU's average slots per sparse layer, the MTP head's layer held whole left out."""
    layers = (g.experts_total - g.experts_whole) / experts_per_layer
    return (g.experts_resident - g.experts_whole) / layers if layers > 0 else 0.0


def keep_misses_small_cache(partial: Sequence[GpuPlan], model: ModelFacts, led: Ledger) -> None:
    """Rule ``experts.keep-misses-small-cache``: a cache of fewer than `KEEP_MIN_SLOTS` times top-k slots a
    layer swaps instead of keeping its misses; a profile that asks to keep them is told it may churn."""
    k = model.num_experts_per_tok
    if not partial or not led["experts.keep_misses"] or not k or not model.num_experts:
        return
    small = [(g, keep_slots_per_layer(g, model.num_experts)) for g in partial]
    small = [(g, per) for g, per in small if per < KEEP_MIN_SLOTS * k]
    if not small:
        return
    where = ", ".join(f"GPU {g.index} {per:.1f}" for g, per in small)
    why = (
        f"slots a layer ({where}) are fewer than {KEEP_MIN_SLOTS:g} x the {k} experts a token routes to: "
        "keeping every miss would evict experts the next windows route to again"
    )
    if led.user_set("experts.keep_misses"):
        led.note(
            "experts.keep-misses-small-cache",
            "experts.keep_misses",
            f"experts.keep_misses = true may move more over the host link than swapping: {why}",
            requested=True,
            because=("experts.cache",),
        )
        return
    led.change(
        "experts.keep_misses",
        False,
        "experts.keep-misses-small-cache",
        f"experts.keep_misses is off: the cache swaps, keeping its most used experts; {why}",
        because=("experts.cache",),
    )


def expert_notes(gpus: list[GpuPlan], sz: Sizing, led: Ledger, model: ModelFacts) -> None:
    """Resolve ``experts.cache`` to the cache size (None: every expert resident) and say where experts are."""
    expert_bytes = model.expert_bytes()
    stage_gpus = [g for g in gpus if g.role == "stage"]
    partial = [g for g in stage_gpus if g.experts_resident < g.experts_total]
    if sz.cache is None:
        smallest = min((g.experts_resident for g in partial), default=None)
        led.resolve_auto("experts.cache", smallest, "experts.cache")
    helper_held = sum(g.experts_resident for g in gpus if g.role == "helper")
    for g in partial:
        missing = g.experts_total - g.experts_resident
        led.note(
            "experts.cache",
            "experts.cache",
            f"GPU {g.index} holds {g.experts_resident} of its {g.experts_total} routed experts in VRAM; "
            f"the other {missing} stream from host memory through that cache",
        )
    for g in partial:
        if g.experts_whole:
            led.note(
                "experts.mtp-whole",
                "experts.cache",
                f"GPU {g.index} keeps all {g.experts_whole} routed experts of the MTP head's layer among the "
                f"{g.experts_resident} it holds in VRAM: the head runs at every drafting step "
                "and on the drafters' stream, which the cache's moves are not ordered with, so its layer "
                "cannot follow its routing as the other layers' slots do",
            )
    if helper_held:
        led.note("experts.cache", "experts.helper_devices", f"helper GPUs hold {helper_held} more experts")
    if partial and led["experts.keep_misses"] and (led["experts.helper_devices"] or helper_held):
        led.change(
            "experts.keep_misses",
            False,
            "experts.keep-misses-tiers",
            "experts.keep_misses is off: the helper tier (helper GPUs or a peer device) adapts by swaps, "
            "which keeping misses would race with",
            because=("experts.helper_devices", "experts.peer_device"),
        )
    keep_misses_small_cache(partial, model, led)
    if partial and led["experts.keep_misses"] and not led.user_set("experts.score_decay"):
        led.resolve_auto("experts.score_decay", KEEP_SCORE_DECAY, "experts.cache")
    if partial:
        led.note("experts.cache", "experts.adapt", cache_policy_text(led, expert_bytes))
    policy_inert(bool(partial), led)
    if led["batch.mtp"] and not partial:
        led.note(
            "batch-mtp.all-experts-resident",
            "batch.mtp",
            "every expert is resident in VRAM: batch MTP pays when experts do not all fit; with all "
            "resident it measured slower than pipelined groups (set batch.mtp = false to pipeline)",
        )


POLICY_KEYS = ("experts.rebalance_every", "experts.score_decay", "experts.swap_margin", "experts.max_swaps")
"""How the expert cache adapts (with ``experts.adapt``, whether it does)."""


def policy_inert(cached: bool, led: Ledger) -> None:
    """Say which cache-policy keys the profile sets for nothing: all of them where every expert is resident
    (no GPU holds a cache), the adaptation's own where ``experts.adapt = false`` freezes the cache, and the
    swaps' margin where the cache keeps its misses instead of swapping."""
    if cached and led["experts.adapt"]:
        if led.user_set("experts.recall_stored") and not led["memory.prefix_store_mib"]:
            led.note(
                "experts.policy-inert",
                "experts.recall_stored",
                "experts.recall_stored does nothing: without a prefix store (memory.prefix_store_mib = 0) "
                "no conversation is copied back",
                requested=True,
                because=("memory.prefix_store_mib",),
            )
        if led["experts.keep_misses"] and led.user_set("experts.swap_margin"):
            led.note(
                "experts.policy-inert",
                "experts.swap_margin",
                "experts.swap_margin does nothing: with experts.keep_misses the cache copies no swaps; a "
                "kept miss takes the queued slot of one of the least used experts",
                requested=True,
                because=("experts.keep_misses",),
            )
        return
    keys = (
        (*POLICY_KEYS, "experts.keep_misses", "experts.recall_stored")
        if cached
        else ("experts.adapt", *POLICY_KEYS, "experts.keep_misses", "experts.recall_stored")
    )
    why = (
        "experts.adapt = false keeps the cache's first contents"
        if cached
        else "every expert is resident in VRAM, so there is no cache to follow the routing"
    )
    for key in keys:
        if led.user_set(key):
            led.note(
                "experts.policy-inert",
                key,
                f"{key} does nothing: {why}",
                requested=True,
                because=("experts.adapt",) if cached else ("experts.cache",),
            )


HOST_LINKS_GBS = (("PCIe 4.0 x16", 25.0), ("PCIe 5.0 x16", 50.0))
"""Host-to-GPU copy rates the plan states a rebalance's pause at (pinned memory, about what such links
measure): the machine facts do not say which link a GPU has."""


def cache_policy_text(led: Ledger, expert_bytes: int) -> str:
    """How the expert cache follows the routing, in words (the ``experts`` policy keys, each read for the
    ``experts.cache`` rule, so that `strata explain` names it), with the most a rebalance copies from host
    memory, which the windows queued after it wait for: a new request's prompt can bring that much."""
    if not led["experts.adapt"]:
        return "the cache keeps its first contents (experts.adapt = false)"
    every, decay, margin, most = (led.get(key, "experts.cache") for key in POLICY_KEYS)
    if led.get("experts.keep_misses", "experts.cache"):
        return (
            f"the cache keeps what the kernels read from host memory: every {every} windows and after each "
            f"prompt chunk read in one window it queues its {most} least used experts (scores decay by "
            f"{decay:g} a window), and each expert a window reads from host memory takes the next queued "
            "slot, written as it is read: nothing is copied, and no window waits"
        )
    gb = most * expert_bytes / 1e9
    pauses = ", ".join(f"{1000 * gb / rate:.0f} ms over {link}" for link, rate in HOST_LINKS_GBS)
    return (
        f"the cache rebalances every {every} windows and after each prompt chunk read in one window: "
        f"scores decay by {decay:g} a window, and a missing expert takes a slot when it beats the resident "
        f"one by {margin:g} uses, at most {most} at a time: up to {gb:.1f} GB from host memory, which the "
        f"windows after it wait for ({pauses}); one cut at that cap goes on at the next window, so a lower "
        "experts.max_swaps spreads a new request's pause over several windows"
        + (
            "; a conversation copied back from the prefix store brings back the experts it routed to "
            "(experts.recall_stored)"
            if led["memory.prefix_store_mib"] and led.get("experts.recall_stored", "experts.cache")
            else ""
        )
    )
