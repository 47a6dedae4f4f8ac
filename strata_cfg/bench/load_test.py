"""`strata loadtest`: N clients keep a running engine busy for T seconds (or a fixed number of requests
each), each sending one ``/v1/completions`` request after another, or with ``chat=True`` holding one
conversation each through ``/v1/chat/completions`` (every request sends the chat so far: a system prompt
every client shares, its messages and the replies); the result is requests served, errors, latency
percentiles, the aggregate token rate, the share of prompt tokens the server did not read again (from the
usage's ``cached_tokens``), and with ``stream=True`` the time to the first token. A request the server
refuses for capacity (429) is counted apart, not as an error, and its client waits as its ``Retry-After``
says before the next one."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..schema.sampling_options import describe_sampling
from .http_driver import Client, Sample, served_model
from .stats import percentile

CHAT_SYSTEM = (
    "You are a narrator in the manner of the old novels of manners. Answer every question about the "
    "household, its visitors and their letters in a few measured sentences, as the narrator would, and "
    "keep to what was said before in this conversation."
)
"""The system prompt every client of a ``chat`` load test sends first (`run_load`)."""
CHAT_TURNS = 4
"""Turns of each conversation of a ``chat`` load test before its client begins a new one."""


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
    chat: bool = False
    """Each client held one conversation through ``/v1/chat/completions``."""

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

    @property
    def reused_pct(self) -> float | None:
        """The share of the served requests' prompt tokens the server did not read again; None where it
        reported no prompt tokens."""
        sent = sum(s.prompt_tokens for s in self.served)
        return 100.0 * sum(s.cached_tokens for s in self.served) / sent if sent else None

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "clients": self.clients,
            "chat": self.chat,
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
            "prompt_tokens": sum(s.prompt_tokens for s in self.served),
            "cached_tokens": sum(s.cached_tokens for s in self.served),
            "reused_pct": None if self.reused_pct is None else round(self.reused_pct, 2),
        }

    def lines(self) -> list[str]:
        j = self.to_json()
        who = f"{j['clients']} chats" if self.chat else f"{j['clients']} clients"
        out = [
            f"{who}, {j['max_tokens']} tokens each, {describe_sampling(j['sampling'])}, "
            f"{j['wall_s']} s: "
            f"{j['requests']} requests served, "
            + (f"{j['rejected']} refused at capacity (HTTP 429), " if j["rejected"] else "")
            + f"{j['errors']} errors",
            f"  latency p50 {_ms(j['latency_p50_s'])}, p95 {_ms(j['latency_p95_s'])}; "
            f"{j['tokens']} tokens, {j['tok_s']} tok/s aggregate",
        ]
        if self.stream:
            out.append(f"  first token p50 {_ms(j['first_token_p50_s'])}, p95 {_ms(j['first_token_p95_s'])}")
        if j["reused_pct"] is not None:
            out.append(
                f"  prompt tokens: {j['prompt_tokens']}, {j['cached_tokens']} of them not read again "
                f"({j['reused_pct']:.1f}%)"
            )
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
    chat: bool = False,
    system: str = CHAT_SYSTEM,
    turns: int = CHAT_TURNS,
    shape: dict[str, Any] | None = None,
) -> LoadResult:
    """Keep ``clients`` clients sending requests for ``seconds`` (or ``requests_per_client`` each), each
    with the fields of ``sampling`` (OpenAI's names; greedy without); a sampled request is seeded by its
    client and number, so a run sends the same requests every time. ``ignore_eos``: every request asks to
    generate past end-of-text, to ``max_tokens``. ``chat``: each client holds one conversation, whose every
    request sends ``system`` (the same for every client), the messages sent before with their replies, and
    a new message (``prompt`` and the client's and request's numbers), for ``turns`` turns, after which
    the client begins a new conversation (so that a chat stays within the server's context); a request
    that fails leaves its message out of the conversation. ``shape``: every request's
    ``structured_outputs`` (a reply held to a schema, a regex or a choice), None for free text."""
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
        said: list[dict[str, str]] = [{"role": "system", "content": system}]
        try:
            while True:
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                if requests_per_client is not None and sent >= requests_per_client:
                    break
                # Distinct prompts per client and request, so no two requests are the same work.
                message = f"{prompt} ({index}.{sent})"
                body: dict[str, Any] = {
                    "model": model,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    **(sampling or {}),
                }
                if chat:
                    body["messages"] = [*said, {"role": "user", "content": message}]
                else:
                    body["prompt"] = message
                if body["temperature"] > 0:
                    body["seed"] = index * 1_000_003 + sent
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                if ignore_eos:
                    body["ignore_eos"] = True
                if shape is not None:
                    body["structured_outputs"] = shape
                sample = client.complete(body)
                sent += 1
                with lock:
                    samples.append(sample)
                if chat and sample.ok:
                    said += [body["messages"][-1], {"role": "assistant", "content": sample.text}]
                    if len(said) > 2 * turns:  # the system prompt and `turns` exchanges: begin anew
                        said = said[:1]
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
        chat=chat,
    )
