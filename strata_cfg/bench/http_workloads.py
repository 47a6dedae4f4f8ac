"""`strata bench --url`: the bench workloads against a launched engine, with the same prompts and figures
as the in-process harness (the window statistics come from the engine's ``/v1/status``)."""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..schema.workloads import (
    CLIENT_COUNTS,
    GENERATING,
    PROMPTS,
    generation_rate,
    prompt_context_problem,
    prompt_ids,
)
from .http_driver import Client, served_model, sse_chunks
from .stats import median, percentile


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
    try:
        r = client.post_completion(body)
        if r.status != 200:
            out.error = f"HTTP {r.status}: {r.read()[:200]!r}"
            return
        for chunk in sse_chunks(r):
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


GREEDY: dict[str, float] = {"temperature": 0.0}


def request_body(
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    sampling: dict[str, float] | None,
    index: int,
    seeded: bool = True,
) -> dict[str, Any]:
    """A streamed completion request of the workload: ``sampling`` (greedy without), seeded by ``index``
    when it samples and ``seeded``."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body.update(sampling or GREEDY)
    if body["temperature"] > 0 and seeded:
        body["seed"] = index
    body["stream_options"] = {"include_usage": True}
    return body


def http_run(
    url: str,
    workload: str,
    *,
    clients: int,
    tokens: int,
    context: int,
    vocab: int,
    api_key: str | None,
    sampling: dict[str, float] | None = None,
    prompt_tokens: int = 0,
    seed: int = 0,
    seeded: bool = True,
) -> dict[str, float]:
    """One run of a workload over HTTP, with the same figures as the in-process harness. ``sampling``: the
    decoding requests' temperature, top_p, top_k and penalties (each request seeded by its index when it
    samples, unless ``seeded`` is False); greedy without.
    ``prompt`` sends one prompt of ``prompt_tokens`` ids (`prompt_ids` with ``seed``) for one greedy token."""
    model = served_model(url, api_key)
    n = {"two-decodes": 2, "clients": clients, "solo": 1, "read-beside-decode": 1, "prompt": 0}[workload]
    streams: list[Stream] = []
    workers: list[threading.Thread] = []
    progress = threading.Event() if workload == "read-beside-decode" else None

    def send(
        prompt: str | list[int], max_tokens: int, watch: threading.Event | None, greedy: bool = False
    ) -> None:
        body = request_body(model, prompt, max_tokens, GREEDY if greedy else sampling, len(streams), seeded)
        stream = Stream(sent=time.perf_counter() - t0)
        worker = threading.Thread(target=_stream, args=(Client(url, api_key, 600.0), body, t0, stream, watch))
        streams.append(stream)
        workers.append(worker)
        worker.start()

    before = _totals(url, api_key)
    t0 = time.perf_counter()
    for i in range(n):
        send(PROMPTS[i % len(PROMPTS)], tokens, progress)
    if workload == "prompt":
        # The one generated token only marks the end of the read: greedy.
        send(list(prompt_ids(prompt_tokens, vocab, seed)), 1, None, greedy=True)
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
    if workload == "prompt":
        (reader,) = streams
        span = (reader.first or reader.done or reader.sent) - reader.sent
        out["prompt_tokens"] = float(reader.prompt_tokens)
        out["prompt_read_s"] = span  # the time to the first token: the read and the first token's window
        out["tok_s"] = reader.prompt_tokens / span if span > 0 else 0.0
    elif workload == "read-beside-decode":
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
    if workload in GENERATING:
        out["generation_tok_s"] = generation_rate((s.tokens, s.first, s.done) for s in streams)
    return out


def bench_url(
    url: str,
    workload: str,
    *,
    tokens: int = 300,
    repeats: int = 3,
    api_key: str | None = None,
    sampling: dict[str, float] | None = None,
    prompt_tokens: int = 4096,
    seeded: bool = True,
) -> dict[str, Any]:
    """A bench workload against a launched engine: medians over ``repeats`` runs, per case (``sampling``
    and ``seeded`` as `http_run` takes them; ``prompt_tokens``: the ``prompt`` workload's length, a fresh
    prompt each run).
    Raises ValueError for a prompt longer than the engine's context."""
    client = Client(url, api_key, 30.0)
    try:
        status = client.get_json("/v1/status")
    finally:
        client.close()
    plan = status["plan"]
    context, vocab = int(plan["memory"]["context"]), int(plan["model"]["facts"]["vocab_size"])
    problem = prompt_context_problem(prompt_tokens, context, launched=True)
    if workload == "prompt" and problem:
        raise ValueError(problem)
    cases = [(f"{c} clients", c) for c in CLIENT_COUNTS] if workload == "clients" else [(workload, 1)]
    runs: dict[str, list[dict[str, float]]] = {case: [] for case, _ in cases}
    for repeat in range(repeats):
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
                    sampling=sampling,
                    prompt_tokens=prompt_tokens,
                    seed=repeat,
                    seeded=seeded,
                )
            )
    medians = {case: {k: median([f[k] for f in figs]) for k in figs[0]} for case, figs in runs.items()}
    b = plan["batch"]
    return {
        "url": url,
        "workload": workload,
        "tokens": 1 if workload == "prompt" else tokens,
        "repeats": repeats,
        "plan": {"mode": b["mode"], "groups": b["groups"], "batch_mtp": b["mtp"], "slots": b["slots"]},
        "cases": {case: {"median": m, "runs": runs[case]} for case, m in medians.items()},
    }


def bench_lines(result: dict[str, Any]) -> list[str]:
    p = result["plan"]
    workload, repeats = result["workload"], result["repeats"]
    what = "one prompt per run" if workload == "prompt" else f"{result['tokens']} tokens per request"
    lines = [
        f"workload {workload} over HTTP at {result['url']}: {what}, medians of {repeats} runs",
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
            if "generation_tok_s" in m:
                extra += f", generating {m['generation_tok_s']:.1f} tok/s"
        if "decode_tok_s" in m:
            extra = f"  prompt read {m['prompt_read_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s"
        if "prompt_read_s" in m:
            extra = f"  {m['prompt_tokens']:.0f} prompt tokens, first token after {m['prompt_read_s']:.3f} s"
        lines.append(
            f"{case:<20} {m['tok_s']:9.1f} {m['ms_per_window']:8.2f} {m['rows_per_window']:8.2f} "
            f"{m['accepted_pct']:6.1f}%{extra}"
        )
    return lines
