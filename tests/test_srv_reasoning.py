"""Replies of models that reason in ``<think>`` blocks (Qwen3): the reasoning read apart from the rest, whole
and streamed, before tool calls are read; ``chat_template_kwargs`` reaching the chat template.

The demo model's byte tokenizer has no ``<think>`` token, so the server tests give the demo engine a byte
tokenizer that holds both tags as tokens (as Qwen3's vocabulary does) and hold replies to a think block
through ``structured_outputs``, which the demo model would not write by itself.
"""

from __future__ import annotations

import json
import re
from types import MappingProxyType

import numpy as np
import pytest
from srv_helpers import DEMO, serve_demo, streamed_reply

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.engine import Engine
from strata_runtime.server import protocol as p
from strata_runtime.thinking import ThinkCount, ThinkSplitter, split_thinking, think_ids, thinking_at_end
from strata_runtime.weights.tokenizer import ByteTokenizer, HFTokenizer


def _pieces(text: str, g: np.random.Generator, opened: bool = False) -> list[tuple[str, str]]:
    splitter, out, at = ThinkSplitter(opened), [], 0
    while at < len(text):
        n = int(g.integers(1, 7))
        out += splitter.feed(text[at : at + n])
        at += n
    return out + splitter.close()


def test_reasoning_splits_from_the_reply_whole_and_in_any_pieces():
    """Seeded replies with and without a think block, blanks around its tags: the reasoning is the block's
    text, the rest follows without the blanks after the tag; fed in random pieces, the same parts come out
    and no piece of a tag is ever said."""
    g = np.random.default_rng(53)
    words = ["Let", "me", "think", "<b>", "</thi", "42", "café", "\n"]
    for _ in range(300):
        thought = " ".join(words[i] for i in g.integers(0, len(words), int(g.integers(1, 8)))).strip()
        answer = " ".join(words[i] for i in g.integers(0, len(words), int(g.integers(0, 6)))).strip()
        opened = bool(g.integers(0, 2))
        thinks = opened or bool(g.integers(0, 2))
        blanks = ["", "\n", "\n\n", " "]
        text = (
            ("" if opened else blanks[int(g.integers(0, 4))] + "<think>") + "\n" + thought + "\n</think>"
            if thinks
            else ""
        )
        text += blanks[int(g.integers(0, 4))] + answer
        reasoning, rest = split_thinking(text, opened)
        if thinks and thought:
            assert reasoning == thought and rest == answer.lstrip(), (text, reasoning, rest)
        elif not thinks:
            assert reasoning is None and rest == text.lstrip()
        parts = _pieces(text, g, opened)
        assert "".join(t for k, t in parts if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t in parts if k == "content") == rest
        assert not any("<think" in t or "</think>" in t for k, t in parts if k == "reasoning")


def test_a_block_is_reasoning_only_at_the_start_and_an_unclosed_one_is_all_reasoning():
    assert split_thinking("Hello <think>x</think> there") == (None, "Hello <think>x</think> there")
    assert split_thinking("<think>\nstill going") == ("still going", "")
    assert split_thinking("<thi") == (None, "<thi")  # the start of a tag that never came
    splitter = ThinkSplitter()
    assert splitter.feed("  <thi") == [] and splitter.feed("nk>\nhm") == [("reasoning", "hm")]
    assert splitter.feed("m</th") == [("reasoning", "m")] and splitter.feed("ink>\n\nOK") == [
        ("content", "OK")
    ]


class ThinkingBytes(ByteTokenizer):
    """The byte tokenizer with Qwen3's think tags as tokens of their own."""

    SPECIALS = MappingProxyType({**ByteTokenizer.SPECIALS, "<think>": 259, "</think>": 260})


def test_a_think_blocks_tokens_are_counted_with_both_tags_and_only_at_the_replys_start():
    count = ThinkCount(False, 259, 260)
    count.feed([259, 1, 2])
    count.feed([3, 260, 4, 259, 5])
    assert count.tokens == 5
    late = ThinkCount(False, 259, 260)
    late.feed([1, 259, 2, 260])
    assert late.tokens == 0
    opened = ThinkCount(True, 259, 260)
    opened.feed([1, 2, 260, 3])
    assert opened.tokens == 3


def test_a_model_reasons_where_its_vocabulary_holds_the_tags_and_its_template_may_open_the_block():
    tok = ThinkingBytes(512)
    assert think_ids(tok) == (259, 260) and think_ids(ByteTokenizer(512)) is None
    assert thinking_at_end(tok, tok.encode("user: hi\nassistant: <think>\n")) == "open"
    assert thinking_at_end(tok, tok.encode("user: <think>\nassistant: ")) is None


def test_an_hf_tokenizer_with_think_tokens_reasons(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["let me think about it"] * 20, trainers.BpeTrainer(special_tokens=["<unk>"]))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert think_ids(HFTokenizer(tmp_path, {})) is not None


def test_chat_template_kwargs_reach_the_template_and_are_checked():
    class Templated(HFTokenizer):
        def __init__(self) -> None:
            self.template = (
                "{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}"
                "<think>\n\n</think>\n\n{% endif %}"
            )

        def encode(self, text: str) -> list[int]:
            return list(text.encode())

    tok = Templated()
    messages = [{"role": "user", "content": "hi"}]
    assert bytes(tok.apply_chat_template(messages)) == b"hi"
    assert bytes(tok.apply_chat_template(messages, None, {"enable_thinking": False})).startswith(b"hi<think>")
    base = {"model": "m", "messages": messages}
    assert p.template_kwargs(p.parse_chat({**base, "chat_template_kwargs": {"enable_thinking": False}})) == {
        "enable_thinking": False
    }
    for key in ("messages", "add_generation_prompt", "not a name", "_private"):
        with pytest.raises(p.ApiError) as info:
            p.template_kwargs(p.parse_chat({**base, "chat_template_kwargs": {key: 1}}))
        assert info.value.param == f"chat_template_kwargs.{key}"
    with pytest.raises(p.ApiError) as info:
        p.parse_chat({**base, "chat_template_kwargs": ["enable_thinking"]})
    assert info.value.param == "chat_template_kwargs"
    # `reasoning_effort` reaches the template; none and minimal turn thinking off, unless the kwargs say.
    effort = p.template_kwargs(p.parse_chat({**base, "reasoning_effort": "none"}))
    assert effort == {"reasoning_effort": "none", "enable_thinking": False}
    assert bytes(tok.apply_chat_template(messages, None, effort)).startswith(b"hi<think>")
    assert p.template_kwargs(p.parse_chat({**base, "reasoning_effort": "high"})) == {
        "reasoning_effort": "high"
    }
    kept = {**base, "reasoning_effort": "minimal", "chat_template_kwargs": {"enable_thinking": True}}
    assert p.template_kwargs(p.parse_chat(kept)) == {"reasoning_effort": "minimal", "enable_thinking": True}
    bad = [
        ({"reasoning_effort": "max"}, "reasoning_effort", "should be 'none', 'minimal'"),
        ({"thinking_token_budget": 0}, "thinking_token_budget", "greater than or equal to 1"),
        (
            {"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]},
            "messages.0.reasoning_content",
            "a valid string",
        ),
    ]
    for fields, param, why in bad:
        with pytest.raises(p.ApiError) as info:
            p.parse_chat({**base, **fields})
        assert (
            info.value.param == param
            and info.value.message.startswith(f"`{param}`")
            and why in info.value.message
        )


NOW_TOOL = {"type": "function", "function": {"name": "now"}}


class ClosingBytes(ThinkingBytes):
    """`ThinkingBytes` whose chat prompt ends with a closed, empty think block, as Qwen3's template writes it
    with ``enable_thinking: false``."""

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        return super().apply_chat_template(messages, tools, template_kwargs) + self.encode(
            "<think>\n\n</think>\n\n"
        )


OPEN = ThinkingBytes.SPECIALS["<think>"]
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
"""A tool's parameters that hold a required call's arguments to ``{}`` (the demo would go on writing keys)."""


def test_the_server_reads_reasoning_apart_whole_and_streamed_and_then_the_calls():
    """Greedy replies of a model that reasons, held to an answer or a required call after their think
    block (a logit bias makes the demo open the block, a budget closes it): ``reasoning_content`` holds the
    block's text and ``content`` the rest, whole and streamed alike; calls are read from the text after the
    block; a reply with no block has no reasoning. A model whose vocabulary has no think tags is not read for
    reasoning at all."""
    messages = [{"role": "user", "content": "Think first."}]
    ask = {"model": "demo", "messages": messages, "max_tokens": 120, "temperature": 0}
    opens = {"logit_bias": {str(OPEN): 100}}
    answer = r"[A-Z][a-z]{2,8}\."
    now = {"type": "function", "function": {"name": "now", "parameters": NO_ARGUMENTS}}
    one = {"parallel_tool_calls": False}  # else the demo goes on making calls
    bodies = [
        {**ask, **opens, "thinking_token_budget": 12, "structured_outputs": {"regex": answer}},
        {**ask, **opens, "thinking_token_budget": 8, "tools": [now], "tool_choice": "required", **one},
        {**ask, "logit_bias": {str(OPEN): -100}, "structured_outputs": {"regex": answer}},
    ]
    (answered, called, plain) = serve_demo(ThinkingBytes, bodies)
    for whole, chunks in (answered, called, plain):
        message = whole["choices"][0]["message"]
        reasoning, content, calls, finish = streamed_reply(chunks)
        assert reasoning == (message["reasoning_content"] or "") and content == (message["content"] or "")
        assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls") or []]
        assert finish == whole["choices"][0]["finish_reason"]
    m = answered[0]["choices"][0]
    assert m["finish_reason"] == "stop" and re.fullmatch(answer, m["message"]["content"])
    assert 0 < len(m["message"]["reasoning_content"]) <= 12
    m = called[0]["choices"][0]
    assert m["finish_reason"] == "tool_calls" and m["message"]["content"] is None
    assert 0 < len(m["message"]["reasoning_content"]) <= 8
    assert m["message"]["tool_calls"][0]["function"]["name"] == "now"
    m = plain[0]["choices"][0]["message"]
    assert m["reasoning_content"] is None and re.fullmatch(answer, m["content"])
    think = r"<think>\n[a-z ]{4,24}\n</think>\n\n"
    ((whole, chunks),) = serve_demo(ByteTokenizer, [{**ask, "structured_outputs": {"regex": think + answer}}])
    message = whole["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("<think>\n")
    assert streamed_reply(chunks)[1] == message["content"]


def test_a_budget_cuts_the_reasoning_where_it_runs_out_and_the_rest_is_free():
    """One greedy reply, starting in a block the template opened, under budgets of 5 and 12 tokens: the
    shorter block is the start of the longer (the same tokens until the budget closes it), each at most its
    budget long; after the block the reply runs free to its length. Where the template closed the block
    (``enable_thinking: false``) no budget is kept, and a grammar holds the reply from its first token."""
    messages = [{"role": "user", "content": "Think first."}]
    ask = {"model": "demo", "messages": messages, "max_tokens": 40, "temperature": 0}
    replies = serve_demo(OpeningBytes, [{**ask, "thinking_token_budget": n} for n in (5, 12)])
    short, long = (whole["choices"][0] for whole, _ in replies)
    for choice, n in ((short, 5), (long, 12)):
        assert choice["finish_reason"] == "length" and choice["message"]["content"]
        assert 0 < len(choice["message"]["reasoning_content"]) <= n
    assert long["message"]["reasoning_content"].startswith(short["message"]["reasoning_content"])
    assert short["message"]["reasoning_content"] != long["message"]["reasoning_content"]
    opens = {"logit_bias": {str(OPEN): 100}}
    closed = serve_demo(
        ClosingBytes,
        [
            {**ask, **opens, "thinking_token_budget": 5},
            {
                **ask,
                **opens,
                "thinking_token_budget": 5,
                "structured_outputs": {"regex": r"[A-Z][a-z]{2,8}\."},
            },
        ],
    )
    free, held = (whole["choices"][0]["message"] for whole, _ in closed)
    # No budget closes a block the biased reply opens: all its 40 tokens are the opening tag.
    assert free["reasoning_content"] == "<think>" * 39 and not free["content"]
    assert held["reasoning_content"] is None
    assert re.fullmatch(r"[A-Z][a-z]{2,8}\.", held["content"])


class OpeningBytes(ThinkingBytes):
    """`ThinkingBytes` whose chat prompt opens a think block, as the templates of models that always reason
    do."""

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        ids = super().apply_chat_template(messages, tools, template_kwargs)
        if (template_kwargs or {}).get("enable_thinking") is False:
            return ids + self.encode("<think>\n\n</think>\n\n")
        return ids + self.encode("<think>\n")


def test_the_terminal_chat_reads_reasoning_apart_and_bounds_it(capsys):
    """`strata chat`'s turns with a model that reasons: the reasoning goes to stderr and into the history
    apart from the answer (``reasoning_content``), a budget closes the block, ``--no-think`` leaves none."""
    import argparse

    from strata_runtime.commands import chat as runtime_chat

    plan = resolve_profile(DEMO)
    engine = Engine(plan)
    engine.tokenizer = OpeningBytes(engine.model.args.vocab_size)
    parser = argparse.ArgumentParser()
    runtime_chat.add_arguments(parser)
    base = ["--plan", "p", "--temperature", "0", "--max-tokens", "30", "--quiet"]
    try:
        chat = runtime_chat.Chat(
            engine, plan.memory.context, parser.parse_args([*base, "--thinking-budget", "6"])
        )
        chat.turn("Think first.")
        out = capsys.readouterr()
        said = chat.messages[-1]
        assert 0 < len(said["reasoning_content"]) <= 6 and said["reasoning_content"] in out.err
        assert said["content"] and out.out.strip() == said["content"].strip()
        chat = runtime_chat.Chat(
            engine, plan.memory.context, parser.parse_args([*base, "--no-think", "--json"])
        )
        chat.turn("Answer at once.")
        (line,) = capsys.readouterr().out.splitlines()
        assert json.loads(line)["reasoning"] is None and "reasoning_content" not in chat.messages[-1]
    finally:
        engine.close()


def test_the_responses_api_gives_the_reasoning_as_an_item_of_its_own():
    """A reply that starts in a think block the template opened: a ``reasoning`` item before the message,
    whole and streamed alike, its tokens counted; streamed, its text arrives as reasoning deltas."""
    ask = {"model": "demo", "input": "Think first.", "max_output_tokens": 40, "temperature": 0}
    ((whole, events),) = serve_demo(OpeningBytes, [ask], "/v1/responses")
    kinds = [item["type"] for item in whole["output"]]
    assert kinds[0] == "reasoning" and set(kinds) <= {"reasoning", "message"}
    text = whole["output"][0]["content"][0]["text"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text and streamed == text
    assert events[-1]["response"]["output"] == [
        {**item, "id": events[-1]["response"]["output"][i]["id"]} for i, item in enumerate(whole["output"])
    ]
    use = whole["usage"]
    if kinds == ["reasoning"]:  # never closed: every token is the block's
        assert use["output_tokens_details"]["reasoning_tokens"] == use["output_tokens"]
    else:
        assert 0 < use["output_tokens_details"]["reasoning_tokens"] < use["output_tokens"]


def test_reasoning_tokens_are_the_think_blocks_counted_whole_andstreamed_reply():
    """``completion_tokens_details.reasoning_tokens``: the tokens of the block the template opened, up to
    the close a budget of 6 forces (7), whole and in a stream's usage chunk; a reply of a model without
    think tags has no such count."""
    ask = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Think."}],
        "max_tokens": 30,
        "temperature": 0,
    }
    budgeted = {**ask, "thinking_token_budget": 6}
    ((whole, chunks),) = serve_demo(
        OpeningBytes, [budgeted], streamed={"stream_options": {"include_usage": True}}
    )
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}
    (last,) = [c for c in chunks if c.get("usage")]
    assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}
    ((plain, _),) = serve_demo(ByteTokenizer, [ask])
    assert "completion_tokens_details" not in plain["usage"]


def test_the_responses_api_takes_a_thinking_budget():
    """``thinking_token_budget`` on a Responses body closes the block the template opened after 5 tokens:
    6 reasoning tokens with the close, then the message."""
    ask = {
        "model": "demo",
        "input": "Think.",
        "max_output_tokens": 30,
        "temperature": 0,
        "thinking_token_budget": 5,
    }
    ((whole, _),) = serve_demo(OpeningBytes, [ask], "/v1/responses")
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
