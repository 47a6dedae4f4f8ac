"""Step 6, placement: which layers each stage holds, and the auto split that balances them.

The auto split minimises the slowest stage's predicted decode-step time (bytes the step reads ÷ the GPU's
bandwidth; the last stage also reads the LM head and runs the MTP drafts), subject to every stage fitting its
GPU. A split that keeps every expert resident is preferred over one that needs an expert cache.

It runs on every keystroke in the TUI, so it is an exact dynamic programme over prefix sums (every stage's
time and VRAM is O(1)) that stops scanning a stage's start as soon as the stage alone is no better than the
best split found: a few thousand checks for 48 layers, not a search over all splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from ..schema.facts import GpuFacts, ModelFacts
from . import sizes
from .sizes import StageShape

MIB = 1 << 20


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
    prefill_chunk_alone: int
    """Rows of a lone prompt's prefill window (at least ``prefill_chunk``)."""
    reserve_first: int
    """Bytes left free on the first stage's GPU."""
    reserve_later: int
    """Bytes left free on every other GPU."""
    cache: int | None
    """``experts.cache`` when the user gave a number; None for auto."""
    stores_scores: bool
    """Prompt attention stores a tile of scores, which the workspace counts (`sizes.stores_attention_scores`:
    not where a GPU reads prompts through the fused kernel)."""
    prefill_graph_rows: int = 0
    """Rows of a prefill graph's temporaries, kept (``memory.prefill_graph_rows``)."""
    attention_tc: bool = False
    """Decode attention runs on tensor cores (``model.decode_attention``), whose scratch holds fewer partial
    results a row and head (`sizes.decode_attention_scratch_bytes`)."""
    gpu: bool = False
    """The stages run on GPUs (``machine.backend = "cuda"``), whose prefill path the workspace counts
    (`sizes.gpu_prefill_bytes`); else on virtual CPU devices, through the array path
    (`sizes.row_activation_bytes`)."""
    lookup: bool = False
    """The solo path drafts by n-gram lookup: the last stage keeps each slot's token history
    (`sizes.lookup_history_bytes`)."""
    int8_draft_head: bool = False
    """The MTP head drafts through an 8-bit copy of the LM head, which the last stage holds
    (``spec.draft_head = "int8"``, `ModelFacts.int8_head_bytes`)."""

    @property
    def prefill_rows(self) -> int:
        """The most rows a prefill window can hold with its workspace: a chunk beside a decode window, or a
        lone prompt's longer chunk."""
        return sizes.prefill_rows(self.prefill_chunk, self.prefill_chunk_alone)

    def workspace(self, model: ModelFacts, last: bool) -> int:
        """A stage's workspace (the sum of `workspace_parts`): on the last stage the MTP head's prefill path
        beside its own where it drafts."""
        return sum(self.workspace_parts(model, last).values())

    def workspace_parts(self, model: ModelFacts, last: bool) -> dict[str, int]:
        """`workspace` by part (`sizes.workspace_parts`)."""
        return sizes.workspace_parts(
            model,
            context=self.context,
            prefill_rows=self.prefill_rows,
            last=last,
            stores_scores=self.stores_scores,
            slots=self.slots if last else 0,
            graph_rows=self.prefill_graph_rows,
            gpu=self.gpu,
            mtp=self.with_mtp,
            attention_tc=self.attention_tc,
            lookup=self.lookup,
        )


@dataclass(frozen=True, slots=True)
class StageNeed:
    """A stage's bytes by purpose, without experts, and the routed experts it owns."""

    weights: int
    kv: int
    drafters: int
    experts: int
    """Routed experts of its layers (count)."""
    workspace_parts: tuple[tuple[str, int], ...] = ()
    """The workspace by part (`sizes.workspace_parts`)."""

    @property
    def workspace(self) -> int:
        """Bytes of workspace: its parts added up."""
        return sum(b for _, b in self.workspace_parts)


def stage_need(model: ModelFacts, shape: StageShape, sz: Sizing) -> StageNeed:
    """Bytes one stage needs by purpose (experts counted, not sized)."""
    parts = sz.workspace_parts(model, shape.last)
    return StageNeed(
        weights=sizes.weight_bytes(model, shape, with_mtp=sz.with_mtp, int8_head=sz.int8_draft_head),
        kv=sizes.kv_bytes(
            model, shape.end - shape.start, context=sz.context, kv_dtype=sz.kv_dtype, slots=sz.slots
        ),
        drafters=(
            sizes.drafter_bytes(model, context=sz.context, kv_dtype=sz.kv_dtype, drafters=sz.drafters)
            if shape.last
            else 0
        ),
        experts=sizes.expert_count(model, shape, with_mtp=sz.with_mtp),
        workspace_parts=tuple(parts.items()),
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


Cost = tuple[float, int]
"""A stage's (predicted time, layer count). Comparing these orders by time, then by size, so the smallest
maximum is the fastest split, and among equally fast ones the one whose slowest stage is smaller."""
_NONE: Cost = (float("inf"), 0)


@dataclass(frozen=True, slots=True)
class _Limits:
    """One stage position's constants, so that its time and fit over [a, b) are a few additions."""

    seconds_per_byte: float
    extra_bytes_read: int
    """The LM head and MTP passes on the last stage."""
    room: int
    """VRAM left for its layers and experts after embedding/head/drafters/workspace/reserve."""
    extra_experts: int
    """The MTP layers' experts on the last stage."""
    expert_cap: float
    """At most this many experts need VRAM (all of them when resident; the smallest cache otherwise)."""


def _proportional(pre: _Prefix, limits: Sequence[_Limits]) -> list[int] | None:
    """A quick first guess: boundaries that give each stage a share of the bytes read in proportion to its
    GPU's speed. Only used to bound the exact search."""
    s, n = len(limits), pre.n
    speed = [1 / lim.seconds_per_byte for lim in limits]
    total, acc = sum(speed), 0.0
    bounds: list[int] = []
    for i in range(s - 1):
        acc += speed[i]
        target = pre.step[n] * acc / total
        b = next((b for b in range(n + 1) if pre.step[b] >= target), n)
        lo = (bounds[-1] + 1) if bounds else 2
        bounds.append(min(max(b, lo), n - (s - 1 - i)))
    return bounds if all(x < y for x, y in zip([0, *bounds], [*bounds, n], strict=True)) else None


def _cost_of(pre: _Prefix, limits: Sequence[_Limits], expert_bytes: int, bounds: list[int]) -> Cost:
    """The slowest stage of a given split, or `_NONE` when a stage does not fit."""
    edges = [0, *bounds, pre.n]
    worst = (0.0, 0)
    for lim, a, b in zip(limits, edges, edges[1:], strict=False):
        n_exp = min(pre.experts[b] - pre.experts[a] + lim.extra_experts, lim.expert_cap)
        if pre.fixed[b] - pre.fixed[a] + n_exp * expert_bytes > lim.room:
            return _NONE
        worst = max(worst, ((pre.step[b] - pre.step[a] + lim.extra_bytes_read) * lim.seconds_per_byte, b - a))
    return worst


def _min_slowest(
    pre: _Prefix, limits: Sequence[_Limits], expert_bytes: int, bound: Cost = _NONE
) -> list[int] | None:
    """Exact bottleneck DP: boundaries for the stages over the layers that minimise the slowest stage.

    best[b] is the best slowest-stage cost of covering layers [0, b) with the stages so far. Stage i takes
    [a, b); scanning a downward from b - 1, the stage only gets slower and bigger, so the scan stops as soon
    as the stage alone is no better than the best found; it never goes below the lowest start that fits
    (found once per end, since it only rises) nor below where an earlier stage can end. Costs above
    ``bound`` (a split known to fit) are dropped early. Stage 0 holds at least two layers.
    """
    s, n = len(limits), pre.n
    step, fixed, experts = pre.step, pre.fixed, pre.experts

    def fits(lim: _Limits, a: int, b: int) -> bool:
        n_exp = min(experts[b] - experts[a] + lim.extra_experts, lim.expert_cap)
        return fixed[b] - fixed[a] + n_exp * expert_bytes <= lim.room

    best = [_NONE] * (n + 1)
    lim = limits[0]
    for b in range(2, n - (s - 1) + 1):
        if not fits(lim, 0, b):
            break  # bigger stages need more VRAM
        cost = ((step[b] + lim.extra_bytes_read) * lim.seconds_per_byte, b)
        if cost > bound:
            break  # and every bigger first stage is slower still
        best[b] = cost
    choice: list[list[int]] = [[-1] * (n + 1) for _ in range(s)]
    for i in range(1, s):
        lim = limits[i]
        reach = [a for a in range(n + 1) if best[a] is not _NONE]
        if not reach:
            return None
        first_a, last_a = reach[0], reach[-1]
        nxt = [_NONE] * (n + 1)
        ends = [n] if i == s - 1 else range(first_a + 1, n - (s - 1 - i) + 1)
        lowest = first_a  # the lowest start that fits with this end; it only rises as the end does
        for b in ends:
            while lowest < b and not fits(lim, lowest, b):
                lowest += 1
            top, where = _NONE, -1
            for a in range(min(b - 1, last_a), max(first_a, lowest) - 1, -1):
                stage = ((step[b] - step[a] + lim.extra_bytes_read) * lim.seconds_per_byte, b - a)
                if stage >= top or stage > bound:
                    break
                before = best[a]
                cost = before if before > stage else stage
                if cost < top:
                    top, where = cost, a
            if top <= bound:
                nxt[b], choice[i][b] = top, where
        best = nxt
    if best[n] is _NONE:
        return None
    bounds, b = [], n
    for i in range(s - 1, 0, -1):
        b = choice[i][b]
        bounds.append(b)
    return bounds[::-1]


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
        sizes.weight_bytes(model, last_shape, with_mtp=sz.with_mtp, int8_head=sz.int8_draft_head)
        + sizes.drafter_bytes(model, context=sz.context, kv_dtype=sz.kv_dtype, drafters=sz.drafters)
        + sz.workspace(model, True)
    )
    mid_ws = sz.workspace(model, False)
    mtp_experts = model.mtp_layers * model.num_experts if sz.with_mtp else 0
    head = _head_step(model, sz)
    eb = model.expert_bytes()

    def limits(resident: bool) -> list[_Limits]:
        out = []
        for i, gpu in enumerate(gpus):
            first, last = i == 0, i == s - 1
            extras = (last_fixed if last else mid_ws) + (emb if first else 0)
            extras += sz.reserve_first if first else sz.reserve_later
            cap: float = float("inf") if resident else sizes.min_cache_experts(model, model.num_experts)
            if sz.cache is not None:
                cap = min(cap, sz.cache)
            out.append(
                _Limits(
                    seconds_per_byte=1 / (gpu.bandwidth_gbs * 1e9),
                    extra_bytes_read=head if last else 0,
                    room=gpu.vram_mib * MIB - extras,
                    extra_experts=mtp_experts if last else 0,
                    expert_cap=cap,
                )
            )
        return out

    for resident in (True, False):
        lims = limits(resident)
        guess = _proportional(pre, lims)
        bound = _cost_of(pre, lims, eb, guess) if guess is not None else _NONE
        found = _min_slowest(pre, lims, eb, bound)
        if found is not None:
            return found, resident
    return None
