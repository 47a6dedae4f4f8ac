"""Stop strings that arrive over several windows are cut whole: no leading part of one is ever sent."""

from __future__ import annotations

import numpy as np

from strata_runtime.api import Request, RequestHandle
from strata_runtime.engine.sampling import Sampler
from strata_runtime.engine.slot import Slot, _stop_prefix_len
from strata_runtime.weights.tokenizer import ByteTokenizer


def _slot(stop: str, max_tokens: int = 100) -> Slot:
    req = Request((1, 2), max_tokens, stop_strings=(stop,))
    return Slot(
        0, RequestHandle(req), Sampler(req.sampling, 0), frozenset(), ByteTokenizer(384), admitted_at=0
    )


def test_a_stop_string_split_over_windows_is_never_partly_sent():
    g = np.random.default_rng()
    body = bytes(g.integers(97, 123, int(g.integers(1, 12)))).decode()
    stop = "V=" + bytes(g.integers(65, 91, int(g.integers(0, 3)))).decode()
    tokens = list((body + stop + "tail").encode())
    slot, sent = _slot(stop), ""
    cuts = sorted(set(g.integers(1, len(tokens), 4).tolist()))
    for a, b in zip([0, *cuts], [*cuts, len(tokens)], strict=True):
        ev = slot.emit(tokens[a:b], 0)
        sent += ev.text
        if ev.finished:
            break
    assert slot.finished == "stop"
    assert sent == body


def test_held_back_text_is_sent_when_the_request_ends_without_the_stop_string():
    tokens = list(b"abcV")
    slot = _slot("V=", max_tokens=len(tokens))
    first = slot.emit(tokens[:3], 0)
    last = slot.emit(tokens[3:], 0)
    assert first.text == "abc" and last.text == "V" and last.finished == "length"


def test_stop_prefix_len():
    assert _stop_prefix_len("xxab", ("abc",)) == 2
    assert _stop_prefix_len("xxab", ("zz",)) == 0
    assert _stop_prefix_len("ab", ("abc", "b")) == 2
