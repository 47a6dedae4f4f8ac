"""Stop strings: a reply ends where the first stop string completes, however its windows split the text.

`StopText` (strata_runtime.engine.stops) is the one cutter; `Slot.emit` feeds it each window's new text, so
the HTTP server and `strata generate` cut the same way (tests/test_srv_stop_strings.py runs both). Window
boundaries are fixed here, not random: every cut point of short texts, and the cases where a stop string
straddles two or three windows are pinned as hypothesis examples.
"""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from strata_runtime.api import Request, RequestHandle
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.slot import Slot
from strata_runtime.engine.stops import StopText
from strata_runtime.weights.tokenizer import ByteTokenizer


def cut_char_by_char(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The reference: generate one character at a time and stop as soon as the text ends with a stop
    string; the reply is cut where that stop string begins (the longest, if two end there)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def stop_end(text: str, stops: tuple[str, ...]) -> int:
    """Where generating one character at a time would have stopped: the end of the first complete stop."""
    return next(end for end in range(1, len(text) + 1) if any(s and text[:end].endswith(s) for s in stops))


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c for c in cuts if 0 <= c <= len(text))})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def stream_stop_text(parts: list[str], stops: tuple[str, ...], keep: bool = False) -> tuple[str, bool]:
    """Feed ``parts`` to a `StopText`; what was sent, checking after each piece that it is a prefix of the
    final reply (nothing of a stop string ever leaks). ``keep``: the reply keeps the stop string it ends at,
    up to where generating one character at a time would have stopped."""
    text = "".join(parts)
    final, hit = cut_char_by_char(text, stops)
    if keep and hit:
        final = text[: stop_end(text, stops)]
    cutter, sent = StopText(stops, keep=keep), ""
    for part in parts:
        sent += cutter.feed(part)
        assert final.startswith(sent), (sent, final)
        if cutter.stopped:
            return sent, True
    return sent + cutter.flush(), False


def _slot(stops: tuple[str, ...], max_tokens: int = 100) -> Slot:
    req = Request((1, 2), max_tokens, stop_strings=stops)
    return Slot(
        0, RequestHandle(req), Sampler(req.sampling, 0), frozenset(), ByteTokenizer(384), admitted_at=0
    )


def stream_slot(text: str, stops: tuple[str, ...], cuts: list[int], max_tokens: int = 100) -> Slot:
    """Emit the UTF-8 bytes of ``text`` as byte tokens, one window per piece between ``cuts`` (byte
    offsets); checks that every event's text keeps the sent text a prefix of the final reply."""
    data = text.encode()
    final, _ = cut_char_by_char(data[:max_tokens].decode(errors="replace"), stops)
    slot = _slot(stops, max_tokens)
    bounds = sorted({0, len(data), *(c for c in cuts if 0 <= c <= len(data))})
    for a, b in itertools.pairwise(bounds):
        slot.emit(list(data[a:b]), 0)
        assert final.startswith(slot.sent_text), (slot.sent_text, final)
        if slot.finished:
            break
    return slot


def test_the_stop_string_completed_first_wins_not_the_one_starting_first():
    """("bcd", "c") on "abcd": "c" is complete at the third character, before "bcd" is, so the reply is
    "ab" (as a server checking after every token cuts it), not "a"."""
    stops = ("bcd", "c")
    assert cut_char_by_char("abcd", stops) == ("ab", True)
    for k in range(5):  # every split of the text into two pieces
        assert stream_stop_text(pieces("abcd", [k]), stops) == ("ab", True)
    for cuts in ([], [1], [2], [3], [1, 2], [1, 3], [2, 3], [1, 2, 3]):  # and of its bytes into windows
        slot = stream_slot("abcd", stops, cuts)
        assert (slot.sent_text, slot.finished) == ("ab", "stop"), cuts
    slot = _slot(stops)
    assert slot.emit(list(b"ab"), 0).stop is None and slot.emit(list(b"cd"), 0).stop == "c"  # the one cut at


def test_of_two_stop_strings_ending_together_the_longer_is_cut():
    assert stream_stop_text(["xab", "c"], ("bc", "abc")) == ("x", True)
    assert stream_stop_text(["xabc"], ("bc", "abc")) == ("x", True)


@given(
    text=st.text(alphabet="abV=x\n", max_size=40),
    stops=st.lists(st.text(alphabet="abV=\n", min_size=1, max_size=4), max_size=4).map(tuple),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
# A stop string straddling two windows, three windows, and one completing inside a longer one.
@example(text="xxV=yy", stops=("V=",), cuts=[3])
@example(text="xxV=AByy", stops=("V=AB",), cuts=[3, 5])
@example(text="abV=ab", stops=("bV=a", "="), cuts=[2, 4])
@example(text="aVa=", stops=("Va=", "a="), cuts=[1, 2, 3])
@example(text="abab", stops=("aba", "bab"), cuts=[2])
@example(text="ab", stops=("abc",), cuts=[1])  # held back, then sent when the reply ends
def test_any_split_gives_the_text_cut_character_by_character(text, stops, cuts):
    assert stream_stop_text(pieces(text, cuts), stops) == cut_char_by_char(text, stops)
    # vLLM's include_stop_str_in_output: the same cut, with the stop string it was cut at kept
    cut, hit = cut_char_by_char(text, stops)
    kept = text[: stop_end(text, stops)] if hit else cut
    assert stream_stop_text(pieces(text, cuts), stops, keep=True) == (kept, hit)


def test_every_two_window_split_of_a_slot_cuts_the_same():
    """Byte tokens through Slot.emit, cut at every offset: the stop string straddles the windows at each
    of its own characters, and a multi-byte character before it is split too. The reply's tokens, and its
    usage, end with the one that completed the stop string, however the windows split."""
    text, stops = "héllo, V=AB: rest", ("V=AB", ":")
    final, _ = cut_char_by_char(text, stops)
    assert final == "héllo, "
    through = list(text[: stop_end(text, stops)].encode())  # the tokens generated one at a time
    for k in range(len(text.encode()) + 1):
        slot = stream_slot(text, stops, [k])
        assert (slot.sent_text, slot.finished) == (final, "stop"), k
        # A window's tokens after the one that completed the stop string are not the reply's.
        assert slot.generated == through and slot.handle.completion_tokens == len(through), k


def test_every_three_window_split_of_a_slot_cuts_the_same():
    text, stops = "ab=cd=ef", ("d=e", "=c")
    final, _ = cut_char_by_char(text, stops)
    assert final == "ab"
    through = list(text[: stop_end(text, stops)].encode())
    for i, j in itertools.combinations(range(1, len(text)), 2):
        slot = stream_slot(text, stops, [i, j])
        assert (slot.sent_text, slot.finished) == (final, "stop"), (i, j)
        assert slot.generated == through, (i, j)


def test_held_back_text_is_sent_when_the_request_ends_without_the_stop_string():
    for k in range(1, 4):
        slot = stream_slot("abcV", ("V=",), [k], max_tokens=4)
        assert (slot.sent_text, slot.finished) == ("abcV", "length"), k
    slot = _slot(("V=",), max_tokens=4)
    first, last = slot.emit(list(b"abc"), 0), slot.emit(list(b"V"), 0)
    assert (first.text, last.text, last.finished) == ("abc", "V", "length")


def test_a_stop_token_ends_the_reply_with_what_was_held_back():
    req = Request((1, 2), 100, stop_ids=(300,), stop_strings=("V=",))
    slot = Slot(0, RequestHandle(req), Sampler(req.sampling, 0), frozenset({300}), ByteTokenizer(384), 0)
    first, last = slot.emit(list(b"abV"), 0), slot.emit([300], 0)
    assert (first.text, last.text, last.finished, last.stop) == ("ab", "V", "stop", 300)


def test_ignore_eos_generates_past_the_models_end_of_text_to_max_tokens() -> None:
    """A request whose every choice is end-of-text (a logit bias of +100 on it): it stops at once with no
    token, and with ``ignore_eos`` runs to ``max_tokens``, emitting those tokens (they decode to nothing)."""
    from strata_cfg.plan.from_profile import resolve_profile
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine

    engine = Engine(resolve_profile("profiles/demo.toml"))
    end = ByteTokenizer.SPECIALS["<|endoftext|>"]
    assert end in engine.tokenizer.eos_ids
    prompt = tuple(engine.tokenizer.encode("The old man"))
    sampling = SamplingParams(temperature=0.0, logit_bias=((end, 100.0),))

    def run(ignore_eos: bool) -> tuple[list[int], str, str | None]:
        handle = engine.submit(Request(prompt, 7, sampling, ignore_eos=ignore_eos))
        while engine.step():
            pass
        events = [handle.events.get() for _ in range(handle.events.qsize())]
        return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1].finished

    assert run(False) == ([], "", "stop")
    assert run(True) == ([end] * 7, "", "length")
