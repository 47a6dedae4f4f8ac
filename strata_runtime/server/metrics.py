"""Prometheus text exposition of the server's counters and the engine's live statistics.

Hand-written (the format is a few lines per metric), so the engine process needs no client library.
Format: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """A cumulative-bucket histogram, as Prometheus wants it."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class ServerCounters:
    """What the HTTP side counts itself (on the event-loop thread only)."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(endpoint, outcome) -> count; outcomes: ``ok``, ``client_error``, ``cancelled``, ``server_error``."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted_proposals: int = 0
    latency: Histogram = field(default_factory=Histogram)
    """Seconds from a request's arrival to its last token, for requests that completed."""


ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    # engine stats key: (metric name, type, help)
    "windows": ("strata_windows_total", "counter", "Windows run through all stages."),
    "rows": ("strata_window_rows_total", "counter", "Rows run in all windows."),
    "tokens": ("strata_engine_tokens_total", "counter", "Tokens the engine emitted."),
    "proposals": ("strata_proposals_total", "counter", "MTP proposals drafted."),
    "accepted_proposals": ("strata_proposals_accepted_total", "counter", "MTP proposals accepted."),
    "queue_depth": ("strata_queue_depth", "gauge", "Requests waiting for a free slot."),
    "slots_busy": ("strata_slots_busy", "gauge", "Slots serving a request."),
    "slots_total": ("strata_slots", "gauge", "Slots the plan provides."),
}
"""Engine statistics exported under stable names; any other numeric key becomes ``strata_engine_<key>``."""


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    label = ""
    if labels:
        label = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"
    return f"{name}{label} {_number(value)}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _head(name: str, kind: str, help_: str) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]


def render(counters: ServerCounters, engine_stats: dict[str, Any], *, ready: bool, in_flight: int) -> str:
    """The whole ``/metrics`` page."""
    out: list[str] = []
    out += _head("strata_ready", "gauge", "1 once the model is loaded and serving.")
    out.append(_line("strata_ready", int(ready)))
    out += _head("strata_requests_in_flight", "gauge", "HTTP generation requests being served or queued.")
    out.append(_line("strata_requests_in_flight", in_flight))
    out += _head("strata_requests_total", "counter", "HTTP generation requests by endpoint and outcome.")
    for (endpoint, outcome), n in sorted(counters.requests.items()):
        out.append(_line("strata_requests_total", n, {"endpoint": endpoint, "outcome": outcome}))
    out += _head("strata_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.")
    out.append(_line("strata_prompt_tokens_total", counters.prompt_tokens))
    out += _head("strata_completion_tokens_total", "counter", "Tokens generated for HTTP clients.")
    out.append(_line("strata_completion_tokens_total", counters.completion_tokens))
    out += _head(
        "strata_request_proposals_accepted_total",
        "counter",
        "Drafted proposals accepted, summed over requests.",
    )
    out.append(_line("strata_request_proposals_accepted_total", counters.accepted_proposals))

    h = counters.latency
    out += _head("strata_request_seconds", "histogram", "Request latency from arrival to the last token.")
    cumulative = 0
    for bound, n in zip((*h.bounds, math.inf), h.counts, strict=True):
        cumulative += n
        out.append(_line("strata_request_seconds_bucket", cumulative, {"le": _number(bound)}))
    out.append(_line("strata_request_seconds_sum", h.total))
    out.append(_line("strata_request_seconds_count", h.n))

    for key, value in sorted(engine_stats.items()):
        if not isinstance(value, int | float):
            continue
        name, kind, help_ = ENGINE_METRICS.get(
            key, (f"strata_engine_{key}", "gauge", f"Engine statistic `{key}`.")
        )
        out += _head(name, kind, help_)
        out.append(_line(name, value))
    return "\n".join(out) + "\n"
