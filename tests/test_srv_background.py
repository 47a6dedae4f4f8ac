"""Background replies of the Responses API (``background: true``): answered at once and followed by their id,
polled, streamed and picked up again after a dropped connection, cancelled and deleted while they run; the
openai SDK against the demo engine started by `strata launch` (CPU), each reply checked against the same
request made without ``background``. And the store that keeps them, without a server."""

from __future__ import annotations

import json
import secrets
import time
from types import SimpleNamespace

import pytest
from srv_helpers import Launched, get_json, http

from strata_runtime.server import responses_store as rs
from strata_runtime.server.background import Run

openai = pytest.importorskip("openai")

ENDED = ("completed", "incomplete", "failed", "cancelled")


def _ask(tokens: int, **more) -> dict:
    question = f"Tell me about Emma {secrets.token_hex(3)}."
    return dict(model="demo", max_output_tokens=tokens, temperature=0, input=question, **more)


def _until_ended(client, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        got = client.responses.retrieve(response_id)
        if got.status in ENDED or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _in_flight(engine: Launched) -> int:
    return int(get_json(f"{engine.url}/v1/status", engine.key)["requests_in_flight"])


def _until_idle(engine: Launched, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while _in_flight(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _in_flight(engine)


def _text(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_reply_is_answered_at_once_and_polled_to_the_foreground_replys_end(client):
    """``background: true`` answers with the response ``queued`` before any output; polled, it ends with the
    text, status and usage of the same greedy request made without ``background``; its kept events, read
    from the start, are numbered in order from ``response.created`` through ``response.queued`` and
    ``response.in_progress`` to ``response.completed`` (or ``incomplete``), their text the reply's; read
    after a cursor, they are the events after it."""
    ask = _ask(40)
    started = client.responses.create(**ask, background=True)
    assert started.status == "queued" and started.background is True and started.output == []
    done = _until_ended(client, started.id)
    fore = client.responses.create(**ask)
    assert fore.background is False
    assert done.status == fore.status and done.output_text == fore.output_text and done.output_text
    assert done.usage.output_tokens == fore.usage.output_tokens
    assert done.usage.input_tokens == fore.usage.input_tokens
    events = list(client.responses.retrieve(started.id, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] == f"response.{done.status}" and events[-1].response.output_text == done.output_text
    assert events[0].response.status == "queued" and _text(events) == done.output_text
    after = list(client.responses.retrieve(started.id, stream=True, starting_after=4))
    assert [e.sequence_number for e in after] == list(range(5, len(events)))
    assert [e.type for e in after] == kinds[5:]


def test_a_streamed_background_reply_is_picked_up_after_its_connection_drops(engine: Launched, client):
    """Streamed with ``background``, the connection is dropped after the reply's first text; the reply runs
    on, and ``GET ...?stream=true&starting_after=N`` gives the events after the last one read, numbered on
    without a gap, the two parts' text together the whole reply's and the foreground reply's."""
    ask = _ask(200, extra_body={"ignore_eos": True})
    read = []
    with client.responses.create(**ask, background=True, stream=True) as stream:
        for event in stream:
            read.append(event)
            if event.type == "response.output_text.delta":
                break
    response_id = read[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=read[-1].sequence_number))
    numbers = [e.sequence_number for e in read + rest]
    assert numbers == list(range(len(numbers)))
    assert rest[-1].type == "response.incomplete"  # ignore_eos: it runs to max_output_tokens
    fore = client.responses.create(**ask)
    assert _text(read) + _text(rest) == rest[-1].response.output_text == fore.output_text
    assert rest[-1].response.usage.output_tokens == 200
    assert _until_idle(engine) == 0


def test_a_background_reply_cancelled_while_it_runs_keeps_its_text_so_far(engine: Launched, client):
    """``POST /v1/responses/{id}/cancel`` on a reply that runs: it ends ``cancelled``, its output the start
    of the foreground reply's text, its stream ends with ``response.cancelled``, its slot is freed; a second
    cancel gives the same object; a conversation cannot go on from it."""
    ask = _ask(900, extra_body={"ignore_eos": True})
    started = client.responses.create(**ask, background=True)
    followed = client.responses.retrieve(started.id, stream=True)
    for event in followed:
        if event.type == "response.output_text.delta":
            break
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.id == started.id
    rest = list(followed)
    assert rest[-1].type == "response.cancelled"  # not among the SDK's events: read as a plain object
    assert rest[-1].response["status"] == "cancelled"
    fore = client.responses.create(**ask)
    so_far = cancelled.output_text
    assert so_far and fore.output_text.startswith(so_far) and len(so_far) < len(fore.output_text)
    assert 0 < cancelled.usage.output_tokens < 900
    again = client.responses.cancel(started.id)
    assert again.model_dump() == cancelled.model_dump()
    assert client.responses.retrieve(started.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**_ask(4), previous_response_id=started.id)
    assert info.value.body["param"] == "previous_response_id" and "is cancelled" in info.value.body["message"]
    assert _until_idle(engine) == 0


def test_a_background_reply_deleted_while_it_runs_stops_and_stays_deleted(engine: Launched, client):
    """``DELETE`` of a running background reply stops it (its slot is freed) and it is not kept again when
    it ends; a finished one cancelled gives its object unchanged."""
    started = client.responses.create(**_ask(900, extra_body={"ignore_eos": True}), background=True)
    for event in client.responses.retrieve(started.id, stream=True):
        if event.type == "response.output_text.delta":
            break
    kept = get_json(f"{engine.url}/v1/status", engine.key)["responses"]
    assert kept["running_in_background"] == 1 and kept["kept"] >= 1
    client.responses.delete(started.id)
    assert _until_idle(engine) == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(started.id)
    assert get_json(f"{engine.url}/v1/status", engine.key)["responses"]["running_in_background"] == 0
    finished = _until_ended(client, client.responses.create(**_ask(6), background=True).id)
    assert finished.status in ("completed", "incomplete")
    assert client.responses.cancel(finished.id).model_dump() == finished.model_dump()


def test_background_errors_name_their_field(engine: Launched, client):
    """``background`` without ``store``, or not a boolean; cancelling a reply made in
    the foreground or one not kept; the events of a foreground reply; a cursor that is not a number."""
    bad = [
        ({"background": True, "store": False}, "store", "`store` cannot be false"),
        ({"background": "yes"}, "background", "must be true or false"),
    ]
    for extra, param, words in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**_ask(4), extra_body=extra)
        assert info.value.body["param"] == param and words in info.value.body["message"], extra
    fore = client.responses.create(**_ask(4))
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(fore.id)
    assert info.value.body["param"] == "response_id" and "not made in the background" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    headers = {"Authorization": f"Bearer {engine.key}"}
    status, body = http("GET", f"{engine.url}/v1/responses/{fore.id}?stream=true", headers=headers)
    assert status == 400 and json.loads(body)["error"]["param"] == "stream"
    back = client.responses.create(**_ask(4), background=True)
    status, body = http(
        "GET", f"{engine.url}/v1/responses/{back.id}?stream=true&starting_after=x", headers=headers
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "starting_after"
    _until_ended(client, back.id)


# ---- the store, without a server ---------------------------------------------------------------------------


def _run(size: int, *, finished: bool) -> Run:
    run = Run(SimpleNamespace(handle=SimpleNamespace(slot=None)), {"status": "queued", "output": []})
    run.write(b"x" * size)
    if finished:
        run.end({"status": "completed", "output": []})
    return run


def test_the_store_keeps_running_replies_and_lets_the_oldest_finished_events_go():
    """Past ``most`` replies the least recently used finished one goes, never one still running; past
    ``event_bytes`` of finished runs' events the oldest runs' events go (their response objects stay)."""
    store = rs.Store(most=2, event_bytes=250)
    running = _run(100, finished=False)
    store.put("a", rs.Kept(None, {}, running))
    store.put("b", rs.Kept([], {}, _run(100, finished=True)))
    old = store.get("b")
    store.put("c", rs.Kept([], {}, _run(100, finished=True)))
    assert store.get("a") is not None and store.get("b") is None and store.get("c") is not None
    store.put("d", rs.Kept([], {}, _run(100, finished=True)))
    assert store.get("a") is not None and store.get("c") is None
    assert old is not None and old.run is not None and old.run.events is not None  # let go, not emptied
    store = rs.Store(most=8, event_bytes=250)
    runs = [_run(100, finished=True) for _ in range(4)]
    for i, run in enumerate(runs):
        store.put(str(i), rs.Kept([], {}, run))
    assert [run.events is None for run in runs] == [True, True, False, False]
    assert all(store.get(str(i)) is not None for i in range(4))
    store.update("gone", rs.Kept([], {}))
    assert store.get("gone") is None
    store.put("x", rs.Kept(None, {"status": "queued"}, running))
    store.update("x", rs.Kept([], {"status": "completed"}, running))
    assert store.get("x").messages == []
