"""The engine: what runs a plan's requests, from admission to the events a caller reads.

`scheduler` (the `Engine`) admits requests into slots and picks each window (a `job`); `executor` launches a
window through the model's stages as a `flight` and, once it is done, decides its rows; `speculative` is
draft, verify and commit; `slot` holds one request's decode state and turns its tokens into events;
`sampling` chooses tokens.
"""

from .scheduler import Engine

__all__ = ["Engine"]
