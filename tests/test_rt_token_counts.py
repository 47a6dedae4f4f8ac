"""The device's token counts and logit bias (`strata_runtime.model.adjust.TokenCounts`, on a CPU device
here; the CUDA kernels are compared with the same NumPy twins in test_cuda_kernels.py) against the host's
`Sampler.adjusted`: a penalised request's rows adjust to the same float32 values on either side, while
slots are reused by new requests and tokens arrive from both sides."""

from __future__ import annotations

import numpy as np

from strata_runtime.api import SamplingParams
from strata_runtime.backend import Device
from strata_runtime.engine.sampling import Sampler
from strata_runtime.model.adjust import TokenCounts
from strata_runtime.models.ops.adjust import Adjusts

V, SLOTS = 64, 3


def _window(samplers: dict[int, Sampler]) -> Adjusts:
    """One window with a row for each of these slots, as `Job.adjusts` builds it."""
    fresh, counted, rows = [], [], []
    for i, (slot, s) in enumerate(samplers.items()):
        new, add = s.device_update()
        if new:
            fresh.append((slot, s.bias_ids, s.bias))
        counted += [(slot, t, c) for t, c in add.items()]
        rows.append(i)
    c = np.array(counted, np.int64).reshape(-1, 3)
    ps = [s.params for s in samplers.values()]
    return Adjusts(
        np.array(rows, np.int64),
        np.array(list(samplers), np.int64),
        np.array([p.frequency_penalty for p in ps]),
        np.array([p.presence_penalty for p in ps]),
        tuple(fresh),
        (c[:, 0], c[:, 1], c[:, 2]),
    )


def _params(g: np.random.Generator) -> SamplingParams:
    ids = g.choice(V, 3, replace=False)
    return SamplingParams(
        presence_penalty=float(g.uniform(-2, 2)),
        frequency_penalty=float(g.uniform(-2, 2)),
        logit_bias=tuple((int(t), float(g.uniform(-20, 20))) for t in ids),
    )


def test_device_counts_adjust_rows_as_the_host_does_bit_for_bit() -> None:
    g = np.random.default_rng(11)
    counts = TokenCounts(Device.parse("cpu:0"), SLOTS, V)
    samplers = {s: Sampler(_params(g), seed=s) for s in range(SLOTS)}
    changed = 0
    for step in range(60):
        if step in (20, 41):  # slot 1 gets a new request: its counts and bias start again
            samplers[1] = Sampler(_params(g), seed=step)
        for s in samplers.values():  # tokens the host decided (a prompt's first, a verified window's)
            if g.random() < 0.3:
                s.record([int(t) for t in g.integers(0, 8, size=int(g.integers(1, 4)))])
        adj = _window(samplers)
        logits = (g.standard_normal((SLOTS, V)) * 3).astype(np.float32)
        want = np.stack([samplers[s].adjusted(logits[i : i + 1])[0] for i, s in enumerate(samplers)])
        got = logits.copy()
        rows, slot = counts.adjust(got, adj)
        assert np.array_equal(got.astype(np.float64), want)
        changed += int((got != logits).sum())
        chosen = g.integers(0, 8, SLOTS)  # few tokens: they repeat, and the penalties grow
        counts.count(rows, slot, chosen)
        for i, s in enumerate(samplers.values()):
            s.record([int(chosen[i])], counted=True)
    assert changed > 1000
    for slot, s in samplers.items():  # the device's counts are the request's own
        want_counts = np.zeros(V, np.int64)
        for t, c in s.counts.items():
            want_counts[t] = c
        assert counts.counts is not None
        assert np.array_equal(counts.counts[slot], want_counts)
