"""The error a request the server refuses raises: its HTTP status, message and the field at fault, written
as OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) so clients surface it as-is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers or {}
        """HTTP headers of the answer (``Retry-After`` on a 429)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def renamed(self, field_of: Callable[[str | None], str | None]) -> ApiError:
        """This error naming another API's field where the chat path named its own (``field_of`` maps one
        to the other: Anthropic's Messages API, OpenAI's Responses API), in its ``param`` and its message."""
        named = field_of(self.param)
        if self.param is not None and named is not None:
            self.message = self.message.replace(f"`{self.param}`", f"`{named}`")
        self.param = named
        return self
