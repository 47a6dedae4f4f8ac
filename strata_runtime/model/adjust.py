"""Every slot's token counts and logit bias on the last stage's device, for adjusting logits there.

A penalised or biased request's decode rows are adjusted and chosen on the device like any other's
(`strata_runtime.models.ops.adjust` states the rule), so its windows can be queued before the host has read
the token the window before chose. What the rule reads is kept here, per slot: how often each token was
generated (int32 [S, V]) and the request's logit bias (float64 [S, V]). Both arrays are made the first time
a window adjusts: 12 bytes a slot per word of the vocabulary (1.8 MB a slot for a 151,936-word
vocabulary).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import Array, Device
from ..models.ops.adjust import Adjusts, adjust_logits, count_tokens


class TokenCounts:
    """Each slot's token counts and logit bias on one device (the last stage's), and the two steps a window
    takes with them: `adjust` its rows' logits before they are chosen, then `count` what was chosen."""

    def __init__(self, device: Device, slots: int, vocab: int) -> None:
        self.device, self.slots, self.vocab = device, slots, vocab
        self.counts: Array | None = None  # [S, V] int32
        self.bias: Array | None = None  # [S, V] float64
        self._kern: Any = None

    def _arrays(self) -> tuple[Array, Array]:
        if self.counts is None or self.bias is None:
            xp = self.device.xp
            with self.device.use():
                self.counts = xp.zeros((self.slots, self.vocab), xp.int32)
                self.bias = xp.zeros((self.slots, self.vocab), xp.float64)
                if self.device.is_cuda:
                    from ..cuda.ops import kernels_for

                    self._kern = kernels_for(self.device.index)
        return self.counts, self.bias

    def adjust(self, logits: Array, adj: Adjusts) -> tuple[Array, Array]:
        """Adjust rows ``adj.rows`` of logits [R, V] in place (current stream): start the fresh slots, count
        the tokens the host decided, then apply each row's slot's bias and penalties. Returns the rows and
        their slots on the device, for `count`."""
        counts, bias = self._arrays()
        dev = self.device
        with dev.use():
            for slot, ids, values in adj.fresh:
                counts[slot] = 0
                bias[slot] = 0.0
                if ids.size:
                    bias[slot, dev.upload(ids.astype(np.int64))] = dev.upload(values.astype(np.float64))
            self._add(*adj.counted)
            rows, slot = dev.upload(adj.rows.astype(np.int64)), dev.upload(adj.slot.astype(np.int64))
            freq = dev.upload(adj.frequency.astype(np.float64))
            pres = dev.upload(adj.presence.astype(np.float64))
            if self._kern is not None:
                self._kern.adjust_logits(logits, rows, slot, counts, bias, freq, pres)
            else:
                adjust_logits(logits, rows, slot, counts, bias, freq, pres)
        return rows, slot

    def count(self, rows: Array, slot: Array, chosen: Array) -> None:
        """Count each adjusted row's chosen token (chosen [R], int64, on this device) for its slot."""
        dev = self.device
        with dev.use():
            tokens = chosen[rows].astype(dev.xp.int64)
            add = dev.xp.ones(int(rows.shape[0]), dev.xp.int32)
            self._count(slot, tokens, add)

    def _add(self, slot: np.ndarray, tokens: np.ndarray, times: np.ndarray) -> None:
        if slot.size:
            dev = self.device
            self._count(
                dev.upload(slot.astype(np.int64)),
                dev.upload(tokens.astype(np.int64)),
                dev.upload(times.astype(np.int32)),
            )

    def _count(self, slot: Array, tokens: Array, add: Array) -> None:
        counts, _ = self._arrays()
        if self._kern is not None:
            self._kern.count_tokens(counts, slot, tokens, add)
        else:
            count_tokens(counts, slot, tokens, add)
