"""Prometheus text exposition of the server's counters and the engine's live statistics.

Hand-written (the format is a few lines per metric), so the engine process needs no client library.
Format: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Buckets of the time per output token: a decode window is milliseconds."""


@dataclass
class Histogram:
    """A cumulative-bucket histogram, as Prometheus wants it."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class ServerCounters:
    """What the HTTP side counts itself (on the event-loop thread only)."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(endpoint, outcome) -> count; outcomes: ``ok``, ``client_error``, ``rejected`` (429: over
    ``serve.max_queued``), ``cancelled``, ``server_error``."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted_proposals: int = 0
    latency: Histogram = field(default_factory=Histogram)
    """Seconds from a request's arrival to its last token, for requests that completed."""
    first_token: Histogram = field(default_factory=Histogram)
    """Seconds from a request's arrival to its first generated token, for requests that completed."""
    per_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS_S))
    """Seconds per generated token after the first (its last token's time less its first's, over the
    tokens between), for completed requests of two tokens or more."""


TOTALS: dict[str, tuple[str, str, float]] = {
    # the engine's stats()["totals"] key: (metric, help, scale)
    "windows": ("strata_windows_total", "Windows run through all stages.", 1),
    "rows": ("strata_window_rows_total", "Rows run in all windows.", 1),
    "tokens": ("strata_tokens_total", "Tokens the engine accepted, for every request.", 1),
    "proposals": ("strata_proposals_total", "MTP proposals drafted.", 1),
    "accepted": ("strata_proposals_accepted_total", "MTP proposals accepted.", 1),
    "ms": ("strata_window_seconds_total", "Time spent running windows.", 1e-3),
    "discarded_rows": (
        "strata_discarded_rows_total",
        "Rows of windows queued ahead of a request's stop, run and discarded.",
        1,
    ),
    "decided_on_device": (
        "strata_windows_decided_on_device_total",
        "Speculative windows (solo, batch MTP) accepted, caught up and drafted on the last stage's device.",
        1,
    ),
    "drafting_paused": (
        "strata_windows_drafting_paused_total",
        "Decode windows run without proposals because their requests' drafts seldom held (spec.draft_floor), "
        "or because windows without them gave more tokens per second (spec.adaptive_depth).",
        1,
    ),
    "silent_probes": (
        "strata_silent_probes_total",
        "Silent probes of paused plain greedy requests: the drafting head's proposal for the next token, "
        "checked against the token the next window gave.",
        1,
    ),
    "silent_probes_held": (
        "strata_silent_probes_held_total",
        "Silent probes whose proposal equalled the next token.",
        1,
    ),
    "forced": (
        "strata_forced_tokens_total",
        "Tokens a request's grammar forced (a JSON schema's keys and punctuation), read in windows as "
        "proposals.",
        1,
    ),
    "prefix_requests": (
        "strata_prefix_reuse_requests_total",
        "Requests that began as another request did and read only the rest of their prompt.",
        1,
    ),
    "prefix_tokens": (
        "strata_prefix_reuse_tokens_total",
        "Prompt tokens not read again: their KV was kept from an earlier request (memory.prefix_reuse).",
        1,
    ),
    "prefix_copies": (
        "strata_prefix_reuse_copies_total",
        "Requests whose reused prefix was copied from another slot's KV (a busy one, or one a busier group "
        "owns) rather than kept in their own.",
        1,
    ),
    "prefix_restores": (
        "strata_prefix_reuse_restores_total",
        "Requests whose reused prefix was copied back from the host's prefix store "
        "(memory.prefix_store_mib).",
        1,
    ),
    "prefix_store_saved": (
        "strata_prefix_store_saved_total",
        "Kept prefixes copied into the host's prefix store before a new request overwrote their slot.",
        1,
    ),
    "prefix_store_dropped": (
        "strata_prefix_store_dropped_total",
        "Stored prefixes dropped to make room (the least recently used), or held whole by a newer one.",
        1,
    ),
}
"""Engine counters, exported under stable names."""

GAUGES: dict[str, tuple[str, str]] = {
    # the engine's stats()["totals"] key: (metric, help)
    "prefix_store_entries": ("strata_prefix_store_entries", "Prefixes the host's prefix store holds."),
    "prefix_store_bytes": ("strata_prefix_store_bytes", "Bytes of KV the host's prefix store holds."),
}
"""Engine gauges among its totals, exported under stable names."""


def engine_lines(stats: dict[str, Any]) -> list[str]:
    """Metrics from the engine's `stats()`: its totals, the queue, and the slots by state."""
    out: list[str] = []
    totals = stats.get("totals") or {}
    for key, (name, help_, scale) in TOTALS.items():
        if isinstance(totals.get(key), int | float):
            out += _head(name, "counter", help_)
            value = totals[key] * scale if scale != 1 else totals[key]
            out.append(_line(name, value))
    for key, (name, help_) in GAUGES.items():
        if isinstance(totals.get(key), int | float):
            out += _head(name, "gauge", help_)
            out.append(_line(name, totals[key]))
    by = totals.get("solo_by_proposals")
    if isinstance(by, dict) and by:
        name = "strata_solo_windows_total"
        out += _head(
            name, "counter", "Solo decode windows (one request alone) by the proposals they drafted."
        )
        for d in sorted(by, key=int):
            out.append(_line(name, by[d], {"proposals": d}))
    for key, name, help_, scale in (
        (
            "windows_by_kind",
            "strata_windows_by_kind_total",
            "Windows by kind: prefill, solo, serial, batch-mtp, pipelined, pipelined-mtp.",
            1.0,
        ),
        ("ms_by_kind", "strata_window_seconds_by_kind_total", "Time spent running windows, by kind.", 1e-3),
    ):
        counts = totals.get(key)
        if isinstance(counts, dict) and counts:
            out += _head(name, "counter", help_)
            for kind in sorted(counts):
                value = counts[kind] * scale if scale != 1 else counts[kind]
                out.append(_line(name, value, {"kind": kind}))
    if isinstance(stats.get("queue"), int):
        out += _head("strata_queue_depth", "gauge", "Requests waiting for a free slot.")
        out.append(_line("strata_queue_depth", stats["queue"]))
    slots = stats.get("slots")
    if isinstance(slots, list):
        states = Counter(str(s.get("state", "?")) for s in slots)
        out += _head("strata_slots", "gauge", "Slots the plan provides.")
        out.append(_line("strata_slots", len(slots)))
        out += _head("strata_slots_busy", "gauge", "Slots serving a request (prefilling or decoding).")
        out.append(_line("strata_slots_busy", len(slots) - states.get("free", 0)))
        out += _head("strata_slots_by_state", "gauge", "Slots by state: free, prefill, decode.")
        for state in sorted({"free", "prefill", "decode", *states}):
            out.append(_line("strata_slots_by_state", states.get(state, 0), {"state": state}))
    late = stats.get("compiled_at_launch")
    if isinstance(late, dict) and isinstance(late.get("kernels"), int):
        name = "strata_kernels_compiled_at_launch_total"
        out += _head(name, "counter", "GPU kernels compiled when first launched rather than at start.")
        out.append(_line(name, late["kernels"]))
        name = "strata_kernel_compile_at_launch_seconds_total"
        out += _head(name, "counter", "Seconds windows waited for kernels compiled at their first launch.")
        out.append(_line(name, float(late.get("seconds") or 0.0)))
    if isinstance(stats.get("acceptance"), int | float):
        out += _head("strata_acceptance_ratio", "gauge", "Accepted over drafted proposals since start.")
        out.append(_line("strata_acceptance_ratio", stats["acceptance"]))
    return out


EXPERT_COUNTERS: dict[str, tuple[str, str]] = {
    # summed over a device's stages: (metric, help)
    "hits": ("strata_expert_hits_total", "Routed-expert assignments served from a VRAM slot."),
    "misses": ("strata_expert_misses_total", "Routed-expert assignments read from host memory."),
    "swaps": ("strata_expert_swaps_total", "Experts copied from host memory into a VRAM slot."),
    "kept": (
        "strata_expert_kept_total",
        "Experts kept in a VRAM slot as the kernels read them from host memory (experts.keep_misses).",
    ),
    "host_link_bytes": (
        "strata_expert_host_bytes_total",
        "Expert bytes moved over the host link: misses' reads plus swaps' copies.",
    ),
    "late_reads": (
        "strata_expert_late_reads_total",
        "Decode assignments read from host memory before a decided swap of their expert into VRAM landed.",
    ),
}


def expert_cache(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's expert cache as it reports it (one entry per stage), each entry with the bytes it moved
    over the host link (``host_link_bytes``: misses' reads plus swaps' copies) and those bytes per generated
    token (``host_link_bytes_per_token``; None before the first token)."""
    tokens = (stats.get("totals") or {}).get("tokens")
    out = []
    for entry in stats.get("experts") or []:
        moved = int(entry.get("miss_bytes") or 0) + int(entry.get("swap_bytes") or 0)
        per_token = moved / tokens if isinstance(tokens, int) and tokens > 0 else None
        out.append({**entry, "host_link_bytes": moved, "host_link_bytes_per_token": per_token})
    return out


def expert_lines(stats: dict[str, Any]) -> list[str]:
    """The expert cache per device: hits, misses, swaps, experts kept, bytes over the host link, and the hit
    ratio (hits over lookups since the start; absent for a device that has not looked one up)."""
    by_device: dict[str, Counter[str]] = {}
    for entry in expert_cache(stats):
        counts = by_device.setdefault(str(entry.get("device", "?")), Counter())
        for key in EXPERT_COUNTERS:
            counts[key] += int(entry.get(key) or 0)
    if not by_device:
        return []
    out: list[str] = []
    for key, (name, help_) in EXPERT_COUNTERS.items():
        out += _head(name, "counter", help_)
        out += [_line(name, counts[key], {"device": dev}) for dev, counts in sorted(by_device.items())]
    out += _head("strata_expert_hit_ratio", "gauge", "Expert-cache hits over lookups since the start.")
    for dev, counts in sorted(by_device.items()):
        lookups = counts["hits"] + counts["misses"]
        if lookups:
            out.append(_line("strata_expert_hit_ratio", counts["hits"] / lookups, {"device": dev}))
    return out


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


def _histogram(name: str, text: str, h: Histogram) -> list[str]:
    out = _head(name, "histogram", text)
    cumulative = 0
    for bound, n in zip((*h.bounds, math.inf), h.counts, strict=True):
        cumulative += n
        out.append(_line(f"{name}_bucket", cumulative, {"le": _number(bound)}))
    out.append(_line(f"{name}_sum", h.total))
    out.append(_line(f"{name}_count", h.n))
    return out


def _head(name: str, kind: str, help_: str) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]


def render(
    counters: ServerCounters,
    engine_stats: dict[str, Any],
    *,
    ready: bool,
    in_flight: int,
    recoveries: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole ``/metrics`` page."""
    out: list[str] = []
    out += _head("strata_ready", "gauge", "1 once the model is loaded and serving.")
    out.append(_line("strata_ready", int(ready)))
    out += _head(
        "strata_engine_recoveries_total",
        "counter",
        "Failed engine steps recovered from (serve.recoveries).",
    )
    out.append(_line("strata_engine_recoveries_total", len(recoveries)))
    out += _head(
        "strata_engine_recovered_requests_total",
        "counter",
        "Requests a failed step held, by what the recovery did: carried on (resumed) or ended with an error.",
    )
    for outcome in ("resumed", "ended"):
        n = sum(int(r[outcome]) for r in recoveries)
        out.append(_line("strata_engine_recovered_requests_total", n, {"outcome": outcome}))
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

    out += _histogram(
        "strata_request_seconds", "Request latency from arrival to the last token.", counters.latency
    )
    out += _histogram(
        "strata_time_to_first_token_seconds",
        "Time from a request's arrival to its first generated token.",
        counters.first_token,
    )
    out += _histogram(
        "strata_time_per_output_token_seconds",
        "Time per generated token after a request's first.",
        counters.per_token,
    )

    out += engine_lines(engine_stats)
    out += expert_lines(engine_stats)
    return "\n".join(out) + "\n"
