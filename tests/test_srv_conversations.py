"""OpenAI's Conversations API and the Responses API's ``conversation``: the openai SDK against the demo engine
started by `strata launch` (CPU). A reply on a conversation is the chat endpoint's reply to its items and the
input, and adds the input and the reply to it; its items are listed in pages, added, read and taken out;
what cannot be done is an error naming the field."""

from __future__ import annotations

import secrets
import time

import pytest
from srv_helpers import Launched, launch

from strata_runtime.server import conversations
from strata_runtime.server import responses as r
from strata_runtime.server.errors import ApiError

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    launched = launch(tmp_path_factory.mktemp("conversations"), key=secrets.token_urlsafe(16))
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def client(engine: Launched):
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key=engine.key, max_retries=0, timeout=60)


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
        r.to_chat({"model": "m", "input": "hi", "conversation": conversation.id}, r.Store(), kept)
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
