"""`strata loadtest`: N clients keep a running engine busy for T seconds (or a fixed number of requests
each), each sending one ``/v1/completions`` request after another; the result is requests served, errors,
latency percentiles and the aggregate token rate, and with ``stream=True`` the time to the first token. A
request the server refuses for capacity (429) is counted apart, not as an error, and its client waits as
its ``Retry-After`` says before the next one."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..schema.sampling_options import describe_sampling
from .http_driver import Client, Sample, served_model
from .stats import percentile


@dataclass
class LoadResult:
    """What a load run measured."""

    url: str
    clients: int
    max_tokens: int
    stream: bool
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    """The sampling fields every request carried (none: greedy)."""

    @property
    def served(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def rejected(self) -> list[Sample]:
        """Requests the server refused for capacity (HTTP 429, `serve.max_queued`): not errors."""
        return [s for s in self.samples if s.retry_after is not None]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok and s.retry_after is None]

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
            "sampling": dict(self.sampling),
            "stream": self.stream,
            "wall_s": round(self.wall_s, 3),
            "requests": len(self.served),
            "rejected": len(self.rejected),
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
            f"{j['clients']} clients, {j['max_tokens']} tokens each, {describe_sampling(j['sampling'])}, "
            f"{j['wall_s']} s: "
            f"{j['requests']} requests served, "
            + (f"{j['rejected']} refused at capacity (HTTP 429), " if j["rejected"] else "")
            + f"{j['errors']} errors",
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


def run_load(
    url: str,
    *,
    clients: int,
    seconds: float | None = None,
    requests_per_client: int | None = None,
    max_tokens: int = 64,
    prompt: str = "Once upon a time",
    sampling: dict[str, float] | None = None,
    stream: bool = False,
    api_key: str | None = None,
    timeout: float = 600.0,
    ignore_eos: bool = False,
) -> LoadResult:
    """Keep ``clients`` clients sending requests for ``seconds`` (or ``requests_per_client`` each), each
    with the fields of ``sampling`` (OpenAI's names; greedy without); a sampled request is seeded by its
    client and number, so a run sends the same requests every time. ``ignore_eos``: every request asks to
    generate past end-of-text, to ``max_tokens``."""
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
                    "temperature": 0.0,
                    **(sampling or {}),
                }
                if body["temperature"] > 0:
                    body["seed"] = index * 1_000_003 + sent
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                if ignore_eos:
                    body["ignore_eos"] = True
                sample = client.complete(body)
                sent += 1
                with lock:
                    samples.append(sample)
                if sample.retry_after is not None:  # refused at capacity: wait as the server asked
                    left = None if deadline is None else deadline - time.perf_counter()
                    time.sleep(
                        sample.retry_after if left is None else max(0.0, min(sample.retry_after, left))
                    )
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return LoadResult(
        url=url,
        clients=clients,
        max_tokens=max_tokens,
        stream=stream,
        wall_s=wall,
        samples=samples,
        sampling=dict(sampling or {}),
    )
