"""`strata launch` refusals, dry runs, a failed start, and `--detach` with `strata stop`, on the demo profile.

Every refusal must come before anything starts: one clear sentence, exit 1, no run directory.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from srv_helpers import DEMO, REPO, alive, free_port, http, strata, wait_for

CPU_MACHINE = """
[machine]
backend = "cpu"
gpus = [{ name = "virtual CPU device", vram_mib = 1024, bandwidth_gbs = 20 }]
"""


def _refused(result, *words: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    for w in words:
        assert w in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_busy_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = strata(
            "launch", str(DEMO), "--set", f"serve.port={port}", "--run-dir", str(tmp_path / "run")
        )
    _refused(result, f"port {port} on 127.0.0.1 is already in use")
    assert not (tmp_path / "run").exists()


def test_an_unset_api_key_variable_is_refused(tmp_path):
    name = f"STRATA_UNSET_{secrets.token_hex(4).upper()}"
    result = strata(
        "launch", str(DEMO), "--set", f'serve.api_key_env="{name}"', "--run-dir", str(tmp_path / "r")
    )
    _refused(result, f"serve.api_key_env names ${name}, but it is not set")
    assert not (tmp_path / "r").exists()


def test_a_missing_model_directory_is_refused(tmp_path):
    profile = tmp_path / "nomodel.toml"
    profile.write_text(f'name = "nomodel"\n{CPU_MACHINE}\n[model]\npath = "no-such-model"\n\n[serve]\n')
    result = strata("launch", str(profile), "--run-dir", str(tmp_path / "run"))
    _refused(result, "model.path", str(tmp_path / "no-such-model"), "nothing was started")
    assert not (tmp_path / "run").exists()


def test_a_profile_without_serve_is_refused(tmp_path):
    profile = tmp_path / "oneshot.toml"
    profile.write_text(f'name = "oneshot"\n{CPU_MACHINE}\n[model]\nsynthetic = "tiny"\n')
    result = strata("launch", str(profile), "--run-dir", str(tmp_path / "run"))
    _refused(result, "has no [serve] table")


def test_strict_refuses_a_plan_that_turns_off_what_was_asked(tmp_path):
    # The demo asks for batch MTP; two pipelined groups turn it off, which --strict refuses.
    result = strata(
        "launch", str(DEMO), "--set", "batch.groups=2", "--strict", "--run-dir", str(tmp_path / "run")
    )
    _refused(result, "batch.mtp", "the plan was refused")
    assert not (tmp_path / "run").exists()


def test_dry_run_shows_the_plan_and_the_turned_off_features_and_starts_nothing(tmp_path):
    port = free_port()
    run = tmp_path / "run"
    result = strata(
        "launch",
        str(DEMO),
        "--set",
        "batch.groups=2",
        "--set",
        f"serve.port={port}",
        "--dry-run",
        "--run-dir",
        str(run),
    )
    assert result.returncode == 0, result.stderr
    assert "batch: 2 slot(s), 2 group(s), pipelined, batch MTP off" in result.stdout
    # The feature the profile asked for and a rule turned off is shown, with where it was asked.
    assert "OFF batch.mtp" in result.stdout and f"{DEMO}:" in result.stdout
    assert f"-m strata_runtime serve --plan {run / 'plan.json'}" in result.stdout
    assert not run.exists()


def test_an_exposed_host_without_a_key_is_a_warning_and_strict_refuses_it(tmp_path):
    sets = ("--set", 'serve.host="0.0.0.0"', "--set", f"serve.port={free_port()}")
    result = strata("launch", str(DEMO), *sets, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "(listening on 0.0.0.0:" in result.stdout
    assert "WARN serve.host:" in result.stdout and "no API key" in result.stdout
    strict = strata("launch", str(DEMO), *sets, "--strict", "--run-dir", str(tmp_path / "run"))
    _refused(strict, "serve.host", "the plan was refused")
    assert not (tmp_path / "run").exists()


def test_an_engine_that_dies_while_loading_fails_fast_with_its_log(tmp_path):
    # Remote expert optimisation resolves, but this runtime refuses it when the engine is built.
    started = time.monotonic()
    result = strata(
        "launch",
        str(DEMO),
        "--set",
        "experts.remote_opt=true",
        "--set",
        f"serve.port={free_port()}",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    assert result.returncode == 1
    assert "the engine exited with code 1" in result.stdout
    assert "remote expert optimisation is not implemented" in result.stdout  # the log tail
    assert "the engine failed to start" in result.stdout
    assert "restarting" not in result.stdout  # a start that never loaded is not retried
    assert time.monotonic() - started < 60
    assert (tmp_path / "run" / "plan.json").is_file()
    assert not (tmp_path / "run" / "launch.pid").exists()


def test_detach_returns_when_ready_and_strata_stop_ends_it(tmp_path):
    port = free_port()
    runs = tmp_path / "runs"
    run = runs / "demo-detached"
    result = strata(
        "launch", str(DEMO), "--set", f"serve.port={port}", "--detach", "--run-dir", str(run), timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"engine ready: http://127.0.0.1:{port}/v1" in result.stdout
    assert f"strata stop {run}" in result.stdout
    assert f"(strata logs -f {run}); state: strata status;" in result.stdout
    # What the launch says to run: its log, and its state, found by profile under the runs root.
    logged = strata("logs", str(run), "-n", "50")
    assert logged.returncode == 0 and "engine ready in" in logged.stdout, logged.stderr
    state = strata("status", "demo", "--runs-root", str(runs))
    assert state.returncode == 0 and state.stdout.startswith(f"demo: ready at http://127.0.0.1:{port}/v1")
    url = f"http://127.0.0.1:{port}"
    assert http("GET", f"{url}/health")[0] == 200
    supervisor = int((run / "launch.pid").read_text())
    engine = int((run / "engine.pid").read_text())
    assert alive(supervisor) and alive(engine)
    plan = json.loads((run / "plan.json").read_text())
    assert plan["serve"]["port"] == port
    # The security default: the demo engine listens on loopback only.
    assert _listeners(port) == {"127.0.0.1"}

    # By profile name, under the runs root: the most recent running launch of `demo`.
    stopped = strata("stop", "demo", "--runs-root", str(runs))
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not alive(supervisor) and not alive(engine), 30, "the detached launch to end")
    assert not (run / "launch.pid").exists()
    assert "the engine stopped cleanly" in (run / "launch.log").read_text()
    assert strata("status", "--runs-root", str(runs)).returncode == 1  # nothing runs any more
    # A second stop of the same run has nothing to do, which is not an error.
    again = strata("stop", str(run))
    assert again.returncode == 0, again.stderr
    assert f"{run} is already stopped" in again.stdout
    assert strata("stop", "demo", "--runs-root", str(runs)).returncode == 0
    # Its logs are private to their owner: an engine's log can hold what clients sent.
    for log in ("engine.log", "launch.log"):
        assert (run / log).stat().st_mode & 0o777 == 0o600, log


def test_strata_serve_runs_a_plan_file_in_the_foreground(tmp_path):
    # The unsupervised engine process: a plan written by strata plan --json, a port override, a clean SIGTERM.
    plan = strata("plan", str(DEMO), "--json")
    assert plan.returncode == 0, plan.stderr
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.stdout)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_cfg", "serve", "--plan", str(plan_file), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ},
    )
    try:
        wait_for(lambda: _ok(f"http://127.0.0.1:{port}/health") or proc.poll() is not None, 60, "health")
        assert proc.poll() is None
        status, body = http(
            "POST",
            f"http://127.0.0.1:{port}/v1/completions",
            json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 3}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert b"stopped" in proc.stderr.read()


def _ok(url: str) -> bool:
    try:
        return http("GET", url, timeout=1)[0] == 200
    except OSError:
        return False


def _listeners(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(host)[::-1]))
    return found
