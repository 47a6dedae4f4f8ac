"""NumPy twins of the CUDA decode kernels: the same contract, written plainly, for the gpu tests.

Each function mirrors the launcher of the same name in `strata_runtime.cuda.ops`, takes NumPy arrays, and
writes its outputs in place. Weights arrive as float16 and are widened to float32, as the kernels do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .keep import moe_admit


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return np.asarray(x / (1.0 + np.exp(-x)))


def _rms_inv(x: np.ndarray, eps: float) -> np.ndarray:
    return np.asarray(1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))  # [R, 1]


def gemv(
    w: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    accumulate: bool = False,
    norm: np.ndarray | None = None,
    eps: float = 1e-6,
) -> None:
    if norm is not None:
        x = x * _rms_inv(x, eps) * _f32(norm)
    y = x @ _f32(w).T  # [R, N]
    out[...] = out + y if accumulate else y


def add_rms_norm_fp32(
    resid: np.ndarray, delta: np.ndarray | None, w: np.ndarray, out: np.ndarray, eps: float
) -> None:
    """The fp32 rule: no rounding between the norm and the weight (`reference.ops.rms_norm_in_dtype` is the
    array path's rule, which rounds to the input dtype in between)."""
    if delta is not None:
        resid += delta
    inv = 1.0 / np.sqrt(np.mean(resid * resid, axis=-1, keepdims=True) + eps)  # [R, 1]
    out[...] = resid * inv * _f32(w)


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """NeoX rotate-half RoPE of x [R, heads, D] at positions pos [R]."""
    d = x.shape[-1]
    inv_freq = theta ** (-2.0 * np.arange(d // 2, dtype=np.float32) / d)  # [D/2]
    ang = pos[:, None].astype(np.float32) * inv_freq[None, :]  # [R, D/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _head_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return np.asarray(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f32(w))


def qk_norm_rope_kv(
    qkv: np.ndarray,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    pos: np.ndarray,
    slot: np.ndarray,
    q_out: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    theta: float,
    eps: float,
) -> None:
    rows = qkv.shape[0]
    _, n_q, d = q_out.shape
    n_kv = k_cache.shape[1]
    q = qkv[:, : n_q * d].reshape(rows, n_q, d)  # [R, NQ, D]
    k = qkv[:, n_q * d : (n_q + n_kv) * d].reshape(rows, n_kv, d)  # [R, NKV, D]
    v = qkv[:, (n_q + n_kv) * d :].reshape(rows, n_kv, d)  # [R, NKV, D]
    q_out[...] = _rope(_head_rmsnorm(q, q_norm, eps), pos, theta)
    k_rot = _rope(_head_rmsnorm(k, k_norm, eps), pos, theta)
    for r in range(rows):
        k_cache[slot[r], :, pos[r]] = k_rot[r]
        v_cache[slot[r], :, pos[r]] = v[r]


def qkv_rope(
    w: np.ndarray,
    x: np.ndarray,
    qkv: np.ndarray,
    norm: np.ndarray,
    eps: float,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    pos: np.ndarray,
    slot: np.ndarray,
    q_out: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    theta: float,
    done: np.ndarray | None = None,
) -> None:
    """``done`` is the launcher's workspace; the reference needs none."""
    gemv(w, x, qkv, norm=norm, eps=eps)
    qk_norm_rope_kv(qkv, q_norm, k_norm, pos, slot, q_out, k_cache, v_cache, theta, eps)


def qk_norm_rope_split(
    qkv: np.ndarray,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    pos: np.ndarray,
    slot: np.ndarray,
    q_hi: np.ndarray,
    q_lo: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    theta: float,
    eps: float,
) -> None:
    q = np.empty(q_hi.shape, np.float32)
    qk_norm_rope_kv(qkv, q_norm, k_norm, pos, slot, q, k_cache, v_cache, theta, eps)
    q_hi[...] = q.astype(np.float16)
    q_lo[...] = (q - q_hi.astype(np.float32)).astype(np.float16)


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    pos: np.ndarray,
    slot: np.ndarray,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
    done: np.ndarray | None = None,
    tensor_cores: bool = True,
) -> None:
    """``scratch`` and ``done`` are the launcher's workspace, and ``tensor_cores`` its choice of kernel; the
    reference needs neither."""
    rows, n_q, d = q.shape
    n_kv = k_cache.shape[1]
    g = n_q // n_kv
    for r in range(rows):
        n = int(pos[r]) + 1
        k = _f32(k_cache[slot[r], :, :n])  # [NKV, n, D]
        v = _f32(v_cache[slot[r], :, :n])  # [NKV, n, D]
        qr = q[r].reshape(n_kv, g, d)  # [NKV, G, D]
        s = np.einsum("hgd,htd->hgt", qr, k) / np.sqrt(d)  # [NKV, G, n]
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[r] = np.einsum("hgt,htd->hgd", p, v).reshape(n_q * d)


def _count(experts: Any, chosen: np.ndarray) -> None:
    """Count assignments to the experts ``chosen`` as the kernels do, where ``experts`` has counters (an
    expert cache): each expert's count, and the misses [not in VRAM, of those in a helper slot]."""
    if experts is None or experts.counts is None:
        return
    np.add.at(experts.counts, chosen, 1)
    where = experts.slot_of[chosen]
    experts.misses[0] += np.count_nonzero(where < 0)
    experts.misses[1] += np.count_nonzero(where < -1)


def moe(
    x: np.ndarray,
    norm: np.ndarray,
    logits: np.ndarray,
    norm_topk: bool,
    eps: float,
    experts: Any,
    resid: np.ndarray,
    idx: np.ndarray,
    wts: np.ndarray,
    h_buf: np.ndarray,
    warm: np.ndarray | None = None,
) -> None:
    """``experts.weights(e)``: expert e's gate/up [2I, H] and down [H, I] (the kernel reads the same through
    ``experts``' address tables); ``counts``, ``slot_of``, ``misses`` and ``keep`` as the launcher's. ``warm``
    only moves weights into a GPU's L2, so it changes nothing here."""
    rows, topk = idx.shape
    inter = h_buf.shape[1]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [R, E]
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :topk]  # ties: lower index first
    idx[...] = order
    w = np.take_along_axis(p, order, axis=-1)  # [R, k]
    wts[...] = w / w.sum(-1, keepdims=True) if norm_topk else w
    keep = getattr(experts, "keep", None)
    if keep is not None:
        moe_admit(keep, idx)
    xn = x * _rms_inv(x, eps) * _f32(norm)  # [R, H]
    for r in range(rows):
        total = np.zeros(x.shape[1], np.float32)
        for j in range(topk):
            e = int(idx[r, j])
            _count(experts, np.array([e]))
            gate_up, down = experts.weights(e)
            if keep is not None and keep.fill[e] >= 0:  # the kernels write what they read into its slot
                for dst, src in zip(keep.slot(int(keep.fill[e])), (gate_up, down), strict=True):
                    dst[...] = src
            gu = _f32(gate_up) @ xn[r]  # [2I]
            h = _silu(gu[:inter]) * gu[inter:]  # [I]
            h_buf[r * topk + j] = h
            total += wts[r, j] * (_f32(down) @ h)  # [H]
        resid[r] += total


def silu_mul(gu: np.ndarray, out: np.ndarray) -> None:
    inter = out.shape[1]
    out[...] = _silu(gu[:, :inter]) * gu[:, inter:]


def add_scaled(resid: np.ndarray, y: np.ndarray, gate: np.ndarray | None = None) -> None:
    """``gate``: one value per row, [R] or [R, 1] (the decode path holds the shared expert gate as [R, 1])."""
    resid += y if gate is None else (1.0 / (1.0 + np.exp(-gate.reshape(-1))))[:, None] * y


def embed(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    out[...] = _f32(table[ids])


def argmax(logits: np.ndarray, out: np.ndarray, scratch: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The launcher's twin; ``scratch`` holds the kernel's per-slice candidates, which NumPy does not need."""
    out[...] = np.argmax(logits, axis=-1)


FIXED_ONE = float(1 << 40)
"""The fixed point the top-p cut sums weights in (a weight w counts as floor(w * 2^40))."""


def choose_tokens(
    logits: np.ndarray,
    inv_temp: np.ndarray,
    uniform: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    log_min_p: np.ndarray | None = None,
) -> np.ndarray:
    """The chosen token of each row of ``logits`` [R, V] (`strata_runtime.models.ops.choose`): the argmax
    (lowest index on ties) where ``inv_temp`` [R] is 0, else the draw at ``uniform`` [R] (in [0, 1)) from the
    weights exp((l - max l) * inv_temp) of the tokens that stay after ``top_k`` [R] (0: no cut), the min-p
    cut ``log_min_p`` [R] (minus infinity: none) and ``top_p`` [R] (1: no cut)."""
    rows = logits.shape[0]
    k_of = np.zeros(rows, np.int64) if top_k is None else np.asarray(top_k)
    p_of = np.ones(rows, np.float32) if top_p is None else np.asarray(top_p, np.float32)
    m_of = np.full(rows, -np.inf, np.float32) if log_min_p is None else np.asarray(log_min_p, np.float32)
    out = np.empty(rows, dtype=np.int64)
    for r, row in enumerate(np.asarray(logits, dtype=np.float32)):
        if inv_temp[r] <= 0:
            out[r] = int(np.argmax(row))
            continue
        weights = staying_weights(row, float(inv_temp[r]), int(k_of[r]), float(p_of[r]), float(m_of[r]))
        cdf = np.cumsum(weights)
        at = int(np.searchsorted(cdf, float(uniform[r]) * cdf[-1], side="right"))
        out[r] = min(at, int(np.flatnonzero(weights)[-1]))  # u * total rounded up to the total: the last
    return out


def min_p_keeps(row: np.ndarray, inv_temp: float, log_min_p: float) -> np.ndarray:
    """Which tokens of logits ``row`` [V] (float32) the min-p cut keeps, [V] bool: (l - max l) * inv_temp,
    in float32 as the kernel computes it, at least ``log_min_p`` (float32; minus infinity keeps all)."""
    if log_min_p == -np.inf:
        return np.ones(row.shape, dtype=bool)
    x = np.asarray(row, np.float32)
    keeps: np.ndarray = (x - x.max()) * np.float32(inv_temp) >= np.float32(log_min_p)
    return keeps


def staying_weights(
    row: np.ndarray, inv_temp: float, top_k: int, top_p: float, log_min_p: float = -np.inf
) -> np.ndarray:
    """The weights [V] (float64) a draw from logits ``row`` [V] (float32) takes: exp((l - max l) * inv_temp)
    for the tokens that stay after the top-k, min-p and top-p cuts, 0 for the others. Top-p weighs only
    what the first two leave."""
    v = row.shape[0]
    stays = min_p_keeps(row, inv_temp, log_min_p)
    if 0 < top_k < v:
        stays &= row >= np.partition(row, -top_k)[-top_k]  # ties at the k-th largest all stay
    x = row.astype(np.float64)
    weights = np.exp((x - x.max()) * inv_temp)  # [V]
    if np.float32(top_p) < 1:
        fixed = np.floor(np.where(stays, weights, 0.0) * FIXED_ONE).astype(np.uint64)
        # At least the top token stays: a top-p so small that its share of the total rounds to 0 keeps it.
        need = max(np.uint64(float(np.float32(top_p)) * float(fixed.sum())), np.uint64(1))
        order = np.lexsort((np.arange(v), -x))  # descending logit, then ascending index
        before = np.cumsum(fixed[order]) - fixed[order]  # the weight before each, in that order
        kept = np.zeros(v, dtype=bool)
        kept[order] = before < need
        stays &= kept
    return np.where(stays, weights, 0.0)


def choose(
    logits: np.ndarray,
    inv_temp: np.ndarray,
    uniform: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    out: np.ndarray,
    gather: bool = True,
    split: bool = True,
    scratch: Any = None,
    log_min_p: np.ndarray | None = None,
) -> None:
    """The launcher's twin; ``gather`` (the kernel's shared-memory shortcut) and ``split`` (its passes over
    slices of the row in parallel, into ``scratch``) do not change the token."""
    out[...] = choose_tokens(logits, inv_temp, uniform, top_k, top_p, log_min_p)


def distribution(
    logits: np.ndarray,
    inv_temp: float,
    top_k: int,
    top_p: float,
    out: np.ndarray,
    gather: bool = True,
    split: bool = True,
    scratch: Any = None,
    log_min_p: float = -np.inf,
) -> None:
    """The launcher's twin: out [R, V] (float64) = the distribution `choose_tokens` draws each row from,
    `staying_weights` over their sum (the argmax's one-hot where ``inv_temp`` is 0). ``gather``, ``split``
    and ``scratch`` as for `choose`."""
    for r, row in enumerate(np.asarray(logits, dtype=np.float32)):
        if inv_temp <= 0:
            out[r] = np.arange(row.shape[0]) == int(np.argmax(row))
            continue
        t = float(np.float32(inv_temp))
        weights = staying_weights(row, t, int(top_k), float(top_p), float(np.float32(log_min_p)))
        out[r] = weights / weights.sum()


def inverse_cdf(w: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    """The launcher's twin: out[r] = the first index whose cumulative weight (w [R, V], float64) exceeds u[r]
    times the row's total, by NumPy's cumulative sum (the kernel's sums differ from it only in rounding, and
    where rounding leaves no index it takes the last of positive weight)."""
    for r, row in enumerate(np.asarray(w, dtype=np.float64)):
        cdf = np.cumsum(row)
        at = int(np.searchsorted(cdf, float(u[r]) * cdf[-1], side="right"))
        out[r] = at if at < row.shape[0] else int(np.flatnonzero(row > 0)[-1])


def verify_sampled(
    p: np.ndarray,
    q: np.ndarray,
    tokens: np.ndarray,
    uniforms: np.ndarray,
    accepted: np.ndarray,
    first: np.ndarray,
) -> None:
    """The launcher's twin: for each of S slots of n rows (p [S n, V], q [S (n - 1), V], tokens [S n],
    uniforms [S, >= n]), the proposals kept while u_j q_j(token) < p_j(token), and the draw at u_(n - 1)
    from the residual max(0, p_a - q_a) at the first rejection (p_a where it is empty) or from the last p."""
    s = uniforms.shape[0]
    n = tokens.shape[0] // s
    for i in range(s):
        ps, qs, ts, us = (
            p[i * n : (i + 1) * n],
            q[i * (n - 1) : (i + 1) * (n - 1)],
            tokens[i * n : (i + 1) * n],
            uniforms[i],
        )
        a = 0
        while a < n - 1 and us[a] * qs[a, ts[a + 1]] < ps[a, ts[a + 1]]:
            a += 1
        after = np.maximum(ps[a] - qs[a], 0.0) if a < n - 1 else ps[a]
        if not after.sum() > 0:
            after = ps[a]
        out = np.empty(1, np.int64)
        inverse_cdf(after[None, :], np.array([us[n - 1]]), out)
        accepted[i], first[i] = a, out[0]


def adjust_logits(
    logits: np.ndarray,
    rows: np.ndarray,
    slot: np.ndarray,
    counts: np.ndarray,
    bias: np.ndarray,
    frequency: np.ndarray,
    presence: np.ndarray,
    tokens: np.ndarray | None = None,
    extra_from: np.ndarray | None = None,
    extra_count: np.ndarray | None = None,
    repetition: np.ndarray | None = None,
) -> None:
    """Each of ``rows`` [A] of logits [R, V] (fp32), in place, after its slot's logit bias and penalties
    (`strata_runtime.models.ops.adjust`): x = l + bias[s]; where the token's count is nonzero (seen in the
    prompt, `PROMPT_SEEN`, or generated) and ``repetition`` [A] is not 1, x / r above 0 and x * r otherwise;
    then x - (frequency * c + presence) where the count c of times generated is above 0; in float64 and
    rounded once to float32. ``slot``, ``frequency`` and ``presence`` [A] are each adjusted row's, ``counts``
    [S, V] (int32) and ``bias`` [S, V] (float64) each slot's; ``repetition`` None is 1 for every row. A
    row's c also counts the ``extra_count[a]`` tokens of ``tokens`` from ``extra_from[a]`` on (the proposals
    a speculative row follows; at most `EXTRA_MOST`)."""
    for i, r in enumerate(np.asarray(rows)):
        s = int(slot[i])
        x = logits[r].astype(np.float64) + bias[s]  # [V]
        raw = counts[s].astype(np.int64)
        c = raw & (PROMPT_SEEN - 1)
        if tokens is not None and extra_count is not None and extra_from is not None and extra_count[i]:
            at = int(extra_from[i])
            np.add.at(c, np.asarray(tokens[at : at + int(extra_count[i])], np.int64), 1)
        rep = 1.0 if repetition is None else float(repetition[i])
        if rep != 1.0:
            seen = (raw != 0) | (c > 0)
            x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        hit = c > 0
        x[hit] -= float(frequency[i]) * c[hit].astype(np.float64) + float(presence[i])
        logits[r] = x.astype(np.float32)


PROMPT_SEEN = 1 << 30
"""Added to a device count for each distinct prompt token of a request with a repetition penalty
(`strata_runtime.models.ops.adjust`): the times the token was generated lie below it (kernels.cu's
ADJUST_SEEN)."""

EXTRA_MOST = 8
"""Tokens an adjusted row may count beyond its slot's counts (`adjust_logits`): a window's rows follow at most
this many proposals (kernels.cu's ADJUST_EXTRA)."""


def mask_logits(logits: np.ndarray, rows: np.ndarray, bits: np.ndarray) -> None:
    """Rows ``rows`` [M] of logits [R, V], in place: minus infinity for each token whose bit is clear in the
    row's packed mask ``bits`` [M, W] (uint32, token t at bit t % 32 of word t // 32)."""
    v = logits.shape[1]
    for a, r in enumerate(np.asarray(rows)):
        allowed = np.unpackbits(np.asarray(bits[a], "<u4").view(np.uint8), bitorder="little")[:v]
        np.putmask(logits[int(r)], allowed == 0, -np.inf)


def count_tokens(counts: np.ndarray, slot: np.ndarray, tokens: np.ndarray, add: np.ndarray) -> None:
    """counts[slot[i], tokens[i]] += add[i] for each i (a slot and token may repeat); counts [S, V] int32."""
    np.add.at(counts, (np.asarray(slot), np.asarray(tokens)), np.asarray(add, dtype=counts.dtype))


def rms_norm_fp32_to_half(x: np.ndarray, w: np.ndarray, out: np.ndarray, eps: float) -> None:
    out[...] = (x * _rms_inv(x, eps) * _f32(w)).astype(np.float16)


def route_topk(
    logits: np.ndarray, norm_topk: bool, idx: np.ndarray, wts: np.ndarray, experts: Any = None
) -> None:
    """``experts``: with counters (an expert cache), each assignment is counted as `moe` counts it."""
    topk = idx.shape[1]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [R, E]
    idx[...] = np.argsort(-logits, axis=-1, kind="stable")[:, :topk]  # ties: lower index first
    w = np.take_along_axis(p, idx, axis=-1)  # [R, k]
    wts[...] = w / w.sum(-1, keepdims=True) if norm_topk else w
    _count(experts, idx.reshape(-1))


def softmax_causal(scores: np.ndarray, probs: np.ndarray, pos: int, group: int) -> None:
    _, rows, length = scores.shape
    for r in range(rows):
        valid = min(pos + r // group + 1, length)
        s = scores[:, r, :valid]  # [B, valid]
        p = np.exp(s - s.max(-1, keepdims=True))
        probs[:, r, :valid] = (p / p.sum(-1, keepdims=True)).astype(np.float16)
        probs[:, r, valid:] = 0


def moe_group(idx: np.ndarray, n_exp: int, rank: np.ndarray, most: np.ndarray) -> None:
    """Places in order of assignment (the kernel's order differs; any bijection onto 0..count-1 is valid)."""
    seen = np.zeros(n_exp, np.int64)
    for a, e in enumerate(idx.ravel()):
        rank.flat[a], seen[e] = seen[e], seen[e] + 1
    most[0] = seen.max()


def silu_mul_half(gu: np.ndarray, out: np.ndarray) -> None:
    inter = out.shape[1]
    g = _f32(gu)
    out[...] = (_silu(g[:, :inter]) * g[:, inter:]).astype(np.float16)


def moe_scatter_rows(x: np.ndarray, idx: np.ndarray, rank: np.ndarray, xs: np.ndarray) -> None:
    rows, topk = idx.shape
    for a in range(rows * topk):
        xs[idx.flat[a], rank.flat[a]] = x[a // topk]


def moe_gather_add(
    ys: np.ndarray, idx: np.ndarray, rank: np.ndarray, wts: np.ndarray, resid: np.ndarray
) -> None:
    rows, topk = idx.shape
    for r in range(rows):
        for j in range(topk):
            resid[r] += wts[r, j] * _f32(ys[idx[r, j], rank[r, j]])
