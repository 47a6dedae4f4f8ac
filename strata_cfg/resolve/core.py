"""`resolve`: a pure function from (profile, machine facts, model facts) to a `LaunchPlan`.

It runs the steps in their order (docs/PROFILES.md, "How a profile is resolved"): defaults and ``auto``
values (0, `defaults`), parse-time refusals (1, `refusals`), the batch gate (2) and the batch-MTP gate (3,
`batch_gates`), groups and the group-dependent gate (4, `groups`), the pipeline-windows gate (5,
`pipeline_windows`), the layer split (6, `layer_split`), the VRAM and host budgets and a lone prompt's
chunk under an expert cache (7, `budget`, `host_budget`, `prompt_chunk`), the windows (8, `window_plan`),
then serving checks and strict mode (9, `final_checks`); and assembles the plan. No I/O, no clock, no
randomness: the same inputs give the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath

from ..schema.errors import ProfileError
from ..schema.facts import MachineFacts, ModelFacts
from ..schema.plan import (
    BatchPlan,
    ExpertsPlan,
    GpuPlan,
    HostPlan,
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
from .batch_gates import batch_gate, batch_mtp_gate
from .budget import PlacedStage, expert_notes, gpu_budgets
from .defaults import drafts_by_lookup, drafts_with_mtp, estimated_bandwidth, resolve_defaults
from .draft_head import draft_head_auto
from .final_checks import serve_exposure, strict_mode
from .groups import resolve_groups
from .host_budget import host_budget
from .layer_split import draft_head_note, place_layers, sizing
from .ledger import Ledger
from .pipeline_windows import pipeline_windows_gate
from .placement import Sizing, stage_shapes
from .prompt_chunk import lone_prompt_chunk
from .prompt_windows import prefill_graphs_gate, resolve_prompt_graph_rows
from .refusals import parse_time_refusals
from .topology import Topology, is_test_split
from .window_plan import batch_shape, prefix_reuse_note, resolve_windows


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
    model, topo = resolve_defaults(profile, machine, model, led, name=name)
    estimated_bandwidth(machine, topo, led)
    # 1. refusals
    parse_time_refusals(machine, model, topo, led)
    _raise_if_refused(led)
    # 2.-5. gates, in order
    inputs = GateInputs(model, topo, serving)
    for gate in GATES:
        gate(inputs, led)
    # 6. placement
    draft_head_note(model, led)
    sz = sizing(model, led)
    topo, boundaries = place_layers(model, machine, topo, sz, led)
    _raise_if_refused(led)
    placed = [
        PlacedStage(shape, gpu)
        for shape, gpu in zip(stage_shapes(boundaries, model.num_hidden_layers), topo.devices, strict=True)
    ]
    # 7. budget
    gpus = gpu_budgets(model, machine, placed, sz, led)
    if gpus is None:
        raise ProfileError(led.problems)
    gpus, sz = lone_prompt_chunk(model, machine, placed, sz, gpus, led)
    gpus, sz = draft_head_auto(model, machine, placed, sz, gpus, led)
    expert_notes(gpus, sz, led, model)
    host = host_budget(model, gpus, led)
    # 8. windows
    stage_gpus = [g for g in gpus if g.role == "stage"]
    cached = [g.index for g in stage_gpus if not g.all_experts_resident]  # stage GPUs with an expert cache
    windows = resolve_windows(led, not cached)
    speeds = [(p.shape, machine.gpus[p.gpu].bandwidth_gbs) for p in placed]
    resolve_prompt_graph_rows(led, model, speeds, not cached)
    prefill_graphs_gate(led, model, cached, len(stage_gpus), sz.with_mtp)
    prefix_reuse_note(led)
    # 9. serving, strict
    if serving:
        serve_exposure(led)
    if strict:
        strict_mode(led)
    _raise_if_refused(led)
    return _assemble(
        profile,
        machine,
        model,
        topo,
        placed,
        gpus,
        host,
        sz,
        windows,
        led,
        name=name,
        profile_file=profile_file,
        strict=strict,
    )


@dataclass(frozen=True, slots=True)
class GateInputs:
    """What steps 2 to 5 read besides the ledger."""

    model: ModelFacts
    topo: Topology
    serving: bool


def _batch(g: GateInputs, led: Ledger) -> None:
    batch_gate(g.topo, led)


def _batch_mtp(g: GateInputs, led: Ledger) -> None:
    batch_mtp_gate(g.model, g.topo, led, serving=g.serving)


def _groups(g: GateInputs, led: Ledger) -> None:
    resolve_groups(g.topo, led)


def _pipeline_windows(g: GateInputs, led: Ledger) -> None:
    pipeline_windows_gate(g.model, g.topo, led)


GATES: tuple[Callable[[GateInputs, Ledger], None], ...] = (_batch, _batch_mtp, _groups, _pipeline_windows)
"""Steps 2 to 5, in the order they must run. The batch gate (2) comes first: it settles the slots every
later gate reads. The batch-MTP gate (3) must come before groups (4): defaulted groups fall to 1 only while
batch MTP is still on, so every reason that turns it off must be known first, or a split with helper caches
would lose its pipelined groups to a batch MTP that never runs. The pipeline-windows gate (5) reads neither
batch MTP nor groups, so it could run anywhere after step 2 (tests/test_resolve_properties.py holds both)."""


def _raise_if_refused(led: Ledger) -> None:
    if led.problems:
        raise ProfileError(led.problems)


def _assemble(
    profile: Profile,
    machine: MachineFacts,
    model: ModelFacts,
    topo: Topology,
    placed: list[PlacedStage],
    gpus: list[GpuPlan],
    host: HostPlan,
    sz: Sizing,
    windows: WindowPlan,
    led: Ledger,
    *,
    name: str,
    profile_file: str | None,
    strict: bool,
) -> LaunchPlan:
    slots, groups, mode, per_window, rows_per_slot = batch_shape(led)
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
    mtp = drafts_with_mtp(model, led)
    lookup = drafts_by_lookup(led)
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
            routing=led["model.routing"],
            prefill_q=led["model.prefill_q"],
            decode_attention=led["model.decode_attention"],
            facts=model,
        ),
        stages=tuple(stages),
        gpus=tuple(gpus),
        batch=BatchPlan(
            slots=slots,
            groups=groups,
            mode=mode,
            mtp=bool(led["batch.mtp"]),
            mtp_in_groups=bool(led["batch.mtp"]) and mode == "pipelined",
            slots_per_window=per_window,
            rows_per_slot=rows_per_slot,
            run_ahead=led["batch.run_ahead"],
        ),
        spec=SpecPlan(
            draft_tokens=led["spec.draft_tokens"],
            draft_floor=led["spec.draft_floor"],
            adaptive_depth=bool(led["spec.adaptive_depth"]) and (mtp or lookup),
            mtp=mtp,
            ngram=lookup,
            ngram_min=led["spec.ngram_min"],
            ngram_max=led["spec.ngram_max"],
            pipeline_windows=led["split.pipeline_windows"],
            draft_head="int8" if sz.int8_draft_head else "shared",
        ),
        memory=MemoryPlan(
            context=led["memory.context"],
            kv_dtype=led["memory.kv_dtype"],
            prefill_chunk=led["memory.prefill_chunk"],
            prefill_chunk_alone=led["memory.prefill_chunk_alone"],
            prompt_graph_rows=led["memory.prompt_graph_rows"],
            prefill_graph_rows=led["memory.prefill_graph_rows"],
            vram_reserve_mib=led["memory.vram_reserve_mib"],
            vram_reserve_later_mib=led["memory.vram_reserve_later_mib"],
            prefix_reuse=bool(led["memory.prefix_reuse"]),
            prefix_store_mib=led["memory.prefix_store_mib"],
        ),
        experts=ExpertsPlan(
            cache=led["experts.cache"] if any(g.experts_resident < g.experts_total for g in gpus) else None,
            helper_devices=tuple(led["experts.helper_devices"]),
            remote_opt=bool(led["experts.remote_opt"]),
            peer_device=led["experts.peer_device"],
            adapt=bool(led["experts.adapt"]),
            score_decay=float(led["experts.score_decay"]),
            rebalance_every=int(led["experts.rebalance_every"]),
            swap_margin=float(led["experts.swap_margin"]),
            max_swaps=int(led["experts.max_swaps"]),
            keep_misses=bool(led["experts.keep_misses"]),
            recall_stored=bool(led["experts.recall_stored"]),
        ),
        host=host,
        windows=windows,
        serve=(
            ServePlan(
                host=led["serve.host"],
                port=led["serve.port"],
                api_key_env=led["serve.api_key_env"],
                model_name=led["serve.model_name"],
                max_queued=led["serve.max_queued"],
                warm_up=bool(led["serve.warm_up"]),
                recoveries=int(led["serve.recoveries"]),
                step_timeout_s=float(led["serve.step_timeout_s"]),
                allowed_origins=tuple(led["serve.allowed_origins"]),
                loopback=is_loopback(led["serve.host"]),
            )
            if profile.serve is not None
            else None
        ),
        split_test_shared_gpu=is_test_split(topo, led),
        decisions=tuple(led.decisions),
        settings=led.settings(),
    )
