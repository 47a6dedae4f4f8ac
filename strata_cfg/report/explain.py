"""One resolved key in words (`strata explain`, the TUI's explain page): its value, where it came from,
what was asked for, the gates and rules that touched it, the decisions made about it, and the effects it
had on other keys (``batch.groups = 2`` turned ``batch.mtp`` off).

The GPUs of ``[machine] gpus`` are not resolved settings; ``machine.gpus`` (or one entry, ``machine.gpus.1``)
explains them from the plan: what each GPU is used for and its budget.
"""

from __future__ import annotations

import json
import re

from ..schema.plan import MIB, Decision, GpuPlan, LaunchPlan, Setting
from .plan_text import decision_lines

_GPU_KEY = re.compile(r"^machine\.gpus(?:\.(\d+))?(?:\..*)?$")


def explain_text(plan: LaunchPlan, key: str) -> str | None:
    """The explanation of ``key`` (or of every key under a table such as ``batch``); None if unknown."""
    gpus = _gpus_text(plan, key)
    keys = [k for k in plan.settings if k == key or k.startswith(key + ".")]
    if not keys and gpus is None:
        return None
    lines: list[str] = []
    for k in keys:
        lines += setting_lines(plan, k)
    if gpus is not None:
        lines += gpus
    return "\n".join(lines) + "\n"


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
