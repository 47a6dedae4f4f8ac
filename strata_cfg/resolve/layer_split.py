"""Step 6: the layer split made concrete. An auto split gets its boundaries from `placement.auto_split`
(and, on unnamed devices, the fastest GPU last); a written split keeps its own. Also the sizing that the
split and the budget (step 7) are computed for: context, slots, drafters and MTP passes."""

from __future__ import annotations

from ..schema.facts import MachineFacts, ModelFacts
from ..schema.plan import MIB
from .defaults import drafts_by_lookup, drafts_with_mtp
from .ledger import Ledger
from .placement import Sizing, auto_split, faster_last, stage_times
from .sizes import stores_attention_scores
from .topology import Topology


def _mtp_passes(led: Ledger, *, spec_mtp: bool, batch_mtp: bool) -> int:
    """MTP head runs per decode step in the mode the profile mostly runs: the chained proposals of the solo
    path, one proposal per slot with batch MTP, none in plain batch windows (nor where the solo path drafts
    by n-gram lookup, which reads no weights: ``spec_mtp`` is false there)."""
    if batch_mtp:
        return 1
    if led["batch.slots"] >= 2:
        return 0
    return led["spec.draft_tokens"] - 1 if spec_mtp else 0


def sizing(model: ModelFacts, led: Ledger) -> Sizing:
    """What the split and the budget are sized for, from the values steps 0 to 5 resolved."""
    slots = max(led["batch.slots"], 1)
    batch_mtp = bool(led["batch.mtp"])
    spec_mtp = drafts_with_mtp(model, led)
    drafting = spec_mtp or batch_mtp  # n-gram lookup needs no drafter and no MTP head
    cache = led["experts.cache"]
    return Sizing(
        context=led["memory.context"],
        kv_dtype=led["memory.kv_dtype"],
        slots=slots,
        drafters=slots if drafting else 0,
        with_mtp=drafting,
        mtp_passes=_mtp_passes(led, spec_mtp=spec_mtp, batch_mtp=batch_mtp),
        prefill_chunk=led["memory.prefill_chunk"],
        prefill_chunk_alone=led["memory.prefill_chunk_alone"],
        reserve_first=led["memory.vram_reserve_mib"] * MIB,
        reserve_later=led["memory.vram_reserve_later_mib"] * MIB,
        cache=None if cache == "auto" else int(cache),
        stores_scores=stores_attention_scores(led["machine.backend"], model),
        prefill_graph_rows=led["memory.prefill_graph_rows"],
        attention_tc=led["model.decode_attention"] == "tensor_cores",
        gpu=led["machine.backend"] == "cuda",
        lookup=drafts_by_lookup(led),
        int8_draft_head=drafting and led["spec.draft_head"] == "int8",
    )


def draft_head_note(model: ModelFacts, led: Ledger) -> None:
    """A note (which strict mode refuses) where the profile asks for the 8-bit draft head and the MTP head
    does not draft: neither the solo path (no drafting, or n-gram lookup) nor batch MTP."""
    if led["spec.draft_head"] != "int8" or not led.user_set("spec.draft_head"):
        return
    if drafts_with_mtp(model, led) or led["batch.mtp"]:
        return
    why = (
        f"{model.source} has no MTP weights"
        if not model.has_mtp
        else 'the solo path drafts by n-gram lookup (spec.method = "ngram") and batch MTP is off'
        if led["spec.method"] == "ngram"
        else f"the solo path does not draft (spec.draft_tokens = {led['spec.draft_tokens']}) and batch MTP "
        "is off"
    )
    led.note(
        "spec.draft-head-inert",
        "spec.draft_head",
        f'spec.draft_head = "int8" does nothing: the MTP head does not draft ({why})',
        requested=True,
        because=("spec.method", "spec.draft_tokens", "batch.mtp"),
    )


def place_layers(
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
