"""A reply made in the background (the Responses API's ``background: true``): it runs on after the request
that made it has been answered, and is followed by its id. A `Run` keeps the events the reply has written, in
order (so a client that lost its stream picks it up after the last event it read), the response object as
it stands, and the engine request it waits on, which ``cancel`` stops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from .engine_loop import Stream


class Run:
    """One background reply: its events (an event's index is its ``sequence_number``), the response object as
    it stands, and the engine request it follows."""

    def __init__(self, stream: Stream, response: dict[str, Any]) -> None:
        self.stream = stream
        self.response = response
        """The response object as it stands: ``queued``, ``in_progress``, then as it ended."""
        self.events: list[bytes] | None = []
        """Every event written so far, or None once let go (`forget_events`)."""
        self.size = 0
        """The bytes of those events."""
        self.finished = False
        self.task: asyncio.Task[None] | None = None
        """What writes the reply (held here so it lives while the run does)."""
        self._more = asyncio.Event()
        """Set, and replaced, when an event is written or the run ends: what a follower waits on."""

    @property
    def status(self) -> str:
        """``queued`` until the engine has given the request a slot, then as the response object says."""
        status: str = self.response["status"]
        if status == "queued" and self.stream.handle.slot is not None:
            return "in_progress"
        return status

    def now(self) -> dict[str, Any]:
        """The response object as it stands, its status up to date."""
        return {**self.response, "status": self.status}

    def write(self, chunk: bytes) -> None:
        assert self.events is not None and not self.finished
        self.events.append(chunk)
        self.size += len(chunk)
        self._wake()

    def end(self, response: dict[str, Any]) -> None:
        """The run ended with ``response`` (its last event already written)."""
        self.response, self.finished = response, True
        self._wake()

    def cancel(self) -> None:
        """Ask the engine to stop the reply; the run then ends ``cancelled`` (unless it finished first)."""
        self.stream.cancel()

    async def ended(self) -> None:
        while not self.finished:
            await self._more.wait()

    def forget_events(self) -> None:
        """Let a finished run's events go: the response object stays, a stream can no longer be picked up."""
        assert self.finished
        self.events, self.size = None, 0

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The events after number ``after`` (-1: all of them), those to come as they are written, until the
        run ends."""
        at = after + 1
        while True:
            events = self.events
            if events is None:
                return
            while at < len(events):
                yield events[at]
                at += 1
            if self.finished:
                return
            await self._more.wait()

    def _wake(self) -> None:
        more, self._more = self._more, asyncio.Event()
        more.set()
