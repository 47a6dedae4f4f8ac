"""The launcher's small parts, without an engine: run directories, port checks, exit reasons, log tails,
which run `strata stop` picks, and the load test's percentiles."""

from __future__ import annotations

import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from srv_helpers import strata

from strata_cfg.bench.stats import percentile
from strata_cfg.cli import build_parser
from strata_cfg.commands import stop
from strata_cfg.commands.launch import launch_options
from strata_cfg.launch.engine_process import exit_reason, log_tail
from strata_cfg.launch.options import LIVENESS_MARGIN_S, LaunchOptions
from strata_cfg.launch.preflight import port_problem
from strata_cfg.launch.run_dir import RunDir, live_supervisor, new_run_dir, open_log
from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.plan_file import write_plan


def test_run_dirs_are_named_after_the_profile_and_never_reused(tmp_path):
    now = time.time()
    first = new_run_dir("demo box", tmp_path, now)
    first.mkdir()
    second = new_run_dir("demo box", tmp_path, now)
    assert first != second
    assert first.name.startswith("demo_box-") and second.name.startswith(first.name)
    assert first.parent == tmp_path


def test_a_listening_port_is_busy_and_a_free_one_is_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        problem = port_problem("127.0.0.1", port)
        assert problem is not None and f"port {port}" in problem and "already in use" in problem
    assert port_problem("127.0.0.1", port) is None


def test_exit_reasons_name_the_signal_or_the_code():
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "was killed by SIGSEGV"
    code = random.randrange(1, 120)
    assert exit_reason(code) == f"exited with code {code}"


def test_log_tail_reads_only_what_was_written_after_the_offset(tmp_path):
    log = tmp_path / "engine.log"
    old = [f"old {i}" for i in range(random.randrange(3, 9))]
    log.write_text("".join(f"{x}\n" for x in old))
    offset = log.stat().st_size
    new = [f"new {i}" for i in range(random.randrange(20, 30))]
    with log.open("a") as f:
        f.write("".join(f"{x}\n" for x in new))
    assert log_tail(log, offset, lines=10) == new[-10:]
    assert log_tail(log, 0, lines=len(old) + len(new)) == old + new
    assert log_tail(tmp_path / "missing.log") == []


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
def test_log_tail_read_back_in_blocks_gives_the_lines_a_whole_read_gives(tmp_path, monkeypatch, block):
    """`log_tail` reads from the end back a block at a time: whatever the block, the offset, the count and
    the file's last line (ended or not, multi-byte text in it), the lines are those of reading it whole."""
    from strata_cfg.launch import engine_process

    monkeypatch.setattr(engine_process, "TAIL_BLOCK", block)
    rng = random.Random(block)
    log = tmp_path / "engine.log"
    for _ in range(20):
        body = [("é" * rng.randrange(0, 4)) + f"line {i} " + "x" * rng.randrange(0, 90) for i in range(60)]
        text = "\n".join(body) + rng.choice(["\n", ""])
        log.write_bytes(text.encode())
        start = rng.choice([0, rng.randrange(0, len(text.encode()))])
        whole = log.read_bytes()[start:].decode(errors="replace").splitlines()
        for lines in (0, 1, 5, 59, 61):
            assert log_tail(log, start, lines) == whole[-lines:], (block, start, lines)


def test_percentile_matches_the_inclusive_quantiles():
    rng = random.Random()
    xs = [rng.uniform(0.001, 5.0) for _ in range(rng.randrange(5, 200))]
    cuts = statistics.quantiles(xs, n=20, method="inclusive")  # 5%, 10%, ..., 95%
    assert percentile(xs, 0.50) == pytest.approx(cuts[9])
    assert percentile(xs, 0.95) == pytest.approx(cuts[18])
    assert percentile([], 0.5) is None


@pytest.fixture(scope="module")
def demo_plan():
    return resolve_profile(None)


def _fake_run(root: Path, name: str, profile: str, pid: int | None, age_s: float, plan) -> RunDir:
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    write_plan(plan.model_copy(update={"profile": profile}), run.plan)
    t = time.time() - age_s
    os.utime(run.plan, (t, t))
    if pid is not None:
        run.launch_pid.write_text(f"{pid}\n")
    return run


@pytest.fixture
def sleeper():
    """A live process whose command line says `strata`, standing in for a supervisor's pid."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "strata"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_stop_picks_the_most_recent_running_launch(tmp_path, sleeper, demo_plan):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old_demo = _fake_run(tmp_path, "demo-1", "demo", sleeper, age_s=300, plan=demo_plan)
    # newest, but its supervisor is gone
    _fake_run(tmp_path, "demo-2", "demo", dead.pid, age_s=10, plan=demo_plan)
    # named by its plan only: the directory was given with --run-dir
    box = _fake_run(tmp_path, "my-run", "box", sleeper, age_s=100, plan=demo_plan)

    assert stop.choose(None, tmp_path)[0] == box
    assert stop.choose("box", tmp_path)[0] == box
    assert stop.choose("demo", tmp_path)[0] == old_demo
    assert stop.choose("profiles/demo.toml", tmp_path)[0] == old_demo
    # A run that is already stopped is nothing to do, not an error; a run that never was is an error.
    run, why, stopped = stop.choose(str(tmp_path / "demo-2"), tmp_path)
    assert run is None and stopped and "already stopped" in why
    run, why, stopped = stop.choose("nosuch", tmp_path)
    assert run is None and not stopped and "`nosuch`" in why
    assert stop.choose(None, tmp_path / "empty") == (None, f"no launch under {tmp_path / 'empty'}/", False)
    only_dead = tmp_path / "dead"
    _fake_run(only_dead, "demo-3", "demo", dead.pid, age_s=5, plan=demo_plan)
    for target in (None, "demo"):
        run, why, stopped = stop.choose(target, only_dead)
        assert run is None and stopped and "already stopped" in why


def test_a_recycled_pid_that_is_not_strata_is_not_a_supervisor(tmp_path, demo_plan):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = _fake_run(tmp_path, "demo-1", "demo", other.pid, age_s=0, plan=demo_plan)
        assert live_supervisor(run) is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("liveness", [None, 0.0, 42.5])
def test_a_detached_supervisor_is_given_the_options_of_the_launch(liveness):
    # `strata launch --detach` hands its options on as flags; parsed back they must be the same options.
    options = LaunchOptions(max_restarts=2, grace_s=3.5, start_timeout_s=77.0, liveness_s=liveness)
    parser, _ = build_parser("launch")
    args = parser.parse_args(["--supervise", "runs/x", *options.argv()])
    assert launch_options(args) == options


def test_the_liveness_bound_follows_the_step_watchdog_unless_given():
    """By default the supervisor waits a minute longer than the engine's own step watchdog, which says where
    a step hung, and not at all where that watchdog is off; ``--liveness-timeout`` sets it (0: never)."""
    assert LaunchOptions().liveness(300.0) == 300.0 + LIVENESS_MARGIN_S
    assert LaunchOptions().liveness(0.0) == 0.0
    assert LaunchOptions(liveness_s=5.0).liveness(0.0) == 5.0
    assert LaunchOptions(liveness_s=0.0).liveness(300.0) == 0.0
    for bad, why in (
        ("-1", "'-1': give a finite number of seconds, 0 or above (0: off)"),
        ("nan", "'nan': give a finite number of seconds, 0 or above (0: off)"),
        ("soon", "'soon' is not a number of seconds"),
    ):
        result = strata("launch", "profiles/demo.toml", "--liveness-timeout", bad, "--dry-run", timeout=30)
        assert result.returncode == 2 and f"argument --liveness-timeout: {why}" in result.stderr, (
            result.stderr
        )


@pytest.mark.parametrize("seconds", ["nan", "inf", "soon"])
def test_loadtest_refuses_seconds_that_never_end_as_a_usage_error(seconds):
    # 127.0.0.1:9 (discard) answers nothing: before the check, `nan` and `inf` made the test loop forever.
    result = strata("loadtest", "http://127.0.0.1:9", "--seconds", seconds, "--clients", "1", timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--seconds" in result.stderr and "usage:" in result.stderr
    assert "Traceback" not in result.stderr


def test_logs_are_created_private_and_made_private(tmp_path):
    fresh = tmp_path / "engine.log"
    with open_log(fresh) as f:
        f.write(b"one\n")
    assert fresh.stat().st_mode & 0o777 == 0o600
    old = tmp_path / "launch.log"
    old.write_bytes(b"before\n")
    old.chmod(0o644)  # a log from before logs were private
    with open_log(old) as f:
        f.write(b"after\n")
    assert old.stat().st_mode & 0o777 == 0o600
    assert old.read_bytes() == b"before\nafter\n"  # appended, not truncated


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (("--top-p", "0"), "--top-p must be in (0, 1], not 0.0"),
        (("--temperature", "-0.5"), "--temperature must be at least 0"),
        (("--presence-penalty", "5"), "--presence-penalty must be in [-2, 2]"),
    ],
)
def test_loadtest_refuses_bad_sampling_options_naming_them(option, needle):
    result = strata("loadtest", "http://127.0.0.1:9", "--clients", "1", "--seconds", "1", *option, timeout=30)
    assert result.returncode == 2 and needle in result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("option", [("--turns", "0"), ("--clients", "0"), ("--max-tokens", "-1")])
def test_loadtest_refuses_counts_below_one_naming_them(option):
    result = strata("loadtest", "http://127.0.0.1:9", "--seconds", "1", "--chat", *option, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "strata loadtest: --clients, --max-tokens and --turns must be positive" in result.stderr


def test_loadtest_requests_carry_the_sampling_and_a_seed_each(monkeypatch):
    """Every request body has the sampling fields; a sampled request gets a seed of its own (client and
    number), the same in every run; greedy requests get none."""
    from strata_cfg.bench import load_test
    from strata_cfg.bench.http_driver import Sample

    bodies: list[dict] = []

    class Recording:
        def __init__(self, *args) -> None:
            pass

        def complete(self, body: dict) -> Sample:
            bodies.append(dict(body))
            return Sample(ok=True, seconds=0.01, tokens=body["max_tokens"])

        def close(self) -> None:
            pass

    monkeypatch.setattr(load_test, "Client", Recording)
    monkeypatch.setattr(load_test, "served_model", lambda *a, **k: "demo")
    sampled = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "presence_penalty": 1.5,
        "frequency_penalty": 0.5,
    }
    result = load_test.run_load("http://x", clients=2, requests_per_client=3, max_tokens=8, sampling=sampled)
    assert result.tokens == 2 * 3 * 8 and len(bodies) == 6
    assert all(b.items() >= sampled.items() for b in bodies)
    assert len({b["seed"] for b in bodies}) == 6
    assert result.to_json()["sampling"] == sampled  # the report says what the requests were
    assert (
        "sampled at temperature 0.8, top-k 20, top-p 0.9, presence penalty 1.5, frequency penalty 0.5"
        in result.lines()[0]
    )
    bodies.clear()
    greedy = load_test.run_load("http://x", clients=2, requests_per_client=1, max_tokens=8)
    assert all(b["temperature"] == 0.0 and "seed" not in b for b in bodies)
    assert ", greedy, " in greedy.lines()[0]
    penalised = load_test.run_load(
        "http://x", clients=1, requests_per_client=1, max_tokens=8, sampling={"presence_penalty": 1.0}
    )
    assert ", greedy, presence penalty 1, " in penalised.lines()[0]
    bodies.clear()
    cut = {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1}
    trimmed = load_test.run_load("http://x", clients=1, requests_per_client=1, max_tokens=8, sampling=cut)
    assert bodies[0].items() >= cut.items()  # the fields go in the request's body, as vLLM takes them
    assert "sampled at temperature 0.7, min-p 0.05, repetition penalty 1.1" in trimmed.lines()[0]


def test_the_engine_a_launcher_starts_does_not_inherit_systemds_notification_variables():
    """Where systemd runs `strata launch`, its notification socket and watchdog are the launcher's: the
    engine it starts must not tell systemd it is ready, nor ping its watchdog, as `strata serve` does."""
    from strata_cfg.launch.supervisor import engine_env

    env = {"PATH": "/bin", "NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "7", "HOME": "/h"}
    assert engine_env(env) == {"PATH": "/bin", "HOME": "/h"}
