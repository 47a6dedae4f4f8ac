"""A pipeline stage: layers [a, b) of the main model on one device, with every slot's KV for them.

The first stage also holds the token embedding; the last holds the final norm and the LM head (and, in
`strata_runtime.model.mtp`, the MTP head and the slot drafters). ``forward`` takes the hidden rows of a window
and returns them; hidden rows cross devices in `strata_runtime.model.placed`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

from strata_cfg.schema.windows import MAX_WINDOW_ROWS, PROMPT_GRAPH_MAX

from ..backend import Array, Device, cupy_module
from ..experts.cache import Policy
from ..experts.routing import RoutingTables, apply_bias
from ..experts.store import ExpertStore
from ..layout import Layout
from ..models.ops.adjust import mask_logits
from ..models.ops.choose import Draws, choose_on_host
from ..models.ops.distribution import distribution, inverse_cdf, verify_sampled
from ..models.ops.norm import rms_norm_in_dtype
from ..models.qwen3_moe import DecoderLayer, ModelArgs, RouterBias, SparseMoeBlock, linear, rope_tables
from .adjust import TokenCounts
from .kvcache import KVCache

if TYPE_CHECKING:
    from ..cuda.decode import CudaLayers
    from ..cuda.experts import CudaExperts
    from ..cuda.head import CudaHead
    from ..cuda.prefill import CudaPrefill
    from ..cuda.routing import DeviceRouting


def in_graph_windows(xp: Any, forward: Callable[..., Array], layout: Layout, *rows: Array) -> Array:
    """``forward(*cuts, window_layout)`` over the layout's rows in consecutive windows of `MAX_WINDOW_ROWS`
    (each array of ``rows`` [R, ...] cut alike), the outputs concatenated: how a short prompt reaches the
    decode graphs, which take at most that many rows."""
    step = MAX_WINDOW_ROWS
    parts = [
        forward(*(r[a : a + step] for r in rows), layout.rows_between(a, a + step))
        for a in range(0, layout.rows, step)
    ]
    return xp.concatenate(parts, axis=0)


@dataclass
class StageWeights:
    """One stage's tensors, and the expert cache over them once a stage is built on them."""

    tensors: dict[str, Array]
    experts: ExpertStore | None = None
    cuda_experts: CudaExperts | None = None
    """The cache's tables on the stage's GPU: one per cache, so that every model reading it sees its swaps."""


class Rope:
    """cos/sin tables [T, D/2] (fp32) on one device, looked up by row position."""

    def __init__(self, device: Device, args: ModelArgs, context: int) -> None:
        cos, sin = rope_tables(args.rope_theta, args.head_dim, context)
        self.device = device
        self.cos, self.sin = device.asarray(cos), device.asarray(sin)  # [T, D/2] each

    @property
    def context(self) -> int:
        """Positions the tables cover (the KV cache's length)."""
        return int(self.cos.shape[0])

    def at(self, layout: Layout) -> tuple[Array, Array]:
        pos = self.device.xp.asarray(layout.positions())  # [R]
        return self.cos[pos], self.sin[pos]  # [R, D/2] each


class Stage:
    """Layers [a, b) on one device, their per-slot KV, and the embedding / head where placed."""

    def __init__(
        self,
        index: int,
        device: Device,
        layers: tuple[int, int],
        args: ModelArgs,
        tensors: dict[str, Array],
        *,
        first: bool,
        last: bool,
        slots: int,
        context: int,
        kv_dtype: DTypeLike,
        routing: RoutingTables | None = None,
        expert_slots: int | None = None,
        head_experts_whole: bool = False,
        policy: Policy | None = None,
        shared: StageWeights | None = None,
        helpers: Sequence[tuple[Device, int]] = (),
        prefill_split_q: bool = True,
        prompt_graph_rows: int = PROMPT_GRAPH_MAX,
        prefill_graph_rows: int = 0,
        attention_tc: bool = True,
    ) -> None:
        """``routing``: every slot's calibrated-routing tables (host), or None for the model's own router.
        ``expert_slots``: VRAM slots for the routed experts of these layers when they do not all fit
        (their tensors in ``tensors`` are then host arrays, the host tier); None: all resident.
        ``head_experts_whole``: under a cache, the MTP head's layer holds all its experts in those slots (the
        plan's ``experts_whole``), not an even share.
        ``shared``: these tensors as other models of the same stage layout share them; the first stage built
        on them makes the expert cache, the others read the same one. ``helpers``: the cache's second tier,
        (device, slots) on each helper or peer device (`strata_runtime.model.placed.helper_slots`).
        ``prefill_split_q``: prompt attention on a CUDA device holds q as two fp16 parts (False: fp16 q,
        ``model.prefill_q``). ``prompt_graph_rows``: a prompt chunk of at most this many rows runs on a GPU
        as 8-row graph windows, a longer one through the CUDA prefill path (``memory.prompt_graph_rows``),
        replayed as a CUDA graph where it pads to at most ``prefill_graph_rows`` rows
        (``memory.prefill_graph_rows``). ``attention_tc``: decode attention on a CUDA device runs on tensor
        cores where the model's shape allows (False: on CUDA cores; ``model.decode_attention``)."""
        self.index, self.device, self.layer_range, self.args = index, device, layers, args
        self.attention_tc = attention_tc
        self.prompt_graph_rows = max(prompt_graph_rows, MAX_WINDOW_ROWS)  # a decode window is one graph
        self.routing = routing
        self.prefill_split_q = prefill_split_q
        self.prefill_graph_rows = prefill_graph_rows
        self.first, self.last = first, last
        self.layers = [
            DecoderLayer(tensors, f"model.layers.{i}.", args, args.is_sparse(i)) for i in range(*layers)
        ]
        sparse = [
            (i, layer.mlp.experts)
            for i, layer in zip(range(*layers), self.layers, strict=True)
            if isinstance(layer.mlp, SparseMoeBlock)
        ]
        self.n_sparse = len(sparse)
        gate_up = [ex.gate_up_proj for _, ex in sparse]
        down = [ex.down_proj for _, ex in sparse]
        ids = [i for i, _ in sparse]
        mtp = "mtp.layers.0.mlp.experts.gate_up_proj"
        if last and mtp in tensors:  # the MTP head's routed experts share this stage's cache
            ids.append(args.num_hidden_layers)
            gate_up.append(tensors[mtp])
            down.append(tensors["mtp.layers.0.mlp.experts.down_proj"])
        self.shared = shared
        self.policy = policy
        """How this model's expert cache adapts (`Engine.restore_experts` gives a shared cache this one)."""
        if shared is not None and shared.experts is not None:
            self.experts = shared.experts
        else:
            fixed = frozenset(range(self.n_sparse, len(ids)))  # the MTP head's layer: see Residency.fixed
            self.experts = ExpertStore(
                device, ids, gate_up, down, expert_slots, policy, fixed, helpers, whole=head_experts_whole
            )
            if shared is not None:
                shared.experts = self.experts
        if self.experts.cached:
            for j, (_, ex) in enumerate(sparse):
                ex.read_from(self.experts, j)
        self.kv = KVCache(
            device, len(self.layers), slots, args.num_key_value_heads, context, args.head_dim, kv_dtype
        )
        self.rope = Rope(device, args, context)
        self.embed_tokens = tensors.get("model.embed_tokens.weight")  # [V, H] on the first stage
        self.norm = tensors.get("model.norm.weight")  # [H] on the last stage
        self.lm_head = tensors.get("lm_head.weight")  # [V, H] on the last stage
        self.token_counts = TokenCounts(device, slots, args.vocab_size) if last else None
        """Every slot's token counts and logit bias, for adjusting logits on this device (last stage)."""
        host = {id(a) for a in (*self.experts.host_gate_up, *self.experts.host_down)}
        self.weight_bytes = sum(int(t.nbytes) for t in tensors.values() if id(t) not in host)
        """Bytes of the tensors held on the device (the expert cache's pool is counted apart)."""
        self.cuda_experts: CudaExperts | None = None  # the expert kernels' tables, on GPUs
        self.cuda: CudaLayers | None = None  # the CUDA decode graphs, on GPUs that can run them
        self.cuda_prefill: CudaPrefill | None = None  # the CUDA path for long prefill chunks
        self.cuda_head: CudaHead | None = None
        self.cuda_routing: DeviceRouting | None = None  # the routing tables on this GPU
        self.cuda_refused: str | None = None
        if device.is_cuda:
            self._build_cuda()

    def _build_cuda(self) -> None:
        from ..cuda import choices, decode, experts, head, layers, prefill
        from ..cuda.routing import DeviceRouting

        dtype = self.layers[0].input_layernorm.dtype if self.layers else self.kv.k.dtype
        self.cuda_refused = layers.supported(self.args, dtype, self.kv.k.dtype, self.device.index)
        if self.cuda_refused is not None:
            return
        gpu, eps = self.device.index, self.args.rms_norm_eps
        if self.routing is not None:
            self.cuda_routing = DeviceRouting(self.routing, self.device)
        if self.shared is not None and self.shared.cuda_experts is not None:
            self.cuda_experts = self.shared.cuda_experts
        else:
            self.cuda_experts = experts.CudaExperts(self.experts, gpu)
            if self.shared is not None:
                self.shared.cuda_experts = self.cuda_experts
        main = self.cuda_experts.view(0, self.n_sparse)
        first = self.layer_range[0]
        stack = layers.LayerStack.of(
            gpu,
            self.layers,
            self.args,
            self.kv.k,
            self.kv.v,
            self.cuda_routing,
            first,
            main,
            self.attention_tc,
        )
        lm_head = self.lm_head if self.last else None
        gemv = choices.head_gemv_shapes(*lm_head.shape) if lm_head is not None else ()
        self.cuda = decode.CudaLayers(stack, gemv)
        self.cuda_prefill = prefill.CudaPrefill(
            stack, experts=main, split_q=self.prefill_split_q, graph_rows=self.prefill_graph_rows
        )
        if self.last:
            self.cuda_head = head.CudaHead(gpu, self.norm, self.lm_head, eps)

    def embed(self, token_ids: Array) -> Array:
        """The embedding rows [R, H] of ``token_ids``: host ids, or ids already on this device (first stage
        only)."""
        assert self.embed_tokens is not None, f"stage {self.index} holds no embedding"
        with self.device.use():
            if isinstance(token_ids, np.ndarray) and self.device.is_cuda:
                token_ids = self.device.upload(token_ids)
            return self.embed_tokens[token_ids]  # [R, H]

    def forward(
        self, hidden: Array, layout: Layout, positions: Array | None = None, account: bool = True
    ) -> Array:
        """Run this stage's layers over a window's hidden rows [R, H], writing their KV; then account the
        window's routing to the expert cache (which may start moving experts, without waiting). The first
        window after a prompt chunk through the CUDA prefill path that is not one itself waits on the host
        for that chunk's routing counts first, so that the rebalance they bring is queued ahead of it
        (`CudaExperts.before_window`).

        On a GPU a window of at most 8 rows (decode, drafts) runs as one replayed CUDA graph, a prompt
        chunk of up to `prompt_graph_rows` rows as several, and a longer chunk through the CUDA prefill path;
        all come back in fp32. CPU devices run the array code below.

        ``positions`` [R] on this device: the rows' positions, decided on a device by the window before
        (the layout then gives only slots and row counts). A CUDA graph reads them where they are; any other
        path reads them to the host first. Without ``account`` the KV lengths are left to the caller (a
        window decided on the device is accounted when the host finishes it).
        """
        with self.device.use():
            if positions is not None and not (self.cuda is not None and layout.rows <= MAX_WINDOW_ROWS):
                layout, positions = layout.placed(self.device.to_host(positions)), None
            if account:
                self.kv.begin(layout.segments)
            prefill = positions is None and self._through_prefill(layout)
            if self.cuda_experts is not None and not prefill:
                self.cuda_experts.before_window()  # a prompt chunk's rebalance lands before this window
            chunk = layout.rows > MAX_WINDOW_ROWS  # on the array path: a window that holds a prompt chunk
            if self.cuda_experts is None:
                self.experts.begin_window(prompt=chunk)
            if positions is not None:
                assert self.cuda is not None
                out = self.cuda.forward(hidden, layout, positions)  # [R, H] fp32
            else:
                out = self._layers(hidden, layout)
            if self.cuda_experts is not None:
                self.cuda_experts.after_window(prompt=prefill)
            else:
                self.experts.end_window(prompt=chunk)
            return out

    def expert_scores(self) -> np.ndarray | None:
        """What this stage's expert cache has learned of the routing so far (`ExpertStore.scores`), for
        `recall_experts`; None without a cache that adapts."""
        return self.experts.scores() if self.experts.cached else None

    def recall_experts(self, scores: np.ndarray) -> None:
        """Bring back into this stage's expert cache what ``scores`` (from `expert_scores`) had taught it, and
        rebalance it at once (`ExpertStore.recall`): on a GPU the swaps' copies are queued on the current
        stream, which must be the stage's, before the windows that read the new tables."""
        if not self.experts.cached:
            return
        if self.cuda_experts is not None:
            self.cuda_experts.recall(scores, cupy_module().cuda.get_current_stream())
        else:
            self.experts.recall(scores)

    def _through_prefill(self, layout: Layout) -> bool:
        """Whether a window of ``layout`` goes through the CUDA prefill path."""
        return self.cuda_prefill is not None and layout.rows > self.prompt_graph_rows

    def _layers(self, hidden: Array, layout: Layout) -> Array:
        xp = self.device.xp
        if self.cuda_prefill is not None and self._through_prefill(layout):
            return self.cuda_prefill.forward(hidden, layout)  # [R, H] fp32
        # Graph windows take every chunk up to the cap where the stage has no prefill path.
        if self.cuda is not None and 0 < layout.rows <= PROMPT_GRAPH_MAX:
            if layout.rows <= MAX_WINDOW_ROWS:
                return self.cuda.forward(hidden, layout)  # [R, H] fp32
            # A short prompt: consecutive windows of 8 rows through the graphs. The prefill path's launches
            # from Python cost about the same for 9 rows as for 64 (``memory.prompt_graph_rows`` says
            # how many windows cost less).
            return in_graph_windows(xp, self.cuda.forward, layout, hidden)  # [R, H] fp32
        cos, sin = self.rope.at(layout)  # [R, D/2] each
        for j, layer in enumerate(self.layers):
            bias = self._router_bias(layout, self.layer_range[0] + j)
            hidden = layer(xp, hidden, layout, self.kv, j, cos, sin, bias)  # [R, H]
        return hidden

    def _router_bias(self, layout: Layout, layer: int) -> RouterBias | None:
        """The array path's calibrated-routing bias for model layer ``layer`` and the window's rows."""
        if self.routing is None or not self.args.is_sparse(layer):
            return None
        return partial(
            apply_bias,
            layer=layer,
            slots=layout.row_slots(),
            positions=layout.positions(),
            tables=self.routing,
            xp=self.device.xp,
        )

    def load_routing(self, slot: int) -> None:
        """Refresh this GPU's copy of ``slot``'s routing tables after the host tables changed."""
        if self.cuda_routing is not None:
            self.cuda_routing.load(slot)

    def final_norm(self, hidden: Array) -> Array:
        """The post-final-norm hidden rows [R, H] (last stage only): the LM head's input and the MTP's."""
        if self.cuda_head is not None:
            return self.cuda_head.final_norm(hidden)  # [R, H] fp32
        with self.device.use():
            return rms_norm_in_dtype(hidden, self.norm, self.args.rms_norm_eps)

    def logits(self, normed: Array) -> Array:
        """Logits [R, V] in fp32 (last stage only)."""
        if self.cuda_head is not None:
            return self.cuda_head.logits(normed)  # [R, V] fp32
        assert self.lm_head is not None, f"stage {self.index} holds no LM head"
        with self.device.use():
            x = normed.astype(self.lm_head.dtype, copy=False)
            return linear(x, self.lm_head).astype(self.device.xp.float32)

    def argmax(self, logits: Array) -> Array:
        """Each row's argmax [R] (int64, the lowest index on ties) of logits [R, V] on this device (last stage
        only)."""
        if self.cuda_head is not None:
            return self.cuda_head.argmax(logits)
        with self.device.use():
            return self.device.xp.argmax(logits, axis=-1)

    def distribution(
        self, logits: Array, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
    ) -> Array:
        """Each row's next-token distribution [R, V] (float64) of logits [R, V] on this device (last stage
        only), at a sampled request's temperature, top-k, top-p and min-p. With the CUDA head, the
        distribution its device choice draws from (`strata_runtime.models.ops.choose`); otherwise the rule's
        own steps on this device's arrays (`strata_runtime.models.ops.distribution`). The two differ only
        where a cut falls within rounding of a token's edge."""
        if self.cuda_head is not None:
            return self.cuda_head.distribution(logits, temperature, top_k, top_p, min_p)
        with self.device.use():
            return distribution(logits, temperature, top_k, top_p, self.device.xp, min_p=min_p)

    def draw(self, probs: Array, uniforms: Array) -> Array:
        """Each row's draw [R] (int64) from probs [R, V] (float64) at uniforms [R] on this device (last stage
        only): one kernel with the CUDA head, the rule's array steps (`inverse_cdf`) otherwise. The two
        differ only where a uniform times a row's total falls within rounding of a token's edge."""
        if self.cuda_head is not None:
            return self.cuda_head.draw(probs, uniforms)
        xp = self.device.xp
        with self.device.use():
            return xp.stack([inverse_cdf(row, u, xp) for row, u in zip(probs, uniforms, strict=True)])

    def verify_sampled(self, p: Array, q: Array, tokens: Array, uniforms: Array) -> tuple[Array, Array]:
        """One slot's speculative rejection sampling on this device (last stage only): one kernel with the
        CUDA head, the rule's array steps otherwise (`strata_runtime.models.ops.distribution.
        verify_sampled`); (proposals kept, the token after them), 0-d arrays."""
        if self.cuda_head is not None:
            return self.cuda_head.verify_sampled(p, q, tokens, uniforms)
        with self.device.use():
            return verify_sampled(self.device.xp, p, q, tokens, uniforms)

    def mask(self, logits: Array, rows: np.ndarray, bits: np.ndarray) -> None:
        """Rows ``rows`` [M] of logits [R, V] on this device (last stage only), in place: minus infinity for
        each token a grammar does not allow there, by the row's packed mask ``bits`` [M, W] (host uint32,
        `strata_runtime.structured.Matcher.bitmasks_after`)."""
        if self.cuda_head is not None:
            self.cuda_head.mask(logits, rows, bits)
            return
        with self.device.use():
            mask_logits(logits, rows, bits)

    def choose(self, logits: Array, draws: Draws) -> Array:
        """Each row's chosen token [R] (int64) of logits [R, V] on this device (last stage only), by
        ``draws`` (`strata_runtime.models.ops.choose`)."""
        if self.cuda_head is not None:
            return self.cuda_head.choose(logits, draws)
        return choose_on_host(np.asarray(logits), draws)
