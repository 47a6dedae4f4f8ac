"""The plan as `strata plan` prints it, for people.

The text is for a new user: one line per topic, a placement table and a memory table with one row per GPU,
then the decisions, with the features the user asked for that were turned off marked so they stand out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..schema.plan import (
    DEFAULT_DRAFT_FLOOR,
    DEFAULT_RECOVERIES,
    DEFAULT_STEP_TIMEOUT_S,
    MIB,
    PREFIX_STORE_PAGE,
    WORKSPACE_PARTS,
    BatchPlan,
    Decision,
    GpuPlan,
    LaunchPlan,
    MemoryPlan,
    StagePlan,
)
from ..schema.windows import PROMPT_GRAPH_MAX
from .table import table

_HOLDS = {
    "embedding": "embedding",
    "final_norm": "final norm",
    "lm_head": "LM head",
    "mtp": "MTP head",
}
_MARK = {"error": "ERROR", "off": "OFF", "clamp": "CLAMP", "warn": "WARN", "note": "note"}


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _layers(stage: StagePlan) -> str:
    a, b = stage.layers
    return f"{a}-{b - 1} ({b - a})"


def _slots(ids: Sequence[int]) -> str:
    if len(ids) > 2 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(str(i) for i in ids)


def _recoveries(n: int) -> str:
    """``serve.recoveries`` where it is not the default."""
    if n == DEFAULT_RECOVERIES:
        return ""
    if n == 0:
        return ", exits at a failed step"
    return f", recovers from {n} failed step{'s' * (n != 1)} in 10 min"


def _step_timeout(seconds: float) -> str:
    """``serve.step_timeout_s`` where it is not the default."""
    if seconds == DEFAULT_STEP_TIMEOUT_S:
        return ""
    return ", no step timeout" if seconds == 0 else f", a step hung after {seconds:g} s"


def holds_text(stage: StagePlan) -> str:
    """What a stage holds besides its layers, in words (drafters with their slots)."""
    parts = [_HOLDS[h] for h in stage.holds if h in _HOLDS]
    if stage.drafters:
        parts.append(f"drafters (slot{'s' * (len(stage.drafters) != 1)} {_slots(stage.drafters)})")
    return ", ".join(parts) or "-"


def _model_line(plan: LaunchPlan) -> str:
    f = plan.model.facts
    name = plan.model.label()
    experts = f", {f.num_experts} experts (top {f.num_experts_per_tok})" if f.num_experts else ""
    mtp = f", MTP {f.mtp_layers} layer{'s' * (f.mtp_layers != 1)}" if f.has_mtp else ", no MTP"
    q = ", prompt attention with fp16 q" if plan.model.prefill_q == "fp16" else ""
    gpu = plan.machine.backend != "cpu"
    att = ", decode attention on CUDA cores" if gpu and plan.model.decode_attention == "cuda_cores" else ""
    return f"{name}, {f.dtype}, {f.num_hidden_layers} layers{experts}{mtp}{q}{att}"


def _batch_line(plan: LaunchPlan) -> str:
    b = plan.batch
    if b.mode == "solo":
        return "1 slot: one request at a time (no batching)"
    if b.mode == "pipelined":
        how = f"{b.groups} pipelined groups of {b.slots // b.groups} ({b.groups} windows in flight)"
    else:
        how = "1 group (serial windows)"
    if b.mtp_in_groups:
        mtp = (
            f"batch MTP inside {b.groups} pipelined groups: each slot sends its token + 1 proposal, "
            f"{b.slots_per_window} slots per group window"
        )
    elif b.mtp:
        mtp = f"batch MTP on: each slot sends its token + 1 proposal, {b.slots_per_window} slots per window"
        if plan.spec.adaptive_depth and b.mode == "serial":
            mtp += ", or serial windows where those measure faster"
    else:
        mtp = "batch MTP off"
    return f"{b.slots} slots, {how}; {mtp}{_ahead(b)}"


def _ahead(b: BatchPlan) -> str:
    """The run-ahead of plain decode windows, where it differs from the default."""
    if b.run_ahead == 1:
        return "; plain decode windows one at a time"
    return "" if b.run_ahead == 2 else f"; {b.run_ahead} plain decode windows in flight"


def floor_text(plan: LaunchPlan) -> str | None:
    """``spec.draft_floor`` in words where it is not the default (None where it is, or nothing drafts)."""
    s = plan.spec
    if not s.drafts or s.draft_floor == DEFAULT_DRAFT_FLOOR:
        return None
    if s.draft_floor > 0:
        return f"drafting pauses under {s.draft_floor:.0%} of proposals held"
    return "no acceptance floor" if s.adaptive_depth else "drafting never pauses"


def proposals_text(plan: LaunchPlan) -> str:
    """The solo window in words: ``window 4: token + up to 3 MTP proposals`` (``spec.adaptive_depth``: as
    many as pay), or ``... + 3 MTP proposals`` where every drafting window carries them all; by n-gram
    lookup, ``window 4: token + up to 3 proposals by n-gram lookup (2-4 tokens matched)``."""
    s = plan.spec
    most = f"{'up to ' if s.adaptive_depth else ''}{s.draft_tokens - 1}"
    if s.ngram:
        run = str(s.ngram_min) if s.ngram_min == s.ngram_max else f"{s.ngram_min}-{s.ngram_max}"
        return f"window {s.draft_tokens}: token + {most} proposals by n-gram lookup ({run} tokens matched)"
    return f"window {s.draft_tokens}: token + {most} MTP proposals"


def _spec_line(plan: LaunchPlan) -> str:
    s = plan.spec
    if not s.drafts:
        return "no drafting (the token alone)"
    line = f"{proposals_text(plan)} when one request runs alone"
    if s.ngram and plan.batch.slots > 1:
        line += ", and in the rows a window of several spares (up to 8)"
    floor = floor_text(plan)
    if floor is not None:
        line += f"; {floor}"
    if s.pipeline_windows:
        line += f"; {s.pipeline_windows} overlapped pipeline windows"
    if s.draft_head == "int8":
        mib = plan.model.facts.int8_head_bytes() / MIB
        line += f"; drafts through an 8-bit copy of the LM head ({mib:,.1f} MiB on the last stage)"
    return line


def _placement(plan: LaunchPlan) -> list[str]:
    by_index = {g.index: g for g in plan.machine.gpus}
    rows = [["GPU", "device", "card", "GB/s", "stage", "layers", "holds"]]
    for s in plan.stages:
        g = by_index[s.gpu]
        speed = f"{g.bandwidth_gbs:g}" + ("?" if g.bandwidth_estimated else "")
        rows.append([str(s.gpu), s.device, g.name, speed, str(s.index), _layers(s), holds_text(s)])
    for gp in plan.gpus:
        if gp.role != "stage":
            role = "expert helper" if gp.role == "helper" else "idle"
            speed = f"{by_index[gp.index].bandwidth_gbs:g}"
            rows.append([str(gp.index), gp.device, gp.name, speed, "-", "-", role])
    return table(rows, right=(3,))


def _experts_cell(g: GpuPlan) -> str:
    if g.experts_total == 0:
        return _mib(g.budget.experts)
    if g.role == "helper":
        return f"{_mib(g.budget.experts)} ({g.experts_resident} cached)"
    return f"{_mib(g.budget.experts)} ({g.experts_resident}/{g.experts_total})"


def _memory(plan: LaunchPlan) -> list[str]:
    rows = [
        [
            "GPU",
            "weights",
            "kv",
            "drafters",
            "workspace",
            "reserve",
            "experts (resident/all)",
            "free",
            "total",
        ]
    ]
    for g in plan.gpus:
        b = g.budget
        rows.append(
            [
                str(g.index),
                _mib(b.weights),
                _mib(b.kv),
                _mib(b.drafters),
                _mib(b.workspace),
                _mib(b.reserve),
                _experts_cell(g),
                _mib(b.free),
                _mib(b.total),
            ]
        )
    return [*table(rows, right=range(1, 9)), *workspace_lines(plan)]


def workspace_lines(plan: LaunchPlan) -> list[str]:
    """Each GPU's workspace by part, one line a GPU that has one."""
    out = []
    for g in plan.gpus:
        parts = g.budget.workspace_parts
        if parts:
            terms = " + ".join(f"{WORKSPACE_PARTS.get(k, k)} {_mib(v)}" for k, v in parts.items())
            out.append(f"workspace of GPU {g.index}: {terms} = {_mib(g.budget.workspace)} MiB")
    return out


def host_line(plan: LaunchPlan) -> str:
    """The host-memory budget in one line: the experts pinned there by GPU, the prefix store, the reserve,
    and the RAM."""
    h = plan.host
    if not h.total:
        return "host memory: no host tier (every routed expert is in VRAM), no prefix store"
    per_gpu = ", ".join(f"GPU {t.gpu} {_mib(t.bytes)}" for t in h.tiers if t.bytes)
    parts = [f"{_mib(h.experts)} MiB of experts pinned ({per_gpu})"] if h.experts else []
    if h.prefix_store:
        parts.append(f"{_mib(h.prefix_store)} MiB prefix store")
    line = f"host memory: {' + '.join(parts)} + {_mib(h.reserve)} reserve = {_mib(h.total + h.reserve)}"
    if h.ram is None:
        return line + "; RAM unknown, not checked (set machine.host_ram_mib)"
    source = "probed" if h.ram_source == "probe" else "machine.host_ram_mib"
    free = f"{_mib(h.free)} free" if h.free is not None else ""
    return line + f" of {_mib(h.ram)} RAM ({source}), {free}"


def decision_lines(decisions: Iterable[Decision]) -> list[str]:
    """Decisions, one per line; an asked-for setting that a rule overrode is marked ``!``."""
    rows = []
    for d in decisions:
        mark = ("! " if d.requested else "  ") + _MARK[d.severity]
        asked = f" (asked at {d.origin})" if d.requested and d.origin else ""
        rows.append([mark, d.rule, f"{d.message}{asked}"])
    return table(rows) if rows else []


def plan_text(plan: LaunchPlan) -> str:
    """The plan as `strata plan` prints it."""
    title = plan.profile + (f"  ({plan.profile_file})" if plan.profile_file else "")
    serve = (
        f"http://{plan.serve.host}:{plan.serve.port}  model {plan.serve.model_name!r}"
        + (f", API key from ${plan.serve.api_key_env}" if plan.serve.api_key_env else "")
        + (
            f", at most {plan.serve.max_queued} waiting for a slot"
            if plan.serve.max_queued is not None
            else ""
        )
        + (f", browsers from {', '.join(plan.serve.allowed_origins)}" if plan.serve.allowed_origins else "")
        + ("" if plan.serve.warm_up else ", no warm-up")
        + _recoveries(plan.serve.recoveries)
        + _step_timeout(plan.serve.step_timeout_s)
        if plan.serve
        else "no (one-shot generation profile)"
    )
    m = plan.memory
    reuse = "on" if m.prefix_reuse else "off"
    if m.prefix_store_mib and m.prefix_reuse:
        pages = plan.prefix_store_pages
        reuse += f" (store {m.prefix_store_mib} MiB in host memory: "
        reuse += (
            f"{pages * PREFIX_STORE_PAGE:,} positions of history)" if pages else "less than a page, none)"
        )
    lines = [
        title,
        f"  model   {_model_line(plan)}",
        f"  batch   {_batch_line(plan)}",
        f"  spec    {_spec_line(plan)}",
        f"  memory  {m.context} tokens per slot, KV {m.kv_dtype}, prefix reuse {reuse}, "
        f"prefill chunk {_chunk(m)}",
        f"  serve   {serve}",
        "",
        *_placement(plan),
        "",
        "MiB by purpose",
        *_memory(plan),
        host_line(plan),
    ]
    decisions = decision_lines(plan.decisions)
    if decisions:
        lines += ["", "decisions (! = overrides what the profile asked for)", *decisions]
    return "\n".join(lines) + "\n"


def _chunk(m: MemoryPlan) -> str:
    """The prefill chunk, a lone prompt's where it differs, the graph windows' share of short prompts
    where the prefill path reads some of them (``memory.prompt_graph_rows`` below 64), and the chunks the
    prefill path replays as graphs (``memory.prefill_graph_rows``)."""
    text = str(m.prefill_chunk)
    if m.prefill_chunk_alone != m.prefill_chunk:
        text += f" ({m.prefill_chunk_alone} for a prompt alone)"
    if m.prompt_graph_rows < PROMPT_GRAPH_MAX:
        text += f", graph windows up to {m.prompt_graph_rows} rows"
    if m.prefill_graph_rows:
        text += f", prefill graphs up to {m.prefill_graph_rows} rows"
    return text
