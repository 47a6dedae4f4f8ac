"""The stage layout as the gates read it: how many stages, on which GPUs, and whether they share one.

Step 0 (`defaults`) builds it from ``[split]`` and the machine; step 1 (`refusals`) checks it; the later
steps only read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ledger import Ledger

MAX_STAGES = 8


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


def is_test_split(topo: Topology, led: Ledger) -> bool:
    """A split whose stages share one GPU, allowed by ``split.test_shared_gpu``."""
    return topo.split and topo.shared_gpu and bool(led["split.test_shared_gpu"])


def count(n: int, noun: str) -> str:
    """``1 stage``, ``2 stages``: a count with its noun, for the sentences of decisions."""
    return f"{n} {noun}{'s' * (n != 1)}"
