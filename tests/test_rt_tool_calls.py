"""Tool calls in the Hermes layout (strata_runtime/chat.py): a reply read into text and calls, whole and as
it streams in arbitrary pieces; tools and earlier calls written into the prompt the same way by every chat
layout; a checkpoint's template rendered as transformers renders it, in a sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from strata_runtime.chat import (
    CALL_CLOSE,
    CALL_OPEN,
    CallArguments,
    CallSplitter,
    CallStart,
    ChatTemplateError,
    ToolCall,
    call_text,
    plain_messages,
    split_reply,
    tools_text,
)
from strata_runtime.weights.tokenizer import CHATML_TEMPLATE, ByteTokenizer, HFTokenizer, _compiled, chatml

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <today> & tomorrow in a city, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]

WORDS = ["Let", "me", "check.", "Bath", "<tool", "</tool_call>", "{}", "café", "中文", "\n", "  ", "ok"]


def _reply(g: np.random.Generator) -> tuple[str, list[str], list[tuple[str, dict]]]:
    """A seeded reply of text and calls: its text as the model writes it, its text parts (each free of
    blanks at its ends) and its calls."""
    parts, texts, calls = [], [], []
    for k in range(int(g.integers(1, 6))):
        if k % 2 == int(g.integers(0, 2)):
            words = " ".join(WORDS[i] for i in g.integers(0, len(WORDS), int(g.integers(1, 6)))).strip()
            if words and CALL_OPEN not in words and not words.endswith("<tool"):
                texts.append(words)
                parts.append(words)
                continue
        name = ["get_weather", "now"][int(g.integers(0, 2))]
        args = {"city": "Bath", "days": int(g.integers(1, 8))} if name == "get_weather" else {}
        calls.append((name, args))
        parts.append(call_text(name, args))
    blanks = ["", "\n", "\n\n", " "]
    text = blanks[int(g.integers(0, 4))]
    for part in parts:
        text += part + blanks[int(g.integers(0, 4))]
    return text, texts, calls


def _fed(text: str, g: np.random.Generator) -> list[str | ToolCall]:
    """``text`` fed to a splitter in random pieces, as a stream brings it."""
    splitter, out, at = CallSplitter(), [], 0
    while at < len(text):
        n = int(g.integers(1, 9))
        out += splitter.feed(text[at : at + n])
        at += n
    return out + splitter.close()


def test_a_reply_splits_into_its_text_and_calls_whole_and_in_any_pieces():
    """Seeded replies of text and calls, with blanks around them: the calls come out in order with their
    arguments, the text is the text parts with no blanks from the layout; a stream fed in random pieces
    gives the same text and calls, and never a piece of a tag as text."""
    g = np.random.default_rng(41)
    for _ in range(300):
        text, texts, calls = _reply(g)
        words, found = split_reply(text)
        assert [(c.name, json.loads(c.arguments)) for c in found] == calls, text
        # Blanks between two text parts not parted by a call stay; the layout's around calls do not.
        assert (words or "").replace(" ", "").replace("\n", "") == "".join(texts).replace(" ", "").replace(
            "\n", ""
        )
        assert words is None or words == words.strip()
        streamed = _fed(text, g)
        assert "".join(p for p in streamed if isinstance(p, str)) == (words or "")
        assert [(c.name, c.arguments) for c in streamed if isinstance(c, ToolCall)] == [
            (c.name, c.arguments) for c in found
        ]
        assert not any(isinstance(p, str) and ("<tool_call" in p or p.endswith("<")) for p in streamed)


def test_the_start_of_a_tag_is_held_until_it_is_known():
    splitter = CallSplitter()
    assert splitter.feed("Checking <tool") == ["Checking"]
    assert splitter.feed('_call>\n{"name": "now", "arguments": {}}\n</tool') == []
    (call,) = splitter.feed("_call>")
    assert call.name == "now" and call.arguments == "{}" and splitter.calls == 1
    assert splitter.feed(" \n<b> ") == ["<b>"] and splitter.close() == []  # blanks by a call, or at the end
    splitter = CallSplitter()
    assert splitter.feed("a <tool") == ["a"] and splitter.feed("s>") == [" <tools>"]


def test_blocks_that_are_not_calls_and_unclosed_blocks_stay_text():
    for inner in ("not json", '{"arguments": {}}', '{"name": "now", "arguments": [1]}', '["now"]'):
        text = f"{CALL_OPEN}\n{inner}\n{CALL_CLOSE}"
        assert split_reply(text) == (text, [])
    cut = f'Sure {CALL_OPEN}\n{{"name": "now"'
    assert split_reply(cut) == (cut, [])
    words, calls = split_reply(f'{CALL_OPEN}\n{{"name": "now"}}\n{CALL_CLOSE}')
    assert words is None and calls[0].arguments == "{}"  # no arguments: an empty object


def test_a_call_is_said_as_it_comes_and_a_call_cut_short_is_a_call():
    """With ``progress``, a call is begun once its head (``{"name": ..., "arguments": {``) has come, and its
    arguments come in stretches that join into the call's arguments (as written: strings, escapes and
    nesting followed, the call object's own closing brace left out), fed in any seeded pieces; a reply cut
    inside a call's arguments ends with that call, its arguments as far as they came; a block whose head
    never reads as a call is read whole when it closes, as before."""
    g = np.random.default_rng(11)
    args = '{"a": "x}\\" {y", "b": [1, {"c": [2]}], "d": "中文"}'
    text = f'Checking.\n{CALL_OPEN}\n{{"name": "get_weather", "arguments": {args}}}\n{CALL_CLOSE}\nDone.'
    for _ in range(20):
        splitter, fed, at = CallSplitter(progress=True), [], 0
        while at < len(text):
            n = int(g.integers(1, 6))
            fed += splitter.feed(text[at : at + n])
            at += n
        fed += splitter.close()
        (start,) = [x for x in fed if isinstance(x, CallStart)]
        (call,) = [x for x in fed if isinstance(x, ToolCall)]
        stretches = [x.text for x in fed if isinstance(x, CallArguments)]
        assert (start.id, start.name) == (call.id, call.name) and "".join(stretches) == call.arguments == args
        assert [x for x in fed if isinstance(x, str)] and "".join(x for x in fed if isinstance(x, str)) == (
            "Checking.Done."
        )
        assert fed.index(start) < fed.index(call) and len(stretches) > 1
    assert split_reply(text)[1][0].arguments == args
    cut = text[: text.index('"b"')]
    words, (partial,) = split_reply(cut)
    assert words == "Checking." and partial.arguments == '{"a": "x}\\" {y", '
    swapped = f'{CALL_OPEN}\n{{"arguments": {{}}, "name": "now"}}\n{CALL_CLOSE}'
    splitter = CallSplitter(progress=True)
    assert splitter.feed(swapped[:-3]) == []  # no head: read when it closes
    (late,) = splitter.feed(swapped[-3:])
    assert isinstance(late, ToolCall) and late.name == "now"


def test_a_call_reads_as_openai_writes_it():
    call = ToolCall("get_weather", '{"city": "Bath"}')
    body = call.openai(2)
    assert body == {
        "index": 2,
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'},
    }
    assert call.id.startswith("call_") and ToolCall("a", "{}").id != call.id


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Bath and the time?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Bath"}},
            },
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 11}'},
    {"role": "tool", "tool_call_id": "c2", "content": "09:30"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "content": "09:31"},
    {"role": "user", "content": "Thanks"},
]


def test_plain_messages_write_tools_calls_and_answers_in_the_hermes_layout():
    plain = plain_messages(CONVERSATION, TOOLS)
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user", "assistant", "user", "user"]
    system = plain[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n") and system == "Be brief.\n\n" + tools_text(TOOLS)
    lines = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in lines] == TOOLS  # a line of JSON a tool, keys in their order
    assert "<today> & tomorrow" in system and "°C" in system  # no escapes
    assert plain[2]["content"] == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    assert plain[3]["content"] == (
        '<tool_response>\n{"temp": 11}\n</tool_response>\n<tool_response>\n09:30\n</tool_response>'
    )
    assert plain[4]["content"] == call_text("now", {}) and plain[5]["content"].count("<tool_response>") == 1
    # Without tools, and with no system message, nothing is added.
    assert plain_messages(CONVERSATION[1:2]) == [CONVERSATION[1]]
    assert plain_messages(CONVERSATION[1:2], TOOLS)[0] == {"role": "system", "content": tools_text(TOOLS)}


HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for c in m.tool_calls or [] %}
{%- if not loop.first or m.content %}{{ '\\n' }}{% endif %}
{%- set f = c.function %}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A checkpoint's template that writes tools and calls itself, in the Hermes layout."""


class _TextTokenizer(HFTokenizer):
    """`HFTokenizer`'s chat rendering with a given template, its ids the text's UTF-8 bytes."""

    def __init__(self, template: str | None) -> None:
        self.template = template

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])


def _text(tokenizer: HFTokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    return bytes(tokenizer.apply_chat_template(messages, tools)).decode()


QWEN3_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
"""The chat template published with Qwen3's checkpoints (their ``tokenizer_config.json``)."""


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, QWEN3_TEMPLATE], ids=["hermes", "qwen3"])
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_every_chat_layout_gives_the_model_the_same_prompt_for_tools_and_calls(tools, template):
    """A template that writes tools itself (Qwen3's own among them), the same chat through a template that
    does not (ChatML: the calls written into the messages first), and no template at all give one text."""
    knows = _TextTokenizer(template)
    assert knows.template_knows_tools and not _TextTokenizer(CHATML_TEMPLATE).template_knows_tools
    own = _text(knows, CONVERSATION, tools)
    assert own == _text(_TextTokenizer(CHATML_TEMPLATE), CONVERSATION, tools)
    assert own == _text(_TextTokenizer(None), CONVERSATION, tools)
    assert own == chatml(plain_messages(CONVERSATION, tools))
    assert own.endswith("<|im_start|>assistant\n") and ('"arguments": {"city": "Bath"}' in own)
    assert ("# Tools" in own) == (tools is not None)


AGENT_STEPS = [
    {"role": "user", "content": "Weather in Bath?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The tool knows.",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Bath"}}}],
    },
    {"role": "tool", "content": '{"temp": 11}'},
]
"""An agent's step after the last user message, its reasoning sent back."""


@pytest.mark.parametrize(
    ("template", "messages", "kwargs"),
    [
        (HERMES_TEMPLATE, CONVERSATION, {}),
        (QWEN3_TEMPLATE, CONVERSATION, {}),
        (QWEN3_TEMPLATE, AGENT_STEPS, {}),
        (QWEN3_TEMPLATE, CONVERSATION[:2], {"enable_thinking": False}),
    ],
    ids=["hermes", "qwen3", "qwen3-agent-steps", "qwen3-no-thinking"],
)
def test_a_checkpoints_template_renders_as_transformers_renders_it(template, messages, kwargs):
    """The same template, tools and messages rendered by transformers and by the runtime: ``tojson`` keeps
    keys in order and writes ``<``, ``&`` and non-ASCII text as themselves (Jinja's own filter would sort
    and escape them)."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    ours = _compiled(template).render(messages=messages, tools=TOOLS, add_generation_prompt=True, **kwargs)
    rendered, _ = utils.render_jinja_template(
        conversations=[messages], tools=TOOLS, chat_template=template, add_generation_prompt=True, **kwargs
    )
    assert ours == rendered[0]
    assert "<today> & tomorrow" in ours


def test_reasoning_sent_back_reaches_qwen3s_template_for_an_agents_steps():
    """An assistant message's ``reasoning_content``, read from a chat body as the server reads it, is shown
    by Qwen3's template for the steps after the last user message; a template that closes the block
    (``enable_thinking: false``) ends the prompt after it."""
    from strata_runtime.server import protocol as p
    from strata_runtime.thinking import thinking_at_end

    body = p.parse_chat(
        {"model": "m", "messages": AGENT_STEPS[:1] + [_openai(AGENT_STEPS[1]), AGENT_STEPS[2]]}
    )
    tok = _TextTokenizer(QWEN3_TEMPLATE)
    text = _text(tok, p.chat_messages(body), TOOLS)
    assert "<|im_start|>assistant\n<think>\nThe tool knows.\n</think>\n\n<tool_call>" in text
    assert thinking_at_end(tok, tok.encode(text)) is None
    closed = bytes(tok.apply_chat_template(p.chat_messages(body), TOOLS, {"enable_thinking": False})).decode()
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert thinking_at_end(tok, tok.encode(closed)) == "closed"


def _openai(message: dict) -> dict:
    """A message as an OpenAI client sends it (a call's ``id``, ``type`` and its arguments as JSON text)."""
    calls = [
        {
            "id": f"c{i}",
            "type": "function",
            "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    return {**message, "tool_calls": calls} if calls else message


def test_a_template_that_refuses_or_escapes_its_sandbox_is_a_chat_template_error():
    refusing = _TextTokenizer("{{ raise_exception('a user message must come last') }}")
    with pytest.raises(ChatTemplateError, match="a user message must come last"):
        refusing.apply_chat_template([{"role": "user", "content": "hi"}])
    escaping = _TextTokenizer("{{ ().__class__.__base__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        escaping.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_byte_tokenizer_writes_tools_and_calls_into_its_transcript():
    tok = ByteTokenizer(512)
    text = bytes(tok.apply_chat_template(CONVERSATION, TOOLS)).decode()
    plain = plain_messages(CONVERSATION, TOOLS)
    assert text == "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant: "
    assert (
        bytes(tok.apply_chat_template(CONVERSATION[1:2]))
        == b"user: Weather in Bath and the time?\nassistant: "
    )
