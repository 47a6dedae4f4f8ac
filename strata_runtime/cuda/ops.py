"""Launchers for the decode kernels in ``kernels.cu``, on CuPy arrays with preallocated outputs.

No launcher here allocates device memory, so every call can be captured into a CUDA graph: scratch comes
from the caller (`argmax_scratch` makes the argmax's, outside any capture). Each launcher has a
NumPy reference of the same name and signature in `strata_runtime.reference.kernels`; the gpu tests compare
them. Template instantiations are compiled on first use, or all at once with `Kernels.prepare` before capture.

Shapes use the letters of kernels.cu: R rows, H hidden, N out features, K reduction, E experts, A = R * topk.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from strata_cfg.schema.windows import (
    DECODE_ATTENTION_CHUNK,
    DECODE_ATTENTION_TC_SPLITS,
    MAX_WINDOW_ROWS,
    decode_attention_counters,
    decode_attention_on_tensor_cores,
    decode_attention_partials,
    decode_attention_scratch_floats,
)

from ..backend import Array, cupy_module
from . import pdl
from .compile import KernelCache, source

if TYPE_CHECKING:
    from ..models.qwen3_moe import ModelArgs

T = TypeVar("T")
_SOURCE = source("kernels.cu")
WARPS_PER_BLOCK = 8
THREADS = WARPS_PER_BLOCK * 32
ATTN_CHUNK = DECODE_ATTENTION_CHUNK  # positions per attention block; kernels.cu's ATTN_CHUNK
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims ``attn_split`` takes: a warp's lanes split evenly into groups of D / 8."""
_NULL = np.uint64(0)  # a null pointer argument


def _tally(experts: Any) -> tuple[Any, Any, Any]:
    """The counting arguments of an expert-routing kernel: ``experts``' tier codes, counts and misses where
    it has counters (an expert cache), else null pointers (the kernel counts nothing)."""
    if experts is None or experts.counts is None:
        return _NULL, _NULL, _NULL
    return experts.slot_of, experts.counts, experts.misses


NO_ROPE = (*(_NULL,) * 7, np.int32(0), np.int32(0), np.int32(0), np.float32(0), _NULL)
"""``gemv_mma``'s arguments after ``eps`` where it fuses no RoPE (`Kernels.qkv_rope`)."""


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
def _in_force(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
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
    return _in_force(_ATTENTION_SPLIT, split)


def attention_on_tensor_cores(head_dim: int, group: int, tensor_cores: bool = True) -> bool:
    """Whether decode attention of this head dim and group of query heads per KV head runs ``attn_tc`` (else
    ``attn_split``): a shape its m16n8k16 products take (`decode_attention_on_tensor_cores`), on a GPU with
    tensor cores where the plan asks for them (``model.decode_attention``). It depends on the model and the
    plan alone, so every window of a model runs the same kernel."""
    return tensor_cores and decode_attention_on_tensor_cores(head_dim, group)


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


def argmax_scratch(xp: Any, rows: int, vocab: int) -> tuple[Any, Any]:
    """The scratch `Kernels.argmax` writes for ``rows`` rows of ``vocab`` logits, allocated with array module
    ``xp``: each slice's largest logit [R, S] (fp32) and its index [R, S] (int32)."""
    nb = argmax_slices(vocab)
    return xp.empty((rows, nb), np.float32), xp.empty((rows, nb), np.int32)


def choose_scratch(xp: Any, rows: int, vocab: int) -> tuple[Any, Any, Any]:
    """The scratch a split `Kernels.choose` or `Kernels.distribution` writes for ``rows`` rows of ``vocab``
    logits, allocated with array module ``xp`` (outside any capture): the slices' maxima and their indices
    (as `argmax_scratch`) and each row's ChoosePrep (`CHOOSE_PREP_BYTES`)."""
    part_v, part_i = argmax_scratch(xp, rows, vocab)
    return part_v, part_i, xp.empty(rows * CHOOSE_PREP_BYTES // 8, np.uint64)


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


def gemv_expression(rows: int, n: int, k: int, norm: bool, tensor_cores: bool) -> str:
    """The instantiation `Kernels.gemv` launches (`gemv_launch`)."""
    return gemv_launch(rows, n, k, norm, tensor_cores)[0]


@dataclass(frozen=True)
class QkvForm:
    """How the q/k/v projection's fused kernel (``gemv_mma`` with RoPE, `Kernels.qkv_rope`) runs. Every form
    computes the same sums in the same order, so each gives the same bits.

    * ``staged``: each warp's weight units after its first round of registers land in dynamic shared memory
      (``cp.async``), issued with the first round before the kernel waits for the one before it, so a block
      has all its weights in flight at once instead of loading its second round after the first is used.
      Where a warp has more than one round (the 30B preset's 5120 x 2048 projection: 128 KiB a block).
    * ``paired``: each head's two blocks run as a thread-block cluster (``gemv_mma_pair``, compute
      capability 9.0 and later) and read each other's half of the head from shared memory, instead of the
      last of the two reading the whole head back through L2 after a counter. Where a block holds half a
      head (64 features of a 128-wide head).

    The engine runs the default, `QKV_FORM` (neither); a benchmark times the others inside `qkv_form`.
    Written and parsed as ``plain``, ``staged``, ``paired`` or ``staged+paired``."""

    staged: bool = False
    paired: bool = False

    def __str__(self) -> str:
        return "+".join(n for n, on in (("staged", self.staged), ("paired", self.paired)) if on) or "plain"

    @classmethod
    def parse(cls, text: str) -> QkvForm:
        if text == "plain":
            return cls()
        names = text.split("+")
        if not set(names) <= {"staged", "paired"} or len(set(names)) != len(names):
            raise ValueError(f"q/k/v form {text!r}: expected plain, staged, paired or staged+paired")
        return cls(staged="staged" in names, paired="paired" in names)


QKV_FORM = QkvForm()
"""The q/k/v kernel's form the engine runs."""
_QKV_FORM: contextvars.ContextVar[QkvForm] = contextvars.ContextVar("strata_qkv_form", default=QKV_FORM)
"""The form `Kernels.qkv_rope` launches on this thread now: the default outside `qkv_form`."""


def qkv_form(form: QkvForm) -> contextlib.AbstractContextManager[None]:
    """Launch the q/k/v projection in ``form`` in this block (on this thread). For benchmarks."""
    return _in_force(_QKV_FORM, form)


@dataclass(frozen=True)
class MoeForm:
    """How the routed experts' kernels (``moe_gate_up``, ``moe_down``) find the chosen experts' weights.
    Plain, each block reads the window's routing and then the chosen experts' addresses, two round trips
    to memory after it waits before its first weight load. With ``tables``, it reads the layer's whole
    address table (one address an expert) beside the routing, one round trip. The sums are the same, so
    the bits are. The engine runs the default, `MOE_FORM` (plain); a benchmark times the other inside
    `moe_form`. Written and parsed as ``plain`` or ``tables``."""

    tables: bool = False

    def __str__(self) -> str:
        return "tables" if self.tables else "plain"

    @classmethod
    def parse(cls, text: str) -> MoeForm:
        if text not in ("plain", "tables"):
            raise ValueError(f"expert form {text!r}: expected plain or tables")
        return cls(tables=text == "tables")


MOE_FORM = MoeForm()
"""The expert kernels' form the engine runs."""
_MOE_FORM: contextvars.ContextVar[MoeForm] = contextvars.ContextVar("strata_moe_form", default=MOE_FORM)
"""The form `Kernels.moe` launches on this thread now: the default outside `moe_form`."""


def moe_form(form: MoeForm) -> contextlib.AbstractContextManager[None]:
    """Launch the routed experts' kernels in ``form`` in this block (on this thread). For benchmarks."""
    return _in_force(_MOE_FORM, form)


MMA_GROUP = 2
"""Units of a warp's reduction ``gemv_mma`` holds in registers at a time (its ``GROUP``)."""


@dataclass(frozen=True)
class QkvLaunch:
    """The fused q/k/v kernel's launch (`qkv_rope_launch`): its instantiation, blocks, threads per block
    and dynamic shared memory in bytes."""

    expression: str
    blocks: int
    threads: int
    shared_bytes: int = 0


def qkv_rope_launch(
    rows: int,
    n: int,
    k: int,
    head_dim: int,
    tensor_cores: bool,
    form: QkvForm = QKV_FORM,
    clusters: bool = False,
    shared_limit: int | None = None,
) -> QkvLaunch | None:
    """The launch of ``gemv_mma`` with q/k RMSNorm, RoPE and the KV write fused into its end, for the q/k/v
    projection [n, k] (with the input norm) of heads of ``head_dim``, in ``form`` on a device with
    thread-block clusters or not; None where the projection does not take ``gemv_mma`` (`gemv_launch`), and
    `Kernels.qkv_rope` launches the projection and ``qk_norm_rope_kv`` one after the other. The projection
    sums as `Kernels.gemv` does. Raises ValueError for a form that these shapes or the device cannot run
    (``shared_limit``: the bytes of shared memory a block may take on it, where known)."""
    expr, blocks, threads = gemv_launch(rows, n, k, True, tensor_cores)
    if not expr.startswith("gemv_mma<"):
        if form != QKV_FORM:
            raise ValueError(
                f"q/k/v form {form}: the projection [{n}, {k}] does not run on tensor cores here"
            )
        return None
    tiles, warps = gemv_mma_shape(n, k)
    features, j = 16 * tiles, 4 // tiles
    per = -(-(k // (32 * j)) // warps)  # units of 32 j a warp sums
    shared = 0
    if form.staged:
        if per <= MMA_GROUP or per % MMA_GROUP:
            raise ValueError(
                f"q/k/v form {form}: a warp of [{n}, {k}] sums {per} units, not whole rounds after a first "
                f"of {MMA_GROUP}, so none can be staged"
            )
        shared = (per - MMA_GROUP) * tiles * j * 2 * warps * 32 * 16  # 16 bytes a lane a piece
        # the block's static arrays: its warps' sums and squares, and with paired its outputs
        static = 4 * (warps * features * (rows + 1) + warps * rows + rows * features) + 64
        if shared_limit is not None and shared + static > shared_limit:
            raise ValueError(
                f"q/k/v form {form}: staging [{n}, {k}] takes {(shared + static) // 1024} KiB of shared "
                f"memory a block at {rows} rows, more than the device's {shared_limit // 1024}"
            )
    name = "gemv_mma"
    if form.paired:
        if not clusters:
            raise ValueError(f"q/k/v form {form}: thread-block clusters need compute capability 9.0")
        if head_dim != 2 * features:
            raise ValueError(
                f"q/k/v form {form}: a block holds {features} features, not half a head of {head_dim}"
            )
        name = "gemv_mma_pair"
    stage = f",{MMA_GROUP}" if form.staged else ""
    body = expr[len("gemv_mma<") : -1]
    return QkvLaunch(f"{name}<{body},{head_dim}{stage}>", blocks, threads, shared)


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
) -> list[str]:
    """Every instantiation of kernels.cu that windows of 1 to ``max_rows`` rows through layers of these
    shapes (and a head) launch: the decode graphs compile them all before the first window
    (`strata_runtime.cuda.decode.CudaLayers`). ``mlp_widths``: the widths of the layers' dense MLPs or
    shared experts; ``gemv_shapes``: (out features, reduction, fused norm) of further GEMVs on the same rows
    (the LM head on normalised rows, the MTP head's input projections). ``attention_tc``: whether attention
    may run on tensor cores (``model.decode_attention``; None: where ``tensor_cores``)."""
    a = args
    attention_tc = tensor_cores if attention_tc is None else attention_tc
    h, q = a.hidden_size, a.num_attention_heads * a.head_dim
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    widths = set(mlp_widths)
    out = ["add_rmsnorm", "qk_norm_rope_kv", "silu_mul", "add_scaled", "argmax_part", "argmax_merge"]
    out += ["choose_rows", "distribution_rows", "adjust_logits", "count_tokens", "gemv_any", *SPLIT_KERNELS]
    out += ["inverse_cdf_rows", "verify_sampled_rows"]
    out += Kernels.attn_exprs(a.head_dim, a.num_attention_heads // a.num_key_value_heads, attention_tc)
    if a.num_experts:
        out += Kernels.moe_exprs(h, a.moe_intermediate_size, a.num_experts_per_tok)
    # (out features, reduction, fused norm) of every projection: q/k/v, output, router, the dense MLP or
    # shared expert (gate/up, down, gate), and the LM head.
    shapes = [(qkv, h, True), (h, q, False), (a.vocab_size, h, True), (1, h, True)]
    shapes += [(a.num_experts, h, True)] if a.num_experts else []
    shapes += [(2 * w, h, True) for w in sorted(widths)] + [(h, w, False) for w in sorted(widths)]
    shapes += list(gemv_shapes)
    for rows in range(1, max_rows + 1):
        out += [gemv_expression(rows, n, k, norm, tensor_cores) for n, k, norm in shapes]
        rope = qkv_rope_launch(rows, qkv, h, a.head_dim, tensor_cores)
        out += [rope.expression] if rope is not None else []
    return out


def prefill_expressions(grouped: bool) -> list[str]:
    """The instantiations of kernels.cu the prefill path launches between its cuBLAS products; ``grouped``:
    whether the experts run as grouped products (grouped.cu) rather than gathered and scattered here."""
    out = ["rmsnorm_half", "add_rmsnorm", "route_topk", "softmax_causal", "silu_mul_half"]
    out += ["qk_norm_rope_split", "add_scaled"]
    return out + ([] if grouped else ["moe_group", "moe_scatter_rows", "moe_gather_add"])


_PROGRAMMATIC: contextvars.ContextVar[bool] = contextvars.ContextVar("strata_pdl", default=False)
"""Whether this thread launches the `PDL_KERNELS` with programmatic dependent launch now."""

PDL_KERNELS = frozenset(
    {
        "gemv_wide",
        "gemv_mma",
        "gemv_mma_pair",
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


class Kernels(KernelCache):
    """The launchers of ``kernels.cu`` on one device, over its compiled functions. Create it with that device
    current.

    Inside a `programmatic` block, where the device and driver allow (`strata_runtime.cuda.pdl.available`),
    the kernels of `PDL_KERNELS` launch with programmatic dependent launch: each may start while the one
    before it finishes.
    """

    def __init__(self) -> None:
        super().__init__(_SOURCE)
        device = cupy_module().cuda.Device()
        self.pdl = pdl.available(device.id)
        self.tensor_cores = int(device.compute_capability) >= 80
        """Whether the projections run on tensor cores (``gemv_mma``), and decode attention may."""
        self.clusters = int(device.compute_capability) >= 90
        """Whether kernels may run as thread-block clusters (`QkvForm`'s ``paired``)."""
        self._pdl_fns: dict[str, pdl.PdlKernel] = {}
        self._carveouts: dict[str, int] = {}
        self._device_id = device.id
        self._sm_shared: int | None = None

    def programmatic(self, on: bool = True) -> contextlib.AbstractContextManager[None]:
        """Launch the kernels of `PDL_KERNELS` with PDL in this block (on this thread), where ``on`` and
        the device allow it. The decode path captures one-row windows so (`strata_runtime.cuda.decode`)."""
        return _in_force(_PROGRAMMATIC, on and self.pdl)

    @property
    def sm_shared(self) -> int:
        """Bytes of shared memory an SM of this device has (`attention_tc_carveout`), read once."""
        if self._sm_shared is None:
            device = cupy_module().cuda.Device(self._device_id)
            self._sm_shared = int(device.attributes["MaxSharedMemoryPerMultiprocessor"])
        return self._sm_shared

    @property
    def block_shared(self) -> int:
        """Bytes of shared memory a block of this device may take (with the function attribute set)."""
        device = cupy_module().cuda.Device(self._device_id)
        return int(device.attributes["MaxSharedMemoryPerBlockOptin"])

    def prefer_carveout(self, expression: str, percent: int) -> None:
        """Set ``expression``'s preferred shared-memory carveout (percent of an SM's), once."""
        if self._carveouts.get(expression) != percent:
            KernelCache.fn(self, expression).preferred_shared_memory_carveout = percent
            self._carveouts[expression] = percent

    def allow_shared(self, expression: str, shared_bytes: int) -> None:
        """Let ``expression``'s blocks take ``shared_bytes`` of dynamic shared memory (past the default 48
        KiB only with the function attribute set), once per size. The attribute is the compiled function's,
        so the launcher `fn` gives (with PDL or not) has it too."""
        if self._shared.get(expression) != shared_bytes:
            KernelCache.fn(self, expression).max_dynamic_shared_size_bytes = shared_bytes
            self._shared[expression] = shared_bytes

    def fn(self, expression: str) -> Any:
        """The launcher of ``expression``: with PDL inside a `programmatic` block where it may take it,
        else CuPy's."""
        if not _PROGRAMMATIC.get() or expression.split("<")[0] not in PDL_KERNELS:
            return super().fn(expression)
        launcher = self._pdl_fns.get(expression)
        if launcher is None:
            launcher = self._pdl_fns[expression] = pdl.PdlKernel(super().fn(expression))
        return launcher

    # ---- expression names -----------------------------------------------------------------------

    def gemv_expr(self, rows: int, n: int, k: int, norm: bool) -> str:
        """The instantiation `gemv` launches for ``rows`` rows through weights [n, k] on this device."""
        return gemv_expression(rows, n, k, norm, self.tensor_cores)

    @staticmethod
    def moe_exprs(h: int, i: int, topk: int, form: MoeForm = MOE_FORM) -> tuple[str, ...]:
        """The instantiations `moe` launches for these shapes in ``form``, at any row count. The narrow
        kernels (``..._any``) take the plain form only."""
        if _wide(h) and _wide(i) and topk <= 16:
            flag = ",true" if form.tables else ""
            return f"moe_gate_up<{h},{i}{flag}>", f"moe_down<{h},{i},{topk}{flag}>", "route_topk"
        if form != MOE_FORM:
            raise ValueError(f"expert form {form}: widths {h} and {i} take the narrow kernels, plain only")
        return "moe_gate_up_any", "moe_down_any"

    @staticmethod
    def attn_exprs(head_dim: int, group: int, tensor_cores: bool = True) -> tuple[str, ...]:
        """The instantiations `attention` launches for these shapes, at any row count."""
        if attention_on_tensor_cores(head_dim, group, tensor_cores):
            return (f"attn_tc<{head_dim},{group},1>", f"attn_tc<{head_dim},{group},0>")
        few, many = (attention_shape(head_dim, group, rows) for rows in (1, ATTENTION_WIDE_ROWS + 1))
        shapes = dict.fromkeys((few, many))
        return tuple(f"attn_split<{head_dim},{group},{b},{w}>" for b, w in shapes)

    # ---- launchers -------------------------------------------------------------------------------

    def gemv(
        self,
        w: Array,
        x: Array,
        out: Array,
        accumulate: bool = False,
        norm: Array | None = None,
        eps: float = 1e-6,
    ) -> None:
        """out[R, N] (+)= x'[R, K] @ w[N, K].T; w fp16, x and out fp32.

        x' is x, or with ``norm`` ([K] fp16) the RMS-normalised x * norm * rsqrt(mean(x^2) + eps).
        """
        n, k = w.shape
        rows = x.shape[0]
        nw = norm if norm is not None else _NULL
        expr, blocks, threads = gemv_launch(rows, n, k, norm is not None, self.tensor_cores)
        if expr == "gemv_any":
            sizes = (np.int32(rows), np.int32(n), np.int32(k))
            args: tuple[Any, ...] = (w, x, out, *sizes, np.int32(accumulate))
        else:
            args = (w, x, out, np.int32(n), np.int32(accumulate))
        rope = NO_ROPE if expr.startswith("gemv_mma<") else ()
        self.fn(expr)((blocks,), (threads,), (*args, nw, np.float32(eps), *rope))

    def qkv_rope(
        self,
        w: Array,
        x: Array,
        qkv: Array,
        norm: Array,
        eps: float,
        q_norm: Array,
        k_norm: Array,
        pos: Array,
        slot: Array,
        q_out: Array,
        k_cache: Array,
        v_cache: Array,
        theta: float,
        done: Array,
    ) -> None:
        """The q/k/v projection with its input norm, then q and k normalised and rotated per head and k and
        v written into the cache at (slot, position): `gemv` into ``qkv`` [R, (NQ + 2 NKV) D] and
        `qk_norm_rope_kv`, in one kernel where the projection runs on tensor cores (`qkv_rope_launch`).
        ``done``: [NQ + 2 NKV] int32, zero before the first launch (the kernel leaves it at zero)."""
        n, k = w.shape
        rows = x.shape[0]
        _, n_q, d = q_out.shape
        _, n_kv, t, _ = k_cache.shape
        form = _QKV_FORM.get()
        limit = self.block_shared if form.staged else None
        launch = qkv_rope_launch(rows, n, k, d, self.tensor_cores, form, self.clusters, limit)
        if launch is None:
            self.gemv(w, x, qkv, norm=norm, eps=eps)
            self.qk_norm_rope_kv(qkv, q_norm, k_norm, pos, slot, q_out, k_cache, v_cache, theta, eps)
            return
        sizes = (np.int32(n_q), np.int32(n_kv), np.int32(t), np.float32(theta))
        rope = (q_norm, k_norm, pos, slot, q_out, k_cache, v_cache, *sizes, done)
        args = (w, x, qkv, np.int32(n), np.int32(0), norm, np.float32(eps), *rope)
        if launch.shared_bytes:
            self.allow_shared(launch.expression, launch.shared_bytes)
        grid, block = (launch.blocks,), (launch.threads,)
        self.fn(launch.expression)(grid, block, args, shared_mem=launch.shared_bytes)

    def add_rms_norm_fp32(self, resid: Array, delta: Array | None, w: Array, out: Array, eps: float) -> None:
        """resid += delta (if given); out = rmsnorm(resid) * w, all in fp32: the CUDA paths' rule (the
        residual stays fp32 and nothing is rounded between the norm and the weight; the array path's
        `strata_runtime.models.ops.norm.rms_norm_in_dtype` rounds in between).

        resid, delta, out: [R, H] fp32; w: [H] fp16. The kernel is ``add_rmsnorm`` of kernels.cu.
        """
        rows, h = resid.shape
        self.fn("add_rmsnorm")(
            (rows,),
            (THREADS,),
            (resid, delta if delta is not None else _NULL, w, out, np.int32(h), np.float32(eps)),
        )

    def qk_norm_rope_kv(
        self,
        qkv: Array,
        q_norm: Array,
        k_norm: Array,
        pos: Array,
        slot: Array,
        q_out: Array,
        k_cache: Array,
        v_cache: Array,
        theta: float,
        eps: float,
    ) -> None:
        """Normalise and rotate q and k per head, write k and v into the cache at (slot, position).

        qkv: [R, (NQ + 2 NKV) D] fp32; q_out: [R, NQ, D] fp32; caches: [S, NKV, T, D] fp16;
        pos, slot: [R] int32.
        """
        rows = qkv.shape[0]
        _, n_q, d = q_out.shape
        _, n_kv, t, _ = k_cache.shape
        threads = 32 * math.ceil(d / 64)
        self.fn("qk_norm_rope_kv")(
            (rows, n_q + n_kv),
            (threads,),
            (
                qkv,
                q_norm,
                k_norm,
                pos,
                slot,
                q_out,
                k_cache,
                v_cache,
                np.int32(n_q),
                np.int32(n_kv),
                np.int32(d),
                np.int32(t),
                np.float32(theta),
                np.float32(eps),
            ),
        )

    def attention_on_tc(self, head_dim: int, group: int, tensor_cores: bool = True) -> bool:
        """Whether `attention` launches ``attn_tc`` for this shape: where the caller asks for tensor cores
        (each layer's `strata_runtime.cuda.layers.LayerWeights.attention_tc`, from ``model.decode_attention``)
        and the device and shape allow it (`attention_on_tensor_cores`). The choice is the caller's: this
        object is shared by every stack on the device."""
        return attention_on_tensor_cores(head_dim, group, self.tensor_cores and tensor_cores)

    def attention(
        self,
        q: Array,
        k_cache: Array,
        v_cache: Array,
        pos: Array,
        slot: Array,
        out: Array,
        scratch: Array,
        done: Array,
        tensor_cores: bool = True,
    ) -> None:
        """Causal decode attention of each row over positions 0..pos[r] of its slot. out: [R, NQ * D] fp32.

        One kernel: ``attn_tc`` on tensor cores where ``tensor_cores``, the device and the shape allow
        (`attention_on_tc`), else ``attn_split``. Each block (a chunk of 64 positions; with ``attn_tc``, a run
        of consecutive chunks: `ATTN_ONE_RUN_CHUNKS`, `ATTN_SHORT_SPLITS` and `ATTN_SPLITS`) writes a partial
        result to ``scratch`` (fp32, at least `attention_scratch_size` elements for the kernel that runs,
        which ``attn_tc`` keeps small at any context), and the blocks that finish last merge them (in groups
        of `DECODE_ATTENTION_MERGE_GROUP`, then the groups, for a long row), counting in ``done`` ([R,
        `attention_counters`] int32, zero before the first launch; the kernel leaves it at zero). A row of
        one run (one block) writes its output directly.
        """
        rows, n_q, d = q.shape
        _, n_kv, t, _ = k_cache.shape
        g = n_q // n_kv
        tc = self.attention_on_tc(d, g, tensor_cores)
        nc = decode_attention_partials(t, tensor_cores=tc)  # a row and head's partials, apart in the scratch
        if done.size < rows * attention_counters(n_kv, t):
            raise ValueError(
                f"attention needs {attention_counters(n_kv, t)} counters a row, got {done.shape}"
            )
        if scratch.size < attention_scratch_size(rows, n_q, n_kv, d, t, tc):
            raise ValueError(
                f"attention needs {attention_scratch_size(rows, n_q, n_kv, d, t, tc)} floats of scratch for "
                f"{rows} rows, got {scratch.size}"
            )
        acc = scratch[: rows * n_kv * nc * g * d]
        ml = scratch[rows * n_kv * nc * g * d : rows * n_kv * nc * g * (d + 2)]
        common = (
            q,
            k_cache,
            v_cache,
            pos,
            slot,
            acc,
            ml,
            done,
            out,
            np.int32(n_kv),
            np.int32(t),
            np.int32(nc),
        )
        if tc:
            few = rows <= ATTENTION_WIDE_ROWS
            expr, smem = f"attn_tc<{d},{g},{int(few)}>", attention_tc_shared_bytes(d, g)
            self.allow_shared(expr, smem)
            if few:
                self.prefer_carveout(expr, attention_tc_carveout(smem, self.sm_shared))
            scale_log2 = np.float32(math.log2(math.e) / math.sqrt(d))  # softmax in base 2
            split = _ATTENTION_SPLIT.get()
            counts = (
                np.int32(split.splits),
                np.int32(split.short_splits),
                np.int32(split.short_chunks),
                np.int32(split.one_run_chunks),
            )
            grid = (rows, n_kv, min(nc, split.splits))
            self.fn(expr)(grid, (128,), (*common, *counts, scale_log2), shared_mem=smem)
            return
        b, w = attention_shape(d, g, rows)
        self.fn(f"attn_split<{d},{g},{b},{w}>")(
            (rows, n_kv, nc), (b,), (*common, np.float32(1.0 / math.sqrt(d)))
        )

    def moe(
        self,
        x: Array,
        norm: Array,
        logits: Array,
        norm_topk: bool,
        eps: float,
        experts: Any,
        resid: Array,
        idx: Array,
        wts: Array,
        h_buf: Array,
    ) -> None:
        """Route and run the experts: resid[R, H] += sum_j wts[r, j] * expert_{idx[r, j]}(x'[r]).

        x': x normalised by ``norm`` ([H] fp16); logits: [R, E] router logits (softmax in fp32, top-k, ties
        to the lower index, renormalised over the k when ``norm_topk``). ``experts`` (a
        `strata_runtime.cuda.experts.LayerExperts`): ``gate_up`` and ``down`` [E] uint64, the addresses of
        each expert's gate/up [2I, H] and down [H, I] fp16 (in VRAM or in mapped host memory); with
        ``counts`` [E] fp32 set, each assignment is added to ``counts`` and, when ``slot_of`` [E] int32 is
        negative for its expert (not in VRAM), to ``misses[0]``, and when below -1 (a helper slot) to
        ``misses[1]`` ([2] fp32). idx [R, k] int32 and wts [R, k] fp32 receive the routing; h_buf:
        [R * k, I] fp32 scratch.

        Shapes the wide kernels take (H and I multiples of 256, k <= 16) are routed first (``route_topk``),
        and their gate/up products run in order of expert (``moe_gate_up``), so that an expert several rows
        share is read from memory about once. Each assignment's sums do not depend on the window: a row
        gets the same bits in any window.
        """
        rows, h = x.shape
        topk = idx.shape[1]
        n_exp, inter = logits.shape[1], h_buf.shape[1]
        if n_exp > 256:
            raise ValueError(f"the expert kernels route at most 256 experts, not {n_exp}")
        tally = _tally(experts)
        a = rows * topk
        gu_expr, down_expr, *_ = self.moe_exprs(h, inter, topk, _MOE_FORM.get())
        tiles = (math.ceil(inter / WARPS_PER_BLOCK), a)
        blocks_d = (math.ceil(rows * h / WARPS_PER_BLOCK),)
        gu, down = experts.gate_up, experts.down
        if gu_expr == "moe_gate_up_any":
            common = (logits, np.int32(n_exp), np.int32(topk), np.int32(norm_topk), np.float32(eps))
            self.fn(gu_expr)(
                tiles,
                (THREADS,),
                (gu, x, norm, *common, np.int32(h), np.int32(inter), h_buf, idx, wts, *tally),
            )
            self.fn(down_expr)(
                blocks_d,
                (THREADS,),
                (down, h_buf, idx, wts, np.int32(rows), np.int32(topk), np.int32(h), np.int32(inter), resid),
            )
            return
        if a > THREADS:
            raise ValueError(f"the expert kernels take at most {THREADS} assignments a window, not {a}")
        self.route_topk(logits, norm_topk, idx, wts)
        self.fn(gu_expr)(
            (a, tiles[0]),
            (THREADS,),
            (gu, x, norm, idx, np.int32(a), np.int32(topk), np.float32(eps), h_buf, *tally, np.int32(n_exp)),
        )
        down_args = (down, h_buf, idx, wts, np.int32(rows), resid, np.int32(n_exp))
        self.fn(down_expr)(blocks_d, (THREADS,), down_args)

    def silu_mul(self, gu: Array, out: Array) -> None:
        """out[R, I] = silu(gu[:, :I]) * gu[:, I:]."""
        rows, inter = out.shape
        self.fn("silu_mul")(
            (math.ceil(rows * inter / THREADS),), (THREADS,), (gu, out, np.int32(rows), np.int32(inter))
        )

    def add_scaled(self, resid: Array, y: Array, gate: Array | None = None) -> None:
        """resid += y, or resid += sigmoid(gate[r]) * y when a per-row gate [R] is given."""
        rows, h = resid.shape
        self.fn("add_scaled")(
            (math.ceil(rows * h / THREADS),),
            (THREADS,),
            (resid, y, gate if gate is not None else _NULL, np.int32(rows), np.int32(h)),
        )

    def embed(self, table: Array, ids: Array, out: Array) -> None:
        """out[R, H] = table[ids] as fp32."""
        self.fn("embed")((ids.shape[0],), (THREADS,), (table, ids, out, np.int32(table.shape[1])))

    def argmax(self, logits: Array, out: Array, scratch: tuple[Array, Array]) -> None:
        """out[R] (int32) = argmax of each row of logits [R, V] (fp32, contiguous), lowest index on ties: each
        row's `argmax_slices` slices in parallel (``argmax_part``, which writes ``scratch``, as
        `argmax_scratch` makes it), then their candidates in order (``argmax_merge``)."""
        rows, v = logits.shape
        nb = argmax_slices(v)
        part_v, part_i = scratch
        if tuple(part_v.shape) != (rows, nb) or tuple(part_i.shape) != (rows, nb):
            raise ValueError(f"argmax scratch {part_v.shape} / {part_i.shape}: {(rows, nb)} wanted")
        self.fn("argmax_part")((nb, rows), (256,), (logits, np.int32(v), np.int32(nb), part_v, part_i))
        self.fn("argmax_merge")((rows,), (32,), (part_v, part_i, np.int32(nb), out))

    def choose(
        self,
        logits: Array,
        inv_temp: Array,
        uniform: Array,
        top_k: Array,
        top_p: Array,
        out: Array,
        gather: bool = True,
        split: bool = True,
        scratch: tuple[Array, Array, Array] | None = None,
    ) -> None:
        """out[R] (int64) = each row's chosen token of logits [R, V]: the argmax where inv_temp [R] is 0,
        else the draw at uniform [R] (fp32) from the tempered weights of the tokens that stay after top_k [R]
        (int32, 0: none) and top_p [R] (fp32, 1: none) (``choose_rows`` of kernels.cu).

        With ``gather``, once at most `CHOOSE_GATHER` tokens are known to hold all that top-k or top-p can
        keep (a cut below the largest logit with k tokens, or top-p's weight, above it; or top-k's first two
        radix passes), they are gathered into shared memory, and the rest of the selection and the draw read
        only those; without, everything reads the whole row (the same token either way: the tests compare
        the two).

        With ``split`` (and ``gather``), the passes over the whole row before the gather run over slices of
        it in parallel (`_split_prep`), and one block per row does the rest (``choose_split_rows``): the same
        token as one block per row, in a fraction of the time. ``scratch`` (`choose_scratch`) is allocated
        here when None, which a graph capture must not do."""
        rows, v = logits.shape
        cap = np.int32(CHOOSE_GATHER if gather else 0)
        if split and gather and argmax_slices(v) > 1:
            prep = self._split_prep(logits, inv_temp, 0.0, top_k, 0, top_p, 1.0, cap, scratch)
            merge = (logits, np.int32(v), inv_temp, top_k, top_p, uniform, out, cap, prep)
            self.fn("choose_split_rows")((rows,), (1024,), merge)
            return
        args = (logits, np.int32(v), inv_temp, top_k, top_p, uniform, out, cap)
        self.fn("choose_rows")((rows,), (1024,), args)

    def _split_prep(
        self,
        logits: Array,
        inv_temp: Array | None,
        t0: float,
        top_k: Array | None,
        k0: int,
        top_p: Array | None,
        p0: float,
        cap: np.int32,
        scratch: tuple[Array, Array, Array] | None = None,
    ) -> Array:
        """Steps 1-3 of a split choice (kernels.cu, "a row's choice split over slices of the row") on logits
        [R, V], with per-row settings (arrays) or one for every row (the scalars, where the array is None),
        into ``scratch`` (`choose_scratch`; allocated here when None): the ChoosePrep of each row, which the
        merge kernels read."""
        rows, v = logits.shape
        nb = argmax_slices(v)
        part_v, part_i, prep = scratch if scratch is not None else choose_scratch(cupy_module(), rows, v)
        if tuple(part_v.shape) != (rows, nb) or prep.nbytes < rows * CHOOSE_PREP_BYTES:
            raise ValueError(f"choose scratch {part_v.shape} / {prep.nbytes} bytes: {(rows, nb)} wanted")
        settings = (
            inv_temp if inv_temp is not None else _NULL,
            np.float32(t0),
            top_k if top_k is not None else _NULL,
            np.int32(k0),
            top_p if top_p is not None else _NULL,
            np.float32(p0),
        )
        sizes = (np.int32(v), np.int32(nb))
        self.fn("argmax_part")((nb, rows), (256,), (logits, *sizes, part_v, part_i))
        cuts = (logits, *sizes, part_v, part_i, *settings, cap, prep)
        self.fn("choose_split_cuts")((nb, rows), (256,), cuts)
        self.fn("choose_split_gather")((nb, rows), (256,), (logits, *sizes, *settings, cap, prep))
        return prep

    def distribution(
        self,
        logits: Array,
        inv_temp: float,
        top_k: int,
        top_p: float,
        out: Array,
        gather: bool = True,
        split: bool = True,
        scratch: tuple[Array, Array, Array] | None = None,
    ) -> None:
        """out [R, V] (float64) = the distribution `choose` draws each row of logits [R, V] (fp32, contiguous)
        from, at one ``inv_temp`` (1 / temperature), ``top_k`` (0: none) and ``top_p`` (1: none) for every
        row: the same cuts and float32 weights exp((l - max l) * inv_temp) of the staying tokens, over their
        sum in float64 (``distribution_rows`` of kernels.cu). ``gather``, ``split`` and ``scratch`` as for
        `choose`; split, the row's values are written by slices in parallel too
        (``distribution_split_write``)."""
        rows, v = logits.shape
        if tuple(out.shape) != (rows, v) or out.dtype != np.float64:
            raise ValueError(f"distribution out {out.shape} {out.dtype}: float64 {(rows, v)} wanted")
        cap = np.int32(CHOOSE_GATHER if gather else 0)
        if split and gather and argmax_slices(v) > 1:
            prep = self._split_prep(logits, None, inv_temp, None, top_k, None, top_p, cap, scratch)
            settings = (np.float32(inv_temp), np.int32(top_k), np.float32(top_p), cap)
            self.fn("distribution_split_rows")((rows,), (1024,), (logits, np.int32(v), *settings, prep))
            nb = np.int32(argmax_slices(v))
            self.fn("distribution_split_write")((int(nb), rows), (256,), (logits, np.int32(v), nb, prep, out))
            return
        args = (logits, np.int32(v), np.float32(inv_temp), np.int32(top_k), np.float32(top_p), cap, out)
        self.fn("distribution_rows")((rows,), (1024,), args)

    def inverse_cdf(self, w: Array, u: Array, out: Array) -> None:
        """out[R] (int64) = the draw from each row of weights w [R, V] (float64, contiguous) at u [R]
        (float64, any stride): the first index whose cumulative weight exceeds u times the row's total
        (``inverse_cdf_rows`` of kernels.cu)."""
        rows, v = w.shape
        fine = w.dtype == np.float64 and w.flags.c_contiguous and u.dtype == np.float64 and u.shape == (rows,)
        if not (fine and out.shape == (rows,) and out.dtype == np.int64):
            raise ValueError(
                f"inverse_cdf: w {w.shape} {w.dtype}, u {u.shape} {u.dtype}, out {out.shape} {out.dtype} "
                f"where w [{rows}, {v}] float64 (contiguous), u [{rows}] float64 and out [{rows}] int64 are "
                "wanted"
            )
        stride = np.int32(u.strides[0] // 8)
        self.fn("inverse_cdf_rows")((rows,), (1024,), (w, np.int32(v), u, stride, out))

    def verify_sampled(
        self, p: Array, q: Array, tokens: Array, uniforms: Array, accepted: Array, first: Array
    ) -> None:
        """Speculative rejection sampling of S slots of n rows (``verify_sampled_rows`` of kernels.cu): p
        [S n, V] and q [S (n - 1), V] (float64, contiguous), tokens [S n] (int64), uniforms [S, >= n]
        (float64, rows at any stride, contiguous within); accepted [S] and first [S] (int64) = each slot's
        proposals kept and the token after them."""
        s = int(uniforms.shape[0])
        n = int(tokens.shape[0]) // max(s, 1)
        v = int(p.shape[-1])
        shapes = (
            (p, (s * n, v), np.float64),
            (q, (s * (n - 1), v), np.float64),
            (tokens, (s * n,), np.int64),
        )
        for a, shape, dtype in shapes:
            if tuple(a.shape) != shape or a.dtype != dtype or not a.flags.c_contiguous:
                raise ValueError(
                    f"verify_sampled: {a.shape} {a.dtype} where {shape} {np.dtype(dtype)} is wanted"
                )
        if uniforms.dtype != np.float64 or uniforms.shape[1] < n or uniforms.strides[1] != 8:
            raise ValueError(
                f"verify_sampled: uniforms {uniforms.shape} {uniforms.dtype}: [{s}, >= {n}] float64"
            )
        stride = np.int32(uniforms.strides[0] // 8)
        args = (p, q, tokens, uniforms, stride, np.int32(n), np.int32(v), accepted, first)
        self.fn("verify_sampled_rows")((s,), (1024,), args)

    def adjust_logits(
        self,
        logits: Array,
        rows: Array,
        slot: Array,
        counts: Array,
        bias: Array,
        frequency: Array,
        presence: Array,
        tokens: Array | None = None,
        extra_from: Array | None = None,
        extra_count: Array | None = None,
    ) -> None:
        """Rows ``rows`` [A] (int64) of logits [R, V] (fp32), in place, after their slots' logit bias and
        penalties (``adjust_logits`` of kernels.cu; the rule: `strata_runtime.models.ops.adjust`): ``slot``
        [A] (int64), ``frequency`` and ``presence`` [A] (float64) per adjusted row; ``counts`` [S, V] (int32)
        and ``bias`` [S, V] (float64) per slot. With ``tokens`` (int64), row a also counts ``extra_count[a]``
        (int32, at most 8) of them from ``extra_from[a]`` (int64) on."""
        _, v = logits.shape
        blocks = (max(1, min(64, math.ceil(v / 1024))), int(rows.shape[0]))
        extra = (_NULL, _NULL, _NULL) if tokens is None else (tokens, extra_from, extra_count)
        args = (logits, np.int32(v), rows, slot, counts, bias, frequency, presence, *extra)
        self.fn("adjust_logits")(blocks, (256,), args)

    def count_tokens(self, counts: Array, slot: Array, tokens: Array, add: Array) -> None:
        """counts[slot[i], tokens[i]] += add[i]: counts [S, V] int32; slot, tokens int64 and add int32 [n]."""
        n = int(tokens.shape[0])
        if n:
            args = (counts, np.int32(counts.shape[1]), slot, tokens, add, np.int32(n))
            self.fn("count_tokens")((math.ceil(n / 256),), (256,), args)

    # ---- prefill pieces (long chunks; the products run on cuBLAS) ---------------------------------

    def rms_norm_fp32_to_half(self, x: Array, w: Array, out: Array, eps: float) -> None:
        """out[R, H] (fp16) = rmsnorm(x) * w computed in fp32 and rounded once to fp16 (the prefill
        products' input); x fp32, w fp16. The kernel is ``rmsnorm_half`` of kernels.cu."""
        rows, h = x.shape
        self.fn("rmsnorm_half")((rows,), (THREADS,), (x, w, out, np.int32(h), np.float32(eps)))

    def qk_norm_rope_split(
        self,
        qkv: Array,
        q_norm: Array,
        k_norm: Array,
        pos: Array,
        slot: Array,
        q_hi: Array,
        q_lo: Array,
        k_cache: Array,
        v_cache: Array,
        theta: float,
        eps: float,
    ) -> None:
        """`qk_norm_rope_kv` for the prefill path: q written as two fp16 parts, q_hi = fp16(q) and q_lo =
        fp16(q - q_hi), each [R, NQ, D], for the flash kernel. Head dims up to 256."""
        rows = qkv.shape[0]
        _, n_q, d = q_hi.shape
        _, n_kv, t, _ = k_cache.shape
        if d > 256:
            raise ValueError(f"q_hi: head dim {d} is more than 256")
        args = (qkv, q_norm, k_norm, pos, slot, q_hi, q_lo, k_cache, v_cache)
        dims = (rows, n_q, n_kv, d, t)
        self.fn("qk_norm_rope_split")(
            (math.ceil(rows * (n_q + n_kv) / 8),),
            (THREADS,),
            (*args, *(np.int32(v) for v in dims), np.float32(theta), np.float32(eps)),
        )

    def route_topk(self, logits: Array, norm_topk: bool, idx: Array, wts: Array, experts: Any = None) -> None:
        """idx[R, k] (int32), wts[R, k] (fp32): each row's top-k experts of logits [R, E] fp32, by the rule of
        `moe` (softmax in fp32, ties to the lower index, renormalised over the k when ``norm_topk``).
        ``experts`` (a `strata_runtime.cuda.experts.LayerExperts`): where it has counters (an expert
        cache), each assignment is counted there as `moe` counts it."""
        rows, n_exp = logits.shape
        topk = idx.shape[1]
        tally = _tally(experts)
        self.fn("route_topk")(
            (rows,),
            (THREADS,),
            (logits, np.int32(n_exp), np.int32(topk), np.int32(norm_topk), idx, wts, *tally),
        )

    def softmax_causal(self, scores: Array, probs: Array, pos: int, group: int) -> None:
        """probs [B, R, L] fp16 = the causal softmax of scores [B, R, L] fp32, where row r is query row
        r // group at position pos + r // group and sees keys [0, that position]; zeros beyond. Both may be
        views of wider buffers whose rows are ``ld`` apart, ld a multiple of 4 (`padded_keys`)."""
        b, rows, length = scores.shape
        ld = scores.strides[1] // scores.itemsize
        if ld % 4 or probs.strides[1] // probs.itemsize != ld or scores.strides[0] != rows * ld * 4:
            raise ValueError("scores and probs need the same row stride, a multiple of 4, rows packed")
        self.fn("softmax_causal")(
            (rows, b),
            (THREADS,),
            (scores, probs, np.int32(rows), np.int32(length), np.int32(ld), np.int32(pos), np.int32(group)),
        )

    def moe_group(self, idx: Array, n_exp: int, rank: Array, most: Array) -> None:
        """rank[a]: a place for assignment a of idx [R, k] within its expert's group (0..count-1, any
        order); most[0]: the largest group. int32 throughout; at most 256 experts."""
        self.fn("moe_group")((1,), (1024,), (idx, np.int32(idx.size), np.int32(n_exp), rank, most))

    def silu_mul_half(self, gu: Array, out: Array) -> None:
        """out[M, I] = silu(gu[:, :I]) * gu[:, I:], fp16 in and out."""
        m, inter = out.shape
        blocks = math.ceil(m * inter / THREADS)
        self.fn("silu_mul_half")((blocks,), (THREADS,), (gu, out, np.int64(m), np.int32(inter)))

    def moe_scatter_rows(self, x: Array, idx: Array, rank: Array, xs: Array) -> None:
        """xs[idx[a], rank[a]] = x[a // k] for each assignment a of idx [R, k]; x [R, H] and xs [E, C, H]
        are fp16."""
        rows, topk = idx.shape
        _, c, h = xs.shape
        self.fn("moe_scatter_rows")(
            (rows * topk,), (THREADS,), (x, idx, rank, xs, np.int32(topk), np.int32(c), np.int32(h))
        )

    def moe_gather_add(self, ys: Array, idx: Array, rank: Array, wts: Array, resid: Array) -> None:
        """resid[r] += sum_j wts[r, j] * ys[idx[r, j], rank[r, j]], j in order; ys [E, C, H] fp16."""
        rows, topk = idx.shape
        _, c, h = ys.shape
        self.fn("moe_gather_add")(
            (rows,), (THREADS,), (ys, idx, rank, wts, resid, np.int32(topk), np.int32(c), np.int32(h))
        )


@cache
def kernels_for(device_id: int) -> Kernels:
    """The kernel set of CUDA device ``device_id`` (compiled functions are per context)."""
    with cupy_module().cuda.Device(device_id):
        return Kernels()
