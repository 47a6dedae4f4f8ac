"""A pipeline stage: layers [a, b) of the main model on one device, with every slot's KV for them.

The first stage also holds the token embedding; the last holds the final norm and the LM head (and, in
`strata_runtime.model.mtp`, the MTP head and the slot drafters). ``forward`` takes the hidden rows of a window
and returns them; hidden rows cross devices in `strata_runtime.model.placed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import DTypeLike

from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..backend import Array, Device
from ..layout import Layout
from ..models.ops.norm import rms_norm_in_dtype
from ..models.qwen3_moe import DecoderLayer, ModelArgs, linear, rope_tables
from .kvcache import KVCache

if TYPE_CHECKING:
    from ..cuda.decode import CudaLayers
    from ..cuda.head import CudaHead
    from ..cuda.prefill import CudaPrefill

CUDA_PREFILL_ROWS = 64
"""Prefill chunks of at most this many rows run as 8-row CUDA graph windows; longer ones run the CUDA
prefill path (`strata_runtime.cuda.prefill`: cuBLAS products, one host read per layer)."""


class Rope:
    """cos/sin tables [T, D/2] (fp32) on one device, looked up by row position."""

    def __init__(self, device: Device, args: ModelArgs, context: int) -> None:
        cos, sin = rope_tables(args.rope_theta, args.head_dim, context)
        self.device = device
        self.cos, self.sin = device.asarray(cos), device.asarray(sin)  # [T, D/2] each

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
    ) -> None:
        self.index, self.device, self.layer_range, self.args = index, device, layers, args
        self.first, self.last = first, last
        self.layers = [
            DecoderLayer(tensors, f"model.layers.{i}.", args, args.is_sparse(i)) for i in range(*layers)
        ]
        self.kv = KVCache(
            device, len(self.layers), slots, args.num_key_value_heads, context, args.head_dim, kv_dtype
        )
        self.rope = Rope(device, args, context)
        self.embed_tokens = tensors.get("model.embed_tokens.weight")  # [V, H] on the first stage
        self.norm = tensors.get("model.norm.weight")  # [H] on the last stage
        self.lm_head = tensors.get("lm_head.weight")  # [V, H] on the last stage
        self.weight_bytes = sum(int(t.nbytes) for t in tensors.values())
        self.cuda: CudaLayers | None = None  # the CUDA decode graphs, on GPUs that can run them
        self.cuda_prefill: CudaPrefill | None = None  # the CUDA path for long prefill chunks
        self.cuda_head: CudaHead | None = None
        self.cuda_refused: str | None = None
        if device.is_cuda:
            self._build_cuda()

    def _build_cuda(self) -> None:
        from ..cuda import decode, head, layers, prefill

        dtype = self.layers[0].input_layernorm.dtype if self.layers else self.kv.k.dtype
        self.cuda_refused = layers.supported(self.args, dtype, self.kv.k.dtype)
        if self.cuda_refused is not None:
            return
        gpu, eps = self.device.index, self.args.rms_norm_eps
        stack = layers.LayerStack.of(gpu, self.layers, self.args, self.kv.k, self.kv.v)
        self.cuda = decode.CudaLayers(stack)
        self.cuda_prefill = prefill.CudaPrefill(stack)
        if self.last:
            self.cuda_head = head.CudaHead(gpu, self.norm, self.lm_head, eps)

    def embed(self, token_ids: np.ndarray) -> Array:
        """The embedding rows [R, H] of ``token_ids`` (first stage only)."""
        assert self.embed_tokens is not None, f"stage {self.index} holds no embedding"
        with self.device.use():
            return self.embed_tokens[self.device.upload(np.asarray(token_ids))]  # [R, H]

    def forward(self, hidden: Array, layout: Layout) -> Array:
        """Run this stage's layers over a window's hidden rows [R, H], writing their KV.

        On a GPU a window of at most 8 rows (decode, drafts) runs as one replayed CUDA graph, a prompt
        chunk of up to 64 rows as several, and a longer chunk through the CUDA prefill path; all come back
        in fp32. CPU devices run the array code below.
        """
        xp = self.device.xp
        with self.device.use():
            self.kv.begin(layout.segments)
            if self.cuda_prefill is not None and layout.rows > CUDA_PREFILL_ROWS:
                return self.cuda_prefill.forward(hidden, layout)  # [R, H] fp32
            if self.cuda is not None and 0 < layout.rows <= CUDA_PREFILL_ROWS:
                if layout.rows <= MAX_WINDOW_ROWS:
                    return self.cuda.forward(hidden, layout)  # [R, H] fp32
                # A short prompt: consecutive windows of 8 rows through the graphs. The prefill path's
                # per-layer launches and host read cost the same for 9 rows as for 500 (the 64-row cut-off
                # was set against the array path and has not been re-measured against the prefill path).
                parts = [
                    self.cuda.forward(
                        hidden[a : a + MAX_WINDOW_ROWS], layout.rows_between(a, a + MAX_WINDOW_ROWS)
                    )
                    for a in range(0, layout.rows, MAX_WINDOW_ROWS)
                ]
                return xp.concatenate(parts, axis=0)  # [R, H] fp32
            cos, sin = self.rope.at(layout)  # [R, D/2] each
            for j, layer in enumerate(self.layers):
                hidden = layer(xp, hidden, layout, self.kv, j, cos, sin)  # [R, H]
            return hidden

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
