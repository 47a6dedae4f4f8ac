"""Shared by the server and launcher tests: a free port, raw HTTP, a `strata launch` process to drive, and the
demo engine served in process with a tokenizer of a test's choosing."""

from __future__ import annotations

import asyncio
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
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import aiohttp

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server
from strata_runtime.weights.tokenizer import ByteTokenizer

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


def serve_demo(
    tokenizer_class: type[ByteTokenizer],
    bodies: list[dict[str, Any]],
    path: str = "/v1/chat/completions",
    streamed: dict[str, Any] | None = None,
    status: int = 200,
) -> list[tuple[dict, list[dict]]]:
    """Each body's whole reply and its streamed chunks (or events; the streamed request with ``streamed``
    added), from the demo engine served in process with ``tokenizer_class`` as its tokenizer. ``status``:
    the status every whole reply must have (then nothing is streamed unless it is 200)."""
    plan = resolve_profile(DEMO)

    def factory(progress: Any) -> Engine:
        engine = Engine(plan, progress=progress)
        engine.tokenizer = tokenizer_class(engine.model.args.vocab_size)
        return engine

    async def scenario() -> list[tuple[dict, list[dict]]]:
        options = ServeOptions(host="127.0.0.1", port=0, model_name="demo", api_key=None)
        server, stop = Server(plan, factory, options), asyncio.Event()
        task = asyncio.create_task(server.serve(stop))
        while server.port is None or server.engine is None or server.engine.state != "ready":
            assert not task.done(), "the server stopped before it was ready"
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{server.port}{path}"
        out = []
        async with aiohttp.ClientSession() as s:
            for body in bodies:
                async with s.post(url, json=body) as r:
                    assert r.status == status, await r.text()
                    whole = await r.json()
                chunks = []
                if status != 200:
                    out.append((whole, chunks))
                    continue
                async with s.post(url, json={**body, **(streamed or {}), "stream": True}) as r:
                    async for line in r.content:
                        data = line.decode().strip()
                        if data.startswith("data: ") and data != "data: [DONE]":
                            data = data.removeprefix("data: ")
                            chunks.append(json.loads(data))
                out.append((whole, chunks))
        stop.set()
        assert await task == 0
        return out

    return asyncio.run(scenario())


def streamed_reply(chunks: list[dict]) -> tuple[str, str, list[dict], str | None]:
    """A streamed chat reply's reasoning, content, calls and finish reason, gathered from its chunks as
    OpenAI's client gathers them: a call's deltas by its ``index``, its arguments joined."""
    reasoning = content = ""
    calls: list[dict] = []
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or []:
                if part["index"] == len(calls):
                    calls.append({**part, "function": dict(part["function"])})
                else:
                    assert part["index"] == len(calls) - 1 and set(part) == {"index", "function"}, part
                    calls[-1]["function"]["arguments"] += part["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


class HealthStandIn(BaseHTTPRequestHandler):
    """A stand-in server's handler: every GET answers ``code`` with ``answer`` as JSON (subclass it with
    ``type(...)`` to set both, as another engine's ``/health`` would answer)."""

    answer: dict[str, Any] = {}
    code = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps(self.answer).encode()
        self.send_response(self.code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass
