"""Launch plans for runtime tests, resolved from profile text exactly as a user's profile would be.

`make_plan` writes a small profile (virtual CPU devices, a synthetic preset or a model directory, the split,
slots, groups, drafting, the expert cache and its helper or peer devices) and runs it through strata_cfg's
load -> facts -> resolve, so the runtime is tested on the plans users get. It checks that the resolver kept
what the test asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from strata_cfg.plan.from_profile import resolve_text
from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.presets import preset_config


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """First layer of each later stage, spread evenly over [2, n) (the resolver's rule: each at least 2)."""
    if n_stages == 1:
        return []
    return [2 + round((n_layers - 2) * i / (n_stages - 1)) for i in range(n_stages - 1)]


VIRTUAL_GPU = '{ name = "virtual CPU device", vram_mib = 8192, bandwidth_gbs = 20 }'
"""Each stage's device in `profile_text`."""


def profile_text(
    *,
    preset: str | None = "tiny",
    model_dir: str | Path | None = None,
    stages: int = 1,
    slots: int = 1,
    groups: int | None = None,
    batch_mtp: bool = False,
    draft_tokens: int = 0,
    context: int = 256,
    prefill_chunk: int = 64,
    prefill_chunk_alone: int | None = None,
    seed: int = 0,
    layer_scale: float | None = None,
    routing: str | None = None,
    serve: bool = False,
    expert_cache: int | None = None,
    adapt: bool | None = None,
    helpers: int = 0,
    peer: bool = False,
    helper_vram_mib: int = 8192,
    run_ahead: int | None = None,
    adaptive_depth: bool | None = None,
    cache_policy: dict[str, Any] | None = None,
    prefix_reuse: bool | None = None,
    prefix_store_mib: int | None = None,
) -> str:
    """``adaptive_depth`` False: every drafting solo window carries all its proposals (window shapes then
    do not depend on measured times). ``helpers``: helper GPUs (``experts.helper_devices``) after the
    stages' GPUs; ``peer``: a peer device (``experts.peer_device``) after them instead;
    ``helper_vram_mib``: the VRAM of each (the resolver fills a helper GPU with as many of the experts the
    stages lack as fit). ``cache_policy``: keys of the profile's ``[experts]`` table (``max_swaps`` ...).
    ``prefix_reuse``: ``memory.prefix_reuse`` (unset: the default, on); ``prefix_store_mib``:
    ``memory.prefix_store_mib``."""
    if model_dir is not None:
        n_layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
        model = f"path = {json.dumps(str(model_dir))}"
    else:
        assert preset is not None
        n_layers = preset_config(preset)["num_hidden_layers"]
        model = f'synthetic = "{preset}"\nseed = {seed}'
        if layer_scale is not None:
            model += f"\nlayer_scale = {layer_scale}"
        if routing is not None:
            model += f'\nrouting = "{routing}"'
    gpu = VIRTUAL_GPU
    extra = helpers + (1 if peer else 0)
    helper_gpu = f'{{ name = "virtual helper device", vram_mib = {helper_vram_mib}, bandwidth_gbs = 20 }}'
    lines = [
        'name = "test"',
        "[machine]",
        'backend = "cpu"',
        f"gpus = [{', '.join([gpu] * stages + [helper_gpu] * extra)}]",
        "[model]",
        model,
        "[batch]",
        f"slots = {slots}",
        f"mtp = {'true' if batch_mtp else 'false'}",
    ]
    lines += [f"run_ahead = {run_ahead}"] if run_ahead is not None else []
    if groups is not None:
        lines.append(f"groups = {groups}")
    if stages > 1:
        lines += ["[split]", f"layers = {even_split(n_layers, stages)}"]
    lines += ["[spec]", f"draft_tokens = {draft_tokens}"]
    if adaptive_depth is not None:
        lines.append(f"adaptive_depth = {str(adaptive_depth).lower()}")
    lines += ["[memory]", f"context = {context}", f"prefill_chunk = {prefill_chunk}", "vram_reserve_mib = 0"]
    lines += [f"prefill_chunk_alone = {prefill_chunk_alone}"] if prefill_chunk_alone is not None else []
    lines += [f"prefix_reuse = {str(prefix_reuse).lower()}"] if prefix_reuse is not None else []
    lines += [f"prefix_store_mib = {prefix_store_mib}"] if prefix_store_mib is not None else []
    if expert_cache is not None or adapt is not None or extra or cache_policy:
        lines += ["[experts]"]
        lines += [f"cache = {expert_cache}"] if expert_cache is not None else []
        lines += [f"adapt = {'true' if adapt else 'false'}"] if adapt is not None else []
        lines += [f"helper_devices = {list(range(stages, stages + helpers))}"] if helpers else []
        lines += [f"peer_device = {stages}"] if peer else []
        lines += [f"{key} = {json.dumps(value)}" for key, value in (cache_policy or {}).items()]
    if serve or batch_mtp:
        lines += ["[serve]"]
    return "\n".join(lines) + "\n"


def float16_profile_text(*, backend: str = "cuda", vram_mib: int | None = None, **kw: Any) -> str:
    """`profile_text` (same keywords) in float16 on ``backend``: the CUDA path, on the fake GPU or, with
    ``vram_mib`` (the real card's), on a GPU, each stage device then that card."""
    text = profile_text(**kw).replace('backend = "cpu"', f'backend = "{backend}"')
    text = text.replace("[model]", '[model]\ndtype = "float16"')
    if vram_mib is not None:
        text = text.replace(VIRTUAL_GPU, f'{{ name = "GPU", vram_mib = {vram_mib}, bandwidth_gbs = 1000 }}')
    return text


def make_plan(**kw: Any) -> LaunchPlan:
    """The resolved plan of `profile_text` (same keywords), checked to be what the test asked for."""
    plan = resolve_text(profile_text(**kw), "test.toml").plan
    slots = max(kw.get("slots", 1), 1)
    assert plan.batch.slots == slots, plan.decisions
    assert len(plan.stages) == kw.get("stages", 1)
    assert plan.batch.mtp == kw.get("batch_mtp", False), [d.message for d in plan.decisions]
    if kw.get("groups"):
        assert plan.batch.groups == kw["groups"], [d.message for d in plan.decisions]
    assert plan.spec.mtp == (kw.get("draft_tokens", 0) >= 2)
    extra = kw.get("helpers", 0) + (1 if kw.get("peer") else 0)
    assert [g.role for g in plan.gpus] == ["stage"] * kw.get("stages", 1) + ["helper"] * extra
    return plan


def pipelined_mtp_plan(**kw: Any) -> LaunchPlan:
    """The plan `batch.mtp_in_groups = true` resolves to for the keywords of `make_plan` (``groups`` > 1 on
    a split, ``draft_tokens`` >= 2 so that the model carries its MTP head)."""
    return with_mtp_in_groups(make_plan(**kw))


def with_mtp_in_groups(plan: LaunchPlan) -> LaunchPlan:
    """A pipelined plan with batch MTP inside each group, as `batch.mtp_in_groups = true` resolves: 2 rows
    per slot, at most 4 slots per group, drafters for every slot on the last stage."""
    b = plan.batch
    assert b.mode == "pipelined" and b.groups > 1 and plan.spec.mtp, "pipelined MTP needs groups and drafting"
    per_group = b.slots // b.groups
    assert per_group <= 4, "a group's batch-MTP window holds at most 4 slots"
    update = {"mtp": True, "mtp_in_groups": True, "rows_per_slot": 2, "slots_per_window": per_group}
    return plan.model_copy(update={"batch": b.model_copy(update=update)})
