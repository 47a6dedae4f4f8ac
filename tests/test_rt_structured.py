"""Structured output: replies that follow a grammar (`strata_runtime.structured`), in every window mode.

A request's grammar removes the tokens it does not allow before each choice, so greedy decoding takes the
most likely allowed token and sampling draws from the distribution renormalised over the allowed tokens. The
tests check both against the model's own logits, check that the replies are JSON that follows the schema in
every window mode, and that a request with a grammar changes nothing for the requests beside it.
"""

from __future__ import annotations

import functools
import json
import random
from types import MappingProxyType

import numpy as np
import pytest
from rt_engine_helpers import (
    MODES,
    chained_grammar_windows,
    collect,
    collect_launched,
    launches,
    mode_plan,
    run_checking_kv,
    run_script,
)
from rt_plans import make_plan

from strata_runtime.api import Reasoning, Request, SamplingParams
from strata_runtime.engine import Engine
from strata_runtime.layout import Layout
from strata_runtime.model import Model
from strata_runtime.server.metrics import engine_lines
from strata_runtime.structured import GrammarError, Grammars, json_grammar, lark_grammar, reasoning_grammar
from strata_runtime.weights.tokenizer import ByteTokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _follows_person(text: bytes) -> None:
    """``text`` is JSON that follows `PERSON` (checked by hand: no schema validator is a dependency)."""
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"} and list(value) == ["name", "age", "tags"]
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"}
    assert not set(_outside_strings(text)) & set(b" \t\r\n")  # laid out compactly


def _outside_strings(text: bytes) -> bytes:
    """The bytes of JSON text that are not inside a string."""
    out, inside, escaped = bytearray(), False, False
    for b in text:
        if inside:
            inside = escaped or b != ord('"')
            escaped = not escaped and b == ord("\\")
        elif b == ord('"'):
            inside = True
        else:
            out.append(b)
    return bytes(out)


# ---- the grammar over a vocabulary -----------------------------------------------------------------------


def _allowed(matcher) -> list[int]:
    return [int(i) for i in np.flatnonzero(matcher.allowed())]


def test_a_json_grammar_allows_exactly_the_bytes_that_keep_the_text_valid_and_the_end_only_once_complete():
    tok = ByteTokenizer(300)  # ids 259..299 stand for nothing: never allowed
    grammars = Grammars(tok, 300)
    m = grammars.matcher(json_grammar(PERSON))
    assert _allowed(m) == [ord("{")]
    m.accept(b'{"')
    assert _allowed(m) == [ord("n")]  # the properties come in order; compact, so no blank before a key
    m.accept(b'name":"')
    inside = _allowed(m)
    assert ord('"') in inside and ord("x") in inside and ord(" ") in inside
    assert not set(inside) & {256, 257, 258} and max(inside) < 256  # no special token inside a string
    m.accept(b'Al","age":4')
    assert _allowed(m) == [ord(","), *range(ord("0"), ord("9") + 1)]  # 4 or 40-49: at most 99
    m.accept(b'2,"tags":["b"')
    assert _allowed(m) == [ord(","), ord("]")]
    assert not m.finished
    m.accept(b"]}")
    assert m.finished and _allowed(m) == sorted(tok.eos_ids)  # complete: only the end of the text
    with pytest.raises(GrammarError, match="token 32 does not follow the grammar"):
        grammars.matcher(json_grammar()).accept(b" ")


def test_the_allowed_tokens_after_proposals_are_those_of_the_grammar_moved_on_and_leave_the_reply_in_place():
    """`Matcher.allowed_after` (what drafted rows are masked with): after each prefix of the proposals, what
    a matcher that had accepted that prefix allows; after a proposal off the grammar, or past its end (the
    end-of-text token), every token; and the reply's own place in the grammar does not move."""
    tok = ByteTokenizer(300)
    grammars = Grammars(tok, 300)
    grammar = json_grammar(PERSON)
    m = grammars.matcher(grammar)
    m.accept(b'{"name":"Al","age":4')
    before = m.allowed()
    drafted = list(b'2,"tags":[]}') + [258, ord("x")]  # to the end of the JSON, then past it
    masks = m.allowed_after(drafted)
    assert len(masks) == len(drafted) + 1
    for k in range(13):  # the JSON's own continuation: a matcher moved on by the first k proposals
        moved = grammars.matcher(grammar)
        moved.accept(b'{"name":"Al","age":4' + bytes(drafted[:k]))
        assert (masks[k] == moved.allowed()).all()
    assert masks[12].sum() == len(tok.eos_ids)  # complete: only the end of the text
    assert masks[13].all() and masks[14].all()  # after the end, nothing is used
    off = m.allowed_after(list(b"x,"))  # "x" does not follow "4"
    assert (off[0] == before).all() and off[1].all() and off[2].all()
    assert (m.allowed() == before).all()
    m.accept(b'2,"tags":[]}')
    assert m.finished


def _one_end_of_text_id(monkeypatch) -> None:
    """llguidance as it was before 1.7 (the newest release built for glibc older than 2.31): its tokenizer
    takes one end-of-text id, and refuses a list."""
    import llguidance

    real = llguidance.LLTokenizer

    def one_id(tokenizer, n_vocab=None, eos_token=None, **kw):
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(tokenizer, n_vocab=n_vocab, eos_token=eos_token, **kw)

    monkeypatch.setattr(llguidance, "LLTokenizer", one_id)


def test_an_llguidance_that_knows_one_end_of_text_id_still_allows_and_reads_each_of_the_models():
    """Where llguidance takes one end-of-text id, the model's others are allowed where it is, and end the
    reply as it does: every mask, packed or not, and every verdict are those of an llguidance that knows
    them all. (The tokenizer here has two.)"""
    tok = ByteTokenizer(300)
    grammar = json_grammar(PERSON)
    text = list(b'{"name":"Al","age":42,"tags":["b"]}')
    assert len(tok.eos_ids) == 2
    knows_all = Grammars(tok, 300).matcher(grammar)
    with pytest.MonkeyPatch.context() as mp:
        _one_end_of_text_id(mp)
        knows_one = Grammars(tok, 300).matcher(grammar)
    for drafted in (text, [*text, tok.eos_ids[1], ord("x")], [*text[:5], tok.eos_ids[1]]):
        assert (knows_one.bitmasks_after(drafted) == knows_all.bitmasks_after(drafted)).all()
        assert knows_one.ends_within(drafted) == knows_all.ends_within(drafted)
    with pytest.raises(GrammarError):  # mid-text, no end-of-text id is allowed
        knows_one.copy().accept([*text[:5], tok.eos_ids[1]])
    for m in (knows_one, knows_all):
        m.accept(text)
    assert knows_one.finished and _allowed(knows_one) == _allowed(knows_all) == sorted(tok.eos_ids)
    for eos in tok.eos_ids:
        ended = knows_one.copy()
        ended.accept([eos])
        assert ended.finished


def test_the_packed_masks_the_device_applies_keep_exactly_the_allowed_tokens_after_each_proposal():
    """`Matcher.bitmasks_after`, applied by the device's step (`mask_logits`, NumPy on a CPU device): after
    each prefix of the proposals, a row keeps its logit for exactly the tokens `allowed_after` allows and is
    minus infinity elsewhere; rows it is not asked to mask are untouched."""
    from strata_runtime.models.ops.adjust import mask_logits

    tok = ByteTokenizer(300)
    m = Grammars(tok, 300).matcher(json_grammar(PERSON))
    m.accept(b'{"name":"Al","age":4')
    drafted = list(b'2,"tags":["a') + [258, ord("x")]
    bits = m.bitmasks_after(drafted)
    masks = m.allowed_after(drafted)
    assert bits.dtype == np.uint32 and bits.shape == (len(drafted) + 1, (300 + 31) // 32)
    logits = np.random.default_rng(5).standard_normal((len(drafted) + 3, 300)).astype(np.float32) + 1
    rows = np.arange(2, len(drafted) + 3)  # the first two rows are another request's
    out = logits.copy()
    mask_logits(out, rows, bits)
    for k, row in enumerate(rows):
        assert np.array_equal(np.isfinite(out[row]), masks[k]), k
        assert np.array_equal(out[row][masks[k]], logits[row][masks[k]])
    assert 1 <= masks[0].sum() < 20 and masks[-1].all()  # a number's digits; past the end, anything
    assert np.array_equal(out[:2], logits[:2])


def test_a_place_ahead_gives_masks_as_wide_as_llguidance_lays_them_out_wherever_it_stands():
    """A place ahead of the host's (`Matcher.copy`, moved by `bitmask_after`) gives rows of the width of
    llguidance's own masks, whatever it moved by: a token the grammar allows, the one that completes it, or
    one off it (every token allowed). On a vocabulary whose size is a multiple of 32 llguidance lays its
    masks one word wider than the vocabulary needs, and a window stacks its slots' rows together."""
    v = 512
    m = Grammars(ByteTokenizer(v), v).matcher(json_grammar({"enum": [7]}))
    width = m.bitmasks_after([]).shape[1]
    assert width == len(m._ll.compute_bitmask()) // 4
    ahead = m.copy()
    rows = [ahead.bitmask_after(ord("7")), ahead.bitmask_after(ord("x")), ahead.bitmask_after(ord("y"))]
    assert all(r.shape == (width,) for r in rows)
    assert np.unpackbits(rows[1].view(np.uint8), bitorder="little")[:v].all()  # lost: anything
    assert np.stack([m.bitmask_last([ord("x")])[0], *rows]).shape == (4, width)
    assert m.allowed()[ord("7")] and m.allowed().sum() == 1  # the reply's own place did not move


def test_a_place_ahead_moved_off_its_grammar_is_lost_without_a_word_from_llguidance(capfd):
    """A place ahead follows a drafter's proposals the device did not mask (`Place.move`), often off the
    grammar: it is then lost (every token allowed after it) and llguidance, asked first whether it takes
    the token, logs nothing (consuming it would print a parser error for each one)."""
    v = 512
    m = Grammars(ByteTokenizer(v), v).matcher(json_grammar({"enum": [71, 72]}))
    ahead = m.copy()
    ahead.move([ord("7"), ord("x"), ord("1")])
    assert np.unpackbits(ahead._packed().view(np.uint8), bitorder="little")[:v].all()
    assert "Parser Error" not in capfd.readouterr().err
    assert m.allowed()[ord("7")] and not m.allowed()[ord("x")]  # the reply's own place did not move


def test_a_greedy_proposal_under_a_grammar_is_the_argmax_over_what_it_allows_after_the_chain():
    """A drafter's greedy proposal under a grammar is masked and chosen where its logits are (a token comes
    back, not the row): the argmax over the tokens the grammar allows after the proposals before it, which
    is what the host's choice from the row gives (`Sampler.adjusted`)."""
    from strata_runtime.engine.sampling import Sampler
    from strata_runtime.engine.speculative import _choose

    model = Model.from_plan(make_plan(stages=1, preset="tiny", context=64))
    v = model.args.vocab_size
    grammar = json_grammar(PERSON)
    sampler = Sampler(SamplingParams(grammar=grammar), 0, Grammars(ByteTokenizer(v), v).matcher(grammar))
    dev = model.last.device
    g = np.random.default_rng(11)
    chains = [[], list(b'{"name":"'), list(b'{"name":"Al","age":'), list(b'{"name":"Al","age":4'), list(b"x")]
    for chain in chains:
        for _ in range(3):
            logits = g.standard_normal(v).astype(np.float32) * 3
            token, q = _choose(model, sampler, dev, dev.upload(logits), chain)
            assert q is None
            assert token == int(np.argmax(sampler.adjusted(logits[None, :], chain)[0]))
    assert sampler.grammar.allowed()[ord("{")] and sampler.grammar.allowed().sum() == 1  # still at the start


def test_any_json_object_and_bad_schemas_are_told_apart_before_a_request_runs():
    grammars = Grammars(ByteTokenizer(300), 300)
    grammars.check(json_grammar())  # any JSON object
    grammars.check(json_grammar({"type": "array", "items": {"type": "number"}}))
    with pytest.raises(GrammarError, match="nonsense"):
        grammars.check(json_grammar({"type": "nonsense"}))
    with pytest.raises(GrammarError):
        grammars.check("not a grammar")


# ---- replies that reason first ----------------------------------------------------------------------------


class ThinkingTokens(ByteTokenizer):
    """The byte tokenizer with think tags as tokens of their own, as Qwen3's vocabulary has them."""

    SPECIALS = MappingProxyType({**ByteTokenizer.SPECIALS, "<think>": 259, "</think>": 260})


OPEN, CLOSE = 259, 260
TEXT = [i for i in range(33, 127)]
"""Printable ASCII: text any think block may hold."""


def test_a_reply_may_reason_first_within_its_budget_then_follows_its_grammar():
    """The reply may open a think block (or answer at once); the block holds text, never the opening tag
    again nor the end of the text; after ``budget`` tokens only the closing tag; then a few blanks and the
    JSON. Where the prompt opened the block, the reply starts in it."""
    tok = ThinkingTokens(300)
    grammars = Grammars(tok, 300)
    m = grammars.matcher(json_grammar(PERSON), Reasoning(OPEN, CLOSE, budget=3))
    assert _allowed(m) == [ord("{"), OPEN]
    m.accept([OPEN])
    inside = _allowed(m)
    assert set(TEXT) <= set(inside) and CLOSE in inside and OPEN not in inside
    assert not set(tok.eos_ids) & set(inside)
    m.accept(b"ab")
    assert CLOSE in _allowed(m)
    m.accept(b"c")
    assert _allowed(m) == [CLOSE]  # the budget is spent
    m.accept([CLOSE])
    assert _allowed(m) == sorted([ord("{"), *b" \t\r\n"])
    m.accept(b"\n\n")
    m.accept(b'{"name":"Al","age":4,"tags":[]}')
    assert m.finished
    answering = grammars.matcher(json_grammar(PERSON), Reasoning(OPEN, CLOSE))
    answering.accept(b'{"name":"Al"')  # no block: the grammar holds the reply from its start
    with pytest.raises(GrammarError):
        answering.accept([CLOSE])
    opened = grammars.matcher(json_grammar(PERSON), Reasoning(OPEN, CLOSE, opened=True))
    assert OPEN not in _allowed(opened) and CLOSE in _allowed(opened) and ord("x") in _allowed(opened)
    opened.accept([*b"x" * 40, CLOSE, ord("{")])  # no budget: as long as it takes
    assert _allowed(opened) == [ord('"')]
    with pytest.raises(GrammarError, match="reasoning"):
        reasoning_grammar(
            '{"grammars": [{"name": "reasoning", "lark_grammar": "start: \\"a\\""}]}', Reasoning(OPEN, CLOSE)
        )


def test_a_budget_alone_is_kept_without_a_grammar_and_the_host_chooses_only_the_forced_close():
    """With no grammar, a budget is counted as the reply goes (`ThinkBudget`): the host chooses only the
    token a spent budget forces (every other token stays the device's), and only ``</think>`` may be it; a
    reply that does not open the block with its first token, or closes it, is free."""
    from strata_runtime.engine.sampling import Sampler, ThinkBudget

    answering = ThinkBudget(Reasoning(OPEN, CLOSE, budget=2))
    assert answering.hold_at == 3
    answering.record(b"Hi")
    assert answering.hold_at is None and not answering.forcing
    closing = ThinkBudget(Reasoning(OPEN, CLOSE, budget=5))
    closing.record([OPEN, ord("a"), CLOSE, ord("b")])
    assert closing.hold_at is None and not closing.forcing
    reasoning = Reasoning(OPEN, CLOSE, opened=True, budget=2)
    sampler = Sampler(SamplingParams(reasoning=reasoning), 0)
    assert sampler.hold_at == 2 and not sampler.host_only and not sampler.needs_logits
    sampler.record(b"ab")
    assert sampler.host_only and sampler.needs_logits  # the budget is spent: the host forces the close
    logits = np.random.default_rng(7).standard_normal((1, 300)) + 1.0
    masked = sampler.adjusted(logits)
    assert np.isfinite(masked[0]).sum() == 1 and masked[0, CLOSE] == logits[0, CLOSE]
    with pytest.raises(GrammarError, match="budget of 2"):
        Sampler(SamplingParams(reasoning=reasoning), 0).record(b"abc")
    sampler.record([CLOSE, ord("x")])
    assert sampler.hold_at is None and not sampler.host_only
    held = Sampler(
        SamplingParams(reasoning=reasoning),
        0,
        Grammars(ThinkingTokens(300), 300).matcher(json_grammar(PERSON), reasoning),
    )
    assert held.think is None  # a grammar holds the budget itself


def test_a_checkpoints_think_tags_are_never_text_to_a_grammar(tmp_path):
    """Qwen3's think tags are added tokens that are not special. A grammar's text never holds them (a JSON
    string cannot hold a think tag), and after the block's closing tag only what follows the block is
    allowed."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from strata_runtime.weights.tokenizer import HFTokenizer

    raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(initial_alphabet=alphabet, special_tokens=["<|im_end|>"])
    raw.train_from_iterator(["let me think {} about it"] * 20, trainer)
    raw.add_tokens(["<think>", "</think>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path, {"eos_token": "<|im_end|>"})
    (open_id,), (close_id,) = tok.encode("<think>"), tok.encode("</think>")
    assert open_id not in tok.special_ids
    grammars = Grammars(tok, raw.get_vocab_size())
    text = grammars.matcher(lark_grammar("start: /(?s:.*)/")).allowed()
    assert text[tok.encode("let")[0]] and not text[open_id] and not text[close_id]
    m = grammars.matcher(json_grammar(), Reasoning(open_id, close_id, opened=True))
    m.accept(tok.encode("let me think"))
    m.accept([close_id])
    after = {tok.decode([int(i)]) for i in np.flatnonzero(m.allowed())}
    assert "{" in after and all(t.lstrip(" \t\r\n").startswith("{") or not t.strip() for t in after)


@pytest.mark.parametrize(
    ("grammar", "reasoning"),
    [
        (json_grammar(PERSON), Reasoning(OPEN, CLOSE, budget=4)),
        (json_grammar(PERSON), Reasoning(OPEN, CLOSE, opened=True)),
        (json_grammar(PERSON), Reasoning(OPEN, CLOSE, opened=True, budget=2)),
    ],
)
def test_the_allowed_tokens_after_proposals_through_a_think_block_are_a_moved_matchers(grammar, reasoning):
    """Seeded random proposals, each allowed where it is drafted (into the block, through its close and on
    into the JSON, or answering at once): `Matcher.allowed_after` is, after each prefix, what a
    matcher that accepted that prefix allows, and the reply's own place does not move."""
    tok = ThinkingTokens(300)
    grammars = Grammars(tok, 300)
    rng = np.random.default_rng(53)
    json_text = list(b'{"name":"Al","age":4,"tags":["a"]}')
    through = 0
    for _ in range(12):
        m, drafted = grammars.matcher(grammar, reasoning), []
        probe = grammars.matcher(grammar, reasoning)
        while len(drafted) < 12:
            allowed = np.flatnonzero(probe.allowed())
            if probe.finished or len(allowed) == 0:
                break
            nxt = json_text[len(drafted) - drafted.index(CLOSE) - 1] if CLOSE in drafted else None
            if nxt is None or nxt not in allowed:
                tags = [t for t in (OPEN, CLOSE) if t in allowed]
                text = [t for t in TEXT if t in allowed] or [int(t) for t in allowed]
                nxt = int(rng.choice(tags if tags and rng.random() < 0.3 else text))
            drafted.append(int(nxt))
            probe.accept([nxt])
        masks = m.allowed_after(drafted)
        assert m.allowed_after([])[0].tolist() == masks[0].tolist()
        for k in range(len(drafted) + 1):
            moved = grammars.matcher(grammar, reasoning)
            moved.accept(drafted[:k])
            assert (masks[k] == moved.allowed()).all(), (drafted, k)
        through += CLOSE in drafted[:-1]
    assert through >= 3  # proposals went through the block's close and on


# ---- the engine -----------------------------------------------------------------------------------------


def _prompts(seed: int, n: int) -> list[tuple[int, ...]]:
    """``n`` prompts of 4 to 30 printable bytes, seeded."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(33, 126) for _ in range(rng.randint(4, 30))) for _ in range(n)]


@functools.cache
def _engine(mode: str) -> Engine:
    preset = "small" if MODES[mode].get("draft_tokens") or mode == "pipelined-mtp" else "tiny"
    return Engine(mode_plan(mode, 2, preset=preset, context=192, prefill_chunk=16))


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_replies_with_a_schema_are_json_that_follows_it_and_leave_the_others_alone(mode):
    """Greedy and sampled requests with a JSON schema beside requests without one, arriving together: each
    reply with the schema is complete JSON that follows it and ends by ``stop`` (the grammar allowed
    nothing more), never by length; the (greedy) requests without a schema get the tokens they get alone."""
    eng = _engine(mode)
    grammar = json_grammar(PERSON)
    prompts = _prompts(31, 5)
    free = [
        (0, Request(prompts[0], 12)),
        (1, Request(prompts[1], 9)),
    ]
    shaped = [
        (0, Request(prompts[2], 80, SamplingParams(grammar=grammar))),
        (0, Request(prompts[3], 80, SamplingParams(temperature=1.0, seed=7, grammar=grammar))),
        (2, Request(prompts[4], 80, SamplingParams(temperature=0.7, top_k=20, seed=9, grammar=grammar))),
    ]
    got = collect(eng, [*free, *shaped])
    alone = [collect(eng, [(0, req)])[0] for _, req in free]
    assert got[:2] == alone
    for tokens in got[2:]:
        _follows_person(bytes(tokens))
        assert len(tokens) < 80


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_what_a_grammar_forces_is_read_as_proposals_and_changes_no_text(mode):
    """Where a schema leaves one way on (its keys, the punctuation between them), the tokens are read as
    proposals, several in one window, and verified as a drafter's. Greedy and sampled replies, each alone
    and two together: greedy text is the text with forcing off (one token a window), and so is seeded
    sampled text where the mode does not draft (each forced proposal takes the uniform its draw would
    have), where fewer windows run with forcing than without. (A drafter under a grammar proposes forced
    tokens too, its choices being over the allowed tokens: there forcing saves the drafting, and how many
    windows run follows the depth that measured times choose.) Where the requests share windows, their
    spare rows (or a batch-MTP window's proposal rows) carry forced tokens."""
    eng = _engine(mode)
    grammar = json_grammar(PERSON)
    prompts = _prompts(43, 3)
    reqs = [
        (0, Request(prompts[0], 80, SamplingParams(grammar=grammar))),
        (0, Request(prompts[1], 80, SamplingParams(temperature=0.9, seed=3, grammar=grammar))),
        (0, Request(prompts[2], 80, SamplingParams(grammar=grammar), ignore_eos=True)),
    ]
    runs = {}
    for forcing in (True, False):
        eng.forcing = forcing
        try:
            before = dict(eng.totals)
            alone = [collect(eng, [req])[0] for req in reqs[:2]]
            together = collect(eng, [reqs[1], (2, reqs[2][1])])
            shared = [w for w in list(eng.windows)[-40:] if w.kind != "solo" and w.forced]
            after = eng.totals
            runs[forcing] = (
                alone,
                together,
                after["windows"] - before["windows"],
                after["forced"] - before["forced"],
                after["proposals"] + after["accepted"] - before["proposals"] - before["accepted"],
                shared,
            )
        finally:
            eng.forcing = True
    alone, together, windows, forced, drafted, shared = runs[True]
    plain_alone, plain_together, plain_windows, none, _, _ = runs[False]
    if mode != "solo":  # windows of both requests, in rows they had to spare (or a batch-MTP proposal)
        assert shared
    assert none == 0 and forced >= 2 * len(b'{"name":"')  # each reply's opening, at least
    total = eng.totals["forced"]
    assert f"{total} tokens a grammar forced" in eng.summary()
    assert f"strata_forced_tokens_total {total}" in "\n".join(engine_lines(eng.stats()))
    assert alone[0] == plain_alone[0] and together[1] == plain_together[1]  # greedy
    if not MODES[mode].get("draft_tokens"):  # (drafting, the depth follows measured times)
        assert windows < plain_windows and drafted == 0  # forced proposals are not counted as drafts
        assert alone[1] == plain_alone[1] and together[0] == plain_together[0]  # seeded sampled
    for tokens in (*alone, *together):
        _follows_person(bytes(tokens))


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_a_grammars_rows_masked_and_chosen_on_the_device_keep_the_hosts_text(mode):
    """A grammar's rows are masked to its allowed tokens and chosen where the logits are (`Entry.masked`),
    and the host reads only the tokens: greedy and seeded sampled replies under a schema, alone and beside
    a free request, and a greedy one with a logit bias and penalties (adjusted on the device too), are the
    replies the host gives choosing from the logits it reads (with masks on the device off); the windows
    whose rows are all chosen on the device read no logits back. In serial windows and pipelined groups the
    replies run ahead of the host: a window's masks follow from the tokens the window before it chose,
    read once its own layers are queued."""
    eng = _engine(mode)
    eng.forget_prefixes()  # (a shared engine: where requests land must not follow earlier tests)
    grammar = json_grammar(PERSON)
    prompts = _prompts(47, 4)
    adjusted = SamplingParams(
        grammar=grammar, presence_penalty=0.5, frequency_penalty=1.0, logit_bias=((ord("x"), 8.0),)
    )
    reqs = [
        (0, Request(prompts[0], 80, SamplingParams(grammar=grammar))),
        (0, Request(prompts[1], 80, SamplingParams(temperature=0.9, top_k=40, seed=3, grammar=grammar))),
        (1, Request(prompts[2], 20)),
        (0, Request(prompts[3], 80, adjusted)),
    ]
    seen = launches(eng)
    try:
        runs = {}
        for on_device in (True, False):
            eng.masks_on_device = on_device
            alone = [collect(eng, [req])[0] for req in (reqs[0], reqs[1], reqs[3])]
            runs[on_device] = alone[:2] + collect(eng, reqs[:3]) + alone[2:]
    finally:
        eng.masks_on_device = True
        del eng.executor.launch
    device, host = runs[True], runs[False]
    # Windows whose rows are all chosen on the device, and whether the host read their logits back.
    read = [
        (f.sampled, j.kind)
        for j, _, f in seen
        if f.masks is not None and all(e.masked or e.on_device for e in j.entries)
    ]
    chained = chained_grammar_windows(seen)
    assert device[0] == host[0] and device[2] == host[2] and device[4] == host[4]  # greedy
    assert device[5] == host[5] and any(f.masks is not None and f.adjusts is not None for _, _, f in seen)
    assert bytes(device[5]).startswith(b'{"name":"xx')  # the bias shows, and the penalties end its run
    if not MODES[mode].get("draft_tokens"):  # drafted and sampled, the host verifies as before
        assert device[1] == host[1] and device[3] == host[3]
    assert read and not any(r for r, _ in read) and "prefill" in {k for _, k in read}  # a first token too
    if mode == "serial":  # a schema's reply runs ahead, alone and beside the free request
        assert 1 in chained and any(n >= 2 for n in chained)
    if mode == "pipelined":  # in each group's windows
        assert 1 in chained
    for tokens in (*device[:4], device[5]):
        _follows_person(bytes(tokens))


def test_a_grammar_reply_chains_a_window_only_behind_a_token_it_was_free_to_choose():
    """In serial windows a reply under a schema runs ahead (a window queued behind the one choosing its
    input) only where that input was a free choice: behind a token the grammar forced, the next window reads
    the forced tokens as proposals instead. Which windows chain follows the tokens alone, so it is the same
    on every run (the host's place in the grammar decides it, not a stage's thread), and with or without
    a free request beside it."""
    eng = Engine(make_plan(stages=1, preset="tiny", slots=2, groups=1, context=192, prefill_chunk=16))
    grammar = json_grammar(PERSON)
    prompts = _prompts(59, 2)
    grammars = Grammars(eng.tokenizer, eng.model.args.vocab_size)
    runs = []
    for reqs in (
        [(0, Request(prompts[0], 80, SamplingParams(grammar=grammar)))],
        [(0, Request(prompts[0], 80, SamplingParams(grammar=grammar))), (1, Request(prompts[1], 24))],
    ):
        for _ in range(2):
            eng.forget_prefixes()
            seen = launches(eng)
            reply = collect(eng, reqs)[0]
            del eng.executor.launch
            forced, m = [], grammars.matcher(grammar)
            for t in reply:  # whether the grammar forced each of the reply's tokens
                forced.append(bool(m.forced(1)))
                m.accept([t])
            chained_at = [
                e.pos - len(prompts[0])  # the reply's token this window reads, chosen by the one before
                for job, after, _ in seen
                if after is not None
                for e in job.entries
                if e.masked
            ]
            runs.append(chained_at)
            assert len(chained_at) >= 5 and not any(forced[i] for i in chained_at), (chained_at, forced)
            assert sum(forced) >= 10  # the keys' text: the rule was met often
    assert runs[0] == runs[1] and runs[2] == runs[3]


def test_replies_under_a_grammar_running_ahead_stop_and_end_where_the_hosts_windows_do():
    """Replies under a schema in serial windows running three deep, on a split of two stages: cut by
    ``max_tokens``, by a stop string inside the JSON, by the grammar's end, and one beside a free request.
    Each ends with the tokens the host's own choice gives (masks on the device off, no window running
    ahead), and the KV stays consistent after every step."""
    plan = make_plan(stages=2, preset="tiny", slots=2, groups=1, context=192, prefill_chunk=16, run_ahead=3)
    eng = Engine(plan)
    grammar = json_grammar(PERSON)
    prompts = _prompts(53, 4)
    reqs = [
        (0, Request(prompts[0], 9, SamplingParams(grammar=grammar))),
        (0, Request(prompts[1], 80, SamplingParams(grammar=grammar, temperature=0.8, seed=2))),
        (2, Request(prompts[2], 80, SamplingParams(grammar=grammar), stop_strings=('"age"',))),
        (3, Request(prompts[3], 16)),
    ]
    seen = launches(eng)
    runs = {}
    for on_device in (True, False):
        eng.masks_on_device = on_device
        runs[on_device] = collect(eng, reqs), len(chained_grammar_windows(seen))
    eng.masks_on_device = True
    (device, ran_ahead), (host, after_host) = runs[True], runs[False]
    assert device == host
    assert ran_ahead > 0 and after_host == ran_ahead  # only masked rows chain under a grammar
    assert len(device[0]) == 9 and bytes(device[0]).startswith(b'{"name":"')
    assert bytes(device[2]).startswith(b'{"name":"') and b'"age"' in bytes(device[2])[-8:]  # cut there
    _follows_person(bytes(device[1]))


@functools.cache
def _thinking_engine(mode: str) -> Engine:
    """`_engine`'s model with a tokenizer that has think tags."""
    preset = "small" if MODES[mode].get("draft_tokens") or mode == "pipelined-mtp" else "tiny"
    eng = Engine(mode_plan(mode, 2, preset=preset, context=192, prefill_chunk=16))
    eng.tokenizer = ThinkingTokens(eng.model.args.vocab_size)
    return eng


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_replies_reason_within_their_budget_then_follow_their_schema_or_go_free(mode):
    """Greedy and sampled replies biased to open a think block, with a budget and a JSON schema: each opens
    the block, holds it to the budget, closes it and writes JSON that follows the schema, ending by ``stop``.
    A greedy reply whose prompt opened the block, with a budget and no grammar, closes it within the budget
    and then goes on free: what follows the block is what a free reply of the prompt and the block gives."""
    eng = _thinking_engine(mode)
    grammar, opens = json_grammar(PERSON), ((OPEN, 100.0),)
    prompts = _prompts(37, 3)
    held = Reasoning(OPEN, CLOSE, budget=6)
    reqs = [
        (0, Request(prompts[0], 80, SamplingParams(logit_bias=opens, grammar=grammar, reasoning=held))),
        (
            0,
            Request(
                prompts[1], 80, SamplingParams(1.0, seed=5, logit_bias=opens, grammar=grammar, reasoning=held)
            ),
        ),
        (1, Request(prompts[2], 30, SamplingParams(reasoning=Reasoning(OPEN, CLOSE, opened=True, budget=5)))),
    ]
    got = collect(eng, reqs)
    for tokens in got[:2]:
        close = tokens.index(CLOSE)
        assert tokens[0] == OPEN and 1 < close <= 7 and OPEN not in tokens[1:]
        _follows_person(bytes(tokens[close + 1 :]).lstrip(b" \t\r\n"))
        assert len(tokens) < 80
    tokens = got[2]
    close = tokens.index(CLOSE)
    assert 0 < close <= 5 and len(tokens) == 30
    block = tuple(tokens[: close + 1])
    assert collect(eng, [(0, Request(prompts[2] + block, 30 - len(block)))])[0] == tokens[close + 1 :]


@functools.cache
def _undrafted_small() -> Engine:
    """The drafting modes' model (the ``small`` preset) in serial windows, which do not draft."""
    return Engine(mode_plan("serial", 2, preset="small", context=192, prefill_chunk=16))


@pytest.mark.parametrize("mode", ["solo", "batch-mtp", "pipelined-mtp"])
def test_drafted_replies_with_a_schema_are_the_greedy_replies_without_drafting(mode):
    """Requests with a schema draft like any other (their proposals drawn and verified over the tokens the
    grammar allows after the proposals before them), and greedy, what they keep is what a model that does not
    draft decodes: the drafting changes the speed, never the text. (Every drafting window drafts its full
    depth here, so that whether proposals are made does not depend on measured window times.)

    Where their drafter proposes (the grammar forces nothing), their windows are decided on the device with
    their rows masked there, and windows run ahead of the host: a chained window's masks follow the
    proposals the device kept, the token after them and the proposals it drafted next."""
    eng = Engine(mode_plan(mode, 2, preset="small", context=192, prefill_chunk=16, adaptive_depth=False))
    plain = _undrafted_small()
    grammar = json_grammar(PERSON)
    prompts = _prompts(41, 3)
    reqs = [(i, Request(p, 80, SamplingParams(grammar=grammar))) for i, p in enumerate(prompts)]
    before = eng.totals["accepted"]
    got, seen = collect_launched(eng, reqs)
    assert got == [collect(plain, [(0, r)])[0] for _, r in reqs]
    for tokens in got:
        _follows_person(bytes(tokens))
    assert eng.totals["accepted"] > before  # proposals were drafted and held
    decided = [after is not None for job, after, _ in seen if job.spec_on_device and job.entries[0].masked]
    assert decided.count(False) >= 1 and decided.count(True) >= 1, decided  # launched, then chained
    eng.grammar_drafts_on_device = False  # the host verifies each drafted window: the same text
    again, seen = collect_launched(eng, reqs)
    assert again == got
    assert not any(job.spec_on_device and job.entries[0].masked for job, _, _ in seen)


@pytest.mark.parametrize("mode", ["solo", "batch-mtp"])
def test_drafted_penalised_replies_with_a_schema_are_decided_on_the_device_as_without_drafting(mode):
    """Replies under a schema with a logit bias and presence, frequency and repetition penalties, drafting:
    their windows are masked, adjusted (each row counting the proposals before it) and decided on the
    device, which counts what they keep once; greedy, what they keep is what the model decodes without
    drafting, and what the host's verification of each window gives."""
    eng = Engine(mode_plan(mode, 2, preset="small", context=192, prefill_chunk=16, adaptive_depth=False))
    grammar = json_grammar(PERSON)
    sampling = SamplingParams(
        grammar=grammar,
        presence_penalty=0.6,
        frequency_penalty=0.8,
        repetition_penalty=1.2,
        logit_bias=((ord("e"), 2.0),),
    )
    reqs = [(i, Request(p, 80, sampling)) for i, p in enumerate(_prompts(43, 2))]
    got, seen = collect_launched(eng, reqs)
    assert got == [collect(_undrafted_small(), [(0, r)])[0] for _, r in reqs]
    decided = [f for job, _, f in seen if job.spec_on_device and job.entries[0].masked]
    assert decided and all(f.adjusts is not None for f in decided)
    assert any(f.after is not None for f in decided)  # and windows ran ahead of the host
    eng.grammar_drafts_on_device = False
    assert collect(eng, reqs) == got
    for tokens in got:
        _follows_person(bytes(tokens))


@functools.cache
def _alone(preset: str) -> Engine:
    """One slot, one stage, no drafting: a request alone."""
    return Engine(make_plan(stages=1, preset=preset, context=192, prefill_chunk=16))


@pytest.mark.parametrize("mode", list(MODES))
def test_in_every_mode_seeded_schedules_of_replies_with_and_without_schemas_keep_their_text(mode):
    """Seeded random schedules (arrival steps, prompts that share beginnings, so prefixes are reused and
    copied, lengths that cut some replies short, sampled and greedy): every greedy reply is the one it gets
    alone in an engine that does not draft, with or without a schema; every sampled reply under a schema
    is valid JSON once it ends by ``stop`` and the start of a JSON object when cut by length; the KV stays
    consistent after every step and no request ends in an error (`collect`)."""
    eng = _engine(mode)
    preset = "small" if MODES[mode].get("draft_tokens") or mode == "pipelined-mtp" else "tiny"
    grammar = json_grammar(PERSON)
    for seed in range(3):
        eng.forget_prefixes()
        rng = random.Random(seed)
        stems = [tuple(rng.randrange(33, 126) for _ in range(rng.randint(3, 20))) for _ in range(2)]
        reqs = []
        for i in range(6):
            prompt = rng.choice(stems) + tuple(rng.randrange(33, 126) for _ in range(rng.randint(1, 8)))
            shaped, sampled = rng.random() < 0.6, rng.random() < 0.4
            params = SamplingParams(
                temperature=0.9 if sampled else 0.0, seed=seed * 10 + i, grammar=grammar if shaped else None
            )
            reqs.append((rng.randrange(0, 4), Request(prompt, rng.choice([6, 20, 70]), params)))
        got = collect(eng, reqs)
        for (_, req), tokens in zip(reqs, got, strict=True):
            if req.sampling.temperature == 0:
                assert tokens == collect(_alone(preset), [(0, req)])[0]
            if req.sampling.grammar is None:
                continue
            text = bytes(tokens)
            assert text.startswith(b"{")
            if len(tokens) < req.max_tokens:  # ended by the grammar: complete
                _follows_person(text)


def test_windows_with_a_grammar_are_timed_apart_from_the_others():
    """A grammar's windows are decided on the host, so their times would mislead the depth chosen for
    other requests: they are measured under kinds of their own (``greedy, grammar``), solo and batch."""
    solo = Engine(mode_plan("solo", 2, preset="small", context=192, prefill_chunk=16))
    shaped = SamplingParams(grammar=json_grammar(PERSON))
    collect(solo, [(0, Request(tuple(b"Who? "), 40, shaped))])
    assert set(solo.choice.solo) == {"greedy, grammar"}
    assert sum(solo.choice.solo["greedy, grammar"][0].seen.values()) > 0  # its windows were measured there
    collect(solo, [(0, Request(tuple(b"Who? "), 8))])
    assert set(solo.choice.solo) == {"greedy, grammar", "greedy"}
    batch = Engine(mode_plan("batch-mtp", 2, preset="small", context=192, prefill_chunk=16))
    collect(batch, [(0, Request(tuple(b"Who? "), 40, shaped)), (0, Request(tuple(b"What? "), 40))])
    assert any(kind.endswith(", grammar") for kind in batch.choice.batch)


def test_a_greedy_reply_with_a_grammar_takes_the_most_likely_allowed_token_each_time():
    """The engine's greedy reply under a grammar, against the model's own logits: at each step the token is
    the argmax of the logits over the tokens the grammar allows after the reply so far."""
    plan = make_plan(stages=1, preset="tiny", context=192, prefill_chunk=16)
    eng, model = Engine(plan), Model.from_plan(plan)
    number = {"type": "integer", "minimum": 0, "maximum": 999}
    schema = {"type": "object", "properties": {"k": number}, "required": ["k"], "additionalProperties": False}
    grammar = json_grammar(schema)
    prompt = tuple(b"Tell me a number: ")
    (reply,) = collect(eng, [(0, Request(prompt, 40, SamplingParams(grammar=grammar)))])
    matcher = eng.grammars.matcher(grammar)
    seen = list(prompt)
    for token in reply:
        logits = np.asarray(model.logits(model.forward(np.array(seen), Layout.of([(0, len(seen), 0)]))))[-1]
        allowed = matcher.allowed()
        assert token == int(np.argmax(np.where(allowed, logits, -np.inf)))
        assert not allowed[int(np.argmax(logits))] or token == int(np.argmax(logits))
        matcher.accept([token])
        model.rewind(0, 0)
        seen.append(token)
    assert matcher.finished and 0 <= json.loads(bytes(reply))["k"] <= 999
    # Complete, it ends there with `stop`, even where the end-of-text tokens would be generated as tokens.
    for ignore_eos in (False, True):
        handle = eng.submit(Request(prompt, 40, SamplingParams(grammar=grammar), ignore_eos=ignore_eos))
        assert run_checking_kv(eng, handle) == (reply, "stop")


def test_a_sampled_first_token_under_a_grammar_follows_the_model_renormalised_over_the_allowed_tokens():
    """The first token of a sampled reply whose grammar is one of three digits: over 600 seeds its
    frequencies match the model's softmax at the request's temperature over those three tokens alone
    (Pearson's chi-square, 2 degrees of freedom, under 13.8: p > 0.001)."""
    plan = make_plan(stages=1, preset="tiny", context=64, prefill_chunk=16)
    eng, model = Engine(plan), Model.from_plan(plan)
    grammar = json_grammar({"enum": [1, 2, 3]})
    prompt = tuple(b"Pick: ")
    logits = np.asarray(model.logits(model.forward(np.array(prompt), Layout.of([(0, len(prompt), 0)]))))[-1]
    digits = [ord("1"), ord("2"), ord("3")]
    scaled = logits[digits].astype(np.float64) / 0.9
    want = np.exp(scaled - scaled.max())
    want /= want.sum()
    n = 600
    reqs = [
        (0, Request(prompt, 3, SamplingParams(temperature=0.9, seed=s, grammar=grammar))) for s in range(n)
    ]
    got = collect(eng, reqs, check_kv=False)
    assert all(len(r) == 1 for r in got)  # one digit, and the grammar is complete
    counts = np.array([sum(r[0] == d for r in got) for d in digits])
    expected = want * n
    assert (expected >= 20).all()  # enough of each for the chi-square to mean something
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, (counts, expected)


def test_sampled_drafted_replies_under_a_grammar_keep_the_models_distribution_over_the_allowed_tokens():
    """Two digits under a grammar (11, 12, 21 or 22), sampled with drafting: the second digit is a proposal
    drawn from the drafting head over the allowed tokens and verified against the target's distribution
    over them. Over 800 seeds the pairs' frequencies match the model's own: the first digit's softmax over
    "1" and "2" times the second's after it (Pearson's chi-square, 3 degrees of freedom, under 16.3: p >
    0.001)."""
    eng = _engine("solo")
    model = Model.from_plan(mode_plan("solo", 1, preset="small", context=192, prefill_chunk=16))
    grammar = json_grammar({"enum": [11, 12, 21, 22]})
    prompt = tuple(b"Two digits: ")
    one, two, t = ord("1"), ord("2"), 1.3

    def after(seen: tuple[int, ...]) -> np.ndarray:
        rows = model.logits(model.forward(np.array(seen), Layout.of([(0, len(seen), 0)])))
        model.rewind(0, 0)
        scaled = np.asarray(rows)[-1, [one, two]].astype(np.float64) / t
        p = np.exp(scaled - scaled.max())
        return p / p.sum()

    first = after(prompt)
    want = {
        (a, b): first[i] * after((*prompt, a))[j]
        for i, a in enumerate((one, two))
        for j, b in enumerate((one, two))
    }
    n = 800
    before = eng.totals["proposals"]
    reqs = [(0, Request(prompt, 4, SamplingParams(temperature=t, seed=s, grammar=grammar))) for s in range(n)]
    got = collect(eng, reqs, check_kv=False)
    assert eng.totals["proposals"] - before >= n // 2  # most second digits were proposals
    counts = {pair: sum(tuple(r) == pair for r in got) for pair in want}
    assert sum(counts.values()) == n  # every reply is two digits, complete
    expected = {pair: p * n for pair, p in want.items()}
    assert min(expected.values()) >= 20, expected
    chi2 = sum((counts[k] - expected[k]) ** 2 / expected[k] for k in want)
    assert chi2 < 16.3, (counts, expected)


def test_a_token_outside_the_grammar_ends_the_request_with_an_error_not_the_engine():
    """`Slot.emit` with a token the grammar does not allow (a grammar with no way on): the request ends with
    an error saying so, and the caller's float64 logits are never masked in place."""
    from strata_runtime.api import RequestHandle
    from strata_runtime.engine.sampling import Sampler
    from strata_runtime.engine.slot import Slot

    tok = ByteTokenizer(300)
    grammar = json_grammar(PERSON)
    req = Request(tuple(b"x"), 10, SamplingParams(grammar=grammar))
    sampler = Sampler(req.sampling, 0, Grammars(tok, 300).matcher(grammar))
    logits = np.random.default_rng(3).standard_normal((1, 300)) + 1.0  # float64, the caller's
    before = logits.copy()
    masked = sampler.adjusted(logits)
    assert np.isinf(masked).sum() == 299 and (logits == before).all()
    slot = Slot(0, RequestHandle(req), sampler, frozenset(), tok, admitted_at=0)
    event = slot.emit([ord("x")], 0)
    assert event.finished == "error" and event.error is not None
    assert event.error.startswith("the reply left its grammar: token 120 does not follow the grammar")


def test_a_request_whose_grammar_does_not_compile_ends_at_once_with_the_reason():
    eng = _engine("serial")
    handle = eng.submit(Request(tuple(b"x"), 4, SamplingParams(grammar=json_grammar({"type": "nonsense"}))))
    event = handle.events.get_nowait()
    assert event.finished == "error" and event.error is not None
    assert event.error.startswith("grammar: ") and "nonsense" in event.error


def test_a_grammar_that_compiled_is_not_checked_again_and_one_that_did_not_always_is(monkeypatch):
    import llguidance

    from strata_runtime.structured import GrammarError, Grammars, json_grammar, regex_grammar
    from strata_runtime.weights.tokenizer import ByteTokenizer

    checked = []
    real = llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(
        llguidance.LLMatcher, "validate_grammar", lambda g, t: checked.append(g) or real(g, t)
    )
    grammars = Grammars(ByteTokenizer(300), 300)
    good, bad = regex_grammar("[a-c]{2}"), json_grammar({"type": "strnig"})
    for _ in range(3):
        grammars.check(good)
    assert checked == [good]
    for _ in range(2):
        with pytest.raises(GrammarError):
            grammars.check(bad)
    assert checked == [good, bad, bad]


def test_a_grammar_that_names_a_part_as_its_wrapper_does_is_refused_by_name():
    """A think block's wrapper, and a format beside strict calls, name their own part; a grammar that
    already names one of its parts so is a `GrammarError` that says which name."""
    from strata_runtime.server.tools import ToolUse

    taken = json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": 'start: "x"'}]})
    with pytest.raises(GrammarError, match="may not name one of its parts `reasoning`"):
        reasoning_grammar(taken, Reasoning(259, 260, opened=False))
    calls = json.dumps({"grammars": [{"name": "calls", "lark_grammar": 'start: "x"'}]})
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    with pytest.raises(GrammarError, match="may not name one of its parts `calls`"):
        _ = ToolUse((strict,), "auto", call_tokens=(261, 262), reply_format=calls).grammar


@pytest.mark.parametrize("schema", [False, True])
def test_the_grammar_cost_bench_runs_every_arm_to_the_same_text_on_the_demo_profile(schema, tmp_path) -> None:
    """`scripts/bench_grammar_cost.py`: the free reply, the reply under a grammar that allows any text, the
    same with its drafted windows verified by the host and with the host choosing from the logits; the last
    two must give the grammar arm's text (the script exits non-zero otherwise); with ``--schema``, under a
    JSON schema, each arm's windows and proposals held counted."""
    argv = ["--tokens", "30", "--repeats", "1"]
    if schema:
        (tmp_path / "person.json").write_text(json.dumps(PERSON))
        argv += ["--schema", str(tmp_path / "person.json")]
    lines = run_script("bench_grammar_cost.py", *argv).splitlines()
    for arm in ("free", "under a grammar", "drafts verified by the host", "masks on the host"):
        assert any(line.startswith(f"{arm}: ") and "tok/s" in line for line in lines), (arm, lines)
    assert sum("(the same text)" in line for line in lines) == 2
    assert sum(" windows, " in line and " proposals held " in line for line in lines) == 4
