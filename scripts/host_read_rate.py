"""How fast a GPU reads pinned, mapped host memory: the copy engine against kernels that read it in place,
as the expert kernels read an expert that holds no VRAM slot.

    python scripts/host_read_rate.py

Prints the host-to-device copy rate of 1 GiB, then the rate at which a kernel of 256-thread blocks, each
with eight 16-byte loads a thread in flight, reads the same memory: 1 GiB over 132 to 4,096 blocks, and 48
pieces one after the other, each read by its own launch, the size of one expert's gate/up (6.29 MB) and
down (3.1 MB) at the 30B preset's widths. Run it under ``taskset -c CPUS`` to place the pinned pages on the
NUMA node of those CPUs. Needs CuPy and a GPU. docs/PERFORMANCE.md's expert-cache section quotes it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import cupy as cp
import numpy as np

SOURCE = r"""
extern "C" __global__ void rd(const uint4* __restrict__ p, long long n16, float* out, int per_block) {
  // block b reads its own contiguous span of per_block uint4s; 256 threads, 8 loads in flight each
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
  if (acc == 1.2345f) out[0] = acc;
}
"""


def best_ms(body: Callable[[], object], reps: int = 5) -> float:
    """The fastest of ``reps`` timed calls of ``body()`` (CUDA events), after one untimed call."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    body()
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(reps):
        start.record()
        body()
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop))
    return best


EXPERT_PIECES = ((2048 * 1536 * 2, "6.29 MB", (96, 192, 768)), (2048 * 768 * 2, "3.1 MB", (64, 256)))
"""One expert's gate/up and down at the 30B preset's widths, and the block counts each is read over."""


class HostReads:
    """A pinned, mapped host region of ``nbytes`` and the kernel that reads it in place (a context manager
    that frees the region)."""

    def __init__(self, nbytes: int) -> None:
        rt = cp.cuda.runtime
        self.nbytes = nbytes
        self.ptr = int(rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped))
        ctypes.memset(self.ptr, 1, nbytes)
        self.kernel = cp.RawKernel(SOURCE, "rd")
        self.out = cp.zeros(1, cp.float32)

    def __enter__(self) -> HostReads:
        return self

    def __exit__(self, *exc: object) -> None:
        cp.cuda.runtime.freeHost(self.ptr)

    def read(self, base: int, size: int, blocks: int) -> None:
        """Read ``size`` bytes from host address ``base`` in a kernel of ``blocks`` blocks."""
        n16 = size // 16
        self.kernel((blocks,), (256,), (base, np.int64(n16), self.out, np.int32(-(-n16 // blocks))))

    def pieces_rate(self, size: int, blocks: int, count: int = 48) -> float:
        """Bytes/s of ``count`` pieces of ``size`` bytes read one after the other, a launch each over
        ``blocks`` blocks: as a one-row window's expert kernels read its misses."""
        assert count * size <= self.nbytes

        def pieces() -> None:
            for j in range(count):
                self.read(self.ptr + j * size, size, blocks)

        return count * size / best_ms(pieces, 3) * 1e3


def expert_read_rate() -> float:
    """Bytes/s at which kernels read one expert's gate/up after another from pinned host memory (48 of
    them, 96 blocks each): the rate a one-row window's misses cross the host link at."""
    size, _, (blocks, *_) = EXPERT_PIECES[0]
    with HostReads(48 * size) as reads:
        return reads.pieces_rate(size, blocks)


def main() -> None:
    rt = cp.cuda.runtime
    cpus = sorted(os.sched_getaffinity(0))
    print(f"CPUs {cpus[0]}..{cpus[-1]} ({len(cpus)})")
    nbytes = 1 << 30
    with HostReads(nbytes) as reads:
        dev = cp.empty(nbytes, cp.uint8)
        stream = cp.cuda.get_current_stream().ptr
        ms = best_ms(lambda: rt.memcpyAsync(dev.data.ptr, reads.ptr, nbytes, rt.memcpyHostToDevice, stream))
        print(f"copy engine, 1 GiB: {nbytes / ms / 1e6:.1f} GB/s")
        for blocks in (132, 528, 1056, 4096):
            ms = best_ms(functools.partial(reads.read, reads.ptr, nbytes, blocks))
            print(f"kernel, 1 GiB over {blocks} blocks: {nbytes / ms / 1e6:.1f} GB/s")
        for size, label, counts in EXPERT_PIECES:
            for blocks in counts:
                rate = reads.pieces_rate(size, blocks)
                each = f"{size / rate * 1e6:.0f} us"
                print(f"kernel, 48 x {label}, a launch each, {blocks} blocks: {rate / 1e9:.1f} GB/s ({each})")


if __name__ == "__main__":
    main()
