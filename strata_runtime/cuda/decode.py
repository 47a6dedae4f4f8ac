"""The CUDA decode path: windows of at most 8 rows through a stage's layers as one replayed CUDA graph.

A 48-layer MoE decode step is several hundred small kernels; launched one by one from Python each costs
several microseconds, so a window would be bound by launch overhead rather than by reading weights. Here
each row count R gets its own CUDA graph per stage, captured on first reuse and replayed after that; the
rows' positions and slots are device data, so one graph serves every window of R rows.

The residual stream stays fp32 across a stage's layers. Weights are the stage's own arrays (fp16): q/k/v
and gate/up are fused into one matrix each at build time by the layer modules themselves
(`Attention.fuse_qkv`, `MLP.fuse_gate_up`), which then hold views of the fused copy, so no weight is held
twice. Longer prefill chunks take `strata_runtime.cuda.prefill`.

Dimension letters as in kernels.cu: R rows, H hidden, N query heads, K kv heads, D head dim, E experts,
I expert width, S slots, T context, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np

from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..layout import Layout
from ..models.qwen3_moe import MLP, DecoderLayer, ModelArgs, SparseMoeBlock
from .blas import matmul_nt
from .ops import Kernels, attention_scratch_size, kernels_for


def supported(args: ModelArgs, dtype: Any, kv_dtype: Any) -> str | None:
    """Why the CUDA path cannot run a model of these shapes and dtypes, or None when it can."""
    if np.dtype(dtype) != np.float16:
        return f"weights are {np.dtype(dtype)}, the kernels read float16"
    if np.dtype(kv_dtype) != np.float16:
        return f"the KV cache is {np.dtype(kv_dtype)}, the kernels write float16"
    if args.attention_bias:
        return "attention biases are not in the kernels"
    if args.num_experts > 256:
        return f"{args.num_experts} experts; the routing kernel handles at most 256"
    if args.head_dim % 16 or args.head_dim > 256:
        return f"head dim {args.head_dim} is not a multiple of 16 up to 256"
    return None


@dataclass
class _Layer:
    """One decoder layer's weights as the kernels read them."""

    ln1: cp.ndarray  # [H]
    ln2: cp.ndarray  # [H]
    qkv: cp.ndarray  # [(N + 2K) D, H]
    o: cp.ndarray  # [H, N D]
    q_norm: cp.ndarray  # [D]
    k_norm: cp.ndarray  # [D]
    router: cp.ndarray | None  # [E, H]
    gate_up: cp.ndarray | None  # [E, 2I, H]
    down: cp.ndarray | None  # [E, H, I]
    mlp_gate_up: cp.ndarray | None  # [2I', H]: the dense MLP, or the shared expert
    mlp_down: cp.ndarray | None  # [H, I']
    shared_gate: cp.ndarray | None  # [1, H]

    @classmethod
    def of(cls, layer: DecoderLayer) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        qkv = att.fuse_qkv(cp)
        router = gate_up = down = shared_gate = None
        dense: MLP | None
        if isinstance(mlp, SparseMoeBlock):
            router, gate_up, down = mlp.gate, mlp.experts.gate_up_proj, mlp.experts.down_proj
            dense, shared_gate = mlp.shared_expert, mlp.shared_expert_gate
        else:
            dense = mlp
        mlp_gate_up = dense.fuse_gate_up(cp) if dense is not None else None
        return cls(
            ln1=layer.input_layernorm,
            ln2=layer.post_attention_layernorm,
            qkv=qkv,
            o=att.o_proj,
            q_norm=att.q_norm,
            k_norm=att.k_norm,
            router=router,
            gate_up=gate_up,
            down=down,
            mlp_gate_up=mlp_gate_up,
            mlp_down=dense.down_proj if dense is not None else None,
            shared_gate=shared_gate,
        )


class _Buffers:
    """Every array one window of R rows touches, allocated once (graphs replay on fixed addresses)."""

    def __init__(self, rows: int, args: ModelArgs, context: int, mlp_width: int) -> None:
        h, n, k, d = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        f32 = cp.float32
        self.rows = rows
        self.pos = cp.zeros(rows, cp.int32)  # [R]
        self.slot = cp.zeros(rows, cp.int32)  # [R]
        self.resid = cp.zeros((rows, h), f32)  # [R, H]
        self.qkv = cp.zeros((rows, (n + 2 * k) * d), f32)  # [R, (N + 2K) D]
        self.q = cp.zeros((rows, n, d), f32)  # [R, N, D]
        self.attn = cp.zeros((rows, n * d), f32)  # [R, N D]
        self.scratch = cp.zeros(attention_scratch_size(rows, n, k, d, context), f32)
        topk = max(args.num_experts_per_tok, 1)
        self.router = cp.zeros((rows, max(args.num_experts, 1)), f32)  # [R, E]
        self.idx = cp.zeros((rows, topk), cp.int32)  # [R, k]
        self.wts = cp.zeros((rows, topk), f32)  # [R, k]
        self.h = cp.zeros((rows * topk, max(args.moe_intermediate_size, 1)), f32)  # [R k, I]
        self._mlp_gu = cp.zeros(rows * 2 * max(mlp_width, 1), f32)  # flat: viewed as [R, 2I'] per layer
        self._mlp_h = cp.zeros(rows * max(mlp_width, 1), f32)  # flat: viewed as [R, I'] per layer
        self.mlp_y = cp.zeros((rows, h), f32)  # [R, H]
        self.gate = cp.zeros((rows, 1), f32)  # [R, 1]
        self.emb = cp.zeros((rows, h), f32)  # [R, H]: the MTP head's embedding rows
        self.out = cp.zeros((rows, h), f32)  # [R, H]: the MTP head's post-norm output

    def mlp(self, width: int) -> tuple[cp.ndarray, cp.ndarray]:
        """Contiguous [R, 2I'] and [R, I'] views for an MLP of width I' (widths differ between the dense
        MLP and the shared expert)."""
        r = self.rows
        return self._mlp_gu[: r * 2 * width].reshape(r, 2 * width), self._mlp_h[: r * width].reshape(r, width)

    def load(self, layout: Layout) -> None:
        """Copy the window's positions and slots to the device."""
        self.pos.set(layout.positions().astype(np.int32))
        self.slot.set(np.concatenate([np.full(s.n, s.slot, np.int32) for s in layout.segments]))


class CudaLayers:
    """Decode windows through a run of decoder layers with their KV, as one CUDA graph per row count.

    ``k_cache``/``v_cache`` are [L, S, K, T, D] fp16: layer j of this run reads and writes slice j, at each
    row's (slot, position).
    """

    def __init__(
        self, device_id: int, layers: list[DecoderLayer], args: ModelArgs, k_cache: Any, v_cache: Any
    ) -> None:
        self.device_id, self.args = device_id, args
        self.k_cache, self.v_cache = k_cache, v_cache
        self.context = int(k_cache.shape[3])
        with cp.cuda.Device(device_id):
            self.kern: Kernels = kernels_for(device_id)
            self.layers = [_Layer.of(layer) for layer in layers]
            self.sparse = [layer.gate_up is not None for layer in self.layers]
            widths = [lay.mlp_down.shape[1] for lay in self.layers if lay.mlp_down is not None]
            self.mlp_width = max(widths, default=0)
            self.capture_stream = cp.cuda.Stream(non_blocking=True)
            # Compile every kernel any window can need in one NVRTC run now, not window by window later.
            self.kern.prepare(self.expressions())
        self._bufs: dict[int, _Buffers] = {}
        self._graphs: dict[int, Any] = {}
        self._seen: set[int] = set()

    def expressions(self) -> list[str]:
        """The kernel instantiations windows of 1 to 8 rows through these layers (and a head) use."""
        a = self.args
        h, q = a.hidden_size, a.num_attention_heads * a.head_dim
        widths = {lay.mlp_down.shape[1] for lay in self.layers if lay.mlp_down is not None}
        out = ["add_rmsnorm", "qk_norm_rope_kv", "silu_mul", "add_scaled", "argmax_rows", "gemv_any"]
        out += self.kern.attn_exprs(a.head_dim, a.num_attention_heads // a.num_key_value_heads)
        if a.num_experts:
            out += self.kern.moe_exprs(h, a.moe_intermediate_size, a.num_experts_per_tok)
        for rows in range(1, MAX_WINDOW_ROWS + 1):
            out += [self.kern.gemv_expr(rows, h, True), self.kern.gemv_expr(rows, h, False)]
            out += [self.kern.gemv_expr(rows, q, False)]
            out += [self.kern.gemv_expr(rows, w, False) for w in widths]
        return out

    def buffers(self, rows: int) -> _Buffers:
        if rows not in self._bufs:
            with cp.cuda.Device(self.device_id):
                self._bufs[rows] = _Buffers(rows, self.args, self.context, self.mlp_width)
        return self._bufs[rows]

    # ---- the kernel sequence -----------------------------------------------------------------------

    def _layer(self, j: int, b: _Buffers) -> None:
        """One decoder layer on b.resid: attention, then the MoE block or dense MLP, each added in place."""
        k, a, lay = self.kern, self.args, self.layers[j]
        eps = a.rms_norm_eps
        kc, vc = self.k_cache[j], self.v_cache[j]  # [S, K, T, D]
        k.gemv(lay.qkv, b.resid, b.qkv, norm=lay.ln1, eps=eps)
        k.qk_norm_rope_kv(b.qkv, lay.q_norm, lay.k_norm, b.pos, b.slot, b.q, kc, vc, a.rope_theta, eps)
        k.attention(b.q, kc, vc, b.pos, b.slot, b.attn, b.scratch)
        k.gemv(lay.o, b.attn, b.resid, accumulate=True)
        dense = lay.mlp_gate_up is not None
        if dense:  # the dense MLP or the shared expert reads the residual before the experts add to it
            gu, hid = b.mlp(lay.mlp_down.shape[1])  # type: ignore[union-attr]
            k.gemv(lay.mlp_gate_up, b.resid, gu, norm=lay.ln2, eps=eps)
            k.silu_mul(gu, hid)
            k.gemv(lay.mlp_down, hid, b.mlp_y)
            if lay.shared_gate is not None:
                k.gemv(lay.shared_gate, b.resid, b.gate, norm=lay.ln2, eps=eps)
        if lay.gate_up is not None:
            k.gemv(lay.router, b.resid, b.router, norm=lay.ln2, eps=eps)
            k.moe(
                b.resid,
                lay.ln2,
                b.router,
                a.norm_topk_prob,
                eps,
                lay.gate_up,
                lay.down,
                b.resid,
                b.idx,
                b.wts,
                b.h,
            )
        if dense:
            k.add_scaled(b.resid, b.mlp_y, b.gate if lay.shared_gate is not None else None)

    def run_layers(self, b: _Buffers) -> None:
        for j in range(len(self.layers)):
            self._layer(j, b)

    def replay(self, b: _Buffers, body: Any) -> None:
        """Run ``body(b)`` on the current stream: eagerly the first time (which also compiles the kernels),
        captured as a graph the second time, replayed after that."""
        rows = b.rows
        stream = cp.cuda.get_current_stream()
        if rows not in self._seen:
            self._seen.add(rows)
            body(b)
            return
        graph = self._graphs.get(rows)
        if graph is None:
            stream.synchronize()
            cap = self.capture_stream
            with cap:
                cap.begin_capture()
                body(b)
                graph = cap.end_capture()
            self._graphs[rows] = graph
        graph.launch(stream)

    def forward(self, hidden: Any, layout: Layout) -> cp.ndarray:
        """The window's hidden rows [R, H] after these layers, as a new fp32 array."""
        with cp.cuda.Device(self.device_id):
            b = self.buffers(layout.rows)
            b.load(layout)
            b.resid[...] = hidden
            self.replay(b, self.run_layers)
            return b.resid.copy()


class CudaHead:
    """The final norm and LM head on fp32 rows (the last stage's, or the MTP head's output)."""

    def __init__(self, device_id: int, norm: cp.ndarray, lm_head: cp.ndarray, eps: float) -> None:
        self.device_id, self.norm, self.lm_head, self.eps = device_id, norm, lm_head, eps
        self.kern = kernels_for(device_id)

    def final_norm(self, hidden: Any) -> cp.ndarray:
        """rmsnorm(hidden) * norm as a new fp32 array [R, H]."""
        with cp.cuda.Device(self.device_id):
            x = cp.ascontiguousarray(hidden, dtype=cp.float32)
            out = cp.empty_like(x)
            self.kern.add_rmsnorm(x, None, self.norm, out, self.eps)
            return out

    def logits(self, normed: Any) -> cp.ndarray:
        """Logits [R, V] in fp32: the GEMV kernel for a window's rows, a cuBLAS product (fp16 rows, fp32
        accumulation and output) for more."""
        with cp.cuda.Device(self.device_id):
            rows = normed.shape[0]
            out = cp.empty((rows, self.lm_head.shape[0]), cp.float32)
            if rows > MAX_WINDOW_ROWS:
                return matmul_nt(cp.ascontiguousarray(normed, dtype=cp.float16), self.lm_head, out)
            self.kern.gemv(self.lm_head, cp.ascontiguousarray(normed, dtype=cp.float32), out)
            return out


class CudaMtp:
    """The MTP head's forward for draft windows, as one CUDA graph per row count.

    out = norm(layer(fc_e @ pre_fc_norm_embedding(emb) + fc_h @ pre_fc_norm_hidden(hidden))), where
    fc = [fc_e | fc_h] is split into two contiguous halves. The MTP layer's KV is one [1, S, K, T, D] pair
    shared by every slot's drafter (each drafter's cache is a view of its slot).
    """

    def __init__(
        self, device_id: int, head: Any, args: ModelArgs, k_cache: cp.ndarray, v_cache: cp.ndarray
    ) -> None:
        self.device_id, self.args = device_id, args
        with cp.cuda.Device(device_id):
            h = args.hidden_size
            self.fc_e = cp.ascontiguousarray(head.fc[:, :h])  # [H, H]
            self.fc_h = cp.ascontiguousarray(head.fc[:, h:])  # [H, H]
            self.norm_e, self.norm_h, self.norm = (
                head.pre_fc_norm_embedding,
                head.pre_fc_norm_hidden,
                head.norm,
            )
            self.layers = CudaLayers(device_id, [head.layer], args, k_cache, v_cache)
        self.kern = self.layers.kern
        self.head = CudaHead(device_id, head.norm, head.lm_head, args.rms_norm_eps)
        from .prefill import CudaPrefill

        self._prefill = CudaPrefill(self.layers)

    def logits(self, out: Any) -> cp.ndarray:
        """Draft logits [R, V] in fp32 from the head's output rows."""
        return self.head.logits(out)

    def _body(self, b: _Buffers) -> None:
        k, eps = self.kern, self.args.rms_norm_eps
        k.gemv(self.fc_e, b.emb, b.resid, norm=self.norm_e, eps=eps)
        k.gemv(self.fc_h, b.out, b.resid, accumulate=True, norm=self.norm_h, eps=eps)
        self.layers.run_layers(b)
        k.add_rmsnorm(b.resid, None, self.norm, b.out, eps)

    def prefill(self, emb: Any, hidden: Any, layout: Layout) -> cp.ndarray:
        """`forward` for a prompt chunk of more than 8 rows, through the CUDA prefill path."""
        with cp.cuda.Device(self.device_id):
            k, eps = self.kern, self.args.rms_norm_eps
            rows, h = hidden.shape
            e16, h16 = cp.empty((rows, h), cp.float16), cp.empty((rows, h), cp.float16)
            k.rmsnorm_half(cp.ascontiguousarray(emb, dtype=cp.float32), self.norm_e, e16, eps)
            k.rmsnorm_half(cp.ascontiguousarray(hidden, dtype=cp.float32), self.norm_h, h16, eps)
            resid = matmul_nt(e16, self.fc_e, cp.empty((rows, h), cp.float32))  # [R, H]
            matmul_nt(h16, self.fc_h, resid, beta=1.0)
            self._prefill.run(resid, layout)
            out = cp.empty_like(resid)
            k.add_rmsnorm(resid, None, self.norm, out, eps)
            return out

    def forward(self, emb: Any, hidden: Any, layout: Layout) -> cp.ndarray:
        """The head's post-norm output [R, H] (fp32) for rows (embedding of token t+1, hidden at t)."""
        with cp.cuda.Device(self.device_id):
            b = self.layers.buffers(layout.rows)
            b.load(layout)
            b.emb[...] = emb
            b.out[...] = hidden  # the hidden input; the body overwrites it with the output at the end
            self.layers.replay(b, self._body)
            return b.out.copy()
