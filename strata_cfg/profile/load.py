"""Loading a profile: TOML text -> merged `extends` chain -> ``--set`` overrides -> validated `Profile`.

Every user-written key keeps its origin (file and line), so that every later error and every resolved value
can say where it came from. The steps live beside this module: `toml_file` (one file and its line index),
`extends` (the chain), `overrides` (``--set``) and `validate` (problems that speak TOML).
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin, find_origin
from ..schema.profile import Profile
from .extends import load_chain
from .overrides import Sets, apply_sets
from .toml_file import read_text
from .validate import validate

DEMO_LABEL = "<embedded>/demo.toml"
"""How the embedded demo profile is named in origins and messages."""


@dataclass(frozen=True)
class LoadedProfile:
    """A validated profile with the origin of every key the user wrote."""

    profile: Profile
    origins: Mapping[str, Origin]
    """Dotted key -> where it was written (the last writer along the ``extends`` chain wins)."""
    path: str | None
    """The profile file as named by the caller (None for text without a file)."""
    files: tuple[str, ...] = ()
    """The ``extends`` chain, base first, ending with ``path``."""
    raw: Mapping[str, Any] = field(default_factory=dict)
    """The merged TOML data before validation."""

    @property
    def name(self) -> str:
        """The profile's name: its ``name`` key, else the file's stem."""
        if self.profile.name:
            return self.profile.name
        return Path(self.path).stem if self.path else "profile"

    def origin(self, key: str) -> Origin | None:
        """Where ``key`` (or its nearest written parent table) was written."""
        return find_origin(self.origins, key)

    def problem(self, key: str, message: str) -> ProfileError:
        """A refusal of ``key`` at the file and line that wrote it (else at the profile file)."""
        origin = self.origin(key)
        file = origin.file if origin else self.path
        return ProfileError(Problem(file, origin.line if origin else None, key, message))


def load_profile_text(
    text: str, path: str | os.PathLike[str] | None = None, sets: Sets = ()
) -> LoadedProfile:
    """Load a profile from ``text`` as if it were the file ``path`` (for relative ``extends``)."""
    file = os.fspath(path) if path is not None else "<profile>"
    seen = (os.path.realpath(file),) if path is not None else ()
    data, origins, files = load_chain(text, file, seen)
    data, origins = apply_sets(data, origins, sets)
    profile = validate(data, origins, file)
    return LoadedProfile(
        profile=profile,
        origins=types.MappingProxyType(origins),
        path=os.fspath(path) if path is not None else None,
        files=files,
        raw=types.MappingProxyType(data),
    )


def load_profile(path: str | os.PathLike[str], sets: Sets = ()) -> LoadedProfile:
    """Load the profile file ``path`` with its ``extends`` chain and ``--set`` overrides."""
    file = os.fspath(path)
    return load_profile_text(read_text(file, None, ""), file, sets)


def demo_text() -> str:
    """The embedded demo profile's TOML."""
    return resources.files("strata_cfg").joinpath("data", "demo.toml").read_text(encoding="utf-8")


def load(path: str | os.PathLike[str] | None, sets: Sets = ()) -> LoadedProfile:
    """Load a profile file, or the embedded demo for ``None`` (so `strata plan` alone shows a real plan)."""
    if path is None:
        return load_profile_text(demo_text(), DEMO_LABEL, sets)
    return load_profile(path, sets)
