"""The endpoints of OpenAI's Conversations API, over the conversations the server keeps (`conversations`):
``POST /v1/conversations`` (``items``, at most `FIRST_ITEMS`, and ``metadata``), ``GET``, ``POST`` (new
``metadata``) and ``DELETE /v1/conversations/{id}``; ``GET /v1/conversations/{id}/items`` (a page:
``limit``, ``order``, ``after``), ``POST`` of more items; ``GET`` and ``DELETE`` of one item."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from . import responses
from .chat_path import ChatPath
from .conversations import Conversation
from .errors import ApiError

FIRST_ITEMS = 20
"""Items a conversation may be created with (OpenAI's limit); more are added afterwards."""
ADDED_ITEMS = 20
"""Items one request may add (OpenAI's limit)."""
PAGE = 20
"""Items a list gives without ``limit``; at most 100."""
METADATA_KEYS = 16
"""Keys ``metadata`` may hold (OpenAI's limit), each a string of at most 64 characters, a value of 512."""


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    ok = isinstance(value, dict) and len(value) <= METADATA_KEYS
    ok = ok and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()
    )
    if not ok:
        raise ApiError(
            400,
            f"`metadata` must be an object of at most {METADATA_KEYS} string values (keys of at most 64 "
            "characters, values of at most 512)",
            "metadata",
        )
    return dict(value)


def _items_field(raw: dict[str, Any], most: int, required: bool) -> list[dict[str, Any]]:
    value = raw.get("items")
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise ApiError(400, "`items` must be a list of one or more items", "items")
    if len(value) > most:
        raise ApiError(400, f"`items` may hold at most {most} items (got {len(value)})", "items")
    return responses.stored_items(value, "items") if value else []


async def _object_body(server: ChatPath, request: web.Request) -> dict[str, Any]:
    raw = await server.read_json(request)
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return raw


async def create(server: ChatPath, request: web.Request) -> web.Response:
    """``POST /v1/conversations``: a new conversation, with ``items`` and ``metadata`` where given."""
    raw = await _object_body(server, request)
    items = _items_field(raw, FIRST_ITEMS, required=False)
    return web.json_response(server.conversations.new(items, _metadata(raw.get("metadata"))).body())


async def get(server: ChatPath, request: web.Request) -> web.Response:
    return web.json_response(server.conversations.get(request.match_info["conversation_id"]).body())


async def update(server: ChatPath, request: web.Request) -> web.Response:
    """``POST /v1/conversations/{id}``: its ``metadata`` replaced."""
    conversation = server.conversations.get(request.match_info["conversation_id"])
    raw = await _object_body(server, request)
    if "metadata" not in raw:
        raise ApiError(400, "`metadata` is required: the conversation's new metadata", "metadata")
    conversation.metadata = _metadata(raw["metadata"])
    return web.json_response(conversation.body())


async def delete(server: ChatPath, request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    server.conversations.drop(conversation_id)
    return web.json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def list_items(server: ChatPath, request: web.Request) -> web.Response:
    """``GET /v1/conversations/{id}/items``: a page of its items (`page`)."""
    conversation = server.conversations.get(request.match_info["conversation_id"])
    return web.json_response(page(conversation.items, request.query, "the conversation"))


def page(items: list[dict[str, Any]], query: Mapping[str, str], holder: str) -> dict[str, Any]:
    """A page of ``items`` (each with an ``id``) as OpenAI lists them: newest first (``order=desc``, the
    default) or oldest first, those after the item ``after``, at most ``limit`` (1 to 100, `PAGE` by
    default), with ``first_id``, ``last_id`` and ``has_more``; 400s naming the parameter at fault (an
    ``after`` that ``holder`` does not hold among them)."""
    limit = query.get("limit", str(PAGE))
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise ApiError(400, "`limit` must be a whole number from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, '`order` must be "asc" or "desc"', "order")
    items = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ApiError(400, f"`after`: {holder} holds no item `{after}`", "after")
        items = items[at + 1 :]
    return _page(items[: int(limit)], len(items) > int(limit))


def _page(items: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": more,
    }


async def add_items(server: ChatPath, request: web.Request) -> web.Response:
    """``POST /v1/conversations/{id}/items``: ``items`` added at its end; the items as kept."""
    conversation = server.conversations.get(request.match_info["conversation_id"])
    items = _items_field(await _object_body(server, request), ADDED_ITEMS, required=True)
    conversation.room(len(items), "items")
    server.conversations.add(conversation.id, items)
    return web.json_response(_page(items, False))


async def get_item(server: ChatPath, request: web.Request) -> web.Response:
    conversation = server.conversations.get(request.match_info["conversation_id"])
    return web.json_response(_item(conversation, request.match_info["item_id"])[1])


async def delete_item(server: ChatPath, request: web.Request) -> web.Response:
    """``DELETE /v1/conversations/{id}/items/{item_id}``: the item taken out; the conversation object."""
    conversation = server.conversations.get(request.match_info["conversation_id"])
    at, _ = _item(conversation, request.match_info["item_id"])
    del conversation.items[at]
    return web.json_response(conversation.body())


def _item(conversation: Conversation, item_id: str) -> tuple[int, dict[str, Any]]:
    for i, item in enumerate(conversation.items):
        if item["id"] == item_id:
            return i, item
    raise ApiError(404, f"conversation `{conversation.id}` holds no item `{item_id}`", "item_id")
