"""`Engine(plan)`: the plan's stages, slots and windows, behind the `strata_runtime.api.EngineCore` interface.

The engine runs exactly what the plan says. At start it refuses a plan that needs something this runtime
does not implement, naming it. Each `step` is one scheduling round:

1. admit queued requests into free slots (staggered: whenever a slot is free);
2. run either one prefill chunk (the oldest prefilling slot) or one decode round, alternating while both
   kinds of work exist, so a long prompt never stalls the other slots' decoding;
3. a decode round is, by the plan's batch mode:
   * *solo*: one decoding slot and nothing prefilling: its token plus ``windows.solo_rows - 1`` chained MTP
     proposals (solo promotion; a newcomer demotes it again);
   * *batch MTP* (serial, one group): 2 rows per slot (token + proposal), at most 4 slots per window, the
     start rotating over the slots;
   * *serial*: one row per slot, every decoding slot in one window (at most 8);
   * *pipelined* (``batch.mode``, G groups): each group's window (its prefill chunk or its decode rows)
     enters the stages one tick after the previous group's, so the groups are on different stages at once.
     No drafts.

Everything the schedule depends on is read from the plan (`batch`, `windows`, `memory`), never re-derived.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

from strata_cfg.schema.plan import MIB, LaunchPlan
from strata_cfg.schema.windows import batch_mtp_window, plain_windows, solo_window

from ..api import PlanMismatch, Request, RequestHandle, TokenEvent
from ..model import Model
from ..model.placed import WeightStore
from ..weights.progress import Progress
from .executor import Entry, Executor, Job
from .refusals import refusals
from .sampling import Sampler
from .slot import Slot
from .speculative import Proposals, draft
from .stats import WindowStat, WindowStats

log = logging.getLogger("strata_runtime")


class Engine:
    """Executes a `LaunchPlan`; see the module docstring for the schedule."""

    def __init__(
        self, plan: LaunchPlan, progress: Progress | None = None, weights: WeightStore | None = None
    ) -> None:
        problems = refusals(plan)
        if problems:
            raise PlanMismatch("this runtime cannot run the plan as written:\n  " + "\n  ".join(problems))
        self.plan = plan
        self.model = Model.from_plan(plan, progress, weights)
        self.tokenizer = self.model.tokenizer
        self.n_slots = max(plan.batch.slots, 1)
        self.slots: list[Slot | None] = [None] * self.n_slots
        self.tracked = self.model.mtp is not None
        self.depth = plan.windows.solo_rows - 1
        """Proposals a solo window drafts after its token (0: the plan does not draft)."""
        self.executor = Executor(self.model, self.tracked)
        self._queue: deque[RequestHandle] = deque()
        self._lock = threading.Lock()
        self._admitted = 0
        self._rotation = 0
        self._plain_turn = 0
        self._prefill_turn: dict[int, bool] = {}
        self.window_stats = WindowStats()
        self.startup = self._startup_lines()
        for line in self.startup:
            log.info(line)

    # ---- EngineCore ----------------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request)
        handle.prompt_tokens = len(request.prompt_ids)
        problem = self._check(request)
        if problem:
            handle.events.put(TokenEvent((), "", "error", 0, problem))
            return handle
        with self._lock:
            self._queue.append(handle)
        return handle

    def step(self) -> bool:
        self._reap_cancelled()
        self._admit()
        active = [s for s in self.slots if s is not None]
        if not active:
            return False
        decoding = [s for s in active if s.decoding]
        prefilling = [s for s in active if s.prefilling]
        solo = len(decoding) == 1 and not prefilling
        if self.plan.batch.mode == "pipelined" and not solo:
            self._pipelined_round(active)
        else:
            self._serial_round(prefilling, decoding)
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "plan": {
                "mode": self.plan.batch.mode,
                "slots": self.n_slots,
                "groups": self.plan.batch.groups,
                "batch_mtp": self.plan.batch.mtp,
                "draft_tokens": self.plan.spec.draft_tokens,
                "stages": [s.device for s in self.plan.stages],
            },
            "queue": len(self._queue),
            "slots": [self._slot_state(i, s) for i, s in enumerate(self.slots)],
            "totals": dict(self.totals),
            "acceptance": self.acceptance,
            "recent_windows": self.window_stats.last(32),
            "drafters": self.drafter_info(),
            "experts": [stage.experts.describe() for stage in self.model.stages],
        }

    # ---- reporting -----------------------------------------------------------------------------------

    @property
    def windows(self) -> deque[WindowStat]:
        """The most recent windows, oldest first."""
        return self.window_stats.recent

    @property
    def totals(self) -> dict[str, Any]:
        """Windows, rows, tokens, proposals, accepted proposals and milliseconds since the start."""
        return self.window_stats.totals

    @property
    def acceptance(self) -> float | None:
        return self.window_stats.acceptance

    def summary(self) -> str:
        return self.window_stats.summary()

    def drafter_info(self) -> dict[str, Any]:
        d = self.model.drafters
        if not d:
            return {"device": None, "slots": [], "bytes_each": 0}
        first = next(iter(d.values()))
        return {
            "device": str(first.device),
            "slots": sorted(d),
            "bytes_each": first.nbytes,
            "kv_bytes_each": first.kv.nbytes,
        }

    def _startup_lines(self) -> list[str]:
        p = self.plan
        stages = ", ".join(f"{s.device} layers [{s.layers[0]}, {s.layers[1]})" for s in p.stages)
        lines = [
            f"stages: {stages}",
            f"slots: {self.n_slots}, mode {p.batch.mode}, {p.batch.groups} group(s), batch MTP "
            f"{'on' if p.batch.mtp else 'off'}, solo drafting {self.depth} proposal(s)",
        ]
        if p.model.routing == "calibrated":
            lines.append("routing: calibrated (skewed and persistent, through a router bias)")
        info = self.drafter_info()
        if info["device"] is None:
            lines.append("drafters: none (the plan does not draft)")
        else:
            each = info["bytes_each"] / MIB
            kv = info["kv_bytes_each"] / MIB
            lines.append(
                f"drafters: slots {info['slots']} on {info['device']} (last stage), {each:.2f} MiB each "
                f"(MTP-layer KV {kv:.2f} MiB + draft-window buffers {each - kv:.2f} MiB)"
            )
        for stage in self.model.stages:
            if stage.device.is_cuda:
                path = "CUDA graphs" if stage.cuda is not None else f"array path ({stage.cuda_refused})"
                lines.append(f"decode windows on {stage.device}: {path}")
            store = stage.experts
            if store.cached:
                total = len(store) * store.n_experts
                lines.append(
                    f"expert cache on {stage.device}: {store.slots} of {total} routed experts in VRAM "
                    f"({store.vram_bytes / MIB:.1f} MiB), all {total} in host memory "
                    f"({store.host_bytes / MIB:.1f} MiB{', pinned' if stage.device.is_cuda else ''}); "
                    f"{'adapting to the routing' if store.residency.policy.adapt else 'frozen'}"
                )
        return lines

    def _slot_state(self, i: int, s: Slot | None) -> dict[str, Any]:
        if s is None:
            return {"slot": i, "state": "free"}
        return {
            "slot": i,
            "state": "prefill" if s.prefilling else "decode",
            "request_id": s.handle.request.request_id,
            "prompt_tokens": len(s.prompt),
            "prefilled": s.prefilled,
            "generated": len(s.generated),
            "length": s.length,
            "kv_lengths": self.model.kv_lengths(i),
        }

    # ---- admission and release ---------------------------------------------------------------------

    def _check(self, r: Request) -> str | None:
        vocab = self.model.args.vocab_size
        if not r.prompt_ids:
            return "prompt_ids: the prompt is empty"
        if any(not 0 <= t < vocab for t in r.prompt_ids):
            return f"prompt_ids: every id must be in [0, {vocab})"
        if r.max_tokens < 1:
            return "max_tokens: must be at least 1"
        if any(not 0 <= t < vocab for t, _ in r.sampling.logit_bias):
            return f"logit_bias: every token id must be in [0, {vocab})"
        if len(r.prompt_ids) + 1 > self.plan.memory.context:
            return (
                f"prompt_ids: a prompt of {len(r.prompt_ids)} tokens does not fit the context of "
                f"{self.plan.memory.context} tokens per slot"
            )
        return None

    def _admit(self) -> None:
        with self._lock:
            while self._queue and None in self.slots:
                handle = self._queue.popleft()
                if handle.cancelled.is_set():
                    handle.events.put(TokenEvent((), "", "cancelled"))
                    continue
                i = self.slots.index(None)
                req = handle.request
                seed = (
                    req.sampling.seed
                    if req.sampling.seed is not None
                    else int.from_bytes(os.urandom(4), "little")
                )
                self._admitted += 1
                handle.slot = i
                self.model.admit(i, req.prompt_ids)
                self.slots[i] = Slot(
                    i,
                    handle,
                    Sampler(req.sampling, seed),
                    frozenset(req.stop_ids) | frozenset(self.tokenizer.eos_ids),
                    self.tokenizer,
                    self._admitted,
                )

    def _reap_cancelled(self) -> None:
        for s in self.slots:
            if s is not None and s.handle.cancelled.is_set():
                s.handle.events.put(s.finish("cancelled"))
                self._release(s)

    def _release(self, slot: Slot) -> None:
        """Free a slot for reuse: its KV on every stage and in its drafter is forgotten."""
        self.model.rewind(slot.id, 0)
        if slot.id in self.model.drafters:
            self.model.drafters[slot.id].rewind(0)
        self.slots[slot.id] = None

    # ---- rounds --------------------------------------------------------------------------------------

    def _serial_round(self, prefilling: list[Slot], decoding: list[Slot]) -> None:
        job = self._next_job(0, prefilling, decoding)
        if job is None:
            return
        t0 = time.perf_counter()
        normed = self.executor.run_serial(job)
        self._deliver(job, self.executor.finish(job, normed), t0)
        self.executor.release_workspace(job)

    def _pipelined_round(self, active: list[Slot]) -> None:
        groups = self.plan.batch.groups
        jobs = []
        for g in range(groups):
            members = [s for s in active if s.id % groups == g]
            job = self._next_job(
                g, [s for s in members if s.prefilling], [s for s in members if s.decoding], pipelined=True
            )
            if job is not None:
                jobs.append(job)
        if not jobs:
            return
        t0 = time.perf_counter()
        normed = self.executor.run_pipelined(jobs)
        for job, n in zip(jobs, normed, strict=True):
            self._deliver(job, self.executor.finish(job, n), t0, share=len(jobs))
            self.executor.release_workspace(job)

    def _next_job(
        self, group: int, prefilling: list[Slot], decoding: list[Slot], pipelined: bool = False
    ) -> Job | None:
        """A prefill chunk or a decode window, alternating while both are waiting."""
        turn = self._prefill_turn.get(group, True)
        if prefilling and (turn or not decoding):
            self._prefill_turn[group] = False
            return self._prefill_job(min(prefilling, key=lambda s: s.admitted_at))
        self._prefill_turn[group] = True
        if not decoding:
            return None
        return self._decode_job(decoding, prefilling, pipelined)

    def _prefill_job(self, slot: Slot) -> Job:
        n = min(self.plan.memory.prefill_chunk, len(slot.prompt) - slot.prefilled)
        tokens = list(slot.prompt[slot.prefilled : slot.prefilled + n])
        return Job("prefill", [Entry(slot, "prefill", tokens)])

    def _decode_job(self, decoding: list[Slot], prefilling: list[Slot], pipelined: bool) -> Job | None:
        decoding = [s for s in decoding if not self._out_of_context(s)]
        if not decoding:
            return None
        ids = [s.id for s in decoding]
        by_id = {s.id: s for s in decoding}
        if len(decoding) == 1 and not prefilling and not pipelined:
            rows = solo_window(ids[0], min(self.depth, self._room(decoding[0])))
            kind = "solo"
        elif self.plan.batch.mtp:
            # Rotate by slot id, so that slots finishing or arriving do not make the others lose their turn.
            start = next((i for i, sid in enumerate(ids) if sid >= self._rotation), 0)
            rows = batch_mtp_window(ids, start)
            self._rotation = rows[-1].slot + 1
            kind = "batch-mtp"
        else:
            windows = plain_windows(ids)
            rows = windows[self._plain_turn % len(windows)]
            self._plain_turn += 1
            kind = "pipelined" if pipelined else "serial"
        entries = []
        for sid in dict.fromkeys(r.slot for r in rows):
            slot, token = by_id[sid], by_id[sid].token
            assert token is not None  # a decoding slot has its next input
            depth = min(sum(1 for r in rows if r.slot == sid) - 1, self._room(slot))
            proposals = draft(self.model, sid, token, depth, slot.sampler) if depth > 0 else Proposals([], [])
            entries.append(Entry(slot, "decode", [token, *proposals.tokens], proposals))
        return Job(kind, entries)

    def _room(self, slot: Slot) -> int:
        """Proposals that still fit the slot's context after its token."""
        return max(0, self.plan.memory.context - slot.length - 1)

    def _out_of_context(self, slot: Slot) -> bool:
        if slot.length + 1 <= self.plan.memory.context:
            return False
        slot.handle.events.put(slot.finish("length"))
        self._release(slot)
        return True

    def _deliver(self, job: Job, events: list[tuple[Slot, TokenEvent]], t0: float, share: int = 1) -> None:
        ms = (time.perf_counter() - t0) * 1000 / share
        accepted = sum(ev.accepted_proposals for _, ev in events)
        slots = tuple(e.slot.id for e in job.entries)
        window = WindowStat(job.kind, job.rows, ms, job.proposals, accepted, slots)
        self.window_stats.record(window, sum(len(ev.token_ids) for _, ev in events))
        for slot, ev in events:
            slot.handle.events.put(ev)
            if ev.finished is not None:
                self._release(slot)
