"""The continuous pipeline: windows of different groups in flight at once, prompt chunks streamed, batch MTP
inside groups, and greedy text the same as serial windows.

The scheduling tests run the engine on virtual CPU devices with a gated executor: each stage's mark of a
flight completes only when a simulated GPU says so. The simulated GPU is a wavefront: at each tick every
stage finishes its oldest pending window, if that window left the previous stage at an earlier tick. The host
(the engine) sees only the marks, as it sees CUDA events on a GPU, so the tests check what it does while
windows are still on the devices: it launches another group's window before the first group's is finished,
streams a prompt's chunks behind each other, and blocks only when it can neither launch nor finish anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from rt_engine_helpers import kept_tokens
from rt_plans import make_plan, pipelined_mtp_plan, with_mtp_in_groups
from test_rt_engine import collect, engine, reference

from strata_runtime.api import Request
from strata_runtime.engine import Engine
from strata_runtime.engine.executor import Executor
from strata_runtime.engine.flight import Chained, Flight, Mark, StageMark
from strata_runtime.engine.job import Job


class Gate(StageMark):
    """A stage mark that is done only when the simulated GPU has passed it."""

    def __init__(self, advance) -> None:
        super().__init__()
        self.at: int | None = None  # the tick it completed at
        self._advance = advance

    @property
    def done(self) -> bool:
        return self.at is not None

    def wait(self) -> None:
        """A synchronous window (solo) waits for its own flight: the GPU runs until it is done."""
        while not self.done:
            self._advance()


@dataclass
class Logged:
    what: str  # launch, finish or wait
    tick: int
    flight: Flight | None = None


class GatedExecutor(Executor):
    """Runs windows on CPU devices at launch, but lets the engine see them done only as the test's GPU
    passes each stage; records every launch, finish and wait."""

    def __init__(self, eng: Engine, check_wait) -> None:
        super().__init__(eng.model, eng.tracked, overlap=True)
        self.engine, self.check_wait = eng, check_wait
        self.tick = 0
        self.flights: list[Flight] = []
        self.log: list[Logged] = []

    def _marks(self) -> list[Mark]:
        return [Gate(self.advance) for _ in self.stages]

    def launch(self, job: Job, after: Chained | None = None) -> Flight:
        flight = super().launch(job, after)
        self.flights.append(flight)
        self.log.append(Logged("launch", self.tick, flight))
        return flight

    def finish(self, flight: Flight):
        self.log.append(Logged("finish", self.tick, flight))
        return super().finish(flight)

    def wait_any(self, marks) -> None:
        marks = list(marks)
        assert marks and not any(m.done for m in marks)
        self.check_wait(self.engine)
        self.log.append(Logged("wait", self.tick))
        while not any(m.done for m in marks):
            self.advance()

    def advance(self) -> None:
        """One tick of the GPU: every stage finishes its oldest pending window that has left the stage
        before it at an earlier tick."""
        self.tick += 1
        for s in range(len(self.stages)):
            pending = [f for f in self.flights if not f.marks[s].done]
            if not pending:
                continue
            f = pending[0]
            before = f.marks[s - 1] if s else None
            if before is None or (before.done and before.at < self.tick):
                f.marks[s].at = self.tick


def group_of(eng: Engine, flight: Flight) -> int:
    return flight.job.entries[0].slot.id % eng.plan.batch.groups


def nothing_else_to_do(eng: Engine) -> None:
    """When the host blocks: no flight is done, and no group could launch a window."""
    assert not eng._flights[0].done.done, "blocked although the oldest flight was done"
    stages = len(eng.model.stages)
    for g in range(eng.plan.batch.groups):
        members = [s for s in eng.slots if s is not None and s.id % eng.plan.batch.groups == g]
        flying = [f for f in eng._flights if group_of(eng, f) == g]
        if not flying:
            assert not any(s.prefilling or s.decoding for s in members), f"group {g} had work and no flight"
            continue
        newest = flying[-1]
        streams = (
            all(f.job.kind == "prefill" for f in flying)
            and not newest.job.entries[0].ends_prompt
            and not newest.job.entries[0].slot.handle.cancelled.is_set()
            and len(flying) < stages
            and not any(s.decoding for s in members)
        )
        assert not (streams and newest.passed(0)), f"group {g} could have streamed its next chunk"


def gated(plan) -> tuple[Engine, GatedExecutor]:
    eng = Engine(plan)
    eng.executor = GatedExecutor(eng, nothing_else_to_do)
    return eng, eng.executor


def in_flight_at(ex: GatedExecutor, i: int) -> list[Flight]:
    """The flights launched and not yet finished just after log entry ``i``."""
    launched = [e.flight for e in ex.log[: i + 1] if e.what == "launch"]
    finished = {id(e.flight) for e in ex.log[: i + 1] if e.what == "finish"}
    return [f for f in launched if id(f) not in finished]


def test_another_groups_window_is_launched_while_one_is_still_on_the_stages() -> None:
    eng, ex = gated(make_plan(stages=2, slots=2, groups=2, context=128, prefill_chunk=16))
    reqs = [(0, Request(tuple(b"First of two"), 12)), (0, Request(tuple(b"Second of two"), 12))]
    got = collect(eng, reqs, check_kv=False)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("tiny", r.prompt_ids, 12)
    decodes = [i for i, e in enumerate(ex.log) if e.what == "launch" and e.flight.job.kind == "pipelined"]
    overlapped = [
        i
        for i in decodes
        if {group_of(eng, f) for f in in_flight_at(ex, i) if f.job.kind == "pipelined"} == {0, 1}
    ]
    # Most decode windows go in while the other group's window is still on the stages (all but the ends).
    assert len(overlapped) >= len(decodes) - 4 and len(overlapped) >= 12
    # A group's next window is launched as soon as its last one is finished: before the host waits again.
    for i, e in enumerate(ex.log):
        if e.what != "finish" or e.flight.job.kind != "pipelined":
            continue
        g = group_of(eng, e.flight)
        after = ex.log[i + 1 :]
        until_wait = after[: next((k for k, x in enumerate(after) if x.what == "wait"), len(after))]
        slot = e.flight.job.entries[0].slot
        if slot.finished is None:
            assert any(x.what == "launch" and group_of(eng, x.flight) == g for x in until_wait)
    # Both stages work at once: at some tick each stage passed a different group's window.
    by_tick: dict[int, set[int]] = {}
    for f in ex.flights:
        for s, m in enumerate(f.marks):
            by_tick.setdefault(m.at, set()).add(s * 10 + group_of(eng, f))
    assert any({0, 11} <= v or {1, 10} <= v for v in by_tick.values())


@pytest.mark.parametrize("stages", [2, 3])
def test_a_prompts_chunks_stream_through_the_stages(stages) -> None:
    eng, ex = gated(make_plan(stages=stages, slots=2, groups=2, context=128, prefill_chunk=16))
    long = tuple(32 + (5 * i) % 90 for i in range(100))  # 7 chunks of 16 (the last of 4)
    reqs = [(0, Request(tuple(b"Decoding beside it"), 30)), (2, Request(long, 4))]
    got = collect(eng, reqs, check_kv=False)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("tiny", r.prompt_ids, r.max_tokens)
    chunks = [
        e
        for e in ex.log
        if e.what == "launch" and e.flight.job.kind == "prefill" and len(e.flight.job.token_array()) != 5
    ]
    reader = [e.flight for e in chunks if e.flight.job.entries[0].slot.prompt == long]
    assert len(reader) == 7
    most = 0
    for i, e in enumerate(ex.log):
        if e.what != "launch" or e.flight not in reader:
            continue
        k = reader.index(e.flight)
        flying = [f for f in in_flight_at(ex, i) if f in reader]
        most = max(most, len(flying))
        if k > 0 and reader[k - 1] in flying:  # launched behind a chunk still in flight...
            assert (
                reader[k - 1].marks[0].at is not None and reader[k - 1].marks[0].at <= e.tick
            )  # ...once it left stage 0
    assert most == stages  # up to one chunk per stage
    # The chunks stay in order everywhere: each starts where the one before it ends.
    assert [f.job.entries[0].pos for f in reader] == list(range(0, 100, 16))


def test_the_host_blocks_only_when_nothing_else_can_be_done_with_batch_mtp_in_groups() -> None:
    eng, ex = gated(
        pipelined_mtp_plan(stages=3, slots=4, groups=2, draft_tokens=3, context=128, prefill_chunk=16)
    )
    prompts = [b"one", b"a second, longer prompt of two chunks", b"three", b"four and more"]
    reqs = [(2 * i, Request(tuple(p), 10)) for i, p in enumerate(prompts)]
    got = collect(eng, reqs, check_kv=False)  # nothing_else_to_do runs at every wait
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("tiny", r.prompt_ids, 10)
    assert sum(1 for e in ex.log if e.what == "wait") > 5
    mtp = [e.flight for e in ex.log if e.what == "launch" and e.flight.job.kind == "pipelined-mtp"]
    assert mtp and all(f.job.rows == 2 * len(f.job.entries) for f in mtp)
    assert sum(ev.accepted for ev in eng.windows) > 0


def test_batch_mtp_windows_in_groups_are_decided_on_the_device_and_run_ahead_within_each_group() -> None:
    """Each group's batch-MTP windows are decided on the last stage and the group's next window is queued
    behind its window still on the stages (up to run_ahead), with the text of every request alone."""
    eng, ex = gated(
        pipelined_mtp_plan(stages=2, slots=4, groups=2, draft_tokens=3, context=128, prefill_chunk=16)
    )
    prompts = [b"one", b"a second prompt", b"three", b"four and more"]
    reqs = [(0, Request(tuple(p), 24)) for p in prompts]
    chained: list[Job] = []
    launch = ex.launch

    def spy(job: Job, after: Chained | None = None) -> Flight:
        if after is not None and after.rows is None:
            chained.append(job)
        return launch(job, after)

    ex.launch = spy  # type: ignore[method-assign]
    got = collect(eng, reqs, check_kv=False)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("tiny", r.prompt_ids, 24)
    grouped = [job for job in chained if job.kind == "pipelined-mtp"]
    assert len(grouped) >= 4 and all(job.spec_on_device for job in grouped)
    assert {job.entries[0].slot.id % 2 for job in grouped} == {0, 1}  # both groups ran ahead
    assert eng.totals["decided_on_device"] > len(grouped)
    assert eng.startup[-2].endswith("solo and batch-MTP windows, in each group")


def test_a_group_runs_ahead_even_when_its_windows_finish_before_the_host_looks_again() -> None:
    """Without the gate, CPU devices finish a window as soon as it is launched. The group's next window
    must still be chained at launch (as serial windows are), not only when the host happens to find its
    window still in flight: run-ahead may not depend on how fast a window runs."""
    eng = Engine(
        pipelined_mtp_plan(stages=2, slots=4, groups=2, draft_tokens=3, context=128, prefill_chunk=16)
    )
    chained: list[Job] = []
    launch = eng.executor.launch

    def spy(job: Job, after: Chained | None = None) -> Flight:
        if after is not None and after.rows is None:
            chained.append(job)
        return launch(job, after)

    eng.executor.launch = spy  # type: ignore[method-assign]
    prompts = [b"one", b"a second prompt", b"three", b"four and more"]
    reqs = [(0, Request(tuple(p), 16)) for p in prompts]
    got = collect(eng, reqs, check_kv=False)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference("tiny", r.prompt_ids, 16)
    assert {job.entries[0].slot.id % 2 for job in chained if job.kind == "pipelined-mtp"} == {0, 1}


LONG = [tuple(32 + (7 * i + 3 * k) % 90 for i in range(n)) for k, n in enumerate((41, 9, 60, 23))]
"""Prompts of 1 to 4 chunks of 16."""


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("mode", ["serial", "pipelined", "batch-mtp", "pipelined-mtp"])
def test_greedy_text_of_long_prompts_arriving_staggered_is_the_same_in_every_mode(stages, mode) -> None:
    preset = "small" if stages == 4 else "tiny"
    reqs = [(3 * k, Request(p, 12 - 2 * k, request_id=f"long-{k}")) for k, p in enumerate(LONG)]
    got = collect(engine(stages, mode), reqs)
    for (_, r), tokens in zip(reqs, got, strict=True):
        assert tuple(tokens) == reference(preset, r.prompt_ids, r.max_tokens)


# ---- the bench: the pipelined-mtp arm and the hand-off workload ----------------------------------------


def test_the_pipelined_mtp_arm_runs_as_named_only_with_batch_mtp_inside_groups() -> None:
    from strata_cfg.bench.arms import ARMS, DEFAULT_ARMS, arm_note, arm_runs_as_named

    assert ("batch.mtp_in_groups", True) in ARMS["pipelined-mtp"] and "pipelined-mtp" not in DEFAULT_ARMS
    pipelined = make_plan(stages=2, slots=4, groups=2, draft_tokens=3)
    assert arm_runs_as_named("pipelined-mtp", with_mtp_in_groups(pipelined))
    assert not arm_runs_as_named("pipelined-mtp", pipelined)  # the key did not take: batch MTP off
    assert arm_note("pipelined-mtp", pipelined).startswith(
        "forced: runs as pipelined, 2 group(s), batch MTP off"
    )


def test_the_in_process_bench_runs_a_pipelined_mtp_arm_with_serials_text(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from strata_cfg.schema.plan_file import write_plan

    # One chunk per prompt: both streams start and end together, so no solo window drafts in `pipelined`.
    kw = dict(stages=2, slots=2, draft_tokens=3, context=128, prefill_chunk=64, layer_scale=0.03)
    plans = {
        "serial": make_plan(groups=1, **kw),
        "pipelined": make_plan(groups=2, **kw),
        "pipelined-mtp": pipelined_mtp_plan(groups=2, **kw),
    }
    argv = [sys.executable, "-m", "strata_runtime", "bench", "--workload", "two-decodes", "--tokens", "24"]
    argv += ["--repeats", "1", "--json"]
    for name, plan in plans.items():
        argv += ["--arm", f"{name}={write_plan(plan, tmp_path / f'{name}.json')}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    arms = json.loads(out.stdout)["arms"]
    mtp, pipelined = arms["pipelined-mtp"]["two-decodes"], arms["pipelined"]["two-decodes"]
    assert arms["pipelined-mtp"]["plan"]["mtp_in_groups"] and mtp["text_equal_to_serial"]
    assert mtp["median"]["accepted_pct"] > 0 and pipelined["median"]["accepted_pct"] == 0
    assert mtp["median"]["rows_per_window"] > pipelined["median"]["rows_per_window"]  # token + proposal rows
    assert "continuous pipeline: 2 groups in flight, batch MTP inside each group" in out.stderr


def test_the_handoff_workload_times_each_pair_of_stage_gpus_and_refuses_one_gpu() -> None:
    from strata_runtime.bench.handoff import run_handoff, stage_pairs

    split = make_plan(stages=3)
    gpus = (0, 1, 1)
    stages = [
        s.model_copy(update={"device": f"cuda:{gpus[s.index]}", "gpu": gpus[s.index]}) for s in split.stages
    ]
    assert stage_pairs(split.model_copy(update={"stages": stages})) == [(0, 1)]
    with pytest.raises(ValueError, match="needs a split over two GPUs"):
        run_handoff(make_plan(stages=1))


def test_a_cancelled_prompt_stops_streaming_and_its_slot_waits_for_its_chunks_in_flight() -> None:
    eng, ex = gated(make_plan(stages=3, slots=2, groups=2, context=128, prefill_chunk=16))
    handle = eng.submit(Request(tuple(32 + i % 90 for i in range(100)), 4))
    while sum(1 for f in eng._flights if f.job.kind == "prefill") < 3:
        eng.step()
    handle.cancel()
    launched = sum(1 for e in ex.log if e.what == "launch")
    while eng.step():
        assert eng.slots[0] is None or eng._flights or handle.events.empty()
    assert sum(1 for e in ex.log if e.what == "launch") == launched  # no chunk after the cancel
    events = [handle.events.get() for _ in range(handle.events.qsize())]
    assert events[-1].finished == "cancelled" and eng.slots == [None, None]
    kept = kept_tokens(eng, 0)  # the chunks read before the cancel, kept for reuse; none after it
    assert 0 < len(kept) < 100 and kept == handle.request.prompt_ids[: len(kept)]
