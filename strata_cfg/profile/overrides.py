"""``--set KEY=VALUE`` overrides: values from the command line, each replacing one dotted key, with the
origin ``--set``."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

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
    created. Parent tables keep the origin of the file that wrote them.
    """
    out: dict[str, Any] = dict(data)
    out_origins = dict(origins)
    for item in sets:
        key, value = parse_set(item) if isinstance(item, str) else item
        parts = key.split(".")
        out = _with_value(out, parts, value, key)
        for k in [k for k in out_origins if k == key or k.startswith(key + ".")]:
            del out_origins[k]
        for n in range(1, len(parts)):
            out_origins.setdefault(".".join(parts[:n]), Origin(file=SET_ORIGIN))
        out_origins[key] = Origin(file=SET_ORIGIN)
        out_origins.update((k, Origin(file=SET_ORIGIN)) for k in _flatten_keys(value, key))
    return out, out_origins


def _with_value(node: Any, parts: list[str], value: Any, key: str) -> Any:
    """A copy of ``node`` with ``value`` at the path ``parts`` (copying only along the path)."""
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if isinstance(node, list):
        if not head.isdigit() or int(head) >= len(node):
            raise ValueError(
                f"--set {key}: {head!r} is not an index of that array (it has {len(node)} items)"
            )
        items = list(node)
        items[int(head)] = _with_value(items[int(head)], rest, value, key)
        return items
    table = dict(node) if isinstance(node, dict) else {}
    table[head] = _with_value(table.get(head), rest, value, key)
    return table


def _flatten_keys(value: Any, prefix: str) -> Iterable[str]:
    """Every dotted key inside a value (table keys and array elements)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield f"{prefix}.{k}"
        yield from _flatten_keys(v, f"{prefix}.{k}")
