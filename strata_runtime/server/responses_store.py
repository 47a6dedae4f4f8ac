"""Replies of the Responses API kept (``store``, the default) for a later request's ``previous_response_id``,
for ``GET /v1/responses/{id}`` (``DELETE`` lets one go) and, for a background reply, its events: in memory,
at most `KEPT`, the least recently used let go first, until the server stops."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .background import Run

KEPT = 256
"""Stored replies kept for ``previous_response_id``, the least recently used let go first."""
EVENT_BYTES = 64 << 20
"""Finished background replies' events kept for a stream picked up again, the oldest replies' let go first."""


@dataclass(frozen=True)
class Kept:
    """A stored reply: the conversation it ends (without the request's ``instructions``, which a later
    request does not inherit; None for a reply that did not end well, or has not ended), the response object
    ``GET`` gives, and the `Run` of one made in the background."""

    messages: list[dict[str, Any]] | None
    response: dict[str, Any]
    run: Run | None = None
    input_items: list[dict[str, Any]] = field(default_factory=list)
    """The request's ``input`` as items (`stored_items`), for ``GET /v1/responses/{id}/input_items``."""

    def now(self) -> dict[str, Any]:
        """The response object as it stands (a background reply's, while it runs)."""
        return self.run.now() if self.run is not None else self.response


class Store:
    """Stored replies by id, at most ``most``, the least recently used let go first (a background reply not
    while it runs); and finished background replies' events, at most ``event_bytes`` of them, the oldest
    replies' let go first."""

    def __init__(self, most: int = KEPT, event_bytes: int = EVENT_BYTES) -> None:
        self.most = most
        self.event_bytes = event_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, kept: Kept) -> None:
        with self._lock:
            self._kept[response_id] = kept
            self._kept.move_to_end(response_id)
            over = len(self._kept) - self.most
            for old in [k for k, v in self._kept.items() if v.run is None or v.run.finished][: max(over, 0)]:
                del self._kept[old]
            ended = [v.run for v in self._kept.values() if v.run is not None and v.run.finished]
            held = sum(run.size for run in ended)
            for run in ended:
                if held <= self.event_bytes:
                    break
                if run.events is not None:
                    held -= run.size
                    run.forget_events()

    def update(self, response_id: str, kept: Kept) -> None:
        """Replace a reply kept, where it still is (one deleted since is not kept again)."""
        with self._lock:
            held = response_id in self._kept
        if held:
            self.put(response_id, kept)

    def counts(self) -> dict[str, int]:
        """How many replies are kept, and how many of them are background replies still running."""
        with self._lock:
            running = sum(1 for v in self._kept.values() if v.run is not None and not v.run.finished)
            return {"kept": len(self._kept), "running_in_background": running}

    def drop(self, response_id: str) -> Kept | None:
        """Let a reply go; what was kept, if it was."""
        with self._lock:
            return self._kept.pop(response_id, None)

    def get(self, response_id: str) -> Kept | None:
        with self._lock:
            found = self._kept.get(response_id)
            if found is not None:
                self._kept.move_to_end(response_id)
            return found
