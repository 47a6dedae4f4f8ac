"""`strata bench` and a request alone's drafting depth: every repeat starts from one estimate of how often
proposals hold, which a warm-up request on other text taught (`teach`), not from what the same request
taught in the repeat before it.

The solo windows are timed by a table (`ONE_PAYS`), so the depth each window takes depends on what proposals
did, not on this machine's timings."""

from __future__ import annotations

from rt_engine_helpers import bench_with_and_without, collect
from rt_plans import make_plan, profile_text

from strata_cfg.schema.workloads import PROMPTS, WARM_PROMPTS
from strata_runtime.api import Request, SamplingParams
from strata_runtime.bench.harness import run_bench, teach_drafting
from strata_runtime.bench.preparing import teach
from strata_runtime.engine import Engine
from strata_runtime.engine.depth import COST_MEASURED, PRIOR_WEIGHT, Holds, WindowCosts

OBSERVE = WindowCosts.observe
ONE_PAYS = {1: 3.0, 2: 3.3, 3: 6.0, 4: 6.5}
"""Solo window times by rows (ms): three proposals pay only where every proposal is sure to hold (a request
that has learned nothing starts there), one pays at the tiny model's acceptance."""


def _timed(monkeypatch) -> None:
    monkeypatch.setattr(WindowCosts, "observe", lambda self, rows, ms: OBSERVE(self, rows, ONE_PAYS[rows]))


def _engine(measured: bool = True) -> Engine:
    """An engine that drafts up to 3 proposals at an adaptive depth; with ``measured``, its greedy solo
    windows of every row count are measured already (as after the bench's warm-up), so that only what
    proposals did moves the depth."""
    eng = Engine(make_plan(draft_tokens=4, context=256, adaptive_depth=True))
    if not measured:
        return eng
    costs = WindowCosts()
    for rows in ONE_PAYS:
        for _ in range(COST_MEASURED):
            costs.observe(rows, 0.0)
    eng.choice.solo["greedy"] = (costs, Holds(PRIOR_WEIGHT))
    return eng


def _solo_rows(eng: Engine, request: Request) -> list[int]:
    before = len(eng.windows)
    collect(eng, [(0, request)])
    return [w.rows for w in list(eng.windows)[before:] if w.kind == "solo"]


def test_restoring_the_drafting_state_brings_a_request_back_to_its_first_depth(monkeypatch) -> None:
    """A request starts at the full depth with nothing learned, and the next of its kind at the depth the
    first settled on; restored to what it held before, the engine starts the request at the full depth
    again (and keeps the window times it measured); restored to what it had learned, at the learned one."""
    _timed(monkeypatch)
    eng = _engine()
    empty = eng.drafting_state()
    request = Request(tuple(b"The river runs"), 80)
    first = _solo_rows(eng, request)
    assert first[0] == 4 and first[-3:] == [2] * 3
    learned = eng.drafting_state()
    assert learned["greedy"].reached[0] > 0
    assert _solo_rows(eng, request)[0] == 2
    seen = dict(eng.choice.solo["greedy"][0].seen)
    eng.restore_drafting(empty)
    assert eng.drafting_state()["greedy"].reached == []
    assert _solo_rows(eng, request)[0] == 4
    assert all(eng.choice.solo["greedy"][0].seen[r] >= n for r, n in seen.items())  # times kept
    eng.restore_drafting(learned)
    assert eng.drafting_state()["greedy"].chance == learned["greedy"].chance
    assert _solo_rows(eng, request)[0] == 2


def test_every_repeat_starts_from_the_drafting_the_run_began_with(monkeypatch) -> None:
    """The same request in three repeats takes the same windows: the second does not start from the depth
    the first taught the engine."""
    _timed(monkeypatch)
    eng = _engine()
    collect(eng, [(0, Request(tuple(b"A warm-up"), 40))])  # as the bench's warm-up: window times measured,
    eng.forget_requests()  # what proposals did forgotten
    runs = run_bench({"solo": eng}, "solo", tokens=60, repeats=3, context=256)["solo"]
    windows = [{kind: (w[0], w[2]) for kind, w in r.items()} for r in runs.windows["solo"]]  # count, tokens
    assert len(windows) == 3 and windows[0] == windows[1] == windows[2], windows
    assert "solo 3" in windows[0]  # it starts at the full depth, as the run began with nothing learned


def test_teaching_decodes_other_text_and_a_repeat_starts_from_what_it_taught(monkeypatch) -> None:
    """`teach` decodes one request per stream on the warm-up prompts (none a repeat uses), with the bench's
    sampling; the workload's own request then starts at the depth that text taught."""
    _timed(monkeypatch)
    eng = _engine()
    sent: list[tuple[int, ...]] = []
    submit = eng.submit

    def spy(request: Request):
        sent.append(request.prompt_ids)
        return submit(request)

    monkeypatch.setattr(eng, "submit", spy)
    taught = teach({"solo": eng}, "solo", 60, eng.tokenizer, SamplingParams())["solo"]
    assert taught is not None and taught.requests == 1 and taught.proposals > taught.accepted > 0
    warm = {tuple(eng.tokenizer.encode(t)) for t in WARM_PROMPTS}
    repeat = {tuple(eng.tokenizer.encode(t)) for t in PROMPTS}
    assert sent and set(sent) <= warm and not set(sent) & repeat
    assert taught.chances["greedy"] == [round(c, 4) for c in eng.drafting_state()["greedy"].chance]
    state = eng.drafting_state()
    before = len(eng.windows)
    run_bench({"solo": eng}, "solo", tokens=60, repeats=1, context=256)
    repeat_rows = [w.rows for w in list(eng.windows)[before:] if w.kind == "solo"]
    request = Request(tuple(eng.tokenizer.encode(PROMPTS[0])), 60)
    eng.restore_drafting(state)
    assert _solo_rows(eng, request) == repeat_rows  # the repeat started from what the warm-up taught
    eng.restore_drafting({})
    assert _solo_rows(eng, request) != repeat_rows  # and that is not where it starts from nothing


def test_nothing_is_taught_where_the_depth_does_not_learn(monkeypatch) -> None:
    """A fixed depth, a plan that does not draft, a seeded sampled bench (whose requests keep the full
    depth so that their text does not depend on window times) and a workload that decodes nothing."""
    _timed(monkeypatch)
    fixed = Engine(make_plan(draft_tokens=4, context=256, adaptive_depth=False))
    plain = Engine(make_plan(context=256))
    engines = {"fixed": fixed, "plain": plain}
    assert teach(engines, "solo", 8, fixed.tokenizer, SamplingParams()) == {"fixed": None, "plain": None}
    assert teach_drafting(fixed, []) is None
    eng = _engine(measured=False)
    sampled = SamplingParams(temperature=0.7)
    assert teach({"solo": eng}, "solo", 8, eng.tokenizer, sampled, seeded=True) == {}
    assert teach({"solo": eng}, "prompt", 8, eng.tokenizer, SamplingParams()) == {}
    assert eng.drafting_state() == {}
    got = teach({"solo": eng}, "solo", 8, eng.tokenizer, sampled, seeded=False)["solo"]
    assert got is not None and "sampled" in got.chances


def test_the_bench_teaches_drafting_before_the_first_repeat_unless_told_not_to(tmp_path) -> None:
    """The line and ``drafting_taught`` in the JSON say what the warm-up taught; ``--cold-drafting`` leaves
    every repeat to start from nothing. The warm-up's proposals, or its silent probes where the measured
    window times say drafting does not pay (they are wall-clock times), teach greedy requests' chances."""
    profile = tmp_path / "drafting.toml"
    profile.write_text(profile_text(draft_tokens=4, context=256, adaptive_depth=True))
    argv = ["--workload", "solo", "--arms", "solo", "--repeats", "2", "--tokens", "24"]
    runs = bench_with_and_without(profile, argv, "--cold-drafting")
    res, err = runs[False]
    taught = res["drafting_taught"]["solo"]
    assert taught["requests"] == 1 and taught["chances"]["greedy"]
    assert 0 <= taught["accepted"] <= taught["proposals"]
    assert "[solo] drafting: every repeat starts from what 1 warm-up request(s) of 24 tokens" in err
    res, err = runs[True]
    assert res["drafting_taught"] == {} and "drafting: every repeat starts" not in err


def test_the_bench_writes_every_window_of_every_repeat_with_windows(tmp_path) -> None:
    """``--windows PATH``: one JSON line per window, repeat by repeat in the order they ran, each run
    starting at its prompt's window; a repeat's windows emit its request's tokens and hold the proposals
    the summary counts. ``--windows`` with a workload that runs no requests is refused at once."""
    import collections
    import json
    import subprocess
    import sys

    profile = tmp_path / "drafting.toml"
    profile.write_text(profile_text(draft_tokens=3, context=256))
    trace = tmp_path / "windows.jsonl"
    argv = [sys.executable, "-m", "strata_cfg", "bench", str(profile), "--workload", "solo", "--arms"]
    argv += ["solo,serial", "--repeats", "2", "--tokens", "20", "--json", "--windows", str(trace)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"every window written to {trace}" in out.stderr
    arms = json.loads(out.stdout)["arms"]
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    for arm in ("solo", "serial"):
        for repeat in (1, 2):
            run = [w for w in lines if w["arm"] == arm and w["repeat"] == repeat]
            assert [w["index"] for w in run] == list(range(1, len(run) + 1))
            assert run[0]["window"] == "prefill" and all(w["window"] != "prefill" for w in run[1:])
            assert sum(w["tokens"] for w in run) == 20 and all(w["case"] == "solo" for w in run)
            mix = arms[arm]["solo"]["windows_by_kind_repeats"][repeat - 1]
            assert {k: v["windows"] for k, v in mix.items()} == collections.Counter(w["window"] for w in run)
            assert all(0 <= w["accepted"] <= w["proposals"] <= w["rows"] - 1 for w in run[1:])
        slow = arms[arm]["solo"]["slowest_windows"][0]
        mine = [w for w in lines if w["arm"] == arm and w["repeat"] == slow["repeat"]]
        assert slow["ms"] == max(w["ms"] for w in mine if w["window"] != "prefill")
    assert sum(w["proposals"] for w in lines) > 0
    # A path that cannot be written is refused before anything runs, naming the path and why.
    missing = tmp_path / "no-such-dir" / "w.jsonl"
    refused = subprocess.run([*argv[:-2], "--windows", str(missing)], capture_output=True, text=True)
    assert refused.returncode != 0 and f"--windows {missing}: No such file or directory" in refused.stderr
    assert "repeat 1" not in refused.stderr  # no repeat ran
    step = [sys.executable, "-m", "strata_cfg", "bench", str(profile), "--workload", "step"]
    refused = subprocess.run([*step, "--windows", str(tmp_path / "w")], capture_output=True, text=True)
    assert refused.returncode != 0 and "--windows lists the windows of arms run in process" in refused.stderr
