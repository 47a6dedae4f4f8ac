"""`strata status`: which launches it lists, the state it reads for each, and its exit code.

The ready engine's report (from ``/v1/status``, with and without the API key) is tested against a launched
demo engine in tests/test_srv_openai.py; here the launches are run directories with a plan, a stand-in
``/health`` server, and the supervisor's liveness set by the test.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from srv_helpers import DEMO, HealthStandIn, free_port

from strata_cfg.commands import status
from strata_cfg.launch.run_dir import ENGINE_START_MARK, RunDir
from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.plan_file import write_plan


@pytest.fixture
def serving() -> Iterator[tuple[int, type[HealthStandIn]]]:
    handler = type("Health", (HealthStandIn,), {"answer": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


def _run(root: Path, name: str, port: int, engine_id: str = "this-run") -> RunDir:
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    write_plan(resolve_profile(DEMO, [("serve.port", port)]), run.plan)
    run.engine_id_file.write_text(f"{engine_id}\n")
    run.engine_log.write_bytes(ENGINE_START_MARK + b"1 at ...\nloading\n" + ENGINE_START_MARK + b"2 at ...\n")
    return run


def _live(monkeypatch: pytest.MonkeyPatch, *running: RunDir) -> None:
    """The supervisors of ``running`` live (pid 4242); every other run's is gone."""
    paths = {r.path for r in running}
    monkeypatch.setattr(status, "live_supervisor", lambda run: 4242 if run.path in paths else None)


def _args(target: str | None, root: Path, everything: bool = False) -> Any:
    return type("Args", (), {"target": target, "runs_root": root, "all": everything, "json": True})()


def test_a_launch_is_ready_only_when_its_own_engine_answers(tmp_path, serving, monkeypatch, capsys):
    port, handler = serving
    run = _run(tmp_path, "demo-1", port)
    _live(monkeypatch, run)
    handler.answer = {"status": "ok", "engine_id": "another-run"}
    got = status.report(run)
    assert got["state"] == "another server" and f"127.0.0.1:{port}/health" in got["error"]
    assert got["engine_starts"] == 2 and got["launcher_pid"] == 4242
    handler.code, handler.answer = 503, {"status": "loading", "progress": "layers", "engine_id": "this-run"}
    assert status.report(run)["state"] == "loading"
    assert status.run(_args(str(run.path), tmp_path)) == 1  # listed, running, not ready
    handler.answer = {"status": "failed", "error": "RuntimeError: x", "engine_id": "this-run"}
    got = status.report(run)
    assert got["state"] == "failed" and got["error"] == "RuntimeError: x"
    assert "  RuntimeError: x" in status.lines(got)
    capsys.readouterr()


def test_a_launch_whose_engine_answers_nothing_or_whose_launcher_is_gone(tmp_path, monkeypatch):
    quiet, gone = _run(tmp_path, "demo-1", free_port()), _run(tmp_path, "demo-2", free_port())
    _live(monkeypatch, quiet)
    assert status.report(quiet)["state"] == "not answering"
    stopped = status.report(gone)
    assert stopped["state"] == "stopped" and stopped["launcher_pid"] is None
    assert status.lines(stopped)[0].startswith("demo: stopped (it served http://127.0.0.1:")


def test_which_launches_are_listed_and_the_exit_code(tmp_path, serving, monkeypatch, capsys):
    port, handler = serving
    handler.answer = {"status": "ok", "engine_id": "this-run"}
    monkeypatch.setattr(status, "_status", lambda url, key: {})  # a stand-in has no /v1/status
    old = _run(tmp_path, "demo-20261201-000000", free_port())
    ready = _run(tmp_path, "demo-20261207-000000", port)
    other = _run(tmp_path, "other-20261207-000000", free_port())
    _live(monkeypatch)
    assert status.run(_args(None, tmp_path)) == 1
    assert "no launch under" in json.loads(capsys.readouterr().out)["why"]
    _live(monkeypatch, ready)
    assert status.run(_args(None, tmp_path)) == 0  # only the running one, and it is ready
    listed = json.loads(capsys.readouterr().out)["launches"]
    assert [r["run_dir"] for r in listed] == [str(ready.path)] and listed[0]["state"] == "ready"
    assert status.run(_args(None, tmp_path, everything=True)) == 0  # the stopped ones do not count against
    assert {r["run_dir"] for r in json.loads(capsys.readouterr().out)["launches"]} == {
        str(r.path) for r in (old, ready, other)
    }
    assert status.run(_args("other", tmp_path)) == 1  # a profile whose launches are all stopped
    assert "no launch of profile `other` under" in json.loads(capsys.readouterr().out)["why"]
    assert status.run(_args("nothing", tmp_path)) == 1
    assert "no launch of profile `nothing`" in json.loads(capsys.readouterr().out)["why"]
    _live(monkeypatch, ready, other)
    assert status.run(_args(None, tmp_path)) == 1  # one running launch does not answer
    states = {r["run_dir"]: r["state"] for r in json.loads(capsys.readouterr().out)["launches"]}
    assert states == {str(ready.path): "ready", str(other.path): "not answering"}
