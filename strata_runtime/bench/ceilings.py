"""The ceilings benchmarks are measured against: the byte roofline of a decode step and the FLOPs of a prompt.

A decode step at a few rows is bound by memory: it must read the weights of every layer (attention, router,
shared expert or dense MLP), the *distinct* routed experts its rows go to, the LM head and the KV, and it can
take no less than those bytes over the device-to-device copy bandwidth. Reading a prompt is bound by
compute: two FLOPs per active parameter per token, plus causal attention, over the fp16 matrix rate. The
arithmetic here is pure (a `ModelFacts` in, numbers out) so that it is tested on the CPU; the two rates are
measured with CuPy on the GPU in the same run as the figure they divide.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata_cfg.schema.facts import ModelFacts, expected_distinct_experts


def si(value: float, unit: str) -> str:
    """``value`` with the decimal prefix that suits it, 3 significant digits: ``6.11 GB``, ``1.46 ms``."""
    if value == 0:
        return f"0 {unit}"
    prefixes = (
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
        (1, ""),
        (1e-3, "m"),
        (1e-6, "µ"),
    )
    for scale, prefix in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value / 1e-9:.3g} n{unit}"


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step of ``rows`` rows must read, by part."""

    rows: int
    layers: int
    sparse_layers: int
    distinct_experts: float
    """Distinct routed experts per sparse layer."""
    positions: int
    """KV positions each row reads in each layer."""
    dense: int
    """Attention, norms, router and shared expert (or dense MLP) of every layer."""
    experts: int
    """The distinct routed experts of every sparse layer."""
    head: int
    """The final norm and the LM head."""
    kv: int
    """Keys and values each row reads, in every layer."""
    expert_bytes: int
    """One routed expert."""

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.head + self.kv

    def seconds(self, copy_bytes_per_s: float) -> float:
        """The roofline: the step cannot take less than its bytes over the copy bandwidth."""
        return self.total / copy_bytes_per_s

    def arithmetic(self, copy_bytes_per_s: float | None = None) -> str:
        """The sum written out, e.g. ``attention+router 48 x 38.3 MB = 1.84 GB; experts ...``."""
        parts = [
            f"attention+router {self.layers} x {si(self.dense / self.layers, 'B')} = {si(self.dense, 'B')}",
            f"experts {self.sparse_layers} x {self.distinct_experts:.1f} x {si(self.expert_bytes, 'B')} "
            f"= {si(self.experts, 'B')}",
            f"LM head {si(self.head, 'B')}",
            f"KV ({self.rows} row(s) x {self.positions} positions) {si(self.kv, 'B')}",
        ]
        text = f"{self.rows} row(s): " + "; ".join(parts) + f"; total {si(self.total, 'B')}"
        if copy_bytes_per_s:
            s = self.seconds(copy_bytes_per_s)
            text += f" / {si(copy_bytes_per_s, 'B/s')} = {si(s, 's')} per step ({self.rows / s:,.0f} rows/s)"
        return text


def decode_step_bytes(
    facts: ModelFacts,
    *,
    rows: int = 1,
    positions: int,
    kv_dtype: str = "float16",
    distinct_experts: float | None = None,
) -> StepBytes:
    """The bytes of one decode step over the whole model at ``rows`` rows, each reading ``positions`` of KV.

    ``distinct_experts`` (per sparse layer) defaults to what random routing gives
    (`expected_distinct_experts`); a benchmark that knows its routing passes the count it saw.
    """
    layers = facts.num_hidden_layers
    sparse = sum(facts.is_sparse(j) for j in range(layers))
    dense = sum(facts.layer_bytes(j)[0] for j in range(layers))
    if distinct_experts is None:
        distinct_experts = expected_distinct_experts(facts.num_experts, facts.num_experts_per_tok, rows)
    experts = round(sparse * distinct_experts * facts.expert_bytes())
    # The head is read every step even when it is tied to the embedding (then it is just not stored twice).
    head = (facts.vocab_size * facts.hidden_size + facts.hidden_size) * facts.weight_bytes
    kv = layers * rows * positions * facts.kv_bytes_per_token(kv_dtype)
    return StepBytes(
        rows=rows,
        layers=layers,
        sparse_layers=sparse,
        distinct_experts=float(distinct_experts),
        positions=positions,
        dense=dense,
        experts=experts,
        head=head,
        kv=kv,
        expert_bytes=facts.expert_bytes(),
    )


@dataclass(frozen=True)
class PromptFlops:
    """FLOPs per prompt token of reading an ``prompt_tokens``-token prompt, by part."""

    prompt_tokens: int
    weights: float
    """2 x the parameters each token multiplies: attention projections, router, its top-k experts, shared
    expert or dense MLP, in every layer."""
    attention: float
    """Causal attention (scores and weighted values) over the average context of the prompt."""
    head: float
    """The LM head, which only the prompt's last row runs, spread over the prompt's tokens."""

    @property
    def total(self) -> float:
        return self.weights + self.attention + self.head

    def arithmetic(self) -> str:
        return (
            f"{si(self.total, 'FLOP')} per token (weights {si(self.weights, 'FLOP')} + attention "
            f"{si(self.attention, 'FLOP')} at an average context of {(self.prompt_tokens + 1) / 2:.0f} + "
            f"LM head {si(self.head, 'FLOP')})"
        )


def prompt_flops(facts: ModelFacts, prompt_tokens: int) -> PromptFlops:
    """FLOPs per token of reading a prompt of ``prompt_tokens`` tokens (the KV it writes is not counted)."""
    h, hd = facts.hidden_size, facts.head_dim
    q, kv = facts.num_attention_heads * hd, facts.num_key_value_heads * hd
    attn_params = h * q + 2 * h * kv + q * h
    shared = 3 * h * facts.shared_expert_intermediate_size + h if facts.shared_expert_intermediate_size else 0
    params = 0
    for j in range(facts.num_hidden_layers):
        params += attn_params
        if facts.is_sparse(j):
            params += facts.num_experts * h + facts.num_experts_per_tok * 3 * h * facts.moe_intermediate_size
            params += shared
        else:
            params += 3 * h * facts.intermediate_size
    # Token i attends to i + 1 positions: on average (N + 1) / 2; q.k and p.v are 2 FLOPs each per element.
    avg_context = (prompt_tokens + 1) / 2
    attention = facts.num_hidden_layers * 2 * 2 * facts.num_attention_heads * hd * avg_context
    head = 2 * facts.vocab_size * h / prompt_tokens
    return PromptFlops(prompt_tokens, 2.0 * params, attention, head)


# ---- the two rates, measured on the GPU --------------------------------------------------------------


def _event_seconds(cp: Any, body: Any, reps: int) -> float:
    """Seconds per call of ``body()`` over ``reps`` calls, timed with CUDA events after one warm-up call."""
    body()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        body()
    stop.record()
    stop.synchronize()
    return float(cp.cuda.get_elapsed_time(start, stop)) / 1e3 / reps


def _copy_seconds(cp: Any, nbytes: int, reps: int) -> float:
    a = cp.empty(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    return _event_seconds(cp, lambda: cp.copyto(b, a), reps)


def _matmul_seconds(cp: Any, n: int, reps: int) -> float:
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    cp.matmul(a, b)  # the first product picks the cuBLAS kernel; later ones reuse its output block
    return _event_seconds(cp, lambda: cp.matmul(a, b), reps)


def copy_bandwidth(device_index: int, nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Device-to-device copy rate of GPU ``device_index`` in bytes/s, counting the read and the write."""
    import cupy as cp

    with cp.cuda.Device(device_index):
        s = _copy_seconds(cp, nbytes, reps)
        cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / s


def matrix_rate(device_index: int, n: int = 8192, reps: int = 10) -> float:
    """fp16 matrix-product rate of GPU ``device_index`` in FLOP/s: ``cupy.matmul`` of two n x n matrices."""
    import cupy as cp

    with cp.cuda.Device(device_index):
        s = _matmul_seconds(cp, n, reps)
        cp.get_default_memory_pool().free_all_blocks()
    return 2 * n**3 / s


def host_link_rate(device_index: int, nbytes: int = 1 << 28, reps: int = 10) -> float:
    """Host-to-device copy rate from pinned memory to GPU ``device_index`` in bytes/s: the rate an expert
    cache's swaps cross the host link at (its misses are read by kernels: `host_read_rate`)."""
    import cupy as cp

    with cp.cuda.Device(device_index):
        host = cp.cuda.alloc_pinned_memory(nbytes)
        src = np.frombuffer(host, np.uint8, nbytes)
        dst = cp.empty(nbytes, cp.uint8)
        s = _event_seconds(cp, functools.partial(dst.set, src), reps)
        dst = None
        cp.get_default_memory_pool().free_all_blocks()
    return nbytes / s


HOST_READ_SOURCE = r"""
extern "C" __global__ void host_read(const uint4* __restrict__ p, long long n16, float* out, int per_block) {
  // Block b reads its own contiguous span of per_block 16-byte words; 256 threads, 8 loads in flight each.
  long long base = (long long)blockIdx.x * per_block;
  float acc = 0.f;
  for (int i = threadIdx.x; i < per_block; i += 256 * 8) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      long long k = base + i + u * 256;
      v[u] = (i + u * 256 < per_block && k < n16) ? __ldg(p + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += __int_as_float(v[u].x ^ v[u].w);
  }
  if (acc == 1.2345f) out[0] = acc;  // never: keeps the loads
}
"""
HOST_READ_BLOCK_BYTES = 1 << 16
"""Bytes each block of ``host_read`` reads of one piece: 96 blocks for one expert's gate/up at the 30B
preset's widths (6.29 MB), about as many as the expert kernels give one expert at one row."""


class HostReads:
    """A pinned, mapped host region of ``nbytes`` (filled) and a kernel that reads it in place, as the expert
    kernels read an expert that holds no VRAM slot; CuPy on the current device. A context manager that frees
    the region."""

    def __init__(self, nbytes: int) -> None:
        import cupy as cp

        rt = cp.cuda.runtime
        self.cp, self.nbytes = cp, nbytes
        self.ptr = int(rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped))
        ctypes.memset(self.ptr, 1, nbytes)
        self.kernel = cp.RawKernel(HOST_READ_SOURCE, "host_read")
        self.out = cp.zeros(1, cp.float32)

    def __enter__(self) -> HostReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cp.cuda.runtime.freeHost(self.ptr)

    def read(self, base: int, size: int, blocks: int) -> None:
        """Read ``size`` bytes from host address ``base`` in one launch of ``blocks`` blocks."""
        n16 = size // 16
        self.kernel((blocks,), (256,), (base, np.int64(n16), self.out, np.int32(-(-n16 // blocks))))

    def pieces_rate(self, size: int, blocks: int, count: int, reps: int = 3) -> float:
        """Bytes/s of ``count`` pieces of ``size`` bytes read one after the other, a launch each over
        ``blocks`` blocks, as a one-row window's expert kernels read its misses."""
        assert count * size <= self.nbytes

        def pieces() -> None:
            for j in range(count):
                self.read(self.ptr + j * size, size, blocks)

        return count * size / _event_seconds(self.cp, pieces, reps)


def host_read_rate(device_index: int, piece: int, count: int = 48) -> float:
    """The rate in bytes/s at which kernels on GPU ``device_index`` read pinned host memory in place, as an
    expert cache's misses cross the host link: ``count`` pieces of ``piece`` bytes (an expert's gate/up) one
    after the other, a launch each. On an H100 about 90% of the copy engine's rate (`host_link_rate`)."""
    import cupy as cp

    size = -(-piece // 16) * 16
    with cp.cuda.Device(device_index), HostReads(count * size) as reads:
        return reads.pieces_rate(size, max(1, -(-size // HOST_READ_BLOCK_BYTES)), count)
