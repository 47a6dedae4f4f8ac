"""Turning a plan into what people read: the `strata plan` text, problems, and the engine command line.

The text is for a new user: one line per topic, a placement table and a memory table with one row per GPU,
then the decisions, with the features the user asked for that were turned off marked so they stand out.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from typing import Any

from .schema.errors import Problem
from .schema.plan import MIB, Decision, GpuPlan, LaunchPlan, StagePlan

ENGINE = "strata-engine"
"""The reference engine's command, for ``--emit engine-args``."""
_HOLDS = {
    "embedding": "embedding",
    "final_norm": "final norm",
    "lm_head": "LM head",
    "mtp": "MTP head",
}
_MARK = {"error": "ERROR", "off": "OFF", "clamp": "CLAMP", "warn": "WARN", "note": "note"}


def table(rows: Sequence[Sequence[str]], right: Iterable[int] = ()) -> list[str]:
    """Rows of cells as aligned text lines (columns in ``right`` are right-aligned)."""
    right = set(right)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _layers(stage: StagePlan) -> str:
    a, b = stage.layers
    return f"{a}-{b - 1} ({b - a})"


def _slots(ids: Sequence[int]) -> str:
    if len(ids) > 2 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(str(i) for i in ids)


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
    return f"{name}, {f.dtype}, {f.num_hidden_layers} layers{experts}{mtp}"


def _batch_line(plan: LaunchPlan) -> str:
    b = plan.batch
    if b.mode == "solo":
        return "1 slot: one request at a time (no batching)"
    if b.mode == "pipelined":
        how = f"{b.groups} pipelined groups of {b.slots // b.groups} ({b.groups} windows in flight)"
    else:
        how = "1 group (serial windows)"
    mtp = (
        f"batch MTP on: each slot sends its token + 1 proposal, {b.slots_per_window} slots per window"
        if b.mtp
        else "batch MTP off"
    )
    return f"{b.slots} slots, {how}; {mtp}"


def _spec_line(plan: LaunchPlan) -> str:
    s = plan.spec
    if not s.mtp:
        return "no drafting (the token alone)"
    line = f"window {s.draft_tokens}: token + {s.draft_tokens - 1} MTP proposals when one request runs alone"
    if s.pipeline_windows:
        line += f"; {s.pipeline_windows} overlapped pipeline windows"
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
    return table(rows, right=range(1, 9))


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
        if plan.serve
        else "no (one-shot generation profile)"
    )
    m = plan.memory
    lines = [
        title,
        f"  model   {_model_line(plan)}",
        f"  batch   {_batch_line(plan)}",
        f"  spec    {_spec_line(plan)}",
        f"  memory  {m.context} tokens per slot, KV {m.kv_dtype}, prefill chunk {m.prefill_chunk}",
        f"  serve   {serve}",
        "",
        *_placement(plan),
        "",
        "MiB by purpose",
        *_memory(plan),
    ]
    decisions = decision_lines(plan.decisions)
    if decisions:
        lines += ["", "decisions (! = overrides what the profile asked for)", *decisions]
    return "\n".join(lines) + "\n"


def problems_text(problems: Iterable[Problem]) -> str:
    """Problems one per line: ``file:line: key: message [rule]``."""
    return "\n".join(str(p) + (f"  [{p.rule}]" if p.rule else "") for p in problems) + "\n"


def problems_json(problems: Iterable[Problem]) -> dict[str, Any]:
    """The JSON a refused profile prints: ``{"errors": [{file, line, key, message}, ...]}``."""
    return {"errors": [p.to_json() for p in problems]}


def engine_args(plan: LaunchPlan) -> list[str]:
    """The Strata engine command line equivalent to the plan, with every value resolved (no ``auto``)."""
    args = [ENGINE, "--model", plan.model.path or f"synthetic:{plan.model.synthetic}"]
    if len(plan.stages) > 1:
        args += ["--layer-split", ",".join(str(s.layers[0]) for s in plan.stages[1:])]
        args += ["--split-device", ",".join(str(s.gpu) for s in plan.stages)]
    b = plan.batch
    args += ["--batch", str(b.slots), "--batch-groups", str(b.groups)]
    if b.mtp:
        args.append("--batch-mtp")
    args += ["--spec", str(plan.spec.draft_tokens)]
    m = plan.memory
    reserve = str(m.vram_reserve_mib)
    if m.vram_reserve_later_mib != m.vram_reserve_mib:
        reserve += f",{m.vram_reserve_later_mib}"
    args += ["--vram-reserve-mib", reserve, "--max-context", str(m.context), "--kv", m.kv_dtype]
    e = plan.experts
    if e.cache is not None:
        args += ["--expert-cache", str(e.cache)]
    for i, d in enumerate(e.helper_devices, start=1):
        args += [f"--expert-cache-device{i}", str(d)]
    if e.remote_opt:
        args.append("--remote-expert-opt")
    if plan.spec.pipeline_windows:
        args += ["--pipeline-windows", str(plan.spec.pipeline_windows)]
    if e.peer_device is not None:
        args += ["--peer-device", str(e.peer_device)]
    if plan.serve:
        args += ["--serve", "--host", plan.serve.host, "--port", str(plan.serve.port)]
    return args


def engine_args_text(plan: LaunchPlan) -> str:
    return shlex.join(engine_args(plan)) + "\n"
