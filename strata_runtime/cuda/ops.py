"""Launchers for the decode kernels in ``kernels.cu``, on CuPy arrays with preallocated outputs; which
instantiation and grid each launch takes is `strata_runtime.cuda.choices`'.

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
from typing import Any

import numpy as np

from strata_cfg.schema.windows import decode_attention_partials

from ..backend import Array, cupy_module
from ..models.ops import locked_cache
from . import pdl
from .choices import (
    ATTENTION_WIDE_ROWS,
    CHOOSE_GATHER,
    CHOOSE_PREP_BYTES,
    PDL_KERNELS,
    THREADS,
    WARPS_PER_BLOCK,
    argmax_slices,
    attention_counters,
    attention_on_tensor_cores,
    attention_scratch_size,
    attention_shape,
    attention_split_in_force,
    attention_tc_carveout,
    attention_tc_shared_bytes,
    gemv_expression,
    gemv_i8_launch,
    gemv_launch,
    in_force,
    l2_warm_in_force,
    moe_expressions,
    qkv_rope_launch,
)
from .compile import KernelCache, source

_SOURCE = source("kernels.cu")
_NULL = np.uint64(0)  # a null pointer argument


def _tally(experts: Any) -> tuple[Any, Any, Any]:
    """The counting arguments of an expert-routing kernel: ``experts``' tier codes, counts and misses where
    it has counters (an expert cache), else null pointers (the kernel counts nothing)."""
    if experts is None or experts.counts is None:
        return _NULL, _NULL, _NULL
    return experts.slot_of, experts.counts, experts.misses


NO_ROPE = (*(_NULL,) * 7, np.int32(0), np.int32(0), np.int32(0), np.float32(0), _NULL)
"""``gemv_mma``'s arguments after ``eps`` where it fuses no RoPE (`Kernels.qkv_rope`)."""


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


_PROGRAMMATIC: contextvars.ContextVar[bool] = contextvars.ContextVar("strata_pdl", default=False)
"""Whether this thread launches the `PDL_KERNELS` with programmatic dependent launch now."""


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
        self._pdl_fns: dict[str, pdl.PdlKernel] = {}
        self._carveouts: dict[str, int] = {}
        self._device_id = device.id
        self._sm_shared: int | None = None

    def programmatic(self, on: bool = True) -> contextlib.AbstractContextManager[None]:
        """Launch the kernels of `PDL_KERNELS` with PDL in this block (on this thread), where ``on`` and
        the device allow it. The decode path captures one-row windows so (`strata_runtime.cuda.decode`)."""
        return in_force(_PROGRAMMATIC, on and self.pdl)

    @property
    def sm_shared(self) -> int:
        """Bytes of shared memory an SM of this device has (`attention_tc_carveout`), read once."""
        if self._sm_shared is None:
            device = cupy_module().cuda.Device(self._device_id)
            self._sm_shared = int(device.attributes["MaxSharedMemoryPerMultiprocessor"])
        return self._sm_shared

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

    def gemv_i8(self, q: Array, scale: Array, x: Array, out: Array) -> None:
        """out[R, N] = (x[R, K] @ q[N, K].T) * scale[N]: q int8, scale, x and out fp32; at most
        `MAX_WINDOW_ROWS` rows, K a multiple of 16 (`gemv_i8_launch`)."""
        n, k = q.shape
        expr, blocks, threads = gemv_i8_launch(x.shape[0], n)
        self.fn(expr)((blocks,), (threads,), (q, scale, x, out, np.int32(n), np.int32(k)))

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
        launch = qkv_rope_launch(rows, n, k, d, self.tensor_cores)
        if launch is None:
            self.gemv(w, x, qkv, norm=norm, eps=eps)
            self.qk_norm_rope_kv(qkv, q_norm, k_norm, pos, slot, q_out, k_cache, v_cache, theta, eps)
            return
        sizes = (np.int32(n_q), np.int32(n_kv), np.int32(t), np.float32(theta))
        rope = (q_norm, k_norm, pos, slot, q_out, k_cache, v_cache, *sizes, done)
        args = (w, x, qkv, np.int32(n), np.int32(0), norm, np.float32(eps), *rope)
        expr, blocks, threads = launch
        self.fn(expr)((blocks,), (threads,), args)

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
            split = attention_split_in_force()
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
        warm: Array | None = None,
    ) -> None:
        """Route and run the experts: resid[R, H] += sum_j wts[r, j] * expert_{idx[r, j]}(x'[r]).

        x': x normalised by ``norm`` ([H] fp16); logits: [R, E] router logits (softmax in fp32, top-k, ties
        to the lower index, renormalised over the k when ``norm_topk``). ``experts`` (a
        `strata_runtime.cuda.experts.LayerExperts`): ``gate_up`` and ``down`` [E] uint64, the addresses of
        each expert's gate/up [2I, H] and down [H, I] fp16 (in VRAM or in mapped host memory); with
        ``counts`` [E] fp32 set, each assignment is added to ``counts`` and, when ``slot_of`` [E] int32 is
        negative for its expert (not in VRAM), to ``misses[0]``, and when below -1 (a helper slot) to
        ``misses[1]`` ([2] fp32). idx [R, k] int32 and wts [R, k] fp32 receive the routing; h_buf:
        [R * k, I] fp32 scratch. With ``keep`` set (a `strata_runtime.cuda.experts.Keep`: the cache keeps
        its misses), the window is routed first and ``moe_admit`` picks the slots the experts it reads from
        host memory are written into as the expert kernels read them.

        Shapes the wide kernels take (H and I multiples of 256, k <= 16) are routed first (``route_topk``),
        and their gate/up products run in order of expert (``moe_gate_up``), so that an expert several rows
        share is read from memory about once. Each assignment's sums do not depend on the window: a row
        gets the same bits in any window.

        ``warm``: weights the next kernels read (the next layer's q/k/v), which the down products bring into
        L2 where the policy in force covers the window (`l2_warm_in_force`, `L2Warm.mode`: another
        instantiation of the down kernel; the wide kernels only; values do not change).
        """
        rows, h = x.shape
        topk = idx.shape[1]
        n_exp, inter = logits.shape[1], h_buf.shape[1]
        if n_exp > 256:
            raise ValueError(f"the expert kernels route at most 256 experts, not {n_exp}")
        tally = _tally(experts)
        a = rows * topk
        keep = getattr(experts, "keep", None)
        warm_mode = l2_warm_in_force().mode(rows) if warm is not None else 0
        gu_expr, down_expr, *_ = moe_expressions(h, inter, topk, keep is not None, warm_mode)
        tiles = (math.ceil(inter / WARPS_PER_BLOCK), a)
        blocks_d = (math.ceil(rows * h / WARPS_PER_BLOCK),)
        gu, down = experts.gate_up, experts.down
        if a > THREADS and (keep is not None or gu_expr != "moe_gate_up_any"):
            raise ValueError(f"the expert kernels take at most {THREADS} assignments a window, not {a}")
        kept_gu = kept_dn = (_NULL, _NULL)
        if keep is not None:  # routed first, so that the admission sees the window's experts
            self.route_topk(logits, norm_topk, idx, wts)
            self.fn("moe_admit")((1,), (THREADS,), (keep.state, np.int32(keep.layer), idx, np.int32(a)))
            kept_gu, kept_dn = (keep.fill, keep.slot_gate_up), (keep.fill, keep.slot_down)
        if gu_expr == "moe_gate_up_any":
            common = (logits, np.int32(n_exp), np.int32(topk), np.int32(norm_topk), np.float32(eps))
            self.fn(gu_expr)(
                tiles,
                (THREADS,),
                (gu, x, norm, *common, np.int32(h), np.int32(inter), h_buf, idx, wts, *tally, *kept_gu),
            )
            dims = (np.int32(rows), np.int32(topk), np.int32(h), np.int32(inter))
            self.fn(down_expr)(blocks_d, (THREADS,), (down, h_buf, idx, wts, *dims, resid, *kept_dn))
            return
        if keep is None:
            self.route_topk(logits, norm_topk, idx, wts)
        self.fn(gu_expr)(
            (a, tiles[0]),
            (THREADS,),
            (gu, x, norm, idx, np.int32(a), np.int32(topk), np.float32(eps), h_buf, *tally, *kept_gu),
        )
        heat = (
            (warm, np.int32(warm.nbytes // 128)) if warm is not None and warm_mode else (_NULL, np.int32(0))
        )
        args = (down, h_buf, idx, wts, np.int32(rows), resid, *kept_dn, *heat)
        self.fn(down_expr)(blocks_d, (THREADS,), args)

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
        log_min_p: Array | None = None,
    ) -> None:
        """out[R] (int64) = each row's chosen token of logits [R, V]: the argmax where inv_temp [R] is 0,
        else the draw at uniform [R] (fp32) from the tempered weights of the tokens that stay after top_k [R]
        (int32, 0: none), the min-p cut ``log_min_p`` [R] (fp32 ln(min_p), minus infinity or None: none)
        and top_p [R] (fp32, 1: none) (``choose_rows`` of kernels.cu).

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
        lmp = log_min_p if log_min_p is not None else _NULL
        if split and gather and argmax_slices(v) > 1:
            cuts = (inv_temp, 0.0, top_k, 0, top_p, 1.0, log_min_p, -math.inf)
            prep = self._split_prep(logits, *cuts, cap, scratch)
            merge = (logits, np.int32(v), inv_temp, top_k, top_p, uniform, out, cap, prep, lmp)
            self.fn("choose_split_rows")((rows,), (1024,), merge)
            return
        args = (logits, np.int32(v), inv_temp, top_k, top_p, uniform, out, cap, lmp)
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
        log_min_p: Array | None,
        m0: float,
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
            log_min_p if log_min_p is not None else _NULL,
            np.float32(m0),
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
        log_min_p: float = -math.inf,
    ) -> None:
        """out [R, V] (float64) = the distribution `choose` draws each row of logits [R, V] (fp32, contiguous)
        from, at one ``inv_temp`` (1 / temperature), ``top_k`` (0: none), ``top_p`` (1: none) and min-p cut
        ``log_min_p`` (ln(min_p) as a float32, minus infinity: none) for every row: the same cuts and float32
        weights exp((l - max l) * inv_temp) of the staying tokens, over their sum in float64
        (``distribution_rows`` of kernels.cu). ``gather``, ``split`` and ``scratch`` as for `choose`; split,
        the row's values are written by slices in parallel too (``distribution_split_write``)."""
        rows, v = logits.shape
        if tuple(out.shape) != (rows, v) or out.dtype != np.float64:
            raise ValueError(f"distribution out {out.shape} {out.dtype}: float64 {(rows, v)} wanted")
        cap = np.int32(CHOOSE_GATHER if gather else 0)
        if split and gather and argmax_slices(v) > 1:
            cuts = (None, inv_temp, None, top_k, None, top_p, None, log_min_p)
            prep = self._split_prep(logits, *cuts, cap, scratch)
            settings = (np.float32(inv_temp), np.int32(top_k), np.float32(top_p), cap)
            merge = (logits, np.int32(v), *settings, prep, np.float32(log_min_p))
            self.fn("distribution_split_rows")((rows,), (1024,), merge)
            nb = np.int32(argmax_slices(v))
            self.fn("distribution_split_write")((int(nb), rows), (256,), (logits, np.int32(v), nb, prep, out))
            return
        settings = (np.float32(inv_temp), np.int32(top_k), np.float32(top_p), cap)
        self.fn("distribution_rows")(
            (rows,), (1024,), (logits, np.int32(v), *settings, out, np.float32(log_min_p))
        )

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
        repetition: Array | None = None,
    ) -> None:
        """Rows ``rows`` [A] (int64) of logits [R, V] (fp32), in place, after their slots' logit bias and
        penalties (``adjust_logits`` of kernels.cu; the rule: `strata_runtime.models.ops.adjust`): ``slot``
        [A] (int64), ``frequency``, ``presence`` and ``repetition`` [A] (float64; None: 1) per adjusted row;
        ``counts`` [S, V] (int32) and ``bias`` [S, V] (float64) per slot. With ``tokens`` (int64), row a also
        counts ``extra_count[a]`` (int32, at most 8) of them from ``extra_from[a]`` (int64) on."""
        _, v = logits.shape
        blocks = (max(1, min(64, math.ceil(v / 1024))), int(rows.shape[0]))
        extra = (_NULL, _NULL, _NULL) if tokens is None else (tokens, extra_from, extra_count)
        rep = repetition if repetition is not None else _NULL
        args = (logits, np.int32(v), rows, slot, counts, bias, frequency, presence, *extra, rep)
        self.fn("adjust_logits")(blocks, (256,), args)

    def mask_logits(self, logits: Array, rows: Array, bits: Array) -> None:
        """Rows ``rows`` [M] (int64) of logits [R, V] (fp32), in place: minus infinity for each token whose
        bit is clear in the row's packed mask ``bits`` [M, W] (uint32, token t at bit t % 32 of word t // 32:
        a grammar's allowed tokens, ``mask_logits`` of kernels.cu)."""
        _, v = logits.shape
        m, w = bits.shape
        if m:
            blocks = (max(1, min(64, math.ceil(v / 1024))), int(m))
            self.fn("mask_logits")(blocks, (256,), (logits, np.int32(v), rows, bits, np.int32(w)))

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


@locked_cache
def kernels_for(device_id: int) -> Kernels:
    """The kernel set of CUDA device ``device_id`` (compiled functions are per context)."""
    with cupy_module().cuda.Device(device_id):
        return Kernels()
