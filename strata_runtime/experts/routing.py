"""Calibrated routing for synthetic presets: the experts a request means to use, and the router bias that
makes the model's own router choose them.

A synthetic preset's router has random weights, so every expert is about equally likely at every token:
the worst case for an expert cache. Real routing is skewed within a prompt and persistent from token to
token. This module gives each MoE layer a routing model that imitates it (docs/RUNTIME.md has the sources
and how well it matches), in three levels:

* **Model** (fixed by the model seed): a global popularity pi(r) ∝ r^-s over ranks r = 1..E, with the
  expert ids shuffled per layer.
* **Request** (fixed by its prompt): a popularity q ~ Dirichlet(c · E · pi) per layer, drawn on the host
  from the request's routing seed (a hash of its prompt ids) and stored as a float32 CDF.
* **Token**: k lanes per layer. Lane j keeps its expert from one position to the next with probability
  p_stay(layer), and otherwise draws a new one from q; a lane whose draw an earlier lane already holds draws
  again, so the k experts are distinct: a draw from q without replacement.

The token level is a pure function of (seed, layer, position), computed by integer hashing: its rules and
its NumPy form are `strata_runtime.reference.routing` (the twin of the CUDA kernel), which this module
feeds with each request's tables. No history is kept, so any window of any rows routes the same.

The router then runs as always on logits + B at the intended experts: B exceeds any spread the synthetic
router's logits can have, so its top-k is the intended set, and the routing weights among those k still
come from the real logits. Verification, greedy equality and every kernel stay real.

Letters: L model layers, E experts, k experts per row, R rows, S slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..reference.routing import MAX_LAYERS, MAX_TOP_K, intended_sets, route_bias

_U64 = np.uint64


@dataclass(frozen=True)
class RoutingParams:
    """The calibrated routing model's parameters. The defaults reproduce Qwen3-30B-A3B's measured locality
    for a 128-expert top-8 layer (docs/RUNTIME.md, "Routing like a real model")."""

    zipf_s: float = 0.9
    """Zipf exponent of the global popularity: pi(r) ∝ r^-s. Larger is more skewed across all requests."""
    concentration: float = 0.6
    """c in q ~ Dirichlet(c · E · pi): smaller makes each request's hot set smaller and more its own."""
    p_stay: float = 0.28
    """Chance that a lane keeps its expert from one token to the next, mid-stack."""
    early_p_stay: tuple[float, ...] = (0.1, 0.2)
    """p_stay of the first layers (layer 0, layer 1, ...): routing is least persistent near the embedding
    (in Mixtral consecutive tokens share their first choice least often in layer 0)."""
    lookback: int = 64
    """Positions a lane looks back for its latest change; a lane unchanged for longer changes anyway
    (with p_stay = 0.28 that happens with probability 0.28^64, never in practice)."""
    bias: float = 256.0
    """B, added to the intended experts' router logits. A synthetic router's weights are uniform with
    |w| <= sqrt(3 / H) and its input is RMS-normalised (|x| = sqrt(H)), so |logit| <= sqrt(3 H): 256 beats
    the widest possible spread (2 sqrt(3 H)) up to H = 5461, and fp32 logits near 256 keep 2^-16 precision."""

    def p_stay_at(self, layer: int) -> float:
        return self.early_p_stay[layer] if layer < len(self.early_p_stay) else self.p_stay


def routing_seed(prompt_ids: Sequence[int]) -> int:
    """A request's routing seed: a stable 64-bit hash of its prompt ids, so a prompt routes the same way in
    every window mode, engine and process."""
    data = np.asarray(list(prompt_ids), dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"strata-routing").digest(), "little")


# ---- the model and the request ------------------------------------------------------------------


def popularity(n_layers: int, n_experts: int, zipf_s: float, model_seed: int) -> np.ndarray:
    """Each layer's global popularity [L, E]: Zipf over ranks, ids shuffled per layer by the model seed."""
    rng = np.random.default_rng([model_seed, 0x726F757465])
    ranked = np.arange(1, n_experts + 1, dtype=np.float64) ** -zipf_s  # [E] by rank
    ranked /= ranked.sum()
    out = np.empty((n_layers, n_experts))  # [L, E]
    for layer in range(n_layers):
        out[layer, rng.permutation(n_experts)] = ranked
    return out


def request_cdf(seed: int, pi: np.ndarray, concentration: float) -> np.ndarray:
    """A request's q ~ Dirichlet(c · E · pi) per layer, as a float32 CDF [L, E] whose last entry is 1.

    Drawn with NumPy's Generator from the routing seed. The CDF is made non-decreasing after rounding, and
    its last entry exactly 1, so an inverse-CDF lookup of any uniform in [0, 1) finds an expert."""
    rng = np.random.default_rng(seed)
    n_layers, n_experts = pi.shape
    cdf = np.empty((n_layers, n_experts), np.float32)  # [L, E]
    for layer in range(n_layers):
        q = rng.dirichlet(concentration * n_experts * pi[layer])  # [E]
        if not np.isfinite(q).all() or q.sum() <= 0:  # every gamma draw underflowed: keep the global one
            q = pi[layer]
        row = np.maximum.accumulate(np.cumsum(q).astype(np.float32))
        row[-1] = 1.0
        cdf[layer] = row
    return cdf


class RoutingModel:
    """The calibrated routing of one model: its global popularity per layer and the rules above."""

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        top_k: int,
        model_seed: int,
        params: RoutingParams | None = None,
    ) -> None:
        self.params = params or RoutingParams()
        if not 1 <= top_k <= min(n_experts, MAX_TOP_K):
            raise ValueError(
                f"calibrated routing needs 1 <= top-k <= min(E, {MAX_TOP_K}); got {top_k} of {n_experts}"
            )
        if n_layers > MAX_LAYERS:
            raise ValueError(f"calibrated routing hashes at most {MAX_LAYERS} layers, not {n_layers}")
        self.n_layers, self.n_experts, self.top_k = n_layers, n_experts, top_k
        self.popularity = popularity(n_layers, n_experts, self.params.zipf_s, model_seed)  # [L, E]
        self.p_stay = np.array([self.params.p_stay_at(j) for j in range(n_layers)], np.float32)  # [L]

    def layer_args(self, layer: int) -> tuple[float, int, float, int]:
        """(p_stay, top_k, bias, lookback) at ``layer``: the last arguments of ``route_bias`` (the kernel's
        and its twin's)."""
        return float(self.p_stay[layer]), self.top_k, self.params.bias, self.params.lookback

    def request(self, prompt_ids: Sequence[int]) -> tuple[int, np.ndarray]:
        """A request's routing seed and its CDF tables [L, E] (float32)."""
        seed = routing_seed(prompt_ids)
        return seed, request_cdf(seed, self.popularity, self.params.concentration)

    def intended(self, seed: int, cdf: np.ndarray, layer: int, positions: np.ndarray) -> np.ndarray:
        """One request's intended experts [R, k] at ``layer`` for ``positions`` [R] (cdf: its [L, E])."""
        n = len(positions)
        rows = np.broadcast_to(cdf[layer], (n, self.n_experts))
        return self.intended_rows(np.full(n, seed, _U64), rows, layer, positions)

    def intended_rows(
        self, seeds: np.ndarray, cdf_rows: np.ndarray, layer: int, positions: np.ndarray
    ) -> np.ndarray:
        """Rows of several requests at once: the intended experts [R, k] at ``layer`` of rows at
        ``positions`` [R] of requests with routing ``seeds`` [R] and this layer's CDFs ``cdf_rows`` [R, E]."""
        p_stay, top_k, _, lookback = self.layer_args(layer)
        return intended_sets(seeds, cdf_rows, layer, np.asarray(positions), top_k, p_stay, lookback)


class RoutingTables:
    """Every slot's request tables on the host: seeds [S] uint64 and CDFs [S, L, E] float32.

    A slot no request has been admitted to routes like a request with an empty prompt."""

    def __init__(self, model: RoutingModel, slots: int) -> None:
        self.model = model
        seed, cdf = model.request(())
        self.seeds = np.full(slots, seed, _U64)  # [S]
        self.cdf = np.repeat(cdf[None], slots, axis=0)  # [S, L, E]

    def admit(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """Give ``slot`` the tables of a request with these prompt ids."""
        seed, cdf = self.model.request(prompt_ids)
        self.seeds[slot] = _U64(seed)
        self.cdf[slot] = cdf


def apply_bias(
    logits: Any, layer: int, slots: np.ndarray, positions: np.ndarray, tables: RoutingTables, xp: Any = np
) -> Any:
    """Router logits [R, E] (fp32) with B added at each row's intended experts at model layer ``layer``;
    row r is at position positions[r] of slot slots[r]. NumPy logits change in place; other array modules
    (``xp``, e.g. CuPy on the array path) get a new array."""
    target = logits if xp is np else np.zeros(logits.shape, np.float32)  # [R, E]
    route_bias(target, positions, slots, tables.cdf, tables.seeds, layer, *tables.model.layer_args(layer))
    return logits if xp is np else logits + xp.asarray(target)
