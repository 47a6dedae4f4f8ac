"""Window row layout: which rows (slot, offset) go through the stages together.

A row is one token at one position of one slot. Offset 0 is the slot's current token; offset k > 0 is its
k-th drafted proposal. This is part of the plan's contract: the resolver states the limits with it and the
runtime schedules with it, so both read the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MAX_WINDOW_ROWS = 8
"""At most this many rows go through the stages in one window (the verify limit)."""
HANDOFF_ROWS = MAX_WINDOW_ROWS
"""Rows handed from one stage to the next are bounded by the window, not by the slot count."""
BATCH_MTP_ROWS_PER_SLOT = 2
"""Batch MTP sends each slot's token and one proposal."""
BATCH_MTP_SLOTS_PER_WINDOW = MAX_WINDOW_ROWS // BATCH_MTP_ROWS_PER_SLOT
DEFER_MOST = 64
"""Rows a slot's drafter may hold unread while its windows carry no proposals, before its head reads them
anyway: its deferred rows buffer holds these and one more window's."""
DECODE_ATTENTION_CHUNK = 64
"""Positions a block of decode attention reads (the CUDA kernel's ``ATTN_CHUNK``); each writes one partial
result per query head to the window's scratch, so the scratch grows with the context."""


DECODE_ATTENTION_TC_SPLITS = 64
"""Partial results of a row and KV head that decode attention's tensor-core kernel writes at most, however
long the row: past that many chunks, each of its blocks streams a run of consecutive chunks."""


def lookup_history_positions(context: int) -> int:
    """Positions of a slot's token history where the solo path drafts by n-gram lookup (each window decided
    on the device writes its rows' choices past its token before the next proposals are looked up there):
    the context, and a window's rows past it."""
    return context + MAX_WINDOW_ROWS


def decode_attention_partials(context: int, *, tensor_cores: bool = False) -> int:
    """Partial results a row and query head of decode attention may write over a ``context``-position KV: one
    per `DECODE_ATTENTION_CHUNK` positions on CUDA cores, at most `DECODE_ATTENTION_TC_SPLITS` on tensor
    cores."""
    chunks = -(-context // DECODE_ATTENTION_CHUNK)
    return min(chunks, DECODE_ATTENTION_TC_SPLITS) if tensor_cores else chunks


def decode_attention_scratch_floats(
    rows: int, heads: int, head_dim: int, context: int, *, tensor_cores: bool = False
) -> int:
    """Float32 elements of decode attention's scratch for ``rows`` rows: each query head's partial sums
    (``head_dim``) and its maximum and total, for each partial result (`decode_attention_partials`)."""
    return rows * heads * decode_attention_partials(context, tensor_cores=tensor_cores) * (head_dim + 2)


DECODE_ATTENTION_MERGE_GROUP = 16
"""Chunks of decode attention merged together (the CUDA kernel's ``ATTN_MERGE_GROUP``): a row whose position
spans more chunks merges them in groups of this many, then the groups."""


DECODE_ATTENTION_TC_HEAD_DIMS = (16, 32, 64, 128)
"""Head dims decode attention's tensor-core kernel takes (the CUDA kernels' ``attn_tc``)."""
DECODE_ATTENTION_TC_MAX_GROUP = 16
"""Query heads per KV head that kernel takes at most: the 16 rows of its products."""


def decode_attention_on_tensor_cores(head_dim: int, group: int) -> bool:
    """Whether decode attention's tensor-core kernel takes a model of this head dim and ``group`` query heads
    per KV head (``model.decode_attention = "auto"`` then runs it on a GPU)."""
    return head_dim in DECODE_ATTENTION_TC_HEAD_DIMS and 1 <= group <= DECODE_ATTENTION_TC_MAX_GROUP


def decode_attention_counters(kv_heads: int, context: int) -> int:
    """Int32 counters decode attention keeps per row: for each KV head, one for the row's merge and one per
    `DECODE_ATTENTION_MERGE_GROUP` chunks of the context."""
    chunks = -(-context // DECODE_ATTENTION_CHUNK)
    return kv_heads * (1 + -(-chunks // DECODE_ATTENTION_MERGE_GROUP))


PROMPT_GRAPH_MAX = 64
"""A prompt chunk on a GPU runs as 8-row decode graph windows when it has at most
``memory.prompt_graph_rows`` rows, which is at most this many; longer chunks take the prefill path."""
PREFILL_EXPERT_TILE_ROWS = 128
"""The prefill path's grouped expert products read an expert's weights once for each tile of up to this
many of a chunk's rows routed to it."""
PREFILL_GRAPH_MIN_ROWS = 16
"""A prefill-path chunk replayed as a CUDA graph is padded to at least this many rows."""
PREFILL_GRAPH_AUTO_ROWS = 512
"""``memory.prefill_graph_rows = "auto"`` on a GPU: chunks that pad to at most this many rows replay graphs
(fewer where no chunk is that long). Past it the GPU's work outlasts the host's launches."""


PREFILL_GRAPH_STEP_ROWS = 64
"""Past 128 rows a prefill graph's rows are a multiple of this, not a power of two: a chunk just past a power
of two would otherwise pad to nearly twice its rows, whose products then outlast the launches the graph
saves (a 257-row prompt took 18.7 ms through a 512-row graph against 17.3 launched)."""


def prefill_graph_rows_for(rows: int) -> int:
    """The rows of the prefill graph that reads a chunk of ``rows`` rows: the next power of two from
    `PREFILL_GRAPH_MIN_ROWS` to 128, then the next multiple of `PREFILL_GRAPH_STEP_ROWS` (a dozen sizes up
    to 512, so that a few graphs serve every prompt)."""
    if rows > 2 * PREFILL_GRAPH_STEP_ROWS:
        return -(-rows // PREFILL_GRAPH_STEP_ROWS) * PREFILL_GRAPH_STEP_ROWS
    return max(PREFILL_GRAPH_MIN_ROWS, 1 << max(rows - 1, 0).bit_length())


def prefill_graph_sizes(graph_rows: int, prompt_graph_rows: int) -> list[int]:
    """Every size of prefill graph a chunk can pad to, largest first (`prefill_graph_rows_for`), up to
    ``graph_rows`` (``memory.prefill_graph_rows``), that takes a chunk of more than ``prompt_graph_rows``
    rows (shorter chunks run as graph windows). A warm-up that reads one prompt of each captures them all,
    the largest first so that their shared temporaries are allocated once."""
    sizes, rows = [], PREFILL_GRAPH_MIN_ROWS
    while rows <= graph_rows:
        if rows > prompt_graph_rows:
            sizes.append(rows)
        rows = prefill_graph_rows_for(rows + 1)
    return sizes[::-1]


def warm_prompt_lengths(graph_rows: int, prompt_graph_rows: int, context: int) -> list[int]:
    """Prompt lengths a warm-up reads beside its first prompt, each up to a quarter of the ``context``: one
    of each size of prefill graph (`prefill_graph_sizes`, largest first), so that each is captured before a
    request needs it; and where the prefill path also reads chunks of a few dozen rows (``prompt_graph_rows``
    below `PROMPT_GRAPH_MAX`), one of that many rows if no graph size is, since products at a few dozen rows
    load other kernels than a long chunk's."""
    cap = max(1, context // 4)
    lengths = [n for n in prefill_graph_sizes(graph_rows, prompt_graph_rows) if n <= cap]
    short = min(PROMPT_GRAPH_MAX, cap)
    if prompt_graph_rows < short and short not in lengths:
        lengths.append(short)
    return lengths


ATTENTION_TILE_BYTES = 1 << 30
"""Prompt attention that stores its scores (float32) and probabilities (float16) takes a prompt window's
query rows in tiles whose two arrays stay under this many bytes (at least `ATTENTION_TILE_MIN_ROWS` rows):
the runtime tiles by it and the resolver plans the workspace by it."""
ATTENTION_TILE_MIN_ROWS = 16


def attention_tile_rows(n_heads: int, keys: int) -> int:
    """Query rows per tile of stored attention scores over ``keys`` keys (`ATTENTION_TILE_BYTES`)."""
    return max(ATTENTION_TILE_MIN_ROWS, ATTENTION_TILE_BYTES // (n_heads * keys * 6))


FLASH_HEAD_DIMS = (16, 32, 64, 128)
"""Head dims of the fused prompt-attention kernel (``strata_runtime.reference.flash.HEAD_DIMS``, which a test
holds this to): on a GPU a prompt chunk at one of these stores no scores, so the resolver plans no tile."""


WindowKind = Literal["solo", "serial", "batch-mtp", "pipelined"]


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a window: a slot and the offset of the token after its last accepted one."""

    slot: int
    offset: int = 0


def solo_window(slot: int, proposals: int) -> tuple[Row, ...]:
    """One slot's token plus ``proposals`` chained drafts."""
    if not 0 <= proposals < MAX_WINDOW_ROWS:
        raise ValueError(f"a solo window holds 1 + at most {MAX_WINDOW_ROWS - 1} proposals, not {proposals}")
    return tuple(Row(slot, k) for k in range(1 + proposals))


def plain_windows(slots: Sequence[int]) -> list[tuple[Row, ...]]:
    """One row per slot, in windows of at most ``MAX_WINDOW_ROWS``."""
    rows = [Row(s) for s in slots]
    return [tuple(rows[i : i + MAX_WINDOW_ROWS]) for i in range(0, len(rows), MAX_WINDOW_ROWS)]


def batch_mtp_window(slots: Sequence[int], start: int) -> tuple[Row, ...]:
    """Token and proposal rows for at most ``BATCH_MTP_SLOTS_PER_WINDOW`` slots, starting at ``start``.

    With more slots than fit, successive windows pass a rotating ``start`` so every slot gets its turn.
    """
    if not slots:
        return ()
    n = min(len(slots), BATCH_MTP_SLOTS_PER_WINDOW)
    chosen = [slots[(start + i) % len(slots)] for i in range(n)]
    return tuple(Row(s, k) for s in chosen for k in range(BATCH_MTP_ROWS_PER_SLOT))


def next_rotation(start: int, n_slots: int) -> int:
    """The start of the batch-MTP window after one that began at ``start``."""
    if n_slots <= BATCH_MTP_SLOTS_PER_WINDOW:
        return 0
    return (start + BATCH_MTP_SLOTS_PER_WINDOW) % n_slots
