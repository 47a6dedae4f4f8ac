"""A cache that keeps its misses, on a real GPU: ``moe_admit`` and the expert kernels that write what they
read, step for step against their NumPy twin (`strata_runtime.reference.keep.moe_admit`).

A stage's store of three layers under a cache of a third of its experts, its queue of victims made from
random scores, runs windows of 1 to 8 rows through `Kernels.moe`: after each layer the device's tables,
``fill``, queue and counters must equal the twin's run on copies of them, the layer's output the float32
reference's, and at the end every slot the tables or ``fill`` give an expert must hold its weights, byte
for byte. Two shapes: one the wide kernels take (H and I multiples of 256), one they do not (the ``_any``
kernels).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

MIRRORED = (
    "gate_up",
    "down",
    "slot_of",
    "fill",
    "host_gate_up",
    "host_down",
    "slot_gate_up",
    "slot_down",
    "victims",
    "victim_keys",
    "queue",
    "misses",
)
"""The `CudaExperts` arrays ``moe_admit`` reads or writes."""


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _store(cp, h: int, inter: int, n_exp: int, layers: int, rng: np.random.Generator):
    from strata_runtime.backend import Device
    from strata_runtime.experts.cache import Policy
    from strata_runtime.experts.host import host_empty
    from strata_runtime.experts.store import ExpertStore

    gate_up, down = [], []
    for _ in range(layers):
        gu = host_empty((n_exp, 2 * inter, h), np.float16, pinned=True)
        dn = host_empty((n_exp, h, inter), np.float16, pinned=True)
        gu[...] = (0.05 * rng.standard_normal(gu.shape)).astype(np.float16)
        dn[...] = (0.05 * rng.standard_normal(dn.shape)).astype(np.float16)
        gate_up.append(gu)
        down.append(dn)
    slots = layers * n_exp // 3
    policy = Policy(keep_misses=True, max_swaps=slots)
    return ExpertStore(Device("cuda", 0), list(range(layers)), gate_up, down, slots, policy)


def _mirror(tables) -> SimpleNamespace:
    return SimpleNamespace(**{name: getattr(tables, name).get() for name in MIRRORED})


def _new_queue(cp, tables, rng: np.random.Generator, learned: bool) -> None:
    """A queue from random scores, over the host's tables as they stand (``learned``: after taking the
    device's, which hold experts being kept; else stale ones, whose evicted experts the admission must pass
    over)."""
    from strata_runtime.reference.keep import held

    r = tables.store.residency
    if learned:
        r.learn(held(tables.slot_of.get(), tables.fill.get()))
    r.scores[...] = rng.random(r.scores.shape)
    r.queue = r.victims()
    tables._upload_queue(cp.cuda.get_current_stream())


@pytest.mark.parametrize("warm", ["off", "8", "8/early"])
@pytest.mark.parametrize("shape", [(256, 256, 32, 4), (64, 64, 12, 3)], ids=["wide", "any"])
def test_the_admission_and_the_expert_kernels_keep_misses_as_their_numpy_twin_does(cp, shape, warm):
    """The admission and the expert kernels of a cache that keeps its misses keep, count and sum as their
    NumPy twins, also where the down products bring other weights into L2 (``warm``, the policy in force:
    another instantiation of the down kernel)."""
    from strata_runtime.cuda.choices import L2Warm, l2_warm
    from strata_runtime.cuda.experts import CudaExperts
    from strata_runtime.cuda.ops import kernels_for
    from strata_runtime.reference import kernels as ref
    from strata_runtime.reference.keep import held, moe_admit

    h, inter, n_exp, topk = shape
    layers = 3
    rng = np.random.default_rng(17)
    store = _store(cp, h, inter, n_exp, layers, rng)
    tables = CudaExperts(store, 0)
    kern = kernels_for(0)
    norm = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float16)
    kept = 0
    heat = cp.asarray(
        np.random.default_rng(18).standard_normal((4 * h, h)).astype(np.float16)
    )  # "next layer"
    with l2_warm(L2Warm.parse(warm)):
        for w, rows in enumerate((1, 4, 1, 8, 2, 1, 8, 1)):
            if w % 3 == 0:
                _new_queue(cp, tables, rng, learned=w > 0 and w % 2 == 0)
            for j in range(layers):
                x = rng.standard_normal((rows, h)).astype(np.float32)
                logits = rng.standard_normal((rows, n_exp)).astype(np.float32)
                resid = cp.zeros((rows, h), cp.float32)
                idx, wts = cp.zeros((rows, topk), cp.int32), cp.zeros((rows, topk), cp.float32)
                h_buf = cp.zeros((rows * topk, inter), cp.float32)
                twin = _mirror(tables)
                experts = tables.layers[j]
                kern.moe(
                    cp.asarray(x),
                    cp.asarray(norm),
                    cp.asarray(logits),
                    True,
                    1e-6,
                    experts,
                    resid,
                    idx,
                    wts,
                    h_buf,
                    warm=heat,
                )
                cp.cuda.Device(0).synchronize()
                moe_admit(SimpleNamespace(owner=twin, layer=j), idx.get())
                for name in MIRRORED:  # the counters' first two columns are the expert kernels' counts
                    got, want = getattr(tables, name).get(), getattr(twin, name)
                    if name == "misses":
                        got, want = got[:, 2], want[:, 2]
                    np.testing.assert_array_equal(got, want, err_msg=f"{name}, window {w}, layer {j}")
                # The layer's output against the float32 reference over the experts' own weights.
                want = np.zeros((rows, h), np.float32)
                own = SimpleNamespace(weights=lambda e, j=j: store.host_weights(j, e), counts=None)
                ref.moe(
                    x,
                    norm,
                    logits,
                    True,
                    1e-6,
                    own,
                    want,
                    *(np.zeros(a.shape, a.dtype) for a in (idx, wts, h_buf)),
                )
                np.testing.assert_allclose(resid.get(), want, rtol=2e-3, atol=2e-3)
            kept = int(tables.misses[:, 2].sum())
    assert kept > 0, "no expert was kept"
    slots = held(tables.slot_of.get(), tables.fill.get())
    assert sorted(slots[slots >= 0].tolist()) == list(range(store.slots))  # each slot held once
    for j, e in zip(*np.nonzero(slots >= 0), strict=True):
        s = int(slots[j, e])
        gate_up, down = store.host_weights(int(j), int(e))
        np.testing.assert_array_equal(store.pool_gate_up[s].get(), gate_up)
        np.testing.assert_array_equal(store.pool_down[s].get(), down)


def test_greedy_text_with_a_cache_that_keeps_its_misses_on_the_gpu_equals_the_all_resident_run(cp):
    """The small preset through the engine on this GPU, batch MTP, a cache of 6 slots that keeps its misses:
    the greedy text of three requests is the all-resident run's, experts were kept and none swapped."""
    from rt_engine_helpers import collect
    from rt_plans import float16_profile_text

    from strata_cfg.plan.from_profile import resolve_text
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    def generate(**kw) -> tuple[list[list[int]], Engine]:
        text = float16_profile_text(
            vram_mib=cp.cuda.runtime.memGetInfo()[1] // (1 << 20),
            preset="small",
            slots=2,
            batch_mtp=True,
            draft_tokens=3,
            context=512,
            prefill_chunk=64,
            **kw,
        )
        engine = Engine(resolve_text(text, "keep-test.toml").plan)
        prompts = [tuple(range(40, 90)), (72, 101, 108, 108, 111, 32) * 3, tuple(range(100, 133))]
        return collect(engine, [(0, Request(p, 24)) for p in prompts], check_kv=False), engine

    resident, _ = generate()
    kept, engine = generate(expert_cache=6, cache_policy={"keep_misses": True})
    assert kept == resident
    for stage in engine.model.stages:
        assert stage.cuda_experts is not None and stage.cuda_experts.keeping
        stage.cuda_experts.settle()
        stats = stage.experts.stats
        assert stats.kept > 0 and stats.swaps == 0 and stats.misses > 0
