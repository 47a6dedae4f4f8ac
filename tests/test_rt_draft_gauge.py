"""Drafting pauses for a request whose proposals rarely hold, and comes back when they do.

A window of k slots with one proposal each costs about as much as 2k rows for k(1 + a) tokens; when a
request's drafts are seldom accepted (a drafter that does not match the model, or sampling at a high
temperature), windows without proposals give more tokens for the time. Each slot's `DraftGauge` estimates
the share of its proposals that hold; below the plan's `spec.draft_floor` the engine runs its windows
without proposals, probing after `DRAFT_PROBE_EVERY` windows. Greedy text must not change, whatever the
gauge decides.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from rt_plans import make_plan, profile_text
from script_loader import load_script
from test_rt_engine import collect

from strata_cfg.plan.from_profile import resolve_text
from strata_cfg.report.plan_text import plan_text
from strata_cfg.schema.errors import ProfileError
from strata_cfg.schema.plan import DEFAULT_DRAFT_FLOOR as FLOOR
from strata_cfg.tui.widgets.plan_view import summary_rows
from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine, speculative
from strata_runtime.engine import executor as executor_module
from strata_runtime.engine.speculative import (
    DRAFT_PROBE_EVERY,
    DRAFT_WARMUP,
    SILENT_PROBE_FIRST,
    SILENT_PROBE_MOST,
    DraftGauge,
)
from strata_runtime.model.mtp import MtpHead
from strata_runtime.server.metrics import engine_lines

PROMPTS = [b"The river", b"Another one"]


def test_a_gauge_drafts_while_warming_up_pauses_below_the_floor_probes_and_comes_back() -> None:
    g = DraftGauge()
    for _ in range(DRAFT_WARMUP - 1):
        g.record(1, 0)
        assert g.drafts  # too few proposals seen to judge
    g.record(1, 0)
    assert g.estimate < FLOOR and not g.drafts
    for _ in range(DRAFT_PROBE_EVERY - 1):
        g.record(0, 0)
        assert not g.drafts
    g.record(0, 0)
    assert g.probe_due and g.drafts  # one probe
    g.record(1, 0)  # it failed: the next one waits twice as long
    for _ in range(2 * DRAFT_PROBE_EVERY - 1):
        g.record(0, 0)
        assert not g.drafts
    g.record(0, 0)
    assert g.probe_due
    g.record(1, 1)  # its proposal held
    assert not g.probe_due and g.drafts and g.estimate >= FLOOR
    assert g.wait == DRAFT_PROBE_EVERY
    for _ in range(8):
        g.record(3, 3)
    assert g.estimate > 0.9


def test_a_silent_gauge_probes_without_windows_backing_off_and_comes_back() -> None:
    """A plain greedy request's gauge (``silent``) never asks its solo windows for a probe: it is due a silent
    probe `SILENT_PROBE_FIRST` windows into a pause, each failed one doubles the wait for the next up to
    `SILENT_PROBE_MOST` (never the probe windows' wait), and one that holds brings drafting back and the
    next pause's first probe as soon as the first."""
    g = DraftGauge(most=3, silent=True)
    for _ in range(DRAFT_WARMUP):
        g.record(1, 0)
    assert not g.drafts and g.depth(3) == 0
    waits = []
    for _probe in range(6):
        idle = 0
        while not g.silent_probe_due:
            g.record(0, 0)
            idle += 1
            assert g.depth(3) == 0 and not g.leaves(0, 3)  # a due probe window never comes
        waits.append(idle)
        g.record(1, 0, silent=True)  # failed
        assert not g.silent_probe_due and g.wait == DRAFT_PROBE_EVERY
    first, most = SILENT_PROBE_FIRST, SILENT_PROBE_MOST
    assert waits == [min(first << k, most) for k in range(6)] and waits[-1] == most > first
    g.record(0, 0)
    g.record(1, 1, silent=True)
    assert g.estimate >= FLOOR and g.depth(3) > 0 and g.leaves(0, 3)
    assert g.silent_wait == first
    loud = DraftGauge(most=3)
    for _ in range(DRAFT_WARMUP):
        loud.record(1, 0)
    for _ in range(DRAFT_PROBE_EVERY):
        loud.record(0, 0)
    assert not loud.silent_probe_due and loud.depth(3) == 3 and loud.leaves(0, 3)  # a probe window


def test_silent_probes_read_the_proposal_for_the_next_token_and_keep_the_greedy_text(monkeypatch) -> None:
    """A paused plain greedy request alone runs no probe windows: every few windows (`SILENT_PROBE_FIRST`
    apart while its probes hold) its drafting head proposes its next token beside the windows in flight,
    and the next window's token decides the probe. With a head that predicts the model well (drafting
    forced off), most such probes hold; with one that does not (layer_scale 0.5), hardly any do (a match
    by chance in some 40 probes): so each proposal is compared with the very token it proposed. Greedy
    text is that of an engine that never pauses."""
    outcomes: list[int] = []
    record = DraftGauge.record

    def counted(self, proposed, accepted, silent=False) -> None:
        if silent:
            outcomes.append(accepted)
        record(self, proposed, accepted, silent)

    monkeypatch.setattr(DraftGauge, "record", counted)
    monkeypatch.setattr(DraftGauge, "_best", lambda self, room: 0)  # paused from the start
    plan = make_plan(stages=1, slots=1, draft_tokens=3, context=256, adaptive_depth=False)
    request = Request(tuple(PROMPTS[0]), 120)
    eng = Engine(plan)
    (text,) = collect(eng, [(0, request)])
    decode = [w for w in eng.windows if w.kind != "prefill"]
    assert all(w.rows == 1 for w in decode)  # no probe window
    assert len(outcomes) >= len(decode) // (SILENT_PROBE_FIRST + 2) - 1 >= 10
    assert sum(outcomes) > 0.6 * len(outcomes)
    probes, held = eng.totals["silent_probes"], eng.totals["silent_probes_held"]
    assert (probes, held) == (len(outcomes), sum(outcomes))
    assert f"({probes} silent probes, {held} held)" in eng.summary()
    metrics = "\n".join(engine_lines(eng.stats()))
    assert f"strata_silent_probes_total {probes}" in metrics
    assert f"strata_silent_probes_held_total {held}" in metrics
    outcomes.clear()
    poor = make_plan(stages=1, slots=1, draft_tokens=3, context=256, adaptive_depth=False, layer_scale=0.5)
    (poor_text,) = collect(Engine(poor), [(0, request)])
    assert len(outcomes) >= 10 and sum(outcomes) <= 0.1 * len(outcomes)
    monkeypatch.undo()
    never = plan.model_copy(update={"spec": plan.spec.model_copy(update={"draft_floor": 0.0})})
    assert collect(Engine(never), [(0, request)]) == [text]
    poor_never = poor.model_copy(update={"spec": poor.spec.model_copy(update={"draft_floor": 0.0})})
    assert collect(Engine(poor_never), [(0, request)]) == [poor_text]


def test_the_floor_weighs_a_windows_first_proposal_alone() -> None:
    """A deeper solo window counts toward the floor as its first proposal did: held or not, whatever the
    proposals after it did (they count by position, in the depth's chances), exactly as a window of one
    proposal. Three proposals that hold 60%, 55% and 50% of the time they are tried keep drafting on: read
    as a share of all proposals (about 37%, and 0 of 3 whenever the first failed) they paused it."""
    one, deep = DraftGauge(), DraftGauge()
    for accepted in [2, 0, 3, 1, 0, 0, 2, 3, 0, 1]:
        one.record(1, min(accepted, 1))
        deep.record(3, accepted)
        assert one.rate == deep.rate
    assert deep.own.chance[:2] != one.own.chance[:2]  # the later positions are measured apart
    g = DraftGauge()
    for accepted in [1, 0, 1, 1, 0, 1, 0, 1, 1, 0]:  # first proposals: 6 of 10 held, never a second
        g.record(3, accepted)
        assert g.drafts
    assert g.estimate >= 2 * FLOOR


def _run(plan, requests) -> tuple[list[list[int]], str, int, int]:
    """Each request's tokens; the windows' kinds in order (P prefill, B batch MTP, s serial, o solo); and
    how many decode windows carried proposals and how many did not. The windows without proposals are
    counted as paused in the totals, the summary and the metrics, all but at most one per request (a
    window chained while another request's last one is in flight is plain whatever the gauge says)."""
    eng = Engine(plan)
    got = collect(eng, [(0, r) for r in requests])
    windows = list(eng.windows)
    paused = sum(1 for w in windows if w.paused)
    plain = sum(1 for w in windows if w.kind != "prefill" and w.rows == len(w.slots))
    assert plain - len(requests) <= paused <= plain
    assert eng.totals["drafting_paused"] == paused
    if paused:
        assert f"{paused} windows without proposals while drafting paused" in eng.summary()
        assert f"strata_windows_drafting_paused_total {paused}" in "\n".join(engine_lines(eng.stats()))
    kinds = "".join({"prefill": "P", "batch-mtp": "B", "serial": "s", "solo": "o"}[w.kind] for w in windows)
    decode = [w for w in windows if w.kind != "prefill"]
    drafted = sum(1 for w in decode if w.rows > len(w.slots))
    return got, kinds, drafted, len(decode) - drafted


@pytest.mark.parametrize("slots", [1, 2])
def test_a_drafter_whose_proposals_never_hold_is_paused_and_the_greedy_text_is_the_same(
    slots, monkeypatch
) -> None:
    """layer_scale 0.5 makes the tiny model's MTP head disagree with it: no proposal holds. The engine
    pauses drafting after the warm-up and probes every `DRAFT_PROBE_EVERY` windows; with the floor at 0
    and a fixed solo depth (never pausing) it drafts in every window. The text is the same."""
    plan = make_plan(
        stages=1,
        slots=slots,
        batch_mtp=slots > 1,
        draft_tokens=3,
        context=256,
        layer_scale=0.5,
        adaptive_depth=False,
    )
    requests = [Request(tuple(p), 110) for p in PROMPTS[:slots]]
    paused, kinds, drafted, plain = _run(plan, requests)
    never = plan.model_copy(
        update={"spec": plan.spec.model_copy(update={"draft_floor": 0.0, "adaptive_depth": False})}
    )
    always, _, drafted_always, plain_always = _run(never, requests)
    assert paused == always
    assert plain_always == 0 and drafted_always > 0
    assert plain > 3 * drafted  # paused after the warm-up, then probes
    if slots > 1:
        # After the warm-up: runs of serial windows, each broken by one probe window.
        runs = kinds[kinds.index("s") :].rstrip("o").split("B")
        assert len(runs) >= 3 and all(len(r) >= DRAFT_PROBE_EVERY for r in runs[:-1])
        # Each failed probe doubles the wait before the next.
        assert all(len(b) >= 2 * len(a) - 1 for a, b in zip(runs[:-2], runs[1:-1], strict=True))


def test_a_drafter_whose_proposals_hold_is_never_paused() -> None:
    """The default tiny model's MTP head predicts it well: by the floor alone (``spec.adaptive_depth`` off:
    on CPUs the measured times favour serial windows), every decode window of two slots is batch MTP."""
    plan = make_plan(stages=1, slots=2, batch_mtp=True, draft_tokens=3, context=256, adaptive_depth=False)
    _, kinds, _, _ = _run(plan, [Request(tuple(p), 60) for p in PROMPTS])
    assert "s" not in kinds and kinds.count("B") > 20
    said = "".join(Engine(plan).startup)
    assert (
        "drafting pauses for a request while under 25% of its proposals hold, with one probe after 16" in said
    )


def test_the_profile_sets_the_floor_and_zero_never_pauses() -> None:
    """``spec.draft_floor`` reaches the plan, its text and the engine: 0 with a fixed solo depth drafts in
    every window of a drafter that never holds (with the adaptive depth, 0 only drops the floor); 0.9
    pauses a good drafter."""
    text = profile_text(stages=1, slots=2, batch_mtp=True, draft_tokens=3, context=256, layer_scale=0.5)
    adaptive = "[spec]\ndraft_floor = 0\nadaptive_depth = true"
    no_floor = resolve_text(text.replace("[spec]", adaptive), "no-floor.toml").plan
    assert no_floor.spec.adaptive_depth and "no acceptance floor" in plan_text(no_floor)
    assert "token + up to 2 MTP proposals" in plan_text(no_floor)
    assert (
        "drafting pauses for a request only while windows without proposals give more tokens per second"
        in ("".join(Engine(no_floor).startup))
    )
    fixed = "[spec]\ndraft_floor = 0\nadaptive_depth = false"
    never = resolve_text(text.replace("[spec]", fixed), "never.toml").plan
    assert never.spec.draft_floor == 0.0 and never.settings["spec.draft_floor"].source.kind == "user"
    assert not never.spec.adaptive_depth and never.settings["spec.adaptive_depth"].source.kind == "user"
    assert "drafting never pauses" in plan_text(never)
    assert "token + 2 MTP proposals" in plan_text(never)
    _, _, drafted, plain = _run(never, [Request(tuple(p), 60) for p in PROMPTS])
    assert plain == 0 and drafted > 20
    assert "drafting never pauses (spec.draft_floor = 0)" in Engine(never).startup
    good = profile_text(stages=1, slots=2, batch_mtp=True, draft_tokens=3, context=256)
    picky = resolve_text(good.replace("[spec]", "[spec]\ndraft_floor = 0.9"), "picky.toml").plan
    assert "drafting pauses under 90% of proposals held" in plan_text(picky)
    assert (
        "spec",
        "window 3: token + up to 2 MTP proposals, drafting pauses under 90% of proposals held",
    ) in [(label, text.plain) for label, text in summary_rows(picky)]
    _, kinds, _, plain = _run(picky, [Request(tuple(p), 60) for p in PROMPTS])
    assert plain > 0 and "s" in kinds  # about 60% of its drafts hold: under 90%, paused


def test_a_floor_outside_zero_to_one_is_refused_naming_the_key() -> None:
    text = profile_text(stages=1, slots=2, batch_mtp=True, draft_tokens=3)
    with pytest.raises(ProfileError) as err:
        resolve_text(text.replace("[spec]", "[spec]\ndraft_floor = 1.5"), "bad.toml")
    assert "bad.toml" in str(err.value) and "spec.draft_floor" in str(err.value)


def test_sampled_requests_whose_drafts_rarely_hold_decode_without_them_and_stay_seeded() -> None:
    """With the drafter of layer_scale 0.5 and temperature 0.4, the target's rows lean to its own choices
    and the drafts to others: few hold, windows without proposals take over, and a seed still gives the
    same text."""
    plan = make_plan(stages=1, slots=2, batch_mtp=True, draft_tokens=3, context=256, layer_scale=0.5)
    params = SamplingParams(temperature=0.4, seed=11)
    requests = [Request(tuple(p), 90, params) for p in PROMPTS]
    first, _, drafted, plain = _run(plan, requests)
    again, _, _, _ = _run(plan, requests)
    assert first == again
    assert plain > 2 * drafted


def _counting_head(monkeypatch) -> list[int]:
    """Rows each call of an MTP head runs, in order, from now until the test ends."""
    calls: list[int] = []
    run = MtpHead.__call__

    def counted(self, drafters, tokens, hidden, layout, *args, **kwargs):
        calls.append(layout.rows)
        return run(self, drafters, tokens, hidden, layout, *args, **kwargs)

    monkeypatch.setattr(MtpHead, "__call__", counted)
    return calls


def test_windows_without_proposals_leave_the_drafter_s_rows_for_one_pass_before_it_drafts(
    monkeypatch,
) -> None:
    """Two slots in serial windows (no batch MTP): neither drafts until one is left alone, so their rows
    wait, up to `DEFER_MOST`, and the head reads them in one pass. Against catching up every window
    (`DEFER_MOST` 0): the same text, far fewer head calls, and the same drafts once the slot is alone."""
    plan = make_plan(stages=2, slots=2, draft_tokens=3, context=256, adaptive_depth=False)
    requests = [(0, Request(tuple(b"The river"), 70)), (0, Request(tuple(b"Another one"), 20))]

    heads = _counting_head(monkeypatch)

    def run() -> tuple[list[list[int]], list[int], int, int]:
        eng = Engine(plan)
        heads.clear()
        got = collect(eng, requests)
        return got, list(heads), eng.totals["proposals"], eng.totals["accepted"]

    got, calls, proposals, accepted = run()
    monkeypatch.setattr(speculative, "DEFER_MOST", 0)
    got_each, calls_each, proposals_each, accepted_each = run()
    assert got == got_each
    assert (proposals, accepted) == (proposals_each, accepted_each) and accepted > 0
    assert len(calls) < len(calls_each) - 15  # one pass for the serial windows' rows, not one per window
    assert max(calls) > 8  # that pass: many windows' rows at once


def test_rewinding_a_drafter_forgets_exactly_the_deferred_rows_past_the_rewind() -> None:
    """Deferred rows sit after the drafter's KV, in order: a rewind keeps those before it (cutting a
    window's rows in the middle when it falls there) and forgets the rest; a rewind into the KV forgets
    them all."""
    import numpy as np

    eng = Engine(make_plan(stages=1, slots=1, draft_tokens=3, context=64))
    drafter = eng.model.drafters[0]
    assert drafter.length == 0
    hidden = drafter.deferred.shape[1]
    rows = (np.arange(5 * hidden, dtype=np.float32).reshape(5, hidden) + 1).astype(drafter.deferred.dtype)
    drafter.defer(rows[:1], [11])
    drafter.defer(rows[1:4], [12, 13, 14])
    drafter.defer(rows[4:], [15])
    drafter.rewind(3)  # positions 0, 1, 2: the first window and two of the second's three rows
    assert drafter.pending_tokens == [11, 12, 13] and drafter.pending_rows == 3
    drafter.rewind(3)
    assert drafter.pending_rows == 3
    drafter.defer(rows[4:], [16])  # after the three kept, over the forgotten row
    kept, tokens = drafter.take()
    assert tokens == [11, 12, 13, 16] and np.array_equal(kept, rows[[0, 1, 2, 4]])
    assert drafter.pending_rows == 0
    drafter.defer(rows[:2], [11, 12])
    drafter.rewind(0)
    assert drafter.pending_rows == 0 and drafter.length == 0
    # A window's own rows are held in place, not copied, when nothing is deferred before them.
    drafter.hold(rows[1:3], [21, 22])
    held, tokens = drafter.take()
    assert held is not None and np.shares_memory(held, rows) and tokens == [21, 22]
    drafter.defer(rows[:1], [31])
    drafter.hold(rows[1:3], [32, 33])  # after deferred rows: copied behind them, read in one pass
    both, tokens = drafter.take()
    assert tokens == [31, 32, 33] and np.array_equal(both, rows[:3]) and not np.shares_memory(both, rows)
    long = np.ones((drafter.deferred.shape[0] + 8, hidden), drafter.deferred.dtype)  # a prompt's chunk
    drafter.hold(long, list(range(len(long))))
    held, tokens = drafter.take()
    assert np.shares_memory(held, long) and len(tokens) == len(long)
    with pytest.raises(ValueError, match="no room"):
        drafter.defer(np.zeros((drafter.deferred.shape[0] + 1, hidden), drafter.deferred.dtype), [0] * 73)


def _simulation() -> ModuleType:
    """`scripts/draft_floor_sim.py`, loaded as a module."""
    return load_script("draft_floor_sim")


def test_the_simulations_probe_intervals_are_read_or_refused_by_name() -> None:
    """``--intervals`` takes N or A-B; anything else is refused naming the span and the form it needs."""
    sim = _simulation()
    assert sim.interval("2") == (2, 2) and sim.interval("1-8") == (1, 8)
    with pytest.raises(ValueError, match=r"--intervals: 'x-8' is not N or A-B"):
        sim.interval("x-8")
    with pytest.raises(ValueError, match=r"--intervals: '8-2' needs 1 <= A <= B"):
        sim.interval("8-2")
    with pytest.raises(ValueError, match=r"--intervals: '0' needs 1 <= A <= B"):
        sim.interval("0")


def test_the_floor_simulation_pauses_less_and_decodes_faster_by_the_first_proposal() -> None:
    """`scripts/draft_floor_sim.py` (docs/PERFORMANCE.md's table) over the engine's own gauge: where
    proposals hold 75%, 70% and 65% of the time they are tried, the floor read by each window's first
    proposal pauses far fewer windows than read by all its proposals, and decodes more tokens a
    millisecond; where they hold 20%, both pause nearly every window."""
    sim = _simulation()
    ms = [2.90, 3.90, 4.80, 5.72]

    def mean(case: str, requests: int = 40) -> tuple[float, float]:
        holds, bursts = sim.CASES[case]
        runs = [sim.request(holds, bursts, ms, seed) for seed in range(requests)]
        return sum(r for r, _ in runs) / len(runs), sum(p for _, p in runs) / len(runs)

    (rate, paused), (low_rate, low_paused) = mean("75 / 70 / 65%"), mean("20 / 20 / 20%")
    with sim.every_proposal():
        (old_rate, old_paused), (_, old_low_paused) = mean("75 / 70 / 65%"), mean("20 / 20 / 20%")
    assert paused < old_paused / 3 and rate > 1.03 * old_rate
    assert low_paused > 0.85 and old_low_paused > 0.85 and low_rate < 1 / ms[0]


def test_the_silent_probe_simulation_drafts_sooner_in_bursts_and_no_slower_where_drafts_fail() -> None:
    """`scripts/draft_floor_sim.py --silent` over the engine's own gauge at one H200's window times: in text
    that alternates predictable and unpredictable stretches, a request that probes silently pauses fewer
    windows and decodes more tokens a millisecond than one that probes with windows; where drafts hold 20%
    of the time it decodes no slower."""
    sim = _simulation()
    ms = [2.60, 4.25, 5.03, 5.71]

    def mean(case: str, silent: bool, requests: int = 40) -> tuple[float, float]:
        holds, bursts = sim.SILENT_CASES[case]
        runs = [sim.request(holds, bursts, ms, seed, silent) for seed in range(requests)]
        return sum(r for r, _ in runs) / len(runs), sum(p for _, p in runs) / len(runs)

    (loud_rate, loud_paused), (rate, paused) = (mean("bursts of 80 / 75 / 70%", s) for s in (False, True))
    assert paused < 0.9 * loud_paused and rate > loud_rate
    (loud_rate, _), (rate, _) = (mean("20 / 20 / 20%", s) for s in (False, True))
    assert rate >= 0.99 * loud_rate


def test_the_depth_simulation_drafts_where_it_pays_after_other_text() -> None:
    """`scripts/draft_floor_sim.py --depth` over the engine's own gauge, at one H200's window times: after
    a request on other text whose first proposals held 42%, a request whose first proposals hold 80% gets
    within 5% of the full depth's tokens a millisecond, far above no drafting; one whose hold 20% gets
    within 5% of no drafting, above the full depth."""
    sim = _simulation()
    ms = [2.60, 4.25, 5.03, 5.71]

    def mean(case: str, adaptive: bool, requests: int = 40) -> float:
        holds, bursts = sim.DEPTH_CASES[case]
        runs = [sim.after_other_text(holds, bursts, ms, seed, adaptive) for seed in range(requests)]
        return sum(r for r, _ in runs) / len(runs)

    none = 1 / ms[0]
    good, good_full = mean("80% / 89% / 100%", True), mean("80% / 89% / 100%", False)
    assert good > 0.95 * good_full and good > 1.3 * none
    bad, bad_full = mean("20% / 89% / 100%", True), mean("20% / 89% / 100%", False)
    assert bad > 0.95 * none and bad > bad_full


def test_each_window_records_the_rows_the_head_caught_up_on_for_it(monkeypatch) -> None:
    """The serial windows' rows, read in one pass when the slot left alone drafts again, are counted in the
    record of that drafting window (`WindowStat.caught_up`), and the windows' figures add up to every row
    the passes read."""
    plan = make_plan(stages=2, slots=2, draft_tokens=3, context=256, adaptive_depth=False)
    requests = [(0, Request(tuple(b"The river"), 70)), (0, Request(tuple(b"Another one"), 20))]
    passes: list[int] = []
    run = speculative.catch_up

    def counted(model, slot) -> None:
        passes.append(model.drafters[slot].pending_rows)
        run(model, slot)

    monkeypatch.setattr(speculative, "catch_up", counted)
    monkeypatch.setattr(executor_module, "catch_up", counted)
    eng = Engine(plan)
    collect(eng, requests)
    recorded = [w.caught_up for w in eng.windows]
    assert sum(recorded) == sum(passes) == sum(d.caught_up for d in eng.model.drafters.values())
    assert max(recorded) > 8  # the pass over the serial windows' rows, in one window's record
    paid = max(eng.windows, key=lambda w: w.caught_up)
    assert paid.kind == "solo" and paid.proposals > 0  # the window that drafted after the pause
    # The host's time on each window: drafting before launch (none for a prompt), finishing after.
    assert paid.draft_ms > 0 and all(w.finish_ms > 0 for w in eng.windows)
    assert all(w.draft_ms == 0 for w in eng.windows if w.kind == "prefill")
    assert sum(1 for c in recorded if c) < len(recorded) // 2  # most windows caught up on nothing


def test_silent_probes_end_a_chance_pause_soon_and_back_off_where_drafts_fail() -> None:
    """`scripts/draft_floor_sim.py --intervals` over the engine's own gauge, at one H100's window times, each
    probe charged the head's pass. Where first proposals hold half the time, the floor's short average dips
    under it by chance, and the engine's silent probes (`SILENT_PROBE_FIRST` apart, backing off to
    `SILENT_PROBE_MOST`) end such pauses sooner than probes 8 windows apart did: fewer windows paused, more
    tokens a millisecond. Where they hold 20% of the time, backing off after failed probes charges fewer of
    them than a fixed interval of 2 did: more tokens a millisecond."""
    sim = _simulation()
    ms = [3.15, 4.47, 5.3, 6.04]
    engine = (SILENT_PROBE_FIRST, SILENT_PROBE_MOST)

    def mean(case: str, span: tuple[int, int], requests: int = 200) -> tuple[float, float]:
        holds, bursts = sim.DEPTH_CASES[case]
        with sim.probes_every(*span):
            runs = [sim.after_other_text(holds, bursts, ms, seed, True, 0.12) for seed in range(requests)]
        return sum(r for r, _ in runs) / len(runs), sum(p for _, p in runs) / len(runs)

    (rate, paused), (rate_8, paused_8) = mean("50% / 89% / 100%", engine), mean("50% / 89% / 100%", (8, 8))
    assert paused < 0.6 * paused_8 and rate > 1.02 * rate_8
    (rate, _), (rate_2, _) = mean("20% / 89% / 100%", engine), mean("20% / 89% / 100%", (2, 2))
    assert rate > 1.02 * rate_2
