"""The server's life around the real demo engine, in process: loading, an engine failure, and SIGTERM.

Two tests here control the engine from outside, because that is what they are about: one holds the real
engine's construction behind a gate to observe the loading state, and one wraps the real engine so that its
step raises, to check what the HTTP side does when the engine thread dies (the real engine has no way to
fail on demand). The SIGTERM test runs the real server process, untouched.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import aiohttp
import pytest
from srv_helpers import DEMO, REPO, free_port

from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.plan_file import write_plan
from strata_runtime.api import RequestHandle, TokenEvent
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server


@pytest.fixture(scope="module")
def plan():
    return resolve_profile(DEMO)


def _server(plan, factory) -> Server:
    return Server(plan, factory, ServeOptions(host="127.0.0.1", port=0, model_name="demo", api_key=None))


async def _started(server: Server, stop: asyncio.Event) -> asyncio.Task[int]:
    task = asyncio.create_task(server.serve(stop))
    while server.port is None:
        assert not task.done(), "the server stopped before listening"
        await asyncio.sleep(0.01)
    return task


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def _until_ready(session: aiohttp.ClientSession, base: str, tries: int = 600) -> None:
    """Poll ``/health`` until the engine is loaded (at most ``tries`` times, 50 ms apart)."""
    for _ in range(tries):
        async with session.get(f"{base}/health") as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine was not ready after {tries} looks at /health")


def test_health_and_requests_say_loading_until_the_engine_is_built(plan):
    gate = threading.Event()

    def gated(progress):
        gate.wait(30)
        return Engine(plan, progress=progress)

    async def scenario() -> int:
        server, stop = _server(plan, gated), asyncio.Event()
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/health") as r:
                assert r.status == 503
                assert (await r.json())["status"] == "loading"
            async with s.post(f"{base}/v1/completions", json={"model": "demo", "prompt": "hi"}) as r:
                status, body = r.status, await r.json()
                assert r.headers["Retry-After"] == "5"  # the client waits between tries
            assert status == 503 and "still loading" in body["error"]["message"]
            async with s.get(f"{base}/tokenizer_info") as r:  # the tokenizer comes with the engine
                assert r.status == 503 and "still loading" in (await r.json())["error"]["message"]
            gate.set()
            await _until_ready(s, base)
            # Greedy, so the reply is fixed: sampled, the demo model may end early on its end-of-text.
            request = {"model": "demo", "prompt": "hi", "max_tokens": 3, "temperature": 0}
            status, body = await _post(s, f"{base}/v1/completions", request)
            assert status == 200 and body["usage"]["completion_tokens"] == 3
        stop.set()
        return await task

    assert asyncio.run(scenario()) == 0


class _Wrapped:
    """The real engine behind the calls the server makes; a test changes the one it is about."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer

    def submit(self, request):
        return self._engine.submit(request)

    def stats(self):
        return self._engine.stats()

    def step(self) -> bool:
        return self._engine.step()

    def recover(self, error):
        return self._engine.recover(error)

    def self_check(self):
        return self._engine.self_check()


class _FailingStep(_Wrapped):
    """The real engine, whose step raises once a request is being served."""

    def step(self) -> bool:
        busy = self._engine.step()
        if busy and self._engine.totals["tokens"] >= 2:
            raise RuntimeError("a device fell off the bus")
        return busy


def _serving(plan, **serve: Any):
    """``plan`` with these ``[serve]`` settings."""
    return plan.model_copy(update={"serve": plan.serve.model_copy(update=serve)})


def _one_request_then_the_end(plan, wrap) -> tuple[int, Server, int, dict[str, Any]]:
    """Serve the real engine wrapped in ``wrap``, send one completion, and wait (bounded) for the server to
    end by itself: its exit code, the server, and the completion's status and body."""

    async def scenario() -> tuple[int, Server, int, dict[str, Any]]:
        server = _server(plan, lambda progress: wrap(Engine(plan, progress=progress)))
        task = await _started(server, asyncio.Event())
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            status, body = await _post(
                s, f"{base}/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 50}
            )
        return await asyncio.wait_for(task, 30), server, status, body

    return asyncio.run(scenario())


def test_an_engine_that_fails_while_serving_gives_500s_and_a_nonzero_exit(plan):
    """With ``serve.recoveries = 0`` the first failed step ends the server."""
    code, _, status, body = _one_request_then_the_end(_serving(plan, recoveries=0), _FailingStep)
    assert status == 500
    message = body["error"]["message"]
    assert "the engine failed" in message and "a device fell off the bus" in message
    assert "Traceback" not in json.dumps(body)
    assert code == 1  # the server ends by itself, with a failure code, so a supervisor restarts it


def _poisoned(plan):
    """The real engine, whose host raises once while queuing the first decode window of a request whose
    prompt holds "poison", once it has two tokens: a bug that one request's window triggers, part-way
    through a step, while other requests are in flight."""

    def build(progress) -> Engine:
        engine = Engine(plan, progress=progress)
        poison, launch, fired = tuple(engine.tokenizer.encode("poison")), engine.executor.launch, []

        def holds(prompt: tuple[int, ...]) -> bool:
            return any(prompt[i : i + len(poison)] == poison for i in range(len(prompt)))

        def launching(job, after=None):
            if not fired and any(
                e.kind == "decode" and holds(e.slot.prompt) and len(e.slot.generated) >= 2
                for e in job.entries
            ):
                fired.append(job)
                raise RuntimeError("a poisoned window")
            return launch(job, after)

        engine.executor.launch = launching
        return engine

    return build


def _streamed_text(sse: str) -> str:
    """The completion text of a streamed `/v1/completions` reply's events."""
    chunks = [line[len("data: ") :] for line in sse.splitlines() if line.startswith("data: {")]
    return "".join(c["text"] for chunk in chunks for c in json.loads(chunk)["choices"])


def test_a_failed_step_carries_the_requests_in_flight_on_and_the_server_serves_on(plan):
    """Two requests in flight when a step fails (a stream, and the request whose window fails) are carried
    on: each gets the text it gets on a sound engine, the stream with no error event; a request queued
    behind them, and every later one, gets its text too, and ``/v1/status`` and ``/metrics`` count the
    recovery and the requests it carried on."""
    greedy = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    long_body = {"model": "demo", "prompt": "It is a truth", "max_tokens": 400, "temperature": 0}
    poison = {**greedy, "prompt": "a poison pen", "max_tokens": 30}

    async def scenario() -> tuple[int, Server]:
        server, stop = _server(plan, _poisoned(plan)), asyncio.Event()
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            status, before = await _post(s, f"{base}/v1/completions", greedy)
            assert status == 200
            async with s.post(f"{base}/v1/completions", json={**long_body, "stream": True}) as stream:
                first = await stream.content.readline()  # the first chunk: the request is being served
                poisoned = asyncio.create_task(_post(s, f"{base}/v1/completions", poison))
                while True:  # both slots are taken before the third request comes
                    async with s.get(f"{base}/v1/status") as r:
                        slots = (await r.json())["engine"]["slots"]
                        if all(slot["state"] != "free" for slot in slots) or poisoned.done():
                            break
                queued = asyncio.create_task(_post(s, f"{base}/v1/completions", greedy))
                text = (first + await stream.read()).decode()
            assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")
            status, carried = await poisoned
            assert status == 200
            status, served = await queued
            assert status == 200 and served["choices"] == before["choices"]
            async with s.get(f"{base}/v1/status") as r:
                recoveries = (await r.json())["recoveries"]
            assert [(r["resumed"], r["ended"], r["error"]) for r in recoveries] == [
                (2, 0, "RuntimeError: a poisoned window")
            ]
            async with s.get(f"{base}/metrics") as r:
                page = await r.text()
            assert "\nstrata_engine_recoveries_total 1\n" in page
            assert '\nstrata_engine_recovered_requests_total{outcome="resumed"} 2\n' in page
            async with s.get(f"{base}/health") as r:
                assert r.status == 200
            # On the engine as sound as before, the same requests give the same text.
            status, after = await _post(s, f"{base}/v1/completions", greedy)
            assert status == 200 and after["choices"] == before["choices"]
            status, again = await _post(s, f"{base}/v1/completions", poison)
            assert status == 200 and again["choices"][0]["text"] == carried["choices"][0]["text"]
            status, whole = await _post(s, f"{base}/v1/completions", long_body)
            assert status == 200 and whole["choices"][0]["text"] == _streamed_text(text)
        stop.set()
        return await task, server

    code, server = asyncio.run(scenario())
    assert code == 0


def _chaotic(plan, share: float, seed: int, armed: list[bool]):
    """The real engine, whose host's launches and stages' layers each raise at a seeded random ``share``
    of their calls while ``armed[0]`` (never in the self-check): bugs that come and go."""
    rng = random.Random(seed)

    def build(progress) -> Engine:
        engine = Engine(plan, progress=progress)

        def chaos(call):
            def chaotic(*args, **kwargs):
                if armed[0] and rng.random() < share:
                    raise RuntimeError("planted chaos")
                return call(*args, **kwargs)

            return chaotic

        engine.executor.launch = chaos(engine.executor.launch)
        for stage in engine.model.stages:
            stage.forward = chaos(stage.forward)
        check = engine.self_check

        def unarmed_check():
            was, armed[0] = armed[0], False
            try:
                return check()
            finally:
                armed[0] = was

        engine.self_check = unarmed_check
        return engine

    return build


def test_under_steps_that_fail_at_random_every_request_is_answered_and_greedy_replies_keep_their_text(plan):
    """A hundred requests six at a time (chat and completions, streamed and whole, greedy and sampled) while
    1% of launches and layers raise: every request is answered, a stream always ends with ``[DONE]``, an
    error names the fault (a request held by two failed steps), nearly all are carried through, and every
    greedy reply that completes is the one the sound engine gives; the server is ready at the end."""
    plan = _serving(plan, recoveries=1000)
    armed = [False]

    async def scenario() -> tuple[int, list[Any], list[dict[str, Any]]]:
        server, stop = _server(plan, _chaotic(plan, 0.01, 11, armed)), asyncio.Event()
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        rng = random.Random(5)
        asks = []
        for i in range(100):
            chat, stream = rng.random() < 0.5, rng.random() < 0.5
            body: dict[str, Any] = {"model": "demo", "max_tokens": rng.choice([4, 20, 60])}
            body["temperature"] = 0 if rng.random() < 0.7 else 0.8
            if chat:
                body["messages"] = [{"role": "user", "content": f"Tell me of the {i % 7}th letter"}]
            else:
                body["prompt"] = f"Once upon a time, {i % 7} sisters"
            asks.append((f"{base}/v1/{'chat/completions' if chat else 'completions'}", body, stream))

        async def answer(s: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> Any:
            async with s.post(url, json={**body, "stream": stream}) as r:
                if not stream:
                    return r.status, await r.json()
                text = (await r.read()).decode()
                assert r.status == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]
                return "stream", text

        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            sound = {}
            for url, body, _ in asks:  # what the sound engine gives each greedy request, whole
                key = (url, json.dumps(body, sort_keys=True))
                if body["temperature"] == 0 and key not in sound:
                    sound[key] = (await _post(s, url, body))[1]
            armed[0] = True
            gate = asyncio.Semaphore(6)

            async def guarded(ask):
                async with gate:
                    return await answer(s, *ask)

            answers = await asyncio.gather(*(guarded(ask) for ask in asks))
            armed[0] = False
            async with s.get(f"{base}/v1/status") as r:
                recoveries = (await r.json())["recoveries"]
            async with s.get(f"{base}/health") as r:
                assert r.status == 200
        stop.set()
        code = await task
        ended = 0
        for (url, body, _), got in zip(asks, answers, strict=True):
            kind, reply = got
            if kind == "stream" and '"error"' in reply or kind == 500:
                assert "planted chaos" in json.dumps(reply), reply
                ended += 1
                continue
            assert kind in (200, "stream"), got
            if body["temperature"] != 0:
                continue
            whole = sound[(url, json.dumps(body, sort_keys=True))]["choices"][0]
            text = whole["message"]["content"] if "chat" in url else whole["text"]
            if kind == 200:
                mine = reply["choices"][0]
                assert (mine["message"]["content"] if "chat" in url else mine["text"]) == text
            else:
                chunks = [json.loads(line[6:]) for line in reply.splitlines() if line.startswith("data: {")]
                parts = [
                    c["delta"].get("content") or "" if "chat" in url else c["text"]
                    for ch in chunks
                    for c in ch["choices"]
                ]
                assert "".join(parts) == text
        return code, recoveries, ended

    code, recoveries, ended = asyncio.run(scenario())
    assert code == 0
    assert len(recoveries) >= 5, "the faults came"
    assert sum(r["resumed"] for r in recoveries) >= 3 * sum(r["ended"] for r in recoveries)
    assert ended == sum(r["ended"] for r in recoveries) and ended <= 15


def test_a_step_that_fails_again_and_again_ends_the_server_after_serve_recoveries(plan):
    """Every step fails once a request is served: the first request is carried through one failure and ended
    by the second, with a 500; the second request is carried through the third; the fourth failure within
    ten minutes ends the server, with a failure code, and answers that request with a 500 too."""

    async def scenario() -> tuple[int, list[str]]:
        server = _server(plan, lambda progress: _FailingStep(Engine(plan, progress=progress)))
        task = await _started(server, asyncio.Event())
        base = f"http://127.0.0.1:{server.port}"
        messages = []
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            for _ in range(2):
                status, body = await _post(
                    s, f"{base}/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 50}
                )
                assert status == 500
                messages.append(body["error"]["message"])
        return await asyncio.wait_for(task, 30), messages

    code, messages = asyncio.run(scenario())
    assert code == 1
    assert "the engine failed while running this request" in messages[0], messages
    assert "the engine failed while stepping (4 times in 10 minutes)" in messages[1], messages
    assert all("a device fell off the bus" in m for m in messages)


class _BreaksItsModel(_Wrapped):
    """The real engine, whose step, once a request is served, leaves the final norm's weight changed (as a
    fault that wrote into the model would) and raises."""

    def step(self) -> bool:
        busy = self._engine.step()
        if busy and self._engine.totals["tokens"] >= 2:
            self._engine.model.stages[-1].norm *= 1.5
            raise RuntimeError("a stray write")
        return busy


def test_a_recovered_engine_whose_self_check_departs_ends_the_server(plan):
    code, server, status, body = _one_request_then_the_end(plan, _BreaksItsModel)
    assert status == 500 and "a stray write" in body["error"]["message"]
    assert code == 1
    assert server.engine is not None and server.engine.recovered == []
    assert "its self-check departs from what it gave after loading: position" in (server.engine.error or "")


class _Hangs(_Wrapped):
    """The real engine, whose step blocks (as on a hung GPU) once a request is served, until released."""

    def __init__(self, engine: Engine, release: threading.Event) -> None:
        super().__init__(engine)
        self.release = release

    def step(self) -> bool:
        busy = self._engine.step()
        if busy and self._engine.totals["tokens"] >= 2:
            self.release.wait(60)
        return busy


def test_a_step_that_hangs_past_serve_step_timeout_s_ends_the_server_with_its_stack_in_the_log(plan, caplog):
    plan = _serving(plan, step_timeout_s=0.5)
    release = threading.Event()

    async def scenario() -> tuple[int, Server, float]:
        server = _server(plan, lambda progress: _Hangs(Engine(plan, progress=progress), release))
        task = await _started(server, asyncio.Event())
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            asked = time.monotonic()
            status, body = await _post(
                s, f"{base}/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 50}
            )
            waited = time.monotonic() - asked
            assert status == 500 and "has not returned for 0.5 s" in body["error"]["message"]
        return await asyncio.wait_for(task, 30), server, waited

    try:
        code, server, waited = asyncio.run(scenario())
    finally:
        release.set()
    assert code == 1 and 0.5 <= waited < 10
    assert server.engine is not None and "serve.step_timeout_s" in (server.engine.error or "")
    assert server.engine.hung
    assert "the engine thread, where it hangs" in caplog.text and "in step" in caplog.text


HANGING_SERVE = """
import atexit, sys, threading
from strata_runtime.__main__ import main
from strata_runtime.commands import serve
from strata_runtime.engine import Engine

forever = threading.Event()
atexit.register(forever.wait)  # as an exit handler that waits on the hung device would


class Hangs:
    def __init__(self, engine):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.submit, self.stats = engine.submit, engine.stats
        self.recover, self.self_check = engine.recover, engine.self_check

    def step(self):
        busy = self.engine.step()
        if busy and self.engine.totals["tokens"] >= 2:
            forever.wait()
        return busy


serve._factory = lambda plan: lambda progress: Hangs(Engine(plan, progress=progress))
sys.exit(main(sys.argv[1:]))
"""


def test_the_serve_process_whose_step_hangs_exits_with_1_past_exit_handlers_that_would_wait(plan, tmp_path):
    """`strata serve` ends the process itself once the watchdog has given a step up: its engine thread is
    still blocked, and an exit handler may wait on the same device."""
    plan = _serving(plan, step_timeout_s=0.5)
    port = free_port()
    plan_file = str(write_plan(plan, tmp_path / "plan.json"))
    command = [sys.executable, "-c", HANGING_SERVE, "serve", "--plan", plan_file, "--port", str(port)]
    proc = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)

    async def ask() -> tuple[int, dict[str, Any]]:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            await _until_serving(s, base)
            body = {"model": "demo", "prompt": "hi", "max_tokens": 9}
            return await _post(s, f"{base}/v1/completions", body)

    try:
        status, body = asyncio.run(ask())
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
    assert status == 500 and "has not returned" in body["error"]["message"]
    assert "the engine thread, where it hangs" in proc.stderr.read()


async def _until_serving(session: aiohttp.ClientSession, base: str) -> None:
    """Poll a server process's ``/health`` (refused connections while it starts) until it answers 200."""
    for _ in range(1200):
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the server was not ready within a minute")


def test_a_slow_step_within_serve_step_timeout_s_is_not_taken_for_a_hang(plan):
    """Steps of 0.2 s under a bound of 1 s: every request is served, and the server stops cleanly."""
    plan = _serving(plan, step_timeout_s=1.0)

    class Slow(_Wrapped):
        def step(self) -> bool:
            busy = self._engine.step()
            if busy:
                time.sleep(0.2)
            return busy

    async def scenario() -> int:
        server, stop = _server(plan, lambda progress: Slow(Engine(plan, progress=progress))), asyncio.Event()
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            status, body = await _post(
                s, f"{base}/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 12}
            )
            assert status == 200 and body["usage"]["completion_tokens"] == 12
        stop.set()
        return await task

    assert asyncio.run(scenario()) == 0


class _RefusesFirstByte(_Wrapped):
    """The real engine, which refuses at submission every request whose prompt begins with byte 1."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.submitted: list[Any] = []

    def submit(self, request):
        if request.prompt_ids[0] == 1:
            handle = RequestHandle(request)
            handle.events.put(TokenEvent((), "", "error", 0, "refused by the test"))
            return handle
        handle = self._engine.submit(request)
        self.submitted.append(handle)
        return handle


def test_a_batch_with_a_failed_choice_answers_at_once_and_cancels_the_others(plan):
    """A whole reply of several choices, one of which the engine refuses: a 500 naming the refusal at once,
    the other choice's request cancelled (its slot freed), and nothing left waiting on the event loop."""
    engines: list[_RefusesFirstByte] = []

    def factory(progress):
        engines.append(_RefusesFirstByte(Engine(plan, progress=progress)))
        return engines[-1]

    async def scenario() -> int:
        server, stop = _server(plan, factory), asyncio.Event()
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            batch = {
                "model": "demo",
                "prompt": [[2, 72, 105], [1, 72]],
                "max_tokens": 500,
                "ignore_eos": True,
            }
            status, body = await _post(s, f"{base}/v1/completions", batch)
            assert status == 500 and "refused by the test" in body["error"]["message"]
            (kept,) = engines[0].submitted
            assert kept.cancelled.is_set() and kept.completion_tokens < 500
            await asyncio.sleep(0.2)
            waiting = [t for t in asyncio.all_tasks() if "Server.collect" in repr(t.get_coro())]
            assert waiting == []
        stop.set()
        return await task

    assert asyncio.run(scenario()) == 0


class _RefusesAll(_Wrapped):
    """The real engine, which refuses every request at submission."""

    def submit(self, request):
        handle = RequestHandle(request)
        handle.events.put(TokenEvent((), "", "error", 0, "refused by the test"))
        return handle


def test_a_request_the_engine_ends_early_fails_in_each_apis_own_shape(plan):
    """The engine fails a request: the Responses API answers a whole one with a 500 in OpenAI's shape, and
    ends a stream with ``error`` and ``response.failed`` (numbered on from ``response.created``); the
    Messages API ends its stream with Anthropic's ``error`` event."""

    async def scenario() -> int:
        server, stop = (
            _server(plan, lambda progress: _RefusesAll(Engine(plan, progress=progress))),
            asyncio.Event(),
        )
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            ask = {"model": "demo", "input": "hi", "max_output_tokens": 8}
            status, body = await _post(s, f"{base}/v1/responses", ask)
            assert status == 500 and "refused by the test" in body["error"]["message"]
            async with s.post(f"{base}/v1/responses", json={**ask, "stream": True}) as r:
                events = [
                    json.loads(line[len(b"data: ") :])
                    async for line in r.content
                    if line.startswith(b"data: ")
                ]
            assert [e["type"] for e in events] == [
                "response.created",
                "response.in_progress",
                "error",
                "response.failed",
            ]
            assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
            failed = events[-1]["response"]
            assert failed["status"] == "failed" and "refused by the test" in failed["error"]["message"]
            message = {
                "model": "demo",
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with s.post(f"{base}/v1/messages", json=message) as r:
                lines = [line async for line in r.content if line.startswith(b"data: ")]
            (last,) = [json.loads(line[len(b"data: ") :]) for line in lines]
            assert last["type"] == "error" and "refused by the test" in last["error"]["message"]
        stop.set()
        return await task

    assert asyncio.run(scenario()) == 0


def test_sigterm_finishes_short_requests_and_cancels_long_ones_within_the_bound(plan, tmp_path):
    port = free_port()
    plan_file = write_plan(plan, tmp_path / "plan.json")
    log_file = tmp_path / "engine.log"
    with log_file.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata_runtime", "serve", "--plan", str(plan_file), "--port", str(port)]
            + ["--drain-seconds", "0.3"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"

    async def scenario() -> tuple[str, dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            await _until_serving(s, base)
            long_body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 1000, "stream": True}
            long_body["temperature"] = 0
            async with s.post(f"{base}/v1/completions", json=long_body) as stream:
                await stream.content.readline()  # the first chunk: the request is being served
                short = asyncio.create_task(
                    _post(s, f"{base}/v1/completions", {"model": "demo", "prompt": "Twice", "max_tokens": 8})
                )
                while not short.done():  # both requests are in the server before SIGTERM comes
                    async with s.get(f"{base}/v1/status") as r:
                        if (await r.json())["requests_in_flight"] == 2:
                            break
                proc.send_signal(signal.SIGTERM)
                text = (await stream.read()).decode()
            _, short_body = await short
            return text, short_body

    text, short_body = asyncio.run(scenario())
    assert proc.wait(timeout=30) == 0
    # The long stream was cut at the drain bound with an error chunk, and still ended properly.
    assert '"error"' in text and "shutting down" in text
    assert text.rstrip().endswith("data: [DONE]")
    # The short request that was in flight when SIGTERM came finished whole.
    assert short_body["choices"][0]["finish_reason"] in ("stop", "length")
    assert short_body["usage"]["completion_tokens"] <= 8
    assert "cancelling 1 requests still in flight" in log_file.read_text()


def test_binding_beyond_loopback_without_a_key_warns_from_the_plans_own_decision():
    """The resolver decides whether the plan's host is loopback (``serve.loopback``); the serve command reads
    that, and warns for any --host it was not asked about."""
    from rt_plans import profile_text

    from strata_cfg.plan.from_profile import resolve_text
    from strata_runtime.commands.serve import exposure_warning

    local = resolve_text(profile_text(serve=True), "t.toml").plan
    text = profile_text(serve=True).replace("[serve]", '[serve]\nhost = "0.0.0.0"')
    exposed = resolve_text(text, "t.toml").plan
    assert local.serve.loopback and not exposed.serve.loopback
    assert exposure_warning(local, "127.0.0.1", None) is None
    assert exposure_warning(local, "127.0.0.1", "key") is None
    assert "binding 0.0.0.0 without an API key" in exposure_warning(exposed, "0.0.0.0", None)
    assert exposure_warning(exposed, "0.0.0.0", "key") is None
    assert "the plan checked only 127.0.0.1" in exposure_warning(local, "10.1.2.3", None)


class _Held(_Wrapped):
    """The real engine, whose steps wait for the test's gate: requests stay in flight until it opens."""

    def __init__(self, engine: Engine, gate: threading.Event) -> None:
        super().__init__(engine)
        self.gate = gate

    def step(self) -> bool:
        self.gate.wait(30)
        return self._engine.step()


def test_requests_beyond_the_slots_and_max_queued_get_429_with_retry_after():
    """With ``serve.max_queued`` 1 and 2 slots, three requests may be in flight: a fourth, or a request of
    two choices beside two, is refused at once with 429, ``Retry-After`` and the counts, and counted as
    rejected; once the three finish, a request is served again."""
    capped = resolve_profile(DEMO, [("serve.max_queued", 1)])
    assert capped.serve is not None and capped.serve.max_queued == 1 and capped.batch.slots == 2
    gate = threading.Event()

    async def scenario() -> int:
        server, stop = (
            _server(capped, lambda progress: _Held(Engine(capped, progress=progress), gate)),
            asyncio.Event(),
        )
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        request = {"model": "demo", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            held = [asyncio.create_task(_post(s, f"{base}/v1/completions", request)) for _ in range(3)]
            while server.engine is None or server.engine.in_flight < 3:
                await asyncio.sleep(0.01)
            async with s.post(f"{base}/v1/completions", json=request) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                error = (await r.json())["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            assert "3 requests in flight for 2 batch slots and at most 1 waiting" in error["message"]
            gate.set()
            assert [status for status, _ in await asyncio.gather(*held)] == [200, 200, 200]
            gate.clear()  # the engine thread now holds at its next step
            held = [asyncio.create_task(_post(s, f"{base}/v1/completions", request)) for _ in range(2)]
            while server.engine.in_flight < 2:
                await asyncio.sleep(0.01)
            status, body = await _post(s, f"{base}/v1/completions", {**request, "n": 2})
            assert status == 429 and "2 requests in flight" in body["error"]["message"]
            gate.set()
            assert [status for status, _ in await asyncio.gather(*held)] == [200, 200]
            status, body = await _post(s, f"{base}/v1/completions", {**request, "n": 2})
            assert status == 200 and body["usage"]["completion_tokens"] == 6
            status, body = await _post(s, f"{base}/v1/completions", {**request, "n": 4})  # never admitted
            assert status == 400 and body["error"]["param"] == "n" and "4 choices" in body["error"]["message"]
            status, body = await _post(s, f"{base}/v1/completions", request)
            assert status == 200 and body["usage"]["completion_tokens"] == 3
            async with s.get(f"{base}/metrics") as r:
                metrics = await r.text()
            assert 'strata_requests_total{endpoint="completions",outcome="rejected"} 2' in metrics
        stop.set()
        return await task

    assert asyncio.run(scenario()) == 0


def test_pages_of_an_allowed_origin_may_call_from_a_browser_and_others_may_not():
    """``serve.allowed_origins``: a preflight from a listed origin is answered 204 before the API key is
    checked, with the methods and the headers it asked for; every answer to that origin, streamed ones
    too, carries ``Access-Control-Allow-Origin``; another origin's preflight is refused with 403 and its
    answers carry none. Without the key, no answer carries CORS headers."""
    page = "http://localhost:3000"
    opened = resolve_profile(
        DEMO, [("serve.allowed_origins", [page]), ("serve.api_key_env", "STRATA_TEST_KEY")]
    )
    assert opened.serve is not None and opened.serve.allowed_origins == (page,)
    plain = resolve_profile(DEMO)

    async def scenario(plan, key: str | None) -> None:
        options = ServeOptions(host="127.0.0.1", port=0, model_name="demo", api_key=key)
        server, stop = (
            Server(plan, lambda progress: Engine(plan, progress=progress), options),
            asyncio.Event(),
        )
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        request = {"model": "demo", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            for origin in (page, "http://evil.example"):
                ask = {
                    "Origin": origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                }
                async with s.options(f"{base}/v1/completions", headers=ask) as r:
                    listed = origin == page and plan is opened
                    assert r.status == (204 if listed else 403)
                    if not listed:  # the refusal names the origin and the key that would admit it
                        message = (await r.json())["error"]["message"]
                        assert (
                            message
                            == f"{origin} may not call this server from a browser (serve.allowed_origins)"
                        )
                    if listed:
                        assert r.headers["Access-Control-Allow-Origin"] == page
                        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
                        assert "POST" in r.headers["Access-Control-Allow-Methods"]
                for stream in (False, True):
                    body = {**request, "stream": stream}
                    async with s.post(
                        f"{base}/v1/completions", json=body, headers={"Origin": origin, **auth}
                    ) as r:
                        assert r.status == 200
                        await r.read()
                        got = r.headers.get("Access-Control-Allow-Origin")
                        assert got == (page if listed else None), (origin, stream, got)
                async with s.get(f"{base}/health", headers={"Origin": origin}) as r:
                    assert r.headers.get("Access-Control-Allow-Origin") == (page if listed else None)
        stop.set()
        assert await task == 0

    asyncio.run(scenario(opened, "k3y"))
    asyncio.run(scenario(plain, None))


def test_metrics_time_the_first_token_and_each_token_after_it():
    """A completed request of several tokens is timed to its first token and per token after it; one of a
    single token only to its first; the times are the server's clock, within the request's latency."""
    plan = resolve_profile(DEMO)

    async def scenario() -> dict[str, float]:
        server, stop = _server(plan, lambda progress: Engine(plan, progress=progress)), asyncio.Event()
        task = await _started(server, stop)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            for tokens, stream in ((8, False), (6, True), (1, False)):
                body = {"model": "demo", "prompt": "hi", "max_tokens": tokens, "temperature": 0}
                async with s.post(f"{base}/v1/completions", json={**body, "stream": stream}) as r:
                    assert r.status == 200
                    await r.read()
            async with s.get(f"{base}/metrics") as r:
                text = await r.text()
        stop.set()
        assert await task == 0
        return {
            name: float(value)
            for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        }

    values = asyncio.run(scenario())
    assert values["strata_time_to_first_token_seconds_count"] == 3
    assert values["strata_time_per_output_token_seconds_count"] == 2  # not the one-token request
    assert 0 < values["strata_time_to_first_token_seconds_sum"] <= values["strata_request_seconds_sum"]
    assert 0 < values["strata_time_per_output_token_seconds_sum"] < values["strata_request_seconds_sum"]
