"""How a prompt chunk is read on a GPU: as 8-row decode graph windows, or through the prefill path, whose
chunks replay CUDA graphs of their own.

A prompt chunk of at most ``memory.prompt_graph_rows`` rows runs through the decode path's CUDA graphs in
windows of 8 rows; a longer one takes the prefill path (cuBLAS products and grouped expert kernels). A graph
window costs its bytes: each layer's weights and the distinct experts its 8 rows route to. The prefill path
reads each distinct expert once for the whole chunk. Replayed as a graph (``memory.prefill_graph_rows``,
resolved with the defaults), a short chunk costs its bytes too: for the 30B preset on an H200 one 16-row
graph reads faster than two windows, so windows take prompts of up to 8 rows. Launched from Python layer by
layer, a short chunk's cost is that host time, about 0.45 ms a layer whatever the rows up to 64: then two
windows (16 rows) pay for the 30B preset, one for the 235B preset, all 8 for the small presets.

``auto`` (the default) sets the rows from that estimate (step 8); a number sets them outright.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..schema.facts import ModelFacts, expected_distinct_experts
from ..schema.windows import (
    MAX_WINDOW_ROWS,
    PREFILL_EXPERT_TILE_ROWS,
    PREFILL_GRAPH_AUTO_ROWS,
    PREFILL_GRAPH_MIN_ROWS,
    PROMPT_GRAPH_MAX,
    prefill_graph_rows_for,
)
from .ledger import Ledger
from .sizes import StageShape, prefill_graph_bytes

RULE = "windows.prompt-graph-rows"
KEY = "memory.prompt_graph_rows"
GRAPHS_RULE = "windows.prefill-graph-rows"
GRAPHS_KEY = "memory.prefill_graph_rows"
GRAPHS_CACHED_RULE = "windows.prefill-graphs-cached"
GRAPHS_SOME_CACHED_RULE = "windows.prefill-graphs-some-cached"
GRAPHS_CPU_RULE = "memory.prefill-graphs-cpu"

PREFILL_LAUNCH_MS_PER_LAYER = 0.45
"""Host time the prefill path takes to queue one layer of a short prompt chunk: 21.4-21.7 ms for the 30B
preset's 48 layers and its MTP head's layer on an H200 machine, the same from 16 to 32 rows (it is Python's
time, so it follows the host's CPU: 17.7 ms on a faster one, before the chunk's temporaries were kept)."""
GRAPH_WINDOW_EFFICIENCY = 0.7
"""The share of its byte roofline an 8-row decode graph window reaches (70-74% measured for the 30B preset
on an H200; one 8-row window of its prompt took about 7.7 ms)."""
PREFILL_GRAPH_EFFICIENCY = 0.9
"""The share of the GPUs' bandwidth at which a 16-row prefill graph reads its bytes (each layer's weights
and its rows' distinct experts under uniform routing): a prompt of 9 to 16 tokens took 9.0-9.3 ms to its
first token for the 30B preset on an H200, where those bytes take 9.2 ms at the 4,280 GB/s copy rate, so
about 90% of the 4,800 GB/s the profile states."""
PREFILL_GRAPH_MS_PER_LAYER = 0.03
"""The latency of one layer of a replayed prefill graph beyond its bytes: about 13 dependent kernels of a
few microseconds each (what decides for small models, whose bytes take almost nothing)."""


@dataclass(frozen=True, slots=True)
class PromptCosts:
    """What reading a short prompt chunk costs each way, in ms."""

    window_ms: float
    """One 8-row graph window through every layer (and the MTP head's, when it drafts)."""
    prefill_ms: float
    """The prefill path for a short chunk through the same layers: its launches, or where it replays
    graphs, the smallest graph (16 rows)."""
    layers: int
    distinct_experts: float
    """Distinct experts an 8-row window's rows route to in a sparse layer (uniform routing)."""
    graphs: bool = False
    """Whether ``prefill_ms`` is a replayed graph's (else the host's launches)."""

    def graph_rows(self) -> int:
        """The most rows whose graph windows cost no more than the prefill path (`prefill_ms`): a multiple
        of 8 from 8 to `PROMPT_GRAPH_MAX`."""
        windows = math.floor(self.prefill_ms / self.window_ms) if self.window_ms > 0 else PROMPT_GRAPH_MAX
        return min(max(windows, 1) * MAX_WINDOW_ROWS, PROMPT_GRAPH_MAX)


def prompt_costs(
    model: ModelFacts, stages: Sequence[tuple[StageShape, float]], drafting: bool, graphs: bool = False
) -> PromptCosts:
    """The costs for ``model`` over ``stages`` (each stage's layers and its GPU's bandwidth in GB/s); with
    ``drafting``, the MTP head's layers on the last stage's GPU too; with ``graphs``, the prefill path
    replays a 16-row graph (else it is launched layer by layer)."""
    distinct = expected_distinct_experts(model.num_experts, model.num_experts_per_tok, MAX_WINDOW_ROWS)
    window = _read_ms(model, stages, drafting, distinct, GRAPH_WINDOW_EFFICIENCY)
    layers = sum(shape.end - shape.start for shape, _ in stages)
    layers += model.mtp_layers if drafting and model.has_mtp and stages else 0
    prefill = layers * PREFILL_LAUNCH_MS_PER_LAYER
    if graphs:
        rows = expected_distinct_experts(model.num_experts, model.num_experts_per_tok, PREFILL_GRAPH_MIN_ROWS)
        prefill = _read_ms(model, stages, drafting, rows, PREFILL_GRAPH_EFFICIENCY)
        prefill += layers * PREFILL_GRAPH_MS_PER_LAYER
    return PromptCosts(window, prefill, layers, distinct, graphs)


def _read_ms(
    model: ModelFacts,
    stages: Sequence[tuple[StageShape, float]],
    drafting: bool,
    distinct: float,
    efficiency: float,
) -> float:
    """Milliseconds to read every layer's weights and ``distinct`` experts of each sparse layer (and the MTP
    head's, with ``drafting``) at ``efficiency`` of each stage GPU's bandwidth."""
    seconds = 0.0
    for shape, gbs in stages:
        rate = gbs * 1e9 * efficiency
        for layer in range(shape.start, shape.end):
            dense, _ = model.layer_bytes(layer)
            experts = distinct * model.expert_bytes() if model.is_sparse(layer) else 0.0
            seconds += (dense + experts) / rate
    if drafting and model.has_mtp and stages:
        dense, _ = model.mtp_bytes()
        experts = model.mtp_layers * distinct * model.expert_bytes() if model.num_experts else 0.0
        seconds += (dense + experts) / (stages[-1][1] * 1e9 * efficiency)
    return seconds * 1e3


def resolve_prompt_graph_rows(
    led: Ledger, model: ModelFacts, stages: Sequence[tuple[StageShape, float]], all_experts_resident: bool
) -> int:
    """Resolve ``memory.prompt_graph_rows``: what the profile says, else (``auto``) `PROMPT_GRAPH_MAX` on
    virtual CPU devices (no prefill path), one window's rows under an expert cache (the prefill path reads
    each expert a chunk routes to once, where graph windows read it again in every window, and an expert in
    host memory crosses the host link at each read), else the estimate of `prompt_costs`; with a note where
    it sends prompts of fewer rows than `PROMPT_GRAPH_MAX` to the prefill path."""
    if led[KEY] != "auto":
        return int(led[KEY])
    if led["machine.backend"] != "cuda":
        led.resolve_auto(KEY, PROMPT_GRAPH_MAX, RULE)
        return PROMPT_GRAPH_MAX
    if not all_experts_resident:
        one, tile = MAX_WINDOW_ROWS, PREFILL_EXPERT_TILE_ROWS
        cached = (
            f"under an expert cache, prompt chunks of more than {one} rows go through the prefill path: its "
            f"grouped products read each expert a chunk routes to once for up to {tile} of its rows, where "
            f"every {one}-row graph window reads its own rows' experts again, and an expert held in host "
            "memory crosses the host link at each read"
        )
        led.resolve_auto(KEY, MAX_WINDOW_ROWS, RULE, cached)
        return MAX_WINDOW_ROWS
    graphs = led[GRAPHS_KEY] >= PREFILL_GRAPH_MIN_ROWS
    mtp_drafts = led["spec.draft_tokens"] >= 2 and led["spec.method"] == "mtp"  # n-gram lookup reads nothing
    costs = prompt_costs(model, stages, drafting=mtp_drafts, graphs=graphs)
    rows = costs.graph_rows()
    message = None
    if rows < PROMPT_GRAPH_MAX:
        windows = rows // MAX_WINDOW_ROWS
        prefill = (
            f"about {costs.prefill_ms:.1f} ms for the prefill path's 16-row graph (its rows' experts at "
            f"{PREFILL_GRAPH_EFFICIENCY:.0%})"
            if costs.graphs
            else f"about {costs.prefill_ms:.0f} ms of the prefill path's launches ({costs.layers} layers)"
        )
        message = (
            f"prompt chunks of up to {rows} rows run as 8-row graph windows, longer ones through the prefill "
            f"path: {windows} window{'s' if windows > 1 else ''} of about {costs.window_ms:.1f} ms"
            f"{' each' if windows > 1 else ''} (the weights and {costs.distinct_experts:.0f} "
            f"distinct experts a layer at {GRAPH_WINDOW_EFFICIENCY:.0%} of the GPUs' bandwidth) against "
            f"{prefill}"
        )
    led.resolve_auto(KEY, rows, RULE, message)
    return rows


def resolve_prefill_graph_rows(led: Ledger) -> int:
    """Resolve ``memory.prefill_graph_rows`` with the other defaults (before the workspace is planned):
    what the profile says, else (``auto``) 0 on virtual CPU devices, which have no prefill path, and on a
    GPU `PREFILL_GRAPH_AUTO_ROWS`, or the graph of the longest chunk where that is smaller. Its note waits
    for step 8 (`prefill_graphs_gate`), which knows where the experts are. A number on virtual CPU devices
    becomes 0, with a note, so that the workspace keeps nothing for graphs that never run."""
    if led[GRAPHS_KEY] != "auto":
        rows = int(led[GRAPHS_KEY])
        if rows and led["machine.backend"] != "cuda":
            message = (
                f"memory.prefill_graph_rows = {rows} does nothing on virtual CPU devices, which read prompts "
                "through the array path: 0, and no workspace kept for it"
            )
            led.change(GRAPHS_KEY, 0, GRAPHS_CPU_RULE, message)
            return 0
        return rows
    rows = 0
    if led["machine.backend"] == "cuda":
        longest = max(led["memory.prefill_chunk"], led["memory.prefill_chunk_alone"])
        rows = min(PREFILL_GRAPH_AUTO_ROWS, prefill_graph_rows_for(longest))
    led.resolve_auto(GRAPHS_KEY, rows, GRAPHS_RULE)
    return rows


def prefill_graphs_gate(
    led: Ledger, model: ModelFacts, cached_gpus: Sequence[int], stage_gpus: int, drafting: bool
) -> None:
    """Step 8: a stage under an expert cache launches its prompt chunks layer by layer: a chunk reads the
    experts held in host memory over the host link, which takes far longer than the host's launches, so the
    budget kept no graph workspace on its GPU for its cache to give up.
    ``cached_gpus``: the stage GPUs that hold an expert cache, of ``stage_gpus``. Where every stage does, the
    value becomes 0; where some do, a note names them; an ``auto`` value that replays graphs is noted with
    the workspace their temporaries keep."""
    rows = led[GRAPHS_KEY]
    if not rows:
        return
    why = (
        "a chunk reads the experts held in host memory over the host link, which takes far longer than "
        "launching its kernels, so the cache keeps that VRAM"
    )
    if len(cached_gpus) == stage_gpus:
        message = (
            f"prompt chunks are launched layer by layer, not replayed as graphs of up to {rows} rows: {why}"
        )
        led.change(GRAPHS_KEY, 0, GRAPHS_CACHED_RULE, message)
        return
    if led.asked(GRAPHS_KEY) in (None, "auto"):
        mib = prefill_graph_bytes(model, rows) / (1 << 20)
        mtp = prefill_graph_bytes(model, rows, mtp=True) / (1 << 20)
        message = (
            f"prompt chunks through the prefill path replay CUDA graphs up to {rows} rows (each padded to a "
            f"power of two from 16 to 128, then to a multiple of 64), so the host does not launch their "
            f"kernels one by one; their temporaries and inputs keep {mib:.1f} MiB of workspace a stage"
            + (f" (and {mtp:.1f} MiB for the MTP head)" if drafting else "")
        )
        led.note(GRAPHS_RULE, GRAPHS_KEY, message)
    if cached_gpus:
        names = ", ".join(f"GPU {i}" for i in cached_gpus)
        message = (
            f"the stages on {names} (under an expert cache) launch their prompt chunks layer by layer: {why}"
        )
        led.note(GRAPHS_SOME_CACHED_RULE, GRAPHS_KEY, message)
