"""`strata logs`: which launch's engine log it prints, how much of it, and following it until the launch
stops. Following a launched engine's log while it serves is tested in tests/test_srv_openai.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from srv_helpers import DEMO, strata

from strata_cfg.commands import logs
from strata_cfg.launch.run_dir import RunDir
from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.plan_file import write_plan


def _run(root: Path, name: str, lines: list[str]) -> RunDir:
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    write_plan(resolve_profile(DEMO), run.plan)
    run.engine_log.write_text("".join(f"{line}\n" for line in lines))
    return run


def _args(target: str | None, root: Path, lines: int = 40, follow: bool = False) -> Any:
    return type("Args", (), {"target": target, "runs_root": root, "lines": lines, "follow": follow})()


def test_the_latest_running_launch_else_the_latest_and_the_last_lines(tmp_path, monkeypatch, capsys):
    old = _run(tmp_path, "demo-20261201-000000", ["old one", "old two"])
    new = _run(tmp_path, "demo-20261207-000000", [f"line {i}" for i in range(100)])
    monkeypatch.setattr(logs, "live_supervisor", lambda run: None)
    assert logs.run(_args(None, tmp_path, lines=3)) == 0  # none runs: the most recent
    assert capsys.readouterr().out == "line 97\nline 98\nline 99\n"
    monkeypatch.setattr(logs, "live_supervisor", lambda run: 1 if run.path == old.path else None)
    assert logs.run(_args("demo", tmp_path)) == 0  # the profile's running launch, before a later stopped one
    assert capsys.readouterr().out == "old one\nold two\n"
    assert logs.run(_args(str(new.path), tmp_path, lines=0)) == 0  # a run directory, the whole log
    assert capsys.readouterr().out.count("\n") == 100
    assert logs.run(_args("other", tmp_path)) == 1
    assert "no launch of profile `other` under" in capsys.readouterr().err
    new.engine_log.unlink()
    assert logs.run(_args(str(new.path), tmp_path)) == 1
    assert "engine.log does not exist yet" in capsys.readouterr().err


def test_following_prints_whole_lines_as_they_come_and_ends_with_the_launch(tmp_path, monkeypatch):
    run = _run(tmp_path, "demo-1", ["before"])
    running = threading.Event()
    running.set()
    monkeypatch.setattr(logs, "live_supervisor", lambda r: 1 if running.is_set() else None)
    monkeypatch.setattr(logs, "FOLLOW_POLL_S", 0.01)

    def engine() -> None:
        time.sleep(0.1)
        with run.engine_log.open("a") as f:
            f.write("first\nsecond, half")
            f.flush()
            time.sleep(0.1)
            f.write(" and the rest\n")
        time.sleep(0.1)
        running.clear()  # the launch stops: following ends

    class Recorder:  # each write as it was made
        writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    out = Recorder()
    monkeypatch.setattr(logs.sys, "stdout", out)
    writer = threading.Thread(target=engine)
    writer.start()
    assert logs.run(_args(str(run.path), tmp_path, follow=True)) == 0
    writer.join()
    assert "".join(out.writes) == "before\nfirst\nsecond, half and the rest\n"
    assert not any(w.endswith("half") for w in out.writes)  # a line is printed whole, once it is


@pytest.mark.parametrize(
    ("bad", "why"), [("-1", "'-1': give 0 or more lines"), ("many", "'many' is not a number")]
)
def test_a_bad_line_count_is_a_usage_error(bad, why):
    out = strata("logs", "--lines", bad, timeout=30)
    assert out.returncode == 2 and f"argument -n/--lines: {why}" in out.stderr, out.stderr
