"""One resolved key in words (`strata explain`, the TUI's explain page): its value, where it came from,
what was asked for, the rules that touched it and the decisions they made."""

from __future__ import annotations

import json

from ..schema.plan import LaunchPlan
from .plan_text import decision_lines


def explain_text(plan: LaunchPlan, key: str) -> str | None:
    """The explanation of ``key`` (or of every key under a table such as ``batch``); None if unknown."""
    keys = [k for k in plan.settings if k == key or k.startswith(key + ".")]
    if not keys:
        return None
    lines: list[str] = []
    for k in keys:
        s = plan.settings[k]
        lines.append(f"{k} = {json.dumps(s.value)}")
        lines.append(f"  source     {s.source}")
        if s.requested is not None:
            lines.append(f"  asked for  {json.dumps(s.requested)}")
        if s.rules:
            lines.append(f"  rules      {', '.join(s.rules)}")
        fired = [d for d in plan.decisions if d.key == k]
        if fired:
            lines.append("  decisions")
            lines += ["    " + line for line in decision_lines(fired)]
    return "\n".join(lines) + "\n"
