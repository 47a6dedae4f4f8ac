"""Steps 0 to 5 of RULES.md: defaults and ``auto`` values first, then the refusals and gates, in order.

Each step is a small function over the ledger. Step 0 gives every key its concrete value (or, for
``batch.groups`` and ``split.layers = "auto"``, records what was asked so that the step that owns it can
resolve it before any gate reads it). Later steps only read resolved values.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema.facts import MachineFacts, ModelFacts
from ..schema.presets import PRESET_DEFAULTS
from ..schema.profile import Profile, parse_device
from .ledger import Ledger

DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_RESERVE_MIB = 700
DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
DEFAULT_DRAFT_TOKENS = 4
MAX_STAGES = 8
MAX_PLAIN_SLOTS = 8


@dataclass(frozen=True, slots=True)
class Topology:
    """The stage layout as far as the gates need it, fixed in step 0 and checked in step 1."""

    n_stages: int
    devices: tuple[int, ...]
    """GPU index of each stage (before step 6 may reorder an auto split)."""
    hosts: tuple[str, ...]
    auto: bool
    """``split.layers = "auto"`` with more than one usable GPU: boundaries are chosen in step 6."""
    boundaries: tuple[int, ...]
    """Explicit boundaries (empty for one stage or an auto split)."""
    usable: tuple[int, ...]
    """GPUs that may hold a stage: all but helper and peer devices."""
    devices_given: bool

    @property
    def split(self) -> bool:
        return self.n_stages > 1

    @property
    def shared_gpu(self) -> bool:
        """Two stages on one GPU."""
        return len(set(self.devices)) < len(self.devices)


def run_dtype(backend: str, asked: str | None, default: str = "float16") -> str:
    """The precision weights sit in on the device: float32 on virtual CPU devices, else as asked."""
    if backend == "cpu":
        return "float32"
    return asked or default


# ---- step 0 -------------------------------------------------------------------------------------


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
    led.take("memory.prefill_chunk", mem.prefill_chunk if mem else None, DEFAULT_PREFILL_CHUNK)
    reserve = led.take("memory.vram_reserve_mib", mem.vram_reserve_mib if mem else None, DEFAULT_RESERVE_MIB)
    led.take("memory.vram_reserve_later_mib", mem.vram_reserve_later_mib if mem else None, reserve)

    b = p.batch
    led.take("batch.slots", b.slots if b else None, 1)
    led.take("batch.groups", b.groups if b else None, None)
    led.take("batch.mtp", b.mtp if b else None, False)

    s = p.spec
    draft = led.take(
        "spec.draft_tokens", s.draft_tokens if s else None, DEFAULT_DRAFT_TOKENS if model.has_mtp else 0
    )
    if draft >= 2 and not model.has_mtp:
        led.change(
            "spec.draft_tokens",
            0,
            "spec.needs-mtp-weights",
            f"speculative decoding is off: {model.source} has no MTP weights to draft with",
        )

    e = p.experts
    led.take("experts.cache", e.cache if e else None, "auto")
    helpers = led.take(
        "experts.helper_devices", tuple(e.helper_devices) if e and e.helper_devices else None, ()
    )
    led.take("experts.remote_opt", e.remote_opt if e else None, False)
    peer = led.take("experts.peer_device", e.peer_device if e else None, None)

    if p.serve is not None:
        sv = p.serve
        led.take("serve.host", sv.host, DEFAULT_HOST)
        led.take("serve.port", sv.port, DEFAULT_PORT)
        led.take("serve.api_key_env", sv.api_key_env, None)
        led.take("serve.model_name", sv.model_name, led["name"])

    sp = p.split
    led.take("split.test_shared_gpu", sp.test_shared_gpu if sp else None, False)
    led.take("split.pipeline_windows", sp.pipeline_windows if sp else None, 0)
    return model, _topology(p, machine, led, helpers=helpers, peer=peer, n_layers=model.num_hidden_layers)


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


# ---- step 1 -------------------------------------------------------------------------------------


_REFUSAL_READS = {
    "split.layers": ("split.rising", "split.range", "split.max-stages", "split.too-many-devices"),
    "split.devices": (
        "split.remote-host",
        "split.too-many-devices",
        "split.device-count",
        "machine.device-missing",
        "split.shared-gpu",
    ),
    "experts.peer_device": ("experts.peer-with-split", "experts.peer-with-helpers", "machine.device-missing"),
    "experts.helper_devices": (
        "experts.peer-with-helpers",
        "machine.device-missing",
        "experts.helper-is-stage",
    ),
}
"""Keys step 1 reads, and the rules that read them (for `strata explain`)."""


def parse_time_refusals(machine: MachineFacts, model: ModelFacts, topo: Topology, led: Ledger) -> None:
    """Profiles the engine would refuse to start. Every refusal is collected."""
    n_gpus = len(machine.gpus)
    for key, rules in _REFUSAL_READS.items():
        for rule_id in rules:
            led.get(key, rule_id)
    for i, host in enumerate(topo.hosts):
        if host != "local":
            led.refuse(
                "split.remote-host",
                f"split.devices.{i}",
                f"device on host {host!r}: stages on other hosts are not built yet; only `local` GPUs can "
                "hold a stage",
            )
    helpers = led["experts.helper_devices"]
    peer = led["experts.peer_device"]
    if peer is not None and topo.split:
        led.refuse(
            "experts.peer-with-split",
            "experts.peer_device",
            "a peer device cannot combine with a layer split",
        )
    if peer is not None and helpers:
        led.refuse(
            "experts.peer-with-helpers",
            "experts.peer_device",
            "a peer device cannot combine with helper caches",
        )

    bounds = topo.boundaries
    n_layers = model.num_hidden_layers
    if any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
        led.refuse("split.rising", "split.layers", f"boundaries {list(bounds)} must rise")
    for i, b in enumerate(bounds):
        if not 2 <= b < n_layers:
            led.refuse(
                "split.range",
                f"split.layers.{i}",
                f"boundary {b} is outside the model's layers: each must be at least 2 and below {n_layers}",
            )
    if topo.n_stages > MAX_STAGES:
        led.refuse("split.max-stages", "split.layers", f"{topo.n_stages} stages; at most {MAX_STAGES}")
    if topo.auto and n_layers < topo.n_stages + 1:
        led.refuse("split.range", "split.layers", f"{n_layers} layers cannot make {topo.n_stages} stages")

    _device_refusals(machine, topo, led, n_gpus=n_gpus, helpers=helpers, peer=peer)


def _device_refusals(
    machine: MachineFacts,
    topo: Topology,
    led: Ledger,
    *,
    n_gpus: int,
    helpers: tuple[int, ...],
    peer: int | None,
) -> None:
    if topo.devices_given:
        if len(topo.devices) > n_gpus:
            led.refuse(
                "split.too-many-devices",
                "split.devices",
                f"{len(topo.devices)} split devices, but the machine has {n_gpus} GPU{'s' * (n_gpus != 1)}",
            )
        elif len(topo.devices) != topo.n_stages:
            led.refuse(
                "split.device-count",
                "split.devices",
                f"{_count(len(topo.devices), 'device')} for {_count(topo.n_stages, 'stage')}: "
                "give one GPU per stage",
            )
    elif topo.n_stages > len(topo.usable) and not (topo.usable and led["split.test_shared_gpu"]):
        led.refuse(
            "split.too-many-devices",
            "split.layers",
            f"{topo.n_stages} stages need {topo.n_stages} GPUs, but the machine has {len(topo.usable)} "
            "that can hold a stage",
        )
    refs = [(f"split.devices.{i}", d) for i, d in enumerate(topo.devices) if topo.devices_given]
    refs += [(f"experts.helper_devices.{i}", d) for i, d in enumerate(helpers)]
    refs += [("experts.peer_device", peer)] if peer is not None else []
    for key, d in refs:
        if d >= n_gpus:
            led.refuse(
                "machine.device-missing", key, f"GPU {d} does not exist: the machine has GPUs 0..{n_gpus - 1}"
            )
    if topo.shared_gpu and not led.get("split.test_shared_gpu", "split.shared-gpu"):
        led.refuse(
            "split.shared-gpu",
            "split.devices",
            f"two stages on one GPU ({list(topo.devices)}); set split.test_shared_gpu = true to test a "
            "split on one card",
        )
    for key, d in refs:
        if not key.startswith("split.") and d in topo.devices:
            led.refuse(
                "experts.helper-is-stage",
                key,
                f"GPU {d} holds a stage, so it cannot also be an expert helper",
            )


def is_test_split(topo: Topology, led: Ledger) -> bool:
    """A split whose stages share one GPU, allowed by ``split.test_shared_gpu``."""
    return topo.split and topo.shared_gpu and bool(led["split.test_shared_gpu"])


# ---- step 2 -------------------------------------------------------------------------------------


def batch_gate(topo: Topology, led: Ledger) -> None:
    """Batching needs two slots and real GPUs per stage; plain batching is bounded by the window."""
    rid = "batch.single-slot"
    slots = led.get("batch.slots", rid)
    if slots < 2 and led.user_set("batch.slots"):
        led.note(rid, "batch.slots", f"batch.slots = {slots}: no batching, one request at a time")
    if slots >= 2 and is_test_split(topo, led):
        led.change(
            "batch.slots",
            1,
            "batch.test-split",
            "batching is off: a single-GPU test split runs one request at a time",
        )
        slots = 1
    if slots > MAX_PLAIN_SLOTS and not led.get("batch.mtp", "batch.max-slots"):
        led.change(
            "batch.slots",
            MAX_PLAIN_SLOTS,
            "batch.max-slots",
            f"{slots} slots without batch MTP: clamped to {MAX_PLAIN_SLOTS}, the rows one window holds",
        )


# ---- step 3 -------------------------------------------------------------------------------------


def batch_mtp_gate(model: ModelFacts, topo: Topology, led: Ledger, *, serving: bool) -> None:
    """Reasons batch MTP cannot run that do not depend on groups; the first failing one turns it off."""
    if not led["batch.mtp"]:
        return
    slots = led["batch.slots"]
    helpers = led["experts.helper_devices"]
    reasons = (
        ("batch-mtp.needs-batching", slots < 2, f"batch MTP is off: batching is off ({slots} slot)"),
        (
            "batch-mtp.needs-mtp-weights",
            not model.has_mtp,
            f"batch MTP is off: {model.source} has no MTP weights",
        ),
        (
            "batch-mtp.needs-spec",
            led["spec.draft_tokens"] < 2,
            f"batch MTP is off: spec.draft_tokens = {led['spec.draft_tokens']} turns MTP drafting off",
        ),
        ("batch-mtp.shared-gpu", topo.shared_gpu, "batch MTP is off: two stages share one GPU"),
        ("batch-mtp.needs-serve", not serving, "batch MTP is off: the profile has no [serve] table"),
        (
            "batch-mtp.helper-caches",
            topo.split and bool(helpers),
            "batch MTP is off: on a split it does not combine with helper-GPU expert caches",
        ),
        (
            "batch-mtp.remote-opt",
            topo.split and bool(led["experts.remote_opt"]),
            "batch MTP is off: on a split it does not combine with remote expert opt",
        ),
    )
    for rule_id, fails, message in reasons:
        led.get("batch.mtp", rule_id)
        if fails:
            led.change("batch.mtp", False, rule_id, message)
            return


# ---- step 4 -------------------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def auto_groups(slots: int, stages: int) -> int:
    """The largest d <= stages such that slots % d == 0."""
    return max(d for d in range(1, max(stages, 1) + 1) if slots % d == 0)


def resolve_groups(topo: Topology, led: Ledger) -> None:
    """Groups resolved as a pure function of slots, stages and batch MTP, then the group-dependent gate."""
    asked = led.asked("batch.groups")
    slots = max(led.get("batch.slots", "groups.auto"), 1)
    stages = topo.n_stages
    defaulted = asked is None and topo.split and slots > 1
    if asked == "auto" or defaulted:
        groups = auto_groups(slots, stages)
        if defaulted and led.get("batch.mtp", "groups.batch-mtp-yield"):
            tail = (
                f", and batch.groups = {groups} would pipeline them and turn batch MTP off"
                if groups > 1
                else ""
            )
            led.change(
                "batch.groups",
                1,
                "groups.batch-mtp-yield",
                f"one group of {slots} slots, because batch MTP does not run in pipelined groups{tail}",
            )
        else:
            why = 'batch.groups = "auto"' if asked == "auto" else "batch.groups unset"
            led.resolve_auto(
                "batch.groups",
                groups,
                "groups.auto",
                f"{why}: {_count(groups, 'group')} of {_count(slots // groups, 'slot')} (the largest divisor "
                f"of {slots} slots that is at most {_count(stages, 'stage')})",
            )
    elif asked is None:
        led.take("batch.groups", None, 1)
    groups = led["batch.groups"]
    if groups > 1 and not topo.split:
        led.change(
            "batch.groups", 1, "groups.no-split", f"{groups} groups need a layer split to pipeline; 1 group"
        )
    elif groups > 1 and slots % groups:
        led.change(
            "batch.groups",
            1,
            "groups.not-divisor",
            f"{groups} groups do not divide {slots} slot{'s' * (slots != 1)}; 1 group",
        )
    groups = led["batch.groups"]
    if topo.split and led.get("batch.mtp", "batch-mtp.pipelined-groups") and groups > 1:
        led.change(
            "batch.mtp",
            False,
            "batch-mtp.pipelined-groups",
            f"batch MTP is off: it does not combine with pipelined slot groups yet ({groups} groups); "
            "leave batch.groups unset or set it to 1 to run it",
        )


# ---- step 5 -------------------------------------------------------------------------------------


def pipeline_windows_gate(model: ModelFacts, topo: Topology, led: Ledger) -> None:
    """Overlapped solo windows on a two-stage split; the first failing reason turns them off."""
    pw = led["split.pipeline_windows"]
    if not pw:
        return
    spec_mtp = model.has_mtp and led["spec.draft_tokens"] >= 2
    reasons = (
        ("pipeline-windows.needs-split", not topo.split, "there is no layer split"),
        ("pipeline-windows.shared-gpu", is_test_split(topo, led), "the split is a single-GPU test split"),
        ("pipeline-windows.two-stages", topo.n_stages != 2, f"the split has {topo.n_stages} stages, not 2"),
        ("pipeline-windows.needs-mtp", not spec_mtp, "the solo path does not draft with MTP"),
        ("pipeline-windows.batch", led["batch.slots"] >= 2, "batch slots are on"),
        ("pipeline-windows.peer-device", led["experts.peer_device"] is not None, "a peer device is set"),
        ("pipeline-windows.helper-caches", bool(led["experts.helper_devices"]), "helper caches are set"),
    )
    for rule_id, fails, why in reasons:
        led.get("split.pipeline_windows", rule_id)
        if fails:
            led.change("split.pipeline_windows", 0, rule_id, f"pipeline windows are off: {why}")
            return
