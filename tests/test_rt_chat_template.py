"""The byte tokenizer's chat format keeps a synthetic model's replies in readable text."""

from __future__ import annotations

import numpy as np
from rt_plans import make_plan

from strata_runtime.api import Request
from strata_runtime.engine import Engine


def test_synthetic_chat_replies_are_readable_text():
    engine = Engine(make_plan(preset="tiny", slots=1, draft_tokens=4))
    g = np.random.default_rng()
    words = ["".join(chr(c) for c in g.integers(97, 123, int(n))) for n in g.integers(2, 8, 3)]
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}])
    handle = engine.submit(Request(tuple(prompt), 24))
    while engine.step():
        pass
    text = ""
    while not handle.events.empty():
        text += handle.events.get().text
    assert len(text) >= 12 and text.isprintable(), repr(text)
