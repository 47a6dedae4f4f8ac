"""`Engine(plan)`: the plan's stages, slots and windows, behind the `strata_runtime.api.EngineCore` interface.

The engine runs exactly what the plan says. At start it refuses a plan that needs something this runtime
does not implement, naming it. Each `step` first admits queued requests into free slots (staggered: whenever
a slot is free), then, by the plan's batch mode:

* *serial windows* (one group): one window, launched and finished at once. It is either one prefill chunk
  (the oldest prefilling slot's, with the whole rest of other waiting prompts where they fit the chunk's
  rows: `_with_short_prompts`) or one decode window, alternating while both kinds of work exist, so a long
  prompt never stalls the other slots' decoding; a prompt that is the only work reads in chunks of
  ``memory.prefill_chunk_alone``. A decode window is
  * *solo*: one decoding slot and nothing prefilling: its token plus ``windows.solo_rows - 1`` chained MTP
    proposals (solo promotion; a newcomer demotes it again), or, with ``spec.method = "ngram"``, the
    tokens that followed the latest earlier occurrence of its text's last few tokens
    (`strata_runtime.engine.lookup`), decided on the device, which looks the next window's proposals up
    there (`strata_runtime.engine.device_spec.decide_lookup`);
  * *batch MTP*: 2 rows per slot (token + proposal), at most 4 slots per window, the start rotating;
    but when every routed expert is resident and more slots decode than one window holds, serial
    windows instead (`_batch_mtp_serves`): a row then brings a token, not three quarters of one; and
    with ``spec.adaptive_depth``, serial windows wherever their measured times give more tokens per second
    (`strata_runtime.engine.window_choice.WindowChoice.batch_drafts`);
  * *serial*: one row per slot, every decoding slot in one window (at most 8); with
    ``spec.method = "ngram"``, looked-up proposals in the rows it spares (`_look_up_spare_rows`).

  A solo or serial window of one row per slot whose tokens the device chooses runs ahead: up to
  ``batch.run_ahead`` windows are in flight, each reading on the device the tokens the one before it chose,
  so the GPU does not wait for the host between them (`_serial_round`); the windows queued past a request's
  stop are discarded. A solo or batch-MTP window with proposals is decided on the device
  (`strata_runtime.engine.device_spec`) and runs ahead the same way (`_spec_continuation`). Pipelined
  groups chain their decode windows (plain or batch-MTP) the same way, each group on its own.
* *the continuous pipeline* (``batch.mode`` pipelined, G groups; slot s is in group s % G): windows of
  different groups stay in flight across steps. A step launches the next window (chosen as above, within
  the group) of every group that has nothing in flight, the group that has waited longest first; it
  finishes every flight that is done, oldest first; and only when it could do neither does the host block,
  on the first mark that would let it. So while one group's tokens are verified on the host, the other
  groups' windows are on the GPUs, and the finished group's next window enters stage 0 at once. A prompt's
  chunks need no host decision until the last one, so a group whose only work is one prompt streams its
  chunks: the next one is launched as soon as the previous one has left stage 0, up to one per stage, so
  chunk k is on stage 1 while chunk k + 1 is on stage 0. With ``batch.mtp`` the decode windows of a group
  are batch-MTP windows (the drafters, on the last stage, draft when the group's previous window is
  finished). One slot alone with nothing in flight still takes the solo window.

Everything the schedule depends on is read from the plan (`batch`, `windows`, `memory`), never re-derived.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.windows import (
    BATCH_MTP_SLOTS_PER_WINDOW,
    MAX_WINDOW_ROWS,
    batch_mtp_window,
    plain_windows,
    solo_window,
)

from ..api import PlanMismatch, Recovery, Request, RequestHandle, TokenEvent, request_problem
from ..bad_words import BadWords, WithGrammar, word_ids
from ..experts.cache import Snapshot
from ..model import Model
from ..model.placed import WeightStore
from ..structured import GrammarError, Grammars, grammars_for
from ..weights.progress import Progress
from . import check, device_spec, speculative
from .depth import Holds, expected_tokens
from .executor import Executor
from .flight import Chained, Flight, Mark
from .job import CHAINED, Entry, Job
from .lookup import TextLookup
from .prefix import STORE_LEAST, Kept, Prefixes, PrefixStore, Stored, worth_waiting
from .refusals import refusals
from .report import engine_stats, startup_lines
from .sampling import Sampler
from .slot import Slot
from .speculative import Proposals
from .stats import WindowStat, WindowStats
from .warm import WARM_LABEL, run_staggered, warm_requests
from .window_choice import WindowChoice

log = logging.getLogger("strata_runtime")

CHECK_STEPS = 1000
"""Steps the self-check request may take (`Engine.self_check`): it needs a few."""

RESTARTS_MOST = 1
"""Recoveries in a row a request is carried through (`Engine.recover`): one held when a step fails again
soon after it was carried on is ended with the error instead, since it may be what makes the steps fail."""

RESTART_FORGOTTEN = 64
"""Tokens a request carried through a recovery decodes after it before that recovery counts no more: a
request that makes steps fail does so again while it reads its tokens again or soon after, and one that
served this many more tokens is not taken for it when a later, unrelated failure comes."""


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
        self.prefixes = Prefixes(self.n_slots, plan.memory.prefix_reuse)
        """What each free slot's KV keeps for a request that begins the same way (``memory.prefix_reuse``)."""
        self.tracked = self.model.mtp is not None
        self.choice = WindowChoice(plan)
        """What the windows measured, and each request's drafting depth and batch windows' kind from it."""
        self.depth = self.choice.depth
        """Proposals a solo window drafts at most after its token (0: the plan does not draft)."""
        self.forcing = True
        """Whether the tokens a request's grammar forces are read as proposals (`speculative.forced`), up to
        a window's rows at once; off, one a window as any other token (`scripts/bench_forced.py` compares)."""
        self.lookup = plan.spec.ngram
        """Whether requests draft by n-gram lookup in their own text (``spec.method = "ngram"``): alone, in
        solo windows; together, in the rows a serial or pipelined window spares (`_look_up_spare_rows`)."""
        self.lookup_on_device = True
        """Whether windows of looked-up proposals (a request alone's, or a serial window's where every slot
        carries as many) are decided on the device, each looking up the next one's proposals there, so that
        they run ahead of the host (`_decided_on_device`); off, the host looks up every window's proposals
        from the tokens it reads (`scripts/bench_lookup.py` compares)."""
        self.masks_on_device = True
        """Whether a grammar's rows are masked and chosen on the device (`Entry.masked`); off, the host reads
        their logits and chooses (`scripts/bench_grammar_cost.py` compares)."""
        self.grammar_drafts_on_device = True
        """Whether drafted windows of requests under a grammar (or bad words of several tokens) are decided
        on the device and run ahead (`_device_decides`); off, the host verifies each one before it launches
        the next (`scripts/bench_grammar_cost.py` compares)."""
        self.first_tokens_on_device = True
        """Whether a prompt's first token is chosen on the device (`Entry.on_device`, `Entry.masked`); off,
        the host reads the prompt's last row's logits and chooses (`scripts/bench_first_token.py`
        compares)."""
        self.pipelined = plan.batch.mode == "pipelined"
        self.executor = Executor(self.model, self.tracked, overlap=self.pipelined)
        self.store = PrefixStore(plan.prefix_store_pages, self.executor.page_bytes)
        """Kept prefixes that no slot holds any more, in host memory (``memory.prefix_store_mib``), in pages
        the executor allocates once, here."""
        if self.store.on:
            self.executor.open_store(self.store.pages)
        self._recalls = self.store.on and plan.experts.recall_stored
        """Whether a prefix copied back from the store brings back what the expert caches had learned from
        its conversation (``experts.recall_stored``; nothing changes where no cache adapts)."""
        self._routed: dict[int, list[Any] | None] = {}
        """For each released slot, what the expert caches had learned when it was released
        (`Executor.expert_scores`), kept with its prefix where the store takes it."""
        self._queue: deque[RequestHandle] = deque()
        self._lock = threading.Lock()
        self._admitted = 0
        self._rotation: dict[int, int] = {}
        self.all_experts_resident = all(g.all_experts_resident for g in plan.gpus if g.role == "stage")
        """Whether every stage holds all its routed experts in VRAM (no expert cache)."""
        self._plain_turn: dict[int, int] = {}
        self._prefill_turn: dict[int, bool] = {}
        self._flights: deque[Flight] = deque()
        """Windows in flight, in launch order (which is also the order they finish in)."""
        self._chain: deque[Flight] = deque()
        """Serial decode windows in flight, each after the window it reads its tokens from (run-ahead)."""
        self._undelivered: list[tuple[Slot, TokenEvent]] = []
        """The events of the window finished last, until they are delivered."""
        self._restarting: list[Slot] = []
        """Requests a recovery carries on (`recover`), until they take their slots back (`_admit`)."""
        self._admitting = True
        """Whether `_admit` admits: not while the self-check runs (`self_check`)."""
        self.run_ahead = plan.batch.run_ahead
        """Chained windows in flight at most (``batch.run_ahead``); 1 runs every window alone."""
        self._idle_since: dict[int, int] = {}
        """Each group's turn when its last window finished: the longest-waiting group launches first."""
        self._turns = itertools.count(1)
        self._delivered_at = time.perf_counter()
        self._first_runs_delivered = self.model.first_runs()
        """`Model.first_runs` when the last window was delivered."""
        self.window_stats = WindowStats()
        self._checked: check.Reading | None = None
        """What the first `self_check` read, which later ones compare with."""
        self.warmed: dict[str, Any] | None = None
        """What `warm_up` ran (windows, seconds); None when it did not run."""
        if self.lookup:
            self.executor.open_lookup(self.n_slots, plan.memory.context)
        device_spec.prepare(self.model, self._spec_shapes(), self.executor.lookup_history)
        self.startup = startup_lines(self)
        for line in self.startup:
            log.info(line)

    @property
    def grammars(self) -> Grammars:
        """Requests' grammars over the model's vocabulary, read through the engine's tokenizer
        (`strata_runtime.structured`)."""
        return grammars_for(self.tokenizer, self.model.args.vocab_size)

    # ---- EngineCore ----------------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request)
        handle.prompt_tokens = len(request.prompt_ids)
        problem = self._check(request)
        sampling = request.sampling
        if problem is None and sampling.grammar is not None:
            try:  # compiled here, on the caller's thread, not the engine's
                handle.grammar = self.grammars.matcher(sampling.grammar, sampling.reasoning)
            except GrammarError as exc:
                problem = f"grammar: {exc}"
        masked_ids = handle.grammar is not None and sampling.allowed_token_ids is not None
        if problem is None and (sampling.bad_words or masked_ids):
            problem = self._layer_masks(handle)
        if problem:
            handle.events.put(TokenEvent((), "", "error", 0, problem))
            return handle
        with self._lock:
            self._enqueue(handle)
        return handle

    def _layer_masks(self, handle: RequestHandle) -> str | None:
        """Tokenize a request's bad words (`strata_runtime.bad_words`) on the caller's thread: one-token words
        alone, with no grammar, become a ban in its bias (``handle.banned``); otherwise the words are held
        as a grammar is (``handle.grammar``), beside the grammar where it has one, and so is
        ``allowed_token_ids`` under a grammar (``handle.allowed_in_masks``), whose masks give way where
        they would leave the grammar nothing. What is wrong with them, naming the field, or None."""
        vocab = self.model.args.vocab_size
        words = word_ids(handle.request.sampling.bad_words, self.tokenizer)
        outside = sorted({t for w in words for t in w if not 0 <= t < vocab})
        if outside:
            return f"bad_words: they tokenize to ids outside the model's vocabulary of {vocab}: {outside[:8]}"
        singles = {w[0] for w in words if len(w) == 1}
        allowed = handle.request.sampling.allowed_token_ids
        if allowed is not None and set(allowed) <= singles:
            return "bad_words: they ban every token allowed_token_ids allows"
        if handle.grammar is None and all(len(w) == 1 for w in words):
            handle.banned = tuple(sorted(singles))
            return None
        if handle.grammar is None:
            handle.grammar = BadWords(words, vocab)
            return None
        held = BadWords(words, vocab, handle.grammar.width, allowed)
        handle.grammar, handle.allowed_in_masks = WithGrammar(handle.grammar, held), allowed is not None
        return None

    def _enqueue(self, handle: RequestHandle) -> None:
        """Queue ``handle`` behind every request waiting of its priority or a lower one (under the lock)."""
        priority = handle.request.priority
        at = next((i for i, h in enumerate(self._queue) if h.request.priority > priority), None)
        self._queue.insert(len(self._queue) if at is None else at, handle)

    def step(self) -> bool:
        self._reap_cancelled()
        self._admit()
        active = [s for s in self.slots if s is not None]
        if not active and not self._flights and not self._chain:
            self._settle_experts()
            return False
        decoding = [s for s in active if s.decoding]
        prefilling = [s for s in active if s.prefilling]
        solo = len(decoding) == 1 and not prefilling
        if self.pipelined and not self._chain and (self._flights or not solo):
            self._pipelined_step()
        else:
            self._serial_round(prefilling, decoding)
        return True

    def recover(self, error: BaseException) -> Recovery:
        """After `step` raised ``error``: bring the engine back to where it serves, without loading anything
        again, carrying on the requests it held (`Slot.restart`: each reads its prompt and the tokens it
        was sent again, then goes on) and serving the queue after them.

        Every window in flight is let go once its stages' threads and devices have run what was queued
        (`Executor.quiesce`, which raises where a device reports an error: then nothing more can run
        there). Events a window decided before the failure and not yet delivered are delivered first. Every
        slot forgets its KV and what it kept for prefix reuse, and the prefix store is emptied: a window
        that failed part-way may have written any of it. A request is ended with an error event instead
        where it was carried through a recovery shortly before (`RESTARTS_MOST` in a row, with fewer than
        `RESTART_FORGOTTEN` tokens decoded since: it may be what fails), or where it
        was decided tokens that cannot be sent on as they were (with their log-probabilities, or with the
        request's end). What the engine learned of window times and drafting, and what the expert caches
        hold, stay. Whether the model still computes what it computed at start is `self_check`'s to say; the
        requests carried on wait for it, in `_restarting`, and take their own slots back at the next step."""
        self.executor.quiesce()
        self._flights.clear()
        self._chain.clear()
        undelivered, self._undelivered = self._undelivered, []
        why = f"the engine failed while running this request ({type(error).__name__}: {error})"
        resumed = ended = 0
        for i, slot in enumerate(self.slots):
            self.slots[i] = None
            self._rewind_slot(i, 0)
            if slot is None or slot.told:
                continue
            sent = self._sent_on(slot, undelivered)
            if slot.told:  # its last event was decided before the failure
                continue
            slot.forget_restarts(RESTART_FORGOTTEN)
            again = slot.restarts_close >= RESTARTS_MOST
            if sent and slot.finished is None and not again:
                slot.restart()
                self._restarting.append(slot)
                resumed += 1
                continue
            if not again:
                how = "; tokens decided for it in the failed window could not be sent as they were"
            elif slot.restarts:
                since = len(slot.generated) - slot.restarted_at
                how = (
                    f"; it was carried on through an earlier failed step and decoded {since} of "
                    f"{RESTART_FORGOTTEN} tokens since, so it may be what makes the steps fail"
                )
            else:  # `RESTARTS_MOST` 0: nothing is carried on
                how = ""
            slot.tell(slot.finish("error", why + how))
            ended += 1
        self.forget_prefixes()  # and the store
        self._routed.clear()
        self._idle_since.clear()
        self._delivered_at = time.perf_counter()
        self._settle_experts()
        return Recovery(resumed, ended)

    @staticmethod
    def _sent_on(slot: Slot, undelivered: list[tuple[Slot, TokenEvent]]) -> bool:
        """Send ``slot``'s tokens that a window decided before a step failed and no event put yet: the
        window's own event, where the failure came before it was delivered, or one event with their tokens
        and text where they carry no more than that. False where there are such tokens and neither can
        send them (a failure inside a window's deciding, where the request asks for log-probabilities, or
        a decided end): the request is then ended."""
        tokens, text = slot.untold()
        event = next((ev for s, ev in undelivered if s is slot), None)
        if event is not None and list(event.token_ids) == tokens and event.text == text:
            slot.tell(event)
            return True
        if slot.finished is None and not tokens:
            return True
        params = slot.sampler.params
        if slot.finished is not None or params.logprobs is not None or params.prompt_logprobs is not None:
            return False
        slot.tell(TokenEvent(tuple(tokens), text, None, 0))
        return True

    def self_check(self) -> str | None:
        """Run the self-check request (`strata_runtime.engine.check`) alone. The first call records what the
        model gives: make it while the engine is known sound (after loading). Each later call compares with
        that, and returns where the model now departs from it, or None.

        Call only while no request holds a slot. No request is admitted while it runs: those queued, those
        that arrive meanwhile (from the server's threads) and those a recovery carries on (`recover`, which
        leaves every slot free for the check) wait for it. It leaves no trace in the window statistics,
        what proposals did, or the kept prefixes (an expert cache counts its routing as a request's)."""
        assert all(s is None for s in self.slots), "the self-check runs while no request holds a slot"
        request = check.probe_request(self.model.args.vocab_size, self.plan.memory.context)
        stats, holds = self.window_stats, self.choice.holds()
        self.window_stats = WindowStats()
        self._admitting = False
        try:
            handle = RequestHandle(request)
            problem = self._check(request)
            assert problem is None, problem
            assert self._take_slot(handle), "the self-check's request takes a free slot at once"
            events: list[TokenEvent] = []
            for _ in range(CHECK_STEPS):
                self.step()
                while not handle.events.empty():
                    events.append(handle.events.get_nowait())
                if events and events[-1].finished is not None:
                    break
            else:
                raise RuntimeError(f"the self-check request did not finish within {CHECK_STEPS} steps")
        finally:
            self._admitting = True
            self.window_stats = stats
            self.choice.restore_holds(holds)
        if handle.slot is not None and self.slots[handle.slot] is None:  # what it kept for prefix reuse
            self._rewind_slot(handle.slot, 0)
            self.prefixes.kept[handle.slot] = None
            self._routed.pop(handle.slot, None)
        reading = check.read(events)
        if self._checked is None:
            self._checked = reading
            return None
        return check.disagreement(self._checked, reading)

    def close(self) -> None:
        """Stop the engine's stage threads (an engine that is dropped need not call it: they are daemons)."""
        self.executor.close()

    def warm_up(self, report: Callable[[str, float], None] | None = None) -> int:
        """Run the windows serving will run before the first request does, where a stage is on a GPU: the
        first window of each row count runs eagerly and the second captures its CUDA graph (and the drafting
        head's), work that would otherwise fall on the first requests' windows. Returns the windows run (0
        on CPU devices, where nothing is captured).

        The requests (`strata_runtime.engine.warm.warm_requests`) run staggered, each joining two tokens
        after the one before it: so windows of one slot alone (at each solo depth), and of every number of
        slots together, serial and batch-MTP (and every pipelined group), run at least twice. Then every
        window shape of 1 to 8 rows that this mix did not capture is captured
        (`strata_runtime.model.placed.Model.capture_window_graphs`): a short prompt's last window and a
        request's last take any row count. The requests are then forgotten (`forget_requests`), and what their
        slots kept for prefix reuse (`forget_prefixes`): the window
        statistics and what the proposals did start afresh; the window times measured by the windows that
        replayed a graph are kept, so the first requests' drafting starts from what each shape takes.
        ``report`` is told (label, fraction done) as each request joins."""
        if not any(stage.device.is_cuda for stage in self.model.stages):
            return 0
        t0 = time.perf_counter()
        cached = any(stage.experts.cached for stage in self.model.stages)
        windows = int(self.window_stats.counts["windows"])
        run_staggered(self, warm_requests(self.plan, self.model.args.vocab_size, cached), report)
        ran = int(self.window_stats.counts["windows"]) - windows
        self._warm_copy()
        self.executor.idle()  # the copy, queued by the stages' threads, before the capture's windows
        self.forget_prefixes()  # the capture writes slot 0's KV, and no request begins as these did
        ran += self.model.capture_window_graphs()  # shapes the mix did not run twice; every slot is free
        self.forget_requests()
        if report is not None:
            report(WARM_LABEL, 1.0)
        seconds = time.perf_counter() - t0
        self.warmed = {"windows": ran, "seconds": round(seconds, 3)}
        log.info("warmed up: %d windows in %.1f s", ran, seconds)
        return ran

    def forget_requests(self) -> None:
        """Start afresh, as an engine that served no request: the window statistics and what proposals did
        (each request kind's acceptance, from which a new request's drafting depth starts). The measured
        window times are kept: only windows that ran no kernel or window shape for the first time count in
        them (`_deliver`), so they are the times each shape takes. After a warm-up, whose requests'
        proposals say nothing of real text."""
        self.window_stats = WindowStats()
        self._first_runs_delivered = self.model.first_runs()  # what ran outside windows is not theirs
        self.choice.forget_requests()

    def drafting_state(self) -> dict[str, Holds]:
        """What earlier requests' proposals taught each request kind (`WindowChoice.holds`): the chance that
        a proposal at each position holds, from which a new request's drafting depth starts. A copy."""
        return self.choice.holds()

    def restore_drafting(self, state: dict[str, Holds]) -> None:
        """Bring each request kind's shared acceptance back to ``state`` (from `drafting_state`), so that
        benchmark repeats each start from the same; a kind not in ``state`` starts afresh. The measured
        window times are kept. Call only while no request is in flight."""
        self.choice.restore_holds(state)

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Windows launched and not yet finished."""
        return len(self._flights) + len(self._chain)

    # ---- the expert caches, between benchmark runs ----------------------------------------------------

    def expert_state(self) -> list[Snapshot]:
        """What each stage's expert cache holds and has learned."""
        return [stage.experts.snapshot() for stage in self.model.stages]

    def restore_experts(self, state: list[Snapshot]) -> None:
        """Bring each stage's expert cache back to ``state`` (from `expert_state`), so that benchmark arms
        sharing the caches each start from the same contents, and adapt by this engine's plan's policy.
        Call only while no window is in flight."""
        for stage, snap in zip(self.model.stages, state, strict=True):
            if stage.policy is not None:
                stage.experts.residency.policy = stage.policy
            if stage.cuda_experts is not None:
                stage.cuda_experts.restore(snap)
            else:
                stage.experts.restore(snap)

    def _settle_experts(self) -> None:
        """With nothing left to run, hand each GPU stage's expert cache what its kernels counted since the
        last read, so that what the caches served is exact while the engine is idle."""
        self.executor.settle_experts()

    # ---- reporting -----------------------------------------------------------------------------------

    @property
    def windows(self) -> deque[WindowStat]:
        """The most recent windows, oldest first."""
        return self.window_stats.recent

    @property
    def totals(self) -> dict[str, Any]:
        """Windows, rows, tokens, proposals, accepted proposals and milliseconds since the start."""
        return {**self.window_stats.totals, **self.prefixes.totals, **self.store.totals}

    @property
    def acceptance(self) -> float | None:
        return self.window_stats.acceptance

    def summary(self) -> str:
        return self.window_stats.summary()

    # ---- admission and release ---------------------------------------------------------------------

    def _check(self, r: Request) -> str | None:
        vocab = self.model.args.vocab_size
        problem = request_problem(r)
        if problem is not None:
            return problem
        if any(not 0 <= t < vocab for t in r.prompt_ids):
            return f"prompt_ids: every id must be in [0, {vocab})"
        if any(not 0 <= t < vocab for t, _ in r.sampling.logit_bias):
            return f"logit_bias: every token id must be in [0, {vocab})"
        if any(not 0 <= t < vocab for t in r.sampling.allowed_token_ids or ()):
            return f"allowed_token_ids: every token id must be in [0, {vocab})"
        allowed = set(r.sampling.allowed_token_ids or ())
        stops = set(r.stop_ids) | set(() if r.ignore_eos else self.tokenizer.eos_ids)
        if allowed and r.sampling.min_tokens > 0 and allowed <= stops:
            return "min_tokens: every token allowed_token_ids allows ends the reply, so none could come first"
        think = r.sampling.reasoning
        if think is not None and not (0 <= think.open_id < vocab and 0 <= think.close_id < vocab):
            return f"reasoning: the think block's open_id and close_id must be in [0, {vocab})"
        if len(r.prompt_ids) + 1 > self.plan.memory.context:
            return (
                f"prompt_ids: a prompt of {len(r.prompt_ids)} tokens does not fit the context of "
                f"{self.plan.memory.context} tokens per slot"
            )
        return None

    def _admit(self) -> None:
        """Admit queued requests, in order (of priority, then of arrival), while slots are free. A request
        that should wait for a busy slot still reading what it shares (`worth_waiting`) stays at the head of
        the queue and keeps one free slot for itself; a later request may take any slot beyond those. Those
        a recovery carries on take their own slots back first. Nothing is admitted while the self-check
        runs."""
        if not self._admitting:
            return
        while self._restarting:  # before any queued request: their slots are their own
            slot = self._restarting[0]
            assert self.slots[slot.id] is None, "a request carried on takes its own slot back"
            self._rewind_slot(slot.id, 0)
            self.prefixes.kept[slot.id] = None
            self.executor.admit(slot.id, slot.prompt)
            self.slots[slot.id] = self._restarting.pop(0)
        with self._lock:
            waiting: list[RequestHandle] = []
            try:
                while self._queue and self.slots.count(None) > len(waiting):
                    handle = self._queue.popleft()
                    if handle.cancelled.is_set():
                        handle.events.put(TokenEvent((), "", "cancelled"))
                        continue
                    try:
                        if not self._take_slot(handle):
                            waiting.append(handle)
                    except BaseException as exc:  # no longer queued, and in no slot (the slot is set last)
                        why = f"the engine failed while admitting this request ({type(exc).__name__}: {exc})"
                        handle.events.put(TokenEvent((), "", "error", 0, why))
                        raise
            finally:
                self._queue.extendleft(reversed(waiting))

    def _take_slot(self, handle: RequestHandle) -> bool:
        """Give ``handle``'s request a free slot, reusing, copying or restoring a prefix where it can; False
        (nothing done) where it should wait for a busy slot still reading what it shares."""
        req = handle.request
        free = [j for j, s in enumerate(self.slots) if s is None]
        key = (self.model.routing_key(req.prompt_ids), req.cache_salt)
        whole, donors = req.sampling.prompt_logprobs is not None, self._donors()
        stored, from_store = None, 0
        if not whole and donors is not None:
            stored, from_store = self.store.best(req.prompt_ids, key)
            reading = self._reading()
            others = {i: k for i, k in donors.items() if i not in reading}
            _, now, _ = self.prefixes.best(free, req.prompt_ids, key, self._group_load, False, others)
            if worth_waiting(reading, donors, req.prompt_ids, key, max(now, from_store)):
                return False  # until that slot has read what they share
        i, reuse, source = self.prefixes.best(free, req.prompt_ids, key, self._group_load, whole, donors)
        restoring = stored if from_store >= reuse + STORE_LEAST else None
        own = reuse if source is None and restoring is None else 0
        if donors is not None:
            self._store_kept(i, own, donors, restoring)
        if restoring is not None:
            reuse, source = from_store, None
        self.prefixes.take(i, reuse, source, restored=restoring is not None)
        self._rewind_slot(i, own)
        if restoring is not None:
            self.store.used(restoring)
            self.executor.restore_prefix(restoring, i, reuse)
            if restoring.experts is not None:
                self.executor.recall_experts(restoring.experts)
        elif source is not None:
            self.executor.copy_prefix(source, i, reuse)
        handle.cached_tokens = reuse
        seed = req.sampling.seed if req.sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._admitted += 1
        handle.slot = i
        self.executor.admit(i, req.prompt_ids)
        stop_ids = frozenset(req.stop_ids) | frozenset(() if req.ignore_eos else self.tokenizer.eos_ids)
        sampler = Sampler(
            req.sampling,
            seed,
            handle.grammar,
            req.prompt_ids,
            stop_ids,
            self.model.args.vocab_size,
            handle.banned,
            handle.allowed_in_masks,
        )
        self.slots[i] = Slot(
            i,
            handle,
            sampler,
            stop_ids,
            self.tokenizer,
            self._admitted,
            prefilled=reuse,
            length=reuse,
            gauge=self.choice.gauge(sampler),
            prefix_key=key,
            lookup=self._text_lookup(req.prompt_ids, sampler),
        )
        return True

    def _text_lookup(self, prompt: tuple[int, ...], sampler: Sampler) -> TextLookup | None:
        """A request's n-gram lookup (``spec.method = "ngram"``), except under a grammar, whose forced
        tokens are its proposals (a looked-up token the grammar does not allow would only fail)."""
        if not self.lookup or sampler.grammar is not None:
            return None
        return TextLookup(prompt, self.plan.spec.ngram_min, self.plan.spec.ngram_max)

    def _looked_up(self, slot: Slot, depth: int) -> Proposals | None:
        """Up to ``depth`` proposals from ``slot``'s own text (`TextLookup.propose`); None where it has no
        lookup or the lookup finds nothing, which counts in the slot's gauge as a first proposal that did
        not hold: drafting by lookup pays by how often a window gets a proposal that holds, so a stretch of
        new text pauses it and the windows run ahead again."""
        if slot.lookup is None or depth <= 0:
            return None
        slot.lookup.follow(slot.generated)
        tokens = slot.lookup.propose(depth)
        if not tokens:
            slot.gauge.record(1, 0, silent=True)
            return None
        return Proposals(tokens, [], looked_up=True)

    def _reap_cancelled(self) -> None:
        busy = self._busy_slots()
        for s in self.slots:
            if s is not None and s.handle.cancelled.is_set() and s.id not in busy:
                s.tell(s.finish("cancelled"))
                self._release(s)

    def _release(self, slot: Slot) -> None:
        """Free a slot for the next request. With ``memory.prefix_reuse`` its KV keeps the tokens the request
        read (its prompt and the generated tokens fed back, nothing past its end) for a request that begins
        the same way (`strata_runtime.engine.prefix`); else every stage and the drafter forget it."""
        i = slot.id
        tokens = self._held(slot) if self.prefixes.on else ()
        self.model.rewind(i, len(tokens))
        drafter = self.model.drafters.get(i)
        drafted = None if drafter is None else drafter.keep(max(len(tokens) - 1, 0))
        if tokens:
            self.prefixes.keep(i, tokens, drafted, slot.prefix_key)
            if self._recalls:
                self._routed[i] = self.executor.expert_scores()
        self.slots[i] = None

    def _held(self, slot: Slot) -> tuple[int, ...]:
        """The tokens busy ``slot``'s KV holds for certain: its prompt and the generated tokens fed back, up
        to its confirmed length (whose windows have run; no rejected draft rewinds them) on every stage."""
        held = min(slot.length, len(slot.prompt) + len(slot.generated), *self.model.kv_lengths(slot.id))
        return (*slot.prompt, *slot.generated)[:held]

    @property
    def _copies(self) -> bool:
        """Whether a request may copy a prefix from another slot: prefix reuse is on, and every slot drafts
        or none does (a drafter's KV is copied with the stages')."""
        return self.prefixes.on and len(self.model.drafters) in (0, self.n_slots)

    def _store_kept(self, i: int, keeps: int, held: dict[int, Kept], restoring: Stored | None) -> None:
        """Free slot ``i``, about to keep only its first ``keeps`` positions for a new request, first copies
        what it kept into the host's prefix store where that is worth it (`PrefixStore.worth_storing`,
        against what the other slots hold, ``held``), making room by dropping stored prefixes other than
        the one the request copies back (``restoring``)."""
        kept = held.get(i)
        if kept is None or not self.store.on or keeps >= len(kept.tokens):
            return
        drafted = None if kept.drafted is None else min(kept.drafted, keeps)
        others = {j: k for j, k in held.items() if j != i} | {
            i: Kept(kept.tokens[:keeps], drafted, kept.key, 0)
        }
        if not self.store.worth_storing(kept, others):
            return
        entry, _ = self.store.store(kept, restoring)
        if entry is not None:  # else it does not fit beside the prefix copied back
            entry.experts = self._routed.get(i)
            self.executor.save_prefix(i, entry)

    def _rewind_slot(self, i: int, length: int) -> None:
        """Slot ``i`` keeps positions [0, length) on every stage and in its drafter."""
        self.model.rewind(i, length)
        if i in self.model.drafters:
            self.model.drafters[i].rewind(length)

    def _donors(self) -> dict[int, Kept] | None:
        """What each slot holds for certain, for a request to copy a prefix from
        (`strata_runtime.engine.prefix`): a free slot its kept tokens, a busy one the tokens its KV has read
        and no rejected draft rewinds (its confirmed length, whose windows have run); of a drafter only its
        KV. None where nothing is copied (`_copies`)."""
        if not self._copies:
            return None
        drafters = self.model.drafters
        out: dict[int, Kept] = {}
        for i, slot in enumerate(self.slots):
            if slot is None:
                kept = self.prefixes.kept[i]
                if kept is None:
                    continue
                tokens, key = kept.tokens, kept.key
            else:
                tokens, key = self._held(slot), slot.prefix_key
            drafted = min(drafters[i].length, len(tokens) - 1) if i in drafters else None
            if tokens:
                out[i] = Kept(tokens, drafted, key, 0)
        return out

    def _reading(self) -> dict[int, Kept]:
        """The whole prompt each busy slot is still reading, as it will hold it once read (`_donors`)."""
        drafters = self.model.drafters
        return {
            i: Kept(slot.reading, len(slot.reading) - 1 if i in drafters else None, slot.prefix_key, 0)
            for i, slot in enumerate(self.slots)
            if slot is not None and slot.prefilling
        }

    def _warm_copy(self) -> None:
        """Copy one position of a slot's kept prefix into another free slot and forget it, so that the copy's
        kernels are compiled before a request copies a prefix (`Executor.copy_prefix`)."""
        kept = [i for i, k in enumerate(self.prefixes.kept) if k is not None and self.slots[i] is None]
        free = [i for i, s in enumerate(self.slots) if s is None]
        if not kept or len(free) < 2 or not self._copies:
            return
        src = kept[0]
        if src in self.model.drafters and self.model.drafters[src].length < 1:
            return
        dst = next(i for i in free if i != src)
        self._rewind_slot(dst, 0)
        self.prefixes.kept[dst] = None
        self.executor.copy_prefix(src, dst, 1)
        self._rewind_slot(dst, 0)

    def forget_prefixes(self) -> None:
        """Every free slot forgets what it kept for prefix reuse: the next requests read their whole prompts
        (the bench starts each repeat so, as it starts each from the same expert caches)."""
        for i, kept in enumerate(self.prefixes.kept):
            if kept is not None and self.slots[i] is None:
                self._rewind_slot(i, 0)
                self.prefixes.kept[i] = None
        self.store.clear()

    def _group_load(self, slot_id: int) -> int:
        """Busy slots in ``slot_id``'s group: a new request goes to the least busy group."""
        group = self._group(slot_id)
        return sum(1 for s in self.slots if s is not None and self._group(s.id) == group)

    # ---- serial windows ------------------------------------------------------------------------------

    def _serial_round(self, prefilling: list[Slot], decoding: list[Slot]) -> None:
        """One window finished: the next one, or the oldest of a chain in flight.

        A decode window whose rows are each a slot's one token, chosen on the device, runs ahead: the
        windows after it are queued at once (`_extend_chain`), each reading the tokens the one before it
        chose on the device, so the GPU never waits for the host between them. The host then finishes them
        in order, and queues one more each time, as long as the schedule would give the same window again.
        """
        if not self._chain:
            job = self._next_job(0, prefilling, decoding)
            if job is None:
                return
            self._chain.append(self.executor.launch(job))
            self._extend_chain()
        flight = self._chain.popleft()
        events = self._finish(flight)
        self._extend_chain()
        self._deliver(flight, events)
        # Windows queued past the end of every request they carry are finished now, not a step later: they
        # are only overrun (discarded), and a finished request leaves the engine idle at once.
        while self._chain and all(e.slot.finished is not None for e in self._chain[0].job.entries):
            overrun = self._chain.popleft()
            self._deliver(overrun, self._finish(overrun))

    def _extend_chain(self) -> None:
        """Queue chained windows behind the newest one until `run_ahead` are in flight or it may not go on."""
        while 0 < len(self._chain) < self.run_ahead:
            before = self._chain[-1]
            following = self._continuation(before)
            if following is None:
                return
            job, rows = following
            self._chain.append(self.executor.launch(job, Chained(before, rows)))

    def _continuation(
        self, before: Flight, group: int | None = None
    ) -> tuple[Job, tuple[int, ...] | None] | None:
        """The window the schedule would give after ``before`` once it is finished, and for each of its
        rows the row of ``before`` whose chosen token it reads (None: ``before`` is a speculative window
        decided on the device, see `_spec_continuation`); None when that window is not known yet.

        It is known when ``before`` is a serial, solo or (in ``group``) pipelined window of one row per slot
        (whose tokens the device chooses), holding every decoding slot (of the group), and nothing else
        waits (no queued request, no prompt in the group): then the next window is
        the same slots one position on. A slot whose windows in flight already reach its ``max_tokens`` is
        left out (it finishes in one of them); one that cannot go on (cancelled, out of context) ends the
        chain, and so does a slot left alone where alone it would draft (its solo windows take over).
        """
        if before.spec is not None:
            return self._spec_continuation(before, group)
        job = before.job
        kinds = ("solo", "serial") if group is None else ("pipelined",)
        if job.kind not in kinds or self._queue:
            return None
        if any(
            len(e.tokens) != 1 or e.kind != "decode" or not (e.on_device or e.masked) for e in job.entries
        ):
            return None
        if any(e.masked for e in job.entries) and not self._grammars_run_ahead(before, group):
            return None
        everyone = [s for s in self.slots if s is not None and s.finished is None]
        live = everyone if group is None else [s for s in everyone if self._group(s.id) == group]
        if any(s.prefilling for s in live):
            return None
        chained = {e.slot.id for e in job.entries}
        if any(s.id not in chained and not self._ends_in_flight(s) for s in live):
            return None
        entries, rows = [], []
        for row, e in enumerate(job.entries):
            slot = e.slot
            if slot.finished is not None or self._ends_in_flight(slot):
                continue
            pos = e.pos + 1
            fits = pos + 1 <= self.plan.memory.context
            if slot.handle.cancelled.is_set() or not fits or self._past_hold(slot, 1):
                return None
            entries.append(Entry(slot, "decode", [CHAINED], pos=pos, masked=e.masked))
            rows.append(row)
        if not entries:
            return None
        mtp = self.plan.batch.mtp and self._batch_mtp_serves(len(entries))
        slots = [e.slot for e in entries]
        pays = job.kind != "solo" and mtp and self.choice.batch_drafts(slots, now_batch_mtp=False)
        if pays:
            return None  # batch-MTP windows again: few enough slots decode, and drafting pays
        room = min(self.depth, self.plan.memory.context - entries[0].pos - 1)
        alone = len(everyone) == 1 and room > 0
        drafts_alone = alone and entries[0].slot.gauge.leaves(0, room)
        if drafts_alone and self.lookup and not self._lookup_finds(entries[0].slot):
            drafts_alone = False  # its lookups pay, but its text up to now gives none: the chain goes on
        if drafts_alone and (group is None or not any(f.job.kind == "prefill" for f in self._flights)):
            return None  # one slot left (pipelined: and no prompt in flight): its solo windows draft
        kind = job.kind if group is not None else "solo" if len(entries) == 1 else "serial"
        if self.lookup and kind != "solo":
            drafting = [s for s in slots if self._lookup_pays(s) and self._lookup_finds(s)]
            if self._spare_depth(kind, slots, drafting, len(entries)) > 0:
                return None  # a slot's lookups pay again: the host looks its next proposals up
        paused = (alone and kind == "solo" and not drafts_alone) or (kind != "solo" and mtp and not pays)
        rates = entries[0].slot.gauge.rates(room) if alone and kind == "solo" else None
        return Job(kind, entries, paused=paused, rates=rates), tuple(rows)

    def _grammars_run_ahead(self, before: Flight, group: int | None) -> bool:
        """Whether a window after ``before``, whose rows under a grammar are masked on the device, may be
        queued before the host has read ``before``'s tokens: its masks then follow from the tokens read on
        its last stage (`Executor._chained_masks`), each reply's place moved on ahead of the host's
        (`Slot.ahead`, copied from the host's where a chain starts: ``before`` is not finished yet).

        Not with two windows of the chain (or group) in flight already (the chained window's last stage
        waits for the one before it, so a longer chain would only hold the host up), and not where a reply
        was forced to ``before``'s token (the grammar likely forces more, which an unchained window reads
        as proposals, several at once). With ``before`` the only window in flight, the host has finished
        every window before it, so its own place in each grammar (the sampler's) stands right before
        ``before``'s token: whether that token was forced is read there, never from `Slot.ahead`, which a
        stage's thread may be moving on meanwhile. So the choice follows the tokens alone, not how soon a
        stage's thread computes a chained window's masks."""
        flying = self._chain if group is None else self._in_flight(group)
        if len(flying) > 1:
            return False
        assert flying and flying[-1] is before
        for e in before.job.entries:
            if not e.masked:
                continue
            grammar = e.slot.sampler.grammar
            assert grammar is not None
            if before.after is None:  # a chain starts: the reply's place ahead starts from the host's
                e.slot.ahead = grammar.copy()
            if grammar.forced(1):
                return False
        return True

    def _spec_continuation(self, before: Flight, group: int | None = None) -> tuple[Job, None] | None:
        """The window after a speculative window decided on the device, chained to it: the same slots, each
        with as many rows, at positions and with tokens and proposals the device decides. Known when the
        window holds every live slot (of ``group``, pipelined), nothing waits (no queued request, no prompt
        of the group), drafting still pays for its slots, none is cancelled or
        about to end within the windows in flight (each gives it at least one token), and the furthest its
        rows could reach still fits the context."""
        job = before.job
        assert before.spec is not None
        if self._queue:
            return None
        live = [s for s in self.slots if s is not None and s.finished is None]
        if group is not None:
            live = [s for s in live if self._group(s.id) == group]
        if any(s.prefilling for s in live) or {s.id for s in live} != set(job.slot_ids):
            return None
        n = before.spec.n
        if any(e.slot.lookup is not None and e.slot.lookup.device_missed for e in job.entries):
            return None  # a lookup on the device found nothing: the host looks up, or pauses drafting
        if job.kind == "solo":
            if job.entries[0].slot.gauge.leaves(n - 1, self.depth, probe=False):
                return None  # another depth pays better: the host launches it
        elif before.spec.lookup is not None:  # a serial window's lookups: while each pays at this depth
            slots = [e.slot for e in job.entries]
            if not all(self._lookup_pays(s) for s in slots):
                return None
            if self._spare_depth(job.kind, slots, slots, len(slots)) != n - 1:
                return None  # another depth pays better: the host launches it
        elif not self.choice.batch_drafts([e.slot for e in job.entries], probe=False, now_batch_mtp=True):
            return None  # the slots' proposals rarely hold, or serial windows give more: they take over
        for e in job.entries:
            slot = e.slot
            if slot.handle.cancelled.is_set() or self._ends_in_flight(slot) or self._past_hold(slot, n):
                return None
            if self._reach(slot) + n > self.plan.memory.context:
                return None
        if any(e.masked for e in job.entries) and not self._grammars_run_ahead(before, group):
            return None
        looked_up = before.spec.lookup is not None
        entries = [
            Entry(
                e.slot,
                "decode",
                [CHAINED] * n,
                Proposals([CHAINED] * (n - 1), [], looked_up=looked_up),
                masked=e.masked,
            )
            for e in job.entries
        ]
        looked = set(job.slot_ids) if looked_up else set()
        rates = job.entries[0].slot.gauge.rates(self.depth) if job.kind == "solo" else None
        return Job(job.kind, entries, spec_on_device=True, looked=looked, rates=rates), None

    def _past_hold(self, slot: Slot, rows: int) -> bool:
        """A window of ``rows`` rows for ``slot`` after the windows in flight could give it the token no
        window may reach unread (`Sampler.hold_at`: where a think budget may be spent, or where
        ``min_tokens`` lets the stop tokens back), or one past it: the chain ends, and the host reads what
        comes before that token first."""
        hold = slot.sampler.hold_at
        return hold is not None and len(slot.generated) + self._reach(slot) - slot.length + rows > hold

    def _reach(self, slot: Slot) -> int:
        """The furthest the windows in flight could take ``slot``'s KV: its length plus every row they hold
        for it (a speculative window keeps at most all of its rows)."""
        flights = (*self._chain, *self._flights)
        rows = sum(len(e.tokens) for f in flights for e in f.job.entries if e.slot.id == slot.id)
        return slot.length + rows

    # ---- the continuous pipeline -------------------------------------------------------------------------

    def _pipelined_step(self) -> None:
        """Launch what can be launched, finish what is done; wait only when neither was possible."""
        launched = self._launch_groups()
        finished = self._finish_done()
        if launched or finished or not self._flights:
            return
        self.executor.wait_any(self._wake_marks())

    def _group(self, slot_id: int) -> int:
        return slot_id % self.plan.batch.groups

    def _members(self, group: int) -> list[Slot]:
        return [s for s in self.slots if s is not None and self._group(s.id) == group]

    def _in_flight(self, group: int) -> list[Flight]:
        return [f for f in self._flights if self._group(f.job.entries[0].slot.id) == group]

    def _ends_in_flight(self, slot: Slot) -> bool:
        """The decode windows in flight reach ``slot``'s ``max_tokens`` (a chained window gives it one token;
        this is asked only of slots whose windows are chained)."""
        ahead = sum(1 for f in (*self._flights, *self._chain) if slot.id in f.job.slot_ids)
        return len(slot.generated) + ahead >= slot.handle.request.max_tokens

    def _busy_slots(self) -> set[int]:
        return {sid for f in (*self._flights, *self._chain) for sid in f.job.slot_ids}

    def _launch_groups(self) -> int:
        """Launch each group's next windows where they may go now, longest-waiting group first: a window,
        then the windows chained behind it at once (up to `run_ahead`), as `_extend_chain` does for serial
        windows, so a group runs ahead however soon its windows finish."""
        launched = 0
        for g in sorted(range(self.plan.batch.groups), key=lambda g: self._idle_since.get(g, 0)):
            while (job := self._group_job(g)) is not None:
                self._flights.append(self.executor.launch(*job))
                launched += 1
                if job[1] is None and self._flights[-1].job.kind == "prefill":
                    break  # a prompt's next chunk follows once this one has left stage 0
        return launched

    def _group_job(self, group: int) -> tuple[Job, Chained | None] | None:
        """The group's next window: any window when it has nothing in flight; else, behind a decode window
        whose tokens the device chooses, the next one chained to it (up to `run_ahead` in flight); else its
        prompt's next chunk once the previous one has left stage 0."""
        flying = self._in_flight(group)
        if not flying:
            members = self._members(group)
            prefilling = [s for s in members if s.prefilling]
            decoding = [s for s in members if s.decoding]
            job = self._next_job(group, prefilling, decoding, pipelined=True)
            return None if job is None else (job, None)
        if len(flying) < self.run_ahead and flying[-1].job.kind in ("pipelined", "pipelined-mtp"):
            following = self._continuation(flying[-1], group)
            return None if following is None else (following[0], Chained(flying[-1], following[1]))
        newest = self._streaming(group, flying)
        if newest is None or not newest.passed(0):
            return None
        entry = newest.job.entries[0]
        return self._prefill_job(entry.slot, entry.pos + len(entry.tokens)), None

    def _streaming(self, group: int, flying: list[Flight]) -> Flight | None:
        """The newest flight of a group that may stream its prompt's next chunk behind it: every flight of
        the group is a chunk of that prompt, the newest is not its last, fewer chunks than stages are in
        flight, no slot of the group waits to decode (a group alternates chunks with decode windows), and
        the request was not cancelled."""
        newest = flying[-1]
        if len(flying) >= len(self.model.stages) or any(f.job.kind != "prefill" for f in flying):
            return None
        entry = newest.job.entries[0]
        if entry.ends_prompt or entry.slot.handle.cancelled.is_set():
            return None
        return None if any(s.decoding for s in self._members(group)) else newest

    def _finish_done(self) -> int:
        """Finish every flight that is done, oldest first (flights finish in launch order)."""
        finished = 0
        while self._flights and self._flights[0].done.done:
            flight = self._flights.popleft()
            self._deliver(flight, self._finish(flight))
            self._idle_since[self._group(flight.job.entries[0].slot.id)] = next(self._turns)
            finished += 1
        return finished

    def _wake_marks(self) -> list[Mark]:
        """What the host may wait for: the oldest flight, and each streaming prompt's chunk on stage 0."""
        marks = [self._flights[0].done]
        for g in range(self.plan.batch.groups):
            flying = self._in_flight(g)
            newest = self._streaming(g, flying) if flying else None
            if newest is not None and not newest.passed(0):
                marks.append(newest.marks[0])
        return marks

    # ---- choosing a window ---------------------------------------------------------------------------------

    def _next_job(
        self, group: int, prefilling: list[Slot], decoding: list[Slot], pipelined: bool = False
    ) -> Job | None:
        """A prefill chunk or a decode window, alternating while both are waiting."""
        turn = self._prefill_turn.get(group, True)
        if prefilling and (turn or not decoding):
            self._prefill_turn[group] = False
            alone = not pipelined and not decoding and len(prefilling) == 1
            oldest = min(prefilling, key=lambda s: s.admitted_at)
            job = self._prefill_job(oldest, alone=alone)
            return job if pipelined else self._with_short_prompts(job, prefilling)
        self._prefill_turn[group] = True
        if not decoding:
            return None
        return self._decode_job(group, decoding, prefilling, pipelined)

    def _prefill_job(self, slot: Slot, pos: int | None = None, alone: bool = False) -> Job:
        """The chunk of ``slot``'s prompt that starts at ``pos`` (default: where its KV ends; a streamed
        chunk starts past the chunks in flight). ``alone``: the prompt is the engine's only work, so the
        chunk is ``memory.prefill_chunk_alone`` long (nothing waits behind it)."""
        start = slot.length if pos is None else pos  # while a slot prefills, its length is its prompt offset
        m = self.plan.memory
        reading = slot.reading
        n = min(m.prefill_chunk_alone if alone else m.prefill_chunk, len(reading) - start)
        tokens = list(reading[start : start + n])
        ends = start + n == len(reading)
        entry = Entry(
            slot,
            "prefill",
            tokens,
            pos=start,
            ends_prompt=ends,
            masked=ends and self._masked(slot),
            by_host=not self.first_tokens_on_device,
        )
        return Job("prefill", [entry])

    def _with_short_prompts(self, job: Job, prefilling: list[Slot]) -> Job:
        """A serial prefill window with, in the rows ``memory.prefill_chunk`` leaves after its chunk, the
        whole rest of the other waiting prompts that fit, oldest first: a burst of short prompts is read in
        one window, not one window each, so their first tokens come together and the slots decoding
        meanwhile wait for one prefill window instead of one per prompt. (A pipelined group streams one
        prompt's chunks through the stages instead.)"""
        room = self.plan.memory.prefill_chunk - job.rows
        first = job.entries[0].slot
        for slot in sorted(prefilling, key=lambda s: s.admitted_at):
            rest = len(slot.reading) - slot.length
            if slot is first or not 0 < rest <= room:
                continue
            tokens = list(slot.reading[slot.length :])
            job.entries.append(
                Entry(
                    slot,
                    "prefill",
                    tokens,
                    pos=slot.length,
                    ends_prompt=True,
                    masked=self._masked(slot),
                    by_host=not self.first_tokens_on_device,
                )
            )
            room -= rest
        return job

    def _decode_job(
        self, group: int, decoding: list[Slot], prefilling: list[Slot], pipelined: bool
    ) -> Job | None:
        decoding = [s for s in decoding if not self._out_of_context(s)]
        if not decoding:
            return None
        ids = [s.id for s in decoding]
        by_id = {s.id: s for s in decoding}
        mtp = self.plan.batch.mtp and self._batch_mtp_serves(len(decoding))
        forced: dict[int, Proposals] = {}  # what a grammar forces (or a lookup finds), in a drafter's stead
        rates: tuple[float, ...] | None = None  # a request alone's depth choice (`DraftGauge.rates`)
        looked_for: set[int] = set()  # slots whose text was looked up for this window
        if len(decoding) == 1 and not prefilling and not pipelined:
            slot = decoding[0]
            room = min(self.depth, self.room(slot))
            most = min(MAX_WINDOW_ROWS - 1, self.room(slot)) if self.forcing else 0
            given = speculative.forced(slot.sampler, most)
            if given is not None:
                forced[slot.id], depth, paused = given, len(given.tokens), False
            else:
                depth = slot.gauge.depth(room)
                rates = slot.gauge.rates(room)
                paused = room > 0 and depth == 0
                looked = self._looked_up(slot, depth)
                if depth > 0 and slot.lookup is not None:
                    looked_for.add(slot.id)
                if looked is not None:
                    forced[slot.id] = looked
                elif self.lookup:
                    depth = 0  # the text gives nothing to propose: a plain window (drafting not paused)
            rows = solo_window(ids[0], depth)
            kind = "solo"
        elif mtp and self.choice.batch_drafts(decoding):
            paused = False
            self.choice.batch_mtp_last = True
            # Rotate by slot id, so that slots finishing or arriving do not make the others lose their turn.
            rotation = self._rotation.get(group, 0)
            start = next((i for i, sid in enumerate(ids) if sid >= rotation), 0)
            rows = batch_mtp_window(ids, start)
            self._rotation[group] = rows[-1].slot + 1
            kind = "pipelined-mtp" if pipelined else "batch-mtp"
        else:
            paused = mtp  # batch-MTP windows would serve these slots, but their drafts do not pay
            if mtp:
                self.choice.batch_mtp_last = False
            windows = plain_windows(ids)
            turn = self._plain_turn.get(group, 0)
            rows = windows[turn % len(windows)]
            self._plain_turn[group] = turn + 1
            kind = "pipelined" if pipelined else "serial"
        depths = {
            sid: min(sum(1 for r in rows if r.slot == sid) - 1, self.room(by_id[sid]))
            for sid in dict.fromkeys(r.slot for r in rows)
        }
        spare = MAX_WINDOW_ROWS - len(rows) if self.forcing else 0
        for sid, depth in depths.items():  # rows the window has room for go to what a grammar forces
            if depth == 0 and spare > 0:
                given = speculative.forced(by_id[sid].sampler, min(spare, self.room(by_id[sid])))
                if given is not None:
                    forced[sid], depths[sid] = given, len(given.tokens)
                    spare -= len(given.tokens)
        if self.lookup and kind in ("serial", "pipelined"):
            self._look_up_spare_rows(kind, len(rows), by_id, depths, forced, looked_for)
        for sid, depth in depths.items():  # a batch-MTP window's proposal too, where a grammar forces one
            given = forced.get(sid) or speculative.forced(by_id[sid].sampler, depth if self.forcing else 0)
            if given is not None and len(given.tokens) == depth:
                forced[sid] = given
            else:
                forced.pop(sid, None)
        looked_up = all(sid in forced and forced[sid].looked_up for sid in depths)
        on_device = all(self._device_decides(by_id[sid], sid in forced) for sid in depths)
        on_device = on_device and self._decided_on_device(
            kind, [1 + d for d in depths.values()], [by_id[sid] for sid in depths], looked_up
        )
        entries = []
        caught_up, t0 = self._caught_up(), time.perf_counter()
        for sid, depth in depths.items():
            slot, token = by_id[sid], by_id[sid].token
            assert token is not None  # a decoding slot has its next input
            if sid in forced:
                proposals = forced[sid]
            elif depth > 0:
                proposals = self.executor.draft(sid, token, depth, slot.sampler, on_device)
            else:
                proposals = Proposals([], [])
            masked = self._masked(slot, proposals, on_device)
            entries.append(Entry(slot, "decode", [token, *proposals.tokens], proposals, masked=masked))
        job = Job(kind, entries, paused=paused, spec_on_device=on_device, looked=looked_for, rates=rates)
        job.caught_up, job.draft_ms = self._caught_up() - caught_up, (time.perf_counter() - t0) * 1e3
        return job

    def _look_up_spare_rows(
        self,
        kind: str,
        rows: int,
        by_id: dict[int, Slot],
        depths: dict[int, int],
        given: dict[int, Proposals],
        looked_for: set[int],
    ) -> None:
        """A serial or pipelined window of ``rows`` rows (plus those ``given`` to what grammars force): its
        slots whose lookups pay (`_lookup_pays`) get looked-up proposals in its rows up to `MAX_WINDOW_ROWS`,
        as many each as `_spare_depth` gives. A slot whose lookup finds nothing counts a failed proposal
        (`_looked_up`)."""
        used = rows + sum(len(g.tokens) for g in given.values())
        slots = [by_id[sid] for sid in depths]
        drafting = [by_id[sid] for sid, d in depths.items() if d == 0 and self._lookup_pays(by_id[sid])]
        depth = self._spare_depth(kind, slots, drafting, used)
        for slot in drafting if depth > 0 else []:
            looked_for.add(slot.id)
            found = self._looked_up(slot, min(depth, self.room(slot)))
            if found is not None:
                given[slot.id], depths[slot.id] = found, len(found.tokens)

    def _lookup_finds(self, slot: Slot) -> bool:
        """Whether a lookup in ``slot``'s text as the host has read it finds a run to propose from. A plain
        window chained to one in flight ends its chain only where it does: a lookup that finds nothing
        would launch the host's next window without proposals, only later (and count as a miss)."""
        if slot.lookup is None:
            return False
        slot.lookup.follow(slot.generated)
        return bool(slot.lookup.propose(1))

    def _lookup_pays(self, slot: Slot) -> bool:
        """Whether ``slot`` has a lookup whose proposals hold often enough to draft (its gauge at or over
        ``spec.draft_floor``) and room for one."""
        return (
            slot.lookup is not None
            and speculative.drafting_pays([slot.gauge], probe=False)
            and self.room(slot) > 0
        )

    def _spare_depth(self, kind: str, slots: list[Slot], drafting: list[Slot], used: int) -> int:
        """Looked-up proposals each slot of ``drafting`` gets in a window of ``slots`` that holds ``used``
        rows without them: the rows up to `MAX_WINDOW_ROWS` shared evenly, at most the plan's depth. With
        ``spec.adaptive_depth``, a serial window takes the depth with the most expected tokens per
        millisecond by the serial windows' measured times (`WindowChoice.lookup_costs`; a row count not
        measured yet is tried), each slot's proposals holding as its gauge expects and every other slot
        giving its one token. Pipelined windows overlap, so their times are no measure: there each slot's
        depth for its solo windows bounds it."""
        if not drafting:
            return 0
        most = min(self.depth, (MAX_WINDOW_ROWS - used) // len(drafting))
        if most <= 0:
            return 0
        if kind != "serial":
            return min(most, max(s.gauge.depth(min(self.depth, self.room(s))) for s in drafting))
        costs = self.choice.lookup_costs(slots)
        if costs is None:
            return most
        holds = [s.gauge.optimistic_holds(most) for s in drafting]
        plain = len(slots) - len(drafting)
        values = []
        for d in range(most + 1):
            ms = costs.cost(used + d * len(drafting))
            tokens = plain + sum(expected_tokens(h, d) for h in holds)
            values.append(None if ms is None else tokens / ms)
        if any(v is None for v in values):
            return most
        return max(range(most + 1), key=lambda d: (values[d] or 0.0, d))

    def _masked(self, slot: Slot, proposals: Proposals | None = None, decided: bool = False) -> bool:
        """Whether ``slot``'s rows in a window (its next token, after ``proposals``; a prompt's first
        token without) are masked to its grammar and chosen on the device (`Entry.masked`): with
        `masks_on_device` and a grammar; proposals, if any, forced, verified greedily, or in a window
        ``decided`` on the device (a sampled drafter's need the distribution they were drawn from, which the
        host has only where it drew them); and where a logit bias or
        penalty adjusts the request, only a row without proposals (a prompt's last, or a decode row), which
        the device adjusts and whose token it counts as it does any such row's, or a window ``decided``
        there, which adjusts each row after the proposals before it and counts what it keeps (the host
        adjusts the others, with the proposals they follow). Not the prompt's last row where a recovery has
        the slot read its tokens again: its token is known (`Slot.resume_token`), nothing is chosen there."""
        sampler = slot.sampler
        if not self.masks_on_device or sampler.grammar is None:
            return False
        if sampler.think is not None and sampler.think.forcing:  # the host forces the block's close
            return False
        if proposals is None and (slot.resume_token is not None or not self.first_tokens_on_device):
            return False
        if sampler.adjusts:  # adjusted and counted on the device as a row without proposals, or decided there
            return proposals is None or not proposals.tokens or decided
        return proposals is None or not proposals.tokens or proposals.certain or sampler.greedy or decided

    def _batch_mtp_serves(self, decoding: int) -> bool:
        """Whether ``decoding`` slots (of a group) take batch-MTP windows rather than serial ones.

        Batch MTP spends two rows per slot for 1 + (acceptance) tokens. While one window holds every
        decoding slot, that beats serial windows, whose fewer rows cost nearly as much. With more slots
        than fit, the same rows give serial windows a token each (and serial windows run ahead), so with
        every expert resident they win: on one H200, 8 clients over 8 slots decoded 20% slower in rotating
        batch-MTP windows than in serial ones. Where experts stream from host memory, a slot's two rows
        route to the same experts and save their reads, so the windows keep rotating there."""
        if decoding <= self.plan.batch.slots_per_window:
            return True
        return not self.all_experts_resident

    def _spec_shapes(self) -> set[tuple[int, int]]:
        """Every (slots, rows per slot) a window decided on the device can have under this plan: solo
        windows of one slot at each depth room allows, serial windows of looked-up proposals (under n-gram
        lookup), and batch-MTP windows of 1 to 4 slots of 2 rows."""
        shapes = {(1, rows) for rows in range(2, self.depth + 2)}
        if self.lookup:  # serial windows' lookups: each slot as many rows, the window at most 8 of them
            together = range(2, self.n_slots + 1)
            shapes |= {(s, rows) for s in together for rows in range(2, MAX_WINDOW_ROWS // s + 1)}
        if self.plan.batch.mtp:
            shapes |= {(s, 2) for s in range(1, min(self.n_slots, BATCH_MTP_SLOTS_PER_WINDOW) + 1)}
        return shapes

    def _device_decides(self, slot: Slot, given: bool) -> bool:
        """Whether ``slot``'s rows in a speculative window may be decided on the device
        (`_decided_on_device` says whether the window's shape may): any request the host does not hold
        (`Sampler.host_only`), and one under a grammar (or bad words of several tokens) whose proposals are
        its drafter's (not ``given``: what its grammar forces, which the host reads as proposals): its rows
        are masked on the device (`Entry.masked`), adjusted there where it has a logit bias or penalties,
        and decided there, greedy or sampled (a sampled drafter's proposals drawn there too, from the head's
        own distribution, which rejection sampling against the masked target's keeps exact), and a window
        chained to it has its masks computed from the tokens the device decided
        (`strata_runtime.engine.executor.Executor._chained_masks`)."""
        sampler = slot.sampler
        if not sampler.host_only:
            return True
        forcing = sampler.think is not None and sampler.think.forcing
        return self.masks_on_device and self.grammar_drafts_on_device and not forcing and not given

    def _decided_on_device(
        self,
        kind: str,
        rows_per_slot: list[int],
        slots: list[Slot],
        looked_up: bool,
    ) -> bool:
        """Whether a decode window whose ``slots`` hold ``rows_per_slot`` rows each is decided on the device
        (`strata_runtime.engine.device_spec`): a solo or batch-MTP window (serial, or a pipelined group's)
        whose slots have the same number of proposals, at least one (greedy or sampled, with or without a
        logit bias or penalties). Under n-gram lookup, a solo or serial window whose slots' proposals were
        all ``looked_up``, none with a logit bias or penalties: the device looks the next window's proposals
        up in its history of each request's text."""
        rows = set(rows_per_slot)
        if len(rows) != 1 or rows.pop() < 2:
            return False
        if self.lookup:
            return (
                self.lookup_on_device
                and kind in ("solo", "serial")
                and looked_up
                and not any(s.sampler.adjusts for s in slots)
            )
        return kind in ("solo", "batch-mtp", "pipelined-mtp") and self.model.mtp is not None

    def _finish(self, flight: Flight) -> list[tuple[Slot, TokenEvent]]:
        """`Executor.finish`, counting in the window's job the rows the drafting heads caught up on
        meanwhile and the host time it took."""
        before, t0 = self._caught_up(), time.perf_counter()
        events = self.executor.finish(flight)
        self._undelivered = events  # until `_deliver` has sent them (a failure meanwhile: `recover` does)
        self._silent_probes(flight.job, events)
        flight.job.caught_up += self._caught_up() - before
        flight.job.finish_ms += (time.perf_counter() - t0) * 1e3
        return events

    def _silent_probes(self, job: Job, events: list[tuple[Slot, TokenEvent]]) -> None:
        """A finished window's part in silent probes (`DraftGauge.silent`): a slot's first token in it
        confirms or not the proposal its drafting head made at the window before (recorded as a probe's
        one proposal); and a paused solo window whose slot is due one queues the next such proposal, on the
        drafters' stream beside the windows in flight."""
        if self.lookup:
            self._lookup_probes(job, events)
            return
        for slot, ev in events:
            if slot.shadow is None:
                continue
            if ev.token_ids:  # none: the request ended before it (a stop), and the probe with it
                held = ev.token_ids[0] == self.executor.read_proposal(slot.shadow)
                slot.gauge.record(1, int(held), silent=True)
                self.window_stats.silent_probe(held)
            slot.shadow = None
        if job.kind != "solo" or not job.paused or self.model.mtp is None:
            return
        slot = job.entries[0].slot
        if slot.finished is None and slot.shadow is None and slot.gauge.silent_probe_due:
            slot.shadow = self.executor.propose(slot.id)

    def _lookup_probes(self, job: Job, events: list[tuple[Slot, TokenEvent]]) -> None:
        """Under n-gram lookup, a silent probe for each slot of a finished window whose text was not looked
        up for it (`Job.looked`: drafting paused, or no rows to spare), free on the host: would a lookup on
        the text before the window's first token have proposed it? Each weighs `LOOKUP_PROBE_WEIGHT`, so
        drafting resumes a few windows after the text turns repetitive, and not on one lucky guess."""
        for slot, ev in events:
            if slot.lookup is None or not ev.token_ids or slot.finished is not None or slot.id in job.looked:
                continue
            slot.lookup.follow(slot.generated)
            guess = slot.lookup.propose(1, len(slot.lookup) - len(ev.token_ids))
            held = bool(guess) and guess[0] == ev.token_ids[0]
            slot.gauge.record(1, int(held), silent=True, weight=speculative.LOOKUP_PROBE_WEIGHT)
            self.window_stats.silent_probe(held)

    def _caught_up(self) -> int:
        """Rows every drafter has caught up on so far (`Drafter.caught_up`)."""
        return sum(d.caught_up for d in self.model.drafters.values())

    def room(self, slot: Slot) -> int:
        """Proposals that still fit the slot's context after its token, and that keep a window before the
        token no window may reach unread (`Sampler.hold_at`)."""
        room = self.plan.memory.context - slot.length - 1
        hold = slot.sampler.hold_at
        if hold is not None:
            room = min(room, hold - len(slot.generated) - 1)
        return max(0, room)

    def _out_of_context(self, slot: Slot) -> bool:
        if slot.length + 1 <= self.plan.memory.context:
            return False
        slot.tell(slot.finish("length"))
        self._release(slot)
        return True

    def _deliver(self, flight: Flight, events: list[tuple[Slot, TokenEvent]]) -> None:
        """Record a finished window and send its events. Its time is the wall time since the later of its
        launch and the previous window's finish, so that overlapping windows add up to the wall time. A
        window during which something ran on a GPU for the first time (a kernel compiled, a window run
        eagerly or captured: `Model.first_runs`) is recorded, but its time does not count in the window
        times that choose drafting depth and batch MTP: it is no measure of its shape."""
        now = time.perf_counter()
        ms = (now - max(flight.launched_at, self._delivered_at)) * 1000
        self._delivered_at = now
        job = flight.job
        runs = self.model.first_runs()
        timed = runs == min(flight.first_runs, self._first_runs_delivered)
        self._first_runs_delivered = runs
        if not timed and self.warmed is not None:  # what the warm-up did not run
            log.info(
                "a %s window of %d rows after the warm-up ran a window shape or kernel for the first time "
                "(%.1f ms); kernels compiled at launch so far: %s",
                job.kind,
                job.rows,
                ms,
                self.model.compiled_at_launch()["recent"] or "none",
            )
        accepted = sum(ev.accepted_proposals for _, ev in events)
        # Proposals verified for a request: not those of rows queued past its end (discarded).
        kept = {slot.id for slot, _ in events}
        verified = [e for e in job.entries if e.slot.id in kept]
        proposals = sum(len(e.proposals.tokens) for e in verified if not e.proposals.forced)
        on_device = flight.spec is not None
        tokens = sum(len(ev.token_ids) for _, ev in events)
        window = WindowStat(
            job.kind,
            job.rows,
            ms,
            proposals,
            accepted,
            job.slot_ids,
            on_device,
            job.paused,
            tokens,
            job.caught_up,
            job.draft_ms,
            job.finish_ms,
            sum(len(e.proposals.tokens) for e in verified if e.proposals.forced),
            job.rates,
        )
        # What the window's shape costs, for the choices of depth and window kind: the wall time between
        # deliveries, or on devices that compute as windows are launched its own launch and finish (there a
        # window that ran ahead finishes while the one before is finished, and the wall time would charge
        # both to the first and next to nothing to the second).
        own = flight.launch_ms + job.finish_ms if self.executor.synchronous else ms
        if job.kind == "solo" and timed:
            self.choice.observe_solo(job.entries[0].slot.sampler, job.rows, own)
        self.choice.observe_batch(job.kind, [e.slot for e in job.entries], job.rows, own if timed else None)
        self.choice.observe_lookup(job.kind, [e.slot for e in job.entries], job.rows, own if timed else None)
        self.window_stats.record(window, flight.discarded)
        for slot, ev in events:
            slot.tell(ev)
            if ev.finished is not None:
                for queued in (*self._flights, *self._chain):  # a chained window behind it counts its KV
                    if slot.id in queued.job.slot_ids:  # when queued: before the release rewinds it
                        queued.wait_queued()
                self._release(slot)
        self._undelivered = []
