"""systemd's notifications from `strata serve` (`strata_runtime.server.notify`): ``READY=1`` once the engine
is ready, the watchdog's pings while it runs, ``STOPPING=1`` at the end, on a Unix datagram socket as
systemd's ``NOTIFY_SOCKET``; nothing at all without one."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from srv_helpers import DEMO

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server
from strata_runtime.server.notify import WATCHDOG_SHARE, Notifier


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


def _received(sock: socket.socket) -> list[tuple[float, str]]:
    out = []
    while True:
        try:
            out.append((time.monotonic(), sock.recv(4096).decode()))
        except BlockingIOError:
            return out


def test_a_served_engine_tells_systemd_it_is_ready_pings_its_watchdog_and_says_it_stops(
    tmp_path, monkeypatch
):
    path = tmp_path / "notify"
    sock = _listening(path)
    period = 0.8
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", str(int(period * 1e6)))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    plan = resolve_profile(DEMO)
    seen: dict[str, Any] = {}

    got: list[tuple[float, str]] = []

    def slow_load(progress: Any) -> Engine:  # a load that takes a second, as a big model's takes minutes
        time.sleep(1.0)
        return Engine(plan, progress=progress)

    async def listen() -> None:  # each message with when it came
        while True:
            got.extend(_received(sock))
            await asyncio.sleep(0.005)

    async def scenario() -> int:
        listener = asyncio.create_task(listen())
        options = ServeOptions(host="127.0.0.1", port=0, model_name="demo", api_key=None)
        server, stop = (
            Server(plan, slow_load, options),
            asyncio.Event(),
        )
        task = asyncio.create_task(server.serve(stop))
        while server.engine is None or server.engine.state != "ready":
            await asyncio.sleep(0.02)
        seen["ready_at"] = time.monotonic()
        seen["port"] = server.port
        await asyncio.sleep(1.5)  # serving: the watchdog's pings
        stop.set()
        code = await task
        await asyncio.sleep(0.05)
        listener.cancel()
        return code

    assert asyncio.run(scenario()) == 0
    got.extend(_received(sock))
    texts = [t for _, t in got]
    assert texts[0] == f"STATUS=loading `demo`\nMAINPID={os.getpid()}"
    ready = next(i for i, t in enumerate(texts) if t.startswith("READY=1"))
    assert texts[ready] == f"READY=1\nSTATUS=serving `demo` on http://127.0.0.1:{seen['port']}"
    assert got[ready][0] - got[0][0] >= 1.0  # not before the engine was ready
    assert got[ready][0] <= seen["ready_at"] + 0.5  # and within a poll of it
    loading = [at for at, t in got[:ready] if t == "WATCHDOG=1"]
    assert len(loading) >= 3  # the pings go on while the engine loads on its own thread
    assert texts[-1] == "STOPPING=1\nSTATUS=stopping"
    pings = [at for at, t in got if t == "WATCHDOG=1"]
    serving = [at for at in pings if got[ready][0] <= at <= got[-1][0]]
    assert len(serving) >= 4  # a quarter period apart over 1.5 s: about 7
    gaps = [b - a for a, b in zip(serving, serving[1:], strict=False)]
    assert max(gaps) < period / 2 and min(gaps) > period / WATCHDOG_SHARE / 2


def test_the_watchdog_is_another_process_s_or_absent_and_without_a_socket_nothing_is_sent(tmp_path):
    assert Notifier.from_env({}).address is None
    path = str(tmp_path / "n")
    theirs = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "500000", "WATCHDOG_PID": "1"})
    assert theirs.address == path and theirs.watchdog_s is None  # systemd watches pid 1, not us
    ours = Notifier.from_env(
        {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}
    )
    assert ours.watchdog_s == pytest.approx(0.5)
    assert Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "soon"}).watchdog_s is None
    Notifier(None, 1.0).send("READY=1")  # nothing to send to: no error
    Notifier(str(tmp_path / "absent"), None).send("READY=1")  # nobody listening: logged, not raised


def test_an_abstract_socket_address_is_reached_too():
    name = f"strata-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    Notifier("@" + name, None).send("READY=1", "STATUS=x")
    assert sock.recv(4096) == b"READY=1\nSTATUS=x"
    sock.close()
