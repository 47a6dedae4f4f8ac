"""The continuous pipeline on two real GPUs: greedy text, overlap, peer access, the hand-off and VRAM.

Each test splits a model over cuda:0 and cuda:1 (the `gpu2` marker skips them with fewer GPUs). Greedy text
must be the same in serial, pipelined, batch-MTP and pipelined-MTP windows, with requests arriving staggered
and prompts long enough to take the prefill path in several chunks, and the same as on one GPU; pipelined
windows must really be in flight together; peer access must really be enabled; and each GPU must hold within
5% of what the plan budgets, after load and after a request that fills the context.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu2]


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _plan(cp, *, stages: int = 2, slots: int = 4, groups: int | None = 1, batch_mtp: bool = False):
    from rt_plans import float16_profile_text

    from strata_cfg.plan.from_profile import resolve_text

    vram = cp.cuda.runtime.memGetInfo()[1] // (1 << 20)
    text = float16_profile_text(
        vram_mib=vram,
        preset="small",
        stages=stages,
        slots=slots,
        groups=groups,
        batch_mtp=batch_mtp,
        draft_tokens=3,
        context=512,
        prefill_chunk=96,
        layer_scale=0.03,
    )
    return resolve_text(text, "gpu2.toml").plan


def _plans(cp) -> dict:
    from rt_plans import with_mtp_in_groups

    return {
        "one GPU": _plan(cp, stages=1),
        "serial": _plan(cp),
        "pipelined": _plan(cp, groups=2),
        "batch-mtp": _plan(cp, batch_mtp=True),
        "pipelined-mtp": with_mtp_in_groups(_plan(cp, groups=2)),
    }


PROMPTS = [
    tuple(int(t) for t in np.random.default_rng(7).integers(1, 250, 300)),  # 4 chunks: prefill path
    (72, 101, 108, 108, 111),
    tuple(int(t) for t in np.random.default_rng(8).integers(1, 250, 130)),
    (87, 111, 114, 108, 100, 33),
    tuple(range(40, 110)),
]


def _run(plan, prompts=PROMPTS, tokens: int = 24):
    """Greedy tokens of each prompt, each arriving three steps after the one before; the engine; and the
    most windows it had in flight at once."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    engine = Engine(plan)
    handles, most = [], 0
    for i in range(100_000):
        if i % 3 == 0 and len(handles) < len(prompts):
            handles.append(engine.submit(Request(prompts[len(handles)], tokens)))
        busy = engine.step()
        most = max(most, len(engine._flights))
        if not busy and len(handles) == len(prompts):
            break
    out = [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]
    return out, engine, most


def test_greedy_text_is_the_same_in_every_mode_on_two_gpus(cp) -> None:
    texts = {}
    for name, plan in _plans(cp).items():
        texts[name], engine, most = _run(plan)
        assert all(s.cuda is not None for s in engine.model.stages), name  # the CUDA path, not the array path
        if name.startswith("pipelined"):  # a thread per stage, and windows really in flight together
            assert engine.executor._workers is not None and most >= 2, name
        if name.endswith("mtp"):
            assert engine.totals["accepted"] > 0, name
        engine.close()
    assert all(len(t) == 24 for t in texts["one GPU"])
    for name, text in texts.items():
        assert text == texts["one GPU"], name


def test_peer_access_is_really_enabled_between_the_stage_gpus(cp) -> None:
    from strata_runtime.backend import Device, peer_access_enabled
    from strata_runtime.engine import Engine

    engine = Engine(_plan(cp, groups=2))
    a, b = Device.parse("cuda:0"), Device.parse("cuda:1")
    if not cp.cuda.runtime.deviceCanAccessPeer(0, 1):
        pytest.skip("these two GPUs cannot access each other's memory")
    assert "peer access cuda:0 -> cuda:1: enabled" in engine.startup
    assert peer_access_enabled(a, b) and peer_access_enabled(b, a)  # asking again: already enabled
    engine.close()


def test_the_handoff_workload_measures_the_link_both_ways(cp) -> None:
    from strata_runtime.bench.handoff import run_handoff

    res = run_handoff(_plan(cp))
    (pair,) = res["pairs"]
    assert pair["src"] == "cuda:0" and pair["dst"] == "cuda:1"
    for state in ("peer", "no_peer") if pair["peer_supported"] else ("no_peer",):
        figures = pair[state]
        for what in ("row", "window", "large"):
            assert figures[what]["us"] > 0 and figures[what]["gb_s"] > 0
        assert figures["chained"]["until_done_us"] >= figures["chained"]["host_queue_us"] > 0
    if pair["peer_supported"]:
        assert pair["peer"]["large"]["gb_s"] > pair["no_peer"]["large"]["gb_s"]
        from strata_runtime.backend import Device, peer_access_enabled

        assert peer_access_enabled(Device.parse("cuda:1"), Device.parse("cuda:0"))  # left enabled


@pytest.mark.slow
def test_vram_per_gpu_stays_within_5_percent_of_the_plan(cp) -> None:
    """The 2x H200 profile's split of the qwen3-30b-a3b shape: what each GPU holds after load and after a
    request that fills the 8k context, against the plan's budget less free and reserve."""
    from strata_cfg.plan.from_profile import resolve_path
    from strata_runtime.bench.vram import run_vram

    plan = resolve_path("profiles/h200-x2.toml", sets=["model.layer_scale=0.03"]).plan
    res = run_vram(plan, [0, 1])
    for g in res["gpus"]:
        assert abs(g["load_vs_plan"]) <= 0.05, g
        assert abs(g["full_context_vs_plan"]) <= 0.05, g
        assert g["pool_total_mib"] <= g["pool_peak_mib"] <= g["pool_cap_mib"], g


def test_schema_replies_in_pipelined_groups_run_ahead_with_the_hosts_text(cp):
    """Greedy replies under a JSON schema beside a free request, in pipelined groups over two GPUs (each
    stage queued by a thread of its own): their rows masked and chosen on the device, each group's windows
    running ahead (the masks computed on the last stage's thread from the tokens the window before chose),
    give the host's own choice from the logits, and the windows really were chained."""
    import json

    from rt_engine_helpers import chained_grammar_windows, launches

    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine
    from strata_runtime.structured import json_grammar

    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "maximum": 99}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    shaped = SamplingParams(grammar=json_grammar(schema))
    plan = _plan(cp, groups=2)
    plan = plan.model_copy(update={"batch": plan.batch.model_copy(update={"run_ahead": 3})})
    assert plan.batch.mode == "pipelined"
    engine = Engine(plan)
    seen = launches(engine)
    texts = {}
    for on_device in (False, True):
        engine.masks_on_device = on_device
        handles = [
            engine.submit(Request(PROMPTS[1], 40, shaped)),
            engine.submit(Request(PROMPTS[3], 40, shaped)),
            engine.submit(Request(PROMPTS[2], 24)),
        ]
        while engine.step():
            pass
        texts[on_device] = [[t for ev in list(h.events.queue) for t in ev.token_ids] for h in handles]
        assert all(list(h.events.queue)[-1].error is None for h in handles)
    assert texts[True] == texts[False]
    assert chained_grammar_windows(seen)
    for tokens in texts[True][:2]:
        assert set(json.loads(bytes(tokens))) == {"word", "n"}
