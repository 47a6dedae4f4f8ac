"""Drive a running engine over HTTP, as its users do, and measure what they get.

``run_load`` keeps N clients busy for T seconds (or for a fixed number of requests each), each sending one
``/v1/completions`` request after another, and reports requests served, errors, latency percentiles and the
aggregate token rate. With ``stream=True`` it also measures the time to the first token. Every response is
checked whole: a 200 with no text, a missing usage count or a stream that does not end in ``[DONE]`` is an
error, not a success.

``bench_url`` runs BENCH.md's workloads against a launched engine (``strata bench --url``), with the same
prompts and figures as the in-process harness; the window statistics come from ``/v1/status``.

Standard library only (threads and ``http.client``), so `strata loadtest` and ``strata bench --url`` work
wherever strata_cfg is installed, without the engine.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..schema.workloads import CLIENT_COUNTS, PROMPTS


@dataclass
class Sample:
    """One request as the client saw it."""

    ok: bool
    seconds: float
    tokens: int = 0
    first_token_s: float | None = None
    error: str | None = None


@dataclass
class LoadResult:
    """What a load run measured."""

    url: str
    clients: int
    max_tokens: int
    stream: bool
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def served(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.served)

    def latency(self, q: float) -> float | None:
        return percentile([s.seconds for s in self.served], q)

    def first_token(self, q: float) -> float | None:
        return percentile([s.first_token_s for s in self.served if s.first_token_s is not None], q)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "clients": self.clients,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "wall_s": round(self.wall_s, 3),
            "requests": len(self.served),
            "errors": len(self.errors),
            "error_samples": sorted({s.error or "" for s in self.errors})[:5],
            "tokens": self.tokens,
            "tok_s": round(self.tokens / self.wall_s, 2) if self.wall_s > 0 else None,
            "latency_p50_s": _round(self.latency(0.50)),
            "latency_p95_s": _round(self.latency(0.95)),
            "first_token_p50_s": _round(self.first_token(0.50)),
            "first_token_p95_s": _round(self.first_token(0.95)),
        }

    def lines(self) -> list[str]:
        j = self.to_json()
        out = [
            f"{j['clients']} clients, {j['max_tokens']} tokens each, {j['wall_s']} s: "
            f"{j['requests']} requests served, {j['errors']} errors",
            f"  latency p50 {_ms(j['latency_p50_s'])}, p95 {_ms(j['latency_p95_s'])}; "
            f"{j['tokens']} tokens, {j['tok_s']} tok/s aggregate",
        ]
        if self.stream:
            out.append(f"  first token p50 {_ms(j['first_token_p50_s'])}, p95 {_ms(j['first_token_p95_s'])}")
        out += [f"  error: {e}" for e in j["error_samples"]]
        return out


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile with linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Client:
    """One keep-alive connection to the engine."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http:// URL, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def get_json(self, path: str) -> Any:
        conn = self._connection()
        conn.request("GET", self.prefix + path, headers=self.headers)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {r.status}: {body[:200]!r}")
        return json.loads(body)

    def complete(self, body: dict[str, Any]) -> Sample:
        start = time.perf_counter()
        try:
            conn = self._connection()
            conn.request("POST", self.prefix + "/v1/completions", json.dumps(body), self.headers)
            r = conn.getresponse()
            if r.status != 200:
                return Sample(
                    False, time.perf_counter() - start, error=f"HTTP {r.status}: {r.read()[:200]!r}"
                )
            if body.get("stream"):
                return self._read_stream(r, start)
            data = json.loads(r.read())
            return _check_whole(data, time.perf_counter() - start)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            return Sample(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")

    def _read_stream(self, r: http.client.HTTPResponse, start: float) -> Sample:
        first: float | None = None
        finish = None
        text = ""
        usage: dict[str, Any] | None = None
        done = False
        for chunk in _sse_chunks(r):
            if chunk is None:
                done = True
                break
            if "error" in chunk:
                self.close()
                return Sample(False, time.perf_counter() - start, error=str(chunk["error"].get("message")))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text") and first is None:
                    first = time.perf_counter() - start
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
        r.read()  # the end of the chunked body, so the connection can carry the next request
        seconds = time.perf_counter() - start
        if not done or finish not in ("stop", "length") or usage is None:
            return Sample(False, seconds, error=f"incomplete stream (done={done}, finish={finish})")
        return Sample(True, seconds, tokens=int(usage["completion_tokens"]), first_token_s=first)


def _sse_chunks(r: http.client.HTTPResponse) -> Iterator[dict[str, Any] | None]:
    """The JSON chunks of a server-sent event stream, then None for its closing ``data: [DONE]``."""
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


def _check_whole(data: dict[str, Any], seconds: float) -> Sample:
    try:
        choice = data["choices"][0]
        tokens = int(data["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return Sample(False, seconds, error=f"malformed response: {str(data)[:200]}")
    if choice.get("finish_reason") not in ("stop", "length") or tokens < 1:
        return Sample(False, seconds, error=f"incomplete response: {str(data)[:200]}")
    return Sample(True, seconds, tokens=tokens)


def served_model(url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The model id the engine serves (the first of ``/v1/models``)."""
    client = Client(url, api_key, timeout)
    try:
        return str(client.get_json("/v1/models")["data"][0]["id"])
    finally:
        client.close()


def run_load(
    url: str,
    *,
    clients: int,
    seconds: float | None = None,
    requests_per_client: int | None = None,
    max_tokens: int = 64,
    prompt: str = "Once upon a time",
    temperature: float = 0.0,
    stream: bool = False,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> LoadResult:
    """Keep ``clients`` clients sending requests for ``seconds`` (or ``requests_per_client`` each)."""
    if (seconds is None) == (requests_per_client is None):
        raise ValueError("give exactly one of seconds or requests_per_client")
    model = served_model(url, api_key, timeout=min(timeout, 30.0))
    samples: list[Sample] = []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = None if seconds is None else start + seconds

    def client_loop(index: int) -> None:
        client = Client(url, api_key, timeout)
        sent = 0
        try:
            while True:
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                if requests_per_client is not None and sent >= requests_per_client:
                    break
                body: dict[str, Any] = {
                    "model": model,
                    # Distinct prompts per client and request, so no two requests are the same work.
                    "prompt": f"{prompt} ({index}.{sent})",
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                }
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                sample = client.complete(body)
                sent += 1
                with lock:
                    samples.append(sample)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return LoadResult(
        url=url, clients=clients, max_tokens=max_tokens, stream=stream, wall_s=wall, samples=samples
    )


def clients_workload(
    url: str, counts: tuple[int, ...] = (1, 2, 4, 8), max_tokens: int = 300, api_key: str | None = None
) -> list[LoadResult]:
    """BENCH.md's ``clients`` workload over HTTP: for each count, that many clients send one request each."""
    return [
        run_load(url, clients=n, requests_per_client=1, max_tokens=max_tokens, api_key=api_key)
        for n in counts
    ]


# ---- BENCH.md workloads against a launched engine (`strata bench --url`) ---------------------------------


@dataclass
class Stream:
    """One streamed request: when it was sent, when its first and last tokens came, how many tokens."""

    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    error: str | None = None

    @property
    def rate(self) -> float:
        """Generated tokens per second over the request's whole run (as the in-process harness counts)."""
        span = (self.done or self.sent) - self.sent
        return self.tokens / span if span > 0 else 0.0


def _stream(
    client: Client, body: dict[str, Any], t0: float, out: Stream, progress: threading.Event | None
) -> None:
    """Send one streaming completion and fill ``out`` as its chunks arrive."""
    conn = client._connection()
    try:
        conn.request("POST", client.prefix + "/v1/completions", json.dumps(body), client.headers)
        r = conn.getresponse()
        if r.status != 200:
            out.error = f"HTTP {r.status}: {r.read()[:200]!r}"
            return
        for chunk in _sse_chunks(r):
            if chunk is None:
                break
            if "error" in chunk:
                out.error = str(chunk["error"].get("message"))
                break
            if chunk.get("usage"):
                out.tokens = int(chunk["usage"]["completion_tokens"])
                out.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
            elif chunk.get("choices"):
                out.chunks += 1
                if out.first is None:
                    out.first = time.perf_counter() - t0
                if progress is not None and out.chunks >= 8:
                    progress.set()
        r.read()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.done = time.perf_counter() - t0
        if progress is not None:
            progress.set()
        client.close()


def _totals(url: str, api_key: str | None) -> dict[str, float]:
    client = Client(url, api_key, 30.0)
    try:
        return dict(client.get_json("/v1/status")["engine"].get("totals", {}))
    finally:
        client.close()


def http_run(
    url: str, workload: str, *, clients: int, tokens: int, context: int, vocab: int, api_key: str | None
) -> dict[str, float]:
    """One run of a workload over HTTP, with the same figures as the in-process harness."""
    model = served_model(url, api_key)
    n = {"two-decodes": 2, "clients": clients, "solo": 1, "read-beside-decode": 1}[workload]
    streams: list[Stream] = []
    workers: list[threading.Thread] = []
    progress = threading.Event() if workload == "read-beside-decode" else None

    def send(prompt: str | list[int], max_tokens: int, watch: threading.Event | None) -> None:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        body["temperature"] = 0
        body["stream_options"] = {"include_usage": True}
        stream = Stream(sent=time.perf_counter() - t0)
        worker = threading.Thread(target=_stream, args=(Client(url, api_key, 600.0), body, t0, stream, watch))
        streams.append(stream)
        workers.append(worker)
        worker.start()

    before = _totals(url, api_key)
    t0 = time.perf_counter()
    for i in range(n):
        send(PROMPTS[i % len(PROMPTS)], tokens, progress)
    if progress is not None:
        progress.wait()  # the long prompt arrives once the decoding stream is under way
        length = max(16, min(context - 2, 48_000))
        send([(7 * k + 11) % min(vocab, 256) for k in range(length)], 1, None)
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    failed = [s.error for s in streams if s.error]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    after = _totals(url, api_key)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("windows", "rows", "ms", "proposals", "accepted")}
    out = {
        "ms_per_window": d["ms"] / d["windows"] if d["windows"] else 0.0,
        "rows_per_window": d["rows"] / d["windows"] if d["windows"] else 0.0,
        "accepted_pct": 100.0 * d["accepted"] / d["proposals"] if d["proposals"] else 0.0,
    }
    if workload == "read-beside-decode":
        decode, reader = streams
        span = (reader.first or reader.done or reader.sent) - reader.sent
        out["prompt_read_tok_s"] = reader.prompt_tokens / span if span > 0 else 0.0
        out["decode_tok_s"] = decode.rate
        out["tok_s"] = out["prompt_read_tok_s"]
    elif workload == "clients":
        lat = [(s.done or s.sent) - s.sent for s in streams]
        out["tok_s"] = sum(s.tokens for s in streams) / wall if wall > 0 else 0.0
        out["p50_s"] = percentile(lat, 0.50) or 0.0
        out["p95_s"] = percentile(lat, 0.95) or 0.0
    else:
        out["tok_s"] = sum(s.rate for s in streams)
    return out


def bench_url(
    url: str, workload: str, *, tokens: int = 300, repeats: int = 3, api_key: str | None = None
) -> dict[str, Any]:
    """A BENCH.md workload against a launched engine: medians over ``repeats`` runs, per case."""
    client = Client(url, api_key, 30.0)
    try:
        status = client.get_json("/v1/status")
    finally:
        client.close()
    plan = status["plan"]
    context, vocab = int(plan["memory"]["context"]), int(plan["model"]["facts"]["vocab_size"])
    cases = [(f"{c} clients", c) for c in CLIENT_COUNTS] if workload == "clients" else [(workload, 1)]
    runs: dict[str, list[dict[str, float]]] = {case: [] for case, _ in cases}
    for _ in range(repeats):
        for case, clients in cases:
            runs[case].append(
                http_run(
                    url,
                    workload,
                    clients=clients,
                    tokens=tokens,
                    context=context,
                    vocab=vocab,
                    api_key=api_key,
                )
            )
    medians = {case: {k: _median([f[k] for f in figs]) for k in figs[0]} for case, figs in runs.items()}
    b = plan["batch"]
    return {
        "url": url,
        "workload": workload,
        "tokens": tokens,
        "repeats": repeats,
        "plan": {"mode": b["mode"], "groups": b["groups"], "batch_mtp": b["mtp"], "slots": b["slots"]},
        "cases": {case: {"median": m, "runs": runs[case]} for case, m in medians.items()},
    }


def _median(xs: list[float]) -> float:
    return percentile(xs, 0.5) or 0.0


def bench_lines(result: dict[str, Any]) -> list[str]:
    p = result["plan"]
    lines = [
        f"workload {result['workload']} over HTTP at {result['url']}: {result['tokens']} tokens per request, "
        f"medians of {result['repeats']} runs",
        f"engine plan: {p['mode']}, {p['groups']} group(s), batch MTP {'on' if p['batch_mtp'] else 'off'}, "
        f"{p['slots']} slot(s)",
        "",
        f"{'case':<20} {'tok/s':>9} {'ms/win':>8} {'rows/win':>8} {'accept':>7}",
    ]
    for case, entry in result["cases"].items():
        m = entry["median"]
        extra = ""
        if "p50_s" in m:
            extra = f"  p50 {m['p50_s']:.3f}s p95 {m['p95_s']:.3f}s"
        if "decode_tok_s" in m:
            extra = f"  prompt read {m['prompt_read_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s"
        lines.append(
            f"{case:<20} {m['tok_s']:9.1f} {m['ms_per_window']:8.2f} {m['rows_per_window']:8.2f} "
            f"{m['accepted_pct']:6.1f}%{extra}"
        )
    return lines
