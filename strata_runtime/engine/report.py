"""What the engine says about itself: its start-up lines and the state the status endpoint and the metrics
serve (`engine_stats`). Read-only: nothing here changes the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from strata_cfg.schema.plan import MIB, LaunchPlan
from strata_cfg.schema.windows import lookup_history_positions

from .prefix import PAGE
from .speculative import DRAFT_PROBE_EVERY, SILENT_PROBE_FIRST, SILENT_PROBE_MOST

if TYPE_CHECKING:
    from ..model import Model
    from .prefix import Prefixes, PrefixStore
    from .slot import Slot
    from .stats import WindowStats
    from .window_choice import WindowChoice


class EngineView(Protocol):
    """What the report reads of an engine (`strata_runtime.engine.scheduler.Engine`)."""

    plan: LaunchPlan
    model: Model
    n_slots: int
    slots: list[Slot | None]
    depth: int
    choice: WindowChoice
    pipelined: bool
    tracked: bool
    run_ahead: int
    all_experts_resident: bool
    window_stats: WindowStats
    warmed: dict[str, Any] | None
    prefixes: Prefixes
    store: PrefixStore

    @property
    def queued(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def totals(self) -> dict[str, Any]: ...

    @property
    def acceptance(self) -> float | None: ...

    def room(self, slot: Slot) -> int: ...


def engine_stats(engine: EngineView) -> dict[str, Any]:
    """The engine's state as the status endpoint and the metrics serve it: the plan's batch settings, the
    queue, each slot, the totals and recent windows, the measured window times the drafting depth reads, the
    drafters and the expert caches, and what compiled late or warmed up."""
    return {
        "plan": {
            "mode": engine.plan.batch.mode,
            "slots": engine.n_slots,
            "groups": engine.plan.batch.groups,
            "batch_mtp": engine.plan.batch.mtp,
            "draft_tokens": engine.plan.spec.draft_tokens,
            "draft_method": _draft_method(engine.plan),
            "stages": [s.device for s in engine.plan.stages],
        },
        "queue": engine.queued,
        "in_flight": engine.in_flight,
        "slots": [_slot_state(engine, i, s) for i, s in enumerate(engine.slots)],
        "totals": engine.totals,  # a fresh copy
        "solo_window_ms": (
            {
                kind: {str(r): round(ms, 3) for r, ms in sorted(costs.ms.items())}
                for kind, (costs, _) in sorted(engine.choice.solo.items())
            }
            if engine.choice.adaptive
            else None
        ),
        "batch_window_ms": (
            {
                kind: {str(r): round(ms, 3) for r, ms in sorted(costs.ms.items())}
                for kind, costs in sorted(engine.choice.batch.items())
                if costs.ms
            }
            if engine.choice.adaptive_batch
            else None
        ),
        "acceptance": engine.acceptance,
        "recent_windows": engine.window_stats.last(32),
        "drafters": drafter_info(engine.model),
        "experts": [stage.experts.describe() for stage in engine.model.stages],
        "compiled_at_launch": engine.model.compiled_at_launch(),
        "warm_up": engine.warmed,
    }


def drafter_info(model: Model) -> dict[str, Any]:
    """Where the slots' MTP drafters live (the last stage's device), which slots have one, and their
    bytes each, of which their MTP layer's KV."""
    d = model.drafters
    if not d:
        return {"device": None, "slots": [], "bytes_each": 0}
    first = next(iter(d.values()))
    return {
        "device": str(first.device),
        "slots": sorted(d),
        "bytes_each": first.nbytes,
        "kv_bytes_each": first.kv.nbytes,
    }


def _draft_method(plan: LaunchPlan) -> str | None:
    """What a request alone drafts with: ``mtp`` (the MTP head), ``ngram`` (its own text), or None."""
    return "ngram" if plan.spec.ngram else "mtp" if plan.spec.mtp else None


def _depth_text(engine: EngineView) -> str:
    """How many proposals a request alone drafts, and from what."""
    spec = engine.plan.spec
    source = (
        f" looked up in its own text ({spec.ngram_max} down to {spec.ngram_min} tokens matched, "
        'spec.method = "ngram")'
        if spec.ngram
        else ""
    )
    if not engine.choice.adaptive:
        return f"{engine.depth} proposal(s){source}"
    return (
        f"up to {engine.depth} proposal(s){source}, as many as give the most tokens per second by each "
        "request's acceptance and the measured window times (spec.adaptive_depth)"
    )


def _pause_text(engine: EngineView) -> str:
    """When drafting pauses for a request, and how it probes while paused."""
    floor, adaptive = engine.plan.spec.draft_floor, engine.choice.adaptive
    probe = (
        f"with one probe after {DRAFT_PROBE_EVERY} windows (a plain greedy request alone: silent probes "
        f"{SILENT_PROBE_FIRST} window{'s' if SILENT_PROBE_FIRST > 1 else ''} apart, twice as far after each "
        f"that fails, up to {SILENT_PROBE_MOST}, its head's proposal checked against the next token)"
    )
    if engine.plan.spec.ngram:
        probe = (
            "with a silent probe every window (would a lookup before its token have proposed it?); a "
            "lookup that finds nothing counts as a proposal that did not hold"
        )
    if floor > 0:
        also = ", or while windows without them give more tokens per second" if adaptive else ""
        return (
            f"drafting pauses for a request while under {floor:.0%} of its proposals hold{also}, "
            f"{probe} (spec.draft_floor)"
        )
    if adaptive:
        return (
            "drafting pauses for a request only while windows without proposals give more tokens per "
            f"second, {probe} (spec.draft_floor = 0)"
        )
    return "drafting never pauses (spec.draft_floor = 0)"


def _store_text(engine: EngineView) -> str:
    """The start-up line's words on the host's prefix store (nothing where it is off)."""
    mib, store = engine.plan.memory.prefix_store_mib, engine.store
    if not mib or not engine.plan.memory.prefix_reuse:
        return ""
    if not store.on:
        page = store.page_bytes / MIB
        return f" (store {mib} MiB: less than one page of {PAGE} positions, {page:.1f} MiB, so none)"
    return f" (store {mib} MiB in host memory: {store.pages} pages of {PAGE} positions)"


def startup_lines(engine: EngineView) -> list[str]:
    """What the engine logs as it starts: its stages, slots, batch mode and prefix reuse, how far windows run
    ahead, how
    batch MTP and solo drafting choose, where the drafters live and when drafting pauses, each stage's
    decode path and expert cache, peer access, and the continuous pipeline."""
    p = engine.plan
    stages = ", ".join(f"{s.device} layers [{s.layers[0]}, {s.layers[1]})" for s in p.stages)
    lines = [
        f"stages: {stages}",
        f"slots: {engine.n_slots}, mode {p.batch.mode}, {p.batch.groups} group(s), batch MTP "
        f"{'on' if p.batch.mtp else 'off'}, solo drafting {_depth_text(engine)}, prefix reuse "
        f"{'on' if p.memory.prefix_reuse else 'off'}" + _store_text(engine),
        (
            f"decode windows whose tokens the device chooses: up to {engine.run_ahead} in flight, each "
            "reading the tokens the one before chose (batch.run_ahead)"
            if engine.run_ahead > 1
            else "decode windows: one at a time (batch.run_ahead = 1)"
        ),
    ]
    if p.batch.mtp:
        per = p.batch.slots_per_window
        beyond = (
            "serial windows (every expert is resident)"
            if engine.all_experts_resident
            else "rotating batch-MTP windows (experts stream from host memory)"
        )
        if p.batch.slots > per:
            lines.append(f"batch MTP: up to {per} decoding slots in one window; more: {beyond}")
        if engine.choice.adaptive_batch:
            lines.append(
                f"batch MTP or serial windows for up to {per} slots decoding together, whichever gives "
                "more tokens per second by their measured times (spec.adaptive_depth)"
            )
    if p.model.routing == "calibrated":
        lines.append("routing: calibrated (skewed and persistent, through a router bias)")
    info = drafter_info(engine.model)
    if engine.plan.spec.ngram:
        lines.append(_pause_text(engine))
        last = engine.model.last.device
        kib = engine.n_slots * lookup_history_positions(engine.plan.memory.context) * 8 // 1024  # int64
        lines.append(
            "drafters: none; a request alone (without a logit bias or penalties) has its looked-up windows "
            f"decided on {last}, running ahead of the host, each looking the next window's proposals up in "
            f"the slots' token histories there ({kib:,} KiB), and so has a serial window whose slots all "
            "carry as many; other windows of slots decoding together are looked up on the host"
        )
    elif info["device"] is None:
        lines.append("drafters: none (the plan does not draft)")
    else:
        each = info["bytes_each"] / MIB
        kv = info["kv_bytes_each"] / MIB
        where = "solo and batch-MTP windows" + (", in each group" if engine.pipelined else "")
        lines.append(_pause_text(engine))
        lines.append(
            f"drafters: slots {info['slots']} on {info['device']} (last stage), {each:.2f} MiB each "
            f"(MTP-layer KV {kv:.2f} MiB + draft-window buffers {each - kv:.2f} MiB); decided there, "
            f"running ahead of the host: {where}"
        )
        head = engine.model.mtp.draft_head if engine.model.mtp is not None else None
        if head is not None:
            mib = head.nbytes / MIB
            lines.append(
                f"draft logits through an 8-bit copy of the LM head on {head.device} ({mib:.1f} MiB, "
                'spec.draft_head = "int8"); the model verifies with its own'
            )
    for stage in engine.model.stages:
        if stage.device.is_cuda:
            path = "CUDA graphs" if stage.cuda is not None else f"array path ({stage.cuda_refused})"
            path += "".join(f"; {note}" for note in getattr(stage.cuda, "notes", ()))
            lines.append(f"decode windows on {stage.device}: {path}")
        store = stage.experts
        if store.cached:
            total = len(store) * store.n_experts
            helper = ""
            if store.helper_slots:
                where = ", ".join(f"{n} on {d}" for d, n in store.helper.sizes())
                helper = (
                    f", {store.helper_slots} more in the helper tier ({where}: "
                    f"{store.helper.nbytes / MIB:.1f} MiB, read over peer-to-peer)"
                )
            lines.append(
                f"expert cache on {stage.device}: {store.slots} of {total} routed experts in VRAM "
                f"({store.vram_bytes / MIB:.1f} MiB){helper}, all {total} in host memory "
                f"({store.host_bytes / MIB:.1f} MiB{', pinned' if stage.device.is_cuda else ''}); "
                f"{'adapting to the routing' if store.residency.policy.adapt else 'frozen'}"
            )
    lines += engine.model.peer_access
    if engine.pipelined:
        inside = ", batch MTP inside each group" if p.batch.mtp else ""
        lines.append(
            f"continuous pipeline: {p.batch.groups} groups in flight{inside}, one stream per stage, "
            f"up to {len(p.stages)} chunks of one prompt in flight"
        )
    return lines


def _slot_state(engine: EngineView, i: int, s: Slot | None) -> dict[str, Any]:
    """Slot ``i``: free (with the tokens it keeps for prefix reuse), or its request's progress, KV lengths and
    drafting."""
    if s is None:
        kept = engine.prefixes.kept[i]
        return {"slot": i, "state": "free", "kept_tokens": 0 if kept is None else len(kept.tokens)}
    return {
        "slot": i,
        "state": ("reread" if s.resume_token is not None else "prefill") if s.prefilling else "decode",
        "request_id": s.handle.request.request_id,
        "prompt_tokens": len(s.prompt),
        "prefilled": s.prefilled,
        "generated": len(s.generated),
        "length": s.length,
        "kv_lengths": engine.model.kv_lengths(i),
        "restarts": s.restarts,
        **({"drafting": _drafting_state(engine, s)} if engine.tracked else {}),
    }


def _drafting_state(engine: EngineView, s: Slot) -> dict[str, Any]:
    """Why the slot drafts as it does: how often its windows' first proposal held, as the floor reads
    it (1 until `DRAFT_WARMUP` proposals were seen), each proposal position's chance of holding, the
    depth its next window alone would draft, whether that depth adapts to the measured window
    times, and whether it probes silently while paused."""
    g = s.gauge
    room = min(engine.depth, engine.room(s))
    depth = g.depth(room)
    return {
        "proposals_seen": g.seen,
        "acceptance": round(g.estimate, 4),
        "holds": [round(h, 4) for h in g.holds_up_to(engine.depth)],
        "solo_depth": depth,
        "paused": room > 0 and depth == 0,
        "adaptive": g.costs is not None,
        "silent_probes": g.silent,
    }
