"""Every resolution rule: a stable id, its step in the resolver's order, its severity and a one-line summary.

Ids never change once published: scripts match on them in ``strata plan --json`` and tests are named after
them. `strata rules` prints this table, and docs/PROFILES.md explains the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from ..schema.plan import Severity


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule the resolver can fire."""

    id: str
    step: int
    """Step in the order of evaluation (0: defaults and ``auto`` values, resolved before any gate)."""
    severity: Severity
    summary: str


STEPS: MappingProxyType[int, str] = MappingProxyType(
    {
        0: "defaults and auto values",
        1: "parse-time refusals",
        2: "batch gate",
        3: "batch-MTP gate (reasons that do not depend on groups)",
        4: "groups, then the group-dependent gate",
        5: "pipeline-windows gate",
        6: "placement",
        7: "budget",
        8: "windows",
        9: "serving and strict mode",
    }
)

_RULES = (
    # 0: defaults and auto values
    Rule("model.cpu-float32", 0, "note", "virtual CPU devices run in float32, whatever model.dtype asks"),
    Rule("memory.context-cap", 0, "clamp", "memory.context is capped at the model's max positions"),
    Rule(
        "memory.prefill-chunk-alone-floor",
        0,
        "clamp",
        "memory.prefill_chunk_alone is at least memory.prefill_chunk",
    ),
    Rule(
        "memory.prefix-store-needs-reuse",
        0,
        "off",
        "memory.prefix_store_mib needs memory.prefix_reuse (slots keep nothing to store without it)",
    ),
    Rule(
        "spec.needs-mtp-weights",
        0,
        "off",
        'spec.draft_tokens >= 2 with spec.method = "mtp" needs a model with MTP weights',
    ),
    Rule(
        "spec.ngram-inert",
        0,
        "note",
        'spec.ngram_min and spec.ngram_max do nothing unless spec.method = "ngram"',
    ),
    Rule(
        "model.decode-attention",
        0,
        "note",
        "model.decode_attention = auto runs on tensor cores where the model's shape allows, else CUDA cores",
    ),
    Rule(
        "memory.prefill-graphs-cpu",
        0,
        "note",
        "memory.prefill_graph_rows does nothing on virtual CPU devices: 0",
    ),
    Rule(
        "machine.estimated-bandwidth", 0, "note", "a probed GPU's bandwidth is an estimate, not a known value"
    ),
    Rule(
        "machine.host-ram-probed",
        0,
        "note",
        "probing: the host memory the engine may pin is read from /proc/meminfo (MemAvailable)",
    ),
    # 1: parse-time refusals
    Rule(
        "split.remote-host",
        1,
        "error",
        "a device on a host other than `local`: multi-host stages are not built",
    ),
    Rule("experts.peer-with-split", 1, "error", "experts.peer_device cannot combine with a layer split"),
    Rule("experts.peer-with-helpers", 1, "error", "experts.peer_device cannot combine with helper caches"),
    Rule("split.rising", 1, "error", "split.layers boundaries must rise"),
    Rule("split.range", 1, "error", "each split.layers boundary is >= 2 and below the model's layer count"),
    Rule("split.max-stages", 1, "error", "at most 8 stages"),
    Rule("split.too-many-devices", 1, "error", "more split devices than the machine has GPUs"),
    Rule("split.device-count", 1, "error", "split.devices names one GPU per stage"),
    Rule("machine.device-missing", 1, "error", "a device index that the machine does not have"),
    Rule("split.shared-gpu", 1, "error", "two stages on one GPU need split.test_shared_gpu = true"),
    Rule("experts.helper-is-stage", 1, "error", "a helper or peer GPU cannot also hold a stage"),
    Rule("split.auto-single-gpu", 1, "note", 'split.layers = "auto" with one usable GPU gives no split'),
    # 2: batch gate
    Rule("batch.single-slot", 2, "note", "batch.slots below 2 means no batching"),
    Rule("batch.test-split", 2, "off", "a single-GPU test split turns batching off"),
    Rule("batch.max-slots", 2, "clamp", "more than 8 slots without batch MTP is clamped to 8"),
    # 3: batch-MTP gate, first part (the first failing reason wins)
    Rule("batch-mtp.needs-batching", 3, "off", "batch MTP needs batching (2 or more slots)"),
    Rule("batch-mtp.needs-mtp-weights", 3, "off", "batch MTP needs a model with MTP weights"),
    Rule(
        "batch-mtp.spec-ngram",
        3,
        "off",
        'batch MTP drafts with the MTP head, so spec.method = "ngram" turns it off',
    ),
    Rule("batch-mtp.needs-spec", 3, "off", "batch MTP needs spec.draft_tokens >= 2"),
    Rule("batch-mtp.shared-gpu", 3, "off", "batch MTP does not run with two stages on one GPU"),
    Rule("batch-mtp.needs-serve", 3, "off", "batch MTP needs a [serve] table (it is a serving feature)"),
    Rule(
        "batch-mtp.helper-caches", 3, "off", "on a split, batch MTP does not combine with helper-GPU caches"
    ),
    Rule("batch-mtp.remote-opt", 3, "off", "on a split, batch MTP does not combine with remote expert opt"),
    # 4: groups
    Rule(
        "groups.auto", 4, "note", "groups = the largest divisor of the slots that is at most the stage count"
    ),
    Rule(
        "groups.batch-mtp-yield",
        4,
        "note",
        "groups left unset with batch MTP on: one group, so batch MTP runs",
    ),
    Rule("groups.no-split", 4, "warn", "more than one group needs a layer split; 1 group"),
    Rule("groups.not-divisor", 4, "warn", "groups must divide the slots; 1 group"),
    Rule("batch-mtp.pipelined-groups", 4, "off", "batch MTP does not combine with pipelined slot groups"),
    Rule(
        "batch-mtp.in-groups",
        4,
        "note",
        "batch.mtp_in_groups: batch MTP runs inside each pipelined group (token + proposal per slot)",
    ),
    Rule(
        "batch-mtp.in-groups-too-many-slots",
        4,
        "error",
        "batch MTP inside pipelined groups holds at most 4 slots per group (2 rows each)",
    ),
    Rule(
        "memory.prefill-chunk-alone-pipelined",
        4,
        "clamp",
        "memory.prefill_chunk_alone applies to serial windows; pipelined groups read every prompt in "
        "memory.prefill_chunk chunks",
    ),
    # 5: pipeline-windows gate (the first failing reason wins)
    Rule("pipeline-windows.needs-split", 5, "off", "pipeline windows need a layer split"),
    Rule("pipeline-windows.shared-gpu", 5, "off", "pipeline windows do not run on a single-GPU test split"),
    Rule("pipeline-windows.two-stages", 5, "off", "pipeline windows need exactly two stages"),
    Rule("pipeline-windows.needs-mtp", 5, "off", "pipeline windows need MTP drafting on the solo path"),
    Rule("pipeline-windows.batch", 5, "off", "pipeline windows do not run with batch slots"),
    Rule("pipeline-windows.peer-device", 5, "off", "pipeline windows do not combine with a peer device"),
    Rule("pipeline-windows.helper-caches", 5, "off", "pipeline windows do not combine with helper caches"),
    # 6: placement
    Rule(
        "split.auto", 6, "note", 'split.layers = "auto": boundaries that minimise the slowest stage\'s time'
    ),
    Rule(
        "spec.draft-head-inert",
        6,
        "note",
        'spec.draft_head = "int8" does nothing where the MTP head does not draft (no drafting, or n-gram '
        "lookup without batch MTP)",
    ),
    Rule(
        "split.auto-order",
        6,
        "note",
        "auto split: the fastest GPU goes last, since it runs the head and drafters",
    ),
    Rule("split.auto-no-fit", 6, "error", "auto split: no split of the layers fits the GPUs"),
    # 7: budget
    Rule(
        "budget.overflow", 7, "error", "a GPU's weights, KV, drafters, workspace and reserve exceed its VRAM"
    ),
    Rule("experts.cache-too-small", 7, "error", "the expert cache must hold one window's experts of a layer"),
    Rule(
        "experts.cache", 7, "note", "not every expert fits: the rest stream from host memory through a cache"
    ),
    Rule(
        "experts.mtp-whole",
        7,
        "note",
        "under an expert cache the MTP head's layer, which cannot follow its routing, holds all its experts "
        "where they take at most an eighth of the GPU's slots",
    ),
    Rule(
        "experts.keep-misses-tiers",
        7,
        "note",
        "experts.keep_misses is off with helper GPUs or a peer device: their tier adapts by swaps",
    ),
    Rule(
        "experts.keep-misses-small-cache",
        7,
        "note",
        "experts.keep_misses is off by default where a cache holds fewer than twice a token's experts a "
        "layer: keeping every miss would churn",
    ),
    Rule(
        "experts.policy-inert",
        7,
        "note",
        "the expert cache's policy keys do nothing where every expert is resident, its adaptation's where "
        "experts.adapt = false, and experts.recall_stored without a prefix store",
    ),
    Rule(
        "batch-mtp.all-experts-resident",
        7,
        "note",
        "batch MTP measured slower than pipelined with all experts resident",
    ),
    Rule(
        "memory.prefill-chunk-alone-cached",
        7,
        "note",
        "under an expert cache an unset memory.prefill_chunk_alone reads a lone prompt in chunks of up to "
        "4096 rows, where their workspace costs at most 1/32 of the cache's slots",
    ),
    Rule(
        "spec.draft-head-auto",
        7,
        "note",
        'spec.draft_head = "auto" on GPUs: the MTP head drafts through an 8-bit copy of the LM head where '
        "the copy displaces no routed expert from VRAM, else through the model's own",
    ),
    Rule(
        "host.ram-overflow",
        7,
        "error",
        "the experts kept in pinned host memory and the prefix store, plus memory.host_reserve_mib, exceed "
        "the host's RAM",
    ),
    # 8: windows
    Rule(
        "windows.batch-mtp-rotation",
        8,
        "note",
        "more than 4 batch-MTP slots: serial windows while more than 4 decode (every expert resident), "
        "else they take turns, 4 per window",
    ),
    Rule(
        "windows.adaptive-depth-inert",
        8,
        "note",
        "spec.adaptive_depth = true does nothing where solo windows do not draft",
    ),
    Rule(
        "windows.prompt-graph-rows",
        8,
        "note",
        "memory.prompt_graph_rows auto: short prompts take graph windows while they cost less than the "
        "prefill path's launches",
    ),
    Rule(
        "windows.prefill-graph-rows",
        8,
        "note",
        "memory.prefill_graph_rows auto: prompt chunks of up to 512 rows replay CUDA graphs on a GPU, and "
        "the workspace their temporaries keep",
    ),
    Rule(
        "windows.prefill-graphs-cached",
        8,
        "note",
        "memory.prefill_graph_rows is 0 where every stage holds an expert cache: a prompt chunk copies host "
        "experts as it runs",
    ),
    Rule(
        "windows.prefill-graphs-some-cached",
        8,
        "note",
        "a stage under an expert cache launches its prompt chunks layer by layer; the others replay graphs",
    ),
    Rule(
        "windows.prefix-reuse-calibrated",
        8,
        "note",
        "with calibrated routing a request's routing follows from its whole prompt: a slot's kept KV serves "
        "only the same prompt again",
    ),
    # 9: serving and strict mode
    Rule("serve.exposed", 9, "warn", "serving on a non-loopback address without serve.api_key_env"),
)

RULES: MappingProxyType[str, Rule] = MappingProxyType({r.id: r for r in _RULES})
"""Every rule by id, in evaluation order."""


def rule(rule_id: str) -> Rule:
    """The rule with this id (a KeyError here is a bug: every fired rule must be registered)."""
    return RULES[rule_id]
