"""The benchmark harness: named workloads over arms (one resolved plan each), interleaved.

Each repeat runs every arm once (A B C A B C ...), so slow drifts of a shared machine hit every arm alike.
Figures are medians over repeats; the gain of an arm over ``serial`` carries a bootstrap 95% interval; every
arm's greedy token ids are checked against ``serial``'s. Requests reach an engine through a `Driver`: the
in-process one steps an `Engine` here; a driver that talks HTTP to a launched engine fits the same seam.
The GPU-only workloads (``step``, ``vram``) build no arms: `strata_runtime.bench.step` and
`strata_runtime.bench.vram` run them on the plan's GPUs, which `cuda_devices` checks first.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.workloads import (
    CLIENT_COUNTS,
    CONTEXT_WORKLOADS,
    GENERATING,
    PROMPTS,
    TURNS,
    WORKLOADS,
    conversation_prompts,
    delivery_gaps,
    depth_prompt,
    gap_figures_ms,
    generation_rate,
    prompt_ids,
    shared_prompts,
    turn_prompts,
    turns_figures,
)

from ..api import Request, SamplingParams, Tokenizer
from ..backend import DeviceError, cupy_module
from ..cuda.compile import LateCompile, late_compiles
from ..engine.stats import WindowStat, window_name

if TYPE_CHECKING:
    from ..engine import Engine


@dataclass(frozen=True)
class Arrival:
    """A request and when it arrives: at the start, once stream 0 has produced ``after_tokens``, or (with
    ``after``) once request ``after`` of the run has finished."""

    request: Request
    after_tokens: int = 0
    after: int | None = None


@dataclass
class Result:
    """One request's outcome and timings (seconds from the run's start)."""

    token_ids: list[int]
    prompt_tokens: int
    submitted: float
    first_token: float | None
    finished: float
    accepted: int
    proposals: int
    gaps: tuple[float, ...] = ()
    """The waits, in seconds, between consecutive deliveries of tokens after the first (`delivery_gaps`;
    none where the driver could not time them): what a reader of the stream sees as stalls."""
    cached: int = 0
    """Prompt tokens the engine did not read again: a slot kept them from an earlier request."""

    @property
    def longest_gap(self) -> float | None:
        """The longest of `gaps` (None without any)."""
        return max(self.gaps, default=None)

    @property
    def rate(self) -> float:
        """Generated tokens per second over the request's whole run."""
        span = self.finished - self.submitted
        return len(self.token_ids) / span if span > 0 else 0.0


class Driver(Protocol):
    """Runs a set of arrivals to completion on one engine and returns each request's result."""

    def run(self, arrivals: list[Arrival]) -> tuple[list[Result], dict[str, Any]]: ...


class Arm(Protocol):
    """One contender of a benchmark: an engine of this runtime, or a peer (`strata_runtime.bench.peer`).
    Its requests are tokenized with its own tokenizer."""

    tokenizer: Tokenizer


class InProcessDriver:
    """Steps an engine in this thread; the second value returned is the window statistics of the run."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, arrivals: list[Arrival]) -> tuple[list[Result], dict[str, Any]]:
        eng = self.engine
        before = dict(eng.totals)
        cache_before = expert_traffic(eng)
        t0 = time.perf_counter()
        handles: list[Any] = [None] * len(arrivals)
        results: list[Result | None] = [None] * len(arrivals)
        tokens: list[list[int]] = [[] for _ in arrivals]
        first: list[float | None] = [None] * len(arrivals)
        deliveries: list[list[float]] = [[] for _ in arrivals]
        submitted = [0.0] * len(arrivals)
        while any(r is None for r in results):
            for i, a in enumerate(arrivals):
                if a.after is not None:
                    due = results[a.after] is not None
                else:
                    due = i == 0 or len(tokens[0]) >= a.after_tokens or results[0] is not None
                if handles[i] is None and due:
                    submitted[i] = time.perf_counter() - t0
                    handles[i] = eng.submit(a.request)
            eng.step()
            now = time.perf_counter() - t0
            for i, h in enumerate(handles):
                while h is not None and not h.events.empty():
                    ev = h.events.get()
                    tokens[i] += ev.token_ids
                    if first[i] is None and ev.token_ids:
                        first[i] = now
                    if ev.token_ids:
                        deliveries[i].append(now)
                    if ev.finished is not None:
                        if ev.error:
                            raise RuntimeError(f"request {i} failed: {ev.error}")
                        results[i] = Result(
                            tokens[i],
                            len(h.request.prompt_ids),
                            submitted[i],
                            first[i],
                            now,
                            h.accepted_proposals,
                            h.proposals,
                            delivery_gaps(deliveries[i]),
                            h.cached_tokens,
                        )
        # Windows still in flight (a request's last windows run ahead of its stop) finish here, not in the
        # next run; the engine, once idle, hands its expert caches what their kernels counted.
        while eng.step():
            pass
        after = eng.totals
        windows = after["windows"] - before["windows"]
        stats = {
            "windows": windows,
            "rows_per_window": (after["rows"] - before["rows"]) / windows if windows else 0.0,
            "ms_per_window": (after["ms"] - before["ms"]) / windows if windows else 0.0,
            "proposals": after["proposals"] - before["proposals"],
            "accepted": after["accepted"] - before["accepted"],
            "windows_by_kind": window_mix(before["by_name"], after["by_name"]),
            "window_records": window_records(getattr(eng, "windows", ()), windows),
        }
        cache_after = expert_traffic(eng)
        if cache_after is not None and cache_before is not None:
            stats["experts"] = {k: cache_after[k] - cache_before[k] for k in cache_after}
        return [r for r in results if r is not None], stats


SLOWEST_WINDOWS = 3
"""Windows the bench names as a run's slowest (`slowest_windows`)."""


def window_records(recent: Sequence[WindowStat], count: int) -> list[dict[str, Any]]:
    """Every window of an engine's last ``count`` windows (one run's, as far back as its record of recent
    windows reaches), in the order they ran: each one's name (`window_name`), rows, milliseconds (the wall
    time since the later of its launch and the window before it delivered, so a stall between windows lands
    in the window after it), tokens, proposals and how many held, the rows drafting heads caught up on for
    it (`WindowStat.caught_up`), the host's milliseconds drafting its proposals before its launch and
    finishing it (``draft_ms``, ``finish_ms``), and ``index``, its place in the run (1: the run's first
    window, its prompt's); a solo window whose depth the adaptive choice decided also has ``rates``, the
    expected tokens a millisecond of each depth 0, 1, ... when it was chosen (`WindowStat.rates`)."""
    ran = list(recent)[-count:] if count > 0 else []
    skipped = count - len(ran)
    return [
        {
            "index": skipped + i + 1,
            "window": window_name(w),
            "rows": w.rows,
            "ms": w.ms,
            "tokens": w.tokens,
            "proposals": w.proposals,
            "accepted": w.accepted,
            "caught_up": w.caught_up,
            "draft_ms": w.draft_ms,
            "finish_ms": w.finish_ms,
            **({"rates": list(w.rates)} if w.rates is not None else {}),
        }
        for i, w in enumerate(ran)
    ]


def slowest_windows(records: Sequence[dict[str, Any]], n: int = SLOWEST_WINDOWS) -> list[dict[str, Any]]:
    """The ``n`` longest decode windows of a run's `window_records`, longest first. Prompt windows are left
    out: their time is their request's wait for its first token, not a gap in its stream."""
    decode = [w for w in records if w["window"] != "prefill"]
    return sorted(decode, key=lambda w: -w["ms"])[:n]


def window_mix(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[float]]:
    """The windows an engine ran between two readings of its totals' ``by_name`` (by
    `strata_runtime.engine.stats.window_name`): ``{"solo 2": [windows, ms, tokens]}``, what the engine chose
    (the depths of an adaptive request alone, serial or batch-MTP windows) and what each kind cost and
    gave."""
    mix: dict[str, list[float]] = {}
    for name, now in after.items():
        was = before.get(name, {"windows": 0, "ms": 0.0, "tokens": 0})
        if now["windows"] > was["windows"]:
            mix[name] = [now[k] - was[k] for k in ("windows", "ms", "tokens")]
    return mix


def merge_window_mix(mixes: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Repeats' window mixes added up: per kind, the windows, their mean time and the tokens each emitted
    on average."""
    total: dict[str, list[float]] = {}
    for mix in mixes:
        for d, (n, ms, tokens) in mix.items():
            t = total.setdefault(d, [0, 0.0, 0])
            t[0] += n
            t[1] += ms
            t[2] += tokens
    return {
        d: {"windows": n, "ms_per_window": ms / n, "tokens_per_window": tokens / n}
        for d, (n, ms, tokens) in sorted(total.items())
        if n
    }


def drafting_balance(mix: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """What a request alone's drafting saved, from its windows by kind (`merge_window_mix`): each drafting
    solo window ("solo k", k proposals) against the time its tokens take at the rate of the same run's
    windows without proposals ("solo 0"). ``saved_ms`` (negative where drafting cost time), ``share`` of
    all the windows' time, and ``base_ms_per_token``; None without both kinds. The windows without
    proposals ran where drafting paused, often on other text, so this is a measure of what drafting did,
    not of what the other choice would have done."""
    base = mix.get("solo 0")
    drafting = {k: m for k, m in mix.items() if k.startswith("solo ") and k != "solo 0"}
    if base is None or not drafting or not base["tokens_per_window"]:
        return None
    rate = base["ms_per_window"] / base["tokens_per_window"]
    saved = sum(
        m["windows"] * (m["tokens_per_window"] * rate - m["ms_per_window"]) for m in drafting.values()
    )
    total = sum(m["windows"] * m["ms_per_window"] for m in mix.values())
    return {"saved_ms": saved, "share": saved / total if total else 0.0, "base_ms_per_token": rate}


def depth_calibration(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """How the adaptive depth's expectations held up, from `window_records` (of one or more runs): per solo
    window kind ("solo k") among the windows that carry ``rates``, how many, the mean tokens a millisecond
    their depth was expected to give when it was chosen (``rates[k]``), and what they gave (their tokens
    over their milliseconds). A kind that gives far less than expected was chosen on chances or times
    that did not hold."""
    by: dict[str, list[float]] = {}
    for w in records:
        rates = w.get("rates")
        if rates is None or not w["window"].startswith("solo "):
            continue
        k = w["rows"] - 1
        acc = by.setdefault(w["window"], [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += rates[k]
        acc[2] += w["tokens"]
        acc[3] += w["ms"]
    return {
        kind: {"windows": n, "expected_tok_per_ms": expected / n, "tok_per_ms": tokens / ms if ms else 0.0}
        for kind, (n, expected, tokens, ms) in sorted(by.items())
    }


TRAFFIC_KEYS = (
    "hits",
    "misses",
    "swaps",
    "kept",
    "miss_bytes",
    "swap_bytes",
    "prompt_hits",
    "prompt_misses",
    "late_reads",
)


def expert_traffic(engine: Engine) -> dict[str, int] | None:
    """What the engine's expert caches served so far, summed over its stages: assignments read from VRAM
    (hits) and from elsewhere (misses), swaps, experts kept as they were read, and bytes moved over the host
    link by misses and by swaps, with the prompt chunks' share of the assignments and of the miss bytes
    (``prompt_*``); ``host_bytes`` is all the link moved. None when every expert is resident."""
    caches = [e for e in engine.stats()["experts"] if e["cached"]]
    if not caches:
        return None
    out = {key: sum(int(e[key]) for e in caches) for key in TRAFFIC_KEYS}
    out["prompt_host_bytes"] = sum(int(e["prompt_miss_bytes"]) for e in caches)
    out["host_bytes"] = out["miss_bytes"] + out["swap_bytes"]
    return out


def cache_figures(
    traffic: dict[str, int], generated: int, prompt_tokens: int, prompt: bool
) -> dict[str, float]:
    """The bench's expert-cache figures of a run: the share of expert work VRAM served and the host link's
    megabytes per token (with the swaps' copies, and those apart), of the decode windows per generated
    token, or with ``prompt`` (the prompt workload) of the prompt chunks per prompt token; beside the decode
    figures, the prompts' share and megabytes per prompt token where the run read prompts through the
    prefill path, and the share of the decode windows' misses that were late reads
    (`CacheStats.late_reads`)."""
    hits, misses = traffic["hits"], traffic["misses"]
    p_hits, p_misses, p_bytes = traffic["prompt_hits"], traffic["prompt_misses"], traffic["prompt_host_bytes"]
    d_hits, d_served = hits - p_hits, hits + misses - p_hits - p_misses
    out = {"expert_swaps": float(traffic["swaps"]), "expert_kept": float(traffic["kept"])}
    if prompt:  # prompts read in graph windows are not marked as a prompt's: then every assignment counts
        marked = p_hits + p_misses > 0
        served = p_hits + p_misses if marked else hits + misses
        out["expert_vram_pct"] = 100.0 * (p_hits if marked else hits) / served if served else 0.0
        moved = (p_bytes if marked else traffic["miss_bytes"]) + traffic["swap_bytes"]
        out["host_mb_per_token"] = moved / prompt_tokens / 1e6 if prompt_tokens else 0.0
        return out
    out["expert_vram_pct"] = 100.0 * d_hits / d_served if d_served else 0.0
    moved = traffic["miss_bytes"] - p_bytes + traffic["swap_bytes"]
    out["host_mb_per_token"] = moved / generated / 1e6 if generated else 0.0
    out["swap_mb_per_token"] = traffic["swap_bytes"] / generated / 1e6 if generated else 0.0
    if traffic["late_reads"] and misses > p_misses:  # of the decode windows' misses
        out["late_read_pct"] = 100.0 * traffic["late_reads"] / (misses - p_misses)
    if p_hits + p_misses:
        out["prompt_expert_vram_pct"] = 100.0 * p_hits / (p_hits + p_misses)
        out["prompt_host_mb_per_token"] = p_bytes / prompt_tokens / 1e6 if prompt_tokens else 0.0
    return out


# ---- workloads --------------------------------------------------------------------------------------


GREEDY = SamplingParams(temperature=0.0)


def _drawn(sampling: SamplingParams, i: int, seeded: bool) -> SamplingParams:
    """Request ``i``'s sampling: sampled and ``seeded``, seeded by its index, so every arm draws the same."""
    return dataclasses.replace(sampling, seed=i) if sampling.temperature > 0 and seeded else sampling


def _request(
    tokenizer: Tokenizer,
    i: int,
    tokens: int,
    sampling: SamplingParams = GREEDY,
    seeded: bool = True,
    depth: int = 0,
    vocab: int = 0,
) -> Request:
    """Request ``i`` of a workload; sampled and ``seeded``, it is seeded by its index, so every arm draws
    the same. With ``depth`` its prompt is `depth_prompt`'s ``depth`` ids (from ``vocab``), not a short
    text."""
    ids = depth_prompt(depth, vocab, i) if depth else tuple(tokenizer.encode(PROMPTS[i % len(PROMPTS)]))
    return Request(ids, tokens, _drawn(sampling, i, seeded), request_id=f"bench-{i}")


def conversation_count(engines: Iterable[Any]) -> int:
    """Conversations of the ``conversations`` workload: one more than the most slots an arm has, so that each
    turn finds its conversation's slot taken by another (arms that are not engines count one slot)."""
    return max((getattr(e, "n_slots", 1) for e in engines), default=1) + 1


def workload_arrivals(
    name: str,
    tokenizer: Tokenizer,
    tokens: int,
    context: int,
    clients: int = 1,
    *,
    prompt_tokens: int = 0,
    vocab: int = 0,
    seed: int = 0,
    sampling: SamplingParams = GREEDY,
    seeded: bool = True,
    depth: int = 0,
) -> list[Arrival]:
    """The requests of a workload (for ``clients``: of one client count; for ``prompt``: a prompt of
    ``prompt_tokens`` ids drawn from ``vocab`` with ``seed``, generating one token; for ``turns``: the
    `turn_prompts` of a context of ``prompt_tokens``, each turn after the one before; for ``shared``: the
    `shared_prompts` of that context, all at once; for ``conversations``: ``clients`` conversations'
    `conversation_prompts`, turn by turn, each request after the one before). The decoding requests
    choose their tokens by ``sampling``, seeded by their index unless ``seeded`` is False; with ``depth``
    (``solo``, ``two-decodes``, ``clients``) each first reads a prompt of that many ids (`depth_prompt`)."""
    if name == "prompt":
        ids = prompt_ids(prompt_tokens, vocab, seed)
        return [Arrival(Request(ids, 1, SamplingParams(temperature=0.0), request_id=f"bench-prompt-{seed}"))]
    if name == "turns":  # one conversation: each turn once the one before has finished
        turns = []
        for k, ids in enumerate(turn_prompts(prompt_tokens, vocab, seed)):
            drawn = _drawn(sampling, k, seeded)
            turns.append(
                Arrival(Request(ids, tokens, drawn, request_id=f"bench-turn-{k}"), after=k - 1 if k else None)
            )
        return turns
    if name == "shared":
        return [
            Arrival(Request(ids, tokens, _drawn(sampling, k, seeded), request_id=f"bench-shared-{k}"))
            for k, ids in enumerate(shared_prompts(prompt_tokens, vocab, seed))
        ]
    if name == "conversations":  # ``clients`` conversations taking turns, each request after the one before
        convs = conversation_prompts(prompt_tokens, vocab, seed, clients)
        order = [(c, t) for t in range(TURNS) for c in range(clients)]
        return [
            Arrival(
                Request(convs[c][t], tokens, _drawn(sampling, k, seeded), request_id=f"bench-conv-{c}-{t}"),
                after=k - 1 if k else None,
            )
            for k, (c, t) in enumerate(order)
        ]
    streams = {"two-decodes": 2, "clients": clients, "solo": 1}.get(name)
    if streams is not None:
        return [
            Arrival(_request(tokenizer, i, tokens, sampling, seeded, depth, vocab)) for i in range(streams)
        ]
    if name == "read-beside-decode":
        length = max(16, min(context - 2, 48_000))
        seed_ids = tokenizer.encode(" ".join(PROMPTS))
        long_ids = tuple((seed_ids * (length // len(seed_ids) + 1))[:length])
        decode = _request(tokenizer, 0, tokens, sampling, seeded)
        reader = Request(long_ids, 1, SamplingParams(temperature=0.0), request_id="bench-long")
        return [Arrival(decode), Arrival(reader, after_tokens=min(8, tokens // 2))]
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def mean_prompt_tokens(
    workload: str,
    tokenizer: Tokenizer,
    tokens: int,
    context: int,
    clients: int,
    depth: int = 0,
    vocab: int = 0,
) -> int:
    """The mean prompt length, in tokens, of a decode workload's requests (for ``clients``: of ``clients``
    of them; ``depth`` as `workload_arrivals` takes it), at least 1: what a peer's streams read first, to
    decode from KV as long as ours."""
    arrivals = workload_arrivals(workload, tokenizer, tokens, context, clients, vocab=vocab, depth=depth)
    lengths = [len(a.request.prompt_ids) for a in arrivals if a.request.max_tokens > 1]
    return max(1, round(sum(lengths) / len(lengths))) if lengths else 1


def measure(name: str, results: list[Result], stats: dict[str, Any], wall: float) -> dict[str, float]:
    """The workload's reported figures for one run."""
    out: dict[str, float] = {
        "ms_per_window": stats["ms_per_window"],
        "rows_per_window": stats["rows_per_window"],
        "accepted_pct": 100.0 * stats["accepted"] / stats["proposals"] if stats["proposals"] else 0.0,
    }
    if name == "prompt":
        (reader,) = results
        read_span = (reader.first_token or reader.finished) - reader.submitted
        out["prompt_tokens"] = reader.prompt_tokens
        out["prompt_read_s"] = read_span
        out["tok_s"] = reader.prompt_tokens / read_span if read_span > 0 else 0.0
    elif name == "read-beside-decode":
        decode, reader = results
        read_span = (reader.first_token or reader.finished) - reader.submitted
        out["prompt_read_tok_s"] = reader.prompt_tokens / read_span if read_span > 0 else 0.0
        out["decode_tok_s"] = decode.rate
        out["tok_s"] = out["prompt_read_tok_s"]
    elif name in CONTEXT_WORKLOADS:
        out |= turns_figures(
            [
                (r.submitted, r.first_token, r.finished, len(r.token_ids), r.prompt_tokens, r.cached)
                for r in results
            ],
            at_once=name == "shared",
            firsts=len(results) // TURNS if name == "conversations" else 1,
        )
    elif name == "clients":
        lat = sorted(r.finished - r.submitted for r in results)
        out["tok_s"] = sum(len(r.token_ids) for r in results) / wall if wall > 0 else 0.0
        out["p50_s"] = float(np.percentile(lat, 50))
        out["p95_s"] = float(np.percentile(lat, 95))
    else:  # two-decodes, solo: the streams' own rates added
        out["tok_s"] = sum(r.rate for r in results)
    if name in GENERATING and any(r.first_token is not None for r in results):
        # A peer that returns whole generations (transformers' generate) times no first token: no rate.
        out["generation_tok_s"] = generation_rate(
            (len(r.token_ids), r.first_token, r.finished) for r in results
        )
    if name in GENERATING:
        out |= gap_figures_ms(r.gaps for r in results)
    traffic = stats.get("experts")
    if traffic is not None:  # an expert cache: how much of the expert work VRAM served, and the link's share
        generated = sum(len(r.token_ids) for r in results)
        prompt_tokens = sum(r.prompt_tokens - r.cached for r in results)
        out |= cache_figures(traffic, generated, prompt_tokens, prompt=name == "prompt")
        kinds = [w for kind, w in (stats.get("windows_by_kind") or {}).items() if kind != "prefill"]
        windows = sum(w[0] for w in kinds)
        if windows and name != "prompt":  # what a decode window takes and yields, for the cache's ceiling
            out["decode_window_ms"] = sum(w[1] for w in kinds) / windows
            out["decode_window_tokens"] = sum(w[2] for w in kinds) / windows
    return out


# ---- statistics ---------------------------------------------------------------------------------------


def bootstrap_gain(
    arm: list[float], base: list[float], seed: int = 0, draws: int = 2000
) -> tuple[float, float]:
    """95% bootstrap interval of median(arm) / median(base) - 1, resampling each arm's repeats."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(arm), np.asarray(base)
    ia = rng.integers(0, len(a), size=(draws, len(a)))
    ib = rng.integers(0, len(b), size=(draws, len(b)))
    gains = np.median(a[ia], axis=1) / np.median(b[ib], axis=1) - 1.0
    lo, hi = np.percentile(gains, [2.5, 97.5])
    return float(lo), float(hi)


@dataclass
class ArmRuns:
    """Every repeat of one arm (for ``clients``, one entry per client count)."""

    name: str
    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    compiled: dict[str, list[list[LateCompile]]] = field(default_factory=dict)
    """Per case and repeat, the kernels compiled at their first launch while the repeat ran (its figures
    hold that time)."""
    windows: dict[str, list[dict[str, list[float]]]] = field(default_factory=dict)
    """Per case and repeat, its windows by kind (``{"solo 2": [windows, ms, tokens]}``, from the engine's
    totals; empty for a peer)."""
    records: dict[str, list[list[dict[str, Any]]]] = field(default_factory=dict)
    """Per case and repeat, every window it ran (`window_records`; empty for a peer)."""


def same_shape(a: list[Any], b: list[Any]) -> bool:
    """Whether two engines' expert-cache snapshots (one per stage) describe caches of the same shape."""
    return len(a) == len(b) and all(x.resident.shape == y.resident.shape for x, y in zip(a, b, strict=True))


def driver_for(arm: Any) -> Driver:
    """How an arm runs: a peer brings its own driver; an engine of this runtime is stepped in process."""
    return arm.driver() if hasattr(arm, "driver") else InProcessDriver(arm)


SETTLE_MOST = 6
"""Warm-up requests at most while an engine's expert caches settle (`settle_experts`)."""


@dataclass(frozen=True)
class Settling:
    """One warm-up request while the expert caches settle: the share of its decode windows' expert work (row
    and chosen expert pairs) that VRAM served, and the experts its windows brought into slots (swapped in,
    or kept as they were read: `Policy.keep_misses`)."""

    from_vram: float
    moved: int


def adaptive_caches(engine: Engine) -> list[Any]:
    """The engine's stages' expert caches that hold only some experts and adapt (`Policy.adapt`)."""
    return [s.experts for s in engine.model.stages if s.experts.cached and s.experts.residency.policy.adapt]


def settled(steps: list[Settling], slots: int) -> bool:
    """Whether warm-up requests that did ``steps`` have settled caches of ``slots`` slots in all: they have
    brought in as many experts as the caches hold (every slot could have been refilled with what the text
    uses), or the last brought in none."""
    return bool(steps) and (sum(x.moved for x in steps) >= slots or steps[-1].moved == 0)


def settle_experts(
    engine: Engine, arrivals: Callable[[int], list[Arrival]], *, most: int = SETTLE_MOST
) -> list[Settling]:
    """Run warm-up requests, the k-th ``arrivals(k)``, until the engine's adaptive expert caches have
    `settled`, at most ``most`` of them. A cache starts with its slots spread evenly over the layers and
    moves a few experts every few windows, so the first requests it serves measure it learning, not what
    it serves once it has served some text. [] where no stage has an adaptive cache."""
    caches = adaptive_caches(engine)
    slots = sum(c.slots for c in caches)
    out: list[Settling] = []

    def figures(c: Any) -> tuple[int, int, int]:  # decode windows' hits and misses, experts brought in
        s = c.stats
        return s.hits - s.prompt_hits, s.misses - s.prompt_misses, s.swaps + s.kept

    while caches and len(out) < most and not settled(out, slots):
        before = [figures(c) for c in caches]
        InProcessDriver(engine).run(arrivals(len(out)))
        after = [figures(c) for c in caches]
        hits, misses, moved = (sum(a[i] - b[i] for a, b in zip(after, before, strict=True)) for i in range(3))
        out.append(Settling(hits / (hits + misses) if hits + misses else 1.0, moved))
    return out


@dataclass(frozen=True)
class Taught:
    """What warm-up requests taught an engine's drafting before the first repeat: the requests, their
    proposals and how many held, and for each request kind the chance that a proposal at each position
    holds (what a new request's drafting depth starts from)."""

    requests: int
    proposals: int
    accepted: int
    chances: dict[str, list[float]]


def teach_drafting(engine: Engine, arrivals: list[Arrival]) -> Taught | None:
    """Run ``arrivals`` so that the engine learns how often proposals hold on text like the workload's, as a
    server does from the requests it serves; None where its drafting depth does not learn (it is fixed, or
    the engine does not draft). Without this, the first repeat starts from no estimate and learns while it
    is timed, and the later ones from what that very request taught."""
    if not engine.choice.adaptive:
        return None
    results, stats = InProcessDriver(engine).run(arrivals)
    chances = {kind: [round(c, 4) for c in prior.chance] for kind, prior in engine.drafting_state().items()}
    return Taught(len(results), int(stats["proposals"]), int(stats["accepted"]), chances)


def run_bench(
    engines: Mapping[str, Arm],
    workload: str,
    *,
    tokens: int,
    repeats: int,
    context: int,
    driver: Callable[[Any], Driver] = driver_for,
    on_run: Callable[[str, str, int, dict[str, float]], None] | None = None,
    prompt_tokens: int = 0,
    vocab: int = 0,
    sampling: SamplingParams = GREEDY,
    seeded: bool = True,
    depth: int = 0,
) -> dict[str, ArmRuns]:
    """Every arm on the workload, interleaved, ``repeats`` times, its decoding requests choosing tokens by
    ``sampling`` (seeded by their index unless ``seeded`` is False), each after a prompt of ``depth`` ids
    where it is not 0 (`workload_arrivals`).

    ``prompt`` gives every arm of a repeat the same prompt, and each repeat a fresh one (seeded by its index).
    """
    cases = [f"{c} clients" for c in CLIENT_COUNTS] if workload == "clients" else [workload]
    conversations = conversation_count(engines.values())
    out = {name: ArmRuns(name) for name in engines}
    # Every arm starts every repeat (and case) from what the first arm's expert caches held when the run
    # began, after the warm-up: no arm runs on a cache another arm just taught, and no repeat on one that
    # the same requests taught in an earlier repeat, so the repeats are alike. An arm whose caches are
    # shaped otherwise (a plan without the MTP layer, say) starts from what its own held.
    states = {n: e.expert_state() for n, e in engines.items() if hasattr(e, "expert_state")}
    first = next(iter(states.values()), None)
    # Likewise every repeat starts from the acceptance each arm had learned when the run began (a new
    # request's drafting depth starts from its kind's), not from what the same request taught it in an
    # earlier repeat.
    drafts = {n: e.drafting_state() for n, e in engines.items() if hasattr(e, "drafting_state")}
    for r in range(repeats):
        for case in cases:
            for name, engine in engines.items():
                if name in states and hasattr(engine, "restore_experts"):
                    own = states[name]
                    engine.restore_experts(first if first is not None and same_shape(first, own) else own)
                if name in drafts and hasattr(engine, "restore_drafting"):
                    engine.restore_drafting(drafts[name])
                if hasattr(engine, "forget_prefixes"):  # no repeat reuses the prompts an earlier one read
                    engine.forget_prefixes()
                clients = int(case.split()[0]) if workload == "clients" else 1
                if workload == "conversations":
                    clients = conversations
                arrivals = workload_arrivals(
                    workload,
                    engine.tokenizer,
                    tokens,
                    context,
                    clients,
                    prompt_tokens=prompt_tokens,
                    vocab=vocab,
                    seed=r,
                    sampling=sampling,
                    seeded=seeded,
                    depth=depth,
                )
                before = len(late_compiles())
                t0 = time.perf_counter()
                results, stats = driver(engine).run(arrivals)
                wall = time.perf_counter() - t0
                figures = measure(workload, results, stats, wall)
                out[name].runs.setdefault(case, []).append(figures)
                out[name].compiled.setdefault(case, []).append(late_compiles()[before:])
                out[name].windows.setdefault(case, []).append(stats.get("windows_by_kind") or {})
                out[name].records.setdefault(case, []).append(stats.get("window_records") or [])
                if r == 0:
                    out[name].tokens[case] = [res.token_ids for res in results]
                if on_run:
                    on_run(name, case, r, figures)
    return out


def same_model(a: LaunchPlan, b: LaunchPlan) -> bool:
    """Whether two arms' plans run the same model: its weights and its routing, which decide the greedy text.
    The kernels' precision settings (``model.prefill_q``, ``model.decode_attention``) do not count."""
    fields = ("path", "synthetic", "packaged", "seed", "layer_scale", "routing", "facts")
    return all(getattr(a.model, f) == getattr(b.model, f) for f in fields)


def references(plans: Mapping[str, LaunchPlan], base: str) -> dict[str, str]:
    """Each arm's reference, for its gain and its text: ``base`` where the arm runs ``base``'s model, else
    the arm of ``base``'s kind on its own model (``serial@routing:calibrated`` for
    ``batch-mtp@routing:calibrated`` under ``--vary model.routing=...``), or the first arm on it. Arms on
    other weights or routing give other text, so they are compared only with arms on theirs."""
    kind = base.split("@", 1)[0]
    out = {}
    for name, plan in plans.items():
        if base in plans and same_model(plan, plans[base]):
            out[name] = base
            continue
        peers = [n for n, p in plans.items() if same_model(p, plan)]
        out[name] = next((n for n in peers if n.split("@", 1)[0] == kind), peers[0])
    return out


def summarise(
    runs: dict[str, ArmRuns],
    base: str = "serial",
    compare_text: bool = True,
    refs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Medians per arm and case, the gain over its reference (``refs``, by default ``base`` for every arm,
    as for peers) with its interval, and the text-equality check (None without ``compare_text``: sampled
    arms that verify drafts draw differently)."""
    summary: dict[str, Any] = {}
    for name, arm in runs.items():
        ref = (refs or {}).get(name, base)
        cases = {}
        for case, figures in arm.runs.items():
            med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
            entry: dict[str, Any] = {
                "median": med,
                "repeats": len(figures),
                "tok_s_repeats": [f["tok_s"] for f in figures],
                "compiled_in_repeats": [
                    [{"kernel": c.expression, "seconds": c.seconds} for c in each]
                    for each in arm.compiled.get(case, [])
                ],
            }
            mix = merge_window_mix(arm.windows.get(case, []))
            if mix:
                entry["windows_by_kind"] = mix
                balance = drafting_balance(mix)
                if balance is not None:
                    entry["drafting"] = balance
                # each repeat's own, to see what a slow repeat spent its time on
                entry["windows_by_kind_repeats"] = [merge_window_mix([m]) for m in arm.windows.get(case, [])]
            slowest = [
                {**w, "repeat": r + 1}
                for r, each in enumerate(arm.records.get(case, []))
                for w in slowest_windows(each)
            ]
            if slowest:
                entry["slowest_windows"] = sorted(slowest, key=lambda w: -w["ms"])[:SLOWEST_WINDOWS]
            calibration = depth_calibration([w for each in arm.records.get(case, []) for w in each])
            if calibration:
                entry["depth_calibration"] = calibration
            if ref in runs:
                entry["reference"] = ref
            if ref in runs and name != ref and case in runs[ref].runs:
                base_rates = [f["tok_s"] for f in runs[ref].runs[case]]
                rates = [f["tok_s"] for f in figures]
                entry["gain"] = statistics.median(rates) / statistics.median(base_rates) - 1.0
                entry["gain_ci95"] = bootstrap_gain(rates, base_rates)
            if ref in runs:
                same = arm.tokens.get(case) == runs[ref].tokens.get(case)
                entry["text_equal_to_" + ref] = same if compare_text else None
            cases[case] = entry
        summary[name] = cases
    return summary


def cuda_devices(plan: LaunchPlan, workload: str) -> list[int]:
    """The plan's GPU ordinals for a GPU-only workload, or a `DeviceError` saying why it cannot run here."""
    used = [g for g in plan.gpus if g.role != "idle"]
    if plan.machine.backend != "cuda":
        names = ", ".join(g.device for g in used)
        raise DeviceError(
            f"--workload {workload} needs a CUDA GPU, but the plan's devices are virtual CPU devices "
            f'({names}); use a profile with machine.backend = "cuda"'
        )
    try:
        cp = cupy_module()
    except DeviceError as exc:
        raise DeviceError(f"--workload {workload} needs a CUDA GPU: {exc}") from None
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CuPy is installed but no driver or device answers
        raise DeviceError(f"--workload {workload} needs a CUDA GPU, and none answers: {exc}") from None
    missing = [g.device for g in used if g.index >= count]
    if missing:
        raise DeviceError(
            f"--workload {workload}: the plan uses {', '.join(missing)}, but this machine has {count} GPU(s)"
        )
    return [g.index for g in used]
