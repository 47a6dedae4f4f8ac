"""The engine's OpenAI-compatible HTTP server.

`protocol` turns OpenAI request bodies into engine requests and back (pure), `engine_loop` runs the one engine
thread and bridges its events to asyncio, `metrics` writes the Prometheus page, `app` is the aiohttp
server with its routes, authentication and shutdown, and `connection` is what aiohttp does outside the routes
(the access log, and its own refusals answered as OpenAI errors).
"""

from .app import ServeOptions, Server

__all__ = ["ServeOptions", "Server"]
