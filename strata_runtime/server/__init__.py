"""The engine's OpenAI-compatible HTTP server.

`protocol` turns OpenAI request bodies into engine requests and back (pure), `engine_loop` runs the one engine
thread and bridges its events to asyncio, `metrics` writes the Prometheus page, and `app` is the aiohttp
server with its routes, authentication and shutdown.
"""

from .app import ServeOptions, Server

__all__ = ["ServeOptions", "Server"]
