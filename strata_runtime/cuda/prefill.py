"""The CUDA prefill path: prompt chunks longer than ``memory.prompt_graph_rows`` through a stage's layers.

A long chunk is compute-bound, so its products run on tensor cores in fp16 with fp32 accumulation: the
q/k/v and output projections and the router on cuBLAS, and the routed experts as one grouped product per
projection over every expert the chunk routes to (`strata_runtime.cuda.grouped`). Rows are grouped by expert
on the device and the products' grids are sized for the worst routing, so nothing is read back to the host
and the host queues the whole chunk's layers ahead of the GPU. The products find each expert through the
layer's address tables, as the decode kernels do: under an expert cache, an expert in a VRAM slot is read
there, one in a helper slot over the peer link and one in host memory over the host link, once per tile of
its rows, and the routing kernel counts each assignment into the cache's device counters. (For a model
whose widths are not multiples of 8 the experts run as cuBLAS products instead, sized on the host once per
layer: two batched products over [E, C, H] groups, C = the most rows any expert got, or under an expert
cache one product per expert, reading it where it is or copying it from host memory first.) Attention is
one fused kernel (`strata_runtime.cuda.flash`: tensor cores, online softmax, no score matrix in memory), one
launch per slot's segment of the window; for head dims it lacks, cuBLAS products over tiles of query rows
whose fp32 scores and fp16 probabilities fit in `strata_cfg.schema.windows.ATTENTION_TILE_BYTES` (the bound
the resolver plans the workspace by).

Everything between the products (norms, q/k norm with RoPE and the KV write, routing, causal softmax,
SwiGLU, scatter and gather) is a kernel of `kernels.cu`, shared where possible with the decode path so that
both read the same weights with the same rules. The residual stream, the attention scores and the router
logits are fp32; products read fp16 and accumulate in fp32 (`strata_runtime.cuda.blas`).

Letters: n rows of the chunk, H hidden, N query heads, K kv heads, G = N / K, D head dim, L keys,
E experts, k experts per row, C rows per expert group, I expert width.
"""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np

from strata_cfg.schema.windows import attention_tile_rows, prefill_graph_rows_for

from ..backend import device_lock, upload_into
from ..experts.cache import HOST
from ..layout import Layout, Segment
from ..reference.flash import HEAD_DIMS
from ..reference.grouped import max_tiles, supported
from .blas import capturing, matmul_nn, matmul_nt
from .choices import padded_keys, prefill_expressions
from .compile import record_graph_build
from .experts import ExpertSlice
from .flash import flash_kernels_for, flash_prefill, kernel_expr, sm_shared_bytes
from .grouped import grouped_kernels_for
from .layers import LayerStack, LayerWeights

Rows = tuple[cp.ndarray, cp.ndarray]
"""A chunk's rows as the routing bias reads them: each row's position and slot [n] int32."""


class Temps:
    """A chunk's temporaries, each allocated once for all its layers: the layers' kernels run in stream
    order, so a layer's temporaries are free for the next layer once its kernels are queued. The prefill
    path is launched from Python, layer by layer, and for a short chunk that host time is its whole cost;
    a fresh ``cupy.empty`` for each of a layer's 15 temporaries took about a seventh of it. They stay
    allocated until the next chunk: the plan's workspace counts them name by name
    (`strata_cfg.resolve.sizes.prefill_temp_row_bytes`), which tests/test_rt_prefill_workspace.py holds
    them to."""

    def __init__(self) -> None:
        self._arrays: dict[str, cp.ndarray] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: Any) -> cp.ndarray:
        """The temporary ``name`` of ``shape`` and ``dtype``, uninitialised (allocated on first use, or when
        a layer asks for another shape)."""
        a = self._arrays.get(name)
        if a is None or a.shape != shape or a.dtype != dtype:
            a = self._arrays[name] = cp.empty(shape, dtype)
        return a


class Arena(Temps):
    """Temporaries that keep their addresses, for chunks replayed as CUDA graphs: each name is a view of one
    flat buffer, grown when a chunk asks for more than it holds. Growing moves the buffer, which every graph
    captured before then reads, so `generation` counts the moves and a graph captured in an older one is
    captured again. Chunks of every size share the buffers (the graphs never run at once: they are queued on
    one stream), so the arena holds one chunk's temporaries, of the largest graph's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def __call__(self, name: str, shape: tuple[int, ...], dtype: Any) -> cp.ndarray:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        flat = self._arrays.get(name)
        if flat is None or flat.size < size:
            flat = self._arrays[name] = cp.empty(size, cp.uint8)
            self.generation += 1
        return flat[:size].view(dtype).reshape(shape)


class GraphInputs:
    """What a prefill graph of ``rows`` rows reads that changes from chunk to chunk, at fixed addresses: the
    residual rows [rows, H] fp32 (the chunk's, then zero rows of padding), each row's position and slot
    [rows] int32, and the chunk's {slot, first position} [2] int32 for the attention kernel."""

    def __init__(self, rows: int, hidden: int) -> None:
        self.resid = cp.empty((rows, hidden), cp.float32)
        self.pos = cp.empty(rows, cp.int32)
        self.slot = cp.empty(rows, cp.int32)
        self.where = cp.empty(2, cp.int32)

    def load(self, resid: cp.ndarray, seg: Segment) -> Layout:
        """Queue the chunk's rows ``resid`` [n, H] of segment ``seg`` into these inputs, padded with zero rows
        at the positions after it; returns the padded chunk's layout."""
        rows, n = self.resid.shape[0], resid.shape[0]
        padded = Layout((Segment(seg.slot, 0, rows, seg.pos),))
        upload_into(self.pos, padded.positions().astype(np.int32))
        upload_into(self.slot, padded.row_slots().astype(np.int32))
        upload_into(self.where, np.array([seg.slot, seg.pos], np.int32))
        self.resid[:n] = resid
        self.resid[n:] = 0
        return padded


class CudaPrefill:
    """Long prefill chunks through the layers (and KV) of a `LayerStack`."""

    def __init__(
        self,
        stack: LayerStack,
        flash: bool = True,
        experts: ExpertSlice | None = None,
        grouped: bool = True,
        split_q: bool = True,
        graph_rows: int = 0,
    ) -> None:
        """``flash``: attention through the fused kernel of `strata_runtime.cuda.flash` where it has the head
        dim; otherwise (or with False) through cuBLAS products over materialised scores. ``grouped``: the
        routed experts through the grouped kernels of `strata_runtime.cuda.grouped` where the model's shape
        allows; otherwise (or with False) through cuBLAS products over groups padded to the largest, whose
        size is read on the host. ``experts``: the
        stage's expert cache, when its experts do not all fit (the grouped kernels then read each expert
        where the cache's tables say it is, and the routing counts into its counters). ``split_q``:
        the flash kernel reads q as two fp16 parts (False: q_hi alone, fp16 q; see
        `strata_runtime.cuda.flash`). ``graph_rows``: a chunk of one slot's rows that pads to at most this
        many (`strata_cfg.schema.windows.prefill_graph_rows_for`) is replayed as a CUDA graph, captured
        when a chunk of its padded size first runs (0: never; only with the fused attention and the
        grouped expert kernels, and every expert in VRAM)."""
        self.stack, self.args, self.kern = stack, stack.args, stack.kern
        self.experts = experts if experts is not None and experts.store.cached else None
        self._sparse_index = {
            j: n for n, j in enumerate(j for j, lay in enumerate(stack.layers) if lay.router is not None)
        }
        self._staging: tuple[cp.ndarray, cp.ndarray] | None = None
        self._temps = Temps()  # the current chunk's (`run` starts a new one)
        self.device_id = stack.device_id
        self.flash = flash and self.args.head_dim in HEAD_DIMS
        self.split_q = split_q
        a = self.args
        self.grouped = (
            grouped_kernels_for(self.device_id)
            if grouped and supported(a.hidden_size, a.moe_intermediate_size, a.num_experts)
            else None
        )
        """The grouped expert kernels, where the model's shape allows them (`strata_runtime.cuda.grouped`)."""
        if self.grouped is not None:
            self.grouped.prepare_all()
        if self.flash:
            expr = kernel_expr(self.args.head_dim, split_q, sm_shared_bytes(self.device_id))
            flash_kernels_for(self.device_id).prepare([expr])
        with cp.cuda.Device(self.device_id):
            # The router in fp32, so that routing reads fp32 rows as the decode kernels do (a flipped
            # top-k choice would change a row's output far more than rounding elsewhere does).
            self.router32 = [
                lay.router.astype(cp.float32) if lay.router is not None else None for lay in stack.layers
            ]
        self.kern.prepare(prefill_expressions(self.grouped is not None))
        graphs = self.flash and self.grouped is not None and self.experts is None
        self.graph_rows = graph_rows if graphs else 0
        """The most rows of a chunk replayed as a graph (0: none)."""
        self._arena = Arena()
        self._graphs: dict[int, tuple[int, Any]] = {}  # rows -> (the arena's generation, graph)
        self._inputs: dict[int, GraphInputs] = {}
        self._capture_stream: Any = None

    def graph_for(self, layout: Layout) -> int | None:
        """The rows of the graph that reads a chunk of ``layout``, or None where it runs eagerly: several
        slots' rows, more rows than `graph_rows`, or padding that would reach past the cache's positions."""
        if not self.graph_rows or len(layout.segments) != 1:
            return None
        rows = prefill_graph_rows_for(layout.rows)
        if rows > self.graph_rows or layout.segments[0].pos + rows > self.stack.context:
            return None
        return rows

    @property
    def captured(self) -> frozenset[int]:
        """The row counts whose chunks replay a captured graph."""
        return frozenset(rows for rows, (gen, _) in self._graphs.items() if gen == self._arena.generation)

    def forward(self, hidden: Any, layout: Layout) -> cp.ndarray:
        """The chunk's hidden rows [n, H] after these layers (fp32), writing their KV."""
        with cp.cuda.Device(self.device_id):
            resid = cp.array(hidden, dtype=cp.float32)  # [n, H]
            self.run(resid, layout)
            return resid

    def run(self, resid: cp.ndarray, layout: Layout) -> None:
        """Every layer on ``resid`` [n, H] fp32, in place: as a replayed graph where `graph_for` gives one,
        else launched layer by layer."""
        rows = self.graph_for(layout)
        if rows is not None:
            self._run_graph(resid, layout, rows)
            return
        pos = cp.empty(layout.rows, cp.int32)  # [n]
        upload_into(pos, layout.positions().astype(np.int32))
        slot = cp.empty(layout.rows, cp.int32)  # [n]
        upload_into(slot, layout.row_slots().astype(np.int32))
        self._temps = Temps()
        self._layers(resid, layout, pos, slot)

    def _layers(
        self, resid: cp.ndarray, layout: Layout, pos: cp.ndarray, slot: cp.ndarray, where: Any = None
    ) -> None:
        """Every layer on ``resid``, its rows at ``pos``/``slot`` [n] int32 on the device; ``where``: a
        graph's {slot, first position} (its layout is then one segment, whose numbers are not read)."""
        for j, lay in enumerate(self.stack.layers):
            self._attention(j, lay, resid, layout, pos, slot, where)
            self._mlp(j, lay, resid, (pos, slot))

    def _run_graph(self, resid: cp.ndarray, layout: Layout, rows: int) -> None:
        """The chunk through the graph of ``rows`` rows, padded with rows after it (their results are
        dropped; the keys and values they write lie past the chunk, where its next chunk or its decode
        windows write before anything reads them). The first chunk of a size, or the first after the arena
        grew, runs once eagerly (which loads the products' kernels and sizes the arena), is captured, and
        then replays the graph like every later chunk: cuBLAS may choose other kernels while it captures,
        so a chunk's bits never depend on whether its graph existed yet."""
        inputs = self._inputs.get(rows)
        if inputs is None:
            inputs = self._inputs[rows] = GraphInputs(rows, self.args.hidden_size)
        seg = layout.segments[0]
        padded = inputs.load(resid, seg)
        self._temps = self._arena
        stream = cp.cuda.get_current_stream()
        generation, graph = self._graphs.get(rows, (-1, None))
        if graph is None or generation != self._arena.generation:
            record_graph_build()
            args = (inputs.resid, padded, inputs.pos, inputs.slot, inputs.where)
            self._layers(*args)
            if self._capture_stream is None:
                self._capture_stream = cp.cuda.Stream(non_blocking=True)
            stream.synchronize()
            cap = self._capture_stream
            # no other thread frees this GPU's memory meanwhile; the products call cuBLAS itself
            with device_lock(self.device_id), cap, capturing():
                cap.begin_capture()
                self._layers(*args)
                graph = cap.end_capture()
            self._graphs[rows] = (self._arena.generation, graph)
            inputs.load(resid, seg)  # the eager run left its output there
        graph.launch(stream)
        resid[...] = inputs.resid[: resid.shape[0]]

    # ---- attention -------------------------------------------------------------------------------

    def _attention(
        self,
        j: int,
        lay: LayerWeights,
        resid: cp.ndarray,
        layout: Layout,
        pos: cp.ndarray,
        slot: cp.ndarray,
        where: Any = None,
    ) -> None:
        a, kern = self.args, self.kern
        n_rows, h = resid.shape
        nq, nkv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        g = nq // nkv
        kc, vc = self.stack.k_cache[j], self.stack.v_cache[j]  # [S, K, T, D]
        t = self._temps
        x = t("x", (n_rows, h), cp.float16)
        kern.rms_norm_fp32_to_half(resid, lay.ln1, x, a.rms_norm_eps)
        qkv = matmul_nt(x, lay.qkv, t("qkv", (n_rows, lay.qkv.shape[0]), cp.float32))  # [n, (N + 2K) D]
        # q as two fp16 parts, q = hi + lo: fp16 alone would move a score by |score| * 2^-11, which for
        # the large scores of sharp heads changes their weights by percents; the split keeps q's fp32
        # precision for one more product over the keys. Without split_q the flash kernel reads hi alone
        # (the products over materialised scores, for other head dims, always take both parts).
        hi, lo = t("q_hi", (n_rows, nq, d), cp.float16), t("q_lo", (n_rows, nq, d), cp.float16)
        kern.qk_norm_rope_split(
            qkv, lay.q_norm, lay.k_norm, pos, slot, hi, lo, kc, vc, a.rope_theta, a.rms_norm_eps
        )
        out = t("attn", (n_rows, nq * d), cp.float16)  # [n, N D]
        scale = 1.0 / math.sqrt(d)
        if self.flash:  # each segment is one slot's consecutive positions
            for seg in layout.segments:
                rows = slice(seg.row, seg.row + seg.n)
                q_lo = lo[rows] if self.split_q else None
                flash_prefill(hi[rows], q_lo, kc, vc, seg.slot, seg.pos, scale, out[rows], where=where)
            matmul_nt(out, lay.o, resid, beta=1.0)  # resid [n, H] += out @ o^T
            return
        for seg in layout.segments:
            n = seg.n
            # [K, n G, D]: the G query heads of each KV head, row r = query row r // G.
            parts = [
                cp.ascontiguousarray(
                    p[seg.row : seg.row + n].reshape(n, nkv, g, d).transpose(1, 0, 2, 3)
                ).reshape(nkv, n * g, d)
                for p in (hi, lo)
            ]
            tile = attention_tile_rows(nq, seg.pos + n)
            for i0 in range(0, n, tile):
                i1 = min(n, i0 + tile)
                m, end = (i1 - i0) * g, seg.pos + i1  # keys past the tile's last row are all masked
                keys, values = kc[seg.slot, :, :end], vc[seg.slot, :, :end]  # [K, L, D] each
                ld = padded_keys(end)
                scores = cp.empty((nkv, m, ld), cp.float32)[:, :, :end]
                for beta, part in enumerate(parts):
                    matmul_nt(part[:, i0 * g : i1 * g], keys, scores, alpha=scale, beta=float(beta))
                probs = cp.empty((nkv, m, ld), cp.float16)[:, :, :end]
                kern.softmax_causal(scores, probs, seg.pos + i0, g)
                del scores
                o = matmul_nn(probs, values, cp.empty((nkv, m, d), cp.float16))  # [K, t G, D]
                o = o.reshape(nkv, i1 - i0, g, d).transpose(1, 0, 2, 3).reshape(i1 - i0, nq * d)
                out[seg.row + i0 : seg.row + i1] = o
        matmul_nt(out, lay.o, resid, beta=1.0)  # resid [n, H] += out @ o^T

    # ---- MLP: routed experts, shared expert, dense MLP ------------------------------------------

    def _mlp(self, j: int, lay: LayerWeights, resid: cp.ndarray, rows: Rows) -> None:
        """The layer's MLP on ``resid`` in place."""
        a, kern, t = self.args, self.kern, self._temps
        n_rows, h = resid.shape
        x = t("x", (n_rows, h), cp.float16)
        kern.rms_norm_fp32_to_half(resid, lay.ln2, x, a.rms_norm_eps)
        dense = gate = None
        if lay.mlp_gate_up is not None:  # read before the experts add to the residual
            assert lay.mlp_down is not None
            width = lay.mlp_down.shape[1]
            gu = matmul_nt(x, lay.mlp_gate_up, t("mlp_gu", (n_rows, 2 * width), cp.float16))
            hid = t("mlp_hid", (n_rows, width), cp.float16)
            kern.silu_mul_half(gu, hid)
            dense = matmul_nt(hid, lay.mlp_down, t("mlp_out", (n_rows, h), cp.float32))  # [n, H]
            if lay.shared_gate is not None:
                gate = matmul_nt(x, lay.shared_gate, t("gate", (n_rows, 1), cp.float32)).reshape(n_rows)
        if lay.router is not None:
            self._experts(j, lay, x, resid, rows)
        if dense is not None:
            kern.add_scaled(resid, dense, gate)

    def _route(
        self, j: int, lay: LayerWeights, x: cp.ndarray, resid: cp.ndarray, rows: Rows
    ) -> tuple[cp.ndarray, cp.ndarray]:
        """Route the chunk's rows: idx and wts [n, k]. ``rows``: each row's position and slot. Under an expert
        cache the routing counts each assignment into the cache's counters, by the tier that serves it."""
        pos, slot = rows
        a, kern = self.args, self.kern
        n_rows, h = x.shape
        topk = a.num_experts_per_tok
        t = self._temps
        xf = t("xf", (n_rows, h), cp.float32)
        kern.add_rms_norm_fp32(resid, None, lay.ln2, xf, a.rms_norm_eps)
        router = self.router32[j]
        assert router is not None  # only sparse layers route
        logits = matmul_nt(xf, router, t("logits", (n_rows, router.shape[0]), cp.float32))  # [n, E] fp32
        if lay.router_bias is not None:  # calibrated synthetic routing: the rows' intended experts
            lay.router_bias(logits, pos, slot)
        idx = t("idx", (n_rows, topk), cp.int32)
        wts = t("wts", (n_rows, topk), cp.float32)
        kern.route_topk(logits, a.norm_topk_prob, idx, wts, lay.experts)
        return idx, wts

    def _experts(self, j: int, lay: LayerWeights, x: cp.ndarray, resid: cp.ndarray, rows: Rows) -> None:
        """Every routed expert of the chunk: the grouped products where the model's shape allows (wherever
        each expert is), else two batched products over [E, C, H] groups (every expert resident) or one
        product per expert (under an expert cache)."""
        idx, wts = self._route(j, lay, x, resid, rows)
        if self.grouped is not None:
            self._grouped_experts(lay, x, idx, wts, resid)
        elif lay.gate_up is not None:
            self._padded_experts(lay, x, idx, wts, resid)
        else:
            self._cached_experts(j, x, idx, wts, resid)

    def _grouped_experts(
        self, lay: LayerWeights, x: cp.ndarray, idx: cp.ndarray, wts: cp.ndarray, resid: cp.ndarray
    ) -> None:
        """The routed experts as one grouped product per projection over the tiles `moe_tiles` cuts on the
        device (`strata_runtime.cuda.grouped`): no host read, and each weight read once per tile of rows,
        from where the layer's tables say it is."""
        assert self.grouped is not None and lay.experts is not None
        kern, n_exp, t = self.grouped, self.args.num_experts, self._temps
        n_assign, topk, h = idx.size, idx.shape[1], x.shape[1]
        rank, order = t("rank", (n_assign,), cp.int32), t("order", (n_assign,), cp.int32)
        tiles, n_tiles = t("tiles", (max_tiles(n_assign, n_exp), 4), cp.int32), t("n_tiles", (1,), cp.int32)
        kern.moe_tiles(idx, n_exp, rank, order, tiles, n_tiles)
        hid = t("hid", (n_assign, self.args.moe_intermediate_size), cp.float16)  # [A, I] by place
        kern.moe_gate_up(x, lay.experts, order, tiles, n_tiles, topk, hid)
        ys = t("ys", (n_assign, h), cp.float16)  # [A, H] by assignment
        kern.moe_down(hid, lay.experts, order, tiles, n_tiles, ys)
        kern.moe_combine(ys, wts, resid)

    def _padded_experts(
        self, lay: LayerWeights, x: cp.ndarray, idx: cp.ndarray, wts: cp.ndarray, resid: cp.ndarray
    ) -> None:
        """Every expert in two batched products over [E, C, H] groups, C read on the host."""
        kern = self.kern
        n_exp, h = self.args.num_experts, x.shape[1]
        assert lay.gate_up is not None and lay.down is not None
        rank = cp.empty(idx.shape, cp.int32)
        most = cp.empty(1, cp.int32)
        self.kern.moe_group(idx, n_exp, rank, most)
        c = int(most.get()[0])  # the one host read of the layer: the group size
        xs = cp.empty((n_exp, c, h), cp.float16)  # [E, C, H]; unused rows are never read back
        kern.moe_scatter_rows(x, idx, rank, xs)
        inter = lay.down.shape[2]
        gu = matmul_nt(xs, lay.gate_up, cp.empty((n_exp, c, 2 * inter), cp.float16))  # [E, C, 2I]
        hid = cp.empty((n_exp, c, inter), cp.float16)
        kern.silu_mul_half(gu.reshape(n_exp * c, 2 * inter), hid.reshape(n_exp * c, inter))
        ys = matmul_nt(hid, lay.down, cp.empty((n_exp, c, h), cp.float16))  # [E, C, H]
        kern.moe_gather_add(ys, idx, rank, wts, resid)

    def _cached_experts(
        self, j: int, x: cp.ndarray, idx: cp.ndarray, wts: cp.ndarray, resid: cp.ndarray
    ) -> None:
        """The routed experts under an expert cache where the grouped kernels do not take the model's shape:
        one product per expert a row routes to, reading it from its VRAM slot or its helper slot (cuBLAS
        reads the helper GPU's memory over the peer link), or copying it from host memory into a staging
        buffer first (on the same stream, so the copy lands before its product and after the previous
        product read the buffer). The chunk's assignments are sorted by expert into one [A, H] block, so the
        temporaries are as large as the assignments whatever the skew of the routing."""
        assert self.experts is not None
        self.experts.owner.learn_now()  # this path reads the host's tables
        store = self.experts.store
        n_exp, (n_rows, h) = self.args.num_experts, x.shape
        topk, inter = self.args.num_experts_per_tok, self.args.moe_intermediate_size
        js = self._store_layer(j)
        flat = idx.reshape(-1)  # [A] each assignment's expert, in (row, choice) order
        order = cp.argsort(flat, kind="stable")  # [A] assignments grouped by expert
        sizes = cp.bincount(flat, minlength=n_exp).get()  # [E]: the layer's one host read
        xs = x[order // topk]  # [A, H] fp16, each expert's rows together
        ys = cp.empty_like(xs)  # [A, H]
        start = 0
        for e in np.flatnonzero(sizes).tolist():
            n = int(sizes[e])
            if store.tier(js, e) == HOST:
                gate_up, down = self._stage(*store.host_weights(js, e))
            else:
                gate_up, down = store.slot_weights(js, e)
            gu = matmul_nt(xs[start : start + n], gate_up, cp.empty((n, 2 * inter), cp.float16))  # [n, 2I]
            hid = cp.empty((n, inter), cp.float16)
            self.kern.silu_mul_half(gu, hid)
            matmul_nt(hid, down, ys[start : start + n])  # [n, H]
            start += n
        y = cp.empty_like(ys)
        y[order] = ys  # back to (row, choice) order
        resid += (y.reshape(n_rows, topk, h).astype(cp.float32) * wts[:, :, None]).sum(axis=1)  # [n, H]

    def _store_layer(self, j: int) -> int:
        """The expert store's index of this stack's layer ``j`` (a sparse layer)."""
        assert self.experts is not None
        return self.experts.first + self._sparse_index[j]

    def _stage(self, gate_up: np.ndarray, down: np.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        """Copy one expert's host weights into the staging buffers (allocated once, one expert's size)."""
        if self._staging is None:
            self._staging = (cp.empty(gate_up.shape, cp.float16), cp.empty(down.shape, cp.float16))
        stream = cp.cuda.get_current_stream()
        self._staging[0].set(gate_up, stream=stream)
        self._staging[1].set(down, stream=stream)
        return self._staging
