"""The one engine thread, and the bridge that carries its events to the asyncio side.

The engine thread builds the engine (so the devices are owned by the thread that uses them), then
loops ``engine.step()``. The asyncio side only ever calls ``submit`` and ``RequestHandle.cancel()``. After
every step taken while requests are outstanding, the engine thread schedules one `_pump` on the event
loop, which wakes every request waiting for events; the events themselves travel through each handle's
thread-safe queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from ..api import EngineCore, Request, RequestHandle, TokenEvent

log = logging.getLogger("strata.serve")

LoadState = Literal["loading", "ready", "failed", "stopped"]
EngineFactory = Callable[["LoadProgress"], EngineCore]

STATS_EVERY_S = 0.05
"""How stale ``/v1/status`` and ``/metrics`` may be while the engine is busy."""
IDLE_WAIT_S = 0.25
"""How long the idle engine thread sleeps between looks at its queue (`submit` and `cancel` wake it)."""
WATCH_EVERY_S = 1.0
"""How often the watchdog looks at the step in progress (at most; a quarter of a shorter timeout)."""
RECOVERY_PERIOD_S = 600.0
"""The window in which ``serve.recoveries`` failed steps are recovered from: one more within it ends the
server (`EngineLoop._recover`)."""


class Stream:
    """The asyncio side of one submitted request."""

    def __init__(self, owner: EngineLoop, handle: RequestHandle) -> None:
        self._owner = owner
        self.handle = handle
        self.finished = False
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0
        """Generated tokens received so far, and when the first and the last arrived (`note_tokens`)."""
        self._wakeup = asyncio.Event()

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield the request's events as the engine produces them, ending with the one that finishes it."""
        while not self.finished:
            try:
                event = self.handle.events.get_nowait()
            except queue.Empty:
                if self._owner.state == "failed":
                    self.finished = True
                    yield TokenEvent(
                        (), "", finished="error", error=self._owner.error or "the engine stopped"
                    )
                    return
                # No await between the empty read and clear(): the pump runs only while we wait, so an event
                # put in between is announced by a pump scheduled after it.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if event.finished is not None:
                self.finished = True
            yield event

    def note_tokens(self, n: int) -> None:
        """``n`` generated tokens arrived now."""
        if n:
            now = time.monotonic()
            self.first_token_at = self.first_token_at or now
            self.last_token_at, self.tokens = now, self.tokens + n

    def notify(self) -> None:
        """Wake the task waiting in `events` to look at the queue again (on the event loop's thread)."""
        self._wakeup.set()

    def cancel(self) -> None:
        """Ask the engine to stop the request; its events go on, ending with a ``cancelled`` one (where it had
        not finished already)."""
        if not self.finished:
            self.handle.cancel()
            self._owner.wake()

    def close(self) -> None:
        """Forget the request; cancel it first when it has not finished (the client went away)."""
        self.cancel()
        self._owner.forget(self)


class _Bar:
    """One loading step (a label and its byte total), as the engine's loader reports it."""

    def __init__(self, owner: LoadProgress, label: str, total: int) -> None:
        self._owner, self.label, self.total, self.done = owner, label, max(total, 1), 0
        self._logged = -1

    def advance(self, n: int) -> None:
        self.done += n
        fraction = min(self.done / self.total, 1.0)
        self._owner.progress, self._owner.fraction = self.label, fraction
        tenth = int(fraction * 10)
        if tenth != self._logged:  # the log gets a line per 10%, not one per tensor
            self._logged = tenth
            log.info("loading: %s %3.0f%% of %.1f MB", self.label, 100 * fraction, self.total / 1e6)

    def close(self) -> None:
        self._owner.progress, self._owner.fraction = f"{self.label}: done", 1.0


class LoadProgress:
    """The engine's progress callback (``Engine(plan, progress=...)``): it makes one bar per loading step
    and keeps the latest label and fraction for ``/health``."""

    def __init__(self) -> None:
        self.progress = "starting"
        self.fraction: float | None = None

    def __call__(self, label: str, total: int) -> _Bar:
        self.progress, self.fraction = label, 0.0
        return _Bar(self, label, total)

    def report(self, label: str, fraction: float) -> None:
        """A step after loading that counts no bytes (`Engine.warm_up`): its label and fraction done."""
        self.progress, self.fraction = label, fraction
        log.info("%s %3.0f%%", label, 100 * fraction)


class EngineLoop:
    """Owns the engine thread: load, step loop, progress, failure, and stop."""

    def __init__(
        self,
        factory: EngineFactory,
        loop: asyncio.AbstractEventLoop,
        recoveries: int = 0,
        step_timeout_s: float = 0.0,
    ) -> None:
        self._factory = factory
        self._loop = loop
        self.step_timeout_s = step_timeout_s
        """Seconds a step (or a recovery) may take before the watchdog counts the engine as hung and fails
        it (``serve.step_timeout_s``); 0: no watchdog."""
        self._busy_since: float | None = None
        """When the step (or recovery, or self-check) in progress began; None between them."""
        self.hung = False
        """The watchdog failed the engine: its thread is still blocked in a step."""
        self.recoveries = recoveries
        """Failed steps recovered from within `RECOVERY_PERIOD_S` at most (``serve.recoveries``); 0: the first
        failed step ends the server."""
        self.recovered: list[dict[str, Any]] = []
        """Each recovery: when (Unix time), the step's error, and the requests it ended."""
        self._failed_at: deque[float] = deque()
        self.engine: EngineCore | None = None
        self.state: LoadState = "loading"
        self.loading = LoadProgress()
        self.error: str | None = None
        self.load_seconds: float | None = None
        self.stats: dict[str, Any] = {}
        """The engine's `stats()`, taken on the engine thread after each step, so readers never race it."""
        self.settled = asyncio.Event()
        """Set once the engine is ready or has failed."""
        self._streams: set[Stream] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pump_scheduled = False
        self._changed = False
        """A request was submitted or let go since the last statistics."""
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    # ---- asyncio side --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if self.step_timeout_s > 0:
            threading.Thread(target=self._watch, name="strata-watchdog", daemon=True).start()

    def submit(self, request: Request) -> Stream:
        assert self.engine is not None and self.state == "ready"
        stream = Stream(self, self.engine.submit(request))
        self._streams.add(stream)
        self._changed = True
        self.wake()
        return stream

    def forget(self, stream: Stream) -> None:
        self._streams.discard(stream)
        self._changed = True

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def cancel_all(self) -> None:
        for stream in list(self._streams):
            stream.handle.cancel()
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def stop(self, timeout: float) -> None:
        """Stop stepping and wait (bounded) for the engine thread to end."""
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, timeout)
        if self.state != "failed":
            self.state = "stopped"

    # ---- engine thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.engine = self._factory(self.loading)
            self.stats = self.engine.stats()
        except BaseException as exc:  # a load failure of any kind must reach the server, not kill the thread
            self._fail("the engine failed to load", exc)
            return
        if self.recoveries:
            try:  # what the model gives now, sound: a recovered engine must give the same
                self._busy_since = time.monotonic()
                self.engine.self_check()
                log.info(
                    "self-check read in %.0f ms: a failed step is recovered from (serve.recoveries = %d)",
                    (time.monotonic() - self._busy_since) * 1e3,
                    self.recoveries,
                )
            except BaseException as exc:
                self._fail("the engine failed its self-check after loading", exc)
                return
            finally:
                self._busy_since = None
        self.load_seconds = time.monotonic() - started
        self.state = "ready"
        log.info("engine ready in %.1f s", self.load_seconds)
        self._loop.call_soon_threadsafe(self.settled.set)
        taken = time.monotonic()
        while not self._stop.is_set() and not self.failed:  # the watchdog may have failed it
            try:
                self._busy_since = time.monotonic()
                busy = self.engine.step()
                self._busy_since = None
                if self.failed:  # the watchdog gave the step up for hung: the server is ending
                    return
                # Statistics are a few dictionaries per slot and window: taken after a step that admitted
                # or released a request, after an idle one, and otherwise at most every STATS_EVERY_S
                # (windows can be a millisecond).
                now = time.monotonic()
                if self._changed or not busy or now - taken >= STATS_EVERY_S:
                    self._changed = False
                    self.stats, taken = self.engine.stats(), now
            except Exception as exc:
                if not self._recover(exc):
                    return
            except BaseException as exc:
                self._fail("the engine failed while stepping", exc)
                return
            # A step that found nothing to run may still have finished requests (a cancelled one is
            # answered as it is reaped), so every step with requests outstanding is followed by a pump.
            if busy or self._streams:
                self._schedule_pump()
            if not busy:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _recover(self, exc: Exception) -> bool:
        """A step raised ``exc``: bring the engine back, carrying on the requests it was running where it
        can (`EngineCore.recover`), and check that the model gives what it gave after loading
        (`EngineCore.self_check`). False (the server then ends, as after a failed load) where recovery is
        off, the step failed more than ``recoveries`` times within `RECOVERY_PERIOD_S`, or the engine cannot
        go on."""
        assert self.engine is not None
        now = time.monotonic()
        while self._failed_at and now - self._failed_at[0] > RECOVERY_PERIOD_S:
            self._failed_at.popleft()
        self._failed_at.append(now)
        if len(self._failed_at) > self.recoveries:
            what = "the engine failed while stepping"
            if self.recoveries:
                what += f" ({len(self._failed_at)} times in {RECOVERY_PERIOD_S / 60:.0f} minutes)"
            self._fail(what, exc)
            return False
        log.error(
            "the engine failed while stepping; recovering\n%s",
            "".join(traceback.format_exception(exc)).rstrip(),
        )
        try:  # watched as the step was: ``_busy_since`` is still the failed step's start
            recovery = self.engine.recover(exc)
            problem = self.engine.self_check()
            self._busy_since = None
        except BaseException as again:
            self._fail(
                f"the engine failed while stepping ({type(exc).__name__}: {exc}), then while recovering",
                again,
            )
            return False
        if problem is not None:
            self._fail(
                "the engine failed while stepping, and after recovering its self-check departs from what it "
                f"gave after loading: {problem}",
                exc,
            )
            return False
        self.recovered.append(
            {
                "at": time.time(),
                "error": f"{type(exc).__name__}: {exc}",
                "resumed": recovery.resumed,
                "ended": recovery.ended,
            }
        )
        log.warning(
            "recovered from a failed step: %d request(s) carried on, %d ended with an error; the self-check "
            "agrees with the start (%d of %d recoveries in %.0f minutes used)",
            recovery.resumed,
            recovery.ended,
            len(self._failed_at),
            self.recoveries,
            RECOVERY_PERIOD_S / 60,
        )
        self._changed = True
        self._schedule_pump()
        return True

    def _watch(self) -> None:
        """The watchdog's thread: fail the engine where a step has not returned within `step_timeout_s`. A
        GPU or kernel that hangs never gives the step back, and nothing else would end the server: its
        ``/health`` would say ready while nothing is served. The engine thread's stack goes to the log."""
        every = min(WATCH_EVERY_S, self.step_timeout_s / 4)
        while not self._stop.wait(every) and not self.failed:
            since = self._busy_since
            if since is None or time.monotonic() - since <= self.step_timeout_s:
                continue
            frame = sys._current_frames().get(self._thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(gone)"
            self.hung = True
            self._fail(
                f"the engine's step has not returned for {self.step_timeout_s:g} s (serve.step_timeout_s): "
                "a GPU or kernel hangs, or a step is far slower than it should be; the server ends so that "
                "its supervisor starts it again",
                stack=f"the engine thread, where it hangs:\n{stack}",
            )
            return

    def _fail(self, what: str, exc: BaseException | None = None, stack: str | None = None) -> None:
        self.error = what if exc is None else f"{what}: {type(exc).__name__}: {exc}"
        if exc is not None:
            stack = "".join(traceback.format_exception(exc)).rstrip()
        log.error("%s\n%s", what, stack)
        log.error("%s", self.error)
        self.state = "failed"
        try:
            self._loop.call_soon_threadsafe(self.settled.set)
            self._schedule_pump()
        except RuntimeError:  # the event loop is already closed: nobody is waiting any more
            pass

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            with contextlib.suppress(RuntimeError):  # a closed event loop: the server ended, nobody waits
                self._loop.call_soon_threadsafe(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        for stream in self._streams:
            stream.notify()
