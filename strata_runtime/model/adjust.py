"""Every slot's token counts and logit bias on the last stage's device, for adjusting logits there.

A penalised or biased request's decode rows are adjusted and chosen on the device like any other's
(`strata_runtime.models.ops.adjust` states the rule), so its windows can be queued before the host has read
the token the window before chose. What the rule reads is kept here, per slot: how often each token was
generated (int32 [S, V]; for a request with a repetition penalty, its prompt's tokens marked there too) and
the request's logit bias (float64 [S, V]). Both arrays are made the first time
a window adjusts: 12 bytes a slot per word of the vocabulary (1.8 MB a slot for a 151,936-word
vocabulary), which the plan counts in the last stage's workspace (`strata_cfg.resolve.sizes`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import Array, Device
from ..models.ops.adjust import Adjusts, adjust_logits, count_tokens


class TokenCounts:
    """Each slot's token counts and logit bias on one device (the last stage's), and the steps a window takes
    with them: `adjust` its rows' logits before they are chosen, then `count` what was chosen or kept."""

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

    def adjust(self, logits: Array, adj: Adjusts, tokens: Array | None = None) -> tuple[Array, Array] | None:
        """A window's adjustments (current stream): start the fresh slots, count the tokens the host decided,
        then adjust rows ``adj.rows`` of logits [R, V] in place; ``tokens``: the window's input ids on this
        device (what its rows' proposals are read from). Returns the rows whose chosen tokens `count` takes
        and their slots, on the device (None: no such row)."""
        counts, bias = self._arrays()
        dev = self.device
        with dev.use():
            for slot, ids, values in adj.fresh:
                counts[slot] = 0
                bias[slot] = 0.0
                if ids.size:
                    bias[slot, dev.upload(ids.astype(np.int64))] = dev.upload(values.astype(np.float64))
            slots, toks, times = adj.counted
            if slots.size:
                self.count(
                    *(
                        dev.upload(a.astype(d))
                        for a, d in ((slots, np.int64), (toks, np.int64), (times, np.int32))
                    )
                )
            extras = adj.extra_count.any()
            self.adjust_rows(
                logits,
                adj.rows,
                adj.slot,
                adj.frequency,
                adj.presence,
                tokens if extras else None,
                adj.extra_from,
                adj.extra_count,
                adj.repetition,
            )
            if not adj.chosen_counts.any():
                return None
            keep = adj.chosen_counts
            return dev.upload(adj.rows[keep].astype(np.int64)), dev.upload(adj.slot[keep].astype(np.int64))

    def adjust_rows(
        self,
        logits: Array,
        rows: np.ndarray,
        slot: np.ndarray,
        frequency: np.ndarray,
        presence: np.ndarray,
        tokens: Array | None = None,
        extra_from: np.ndarray | None = None,
        extra_count: np.ndarray | None = None,
        repetition: np.ndarray | None = None,
    ) -> None:
        """Adjust rows ``rows`` of logits [R, V] in place for their slots (host arrays [A], uploaded); with
        ``tokens`` (on this device), row a also counts ``extra_count[a]`` of them from ``extra_from[a]``;
        ``repetition`` [A]: each row's repetition penalty (None, or all 1: none)."""
        counts, bias = self._arrays()
        dev = self.device
        up = dev.upload
        with dev.use():
            args = [up(rows.astype(np.int64)), up(slot.astype(np.int64)), counts, bias]
            args += [up(frequency.astype(np.float64)), up(presence.astype(np.float64))]
            extra: dict[str, Any] = {}
            if tokens is not None:
                assert extra_from is not None and extra_count is not None
                extra.update(tokens=tokens, extra_from=up(extra_from.astype(np.int64)))
                extra.update(extra_count=up(extra_count.astype(np.int32)))
            if repetition is not None and (repetition != 1.0).any():
                extra.update(repetition=up(repetition.astype(np.float64)))
            if self._kern is not None:
                self._kern.adjust_logits(logits, *args, **extra)
            else:
                adjust_logits(logits, *args, **extra)

    def count_chosen(self, rows: Array, slot: Array, chosen: Array) -> None:
        """Count each of ``rows``' chosen token (chosen [R] on this device) for its slot: what `adjust`
        returned."""
        xp = self.device.xp
        with self.device.use():
            self.count(slot, chosen[rows], xp.ones(int(rows.shape[0]), xp.int32))

    def count(self, slot: Array, tokens: Array, add: Array) -> None:
        """counts[slot[i], tokens[i]] += add[i] on this device (int64, int64, int32 arrays there)."""
        counts, _ = self._arrays()
        with self.device.use():
            if self._kern is not None:
                self._kern.count_tokens(counts, slot, tokens.astype(self.device.xp.int64), add)
            else:
                count_tokens(counts, slot, tokens, add)
