"""The vram workload's pool peaks and its table, on a stand-in for CuPy (the workload itself needs GPUs:
tests/test_cuda_pipeline.py)."""

from __future__ import annotations

import contextlib
import types

from strata_runtime.bench.vram import PoolPeaks, render_vram


def test_pool_peaks_keep_each_devices_most_between_samples():
    """Each device's peak is the most its own pool held at any sample, not the last or another device's."""
    held = {0: iter([5, 90, 20]), 1: iter([7, 3, 40])}
    current = {"device": 0}

    @contextlib.contextmanager
    def device(i: int):
        current["device"] = i
        yield

    cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=device),
        get_default_memory_pool=lambda: types.SimpleNamespace(
            total_bytes=lambda: next(held[current["device"]])
        ),
    )
    peaks = PoolPeaks(cp, [0, 1])
    for _ in range(3):
        peaks.sample()
    assert peaks.peak == {0: 90, 1: 40}


def test_the_table_shows_the_pool_peak_and_how_far_under_its_cap():
    g = {
        "device": "cuda:0",
        "planned_mib": {"total": 24576.0, "weights": 100.0, "free": 1.0, "reserve": 700.0},
        "planned_in_use_mib": 23875.0,
        "after_load_mib": 23000.0,
        "after_full_context_request_mib": 23500.0,
        "pool_total_mib": 23400.0,
        "pool_used_mib": 23300.0,
        "pool_peak_mib": 23666.0,
        "pool_cap_mib": 23876.0,
        "load_vs_plan": -0.04,
        "full_context_vs_plan": -0.02,
    }
    text = render_vram({"prompt_tokens": 8183, "generated_tokens": 8, "context": 8192, "gpus": [g]})
    row = next(line for line in text.splitlines() if line.startswith("cuda:0 "))
    assert row.split()[-2:] == ["23,666", "210"]
    uncapped = render_vram(
        {"prompt_tokens": 1, "generated_tokens": 8, "context": 16, "gpus": [{**g, "pool_cap_mib": None}]}
    )
    assert next(line for line in uncapped.splitlines() if line.startswith("cuda:0 ")).endswith("no cap")
