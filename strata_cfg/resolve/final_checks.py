"""Step 9: the checks on the finished plan: a server exposed without an API key, and strict mode, which
makes every decision that overrode what the profile asked for an error."""

from __future__ import annotations

from ..schema.profile import is_loopback
from .ledger import Ledger


def serve_exposure(led: Ledger) -> None:
    """A non-loopback host without an API key: a note marked as asked for, so strict mode refuses it."""
    host = led["serve.host"]
    if not is_loopback(host) and not led["serve.api_key_env"]:
        led.note(
            "serve.exposed",
            "serve.host",
            f"serve.host = {host!r} exposes the model to the network with no API key; set serve.api_key_env",
            requested=True,
        )


def strict_mode(led: Ledger) -> None:
    """Strict mode: every decision that overrode or turned off what the user asked for is an error."""
    for d in led.decisions:
        if d.requested:
            led.refuse(d.rule, d.key, f"strict: {d.message}")
