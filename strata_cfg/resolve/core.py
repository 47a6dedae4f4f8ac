"""`resolve`: a pure function from (profile, machine facts, model facts) to a `LaunchPlan`.

It runs RULES.md's steps in their order: defaults and ``auto`` values (0), parse-time refusals (1), the
batch gate (2), the batch-MTP gate (3), groups and the group-dependent gate (4), the pipeline-windows gate
(5), placement (6), the budget (7) and the windows (8); then serving checks and strict mode (9). No I/O, no
clock, no randomness: the same inputs give the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePath

from ..schema.errors import ProfileError
from ..schema.facts import MachineFacts, ModelFacts
from ..schema.plan import (
    MIB,
    BatchMode,
    BatchPlan,
    ExpertsPlan,
    GpuPlan,
    LaunchPlan,
    MemoryPlan,
    ModelPlan,
    Origin,
    ServePlan,
    SpecPlan,
    StagePlan,
    WindowPlan,
)
from ..schema.profile import Profile, is_loopback
from ..schema.windows import (
    BATCH_MTP_ROWS_PER_SLOT,
    BATCH_MTP_SLOTS_PER_WINDOW,
    HANDOFF_ROWS,
    MAX_WINDOW_ROWS,
)
from . import gates
from .budget import PlacedStage, gpu_budgets
from .gates import Topology
from .ledger import Ledger
from .placement import Sizing, auto_split, faster_last, stage_shapes, stage_times


def resolve(
    profile: Profile,
    machine: MachineFacts,
    model: ModelFacts,
    *,
    origins: Mapping[str, Origin] | None = None,
    strict: bool = False,
    profile_file: str | None = None,
) -> LaunchPlan:
    """Resolve a validated profile on a machine and model into a launch plan.

    ``origins`` maps dotted keys to where the user wrote them (from the loader); ``profile_file`` names the
    profile for the plan and for problems without a line. Raises `ProfileError` with every problem found,
    and nothing else.
    """
    name = profile.name or (PurePath(profile_file).stem if profile_file else "profile")
    led = Ledger(origins, default_file=profile_file)
    serving = profile.serve is not None
    if not machine.gpus:
        led.refuse("machine.device-missing", "machine.gpus", "the machine has no GPUs")
        raise ProfileError(led.problems)

    # 0. every default and auto value, before any gate reads it
    model, topo = gates.resolve_defaults(profile, machine, model, led, name=name)
    gates.estimated_bandwidth(machine, topo, led)
    # 1. refusals
    gates.parse_time_refusals(machine, model, topo, led)
    _raise_if_refused(led)
    # 2.-5. gates, in order
    gates.batch_gate(topo, led)
    gates.batch_mtp_gate(model, topo, led, serving=serving)
    gates.resolve_groups(topo, led)
    gates.pipeline_windows_gate(model, topo, led)
    # 6. placement
    sz = _sizing(model, led)
    topo, boundaries = _place(model, machine, topo, sz, led)
    _raise_if_refused(led)
    placed = [
        PlacedStage(shape, gpu)
        for shape, gpu in zip(stage_shapes(boundaries, model.num_hidden_layers), topo.devices, strict=True)
    ]
    # 7. budget
    gpus = gpu_budgets(model, machine, placed, sz, led)
    if gpus is None:
        raise ProfileError(led.problems)
    _expert_notes(gpus, sz, led)
    # 8. windows
    windows = _windows(led)
    # 9. serving, strict
    if serving:
        _serve_exposure(led)
    if strict:
        _strict(led)
    _raise_if_refused(led)
    return _assemble(
        profile,
        machine,
        model,
        topo,
        placed,
        gpus,
        sz,
        windows,
        led,
        name=name,
        profile_file=profile_file,
        strict=strict,
    )


def _raise_if_refused(led: Ledger) -> None:
    if led.problems:
        raise ProfileError(led.problems)


# ---- sizing and placement -----------------------------------------------------------------------


def _spec_mtp(model: ModelFacts, led: Ledger) -> bool:
    return model.has_mtp and led["spec.draft_tokens"] >= 2


def _mtp_passes(led: Ledger, *, spec_mtp: bool, batch_mtp: bool) -> int:
    """MTP head runs per decode step in the mode the profile mostly runs: the chained proposals of the solo
    path, one proposal per slot with batch MTP, none in plain batch windows."""
    if batch_mtp:
        return 1
    if led["batch.slots"] >= 2:
        return 0
    return led["spec.draft_tokens"] - 1 if spec_mtp else 0


def _sizing(model: ModelFacts, led: Ledger) -> Sizing:
    slots = max(led["batch.slots"], 1)
    batch_mtp = bool(led["batch.mtp"])
    spec_mtp = _spec_mtp(model, led)
    drafting = spec_mtp or batch_mtp
    cache = led["experts.cache"]
    return Sizing(
        context=led["memory.context"],
        kv_dtype=led["memory.kv_dtype"],
        slots=slots,
        drafters=slots if drafting else 0,
        with_mtp=drafting,
        mtp_passes=_mtp_passes(led, spec_mtp=spec_mtp, batch_mtp=batch_mtp),
        prefill_chunk=led["memory.prefill_chunk"],
        reserve_first=led["memory.vram_reserve_mib"] * MIB,
        reserve_later=led["memory.vram_reserve_later_mib"] * MIB,
        cache=None if cache == "auto" else int(cache),
    )


def _place(
    model: ModelFacts, machine: MachineFacts, topo: Topology, sz: Sizing, led: Ledger
) -> tuple[Topology, list[int]]:
    """Concrete boundaries (and, for an auto split on unnamed devices, the device order)."""
    if not topo.auto:
        return topo, list(topo.boundaries)
    by_index = {g.index: g for g in machine.gpus}
    gpus = [by_index[d] for d in topo.devices]
    if not topo.devices_given:
        ordered = faster_last(gpus)
        if ordered != gpus:
            devices = [g.index for g in ordered]
            led.change(
                "split.devices",
                devices,
                "split.auto-order",
                f"stages on GPUs {devices}: slowest first and the fastest ({ordered[-1].name}, "
                f"{ordered[-1].bandwidth_gbs:g} GB/s) last, since the last stage runs the head and the "
                "drafters",
            )
            gpus = ordered
            topo = Topology(
                n_stages=topo.n_stages,
                devices=tuple(devices),
                hosts=topo.hosts,
                auto=True,
                boundaries=(),
                usable=topo.usable,
                devices_given=False,
            )
    found = auto_split(model, gpus, sz)
    if found is None:
        led.refuse(
            "split.auto-no-fit",
            "split.layers",
            f"no split of {model.num_hidden_layers} layers over {len(gpus)} GPUs fits: even with an expert "
            "cache, some stage runs out of VRAM; lower memory.context or batch.slots, or add a GPU",
        )
        return topo, []
    boundaries, resident = found
    times = stage_times(model, boundaries, gpus, sz)
    per_stage = ", ".join(f"{t * 1e3:.2f}" for t in times)
    fit = (
        "every expert resident"
        if resident
        else "no split keeps every expert resident, so with an expert cache"
    )
    led.resolve_auto(
        "split.layers",
        boundaries,
        "split.auto",
        f"split.layers = {boundaries}: predicted decode step per stage {per_stage} ms; {fit}",
    )
    return topo, boundaries


# ---- notes after the budget ---------------------------------------------------------------------


def _expert_notes(gpus: list[GpuPlan], sz: Sizing, led: Ledger) -> None:
    """Resolve ``experts.cache`` to the cache size (None: every expert resident) and say where experts are."""
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
    if helper_held:
        led.note("experts.cache", "experts.helper_devices", f"helper GPUs hold {helper_held} more experts")
    if led["batch.mtp"] and not partial:
        led.note(
            "batch-mtp.all-experts-resident",
            "batch.mtp",
            "every expert is resident in VRAM: batch MTP pays when experts do not all fit; with all "
            "resident it measured slower than pipelined groups (set batch.mtp = false to pipeline)",
        )


def _serve_exposure(led: Ledger) -> None:
    host = led["serve.host"]
    if not is_loopback(host) and not led["serve.api_key_env"]:
        led.note(
            "serve.exposed",
            "serve.host",
            f"serve.host = {host!r} exposes the model to the network with no API key; set serve.api_key_env",
            requested=True,
        )


def _strict(led: Ledger) -> None:
    """Strict mode: every decision that overrode or turned off what the user asked for is an error."""
    for d in led.decisions:
        if d.requested:
            led.refuse(d.rule, d.key, f"strict: {d.message}")


# ---- windows and assembly -----------------------------------------------------------------------


def _batch_shape(led: Ledger) -> tuple[int, int, BatchMode, int, int]:
    """(slots, groups, mode, slots per window, rows per slot)."""
    slots = max(led["batch.slots"], 1)
    groups = led["batch.groups"] if slots > 1 else 1
    if slots < 2:
        return 1, 1, "solo", 1, 1
    if led["batch.mtp"]:
        return slots, groups, "serial", min(slots, BATCH_MTP_SLOTS_PER_WINDOW), BATCH_MTP_ROWS_PER_SLOT
    mode: BatchMode = "pipelined" if groups > 1 else "serial"
    return slots, groups, mode, min(slots // groups, MAX_WINDOW_ROWS), 1


def _windows(led: Ledger) -> WindowPlan:
    slots, _, mode, per_window, rows_per_slot = _batch_shape(led)
    draft = led["spec.draft_tokens"]
    solo_rows = min(1 + max(draft - 1, 0), MAX_WINDOW_ROWS)
    if led["batch.mtp"] and slots > BATCH_MTP_SLOTS_PER_WINDOW:
        led.note(
            "windows.batch-mtp-rotation",
            "batch.slots",
            f"{slots} batch-MTP slots take turns, {BATCH_MTP_SLOTS_PER_WINDOW} per window of "
            f"{MAX_WINDOW_ROWS} rows (token and proposal each)",
        )
    batch_rows = solo_rows if mode == "solo" else per_window * rows_per_slot
    return WindowPlan(
        max_rows=MAX_WINDOW_ROWS, handoff_rows=HANDOFF_ROWS, solo_rows=solo_rows, batch_rows=batch_rows
    )


def _assemble(
    profile: Profile,
    machine: MachineFacts,
    model: ModelFacts,
    topo: Topology,
    placed: list[PlacedStage],
    gpus: list[GpuPlan],
    sz: Sizing,
    windows: WindowPlan,
    led: Ledger,
    *,
    name: str,
    profile_file: str | None,
    strict: bool,
) -> LaunchPlan:
    slots, groups, mode, per_window, rows_per_slot = _batch_shape(led)
    drafters = tuple(range(sz.drafters))
    stages = []
    for i, p in enumerate(placed):
        holds: list[str] = []
        if p.shape.first:
            holds.append("embedding")
        if p.shape.last:
            holds += ["final_norm", "lm_head"]
            if sz.with_mtp:
                holds.append("mtp")
            if drafters:
                holds.append("drafters")
        stages.append(
            StagePlan(
                index=i,
                gpu=p.gpu,
                device=machine.device_name(p.gpu),
                host=topo.hosts[i] if i < len(topo.hosts) else "local",
                layers=(p.shape.start, p.shape.end),
                holds=tuple(holds),
                drafters=drafters if p.shape.last else (),
            )
        )
    m = profile.model
    return LaunchPlan(
        profile=name,
        profile_file=profile_file,
        strict=strict,
        machine=machine,
        model=ModelPlan(
            path=None if model.source.startswith("synthetic:") else model.source,
            synthetic=m.synthetic if m else None,
            packaged=m.packaged if m else None,
            seed=led["model.seed"],
            layer_scale=led["model.layer_scale"],
            facts=model,
        ),
        stages=tuple(stages),
        gpus=tuple(gpus),
        batch=BatchPlan(
            slots=slots,
            groups=groups,
            mode=mode,
            mtp=bool(led["batch.mtp"]),
            slots_per_window=per_window,
            rows_per_slot=rows_per_slot,
        ),
        spec=SpecPlan(
            draft_tokens=led["spec.draft_tokens"],
            mtp=_spec_mtp(model, led),
            pipeline_windows=led["split.pipeline_windows"],
        ),
        memory=MemoryPlan(
            context=led["memory.context"],
            kv_dtype=led["memory.kv_dtype"],
            prefill_chunk=led["memory.prefill_chunk"],
            vram_reserve_mib=led["memory.vram_reserve_mib"],
            vram_reserve_later_mib=led["memory.vram_reserve_later_mib"],
        ),
        experts=ExpertsPlan(
            cache=led["experts.cache"] if any(g.experts_resident < g.experts_total for g in gpus) else None,
            helper_devices=tuple(led["experts.helper_devices"]),
            remote_opt=bool(led["experts.remote_opt"]),
            peer_device=led["experts.peer_device"],
        ),
        windows=windows,
        serve=(
            ServePlan(
                host=led["serve.host"],
                port=led["serve.port"],
                api_key_env=led["serve.api_key_env"],
                model_name=led["serve.model_name"],
            )
            if profile.serve is not None
            else None
        ),
        split_test_shared_gpu=gates.is_test_split(topo, led),
        decisions=tuple(led.decisions),
        settings=led.settings(),
    )
