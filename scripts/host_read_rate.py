"""How fast a GPU reads pinned, mapped host memory: the copy engine against kernels that read it in place,
as the expert kernels read an expert that holds no VRAM slot.

    python scripts/host_read_rate.py

Prints the host-to-device copy rate of 1 GiB, then the rate at which a kernel of 256-thread blocks, each
with eight 16-byte loads a thread in flight, reads the same memory: 1 GiB over 132 to 4,096 blocks, and 48
pieces one after the other, each read by its own launch, the size of one expert's gate/up (6.29 MB) and
down (3.1 MB) at the 30B preset's widths: the kernel and the measurement `strata bench` prices a cache's
misses by (`strata_runtime.bench.ceilings.HostReads`). Run it under ``taskset -c CPUS`` to place the pinned
pages on the NUMA node of those CPUs. Needs CuPy and a GPU. docs/PERFORMANCE.md's expert-cache section
quotes it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import cupy as cp

from strata_runtime.bench.ceilings import HostReads

EXPERT_PIECES = ((2048 * 1536 * 2, "6.29 MB", (96, 192, 768)), (2048 * 768 * 2, "3.1 MB", (64, 256)))
"""One expert's gate/up and down at the 30B preset's widths, and the block counts each is read over."""


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
                rate = reads.pieces_rate(size, blocks, 48)
                each = f"{size / rate * 1e6:.0f} us"
                print(f"kernel, 48 x {label}, a launch each, {blocks} blocks: {rate / 1e9:.1f} GB/s ({each})")


if __name__ == "__main__":
    main()
