"""systemd's service notifications (``sd_notify``), for `strata serve` run by a systemd unit.

Under a unit of ``Type=notify`` systemd passes ``NOTIFY_SOCKET``, and the server tells it ``READY=1`` once the
engine is ready (so that units ordered after it start only then), ``STATUS=...`` lines on the way, and
``STOPPING=1`` when it stops. With ``WatchdogSec=`` set, systemd also passes ``WATCHDOG_USEC``, and the
server sends ``WATCHDOG=1`` at a quarter of that period from its event loop: a process that no longer runs
Python at all (a driver call that never returns while it holds the interpreter's lock), which the engine's
own step watchdog cannot end, stops sending, and systemd restarts it.

The protocol is one datagram per message on a Unix socket (an abstract one where the path starts with
``@``); nothing here needs systemd's libraries. Without ``NOTIFY_SOCKET`` every call does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger("strata_runtime.server")

WATCHDOG_SHARE = 4
"""Pings per watchdog period: systemd's advice is at least two."""


class Notifier:
    """Sends systemd's notifications where it asked for them (`from_env`)."""

    def __init__(self, address: str | None, watchdog_s: float | None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        """systemd's watchdog period in seconds, where it watches this process; None otherwise."""
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """From systemd's variables: ``NOTIFY_SOCKET``, and ``WATCHDOG_USEC`` where ``WATCHDOG_PID`` is
        absent or this process's."""
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        watchdog = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if address and usec and (not pid or pid == str(os.getpid())):
            try:
                watchdog = int(usec) / 1e6 if int(usec) > 0 else None
            except ValueError:
                watchdog = None
        return cls(address, watchdog)

    def send(self, *lines: str) -> None:
        """One notification of ``lines`` (``READY=1``, ``STATUS=...``); a failure is logged once, never
        raised: systemd's bookkeeping must not stop the server."""
        if not self.address:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto("\n".join(lines).encode(), target)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify systemd at %s: %s", self.address, exc)
                self._warned = True

    async def run(self, ready: Callable[[], bool], status: Callable[[], str]) -> None:
        """Until cancelled: ``READY=1`` once ``ready()``, with ``status()`` as its STATUS line, and the
        watchdog's pings throughout (loading included: the load runs on the engine's thread, and the event
        loop that sends them keeps running meanwhile)."""
        if not self.address:
            return
        loop = asyncio.get_running_loop()
        told, ping = False, loop.time()
        while True:
            now = loop.time()
            if not told and ready():
                self.send("READY=1", f"STATUS={status()}")
                told = True
            if self.watchdog_s and now >= ping:
                self.send("WATCHDOG=1")
                ping = now + self.watchdog_s / WATCHDOG_SHARE
            if told and not self.watchdog_s:
                return
            wait = ping - now if self.watchdog_s else READY_POLL_S
            await asyncio.sleep(min(wait, READY_POLL_S) if not told else wait)


READY_POLL_S = 0.2
"""How often the notifier looks whether the engine is ready yet."""
