"""Fill in the middle on ``/v1/completions`` (``suffix``): the demo engine served in process with a tokenizer
that holds the fill-in-the-middle tokens, and with one that does not."""

from __future__ import annotations

from types import MappingProxyType

from srv_helpers import serve_demo

from strata_runtime.server.protocol import FIM_TAGS
from strata_runtime.weights.tokenizer import ByteTokenizer

PREFIX, SUFFIX = 'def greet(name):\n    return "Dear " + ', '\n\nprint(greet("Emma"))\n'


class FimBytes(ByteTokenizer):
    """The byte tokenizer with the fill-in-the-middle tags as tokens of their own, as Qwen's coder models'
    vocabularies hold them."""

    SPECIALS = MappingProxyType(
        {**ByteTokenizer.SPECIALS, **{tag: 259 + i for i, tag in enumerate(FIM_TAGS)}}
    )


def test_a_suffix_makes_a_fill_in_the_middle_prompt():
    """With ``suffix``, the prompt the model reads is the prefix, the suffix and the middle's tag, each tag
    one token: the greedy reply and the prompt's length are those of that prompt written out by hand; a
    batch of prompts shares the suffix. An empty suffix asks for nothing more than the prompt."""
    tagged = f"{FIM_TAGS[0]}{PREFIX}{FIM_TAGS[1]}{SUFFIX}{FIM_TAGS[2]}"
    ask = {"model": "demo", "max_tokens": 12, "temperature": 0}
    (fim, _), (hand, _), (batch, _), (empty, _), (plain, _) = serve_demo(
        FimBytes,
        [
            {**ask, "prompt": PREFIX, "suffix": SUFFIX},
            {**ask, "prompt": tagged},
            {**ask, "prompt": [PREFIX, "x = "], "suffix": SUFFIX},
            {**ask, "prompt": PREFIX, "suffix": ""},
            {**ask, "prompt": PREFIX},
        ],
        path="/v1/completions",
    )
    assert fim["choices"][0]["text"] == hand["choices"][0]["text"]
    tokens = len(PREFIX.encode()) + len(SUFFIX.encode()) + 3
    assert fim["usage"]["prompt_tokens"] == hand["usage"]["prompt_tokens"] == tokens
    assert batch["choices"][0]["text"] == fim["choices"][0]["text"]
    assert batch["usage"]["prompt_tokens"] == tokens + len(b"x = ") + len(SUFFIX.encode()) + 3
    assert empty["choices"][0]["text"] == plain["choices"][0]["text"] != fim["choices"][0]["text"]


def test_a_suffix_for_a_model_without_fill_in_the_middle_tokens_is_a_400():
    ((whole, _),) = serve_demo(
        ByteTokenizer,
        [{"model": "demo", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4}],
        path="/v1/completions",
        status=400,
    )
    assert whole["error"]["param"] == "suffix" and FIM_TAGS[0] in whole["error"]["message"]
