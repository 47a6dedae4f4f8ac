"""One path from a profile to a plan, shared by every command and the TUI: load -> facts -> resolve.

``path=None`` means the embedded demo profile, so `strata plan` with no argument shows something real.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .facts.gather import gather_facts
from .facts.machine import probe_nvidia_smi
from .profile.load import LoadedProfile, load_profile, load_profile_text
from .resolve import resolve
from .schema.facts import MachineFacts, ModelFacts
from .schema.plan import LaunchPlan

DEMO_LABEL = "<embedded>/demo.toml"
"""How the embedded demo profile is named in origins and messages."""

Sets = Iterable[tuple[str, Any] | str]


@dataclass(frozen=True)
class Resolved:
    """A profile and everything resolved from it."""

    loaded: LoadedProfile
    machine: MachineFacts
    model: ModelFacts
    plan: LaunchPlan


def demo_text() -> str:
    """The embedded demo profile's TOML."""
    return resources.files("strata_cfg").joinpath("data", "demo.toml").read_text(encoding="utf-8")


def load(path: str | os.PathLike[str] | None, sets: Sets = ()) -> LoadedProfile:
    """Load a profile file, or the embedded demo for ``None``."""
    if path is None:
        return load_profile_text(demo_text(), DEMO_LABEL, sets)
    return load_profile(path, sets)


def resolve_loaded(
    loaded: LoadedProfile, *, strict: bool = False, probe: Callable[[], str] = probe_nvidia_smi
) -> Resolved:
    """Facts, then the pure resolver. Raises `ProfileError` only."""
    machine, model = gather_facts(loaded, probe=probe)
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
