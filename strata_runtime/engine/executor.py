"""Running windows: serially through the stages, or several pipelined at once; then deciding each slot.

A `Job` is one window: a prefill chunk of one slot, or the decode rows (token plus proposals) of one or
more slots. `run_serial` passes it through every stage in order. `run_pipelined` runs several jobs as a
wavefront: at tick t, stage s works on job t - s, so different groups' windows are on different stages at
the same time. On GPUs each stage's work runs in its own thread, on its own device and stream, so the
devices really overlap; on virtual CPU devices the same ticks run one after another. `finish` verifies
each slot's rows and commits (accept/rewind) through `strata_runtime.engine.speculative`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..api import TokenEvent
from ..backend import Array, Device, cupy_module, transfer
from ..layout import Layout
from ..model import Model
from .slot import Slot
from .speculative import Proposals, commit, verify


@dataclass
class Entry:
    """One slot's rows in a window."""

    slot: Slot
    kind: Literal["prefill", "decode"]
    tokens: list[int]
    proposals: Proposals = field(default_factory=lambda: Proposals([], []))


@dataclass
class Job:
    """One window."""

    kind: str
    """``prefill``, ``solo``, ``serial``, ``batch-mtp`` or ``pipelined``."""
    entries: list[Entry]

    def layout(self) -> Layout:
        return Layout.of([(e.slot.id, len(e.tokens), e.slot.length) for e in self.entries])

    def token_array(self) -> np.ndarray:
        return np.array([t for e in self.entries for t in e.tokens], dtype=np.int64)

    @property
    def rows(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    @property
    def proposals(self) -> int:
        return sum(len(e.proposals.tokens) for e in self.entries)


class Executor:
    """Runs jobs on a model; ``tracked`` keeps every slot's drafter caught up after each window."""

    def __init__(self, model: Model, tracked: bool) -> None:
        self.model, self.tracked = model, tracked
        self.devices = [s.device for s in model.stages]
        self._streams: dict[Device, Any] = {}  # CuPy streams
        self._pool = (
            ThreadPoolExecutor(max_workers=len(self.devices), thread_name_prefix="strata-stage")
            if any(d.is_cuda for d in self.devices) and len(self.devices) > 1
            else None
        )
        self._lock = threading.Lock()

    def run_serial(self, job: Job) -> Array:
        """The job's post-final-norm rows [R, H] on the last device."""
        return self.model.forward(job.token_array(), job.layout())

    def release_workspace(self, job: Job) -> None:
        """Give a long prefill chunk's activation memory back to the driver.

        Chunks attend over a growing prefix, so each allocates differently sized temporaries that a caching
        pool cannot reuse; without this the pool grows with the prompt, far past the plan's workspace.
        """
        if job.kind == "prefill" and job.rows > MAX_WINDOW_ROWS and any(d.is_cuda for d in self.devices):
            cupy_module().get_default_memory_pool().free_all_blocks()

    def run_pipelined(self, jobs: list[Job]) -> list[Array]:
        """Several jobs (different slot groups) in flight at once, one per stage at each tick."""
        stages = self.model.stages
        layouts = [j.layout() for j in jobs]
        hidden: list[Array] = [None] * len(jobs)
        where: list[Device | None] = [None] * len(jobs)

        def work(s: int, w: int) -> None:
            stage = stages[s]
            with stage.device.use(), self._stream(stage.device):
                if s == 0:
                    h = stage.embed(jobs[w].token_array())
                else:
                    src = where[w]
                    assert src is not None  # the previous stage ran this job at the previous tick
                    h = transfer(hidden[w], src, stage.device)
                hidden[w] = stage.forward(h, layouts[w])
                where[w] = stage.device
                if stage.device.is_cuda:
                    cupy_module().cuda.get_current_stream().synchronize()

        for tick in range(len(jobs) + len(stages) - 1):
            pairs = [(s, tick - s) for s in range(len(stages)) if 0 <= tick - s < len(jobs)]
            if self._pool is None:
                for s, w in reversed(pairs):
                    work(s, w)
            else:
                for f in [self._pool.submit(work, s, w) for s, w in pairs]:
                    f.result()
        return [self.model.last.final_norm(h) for h in hidden]

    def _stream(self, device: Device) -> Any:
        """The device's own stream (GPUs), or a null context (CPU devices)."""
        if not device.is_cuda:
            import contextlib

            return contextlib.nullcontext()
        with self._lock:
            if device not in self._streams:
                with device.use():
                    self._streams[device] = cupy_module().cuda.Stream(non_blocking=True)
        return self._streams[device]

    # ---- deciding a finished window ---------------------------------------------------------------

    def finish(self, job: Job, normed: Array) -> list[tuple[Slot, TokenEvent]]:
        """Verify and commit every slot's rows; return the events to send."""
        last = self.model.last
        # Logits only where a token is decided: every decode row, and the last row of a prompt's final
        # chunk (a long chunk's other rows would cost an LM-head product of their own for nothing).
        needed: list[int] = []
        row = 0
        for e in job.entries:
            n = len(e.tokens)
            if e.kind == "decode":
                needed += range(row, row + n)
            elif e.slot.prefilled + n == len(e.slot.prompt):
                needed.append(row + n - 1)
            row += n
        logit_row = {r: i for i, r in enumerate(needed)}
        argmax, host_logits = np.zeros(0, np.int64), None
        if needed:
            with last.device.use():
                picked = normed if len(needed) == job.rows else normed[last.device.xp.asarray(needed)]
            logits = self.model.logits(picked)  # [len(needed), V] fp32 on the last device
            with last.device.use():
                argmax = last.device.to_host(last.device.xp.argmax(logits, axis=-1))  # [len(needed)]
            if any(e.slot.sampler.needs_logits for e in job.entries):
                host_logits = last.device.to_host(logits)  # [len(needed), V]
        events = []
        row = 0
        for e in job.entries:
            n, slot = len(e.tokens), e.slot

            def target(first: int, count: int, slot: Slot = slot) -> np.ndarray:
                """The target's rows [first, first + count) of ``needed``: the argmax for plain greedy, else
                the logits (`verify` adjusts and decides)."""
                if not slot.sampler.needs_logits:
                    return argmax[first : first + count]
                assert host_logits is not None  # read above whenever a sampled slot is in the window
                return host_logits[first : first + count]

            if e.kind == "prefill":
                # Only the last row of the prompt's last chunk has logits; an earlier chunk decides nothing.
                at = logit_row.get(row + n - 1)
                decided = None if at is None else target(at, 1)
                events += self._finish_prefill(slot, n, decided, normed[row : row + n])
            else:
                verdict = verify(target(logit_row[row], n), e.proposals, slot.sampler)
                kept = verdict.accepted + 1
                mine = normed[row : row + n]
                commit(self.model, slot.id, slot.length, kept, mine, verdict.tokens, self.tracked)
                proposed = len(e.proposals.tokens)
                events.append((slot, slot.advance(kept, verdict.tokens, proposed, verdict.accepted)))
            row += n
        return events

    def _finish_prefill(
        self, slot: Slot, n: int, target: np.ndarray | None, normed: Array
    ) -> list[tuple[Slot, TokenEvent]]:
        """Commit a prompt chunk; ``target`` is its last row's argmax or logits, only in the last chunk."""
        p, prompt = slot.prefilled, slot.prompt
        done = p + n == len(prompt)
        first: int | None = None
        if done:
            assert target is not None
            # The first token is a window of one row and no proposals: `verify` decides it as it decides any.
            token = verify(target[-1:], Proposals([], []), slot.sampler).tokens[0]
            first, following = token, [*prompt[p + 1 : p + n], token]
        else:
            following = list(prompt[p + 1 : p + n + 1])
        commit(self.model, slot.id, slot.length, n, normed, following, self.tracked)
        event = slot.prefilled_chunk(n, first)
        return [] if event is None else [(slot, event)]
