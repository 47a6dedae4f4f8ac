"""Locality of a routing trace: the measures an expert cache lives on, as public measurements report them.

A trace is one layer's routing of one prompt: an int array [T, k] of the experts chosen at each of T
positions. Each measure pools a layer's prompts; `measure` averages the layers. `PUBLISHED` holds the
figures measured on Qwen3-30B-A3B (128 experts, top-8) that the calibrated routing model
(`strata_runtime.experts.routing`) is tuned to reproduce; docs/RUNTIME.md cites their sources.

Letters: T positions of a prompt, k experts per position, E experts of the layer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .routing import RoutingModel

RESIDENT = 0.4
"""The share of a layer's experts the cache measures assume resident."""
LRU_WARMUP = 64
"""Positions an LRU cache warms up before its hits count (the steady state the measurement reports)."""
ORACLE_WINDOWS = (4, 16, 64)


@dataclass(frozen=True)
class Locality:
    """The measures of one set of traces, as fractions."""

    repeat: float
    """Share of a position's experts that were also chosen at the previous position."""
    within_8: float
    """Share of choices (after position 0) whose expert was chosen in one of the previous 8 positions."""
    lru_40: float
    """Hit rate of an LRU cache holding 40% of the experts, per prompt from cold, after `LRU_WARMUP`."""
    best_40: float
    """Share of a prompt's choices the best 40% of experts for that very prompt would cover."""
    held_out_40: float
    """Share of a prompt's choices covered by the 40% of experts most used by the other prompts."""
    oracle_4: float
    """Best hit rate of a cache of 2k experts chosen for each window of 4 positions, held for the window."""
    oracle_16: float
    oracle_64: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


PUBLISHED = Locality(
    repeat=0.45,
    within_8=0.80,
    lru_40=0.925,  # 90.0-95.3% over three prompts
    best_40=0.92,
    held_out_40=0.726,  # 68-73% over the held-out prompts
    oracle_4=0.917,
    oracle_16=0.756,
    oracle_64=0.672,
)
"""Qwen3-30B-A3B: repeats, reuse and LRU from kekzl/imp pulls 1358 and 1359; the oracle from arXiv
2505.16056 (tables 3 and 8). Ranges are given as their middle."""


def resident_count(n_experts: int, share: float = RESIDENT) -> int:
    return max(1, round(share * n_experts))


def _chosen(trace: np.ndarray, n_experts: int) -> np.ndarray:
    """Which experts each position chose [T, E] (bool)."""
    out = np.zeros((trace.shape[0], n_experts), bool)
    out[np.arange(trace.shape[0])[:, None], trace] = True
    return out


def next_token_repeat(traces: Sequence[np.ndarray], n_experts: int) -> float:
    same = total = 0
    for t in traces:
        chosen = _chosen(t, n_experts)  # [T, E]
        same += int((chosen[1:] & chosen[:-1]).sum())
        total += t[1:].size
    return same / total


def reuse_within(traces: Sequence[np.ndarray], n_experts: int, window: int = 8) -> float:
    reused = total = 0
    for t in traces:
        chosen = _chosen(t, n_experts)  # [T, E]
        seen = np.concatenate([np.zeros((1, n_experts), np.int64), np.cumsum(chosen, axis=0)])  # [T+1, E]
        ends = np.arange(1, t.shape[0])  # positions 1..T-1; their previous `window` are [p - window, p)
        recent = seen[ends] - seen[np.maximum(ends - window, 0)] > 0  # [T-1, E]
        reused += int((recent & chosen[1:]).sum())
        total += t[1:].size
    return reused / total


def lru_hit_rate(
    traces: Sequence[np.ndarray], n_experts: int, share: float = RESIDENT, warmup: int = LRU_WARMUP
) -> float:
    """Each prompt from a cold cache; a position's experts are looked up together, then made most recent."""
    cap = resident_count(n_experts, share)
    hits = total = 0
    for t in traces:
        cache: OrderedDict[int, None] = OrderedDict()
        for pos, row in enumerate(t.tolist()):
            if pos >= warmup:
                hits += sum(e in cache for e in row)
                total += len(row)
            for e in row:
                cache[e] = None
                cache.move_to_end(e)
            while len(cache) > cap:
                cache.popitem(last=False)
    return hits / total


def _counts(trace: np.ndarray, n_experts: int) -> np.ndarray:
    return np.bincount(trace.ravel(), minlength=n_experts)  # [E]


def best_coverage(traces: Sequence[np.ndarray], n_experts: int, share: float = RESIDENT) -> float:
    cap = resident_count(n_experts, share)
    covered = [np.sort(_counts(t, n_experts))[::-1][:cap].sum() / t.size for t in traces]
    return float(np.mean(covered))


def held_out_coverage(traces: Sequence[np.ndarray], n_experts: int, share: float = RESIDENT) -> float:
    """The resident set of each prompt is chosen from the other prompts' counts (ties to the lower id)."""
    cap = resident_count(n_experts, share)
    counts = np.stack([_counts(t, n_experts) for t in traces])  # [P, E]
    covered = []
    for i, t in enumerate(traces):
        others = counts.sum(axis=0) - counts[i]  # [E]
        chosen = np.argsort(-others, kind="stable")[:cap]
        covered.append(counts[i, chosen].sum() / t.size)
    return float(np.mean(covered))


def oracle_hit(traces: Sequence[np.ndarray], n_experts: int, window: int) -> float:
    """Cache of 2k experts, the best for each whole window of ``window`` positions, fixed within it."""
    hits = total = 0
    for t in traces:
        k = t.shape[1]
        for start in range(0, t.shape[0] - window + 1, window):
            counts = _counts(t[start : start + window], n_experts)
            hits += int(np.sort(counts)[::-1][: 2 * k].sum())
            total += window * k
    return hits / total


def locality(traces: Sequence[np.ndarray], n_experts: int) -> Locality:
    """Every measure over one layer's traces (one per prompt)."""
    return Locality(
        repeat=next_token_repeat(traces, n_experts),
        within_8=reuse_within(traces, n_experts),
        lru_40=lru_hit_rate(traces, n_experts),
        best_40=best_coverage(traces, n_experts),
        held_out_40=held_out_coverage(traces, n_experts),
        oracle_4=oracle_hit(traces, n_experts, 4),
        oracle_16=oracle_hit(traces, n_experts, 16),
        oracle_64=oracle_hit(traces, n_experts, 64),
    )


def measure(by_layer: Sequence[Sequence[np.ndarray]], n_experts: int) -> Locality:
    """The measures averaged over layers (each a list of per-prompt traces)."""
    per = [locality(traces, n_experts).as_dict() for traces in by_layer]
    return Locality(**{k: float(np.mean([p[k] for p in per])) for k in per[0]})


# ---- traces from the routing models ---------------------------------------------------------------


def calibrated_traces(
    model: RoutingModel, prompts: Sequence[Sequence[int]], tokens: int, layers: Sequence[int]
) -> list[list[np.ndarray]]:
    """The calibrated model's intended sets at positions 0..tokens-1 of each prompt, for each layer."""
    requests = [model.request(p) for p in prompts]
    positions = np.arange(tokens)
    return [[model.intended(seed, cdf, layer, positions) for seed, cdf in requests] for layer in layers]


def uniform_traces(
    rng: np.random.Generator, prompts: int, tokens: int, layers: int, n_experts: int, top_k: int
) -> list[list[np.ndarray]]:
    """Random routing: k distinct experts, uniformly, at every position (what a random router gives)."""
    return [
        [np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k] for _ in range(prompts)]
        for _ in range(layers)
    ]
