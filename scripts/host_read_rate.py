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


def main() -> None:
    rt = cp.cuda.runtime
    cpus = sorted(os.sched_getaffinity(0))
    print(f"CPUs {cpus[0]}..{cpus[-1]} ({len(cpus)})")
    kernel = cp.RawKernel(SOURCE, "rd")
    nbytes = 1 << 30
    ptr = int(rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped))
    try:
        ctypes.memset(ptr, 1, nbytes)
        dev = cp.empty(nbytes, cp.uint8)
        out = cp.zeros(1, cp.float32)
        stream = cp.cuda.get_current_stream().ptr
        ms = best_ms(lambda: rt.memcpyAsync(dev.data.ptr, ptr, nbytes, rt.memcpyHostToDevice, stream))
        print(f"copy engine, 1 GiB: {nbytes / ms / 1e6:.1f} GB/s")

        def read(base: int, size: int, blocks: int) -> None:
            n16 = size // 16
            kernel((blocks,), (256,), (base, np.int64(n16), out, np.int32(-(-n16 // blocks))))

        for blocks in (132, 528, 1056, 4096):
            ms = best_ms(functools.partial(read, ptr, nbytes, blocks))
            print(f"kernel, 1 GiB over {blocks} blocks: {nbytes / ms / 1e6:.1f} GB/s")
        for size, label, counts in (
            (2048 * 1536 * 2, "6.29 MB", (96, 192, 768)),
            (2048 * 768 * 2, "3.1 MB", (64, 256)),
        ):
            for blocks in counts:

                def pieces(s: int = size, b: int = blocks) -> None:
                    for j in range(48):
                        read(ptr + j * s, s, b)

                ms = best_ms(pieces, 3)
                rate, each = 48 * size / ms / 1e6, ms / 48 * 1000
                print(
                    f"kernel, 48 x {label}, a launch each, {blocks} blocks: {rate:.1f} GB/s ({each:.0f} us)"
                )
    finally:
        rt.freeHost(ptr)


if __name__ == "__main__":
    main()
