"""Shared by the server and launcher tests: a free port, raw HTTP, and a `strata launch` process to drive."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "profiles" / "demo.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(url: str, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, body = http("GET", url, headers=headers)
    assert status == 200, body
    return json.loads(body)


def strata(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run a `strata` command to completion."""
    return subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_for(predicate: Any, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


@dataclass
class Launched:
    """A `strata launch` process in the foreground, its output in a file."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    out: Path
    url: str
    key: str | None

    def output(self) -> str:
        return self.out.read_text()

    def engine_pid(self) -> int:
        return int((self.run_dir / "engine.pid").read_text())

    def healthy(self) -> bool:
        try:
            return http("GET", f"{self.url}/health", timeout=2.0)[0] == 200
        except OSError:
            return False

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def launch(
    tmp: Path, *sets: str, key: str | None = None, extra: tuple[str, ...] = (), ready_timeout: float = 90.0
) -> Launched:
    """`strata launch profiles/demo.toml` on a free port, waited on until the engine answers /health."""
    port = free_port()
    run_dir = tmp / "run"
    out = tmp / "launch.out"
    env = dict(os.environ)
    args = ["--set", f"serve.port={port}", *(a for s in sets for a in ("--set", s))]
    if key is not None:
        env["STRATA_TEST_KEY"] = key
        args += ["--set", 'serve.api_key_env="STRATA_TEST_KEY"']
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "strata_cfg",
                "launch",
                str(DEMO),
                *args,
                "--run-dir",
                str(run_dir),
                *extra,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    launched = Launched(proc, run_dir, out, f"http://127.0.0.1:{port}", key)
    try:
        wait_for(
            lambda: "engine ready" in launched.output() or proc.poll() is not None, ready_timeout, "ready"
        )
    except AssertionError:
        launched.stop()
        raise
    assert proc.poll() is None, launched.output()
    return launched
