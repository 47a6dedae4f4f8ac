"""The stream-order checker (`stream_order`) on the CuPy stand-in: it notes a race where a GPU would have one,
and none where an event, a wait or a synchronisation orders the work."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fake_cupy import RECORDER, installed
from stream_order import Order, tracking


@pytest.fixture
def cp() -> Iterator[Any]:
    with installed(), np.errstate(all="ignore"):
        yield importlib.import_module("cupy")


def _double(src: Any, out: Any) -> None:
    out[...] = 2 * src


def _launch(src: Any, out: Any) -> None:
    """A kernel (through the stand-in's launcher): reads ``src``, writes ``out``."""
    RECORDER.launch(_double, src, out)


def _streams(cp: Any) -> tuple[Any, Any]:
    return cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)


def _written(cp: Any, stream: Any, order: Order) -> Any:
    with stream:
        x = cp.zeros((4, 8), cp.float32)
        x += 1.5  # (a ufunc in place: a write on this stream)
    return x


@pytest.mark.parametrize("ordered", [False, True])
def test_a_kernel_reading_what_another_stream_wrote_races_unless_it_waits_for_it(
    cp: Any, ordered: bool
) -> None:
    a, b = _streams(cp)
    with tracking() as order:
        x = _written(cp, a, order)
        if ordered:
            b.wait_event(a.record())
        with b:
            out = cp.empty((4, 8), cp.float32)
            _launch(x, out)
    assert float(out[0, 0]) == 3.0
    assert bool(order.races) is not ordered, order.races
    if not ordered:
        assert "_double" in order.races[0] and "which writes" in order.races[0]


@pytest.mark.parametrize("sync", ["stream", "event", "device", "read"])
def test_work_queued_after_the_host_waited_for_a_stream_is_ordered_after_it(cp: Any, sync: str) -> None:
    a, b = _streams(cp)
    with tracking() as order:
        x = _written(cp, a, order)
        if sync == "stream":
            a.synchronize()
        elif sync == "event":
            a.record().synchronize()
        elif sync == "device":
            cp.cuda.Device(0).synchronize()
        else:  # a blocking read on the host, on the writing stream
            with a:
                x.get()
        with b:
            _launch(x, cp.empty((4, 8), cp.float32))
    assert not order.races


def test_two_streams_writing_different_rows_of_one_array_do_not_race(cp: Any) -> None:
    a, b = _streams(cp)
    with tracking() as order:
        with a:
            x = cp.zeros((4, 8), cp.float32)
        b.wait_event(a.record())  # the zeros are in before b writes
        with a:
            _launch(cp.ones((8,), cp.float32), x[0])
        with b:
            _launch(cp.ones((8,), cp.float32), x[1])
    assert not order.races
    with tracking() as order:
        with a:
            _launch(cp.ones((8,), cp.float32), x[2])
        with b:
            _launch(cp.ones((8,), cp.float32), x[2])
    assert len(order.races) == 1


@pytest.mark.parametrize("waits", [False, True])
def test_an_array_another_stream_read_races_when_freed_to_its_own_streams_pool(cp: Any, waits: bool) -> None:
    a, b = _streams(cp)
    with tracking() as order:
        x = _written(cp, a, order)
        b.wait_event(a.record())
        with b:
            _launch(x, cp.empty((4, 8), cp.float32))
        if waits:
            a.wait_event(b.record())
        del x  # back to a's pool, where a's next allocation may take it
    assert bool(order.races) is not waits, order.races
    if not waits:
        assert "freed to the pool of its stream" in order.races[0]


def test_a_graph_replays_its_kernels_on_the_stream_it_is_launched_on(cp: Any) -> None:
    a, b, capture = *_streams(cp), cp.cuda.Stream(non_blocking=True)
    with tracking() as order:
        x = _written(cp, a, order)
        out = cp.empty((4, 8), cp.float32)
        with capture:
            capture.begin_capture()
            _launch(x, out)
            graph = capture.end_capture()
        assert not order.races and np.isnan(float(out[0, 0]))  # captured, not run
        b.wait_event(a.record())
        graph.launch(b)
        assert not order.races and float(out[0, 0]) == 3.0
        with a:
            x[...] = 0.0  # a rewrites what b's replay read, without waiting for it
    assert len(order.races) == 1 and "in a graph" in order.races[0], order.races


def test_closing_an_engine_waits_for_its_gpus_and_logs_a_fault_left_on_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`Executor.close` waits for every device (the memory the engine lets go of returns to its streams'
    pools), and a device holding a kernel's fault is logged, not raised: the engine is being dropped."""
    from types import SimpleNamespace

    from strata_runtime.engine.executor import Executor

    waited: list[str] = []

    class Gpu:
        def __init__(self, name: str, fault: bool) -> None:
            self.name, self.fault = name, fault

        def __str__(self) -> str:
            return self.name

        def wait_idle(self) -> None:
            waited.append(self.name)
            if self.fault:
                raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    healthy, faulty = Gpu("cuda:0", False), Gpu("cuda:1", True)
    executor = object.__new__(Executor)
    executor._workers = None
    executor.stages = [SimpleNamespace(device=d) for d in (healthy, healthy, faulty)]
    with caplog.at_level("WARNING", logger="strata_runtime"):
        executor.close()
    assert waited == ["cuda:0", "cuda:1"]
    assert "cuda:1 reports cudaErrorIllegalAddress" in caplog.text


@pytest.mark.parametrize("waits", [False, True])
def test_the_host_reading_a_download_before_waiting_for_its_copy_races(cp: Any, waits: bool) -> None:
    """`strata_runtime.backend.download` queues a copy into page-locked memory and returns at once: the host
    may read it only once it has waited for that copy (here an event after it)."""
    from strata_runtime.backend import download

    a, _ = _streams(cp)
    with tracking() as order:
        x = _written(cp, a, order)
        with a:
            host = download(x)
            done = a.record()
        if waits:
            done.synchronize()
        assert float(host[1, 2]) == 1.5
    assert bool(order.races) is not waits, order.races
    if not waits:
        assert "before the host waited for it" in order.races[0]
