"""``strata bench --workload step``: one decode step of the plan's model straight from the CUDA kernels.

Random fp16 weights with the shapes of the plan's model facts (every layer of the whole model, on the first
stage's GPU), random routing, KV at a fixed position. For 1, 2, 4 and 8 rows it times the whole step
(embedding, every layer, final norm, LM head, argmax) eagerly and as a replayed CUDA graph, against the byte
roofline: the step's bytes (`ceilings.decode_step_bytes`, with the distinct experts the last
layer's rows routed to) over the device-to-device copy rate measured in the same run. Then it times each
kernel of a layer alone, in a graph over the layers that run it, at one row. No engine is built: this is
the kernels' own ceiling, without scheduling, sampling or Python between windows.

Shapes: L layers, H hidden, NQ/NKV query/KV heads of D, E experts, K top-k, I expert width, W dense-MLP or
shared-expert width, V vocabulary, S slots, T context, R rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.plan import LaunchPlan

from .ceilings import copy_bandwidth, decode_step_bytes

ROWS = (1, 2, 4, 8)
SLOTS = 8  # one KV slot per row of the largest window
Op = Callable[[dict[str, Any], dict[str, Any]], None]


def step_memory_bytes(facts: ModelFacts, context: int) -> int:
    """Device bytes the step's weights and fp16 KV take (the buffers of a window are small beside them)."""
    layers = range(facts.num_hidden_layers)
    weights = sum(sum(facts.layer_bytes(j)) for j in layers) + facts.embedding_bytes()
    head = (facts.vocab_size * facts.hidden_size + facts.hidden_size) * facts.weight_bytes
    kv = facts.num_hidden_layers * SLOTS * context * facts.kv_bytes_per_token("float16")
    return weights + head + kv


def _rnd(cp: Any, shape: tuple[int, ...], scale: float = 0.02) -> Any:
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(cp.float16)


def make_layer(cp: Any, f: ModelFacts, j: int, context: int) -> dict[str, Any]:
    """Layer ``j``'s weights and KV, shaped as the CUDA decode path holds them."""
    h, d, nq, nkv = f.hidden_size, f.head_dim, f.num_attention_heads, f.num_key_value_heads
    ly: dict[str, Any] = {
        "ln1": _rnd(cp, (h,), 1.0),  # [H]
        "ln2": _rnd(cp, (h,), 1.0),  # [H]
        "qkv": _rnd(cp, ((nq + 2 * nkv) * d, h)),  # [(NQ + 2 NKV) D, H]
        "o": _rnd(cp, (h, nq * d)),  # [H, NQ D]
        "qn": _rnd(cp, (d,), 1.0),  # [D]
        "kn": _rnd(cp, (d,), 1.0),  # [D]
        "kc": cp.zeros((SLOTS, nkv, context, d), cp.float16),  # [S, NKV, T, D]
        "vc": cp.zeros((SLOTS, nkv, context, d), cp.float16),  # [S, NKV, T, D]
    }
    if f.is_sparse(j):
        e, i = f.num_experts, f.moe_intermediate_size
        ly["router"] = _rnd(cp, (e, h))  # [E, H]
        ly["gu"] = _rnd(cp, (e, 2 * i, h))  # [E, 2I, H]
        ly["dn"] = _rnd(cp, (e, h, i))  # [E, H, I]
        width = f.shared_expert_intermediate_size
        if width:
            ly["shared_gate"] = _rnd(cp, (1, h))  # [1, H]
    else:
        width = f.intermediate_size
    if width:
        ly["mlp_gu"] = _rnd(cp, (2 * width, h))  # [2W, H]
        ly["mlp_dn"] = _rnd(cp, (h, width))  # [H, W]
    return ly


def make_buffers(cp: Any, f: ModelFacts, rows: int, scratch: int) -> dict[str, Any]:
    """Every array a window of ``rows`` rows touches, allocated once (a graph replays fixed addresses);
    ``scratch``: the attention kernel's fp32 scratch elements for that many rows."""
    h, d, nq, nkv = f.hidden_size, f.head_dim, f.num_attention_heads, f.num_key_value_heads
    k, width = max(f.num_experts_per_tok, 1), max(f.intermediate_size, f.shared_expert_intermediate_size, 1)
    f32 = cp.float32
    return {
        "ids": cp.zeros(rows, cp.int32),  # [R]
        "pos": cp.zeros(rows, cp.int32),  # [R]
        "slot": cp.arange(rows, dtype=cp.int32) % SLOTS,  # [R]
        "resid": cp.zeros((rows, h), f32),  # [R, H]
        "qkv": cp.zeros((rows, (nq + 2 * nkv) * d), f32),  # [R, (NQ + 2 NKV) D]
        "q": cp.zeros((rows, nq, d), f32),  # [R, NQ, D]
        "attn": cp.zeros((rows, nq * d), f32),  # [R, NQ D]
        "rl": cp.zeros((rows, max(f.num_experts, 1)), f32),  # [R, E]
        "idx": cp.zeros((rows, k), cp.int32),  # [R, K]
        "wts": cp.zeros((rows, k), f32),  # [R, K]
        "hb": cp.zeros((rows * k, max(f.moe_intermediate_size, 1)), f32),  # [R K, I]
        "mlp_gu_flat": cp.zeros(rows * 2 * width, f32),  # viewed as [R, 2W] per layer
        "mlp_h_flat": cp.zeros(rows * width, f32),  # viewed as [R, W] per layer
        "mlp_y": cp.zeros((rows, h), f32),  # [R, H]
        "gate": cp.zeros((rows, 1), f32),  # [R, 1]
        "logits": cp.zeros((rows, f.vocab_size), f32),  # [R, V]
        "out": cp.zeros(rows, cp.int32),  # [R]
        "scratch": cp.zeros(scratch, f32),
    }


def layer_ops(kern: Any, f: ModelFacts, theta: float = 1e6, eps: float = 1e-6) -> dict[str, Op]:
    """A decoder layer as named kernel groups, in the order the CUDA decode path runs them.

    Each op takes the window's buffers and one layer, and does nothing for a layer without that part.
    """

    def mlp_views(b: dict[str, Any], width: int) -> tuple[Any, Any]:
        r = b["resid"].shape[0]
        gu = b["mlp_gu_flat"][: r * 2 * width].reshape(r, 2 * width)  # [R, 2W]
        return gu, b["mlp_h_flat"][: r * width].reshape(r, width)  # [R, W]

    def mlp(b: dict[str, Any], ly: dict[str, Any]) -> None:
        # The dense MLP or the shared expert reads the residual before the routed experts add to it.
        if "mlp_gu" not in ly:
            return
        gu, hid = mlp_views(b, ly["mlp_dn"].shape[1])
        kern.gemv(ly["mlp_gu"], b["resid"], gu, norm=ly["ln2"], eps=eps)
        kern.silu_mul(gu, hid)
        kern.gemv(ly["mlp_dn"], hid, b["mlp_y"])
        if "shared_gate" in ly:
            kern.gemv(ly["shared_gate"], b["resid"], b["gate"], norm=ly["ln2"], eps=eps)

    def router(b: dict[str, Any], ly: dict[str, Any]) -> None:
        if "router" in ly:
            kern.gemv(ly["router"], b["resid"], b["rl"], norm=ly["ln2"], eps=eps)

    def moe(b: dict[str, Any], ly: dict[str, Any]) -> None:
        if "router" in ly:
            kern.moe(
                b["resid"],
                ly["ln2"],
                b["rl"],
                True,
                eps,
                ly["gu"],
                ly["dn"],
                b["resid"],
                b["idx"],
                b["wts"],
                b["hb"],
            )

    def mlp_add(b: dict[str, Any], ly: dict[str, Any]) -> None:
        if "mlp_gu" in ly:
            kern.add_scaled(b["resid"], b["mlp_y"], b["gate"] if "shared_gate" in ly else None)

    return {
        "qkv+norm": lambda b, ly: kern.gemv(ly["qkv"], b["resid"], b["qkv"], norm=ly["ln1"], eps=eps),
        "qknorm_rope": lambda b, ly: kern.qk_norm_rope_kv(
            b["qkv"], ly["qn"], ly["kn"], b["pos"], b["slot"], b["q"], ly["kc"], ly["vc"], theta, eps
        ),
        "attention": lambda b, ly: kern.attention(
            b["q"], ly["kc"], ly["vc"], b["pos"], b["slot"], b["attn"], b["scratch"]
        ),
        "o_proj": lambda b, ly: kern.gemv(ly["o"], b["attn"], b["resid"], True),
        "mlp": mlp,
        "router+norm": router,
        "moe": moe,
        "mlp_add": mlp_add,
    }


def op_applies(name: str, ly: dict[str, Any]) -> bool:
    """Whether layer ``ly`` runs op ``name`` (dense layers have no router, sparse ones may have no MLP)."""
    if name in ("mlp", "mlp_add"):
        return "mlp_gu" in ly
    if name in ("router+norm", "moe"):
        return "router" in ly
    return True


def _over(op: Op, b: dict[str, Any], layers: list[dict[str, Any]]) -> None:
    """One op over several layers, as one body to capture."""
    for ly in layers:
        op(b, ly)


def graph_seconds(cp: Any, body: Callable[[], None], repeats: int) -> float:
    """Capture ``body()`` as a CUDA graph, run it once; the median seconds of ``repeats`` replays."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        body()
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g.launch(s)
        s.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


class KernelModel:
    """The plan's model as random fp16 weights on one GPU, run one decode step at a time by the kernels.

    ``kern`` is the device's `strata_runtime.cuda.ops.Kernels` (anything with its launchers' signatures), and
    ``scratch_size`` its `attention_scratch_size`.
    """

    def __init__(
        self, cp: Any, f: ModelFacts, context: int, kern: Any, scratch_size: Callable[..., int]
    ) -> None:
        self.cp, self.f, self.context = cp, f, context
        self.kern, self.scratch_size = kern, scratch_size
        self.ops = layer_ops(self.kern, f)
        self.layers = [make_layer(cp, f, j, context) for j in range(f.num_hidden_layers)]
        self.emb = _rnd(cp, (f.vocab_size, f.hidden_size))  # [V, H]
        self.head = _rnd(cp, (f.vocab_size, f.hidden_size))  # [V, H]
        self.final_norm = _rnd(cp, (f.hidden_size,), 1.0)  # [H]

    def step(self, b: dict[str, Any]) -> None:
        """Embedding, every layer, final norm and LM head, argmax: one window of b's rows."""
        k = self.kern
        k.embed(self.emb, b["ids"], b["resid"])
        for ly in self.layers:
            for op in self.ops.values():
                op(b, ly)
        k.gemv(self.head, b["resid"], b["logits"], norm=self.final_norm)
        k.argmax(b["logits"], b["out"])

    def window(self, rows: int, position: int) -> dict[str, Any]:
        """Buffers of a ``rows``-row window of fresh token ids at ``position``, run once eagerly (which
        compiles the kernels)."""
        cp = self.cp
        f = self.f
        scratch = self.scratch_size(
            rows, f.num_attention_heads, f.num_key_value_heads, f.head_dim, self.context
        )
        b = make_buffers(cp, f, rows, scratch)
        b["ids"][:] = cp.asarray(
            np.random.default_rng().integers(1, self.f.vocab_size, rows).astype(np.int32)
        )
        b["pos"][:] = position
        self.step(b)
        cp.cuda.Device().synchronize()
        return b

    def time_rows(self, rows: int, position: int, repeats: int, copy: float) -> dict[str, Any]:
        """One row count: the step eager and graph-replayed, against its roofline."""
        cp, f = self.cp, self.f
        b = self.window(rows, position)
        t0 = time.perf_counter()
        for _ in range(3):
            self.step(b)
        cp.cuda.Device().synchronize()
        eager = (time.perf_counter() - t0) / 3
        graph = graph_seconds(cp, lambda: self.step(b), repeats)
        # The last layer's routing stands for every layer's: random weights route alike in each.
        distinct = len(set(b["idx"].get().ravel().tolist())) if f.num_experts else 0
        nbytes = decode_step_bytes(
            f, rows=rows, positions=position + 1, kv_dtype="float16", distinct_experts=distinct
        )
        roof = nbytes.seconds(copy)
        return {
            "rows": rows,
            "eager_ms": eager * 1e3,
            "graph_ms": graph * 1e3,
            "roofline_ms": roof * 1e3,
            "graph_of_roofline": roof / graph,
            "distinct_experts_last_layer": distinct,
            "bytes": {
                "dense": nbytes.dense,
                "experts": nbytes.experts,
                "head": nbytes.head,
                "kv": nbytes.kv,
                "total": nbytes.total,
            },
            "arithmetic": nbytes.arithmetic(copy),
        }

    def time_kernels(self, position: int, repeats: int) -> dict[str, float]:
        """µs per layer of each kernel group at one row, each timed alone in a graph over its layers."""
        b = self.window(1, position)
        out = {}
        for name, op in self.ops.items():
            runs = [ly for ly in self.layers if op_applies(name, ly)]
            if runs:
                out[name] = graph_seconds(self.cp, partial(_over, op, b, runs), repeats) / len(runs) * 1e6
        return out


def gpu_name(cp: Any, device_index: int) -> str:
    name = cp.cuda.runtime.getDeviceProperties(device_index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def run_step(
    plan: LaunchPlan, device_index: int, *, position: int = 300, repeats: int = 20
) -> dict[str, Any]:
    """Time the kernel step of the plan's model on GPU ``device_index``; the figures as a JSON-able dict."""
    import cupy as cp

    from ..cuda.ops import attention_scratch_size, kernels_for

    f, context = plan.model.facts, plan.memory.context
    position = max(0, min(position, context - 1))
    need = step_memory_bytes(f, context)
    with cp.cuda.Device(device_index):
        free, _ = cp.cuda.runtime.memGetInfo()
        if need > 0.95 * free:
            raise MemoryError(
                f"the step workload holds the whole model on cuda:{device_index}: {need / 2**30:.1f} GiB of "
                f"weights and KV, but {free / 2**30:.1f} GiB are free"
            )
        copy = copy_bandwidth(device_index)
        t0 = time.perf_counter()
        model = KernelModel(cp, f, context, kernels_for(device_index), attention_scratch_size)
        cp.cuda.Device().synchronize()
        made_s = time.perf_counter() - t0
        table = [model.time_rows(rows, position, repeats, copy) for rows in ROWS]
        per_kernel = model.time_kernels(position, max(repeats // 2, 3))
        name = gpu_name(cp, device_index)
    del model
    with cp.cuda.Device(device_index):
        cp.get_default_memory_pool().free_all_blocks()
    return {
        "workload": "step",
        "device": f"cuda:{device_index}",
        "gpu": name,
        "model": model_summary(f),
        "context": context,
        "position": position,
        "weights_generated_s": made_s,
        "copy_gbs": copy / 1e9,
        "rows": table,
        "per_kernel_us_per_layer_1_row": per_kernel,
    }


def model_summary(f: ModelFacts) -> dict[str, Any]:
    return {
        "source": f.source,
        "layers": f.num_hidden_layers,
        "hidden": f.hidden_size,
        "heads": f.num_attention_heads,
        "kv_heads": f.num_key_value_heads,
        "head_dim": f.head_dim,
        "experts": f.num_experts,
        "top_k": f.num_experts_per_tok,
        "expert_width": f.moe_intermediate_size,
        "vocab": f.vocab_size,
    }


def render_step(res: dict[str, Any]) -> str:
    m = res["model"]
    lines = [
        f"step: {m['source']} ({m['layers']} layers, hidden {m['hidden']}, "
        f"{m['heads']}/{m['kv_heads']} heads x {m['head_dim']}, {m['experts']} experts top-{m['top_k']} "
        f"of width {m['expert_width']}, "
        f"vocab {m['vocab']}) on {res['device']} ({res['gpu']}), KV at position {res['position']} "
        f"of {res['context']}, random fp16 weights and routing",
        f"device-to-device copy measured in this run: {res['copy_gbs']:,.0f} GB/s (read + write)",
        "roofline = bytes one step must read / copy rate:",
        *(f"  {r['arithmetic']}" for r in res["rows"]),
        "",
        f"{'rows':>4} {'eager ms':>9} {'graph ms':>9} {'roofline ms':>12} {'graph/roofline':>15} "
        f"{'distinct experts (last layer)':>30}",
    ]
    for r in res["rows"]:
        lines.append(
            f"{r['rows']:>4} {r['eager_ms']:9.2f} {r['graph_ms']:9.2f} {r['roofline_ms']:12.2f} "
            f"{100 * r['graph_of_roofline']:14.0f}% {r['distinct_experts_last_layer']:>30}"
        )
    parts = ", ".join(f"{k} {v:.1f}" for k, v in res["per_kernel_us_per_layer_1_row"].items())
    lines += [
        "",
        f"µs per layer at 1 row (each kernel group timed alone in a graph over its layers): {parts}",
    ]
    return "\n".join(lines)
