"""``bad_words`` (vLLM's): each word's tokens never come in a row in the reply. A one-token word is banned in
the request's bias; a longer word's last token is banned where the reply's last tokens are the rest of it,
by a mask computed from where the reply stands, as a grammar's is. The text is the same in every window
mode, and the reply is the free reply's up to where that would have completed a word."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from rt_engine_helpers import MODES, collect, launches, mode_plan, run_script
from rt_plans import make_plan

from strata_runtime.api import Request, SamplingParams, request_problem
from strata_runtime.bad_words import BadWords, WithGrammar, mask_width, word_ids
from strata_runtime.engine import Engine
from strata_runtime.engine.sampling import Sampler
from strata_runtime.masks import Place

PROMPT = tuple(b"Once upon a time there was")


def allowed(bits: np.ndarray, vocab: int) -> set[int]:
    """The tokens a packed mask [W] allows."""
    unpacked = np.unpackbits(np.asarray(bits, "<u4").view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(unpacked).tolist())


def printable(tokens: list[int], n: int, after: int = 0) -> tuple[int, ...]:
    """The first ``n`` tokens in a row at or after ``after`` that are printable ASCII bytes other than a
    blank (a word the byte-level tokenizer spells with those very tokens)."""
    runs = range(after, len(tokens) - n + 1)
    start = next(i for i in runs if all(33 <= t <= 126 for t in tokens[i : i + n]))
    return tuple(tokens[start : start + n])


def contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    n = len(word)
    return any(tuple(tokens[i : i + n]) == word for i in range(len(tokens) - n + 1))


class Pieces:
    """A tokenizer of a few word pieces, for vLLM's tokenizing rule: a space before a word is a token of its
    own except before ``cat``, which has a spaced token."""

    ids = {"cat": 1, " cat": 2, "dog": 3, " ": 4, "s": 5, "hot": 6, " hot": 7}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        while text:
            piece = max((p for p in self.ids if text.startswith(p)), key=len)
            out.append(self.ids[piece])
            text = text[len(piece) :]
        return out


def test_words_are_tokenized_at_the_start_and_after_a_space_where_that_is_another_token() -> None:
    """vLLM's rule: the word without its leading blanks, and after a space where that starts with another
    token and has as many tokens."""
    got = word_ids(["cat", "  dog", "cats", "hot dog"], Pieces())  # type: ignore[arg-type]
    assert got == [(1,), (2,), (3,), (1, 5), (2, 5), (6, 4, 3), (7, 4, 3)]  # " dog" is two tokens: not banned


def test_the_mask_bans_single_tokens_always_and_a_words_last_token_after_the_rest_of_it() -> None:
    vocab = 70
    words = BadWords([(5,), (1, 2, 3), (2, 64), (9, 3)], vocab)
    assert words.width == mask_width(vocab) == 3
    everything = set(range(vocab))
    assert allowed(words.bitmasks_after([])[0], vocab) == everything - {5}
    rows = words.bitmasks_after([1, 2, 9])  # after nothing, 1, 1 2, and 1 2 9
    assert [everything - allowed(r, vocab) for r in rows] == [{5}, {5}, {5, 3, 64}, {5, 3}]
    assert words.recent == ()  # the reply's own place did not move
    words.accept([7, 1, 2])
    assert everything - allowed(words.bitmasks_after([])[0], vocab) == {5, 3, 64}
    ahead = words.copy()
    assert everything - allowed(ahead.bitmask_after(4), vocab) == {5}
    assert everything - allowed(words.bitmask_last([]), vocab) == {5, 3, 64}  # the copy moved alone
    fresh = BadWords([(1, 2, 3)], vocab)
    fresh.accept([2])  # the word's beginning must be generated: (1,) before it is not
    assert allowed(fresh.bitmasks_after([])[0], vocab) == everything
    assert fresh.forced(4) == [] and fresh.ends_within([1, 2, 3]) is None and not fresh.finished


class Forcing(Place):
    """A grammar that allows only ``allows`` and forces ``forces``."""

    holds_think = True
    finished = False

    def __init__(self, allows: set[int], forces: list[int], vocab: int) -> None:
        self.width = mask_width(vocab)
        self.bits = np.zeros(self.width, np.uint32)
        for t in allows:
            self.bits[t // 32] |= np.uint32(1 << (t % 32))
        self.forces = forces

    def _packed(self):
        return self.bits.copy()

    def _move(self, token):
        pass

    def copy(self):
        return self

    def forced(self, most):
        return self.forces[:most]

    def ends_within(self, tokens):
        return None

    def accept(self, tokens):
        pass


def test_with_a_grammar_a_token_comes_where_both_allow_it_and_the_grammar_wins_an_empty_row() -> None:
    vocab = 40
    both = WithGrammar(Forcing({1, 2, 3}, [1, 2, 3], vocab), BadWords([(3,), (1, 2)], vocab))
    assert both.holds_think
    assert allowed(both.bitmasks_after([])[0], vocab) == {1, 2}
    assert [allowed(r, vocab) for r in both.bitmasks_after([1])] == [{1, 2}, {1}]
    assert both.forced(3) == [1]  # 2 would complete a bad word after 1
    only = WithGrammar(Forcing({3}, [], vocab), BadWords([(3,)], vocab))
    assert allowed(only.bitmask_last([]), vocab) == {3}  # nothing else: the grammar's mask stands


def test_one_token_words_alone_go_into_the_bias_and_blank_words_are_refused() -> None:
    sampler = Sampler(SamplingParams(logit_bias=((7, 3.0), (9, 1.0))), seed=0, banned=[7, 8])
    assert sampler.adjusts and not sampler.host_only
    got = dict(zip(sampler.bias_ids.tolist(), sampler.bias.tolist(), strict=True))
    assert got == {9: 1.0, 7: -np.inf, 8: -np.inf}
    for bad in ((" ",), ("ok", ""), (7,)):
        problem = request_problem(Request((1, 2), 5, SamplingParams(bad_words=bad)))  # type: ignore[arg-type]
        assert problem is not None and problem.startswith("bad_words:"), (bad, problem)


@functools.cache
def engine(mode: str, stages: int) -> Engine:
    return Engine(mode_plan(mode, stages, context=160, prefill_chunk=16))


def reply(eng: Engine, sampling: SamplingParams, n: int = 40) -> list[int]:
    return collect(eng, [(0, Request(PROMPT, n, sampling, ignore_eos=True))])[0]


@functools.cache
def free_reply() -> tuple[int, ...]:
    return tuple(reply(engine("serial", 1), SamplingParams()))


@pytest.mark.parametrize(("mode", "stages"), [("solo", 1), ("serial", 2), ("batch-mtp", 1), ("pipelined", 2)])
def test_a_word_of_the_free_reply_never_comes_and_the_reply_is_the_same_until_it_would(mode, stages) -> None:
    """Greedy: the free reply up to where it would complete the word, then a token that does not; the word
    never comes. A word of several tokens and one of a single token, in each window mode, next to a plain
    request."""
    free = list(free_reply())
    word = printable(free, 3, 4)  # three bytes of the free reply
    first = next(i for i in range(len(free)) if tuple(free[i : i + 3]) == word)
    eng = engine(mode, stages)
    text = bytes(word).decode()
    got = reply(eng, SamplingParams(bad_words=(text,)))
    assert not contains(got, word) and len(got) == 40
    assert got[: first + 2] == free[: first + 2] and got[first + 2] != free[first + 2]
    (single,) = printable(free, 1, 2)
    at = free.index(single)
    alone = reply(eng, SamplingParams(bad_words=(chr(single),)))
    assert single not in alone and alone[:at] == free[:at]
    side = collect(
        eng,
        [
            (0, Request(PROMPT, 40, SamplingParams(bad_words=(text,)), ignore_eos=True)),
            (0, Request(tuple(b"Another"), 20, ignore_eos=True)),
        ],
    )
    beside = collect(engine("serial", 1), [(0, Request(tuple(b"Another"), 20, ignore_eos=True))])[0]
    assert side[0] == got and side[1] == beside


@pytest.mark.parametrize("mode", sorted(set(MODES) - {"pipelined-mtp"}))
def test_sampled_replies_never_hold_the_words_and_a_seed_gives_the_same_text(mode) -> None:
    """Seeded sampling at a high temperature, words of one and two tokens that the free sampled replies
    hold: neither comes in any reply, and a seed gives the same text again."""
    eng = engine(mode, 1)
    hot = SamplingParams(temperature=1.5, seed=3)
    free = reply(eng, hot, 60)
    pair = printable(free, 2)
    (single,) = printable(free, 1, free.index(pair[0]) + 2)
    words = (bytes(pair).decode(), chr(single))
    held = SamplingParams(temperature=1.5, seed=3, bad_words=words)
    got = reply(eng, held, 60)
    assert not contains(got, pair) and single not in got
    assert reply(eng, held, 60) == got


@pytest.mark.parametrize("ahead", [1, 3])
def test_a_word_of_several_tokens_is_held_as_a_grammar_while_windows_run_ahead(ahead) -> None:
    """Serial windows of two slots run ahead, the masks of a chained window computed from the token the
    window before chose; a one-token word alone runs ahead on the device's bias."""
    plan = make_plan(stages=1, slots=2, groups=1, context=160, prefill_chunk=16, run_ahead=ahead)
    free = list(free_reply())
    word = printable(free, 3, 4)
    (single,) = printable(free, 1, 2)
    eng = Engine(plan)
    seen = launches(eng)
    got = collect(
        eng,
        [
            (
                0,
                Request(
                    PROMPT, 40, SamplingParams(bad_words=(bytes(word).decode("latin-1"),)), ignore_eos=True
                ),
            ),
            (0, Request(tuple(b"Another"), 30, SamplingParams(bad_words=(chr(free[3]),)), ignore_eos=True)),
        ],
    )
    assert not contains(got[0], word) and single not in got[1]
    assert got[0] == reply(engine("serial", 1), SamplingParams(bad_words=(bytes(word).decode(),)))
    assert any(after is not None for _, after, _ in seen) == (ahead > 1)


def test_with_a_grammar_the_reply_follows_it_and_holds_no_bad_word() -> None:
    """A grammar of a's and b's and the bad word ``ab``: once an ``a`` comes, only ``a`` may follow."""
    eng = engine("serial", 1)
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar="start: /[ab]{12}/", bad_words=("ab",))
        got = bytes(reply(eng, sampling, 20)).decode()
        assert len(got) == 12 and set(got) <= {"a", "b"} and "ab" not in got
        assert got == "b" * got.count("b") + "a" * got.count("a")


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_a_think_budget_beside_bad_words_closes_the_block_where_it_runs_out(draft_tokens) -> None:
    """Bad words of several tokens are held as a grammar is, but the think budget stays the sampler's: the
    host forces the block's close where the budget runs out (that row is not masked on the device), with
    windows running ahead, and the text is the text of windows one at a time."""
    from test_rt_run_ahead import engine as ahead_engine

    from strata_runtime.api import Reasoning

    close, budget = 300, 6
    free = list(free_reply())
    word = bytes(printable(free, 3, 4)).decode()

    def requests() -> list[tuple[int, Request]]:
        thinking = Reasoning(299, close, True, budget)
        return [
            (0, Request(PROMPT, 24, SamplingParams(reasoning=thinking, bad_words=(word,)), ignore_eos=True))
        ]

    base = collect(ahead_engine(1, 1, 1, draft_tokens), requests())
    got = collect(ahead_engine(1, 1, 3, draft_tokens), requests())
    assert got == base
    assert got[0].index(close) == budget and not contains(got[0], tuple(word.encode()))


def test_the_held_bench_runs_every_arm_to_the_same_text_on_the_demo_profile() -> None:
    """`scripts/bench_held.py`: ``min_tokens`` over the whole reply and bad words the free reply lacks (of one
    token and of several) choose the free reply's tokens, each arm's rate beside the free one's."""
    lines = run_script("bench_held.py", "--tokens", "30", "--repeats", "1").splitlines()
    for arm in ("min_tokens", "bad word 'Zqxjv Wkpfq'", "(one token)"):
        assert any(arm in line and "/ free:" in line for line in lines), (arm, lines)
    assert lines[-1] == "the same text in every arm, 30 tokens"


def test_a_spent_think_budget_forces_the_close_even_where_a_ban_holds_it() -> None:
    """The budget's close is the engine's structure, not a choice: forced where ``allowed_token_ids`` (or a
    one-token bad word) bans it, so the row never has nothing to choose."""
    from strata_runtime.api import Reasoning

    for params in (
        SamplingParams(reasoning=Reasoning(5, 6, True, 1), allowed_token_ids=(1, 2)),
        SamplingParams(reasoning=Reasoning(5, 6, True, 1)),
    ):
        sampler = Sampler(params, seed=0, vocab=8, banned=[6] if params.allowed_token_ids is None else [])
        sampler.record([1])
        assert sampler.think is not None and sampler.think.forcing
        row = sampler.adjusted(np.arange(8, dtype=np.float32)[None, :])[0]
        assert np.isfinite(row[6]) and np.isneginf(np.delete(row, 6)).all()


@pytest.mark.parametrize(("mode", "stages"), [("serial", 1), ("solo", 1), ("batch-mtp", 1)])
def test_under_a_grammar_allowed_token_ids_are_masks_that_give_way_where_they_would_leave_nothing(
    mode, stages
):
    """``allowed_token_ids`` beside a grammar are held by the masks (not the bias): the reply keeps to them
    where the grammar allows them, and where it allows none of them the grammar's mask stands alone, so a
    row never has nothing to choose; greedy and sampled."""
    eng = engine(mode, stages)
    c = ord("c")
    for temperature in (0.0, 0.8):
        free = SamplingParams(
            temperature=temperature, seed=1, grammar="start: /[abc]+/", allowed_token_ids=(c,)
        )
        assert reply(eng, free, 10) == [c] * 10
        fixed = SamplingParams(temperature=temperature, seed=1, grammar="start: /ab/", allowed_token_ids=(c,))
        tokens = collect(eng, [(0, Request(tuple(b"Say ab:"), 10, fixed))])[0]
        assert bytes(tokens) == b"ab"


def test_bad_words_the_tokenizer_spells_outside_the_vocabulary_are_refused_by_name(monkeypatch) -> None:
    eng = engine("serial", 1)
    vocab = eng.model.args.vocab_size
    monkeypatch.setattr(eng.tokenizer, "encode", lambda text: [vocab + 3])
    ev = eng.submit(Request(tuple(b"x"), 8, SamplingParams(bad_words=("zz",)))).events.get()
    assert ev.finished == "error" and ev.error is not None
    assert ev.error.startswith(f"bad_words: they tokenize to ids outside the model's vocabulary of {vocab}")
