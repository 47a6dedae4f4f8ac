"""`strata bench --url`: the bench workloads against launched engines, with the same prompts and figures
as the in-process harness (the window statistics come from a strata engine's ``/v1/status``).

Any OpenAI-compatible server can be measured (llama.cpp's ``llama-server``, vLLM, another strata engine):
one without ``/v1/status`` gives every figure but the window statistics. Several ``--url`` are measured
interleaved, case by case and repeat by repeat, and each is compared with the first: the ratio of their
median rates, with a bootstrap 95% interval. Prompts are sent as text, which every server cuts with its
own tokenizer; the ``prompt`` workload's random prompt is sent as ids, drawn from the smallest vocabulary
the strata engines among the URLs report, or from the 256 byte ids where another server is measured (ids
every vocabulary holds).
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..schema.workloads import (
    CLIENT_COUNTS,
    CONTEXT_WORKLOADS,
    GENERATING,
    PROMPTS,
    SHARED_REQUESTS,
    TURNS,
    context_problem,
    conversation_prompts,
    delivery_gaps,
    depth_prompt,
    gap_figures_ms,
    gap_text,
    generation_rate,
    longest_gap,
    prompt_ids,
    shared_prompts,
    turn_prompts,
    turns_figures,
    turns_text,
)
from .http_driver import Client, engine_status, served_model, sse_chunks
from .stats import median, percentile


@dataclass
class Stream:
    """One streamed request: when it was sent, when its first and last tokens came, how many tokens."""

    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the server did not read again (its usage's ``prompt_tokens_details.cached_tokens``)."""
    chunks: int = 0
    error: str | None = None
    deliveries: list[float] = field(default_factory=list)
    """When each chunk of tokens came."""

    @property
    def longest_gap(self) -> float | None:
        """The longest wait between two chunks of tokens after the first (None: fewer than two)."""
        return longest_gap(self.deliveries)

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
                details = chunk["usage"].get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens") or 0)
            elif chunk.get("choices"):
                out.chunks += 1
                out.deliveries.append(time.perf_counter() - t0)
                if out.first is None:
                    out.first = out.deliveries[0]
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
    ignore_eos: bool = False,
    shape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed completion request of the workload: ``sampling`` (greedy without), seeded by ``index``
    when it samples and ``seeded``; with ``ignore_eos`` it asks to generate past end-of-text; ``shape``:
    its ``structured_outputs`` (a reply held to a schema, a regex or a choice)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body.update(sampling or GREEDY)
    if body["temperature"] > 0 and seeded:
        body["seed"] = index
    if ignore_eos:
        body["ignore_eos"] = True
    if shape is not None:
        body["structured_outputs"] = shape
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
    depth: int = 0,
    seed: int = 0,
    seeded: bool = True,
    windows: bool = True,
    ignore_eos: bool = False,
    shape: dict[str, Any] | None = None,
) -> dict[str, float]:
    """One run of a workload over HTTP, with the same figures as the in-process harness. ``sampling``: the
    decoding requests' temperature, top_p, top_k and penalties (each request seeded by its index when it
    samples, unless ``seeded`` is False); greedy without.
    ``prompt`` sends one prompt of ``prompt_tokens`` ids (`prompt_ids` with ``seed``) for one greedy token.
    With ``depth`` each decoding request's prompt is `depth_prompt`'s ids instead of a short text.
    ``windows``: the server is a strata engine, whose window statistics come from its ``/v1/status``
    (without, the figures leave them out). ``shape``: the decoding requests' ``structured_outputs``."""
    model = served_model(url, api_key)
    n = {"two-decodes": 2, "clients": clients, "solo": 1, "read-beside-decode": 1}.get(workload, 0)
    streams: list[Stream] = []
    workers: list[threading.Thread] = []
    progress = threading.Event() if workload == "read-beside-decode" else None

    def send(
        prompt: str | list[int], max_tokens: int, watch: threading.Event | None, greedy: bool = False
    ) -> None:
        body = request_body(
            model,
            prompt,
            max_tokens,
            GREEDY if greedy else sampling,
            len(streams),
            seeded,
            ignore_eos,
            None if greedy else shape,
        )
        stream = Stream(sent=time.perf_counter() - t0)
        worker = threading.Thread(target=_stream, args=(Client(url, api_key, 600.0), body, t0, stream, watch))
        streams.append(stream)
        workers.append(worker)
        worker.start()

    before = _totals(url, api_key) if windows else {}
    t0 = time.perf_counter()
    for i in range(n):
        send(list(depth_prompt(depth, vocab, i)) if depth else PROMPTS[i % len(PROMPTS)], tokens, progress)
    if workload == "prompt":
        # The one generated token only marks the end of the read: greedy.
        send(list(prompt_ids(prompt_tokens, vocab, seed)), 1, None, greedy=True)
    if workload == "turns":  # one conversation: each turn once the one before has finished
        for ids in turn_prompts(prompt_tokens, vocab, seed):
            send(list(ids), tokens, None)
            workers[-1].join()
    if workload == "shared":  # one context, a question each, all at once
        for ids in shared_prompts(prompt_tokens, vocab, seed):
            send(list(ids), tokens, None)
    if workload == "conversations":  # ``clients`` conversations taking turns, one request at a time
        convs = conversation_prompts(prompt_tokens, vocab, seed, clients)
        for turn in range(TURNS):
            for conv in convs:
                send(list(conv[turn]), tokens, None)
                workers[-1].join()
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
    out: dict[str, float] = {}
    if windows:
        after = _totals(url, api_key)
        d = {
            k: after.get(k, 0) - before.get(k, 0) for k in ("windows", "rows", "ms", "proposals", "accepted")
        }
        out["ms_per_window"] = d["ms"] / d["windows"] if d["windows"] else 0.0
        out["rows_per_window"] = d["rows"] / d["windows"] if d["windows"] else 0.0
        out["accepted_pct"] = 100.0 * d["accepted"] / d["proposals"] if d["proposals"] else 0.0
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
    elif workload in CONTEXT_WORKLOADS:
        rows = [
            (s.sent, s.first, s.done or s.sent, s.tokens, s.prompt_tokens, s.cached_tokens) for s in streams
        ]
        out |= turns_figures(
            rows, at_once=workload == "shared", firsts=clients if workload == "conversations" else 1
        )
    elif workload == "clients":
        lat = [(s.done or s.sent) - s.sent for s in streams]
        out["tok_s"] = sum(s.tokens for s in streams) / wall if wall > 0 else 0.0
        out["p50_s"] = percentile(lat, 0.50) or 0.0
        out["p95_s"] = percentile(lat, 0.95) or 0.0
    else:
        out["tok_s"] = sum(s.rate for s in streams)
    if workload in GENERATING:
        out["generation_tok_s"] = generation_rate((s.tokens, s.first, s.done) for s in streams)
        out |= gap_figures_ms(delivery_gaps(s.deliveries) for s in streams)
    return out


@dataclass(frozen=True)
class Target:
    """One server the bench measures: a strata engine (``status``: its ``/v1/status``) or another
    OpenAI-compatible server (``status`` None)."""

    name: str
    url: str
    status: dict[str, Any] | None

    @property
    def context(self) -> int | None:
        return int(self.status["plan"]["memory"]["context"]) if self.status else None

    @property
    def vocab(self) -> int | None:
        return int(self.status["plan"]["model"]["facts"]["vocab_size"]) if self.status else None

    def plan(self) -> dict[str, Any] | None:
        if self.status is None:
            return None
        b = self.status["plan"]["batch"]
        return {"mode": b["mode"], "groups": b["groups"], "batch_mtp": b["mtp"], "slots": b["slots"]}


def bootstrap_ratio(arm: list[float], base: list[float], seed: int = 0, draws: int = 2000) -> list[float]:
    """95% bootstrap interval of median(arm) / median(base), resampling each side's runs."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        b = median([rng.choice(base) for _ in base])
        if b > 0:
            ratios.append(median([rng.choice(arm) for _ in arm]) / b)
    lo, hi = percentile(ratios, 0.025), percentile(ratios, 0.975)
    return [lo or 0.0, hi or 0.0]


def bench_urls(
    urls: dict[str, str],
    workload: str,
    *,
    tokens: int = 300,
    repeats: int = 3,
    api_key: str | None = None,
    sampling: dict[str, float] | None = None,
    prompt_tokens: int = 4096,
    depth: int = 0,
    seeded: bool = True,
    ignore_eos: bool = False,
    shape: dict[str, Any] | None = None,
    on_run: Callable[[str, str, int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """A bench workload against launched servers (``urls``: by name), interleaved: each repeat runs every
    case on every server in turn. Medians over ``repeats`` runs per server and case, and for each server
    after the first its rate over the first's (``ratio`` and its bootstrap ``ratio_ci95``). ``sampling``,
    ``seeded``, ``ignore_eos`` and ``shape`` as `http_run` takes them; ``prompt_tokens``: the ``prompt``
    workload's length, a fresh prompt each run; ``depth``: the decoding requests' prompt length
    (`depth_prompt`; 0: the short text prompts). ``on_run(name, case, repeat, figures)`` is called after
    each run, as the in-process harness's is (the command prints a progress line).

    Raises ValueError for a prompt (or a depth and its tokens) longer than a strata engine's context, and
    for ``read-beside-decode`` without a strata engine among the servers (its long prompt is sized by the
    engine's context)."""
    targets = [Target(name, url, engine_status(url, api_key)) for name, url in urls.items()]
    contexts = [t.context for t in targets if t.context is not None]
    vocabs = [t.vocab for t in targets if t.vocab is not None]
    context = min(contexts) if contexts else None
    vocab = 256 if any(t.status is None for t in targets) else min(vocabs)
    if context is not None:
        problem = context_problem(workload, prompt_tokens, depth, tokens, context, launched=True)
        if problem:
            raise ValueError(problem)
    elif workload == "read-beside-decode":
        raise ValueError(
            "read-beside-decode sizes its long prompt by a strata engine's context, and none of the URLs is "
            "a strata engine (none answers /v1/status)"
        )
    slots = [int(t.status["plan"]["batch"]["slots"]) for t in targets if t.status is not None]
    if workload == "conversations" and not slots:
        raise ValueError(
            "conversations sends one conversation more than a strata engine has slots, and none of the URLs "
            "is a strata engine (none answers /v1/status)"
        )
    cases = [(f"{c} clients", c) for c in CLIENT_COUNTS] if workload == "clients" else [(workload, 1)]
    if workload == "conversations":
        cases = [(workload, max(slots) + 1)]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {t.name: {c: [] for c, _ in cases} for t in targets}
    for repeat in range(repeats):
        for case, clients in cases:
            for t in targets:
                figures = http_run(
                    t.url,
                    workload,
                    clients=clients,
                    tokens=tokens,
                    context=context or 0,
                    vocab=vocab,
                    api_key=api_key,
                    sampling=sampling,
                    prompt_tokens=prompt_tokens,
                    depth=depth,
                    seed=repeat,
                    seeded=seeded,
                    windows=t.status is not None,
                    ignore_eos=ignore_eos,
                    shape=shape,
                )
                runs[t.name][case].append(figures)
                if on_run is not None:
                    on_run(t.name, case, repeat, figures)
    arms: dict[str, Any] = {}
    base = targets[0].name
    for t in targets:
        entry: dict[str, Any] = {
            "url": t.url,
            "server": "strata" if t.status else "openai-compatible",
            "plan": t.plan(),
        }
        entry["cases"] = {}
        for case, figs in runs[t.name].items():
            med = {k: median([f[k] for f in figs]) for k in figs[0]}
            entry["cases"][case] = {"median": med, "runs": figs}
            if t.name != base:
                mine = [f["tok_s"] for f in figs]
                theirs = [f["tok_s"] for f in runs[base][case]]
                first = median(theirs)
                entry["cases"][case]["ratio"] = med["tok_s"] / first if first > 0 else 0.0
                entry["cases"][case]["ratio_ci95"] = bootstrap_ratio(mine, theirs)
        arms[t.name] = entry
    return {
        "workload": workload,
        "tokens": 1 if workload == "prompt" else tokens,
        **({"depth": depth} if depth else {}),
        **({"conversations": cases[0][1]} if workload == "conversations" else {}),
        "repeats": repeats,
        "base": base,
        "arms": arms,
    }


def bench_url(url: str, workload: str, **kw: Any) -> dict[str, Any]:
    """`bench_urls` for one server, in the one-server layout: its ``url``, ``plan`` (None for a server
    other than strata) and ``cases`` at the top."""
    res = bench_urls({url: url}, workload, **kw)
    (arm,) = res.pop("arms").values()
    res.pop("base")
    return {"url": url, **res, "server": arm["server"], "plan": arm["plan"], "cases": arm["cases"]}


def _plan_line(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "an OpenAI-compatible server other than strata (no window statistics)"
    return (
        f"engine plan: {plan['mode']}, {plan['groups']} group(s), batch MTP "
        f"{'on' if plan['batch_mtp'] else 'off'}, {plan['slots']} slot(s)"
    )


def _case_line(label: str, m: dict[str, float], ratio: str = "", width: int = 20, workload: str = "") -> str:
    extra = ""
    if "p50_s" in m:
        extra = f"  p50 {m['p50_s']:.3f}s p95 {m['p95_s']:.3f}s"
        if "generation_tok_s" in m:
            extra += f", generating {m['generation_tok_s']:.1f} tok/s"
    extra += gap_text(m)
    if "decode_tok_s" in m:
        extra = f"  prompt read {m['prompt_read_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s"
    if "prompt_read_s" in m:
        extra = f"  {m['prompt_tokens']:.0f} prompt tokens, first token after {m['prompt_read_s']:.3f} s"
    extra = turns_text(m, workload) + extra
    if "ms_per_window" in m:
        win = f"{m['ms_per_window']:8.2f} {m['rows_per_window']:8.2f} {m['accepted_pct']:6.1f}%"
    else:
        win = f"{'-':>8} {'-':>8} {'-':>7}"
    return f"{label:<{width}} {m['tok_s']:9.1f} {win}{ratio}{extra}"


def bench_lines(result: dict[str, Any]) -> list[str]:
    """The table of a `bench_url` or `bench_urls` result."""
    workload, repeats = result["workload"], result["repeats"]
    what = "one prompt per run" if workload == "prompt" else f"{result['tokens']} tokens per request"
    if workload == "turns":
        what = f"one conversation of {TURNS} turns, {result['tokens']} tokens each"
    if workload == "shared":
        what = f"{SHARED_REQUESTS} requests with one context and a question each, at once, "
        what += f"{result['tokens']} tokens each"
    if workload == "conversations":
        what = (
            f"{result['conversations']} conversations of {TURNS} turns (one more than the most slots a "
            f"strata server has), taking turns one request at a time, {result['tokens']} tokens each"
        )
    if result.get("depth"):
        what += f", each after a prompt of {result['depth']} tokens"
    figures = f"{'tok/s':>9} {'ms/win':>8} {'rows/win':>8} {'accept':>7}"
    header = f"{'case':<20} {figures}"
    if "arms" not in result:
        return [
            f"workload {workload} over HTTP at {result['url']}: {what}, medians of {repeats} runs",
            _plan_line(result["plan"]),
            "",
            header,
            *(_case_line(case, e["median"], workload=workload) for case, e in result["cases"].items()),
        ]
    base = result["base"]
    lines = [f"workload {workload} over HTTP, servers interleaved: {what}, medians of {repeats} runs"]
    lines += [f"  {name}: {arm['url']}: {_plan_line(arm['plan'])}" for name, arm in result["arms"].items()]
    first = next(iter(result["arms"].values()))
    cases = max(len(c) for c in first["cases"])
    names = max(len(n) for n in result["arms"])
    width = cases + 1 + names
    lines += ["", f"{'case':<{cases}} {'server':<{names}} {figures}  tok/s over {base}"]
    for case in first["cases"]:
        for name, arm in result["arms"].items():
            e = arm["cases"][case]
            ratio = ""
            if "ratio" in e:
                lo, hi = e["ratio_ci95"]
                ratio = f"  {e['ratio']:.2f}x [{lo:.2f}, {hi:.2f}]"
            lines.append(_case_line(f"{case:<{cases}} {name:<{names}}", e["median"], ratio, width, workload))
    return lines
