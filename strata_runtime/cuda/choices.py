"""Which instantiation of each decode kernel of ``kernels.cu`` a launch takes, with what grid and shared
memory, and the setting a benchmark can put in force around launches (attention's split).

Pure Python over shapes, with no CuPy: `strata_runtime.cuda.ops.Kernels` launches what these functions
choose, the decode graphs compile the instantiations `decode_expressions` lists, and the plan's checks, the
scripts and the CPU tests read the same choices without a device.

Shapes use the letters of kernels.cu: R rows, H hidden, N out features, K reduction, E experts, A = R * topk.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from strata_cfg.schema.windows import (
    DECODE_ATTENTION_CHUNK,
    DECODE_ATTENTION_TC_SPLITS,
    MAX_WINDOW_ROWS,
    decode_attention_counters,
    decode_attention_on_tensor_cores,
    decode_attention_scratch_floats,
)

if TYPE_CHECKING:
    from ..models.qwen3_moe import ModelArgs


T = TypeVar("T")
WARPS_PER_BLOCK = 8
THREADS = WARPS_PER_BLOCK * 32
ATTN_CHUNK = DECODE_ATTENTION_CHUNK  # positions per attention block; kernels.cu's ATTN_CHUNK
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims ``attn_split`` takes: a warp's lanes split evenly into groups of D / 8."""


def _wide(k: int) -> bool:
    return k % 256 == 0


def attention_scratch_size(
    rows: int, n_q: int, n_kv: int, head_dim: int, context: int, tensor_cores: bool = False
) -> int:
    """fp32 elements of attention scratch for a window of ``rows``: partial sums, maxima and totals
    (`decode_attention_scratch_floats`, which the plan counts too); fewer where ``attn_tc`` runs
    (``tensor_cores``: `Kernels.attention_on_tc`). The CUDA cores' size holds either kernel's."""
    return decode_attention_scratch_floats(rows, n_q, head_dim, context, tensor_cores=tensor_cores)


def attention_counters(n_kv: int, context: int) -> int:
    """int32 counters attention keeps per row (`decode_attention_counters`, which the plan counts too): zero
    before the first launch, and the kernel leaves them at zero."""
    return decode_attention_counters(n_kv, context)


ATTN_SPLITS = DECODE_ATTENTION_TC_SPLITS
"""Runs of consecutive chunks a row splits into in ``attn_tc``, at most (64, which the plan's scratch counts):
each run is one block's, and writes one partial result. A long row alone needs its runs to fill the GPU:
on an H200 (a 32,768-position plan) one row at 32,000 positions took 3.86 ms in 63 runs, 4.21 in 32."""
ATTN_SHORT_SPLITS = 16
"""Runs a row of up to `ATTN_SHORT_CHUNKS` chunks splits into in ``attn_tc``, at most: fewer, longer runs
merge in fewer round trips to L2, and up to 16 partials merge in one level. On an H200 the whole step at
2,000 / 4,000 / 8,000 positions took 5-9% / 7-12% / 1-9% less than with `ATTN_SPLITS` runs (1 to 8 rows)."""
ATTN_SHORT_CHUNKS = 128
"""Chunks (8,192 positions) up to which a row takes `ATTN_SHORT_SPLITS` runs. Longer rows take up to
`ATTN_SPLITS`: at 16,000 positions 16 runs made one row 10% slower. The counts are the same for every
window, so that a row's split, and its result, depend only on its position."""
ATTN_ONE_RUN_CHUNKS = 3
"""Chunks (192 positions) up to which a row is one run in ``attn_tc``: one block reads them in turn and
writes the row's output, with no partials and no merge. On an H200 the whole step at 1 and 2 rows took
2.0-2.1% less at 64 positions (2 chunks) and 0.8-1.1% less at 150 (3 chunks) than in a run a chunk;
at 300 positions (5 chunks) one run was 0.8-1.6% slower, at 1,000 10-16% slower."""


@dataclass(frozen=True)
class AttentionSplit:
    """How ``attn_tc`` splits a row into runs of consecutive chunks, by the row's chunks alone: one run up to
    ``one_run_chunks``, at most ``short_splits`` runs up to ``short_chunks``, at most ``splits`` past that.
    The engine runs the default, `ATTN_SPLIT` (`ATTN_ONE_RUN_CHUNKS`, `ATTN_SHORT_SPLITS`,
    `ATTN_SHORT_CHUNKS`, `ATTN_SPLITS`); a benchmark times others inside `attention_split`. Written and
    parsed as ``one_run_chunks/short_splits/short_chunks/splits``, as ``3/16/128/64``."""

    one_run_chunks: int = ATTN_ONE_RUN_CHUNKS
    short_splits: int = ATTN_SHORT_SPLITS
    short_chunks: int = ATTN_SHORT_CHUNKS
    splits: int = ATTN_SPLITS

    def __post_init__(self) -> None:
        if not 1 <= self.short_splits <= self.splits <= ATTN_SPLITS:
            raise ValueError(
                f"attention split {self}: need 1 <= short_splits <= splits <= {ATTN_SPLITS} (the partials "
                "the scratch holds)"
            )
        if self.one_run_chunks < 0 or self.short_chunks < 0:
            raise ValueError(f"attention split {self}: chunk counts cannot be negative")

    def __str__(self) -> str:
        return f"{self.one_run_chunks}/{self.short_splits}/{self.short_chunks}/{self.splits}"

    @classmethod
    def parse(cls, text: str) -> AttentionSplit:
        """``one_run_chunks/short_splits/short_chunks/splits``; fewer fields keep the defaults of the rest."""
        try:
            counts = [int(x) for x in text.split("/")]
        except ValueError:
            counts = []
        if not 1 <= len(counts) <= 4:
            raise ValueError(
                f"attention split {text!r}: expected up to four integers one_run_chunks/short_splits/"
                "short_chunks/splits, as 3/16/128/64"
            )
        return cls(*counts)


@contextlib.contextmanager
def in_force(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """``var`` set to ``value`` in this block (on this thread), and back to what it was after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


ATTN_SPLIT = AttentionSplit()
"""The split the engine runs."""
_ATTENTION_SPLIT: contextvars.ContextVar[AttentionSplit] = contextvars.ContextVar(
    "strata_attention_split", default=ATTN_SPLIT
)
"""The split `Kernels.attention` gives ``attn_tc`` on this thread now: the default outside
`attention_split`."""


def attention_split(split: AttentionSplit) -> contextlib.AbstractContextManager[None]:
    """Launch ``attn_tc`` with ``split`` in this block (on this thread). For benchmarks: a row's result
    depends on its split, so an engine keeps the default for the whole of a request."""
    return in_force(_ATTENTION_SPLIT, split)


def attention_split_in_force() -> AttentionSplit:
    """The split ``attn_tc`` launches with on this thread now."""
    return _ATTENTION_SPLIT.get()


@dataclass(frozen=True)
class L2Warm:
    """What ``moe_down`` brings into L2 for the kernels after it: the next layer's q/k/v weights, read by
    the projection that runs next, in windows of up to ``rows`` rows (0: none), issued before the kernel's
    programmatic-launch wait where ``early``, else once its own weight loads are out. The down products of
    a short window wait on memory latency and leave the DRAM part idle; the next projection's blocks start
    only once those products are done. Values do not depend on it."""

    rows: int = 0
    early: bool = False

    def __str__(self) -> str:
        return "off" if not self.rows else f"{self.rows}{'/early' if self.early else ''}"

    @classmethod
    def parse(cls, text: str) -> L2Warm:
        """``off``, or ``ROWS`` or ``ROWS/early``: warm in windows of up to ROWS rows."""
        if text == "off":
            return cls()
        rows, _, when = text.partition("/")
        if not rows.isdigit() or int(rows) < 1 or when not in ("", "early"):
            raise ValueError(f"L2 warming {text!r}: expected off, ROWS or ROWS/early, as 2/early")
        return cls(int(rows), when == "early")

    def mode(self, rows: int) -> int:
        """``moe_down``'s WARM for a window of ``rows`` rows: 0 (none), 1 (after its loads), 2 (early)."""
        if rows > self.rows:
            return 0
        return 2 if self.early else 1


def _engine_l2_warm() -> L2Warm:
    text = os.environ.get("STRATA_L2_WARM", "off")
    try:
        return L2Warm.parse(text)
    except ValueError as e:
        raise ValueError(f"STRATA_L2_WARM={text}: {e}") from None


L2_WARM = _engine_l2_warm()
"""What the engine's windows warm: ``STRATA_L2_WARM`` (`L2Warm.parse`), off where unset."""
_L2_WARM: contextvars.ContextVar[L2Warm] = contextvars.ContextVar("strata_l2_warm", default=L2_WARM)


def l2_warm(warm: L2Warm) -> contextlib.AbstractContextManager[None]:
    """Launch ``moe_down`` warming L2 as ``warm`` says in this block (on this thread)."""
    return in_force(_L2_WARM, warm)


def l2_warm_in_force() -> L2Warm:
    """How ``moe_down`` warms L2 on this thread now."""
    return _L2_WARM.get()


def attention_on_tensor_cores(head_dim: int, group: int, tensor_cores: bool = True) -> bool:
    """Whether decode attention of this head dim and group of query heads per KV head runs ``attn_tc`` (else
    ``attn_split``): a shape its m16n8k16 products take (`decode_attention_on_tensor_cores`), on a GPU with
    tensor cores where the plan asks for them (``model.decode_attention``). It depends on the model and the
    plan alone, so every window of a model runs the same kernel."""
    return tensor_cores and decode_attention_on_tensor_cores(head_dim, group)


def attention_expressions(head_dim: int, group: int, tensor_cores: bool = True) -> tuple[str, ...]:
    """The instantiations `Kernels.attention` launches for these shapes, at any row count."""
    if attention_on_tensor_cores(head_dim, group, tensor_cores):
        return (f"attn_tc<{head_dim},{group},1>", f"attn_tc<{head_dim},{group},0>")
    few, many = (attention_shape(head_dim, group, rows) for rows in (1, ATTENTION_WIDE_ROWS + 1))
    shapes = dict.fromkeys((few, many))
    return tuple(f"attn_split<{head_dim},{group},{b},{w}>" for b, w in shapes)


def attention_tc_shared_bytes(head_dim: int, group: int) -> int:
    """Dynamic shared memory of an ``attn_tc`` block: two buffers of a chunk's keys and values, then q's two
    fp16 parts (``group`` heads and a row of zeros), each row padded by 8 halves. At head dim 128 and 8
    heads, 74.5 KiB: three blocks to an H200's SM."""
    return (2 * 2 * ATTN_CHUNK + 2 * (group + 1)) * (head_dim + 8) * 2


ATTENTION_FEW_BLOCKS = 2
"""``attn_tc`` blocks an SM holds at once in windows of up to `ATTENTION_WIDE_ROWS` rows
(`attention_tc_carveout`)."""


def attention_tc_carveout(shared_bytes: int, sm_shared: int) -> int:
    """The preferred shared-memory carveout (percent of an SM's ``sm_shared`` bytes) of ``attn_tc`` in windows
    of few rows: room for `ATTENTION_FEW_BLOCKS` blocks of ``shared_bytes`` (and the 1 KiB the hardware
    keeps per block), and no more.

    Left to itself the driver takes the carveout that fits the most blocks, which leaves the SM's L1 small
    for the kernels around it, and a one-row step is latency-bound in those kernels. On an H200 (head dim
    128, 8 query heads per KV head, a 32,768-position plan) one row's step took 3.21 ms at 1,000 positions
    with three blocks an SM, 2.73 with two and 2.70 with one; at 32,000 positions 4.50, 3.88 and 4.10. Eight
    rows, whose blocks fill the GPU, were fastest with three: 10.58 ms at 4,000 positions against 11.06 with
    two."""
    return min(100, math.ceil(100 * ATTENTION_FEW_BLOCKS * (shared_bytes + 1024) / sm_shared))


ATTENTION_WIDE_ROWS = 2
"""Windows of up to this many rows run ``attn_split`` with 256 threads a block (`attention_shape`)."""


STATIC_SHARED = 48 * 1024
"""Bytes of static shared memory a block may declare."""


def attention_shared_bytes(head_dim: int, group: int, warps: int) -> int:
    """Static shared memory of an ``attn_split`` block that sums in the order of ``warps`` canonical warps:
    its q, its chunk's scores, the warps' sums, and one flag."""
    return 4 * (warps * group * head_dim + group * head_dim + group * ATTN_CHUNK) + 4


def attention_fits(head_dim: int, group: int) -> bool:
    """Whether ``attn_split`` takes this head dim and group of query heads per KV head: a head dim whose
    D / 8 pieces split a warp evenly, and a block of 4 canonical warps within static shared memory (16
    query heads per KV head at head dim 256 would need 84 KiB)."""
    return head_dim in ATTENTION_HEAD_DIMS and attention_shared_bytes(head_dim, group, 4) <= STATIC_SHARED


def attention_shape(head_dim: int, group: int, rows: int) -> tuple[int, int]:
    """(threads, canonical warps) of the ``attn_split`` blocks of a ``rows``-row window, for this head dim
    and group of query heads per KV head.

    A block's time is its threads' chains of dependent arithmetic over all the group's heads. With few
    rows the blocks are few and each one's latency is the kernel's, so they take 256 threads; with more
    rows the blocks fill the GPU and 128 threads a block do the same work with less shuffling. On an H200
    (head dim 128, 8 query heads per KV head, each layer's attention alone in a graph) one row at 300
    positions took 7.0 us per layer at 256 threads and 12.2 at 128; 8 rows at 4,000 positions took 70.8 us
    at 128 and 79.0 at 256.
    Both sum in the order of 8 canonical warps, so a row's result does not depend on its window. A shape
    whose 8 warps' sums do not fit in static shared memory, or whose head dim is below 32, runs at 128
    threads with 4 warps' order."""
    if head_dim < 32 or attention_shared_bytes(head_dim, group, 8) > STATIC_SHARED:
        return 128, 4
    return (256 if rows <= ATTENTION_WIDE_ROWS else 128), 8


CHOOSE_GATHER = 2048
"""Tokens ``choose_rows`` gathers into shared memory, at most (kernels.cu's CHOOSE_CAP), once they are known
to hold every token a row's top-k or top-p can keep: its remaining selection passes and its draw then read
those instead of the vocabulary."""


CHOOSE_PREP_BYTES = 32768
"""Scratch a row of the split choice takes (kernels.cu's ChoosePrep, which it asserts fits)."""

SPLIT_KERNELS = (
    "choose_split_cuts",
    "choose_split_gather",
    "choose_split_rows",
    "distribution_split_rows",
    "distribution_split_write",
)
"""The kernels of a token choice or distribution split over slices of each row (with ``argmax_part``)."""


def argmax_slices(vocab: int) -> int:
    """Slices ``argmax_part`` cuts a row of ``vocab`` logits into: one load of 8 values per thread of its
    256 for each slice, up to 128 slices."""
    return max(1, min(128, math.ceil(vocab / 2048)))


def padded_keys(length: int) -> int:
    """Row stride of attention scores over ``length`` keys: rows start 16-byte aligned."""
    return -(-length // 4) * 4


def gemv_rows_per_warp(rows: int, n: int, k: int) -> int:
    """Output features per warp of ``gemv_wide`` for a window of ``rows`` and weights [n, k].

    More features per warp reuse each load of x across them; fewer give more warps, so more weight loads in
    flight. Which wins depends on the shape; this table was measured on an H200 (``strata bench --workload
    step`` and each projection alone): a vocabulary-sized head always takes 4, a router-sized one 1, and the
    projections between take 1 for a row, then 2 (and 4 for a short reduction from 4 rows). Every choice
    sums a row in the same order, so the choice never changes a result.
    """
    if n >= 32768:
        return 4
    if n <= 256 or rows == 1:
        return 1
    if rows == 2:
        return 1 if k >= 4096 else 2
    return 4 if k <= 2048 else 2


def gemv_mma_shape(n: int, k: int) -> tuple[int, int]:
    """(16-feature tiles, warps) of a ``gemv_mma`` block for weights [n, k], as measured fastest on an H200
    (each projection alone, 1 to 8 rows, then inside the whole step): 64 features in 8 warps for a
    vocabulary-sized head, 64 in 16 warps from 4,096 features, else 16 features (a short output keeps its
    blocks many), in 32 warps where the reduction is a multiple of 4,096 (each warp then sums one unit of
    128 per 4,096: the 30B preset's output projection, 2048 x 4096, ran 0.4-1.2% faster a step than in 16
    warps) and in 16 otherwise. A shape's choice does not depend on the row count, so neither does a row's
    result."""
    if n >= 32768:
        return 4, 8
    if n >= 4096:
        return 4, 16
    return (1, 32) if k % 4096 == 0 else (1, 16)


def gemv_on_tensor_cores(n: int, tensor_cores: bool) -> bool:
    """Whether weights of ``n`` output features take ``gemv_mma``: where the device has tensor cores, for
    every output but a router-sized one (256 features or fewer). Those would make too few 16-feature blocks
    (8 for 128 experts), and ran 1.5 us slower per layer at one row on an H200 than ``gemv_wide``; they
    take ``gemv_split`` where `gemv_split_fits`."""
    return tensor_cores and n > 256


SPLIT_FEATURES = 2
"""Output features per block of ``gemv_split``."""


def gemv_split_fits(n: int, k: int) -> bool:
    """Whether weights [n, k] take ``gemv_split``: a router-sized output (256 features or fewer), whose
    reduction (a multiple of 2048) is split over a block's 8 warps. One warp per feature would leave most
    of the GPU idle and sum the whole reduction of every row alone."""
    return n <= 256 and k % 2048 == 0


def gemv_launch(rows: int, n: int, k: int, norm: bool, tensor_cores: bool) -> tuple[str, int, int]:
    """(instantiation, blocks, threads per block) of the GEMV `Kernels.gemv` launches for ``rows`` rows
    through weights [n, k]: ``gemv_any`` for a reduction that is not a multiple of 256, ``gemv_split`` where
    `gemv_split_fits`, ``gemv_mma`` where `gemv_on_tensor_cores`, else ``gemv_wide``. The choice depends on
    the shape and the device, never on the row count, so a row's result never depends on the window it is
    in."""
    flag = "true" if norm else "false"
    if not _wide(k):
        return "gemv_any", math.ceil(n / WARPS_PER_BLOCK), THREADS
    if gemv_split_fits(n, k):
        return f"gemv_split<{rows},{k},{SPLIT_FEATURES},{flag}>", math.ceil(n / SPLIT_FEATURES), THREADS
    if gemv_on_tensor_cores(n, tensor_cores):
        tiles, warps = gemv_mma_shape(n, k)
        return f"gemv_mma<{rows},{k},{tiles},{warps},{flag}>", math.ceil(n / (16 * tiles)), 32 * warps
    per = gemv_rows_per_warp(rows, n, k)
    return f"gemv_wide<{rows},{k},{per},{flag}>", math.ceil(math.ceil(n / per) / WARPS_PER_BLOCK), THREADS


I8_FEATURES_PER_WARP = 4
"""Rows of an 8-bit head each warp of ``gemv_i8`` sums (each load of x serves them all), as the fp16 kernel
takes for a vocabulary-sized head (`gemv_rows_per_warp`)."""


def gemv_i8_launch(rows: int, n: int) -> tuple[str, int, int]:
    """(instantiation, blocks, threads per block) of ``gemv_i8`` for ``rows`` rows (at most
    `MAX_WINDOW_ROWS`) through 8-bit weights of ``n`` rows."""
    warps = math.ceil(n / I8_FEATURES_PER_WARP)
    return f"gemv_i8<{rows},{I8_FEATURES_PER_WARP}>", math.ceil(warps / WARPS_PER_BLOCK), THREADS


def gemv_expression(rows: int, n: int, k: int, norm: bool, tensor_cores: bool) -> str:
    """The instantiation `Kernels.gemv` launches (`gemv_launch`)."""
    return gemv_launch(rows, n, k, norm, tensor_cores)[0]


def moe_wide(h: int, i: int, topk: int) -> bool:
    """Whether `Kernels.moe` takes the wide expert kernels for these shapes (H and I multiples of 256, k <=
    16): routed first, in order of expert, and able to warm L2 (`L2Warm`); else the kernels that take any
    shape."""
    return _wide(h) and _wide(i) and topk <= 16


def moe_expressions(h: int, i: int, topk: int, keep: bool = False, warm: int = 0) -> tuple[str, ...]:
    """The instantiations `Kernels.moe` launches for these shapes, at any row count: the gate/up kernel, the
    down kernel, then any others. ``keep``: under a cache that keeps its misses (``moe_admit`` between the
    routing and the experts, which write the experts they keep); ``warm``: the down kernel's warming of L2
    (`L2Warm.mode`; the kernels that take any shape warm nothing)."""
    if moe_wide(h, i, topk):
        tail = f",{'true' if keep else 'false'},{warm}" if warm else ",true" * keep
        down = f"moe_down<{h},{i},{topk}{tail}>"
        if keep:
            return f"moe_gate_up<{h},{i},true>", down, "route_topk", "moe_admit"
        return f"moe_gate_up<{h},{i}>", down, "route_topk"
    return ("moe_gate_up_any", "moe_down_any") + (("route_topk", "moe_admit") if keep else ())


def qkv_rope_launch(
    rows: int, n: int, k: int, head_dim: int, tensor_cores: bool
) -> tuple[str, int, int] | None:
    """(instantiation, blocks, threads per block) of ``gemv_mma`` with q/k RMSNorm, RoPE and the KV write
    fused into its end, for the q/k/v projection [n, k] (with the input norm) of heads of ``head_dim``; None
    where the projection does not take ``gemv_mma`` (`gemv_launch`), and `Kernels.qkv_rope` launches the
    projection and ``qk_norm_rope_kv`` one after the other. The projection sums as `Kernels.gemv` does."""
    expr, blocks, threads = gemv_launch(rows, n, k, True, tensor_cores)
    if not expr.startswith("gemv_mma<"):
        return None
    return f"{expr[:-1]},{head_dim}>", blocks, threads


def head_gemv_shapes(vocab: int, hidden: int) -> list[tuple[int, int, bool]]:
    """(out features, reduction, fused norm) of the GEMV a head launches on a window's rows: the LM head on
    rows already normalised. The decode graphs compile it with their own kernels (`decode_expressions`), so
    that no window waits for a compile."""
    return [(vocab, hidden, False)]


def mtp_gemv_shapes(vocab: int, hidden: int) -> list[tuple[int, int, bool]]:
    """The GEMVs beside the MTP head's layer on every draft window: its input projections (the norm fused)
    and the shared LM head."""
    return [(hidden, hidden, True), *head_gemv_shapes(vocab, hidden)]


def decode_expressions(
    args: ModelArgs,
    mlp_widths: Iterable[int],
    gemv_shapes: Iterable[tuple[int, int, bool]] = (),
    tensor_cores: bool = True,
    max_rows: int = MAX_WINDOW_ROWS,
    attention_tc: bool | None = None,
    keep: bool = False,
    warm: L2Warm | None = None,
) -> list[str]:
    """Every instantiation of kernels.cu that windows of 1 to ``max_rows`` rows through layers of these
    shapes (and a head) launch: the decode graphs compile them all before the first window
    (`strata_runtime.cuda.decode.CudaLayers`). ``mlp_widths``: the widths of the layers' dense MLPs or
    shared experts; ``gemv_shapes``: (out features, reduction, fused norm) of further GEMVs on the same rows
    (the LM head on normalised rows, the MTP head's input projections). ``attention_tc``: whether attention
    may run on tensor cores (``model.decode_attention``; None: where ``tensor_cores``). ``keep``: the layers'
    expert cache keeps its misses (`moe_expressions`). ``warm``: how the expert kernels warm L2 (None: the
    policy in force, `l2_warm_in_force`)."""
    a = args
    warm = l2_warm_in_force() if warm is None else warm
    attention_tc = tensor_cores if attention_tc is None else attention_tc
    h, q = a.hidden_size, a.num_attention_heads * a.head_dim
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    widths = set(mlp_widths)
    out = ["add_rmsnorm", "qk_norm_rope_kv", "silu_mul", "add_scaled", "argmax_part", "argmax_merge"]
    out += ["choose_rows", "distribution_rows", "adjust_logits", "count_tokens", "gemv_any", *SPLIT_KERNELS]
    out += ["inverse_cdf_rows", "verify_sampled_rows", "mask_logits"]
    out += attention_expressions(a.head_dim, a.num_attention_heads // a.num_key_value_heads, attention_tc)
    if a.num_experts:
        out += moe_expressions(h, a.moe_intermediate_size, a.num_experts_per_tok, keep)
        if warm.rows:  # the engine's windows of up to warm.rows rows warm L2
            out += moe_expressions(h, a.moe_intermediate_size, a.num_experts_per_tok, keep, warm.mode(1))[1:2]
    # (out features, reduction, fused norm) of every projection: q/k/v, output, router, the dense MLP or
    # shared expert (gate/up, down, gate), and the LM head.
    shapes = [(qkv, h, True), (h, q, False), (a.vocab_size, h, True), (1, h, True)]
    shapes += [(a.num_experts, h, True)] if a.num_experts else []
    shapes += [(2 * w, h, True) for w in sorted(widths)] + [(h, w, False) for w in sorted(widths)]
    shapes += list(gemv_shapes)
    for rows in range(1, max_rows + 1):
        out += [gemv_expression(rows, n, k, norm, tensor_cores) for n, k, norm in shapes]
        rope = qkv_rope_launch(rows, qkv, h, a.head_dim, tensor_cores)
        out += [rope[0]] if rope is not None else []
    return out


def prefill_expressions(grouped: bool) -> list[str]:
    """The instantiations of kernels.cu the prefill path launches between its cuBLAS products; ``grouped``:
    whether the experts run as grouped products (grouped.cu) rather than gathered and scattered here."""
    out = ["rmsnorm_half", "add_rmsnorm", "route_topk", "softmax_causal", "silu_mul_half"]
    out += ["qk_norm_rope_split", "add_scaled"]
    return out + ([] if grouped else ["moe_group", "moe_scatter_rows", "moe_gather_add"])


PDL_KERNELS = frozenset(
    {
        "gemv_wide",
        "gemv_mma",
        "gemv_split",
        "gemv_any",
        "add_rmsnorm",
        "qk_norm_rope_kv",
        "attn_split",
        "attn_tc",
        "moe_gate_up",
        "moe_down",
        "moe_gate_up_any",
        "moe_down_any",
        "moe_admit",
        "route_topk",
        "silu_mul",
        "add_scaled",
    }
)
"""The kernels of kernels.cu that wait for the kernel before them (``STRATA_PDL_WAIT``) before they read
what it wrote, so they may launch with programmatic dependent launch (`strata_runtime.cuda.pdl`)."""


PDL_ROWS = frozenset({1})
"""Row counts whose decode graphs (`strata_runtime.cuda.decode`) launch their kernels with programmatic
dependent launch (`strata_runtime.cuda.pdl`): on an H200 a one-row window ran 5% faster end to end with it,
and the graphs of 2 to 8 rows 2-3% slower."""
