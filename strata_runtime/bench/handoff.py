"""``strata bench --workload handoff``: what handing a window's hidden rows to the next stage's GPU costs.

For each pair of consecutive stages on different GPUs, once with peer access enabled and once disabled, it
measures on the receiving GPU's stream with CUDA events:

* one copy of a window's hidden rows (``windows.handoff_rows`` rows of fp32 [R, H], what the engine hands
  over), of one row, and of a large buffer (256 MiB): µs per copy and GB/s;
* the hand-off as the engine queues it (an event on the sending stream, the receiving stream waiting for it,
  the peer copy, an event after it): the host's µs to queue it, and the µs from queuing to the copy's end as
  the host sees it.

Peer access is left enabled at the end, as the engine wants it. It needs CuPy and two GPUs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from strata_cfg.schema.plan import LaunchPlan

from ..backend import PEER_ACCESS_ALREADY_ENABLED

PEER_ACCESS_NOT_ENABLED = 705
"""cudaErrorPeerAccessNotEnabled: what disabling a pair that is not enabled answers."""
LARGE_BYTES = 256 << 20
REPEATS = {"small": 200, "large": 10}


def stage_pairs(plan: LaunchPlan) -> list[tuple[int, int]]:
    """(sending GPU, receiving GPU) of each hand-off between consecutive stages on different GPUs."""
    pairs = []
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        if a.device != b.device and a.device.startswith("cuda:") and b.device.startswith("cuda:"):
            pairs.append((a.gpu, b.gpu))
    return list(dict.fromkeys(pairs))


def set_peer_access(cp: Any, a: int, b: int, on: bool) -> None:
    """Enable or disable direct access between GPUs ``a`` and ``b``, both ways."""
    for x, y in ((a, b), (b, a)):
        with cp.cuda.Device(x):
            try:
                if on:
                    cp.cuda.runtime.deviceEnablePeerAccess(y)
                else:
                    cp.cuda.runtime.deviceDisablePeerAccess(y)
            except cp.cuda.runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) not in (PEER_ACCESS_ALREADY_ENABLED, PEER_ACCESS_NOT_ENABLED):
                    raise


class _Pair:
    """Buffers and streams for copies from GPU ``src`` to GPU ``dst``."""

    def __init__(self, cp: Any, src: int, dst: int, nbytes: int) -> None:
        self.cp, self.src, self.dst = cp, src, dst
        with cp.cuda.Device(src):
            self.send = cp.cuda.Stream(non_blocking=True)
            self.a = cp.ones(nbytes, cp.uint8)
        with cp.cuda.Device(dst):
            self.recv = cp.cuda.Stream(non_blocking=True)
            self.b = cp.empty(nbytes, cp.uint8)
            cp.cuda.Device().synchronize()

    def copy(self, nbytes: int) -> None:
        """One peer copy of ``nbytes`` on the receiving stream (the receiving GPU is current)."""
        self.cp.cuda.runtime.memcpyPeerAsync(
            self.b.data.ptr, self.dst, self.a.data.ptr, self.src, nbytes, self.recv.ptr
        )

    def copy_us(self, nbytes: int, reps: int) -> float:
        """µs per copy: CUDA events around ``reps`` copies on the receiving stream, after one warm-up."""
        cp = self.cp
        with cp.cuda.Device(self.dst):
            self.copy(nbytes)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.recv)
            for _ in range(reps):
                self.copy(nbytes)
            stop.record(self.recv)
            stop.synchronize()
            return float(cp.cuda.get_elapsed_time(start, stop)) * 1e3 / reps

    def handoff_us(self, nbytes: int, reps: int) -> tuple[float, float]:
        """(host µs to queue, µs until the host sees the copy done) of an event-chained hand-off, medians."""
        cp = self.cp
        queue, total = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            with cp.cuda.Device(self.src):
                ready = self.send.record(cp.cuda.Event(disable_timing=True))
            with cp.cuda.Device(self.dst):
                self.recv.wait_event(ready)
                self.copy(nbytes)
                done = self.recv.record(cp.cuda.Event(disable_timing=True))
            t1 = time.perf_counter()
            done.synchronize()
            t2 = time.perf_counter()
            queue.append((t1 - t0) * 1e6)
            total.append((t2 - t0) * 1e6)
        return statistics.median(queue[1:]), statistics.median(total[1:])


def _measure(pair: _Pair, sizes: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, nbytes in sizes.items():
        us = pair.copy_us(nbytes, REPEATS["large" if nbytes >= LARGE_BYTES else "small"])
        out[name] = {"bytes": nbytes, "us": us, "gb_s": nbytes / us / 1e3}
    queue, total = pair.handoff_us(sizes["window"], REPEATS["small"])
    out["chained"] = {"bytes": sizes["window"], "host_queue_us": queue, "until_done_us": total}
    return out


def run_handoff(plan: LaunchPlan) -> dict[str, Any]:
    """Every stage-to-stage hand-off of the plan, with and without peer access; a JSON-able dict."""
    pairs = stage_pairs(plan)
    if not pairs:
        raise ValueError("--workload handoff needs a split over two GPUs; the plan's stages share one")
    import cupy as cp

    hidden, rows = plan.model.facts.hidden_size, plan.windows.handoff_rows
    sizes = {"window": rows * hidden * 4, "row": hidden * 4, "large": LARGE_BYTES}
    results = []
    for src, dst in pairs:
        can = bool(cp.cuda.runtime.deviceCanAccessPeer(dst, src))
        pair = _Pair(cp, src, dst, LARGE_BYTES)
        entry: dict[str, Any] = {"src": f"cuda:{src}", "dst": f"cuda:{dst}", "peer_supported": can}
        try:
            for state in (True, False) if can else (False,):
                set_peer_access(cp, src, dst, state)
                entry["peer" if state else "no_peer"] = _measure(pair, sizes)
        finally:
            if can:
                set_peer_access(cp, src, dst, True)
        results.append(entry)
    return {"workload": "handoff", "hidden_size": hidden, "window_rows": rows, "pairs": results}


def render_handoff(res: dict[str, Any]) -> str:
    lines = [
        f"handoff: peer copies on the receiving GPU's stream (CUDA events); a window is "
        f"{res['window_rows']} rows x {res['hidden_size']} fp32; the chained hand-off is an event on the "
        "sending stream, a wait on the receiving one, the copy and an event",
        "",
    ]
    head = f"{'pair':<18} {'peer':<8} {'what':<10} {'bytes':>11} {'µs':>10} {'GB/s':>9}"
    lines += [head, "-" * len(head)]
    for p in res["pairs"]:
        name = f"{p['src']} -> {p['dst']}"
        for state in ("peer", "no_peer"):
            if state not in p:
                continue
            figures = p[state]
            for what in ("row", "window", "large"):
                f = figures[what]
                label = "on" if state == "peer" else "off"
                lines.append(
                    f"{name:<18} {label:<8} {what:<10} {f['bytes']:11,} {f['us']:10.1f} {f['gb_s']:9.1f}"
                )
            c = figures["chained"]
            lines.append(
                f"{name:<18} {'on' if state == 'peer' else 'off':<8} {'chained':<10} {c['bytes']:11,} "
                f"{c['until_done_us']:10.1f} {'':>9}  (host queues it in {c['host_queue_us']:.1f} µs)"
            )
        if not p["peer_supported"]:
            lines.append(f"{name}: peer access is not supported between these GPUs")
    return "\n".join(lines)
