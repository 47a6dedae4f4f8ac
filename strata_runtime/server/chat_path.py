"""What the endpoints of the APIs served over the chat path (`messages_api`, `responses_api`) use of the
server (`app.Server`): reading a body, preparing it as a chat, submitting it, and following its reply."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from . import protocol as p

if TYPE_CHECKING:
    from ..api import TokenLogprob
    from .conversations import Conversations
    from .engine_loop import Stream
    from .replies import Piece, Whole
    from .responses_store import Store
    from .tools import ToolUse


class ServeNames(Protocol):
    """What the server calls its model."""

    model_name: str


class ChatPath(Protocol):
    """The server as those endpoints see it."""

    @property
    def options(self) -> ServeNames: ...

    @property
    def kept(self) -> Store:
        """Replies of the Responses API kept for ``previous_response_id``."""
        ...

    @property
    def conversations(self) -> Conversations:
        """Conversations kept for the Responses API's ``conversation`` (`conversations`)."""
        ...

    async def read_json(self, request: web.Request) -> Any: ...

    async def prepare_chat(self, raw: Any) -> tuple[p.ChatBody, p.Prepared]: ...

    def chat_prompt(self, body: p.ChatBody, tools: ToolUse | None) -> list[int]: ...

    def submit(self, prepared: p.Prepared) -> Stream: ...

    def chat_logprobs(self, prepared: p.Prepared, entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        """Generated tokens' log-probabilities as chat's ``logprobs.content`` entries (none where the
        request did not ask)."""
        ...

    def pieces(self, stream: Stream) -> AsyncIterator[Piece]: ...

    async def collect(self, stream: Stream, prepared: p.Prepared, chat: bool) -> Whole: ...

    def observe(self, stream: Stream) -> None: ...
