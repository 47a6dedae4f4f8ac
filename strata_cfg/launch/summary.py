"""What `strata launch` and the TUI's launch page say about a plan before it starts and once it serves:
a short summary, the decisions a user must see, and how to call the engine."""

from __future__ import annotations

import json

from ..schema.plan import LaunchPlan
from ..schema.profile import is_loopback
from .preflight import base_url


def summary(plan: LaunchPlan) -> list[str]:
    """A few lines: model, stages, batching, context, address."""
    model = plan.model.path or f"synthetic `{plan.model.synthetic}` (seed {plan.model.seed})"
    lines = [f"profile {plan.profile}: {model}, {plan.model.facts.num_hidden_layers} layers"]
    for st in plan.stages:
        extra = f" + {', '.join(st.holds)}" if st.holds else ""
        lines.append(f"  stage {st.index} on {st.device}: layers {st.layers[0]}-{st.layers[1] - 1}{extra}")
    b = plan.batch
    mtp = "on" if b.mtp else "off"
    lines.append(f"  batch: {b.slots} slot(s), {b.groups} group(s), {b.mode}, batch MTP {mtp}")
    lines.append(
        f"  spec: {plan.spec.draft_tokens} draft tokens{' by n-gram lookup' if plan.spec.ngram else ''}; "
        f"context {plan.memory.context} tokens per slot"
    )
    if plan.serve is not None:
        key = f", API key from ${plan.serve.api_key_env}" if plan.serve.api_key_env else ", no API key"
        bind = "" if is_loopback(plan.serve.host) else f" (listening on {plan.serve.host}:{plan.serve.port})"
        cap = plan.serve.max_queued
        queue = "" if cap is None else f"; at most {cap} request(s) waiting for a slot, then 429"
        if plan.serve.allowed_origins:
            queue += f"; browsers from {', '.join(plan.serve.allowed_origins)}"
        lines.append(
            f"  serve: {base_url(plan.serve)}/v1{bind} as model `{plan.serve.model_name}`{key}{queue}"
        )
    return lines


def notices(plan: LaunchPlan) -> list[str]:
    """What a user must see before launching: anything they asked for that a rule changed, and warnings."""
    out = []
    for d in plan.decisions:
        if d.requested and d.severity in ("off", "clamp", "error"):
            where = f" (asked at {d.origin})" if d.origin else ""
            out.append(f"  {d.severity.upper()} {d.key}: {d.message}{where} [{d.rule}]")
        elif d.severity == "warn":  # e.g. a non-loopback serve.host without an API key
            out.append(f"  WARN {d.key}: {d.message} [{d.rule}]")
    return out


def client_snippet(plan: LaunchPlan) -> list[str]:
    """How to call the engine: curl and the OpenAI Python client."""
    assert plan.serve is not None
    url = base_url(plan.serve)
    env = plan.serve.api_key_env
    auth = f' -H "Authorization: Bearer ${env}"' if env else ""
    body = json.dumps(
        {"model": plan.serve.model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}
    )
    key = f'os.environ["{env}"]' if env else '"none"'
    return [
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"       -d '{body}'",
        f'  python: OpenAI(base_url="{url}/v1", api_key={key})',
    ]
