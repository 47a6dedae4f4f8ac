"""``strata bench --workload step``: one decode step of the plan's model straight from the CUDA kernels.

Random fp16 weights with the shapes of the plan's model facts (every layer of the whole model, on the first
stage's GPU), the plan's routing (the random router's, or calibrated: `strata_runtime.experts.routing`, each
slot with a prompt of its own), KV at a fixed position. For 1, 2, 4 and 8 rows it times the whole step
(embedding, every layer, final norm, LM head, argmax) eagerly and as a replayed CUDA graph, against the byte
roofline: the step's bytes (`ceilings.decode_step_bytes`, with the distinct experts the last
layer's rows routed to) over the device-to-device copy rate measured in the same run. Then it times each
kernel of a layer alone, in a graph over the layers that run it, at one row and at eight, and gives the rate
at which it reads the bytes it must (`kernel_bytes`); and what each costs inside the whole step, where
programmatic launch lets kernels overlap: the step's time less the same step's with that kernel group left
out (`KernelModel.time_in_step`). No engine is built: this is the kernels' own ceiling, without scheduling,
sampling or Python between windows.

With more than one plan (``strata bench --workload step --vary model.decode_attention=auto,cuda_cores``)
it also times the whole step with each plan's kernel, switched in the one model on the same weights and
window, in interleaved rounds (`KernelModel.time_kernel_arms`): the kernels' ratio comes from one run.

Shapes: L layers, H hidden, NQ/NKV query/KV heads of D, E experts, K top-k, I expert width, W dense-MLP or
shared-expert width, V vocabulary, S slots, T context, R rows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.plan import LaunchPlan

from ..backend import Device
from ..cuda.choices import (
    PDL_ROWS,
    AttentionSplit,
    L2Warm,
    attention_split,
    l2_warm,
)
from ..cuda.experts import resident_experts
from ..cuda.layers import (
    LAYER_STEPS,
    LayerStack,
    LayerWeights,
    Step,
    WindowBuffers,
    step_applies,
    supported,
)
from ..cuda.ops import Kernels, argmax_scratch, choose_scratch
from ..cuda.routing import DeviceRouting, RowBias
from ..model.placed import routing_tables
from ..models.ops.distribution import log_min_p
from ..models.qwen3_moe import ModelArgs
from .ceilings import copy_bandwidth, decode_step_bytes

ROWS = (1, 2, 4, 8)
KERNEL_ROWS = (1, 8)  # the row counts whose kernels are timed one by one

CHOICES: dict[str, tuple[float, int, float, float]] = {
    "argmax": (0.0, 0, 1.0, 0.0),
    "temperature 0.7": (1 / 0.7, 0, 1.0, 0.0),
    "top-k 20": (1 / 0.7, 20, 1.0, 0.0),
    "top-p 0.8": (1 / 0.7, 0, 0.8, 0.0),
    "top-k 20 + top-p 0.8": (1 / 0.7, 20, 0.8, 0.0),
    "min-p 0.05": (1 / 0.7, 0, 1.0, 0.05),
    "top-k 20 + min-p 0.05": (1 / 0.7, 20, 1.0, 0.05),
}
"""The ways of choosing a window's tokens `KernelModel.time_choices` times: (inverse temperature, top-k,
top-p, min-p) for the draw, the greedy argmax where the inverse temperature is 0."""
SLOTS = 8  # one KV slot per row of the largest window
ATTENTION_ROUNDS = 3
"""Rounds of `KernelModel.time_kernel_arms`: each times every arm once, in turn."""


def step_memory_bytes(facts: ModelFacts, context: int) -> int:
    """Device bytes the step's weights and fp16 KV take (the buffers of a window are small beside them)."""
    layers = range(facts.num_hidden_layers)
    weights = sum(sum(facts.layer_bytes(j)) for j in layers) + facts.embedding_bytes()
    head = (facts.vocab_size * facts.hidden_size + facts.hidden_size) * facts.weight_bytes
    kv = facts.num_hidden_layers * SLOTS * context * facts.kv_bytes_per_token("float16")
    return weights + head + kv


def kernel_bytes(
    f: ModelFacts, name: str, rows: int, positions: int, distinct_experts: int, sparse: bool = True
) -> int:
    """Bytes kernel group ``name`` (of `LAYER_STEPS`) must read from memory in one layer (``sparse``: an
    MoE layer) for a window of ``rows`` rows, each reading ``positions`` of fp16 KV, whose routing picks
    ``distinct_experts``: its weights (read once for every row) and, for attention, the KV. 0 for the steps
    that read no weights (the router bias, the MLP's add). Summed over the groups each layer runs and over
    the layers, with the LM head, they are `ceilings.decode_step_bytes`."""
    h, wb = f.hidden_size, f.weight_bytes
    q, kv = f.num_attention_heads * f.head_dim, f.num_key_value_heads * f.head_dim
    shared = f.shared_expert_intermediate_size
    if name == "qkv+rope":  # with the input norm, the biases where the model has them, and q/k's norms
        return (h * (q + 2 * kv) + h + (q + 2 * kv if f.attention_bias else 0) + 2 * f.head_dim) * wb
    if name == "attention":
        return rows * positions * f.kv_bytes_per_token("float16")
    if name == "o_proj":
        return q * h * wb
    if name == "mlp":  # an MoE layer's shared expert and its gate; a dense layer's MLP with its norm
        return (3 * h * shared + h) * wb if sparse else (3 * h * f.intermediate_size + h) * wb
    if name == "router+norm":  # with the post-attention norm
        return (f.num_experts * h + h) * wb
    if name == "moe":
        return distinct_experts * f.expert_bytes()
    return 0


def facts_args(f: ModelFacts) -> ModelArgs:
    """The model's numbers as the kernels take them. The facts leave out RoPE's theta, the norm's eps and
    whether top-k weights are renormalised, none of which changes what a step reads or computes."""
    return ModelArgs(
        vocab_size=f.vocab_size,
        hidden_size=f.hidden_size,
        num_hidden_layers=f.num_hidden_layers,
        num_attention_heads=f.num_attention_heads,
        num_key_value_heads=f.num_key_value_heads,
        head_dim=f.head_dim,
        intermediate_size=f.intermediate_size,
        moe_intermediate_size=f.moe_intermediate_size,
        num_experts=f.num_experts,
        num_experts_per_tok=f.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=f.decoder_sparse_step,
        mlp_only_layers=f.mlp_only_layers,
        shared_expert_intermediate_size=f.shared_expert_intermediate_size,
        rope_theta=1e6,
    )


def _rnd(cp: Any, shape: tuple[int, ...], scale: float = 0.02) -> Any:
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(cp.float16)


def random_layer(cp: Any, f: ModelFacts, j: int, router_bias: RowBias | None = None) -> LayerWeights:
    """Layer ``j``'s weights as the CUDA path holds them (q/k/v and gate/up fused), random fp16, and its
    router bias (sparse layers only)."""
    h, d, nq, nkv = f.hidden_size, f.head_dim, f.num_attention_heads, f.num_key_value_heads
    e, i = f.num_experts, f.moe_intermediate_size
    sparse = f.is_sparse(j)
    width = f.shared_expert_intermediate_size if sparse else f.intermediate_size
    gate_up = _rnd(cp, (e, 2 * i, h)) if sparse else None  # [E, 2I, H]
    down = _rnd(cp, (e, h, i)) if sparse else None  # [E, H, I]
    return LayerWeights(
        ln1=_rnd(cp, (h,), 1.0),  # [H]
        ln2=_rnd(cp, (h,), 1.0),  # [H]
        qkv=_rnd(cp, ((nq + 2 * nkv) * d, h)),  # [(NQ + 2 NKV) D, H]
        o=_rnd(cp, (h, nq * d)),  # [H, NQ D]
        q_norm=_rnd(cp, (d,), 1.0),  # [D]
        k_norm=_rnd(cp, (d,), 1.0),  # [D]
        router=_rnd(cp, (e, h)) if sparse else None,  # [E, H]
        gate_up=gate_up,
        down=down,
        mlp_gate_up=_rnd(cp, (2 * width, h)) if width else None,  # [2W, H]
        mlp_down=_rnd(cp, (h, width)) if width else None,  # [H, W]
        shared_gate=_rnd(cp, (1, h)) if sparse and width else None,  # [1, H]
        router_bias=router_bias if sparse else None,
        experts=resident_experts(gate_up, down, cp) if gate_up is not None and down is not None else None,
    )


@dataclass
class StepWindow:
    """A window's buffers through the layers, and what the step adds around them."""

    buffers: WindowBuffers
    ids: Any  # [R] int32 token ids
    logits: Any  # [R, V] fp32
    out: Any  # [R] int32 argmax
    scratch: tuple[Any, Any]  # the argmax's per-slice candidates (`strata_runtime.cuda.ops.argmax_scratch`)


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


@dataclass(frozen=True)
class KernelArm:
    """The kernels of one arm of a step comparison: decode attention on tensor cores where the shape allows
    (else CUDA cores), and a split of a row on tensor cores (None: the engine's)."""

    tensor_cores: bool = True
    split: AttentionSplit | None = None
    warm: L2Warm | None = None
    """How the expert kernels warm L2 (None: the engine's)."""

    def label(self) -> str:
        """A short name of the arm: ``tensor cores`` or ``CUDA cores``, with the split and the L2 warming
        where given."""
        out = "tensor cores" if self.tensor_cores else "CUDA cores"
        if self.split is not None:
            out += f" {self.split}"
        if self.warm is not None:
            out += f", L2 warming {self.warm}"
        return out


class KernelModel:
    """The plan's model as random fp16 weights on one GPU, run one decode step at a time by the kernels.

    The layers are a `strata_runtime.cuda.layers.LayerStack` run by its own kernel sequence (`LAYER_STEPS`),
    exactly as the decode graphs run a stage's. ``kern`` is the device's `strata_runtime.cuda.ops.Kernels`
    (the CPU tests pass the NumPy references, which have the launchers' names and signatures) and ``cp``
    the array module; ``routing``, calibrated routing's tables on that device (None: the router's own);
    ``attention_tc``, decode attention on tensor cores where the device and shape allow
    (``model.decode_attention``).
    """

    def __init__(
        self,
        cp: Any,
        f: ModelFacts,
        context: int,
        kern: Kernels,
        device_index: int = 0,
        routing: DeviceRouting | None = None,
        attention_tc: bool = True,
    ) -> None:
        self.cp, self.f, self.context = cp, f, context
        layers = [
            random_layer(cp, f, j, routing.layer(j) if routing is not None else None)
            for j in range(f.num_hidden_layers)
        ]
        kv = (f.num_hidden_layers, SLOTS, f.num_key_value_heads, context, f.head_dim)  # [L, S, NKV, T, D]
        k_cache, v_cache = cp.zeros(kv, cp.float16), cp.zeros(kv, cp.float16)
        self.stack = LayerStack(device_index, facts_args(f), layers, k_cache, v_cache, kern)
        self.use_attention(attention_tc)
        self.emb = _rnd(cp, (f.vocab_size, f.hidden_size))  # [V, H]
        self.head = _rnd(cp, (f.vocab_size, f.hidden_size))  # [V, H]
        self.final_norm = _rnd(cp, (f.hidden_size,), 1.0)  # [H]

    def use_attention(self, tensor_cores: bool) -> None:
        """Run decode attention on tensor cores where the device and shape allow (else CUDA cores) in every
        layer from now on (`strata_runtime.cuda.layers.LayerWeights.attention_tc`)."""
        for lay in self.stack.layers:
            lay.attention_tc = tensor_cores

    def time_kernel_arms(
        self,
        rows: int,
        position: int,
        repeats: int,
        arms: Mapping[str, KernelArm],
        timer: Callable[[Any, Callable[[], None], int], float] = graph_seconds,
        rounds: int = ATTENTION_ROUNDS,
    ) -> dict[str, Any]:
        """`time_arms` with each arm's kernels (`KernelArm`: decode attention and its split)."""
        contexts = {name: partial(self.arm, a) for name, a in arms.items()}
        return self.time_arms(rows, position, repeats, contexts, timer, rounds)

    @contextlib.contextmanager
    def arm(self, kernels: KernelArm) -> Iterator[None]:
        """Every layer's kernels as ``kernels`` says inside the block: decode attention on tensor cores
        where the shape allows (else CUDA cores), split as its ``split`` where given; the layers' own choice
        again after it."""
        before = self.stack.attention_tc
        self.use_attention(kernels.tensor_cores)
        try:
            split, warm = kernels.split, kernels.warm
            with (
                attention_split(split) if split is not None else contextlib.nullcontext(),
                l2_warm(warm) if warm is not None else contextlib.nullcontext(),
            ):
                yield
        finally:
            self.use_attention(before)

    def time_arms(
        self,
        rows: int,
        position: int,
        repeats: int,
        arms: Mapping[str, Callable[[], contextlib.AbstractContextManager[Any]]],
        timer: Callable[[Any, Callable[[], None], int], float] = graph_seconds,
        rounds: int = ATTENTION_ROUNDS,
    ) -> dict[str, Any]:
        """The whole step at ``rows`` rows inside each arm's context (name -> a context manager factory that
        sets that arm's kernels), on one window: ``rounds`` rounds, each timing every arm in turn by
        ``timer`` as the decode graphs launch it; ms per step (the median of the rounds) and each arm's
        argmax token of each row."""
        w = self.window(rows, position)
        times: dict[str, list[float]] = {name: [] for name in arms}
        tokens: dict[str, list[int]] = {}
        with _as_engine(self.stack.kern, rows):
            for arm in arms.values():  # each arm's kernels compiled before any timing
                with arm():
                    self.step(w)
            for _ in range(rounds):
                for name, arm in arms.items():
                    with arm():
                        times[name].append(timer(self.cp, partial(self.step, w), repeats))
                    out = w.out.get() if hasattr(w.out, "get") else w.out
                    tokens[name] = [int(t) for t in out]
        return {
            "rows": rows,
            "ms": {name: float(np.median(t)) * 1e3 for name, t in times.items()},
            "tokens": tokens,
        }

    def step(self, w: StepWindow, leave_out: str | None = None) -> None:
        """Embedding, every layer, final norm and LM head, argmax: one window of w's rows; ``leave_out``
        names a group of `LAYER_STEPS` left out of every layer (`time_in_step`)."""
        k, s = self.stack.kern, self.stack
        k.embed(self.emb, w.ids, w.buffers.resid)
        if leave_out is None:
            s.run(w.buffers)
        else:
            for j, lay in enumerate(s.layers):
                for name, step in LAYER_STEPS.items():
                    if name != leave_out:
                        step(k, s.args, lay, w.buffers, s.k_cache[j], s.v_cache[j])
        k.gemv(self.head, w.buffers.resid, w.logits, norm=self.final_norm)
        k.argmax(w.logits, w.out, w.scratch)

    def window(self, rows: int, position: int, seed: int | None = None) -> StepWindow:
        """Buffers of a ``rows``-row window of fresh token ids (drawn with ``seed``) at ``position``, each row
        in its own slot, run once eagerly (which compiles the kernels)."""
        cp, f, s = self.cp, self.f, self.stack
        b = WindowBuffers(cp, rows, s.args, s.context, s.mlp_width)
        b.pos[...] = position
        b.slot[...] = cp.arange(rows, dtype=cp.int32) % SLOTS
        ids = cp.asarray(np.random.default_rng(seed).integers(1, f.vocab_size, rows).astype(np.int32))
        logits = cp.zeros((rows, f.vocab_size), cp.float32)
        w = StepWindow(b, ids, logits, cp.zeros(rows, cp.int32), argmax_scratch(cp, rows, f.vocab_size))
        self.step(w)
        cp.cuda.Device().synchronize()
        return w

    def time_rows(self, rows: int, position: int, repeats: int, copy: float) -> dict[str, Any]:
        """One row count: the step eager and graph-replayed, against its roofline."""
        cp, f = self.cp, self.f
        w = self.window(rows, position)
        t0 = time.perf_counter()
        for _ in range(3):
            self.step(w)
        cp.cuda.Device().synchronize()
        eager = (time.perf_counter() - t0) / 3
        with _as_engine(self.stack.kern, rows):  # as the decode graphs are captured
            graph = graph_seconds(cp, lambda: self.step(w), repeats)
        distinct = self._distinct_experts(w)
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

    def time_kernels(self, position: int, repeats: int, rows: int = 1) -> dict[str, dict[str, float]]:
        """Each kernel group at ``rows`` rows, timed alone in a graph over its layers: µs per layer, the
        bytes per layer it must read (`kernel_bytes`, the experts as the window's last layer routed) and
        the rate that makes (GB/s; 0 for a group that moves next to nothing)."""
        w = self.window(rows, position)
        distinct = self._distinct_experts(w)
        out = {}
        for name, step in LAYER_STEPS.items():
            runs = [j for j, lay in enumerate(self.stack.layers) if step_applies(name, lay)]
            if runs:
                body = partial(self._over, step, w.buffers, runs)
                us = graph_seconds(self.cp, body, repeats) / len(runs) * 1e6
                each = [
                    kernel_bytes(self.f, name, rows, position + 1, distinct, self.f.is_sparse(j))
                    for j in runs
                ]
                nbytes = sum(each) / len(each)
                out[name] = {"us": us, "bytes": nbytes, "gbs": nbytes / us / 1e3 if us > 0 else 0.0}
        return out

    def time_in_step(
        self,
        rows: int,
        position: int,
        repeats: int,
        timer: Callable[[Any, Callable[[], None], int], float] = graph_seconds,
        rounds: int = 3,
    ) -> dict[str, float]:
        """What each kernel group of `LAYER_STEPS` costs inside the whole step at ``rows`` rows, launched as
        the decode graphs launch it (with programmatic launch where they take it, so a kernel may overlap
        the tail of the one before): µs per layer that runs the group, the step's time (by ``timer``) less
        the same step's with the group left out of every layer, the median of ``rounds`` such pairs, each
        pair timed back to back. Leaving a group out leaves its outputs stale, which the groups after it
        read in the same time. A group that overlaps its neighbours costs less here than alone
        (`time_kernels`); what remains is what removing it would save."""
        w = self.window(rows, position)
        layers = self.stack.layers
        groups = {name: sum(step_applies(name, lay) for lay in layers) for name in LAYER_STEPS}
        saved: dict[str, list[float]] = {name: [] for name, n in groups.items() if n}
        with _as_engine(self.stack.kern, rows):
            for _ in range(rounds):
                for name in saved:
                    full = timer(self.cp, partial(self.step, w), repeats)
                    without = timer(self.cp, partial(self.step, w, name), repeats)
                    saved[name].append(full - without)
        return {name: float(np.median(v)) / groups[name] * 1e6 for name, v in saved.items()}

    def time_choices(
        self,
        rows: int,
        position: int,
        repeats: int,
        timer: Callable[[Any, Callable[[], None], int], float] = graph_seconds,
        seed: int | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Each of `CHOICES` on the logits of a ``rows``-row step (of token ids drawn with ``seed``), timed
        alone by ``timer`` (a graph's replays on a GPU): µs per window, and the token it chose for each row
        (each row draws at its own uniform number, spread over (0, 1)). A draw's case also times the whole
        distribution it takes (`Kernels.distribution`: what a sampled window decided on the device verifies
        its proposals against), as ``distribution_us``, and keeps it as ``distribution``. Both run split over
        slices of each row, as the engine runs them; ``one_block_us`` and ``one_block_distribution_us`` time
        them by one block per row, the form before the split (the same tokens and distributions)."""
        cp, k = self.cp, self.stack.kern
        w = self.window(rows, position, seed)
        u = cp.asarray(np.linspace(0.1, 0.9, rows, dtype=np.float32))
        scratch = choose_scratch(cp, *w.logits.shape)
        out: dict[str, dict[str, Any]] = {}
        for name, (inv_temp, top_k, top_p, min_p) in CHOICES.items():
            chosen = cp.zeros(rows, cp.int32 if inv_temp == 0 else np.int64)
            lmp = log_min_p(min_p)
            if inv_temp == 0:
                body = partial(k.argmax, w.logits, chosen, w.scratch)
            else:
                t, kk, pp, mm = (
                    cp.asarray(np.full(rows, v, dtype))
                    for v, dtype in (
                        (inv_temp, np.float32),
                        (top_k, np.int32),
                        (top_p, np.float32),
                        (lmp, np.float32),
                    )
                )
                one = partial(k.choose, w.logits, t, u, kk, pp, chosen, split=False, log_min_p=mm)
                one_us = timer(cp, one, repeats) * 1e6
                body = partial(k.choose, w.logits, t, u, kk, pp, chosen, scratch=scratch, log_min_p=mm)
            us = timer(cp, body, repeats) * 1e6
            tokens = chosen.get() if hasattr(chosen, "get") else chosen
            out[name] = {"us": us, "tokens": [int(x) for x in tokens]}
            if inv_temp > 0:
                out[name]["one_block_us"] = one_us
                dist = cp.zeros(w.logits.shape, np.float64)
                cuts = (inv_temp, top_k, top_p, dist)
                one = partial(k.distribution, w.logits, *cuts, split=False, log_min_p=lmp)
                out[name]["one_block_distribution_us"] = timer(cp, one, repeats) * 1e6
                body = partial(k.distribution, w.logits, *cuts, scratch=scratch, log_min_p=lmp)
                out[name]["distribution_us"] = timer(cp, body, repeats) * 1e6
                out[name]["distribution"] = dist.get() if hasattr(dist, "get") else dist
        return out

    def _distinct_experts(self, w: StepWindow) -> int:
        """The experts the window's rows routed to in the last layer (which stands for every layer's: random
        weights, and mid-stack calibrated routing, route alike in each); 0 for a dense model."""
        return len(set(w.buffers.idx.get().ravel().tolist())) if self.f.num_experts else 0

    def _over(self, step: Step, b: WindowBuffers, runs: list[int]) -> None:
        """One step over several layers, as one body to capture."""
        s = self.stack
        for j in runs:
            step(s.kern, s.args, s.layers[j], b, s.k_cache[j], s.v_cache[j])


def _as_engine(kern: Any, rows: int) -> contextlib.AbstractContextManager[None]:
    """Launches as the decode graphs make them, with programmatic launch at the row counts that take it
    (`PDL_ROWS`), where ``kern`` launches kernels at all (the NumPy references run in place)."""
    programmatic = getattr(kern, "programmatic", None)
    return programmatic(rows in PDL_ROWS) if programmatic is not None else contextlib.nullcontext()


def gpu_name(cp: Any, device_index: int) -> str:
    name = cp.cuda.runtime.getDeviceProperties(device_index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def step_routing(plan: LaunchPlan, device: Device) -> DeviceRouting | None:
    """Calibrated routing's tables on ``device`` when the plan asks for it, each of the `SLOTS` slots with a
    seeded prompt of its own (so each row of a window routes as a request of its own)."""
    tables = routing_tables(plan, facts_args(plan.model.facts), SLOTS)
    if tables is None:
        return None
    g = np.random.default_rng(plan.model.seed)
    for slot in range(SLOTS):
        tables.admit(slot, g.integers(1, plan.model.facts.vocab_size, 16).tolist())
    return DeviceRouting(tables, device)


def attention_name(on_tensor_cores: bool) -> str:
    """How the step's result names a decode attention kernel."""
    return "tensor cores (attn_tc)" if on_tensor_cores else "CUDA cores (attn_split)"


def kernel_arms(plans: Mapping[str, LaunchPlan]) -> dict[str, KernelArm]:
    """Each plan's kernels (its decode attention) for `KernelModel.time_kernel_arms`. The step switches only
    that kernel in one model, so the plans may differ in nothing else it builds: the model, its routing and
    seed, the context and the GPU; raises ValueError naming what differs."""
    (first, base), *rest = plans.items()
    for name, plan in rest:
        for what, a, b in (
            ("model", base.model.facts, plan.model.facts),
            ("routing", (base.model.routing, base.model.seed), (plan.model.routing, plan.model.seed)),
            ("memory.context", base.memory.context, plan.memory.context),
            ("first GPU", base.stages[0].gpu, plan.stages[0].gpu),
        ):
            if a != b:
                raise ValueError(
                    "the step workload compares plans that differ only in model.decode_attention (it "
                    f"switches that kernel in one model), but {first} and {name} differ in their {what}"
                )
    return {name: KernelArm(plan.model.decode_attention == "tensor_cores") for name, plan in plans.items()}


def run_step(
    plan: LaunchPlan,
    device_index: int,
    *,
    position: int = 300,
    repeats: int = 20,
    versus: Mapping[str, LaunchPlan] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the kernel step of the plan's model on GPU ``device_index``; the figures as a JSON-able dict.
    ``versus``: several plans by name (``plan`` among them, first), which differ only in
    ``model.decode_attention``: the whole step is also timed with each one's kernel (`kernel_arms`).
    ``progress`` is told each part as it ends, with the seconds since the start (the whole takes minutes on
    a large model)."""
    begun = time.perf_counter()

    def done(what: str) -> None:
        if progress is not None:
            progress(f"{what} ({time.perf_counter() - begun:.0f} s)")

    import cupy as cp

    from ..cuda.ops import kernels_for

    arms = kernel_arms(versus) if versus is not None and len(versus) > 1 else None
    f, context = plan.model.facts, plan.memory.context
    position = max(0, min(position, context - 1))
    why = supported(facts_args(f), np.float16, np.float16, device_index)
    if why is not None:
        raise ValueError(f"the step workload times the CUDA kernels, which cannot run here: {why}")
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
        routing = step_routing(plan, Device("cuda", device_index))
        kern = kernels_for(device_index)
        tc = plan.model.decode_attention == "tensor_cores"
        group = f.num_attention_heads // f.num_key_value_heads
        on_tc = kern.attention_on_tc(f.head_dim, group, tc)
        model = KernelModel(cp, f, context, kern, device_index, routing, attention_tc=tc)
        cp.cuda.Device().synchronize()
        made_s = time.perf_counter() - t0
        done(f"weights of {f.num_hidden_layers} layers made")
        table = []
        for rows in ROWS:
            table.append(model.time_rows(rows, position, repeats, copy))
            done(f"the step at {rows} row{'s' * (rows > 1)} timed, eager and as a graph")
        kernels = {
            str(rows): model.time_kernels(position, max(repeats // 2, 3), rows) for rows in KERNEL_ROWS
        }
        done("each kernel timed alone")
        in_step = {
            str(rows): model.time_in_step(rows, position, max(repeats // 2, 3)) for rows in KERNEL_ROWS
        }
        done("each kernel group timed inside the step")
        choices = {
            str(rows): model.time_choices(rows, position, max(repeats // 2, 3)) for rows in KERNEL_ROWS
        }
        done("the token choices timed")
        by_arm = None
        if arms is not None:
            named = {
                name: KernelArm(kern.attention_on_tc(f.head_dim, group, a.tensor_cores), a.split).label()
                for name, a in arms.items()
            }
            timed = [model.time_kernel_arms(rows, position, repeats, arms) for rows in ROWS]
            by_arm = {"kernels": named, "rounds": ATTENTION_ROUNDS, "rows": timed}
            done("the attention arms timed")
        name = gpu_name(cp, device_index)
    del model, routing
    with cp.cuda.Device(device_index):
        cp.get_default_memory_pool().free_all_blocks()
    return {
        "workload": "step",
        "device": f"cuda:{device_index}",
        "gpu": name,
        "model": model_summary(f),
        "routing": plan.model.routing,
        "attention": attention_name(on_tc),
        "context": context,
        "position": position,
        "weights_generated_s": made_s,
        "copy_gbs": copy / 1e9,
        "rows": table,
        "per_kernel_us_per_layer": {r: {k: v["us"] for k, v in ks.items()} for r, ks in kernels.items()},
        "per_kernel_bytes_per_layer": {
            r: {k: v["bytes"] for k, v in ks.items()} for r, ks in kernels.items()
        },
        "per_kernel_gbs": {r: {k: v["gbs"] for k, v in ks.items()} for r, ks in kernels.items()},
        "in_step_us_per_layer": in_step,
        **{key: _per_rows(choices, key) for key in CHOICE_TIMES},
        **({"kernel_arms": by_arm} if by_arm is not None else {}),
    }


CHOICE_TIMES = {
    "choice_us": "us",
    "distribution_us": "distribution_us",
    "one_block_us": "one_block_us",
    "one_block_distribution_us": "one_block_distribution_us",
}
"""The result's tables of `KernelModel.time_choices` (row count -> case -> µs), by the key of each case's."""


def _per_rows(choices: dict[str, dict[str, dict[str, Any]]], table: str) -> dict[str, dict[str, float]]:
    """One of `CHOICE_TIMES`'s tables from each row count's `KernelModel.time_choices`."""
    key = CHOICE_TIMES[table]
    return {r: {k: v[key] for k, v in cs.items() if key in v} for r, cs in choices.items()}


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
