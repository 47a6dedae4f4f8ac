"""The MTP head's 8-bit LM head (``spec.draft_head = "int8"``): draft logits at half the bytes a step reads.

A draft step of the MTP head ends in the LM head, vocab x hidden weights that the model shares with its MTP
head; on the 30B preset that is 622 MB of the step's 752 MB. Under ``spec.draft_head = "int8"`` the last stage
keeps a second copy of it made when the engine loads: each vocabulary row as int8 weights and one float32
scale (its largest magnitude / 127), so ``logits[r, v] = scale[v] * sum_k q[v, k] x[r, k]``. The rounding
moves a logit by far less than the gap between the top tokens, except where two are nearly tied, and then
only the proposal changes: the model verifies every proposal with its own fp16 head, so greedy text is the
same and sampled drafting keeps the model's distribution (the proposal is drawn from the 8-bit head's
distribution, and acceptance reads that same distribution).

The rounding and the product are `strata_runtime.models.ops.int8`'s; on a GPU the product is one kernel
(``gemv_i8`` of kernels.cu).
"""

from __future__ import annotations

from strata_cfg.schema.windows import MAX_WINDOW_ROWS

from ..backend import Array, Device
from ..models.ops.int8 import linear_int8, quantize_rows


class Int8Head:
    """An LM head [V, H] as 8-bit weights and a scale a row, on one device; `logits` as the fp16 head's."""

    def __init__(self, device: Device, q: Array, scale: Array) -> None:
        self.device, self.q, self.scale = device, q, scale
        self._kern = None
        if device.is_cuda and q.shape[1] % 16 == 0:  # the kernel reads rows 16 bytes at a time (else CuPy)
            from ..cuda.choices import gemv_i8_launch
            from ..cuda.ops import kernels_for

            with device.use():  # compiled and loaded in this device's context, not the current one's
                self._kern = kernels_for(device.index)
                # Compiled now, so that no draft window waits for a compile.
                self._kern.prepare([gemv_i8_launch(r, q.shape[0])[0] for r in range(1, MAX_WINDOW_ROWS + 1)])

    @classmethod
    def of(cls, device: Device, lm_head: Array) -> Int8Head:
        """The 8-bit copy of ``lm_head`` [V, H] (on ``device``), made there."""
        with device.use():
            q, scale = quantize_rows(device.xp, lm_head)
        return cls(device, q, scale)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)

    def logits(self, out: Array) -> Array:
        """Draft logits [R, V] in float32 from the head's post-norm output rows [R, H]."""
        xp = self.device.xp
        with self.device.use():
            x = xp.ascontiguousarray(out, dtype=xp.float32)
            rows = x.shape[0]
            logits = xp.empty((rows, self.q.shape[0]), dtype=xp.float32)
            if self._kern is None:
                linear_int8(xp, self.q, self.scale, x, logits)
                return logits
            for r0 in range(0, rows, MAX_WINDOW_ROWS):
                r1 = min(rows, r0 + MAX_WINDOW_ROWS)
                self._kern.gemv_i8(self.q, self.scale, x[r0:r1], logits[r0:r1])
            return logits
