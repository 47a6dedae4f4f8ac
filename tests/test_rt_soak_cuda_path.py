"""The GPU soak's scenarios through the CUDA path on the CPU: `tests/fake_cupy.py` stands in for CuPy, so the
engine runs its GPU code (windows captured and replayed as graphs, decided on the device and chained, the
prefill graphs, the streams and their marks) with the kernels' NumPy references, as the GPU soak runs it on
one card (`test_rt_soak.test_a_random_mix_of_requests_on_the_gpu_runs_as_each_would_alone`).

Each scenario's requests must give what each gives alone, as in the soak, and no kernel that picks indices
(the routing's experts, a row's token) may read a row holding NaN: on the stand-in every element nothing wrote
is NaN, so such a read is a window choosing from memory nothing wrote, which on a GPU holds whatever the
memory held before (`fake_cupy.NAN_CHOICES`). And no two streams may race (`stream_order`): every access
to device memory that another stream wrote, or that another stream writes after, is ordered with it by
the events, waits and synchronisations a GPU would keep. ``STRATA_SOAK_CUDA_PATH_SCENARIOS`` runs more of
them (from ``STRATA_SOAK_FROM``, as the soak numbers them).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator

import numpy as np
import pytest
import test_rt_soak
from fake_cupy import NAN_CHOICES, installed
from rt_engine_helpers import collect
from rt_plans import float16_profile_text
from stream_order import tracking

from strata_cfg.plan.from_profile import resolve_text
from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import Request
from strata_runtime.engine import Engine

SCENARIOS = int(os.environ.get("STRATA_SOAK_CUDA_PATH_SCENARIOS", "24"))
RACED = (33, 44, 61, 67, 68, 72, 97)
"""Scenarios past the first `SCENARIOS` that met a race between streams before it was closed (an expert
cache's swaps and the MTP head, the idle caches' counters, a slot's drafter on two streams, a slot's
calibrated routing copied beside its last request's windows), or whose cache swaps experts on its copy
stream while windows read them (33, 72), run too."""


@pytest.fixture(scope="module")
def fake_gpu() -> Iterator[int]:
    """The stand-in installed for the module; yields its card's VRAM in MiB. The requests' engines alone are
    made again after it (they ran on the stand-in)."""
    test_rt_soak._alone_engine.cache_clear()
    with installed(), np.errstate(all="ignore"):
        cp = importlib.import_module("cupy")
        yield int(cp.cuda.runtime.memGetInfo()[1] // (1 << 20))
    test_rt_soak._alone_engine.cache_clear()


NUMBERS = sorted({*range(test_rt_soak.FIRST, test_rt_soak.FIRST + SCENARIOS), *RACED})


@pytest.mark.parametrize("number", NUMBERS)
def test_a_random_mix_through_the_cuda_path_runs_as_each_would_alone_choosing_only_from_written_rows(
    fake_gpu: int, number: int
) -> None:
    NAN_CHOICES.clear()
    with tracking() as order:
        test_rt_soak.soak(test_rt_soak.draw(number), fake_gpu)
    assert not NAN_CHOICES, f"kernels picked indices from rows holding unwritten memory: {NAN_CHOICES[:8]}"
    assert not order.races, "streams race:\n" + "\n".join(order.races[:6])


SPREAD = [
    n for n in range(test_rt_soak.FIRST, test_rt_soak.FIRST + SCENARIOS) if test_rt_soak.draw(n).stages > 1
][:6]
"""The first six scenarios of more than one stage, run with each stage on a GPU of its own."""


@pytest.mark.parametrize("number", SPREAD)
def test_a_random_mix_with_each_stage_on_a_gpu_of_its_own_keeps_its_streams_apart(
    fake_gpu: int, number: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above with the stages on GPUs of their own (the stand-in has four): the hidden rows a stage hands
    on, a chained window's tokens and positions, and the drafters' copies cross devices by peer copies,
    each ordered by an event of the stage before."""

    def spread(vram_mib: int, **kw: object) -> LaunchPlan:
        return resolve_text(float16_profile_text(vram_mib=vram_mib, **kw), "soak.toml").plan

    monkeypatch.setattr(test_rt_soak, "on_one_gpu", spread)
    scenario = test_rt_soak.draw(number)
    assert len({s.device for s in scenario.plan(fake_gpu).stages}) == scenario.stages
    with tracking() as order:
        test_rt_soak.soak(scenario, fake_gpu)
    assert not order.races, "streams race:\n" + "\n".join(order.races[:6])


@pytest.mark.parametrize("number", [0, 3, 6])
def test_a_random_mix_with_a_failed_step_keeps_its_streams_apart(fake_gpu: int, number: int) -> None:
    """The soak's planted faults through the CUDA path (`test_rt_soak.fault_soak`): a failed window or
    share, the engine's recovery (its threads drained, its devices waited for, its caches restored) and the
    self-check after it race no stream either."""
    with tracking() as order:
        test_rt_soak.fault_soak(test_rt_soak.draw(number), fake_gpu)
    assert not order.races, "streams race:\n" + "\n".join(order.races[:6])


@pytest.mark.parametrize("number", [9, 25])
def test_a_warm_up_keeps_its_windows_apart_from_the_engines_streams(fake_gpu: int, number: int) -> None:
    """`Engine.warm_up` runs requests through the engine's streams (and, pipelined, the stages' threads),
    copies a prefix, then captures the shapes they did not run on each device's own stream: those windows
    come after the copy and before the first request's windows (scenario 9: pipelined batch MTP on three
    stages, each with its thread; 25: solo windows on three stages)."""
    scenario = test_rt_soak.draw(number)
    request = Request(prompt_ids=(72, 105, 33), max_tokens=12)
    with tracking() as order:
        eng = Engine(scenario.plan(fake_gpu))
        assert eng.warm_up() > 0
        (tokens,) = collect(eng, [(0, request)], check_kv=False)
        eng.close()
    assert not order.races, "streams race:\n" + "\n".join(order.races[:6])
    assert tokens == list(test_rt_soak.alone(request, scenario, fake_gpu))


def test_the_stand_in_notes_each_choice_made_from_rows_holding_nan(fake_gpu: int) -> None:
    """The check above holds: the routing, a greedy choice and a sampled one each note a run over rows that
    hold NaN, and none over rows without."""
    from fake_cupy import ReferenceKernels

    kern = ReferenceKernels()
    g = np.random.default_rng(7)
    rows = g.standard_normal((2, 8)).astype(np.float32)
    idx, wts, out = np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32), np.zeros(2, np.int64)
    one = np.ones(2, np.float32)
    for poisoned in (False, True):
        NAN_CHOICES.clear()
        logits = rows.copy()
        if poisoned:
            logits[1, 3] = np.nan
        kern.route_topk(logits, True, idx, wts)
        kern.argmax(logits, out)
        kern.choose(logits, one, one * 0.5, np.zeros(2, np.int32), one, out)
        want = ["route_topk", "argmax", "choose"] if poisoned else []
        assert list(NAN_CHOICES) == want, poisoned


@pytest.mark.parametrize("admit", ["executor", "model"])
def test_a_slots_routing_is_copied_after_the_windows_queued_for_its_last_request(
    fake_gpu: int, admit: str
) -> None:
    """Under calibrated routing a request's tables go into its slot's rows of each stage's tables as it is
    admitted. The slot's last request may still have windows queued on the stages' streams (run ahead past
    its end, or not yet reached by a stage's thread), and those read the rows: the engine's copy
    (`Executor.admit`) is queued on each stage's stream after them. The model's own copy, which waits only
    for itself, races them, as the check sees."""
    plan = test_rt_soak.draw(44).plan(fake_gpu)  # pipelined batch MTP on three stages, calibrated routing
    assert plan.model.routing == "calibrated" and len(plan.stages) == 3
    with tracking() as order:
        eng = Engine(plan)
        handle = eng.submit(Request(prompt_ids=(72, 105, 33, 40), max_tokens=24))
        while not (eng.in_flight and handle.slot is not None and eng.slots[handle.slot] is not None):
            eng.step()
        for flight in (*eng._flights, *eng._chain):  # every stage's share queued, none waited for
            flight.wait_queued()
        owner = eng.executor if admit == "executor" else eng.model
        owner.admit(handle.slot, (9, 8, 7, 6, 5))
        while eng.step():
            pass
        eng.close()
    routing = [r for r in order.races if "route_bias" in r]
    assert bool(routing) == (admit == "model"), "\n".join(order.races[:4])
