"""Step 6, placement: which layers each stage holds, and the auto split that balances them.

The auto split minimises the slowest stage's predicted decode-step time (bytes the step reads ÷ the GPU's
bandwidth; the last stage also reads the LM head and runs the MTP drafts), subject to every stage fitting its
GPU. A split that keeps every expert resident is preferred over one that needs an expert cache.

It runs on every keystroke in the TUI, so it is a bisection on the time bound with a greedy fill under each
bound (each stage takes as many layers as the bound and its VRAM allow, the last stage takes the rest), over
prefix sums: a few hundred O(1) checks, not a search over all splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from ..schema.facts import GpuFacts, ModelFacts
from . import sizes
from .sizes import StageShape

MIB = 1 << 20
_BISECT_STEPS = 60


@dataclass(frozen=True, slots=True)
class Sizing:
    """The resolved numbers that size a stage, fixed by steps 0 to 5."""

    context: int
    kv_dtype: str
    slots: int
    """KV slots (1 when batching is off)."""
    drafters: int
    """Slot drafters on the last stage."""
    with_mtp: bool
    """The last stage holds the MTP head."""
    mtp_passes: int
    """MTP head runs per decode step (chained solo proposals, or one per slot with batch MTP)."""
    prefill_chunk: int
    reserve_first: int
    """Bytes left free on the first stage's GPU."""
    reserve_later: int
    """Bytes left free on every other GPU."""
    cache: int | None
    """``experts.cache`` when the user gave a number; None for auto."""


@dataclass(frozen=True, slots=True)
class StageNeed:
    """A stage's bytes by purpose, without experts, and the routed experts it owns."""

    weights: int
    kv: int
    drafters: int
    workspace: int
    experts: int
    """Routed experts of its layers (count)."""


def stage_need(model: ModelFacts, shape: StageShape, sz: Sizing) -> StageNeed:
    """Bytes one stage needs by purpose (experts counted, not sized)."""
    return StageNeed(
        weights=sizes.weight_bytes(model, shape, with_mtp=sz.with_mtp),
        kv=sizes.kv_bytes(
            model, shape.end - shape.start, context=sz.context, kv_dtype=sz.kv_dtype, slots=sz.slots
        ),
        drafters=(
            sizes.drafter_bytes(model, context=sz.context, kv_dtype=sz.kv_dtype, drafters=sz.drafters)
            if shape.last
            else 0
        ),
        workspace=sizes.workspace_bytes(
            model, context=sz.context, prefill_chunk=sz.prefill_chunk, last=shape.last
        ),
        experts=sizes.expert_count(model, shape, with_mtp=sz.with_mtp),
    )


def stage_shapes(boundaries: Sequence[int], n_layers: int) -> list[StageShape]:
    """Boundaries ``[b1, b2, ...]`` -> stages [0, b1), [b1, b2), ..., [bk, n_layers)."""
    edges = [0, *boundaries, n_layers]
    last = len(edges) - 2
    return [StageShape(edges[i], edges[i + 1], i == 0, i == last) for i in range(last + 1)]


def faster_last(gpus: Sequence[GpuFacts]) -> list[GpuFacts]:
    """Order stage GPUs slowest first when their speeds differ by more than 5%, so the fastest runs the
    head and the drafters; equal speeds keep device order."""
    speeds = [g.bandwidth_gbs for g in gpus]
    if not speeds or max(speeds) <= 1.05 * min(speeds):
        return list(gpus)
    return sorted(gpus, key=lambda g: g.bandwidth_gbs)


def stage_times(
    model: ModelFacts, boundaries: Sequence[int], gpus: Sequence[GpuFacts], sz: Sizing
) -> list[float]:
    """Predicted decode-step time of each stage, in seconds (bytes read ÷ bandwidth)."""
    times = []
    for shape, gpu in zip(stage_shapes(boundaries, model.num_hidden_layers), gpus, strict=True):
        n = sum(
            sizes.layer_step_bytes(model, layer, context=sz.context, kv_dtype=sz.kv_dtype, slots=sz.slots)
            for layer in range(shape.start, shape.end)
        )
        if shape.last:
            n += _head_step(model, sz)
        times.append(n / (gpu.bandwidth_gbs * 1e9))
    return times


def _head_step(model: ModelFacts, sz: Sizing) -> int:
    return sizes.head_step_bytes(
        model, mtp_passes=sz.mtp_passes, context=sz.context, kv_dtype=sz.kv_dtype, drafters=sz.drafters
    )


class _Prefix:
    """Prefix sums over the layers, so that any stage's time and memory is O(1)."""

    def __init__(self, model: ModelFacts, sz: Sizing) -> None:
        n = model.num_hidden_layers
        kv_layer = sizes.kv_bytes(model, 1, context=sz.context, kv_dtype=sz.kv_dtype, slots=sz.slots)
        self.step = [
            0,
            *accumulate(
                sizes.layer_step_bytes(model, i, context=sz.context, kv_dtype=sz.kv_dtype, slots=sz.slots)
                for i in range(n)
            ),
        ]
        self.fixed = [0, *accumulate(model.layer_bytes(i)[0] + kv_layer for i in range(n))]
        self.experts = [0, *accumulate(model.layer_experts(i) for i in range(n))]
        self.n = n


def auto_split(model: ModelFacts, gpus: Sequence[GpuFacts], sz: Sizing) -> tuple[list[int], bool] | None:
    """Boundaries for ``len(gpus)`` stages in that order, and whether every expert is resident.

    None when no split fits. Stage 0 gets at least two layers, as a written split must.
    """
    s = len(gpus)
    pre = _Prefix(model, sz)
    last_shape = StageShape(0, 0, False, True)
    # Constant per-position extras, computed once.
    emb = model.embedding_bytes()
    last_fixed = (
        sizes.weight_bytes(model, last_shape, with_mtp=sz.with_mtp)
        + sizes.drafter_bytes(model, context=sz.context, kv_dtype=sz.kv_dtype, drafters=sz.drafters)
        + sizes.workspace_bytes(model, context=sz.context, prefill_chunk=sz.prefill_chunk, last=True)
    )
    mid_ws = sizes.workspace_bytes(model, context=sz.context, prefill_chunk=sz.prefill_chunk, last=False)
    mtp_experts = model.mtp_layers * model.num_experts if sz.with_mtp else 0
    head = _head_step(model, sz)
    eb = model.expert_bytes()

    def fits_fn(resident: bool) -> Callable[[int, int, int], bool]:
        def fits(i: int, a: int, b: int) -> bool:
            is_first, is_last = i == 0, i == s - 1
            need = pre.fixed[b] - pre.fixed[a]
            need += last_fixed if is_last else mid_ws
            if is_first:
                need += emb
            need += sz.reserve_first if is_first else sz.reserve_later
            n_exp = pre.experts[b] - pre.experts[a] + (mtp_experts if is_last else 0)
            if sz.cache is not None:
                n_exp = min(n_exp, sz.cache)
            elif not resident:
                n_exp = sizes.min_cache_experts(model, n_exp)
            return need + n_exp * eb <= gpus[i].vram_mib * MIB

        return fits

    def time(i: int, a: int, b: int) -> float:
        n = pre.step[b] - pre.step[a] + (head if i == s - 1 else 0)
        return n / gpus[i].bandwidth_gbs

    def fill(bound: float, fits: Callable[[int, int, int], bool]) -> list[int] | None:
        """Greedy: each stage but the last takes the most layers within ``bound`` and its VRAM."""
        bounds: list[int] = []
        a = 0
        for i in range(s - 1):
            lo = a + (2 if i == 0 else 1)
            hi = pre.n - (s - 1 - i)
            if lo > hi or not (time(i, a, lo) <= bound and fits(i, a, lo)):
                return None
            while lo < hi:  # largest b in [lo, hi] that passes; both checks rise with b
                mid = (lo + hi + 1) // 2
                if time(i, a, mid) <= bound and fits(i, a, mid):
                    lo = mid
                else:
                    hi = mid - 1
            bounds.append(lo)
            a = lo
        if time(s - 1, a, pre.n) <= bound and fits(s - 1, a, pre.n):
            return bounds
        return None

    for resident in (True, False):
        fits = fits_fn(resident)
        hi = max(time(i, 0, pre.n) for i in range(s)) * 2 + 1.0
        best = fill(hi, fits)
        if best is None:
            continue
        lo = 0.0
        for _ in range(_BISECT_STEPS):
            mid = (lo + hi) / 2
            found = fill(mid, fits)
            if found is None:
                lo = mid
            else:
                hi, best = mid, found
            if hi - lo <= hi * 1e-12:
                break
        return best, resident
    return None
