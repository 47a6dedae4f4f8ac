"""The NumPy twin of the router-bias kernel (`strata_runtime.cuda.routing.route_bias`), and its contract.

Calibrated routing (`strata_runtime.experts.routing` holds the model; docs/RUNTIME.md describes it) adds a
bias B to the router logits of the k experts each row intends. A row at position t of a request with routing
seed ``seed`` and CDF table ``cdf[layer]`` (its q per layer, float32) intends, at model layer ``layer``:

* for each lane j < k, its latest change u* <= t: the first u = t, t - 1, ... (at most ``lookback`` of them)
  with u == 0 or ``hash_uniform(seed, STAY, layer, j, 0, u) >= p_stay``; none found: max(t - lookback + 1, 0);
* lane j's expert: the first attempt a < `ATTEMPTS` whose draw ``first_above(cdf, hash_uniform(seed, DRAW,
  layer, j, a, u*))`` no earlier lane holds; when every attempt collides, the first free expert after its
  attempt-0 draw, cyclically. So the k experts are distinct.

Everything is integer hashing (splitmix64 on uint64), uniforms on a 2^-24 grid (exact in float32) compared
with float32 thresholds, and a binary search over the float32 table, so the kernel (``cuda/routing.cu``) and
`route_bias` here choose bit-identical sets. The only float arithmetic is the final ``logits += B``, one
IEEE add in both. Nothing keeps history: a row's set is a pure function of (seed, layer, position).

Letters: R rows, E experts, L model layers, S slots, k experts per row (top-k), A attempts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KIND_STAY = 1
"""Hash kind of a lane's keep-or-change uniform at a position."""
KIND_DRAW = 2
"""Hash kind of a lane's draw from q (with the attempt number)."""
ATTEMPTS = 32
"""Draws a colliding lane tries before scanning for a free expert; one warp lane each in the kernel."""
MAX_TOP_K = 32
"""Lanes per row the kernel holds (one warp's shared arrays)."""
MAX_LAYERS = 4096
"""Layer ids fit the hash word's 12 bits."""
MAX_KERNEL_EXPERTS = 256
"""Experts per layer the kernel's shared CDF row holds (the CUDA expert kernels route at most 256 too)."""

_U64 = np.uint64
_GRID = np.float32(2.0**-24)


# ---- hashing: the same integer arithmetic as routing.cu -------------------------------------------------


def mix64(x: Any) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a bijection that scrambles every bit."""
    z = np.asarray(x, dtype=_U64)
    with np.errstate(over="ignore"):
        z = z + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return np.asarray(z ^ (z >> _U64(31)))


def hash_uniform(seed: Any, kind: int, layer: int, lane: Any, attempt: Any, position: Any) -> np.ndarray:
    """A uniform in [0, 1) on a 2^-24 grid (exact in float32), from (seed, kind, layer, lane, attempt,
    position). The word packs kind (4 bits), layer (12), lane (8), attempt (8), position (32); mixing it and
    then the seed xor it gives every word its own value for a given seed. Array arguments broadcast."""
    word = (
        (_U64(kind) << _U64(60))
        | (_U64(layer) << _U64(48))
        | (np.asarray(lane, dtype=_U64) << _U64(40))
        | (np.asarray(attempt, dtype=_U64) << _U64(32))
        | np.asarray(position, dtype=_U64)
    )
    h = mix64(np.asarray(seed, dtype=_U64) ^ mix64(word))
    return np.asarray((h >> _U64(40)).astype(np.float32) * _GRID)


# ---- intended sets: the kernel's algorithm, vectorised over rows -----------------------------------------


def lane_origins(
    seeds: np.ndarray, layer: int, positions: np.ndarray, top_k: int, p_stay: float, lookback: int
) -> np.ndarray:
    """u* [R, k]: each lane's latest change position <= the row's position t, looking back ``lookback``
    positions (t - lookback + 1 when it found none). Position 0 is always a change."""
    pos = np.asarray(positions, dtype=np.int64)  # [R]
    p = np.float32(p_stay)
    out = np.empty((pos.size, top_k), np.int64)  # [R, k]
    chunk = 8  # positions looked at per pass; almost every lane changed within the first few
    for lane in range(top_k):
        origin = np.maximum(pos - lookback + 1, 0)  # [R] the answer when no change is found
        todo = np.arange(pos.size)
        for start in range(0, lookback, chunk):
            if not todo.size:
                break
            back = np.arange(start, min(start + chunk, lookback))  # [c]
            u = pos[todo, None] - back[None, :]  # [n, c]
            stay = hash_uniform(seeds[todo, None], KIND_STAY, layer, lane, 0, np.maximum(u, 0))
            change = (u >= 0) & ((u == 0) | (stay >= p))  # [n, c]
            found = change.any(axis=1)
            origin[todo[found]] = pos[todo[found]] - back[change[found].argmax(axis=1)]
            todo = todo[~found]
        out[:, lane] = origin
    return out


def first_above(cdf_rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """For each row r, the first expert e with cdf_rows[r, e] > u[r, i] ([R, n] of int64), by the kernel's
    binary search (E - 1 when no entry is above u)."""
    n_experts = cdf_rows.shape[1]
    lo = np.zeros(u.shape, np.int64)
    hi = np.full(u.shape, n_experts - 1, np.int64)
    for _ in range(max(n_experts - 1, 1).bit_length()):
        mid = (lo + hi) >> 1
        above = np.take_along_axis(cdf_rows, mid, axis=1) > u
        active = lo < hi
        hi = np.where(active & above, mid, hi)
        lo = np.where(active & ~above, mid + 1, lo)
    return lo


def _draws(
    seeds: np.ndarray, cdf_rows: np.ndarray, layer: int, lane: int, attempts: np.ndarray, origin: np.ndarray
) -> np.ndarray:
    """Lane ``lane``'s candidate expert at each attempt [R, A], drawn from q with its origin's uniforms."""
    u = hash_uniform(seeds[:, None], KIND_DRAW, layer, lane, attempts[None, :], origin[:, None])  # [R, A]
    return first_above(cdf_rows, u)


def _scan_free(start: np.ndarray, taken: np.ndarray, n_experts: int) -> np.ndarray:
    """The first expert after ``start`` (cyclically) that is not in ``taken`` [n, j]."""
    ring = (start[:, None] + np.arange(1, n_experts + 1)[None, :]) % n_experts  # [n, E]
    free = ~(ring[:, :, None] == taken[:, None, :]).any(axis=2)  # [n, E]
    out: np.ndarray = ring[np.arange(start.size), free.argmax(axis=1)]
    return out


def intended_sets(
    seeds: np.ndarray,
    cdf_rows: np.ndarray,
    layer: int,
    positions: np.ndarray,
    top_k: int,
    p_stay: float,
    lookback: int,
) -> np.ndarray:
    """The k distinct experts [R, k] (lane order) that rows at ``positions`` of requests with ``seeds`` [R]
    and CDFs ``cdf_rows`` [R, E] (this layer's) intend at ``layer``.

    Lane j's pick is its first attempt whose candidate no earlier lane holds; when all `ATTEMPTS` collide,
    the first free expert after its attempt-0 candidate."""
    seeds = np.asarray(seeds, dtype=_U64)
    n_experts = cdf_rows.shape[1]
    origins = lane_origins(seeds, layer, positions, top_k, p_stay, lookback)  # [R, k]
    chosen = np.empty((seeds.size, top_k), np.int64)  # [R, k]
    first_try, more = np.arange(1), np.arange(1, ATTEMPTS)
    for lane in range(top_k):
        taken = chosen[:, :lane]  # [R, j]
        pick = _draws(seeds, cdf_rows, layer, lane, first_try, origins[:, lane])[:, 0]  # [R]
        clash = np.nonzero((taken == pick[:, None]).any(axis=1))[0]
        if clash.size:  # the few rows whose first draw is taken try the other attempts
            cand = _draws(seeds[clash], cdf_rows[clash], layer, lane, more, origins[clash, lane])  # [n, A-1]
            free = ~(cand[:, :, None] == taken[clash][:, None, :]).any(axis=2)  # [n, A-1]
            ok = free.any(axis=1)
            first = pick[clash]
            pick[clash[ok]] = cand[ok, free[ok].argmax(axis=1)]
            stuck = clash[~ok]
            if stuck.size:
                pick[stuck] = _scan_free(first[~ok], taken[stuck], n_experts)
        chosen[:, lane] = pick
    return chosen


# ---- the kernel's contract and its twin ------------------------------------------------------------------


def check_args(
    logits: Any, pos: Any, slot: Any, cdf: Any, seeds: Any, layer: int, top_k: int, kernel: bool = True
) -> tuple[int, int]:
    """(R, E) of a valid call; ValueError naming what does not fit. With ``kernel``, also the launcher's
    dtypes (logits and cdf float32, pos and slot int32, seeds uint64), C order and `MAX_KERNEL_EXPERTS`."""
    if logits.ndim != 2 or cdf.ndim != 3:
        raise ValueError(
            f"route_bias: logits must be [R, E] and cdf [S, L, E], not {logits.shape}, {cdf.shape}"
        )
    rows, n_exp = logits.shape
    if not 1 <= top_k <= min(n_exp, MAX_TOP_K):
        raise ValueError(f"route_bias: top-k {top_k} must be in [1, min(E = {n_exp}, {MAX_TOP_K})]")
    if (
        tuple(pos.shape) != (rows,)
        or tuple(slot.shape) != (rows,)
        or cdf.shape[2] != n_exp
        or tuple(seeds.shape) != (cdf.shape[0],)
        or not 0 <= layer < min(cdf.shape[1], MAX_LAYERS)
    ):
        raise ValueError(
            f"route_bias: shapes logits {logits.shape}, pos {pos.shape}, slot {slot.shape}, cdf {cdf.shape}, "
            f"seeds {seeds.shape} at layer {layer}"
        )
    if not kernel:
        return rows, n_exp
    if n_exp > MAX_KERNEL_EXPERTS:
        raise ValueError(f"route_bias: {n_exp} experts; the kernel holds at most {MAX_KERNEL_EXPERTS}")
    for name, a, dtype in (
        ("logits", logits, np.float32),
        ("pos", pos, np.int32),
        ("slot", slot, np.int32),
        ("cdf", cdf, np.float32),
        ("seeds", seeds, np.uint64),
    ):
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"route_bias: {name} must be C-contiguous {np.dtype(dtype)}, not {a.dtype}")
    return rows, n_exp


def route_bias(
    logits: np.ndarray,
    pos: np.ndarray,
    slot: np.ndarray,
    cdf: np.ndarray,
    seeds: np.ndarray,
    layer: int,
    p_stay: float,
    top_k: int,
    bias: float,
    lookback: int,
) -> None:
    """logits [R, E] fp32 += B at each row's intended experts, in place. Row r is at position pos[r] of slot
    slot[r]; cdf [S, L, E] fp32 and seeds [S] uint64 are every slot's request tables; ``layer`` is the model
    layer (an index into L). Positions and slots may be of any integer dtype here."""
    check_args(logits, pos, slot, cdf, seeds, layer, top_k, kernel=False)
    pos, slot = np.asarray(pos, np.int64), np.asarray(slot, np.int64)
    sets = intended_sets(seeds[slot], cdf[slot, layer], layer, pos, top_k, p_stay, lookback)  # [R, k]
    logits[np.arange(pos.size)[:, None], sets] += np.float32(bias)
