"""Running windows: `launch` queues one on every stage and returns at once; `finish` decides its rows.

A `strata_runtime.engine.job.Job` is one window. `Executor.launch` queues it through the stages and returns
a `strata_runtime.engine.flight.Flight` without waiting. On GPUs each stage works on its own non-blocking CUDA
stream (one per stage, made once):
stage 0 embeds the tokens; each later stage waits for the previous stage's event and copies the hidden rows
over from its device (a peer copy, on the receiving stream); every stage runs its layers and records an
event. The last stage adds the final norm, the LM head of the rows that decide a token, each one's chosen
token (the argmax, or for a sampled row a draw at a uniform the host drew at launch:
`strata_runtime.models.ops.choose`, after the request's logit bias and penalties where it has them:
`strata_runtime.model.adjust`; a prompt's last row is chosen so too) and, for rows the host chooses
(proposals it verifies, a grammar's rows it masks itself), the logits, copied into pinned host buffers
without the host waiting,
and the flight's ``done`` event. A speculative window decided on the device
(`strata_runtime.engine.device_spec`) is accepted, caught up and drafted there too, right after its
logits. A chained window (`strata_runtime.engine.flight.Chained`) embeds the tokens the window before it
chose (or, after a speculative window decided on the device, its next tokens, at the positions it decided),
on the device, after that window's ``done`` event. Uploads (token ids, a window's positions and slots) go
through pinned memory too (`strata_runtime.backend.upload_into`), so queuing a window never makes the host
wait for a stream.

`Executor.finish` waits for ``done``, then verifies each slot's rows and commits (accept/rewind) through
`strata_runtime.engine.speculative`, or, for a window decided on the device, reads its decision and
accounts the KV it kept (`_settle`); the drafters' work runs on one more stream of the last device, after
the flight (a window decided on the device drafts on the last stage's stream, and `_drafting` keeps all
work on the drafters in the order the host queued it, across the two). A serial window is `launch` then
`finish`. On virtual CPU devices a flight has run by the time
`launch` returns; the code path is the same.

Reuse of device memory: everything a flight's stage share writes into a buffer it shares with other windows
(a row count's graph buffers, copy-in, graph, copy-out) is queued on that stage's stream by one thread, so
stream order keeps windows apart; arrays another stream reads (the hand-off rows, the rows the drafters read)
are held by the flight until it is finished, and a finished flight until the drafters' stream has passed it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from strata_cfg.schema.windows import MAX_WINDOW_ROWS, lookup_history_positions

from ..api import TokenEvent, TokenLogprob
from ..backend import (
    Array,
    Device,
    cupy_module,
    device_lock,
    download,
    holding,
    peer_copy,
    transfer,
)
from ..model import Model
from ..model.kvcache import HostRows
from ..model.stage import Stage
from .device_spec import decide
from .flight import Chained, Flight, Mark, StageMark, StageWorker, wait_any
from .job import Entry, Job
from .logprobs import token_logprobs
from .prefix import PAGE, Stored, page_runs
from .sampling import Sampler
from .slot import Slot
from .speculative import Proposals, Verdict, catch_up, commit, draft, verify, verify_choices

log = logging.getLogger("strata_runtime")

Run = tuple[int, int, int]
"""A run of a prefix's positions in the prefix store's pages (`strata_runtime.engine.prefix.page_runs`)."""

QUIESCE_S = 60.0
"""How long `Executor.quiesce` waits for a stage's thread to run what it was given."""

PROMPT_LOGPROB_ROWS = 256
"""Prompt rows whose logits are taken at once for a request that asks the prompt's log-probabilities: 156 MB
of fp32 logits at a 151,936-word vocabulary."""


def _using(stream: Any) -> Any:
    """``stream`` as the current stream of its device (a null context without one)."""
    return stream if stream is not None else contextlib.nullcontext()


class Executor:
    """Runs jobs on a model; ``tracked`` keeps every slot's drafter caught up after each window.

    With ``overlap`` (pipelined groups) and a model split over GPUs, each stage's shares are queued by that
    stage's own thread (`StageWorker`), so that windows of different groups overlap even where queuing one
    waits on the host (the prefill path reads one number per layer); otherwise the calling thread queues
    them.
    """

    def __init__(self, model: Model, tracked: bool, overlap: bool = False) -> None:
        self.model, self.tracked = model, tracked
        self.stages: list[Stage] = list(model.stages)
        self.gpu = any(s.device.is_cuda for s in self.stages)
        self._streams: list[Any] = [self._new_stream(s) for s in self.stages]
        mtp = model.mtp
        shares_cache = mtp is not None and getattr(mtp, "stage", None) is not None
        self._draft_stream = self._streams[-1] if shares_cache else self._new_stream(self.stages[-1])
        """The drafters' stream on the last device: drafting and catching up, after the flights they read.
        Where the MTP head reads its experts through the last stage's expert cache, that stage's own stream:
        the cache's swaps rewrite the tables the head's kernels read, and its counters are read and cleared
        there, so both run in the one stream's order."""
        self._workers: list[StageWorker] | None = None
        if overlap and self.gpu and len(self.stages) > 1:
            self._workers = [StageWorker(f"strata-stage-{s.index}") for s in self.stages]
        self._retired: deque[tuple[Any, Flight]] = deque()
        self._drafters_lock = threading.RLock()
        self._drafted: Any = None
        """An event after the newest work on the drafters queued on the last device (`_drafting`)."""
        self._copy_error: BaseException | None = None
        """A copy queued on a stage's thread (a prefix's, a slot's routing) that failed, raised by the next
        `finish`."""
        self._store: list[HostRows] = []
        """The prefix store's host memory of each stage (`open_store`), and a drafter's."""
        self._store_drafter: HostRows | None = None
        self.lookup_history: Array = None
        """Every slot's tokens by position on the last device, where windows decided there look their
        proposals up (`open_lookup`); None without n-gram lookup."""

    def open_lookup(self, slots: int, context: int) -> None:
        """Allocate the slots' token histories for looked-up windows decided on the device
        (`strata_runtime.engine.device_spec.decide_lookup`): ``context`` positions each, and room for a
        window's rows past them."""
        device = self.stages[-1].device
        with device.use():
            self.lookup_history = device.xp.zeros((slots, lookup_history_positions(context)), device.xp.int64)

    def _new_stream(self, stage: Stage) -> Any:
        """A non-blocking CUDA stream on the stage's GPU (None on a CPU device)."""
        if not stage.device.is_cuda:
            return None
        with stage.device.use():
            return cupy_module().cuda.Stream(non_blocking=True)

    def close(self) -> None:
        """Stop the stage threads and wait for every device to run what was queued (the engine is being
        dropped: its memory goes back to the pools of the streams it was allocated on, where the next
        allocation may take it while this engine's streams still use it)."""
        for w in self._workers or []:
            w.close()
        self._workers = None
        for device in dict.fromkeys(stage.device for stage in self.stages):
            try:
                device.wait_idle()
            except Exception as exc:  # a kernel's fault stays on its device: nothing queued there runs now
                log.warning("closing the engine: %s reports %s", device, exc)

    def settle_experts(self) -> None:
        """Hand each GPU stage's expert cache what its kernels counted since the last read (the engine is
        idle), on the stage's stream: the swaps this starts rewrite tables the stage's windows read, so
        they are queued in that stream's order."""
        for s, stage in enumerate(self.stages):
            if stage.cuda_experts is not None:
                with stage.device.use(), _using(self._streams[s]), self._lock_for(s):
                    stage.cuda_experts.settle()

    def quiesce(self, timeout_s: float = QUIESCE_S) -> None:
        """After a window failed: wait until every stage's thread has queued what it was given and every
        device has run what was queued on it, then forget the failure and what finished flights held for
        the drafters. Raises where a stage's thread does not come back within ``timeout_s`` or a device
        reports an error (a kernel's fault stays on its device: nothing more can run there)."""
        self.idle(timeout_s)
        self._retired.clear()
        self._copy_error = None

    def idle(self, timeout_s: float = QUIESCE_S) -> None:
        """Wait until every stage's thread has queued what it was given and every device has run what was
        queued on it: work queued after, on any stream, comes after it. Raises as `quiesce` does."""
        for s, worker in enumerate(self._workers or []):
            if not worker.drain(timeout_s):
                raise RuntimeError(f"stage {s}'s thread did not come back within {timeout_s:.0f} s")
        for device in dict.fromkeys(stage.device for stage in self.stages):
            device.wait_idle()

    # ---- copying a prefix between slots ------------------------------------------------------------

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Empty slot ``dst`` (its stages and drafter rewound to 0 by the caller) takes positions [0, n) of
        slot ``src``'s KV on every stage, and of its drafter's KV (`strata_runtime.engine.prefix`): counted
        now; copied on each stage's stream after every window queued there before (through the stage's
        thread, where it has one), so before any window of ``dst``. The drafters' copy runs on their stream
        after the last stage's copy, and the last stage's stream waits for it, so drafting there (windows
        decided on the device) reads it too."""
        drafters = self.model.drafters
        pair = None
        if dst in drafters:
            pair = (drafters[src], drafters[dst])
            pair[1].kv.claim(0, pair[0].kv, 0, n)
        for stage in self.stages:
            stage.kv.claim(dst, stage.kv, src, n)
        last = len(self.stages) - 1
        for s in range(len(self.stages)):
            self._on_stage(
                s, functools.partial(self._copy_share, s, src, dst, n, pair if s == last else None)
            )

    def _copy_share(self, s: int, src: int, dst: int, n: int, drafters: tuple[Any, Any] | None) -> None:
        """Stage ``s``'s part of `copy_prefix`, queued on its stream (and the drafters' on theirs)."""
        stage, stream = self.stages[s], self._streams[s]
        try:
            with stage.device.use(), _using(stream), self._lock_for(s):
                stage.kv.copy_rows(stage.kv, src, dst, n)
                if drafters is not None:
                    source, target = drafters
                    self._on_draft_stream(stream, lambda: target.kv.copy_rows(source.kv, 0, 0, n))
        except BaseException as exc:  # on a stage's thread: the engine's next `finish` raises it
            self._copy_error = exc

    @property
    def page_bytes(self) -> int:
        """Host bytes of one page of the prefix store (`strata_runtime.engine.prefix.PAGE` positions of every
        stage's KV and of a drafter's)."""
        caches = [st.kv for st in self.stages] + [d.kv for d in list(self.model.drafters.values())[:1]]
        return PAGE * sum(int(kv.k[:, 0, :, 0].nbytes + kv.v[:, 0, :, 0].nbytes) for kv in caches)

    def open_store(self, pages: int) -> None:
        """Allocate the prefix store's host memory, ``pages`` pages of every stage's KV and of a drafter's
        (page-locked on a GPU), once: `save_prefix` and `restore_prefix` copy into and out of it."""
        positions = pages * PAGE
        self._store = [HostRows(st.kv, positions) for st in self.stages]
        drafter = next(iter(self.model.drafters.values()), None)
        self._store_drafter = None if drafter is None else HostRows(drafter.kv, positions)

    def stored_rows(self, entry: Stored) -> list[tuple[np.ndarray, np.ndarray]]:
        """What ``entry``'s pages hold: each stage's keys and values [layers, K, n, D], then (with drafters)
        the drafter's of its ``drafted`` positions. For tests; on a GPU valid once the copies have run."""
        runs = page_runs(entry.pages, len(entry.kept.tokens))
        out = [rows.rows(runs) for rows in self._store]
        if self._store_drafter is not None and entry.kept.drafted:
            out.append(self._store_drafter.rows(page_runs(entry.pages, entry.kept.drafted)))
        return out

    def save_prefix(self, slot: int, entry: Stored) -> None:
        """Copy positions [0, n) of ``slot``'s KV on every stage, and the first ``drafted`` of its drafter's
        (``entry.kept``'s), into ``entry``'s pages of the host's prefix store
        (`strata_runtime.engine.prefix.PrefixStore`): queued on each stage's stream after every window
        queued there before (through the stage's thread, where it has one), so before any later window
        overwrites them; the drafter's on the drafters' stream after the last stage's copy. The host does
        not wait. Whatever is queued later on those streams (a `restore_prefix`, or a save into the same
        pages once they hold another prefix) comes after."""
        runs = page_runs(entry.pages, len(entry.kept.tokens))
        drafted = page_runs(entry.pages, entry.kept.drafted or 0)
        for s in range(len(self.stages)):
            self._on_stage(s, functools.partial(self._save_share, s, slot, runs, drafted))

    def restore_prefix(self, entry: Stored, slot: int, n: int) -> None:
        """Empty slot ``slot`` (its stages and drafter rewound to 0 by the caller) takes positions [0, n) of
        stored ``entry``, at most what it holds: counted now, copied on each stage's stream after every
        window queued there before, so before any window of ``slot`` (the drafter's as `copy_prefix` orders
        them)."""
        drafter = self.model.drafters.get(slot)
        if drafter is not None:
            drafter.kv.fill(0, n, entry.kept.drafted or 0, "a stored prefix's drafter")
        for stage in self.stages:
            stage.kv.fill(slot, n, len(entry.kept.tokens), "a stored prefix")
        runs = page_runs(entry.pages, n)
        for s in range(len(self.stages)):
            self._on_stage(s, functools.partial(self._restore_share, s, slot, runs))

    def admit(self, slot: int, prompt_ids: tuple[int, ...]) -> None:
        """A request with these prompt ids now holds ``slot``: its routing (calibrated routing only) goes into
        the host tables now, and into each GPU stage's tables on the stage's stream, after every window
        queued there before (the slot's last request's windows still queued read its own tables) and before
        every window queued after (this request's). `Model.admit` does the same for a model without an
        engine, waiting for each copy."""
        routing = self.model.routing
        if routing is None:
            return
        routing.admit(slot, prompt_ids)
        for s, stage in enumerate(self.stages):
            if stage.cuda_routing is not None:
                rows = stage.cuda_routing.rows(slot)  # as admitted: the host tables change with the next
                self._on_stage(s, functools.partial(self._routing_share, s, slot, rows))

    def _routing_share(self, s: int, slot: int, rows: tuple[Any, Any]) -> None:
        """Stage ``s``'s part of `admit`."""
        stage = self.stages[s]
        assert stage.cuda_routing is not None
        try:
            with stage.device.use(), _using(self._streams[s]), self._lock_for(s):
                stage.cuda_routing.put(slot, rows)
        except BaseException as exc:
            self._copy_error = exc

    def expert_scores(self) -> list[Any] | None:
        """What each stage's expert cache has learned of the routing (`Stage.expert_scores`), for
        `recall_experts`; None where no stage has a cache that adapts. Each stage's entry is taken by the
        thread that owns its cache (the stage's, where it has one), after the windows queued there before:
        the list is filled in as they get to it, and a `recall_experts` queued later reads it after."""
        if all(not stage.experts.cached for stage in self.stages):
            return None
        out: list[Any] = [None] * len(self.stages)

        def take(s: int) -> None:
            out[s] = self.stages[s].expert_scores()

        for s in range(len(self.stages)):
            self._on_stage(s, functools.partial(take, s))
        return out

    def recall_experts(self, scores: list[Any]) -> None:
        """Bring back into each stage's expert cache what ``scores`` (`expert_scores`, taken when a stored
        conversation's slot was released) had taught it, rebalancing it at once: queued on each stage's
        stream after every window queued there before (through the stage's thread, where it has one), so the
        swaps' copies come before the windows queued after."""
        for s in range(len(self.stages)):
            self._on_stage(s, functools.partial(self._recall_share, s, scores))

    def _recall_share(self, s: int, scores: list[Any]) -> None:
        """Stage ``s``'s part of `recall_experts`."""
        stage, stream = self.stages[s], self._streams[s]
        if scores[s] is None:
            return
        try:
            with stage.device.use(), _using(stream), self._lock_for(s):
                stage.recall_experts(scores[s])
        except BaseException as exc:  # on a stage's thread: the engine's next `finish` raises it
            self._copy_error = exc

    def _lock_for(self, s: int) -> Any:
        """Stage ``s``'s device lock on a GPU (no copy is queued while another thread captures a graph
        there); nothing on the CPU."""
        if self._streams[s] is None:
            return contextlib.nullcontext()
        return device_lock(self.stages[s].device.index)

    def _on_stage(self, s: int, task: Any) -> None:
        if self._workers is not None:
            self._workers[s].submit(task)
        else:
            task()

    def _save_share(self, s: int, slot: int, runs: list[Run], drafted: list[Run]) -> None:
        """Stage ``s``'s part of `save_prefix` (and the drafter's, on the last stage)."""
        stage, stream = self.stages[s], self._streams[s]
        try:
            with stage.device.use(), _using(stream), self._lock_for(s):
                stage.kv.save_rows(slot, self._store[s], runs)
                into = self._store_drafter
                if s == len(self.stages) - 1 and drafted and into is not None:
                    kv = self.model.drafters[slot].kv
                    self._on_draft_stream(stream, lambda: kv.save_rows(0, into, drafted))
        except BaseException as exc:  # on a stage's thread: the engine's next `finish` raises it
            self._copy_error = exc

    def _restore_share(self, s: int, slot: int, runs: list[Run]) -> None:
        """Stage ``s``'s part of `restore_prefix` (and the drafter's, on the last stage)."""
        stage, stream = self.stages[s], self._streams[s]
        try:
            with stage.device.use(), _using(stream), self._lock_for(s):
                stage.kv.load_rows(slot, self._store[s], runs)
                drafter, source = self.model.drafters.get(slot), self._store_drafter
                if s == len(self.stages) - 1 and drafter is not None and source is not None and runs:
                    self._on_draft_stream(stream, lambda: drafter.kv.load_rows(0, source, runs))
        except BaseException as exc:
            self._copy_error = exc

    def _on_draft_stream(self, stream: Any, copy: Callable[[], Any]) -> Any:
        """Run ``copy`` on the drafters' stream after what ``stream`` has queued, and make ``stream`` wait for
        it; on the CPU, now."""
        if stream is None:
            return copy()
        event = cupy_module().cuda.Event
        draft = self._draft_stream
        draft.wait_event(stream.record(event(disable_timing=True)))
        with draft, self._drafting(draft):
            out = copy()
        stream.wait_event(draft.record(event(disable_timing=True)))
        return out

    @contextlib.contextmanager
    def _drafting(self, stream: Any) -> Iterator[None]:
        """Work on the drafters (their states, their KV, the MTP head's graph buffers) queued in the block on
        ``stream``, ordered after such work queued before on any stream of the last device, and before such
        work queued after. The drafters' stream drafts for windows the host decides, while a window decided
        on the device drafts on the last stage's stream; one slot's drafter passes from one to the other,
        and every slot's drafting runs the one head through the same buffers. (A lock keeps the threads
        that queue them, the engine's and the last stage's, apart.) Nothing to order on a CPU device (None)
        or for a model that drafts with no head."""
        if stream is None or not self.model.drafters:
            yield
            return
        with self._drafters_lock:
            if self._drafted is not None:
                stream.wait_event(self._drafted)
            yield
            self._drafted = stream.record(cupy_module().cuda.Event(disable_timing=True))

    # ---- launching ----------------------------------------------------------------------------------

    def launch(self, job: Job, after: Chained | None = None) -> Flight:
        """Queue ``job`` through every stage and return its flight without waiting for it; ``after``: its
        tokens are the choices of the window before it, read on the device."""
        needed = job.needed()
        sampled = (
            bool(needed)
            and not job.spec_on_device
            and any(e.slot.sampler.needs_logits and not e.chosen_on_device for e in job.entries)
        )
        flight = Flight(
            job, job.layout(), needed, sampled, self._marks(), after, job.draws(), job.device_spec()
        )
        for e in job.entries:
            e.drawn_to = e.slot.sampler.drawn
        if flight.spec is not None and flight.spec.lookup is not None:
            flight.spec.history = self.lookup_history
        flight.adjusts = job.adjusts()
        flight.masks = job.masks() if after is None else None  # a chained window's: `_chained_masks`
        flight.first_runs = self.model.first_runs()
        flight.wants_logprobs = bool(needed) and any(
            e.slot.sampler.params.logprobs is not None for e in job.entries
        )
        for s in range(len(self.stages)):
            if self._workers is not None:
                self._workers[s].submit(functools.partial(self._share, flight, s))
            else:
                self._share(flight, s)
        flight.launch_ms = (time.perf_counter() - flight.launched_at) * 1e3
        return flight

    @property
    def synchronous(self) -> bool:
        """Whether a window computes while it is launched (virtual CPU devices), not on a device's stream
        after it: a window's own time is then its launch and its finish, where the wall time between
        deliveries would charge a window that ran ahead to the one before it."""
        return not self.gpu

    def _marks(self) -> list[Mark]:
        return [StageMark() for _ in self.stages]

    def _share(self, flight: Flight, s: int) -> None:
        """Stage ``s``'s part of a flight, queued on its stream; records the stage's mark, also on failure."""
        mark = flight.marks[s]
        event = None
        try:
            if s > 0:
                before = flight.marks[s - 1]
                assert isinstance(before, StageMark)
                before.wait_recorded()  # the previous stage's share is queued (not necessarily run)
                if flight.error is not None:
                    return
            stage, stream = self.stages[s], self._streams[s]
            with stage.device.use(), _using(stream), holding(flight.keep):
                hidden = self._embed(flight, stage, stream) if s == 0 else self._receive(flight, s)
                positions = self._positions(flight, s)
                hidden = stage.forward(
                    hidden, flight.layout, positions, account=flight.spec is None
                )  # [R, H]
                flight.hidden.append(hidden)
                flight.keep.append(hidden)  # the next stage's copy reads it from another stream
                if stage.last:
                    self._head(flight, stage)
                self._release_workspace(flight, stage)
                if stream is not None:
                    event = stream.record(cupy_module().cuda.Event(disable_timing=True))
        except BaseException as exc:  # the flight carries it to `finish`, on the engine's thread
            flight.error = exc
        finally:
            assert isinstance(mark, StageMark)
            mark.record(event)

    def _embed(self, flight: Flight, first: Stage, stream: Any) -> Array:
        """The window's embedding rows on the first stage: of its token ids, or for a chained window of the
        tokens the window before it chose, read on the device after that window's last stage."""
        after = flight.after
        if after is None:
            return first.embed(flight.job.token_array())
        source = after.take()
        if source.error is not None:
            raise RuntimeError("the window this chained window follows failed") from source.error
        if any(e.masked for e in flight.job.entries):
            flight.source = source  # its tokens move the grammars on before this window's masks
        if after.rows is None:  # the source decided a speculative window on the device
            assert source.spec is not None and flight.spec is not None
            flight.spec.tokens, flight.spec.positions = source.spec.next_tokens, source.spec.next_positions
            tokens, positions = self._from_last(
                flight, source, stream, flight.spec.tokens, flight.spec.positions
            )
            flight.positions.append(positions)
            return first.embed(tokens)
        chosen = source.chosen  # [needed rows of the source] on the last stage's device
        (chosen,) = self._from_last(flight, source, stream, chosen)
        if after.rows != tuple(range(len(chosen))):
            chosen = chosen[first.device.upload(np.asarray(after.rows, np.int64))]
        return first.embed(chosen)

    def _from_last(self, flight: Flight, source: Flight, stream: Any, *arrays: Array) -> list[Array]:
        """``arrays`` that ``source`` left on the last stage's device, on the first stage's device and ordered
        after ``source`` on this (the first) stage's stream; ``flight`` holds them until it is finished."""
        first, last = self.stages[0], self.stages[-1]
        flight.keep.extend(arrays)  # read on this stage's stream
        if stream is not None:
            done = source.done
            assert isinstance(done, StageMark)
            if done.event is not None:
                stream.wait_event(done.event)
        return [self._move(flight, a, last.device, first.device, stream) for a in arrays]

    @staticmethod
    def _move(flight: Flight, a: Array, src: Device, dst: Device, stream: Any) -> Array:
        """``a`` (on ``src``) on ``dst``: itself on the same device, a peer copy queued on ``stream`` (held by
        the flight), or a plain transfer between CPU devices (no stream)."""
        if src == dst:
            return a
        if stream is None:
            return transfer(a, src, dst)
        out = peer_copy(a, src, dst)
        flight.keep.append(out)
        return out

    def _positions(self, flight: Flight, s: int) -> Array | None:
        """Stage ``s``'s copy of a chained speculative window's positions (None for any other window): the
        first stage's came with the tokens; each later stage copies the previous one's on its stream, which
        `_receive` has ordered after the previous stage."""
        if not flight.positions:
            return None
        if s < len(flight.positions):
            return flight.positions[s]
        src, dst = self.stages[s - 1], self.stages[s]
        here = self._move(flight, flight.positions[s - 1], src.device, dst.device, self._streams[s])
        flight.positions.append(here)
        return here

    def _receive(self, flight: Flight, s: int) -> Array:
        """The previous stage's output rows, on stage ``s``'s device and ordered after that stage's work."""
        src, dst = self.stages[s - 1], self.stages[s]
        rows = flight.hidden[s - 1]
        stream = self._streams[s]
        if stream is None:
            return transfer(rows, src.device, dst.device)
        before = flight.marks[s - 1]
        assert isinstance(before, StageMark)
        stream.wait_event(before.event)
        if src.device == dst.device:
            return rows
        return peer_copy(rows, src.device, dst.device)  # on this stage's stream; the flight holds ``rows``

    def _head(self, flight: Flight, last: Stage) -> None:
        """The final norm, and the logits of the needed rows with their chosen tokens, read back without
        waiting."""
        normed = last.final_norm(flight.hidden[-1])  # [R, H]
        flight.normed = normed
        flight.keep.append(normed)  # the drafters read it on their own stream
        if not flight.needed:
            return
        dev = last.device
        if len(flight.needed) == flight.layout.rows:
            picked = normed
        else:
            picked = normed[dev.upload(np.asarray(flight.needed, np.int64))]
        logits = self.model.logits(picked)  # [len(needed), V] fp32
        if flight.wants_logprobs:  # the raw logits, copied before anything adjusts them in place
            flight.raw_logits = download(logits) if dev.is_cuda else np.array(logits, copy=True)
        spec = flight.spec
        if spec is not None and spec.tokens is None:  # launched by the host: its tokens and positions
            spec.tokens = dev.upload(flight.job.token_array())
            spec.positions = dev.upload(flight.layout.positions())
        if flight.source is not None:
            flight.masks = self._chained_masks(flight)
        if flight.masks is not None:  # a grammar's rows: only the tokens it allows may be chosen
            self.model.mask(logits, *flight.masks)
        counted = None
        if flight.adjusts is not None:  # a speculative window's rows read its proposals from its tokens
            counted = self.model.adjust(logits, flight.adjusts, None if spec is None else spec.tokens)
        if flight.draws is None:
            chosen = self.model.argmax(logits)  # [len(needed)]
        else:
            chosen = self.model.choose(logits, flight.draws)  # [len(needed)]
        if counted is not None:
            self.model.count_chosen(*counted, chosen)
        flight.chosen = chosen
        if spec is not None:
            if spec.uniforms is not None:
                spec.uniforms = dev.upload(spec.uniforms)
            with self._drafting(cupy_module().cuda.get_current_stream() if dev.is_cuda else None):
                decide(self.model, spec, chosen, logits, normed, flight.layout)
            read = {
                "accepted": spec.accepted,
                "first": spec.first,
                "tokens": spec.tokens,
                "positions": spec.positions,
            }
            if spec.found is not None:
                read["found"] = spec.found
            if any(e.masked for e in flight.job.entries):  # a window chained to it masks after them
                read["next_tokens"] = spec.next_tokens
            spec.host = {name: download(a) if dev.is_cuda else np.asarray(a) for name, a in read.items()}
            flight.keep += [*read.values(), spec.uniforms, spec.next_tokens, spec.next_positions]
        if dev.is_cuda:
            flight.chosen_host = download(chosen)
            flight.logits = download(logits) if flight.sampled else None
            flight.keep += [picked, logits, chosen]
        else:
            flight.chosen_host = np.asarray(chosen)
            flight.logits = np.asarray(logits) if flight.sampled else None

    @staticmethod
    def _chained_masks(flight: Flight) -> tuple[np.ndarray, np.ndarray]:
        """The masks of a chained window's rows under a grammar, computed on its last stage once its forward
        pass is queued: wait for the window before it (the GPU runs this one's layers meanwhile), read the
        tokens the device decided there, and move each reply's place ahead (`Slot.ahead`) on by them.
        The host so never holds up the device between two such windows.

        After a window of one row a slot, each row follows the token the source chose at its row. After a
        speculative window decided on the device, a slot's place moves on by the proposals it kept and the
        token after them (the new window's first), and its rows follow the proposals drafted after that one,
        row j the first j of them: the place ahead then stands after the window's first token."""
        source, after = flight.source, flight.after
        assert source is not None and after is not None
        flight.source = None
        source.done.wait()
        masked, bits = [], []
        if after.rows is not None:
            for i, e in enumerate(flight.job.entries):
                if e.masked:
                    ahead = e.slot.ahead
                    assert ahead is not None, "a chained row under a grammar moves a place ahead"
                    masked.append(i)
                    bits.append(ahead.bitmask_after(int(source.chosen_host[after.rows[i]])))
            return np.array(masked, np.int64), np.stack(bits)
        spec = source.spec
        assert spec is not None and flight.spec is not None
        n = spec.n
        window = spec.host["tokens"].reshape(len(spec.slots), n)
        following = spec.host["next_tokens"].reshape(len(spec.slots), n)
        for i, e in enumerate(flight.job.entries):
            if e.masked:
                ahead = e.slot.ahead
                assert ahead is not None, "a chained window under a grammar moves a place ahead"
                kept = int(spec.host["accepted"][i])
                ahead.move([*window[i, 1 : 1 + kept].tolist(), int(spec.host["first"][i])])
                masked += range(i * n, (i + 1) * n)
                bits.append(ahead.bitmasks_after(following[i, 1:].tolist()))
        return np.array(masked, np.int64), np.concatenate(bits)

    def _release_workspace(self, flight: Flight, stage: Stage) -> None:
        """Give a long prefill chunk's activation memory on this stage's GPU back to the driver.

        Chunks attend over a growing prefix, so each allocates differently sized temporaries that a caching
        pool cannot reuse; without this the pool grows with the prompt, far past the plan's workspace. It is
        done on each stage's own device, by the thread that queued the chunk there (freeing waits for the
        device, which only that stage's thread may afford).
        """
        job = flight.job
        if job.kind == "prefill" and job.rows > MAX_WINDOW_ROWS and stage.device.is_cuda:
            with device_lock(stage.device.index):  # not while another thread captures a graph here
                cupy_module().get_default_memory_pool().free_all_blocks()

    # ---- waiting ------------------------------------------------------------------------------------

    def wait_any(self, marks: Iterable[Mark]) -> None:
        """Block the host until one of ``marks`` is done (the engine calls it only when nothing else can
        be done)."""
        wait_any(marks)

    # ---- drafting -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _on_drafters(self, after: Flight | None = None) -> Iterator[None]:
        """The drafters' device and stream, ordered after ``after``'s work on the last stage."""
        last = self.stages[-1]
        stream = self._draft_stream
        with last.device.use(), _using(stream), self._drafting(stream):
            if stream is not None and after is not None:
                done = after.done
                assert isinstance(done, StageMark)
                if done.event is not None:
                    stream.wait_event(done.event)
            yield

    def draft(
        self, slot: int, token: int, depth: int, sampler: Sampler, on_device: bool = False
    ) -> Proposals:
        """`strata_runtime.engine.speculative.draft` on the drafters' stream; ``on_device``: the window is
        decided on the device, which needs no host copy of what a sampled proposal was drawn from."""
        with self._on_drafters():
            catch_up(self.model, slot)  # the rows of its windows without proposals, if any
            return draft(self.model, slot, token, depth, sampler, on_device)

    def propose(self, slot: int) -> Array:
        """A silent probe's proposal for ``slot``'s next token, queued on the drafters' stream: its deferred
        rows caught up (`catch_up`), then the argmax of the head's logits, on the device (plain greedy
        requests only, whose proposal is that argmax)."""
        with self._on_drafters():
            catch_up(self.model, slot)
            drafter = self.model.drafters[slot]
            with drafter.device.use():
                return drafter.device.xp.argmax(drafter.logits[0])

    def read_proposal(self, proposal: Array) -> int:
        """`propose`'s token on the host (its work queued long before: the window after it has finished)."""
        with self._on_drafters():
            return int(self.stages[-1].device.to_host(proposal))

    def _retire(self, flight: Flight) -> None:
        """Hold a finished flight's arrays until the drafters' stream has read them (called on that stream's
        device: an event is recorded only on a stream of the device it was made on)."""
        stream = self._draft_stream
        while self._retired and self._retired[0][0].done:
            self._retired.popleft()
        if stream is not None:
            self._retired.append((stream.record(cupy_module().cuda.Event(disable_timing=True)), flight))

    # ---- deciding a finished window ---------------------------------------------------------------

    def finish(self, flight: Flight) -> list[tuple[Slot, TokenEvent]]:
        """Wait for the flight, then verify and commit every slot's rows; return the events to send."""
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        if self._copy_error is not None:
            raise self._copy_error
        logit_row = {r: i for i, r in enumerate(flight.needed)}
        events = []
        row = 0
        with self._on_drafters(after=flight):
            for e in flight.job.entries:
                sampler, before = e.slot.sampler, e.slot.sampler.drawn
                if flight.spec is not None:
                    events += self._settle(flight, e, row)
                else:
                    events += self._decide(flight, e, row, logit_row)
                sampler.kept = e.drawn_to + sampler.drawn - before  # (windows ahead drew after it)
                row += len(e.tokens)
            self._retire(flight)
        return events

    def _decide(
        self, flight: Flight, e: Entry, row: int, logit_row: dict[int, int]
    ) -> list[tuple[Slot, TokenEvent]]:
        """One slot's rows of a finished window (starting at window row ``row``): verify and commit."""
        n, slot, normed = len(e.tokens), e.slot, flight.normed
        if slot.finished is not None:
            # A chained window queued before the window that ended the request was finished: its rows are
            # the bounded overrun of running ahead. Nothing is emitted or kept (the slot's release has
            # rewound its KV).
            flight.discarded += n
            return []
        if e.pos != slot.length:
            raise RuntimeError(
                f"slot {slot.id}: a window at position {e.pos} finished while the slot holds {slot.length} "
                "positions (windows of one slot must finish in launch order)"
            )

        def target(first: int, count: int) -> np.ndarray:
            """The target's rows [first, first + count) of ``needed``: the argmax for plain greedy, else the
            logits (`verify` adjusts and decides)."""
            if not slot.sampler.needs_logits:
                return flight.chosen_host[first : first + count]
            assert flight.logits is not None  # read whenever a sampled slot is in the window
            return flight.logits[first : first + count]

        if e.kind == "prefill":
            # Only the last row of the prompt's last chunk has logits; an earlier chunk decides nothing.
            at = logit_row.get(row + n - 1)
            if at is not None and e.chosen_on_device:  # the first token is the device's choice
                return self._finish_prefill(
                    flight, slot, n, None, normed[row : row + n], at, int(flight.chosen_host[at])
                )
            decided = None if at is None else target(at, 1)
            return self._finish_prefill(flight, slot, n, decided, normed[row : row + n], at)
        if e.on_device:  # the device chose the token (and counted it): nothing to verify
            verdict = Verdict(0, [int(flight.chosen_host[logit_row[row]])])
        elif e.masked or e.compared:  # the device chose each row's token: the proposals hold by them
            first = logit_row[row]
            verdict = verify_choices(flight.chosen_host[first : first + n], e.proposals.tokens)
        else:
            verdict = verify(target(logit_row[row], n), e.proposals, slot.sampler)
        kept = verdict.accepted + 1
        plain = e.kind == "decode" and not e.proposals.tokens  # the drafter may read these rows later
        rows = normed[row : row + n]
        commit(self.model, slot.id, slot.length, kept, rows, verdict.tokens, self.tracked, defer=plain)
        lps = self._logprobs(flight, slot, logit_row[row], verdict.tokens)
        if e.proposals.forced:  # a grammar's, not a drafter's: no measure of drafting
            event = slot.advance(kept, verdict.tokens, 0, 0, logprobs=lps)
        else:
            proposed, counted = len(e.proposals.tokens), e.on_device or (e.masked and not e.proposals.tokens)
            event = slot.advance(
                kept, verdict.tokens, proposed, verdict.accepted, counted=counted, logprobs=lps
            )
        return [(slot, event)]

    @staticmethod
    def _logprobs(flight: Flight, slot: Slot, first: int, tokens: list[int]) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of ``tokens``, decided by the needed rows from ``first`` on, where the slot's
        request asks for them."""
        top = slot.sampler.params.logprobs
        if top is None:
            return ()
        assert flight.raw_logits is not None  # copied whenever such a request is in the window
        return token_logprobs(flight.raw_logits[first : first + len(tokens)], tokens, top)

    def _settle(self, flight: Flight, e: Entry, row: int) -> list[tuple[Slot, TokenEvent]]:
        """One slot's rows (from window row ``row``) of a window decided on the device: read the decision,
        check it against `verify` on the same tokens, and account the KV it kept."""
        slot, spec = e.slot, flight.spec
        assert spec is not None
        n = spec.n
        if slot.finished is not None:  # queued ahead of the request's end: nothing is emitted or kept
            flight.discarded += n
            return []
        base = int(spec.host["positions"][row])
        if base != slot.length:
            raise RuntimeError(
                f"slot {slot.id}: a window decided on the device at position {base} finished while the slot "
                f"holds {slot.length} positions"
            )
        window = [int(t) for t in spec.host["tokens"][row : row + n]]
        i = spec.slots.index(slot.id)
        accepted, after = int(spec.host["accepted"][i]), int(spec.host["first"][i])
        tokens = [*window[1 : 1 + accepted], after]
        if slot.sampler.greedy or spec.lookup is not None:
            # The same decision as the host's own verification, or nothing is emitted: of the target's
            # choices, made on rows the device adjusted where the request asks (a looked-up window's sampled
            # rows are its draws, which decide it the same way).
            verdict = verify_choices(flight.chosen_host[row : row + n], window[1:])
            if verdict.tokens != tokens:
                raise RuntimeError(
                    f"slot {slot.id}: the device kept {accepted} proposals of {window[1:]} and chose {after} "
                    f"where verifying them against the target's choices "
                    f"{flight.chosen_host[row : row + n].tolist()} gives {verdict.tokens}"
                )
        elif not 0 <= accepted < n:
            raise RuntimeError(f"slot {slot.id}: the device kept {accepted} of {n - 1} proposals")
        self.model.settle(slot.id, base, n, accepted + 1)
        lps = self._logprobs(flight, slot, row, tokens)  # every row of a window decided there is needed
        event = slot.advance(accepted + 1, tokens, n - 1, accepted, counted=True, logprobs=lps)
        if spec.lookup is not None and slot.lookup is not None:  # the device's history holds it all now
            slot.lookup.on_device = slot.length + 1
            slot.lookup.device_missed = not spec.host["found"][i]
        return [(slot, event)]

    def _prompt_logprobs(self, normed: Array, following: list[int], top: int) -> tuple[TokenLogprob, ...]:
        """The log-probability of each prompt token in ``following`` after the rows before it: row i of a
        chunk's post-norm rows ``normed`` decides token i. The LM head runs on those rows, 256 at a time, on
        the drafters' stream (after the chunk), and the host reads each piece's logits."""
        last = self.stages[-1].device
        out: list[TokenLogprob] = []
        for i in range(0, len(following), PROMPT_LOGPROB_ROWS):
            piece = following[i : i + PROMPT_LOGPROB_ROWS]
            raw = last.to_host(self.model.logits(normed[i : i + len(piece)]))
            out += token_logprobs(raw, piece, top)
        return tuple(out)

    def _finish_prefill(
        self,
        flight: Flight,
        slot: Slot,
        n: int,
        target: np.ndarray | None,
        normed: Array,
        at: int | None,
        chosen: int | None = None,
    ) -> list[tuple[Slot, TokenEvent]]:
        """Commit a prompt chunk; ``target`` is its last row's argmax or logits, only in the last chunk, whose
        last row is needed row ``at``; or ``chosen``, the first token the device chose there (and counted,
        where the request's penalties count tokens there). A slot reading its prompt and tokens again after a
        recovery (`Slot.restart`) has its next token already."""
        p, reading, again = slot.prefilled, slot.reading, slot.resume_token
        done = p + n == len(reading)
        first: int | None = None
        if done:
            if again is not None:
                token = again
            elif chosen is not None:
                token = chosen
            else:
                assert target is not None
                # A window of one row and no proposals: `verify` decides it as it decides any.
                token = verify(target[-1:], Proposals([], []), slot.sampler).tokens[0]
            first, following = token, [*reading[p + 1 : p + n], token]
        else:
            following = list(reading[p + 1 : p + n + 1])
        commit(self.model, slot.id, slot.length, n, normed, following, self.tracked)
        top = slot.sampler.params.prompt_logprobs
        if top is not None and again is None:
            slot.prompt_logprobs += self._prompt_logprobs(normed, list(reading[p + 1 : p + n + 1]), top)
        lps: tuple[TokenLogprob, ...] = ()
        if first is not None and at is not None and again is None:
            lps = self._logprobs(flight, slot, at, [first])
        event = slot.prefilled_chunk(n, first, lps, counted=chosen is not None)
        return [] if event is None else [(slot, event)]
