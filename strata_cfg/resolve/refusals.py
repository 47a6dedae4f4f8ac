"""Step 1: the profiles the engine would refuse to start (stages on other hosts, boundaries outside the
model, more stages than GPUs, missing devices, a peer device with a split or helpers). Every refusal is
collected, so one run of `strata check` names them all."""

from __future__ import annotations

from ..schema.facts import MachineFacts, ModelFacts
from .ledger import Ledger
from .topology import MAX_STAGES, Topology, count

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
                f"{count(len(topo.devices), 'device')} for {count(topo.n_stages, 'stage')}: "
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
