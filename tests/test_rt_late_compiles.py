"""Kernels compiled at their first launch, not before: recorded by the kernel cache, named by `strata bench`.

On a GPU such a compile stalls the window that launches it for a second or more, so a bench repeat that met
one holds that stall in its figures. NVRTC is replaced here by a stand-in that takes a known time.
"""

from __future__ import annotations

import types

import pytest

from strata_runtime.bench import harness
from strata_runtime.bench.table import compile_notes
from strata_runtime.cuda import compile as kc


class _Module:
    """CuPy's RawModule: every named instantiation of a source, compiled in one run."""

    runs: list[list[str]] = []

    def __init__(self, code: str, options: tuple[str, ...], name_expressions: list[str]) -> None:
        _Module.runs.append(list(name_expressions))

    def get_function(self, expression: str) -> str:
        return f"fn:{expression}"


@pytest.fixture
def nvrtc(monkeypatch):
    _Module.runs = []
    monkeypatch.setattr(kc, "cupy_module", lambda: types.SimpleNamespace(RawModule=_Module))
    return _Module.runs


def test_a_kernel_compiled_at_first_launch_is_recorded_and_a_prepared_one_is_not(nvrtc) -> None:
    cache = kc.KernelCache("// source")
    cache.prepare(["a<1>", "a<2>"])
    before, runs = len(kc.late_compiles()), kc.first_runs()
    assert cache.fn("a<1>") == "fn:a<1>" and cache.fn("a<2>") == "fn:a<2>"
    assert kc.late_compiles()[before:] == [] and kc.first_runs() == runs  # prepared: no compile at launch
    assert cache.fn("b<3>") == "fn:b<3>" and cache.fn("b<3>") == "fn:b<3>"
    assert kc.first_runs() == runs + 1  # the window that launched it is not timed into the window costs
    late = kc.late_compiles()[before:]
    assert [c.expression for c in late] == ["b<3>"] and late[0].seconds >= 0  # once, at its first launch
    assert nvrtc == [["a<1>", "a<2>"], ["b<3>"]]


def test_the_bench_names_each_repeat_that_waited_for_a_compile(nvrtc, monkeypatch) -> None:
    cache = kc.KernelCache("// source")
    launches = iter([["g<1>", "g<1>"], [], ["h<4>"]])  # repeat 1 meets g<1> (once compiled), 3 meets h<4>

    class Driver:
        def run(self, arrivals):
            for expression in next(launches):
                cache.fn(expression)
            return [], {}

    monkeypatch.setattr(harness, "workload_arrivals", lambda *a, **k: [])
    monkeypatch.setattr(harness, "measure", lambda *a: {"tok_s": 100.0})
    arms = {"serial": types.SimpleNamespace(tokenizer=None)}
    runs = harness.run_bench(arms, "two-decodes", tokens=4, repeats=3, context=64, driver=lambda e: Driver())
    case = harness.summarise(runs)["serial"]["two-decodes"]
    assert [[c["kernel"] for c in each] for each in case["compiled_in_repeats"]] == [["g<1>"], [], ["h<4>"]]
    notes = compile_notes(harness.summarise(runs))
    assert notes[0] == "" and len(notes) == 3
    assert notes[1].startswith("note: serial two-decodes, repeat 1: 1 kernel compile(s) at first launch")
    assert notes[1].endswith("held in its figures (g<1>)") and "repeat 3" in notes[2] and "(h<4>)" in notes[2]
    assert compile_notes({"serial": {"solo": {"compiled_in_repeats": [[], []]}}}) == []


def test_the_engine_reports_kernels_compiled_at_launch(nvrtc) -> None:
    """The engine's status (and so ``/v1/status`` and ``/metrics``) counts them, with the latest names."""
    from strata_cfg.plan.from_profile import resolve_text
    from strata_cfg.profile.load import demo_text
    from strata_runtime.engine import Engine

    engine = Engine(resolve_text(demo_text(), "demo.toml").plan)
    before = engine.stats()["compiled_at_launch"]
    kc.KernelCache("// source").fn("late<7>")
    after = engine.stats()["compiled_at_launch"]
    assert after["kernels"] == before["kernels"] + 1 and after["recent"][-1] == "late<7>"
    assert after["seconds"] >= before["seconds"]


def test_a_kernel_maker_runs_once_however_many_threads_ask_at_once() -> None:
    """`locked_cache`: eight threads asking at once for what is not made yet get one object, made once
    (two kernels made at once, one dropped, would unload a module whose kernel another thread launched)."""
    import threading
    import time

    from strata_runtime.models.ops import locked_cache

    made: list[int] = []

    @locked_cache
    def make(device: int) -> object:
        made.append(device)
        time.sleep(0.05)  # long enough for every thread to ask while the first makes it
        return object()

    start = threading.Barrier(8)
    got: list[object] = []

    def ask() -> None:
        start.wait()
        got.append(make(3))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [3] and len(got) == 8 and all(g is got[0] for g in got)
    assert make(4) is not got[0] and made == [3, 4]
