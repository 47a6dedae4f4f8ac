"""The ``qwen3_moe`` architecture (transformers' ``Qwen3MoeForCausalLM``), written once against ``xp``.

Attention is GQA with a per-head RMSNorm on q and k before NeoX RoPE. The MoE block routes each row to its
top-k experts with an fp32 softmax (renormalised when ``norm_topk_prob``), runs SwiGLU experts, and adds an
optional Qwen2-MoE style shared expert behind a sigmoid gate. Layers whose index is in ``mlp_only_layers`` or
not a multiple of ``decoder_sparse_step`` are dense.

Attribute names mirror the checkpoint's tensor names; the routed experts are held in the transformers v5
fused layout (``experts.gate_up_proj`` [E, 2I, H] with gate first, ``experts.down_proj`` [E, H, I]), and
`sanitize` says how to build those from the older per-expert layout.

Dimension letters: R rows of a window, H hidden, N query heads, K kv heads, G = N / K, D head dim,
E experts, k experts per row, A = R * k assignments, I expert width, L keys attended to, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..layout import Layout
from .ops.activation import silu_mul
from .ops.norm import rms_norm_in_dtype
from .ops.rope import rope

Shapes = dict[str, tuple[int, ...]]
RouterBias = Callable[[Any], Any]
"""Router logits [R, E] (fp32) -> the logits the top-k reads: calibrated routing for synthetic presets
(`strata_runtime.experts.routing.apply_bias`, bound by the stage to a model layer and the window's rows)."""


@dataclass(frozen=True)
class ModelArgs:
    """The numbers of a ``config.json`` that the forward pass needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mtp_layers: int = 0
    eos_token_id: tuple[int, ...] = field(default=())

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Read a ``config.json`` dictionary in either transformers spelling."""
        n_heads = config["num_attention_heads"]
        rope_params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only the default RoPE)")
        theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        mtp = config.get("num_nextn_predict_layers", config.get("mtp_num_hidden_layers", 0)) or 0
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=config.get("num_key_value_heads", n_heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            intermediate_size=config.get("intermediate_size", 0),
            moe_intermediate_size=config.get("moe_intermediate_size", 0),
            num_experts=config.get("num_experts", config.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=config.get("num_experts_per_tok", 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=config.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0) or 0,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mtp_layers=int(mtp),
            eos_token_id=eos_ids,
        )

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule for which main-model layers have an MoE block."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


# ---- tensor names and shapes -----------------------------------------------------------------------


def layer_shapes(args: ModelArgs, prefix: str, sparse: bool) -> Shapes:
    """Every tensor of one decoder layer under ``prefix`` (``model.layers.3.``), in the fused layout."""
    h, d = args.hidden_size, args.head_dim
    q, kv = args.num_attention_heads * d, args.num_key_value_heads * d
    p = prefix
    shapes: Shapes = {
        f"{p}input_layernorm.weight": (h,),
        f"{p}post_attention_layernorm.weight": (h,),
        f"{p}self_attn.q_proj.weight": (q, h),
        f"{p}self_attn.k_proj.weight": (kv, h),
        f"{p}self_attn.v_proj.weight": (kv, h),
        f"{p}self_attn.o_proj.weight": (h, q),
        f"{p}self_attn.q_norm.weight": (d,),
        f"{p}self_attn.k_norm.weight": (d,),
    }
    if args.attention_bias:
        for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
            shapes[f"{p}self_attn.{name}.bias"] = (n,)
    if sparse:
        e, i, s = args.num_experts, args.moe_intermediate_size, args.shared_expert_intermediate_size
        shapes[f"{p}mlp.gate.weight"] = (e, h)
        shapes[f"{p}mlp.experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[f"{p}mlp.experts.down_proj"] = (e, h, i)
        if s:
            shapes[f"{p}mlp.shared_expert.gate_proj.weight"] = (s, h)
            shapes[f"{p}mlp.shared_expert.up_proj.weight"] = (s, h)
            shapes[f"{p}mlp.shared_expert.down_proj.weight"] = (h, s)
            shapes[f"{p}mlp.shared_expert_gate.weight"] = (1, h)
    else:
        i = args.intermediate_size
        shapes[f"{p}mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, i)
    return shapes


def stage_shapes(args: ModelArgs, layers: tuple[int, int], *, first: bool, last: bool, mtp: bool) -> Shapes:
    """Every tensor one pipeline stage holds: its layers, plus embedding (first) and head and MTP (last)."""
    h, v = args.hidden_size, args.vocab_size
    shapes: Shapes = {}
    if first:
        shapes["model.embed_tokens.weight"] = (v, h)
    for i in range(*layers):
        shapes.update(layer_shapes(args, f"model.layers.{i}.", args.is_sparse(i)))
    if last:
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (v, h)
        if mtp:
            shapes.update(mtp_shapes(args))
    return shapes


def mtp_shapes(args: ModelArgs) -> Shapes:
    """The Qwen3-Next style MTP head: two pre-fc norms, fc (2H -> H), one decoder layer, a final norm."""
    h = args.hidden_size
    shapes: Shapes = {
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
    }
    shapes.update(layer_shapes(args, "mtp.layers.0.", args.num_experts > 0))
    return shapes


@dataclass(frozen=True)
class Source:
    """How to build one runtime tensor from checkpoint tensors.

    ``parts`` lists, for each slice along axis 0 of the result, the checkpoint names that are concatenated
    (along their axis 0) to make that slice. A plain tensor is one part with one name and ``stacked`` False.
    """

    parts: tuple[tuple[str, ...], ...]
    stacked: bool


def sanitize(name: str, shape: tuple[int, ...], available: set[str], tie_word_embeddings: bool) -> Source:
    """Which checkpoint tensors make runtime tensor ``name``, for either expert layout.

    The transformers v5 layout stores ``experts.gate_up_proj`` and ``experts.down_proj`` fused; older
    checkpoints (and ``save_pretrained`` output) store ``experts.{e}.{gate,up,down}_proj.weight``.
    """
    if name == "lm_head.weight" and name not in available and tie_word_embeddings:
        return Source((("model.embed_tokens.weight",),), stacked=False)
    if name in available or not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return Source(((name,),), stacked=False)
    base = name.rsplit(".", 1)[0]  # "...mlp.experts"
    parts: tuple[tuple[str, ...], ...]
    if name.endswith("gate_up_proj"):
        parts = tuple((f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight") for e in range(shape[0]))
    else:
        parts = tuple((f"{base}.{e}.down_proj.weight",) for e in range(shape[0]))
    return Source(parts, stacked=True)


# ---- layers -------------------------------------------------------------------------------------------


def linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight.T (+ bias)`` with a checkpoint-layout weight [out, in].

    On NumPy every row is its own vector-matrix product, so a row's result does not depend on which other
    rows share its window: that makes the CPU path batch-invariant, and greedy text identical whether a
    token is read in a prefill chunk, a solo window or a batch window. (A BLAS matrix product blocks the
    sum differently for different row counts.) GPUs keep the batched product.
    """
    y = (x[:, None, :] @ weight.T)[:, 0] if isinstance(x, np.ndarray) else x @ weight.T  # [R, out]
    return y if bias is None else y + bias


def fuse_rows(xp: Any, parts: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """One contiguous matrix of ``parts`` stacked along axis 0, and each part as its row slice of it.

    A module that swaps its weights for the slices holds every weight once: the originals are freed once
    nothing else refers to them. Parts that already are consecutive row slices of one matrix (see
    `fuse_tensors`) come back as that matrix's span, with no copy.
    """
    span = _adjacent_rows(parts)
    if span is not None:
        return span, parts
    fused = xp.ascontiguousarray(xp.concatenate(parts, axis=0))  # [sum of rows, in]
    views, start = [], 0
    for p in parts:
        views.append(fused[start : start + p.shape[0]])
        start += p.shape[0]
    return fused, tuple(views)


def _address(a: Any) -> int:
    data = a.data
    return int(data.ptr) if hasattr(data, "ptr") else int(a.ctypes.data)


def _adjacent_rows(parts: tuple[Any, ...]) -> Any | None:
    """The span of one contiguous matrix that ``parts`` are consecutive row slices of, or None."""
    base = parts[0].base
    if base is None or base.ndim != 2 or not base.flags.c_contiguous:
        return None
    row = base.strides[0]
    at = _address(parts[0])
    for p in parts:
        if p.base is not base or not p.flags.c_contiguous or _address(p) != at:
            return None
        at += p.nbytes
    first = (_address(parts[0]) - _address(base)) // row
    return base[first : first + sum(p.shape[0] for p in parts)]


FUSED_ROWS = (
    ("self_attn.", ("q_proj", "k_proj", "v_proj")),
    ("mlp.", ("gate_proj", "up_proj")),
    ("mlp.shared_expert.", ("gate_proj", "up_proj")),
)
"""Weights the CUDA path reads as one matrix: q/k/v, and gate/up of a dense MLP or a shared expert."""


def fuse_tensors(xp: Any, tensors: dict[str, Any]) -> None:
    """Store each layer's q/k/v (and gate/up) as row slices of one contiguous matrix, in ``tensors`` itself,
    so that every model built on these tensors (benchmark arms share them) fuses without a copy and no
    weight is held twice."""
    for name in list(tensors):
        for sub, parts in FUSED_ROWS:
            head = f"{sub}{parts[0]}.weight"
            if not name.endswith(head):
                continue
            prefix = name[: -len(head)] + sub
            names = [f"{prefix}{p}.weight" for p in parts]
            if all(n in tensors for n in names):
                _, views = fuse_rows(xp, tuple(tensors[n] for n in names))
                tensors.update(zip(names, views, strict=True))


def softmax_fp32(xp: Any, x: Any, axis: int = -1) -> Any:
    x = x.astype(xp.float32)
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class Attention:
    """GQA attention with per-head q/k RMSNorm before RoPE, over each slot's KV cache."""

    def __init__(self, t: dict[str, Any], p: str, args: ModelArgs) -> None:
        self.q_proj, self.k_proj = t[f"{p}q_proj.weight"], t[f"{p}k_proj.weight"]
        self.v_proj, self.o_proj = t[f"{p}v_proj.weight"], t[f"{p}o_proj.weight"]
        self.q_norm, self.k_norm = t[f"{p}q_norm.weight"], t[f"{p}k_norm.weight"]
        self.bias = {n: t.get(f"{p}{n}.bias") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        self.n_heads, self.n_kv, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.eps = args.rms_norm_eps
        self.scale = args.head_dim**-0.5

    def fuse_qkv(self, xp: Any) -> Any:
        """Hold q, k and v as row slices of one contiguous [(N + 2K) D, H] matrix, and return it (the CUDA
        path reads the three projections in one product). Biases stay separate."""
        fused, (self.q_proj, self.k_proj, self.v_proj) = fuse_rows(
            xp, (self.q_proj, self.k_proj, self.v_proj)
        )
        return fused

    def __call__(self, xp: Any, x: Any, layout: Layout, kv: Any, layer: int, cos: Any, sin: Any) -> Any:
        r, n, k, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        q = linear(x, self.q_proj, self.bias["q_proj"]).reshape(r, n, d)  # [R, N, D]
        key = linear(x, self.k_proj, self.bias["k_proj"]).reshape(r, k, d)  # [R, K, D]
        val = linear(x, self.v_proj, self.bias["v_proj"]).reshape(r, k, d)  # [R, K, D]
        q = rope(rms_norm_in_dtype(q, self.q_norm, self.eps), cos, sin)  # [R, N, D]
        key = rope(rms_norm_in_dtype(key, self.k_norm, self.eps), cos, sin)  # [R, K, D]
        out = xp.empty((r, n * d), dtype=x.dtype)  # [R, N*D]
        for seg in layout.segments:
            rows = slice(seg.row, seg.row + seg.n)
            keys, values = kv.write(layer, seg, key[rows], val[rows])  # [K, L, D] each, L = pos + n
            out[rows] = self._attend(xp, q[rows], keys, values, seg.pos)  # [n, N*D]
        return linear(out, self.o_proj, self.bias["o_proj"])  # [R, H]

    def _attend(self, xp: Any, q: Any, keys: Any, values: Any, pos: int) -> Any:
        """Causal attention of ``n`` consecutive rows starting at position ``pos`` over keys [0, pos + n)."""
        n, k, d = q.shape[0], self.n_kv, self.head_dim
        g, length = self.n_heads // k, keys.shape[1]
        if xp is np:
            return self._attend_rows(q, keys, values, pos)
        q = q.reshape(n, k, g, d).transpose(1, 2, 0, 3)  # [K, G, n, D]; query head h reads kv head h // G
        scores = (q @ keys[:, None].transpose(0, 1, 3, 2)) * q.dtype.type(self.scale)  # [K, G, n, L]
        future = xp.arange(length)[None, :] > (pos + xp.arange(n))[:, None]  # [n, L]
        scores = xp.where(future, -xp.inf, scores.astype(xp.float32))  # [K, G, n, L]
        probs = softmax_fp32(xp, scores).astype(q.dtype)  # [K, G, n, L]
        out = probs @ values[:, None]  # [K, G, n, D]
        return out.transpose(2, 0, 1, 3).reshape(n, self.n_heads * d)  # [n, N*D]

    def _attend_rows(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: int) -> np.ndarray:
        """The NumPy path: each row over exactly its own keys [0, its position], so that the sums (and so
        the result) do not depend on how many rows share the window."""
        n, k, d = q.shape[0], self.n_kv, self.head_dim
        out = np.empty((n, self.n_heads * d), dtype=q.dtype)  # [n, N*D]
        for j in range(n):
            length = pos + j + 1
            qj = q[j].reshape(k, self.n_heads // k, d)  # [K, G, D]
            scores = (qj @ keys[:, :length].transpose(0, 2, 1)) * q.dtype.type(self.scale)  # [K, G, L]
            probs = softmax_fp32(np, scores).astype(q.dtype)  # [K, G, L]
            out[j] = (probs @ values[:, :length]).reshape(-1)  # [N*D]
        return out


class MLP:
    """A SwiGLU MLP: the dense layers' MLP and the shared expert."""

    def __init__(self, t: dict[str, Any], p: str) -> None:
        self.gate_proj, self.up_proj = t[f"{p}gate_proj.weight"], t[f"{p}up_proj.weight"]
        self.down_proj = t[f"{p}down_proj.weight"]

    def fuse_gate_up(self, xp: Any) -> Any:
        """Hold gate and up as row slices of one contiguous [2I, H] matrix (gate first), and return it."""
        fused, views = fuse_rows(xp, (self.gate_proj, self.up_proj))
        self.gate_proj, self.up_proj = views
        return fused

    def __call__(self, xp: Any, x: Any) -> Any:
        return linear(silu_mul(linear(x, self.gate_proj), linear(x, self.up_proj)), self.down_proj)  # [R, H]


class ExpertSource(Protocol):
    """Where a layer's routed experts are read from when an expert cache holds them
    (`strata_runtime.experts.store.ExpertStore`)."""

    def weights(self, j: int, e: int) -> tuple[Any, Any]:
        """Expert ``e`` of the stage's ``j``-th sparse layer: gate/up [2I, H] and down [H, I]."""
        ...

    def count(self, j: int, experts: np.ndarray, assignments: np.ndarray) -> None:
        """Record that layer ``j``'s rows routed ``assignments[n]`` times to expert ``experts[n]``."""
        ...


class Experts:
    """Routed SwiGLU experts in the fused layout."""

    def __init__(self, t: dict[str, Any], p: str) -> None:
        self.gate_up_proj = t[f"{p}gate_up_proj"]  # [E, 2I, H]
        self.down_proj = t[f"{p}down_proj"]  # [E, H, I]
        self.source: ExpertSource | None = None
        self.source_layer = 0

    def read_from(self, source: ExpertSource, j: int) -> None:
        """Read the experts through ``source`` (an expert cache), as its sparse layer ``j``."""
        self.source, self.source_layer = source, j

    def __call__(self, xp: Any, x: Any, top_idx: Any, top_w: Any) -> Any:
        """Each row's experts, weighted and summed. Only experts some row routes to are touched.

        The assignments are sorted by expert on the host (one small device-to-host copy per layer), so each
        routed expert runs one product over all of its rows.
        """
        r, k = top_idx.shape
        i = self.down_proj.shape[2]
        chosen = np.asarray(top_idx.get() if hasattr(top_idx, "get") else top_idx).reshape(-1)  # [A]
        order = np.argsort(chosen, kind="stable")  # [A] assignments grouped by expert
        experts, starts, counts = np.unique(chosen[order], return_index=True, return_counts=True)
        order_dev = xp.asarray(order)  # [A]
        xs = x[xp.asarray(order // k)]  # [A, H] each assignment's row
        ys = xp.empty_like(xs)  # [A, H]
        for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist(), strict=True):
            if self.source is None:
                gate_up, down = self.gate_up_proj[e], self.down_proj[e]
            else:
                gate_up, down = self.source.weights(self.source_layer, e)
            h = linear(xs[s : s + c], gate_up)  # [c, 2I]
            ys[s : s + c] = linear(silu_mul(h[:, :i], h[:, i:]), down)  # [c, H]
        if self.source is not None:
            self.source.count(self.source_layer, experts, counts)
        y = xp.empty_like(ys)  # [A, H]
        y[order_dev] = ys  # back to (row, choice) order
        return (y.reshape(r, k, -1) * top_w[:, :, None]).sum(axis=1)  # [R, H]


class SparseMoeBlock:
    """Top-k routing in fp32, routed experts, and the optional sigmoid-gated shared expert."""

    def __init__(self, t: dict[str, Any], p: str, args: ModelArgs) -> None:
        self.gate = t[f"{p}gate.weight"]  # [E, H] the router
        self.experts = Experts(t, f"{p}experts.")
        self.shared_expert = MLP(t, f"{p}shared_expert.") if f"{p}shared_expert_gate.weight" in t else None
        self.shared_expert_gate = t.get(f"{p}shared_expert_gate.weight")  # [1, H]
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob

    def route(self, xp: Any, x: Any, bias: RouterBias | None = None) -> tuple[Any, Any]:
        """Top-k expert ids [R, k] and their weights [R, k] (in the activation dtype); ``bias`` moves the
        fp32 logits first."""
        logits = linear(x, self.gate).astype(xp.float32, copy=False)  # [R, E]
        if bias is not None:
            logits = bias(logits)
        probs = softmax_fp32(xp, logits)  # [R, E]
        top_idx = xp.argsort(-probs, axis=-1)[:, : self.top_k]  # [R, k]
        top_w = xp.take_along_axis(probs, top_idx, axis=-1)  # [R, k]
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(axis=-1, keepdims=True)
        return top_idx, top_w.astype(x.dtype)

    def __call__(self, xp: Any, x: Any, bias: RouterBias | None = None) -> Any:
        out = self.experts(xp, x, *self.route(xp, x, bias))  # [R, H]
        if self.shared_expert is not None:
            g = linear(x, self.shared_expert_gate).astype(xp.float32)  # [R, 1]
            gate = (1.0 / (1.0 + xp.exp(-g))).astype(x.dtype)  # [R, 1]
            out = out + gate * self.shared_expert(xp, x)  # [R, H]
        return out


class DecoderLayer:
    """Pre-norm attention and MLP/MoE, each added to the residual stream."""

    def __init__(self, t: dict[str, Any], p: str, args: ModelArgs, sparse: bool) -> None:
        self.input_layernorm = t[f"{p}input_layernorm.weight"]
        self.post_attention_layernorm = t[f"{p}post_attention_layernorm.weight"]
        self.self_attn = Attention(t, f"{p}self_attn.", args)
        self.mlp: SparseMoeBlock | MLP = SparseMoeBlock(t, f"{p}mlp.", args) if sparse else MLP(t, f"{p}mlp.")
        self.eps = args.rms_norm_eps

    def __call__(
        self,
        xp: Any,
        x: Any,
        layout: Layout,
        kv: Any,
        layer: int,
        cos: Any,
        sin: Any,
        router_bias: RouterBias | None = None,
    ) -> Any:
        """``layer`` indexes ``kv`` (this stage's layers); ``router_bias`` goes to the MoE router."""
        x = x + self.self_attn(
            xp, rms_norm_in_dtype(x, self.input_layernorm, self.eps), layout, kv, layer, cos, sin
        )
        h = rms_norm_in_dtype(x, self.post_attention_layernorm, self.eps)  # [R, H]
        if isinstance(self.mlp, SparseMoeBlock):
            return x + self.mlp(xp, h, router_bias)  # [R, H]
        return x + self.mlp(xp, h)  # [R, H]


def rope_tables(theta: float, head_dim: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, D/2] in fp32, computed as transformers does (fp32 inverse frequencies)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponent)  # [D/2]
    freqs = np.arange(context, dtype=np.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
