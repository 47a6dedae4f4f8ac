"""``llama-server`` as the llama.cpp peer where its benchmark tools are missing: which cases it runs, the
figures from its replies, a stand-in server on PATH end to end (CPU), and, where a real ``llama-server`` is
on PATH, the exported demo model decoding in llama.cpp to the runtime's own greedy tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strata_runtime.bench import llamacpp
from strata_runtime.bench.llamacpp_server import (
    SERVER,
    ServerCase,
    completion,
    decode_rate,
    prompt_rate,
    run_server,
    server_command,
)

gguf = pytest.importorskip("gguf")

ALL = {"llama-bench": "lb", "llama-batched-bench": "lbb", SERVER: "ls"}


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in ALL.items() if k not in names}


def test_the_server_runs_only_the_cases_whose_benchmark_tool_is_missing() -> None:
    clients = llamacpp.Workload("clients", 64, 4096, 3, (1, 2, 4, 8), stream_prompt=17)
    assert llamacpp.server_cases(ALL, clients) == []
    assert llamacpp.server_cases(_without(SERVER, "llama-bench", "llama-batched-bench"), clients) == []
    only = llamacpp.server_cases(_without("llama-bench", "llama-batched-bench"), clients)
    assert [(c.case, c.streams, c.prompt, c.tokens) for c in only] == [
        ("1 clients", 1, 17, 64),
        ("2 clients", 2, 17, 64),
        ("4 clients", 4, 17, 64),
        ("8 clients", 8, 17, 64),
    ]
    assert [c.case for c in llamacpp.server_cases(_without("llama-batched-bench"), clients)] == [
        "2 clients",
        "4 clients",
        "8 clients",
    ]
    assert [c.case for c in llamacpp.server_cases(_without("llama-bench"), clients)] == ["1 clients"]
    (prompt,) = llamacpp.server_cases({SERVER: "ls"}, llamacpp.Workload("prompt", 64, 4096, 3, ()))
    assert (prompt.case, prompt.streams, prompt.prompt, prompt.tokens, prompt.what) == (
        "prompt",
        1,
        4096,
        1,
        "server pp4096",
    )
    (two,) = llamacpp.server_cases({SERVER: "ls"}, llamacpp.Workload("two-decodes", 64, 0, 3, (), 20))
    assert (two.case, two.streams, two.what) == ("two-decodes", 2, "server 2 streams, pp20 tg64")
    # The server alone is enough for every workload llama.cpp has a counterpart of.
    for workload in ("solo", "prompt", "two-decodes", "clients"):
        assert llamacpp.skip_reason({SERVER: "ls"}, workload) is None
    assert "llama-bench or llama-server" in str(llamacpp.skip_reason({"llama-batched-bench": "x"}, "solo"))


def test_the_server_gets_a_slot_per_stream_each_holding_a_streams_prompt_and_tokens() -> None:
    cases = [ServerCase("1 clients", 1, 17, 64), ServerCase("8 clients", 8, 17, 64)]
    cmd = server_command("ls", "m.gguf", 8123, cases)
    assert cmd[0] == "ls" and cmd[cmd.index("-m") + 1] == "m.gguf" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("-ngl") + 1] == llamacpp.FULL_OFFLOAD and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    slots, context = int(cmd[cmd.index("-np") + 1]), int(cmd[cmd.index("-c") + 1])
    assert slots == 8 and context // slots >= 17 + 64
    (cmd,) = [server_command("ls", "m.gguf", 1, [ServerCase("prompt", 1, 32768, 1)])]
    assert int(cmd[cmd.index("-c") + 1]) >= 32769 and cmd[cmd.index("-np") + 1] == "1"
    body = completion([5, 6], 64)  # greedy, every token generated, the prompt read afresh
    assert body["n_predict"] == 64 and body["temperature"] == 0 and body["ignore_eos"]
    assert body["cache_prompt"] is False and body["prompt"] == [5, 6]


def test_figures_come_from_the_servers_own_timings() -> None:
    """Streams that decode together: every stream's tokens over the longest stream's generation time (what
    llama-batched-bench's decode rate is); a prompt: the ids read per second of reading."""
    replies = [
        {"timings": {"predicted_n": 64, "predicted_ms": 400.0}},
        {"timings": {"predicted_n": 64, "predicted_ms": 500.0}},
    ]
    assert decode_rate(replies) == pytest.approx(128 / 0.5)
    assert prompt_rate({"timings": {"prompt_n": 4096, "prompt_ms": 250.0}}) == pytest.approx(4096 / 0.25)


def test_a_stream_that_stops_short_or_a_prompt_read_in_part_becomes_a_note() -> None:
    from strata_runtime.bench.llamacpp_server import measure

    def post(n: int, p: int):
        return lambda path, body: {
            "timings": {"predicted_n": n, "predicted_ms": 10.0, "prompt_n": p, "prompt_ms": 1.0}
        }

    figure, notes = measure(post(5, 20), ServerCase("two-decodes", 2, 20, 8), repeats=2)
    assert (
        figure == pytest.approx(1000.0)
        and notes == ["server 2 streams, pp20 tg8: a stream stopped after 5 of 8 tokens"] * 2
    )
    figure, notes = measure(post(1, 100), ServerCase("prompt", 1, 300, 1), repeats=1)
    assert figure == pytest.approx(100_000.0) and notes == ["server pp300: read 100 of 300 prompt ids"]


def test_a_server_that_never_answers_and_an_error_reply_are_named(tmp_path: Path) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from strata_runtime.bench.llamacpp_server import free_port, http_post, wait_ready

    log = tmp_path / "server.log"
    log.write_text("loading the model\n")
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        why = wait_ready(f"http://127.0.0.1:{free_port()}", silent, str(log), timeout=1.0)
    finally:
        silent.kill()
        silent.wait()
    assert why == f"{SERVER} was not ready after 1 s: loading the model"

    class Refusing(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_POST(self) -> None:
            body = b'{"error": {"message": "the request exceeds the available context size"}}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(
            ValueError, match="/completion answered 400: .*exceeds the available context size"
        ):
            http_post(f"http://127.0.0.1:{server.server_address[1]}")("/completion", {})
    finally:
        server.shutdown()
        server.server_close()


STAND_IN = """\
#!{python}
# A stand-in llama-server: loads the GGUF's vocabulary as llama.cpp's server needs one to answer, then
# serves /health and /completion with timings of 2 ms a token generated and 0.1 ms a prompt id read, and
# logs every request with how many were in flight.
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import gguf
args = sys.argv[1:]
if "FAIL" in args[args.index("-m") + 1]:
    print("error: loading model: this file was meant to fail", flush=True)
    sys.exit(3)
model = gguf.GGUFReader(args[args.index("-m") + 1])
assert "tokenizer.ggml.tokens" in model.fields, "no vocabulary: the server would abort"
slots = int(args[args.index("-np") + 1])
log = open({log!r}, "a")
lock = threading.Lock()
flight = [0]

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            flight[0] += 1
            now = flight[0]
        time.sleep(0.5)  # long enough that a round's streams are all in flight together
        with lock:
            flight[0] -= 1
        n, p = body["n_predict"], len(body["prompt"])
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        record = {{"n": n, "prompt": p, "in_flight": now, "slots": slots, "body": body, "gpus": gpus}}
        log.write(json.dumps(record) + "\\n")
        log.flush()
        self.reply(200, {{"content": "", "timings": {{"prompt_n": p, "prompt_ms": 0.1 * p,
                                                      "predicted_n": n, "predicted_ms": 2.0 * n}}}})

ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


def _stand_in(tmp_path: Path) -> tuple[dict[str, str], Path]:
    log = tmp_path / "requests.jsonl"
    tool = tmp_path / "bin" / SERVER
    tool.parent.mkdir()
    tool.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{tool.parent}{os.pathsep}{Path(sys.executable).parent}"}
    return env, log


def test_bench_runs_llama_server_beside_its_arm_where_the_benchmark_tools_are_missing(tmp_path: Path) -> None:
    env, log = _stand_in(tmp_path)
    args = ["bench", "profiles/demo.toml", "--workload", "clients", "--arms", "serial", "--repeats", "2"]
    args += ["--tokens", "8", "--peer", "llama.cpp", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "strata_cfg", *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr
    peer = json.loads(out.stdout)["peers"]["llama.cpp"]
    assert peer["notes"] == []
    # Each stream reads a prompt as long as the runtime's requests' on average (the demo's byte-level ids).
    from strata_runtime.bench.harness import mean_prompt_tokens
    from strata_runtime.weights.tokenizer import ByteTokenizer

    pp = mean_prompt_tokens("clients", ByteTokenizer(384), 8, 1024, 8)
    assert [(f["case"], f["what"]) for f in peer["figures"]] == [
        ("1 clients", "server tg8"),
        ("2 clients", f"server 2 streams, pp{pp} tg8"),
        ("4 clients", f"server 4 streams, pp{pp} tg8"),
        ("8 clients", f"server 8 streams, pp{pp} tg8"),
    ]
    # 2 ms a token: 500 tok/s a stream, and streams decoding together add up.
    assert [f["tok_s"] for f in peer["figures"]] == pytest.approx([500.0, 1000.0, 2000.0, 4000.0])
    (cmd,) = peer["commands"]
    # The demo plan runs on CPU devices: llama.cpp sees no GPU, as the command shown says.
    assert cmd[0] == "CUDA_VISIBLE_DEVICES=" and Path(cmd[1]).name == SERVER
    assert cmd[cmd.index("-np") + 1] == "8" and "-ts" not in cmd
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["gpus"] for r in requests} == {""}
    # Per case: a warm-up round and two measured ones, every stream of a round at once.
    assert len(requests) == 3 * (1 + 2 + 4 + 8)
    assert max(r["in_flight"] for r in requests) == 8 and {r["slots"] for r in requests} == {8}
    measured = [r for r in requests if r["n"] == 8]
    assert len(measured) == 2 * (1 + 2 + 4 + 8) + (1 + 2 + 4 + 8)  # 8 tokens: the warm-up generates as many
    assert {r["prompt"] for r in requests} == {pp} and all(r["body"]["ignore_eos"] for r in requests)
    prompts = [tuple(r["body"]["prompt"]) for r in requests]
    assert len(set(prompts)) > len(prompts) // 2  # fresh ids round by round, not one prompt again and again


def test_a_prompt_through_the_server_and_a_server_that_fails_to_start(tmp_path: Path) -> None:
    env, log = _stand_in(tmp_path)
    model = tmp_path / "m.gguf"
    subprocess.run(
        [sys.executable, "-m", "strata_cfg", "gguf", "profiles/demo.toml", str(model)],
        check=True,
        timeout=300,
    )
    server = str(Path(env["PATH"].split(os.pathsep)[0]) / SERVER)
    run = run_server(server, str(model), [ServerCase("prompt", 1, 300, 1)], repeats=3)
    assert run.notes == [] and [(c.what, f) for c, f in run.figures] == [
        ("server pp300", pytest.approx(10_000.0))
    ]
    assert [json.loads(x)["prompt"] for x in log.read_text().splitlines()] == [300] * 4  # warm-up + 3
    # A file without a vocabulary (a checkpoint's, or one an earlier version wrote) is refused before the
    # server starts: it would abort on the first token it turns into text.
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), "qwen3moe")
    writer.add_tokenizer_model("none")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    run = run_server(server, str(bare), [ServerCase("solo", 1, 20, 8)], repeats=1)
    assert run.figures == [] and len(run.notes) == 1 and "has no vocabulary" in run.notes[0]
    assert len(log.read_text().splitlines()) == 4  # no request reached a server
    failing = tmp_path / "FAIL.gguf"
    shutil.copy(model, failing)
    run = run_server(server, str(failing), [ServerCase("solo", 1, 20, 8)], repeats=1)
    assert run.figures == [] and run.notes == [
        f"{SERVER} exited 3 before it was ready: error: loading model: this file was meant to fail"
    ]


def _real_server() -> str | None:
    found = shutil.which(SERVER)
    if found is None:
        return None
    head = Path(found).read_bytes()[:4]
    return found if head == b"\x7fELF" else None  # a built binary, not a stand-in script


@pytest.mark.skipif(_real_server() is None, reason="needs llama.cpp's llama-server on PATH")
def test_llama_cpp_serves_the_exported_demo_model_as_the_engine_does(tmp_path: Path) -> None:
    """The same weights and the same ids in fact: llama.cpp, given the demo model as `strata gguf` writes
    it, cuts text into the runtime's ids (special tokens included) and continues a prompt, sent as text,
    with the runtime's own greedy tokens and text."""
    import urllib.request

    from strata_cfg.plan.from_profile import resolve_profile
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.bench.llamacpp_server import free_port, wait_ready
    from strata_runtime.engine import Engine

    plan = resolve_profile("profiles/demo.toml")
    engine = Engine(plan)
    text = "It is a truth universally acknowledged, that a single man"
    prompt = engine.tokenizer.encode(text)
    handle = engine.submit(Request(tuple(prompt), 24, SamplingParams(temperature=0.0)))
    while engine.step():
        pass
    ours = [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]
    model = tmp_path / "demo.gguf"
    subprocess.run(
        [sys.executable, "-m", "strata_cfg", "gguf", "profiles/demo.toml", str(model)],
        check=True,
        timeout=300,
    )
    port = free_port()
    cmd = server_command(str(_real_server()), str(model), port, [ServerCase("solo", 1, len(prompt), 24)])
    with open(tmp_path / "server.log", "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(base + path, json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())

    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_ready(base, proc, str(tmp_path / "server.log"), timeout=120) is None
        mixed = "Élinor’s <|im_start|>user\nnaïve 🙂 café<|im_end|>"
        cut = post("/tokenize", {"content": mixed, "add_special": False, "parse_special": True})
        assert cut["tokens"] == engine.tokenizer.encode(mixed)
        body = {**completion([], 24), "prompt": text, "return_tokens": True, "ignore_eos": False}
        theirs = post("/completion", body)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(ours) == 24 and theirs["tokens"] == ours
    assert theirs["content"] == engine.tokenizer.decode(ours)
