"""A window in flight: what it carries, the marks that say how far it got, and the threads that queue it.

`Executor.launch` queues a window on every stage and returns a `Flight` at once; `Executor.finish` reads
its results when it is done. Between the two the host is free. A flight has one `Mark` per stage: the point
in that stage's stream after the window's work there. A mark is *recorded* once the stage's share has been
queued (by whichever thread queues it) and *done* once the GPU has passed it; on virtual CPU devices the
share runs when it is queued, so its mark is done at once.

On GPUs a stage's share may wait on the host: the prefill path reads one number per layer. So when several
windows are to overlap, each stage gets a `StageWorker`, a thread that queues that stage's shares in launch
order, so that stage 0 queues chunk k + 1 while stage 1 still queues chunk k. One thread per stage, in
launch order, is also what keeps a stage's stream in launch order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..backend import Array
from ..layout import Layout
from ..model import Adjusts, Draws
from .device_spec import DeviceSpec
from .job import Job

POLL_S = 50e-6
"""How often the host looks again while it waits for the first of several marks (no CUDA call waits for
any one of several events; a single mark is waited for in the driver)."""


class Mark(Protocol):
    """A point a window reaches on one stage."""

    @property
    def recorded(self) -> bool:
        """The stage's share has been queued (or has failed)."""

    @property
    def done(self) -> bool:
        """The device has passed the point; never waits."""

    def wait(self) -> None:
        """Block the host until ``done``."""

    def wait_recorded(self) -> None:
        """Block the host until ``recorded`` (the share is queued, never waiting for the device)."""


class StageMark:
    """A stage's mark: recorded by the thread that queues the share, with the CUDA event after it (None on
    CPU devices, where the share has run by the time it is recorded)."""

    def __init__(self) -> None:
        self._recorded = threading.Event()
        self.event: Any = None

    def record(self, event: Any = None) -> None:
        self.event = event
        self._recorded.set()

    @property
    def recorded(self) -> bool:
        return self._recorded.is_set()

    def wait_recorded(self) -> None:
        self._recorded.wait()

    @property
    def done(self) -> bool:
        return self._recorded.is_set() and (self.event is None or bool(self.event.done))

    def wait(self) -> None:
        self._recorded.wait()
        if self.event is not None:
            self.event.synchronize()


def wait_any(marks: Iterable[Mark]) -> None:
    """Block until at least one of ``marks`` is done: in the driver for one, by looking again every
    `POLL_S` for several."""
    pending = list(marks)
    if not pending or any(m.done for m in pending):
        return
    if len(pending) == 1:
        pending[0].wait()
        return
    while not any(m.done for m in pending):
        time.sleep(POLL_S)


class Chained:
    """Where a chained window's tokens come from: row r reads the token that window ``source`` chose for its
    needed row ``rows[r]``, on the device, so the window is queued before the host has seen that token.
    Without ``rows`` the source is a speculative window decided on the device
    (`strata_runtime.engine.device_spec`), and the chained window takes its next tokens and positions.

    `take` hands the source's chosen tokens over once its last stage has been queued, and lets go of the
    source flight, so that a run of chained windows never holds more than the flight before each.
    """

    def __init__(self, source: Flight, rows: tuple[int, ...] | None) -> None:
        self._source: Flight | None = source
        self.rows = rows

    def take(self) -> Flight:
        """The source flight, its last stage queued (its ``chosen`` and ``done`` are set); once only."""
        source = self._source
        assert source is not None, "a chained window takes its source's tokens once"
        self._source = None
        source.done.wait_recorded()
        return source


@dataclass(eq=False)
class Flight:
    """One window from launch to finish.

    ``needed`` are the window's rows whose logits decide a token (every decode row, and the last row of a
    prompt's final chunk). The last stage leaves ``normed`` (the post-final-norm rows, for the drafters'
    catch-up), ``chosen`` (the needed rows' tokens, chosen on its device) and, in pinned host arrays filled by
    copies the host did not wait for, ``chosen_host`` and, when a row's token is chosen on the host, the
    needed rows' ``logits``. ``keep`` holds every array and pinned
    buffer a queued copy reads or writes, until the flight is finished.
    """

    job: Job
    layout: Layout
    needed: list[int]
    sampled: bool
    marks: list[Mark]
    after: Chained | None = None
    """A chained window: its tokens are the choices of the window before it, read on the device."""
    draws: Draws | None = None
    """How the device draws each needed row (`strata_runtime.engine.job.Job.draws`); None: every needed
    row's choice is its argmax."""
    spec: DeviceSpec | None = None
    """A speculative window decided on the device: its shape, and what the last stage decided."""
    adjusts: Adjusts | None = None
    """The needed rows the device adjusts for a logit bias or penalty before choosing them
    (`strata_runtime.engine.job.Job.adjusts`); None: none."""
    source: Flight | None = None
    """A chained window with rows under a grammar: the window whose chosen tokens it reads, until its last
    stage has read them on the host to compute the next masks."""
    masks: tuple[np.ndarray, np.ndarray] | None = None
    """The needed rows the device masks to a grammar's allowed tokens before choosing them, and their packed
    masks (`strata_runtime.engine.job.Job.masks`); None: none."""
    positions: list[Array] = field(default_factory=list)
    """A window chained to a speculative one: its rows' positions on each stage's device, in stage order
    (decided on the device; the layout's positions are placeholders then)."""
    launched_at: float = field(default_factory=time.perf_counter)
    launch_ms: float = 0.0
    """Host wall time queueing the window through its stages (`Executor.launch`): on virtual CPU devices,
    which compute as they are queued, its own compute."""
    first_runs: int = 0
    """`strata_runtime.model.placed.Model.first_runs` when the window launched."""
    hidden: list[Array] = field(default_factory=list)
    """Each stage's output rows, in stage order (the next stage copies from them)."""
    normed: Array = None
    chosen: Array = None
    """The chosen token of each needed row on the last stage's device (the argmax, or the device's draw):
    what a chained window after it reads."""
    chosen_host: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    logits: np.ndarray | None = None
    wants_logprobs: bool = False
    """A request in the window asks for its tokens' log-probabilities (`strata_runtime.engine.logprobs`)."""
    raw_logits: np.ndarray | None = None
    """With ``wants_logprobs``: the needed rows' logits on the host as the LM head gave them, before any
    bias or penalty adjusted them on the device."""
    keep: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    discarded: int = 0
    """Rows `strata_runtime.engine.executor.Executor.finish` found past their request's end (queued ahead of
    its stop) and kept nothing of."""

    @property
    def done(self) -> Mark:
        """The last stage's mark: the window's results are on the host."""
        return self.marks[-1]

    def passed(self, stage: int) -> bool:
        """Whether the window has left ``stage`` (its device is free for the next window)."""
        return self.marks[stage].done

    def wait_queued(self) -> None:
        """Block the host until every stage's share is queued (never waiting for the device)."""
        for mark in self.marks:
            mark.wait_recorded()


class StageWorker:
    """A thread that runs one stage's shares of windows, one after another, in the order they came."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, share: Callable[[], None]) -> None:
        self._queue.put(share)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def drain(self, timeout_s: float) -> bool:
        """Wait until the thread has run every share given to it so far; False where it has not within
        ``timeout_s`` (a share that hangs)."""
        passed = threading.Event()
        self._queue.put(passed.set)
        return passed.wait(timeout_s)

    def _run(self) -> None:
        while True:
            share = self._queue.get()
            if share is None:
                return
            share()  # records its mark even when it fails (the flight carries the error)
