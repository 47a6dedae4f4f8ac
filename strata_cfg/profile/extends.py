"""The ``extends`` chain: a profile loaded on top of the profile it extends, and so on down to a base.

Merge semantics: tables merge key by key, everything else (numbers, strings, arrays) is replaced whole, and
the origins follow the values. ``name`` and ``description`` belong to each file and are not inherited. A
chain that comes back to a file it already holds is refused, naming the cycle, and so is a chain of more
than `MAX_CHAIN` files (a profile extends a base or two, never hundreds).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin
from .toml_file import display_path, parse_toml, read_text

NOT_INHERITED = ("name", "description", "extends")
"""Keys a profile does not take from the profile it extends."""
MAX_CHAIN = 16
"""The most files one ``extends`` chain may hold, the profile itself included."""


def load_chain(
    text: str, file: str, seen: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Origin], tuple[str, ...]]:
    """Load ``text`` and, first, everything it extends. Returns merged data, origins and the file chain."""
    data, origins = parse_toml(text, file)
    base_ref = data.get("extends")
    if base_ref is None:
        return data, origins, (file,)
    ext_origin = origins.get("extends", Origin(file=file))
    if not isinstance(base_ref, str) or not base_ref:
        raise ProfileError(
            Problem(file, ext_origin.line, "extends", "expected the path of a base profile, as a string")
        )
    base_file = display_path(file, base_ref)
    key = os.path.realpath(base_file)
    if key in seen:
        cycle = " -> ".join([*(os.path.relpath(s) for s in seen), os.path.relpath(key)])
        raise ProfileError(Problem(file, ext_origin.line, "extends", f"`extends` makes a cycle: {cycle}"))
    if len(seen) >= MAX_CHAIN:
        raise ProfileError(
            Problem(file, ext_origin.line, "extends", f"the `extends` chain is longer than {MAX_CHAIN} files")
        )
    base_text = read_text(base_file, ext_origin, "extends")
    base_data, base_origins, base_files = load_chain(base_text, base_file, (*seen, key))
    for k in NOT_INHERITED:
        base_data.pop(k, None)
        base_origins.pop(k, None)
    merged, merged_origins = merge(base_data, base_origins, data, origins)
    return merged, merged_origins, (*base_files, file)


def merge(
    base: Mapping[str, Any],
    base_origins: Mapping[str, Origin],
    over: Mapping[str, Any],
    over_origins: Mapping[str, Origin],
) -> tuple[dict[str, Any], dict[str, Origin]]:
    """Merge ``over`` onto ``base``: tables key by key, other values replaced whole (origins follow)."""
    out = _merge_data(base, over)
    origins = dict(base_origins)
    for key in _replaced_prefixes(base, over):
        for k in [k for k in origins if k == key or k.startswith(key + ".")]:
            del origins[k]
    origins.update(over_origins)
    return out, origins


def _merge_data(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_data(out[k], v)
        else:
            out[k] = v
    return out


def _replaced_prefixes(base: Mapping[str, Any], over: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """Dotted keys whose whole value ``over`` replaces (so the base's origins below them go)."""
    for k, v in over.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            yield from _replaced_prefixes(base[k], v, key + ".")
        elif k in base:
            yield key
