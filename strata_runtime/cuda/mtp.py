"""The MTP head on the CUDA path: draft windows as CUDA graphs, prompt chunks through the prefill path.

The head's one decoder layer is a `LayerStack` of one layer over the drafters' shared KV, run by the same
decode graphs (`strata_runtime.cuda.decode`) and prefill path (`strata_runtime.cuda.prefill`) as a stage's.
"""

from __future__ import annotations

from typing import Any, Protocol

import cupy as cp

from ..backend import Array
from ..layout import Layout
from ..models.qwen3_moe import DecoderLayer, ModelArgs
from .blas import matmul_nt
from .choices import mtp_gemv_shapes
from .decode import CudaLayers
from .experts import ExpertSlice
from .head import CudaHead
from .layers import LayerStack, WindowBuffers
from .prefill import CudaPrefill


class MtpWeights(Protocol):
    """What the CUDA path reads of the MTP head (`strata_runtime.model.mtp.MtpHead` has it)."""

    fc: Array  # [H, 2H]
    pre_fc_norm_embedding: Array  # [H]
    pre_fc_norm_hidden: Array  # [H]
    norm: Array  # [H]
    lm_head: Array  # [V, H], the main model's
    layer: DecoderLayer


class CudaMtp:
    """The MTP head's forward for draft windows, as one CUDA graph per row count.

    out = norm(layer(fc_e @ pre_fc_norm_embedding(emb) + fc_h @ pre_fc_norm_hidden(hidden))), where
    fc = [fc_e | fc_h] is split into two contiguous halves. The MTP layer's KV is one [1, S, K, T, D] pair
    shared by every slot's drafter (each drafter's cache is a view of its slot).
    """

    def __init__(
        self,
        device_id: int,
        head: MtpWeights,
        args: ModelArgs,
        k_cache: cp.ndarray,
        v_cache: cp.ndarray,
        experts: ExpertSlice | None = None,
        split_q: bool = True,
        graph_rows: int = 0,
        attention_tc: bool = True,
    ) -> None:
        """``experts``: the head's routed experts in the last stage's expert cache, when it holds them.
        ``split_q``: the prompt rows' attention holds q as two fp16 parts (False: fp16 q). ``graph_rows``:
        its prompt chunks through the prefill path replay a graph up to this many rows (`CudaPrefill`).
        ``attention_tc``: decode attention on tensor cores where the shape allows
        (``model.decode_attention``)."""
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
            self.stack = LayerStack.of(
                device_id,
                [head.layer],
                args,
                k_cache,
                v_cache,
                experts=experts,
                attention_tc=attention_tc,
            )
            # The input projections (norm fused) and the LM head run beside the layer on every draft window.
            shapes = mtp_gemv_shapes(*head.lm_head.shape)
            self.layers = CudaLayers(self.stack, shapes)
            # Windows decided on the device run the head on the last stage's stream while host drafting
            # may run it on the drafters' stream (pipelined groups): each gets its own buffers and graphs.
            self.device_layers = CudaLayers(self.stack, shapes)
        self.kern = self.stack.kern
        self.head = CudaHead(device_id, head.norm, head.lm_head, args.rms_norm_eps)
        self._prefill = CudaPrefill(self.stack, experts=experts, split_q=split_q, graph_rows=graph_rows)

    def logits(self, out: Any) -> cp.ndarray:
        """Draft logits [R, V] in fp32 from the head's output rows."""
        return self.head.logits(out)

    def _body(self, b: WindowBuffers) -> None:
        k, eps = self.kern, self.args.rms_norm_eps
        k.gemv(self.fc_e, b.emb, b.resid, norm=self.norm_e, eps=eps)
        k.gemv(self.fc_h, b.out, b.resid, accumulate=True, norm=self.norm_h, eps=eps)
        self.stack.run(b)
        k.add_rms_norm_fp32(b.resid, None, self.norm, b.out, eps)

    def prefill(self, emb: Any, hidden: Any, layout: Layout) -> cp.ndarray:
        """`forward` for a prompt chunk of more than ``memory.prompt_graph_rows`` rows, through the CUDA
        prefill path."""
        with cp.cuda.Device(self.device_id):
            k, eps = self.kern, self.args.rms_norm_eps
            rows, h = hidden.shape
            e16, h16 = cp.empty((rows, h), cp.float16), cp.empty((rows, h), cp.float16)
            k.rms_norm_fp32_to_half(cp.ascontiguousarray(emb, dtype=cp.float32), self.norm_e, e16, eps)
            k.rms_norm_fp32_to_half(cp.ascontiguousarray(hidden, dtype=cp.float32), self.norm_h, h16, eps)
            resid = matmul_nt(e16, self.fc_e, cp.empty((rows, h), cp.float32))  # [R, H]
            matmul_nt(h16, self.fc_h, resid, beta=1.0)
            self._prefill.run(resid, layout)
            out = cp.empty_like(resid)
            k.add_rms_norm_fp32(resid, None, self.norm, out, eps)
            return out

    def forward(self, emb: Any, hidden: Any, layout: Layout, positions: Any = None) -> cp.ndarray:
        """The head's post-norm output [R, H] (fp32) for rows (embedding of token t+1, hidden at t);
        ``positions`` [R] on this device, when they were decided here (the layout's are then not read): such
        a window runs on its own buffers and graphs (`device_layers`)."""
        layers = self.layers if positions is None else self.device_layers
        with cp.cuda.Device(self.device_id):
            b = layers.buffers(layout.rows)
            b.load(layout, positions)
            b.emb[...] = emb
            b.out[...] = hidden  # the hidden input; the body overwrites it with the output at the end
            layers.replay(b, self._body)
            return b.out.copy()
