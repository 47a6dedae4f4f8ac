"""The byte tokenizer's chat format, and what it does for a synthetic model's replies.

A synthetic model is random layers over a planted token chain (strata_runtime/weights/synthetic.py): with no
layer output its reply is the chain, which cycles through printable ASCII after a printable byte, and the
chat format ends on one. The layers then change some next tokens; the LM head pulls those towards printable
bytes too, so replies stay mostly (not wholly) printable. Prompts are seeded.
"""

from __future__ import annotations

import numpy as np
from rt_plans import make_plan

from strata_runtime.api import Request
from strata_runtime.engine import Engine
from strata_runtime.weights.synthetic import chain_permutation


def _chat(engine: Engine, content: str, max_tokens: int = 24) -> list[int]:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    handle = engine.submit(Request(tuple(prompt), max_tokens))
    while engine.step():
        pass
    return [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]


def _words(seed: int) -> str:
    g = np.random.default_rng(seed)
    return " ".join("".join(chr(c) for c in g.integers(97, 123, int(n))) for n in g.integers(2, 8, 3))


def test_the_chat_prompt_is_a_plain_transcript_ending_on_a_printable_byte():
    engine = Engine(make_plan(preset="tiny", slots=1))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = engine.tokenizer.apply_chat_template(messages)
    assert bytes(ids) == b"system: Be brief.\nuser: hi\nassistant: "


def test_with_no_layer_output_the_reply_is_the_printable_chain():
    engine = Engine(make_plan(preset="tiny", slots=1, draft_tokens=4, layer_scale=0.0))
    chain = chain_permutation(engine.model.args.vocab_size, engine.plan.model.seed)
    reply = _chat(engine, _words(0))
    assert len(reply) == 24 and all(32 <= t < 127 for t in reply)
    assert all(int(chain[a]) == b for a, b in zip(reply, reply[1:], strict=False))


def test_at_the_default_layer_scale_replies_stay_mostly_printable():
    """Measured over these 12 prompts: 92% of the reply bytes are printable on average, the worst reply 67%;
    without the LM head's pull towards printable bytes, 33%. Uniform choices would give 25% (95 of 384)."""
    engine = Engine(make_plan(preset="tiny", slots=1, draft_tokens=4))
    shares = []
    for seed in range(12):
        reply = _chat(engine, _words(seed))
        assert len(reply) == 24  # the chain avoids the end-of-text id, and so mostly do the layers
        shares.append(np.mean([32 <= t < 127 for t in reply]))
    assert np.mean(shares) > 0.85 and min(shares) > 0.5, shares
