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
from strata_runtime.models.ops.adjust import PROMPT_SEEN, Adjusts

V, SLOTS = 64, 3


def _window(samplers: dict[int, Sampler], n: int, g: np.random.Generator) -> tuple[Adjusts, np.ndarray]:
    """A speculative window of n rows for each of these slots (its token, then n - 1 proposals), as
    `Job.adjusts` builds it, with the window's input ids."""
    fresh, counted, rows, extra_from, extra_count = [], [], [], [], []
    for i, (slot, s) in enumerate(samplers.items()):
        new, add = s.device_update()
        if new:
            fresh.append((slot, s.bias_ids, s.bias))
        counted += [(slot, t, c) for t, c in add.items()]
        for j in range(n):
            rows.append(i * n + j)
            extra_from.append(i * n + 1)
            extra_count.append(j)
    c = np.array(counted, np.int64).reshape(-1, 3)
    ps = [s.params for s in samplers.values()]
    adj = Adjusts(
        np.array(rows, np.int64),
        np.repeat(np.array(list(samplers), np.int64), n),
        np.repeat([p.frequency_penalty for p in ps], n),
        np.repeat([p.presence_penalty for p in ps], n),
        np.repeat([p.repetition_penalty for p in ps], n),
        np.array(extra_from, np.int64),
        np.array(extra_count, np.int32),
        np.full(len(rows), n == 1),
        tuple(fresh),
        (c[:, 0], c[:, 1], c[:, 2]),
    )
    return adj, g.integers(0, 8, len(rows))


def _params(g: np.random.Generator) -> SamplingParams:
    ids = g.choice(V, 3, replace=False)
    return SamplingParams(
        presence_penalty=float(g.uniform(-2, 2)),
        frequency_penalty=float(g.uniform(-2, 2)),
        logit_bias=tuple((int(t), float(g.uniform(-20, 20))) for t in ids),
        repetition_penalty=float(g.choice([1.0, g.uniform(0.5, 2.0)])),
    )


def _sampler(g: np.random.Generator, seed: int) -> Sampler:
    """A request with a bias and penalties, and a prompt of tokens the rows' counts and others: its tokens
    count as seen for its repetition penalty (where it has one)."""
    return Sampler(_params(g), seed=seed, prompt=[int(t) for t in g.integers(0, V, 12)])


def test_device_counts_adjust_rows_as_the_host_does_bit_for_bit() -> None:
    g = np.random.default_rng(11)
    counts = TokenCounts(Device.parse("cpu:0"), SLOTS, V)
    samplers = {s: _sampler(g, s) for s in range(SLOTS)}
    assert any(s.params.repetition_penalty != 1.0 for s in samplers.values())
    changed = 0
    for step in range(60):
        if step in (20, 41):  # slot 1 gets a new request: its counts and bias start again
            samplers[1] = _sampler(g, step)
        for s in samplers.values():  # tokens the host decided (a prompt's first, a verified window's)
            if g.random() < 0.3:
                s.record([int(t) for t in g.integers(0, 8, size=int(g.integers(1, 4)))])
        n = 1 if step % 3 else 4  # rows without proposals, or a speculative window's (repeats on purpose)
        adj, tokens = _window(samplers, n, g)
        logits = (g.standard_normal((SLOTS * n, V)) * 3).astype(np.float32)
        want = np.concatenate(
            [
                s.adjusted(logits[i * n : (i + 1) * n], [int(t) for t in tokens[i * n + 1 : (i + 1) * n]])
                for i, s in enumerate(samplers.values())
            ]
        )
        got = logits.copy()
        chosen_rows = counts.adjust(got, adj, tokens)
        assert np.array_equal(got.astype(np.float64), want)
        changed += int((got != logits).sum())
        if n == 1:  # the chosen tokens: few, so they repeat and the penalties grow
            assert chosen_rows is not None
            chosen = g.integers(0, 8, SLOTS)
            counts.count_chosen(*chosen_rows, chosen)
            for i, s in enumerate(samplers.values()):
                s.record([int(chosen[i])], counted=True)
        else:  # a speculative window counts what it keeps, not what each row chose
            assert chosen_rows is None
    assert changed > 1000
    for slot, s in samplers.items():  # the device's counts are the request's own
        want_counts = np.zeros(V, np.int64)
        for t, c in s.counts.items():
            want_counts[t] = c
        want_counts[s.seen] += PROMPT_SEEN  # the prompt's tokens, marked for the repetition penalty
        assert counts.counts is not None
        assert np.array_equal(counts.counts[slot], want_counts)
