"""What changes between two plans (`strata diff`, the TUI's diff page): values that differ, a whole stage
or GPU when only one plan has it, and decisions added or removed."""

from __future__ import annotations

import json
from typing import Any

from ..schema.plan import LaunchPlan

IGNORED = ("settings", "decisions", "profile_file")
"""Plan fields not compared value by value (decisions are compared as a set)."""


_ABSENT = object()


def _plain(plan: LaunchPlan) -> dict[str, Any]:
    """The plan's JSON without what is not compared (budgets in bytes: their MiB are compared)."""
    out = {k: v for k, v in plan.to_json().items() if k not in IGNORED}
    out["gpus"] = [{k: v for k, v in g.items() if k != "budget"} for g in out["gpus"]]
    return out


def _walk(a: Any, b: Any, path: str, out: list[dict[str, Any]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            _walk(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else k, out)
    elif isinstance(a, list) and isinstance(b, list) and any(isinstance(v, dict) for v in [*a, *b]):
        for i in range(max(len(a), len(b))):
            _walk(a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, f"{path}.{i}", out)
    elif a != b:
        out.append({"path": path, "a": None if a is _ABSENT else a, "b": None if b is _ABSENT else b})


def plan_changes(a: LaunchPlan, b: LaunchPlan) -> dict[str, Any]:
    """What differs between two plans: changed values (a whole stage or GPU when only one plan has it)
    and decisions added or removed."""
    changed: list[dict[str, Any]] = []
    _walk(_plain(a), _plain(b), "", changed)
    da = {(d.rule, d.key, d.message) for d in a.decisions}
    db = {(d.rule, d.key, d.message) for d in b.decisions}

    def listed(plan: LaunchPlan, keep: set[tuple[str, str, str]]) -> list[dict[str, Any]]:
        return [d.model_dump(mode="json") for d in plan.decisions if (d.rule, d.key, d.message) in keep]

    return {
        "changed": changed,
        "decisions_added": listed(b, db - da),
        "decisions_removed": listed(a, da - db),
    }


def changes_text(changes: dict[str, Any], a_name: str, b_name: str) -> str:
    lines = [f"--- {a_name}", f"+++ {b_name}"]
    if not any(changes.values()):
        return "\n".join([*lines, "no change in the plan"]) + "\n"
    width = max((len(c["path"]) for c in changes["changed"]), default=0)
    for c in changes["changed"]:
        a, b = (json.dumps(c[k], separators=(", ", ": ")) for k in ("a", "b"))
        lines.append(f"  {c['path']:<{width}}  {a} -> {b}")
    for d in changes["decisions_removed"]:
        lines.append(f"- {d['severity']:<5} {d['rule']}: {d['message']}")
    for d in changes["decisions_added"]:
        lines.append(f"+ {d['severity']:<5} {d['rule']}: {d['message']}")
    return "\n".join(lines) + "\n"
