"""Step 8: how a short prompt is read on a GPU, as 8-row decode graph windows or through the prefill path.

A prompt chunk of at most ``memory.prompt_graph_rows`` rows runs through the decode path's CUDA graphs in
windows of 8 rows; a longer one takes the prefill path (cuBLAS products and grouped expert kernels). A graph
window costs its bytes: each layer's weights and the distinct experts its 8 rows route to. The prefill path
reads each distinct expert once for the whole chunk, but its launches are queued from Python, layer by
layer, and for a short chunk that host time is the whole cost: about 0.45 ms a layer whatever the rows up
to 64. So graph windows pay while a few of them take less than the prefill path's launches; for the 30B
preset on an H200 that is 2 windows (16 rows), for the 235B preset one, for the small presets all 8.

``auto`` (the default) sets the rows from that estimate; a number sets them outright.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..schema.facts import ModelFacts, expected_distinct_experts
from ..schema.windows import (
    MAX_WINDOW_ROWS,
    PREFILL_GRAPH_AUTO_ROWS,
    PROMPT_GRAPH_MAX,
    prefill_graph_rows_for,
)
from .ledger import Ledger
from .sizes import StageShape, row_activation_bytes

RULE = "windows.prompt-graph-rows"
KEY = "memory.prompt_graph_rows"

PREFILL_LAUNCH_MS_PER_LAYER = 0.45
"""Host time the prefill path takes to queue one layer of a short prompt chunk: 21.4-21.7 ms for the 30B
preset's 48 layers and its MTP head's layer on an H200 machine, the same from 16 to 32 rows (it is Python's
time, so it follows the host's CPU: 17.7 ms on a faster one, before the chunk's temporaries were kept)."""
GRAPH_WINDOW_EFFICIENCY = 0.7
"""The share of its byte roofline an 8-row decode graph window reaches (70-74% measured for the 30B preset
on an H200; one 8-row window of its prompt took about 7.7 ms)."""


@dataclass(frozen=True, slots=True)
class PromptCosts:
    """What reading a short prompt chunk costs each way, in ms."""

    window_ms: float
    """One 8-row graph window through every layer (and the MTP head's, when it drafts)."""
    prefill_ms: float
    """The prefill path's launches for a chunk through the same layers."""
    layers: int
    distinct_experts: float
    """Distinct experts an 8-row window's rows route to in a sparse layer (uniform routing)."""

    def graph_rows(self) -> int:
        """The most rows whose graph windows cost no more than the prefill path's launches: a multiple of
        8 from 8 to `PROMPT_GRAPH_MAX`."""
        windows = math.floor(self.prefill_ms / self.window_ms) if self.window_ms > 0 else PROMPT_GRAPH_MAX
        return min(max(windows, 1) * MAX_WINDOW_ROWS, PROMPT_GRAPH_MAX)


def prompt_costs(
    model: ModelFacts, stages: Sequence[tuple[StageShape, float]], drafting: bool
) -> PromptCosts:
    """The costs for ``model`` over ``stages`` (each stage's layers and its GPU's bandwidth in GB/s); with
    ``drafting``, the MTP head's layers on the last stage's GPU too."""
    distinct = expected_distinct_experts(model.num_experts, model.num_experts_per_tok, MAX_WINDOW_ROWS)
    seconds, layers = 0.0, 0
    for shape, gbs in stages:
        rate = gbs * 1e9 * GRAPH_WINDOW_EFFICIENCY
        for layer in range(shape.start, shape.end):
            dense, _ = model.layer_bytes(layer)
            experts = distinct * model.expert_bytes() if model.is_sparse(layer) else 0.0
            seconds += (dense + experts) / rate
            layers += 1
    if drafting and model.has_mtp and stages:
        dense, _ = model.mtp_bytes()
        experts = model.mtp_layers * distinct * model.expert_bytes() if model.num_experts else 0.0
        seconds += (dense + experts) / (stages[-1][1] * 1e9 * GRAPH_WINDOW_EFFICIENCY)
        layers += model.mtp_layers
    return PromptCosts(seconds * 1e3, layers * PREFILL_LAUNCH_MS_PER_LAYER, layers, distinct)


def resolve_prompt_graph_rows(
    led: Ledger, model: ModelFacts, stages: Sequence[tuple[StageShape, float]], all_experts_resident: bool
) -> int:
    """Resolve ``memory.prompt_graph_rows``: what the profile says, else (``auto``) `PROMPT_GRAPH_MAX` on
    virtual CPU devices (no prefill path) and under an expert cache (a chunk through the prefill path
    copies each expert held in host memory to the GPU, where a graph window reads it in place), else the
    estimate of `prompt_costs`, with a note where it sends prompts of fewer rows than that to the prefill
    path."""
    if led[KEY] != "auto":
        return int(led[KEY])
    if led["machine.backend"] != "cuda" or not all_experts_resident:
        led.resolve_auto(KEY, PROMPT_GRAPH_MAX, RULE)
        return PROMPT_GRAPH_MAX
    costs = prompt_costs(model, stages, drafting=led["spec.draft_tokens"] >= 2)
    rows = costs.graph_rows()
    message = None
    if rows < PROMPT_GRAPH_MAX:
        windows = rows // MAX_WINDOW_ROWS
        message = (
            f"prompt chunks of up to {rows} rows run as 8-row graph windows, longer ones through the prefill "
            f"path: {windows} window{'s' if windows > 1 else ''} of about {costs.window_ms:.1f} ms"
            f"{' each' if windows > 1 else ''} (the weights and {costs.distinct_experts:.0f} "
            f"distinct experts a layer at {GRAPH_WINDOW_EFFICIENCY:.0%} of the GPUs' bandwidth) against "
            f"about {costs.prefill_ms:.0f} ms of the prefill path's launches ({costs.layers} layers)"
        )
    led.resolve_auto(KEY, rows, RULE, message)
    return rows


GRAPHS_RULE = "memory.prefill-graph-rows"
GRAPHS_KEY = "memory.prefill_graph_rows"
GRAPHS_CACHED_RULE = "windows.prefill-graphs-cached"
GRAPHS_SOME_CACHED_RULE = "windows.prefill-graphs-some-cached"


def resolve_prefill_graph_rows(led: Ledger, model: ModelFacts) -> int:
    """Resolve ``memory.prefill_graph_rows`` with the other defaults (step 0, before the workspace is
    planned): what the profile says, else (``auto``) 0 on virtual CPU devices, which have no prefill path,
    and on a GPU `PREFILL_GRAPH_AUTO_ROWS`, or the graph of the longest chunk where that is smaller, with a
    note of the workspace its temporaries keep."""
    if led[GRAPHS_KEY] != "auto":
        return int(led[GRAPHS_KEY])
    if led["machine.backend"] != "cuda":
        led.resolve_auto(GRAPHS_KEY, 0, GRAPHS_RULE)
        return 0
    longest = max(led["memory.prefill_chunk"], led["memory.prefill_chunk_alone"])
    rows = min(PREFILL_GRAPH_AUTO_ROWS, prefill_graph_rows_for(longest))
    mib = rows * row_activation_bytes(model) / (1 << 20)
    message = (
        f"prompt chunks through the prefill path replay CUDA graphs up to {rows} rows (each padded to a "
        f"power of two, at least 16), so the host does not launch their kernels one by one; their "
        f"temporaries keep {mib:.1f} MiB of workspace a stage (and as much for a drafting MTP head)"
    )
    led.resolve_auto(GRAPHS_KEY, rows, GRAPHS_RULE, message)
    return rows


def prefill_graphs_gate(led: Ledger, cached_gpus: Sequence[int], stage_gpus: int) -> None:
    """Step 8: a stage under an expert cache launches its prompt chunks layer by layer, since a chunk copies
    the experts held in host memory as it reaches them (the budget kept no graph workspace on its GPU).
    ``cached_gpus``: the stage GPUs that hold an expert cache, of ``stage_gpus``. Where every stage does,
    the plan's value becomes 0."""
    rows = led[GRAPHS_KEY]
    if not rows or not cached_gpus:
        return
    why = "a chunk copies the experts held in host memory as it reaches them"
    if len(cached_gpus) == stage_gpus:
        message = (
            f"prompt chunks are launched layer by layer, not replayed as graphs of up to {rows} rows: {why}"
        )
        led.change(GRAPHS_KEY, 0, GRAPHS_CACHED_RULE, message)
        return
    names = ", ".join(f"GPU {i}" for i in cached_gpus)
    message = (
        f"the stages on {names} (under an expert cache) launch their prompt chunks layer by layer: {why}"
    )
    led.note(GRAPHS_SOME_CACHED_RULE, GRAPHS_KEY, message)
