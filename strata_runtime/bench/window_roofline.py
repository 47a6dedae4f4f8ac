"""What batch MTP can gain over serial windows when both run at the byte roofline.

S streams decoding in serial windows read one step's bytes for S rows a window and get S tokens. Batch-MTP
windows carry each stream's token and one proposal, 2S rows, read the drafting head besides
(`drafting_bytes`), and get S (1 + a) tokens at acceptance a. Most of a step's bytes are the routed experts,
one read per distinct expert a layer, so what the second row of each stream costs depends on routing:

* **uniform** (a synthetic preset's own router): rows share experts only by chance, and 2S rows read
  nearly twice the experts of S rows;
* **calibrated** (``model.routing = "calibrated"``, routing like a real model's: docs/RUNTIME.md, "Routing
  like a real model"): a stream's consecutive positions keep many of their experts, so its proposal row
  reads few experts its token row has not.

`table` gives, under both routings, each window's distinct experts a layer, bytes and time at a copy rate,
and the gain of batch-MTP windows over serial ones at the rooflines, (S (1 + a) / t(batch MTP)) / (S /
t(serial)) - 1, in which the copy rate cancels. `strata bench --workload two-decodes` prints it beside the
measured gain: a measured gain above it means the serial windows run further below their roofline than the
batch-MTP ones. From the plan's model alone (no weights, no GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from strata_cfg.schema.facts import ModelFacts, expected_distinct_experts

from ..experts.routing import RoutingModel
from .ceilings import decode_step_bytes

ROUTINGS: tuple[str, ...] = ("uniform", "calibrated")


@dataclass(frozen=True)
class Window:
    """One window shape under one routing: its rows, distinct experts per sparse layer, and byte time."""

    kind: str
    streams: int
    rows: int
    distinct_experts: float
    gbytes: float
    ms: float


def calibrated_distinct(facts: ModelFacts, seed: int, streams: int, per_stream: int, samples: int) -> float:
    """Distinct experts a sparse layer reads for ``streams`` requests of ``per_stream`` consecutive
    positions each, under calibrated routing (the model's `RoutingModel` for weights seed ``seed``):
    the mean over ``samples`` windows of random prompts and positions, seeded so the figure repeats."""
    model = RoutingModel(facts.num_hidden_layers, facts.num_experts, facts.num_experts_per_tok, seed)
    rng = np.random.default_rng([seed, streams, per_stream])
    n = samples * streams  # requests, sample-major
    requests = [model.request(rng.integers(1, 50_000, 16).tolist()) for _ in range(n)]
    seeds = np.repeat(np.array([s for s, _ in requests], np.uint64), per_stream)  # [N] rows
    cdfs = np.stack([cdf for _, cdf in requests])  # [n, L, E]
    positions = (rng.integers(16, 2_000, n)[:, None] + np.arange(per_stream)).ravel()  # [N]
    sparse = [j for j in range(facts.num_hidden_layers) if facts.is_sparse(j)]
    total = 0
    for layer in sparse:
        rows = np.repeat(cdfs[:, layer], per_stream, axis=0)  # [N, E]
        chosen = model.intended_rows(seeds, rows, layer, positions)  # [N, k]
        for window_rows in chosen.reshape(samples, -1):  # one window's experts, all its rows
            total += len(np.unique(window_rows))
    return total / (samples * len(sparse))


def window(
    facts: ModelFacts,
    kind: str,
    streams: int,
    routing: str,
    *,
    seed: int,
    positions: int,
    copy: float,
    samples: int,
    int8_head: bool = False,
) -> Window:
    """A serial (one row a stream) or batch-MTP (two rows a stream) window of ``streams`` streams
    (``int8_head``: its drafts read the 8-bit LM head, ``spec.draft_head = "int8"``)."""
    per = 2 if kind == "batch-mtp" else 1
    rows = streams * per
    if routing == "uniform":
        distinct = expected_distinct_experts(facts.num_experts, facts.num_experts_per_tok, rows)
    else:
        distinct = calibrated_distinct(facts, seed, streams, per, samples)
    nbytes = decode_step_bytes(facts, rows=rows, positions=positions, distinct_experts=distinct).total
    if kind == "batch-mtp":
        nbytes += drafting_bytes(facts, distinct, int8_head)
    return Window(kind, streams, rows, distinct, nbytes / 1e9, nbytes / copy * 1e3)


def drafting_bytes(facts: ModelFacts, distinct: float, int8_head: bool = False) -> int:
    """What a batch-MTP window reads to draft the next one's proposals: the MTP head's own weights
    (`ModelFacts.mtp_bytes`, less its routed experts) and, per MTP layer, ``distinct`` experts as the
    window's own rows route, then the LM head once for every stream's proposal: the model's, or with
    ``int8_head`` its 8-bit copy (`ModelFacts.int8_head_bytes`). Serial windows of streams that do not
    draft read none of it."""
    dense, _ = facts.mtp_bytes()
    experts = facts.mtp_layers * round(distinct * facts.expert_bytes())
    # the LM head again, as `decode_step_bytes` counts it: it is not kept in L2 between launches
    if int8_head:
        head = facts.int8_head_bytes() + facts.hidden_size * facts.weight_bytes
    else:
        head = (facts.vocab_size * facts.hidden_size + facts.hidden_size) * facts.weight_bytes
    return dense + experts + head


def gain_at_roofline(serial: Window, batch: Window, acceptance: float) -> float:
    """Batch-MTP windows over serial ones, both at their byte time: S (1 + a) tokens a batch-MTP window
    against S a serial one."""
    return (serial.streams * (1 + acceptance) / batch.ms) / (serial.streams / serial.ms) - 1


def table(
    facts: ModelFacts,
    *,
    seed: int,
    streams: Sequence[int],
    acceptances: Sequence[float],
    positions: int,
    copy: float,
    samples: int,
    int8_head: bool = False,
) -> list[dict[str, Any]]:
    """Per routing and stream count: both windows and the gain at each acceptance (``int8_head``: the
    drafts read the 8-bit LM head). Calibrated routing is left out where the model's shape is beyond it
    (`RoutingModel` refuses it)."""
    out: list[dict[str, Any]] = []
    try:
        RoutingModel(facts.num_hidden_layers, facts.num_experts, facts.num_experts_per_tok, seed)
        routings = ROUTINGS
    except ValueError:
        routings = ("uniform",)
    for routing in routings:
        for s in streams:
            serial, batch = (
                window(
                    facts,
                    k,
                    s,
                    routing,
                    seed=seed,
                    positions=positions,
                    copy=copy,
                    samples=samples,
                    int8_head=int8_head,
                )
                for k in ("serial", "batch-mtp")
            )
            gains = {f"{a:g}": gain_at_roofline(serial, batch, a) for a in acceptances}
            out.append(
                {
                    "routing": routing,
                    "streams": s,
                    "serial": asdict(serial),
                    "batch_mtp": asdict(batch),
                    "gain": gains,
                }
            )
    return out
