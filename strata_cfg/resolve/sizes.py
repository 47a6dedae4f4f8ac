"""Byte sizes the budget and the auto split are built from: pure functions of the model's shapes.

Legend for the formulas (docs/PROFILES.md writes them out the same way):
R rows per window (8), P prefill chunk, C context per slot, H hidden, Q = heads x head_dim,
K = kv_heads x head_dim, nh heads, E experts, k experts per token, I expert width, Id dense MLP width,
Is shared-expert width, V vocab, a activation bytes (the model dtype), f = 4 bytes (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema.facts import DTYPE_BYTES, ModelFacts
from ..schema.windows import FLASH_HEAD_DIMS, MAX_WINDOW_ROWS, attention_tile_rows

F32 = 4


@dataclass(frozen=True, slots=True)
class StageShape:
    """What a stage holds, for sizing: its layers and whether it is first and/or last."""

    start: int
    end: int
    first: bool
    last: bool


def weight_bytes(model: ModelFacts, stage: StageShape, *, with_mtp: bool) -> int:
    """Non-expert weights of the stage's layers, plus embedding (first) and head / MTP (last)."""
    n = sum(model.layer_bytes(layer)[0] for layer in range(stage.start, stage.end))
    if stage.first:
        n += model.embedding_bytes()
    if stage.last:
        n += model.head_bytes()
        if with_mtp:
            n += model.mtp_bytes()[0]
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
    draft-window buffers (residual rows [R, H] and logits [R, V], both float32)."""
    mtp_kv = model.mtp_layers * model.kv_bytes_per_token(kv_dtype) * context
    buffers = MAX_WINDOW_ROWS * model.hidden_size * F32 + MAX_WINDOW_ROWS * model.vocab_size * F32
    return drafters * (mtp_kv + buffers)


def row_activation_bytes(model: ModelFacts) -> int:
    """Activations one row needs while it passes a layer.

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
    dense = model.intermediate_size if _has_dense_layer(model) else 0
    n += a * 2 * max(dense, model.shared_expert_intermediate_size)
    return n


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


def workspace_bytes(
    model: ModelFacts,
    *,
    context: int,
    prefill_rows: int,
    last: bool,
    stores_scores: bool,
    slots: int = 0,
    graph_rows: int = 0,
) -> int:
    """Activation workspace: ``prefill_rows`` rows (`prefill_rows`) at `row_activation_bytes`, one tile of
    their attention scores (`attention_scores_bytes`) where prompt attention stores them (``stores_scores``,
    `stores_attention_scores`), and ``graph_rows`` more rows kept for the prefill graphs
    (``memory.prefill_graph_rows``: their temporaries keep their addresses, beside a longer chunk's; the
    caller counts the MTP head's graphs on the last stage); the last stage adds a decode window's logits
    [R, V] in float32 and each of ``slots`` slots' token counts and logit bias (`TOKEN_COUNT_BYTES` per
    vocabulary word)."""
    per_row = row_activation_bytes(model)
    n = (prefill_rows + graph_rows) * per_row
    if stores_scores:
        n += attention_scores_bytes(model, context=context, rows=prefill_rows)
    if last:
        n += MAX_WINDOW_ROWS * model.vocab_size * F32 + slots * model.vocab_size * TOKEN_COUNT_BYTES
    return n


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
