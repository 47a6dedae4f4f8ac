"""Launching from `strata tui`, driven with Pilot: the launcher's refusals, a real engine started, watched and
stopped, and an engine that stays in sight (and stoppable) after its page is closed."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from srv_helpers import free_port
from textual.widgets import Static
from tui_helpers import DEMO, app_on, pilot_test, plain, settle, until, work_on_copies

from strata_cfg.launch.run_dir import RunDir, find_runs, live_supervisor, new_run_dir
from strata_cfg.launch.supervisor import stop_run
from strata_cfg.plan.from_profile import resolve_path
from strata_cfg.schema.plan_file import write_plan
from strata_cfg.tui.app import StrataApp
from strata_cfg.tui.engine import Engine, EngineState, health_text, indicator_text
from strata_cfg.tui.screens.launch import LaunchScreen

SIZE = (160, 48)


@pytest.fixture
def profiles(tmp_path, monkeypatch) -> Path:
    return work_on_copies(tmp_path, monkeypatch)


def _demo_on_a_free_port(profiles: Path) -> int:
    port = free_port()
    demo = profiles / "demo.toml"
    demo.write_text(demo.read_text().replace("port = 8000", f"port = {port}"))
    return port


def _indicator(app: StrataApp) -> str:
    """The engine indicator beside the status line, "" while it is hidden."""
    shown = [w for w in app.query("#engine").results(Static) if w.display]
    return plain(shown[0].content) if shown else ""


def _shown(screen: LaunchScreen, part: str) -> str:
    return plain(screen.query_one(f"#launch-{part}", Static).content)


@pilot_test
async def test_launch_refuses_a_profile_without_serve_and_starts_nothing(profiles, tmp_path):
    oneshot = profiles / "oneshot.toml"
    oneshot.write_text((profiles / "demo.toml").read_text().split("[serve]")[0])
    app = app_on(str(oneshot), runs_root=tmp_path / "runs")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert isinstance(app.screen, LaunchScreen)
        shown = plain(app.screen.query_one("#launch-summary", Static).content)
        assert "has no [serve] table" in shown
        await pilot.press("enter")
        await pilot.pause()
        assert not (tmp_path / "runs").exists()


@pilot_test
async def test_launch_asks_to_save_first(profiles):
    app = app_on(DEMO)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        app.editor.focus()
        await pilot.press("x")
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert not isinstance(app.screen, LaunchScreen)


@pilot_test
async def test_a_launched_engine_stays_in_sight_after_its_page_closes_and_ctrl_l_reopens_it(
    profiles, tmp_path
):
    port = _demo_on_a_free_port(profiles)
    runs = tmp_path / "runs"
    app = app_on(DEMO, runs_root=runs)
    run: RunDir | None = None
    try:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert _indicator(app) == ""  # nothing launched yet
            await pilot.press("ctrl+l")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, LaunchScreen)
            assert "batch: 2 slot(s), 1 group(s), serial, batch MTP on" in _shown(screen, "summary")
            await pilot.press("enter")
            run = screen.run_dir
            assert run is not None and run.plan.is_file() and find_runs(runs) == [run]
            # The tiny engine loads in seconds; allow a slow CI machine.
            await until(pilot, lambda: "ready at" in _shown(screen, "health"), 60, "for the engine")
            assert f"ready at http://127.0.0.1:{port}/v1" in _shown(screen, "health")
            log = _shown(screen, "log")
            assert "starting the engine (pid" in log  # the supervisor's own output
            assert "engine ready in" in log.split("engine log")[1]  # the engine log's tail

            # Esc closes the page; the engine stays in sight beside the status line.
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, LaunchScreen)
            assert _indicator(app) == f"engine demo :{port} ready"

            # Ctrl+L shows its page again, instead of a new launch that would find its port in use.
            await pilot.press("ctrl+l")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, LaunchScreen) and screen.run_dir == run and not screen.can_start
            assert "in use" not in _shown(screen, "summary")
            await until(pilot, lambda: "ready at" in _shown(screen, "health"), 10, "for the page to show it")

            # Quitting asks about it; cancelling keeps both the app and the engine.
            await pilot.press("escape", "ctrl+q")
            await pilot.pause()
            assert "The engine of demo is running" in getattr(app.screen, "question", "")
            await pilot.press("escape")
            await pilot.pause()
            assert app.return_code is None and live_supervisor(run) is not None

            # `s` on its page stops it, as `strata stop` does; the indicator says so; quitting asks no more.
            await pilot.press("ctrl+l")
            await pilot.pause()
            await pilot.press("s")
            await until(pilot, lambda: live_supervisor(run) is None, 30, "for the engine to stop")
            assert "the engine stopped cleanly" in run.launch_log.read_text()
            await until(pilot, lambda: _indicator(app) == f"engine demo :{port} stopped", 10)
            await pilot.press("escape", "ctrl+q")
            await pilot.pause()
            assert app.return_code == 0
    finally:
        if run is not None:
            stop_run(run, grace_s=20)


@pilot_test
async def test_ctrl_l_finds_an_engine_left_running_and_quitting_can_stop_it(profiles, tmp_path):
    """An engine an earlier session left running: Ctrl+L shows its page rather than a launch refused for a
    busy port, the indicator shows it, and Ctrl+Q offers to stop it. The supervisor is a stand-in: a
    process whose command line names strata (as the launcher checks) and that ends on SIGTERM."""
    port = _demo_on_a_free_port(profiles)
    runs = tmp_path / "runs"
    plan = resolve_path(profiles / "demo.toml").plan
    run = RunDir(new_run_dir(plan.profile, runs))
    write_plan(plan, run.plan)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "strata-stand-in"])
    run.launch_pid.write_text(f"{stand_in.pid}\n")
    try:
        app = app_on(DEMO, runs_root=runs)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("ctrl+l")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, LaunchScreen) and screen.run_dir == run and not screen.can_start
            await pilot.press("escape")
            await until(pilot, lambda: _indicator(app) == f"engine demo :{port} starting", 10)

            await pilot.press("ctrl+q")
            await pilot.pause()
            assert f"(run {run.path.as_posix()})" in getattr(app.screen, "question", "")
            await pilot.press("s")  # stop it and quit
            await until(pilot, lambda: app.return_code is not None, 30, "for the app to quit")
            assert stand_in.poll() is not None
    finally:
        stand_in.kill()
        stand_in.wait()


def test_the_indicator_says_how_far_loading_has_come(profiles, tmp_path):
    port = _demo_on_a_free_port(profiles)
    plan = resolve_path(profiles / "demo.toml").plan
    engine = Engine(RunDir(tmp_path / "run"), plan)
    assert plain(indicator_text(engine)) == f"engine demo :{port} starting"  # not looked at yet
    fraction = (1 + secrets.randbelow(98)) / 100
    body = {"status": "loading", "progress": "stage 1 on cpu:1", "fraction": fraction}
    engine.state = EngineState((503, body), True, [], [])
    assert plain(indicator_text(engine)) == f"engine demo :{port} loading {fraction:.0%}"
    assert plain(health_text(engine.state, engine.url)) == f"loading: stage 1 on cpu:1 ({fraction:.0%})"
