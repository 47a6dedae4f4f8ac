"""One resolved key in words (`strata explain`, the TUI's explain page): its value, where it came from,
what was asked for, the gates and rules that touched it, the decisions made about it, and the effects it
had on other keys (``batch.groups = 2`` turned ``batch.mtp`` off).

The GPUs of ``[machine] gpus`` are not resolved settings; ``machine.gpus`` (or one entry, ``machine.gpus.1``)
explains them from the plan: what each GPU is used for and its budget. ``host`` explains the host-memory
budget, and so do the keys it is checked with (``machine.host_ram_mib``, ``memory.host_reserve_mib``).
"""

from __future__ import annotations

import json
import re

from ..schema.plan import MIB, Decision, GpuPlan, LaunchPlan, Setting
from .plan_text import decision_lines

_GPU_KEY = re.compile(r"^machine\.gpus(?:\.(\d+))?(?:\..*)?$")
HOST_KEYS = ("host", "machine", "machine.host_ram_mib", "memory", "memory.host_reserve_mib")
"""Keys whose explanation ends with the host-memory budget (``host`` is that budget alone)."""


def explain_text(plan: LaunchPlan, key: str) -> str | None:
    """The explanation of ``key`` (or of every key under a table such as ``batch``); None if unknown."""
    gpus = _gpus_text(plan, key)
    keys = [k for k in plan.settings if k == key or k.startswith(key + ".")]
    if not keys and gpus is None and key not in HOST_KEYS:
        return None
    lines: list[str] = []
    for k in keys:
        lines += setting_lines(plan, k)
    if gpus is not None:
        lines += gpus
    if key in HOST_KEYS:
        lines += host_lines(plan)
    return "\n".join(lines) + "\n"


def host_lines(plan: LaunchPlan) -> list[str]:
    """The host-memory budget: each GPU's experts in pinned host memory, the reserve, the RAM."""
    h = plan.host
    lines = ["host memory (experts kept in pinned host memory when a GPU cannot hold them all)"]
    for t in h.tiers:
        what = f"{t.experts} experts, {t.bytes / MIB:.1f} MiB" if t.experts else "none"
        lines.append(f"  GPU {t.gpu:<6} {what}")
    lines.append(f"  reserve    {h.reserve / MIB:.1f} MiB (memory.host_reserve_mib)")
    if h.ram is None:
        lines.append("  RAM        unknown: not checked (set machine.host_ram_mib, or probe = true)")
    else:
        source = "probed from /proc/meminfo" if h.ram_source == "probe" else "machine.host_ram_mib"
        free = f", {h.free / MIB:.1f} free" if h.free is not None else ""
        lines.append(f"  RAM        {h.ram / MIB:.1f} MiB ({source}){free}")
    return lines


def setting_lines(plan: LaunchPlan, key: str) -> list[str]:
    """One resolved setting: value, source, request, gates, rules, decisions on it, effects of it."""
    s = plan.settings[key]
    lines = [f"{key} = {json.dumps(s.value)}", f"  source     {s.source}"]
    if s.requested is not None:
        lines.append(f"  asked for  {json.dumps(s.requested)}")
    if s.gates:
        lines.append(f"  {_gates_line(s)}")
    others = [r for r in s.rules if r not in s.gates]
    if others:
        lines.append(f"  rules      {', '.join(others)}")
    fired = [d for d in plan.decisions if d.key == key]
    if fired:
        lines.append("  decisions")
        lines += ["    " + line for line in decision_lines(fired)]
    effects = [d for d in plan.decisions if key in d.because and d.key != key]
    if effects:
        lines.append("  effects")
        lines += [f"    {_effect(plan, d)}" for d in effects]
    return lines


def _gates_line(s: Setting) -> str:
    """``on: every gate passed``, or which gate turned the feature off after how many passed."""
    n = len(s.gates)
    if s.source.rule in s.gates:
        passed = n - 1
        before = f"; the {passed} before it passed" if passed else ""
        return f"off        turned off by the gate {s.source.rule}{before}"
    return f"on         every gate passed ({n} checked)" if s.value else f"off        ({n} gates checked)"


def _effect(plan: LaunchPlan, d: Decision) -> str:
    """What a decision this key caused did to another key, in one line."""
    target = plan.settings.get(d.key)
    if d.severity == "off":
        what = f"turned {d.key} off"
    elif target is not None and target.source.rule == d.rule:
        what = f"made {d.key} = {json.dumps(target.value)}"
    else:
        what = f"{d.severity} on {d.key}"
    return f"{what} (rule {d.rule}): {d.message}"


def _gpus_text(plan: LaunchPlan, key: str) -> list[str] | None:
    """``machine.gpus``, one entry of it, or the whole ``machine`` table: each GPU and its use."""
    m = _GPU_KEY.match(key)
    if key == "machine":
        wanted = [g.index for g in plan.machine.gpus]
    elif m is not None:
        wanted = [int(m.group(1))] if m.group(1) is not None else [g.index for g in plan.machine.gpus]
    else:
        return None
    facts = {g.index: g for g in plan.machine.gpus}
    used = {g.index: g for g in plan.gpus}
    if any(i not in facts for i in wanted):
        return None
    source = (
        "the profile's [machine] gpus"
        if plan.machine.source == "profile"
        else "probed with nvidia-smi on this machine"
    )
    lines = []
    for i in wanted:
        g = facts[i]
        speed = f"{g.bandwidth_gbs:g} GB/s" + (" (an estimate)" if g.bandwidth_estimated else "")
        lines += [
            f"machine.gpus.{i} = {g.name}, {g.vram_mib} MiB, {speed}",
            f"  source     {source}",
            f"  device     {plan.machine.device_name(i)}",
            f"  role       {_role(plan, used[i])}",
            f"  MiB        {_budget(used[i])}",
        ]
    return lines


def _role(plan: LaunchPlan, g: GpuPlan) -> str:
    if g.role == "stage":
        stages = [plan.stages[i] for i in g.stages]
        parts = [f"stage {s.index} (layers {s.layers[0]}-{s.layers[1] - 1})" for s in stages]
        experts = f"; {g.experts_resident} of its {g.experts_total} routed experts in VRAM"
        return ", ".join(parts) + (experts if g.experts_total else "")
    if g.role == "helper":
        return f"expert helper: caches {g.experts_resident} experts the stages could not hold"
    return "idle: no stage and no experts"


def _budget(g: GpuPlan) -> str:
    b = g.budget
    terms = [f"{n} {getattr(b, n) / MIB:.1f}" for n in b.TERMS if getattr(b, n) or n == "free"]
    return ", ".join(terms) + f" of {b.total / MIB:.1f}"
