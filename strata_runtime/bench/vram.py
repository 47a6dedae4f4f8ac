"""``strata bench --workload vram``: device memory the engine really holds, against the plan's budget.

For every GPU of the plan it reads the driver's free memory (``cudaMemGetInfo``) before the engine is built,
after it is built, and after one request whose prompt fills the context has been read and decoded. What the
engine holds is the drop in free memory (so it includes the CUDA context, cuBLAS workspaces and CuPy's pool,
as a user's ``nvidia-smi`` would show). The plan's figure is everything its budget gives the GPU except
``free`` and ``reserve``: weights, KV, drafters, workspace and experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_cfg.schema.plan import MIB, LaunchPlan

from ..api import Request, SamplingParams

DECODED = 8
"""Tokens the full-context request generates, so that decode windows (and their graphs) run too."""


def _free_bytes(cp: Any, index: int) -> int:
    with cp.cuda.Device(index):
        cp.cuda.Device().synchronize()
        return int(cp.cuda.runtime.memGetInfo()[0])


class PoolPeaks:
    """The most bytes each device's CuPy pool has held (its cached free blocks included, which count
    against its cap), sampled whenever `sample` is called: between engine steps, where a prompt chunk's
    temporaries are still held."""

    def __init__(self, cp: Any, devices: list[int]) -> None:
        self.cp, self.peak = cp, dict.fromkeys(devices, 0)

    def sample(self) -> None:
        for i in self.peak:
            with self.cp.cuda.Device(i):
                self.peak[i] = max(self.peak[i], int(self.cp.get_default_memory_pool().total_bytes()))


def full_context_request(plan: LaunchPlan, seed: int = 0) -> Request:
    """A request whose prompt and generated tokens fill the plan's context: fresh ids within the vocab."""
    length = max(1, plan.memory.context - DECODED - 1)
    ids = np.random.default_rng(seed).integers(1, plan.model.facts.vocab_size, length)
    return Request(tuple(int(i) for i in ids), DECODED, SamplingParams(temperature=0.0), request_id="vram")


def run_vram(plan: LaunchPlan, devices: list[int]) -> dict[str, Any]:
    """Build the plan's engine and read what it holds on each of ``devices``; a JSON-able dict."""
    import cupy as cp

    from ..engine import Engine
    from ..weights.progress import stderr_progress

    before = {i: _free_bytes(cp, i) for i in devices}
    engine = Engine(plan, progress=stderr_progress)
    after_load = {i: _free_bytes(cp, i) for i in devices}
    request = full_context_request(plan)
    handle = engine.submit(request)
    peaks = PoolPeaks(cp, devices)
    peaks.sample()
    while engine.step():
        peaks.sample()
    peaks.sample()
    while not handle.events.empty():
        ev = handle.events.get()
        if ev.error:
            raise RuntimeError(f"the full-context request failed: {ev.error}")
    after_request = {i: _free_bytes(cp, i) for i in devices}
    gpus = []
    for g in plan.gpus:
        if g.index not in devices:
            continue
        planned = g.budget.total - g.budget.free - g.budget.reserve
        load = before[g.index] - after_load[g.index]
        full = before[g.index] - after_request[g.index]
        with cp.cuda.Device(g.index):
            pool = cp.get_default_memory_pool().total_bytes()
            pool_used = cp.get_default_memory_pool().used_bytes()
            cap = cp.get_default_memory_pool().get_limit()  # the engine's cap (0: none)
        gpus.append(
            {
                "device": g.device,
                "planned_mib": g.budget.mib(),
                "planned_in_use_mib": round(planned / MIB, 1),
                "after_load_mib": round(load / MIB, 1),
                "after_full_context_request_mib": round(full / MIB, 1),
                "pool_total_mib": round(pool / MIB, 1),
                "pool_used_mib": round(pool_used / MIB, 1),
                "pool_peak_mib": round(peaks.peak[g.index] / MIB, 1),
                "pool_cap_mib": round(cap / MIB, 1) if cap else None,
                "load_vs_plan": load / planned - 1 if planned else None,
                "full_context_vs_plan": full / planned - 1 if planned else None,
            }
        )
    return {
        "workload": "vram",
        "context": plan.memory.context,
        "prompt_tokens": len(request.prompt_ids),
        "generated_tokens": DECODED,
        "gpus": gpus,
    }


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _under(cap: float | None, peak: float) -> str:
    return "no cap" if cap is None else f"{cap - peak:,.0f}"


def render_vram(res: dict[str, Any]) -> str:
    lines = [
        f"vram: the drop in cudaMemGetInfo's free memory after building the engine, and after one request of "
        f"{res['prompt_tokens']} prompt tokens + {res['generated_tokens']} generated (context "
        f"{res['context']}), against the plan's budget less free and reserve; CuPy's pool at the end, in use "
        "then, and its most between engine steps, under the cap the engine sets (budget less reserve)",
        "",
    ]
    head = (
        f"{'device':<8} {'plan MiB':>10} {'after load':>11} {'vs plan':>8} "
        f"{'after request':>14} {'vs plan':>8} {'CuPy pool':>10} {'in use':>8} {'pool peak':>10} "
        f"{'under cap':>10}"
    )
    lines += [head, "-" * len(head)]
    for g in res["gpus"]:
        lines.append(
            f"{g['device']:<8} {g['planned_in_use_mib']:10,.0f} {g['after_load_mib']:11,.0f} "
            f"{_pct(g['load_vs_plan']):>8} {g['after_full_context_request_mib']:14,.0f} "
            f"{_pct(g['full_context_vs_plan']):>8} {g['pool_total_mib']:10,.0f} {g['pool_used_mib']:8,.0f} "
            f"{g['pool_peak_mib']:10,.0f} {_under(g['pool_cap_mib'], g['pool_peak_mib']):>10}"
        )
    for g in res["gpus"]:
        terms = " + ".join(
            f"{k} {v:,.1f}" for k, v in g["planned_mib"].items() if k not in ("total", "free", "reserve")
        )
        lines.append(f"{g['device']} plan: {terms} = {g['planned_in_use_mib']:,.1f} MiB")
    return "\n".join(lines)
