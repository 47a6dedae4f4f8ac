"""Prefix reuse (``memory.prefix_reuse``): a free slot keeps its last request's KV, and a request that begins
the same way reads only the rest of its prompt, with the text, log-probabilities and drafting it would have
had reading the whole prompt. Where another slot, busy or free, holds a longer shared prefix, the new
request's slot copies that prefix's KV instead.

The pure rules (`strata_runtime.engine.prefix`) are checked on their own: the shared prefix, what a kept slot
lends a prompt (less the prompt's last token, less one more where a drafter needs the token after its last
row, nothing under another routing key) and which free slot a request takes. Then engines on virtual CPU
devices, in every window mode: a chat's next turn reads only what is new, and its tokens and
log-probabilities equal those of an engine that reads every prompt whole.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rt_engine_helpers import MODES, assert_kv_consistent, collect, kept_tokens, mode_plan
from rt_plans import make_plan

from strata_cfg.schema.packaged import packaged_dir
from strata_runtime.api import Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.engine.prefix import (
    PAGE,
    STORE_LEAST,
    WAIT_LEAST,
    Kept,
    Prefixes,
    PrefixStore,
    best_donor,
    choose_slot,
    page_runs,
    pages_for,
    reusable,
    shared_prefix,
    worth_waiting,
)
from strata_runtime.server.metrics import engine_lines

# ---- the rules --------------------------------------------------------------------------------------------


def test_the_shared_prefix_is_the_leading_run_of_equal_tokens_however_long() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.choice([0, 1, 5, 255, 256, 257, 600, 1300])
        a = tuple(rng.randrange(1, 50) for _ in range(n))
        cut = rng.randrange(0, n + 1)
        b = a[:cut] + tuple(rng.randrange(1, 50) for _ in range(rng.randrange(0, 300)))
        naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert shared_prefix(a, b) == naive >= min(cut, len(b))


def _kept(tokens: tuple[int, ...], drafted: int | None = None, key: object = None, freed: int = 1) -> Kept:
    return Kept(tokens, drafted, key, freed)


def test_a_kept_slot_lends_the_shared_prefix_less_the_prompts_last_token_and_the_drafters_last_row() -> None:
    kept = tuple(range(1, 21))  # 20 tokens
    longer = kept + (90, 91)
    # Without a drafter: the whole kept run, since the prompt goes on past it.
    assert reusable(_kept(kept), longer, None) == 20
    # With one: a position less, as the drafter's row 19 needs the token after it (the prompt's 90).
    assert reusable(_kept(kept, drafted=19), longer, None) == 19
    # A drafter that holds fewer positions (rows it had not read) lends only those.
    assert reusable(_kept(kept, drafted=12), longer, None) == 12
    # The prompt's last token is always read: its logits choose the first token.
    assert reusable(_kept(kept), kept, None) == 19
    assert reusable(_kept(kept), kept[:10], None) == 9
    # Diverging at position 8: the stages lend 8, a drafter 7 (its row 7 read the kept token 9, not 99).
    other = kept[:8] + (99,) + kept[9:]
    assert reusable(_kept(kept), other, None) == 8
    assert reusable(_kept(kept, drafted=19), other, None) == 7
    # Another key (calibrated routing drew other tables, or another cache salt), nothing kept, an empty
    # prompt: nothing.
    assert reusable(_kept(kept, key=(5, "")), longer, (6, "")) == 0
    assert reusable(_kept(kept, key=(None, "a")), longer, (None, "b")) == 0
    assert reusable(_kept(kept, key=(5, "a")), longer, (5, "a")) == 20
    assert reusable(None, longer, None) == 0
    assert reusable(_kept(kept), (), None) == 0
    assert reusable(_kept(kept), (50, 51), None) == 0


def test_a_request_takes_the_least_busy_group_then_the_longest_reuse_then_the_oldest_release() -> None:
    prompt = tuple(range(1, 31))
    kept = [
        _kept(prompt[:5], freed=3),  # slot 0: 5 shared
        _kept(prompt[:20], freed=4),  # slot 1: 20 shared
        _kept((7, 7, 7), freed=1),  # slot 2: none shared, freed first
        None,  # slot 3: never served
    ]
    idle = lambda i: 0  # noqa: E731
    assert choose_slot([0, 1, 2, 3], kept, prompt, None, idle) == (1, 20)
    assert choose_slot([0, 2, 3], kept, prompt, None, idle) == (0, 5)
    # Nothing shared: a slot that never served, then the least recently freed.
    assert choose_slot([2, 3], kept, (60, 61), None, idle) == (3, 0)
    assert choose_slot([0, 1, 2], kept, (60, 61), None, idle) == (2, 0)
    # Pipelined groups stay balanced: slot 1's group is busier, so the longest reuse waits.
    busy = {0: 0, 1: 2, 2: 0, 3: 2}
    assert choose_slot([0, 1, 2, 3], kept, prompt, None, busy.__getitem__) == (0, 5)


def test_a_request_that_may_copy_takes_a_free_slot_rather_than_cut_a_long_kept_history_short() -> None:
    """With ``spare`` (the request may copy a prefix from another slot), a slot whose kept tokens it would
    cut short by `STORE_LEAST` or more comes after one it would not: an empty slot, a slot whose kept
    tokens the prompt continues, or one that keeps little."""
    prompt = tuple(range(1, 31))
    history = _kept(prompt[:5] + tuple(range(100, 170)), freed=1)  # shares 5, would lose 70
    idle = lambda i: 0  # noqa: E731
    assert choose_slot([0, 1], [history, None], prompt, None, idle) == (0, 5)  # the longest reuse
    assert choose_slot([0, 1], [history, None], prompt, None, idle, spare=True) == (1, 0)
    assert choose_slot([0, 1], [history, None], prompt, "other salt", idle, spare=True) == (1, 0)
    short = _kept(prompt[:5] + tuple(range(100, 100 + STORE_LEAST - 1)), freed=1)  # would lose 63
    assert choose_slot([0, 1], [short, None], prompt, None, idle, spare=True) == (0, 5)
    continued = _kept(prompt[:20], freed=1)
    assert choose_slot([0, 1], [continued, None], prompt, None, idle, spare=True) == (0, 20)
    other = _kept(tuple(range(200, 300)), freed=2)  # every slot would be cut: the longest reuse, as before
    assert choose_slot([0, 1], [history, other], prompt, None, idle, spare=True) == (0, 5)
    # Prefixes.best spares the history and copies the 5 shared positions from it instead.
    p = Prefixes(2, True)
    p.kept[0] = history
    assert p.best([0, 1], prompt, None, idle, donors={0: history}) == (1, 5, 0)


def test_a_second_conversation_spares_the_first_ones_history_without_a_store() -> None:
    """Two slots, no store: a conversation's first turn while the other slot keeps another conversation's
    long history takes the empty slot (copying the chat template's shared opening), so the first
    conversation's next turn still reuses its history in place. The tokens are the whole-prompt engine's."""
    eng = _engine_in_mode("serial", context=256, slots=2)
    whole = _engine_in_mode("serial", context=256, slots=2, prefix_reuse=False)
    opening = tuple(b"<|system|>")
    a = opening + tuple(random.Random(3).randrange(33, 126) for _ in range(100))
    b = opening + tuple(b"Another client, another question entirely.")
    reqs = [Request(a, 6), Request(b, 6)]
    outs = [collect(eng, [(0, r)]) for r in reqs]
    assert outs == [collect(whole, [(0, r)]) for r in reqs]
    assert eng.totals["prefix_copies"] == 1 and eng.totals["prefix_tokens"] == len(opening)
    follow = Request(a + tuple(outs[0][0]) + tuple(b" And then?"), 6)
    before = eng.totals["prefix_tokens"]
    assert collect(eng, [(0, follow)]) == collect(whole, [(0, follow)])
    assert eng.totals["prefix_tokens"] - before >= len(a) + len(outs[0][0]) - 2


def test_a_request_copies_the_prefix_another_slot_holds_where_it_shares_more_than_its_own() -> None:
    """`best_donor` finds the slot that lends the most under the same rules (`reusable`); `Prefixes.best`
    copies from it where it lends more than the chosen slot's own kept tokens and never names the chosen
    slot as its own donor; a request that reads its whole prompt copies nothing; `take` counts the choice
    and the copy."""
    prompt = tuple(range(1, 41))
    donors = {
        0: _kept(prompt[:30], drafted=29),  # lends 29 (a drafter's last row needs the token after it)
        2: _kept(prompt[:30]),  # lends 30
        3: _kept(prompt[:35], key=("other",)),  # another key: nothing
    }
    assert best_donor(donors, prompt, None) == (2, 30)
    assert best_donor({0: donors[0], 5: _kept(prompt[:30], drafted=29)}, prompt, None) == (
        0,
        29,
    )  # lower slot
    assert best_donor({}, prompt, None) == (None, 0)
    idle = lambda i: 0  # noqa: E731

    p = Prefixes(4, on=True)
    p.kept[1] = _kept(prompt[:10])  # slot 1's own: 10

    def choose(free: list[int], whole: bool = False) -> tuple[int, int, int | None]:
        chosen = p.best(free, prompt, None, idle, whole, donors)
        p.take(*chosen)
        return chosen

    assert p.best([1], prompt, None, idle, donors=donors) == (1, 30, 2) and p.totals["prefix_copies"] == 0
    assert choose([1]) == (1, 30, 2)
    assert p.totals == {"prefix_requests": 1, "prefix_tokens": 30, "prefix_copies": 1, "prefix_restores": 0}
    assert p.kept[1] is None  # taken
    p.kept[1] = _kept(prompt[:36])  # its own lends more than any other slot
    assert choose([1]) == (1, 36, None)
    assert choose([2]) == (2, 29, 0)  # slot 2 is not its own donor
    assert choose([1], whole=True) == (1, 0, None)
    assert p.totals == {"prefix_requests": 3, "prefix_tokens": 95, "prefix_copies": 2, "prefix_restores": 0}


def test_a_request_waits_for_a_slot_still_reading_a_prompt_that_would_lend_it_enough_more() -> None:
    prompt = tuple(range(1, 201))
    whole = _kept(prompt[:150] + (999,) * 40, drafted=189)  # slot 3 reads it: it will lend 149 (a drafter)
    reading, held = {3: whole}, {3: _kept(prompt[:60], drafted=59)}  # it holds 60 so far: lends 59
    assert worth_waiting(reading, held, prompt, None, now=0)
    assert worth_waiting(reading, held, prompt, None, now=149 - WAIT_LEAST)
    assert not worth_waiting(reading, held, prompt, None, now=149 - WAIT_LEAST + 1)  # too little to gain
    assert not worth_waiting(
        reading, {3: _kept(prompt[:151], drafted=150)}, prompt, None, now=0
    )  # it holds them
    assert not worth_waiting(reading, held, prompt, ("other",), now=0)  # another key: it would lend nothing
    assert not worth_waiting({}, held, prompt, None, now=0)


# ---- the engine ------------------------------------------------------------------------------------------


def _run(eng: Engine, req: Request) -> tuple[list[int], list[float], tuple[int, int, int]]:
    """A request alone through ``eng``: its tokens, each token's log-probability, and the prompt tokens it
    did not read again, its proposals and those accepted."""
    h = eng.submit(req)
    events = []
    while eng.step():
        while not h.events.empty():
            events.append(h.events.get())
    while not h.events.empty():
        events.append(h.events.get())
    assert events[-1].error is None, events[-1].error
    return (
        [t for e in events for t in e.token_ids],
        [lp.logprob for e in events for lp in e.logprobs],
        (h.cached_tokens, h.proposals, h.accepted_proposals),
    )


@functools.cache
def _engine(model: str, reuse: bool, stages: int = 2) -> Engine:
    source = (
        {"model_dir": packaged_dir("austen"), "draft_tokens": 3} if model == "austen" else {"preset": model}
    )
    # Every drafting window carries all its proposals (no depth chosen by the clock), so that two engines
    # that served the same requests draft alike.
    kw = dict(stages=stages, slots=2, context=256, prefill_chunk=16, adaptive_depth=False, **source)
    return Engine(make_plan(prefix_reuse=reuse, **kw))


@pytest.mark.parametrize("model", ["austen", "tiny"])
def test_a_chats_next_turn_reads_only_what_is_new_and_gives_what_reading_it_whole_gives(model) -> None:
    """Turn 2's prompt is turn 1's, its reply and a new message. With reuse it reads only the new part (and
    the last shared token, where the MTP head drafts); its tokens and log-probabilities equal an engine's
    that reads every prompt whole, bit for bit on CPU devices."""
    eng, whole = _engine.__wrapped__(model, True), _engine.__wrapped__(model, False)  # both new
    with_lps = SamplingParams(logprobs=2)
    first = tuple(b"It is a truth universally acknowledged, that a single man")
    reply, _, (cached, _, _) = _run(eng, Request(first, 24, with_lps))
    assert cached == 0
    assert _run(whole, Request(first, 24, with_lps))[0] == reply  # both engines learned the same of drafting
    second = first + tuple(reply) + tuple(b" Mr. Darcy said")
    mark = len(eng.windows)
    got, lps, (cached, *drafting) = _run(eng, Request(second, 24, with_lps))
    drafts = eng.tracked
    # The slot kept the prompt and the reply's tokens fed back (all but its last, or all where a window fed
    # that one back too); a drafting slot lends one position fewer.
    kept = len(first) + len(reply) - (1 if drafts else 0)
    assert cached in (kept - 1, kept)
    assert eng.totals["prefix_tokens"] >= cached and eng.totals["prefix_requests"] >= 1
    # Only the rest was read: the prefill windows' rows are the prompt less what was kept.
    read = sum(w.rows for w in list(eng.windows)[mark:] if w.kind == "prefill")
    assert read == len(second) - cached <= len(b" Mr. Darcy said") + 2
    want, want_lps, (none, *want_drafting) = _run(whole, Request(second, 24, with_lps))
    assert none == 0
    assert got == want and lps == want_lps
    # The drafter kept rows that read the right tokens: it proposes, and its proposals hold, as reading the
    # whole prompt would have made them.
    assert drafting == want_drafting and (not drafts or drafting[0] > 0)


def test_a_prompt_that_parts_from_the_kept_tokens_midway_reuses_up_to_there_and_drafts_as_if_whole() -> None:
    """An edited message: the new prompt leaves the kept tokens at position 30. The stages lend 30 positions
    and the drafter 29 (its row 29 read the kept token 30, which the new prompt replaces), so the text, the
    log-probabilities and the drafting are what reading the whole prompt gives."""
    eng, whole = _engine.__wrapped__("austen", True), _engine.__wrapped__("austen", False)
    first = tuple(b"It is a truth universally acknowledged, that a single man in possession")
    for engine in (eng, whole):
        _run(engine, Request(first, 16))
    edited = first[:30] + tuple(b"quite the reverse, that a lady")
    assert edited[30] != first[30]
    got, lps, (cached, *drafting) = _run(eng, Request(edited, 24, SamplingParams(logprobs=1)))
    want, want_lps, (none, *want_drafting) = _run(whole, Request(edited, 24, SamplingParams(logprobs=1)))
    assert (cached, none) == (29, 0)
    assert got == want and lps == want_lps and drafting == want_drafting and drafting[0] > 0


def test_a_request_that_asks_for_the_prompts_log_probabilities_reads_its_whole_prompt() -> None:
    eng, whole = _engine("tiny", True), _engine("tiny", False)
    prompt = tuple(b"The quick brown fox jumps over the lazy dog")
    _run(eng, Request(prompt, 8))
    asks = SamplingParams(prompt_logprobs=1)
    h = eng.submit(Request(prompt, 8, asks))
    w = whole.submit(Request(prompt, 8, asks))
    for engine in (eng, whole):
        while engine.step():
            pass
    got = [e for e in (h.events.get() for _ in range(h.events.qsize())) if e.prompt_logprobs]
    want = [e for e in (w.events.get() for _ in range(w.events.qsize())) if e.prompt_logprobs]
    assert h.cached_tokens == 0
    assert [lp.logprob for lp in got[0].prompt_logprobs] == [lp.logprob for lp in want[0].prompt_logprobs]
    assert len(got[0].prompt_logprobs) == len(prompt) - 1


def test_calibrated_routing_reuses_a_slot_only_for_the_same_prompt() -> None:
    """Each request's routing tables follow from its whole prompt, so a prompt that only begins the same way
    reads everything; the same prompt again reuses all but its last token."""
    plan = make_plan(slots=1, context=128, prefill_chunk=16, routing="calibrated", preset="tiny")
    assert plan.memory.prefix_reuse
    eng = Engine(plan)
    prompt = tuple(b"Calibrated routing follows the prompt")
    first, _, _ = _run(eng, Request(prompt, 10))
    longer = prompt + tuple(first) + (65, 66)
    _, _, (cached, _, _) = _run(eng, Request(longer, 4))
    assert cached == 0
    again, _, (cached, _, _) = _run(eng, Request(longer, 4))
    assert cached == len(longer) - 1
    fresh = Engine(make_plan(slots=1, context=128, prefill_chunk=16, routing="calibrated", preset="tiny"))
    assert again == _run(fresh, Request(longer, 4))[0]


def test_a_request_reuses_only_what_was_sent_with_its_own_cache_salt() -> None:
    """Parties that share a server each send their own ``cache_salt``: another party's kept prompt is read
    again, as if nothing were kept, and what was sent with the same salt (or none, with none) is reused."""
    eng = _engine("tiny", True)
    eng.forget_prefixes()
    prompt = tuple(b"A secret beginning, then a question")
    reply, _, (cached, _, _) = _run(eng, Request(prompt, 6, cache_salt="alice"))
    assert cached == 0
    again = prompt + tuple(reply) + (63,)
    assert _run(eng, Request(again, 4, cache_salt="bob"))[2][0] == 0
    assert _run(eng, Request(again, 4))[2][0] == 0  # no salt is a salt of its own
    eng.forget_prefixes()
    _run(eng, Request(prompt, 6, cache_salt="alice"))
    assert _run(eng, Request(again, 4, cache_salt="alice"))[2][0] == len(prompt) + len(reply) - 1


def test_a_follow_up_goes_to_the_slot_that_kept_its_beginning_not_the_first_free_one() -> None:
    eng = _engine("tiny", True)
    eng.forget_prefixes()
    a, b = tuple(b"First conversation, about the sea"), tuple(b"Second conversation, about a garden")
    out = collect(eng, [(0, Request(a, 6)), (0, Request(b, 6))])
    assert kept_tokens(eng, 1)[: len(b)] == b  # b took slot 1
    status = eng.stats()["slots"]  # /v1/status says what each free slot keeps
    assert [s["kept_tokens"] for s in status] == [len(kept_tokens(eng, 0)), len(kept_tokens(eng, 1))]
    h = eng.submit(Request(b + tuple(out[1]) + (33,), 4))
    eng.step()
    assert h.slot == 1 and h.cached_tokens == len(b) + len(out[1]) - 1


def _two_clients(eng: Engine, first: Request, second: Request) -> tuple[list, list, int, list]:
    """``first`` alone until it decodes, then ``second`` beside it: each one's tokens and log-probabilities,
    the prompt rows the engine read for ``second``, and each one's proposals and those accepted."""
    handles = [eng.submit(first)]
    eng.step()  # admitted
    slot = eng.slots[handles[0].slot]
    while not slot.decoding:
        eng.step()
    mark = len(eng.windows)
    handles.append(eng.submit(second))
    events: list[list] = [[], []]
    while eng.step():
        assert_kv_consistent(eng)
        for h, got in zip(handles, events, strict=True):
            while not h.events.empty():
                got.append(h.events.get())
    for h, got in zip(handles, events, strict=True):
        while not h.events.empty():
            got.append(h.events.get())
        assert got[-1].error is None, got[-1].error
    read = sum(w.rows for w in list(eng.windows)[mark:] if w.kind == "prefill")
    tokens = [[t for e in got for t in e.token_ids] for got in events]
    lps = [[lp.logprob for e in got for lp in e.logprobs] for got in events]
    return tokens, lps, read, [(h.proposals, h.accepted_proposals) for h in handles]


@pytest.mark.parametrize("model", ["austen", "tiny"])
def test_two_clients_with_one_system_prompt_read_it_once_and_get_what_reading_it_whole_gives(model) -> None:
    """The second client's request arrives while the first's decodes and begins with the same instructions:
    its slot copies the prefix's KV (and its drafter's) from the first's and reads only its own question
    (and the last shared token, where the MTP head drafts); its tokens, log-probabilities and KV equal an
    engine's that reads every prompt whole."""
    eng, whole = _engine.__wrapped__(model, True), _engine.__wrapped__(model, False)
    system = tuple(b"You answer in the manner of a novel of manners, briefly. ")
    first = Request(system + tuple(b"Who is Mr. Bingley?"), 20, SamplingParams(logprobs=1))
    second = Request(system + tuple(b"Is Netherfield far?"), 20, SamplingParams(logprobs=1))
    got, lps, read, drafting = _two_clients(eng, first, second)
    want, want_lps, whole_read, want_drafting = _two_clients(whole, first, second)
    assert got == want and lps == want_lps
    assert eng.totals["prefix_copies"] == 1 and whole.totals["prefix_copies"] == 0
    lent = len(system) - (1 if eng.tracked else 0)  # all the shared instructions, a drafter's row fewer
    assert eng.totals["prefix_tokens"] == lent
    metrics = "\n".join(engine_lines(eng.stats()))
    assert (
        "strata_prefix_reuse_copies_total 1\n" in metrics
        and f"strata_prefix_reuse_tokens_total {lent}" in metrics
    )
    assert whole_read == len(second.prompt_ids) and read == len(second.prompt_ids) - lent
    # What the copy wrote is what reading the prompt wrote: the second slot keeps the same KV on every stage
    # and in its drafter (whose proposals then come as the whole-prompt engine's would; the two engines'
    # windows differ, so their drafting differs by when each chose to draft).
    # (The whole-prompt engine's slot keeps nothing, but its arrays still hold what the request wrote.)
    n = len(second.prompt_ids) - 1  # the prompt's rows, past the copied ones: a stage's and a drafter's
    for stage, other in zip(eng.model.stages, whole.model.stages, strict=True):
        assert int(stage.kv.lengths[1]) > n
        assert (stage.kv.k[:, 1, :, :n] == other.kv.k[:, 1, :, :n]).all()
        assert (stage.kv.v[:, 1, :, :n] == other.kv.v[:, 1, :, :n]).all()
    if eng.tracked:
        mine, theirs = eng.model.drafters[1].kv, whole.model.drafters[1].kv
        assert int(mine.lengths[0]) >= n and (mine.k[..., :n, :] == theirs.k[..., :n, :]).all()
        assert (mine.v[..., :n, :] == theirs.v[..., :n, :]).all() and mine.k[..., :lent, :].any()
        assert drafting[1][0] > 0 and want_drafting[1][0] > 0


def _engine_in_mode(mode: str, **kw: object) -> Engine:
    """An engine of window mode ``mode`` on two virtual CPU stages (the drafting modes' model has an MTP
    head); ``kw``: more plan keywords."""
    preset = "small" if MODES[mode].get("draft_tokens") or mode == "pipelined-mtp" else "tiny"
    return Engine(mode_plan(mode, 2, **{"preset": preset, "prefill_chunk": 16, **kw}))


@functools.cache
def _mode_engine(mode: str, reuse: bool) -> Engine:
    return _engine_in_mode(mode, context=128, prefix_reuse=reuse)


turns = st.lists(
    st.tuples(
        st.integers(0, 6),  # arrival step
        st.integers(0, 2),  # the conversation it continues
        st.lists(st.integers(32, 126), min_size=1, max_size=10),  # its new message
        st.integers(1, 10),  # max tokens
    ),
    min_size=2,
    max_size=6,
)


@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=turns)
def test_in_every_mode_conversations_that_share_beginnings_give_the_text_of_whole_prompts(
    mode, schedule
) -> None:
    """Requests that continue one of three conversations (a stem and the messages sent so far), arriving
    staggered: in every window mode the engine that reuses prefixes gives each request the tokens of the
    engine that reads every prompt whole (and `collect` checks the KV, kept or held, after every step)."""
    stems = [tuple(b"Chapter one. "), tuple(b"Chapter two, "), tuple(b"Chapter one, again")]
    said = [list(s) for s in stems]
    reqs = []
    for i, (at, conv, message, n) in enumerate(schedule):
        said[conv] += message
        reqs.append((at, Request(tuple(said[conv]), n, request_id=f"t{i}")))
    assert collect(_mode_engine(mode, True), reqs) == collect(_mode_engine(mode, False), reqs)


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_a_burst_with_one_long_system_prompt_reads_it_once(mode) -> None:
    """Two requests sent at once that begin with the same 100 tokens: the second waits at the head of the
    queue until the first's slot has read them (the gain is at least `WAIT_LEAST`), then copies them, and
    both get the whole-prompt engine's tokens. With 30 shared tokens (under `WAIT_LEAST`) the second does
    not wait: it reads its whole prompt beside the first. (With one slot it waits for the slot, and then
    reuses what the first kept there.)"""
    eng, whole = _mode_engine(mode, True), _mode_engine(mode, False)
    rng = random.Random(11)
    for shared, waits in ((100, True), (30, False)):
        eng.forget_prefixes()
        system = tuple(rng.randrange(33, 126) for _ in range(shared))
        reqs = [(0, Request(system + tuple(b"first?"), 6)), (0, Request(system + tuple(b"Second!"), 6))]
        before = dict(eng.totals)
        mark = len(eng.windows)
        assert collect(eng, reqs) == collect(whole, reqs)
        lent = shared - (1 if eng.tracked else 0)
        copies = eng.totals["prefix_copies"] - before["prefix_copies"]
        saved = eng.totals["prefix_tokens"] - before["prefix_tokens"]
        read = sum(w.rows for w in list(eng.windows)[mark:] if w.kind == "prefill")
        one = eng.n_slots == 1  # the second waits for the slot anyway, and reuses what the first kept there
        if waits or one:
            assert (copies, saved) == (0 if one else 1, lent) and read == len(system) * 2 + 13 - lent
        else:
            assert (copies, saved) == (0, 0) and read == len(system) * 2 + 13
    assert WAIT_LEAST <= 100 - 1 and WAIT_LEAST > 30


def test_a_request_that_waits_keeps_a_free_slot_and_lets_an_unrelated_one_past() -> None:
    """While a request waits for a busy slot to read the instructions it shares, it keeps one free slot for
    itself: unrelated requests behind it take the other free slots at once (two of the three), never the
    waiting request's. All get the whole-prompt engine's tokens, and the waiting one copies the
    instructions."""
    eng, whole = (
        _engine_in_mode("serial", context=256),
        _engine_in_mode("serial", context=256, prefix_reuse=False),
    )
    assert eng.n_slots == 4
    rng = random.Random(13)
    system = tuple(rng.randrange(33, 126) for _ in range(120))
    reading = eng.submit(Request(system + tuple(b"first?"), 6))
    eng.step()
    assert eng.slots[reading.slot].prefilling  # 16 rows a chunk: 127 tokens take several windows
    sharing = eng.submit(Request(system + tuple(b"second!"), 6))
    others = [eng.submit(Request(tuple(b"Unrelated %d: a note on the weather." % k), 6)) for k in range(3)]
    eng.step()
    assert sharing.slot is None  # it waits for the instructions
    assert [h.slot is not None for h in others] == [True, True, False]  # its one free slot stays free
    assert None in eng.slots
    reqs = [h.request for h in (reading, sharing, *others)]
    while eng.step():
        pass
    got = [[t for ev in list(h.events.queue) for t in ev.token_ids] for h in (reading, sharing, *others)]
    assert got == collect(whole, [(0, r) for r in reqs])
    assert sharing.cached_tokens == len(system) - (1 if eng.tracked else 0)


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_a_conversations_next_turns_reuse_its_slot(mode) -> None:
    """Conversations of three turns each, as many as the plan has slots (up to two), in flight together:
    every later turn reads only its new message, the last token of the reply before it and, where the MTP
    head drafts, the token before that; every turn's tokens equal the whole-prompt engine's."""
    eng, whole = _mode_engine(mode, True), _mode_engine(mode, False)
    eng.forget_prefixes()
    said = [list(b"Letters from Bath: "), list(b"A walk to Meryton, ")][: eng.n_slots]
    reread = 1 + (1 if eng.tracked else 0)
    new: list[int] = []
    prompts: list[list[int]] = []
    for turn in range(3):
        reqs = [(0, Request(tuple(s), 6 + turn)) for s in said]
        before = eng.totals["prefix_tokens"], eng.totals["prefix_requests"]
        got = collect(eng, reqs)
        assert got == collect(whole, reqs)
        reused = eng.totals["prefix_tokens"] - before[0], eng.totals["prefix_requests"] - before[1]
        if turn:  # a reply's last token is read again unless a window had already fed it back
            least = sum(len(p) - len(new) - reread for p in prompts)
            assert reused[1] == len(said) and least <= reused[0] <= least + len(said)
        new = list(b" Then: ")
        for s, out in zip(said, got, strict=True):
            s += out + new
        prompts = [s[:] for s in said]


# ---- the host's prefix store ----------------------------------------------------------------------------


def test_the_store_keeps_a_prefix_only_where_it_holds_enough_that_nothing_else_does() -> None:
    store = PrefixStore(20, 100)
    conv = tuple(range(1, 101))  # 100 tokens
    kept = _kept(conv, drafted=99)
    assert store.worth_storing(kept, {})
    # Another slot holds all but its last 63 positions: too little would be lost.
    assert not store.worth_storing(kept, {1: _kept(conv[:38], drafted=37)})
    assert store.worth_storing(kept, {1: _kept(conv[:30], drafted=29)})
    assert store.worth_storing(kept, {1: _kept(conv, drafted=99, key="other salt")})  # another key lends none
    assert not PrefixStore(0, 100).worth_storing(kept, {})  # off
    store.store(kept)
    assert not store.worth_storing(kept, {})  # stored already
    longer = _kept(conv + tuple(range(200, 270)), drafted=169)
    assert store.worth_storing(longer, {})  # 70 positions more than the stored one
    assert STORE_LEAST == 64


def test_the_store_lends_its_longest_match_and_makes_room_from_what_a_new_prefix_holds_then_the_oldest() -> (
    None
):
    """Five pages of 64 positions; each prefix of 100 tokens takes two."""
    store = PrefixStore(5, 10)
    a, b, c = (tuple(range(k, k + 100)) for k in (1, 1000, 2000))
    (ea, none), (eb, _) = store.store(_kept(a)), store.store(_kept(b))
    assert none == [] and (ea.pages, eb.pages) == ((0, 1), (2, 3))
    assert store.best(a + (5, 6), None) == (ea, 100) and store.best(b[:50] + (7,), None) == (eb, 50)
    assert store.best(c, None) == (None, 0) and store.best(a + (5,), "other salt") == (None, 0)
    assert store.nbytes == 40 and store.totals["prefix_store_entries"] == 2
    # a, used since b was stored, is no longer the oldest: c makes room by dropping b, and takes its pages.
    store.used(ea)
    ec, dropped = store.store(_kept(c))
    assert dropped == [eb] and store.entries == [ea, ec] and ec.pages == (2, 3)
    # A longer a holds the stored a whole: it goes first, whatever its age, and nothing else must.
    ea2, dropped = store.store(_kept(a + (9, 9)))
    assert dropped == [ea] and store.entries == [ec, ea2] and ea2.pages == (0, 1)
    assert store.store(_kept(tuple(range(5000, 5321)))) == (None, [])  # 6 pages: more than the store
    assert store.store(_kept(b + c + a), spare=ec) == (None, [])  # 5 pages: not beside the one in use
    assert store.entries == [ec, ea2]
    # 3 pages, beside the one in use: no three free pages in a row are left, so it takes the lowest.
    ed, dropped = store.store(_kept(b + c[:50]), spare=ec)
    assert dropped == [ea2] and store.entries == [ec, ed] and ed.pages == (0, 1, 4)
    assert page_runs(ed.pages, 150) == [(0, 0, 128), (256, 128, 22)]
    assert store.totals == {
        "prefix_store_saved": 5,
        "prefix_store_dropped": 3,
        "prefix_store_entries": 2,
        "prefix_store_bytes": 50,
    }
    store.clear()
    assert store.nbytes == 0 and store.entries == [] and store.store(_kept(b + c + a))[0] is not None
    # A prefix takes consecutive pages where there are enough, even above lower free ones.
    store.clear()
    (x, _), (y, _), (z, _) = (store.store(_kept(t)) for t in (a[:60], b[:60], c))
    assert (x.pages, y.pages, z.pages) == ((0,), (1,), (2, 3))
    store.used(y)
    w, dropped = store.store(_kept(tuple(range(3000, 3150))))  # 3 pages: x and z make room, in that order
    assert dropped == [x, z] and w.pages == (2, 3, 4)


def test_a_prefixs_pages_are_copied_in_one_run_for_each_stretch_of_consecutive_pages() -> None:
    assert PAGE == 64 and [pages_for(n) for n in (1, 64, 65, 128)] == [1, 1, 2, 2]
    assert page_runs((3, 4, 0, 1), 200) == [(192, 0, 128), (0, 128, 72)]
    assert page_runs((3, 4, 0, 1), 64) == [(192, 0, 64)]  # only the pages n positions fill
    assert page_runs((5, 2), 70) == [(320, 0, 64), (128, 64, 6)]
    assert page_runs((5, 2), 0) == []


def test_a_copied_or_restored_prefix_goes_only_into_an_empty_slot_and_never_past_what_its_lender_holds() -> (
    None
):
    """`KVCache.fill`, which counts a prefix copied from another slot or the host's store: the errors name
    the slot that is not empty, and the lender that holds too little."""
    from strata_runtime.backend import Device
    from strata_runtime.model.kvcache import KVCache, KVError

    kv = KVCache(Device.parse("cpu:0"), 2, 3, 1, 16, 4, "float32")
    kv.fill(0, 5, 8, "a stored prefix")
    assert list(kv.lengths) == [5, 0, 0]
    with pytest.raises(KVError, match="slot 0: a prefix is copied only into an empty slot, it holds 5"):
        kv.fill(0, 2, 8, "a stored prefix")
    with pytest.raises(KVError, match="a stored prefix: cannot lend 9 positions, it holds 8"):
        kv.fill(1, 9, 8, "a stored prefix")
    with pytest.raises(KVError, match="slot 0: cannot lend 6 positions, it holds 5"):
        kv.claim(2, kv, 0, 6)
    kv.claim(2, kv, 0, 5)
    assert list(kv.lengths) == [5, 0, 5]


def _store_engine(mode: str, store_mib: int) -> Engine:
    return _engine_in_mode(mode, context=192, prefix_store_mib=store_mib)


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_conversations_that_outnumber_the_slots_copy_their_history_back_from_the_store(
    mode,
) -> None:
    """One conversation more than the plan has slots, taking turns one request at a time: each turn finds its
    conversation's slot taken by another. With a store each later turn copies its history back (the slot's
    prefix was stored before the other conversation overwrote it) and reads only the rest: its new message,
    the tokens reuse always reads again and, where the drafter had not yet read the reply's rows, those
    (a drafter's stored positions are its KV's). Without one it reads its whole prompt. The tokens are the
    same, and every slot's KV matches what it holds after every step (`collect`)."""
    eng, without = _store_engine(mode, 64), _store_engine(mode, 0)
    # A page holds 64 positions of every layer's keys and values, and of the drafter's one layer.
    f, kv = eng.plan.model.facts, eng.model.stages[0].kv
    layers = f.num_hidden_layers + (1 if eng.model.drafters else 0)
    per = layers * f.num_key_value_heads * f.head_dim * 2 * kv.k.dtype.itemsize
    assert eng.store.page_bytes == PAGE * per and eng.store.pages == (64 << 20) // (PAGE * per) > 0
    pages = f"{eng.store.pages} pages of 64 positions"
    assert f"prefix reuse on (store 64 MiB in host memory: {pages})" in eng.startup[1]
    assert without.startup[1].endswith("prefix reuse on")
    rng = random.Random(5)
    said = [[rng.randrange(33, 126) for _ in range(80)] for _ in range(eng.n_slots + 1)]
    reread = 1 + (1 if eng.tracked else 0)
    for turn in range(2):
        for conv in range(len(said)):
            req = [(0, Request(tuple(said[conv]), 5))]
            before, mark = dict(eng.totals), len(eng.windows)
            (out,) = collect(eng, req)
            assert [out] == collect(without, req)
            restored = eng.totals["prefix_restores"] - before["prefix_restores"]
            reused = eng.totals["prefix_tokens"] - before["prefix_tokens"]
            read = sum(w.rows for w in list(eng.windows)[mark:] if w.kind == "prefill")
            assert read == len(said[conv]) - reused
            if turn:  # at least the first turn's prompt came back, at most all but what is always read
                assert (
                    restored == 1 and 80 - 1 <= reused <= len(said[conv]) - len(b" and then? ") - reread + 1
                )
            else:
                assert restored == reused == 0
            said[conv] += out + list(b" and then? ")
    t = eng.totals
    assert t["prefix_store_saved"] >= len(said) and t["prefix_store_bytes"] <= 64 << 20
    metrics = "\n".join(engine_lines(eng.stats()))
    assert f"strata_prefix_reuse_restores_total {len(said)}\n" in metrics
    assert f"strata_prefix_store_saved_total {t['prefix_store_saved']}\n" in metrics
    assert f"strata_prefix_store_bytes {t['prefix_store_bytes']}\n" in metrics
    assert f"strata_prefix_store_entries {len(eng.store.entries)}\n" in metrics
    assert without.totals["prefix_restores"] == without.totals["prefix_store_saved"] == 0


def test_the_plan_says_how_much_history_the_store_holds_and_the_engine_allocates_that_many_pages() -> None:
    """`LaunchPlan.prefix_store_pages` (the plan text's "positions of history") is what the engine's store
    holds, with and without drafters; a store smaller than a page holds none, as the plan says."""
    from strata_cfg.report.plan_text import plan_text

    for mode, mib in (("serial", 1), ("batch-mtp", 1), ("serial", 0)):
        eng = _engine_in_mode(mode, context=64, prefix_store_mib=mib)
        plan = eng.plan
        assert eng.store.pages == plan.prefix_store_pages and (eng.store.pages > 0) == (mib > 0)
        if mib:
            text = f"(store 1 MiB in host memory: {plan.prefix_store_pages * PAGE:,} positions of history)"
            assert text in plan_text(plan)
    # A model whose page (64 positions of 4,096 layers) is larger than the store holds none.
    plan = mode_plan("serial", 2, preset="tiny", context=64, prefix_store_mib=1)
    facts = plan.model.facts.model_copy(update={"num_hidden_layers": 4096})
    huge = plan.model_copy(update={"model": plan.model.model_copy(update={"facts": facts})})
    assert huge.prefix_store_pages == 0 and "less than a page, none" in plan_text(huge)


def test_a_full_store_drops_its_least_recently_used_prefix_and_never_holds_more_than_its_pages() -> None:
    """A store with room for about one conversation's history: storing the next drops the one stored
    before, whose conversation then reads its whole prompt again, with the same tokens."""
    eng, without = _store_engine("serial", 64), _store_engine("serial", 0)
    eng.store = PrefixStore(pages_for(90) + 1, eng.store.page_bytes)  # room for one stored history, not two
    rng = random.Random(9)
    said = [[33 + c] + [rng.randrange(33, 126) for _ in range(79)] for c in range(eng.n_slots + 2)]
    for conv in range(len(said)):  # two more conversations than slots: two histories stored, one dropped
        req = [(0, Request(tuple(said[conv]), 5))]
        (out,) = collect(eng, req)
        said[conv] += out + list(b" ok")
    assert eng.totals["prefix_store_saved"] == 2 and eng.totals["prefix_store_dropped"] == 1
    assert [e.kept.tokens[0] for e in eng.store.entries] == [34]  # the second conversation's
    # The second copies its history back; the slot it takes stores its own history, for which the store
    # drops nothing but what it has room for beside the one being copied back: here, nothing is stored.
    for conv, restores in ((1, 1), (0, 0)):
        before = eng.totals["prefix_restores"]
        req = [(0, Request(tuple(said[conv]), 5))]
        assert collect(eng, req) == collect(without, req)
        assert eng.totals["prefix_restores"] - before == restores
        assert eng.store.nbytes <= eng.store.pages * eng.store.page_bytes


@functools.cache
def _store_mode_engine(mode: str, store: bool) -> Engine:
    return _engine_in_mode(mode, context=256, prefix_reuse=store, prefix_store_mib=4 if store else 0)


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_more_conversations_than_slots_give_the_text_of_whole_prompts_through_a_small_store(
    mode,
) -> None:
    """Two conversations more than the mode's slots, of 70-token beginnings, their turns arriving at random
    steps (seeded schedules), through a store of five pages (two conversations' histories): slots are taken
    from conversations, their histories stored and dropped, some copied back while others are stored. Every
    request gets the tokens of the engine that reads every prompt whole (and `collect` checks each slot's
    KV after every step), and the store is used: prefixes stored, dropped and copied back."""
    eng, whole = _store_mode_engine(mode, True), _store_mode_engine(mode, False)
    assert eng.store.pages >= 5  # the host memory the engine allocated holds these five pages
    restores, saved, dropped = eng.totals["prefix_restores"], 0, 0
    for seed in range(4):
        eng.forget_prefixes()
        eng.store = PrefixStore(5, eng.store.page_bytes)
        rng = random.Random(seed)
        said = [[rng.randrange(33, 126) for _ in range(70)] for _ in range(eng.n_slots + 2)]
        reqs = []
        for i in range(8):
            at, conv = rng.randrange(0, 3 * i + 1), rng.randrange(len(said))
            said[conv] += [rng.randrange(32, 127) for _ in range(rng.randint(1, 12))]
            reqs.append((at, Request(tuple(said[conv]), rng.randint(1, 8), request_id=f"c{i}")))
        assert collect(eng, reqs) == collect(whole, reqs)
        assert sum(len(e.pages) for e in eng.store.entries) <= 5
        saved, dropped = saved + eng.store.saved, dropped + eng.store.dropped
    assert saved >= 4 and dropped >= 1 and eng.totals["prefix_restores"] - restores >= 2


def _vram_share(eng: Engine) -> list[tuple[float, float]]:
    """Each stage's expert cache's hits and misses so far."""
    return [(st.experts.stats.hits, st.experts.stats.misses) for st in eng.model.stages]


@pytest.mark.parametrize("stages", [1, 2])
def test_a_conversation_copied_back_from_the_store_brings_back_the_experts_it_routes_to(stages) -> None:
    """Three conversations over two slots under an expert cache that swaps and holds about a third of the
    experts (the router's own routing, so a conversation's tokens route alike and the cache can learn them).
    A later turn copies its history back from the store instead of reading it, so the cache learns nothing
    of it from the prompt; with ``experts.recall_stored`` what the cache had learned when the conversation's
    slot was released is added back, and the cache rebalances before the turn's windows. The restored turns
    then find more of their expert work in VRAM than without it, on every stage, and the text is the same."""
    runs: dict[bool, tuple[list[list[int]], list[float]]] = {}
    for recall in (False, True):
        plan = make_plan(
            preset="small",
            stages=stages,
            slots=2,
            context=256,
            prefill_chunk=16,
            expert_cache=24 if stages == 1 else 12,
            prefix_store_mib=64,
            cache_policy={"recall_stored": recall, "keep_misses": False},
        )
        assert plan.experts.recall_stored is recall
        eng = Engine(plan)
        rng = random.Random(5)
        said = [[rng.randrange(33, 126) for _ in range(120)] for _ in range(3)]
        texts, shares = [], []
        for turn in range(3):
            for conv in range(3):
                before, restores = _vram_share(eng), eng.totals["prefix_restores"]
                (out,) = collect(eng, [(0, Request(tuple(said[conv]), 12))])
                texts.append(out)
                if turn:
                    assert eng.totals["prefix_restores"] == restores + 1, "the turn's history came back"
                    after = _vram_share(eng)
                    shares.append(
                        [(h - h0) / (h - h0 + m - m0) for (h0, m0), (h, m) in zip(before, after, strict=True)]
                    )
                said[conv] += out + list(b" and then? ")
        runs[recall] = texts, shares
    (plain, off), (recalled, on) = runs[False], runs[True]
    assert recalled == plain
    # Without the recall the two runs route, swap and hit alike: every stage must gain, and the stages
    # together by more than 2 points of the restored turns' expert work on average.
    gains = [(sum(turn[s] for turn in on) - sum(turn[s] for turn in off)) / len(on) for s in range(stages)]
    assert min(gains) > 0 and sum(gains) / stages > 0.02, (gains, off, on)
