"""Readiness is this launch's engine answering, never another server on the same port.

Each run directory has an engine id, which the launcher passes to every engine it starts and the engine
reports in ``/health``. A stand-in server that answers ``/health`` 200 with another id (the other launch of
two that raced for one port) must not make a launch "ready", nor its supervisor "ready again": the loser's
engine cannot listen, and the launch exits 1 saying that the port is taken.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from srv_helpers import HealthStandIn, alive, launch, wait_for

from strata_cfg.launch.engine_process import engine_command
from strata_cfg.launch.health import wait_ready
from strata_cfg.launch.options import LaunchOptions
from strata_cfg.launch.run_dir import RunDir
from strata_cfg.launch.supervisor import Supervisor
from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.plan_file import write_plan


@pytest.fixture
def other_server() -> Iterator[tuple[int, type[HealthStandIn]]]:
    """A server on a port of its own that answers /health 200 with the engine id the test sets."""
    handler = type("Health", (HealthStandIn,), {"answer": {"status": "ok", "engine_id": "someone-else"}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


FAST = LaunchOptions(max_restarts=1, backoff_s=0.1, poll_s=0.05, start_timeout_s=60.0, grace_s=5.0)


def _wait(url: str, said: list[str], alive_polls: int | None) -> str:
    """`wait_ready` for engine ``mine``, whose process "dies" after ``alive_polls`` polls (None: never), as
    the loser's engine does when it cannot listen."""
    polls = iter(range(1000))
    return wait_ready(
        url,
        engine_id="mine",
        running=lambda: alive_polls is None or next(polls) < alive_polls,
        stopping=lambda: False,
        options=FAST,
        say=said.append,
    )


def test_a_ready_answer_counts_only_with_this_launchs_engine_id(other_server):
    port, handler = other_server
    url = f"http://127.0.0.1:{port}"
    said: list[str] = []
    assert _wait(url, said, alive_polls=5) == "taken"
    assert any("another server answers" in s and "someone-else" in s for s in said)
    handler.answer = {"status": "ok"}  # a server that gives no engine id is not this launch's either
    assert _wait(url, said, alive_polls=3) == "taken"
    handler.answer = {"status": "ok", "engine_id": "mine"}
    assert _wait(url, said, alive_polls=None) == "ready"


def test_the_run_directory_keeps_one_engine_id_and_the_engine_is_given_it(tmp_path):
    run = RunDir(tmp_path)
    first = run.engine_id()
    assert len(first) == 16 and run.engine_id() == first == RunDir(tmp_path).engine_id()
    (tmp_path / "other").mkdir()
    assert RunDir(tmp_path / "other").engine_id() != first
    cmd = engine_command(run.plan, first)
    assert cmd[cmd.index("--engine-id") + 1] == first
    assert "--engine-id" not in engine_command(run.plan)


def test_a_launch_whose_port_another_engine_holds_exits_1_and_never_says_ready(tmp_path: Path, other_server):
    port, _ = other_server
    plan = resolve_profile(None)
    assert plan.serve is not None
    plan = plan.model_copy(update={"serve": plan.serve.model_copy(update={"port": port})})
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    write_plan(plan, run.plan)
    said: list[str] = []
    readied: list[bool] = []
    code = Supervisor(run, plan, FAST, say=said.append).run(on_ready=lambda: readied.append(True))
    text = "\n".join(said)
    assert code == 1, text
    assert not readied, text
    assert "ready again" not in text
    assert f"another server already answers on http://127.0.0.1:{port}" in text
    assert "choose another serve.port" in text
    assert "cannot listen" in text  # the engine's own log line, in the tail the supervisor shows
    assert "restarting" not in text  # a restart cannot help while the port is taken


def _bind_when_free(port: int, handler: type[HealthStandIn]) -> ThreadingHTTPServer:
    """A server on ``port`` as soon as a killed engine's listener is gone: its main thread shows as exited a
    moment before its other threads have closed their files."""
    deadline = time.monotonic() + 0.8
    while True:
        try:
            return ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_a_supervisor_whose_port_is_taken_while_it_restarts_gives_up_instead_of_ready_again(tmp_path):
    launched = launch(tmp_path)
    try:
        port = int(launched.url.rsplit(":", 1)[1])
        engine = launched.engine_pid()
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: not alive(engine), 10, "the engine to die")
        handler = type(
            "Health", (HealthStandIn,), {"answer": {"status": "ok", "engine_id": "the-other-launch"}}
        )
        server = _bind_when_free(port, handler)  # in the port before the restart, a second later
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert launched.proc.wait(timeout=60) == 1
        finally:
            server.shutdown()
            server.server_close()
    finally:
        launched.stop()
    out = launched.output()
    assert "restarting in" in out
    assert "ready again" not in out
    assert f"giving up: another server already answers on http://127.0.0.1:{port}" in out


def test_the_tuis_engine_is_not_ready_when_another_server_answers_on_its_port(other_server, tmp_path):
    """The TUI's indicator and launch page read the same answer: another engine's id is not this one up."""
    from strata_cfg.plan.from_profile import resolve_text
    from strata_cfg.tui.engine import Engine

    port, handler = other_server
    text = (Path(__file__).resolve().parent.parent / "profiles" / "demo.toml").read_text()
    plan = resolve_text(text.replace("port = 8000", f"port = {port}"), "demo.toml").plan
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    engine = Engine(run, plan)
    assert not engine.look().ready  # "someone-else" holds the port
    handler.answer = {"status": "ok", "engine_id": run.engine_id()}
    assert engine.look().ready


def test_an_engine_that_answers_nothing_is_taken_for_hung_and_started_again(tmp_path):
    """An engine whose process runs no Python at all (here stopped by SIGSTOP; in practice a driver call
    that never returns while it holds the interpreter's lock) answers nothing, and its own step watchdog
    cannot act. The supervisor, which asks ``/health``, stops it once nothing answered for
    ``--liveness-timeout`` and starts it again; while the engine answers it is left alone."""
    launched = launch(tmp_path, extra=("--liveness-timeout", "2", "--grace", "1"))
    try:
        first = launched.engine_pid()
        time.sleep(4)  # twice the bound, answering: kept
        assert launched.engine_pid() == first and "taking it for hung" not in launched.output()
        os.kill(first, signal.SIGSTOP)
        wait_for(lambda: "ready again" in launched.output(), 60, "the engine started again")
        assert not alive(first) and launched.engine_pid() != first
    finally:
        launched.stop()
    out = launched.output()
    said = next(line for line in out.splitlines() if "has not answered" in line)
    assert "/health for " in said and "(the bound: 2 s, --liveness-timeout); taking it for hung" in said
    assert "the engine was killed by SIGKILL" in out  # SIGTERM waits while it is stopped; SIGKILL does not
