"""Byte sizes the budget and the auto split are built from: pure functions of the model's shapes.

Legend for the formulas (docs/PROFILES.md writes them out the same way):
R rows per window (8), P prefill chunk, C context per slot, H hidden, Q = heads x head_dim,
K = kv_heads x head_dim, nh heads, E experts, k experts per token, I expert width, Id dense MLP width,
Is shared-expert width, V vocab, a activation bytes (the model dtype), f = 4 bytes (float32), h = 2 bytes
(float16, what a GPU's kernels read and write), i = 4 bytes (int32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schema.facts import DTYPE_BYTES, ModelFacts
from ..schema.windows import (
    DEFER_MOST,
    FLASH_HEAD_DIMS,
    MAX_WINDOW_ROWS,
    PREFILL_EXPERT_TILE_ROWS,
    attention_tile_rows,
    decode_attention_counters,
    decode_attention_scratch_floats,
    lookup_history_positions,
    prefill_graph_sizes,
)

F32 = 4
GPU_POOL_HEADROOM = 256 << 20
"""Bytes a GPU's memory pool may hold beyond every term this module counts (allocation rounding, CuPy's own
small arrays). On one H200 capped at 24 GiB (the 30B shape, one stage that drafts) an 8183-token prompt's
pool once held 184-254 MiB more than the counted workspace, almost all of it the decode windows' buffers
(231 MiB, then uncounted, each window size with its own attention scratch); those are now counted
(`decode_window_bytes`) and share one scratch a set (docs/PERFORMANCE_LOG.md, "a twelfth lease")."""
HALF = 2
"""float16: the CUDA path's activations, whatever the checkpoint's dtype (bfloat16 is converted on load)."""
I32 = 4


@dataclass(frozen=True, slots=True)
class StageShape:
    """What a stage holds, for sizing: its layers and whether it is first and/or last."""

    start: int
    end: int
    first: bool
    last: bool


def weight_bytes(model: ModelFacts, stage: StageShape, *, with_mtp: bool, int8_head: bool = False) -> int:
    """Non-expert weights of the stage's layers, plus embedding (first) and head / MTP (last), and on the
    last stage the MTP head's 8-bit copy of the LM head where it drafts through one (``int8_head``,
    `ModelFacts.int8_head_bytes`)."""
    n = sum(model.layer_bytes(layer)[0] for layer in range(stage.start, stage.end))
    if stage.first:
        n += model.embedding_bytes()
    if stage.last:
        n += model.head_bytes()
        if with_mtp:
            n += model.mtp_bytes()[0]
        if int8_head:
            n += model.int8_head_bytes()
    return n


def expert_count(model: ModelFacts, stage: StageShape, *, with_mtp: bool) -> int:
    """Routed experts of the stage's layers (and of the MTP layers on the last stage)."""
    n = sum(model.layer_experts(layer) for layer in range(stage.start, stage.end))
    if stage.last and with_mtp:
        n += model.mtp_layers * model.num_experts
    return n


def kv_bytes(model: ModelFacts, n_layers: int, *, context: int, kv_dtype: str, slots: int) -> int:
    """KV cache: 2 x layers x kv_heads x head_dim x context x bytes(kv), for every slot."""
    return n_layers * model.kv_bytes_per_token(kv_dtype) * context * slots


def drafter_bytes(model: ModelFacts, *, context: int, kv_dtype: str, drafters: int) -> int:
    """The slot drafters' private state: per drafter, its MTP layers' KV over the slot's context, plus the
    draft-window buffers (residual rows [R, H] and logits [R, V], both float32) and the rows it defers while
    its windows carry no proposals (`DEFER_MOST` and one window's more, [., H] float32)."""
    mtp_kv = model.mtp_layers * model.kv_bytes_per_token(kv_dtype) * context
    buffers = MAX_WINDOW_ROWS * model.hidden_size * F32 + MAX_WINDOW_ROWS * model.vocab_size * F32
    buffers += (DEFER_MOST + MAX_WINDOW_ROWS) * model.hidden_size * F32
    return drafters * (mtp_kv + buffers)


def row_activation_bytes(model: ModelFacts) -> int:
    """Activations one row needs while it passes a layer on the array path (virtual CPU devices; a GPU's
    prefill path holds `prefill_temp_row_bytes` and `chunk_row_bytes` instead).

    a x (3H + Q + 2K + Q): residual, normed input and MLP output; q, k, v; attention output.
    f x E: router logits (float32).
    a x (2kI + kH): each chosen expert's gate/up and its output.
    a x 2 max(Id, Is): a dense layer's or the shared expert's gate/up, where the model has them.
    """
    a = DTYPE_BYTES[model.dtype]
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    n = a * (3 * h + q + 2 * kv + q)
    if model.num_experts:
        k, width = model.num_experts_per_tok, model.moe_intermediate_size
        n += F32 * model.num_experts + a * (2 * k * width + k * h)
    return n + a * 2 * _mlp_width(model)


def prefill_temp_row_bytes(model: ModelFacts, *, mtp: bool = False, flash: bool = True) -> int:
    """Bytes one row of a prompt chunk holds in the temporaries of a GPU's prefill path
    (`strata_runtime.cuda.prefill.Temps`: allocated once a chunk for all the stage's layers, and kept until
    the next chunk), by name:

    x: h x H; qkv: f x (Q + 2K); q_hi, q_lo, attn: h x Q each. Without the fused attention kernel
    (``flash`` False) q's two parts again, regrouped by KV head: h x 2Q.
    Where a layer has a dense MLP or a shared expert, of width W = max(Id, Is): mlp_gu h x 2W, mlp_hid h x W,
    mlp_out f x H, and the shared expert's gate f.
    Routed experts: xf f x H, logits f x E, idx, wts, rank, order i x k each, hid h x kI, ys h x kH (the
    tile table is `prefill_tile_table_bytes`).
    ``mtp``: the MTP head's layer (routed experts and the shared expert where the model has them, else a
    dense MLP of width Id)."""
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    n = HALF * h + F32 * (q + 2 * kv) + 3 * HALF * q
    if not flash:
        n += 2 * HALF * q
    width = _mlp_width(model, mtp=mtp)
    if width:
        n += 3 * HALF * width + F32 * h + (F32 if model.shared_expert_intermediate_size else 0)
    if model.num_experts:
        k = model.num_experts_per_tok
        n += F32 * (h + model.num_experts) + 4 * I32 * k + HALF * k * (model.moe_intermediate_size + h)
    return n


def prefill_tile_table_bytes(model: ModelFacts, rows: int) -> int:
    """The grouped expert products' tile table of a chunk of ``rows`` rows and its count (the temporaries
    tiles and n_tiles): [T, 4] int32, T = ceil(A / `PREFILL_EXPERT_TILE_ROWS`) + min(E, A) for A = rows x k
    assignments (`strata_runtime.reference.grouped.max_tiles`)."""
    if not model.num_experts:
        return 0
    assignments = rows * model.num_experts_per_tok
    tiles = -(-assignments // PREFILL_EXPERT_TILE_ROWS) + min(model.num_experts, assignments)
    return 4 * I32 * tiles + I32


def prefill_temp_bytes(model: ModelFacts, rows: int, *, mtp: bool = False, flash: bool = True) -> int:
    """A GPU's prefill temporaries for a chunk of ``rows`` rows: `prefill_temp_row_bytes` a row and the
    tile table (`prefill_tile_table_bytes`)."""
    if not rows:
        return 0
    return rows * prefill_temp_row_bytes(model, mtp=mtp, flash=flash) + prefill_tile_table_bytes(model, rows)


def chunk_row_bytes(model: ModelFacts, *, last: bool) -> int:
    """What one row of a prompt chunk holds on a GPU beside the temporaries: its hidden rows in and out,
    and the previous window's out, which the engine holds until this one is finished
    (`strata_runtime.engine.executor.Executor._retire`), f x 3H; on the last stage the final norm's rows of
    both windows, f x H more (the input is gone by the time the norm's rows are made); and each row's
    position and slot, i x 2."""
    return F32 * model.hidden_size * (4 if last else 3) + 2 * I32


def mtp_chunk_row_bytes(model: ModelFacts) -> int:
    """What the MTP head's pass over a prompt chunk adds a row beside its temporaries
    (`strata_runtime.cuda.mtp.CudaMtp.prefill`): the rows' embeddings and both normed inputs, h x 3H, and
    its residual and output rows, f x 2H."""
    return (3 * HALF + 2 * F32) * model.hidden_size


def prefill_graph_bytes(model: ModelFacts, graph_rows: int, *, mtp: bool = False) -> int:
    """What a GPU's prefill path keeps for its CUDA graphs of up to ``graph_rows`` rows: one set of
    temporaries of the largest graph's rows (`strata_runtime.cuda.prefill.Arena`), and each graph size's
    inputs (`GraphInputs`: residual rows f x H, positions and slots i x 2 a row, and i x 2 more), for every
    size a chunk of more than one window can pad to (`prefill_graph_sizes`)."""
    graphs = prefill_graph_sizes(graph_rows, MAX_WINDOW_ROWS)
    if not graphs:
        return 0
    inputs = sum(rows * (F32 * model.hidden_size + 2 * I32) + 2 * I32 for rows in graphs)
    return prefill_temp_bytes(model, graphs[0], mtp=mtp) + inputs


def gpu_prefill_bytes(
    model: ModelFacts, *, rows: int, graph_rows: int, last: bool, mtp: bool, flash: bool
) -> int:
    """What a GPU's prefill path holds for a chunk of ``rows`` rows: its temporaries, kept from one chunk to
    the next (`prefill_temp_bytes`), its rows (`chunk_row_bytes`; ``last``: the last stage's), and where
    its chunks replay graphs (``flash``: through the fused attention kernel) its graphs' own
    (`prefill_graph_bytes`). ``mtp``: the MTP head's prefill path too (the last stage, where it drafts): it
    runs after the stage's on each chunk, with temporaries of its own kept beside the stage's (and a graph
    set of its own), and its rows (`mtp_chunk_row_bytes`)."""
    n = prefill_temp_bytes(model, rows, flash=flash) + rows * chunk_row_bytes(model, last=last)
    graphs = graph_rows if flash else 0  # a chunk replays a graph only through the fused kernel
    n += prefill_graph_bytes(model, graphs)
    if mtp:
        n += prefill_temp_bytes(model, rows, mtp=True, flash=flash) + rows * mtp_chunk_row_bytes(model)
        n += prefill_graph_bytes(model, graphs, mtp=True)
    return n


def decode_window_row_bytes(model: ModelFacts, *, mtp: bool = False) -> int:
    """Bytes one row of a GPU's decode window buffers holds (`strata_runtime.cuda.layers.WindowBuffers`),
    all float32 or int32, beside the attention scratch the window sizes share
    (`decode_attention_scratch_bytes`).

    i x 2: position and slot. f x (4H + 1): residual, MLP output, the MTP head's embedding and output rows,
    and the shared-expert gate's one value. f x (Q + 2K + 2Q): q/k/v, q and the attention output
    (attention's counters grow with the context: `decode_window_bytes`). f x E: router logits; f x 2k + f x
    kI: the routing and each chosen expert's activation. f x 3 max(Id, Is, 1): the dense MLP's or shared
    expert's gate/up and activation (with ``mtp``, the MTP head's layer's)."""
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    k = max(model.num_experts_per_tok, 1)
    n = 2 * I32 + F32 * (4 * h + 1) + F32 * (q + 2 * kv + 2 * q)
    n += F32 * max(model.num_experts, 1) + F32 * 2 * k + F32 * k * max(model.moe_intermediate_size, 1)
    return n + F32 * 3 * max(_mlp_width(model, mtp=mtp), 1)


def decode_attention_scratch_bytes(
    model: ModelFacts, *, context: int, rows: int, tensor_cores: bool = False
) -> int:
    """Decode attention's partial sums, maxima and totals (float32) for ``rows`` rows: every query head over
    each block of `DECODE_ATTENTION_CHUNK` positions of the context, or on ``tensor_cores`` at most 64 of
    them (`decode_attention_scratch_floats`)."""
    heads, dim = model.num_attention_heads, model.head_dim
    return F32 * decode_attention_scratch_floats(rows, heads, dim, context, tensor_cores=tensor_cores)


def decode_window_bytes(
    model: ModelFacts, *, context: int, mtp: bool = False, attention_tc: bool = False
) -> int:
    """One set of decode window buffers (a `strata_runtime.cuda.decode.CudaLayers`) through the main model's
    layers, or with ``mtp`` through the MTP head's: a window of each size from 1 to R rows keeps its own
    buffers (its CUDA graph replays on their addresses), and all of them share one attention scratch of R
    rows, since a set's windows run one at a time on one stream. Plus the fused q/k/v kernel's counters
    (i x (nh + 2 nkv)) for each size, and attention's for each row (`decode_attention_counters`: one a KV
    head, and one a KV head for each group of chunks its merge takes, which grow with the context). The
    scratch holds fewer partial results where decode attention runs on tensor cores (``attention_tc``,
    ``model.decode_attention``)."""
    sizes = range(1, MAX_WINDOW_ROWS + 1)
    counters = I32 * (model.num_attention_heads + 2 * model.num_key_value_heads)
    row = decode_window_row_bytes(model, mtp=mtp)
    row += I32 * decode_attention_counters(model.num_key_value_heads, context)
    n = sum(rows * row + counters for rows in sizes)
    scratch = decode_attention_scratch_bytes(
        model, context=context, rows=MAX_WINDOW_ROWS, tensor_cores=attention_tc
    )
    return n + scratch


MTP_WINDOW_SETS = 2
"""Sets of decode window buffers the MTP head keeps on the last stage where it drafts, beside the stage's
own: windows at positions the host sends, and windows at positions decided on the device, which replay
graphs of their own."""


def _mlp_width(model: ModelFacts, *, mtp: bool = False) -> int:
    """I' of the widest dense MLP or shared expert of the main model's layers (0 without either), or with
    ``mtp`` of the MTP head's layer (its shared expert, or in a dense model its MLP)."""
    if mtp:
        return model.shared_expert_intermediate_size if model.num_experts else model.intermediate_size
    dense = model.intermediate_size if _has_dense_layer(model) else 0
    return max(dense, model.shared_expert_intermediate_size)


def _has_dense_layer(model: ModelFacts) -> bool:
    """Whether any main-model layer is dense (``ModelFacts.is_sparse``'s rule, without a loop)."""
    return bool(model.mlp_only_layers) or model.num_experts == 0 or model.decoder_sparse_step > 1


def prefill_rows(prefill_chunk: int, prefill_chunk_alone: int) -> int:
    """Rows of activation workspace for prefill: an R-row decode window beside a P-row chunk, or a lone
    prompt's chunk of ``prefill_chunk_alone`` rows, whichever is more."""
    return max(MAX_WINDOW_ROWS + prefill_chunk, prefill_chunk_alone)


TOKEN_COUNT_BYTES = 4 + 8
"""Per slot and vocabulary word on the last stage: the token's count (int32) and logit bias (float64), which
the runtime reads to apply a request's penalties and logit bias on the device."""


def stores_attention_scores(backend: str, model: ModelFacts) -> bool:
    """Whether prompt attention stores its scores, as the runtime chooses: a GPU's prefill path reads every
    head dim the fused kernel has (`FLASH_HEAD_DIMS`) through it, which stores none; other head dims (cuBLAS
    over tiles of scores) and virtual CPU devices (the array path) store them."""
    return backend != "cuda" or model.head_dim not in FLASH_HEAD_DIMS


def attention_scores_bytes(model: ModelFacts, *, context: int, rows: int) -> int:
    """Stored attention scores (float32) and probabilities (float16) of ``rows`` query rows over the whole
    context, in the tiles of at most `attention_tile_rows` rows that prompt attention takes where it stores
    them (`stores_attention_scores`)."""
    nh = model.num_attention_heads
    return min(rows, attention_tile_rows(nh, context)) * nh * context * (F32 + 2)


def workspace_parts(
    model: ModelFacts,
    *,
    context: int,
    prefill_rows: int,
    last: bool,
    stores_scores: bool,
    slots: int = 0,
    graph_rows: int = 0,
    gpu: bool = False,
    mtp: bool = False,
    attention_tc: bool = False,
    lookup: bool = False,
) -> dict[str, int]:
    """Activation workspace by part, in the order and with the names of
    `strata_cfg.schema.plan.WORKSPACE_PARTS` (a part that is 0 is left out).

    On a GPU (``gpu``) what its prefill path holds for a chunk of ``prefill_rows`` rows (`prefill_rows`) with
    graphs of up to ``graph_rows`` rows (``memory.prefill_graph_rows``), and on the last stage where it drafts
    (``mtp``) the MTP head's prefill path beside it (`gpu_prefill_bytes`), and its decode window buffers
    (`decode_window_bytes`, with decode attention on tensor cores where ``attention_tc``; the MTP head's
    `MTP_WINDOW_SETS` too); on virtual CPU devices ``prefill_rows``
    rows at `row_activation_bytes` (the array path; and ``graph_rows`` more, twice with ``mtp`` on the last
    stage, though a CPU device resolves them to 0). Either way one tile of the rows' attention scores
    (`attention_scores_bytes`) where prompt attention stores them (``stores_scores``,
    `stores_attention_scores`); the last stage adds a decode window's logits [R, V] in float32 and each of
    ``slots`` slots' token counts and logit bias (`TOKEN_COUNT_BYTES` per vocabulary word), and under n-gram
    lookup (``lookup``) each slot's token history (`lookup_history_bytes`)."""
    parts: dict[str, int] = {}
    if gpu:
        flash = not stores_scores
        parts["prompt"] = gpu_prefill_bytes(
            model, rows=prefill_rows, graph_rows=graph_rows, last=last, mtp=last and mtp, flash=flash
        )
        windows = decode_window_bytes(model, context=context, attention_tc=attention_tc)
        if last and mtp:
            head = decode_window_bytes(model, context=context, mtp=True, attention_tc=attention_tc)
            windows += MTP_WINDOW_SETS * head
        parts["windows"] = windows
    else:
        parts["prompt"] = (prefill_rows + graph_rows * (2 if last and mtp else 1)) * row_activation_bytes(
            model
        )
    if stores_scores:
        parts["scores"] = attention_scores_bytes(model, context=context, rows=prefill_rows)
    if last:
        parts["logits"] = (
            MAX_WINDOW_ROWS * model.vocab_size * F32 + slots * model.vocab_size * TOKEN_COUNT_BYTES
        )
        if lookup:
            parts["logits"] += lookup_history_bytes(context=context, slots=slots)
    if gpu:
        parts["headroom"] = GPU_POOL_HEADROOM
    return {k: v for k, v in parts.items() if v}


def lookup_history_bytes(*, context: int, slots: int) -> int:
    """The slots' token histories on the last stage under n-gram lookup, where windows decided on the
    device look their proposals up (`strata_runtime.engine.executor.Executor.open_lookup`): int64 over the
    context and a window's rows past it, a slot."""
    return slots * lookup_history_positions(context) * 8


def workspace_bytes(model: ModelFacts, **parts: Any) -> int:
    """The whole activation workspace: the sum of `workspace_parts` (its keyword arguments)."""
    return sum(workspace_parts(model, **parts).values())


def min_cache_experts(model: ModelFacts, n_experts: int) -> int:
    """The smallest useful expert cache: every expert one full window can route to in one layer."""
    return min(n_experts, model.num_experts, MAX_WINDOW_ROWS * model.num_experts_per_tok)


def layer_step_bytes(model: ModelFacts, layer: int, *, context: int, kv_dtype: str, slots: int) -> int:
    """Bytes one decode step reads in a main-model layer: its non-expert weights, the k experts one
    token routes to, and every slot's KV over the full context (an upper bound)."""
    dense, _ = model.layer_bytes(layer)
    experts = model.num_experts_per_tok * model.expert_bytes() if model.is_sparse(layer) else 0
    return dense + experts + model.kv_bytes_per_token(kv_dtype) * context * slots


def head_step_bytes(model: ModelFacts, *, mtp_passes: int, context: int, kv_dtype: str, drafters: int) -> int:
    """Bytes the last stage reads per decode step beyond its layers: the final norm and LM head, and
    ``mtp_passes`` runs of the MTP head (its non-expert weights, k experts, and the drafters' MTP KV)."""
    n = model.head_bytes()
    if mtp_passes and model.has_mtp:
        dense, _ = model.mtp_bytes()
        experts = model.mtp_layers * model.num_experts_per_tok * model.expert_bytes()
        mtp_kv = model.mtp_layers * model.kv_bytes_per_token(kv_dtype) * context * drafters
        n += mtp_passes * (dense + experts + model.head_bytes()) + mtp_kv
    return n
