"""Step 0: every key gets its concrete value, what the profile wrote or the default, before any gate reads it.

For ``batch.groups`` and ``split.layers = "auto"`` it records what was asked, so that the step that owns the
value (4 and 6) resolves it before anything reads it. It also builds the stage `Topology`. The steps are
described in docs/PROFILES.md, "How a profile is resolved".
"""

from __future__ import annotations

from ..schema.facts import MachineFacts, ModelFacts, run_dtype
from ..schema.plan import (
    DEFAULT_DRAFT_FLOOR,
    DEFAULT_RECOVERIES,
    DEFAULT_STEP_TIMEOUT_S,
    MAX_SWAPS,
    REBALANCE_EVERY,
    SCORE_DECAY,
    SWAP_MARGIN,
)
from ..schema.presets import PRESET_DEFAULTS
from ..schema.profile import Profile, parse_device
from ..schema.windows import (
    DECODE_ATTENTION_TC_HEAD_DIMS,
    DECODE_ATTENTION_TC_MAX_GROUP,
    decode_attention_on_tensor_cores,
)
from .ledger import Ledger
from .prompt_windows import resolve_prefill_graph_rows
from .topology import MAX_STAGES, Topology

DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_RESERVE_MIB = 700
DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
DEFAULT_DRAFT_TOKENS = 4
DEFAULT_HOST_RESERVE_MIB = 4096
DEFAULT_RUN_AHEAD = 2
DEFAULT_NGRAM_MIN = 2
DEFAULT_NGRAM_MAX = 4


def drafts_with_mtp(model: ModelFacts, led: Ledger) -> bool:
    """Whether the solo path drafts with the MTP head: ``spec.method = "mtp"``, the model has one and the
    window holds a proposal."""
    return model.has_mtp and led["spec.method"] == "mtp" and led["spec.draft_tokens"] >= 2


def drafts_by_lookup(led: Ledger) -> bool:
    """Whether the solo path drafts by n-gram lookup: ``spec.method = "ngram"`` and the window holds a
    proposal."""
    return bool(led["spec.method"] == "ngram" and led["spec.draft_tokens"] >= 2)


def resolve_defaults(
    profile: Profile, machine: MachineFacts, model: ModelFacts, led: Ledger, *, name: str
) -> tuple[ModelFacts, Topology]:
    """Give every key its value: what the user wrote, else the default. Returns the model facts in the
    resolved dtype and the stage topology."""
    p = profile
    led.take("name", p.name, name)
    led.take("machine.backend", p.machine.backend if p.machine else None, machine.backend)

    m = p.model
    synthetic = m.synthetic if m else None
    if synthetic is not None:
        led.take("model.synthetic", synthetic, None)
    if m is not None and m.path is not None:
        led.take("model.path", m.path, None)
    if m is not None and m.packaged is not None:
        led.take("model.packaged", m.packaged, None)
    asked_dtype = m.dtype if m else None
    led.take("model.dtype", asked_dtype, run_dtype(machine.backend, None, model.dtype))
    dtype = run_dtype(machine.backend, asked_dtype, model.dtype)
    if dtype != led["model.dtype"]:
        led.change(
            "model.dtype",
            dtype,
            "model.cpu-float32",
            f"virtual CPU devices run in float32, so model.dtype = {asked_dtype!r} is not used",
        )
    if model.dtype != dtype:
        model = model.model_copy(update={"dtype": dtype})
    led.take("model.seed", m.seed if m else None, 0)
    preset_scale = PRESET_DEFAULTS[synthetic]["layer_scale"] if synthetic is not None else None
    led.take("model.layer_scale", m.layer_scale if m else None, preset_scale)
    led.take("model.routing", m.routing if m else None, "uniform")
    led.take("model.prefill_q", m.prefill_q if m else None, "split")
    if led.take("model.decode_attention", m.decode_attention if m else None, "auto") == "auto":
        group = model.num_attention_heads // model.num_key_value_heads
        if decode_attention_on_tensor_cores(model.head_dim, group):
            led.resolve_auto("model.decode_attention", "tensor_cores", "model.decode-attention")
        else:
            dims = ", ".join(map(str, DECODE_ATTENTION_TC_HEAD_DIMS))
            why = (
                f"decode attention runs on CUDA cores: its tensor-core kernel takes head dims {dims} with at "
                f"most {DECODE_ATTENTION_TC_MAX_GROUP} query heads per KV head, and the model has head dim "
                f"{model.head_dim} with {group}"
            )
            cpu = machine.backend == "cpu"  # virtual CPU devices run no attention kernel: nothing to say
            led.resolve_auto(
                "model.decode_attention", "cuda_cores", "model.decode-attention", None if cpu else why
            )

    mem = p.memory
    max_ctx = model.max_position_embeddings
    # The default is already within the model's positions; only an asked-for context is clamped.
    context = led.take("memory.context", mem.context if mem else None, min(DEFAULT_CONTEXT, max_ctx))
    if context > max_ctx:
        led.change(
            "memory.context",
            max_ctx,
            "memory.context-cap",
            f"context {context} is more than the model's {max_ctx} positions; {max_ctx} per slot",
        )
    led.take("memory.kv_dtype", mem.kv_dtype if mem else None, dtype)
    chunk = led.take("memory.prefill_chunk", mem.prefill_chunk if mem else None, DEFAULT_PREFILL_CHUNK)
    alone = led.take("memory.prefill_chunk_alone", mem.prefill_chunk_alone if mem else None, chunk)
    if alone < chunk:
        led.change(
            "memory.prefill_chunk_alone",
            chunk,
            "memory.prefill-chunk-alone-floor",
            f"a lone prompt's chunk of {alone} is shorter than every prompt's {chunk}; {chunk}",
        )
    led.take("memory.prompt_graph_rows", mem.prompt_graph_rows if mem else None, "auto")
    led.take("memory.prefill_graph_rows", mem.prefill_graph_rows if mem else None, "auto")
    reuse = led.take("memory.prefix_reuse", mem.prefix_reuse if mem else None, True)
    store = led.take("memory.prefix_store_mib", mem.prefix_store_mib if mem else None, 0)
    if store and not reuse:
        led.change(
            "memory.prefix_store_mib",
            0,
            "memory.prefix-store-needs-reuse",
            "memory.prefix_store_mib stores what slots kept, and with memory.prefix_reuse false they keep "
            "nothing; 0",
            because=("memory.prefix_reuse",),
        )
    resolve_prefill_graph_rows(led)
    reserve = led.take("memory.vram_reserve_mib", mem.vram_reserve_mib if mem else None, DEFAULT_RESERVE_MIB)
    led.take("memory.vram_reserve_later_mib", mem.vram_reserve_later_mib if mem else None, reserve)
    led.take("memory.host_reserve_mib", mem.host_reserve_mib if mem else None, DEFAULT_HOST_RESERVE_MIB)
    _host_ram(p, machine, led)

    b = p.batch
    led.take("batch.slots", b.slots if b else None, 1)
    led.take("batch.groups", b.groups if b else None, None)
    led.take("batch.mtp", b.mtp if b else None, False)
    led.take("batch.mtp_in_groups", b.mtp_in_groups if b else None, False)
    led.take("batch.run_ahead", b.run_ahead if b else None, DEFAULT_RUN_AHEAD)

    s = p.spec
    method = led.take("spec.method", s.method if s else None, "mtp")
    lookup = method == "ngram"
    draft = led.take(
        "spec.draft_tokens",
        s.draft_tokens if s else None,
        DEFAULT_DRAFT_TOKENS if model.has_mtp or lookup else 0,
    )
    led.take("spec.draft_floor", s.draft_floor if s else None, DEFAULT_DRAFT_FLOOR)
    led.take("spec.adaptive_depth", s.adaptive_depth if s else None, True)
    led.take("spec.draft_head", s.draft_head if s else None, "auto")  # resolved after the budget
    # A written bound moves the other's default so the two stay ordered (both written: the schema checks).
    asked_min, asked_max = (s.ngram_min, s.ngram_max) if s else (None, None)
    led.take("spec.ngram_min", asked_min, min(DEFAULT_NGRAM_MIN, asked_max or DEFAULT_NGRAM_MIN))
    led.take("spec.ngram_max", asked_max, max(DEFAULT_NGRAM_MAX, asked_min or DEFAULT_NGRAM_MAX))
    if draft >= 2 and not model.has_mtp and not lookup:
        led.change(
            "spec.draft_tokens",
            0,
            "spec.needs-mtp-weights",
            f"speculative decoding is off: {model.source} has no MTP weights to draft with "
            '(spec.method = "ngram" drafts without them)',
            because=("spec.method",),
        )
    if not lookup:
        for key in ("spec.ngram_min", "spec.ngram_max"):
            if led.user_set(key):
                led.note(
                    "spec.ngram-inert",
                    key,
                    f'{key} does nothing: spec.method is "mtp" (n-gram lookup drafts only with '
                    'spec.method = "ngram")',
                    requested=True,
                    because=("spec.method",),
                )

    e = p.experts
    led.take("experts.cache", e.cache if e else None, "auto")
    helpers = led.take(
        "experts.helper_devices", tuple(e.helper_devices) if e and e.helper_devices else None, ()
    )
    led.take("experts.remote_opt", e.remote_opt if e else None, False)
    peer = led.take("experts.peer_device", e.peer_device if e else None, None)
    led.take("experts.adapt", e.adapt if e else None, True)
    led.take("experts.score_decay", e.score_decay if e else None, SCORE_DECAY)
    led.take("experts.rebalance_every", e.rebalance_every if e else None, REBALANCE_EVERY)
    led.take("experts.swap_margin", e.swap_margin if e else None, SWAP_MARGIN)
    led.take("experts.max_swaps", e.max_swaps if e else None, MAX_SWAPS)
    led.take("experts.keep_misses", e.keep_misses if e else None, True)
    led.take("experts.recall_stored", e.recall_stored if e else None, True)

    if p.serve is not None:
        sv = p.serve
        led.take("serve.host", sv.host, DEFAULT_HOST)
        led.take("serve.port", sv.port, DEFAULT_PORT)
        led.take("serve.api_key_env", sv.api_key_env, None)
        led.take("serve.model_name", sv.model_name, led["name"])
        led.take("serve.max_queued", sv.max_queued, None)
        led.take("serve.warm_up", sv.warm_up, True)
        led.take("serve.recoveries", sv.recoveries, DEFAULT_RECOVERIES)
        led.take("serve.step_timeout_s", sv.step_timeout_s, DEFAULT_STEP_TIMEOUT_S)
        led.take("serve.allowed_origins", tuple(sv.allowed_origins) if sv.allowed_origins else None, ())

    sp = p.split
    led.take("split.test_shared_gpu", sp.test_shared_gpu if sp else None, False)
    led.take("split.pipeline_windows", sp.pipeline_windows if sp else None, 0)
    return model, _topology(p, machine, led, helpers=helpers, peer=peer, n_layers=model.num_hidden_layers)


def _host_ram(p: Profile, machine: MachineFacts, led: Ledger) -> None:
    """``machine.host_ram_mib``: as written, else what the facts step probed, else unknown (None)."""
    led.take("machine.host_ram_mib", p.machine.host_ram_mib if p.machine else None, None)
    if not led.user_set("machine.host_ram_mib") and machine.host_ram_source == "probe":
        led.resolve_auto(
            "machine.host_ram_mib",
            machine.host_ram_mib,
            "machine.host-ram-probed",
            f"host memory: {machine.host_ram_mib} MiB available, probed from /proc/meminfo (MemAvailable); "
            "write machine.host_ram_mib to plan for another amount",
        )


def _topology(
    p: Profile,
    machine: MachineFacts,
    led: Ledger,
    *,
    helpers: tuple[int, ...],
    peer: int | None,
    n_layers: int,
) -> Topology:
    sp = p.split
    excluded = set(helpers) | ({peer} if peer is not None else set())
    usable = tuple(g.index for g in machine.gpus if g.index not in excluded)
    layers = led.take("split.layers", sp.layers if sp else None, [])
    asked_devices = sp.devices if sp else None
    auto = layers == "auto"
    if auto:
        # Unnamed devices: every usable GPU, as far as the layers (two on the first stage) and the stage
        # limit allow.
        n_stages = len(asked_devices) if asked_devices else min(len(usable), n_layers - 1, MAX_STAGES)
        if n_stages <= 1:
            led.resolve_auto(
                "split.layers",
                [],
                "split.auto-single-gpu",
                f'split.layers = "auto" with {max(n_stages, 0)} usable GPU: one stage, no split',
            )
            auto = False
            n_stages = 1
    else:
        n_stages = len(layers) + 1
    hosts: tuple[str, ...]
    if asked_devices:
        parsed = [parse_device(d) for d in asked_devices]
        hosts = tuple(h for h, _ in parsed)
        devices = tuple(i for _, i in parsed)
        led.take("split.devices", list(devices), None)
    else:
        if n_stages <= len(usable):
            devices = usable[:n_stages]
        elif usable and led["split.test_shared_gpu"]:
            devices = tuple(usable[i % len(usable)] for i in range(n_stages))
        else:
            devices = tuple(range(n_stages))  # refused in step 1 (more stages than GPUs)
        hosts = ("local",) * n_stages
        led.take("split.devices", None, list(devices))
    return Topology(
        n_stages=n_stages,
        devices=devices,
        hosts=hosts,
        auto=auto,
        boundaries=() if auto else tuple(led["split.layers"]),
        usable=usable,
        devices_given=bool(asked_devices),
    )


def estimated_bandwidth(machine: MachineFacts, topo: Topology, led: Ledger) -> None:
    """Say so when a stage GPU's speed is a guess, since the auto split and roofline lean on it."""
    for g in machine.gpus:
        if g.index in topo.devices and g.bandwidth_estimated:
            led.note(
                "machine.estimated-bandwidth",
                "machine.gpus",
                f"GPU {g.index} ({g.name}): {g.bandwidth_gbs:g} GB/s is an estimate; write [machine] gpus "
                "with its bandwidth_gbs to place layers by its real speed",
            )
