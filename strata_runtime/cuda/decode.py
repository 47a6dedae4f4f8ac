"""The CUDA decode path: windows of at most 8 rows through a stage's layers as one replayed CUDA graph.

A 48-layer MoE decode step is several hundred small kernels; launched one by one from Python each costs
several microseconds, so a window would be bound by launch overhead rather than by reading weights. Here
each row count R gets its own CUDA graph per stage, captured on first reuse and replayed after that; the
rows' positions and slots are device data, so one graph serves every window of R rows.

The residual stream stays fp32 across a stage's layers. Weights are the stage's own arrays (fp16), held by
a `strata_runtime.cuda.layers.LayerStack` (q/k/v and gate/up fused by the layer modules themselves, which
then hold views of the fused copy, so no weight is held twice); the kernel sequence of one layer is its
`LAYER_STEPS`. Longer prefill chunks take `strata_runtime.cuda.prefill`, over the same stack.

Dimension letters as in kernels.cu: R rows, H hidden, N query heads, K kv heads, D head dim, E experts,
I expert width, S slots, T context, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import cupy as cp

from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..backend import device_lock
from ..layout import Layout
from .choices import PDL_ROWS, attention_scratch_size, decode_expressions, l2_warm_in_force, moe_wide
from .compile import record_graph_build
from .layers import LayerStack, WindowBuffers


class CudaLayers:
    """Decode windows of at most 8 rows through a `LayerStack`, as one CUDA graph per row count."""

    def __init__(self, stack: LayerStack, gemv_shapes: Iterable[tuple[int, int, bool]] = ()) -> None:
        """``gemv_shapes``: (out features, reduction, fused norm) of GEMVs that run beside these layers on
        windows of 1 to 8 rows (a head's LM head, the MTP head's input projections), compiled with them."""
        self.stack, self.gemv_shapes = stack, tuple(gemv_shapes)
        with cp.cuda.Device(stack.device_id):
            self.capture_stream = cp.cuda.Stream(non_blocking=True)
            # Compile every kernel any window can need in one NVRTC run now, not window by window later.
            stack.kern.prepare(self.expressions())
        warm, a = l2_warm_in_force(), stack.args
        sparse = any(lay.warm is not None and lay.experts is not None for lay in stack.layers)
        wide = moe_wide(a.hidden_size, a.moe_intermediate_size, a.num_experts_per_tok)
        when = ", before they wait" if warm.early else ""
        self.notes = (
            [
                f"the expert kernels bring the next layer's q/k/v into L2 in windows of up to {warm.rows} "
                f"row(s){when} (STRATA_L2_WARM={warm})"
            ]
            if warm.rows and sparse and wide
            else []
        )
        """What the start-up line of the stage says of these windows beyond their graphs."""
        self._bufs: dict[int, WindowBuffers] = {}
        self._scratch: cp.ndarray | None = None
        self._graphs: dict[int, Any] = {}
        self._seen: set[int] = set()

    def expressions(self) -> list[str]:
        """The kernel instantiations windows of 1 to 8 rows through these layers (and a head) use."""
        widths = [lay.mlp_width for lay in self.stack.layers if lay.mlp_down is not None]
        kern = self.stack.kern
        return decode_expressions(
            self.stack.args,
            widths,
            self.gemv_shapes,
            kern.tensor_cores,
            attention_tc=self.stack.attention_tc,
            keep=any(lay.experts is not None and lay.experts.keep is not None for lay in self.stack.layers),
        )

    @property
    def captured(self) -> frozenset[int]:
        """The row counts whose windows replay a captured graph."""
        return frozenset(self._graphs)

    def buffers(self, rows: int) -> WindowBuffers:
        """The buffers of windows of ``rows`` rows. Each size keeps its own (its graph replays on their
        addresses), but all share one attention scratch of `MAX_WINDOW_ROWS` rows, which grows with the
        context on CUDA cores (8.5 MB a row at 32,768 positions of the 30B shape) and stops at 64 partials on
        tensor cores (1.1 MB a row from 4,096 positions on): these layers' windows run one at a time,
        in the order of one stream, and attention's scratch is dead once its kernel ends."""
        s = self.stack
        if rows not in self._bufs:
            with cp.cuda.Device(s.device_id):
                a = s.args
                tc = s.kern.attention_on_tc(
                    a.head_dim, a.num_attention_heads // a.num_key_value_heads, s.attention_tc
                )
                if self._scratch is None:
                    size = attention_scratch_size(
                        MAX_WINDOW_ROWS,
                        a.num_attention_heads,
                        a.num_key_value_heads,
                        a.head_dim,
                        s.context,
                        tc,
                    )
                    self._scratch = cp.zeros(size, cp.float32)
                self._bufs[rows] = WindowBuffers(cp, rows, s.args, s.context, s.mlp_width, self._scratch, tc)
        return self._bufs[rows]

    def replay(self, b: WindowBuffers, body: Callable[[WindowBuffers], None]) -> None:
        """Run ``body(b)`` on the current stream: eagerly the first time (which also compiles the kernels),
        captured as a graph the second time, replayed after that."""
        rows = b.rows
        stream = cp.cuda.get_current_stream()
        programmatic = self.stack.kern.programmatic(rows in PDL_ROWS)
        if rows not in self._seen:
            self._seen.add(rows)
            record_graph_build()
            with programmatic:
                body(b)
            return
        graph = self._graphs.get(rows)
        if graph is None:
            record_graph_build()
            stream.synchronize()
            cap = self.capture_stream
            # no other thread frees this GPU's memory meanwhile
            with device_lock(self.stack.device_id), cap, programmatic:
                cap.begin_capture()
                body(b)
                graph = cap.end_capture()
            self._graphs[rows] = graph
        graph.launch(stream)

    def forward(self, hidden: Any, layout: Layout, positions: Any = None) -> cp.ndarray:
        """The window's hidden rows [R, H] after these layers, as a new fp32 array; ``positions`` [R] on this
        device, when the window's positions were decided here (the layout's are then not read)."""
        with cp.cuda.Device(self.stack.device_id):
            b = self.buffers(layout.rows)
            b.load(layout, positions)
            b.resid[...] = hidden
            self.replay(b, self.stack.run)
            return b.resid.copy()
