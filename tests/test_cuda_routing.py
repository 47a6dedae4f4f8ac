"""The router-bias kernel (strata_runtime/cuda/routing.cu) against its NumPy twin, bit for bit.

Inputs are fresh and random each run: request tables from the routing model, tables that put all of q on
one expert (every lane after the first collides 32 times and scans), and arbitrary unsorted floats (the
binary search must still walk the same way); positions near 0 and far past the lookback; several slots.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_checks import rng

from strata_runtime.experts import routing as r
from strata_runtime.reference import routing as twin

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def random_case(g: np.random.Generator, n_exp: int, top_k: int, tables: str) -> dict:
    n_layers, slots, rows = int(g.integers(1, 6)), int(g.integers(1, 5)), int(g.integers(1, 70))
    model = r.RoutingModel(n_layers, n_exp, top_k, model_seed=int(g.integers(1 << 30)))
    if tables == "requests":
        cdf = np.stack([model.request(g.integers(0, 1000, 7).tolist())[1] for _ in range(slots)])
    elif tables == "one-hot":
        cdf = np.zeros((slots, n_layers, n_exp), np.float32)
        for s in range(slots):
            for j in range(n_layers):
                cdf[s, j, int(g.integers(0, n_exp)) :] = 1.0
    else:
        cdf = g.random((slots, n_layers, n_exp)).astype(np.float32)
    pos = g.integers(0, 100_000, rows).astype(np.int32)
    pos[: rows // 3] = g.integers(0, 80, rows // 3)  # inside the first lookback, position 0 included
    return {
        "logits": (g.standard_normal((rows, n_exp)) * 3).astype(np.float32),
        "pos": pos,
        "slot": g.integers(0, slots, rows).astype(np.int32),
        "cdf": cdf,
        "seeds": g.integers(0, 2**63, slots, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1),
        "layer": int(g.integers(0, n_layers)),
        "p_stay": float(np.float32(g.choice([0.0, 0.1, 0.28, 0.9, 1.0]))),
        "top_k": top_k,
        "bias": 256.0,
        "lookback": int(g.choice([1, 31, 32, 33, 64, 100])),
    }


def run_kernel(cp, case: dict) -> np.ndarray:
    from strata_runtime.cuda.routing import route_bias

    dev = {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    route_bias(**dev)
    return dev["logits"].get()


def run_twin(case: dict) -> np.ndarray:
    ref = {**case, "logits": case["logits"].copy()}
    twin.route_bias(**ref)
    return ref["logits"]


@pytest.mark.parametrize(("n_exp", "top_k"), [(128, 8), (8, 2), (16, 4), (256, 32), (5, 5), (60, 1)])
@pytest.mark.parametrize("tables", ["requests", "one-hot", "arbitrary"])
def test_route_bias_matches_its_twin_bit_for_bit(cp, n_exp, top_k, tables):
    g = rng()
    for _ in range(4):
        case = random_case(g, n_exp, top_k, tables)
        got, want = run_kernel(cp, case), run_twin(case)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        # And so the same chosen sets: the biased entries are exactly the intended experts.
        assert ((got != case["logits"]).sum(axis=1) == top_k).all()


def test_route_bias_replays_in_a_cuda_graph_reading_positions_and_slots_from_the_device(cp):
    from strata_runtime.cuda.routing import KERNEL, route_bias, routing_kernels_for

    g = rng()
    case = random_case(g, 128, 8, "requests")
    rows = case["logits"].shape[0]
    routing_kernels_for(0).prepare([KERNEL])  # compiled before capture, as DeviceRouting does
    dev = {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    base = cp.asarray(case["logits"])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dev["logits"][...] = base  # compiles the copy kernel before capture
        stream.synchronize()
        stream.begin_capture()
        dev["logits"][...] = base
        route_bias(**dev)
        graph = stream.end_capture()
    for _ in range(3):
        pos = g.integers(0, 5000, rows).astype(np.int32)
        slot = g.integers(0, case["cdf"].shape[0], rows).astype(np.int32)
        dev["pos"].set(pos)
        dev["slot"].set(slot)
        graph.launch(stream)
        stream.synchronize()
        want = run_twin({**case, "pos": pos, "slot": slot})
        np.testing.assert_array_equal(dev["logits"].get().view(np.uint32), want.view(np.uint32))


def test_device_tables_follow_the_host_tables_of_an_admitted_slot(cp):
    from strata_runtime.backend import Device
    from strata_runtime.cuda.routing import DeviceRouting

    model = r.RoutingModel(4, 16, 4, model_seed=1)
    host = r.RoutingTables(model, slots=3)
    device = DeviceRouting(host, Device.parse("cuda:0"))
    host.admit(1, [5, 6, 7])
    device.load(1)
    np.testing.assert_array_equal(device.cdf.get(), host.cdf)
    np.testing.assert_array_equal(device.seeds.get(), host.seeds)
    g = rng()
    logits = (g.standard_normal((6, 16)) * 3).astype(np.float32)
    pos, slot = g.integers(0, 900, 6).astype(np.int32), np.array([0, 1, 1, 2, 1, 0], np.int32)
    got = cp.asarray(logits)
    device.apply(got, 3, cp.asarray(pos), cp.asarray(slot))
    want = logits.copy()
    r.apply_bias(want, 3, slot, pos, host)
    np.testing.assert_array_equal(got.get(), want)
    # The layer's bias step (what the decode graphs and the prefill path run) is the same launch.
    again = cp.asarray(logits)
    device.layer(3)(again, cp.asarray(pos), cp.asarray(slot))
    np.testing.assert_array_equal(again.get(), want)
