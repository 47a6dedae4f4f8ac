"""The Qwen3-Next style MTP head and the per-slot drafters that use it.

The head predicts the token after next. At position t it reads the embedding of token t+1 and the main
model's post-final-norm hidden state at t::

    x = fc(cat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])   # 2H -> H
    x = layers.0(x)                                                                  # one decoder layer
    out = norm(x)                                                                    # mtp.norm
    logits = lm_head(out)                                                            # shared with the model

Chained proposals feed back the head's own ``out`` as the next ``hidden``. Each slot has a `Drafter` on the
last stage's device: the MTP layer's KV over the slot's context, plus its draft-window buffers and the rows
it defers while its windows carry no proposals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from numpy.typing import DTypeLike

from strata_cfg.schema.windows import DEFER_MOST, MAX_WINDOW_ROWS, PROMPT_GRAPH_MAX

from ..backend import Array, Device
from ..layout import Layout, Segment
from ..models.ops.norm import rms_norm_in_dtype
from ..models.qwen3_moe import DecoderLayer, ModelArgs, SparseMoeBlock, linear
from .draft_head import Int8Head
from .kvcache import KVCache
from .stage import Rope, Stage, in_graph_windows

if TYPE_CHECKING:
    from ..cuda.mtp import CudaMtp


class Drafter:
    """One slot's private drafting state, on the last stage's device.

    ``kv`` is the MTP layer's KV over the slot's context; ``hidden`` and ``logits`` hold the draft window:
    the head's output rows, and the logits of the proposals drafted from them.
    """

    def __init__(
        self,
        slot: int,
        device: Device,
        args: ModelArgs,
        context: int,
        dtype: DTypeLike,
        kv_dtype: DTypeLike,
        kv_arrays: tuple[Array, Array] | None = None,
    ) -> None:
        """``kv_arrays``: this slot's views [1, 1, K, T, D] of a KV cache shared by all drafters (GPUs)."""
        self.slot, self.device = slot, device
        kv_heads, head_dim = args.num_key_value_heads, args.head_dim
        self.kv = KVCache(device, 1, 1, kv_heads, context, head_dim, kv_dtype, arrays=kv_arrays)
        self.hidden = device.zeros((MAX_WINDOW_ROWS, args.hidden_size), dtype)  # [8, H]
        self.logits = device.zeros((MAX_WINDOW_ROWS, args.vocab_size), device.xp.float32)  # [8, V]
        rows = DEFER_MOST + MAX_WINDOW_ROWS
        self.deferred = device.zeros((rows, args.hidden_size), device.xp.float32 if device.is_cuda else dtype)
        """Rows the head has not read yet, in order from position ``length``: windows' post-norm rows [., H]
        (`defer`), at most `DEFER_MOST` and then one window's. A GPU's are float32 (its final norm's)."""
        self.pending_tokens: list[int] = []
        """The token that follows each deferred row."""
        self._held: Array | None = None
        """A window's own rows, read by the head before that window's buffers are reused (`hold`)."""
        self.caught_up = 0
        """Rows `catch_up` has run through the head since the drafter was made (the engine's window record
        counts them per window)."""

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + int(self.hidden.nbytes) + int(self.logits.nbytes) + int(self.deferred.nbytes)

    @property
    def length(self) -> int:
        """Positions in the MTP layer's KV (the deferred rows come after them)."""
        return int(self.kv.lengths[0])

    @property
    def pending_rows(self) -> int:
        """Rows the head has not read yet (deferred or held)."""
        return len(self.pending_tokens)

    def defer(self, rows: Array, tokens: list[int]) -> None:
        """Copy a window's rows [k, H] (and the token that follows each) after those deferred, on the current
        stream: the window's own buffers are reused by later windows. No allocation and no concatenation
        when the head reads them (`take`)."""
        assert self._held is None, "a held window is read before more rows are deferred"
        at, k = self.pending_rows, len(tokens)
        if at + k > self.deferred.shape[0]:
            raise ValueError(f"slot {self.slot}: {at} rows deferred, no room for {k} more")
        if rows.dtype != self.deferred.dtype:  # the CPU path's rows are in the model's dtype
            self.deferred = self.deferred.astype(rows.dtype)
        self.deferred[at : at + k] = rows
        self.pending_tokens += tokens

    def hold(self, rows: Array, tokens: list[int]) -> None:
        """Rows [k, H] for the head to read next: in place where nothing is deferred before them (no copy,
        whatever their count: the head reads them before their window's buffers are reused); else copied
        behind those deferred, as `defer` copies."""
        if self.pending_rows:
            self.defer(rows, tokens)
            return
        self._held, self.pending_tokens = rows, list(tokens)

    def take(self) -> tuple[Array, list[int]]:
        """The rows the head has not read [k, H] (a view that the next `defer` overwrites) and the token
        after each, forgotten here."""
        rows = self._held if self._held is not None else self.deferred[: self.pending_rows]
        tokens, self.pending_tokens, self._held = self.pending_tokens, [], None
        return rows, tokens

    def rewind(self, length: int) -> None:
        """Forget positions [length, ...): of the KV, and of the deferred rows past it."""
        keep = min(max(length - self.length, 0), self.pending_rows)
        self.pending_tokens = self.pending_tokens[:keep]
        if self._held is not None:
            self._held = self._held[:keep] if keep else None
        self.kv.rewind(0, min(length, self.length))

    def keep(self, length: int) -> int:
        """What a finished request leaves for the next one to reuse (`strata_runtime.engine.prefix`): the
        positions before ``length``, of the KV and of the deferred rows, but no rows held in place (views of
        a window's buffers, which later windows overwrite). Returns the positions kept."""
        if self._held is not None:
            self.rewind(self.length)
        self.rewind(length)
        return self.length + self.pending_rows


class _DrafterKV:
    """Routes a multi-slot MTP window's KV reads and writes to each slot's own drafter."""

    def __init__(self, drafters: dict[int, Drafter]) -> None:
        self.drafters = drafters

    def begin(self, segments: tuple[Segment, ...]) -> None:
        for s in segments:
            self.drafters[s.slot].kv.begin((Segment(0, s.row, s.n, s.pos),))

    def write(self, layer: int, seg: Segment, keys: Array, values: Array) -> tuple[Array, Array]:
        return self.drafters[seg.slot].kv.write(layer, Segment(0, seg.row, seg.n, seg.pos), keys, values)


class MtpHead:
    """The MTP weights on the last stage, shared by every slot's drafter."""

    def __init__(
        self,
        tensors: dict[str, Array],
        args: ModelArgs,
        device: Device,
        rope: Rope,
        lm_head: Array,
        embed: Callable[[Array], Array],
        prompt_graph_rows: int = PROMPT_GRAPH_MAX,
        prefill_graph_rows: int = 0,
    ) -> None:
        """``prompt_graph_rows``: a prompt chunk of at most this many rows runs through the head's 8-row
        graph windows on a GPU, as the stages read it (``memory.prompt_graph_rows``); longer ones through
        the CUDA prefill path, replayed as a graph up to ``prefill_graph_rows`` rows
        (``memory.prefill_graph_rows``)."""
        self.device, self.args, self.rope = device, args, rope
        self.prompt_graph_rows = max(prompt_graph_rows, MAX_WINDOW_ROWS)
        self.prefill_graph_rows = prefill_graph_rows
        self.pre_fc_norm_embedding = tensors["mtp.pre_fc_norm_embedding.weight"]  # [H]
        self.pre_fc_norm_hidden = tensors["mtp.pre_fc_norm_hidden.weight"]  # [H]
        self.fc = tensors["mtp.fc.weight"]  # [H, 2H]
        self.layer = DecoderLayer(tensors, "mtp.layers.0.", args, args.num_experts > 0)
        self.norm = tensors["mtp.norm.weight"]  # [H]
        self.lm_head = lm_head  # [V, H], the main model's
        self.embed = embed  # token ids (host, or on this device) -> embedding rows [R, H] on this device
        self.weight_bytes = sum(int(t.nbytes) for n, t in tensors.items() if n.startswith("mtp."))
        self.cuda: CudaMtp | None = None  # once `use_cuda` hands it the drafters' shared KV
        self.stage: Stage | None = None
        """The last stage, when its expert cache holds this head's routed experts too."""
        self.draft_head: Int8Head | None = None
        """The 8-bit copy of the LM head that draft logits read (``spec.draft_head = "int8"``), else None:
        the shared head."""

    def share_experts(self, stage: Stage) -> None:
        """Read the routed experts through ``stage``'s expert cache when it holds them (the last stage's
        store ends with this head's layer)."""
        mlp = self.layer.mlp
        if not stage.experts.cached or not isinstance(mlp, SparseMoeBlock):
            return
        self.stage = stage
        mlp.experts.read_from(stage.experts, stage.n_sparse)
        self.weight_bytes -= int(mlp.experts.gate_up_proj.nbytes + mlp.experts.down_proj.nbytes)

    def use_cuda(
        self,
        k_cache: Array,
        v_cache: Array,
        split_q: bool = True,
        attention_tc: bool = True,
    ) -> str | None:
        """Run draft windows of at most 8 rows as CUDA graphs over the drafters' shared KV [1, S, K, T, D].
        Returns why not, when the kernels cannot run this head. ``split_q``: its prompt rows' attention
        holds q as two fp16 parts (False: fp16 q; ``model.prefill_q``). ``attention_tc``: its decode
        attention runs on tensor cores where the shape allows (``model.decode_attention``)."""
        from ..cuda import layers
        from ..cuda.mtp import CudaMtp

        why = layers.supported(self.args, self.fc.dtype, k_cache.dtype, self.device.index)
        if why is None:
            experts = None
            if self.stage is not None and self.stage.cuda_experts is not None:
                experts = self.stage.cuda_experts.view(self.stage.n_sparse, 1)
            self.cuda = CudaMtp(
                self.device.index,
                self,
                self.args,
                k_cache,
                v_cache,
                experts,
                split_q,
                graph_rows=self.prefill_graph_rows,
                attention_tc=attention_tc,
            )
        return why

    def __call__(
        self,
        drafters: dict[int, Drafter],
        tokens: Array,
        hidden: Array,
        layout: Layout,
        positions: Array | None = None,
        account: bool = True,
    ) -> Array:
        """The head's post-norm output [R, H] for rows (token t+1, hidden at t) at the layout's positions.

        ``tokens`` are host ids or ids on this device. ``positions`` [R] on this device, when the rows'
        positions were decided here (a CUDA graph reads them in place; other paths read them to the host).
        Without ``account`` the drafters' KV lengths are left to the caller.
        """
        xp, eps = self.device.xp, self.args.rms_norm_eps
        with self.device.use():
            graph = self.cuda is not None and 0 < layout.rows <= MAX_WINDOW_ROWS
            if positions is not None and not graph:
                layout, positions = layout.placed(self.device.to_host(positions)), None
            kv = _DrafterKV(drafters)
            if account:
                kv.begin(layout.segments)
            if graph:
                assert self.cuda is not None
                return self.cuda.forward(self.embed(tokens), hidden, layout, positions)  # [R, H] fp32
            if self.cuda is not None and 0 < layout.rows <= self.prompt_graph_rows:
                # A short prompt: through the head's graphs, as a stage reads it (`Stage._layers`), not the
                # prefill path's cuBLAS products launched layer by layer.
                return in_graph_windows(xp, self.cuda.forward, layout, self.embed(tokens), hidden)
            if self.cuda is not None:
                return self.cuda.prefill(self.embed(tokens), hidden, layout)  # [R, H] fp32
            e = rms_norm_in_dtype(self.embed(tokens), self.pre_fc_norm_embedding, eps)  # [R, H]
            h = rms_norm_in_dtype(hidden, self.pre_fc_norm_hidden, eps)  # [R, H]
            x = linear(xp.concatenate([e, h], axis=-1), self.fc)  # [R, H]
            cos, sin = self.rope.at(layout)  # [R, D/2] each
            x = self.layer(xp, x, layout, kv, 0, cos, sin)  # [R, H]
            return rms_norm_in_dtype(x, self.norm, eps)  # [R, H]

    def quantize_head(self) -> None:
        """Draft through an 8-bit copy of the LM head from now on (``spec.draft_head = "int8"``), made on
        this device (`strata_runtime.model.draft_head`)."""
        self.draft_head = Int8Head.of(self.device, self.lm_head)

    def logits(self, out: Array) -> Array:
        """Draft logits [R, V] in fp32 from the head's output rows: through the 8-bit head where it has one,
        else the shared head."""
        if self.draft_head is not None:
            return self.draft_head.logits(out)
        if self.cuda is not None:
            return self.cuda.logits(out)  # [R, V] fp32
        with self.device.use():
            x = out.astype(self.lm_head.dtype, copy=False)
            return linear(x, self.lm_head).astype(self.device.xp.float32)
