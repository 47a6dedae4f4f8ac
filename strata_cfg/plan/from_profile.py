"""One path from a profile to a plan, shared by every command and the TUI: load -> facts -> resolve.

``path=None`` means the embedded demo profile, so `strata plan` with no argument shows something real.
The plan goes on from here to the report (`strata_cfg.report`) or to a launch (`strata_cfg.launch`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..facts.gather import gather_facts
from ..facts.machine import probe_nvidia_smi, read_meminfo
from ..profile.load import LoadedProfile, load, load_profile_text
from ..profile.overrides import Sets
from ..resolve import resolve
from ..schema.facts import MachineFacts, ModelFacts
from ..schema.plan import LaunchPlan


@dataclass(frozen=True)
class Resolved:
    """A profile and everything resolved from it."""

    loaded: LoadedProfile
    machine: MachineFacts
    model: ModelFacts
    plan: LaunchPlan


def resolve_loaded(
    loaded: LoadedProfile,
    *,
    strict: bool = False,
    probe: Callable[[], str] = probe_nvidia_smi,
    meminfo: Callable[[], str] = read_meminfo,
) -> Resolved:
    """Facts, then the pure resolver. Raises `ProfileError` only."""
    machine, model = gather_facts(loaded, probe=probe, meminfo=meminfo)
    plan = resolve(
        loaded.profile, machine, model, origins=loaded.origins, strict=strict, profile_file=loaded.path
    )
    return Resolved(loaded, machine, model, plan)


def resolve_path(
    path: str | os.PathLike[str] | None = None, sets: Sets = (), *, strict: bool = False
) -> Resolved:
    """Load and resolve a profile file (``None``: the embedded demo)."""
    return resolve_loaded(load(path, sets), strict=strict)


def resolve_text(
    text: str, path: str | os.PathLike[str] | None = None, sets: Sets = (), *, strict: bool = False
) -> Resolved:
    """Resolve profile text that is not (yet) saved, as if it were the file ``path`` (the TUI's editor)."""
    return resolve_loaded(load_profile_text(text, path, sets), strict=strict)


def resolve_profile(
    path: str | os.PathLike[str] | None = None, sets: Sets = (), *, strict: bool = False
) -> LaunchPlan:
    """Load, gather facts and resolve: the plan for a profile file (``None``: the embedded demo).

    Raises `ProfileError` with every problem when the profile is refused.
    """
    return resolve_path(path, sets, strict=strict).plan
