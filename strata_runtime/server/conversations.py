"""Conversations the server keeps (OpenAI's Conversations API, served by `conversations_api`): their items
(messages, function calls and their outputs, reasoning) in order, for the Responses API's ``conversation``,
which reads a conversation's items before its input and adds its input and its output to it when the reply
ends well. Kept in memory, at most `KEPT` conversations, the least recently used let go first, until the
server restarts.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from . import protocol as p
from .errors import ApiError

KEPT = 256
"""Conversations kept, the least recently used let go first."""
MOST_ITEMS = 4096
"""Items a conversation holds at most (a request that would add more is refused)."""


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)

    def room(self, more: int, param: str) -> None:
        """A 400 naming ``param`` where ``more`` items would take the conversation past `MOST_ITEMS`."""
        if len(self.items) + more > MOST_ITEMS:
            raise ApiError(
                400,
                f"`{param}`: conversation `{self.id}` holds {len(self.items)} items, and a conversation "
                f"keeps at most {MOST_ITEMS}; start another",
                param,
            )

    def body(self) -> dict[str, Any]:
        """The conversation object."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }


class Conversations:
    """Conversations by id, at most ``most``, the least recently used let go first."""

    def __init__(self, most: int = KEPT) -> None:
        self.most = most
        self._kept: OrderedDict[str, Conversation] = OrderedDict()
        self._lock = threading.Lock()

    def new(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> Conversation:
        conversation = Conversation(p.new_id("conv", "_"), int(time.time()), metadata, items)
        with self._lock:
            self._kept[conversation.id] = conversation
            while len(self._kept) > self.most:
                self._kept.popitem(last=False)
        return conversation

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        """The conversation, or a 404 naming ``param``."""
        with self._lock:
            found = self._kept.get(conversation_id)
            if found is not None:
                self._kept.move_to_end(conversation_id)
        if found is None:
            raise ApiError(
                404,
                f"no conversation `{conversation_id}` (this server keeps the last {self.most} conversations, "
                "in memory, until it restarts)",
                param,
                code="conversation_not_found",
            )
        return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def drop(self, conversation_id: str) -> None:
        self.get(conversation_id)
        with self._lock:
            self._kept.pop(conversation_id, None)

    def add(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Add ``items`` (stored already) to a conversation that may have been deleted since."""
        with self._lock:
            found = self._kept.get(conversation_id)
            if found is not None:
                found.items += items
