"""``--set KEY=VALUE`` overrides: values from the command line, each replacing one dotted key, with the
origin ``--set``."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin

SET_ORIGIN = "--set"
"""The ``file`` of an `Origin` for a value given on the command line."""

Sets = Iterable[tuple[str, Any] | str]
"""Overrides as given: ``("batch.slots", 4)`` pairs, or ``"batch.slots=4"`` text."""


def parse_set(item: str) -> tuple[str, Any]:
    """``"batch.slots=4"`` -> ``("batch.slots", 4)``. Values are TOML; a bare word is a string.

    Raises ValueError with a usage message for anything else.
    """
    key, sep, text = item.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key or not all(key.split(".")):
        raise ValueError(f"--set wants KEY=VALUE with a dotted key (batch.slots=4), not {item!r}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if not text or any(c in text for c in "[]{}\"'=\n"):
            raise ValueError(f"--set {key}: {text!r} is not a TOML value") from None
        value = text
    return key, value


def apply_sets(
    data: Mapping[str, Any], origins: Mapping[str, Origin], sets: Sets
) -> tuple[dict[str, Any], dict[str, Origin]]:
    """Apply command-line overrides, each replacing one dotted key, with origin ``--set``.

    A number in the key indexes an existing array (``machine.gpus.1.vram_mib=16384``); missing tables are
    created. Parent tables keep the origin of the file that wrote them. Raises `ProfileError` at ``--set``
    for an override that cannot apply: ``extends`` (the chain is loaded before any override), a path
    through a value that is not a table, an index past an array.
    """
    out: dict[str, Any] = dict(data)
    out_origins = dict(origins)
    for item in sets:
        try:
            key, value = parse_set(item) if isinstance(item, str) else item
        except ValueError as exc:
            raise ProfileError(Problem(SET_ORIGIN, None, "", str(exc))) from None
        parts = key.split(".")
        if parts[0] == "extends":
            raise _set_problem(
                key,
                "`extends` cannot be set from the command line: the base is loaded before any --set "
                "applies; write `extends` in a profile file",
            )
        try:
            out = _with_value(out, parts, value, key)
        except ValueError as exc:
            raise _set_problem(key, str(exc)) from None
        for k in [k for k in out_origins if k == key or k.startswith(key + ".")]:
            del out_origins[k]
        for n in range(1, len(parts)):
            out_origins.setdefault(".".join(parts[:n]), Origin(file=SET_ORIGIN))
        out_origins[key] = Origin(file=SET_ORIGIN)
        out_origins.update((k, Origin(file=SET_ORIGIN)) for k in _flatten_keys(value, key))
    return out, out_origins


def _set_problem(key: str, message: str) -> ProfileError:
    return ProfileError(Problem(SET_ORIGIN, None, key, message))


def _with_value(node: Any, parts: list[str], value: Any, key: str, depth: int = 0) -> Any:
    """A copy of ``node`` with ``value`` at the path ``parts`` (copying only along the path).

    Raises ValueError when the path runs through a value that is neither a table nor an array, or past an
    array's end."""
    if len(parts) == depth:
        return value
    head = parts[depth]
    if isinstance(node, list):
        if not head.isdigit() or int(head) >= len(node):
            raise ValueError(f"{head!r} is not an index of that array (it has {len(node)} items)")
        items = list(node)
        items[int(head)] = _with_value(items[int(head)], parts, value, key, depth + 1)
        return items
    if node is not None and not isinstance(node, dict):
        where = ".".join(parts[:depth])
        raise ValueError(f"{where} is {_toml(node)}, not a table: there is no {key} to set")
    table = dict(node) if isinstance(node, dict) else {}
    table[head] = _with_value(table.get(head), parts, value, key, depth + 1)
    return table


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _flatten_keys(value: Any, prefix: str) -> Iterable[str]:
    """Every dotted key inside a value (table keys and array elements)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield f"{prefix}.{k}"
        yield from _flatten_keys(v, f"{prefix}.{k}")
