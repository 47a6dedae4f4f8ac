"""OpenAI's Conversations API and the Responses API's ``conversation``: the openai SDK against the demo engine
started by `strata launch` (CPU). A reply on a conversation is the chat endpoint's reply to its items and the
input, and adds the input and the reply to it; its items are listed in pages, added, read and taken out;
what cannot be done is an error naming the field."""

from __future__ import annotations

import json
import secrets
import time

import pytest
from srv_helpers import Launched, http

from strata_runtime.server import conversations
from strata_runtime.server import responses as r
from strata_runtime.server import responses_store as rs
from strata_runtime.server.errors import ApiError

openai = pytest.importorskip("openai")


def _chat(client, messages: list[dict], tokens: int) -> str:
    reply = client.chat.completions.create(model="demo", max_tokens=tokens, temperature=0, messages=messages)
    return reply.choices[0].message.content or ""


def _texts(items) -> list[tuple[str, str]]:
    return [(item.role, "".join(part.text for part in item.content)) for item in items]


def test_a_reply_on_a_conversation_reads_its_items_and_adds_its_input_and_reply(client):
    """Two turns on a conversation created with a question and an answer: each reply is what the chat
    endpoint gives the conversation's messages so far; each turn adds its input and its reply as items, in
    order, and the second turn reads again only what is new."""
    question = f"Who is Emma {secrets.token_hex(3)}?"
    conversation = client.conversations.create(
        items=[
            {"type": "message", "role": "user", "content": question},
            {"type": "message", "role": "assistant", "content": "A heroine."},
        ],
        metadata={"topic": "austen"},
    )
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "austen"}
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "A heroine."}]
    first = client.responses.create(
        model="demo",
        input="And her father?",
        conversation=conversation.id,
        max_output_tokens=12,
        temperature=0,
    )
    messages.append({"role": "user", "content": "And her father?"})
    assert first.output_text == _chat(client, messages, 12) and first.conversation.id == conversation.id
    messages.append({"role": "assistant", "content": first.output_text})
    second = client.responses.create(
        model="demo",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Where?"}]}],
        conversation={"id": conversation.id},
        max_output_tokens=12,
        temperature=0,
    )
    messages.append({"role": "user", "content": "Where?"})
    assert second.output_text == _chat(client, messages, 12)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    messages.append({"role": "assistant", "content": second.output_text})
    assert _texts(items) == [(m["role"], m["content"]) for m in messages]
    assert (items[3].id, items[5].id) == (first.output[0].id, second.output[0].id)
    assert len({item.id for item in items}) == 6


def test_a_conversations_items_are_paged_added_read_and_taken_out(client):
    """Items come newest first by default, in pages that the SDK follows (``after``, ``has_more``); added
    items come back with ids; one item is read and taken out; the metadata is replaced; a deleted
    conversation is gone, for the API and for a reply."""
    words = [f"w{i}" for i in range(7)]
    conversation = client.conversations.create(items=[{"role": "user", "content": w} for w in words[:5]])
    added = client.conversations.items.create(
        conversation.id, items=[{"role": "user", "content": w} for w in words[5:]]
    )
    assert [item.content[0].text for item in added.data] == words[5:] and added.first_id == added.data[0].id
    page = client.conversations.items.list(conversation.id, limit=3)
    assert [item.content[0].text for item in page.data] == words[::-1][:3] and page.has_more
    every = list(client.conversations.items.list(conversation.id, limit=3, order="asc"))
    assert [item.content[0].text for item in every] == words
    middle = every[3]
    assert client.conversations.items.retrieve(middle.id, conversation_id=conversation.id).id == middle.id
    after = client.conversations.items.delete(middle.id, conversation_id=conversation.id)
    assert after.id == conversation.id
    left = [item.content[0].text for item in client.conversations.items.list(conversation.id, order="asc")]
    assert left == words[:3] + words[4:]
    updated = client.conversations.update(conversation.id, metadata={"k": "v"})
    assert updated.metadata == {"k": "v"} == client.conversations.retrieve(conversation.id).metadata
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="demo", input="hi", conversation=conversation.id, max_output_tokens=2)
    assert info.value.body["param"] == "conversation"


def test_a_reply_that_does_not_end_well_adds_nothing(client):
    """A background reply on a conversation cancelled while it runs leaves the conversation as it was."""
    conversation = client.conversations.create(items=[{"role": "user", "content": "Begin."}])
    started = client.responses.create(
        model="demo",
        input="Go on at length.",
        conversation=conversation.id,
        max_output_tokens=900,
        temperature=0,
        background=True,
        extra_body={"ignore_eos": True},
    )
    for event in client.responses.retrieve(started.id, stream=True):
        if event.type == "response.output_text.delta":
            break
    assert client.responses.cancel(started.id).status == "cancelled"
    time.sleep(0.2)
    assert [i.content[0].text for i in client.conversations.items.list(conversation.id)] == ["Begin."]


def test_a_full_conversation_takes_no_more_items(monkeypatch):
    """At `MOST_ITEMS` a conversation refuses more items, and a reply that would add to it, naming the
    field; below it, it takes them."""
    monkeypatch.setattr(conversations, "MOST_ITEMS", 3)
    kept = conversations.Conversations()
    said = [{"type": "message", "id": i, "role": "user", "content": i} for i in "ab"]
    conversation = kept.new(said, {})
    conversation.room(1, "items")
    with pytest.raises(ApiError) as info:
        conversation.room(2, "items")
    assert info.value.param == "items" and "at most 3" in info.value.message
    with pytest.raises(ApiError) as info:
        r.to_chat({"model": "m", "input": "hi", "conversation": conversation.id}, rs.Store(), kept)
    assert info.value.param == "conversation"
    kept.add(conversation.id, [{**said[0], "id": "c"}])
    assert [i["id"] for i in kept.get(conversation.id).items] == ["a", "b", "c"]


def test_conversation_errors_name_their_field(engine: Launched, client):
    conversation = client.conversations.create()
    bad_creates = [
        ({"items": [{"role": "tool", "content": "x"}]}, "items.0.role"),
        ({"items": [{"type": "item_reference", "id": "x"}]}, "items.0.type"),
        ({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ({"metadata": {"k": 3}}, "metadata"),
    ]
    for body, param in bad_creates:
        with pytest.raises(openai.BadRequestError) as info:
            client.conversations.create(extra_body=body)
        assert info.value.body["param"] == param and f"`{param}`" in info.value.body["message"], body
    with pytest.raises(openai.BadRequestError) as info:
        client.conversations.items.create(conversation.id, items=[])
    assert info.value.body["param"] == "items"
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        with pytest.raises(openai.BadRequestError) as info:
            client.conversations.items.list(conversation.id, extra_query=query)
        assert info.value.body["param"] == param, query
    with pytest.raises(openai.NotFoundError) as info:
        client.conversations.items.retrieve("msg_x", conversation_id=conversation.id)
    assert info.value.body["param"] == "item_id"
    first = client.responses.create(model="demo", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model="demo", input="hi", conversation=conversation.id, previous_response_id=first.id
        )
    assert info.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input="hi", extra_body={"conversation": 3})
    assert info.value.body["param"] == "conversation"


def test_truncated_drops_the_oldest_steps_and_keeps_the_task_and_the_input():
    """A step is a user or an assistant message with the tool answers after it; the system messages and the
    first user message stay, and the last step (the input) is never dropped."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "now"},
    ]
    contents = [[m["content"] for m in r.truncated(messages, k) or []] for k in range(4)]
    assert contents == [
        ["s", "task", "", "r1", "a", "now"],
        ["s", "task", "a", "now"],
        ["s", "task", "now"],
        [],
    ]
    assert r.truncated(messages, 3) is None


def _count(engine: Launched, messages: list[dict]) -> int:
    status, body = http(
        "POST",
        f"{engine.url}/tokenize",
        json.dumps({"model": "demo", "messages": messages}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {engine.key}"},
    )
    assert status == 200, body
    return int(json.loads(body)["count"])


def test_truncation_auto_drops_as_few_old_steps_as_make_a_long_conversation_fit(engine: Launched, client):
    """A conversation longer than the demo's 1,024-token context: without ``truncation`` a 400 naming the
    input; with ``"auto"``, the reply to the conversation without as few of its oldest steps as let the
    prompt and the output fit, as the chat endpoint gives it, its usage that prompt's; the conversation
    itself keeps every item."""
    lines = [f"Line {i}: " + " ".join(["Emma walked to Highbury"] * 4) for i in range(12)]
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(lines)]
    conversation = client.conversations.create(items=items)
    ask = dict(
        model="demo", input="And then?", conversation=conversation.id, max_output_tokens=8, temperature=0
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**ask)
    assert info.value.body["param"] == "input" and info.value.body["code"] == "context_length_exceeded"
    reply = client.responses.create(**ask, truncation="auto")
    assert reply.truncation == "auto"
    messages = [{"role": m["role"], "content": m["content"]} for m in items] + [
        {"role": "user", "content": "And then?"}
    ]
    counts = [_count(engine, r.truncated(messages, k)) for k in range(1, 8)]
    fewest = next(k for k, n in enumerate(counts, start=1) if n + 8 <= 1024)
    assert fewest > 1 and counts[fewest - 2] + 8 > 1024  # one step fewer does not fit
    assert reply.usage.input_tokens == counts[fewest - 1]
    kept = r.truncated(messages, fewest)
    assert reply.output_text == _chat(client, kept, 8)
    assert len(list(client.conversations.items.list(conversation.id, limit=100))) == 14


def test_a_kept_replys_input_items_are_listed(client):
    """``GET /v1/responses/{id}/input_items``: the request's input as items with ids, newest first unless
    asked otherwise, in pages the SDK follows; a string input is one user message."""
    said = [("user", "Who is Emma?"), ("assistant", "A heroine."), ("user", "And Harriet?")]
    reply = client.responses.create(
        model="demo",
        input=[{"role": role, "content": text} for role, text in said],
        max_output_tokens=2,
    )
    listed = client.responses.input_items.list(reply.id, order="asc", limit=1)
    assert _texts(listed.data) == said[:1] and listed.has_more
    assert _texts(list(client.responses.input_items.list(reply.id, limit=1))) == said[::-1]
    assert all(item.id for item in listed.data)
    short = client.responses.create(model="demo", input="Hi.", max_output_tokens=2)
    assert _texts(client.responses.input_items.list(short.id)) == [("user", "Hi.")]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list(reply.id, after="msg_x")
    assert info.value.body["param"] == "after"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_x")
