"""Where one stream's decode time goes under an expert cache: the layers' graphs, the misses' bytes over the
host link inside them, the waits for rebalances' copies, and the work between two graphs.

    python scripts/cache_timeline.py PROFILE [--set KEY=VALUE ...] [--tokens 128]

Runs ``strata bench PROFILE --workload solo --arms solo --repeats 1 --tokens N``, its engine in this process
(where ``strata bench`` starts one of its own), with CUDA
events added around every decode window's layer graph (`strata_runtime.cuda.decode.CudaLayers.replay`),
around the compute stream's wait for each rebalance's copies
(`strata_runtime.cuda.experts.CudaExperts.apply`), and a note of every hand-over's misses; the engine's
code is wrapped, not changed. Then it splits the timed request's decode windows (those after its prompt; a
window is a token where the request does not draft) into:

* the layers' graphs, and of them the time the misses' bytes take at the rate kernels read pinned host memory
  (as the bench measures it before the engine starts, to price a cache's misses: one expert's gate/up after
  another, a launch each);
* the compute stream's waits for rebalances' copies;
* the rest between two graphs (the LM head, the token's choice, the next embedding).

Prints a table and writes it as JSON with ``--json FILE``. Needs CuPy and a GPU; a profile whose experts all
fit has nothing to split (no misses, no rebalances). docs/PERFORMANCE.md's expert-cache section quotes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import cupy as cp
import numpy as np

import strata_cfg.commands.bench as cfg_bench
from strata_cfg.cli import main as strata
from strata_runtime.__main__ import main as runtime
from strata_runtime.commands import bench as runtime_bench
from strata_runtime.cuda.decode import CudaLayers
from strata_runtime.cuda.experts import CudaExperts


@dataclass
class Trace:
    """Events and counts gathered while the bench runs."""

    windows: list[tuple[int, Any, Any]] = field(default_factory=list)
    """(the layers' id, event before their graph, event after it), in launch order."""
    waits: list[tuple[int, Any, Any]] = field(default_factory=list)
    """(the compute stream, event before a rebalance, event after its copies and tables)."""
    reads: list[tuple[int, int, int, bool]] = field(default_factory=list)
    """Each hand-over: (windows, misses, bytes an expert, whether a prompt chunk's)."""
    rates: dict[str, float] = field(default_factory=dict)
    """The rates the bench measured before its engine started (`measure_rates`)."""

    def install(self) -> None:
        """Wrap the three engine methods this trace reads, and the bench's measurement of its rates."""
        replay, apply, hand_over = CudaLayers.replay, CudaExperts.apply, CudaExperts._hand_over
        measure = runtime_bench.measure_rates
        trace = self

        def timed(events: list[tuple[int, Any, Any]], key: int, stream: Any, body: Any) -> None:
            before, after = cp.cuda.Event(), cp.cuda.Event()
            before.record(stream)
            body()
            after.record(stream)
            events.append((key, before, after))

        def replay_timed(self: CudaLayers, b: Any, body: Any) -> None:
            stream = cp.cuda.get_current_stream()
            timed(trace.windows, id(self), stream, lambda: replay(self, b, body))

        def apply_timed(self: CudaExperts, swaps: Any, stream: Any) -> None:
            timed(trace.waits, stream.ptr, stream, lambda: apply(self, swaps, stream))

        def hand_over_noted(self: CudaExperts, stream: Any) -> Any:
            away, helper, _ = self._read[1].sum(axis=0)  # misses, of them from a helper slot, experts kept
            noted = (self._read_windows, int(away - helper), self.store.expert_bytes, self._read_prompt)
            trace.reads.append(noted)
            return hand_over(self, stream)

        def measure_noted(workload: str, plans: Any) -> dict[str, float]:
            rates = measure(workload, plans)
            trace.rates.update(rates)
            return rates

        runtime_bench.measure_rates = measure_noted
        CudaLayers.replay = replay_timed  # type: ignore[method-assign]
        CudaExperts.apply = apply_timed  # type: ignore[method-assign]
        CudaExperts._hand_over = hand_over_noted  # type: ignore[method-assign]

    def split(self) -> dict[str, Any]:
        """The timed request's decode windows (those after the last prompt's hand-over) split as the module
        docstring says."""
        cp.cuda.Device().synchronize()
        prompts = [i for i, r in enumerate(self.reads) if r[3]]
        read_rate = self.rates.get("host_read_bytes_s")
        if not prompts or not self.windows or not read_rate:
            raise SystemExit("no expert cache at work: the profile's experts all fit, or nothing ran")
        after = self.reads[prompts[-1] + 1 :]
        count = sum(r[0] for r in after)
        miss_bytes = sum(r[1] * r[2] for r in after)
        by_layers: dict[int, list[tuple[Any, Any]]] = {}
        for layers, a, b in self.windows:
            by_layers.setdefault(layers, []).append((a, b))
        stage = max(by_layers.values(), key=len)  # the stage's layers, not the drafting head's
        decode = stage[-count:]
        first, last = decode[0][0], decode[-1][1]
        span = cp.cuda.get_elapsed_time(first, last)
        graphs = sum(cp.cuda.get_elapsed_time(a, b) for a, b in decode)
        waits = sum(
            cp.cuda.get_elapsed_time(a, b)
            for _, a, b in self.waits
            if 0 <= cp.cuda.get_elapsed_time(first, a) <= span
        )
        link = miss_bytes / read_rate * 1e3
        n = len(decode)
        rows = {
            "the layers' graphs": graphs,
            "of them, the misses' bytes at the kernels' host read rate": link,
            "of them, the rest of the layers": graphs - link,
            "waiting for rebalances' copies": waits,
            "between graphs: LM head, the token's choice, the next embedding": span - graphs - waits,
        }
        return {
            "windows": n,
            "ms_per_window": span / n,
            "graph_ms_median": float(np.median([cp.cuda.get_elapsed_time(a, b) for a, b in decode])),
            "miss_mb_per_window": miss_bytes / count / 1e6,
            "kernel_read_gbs": read_rate / 1e9,
            "ms_per_window_by_part": {k: v / n for k, v in rows.items()},
            "share_by_part": {k: v / span for k, v in rows.items()},
        }


def in_this_process(argv: list[str], check: bool = False) -> subprocess.CompletedProcess[bytes]:
    """``strata bench`` starts the engine as ``python -m strata_runtime bench ...``; run it in this process
    instead, where the trace's wrappers are."""
    assert argv[1:3] == ["-m", "strata_runtime"], argv
    return subprocess.CompletedProcess(argv, runtime(argv[3:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as strata bench --set")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", metavar="FILE", help="also write the split as JSON")
    args = ap.parse_args()
    trace = Trace()
    trace.install()
    sets = [x for kv in args.set for x in ("--set", kv)]
    bench = ["bench", args.profile, *sets, "--workload", "solo", "--arms", "solo", "--repeats", "1"]
    t0 = time.perf_counter()
    with mock.patch.object(cfg_bench.subprocess, "run", in_this_process):
        code = strata([*bench, "--tokens", str(args.tokens)])
    if code:
        raise SystemExit(code)
    out = trace.split()
    print(
        f"\nkernels read pinned host memory at {out['kernel_read_gbs']:.1f} GB/s (the bench's measurement); "
        f"{out['windows']} decode windows of the timed request ({time.perf_counter() - t0:.0f} s in all): "
        f"{out['ms_per_window']:.2f} ms a window, graphs {out['graph_ms_median']:.2f} ms (median), "
        f"{out['miss_mb_per_window']:.1f} MB of misses a window"
    )
    print("| where the time goes | ms a window | share |\n| --- | ---: | ---: |")
    for part, ms in out["ms_per_window_by_part"].items():
        print(f"| {part} | {ms:.2f} | {100 * out['share_by_part'][part]:.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
