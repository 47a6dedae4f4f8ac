"""A run of decoder layers as the CUDA kernels read them: weights, a window's buffers, one layer's steps.

`LayerStack` is what the decode graphs (`strata_runtime.cuda.decode`) and the prefill path
(`strata_runtime.cuda.prefill`) share: each layer's weights (`LayerWeights`, q/k/v and gate/up fused, and
under calibrated routing the layer's router bias), the KV cache the layers write, the model's numbers and the
device's kernels. `LAYER_STEPS` is one layer's decode kernel sequence as named steps: the decode graphs run
them in order, and ``strata bench --workload step`` times each alone. `WindowBuffers` holds every array a
window of R rows touches.

Nothing here imports CuPy: arrays come from the caller (``xp``), so the CPU tests run the very same sequence
on the kernels' NumPy references (`strata_runtime.reference.kernels`).

Dimension letters as in kernels.cu: R rows, H hidden, N query heads, K kv heads, D head dim, E experts,
I expert width, S slots, T context, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import Array, cupy_module, upload_into
from ..layout import Layout
from ..models.qwen3_moe import MLP, DecoderLayer, ModelArgs, SparseMoeBlock
from .choices import (
    ATTENTION_HEAD_DIMS,
    STATIC_SHARED,
    attention_counters,
    attention_fits,
    attention_scratch_size,
    attention_shared_bytes,
)
from .experts import ExpertSlice, LayerExperts, resident_experts
from .ops import Kernels, kernels_for
from .routing import DeviceRouting, RowBias

MIN_COMPUTE_CAPABILITY = 80
"""The kernels' oldest GPU generation (Ampere): they use cp.async, mma.sync and warp reductions of 8.0."""


def supported(args: ModelArgs, dtype: Any, kv_dtype: Any, device_id: int | None = None) -> str | None:
    """Why the CUDA path cannot run a model of these shapes and dtypes (on CUDA device ``device_id``, when
    given), or None when it can."""
    if device_id is not None:
        capability = int(cupy_module().cuda.Device(device_id).compute_capability)
        if capability < MIN_COMPUTE_CAPABILITY:
            (major, minor), oldest = divmod(capability, 10), divmod(MIN_COMPUTE_CAPABILITY, 10)
            return (
                f"cuda:{device_id} has compute capability {major}.{minor}; the kernels need "
                f"{oldest[0]}.{oldest[1]} (Ampere) or later"
            )
    if np.dtype(dtype) != np.float16:
        return f"weights are {np.dtype(dtype)}, the kernels read float16"
    if np.dtype(kv_dtype) != np.float16:
        return f"the KV cache is {np.dtype(kv_dtype)}, the kernels write float16"
    if args.attention_bias:
        return "attention biases are not in the kernels"
    if args.num_experts > 256:
        return f"{args.num_experts} experts; the routing kernel handles at most 256"
    if args.head_dim not in ATTENTION_HEAD_DIMS:
        dims = ", ".join(map(str, ATTENTION_HEAD_DIMS))
        return f"head dim {args.head_dim} is not one the attention kernel takes ({dims})"
    group = args.num_attention_heads // args.num_key_value_heads
    if not attention_fits(args.head_dim, group):
        need = attention_shared_bytes(args.head_dim, group, 4) / 1024
        return (
            f"{group} query heads per KV head at head dim {args.head_dim}: a block of the attention kernel "
            f"would need {need:.0f} KiB of shared memory, more than {STATIC_SHARED // 1024}"
        )
    return None


@dataclass
class LayerWeights:
    """One decoder layer's weights as the kernels read them (fp16, q/k/v and gate/up fused), and its router
    bias under calibrated routing (`strata_runtime.cuda.routing`; None: the router's own choice)."""

    ln1: Array  # [H]
    ln2: Array  # [H]
    qkv: Array  # [(N + 2K) D, H]
    o: Array  # [H, N D]
    q_norm: Array  # [D]
    k_norm: Array  # [D]
    router: Array | None  # [E, H]
    gate_up: Array | None  # [E, 2I, H] on the device; None when the experts are held by an expert cache
    down: Array | None  # [E, H, I] likewise
    mlp_gate_up: Array | None  # [2I', H]: the dense MLP, or the shared expert
    mlp_down: Array | None  # [H, I']
    shared_gate: Array | None  # [1, H]
    router_bias: RowBias | None = None
    experts: LayerExperts | None = None
    """Where the expert kernels find each routed expert (sparse layers; set by `LayerStack.of`)."""
    attention_tc: bool = True
    """Decode attention on tensor cores where the shape allows (``model.decode_attention``), else CUDA cores:
    the layer's own choice, not the device's `Kernels`, which every stack of the device shares."""
    warm: Array | None = None
    """The next layer's q/k/v weights where the same stack runs it (set by `LayerStack`): the expert kernels
    may bring them into L2 while they finish (`strata_runtime.cuda.choices.L2Warm`)."""

    @classmethod
    def of(cls, layer: DecoderLayer, xp: Any, router_bias: RowBias | None = None) -> LayerWeights:
        """The kernels' view of ``layer``, whose q/k/v and gate/up it fuses (``xp``: the arrays' module);
        ``router_bias`` is kept for a sparse layer only."""
        att, mlp = layer.self_attn, layer.mlp
        qkv = att.fuse_qkv(xp)
        router = gate_up = down = shared_gate = None
        dense: MLP | None
        if isinstance(mlp, SparseMoeBlock):
            router, gate_up, down = mlp.gate, mlp.experts.gate_up_proj, mlp.experts.down_proj
            dense, shared_gate = mlp.shared_expert, mlp.shared_expert_gate
        else:
            dense = mlp
        mlp_gate_up = dense.fuse_gate_up(xp) if dense is not None else None
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
            router_bias=router_bias if router is not None else None,
        )

    @property
    def mlp_width(self) -> int:
        """I' of the dense MLP or the shared expert (0 without one)."""
        return 0 if self.mlp_down is None else int(self.mlp_down.shape[1])


class WindowBuffers:
    """Every array one window of R rows touches, allocated once (graphs replay on fixed addresses) with
    ``xp`` (CuPy on the GPU)."""

    def __init__(
        self,
        xp: Any,
        rows: int,
        args: ModelArgs,
        context: int,
        mlp_width: int,
        scratch: Array | None = None,
        attention_tc: bool = False,
    ) -> None:
        """``scratch``: attention's scratch, shared with windows of other sizes that never run at the same
        time as this one (at least `attention_scratch_size` of these rows, for ``attn_tc`` where
        ``attention_tc``); None: a scratch of its own, of the size either kernel takes."""
        h, n, k, d = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        f32 = xp.float32
        self.rows = rows
        self.pos = xp.zeros(rows, xp.int32)  # [R]
        self.slot = xp.zeros(rows, xp.int32)  # [R]
        self.resid = xp.zeros((rows, h), f32)  # [R, H]
        self.qkv = xp.zeros((rows, (n + 2 * k) * d), f32)  # [R, (N + 2K) D]
        self.q = xp.zeros((rows, n, d), f32)  # [R, N, D]
        self.attn = xp.zeros((rows, n * d), f32)  # [R, N D]
        size = attention_scratch_size(rows, n, k, d, context, attention_tc)
        if scratch is None:
            scratch = xp.zeros(size, f32)
        assert scratch.size >= size and scratch.dtype == f32
        self.scratch = scratch
        self.attn_done = xp.zeros((rows, attention_counters(k, context)), xp.int32)  # attention's counters
        self.heads_done = xp.zeros(n + 2 * k, xp.int32)  # [N + 2K]: the fused q/k/v kernel's counters
        topk = max(args.num_experts_per_tok, 1)
        self.router = xp.zeros((rows, max(args.num_experts, 1)), f32)  # [R, E]
        self.idx = xp.zeros((rows, topk), xp.int32)  # [R, k]
        self.wts = xp.zeros((rows, topk), f32)  # [R, k]
        self.h = xp.zeros((rows * topk, max(args.moe_intermediate_size, 1)), f32)  # [R k, I]
        self._mlp_gu = xp.zeros(rows * 2 * max(mlp_width, 1), f32)  # flat: viewed as [R, 2I'] per layer
        self._mlp_h = xp.zeros(rows * max(mlp_width, 1), f32)  # flat: viewed as [R, I'] per layer
        self.mlp_y = xp.zeros((rows, h), f32)  # [R, H]
        self.gate = xp.zeros((rows, 1), f32)  # [R, 1]
        self.emb = xp.zeros((rows, h), f32)  # [R, H]: the MTP head's embedding rows
        self.out = xp.zeros((rows, h), f32)  # [R, H]: the MTP head's post-norm output

    def mlp(self, width: int) -> tuple[Array, Array]:
        """Contiguous [R, 2I'] and [R, I'] views for an MLP of width I' (widths differ between the dense
        MLP and the shared expert)."""
        r = self.rows
        return self._mlp_gu[: r * 2 * width].reshape(r, 2 * width), self._mlp_h[: r * width].reshape(r, width)

    def load(self, layout: Layout, positions: Array | None = None) -> None:
        """Copy the window's positions and slots to the device (CuPy buffers) on the current stream, through
        pinned memory, so that the host does not wait for the stream's earlier work on these buffers.
        ``positions`` [R]: the rows' positions already on this device (decided there by the window before),
        copied on the stream instead of the layout's."""
        if positions is None:
            upload_into(self.pos, layout.positions().astype(np.int32))
        else:
            self.pos[...] = positions
        upload_into(self.slot, layout.row_slots().astype(np.int32))


# ---- one layer's kernel sequence ---------------------------------------------------------------------

Step = Callable[[Kernels, ModelArgs, LayerWeights, WindowBuffers, Array, Array], None]
"""One part of a decoder layer on ``b.resid``: (kernels, the model's numbers, the layer's weights, the
window's buffers, the layer's keys and values [S, K, T, D])."""


def _qkv_rope(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    """q/k/v with the input norm, q and k normalised and rotated, k and v into the cache: one kernel where the
    projection runs on tensor cores (`Kernels.qkv_rope`)."""
    eps = a.rms_norm_eps
    norms = (lay.q_norm, lay.k_norm, b.pos, b.slot, b.q, kc, vc, a.rope_theta, b.heads_done)
    k.qkv_rope(lay.qkv, b.resid, b.qkv, lay.ln1, eps, *norms)


def _attention(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    k.attention(b.q, kc, vc, b.pos, b.slot, b.attn, b.scratch, b.attn_done, tensor_cores=lay.attention_tc)


def _o_proj(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    k.gemv(lay.o, b.attn, b.resid, accumulate=True)


def _mlp(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    """The dense MLP or the shared expert; it reads the residual before the routed experts add to it."""
    if lay.mlp_gate_up is None:
        return
    eps = a.rms_norm_eps
    gu, hid = b.mlp(lay.mlp_width)
    k.gemv(lay.mlp_gate_up, b.resid, gu, norm=lay.ln2, eps=eps)
    k.silu_mul(gu, hid)
    k.gemv(lay.mlp_down, hid, b.mlp_y)
    if lay.shared_gate is not None:
        k.gemv(lay.shared_gate, b.resid, b.gate, norm=lay.ln2, eps=eps)


def _router(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    if lay.router is not None:
        k.gemv(lay.router, b.resid, b.router, norm=lay.ln2, eps=a.rms_norm_eps)


def _route_bias(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    """Calibrated routing: B on the router logits of each row's intended experts, before the top-k."""
    if lay.router_bias is not None:
        lay.router_bias(b.router, b.pos, b.slot)


def _moe(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    if lay.experts is None:
        return
    k.moe(
        b.resid,
        lay.ln2,
        b.router,
        a.norm_topk_prob,
        a.rms_norm_eps,
        lay.experts,
        b.resid,
        b.idx,
        b.wts,
        b.h,
        warm=lay.warm,
    )


def _mlp_add(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    if lay.mlp_gate_up is not None:
        k.add_scaled(b.resid, b.mlp_y, b.gate if lay.shared_gate is not None else None)


LAYER_STEPS: dict[str, Step] = {
    "qkv+rope": _qkv_rope,
    "attention": _attention,
    "o_proj": _o_proj,
    "mlp": _mlp,
    "router+norm": _router,
    "route_bias": _route_bias,
    "moe": _moe,
    "mlp_add": _mlp_add,
}
"""A decoder layer on a window, in the order the steps run: attention (each output added to the residual in
place), then the dense MLP or shared expert, the router (biased under calibrated routing), the routed experts,
and the MLP's output added last."""


def step_applies(name: str, lay: LayerWeights) -> bool:
    """Whether step ``name`` does anything for ``lay`` (dense layers have no router; sparse ones may have no
    shared expert)."""
    if name in ("mlp", "mlp_add"):
        return lay.mlp_gate_up is not None
    if name in ("router+norm", "moe"):
        return lay.router is not None
    if name == "route_bias":
        return lay.router_bias is not None
    return True


def run_layer(k: Kernels, a: ModelArgs, lay: LayerWeights, b: WindowBuffers, kc: Array, vc: Array) -> None:
    """One decoder layer on ``b.resid``, in place: every step of `LAYER_STEPS` in order."""
    for step in LAYER_STEPS.values():
        step(k, a, lay, b, kc, vc)


@dataclass
class LayerStack:
    """A run of decoder layers on one device as the kernels read them, with the KV cache they write.

    ``k_cache``/``v_cache`` are [L, S, K, T, D] fp16: layer j of the run reads and writes slice j, at each
    row's (slot, position).
    """

    device_id: int
    args: ModelArgs
    layers: list[LayerWeights]
    k_cache: Array
    v_cache: Array
    kern: Kernels

    def __post_init__(self) -> None:
        for lay, after in zip(self.layers[:-1], self.layers[1:], strict=True):
            lay.warm = after.qkv

    @classmethod
    def of(
        cls,
        device_id: int,
        layers: list[DecoderLayer],
        args: ModelArgs,
        k_cache: Array,
        v_cache: Array,
        routing: DeviceRouting | None = None,
        first_layer: int = 0,
        experts: ExpertSlice | None = None,
        attention_tc: bool = True,
    ) -> LayerStack:
        """The stack of ``layers`` (CuPy arrays on GPU ``device_id``), fusing their weights there. With
        ``routing`` (calibrated routing), each MoE layer gets its bias step; ``layers[j]`` is model layer
        ``first_layer + j``.

        ``experts``: where the layers' routed experts are (one entry per sparse layer, in order), from the
        stage's `CudaExperts`; without it each sparse layer's stacked experts are read where they are.
        ``attention_tc``: decode attention on tensor cores where the shape allows (``model.decode_attention``
        = ``"auto"``), else on CUDA cores.
        """
        cp = cupy_module()
        with cp.cuda.Device(device_id):
            kern = kernels_for(device_id)
            weights = [
                LayerWeights.of(layer, cp, routing.layer(first_layer + j) if routing is not None else None)
                for j, layer in enumerate(layers)
            ]
            sparse = [lay for lay in weights if lay.router is not None]
            if experts is not None:
                if len(experts.layers) != len(sparse):
                    raise ValueError(f"{len(experts.layers)} expert tables for {len(sparse)} sparse layers")
                for lay, table in zip(sparse, experts.layers, strict=True):
                    lay.experts = table
                    if experts.store.cached:
                        lay.gate_up = lay.down = None  # held by the cache: read only through its tables
            else:
                for lay in sparse:
                    assert lay.gate_up is not None and lay.down is not None
                    lay.experts = resident_experts(lay.gate_up, lay.down, cp)
            for lay in weights:
                lay.attention_tc = kern.tensor_cores and attention_tc
        return cls(device_id, args, weights, k_cache, v_cache, kern)

    @property
    def context(self) -> int:
        return int(self.k_cache.shape[3])

    @property
    def mlp_width(self) -> int:
        """The widest dense MLP or shared expert of the run (0 without one)."""
        return max((lay.mlp_width for lay in self.layers), default=0)

    @property
    def attention_tc(self) -> bool:
        """Whether this stack's decode attention may run on tensor cores (`LayerWeights.attention_tc`)."""
        return all(lay.attention_tc for lay in self.layers)

    def run(self, b: WindowBuffers) -> None:
        """Every layer on ``b.resid`` in place, writing each row's keys and values."""
        for j, lay in enumerate(self.layers):
            run_layer(self.kern, self.args, lay, b, self.k_cache[j], self.v_cache[j])
