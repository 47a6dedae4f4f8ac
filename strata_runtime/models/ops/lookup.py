"""N-gram lookup over token histories on the device: the rule of `strata_runtime.engine.lookup.TextLookup`
for windows the device decides, whose text length the host does not know yet when they are queued.

Each slot's history holds its tokens by position; ``lengths`` says how many of them are its text (a value on
the device, where a window's decision left it). For each slot, the latest earlier occurrence of the longest
run of its last tokens (``longest`` down to ``shortest`` of them) gives the proposals: the tokens after that
occurrence, read on through the proposals themselves where the occurrence is close behind. A slot whose text
holds no such run proposes its last token ``most`` times, and is marked not ``found``: the window then runs
its rows anyway (its shape was fixed when it was queued) and the host counts it as a lookup that missed.

The NumPy path compares shifted copies of the histories, ``longest`` of them; on a GPU one block a slot
scans its history once (one launch, no host round trip).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import locked_cache, on_gpu


def lookup_propose(history: Any, lengths: Any, shortest: int, longest: int, most: int) -> tuple[Any, Any]:
    """(proposals [S, most] int64, found [S] bool) for histories [S, C] (int64) of which the first
    ``lengths`` [S] (int64, each at least 1 and at most C) tokens are each slot's text."""
    assert 1 <= shortest <= longest and most >= 1
    if on_gpu(history):
        return _lookup_gpu(history, lengths, shortest, longest, most)
    return _lookup_numpy(np.asarray(history), np.asarray(lengths), shortest, longest, most)


def _lookup_numpy(
    history: np.ndarray, lengths: np.ndarray, shortest: int, longest: int, most: int
) -> tuple[np.ndarray, np.ndarray]:
    s, c = history.shape
    slots = np.arange(s)
    last = lengths.astype(np.int64) - 1  # [S]: each slot's last token's position
    ends = np.arange(c)  # each candidate occurrence's last position
    alive = ends[None, :] < last[:, None]  # an earlier occurrence ends before the last token
    matched = np.zeros((s, c), np.int64)
    for t in range(longest):  # the occurrence's t-th token from its end against the text's
        shifted = np.roll(history, t, axis=1)  # shifted[:, e] = history[:, e - t] where e >= t
        against = history[slots, np.maximum(last - t, 0)]  # [S]
        alive &= (ends[None, :] >= t) & (last[:, None] >= t) & (shifted == against[:, None])
        matched += alive
    score = np.where(matched >= shortest, matched * c + ends[None, :], -1)  # longest, then latest
    best = score.max(axis=1)
    found = best >= 0
    end = np.where(found, best % c, 0)
    period = np.maximum(last - end, 1)  # the continuation repeats with this period past the text's end
    at = end[:, None] + 1 + np.arange(most)[None, :] % period[:, None]
    proposals = np.where(
        found[:, None], history[slots[:, None], np.minimum(at, c - 1)], history[slots, last][:, None]
    )
    return proposals.astype(np.int64), found


_SOURCE = r"""
extern "C" __global__ void lookup_propose(const long long* history, int stride, const long long* lengths,
                                          int shortest, int longest, int most, long long* proposals,
                                          bool* found) {
    const long long* h = history + (long long)blockIdx.x * stride;
    const long long last = lengths[blockIdx.x] - 1;
    const long long tail = h[last];
    long long best = -1;  // matched * 2^32 + end: the longest run, then the latest occurrence
    for (long long e = threadIdx.x; e < last; e += blockDim.x) {
        if (h[e] != tail) continue;
        int m = 1;
        while (m < longest && e - m >= 0 && h[e - m] == h[last - m]) ++m;
        if (m >= shortest) best = max(best, ((long long)m << 32) | e);
    }
    __shared__ long long part[32];
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffff, best, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        best = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : -1;
        for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffff, best, o));
        if (threadIdx.x == 0) part[0] = best;
    }
    __syncthreads();
    best = part[0];
    long long* out = proposals + (long long)blockIdx.x * most;
    if (best < 0) {
        for (int j = threadIdx.x; j < most; j += blockDim.x) out[j] = tail;
    } else {
        const long long end = best & 0xffffffffLL;
        const long long period = last - end;
        for (int j = threadIdx.x; j < most; j += blockDim.x) out[j] = h[end + 1 + j % period];
    }
    if (threadIdx.x == 0) found[blockIdx.x] = best >= 0;
}
"""

THREADS = 256


@locked_cache
def _kernel() -> Any:
    import cupy

    kernel = cupy.RawKernel(_SOURCE, "lookup_propose")
    kernel.compile()  # loaded here, under the lock, not at a first launch on some thread
    return kernel


def _lookup_gpu(history: Any, lengths: Any, shortest: int, longest: int, most: int) -> tuple[Any, Any]:
    import cupy

    s, c = history.shape
    assert history.dtype == cupy.int64 and history.flags.c_contiguous and c < 2**31
    proposals = cupy.empty((s, most), cupy.int64)
    found = cupy.empty(s, cupy.bool_)
    if s:
        lens = cupy.ascontiguousarray(lengths.astype(cupy.int64, copy=False))
        args = (history, np.int32(c), lens, np.int32(shortest), np.int32(longest), np.int32(most))
        _kernel()((s,), (THREADS,), (*args, proposals, found))
    return proposals, found


def prepare_gpu() -> None:
    """Compile the kernel now (a window decided on the device must not wait for NVRTC)."""
    _kernel()
