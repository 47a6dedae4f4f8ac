"""The facts step: machine and model facts for a loaded profile, gathered (with I/O) before the pure
resolver runs, with the problems of both reported together."""

from __future__ import annotations

from collections.abc import Callable

from ..profile.load import LoadedProfile
from ..schema.errors import Problem, ProfileError
from ..schema.facts import MachineFacts, ModelFacts
from .machine import machine_facts, probe_nvidia_smi, read_meminfo
from .model import model_facts


def gather_facts(
    loaded: LoadedProfile,
    *,
    probe: Callable[[], str] = probe_nvidia_smi,
    meminfo: Callable[[], str] = read_meminfo,
) -> tuple[MachineFacts, ModelFacts]:
    """Machine and model facts for a loaded profile, reporting problems of both together. ``probe`` and
    ``meminfo`` are read only when the profile says ``probe = true``."""
    problems: list[Problem] = []
    machine: MachineFacts | None = None
    model: ModelFacts | None = None
    try:
        machine = machine_facts(loaded, probe=probe, meminfo=meminfo)
    except ProfileError as exc:
        problems += exc.problems
    m = loaded.profile.machine
    backend = machine.backend if machine else (m.backend if m and m.backend else "cuda")
    try:
        model = model_facts(loaded, backend)
    except ProfileError as exc:
        problems += exc.problems
    if problems or machine is None or model is None:
        raise ProfileError(problems)
    return machine, model
