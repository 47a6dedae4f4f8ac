"""The expert cache's second tier on a real second GPU: one stage on cuda:0, cuda:1 as helper or peer device.

The stage's kernels read the helper tier's experts in cuda:1's memory over peer-to-peer. Greedy text must
equal the all-resident run's (and the VRAM-cache run's without a second tier) with prompts long enough for
the prefill path, in serial and batch-MTP windows; the device tables must point each expert at its VRAM
slot, its helper slot on cuda:1 or its host copy; and the kernels must count the reads each tier served
(the `gpu2` marker skips these with fewer than two GPUs).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu2]


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.runtime.deviceCanAccessPeer(0, 1):
        pytest.skip("cuda:0 cannot access cuda:1's memory: a helper tier is refused there")
    yield cupy
    for device in (0, 1):  # the engines capped each GPU's pool at its plan (2 MiB on cuda:1): lift it
        with cupy.cuda.Device(device):
            cupy.get_default_memory_pool().set_limit(size=0)


def _plan(
    cp,
    *,
    helper: str | None,
    cache: int | None,
    batch_mtp: bool = False,
    adapt: bool | None = None,
    draft_tokens: int = 3,
):
    from rt_plans import profile_text

    from strata_cfg.plan.from_profile import resolve_text

    vram = cp.cuda.runtime.memGetInfo()[1] // (1 << 20)
    kw = {"helpers": 1} if helper == "helper" else {"peer": True} if helper == "peer" else {}
    text = profile_text(
        preset="small",
        slots=2,
        groups=1,
        batch_mtp=batch_mtp,
        draft_tokens=draft_tokens,
        context=512,
        prefill_chunk=96,
        layer_scale=0.03,
        expert_cache=cache,
        adapt=adapt,
        helper_vram_mib=2,  # 10 experts of the small preset in fp16: most experts stay in host memory
        **kw,
    )
    gpu = '{ name = "virtual CPU device", vram_mib = 8192, bandwidth_gbs = 20 }'
    text = text.replace('backend = "cpu"', 'backend = "cuda"').replace(
        "[model]", '[model]\ndtype = "float16"'
    )
    text = text.replace(gpu, f'{{ name = "GPU", vram_mib = {vram}, bandwidth_gbs = 1000 }}')
    return resolve_text(text, "gpu2-tiers.toml").plan


PROMPTS = [
    tuple(int(t) for t in np.random.default_rng(7).integers(1, 250, 300)),  # 4 chunks: prefill path
    (72, 101, 108, 108, 111),
    tuple(int(t) for t in np.random.default_rng(8).integers(1, 250, 40)),
]


def _run(plan, prompts=PROMPTS, tokens: int = 24):
    """Greedy tokens of each prompt, each arriving two steps after the one before, and the engine."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    engine = Engine(plan)
    handles = []
    for i in range(100_000):
        if i % 2 == 0 and len(handles) < len(prompts):
            handles.append(engine.submit(Request(prompts[len(handles)], tokens)))
        if not engine.step() and len(handles) == len(prompts):
            break
    return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles], engine


def _check_tables(cp, stage) -> None:
    """Each expert's addresses: its VRAM slot's, its helper slot's (memory of cuda:1) or its host copy's."""
    from strata_runtime.experts.cache import HELPER, HOST

    store, tables = stage.experts, stage.cuda_experts
    gate_up, down, codes = (a.get() for a in (tables.gate_up, tables.down, tables.slot_of))
    r = store.residency
    want = np.where(r.slot_of >= 0, r.slot_of, np.where(r.helper_of >= 0, -2 - r.helper_of, -1))
    np.testing.assert_array_equal(codes, want)
    for j in range(len(store)):
        for e in range(store.n_experts):
            tier = store.tier(j, e)
            if tier == HOST:
                gu, dn = (a.ctypes.data for a in store.host_weights(j, e))
            else:
                gu, dn = (a.data.ptr for a in store.slot_weights(j, e))
                assert store.slot_weights(j, e)[0].device.id == (1 if tier == HELPER else 0)
            assert (int(gate_up[j, e]), int(down[j, e])) == (gu, dn)


@pytest.mark.parametrize("helper", ["helper", "peer"])
@pytest.mark.parametrize("batch_mtp", [False, True], ids=["serial", "batch-mtp"])
def test_greedy_text_with_a_helper_tier_on_the_second_gpu_equals_the_all_resident_run(cp, helper, batch_mtp):
    resident, engine = _run(_plan(cp, helper=None, cache=None, batch_mtp=batch_mtp))
    engine.close()
    vram_only, engine = _run(_plan(cp, helper=None, cache=5, batch_mtp=batch_mtp))
    engine.close()
    tiered, engine = _run(_plan(cp, helper=helper, cache=5, batch_mtp=batch_mtp))
    [stage] = engine.model.stages
    assert stage.cuda is not None and stage.cuda_experts is not None  # the CUDA path
    assert "peer access cuda:0 -> cuda:1: enabled" in engine.startup
    assert any("more in the helper tier (10 on cuda:1" in line for line in engine.startup), engine.startup
    assert all(len(t) == 24 for t in resident)
    assert tiered == vram_only, "a second tier changed a token against the VRAM cache alone"
    assert tiered == resident
    s = stage.experts.stats
    assert s.hits > 0 and s.helper_hits > 0 and s.host_reads > 0, s
    assert s.helper_bytes == s.helper_hits * stage.experts.expert_bytes > 0  # read over the peer link
    assert s.helper_swaps > 0 and s.peer_swap_bytes > 0, "experts moved into and out of the helper tier"
    cp.cuda.Device(0).synchronize()
    _check_tables(cp, stage)
    engine.close()


def test_the_kernels_count_the_reads_of_the_helper_tier(cp):
    """Graph windows only (prompts of at most 64 rows), a frozen cache: the device counters must hand the
    cache exactly each expert's count in its tier, and the helper tier must have served reads. No drafting:
    the MTP head's counts, from another stream, may race with a read of the counters."""
    from rt_engine_helpers import assert_reads_by_tier, handed_to_cache

    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    plan = _plan(cp, helper="peer", cache=5, adapt=False, draft_tokens=0)

    engine = Engine(plan)
    [stage] = engine.model.stages
    store = stage.experts
    tiers = store.residency.tiers()
    handed = handed_to_cache(store)
    for p in PROMPTS[1:]:
        engine.submit(Request(p, 40))
    while engine.step():
        pass
    assert sum(r.helper for _, r in handed if r is not None) > 0, "no read of the helper tier was counted"
    assert_reads_by_tier(handed, tiers)
    engine.close()
