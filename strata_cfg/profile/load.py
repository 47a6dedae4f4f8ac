"""Loading a profile: TOML text -> merged `extends` chain -> ``--set`` overrides -> validated `Profile`.

Every user-written key keeps its origin (file and line), so that every later error and every resolved value
can say where it came from. Validation errors are turned into `Problem`s that speak TOML: file, line, dotted
key, what was expected, and a did-you-mean for unknown keys.

Merge semantics of ``extends``: tables merge key by key, everything else (numbers, strings, arrays) is
replaced whole. ``name`` and ``description`` belong to each file and are not inherited.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin, find_origin
from ..schema.profile import Profile
from .toml_lines import key_lines

SET_ORIGIN = "--set"
"""The ``file`` of an `Origin` for a value given on the command line."""
NOT_INHERITED = ("name", "description", "extends")
"""Keys a profile does not take from the profile it extends."""
_DEVICE_EXPECTED = 'expected a GPU index or "host:index"'
_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


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


# ---- parsing one file ----------------------------------------------------------------------------


def _parse(text: str, file: str) -> tuple[dict[str, Any], dict[str, Origin]]:
    """TOML text -> (data, origins of every key written in it)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = _TOML_POS.search(msg)
        line = int(m.group(1)) if m else None
        message = _TOML_POS.sub("", msg).strip()
        raise ProfileError(Problem(file, line, "", f"not valid TOML: {message}")) from None
    origins = {k: Origin(file=file, line=n) for k, n in key_lines(text).items()}
    return data, origins


def _display_path(base_display: str, relative: str) -> str:
    """Name a file the way the user would: relative to the one that referred to it."""
    if os.path.isabs(relative):
        return relative
    return os.path.normpath(os.path.join(os.path.dirname(base_display), relative))


def _read(path: str, referrer: Origin | None, key: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        where = referrer or Origin(file=path)
        raise ProfileError(Problem(where.file, where.line, key, f"no such profile file: {path}")) from None
    except (OSError, UnicodeDecodeError) as exc:
        where = referrer or Origin(file=path)
        raise ProfileError(Problem(where.file, where.line, key, f"cannot read {path}: {exc}")) from None


# ---- the extends chain ---------------------------------------------------------------------------


def _chain(
    text: str, file: str, seen: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Origin], tuple[str, ...]]:
    """Load ``text`` and, first, everything it extends. Returns merged data, origins and the file chain."""
    data, origins = _parse(text, file)
    base_ref = data.get("extends")
    if base_ref is None:
        return data, origins, (file,)
    ext_origin = origins.get("extends", Origin(file=file))
    if not isinstance(base_ref, str) or not base_ref:
        raise ProfileError(
            Problem(file, ext_origin.line, "extends", "expected the path of a base profile, as a string")
        )
    base_file = _display_path(file, base_ref)
    key = os.path.realpath(base_file)
    if key in seen:
        cycle = " -> ".join([*(os.path.relpath(s) for s in seen), os.path.relpath(key)])
        raise ProfileError(Problem(file, ext_origin.line, "extends", f"`extends` makes a cycle: {cycle}"))
    base_text = _read(base_file, ext_origin, "extends")
    base_data, base_origins, base_files = _chain(base_text, base_file, (*seen, key))
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


# ---- --set overrides -----------------------------------------------------------------------------


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
    data: Mapping[str, Any], origins: Mapping[str, Origin], sets: Iterable[tuple[str, Any] | str]
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


# ---- validation ----------------------------------------------------------------------------------


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as ``MachineSection | None`` or ``list[GpuSpec]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _section_model(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple):
        for arg in typing.get_args(annotation):
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def _fields_at(path: list[str]) -> list[str]:
    """The field names valid at a dotted location in a profile (for did-you-mean)."""
    model: type[BaseModel] | None = Profile
    for part in path:
        if model is None:
            return []
        if part.isdigit():
            continue
        info = model.model_fields.get(part)
        model = _section_model(info.annotation) if info else None
    return list(model.model_fields) if model else []


def _loc_key(loc: tuple[str | int, ...], data: Any) -> list[str]:
    """Turn a pydantic error location into the dotted path in the data, dropping union-member tags."""
    path: list[str] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(str(part))
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and not path:
            path.append(part)  # a missing required key at the top
            node = None
    return path


def _plain(msg: str) -> str:
    """Pydantic's message in the words of a profile: ``expected ...``."""
    msg = msg.removeprefix("Value error, ")
    msg = re.sub(r", unable to parse string as an? \w+", "", msg)
    # The only patterned strings in a profile are device specs (`"local:1"`).
    msg = re.sub(r"String should match pattern '[^']*'", _DEVICE_EXPECTED, msg)
    msg = msg.replace(" after validation", "").replace("List should have", "expected")
    return msg.replace("Input should be ", "expected ").replace("Field required", "required")


def _describe(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 40 else text[:37] + "..."


def validation_problems(
    exc: ValidationError, data: Mapping[str, Any], origins: Mapping[str, Origin], file: str | None
) -> list[Problem]:
    """One `Problem` per offending key, in file order, with did-you-mean for unknown keys."""
    by_key: dict[str, list[str]] = {}
    inputs: dict[str, Any] = {}
    for err in exc.errors():
        path = _loc_key(tuple(err["loc"]), data)
        key = ".".join(path)
        if err["type"] == "extra_forbidden":
            import difflib  # only on errors

            valid = _fields_at(path[:-1])
            msg = f"unknown key `{path[-1]}`"
            close = difflib.get_close_matches(path[-1], valid, n=1)
            if close:
                msg += f"; did you mean `{close[0]}`?"
            elif valid:
                msg += f" (expected one of: {', '.join(valid)})"
        else:
            msg = _plain(err["msg"])
            if err["type"] not in ("value_error", "missing"):
                inputs.setdefault(key, err.get("input"))
        if msg not in by_key.setdefault(key, []):
            by_key[key].append(msg)
    problems = []
    for key, msgs in by_key.items():
        if _DEVICE_EXPECTED in msgs:  # an int-or-device union: one message says both
            msgs = [_DEVICE_EXPECTED]
        origin = find_origin(origins, key)
        message = " or ".join(msgs)
        if key in inputs and not isinstance(inputs[key], dict | list):
            message += f" (got {_describe(inputs[key])})"
        problems.append(
            Problem(origin.file if origin else file, origin.line if origin else None, key, message)
        )
    return sorted(problems, key=lambda p: (p.file != SET_ORIGIN, p.file or "", p.line or 0, p.key))


def validate(data: Mapping[str, Any], origins: Mapping[str, Origin], file: str | None) -> Profile:
    """Validate merged data into a `Profile`, raising `ProfileError` with every problem."""
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(validation_problems(exc, data, origins, file)) from None


# ---- entry points --------------------------------------------------------------------------------


def load_profile_text(
    text: str, path: str | os.PathLike[str] | None = None, sets: Iterable[tuple[str, Any] | str] = ()
) -> LoadedProfile:
    """Load a profile from ``text`` as if it were the file ``path`` (for relative ``extends``)."""
    file = os.fspath(path) if path is not None else "<profile>"
    seen = (os.path.realpath(file),) if path is not None else ()
    data, origins, files = _chain(text, file, seen)
    try:
        data, origins = apply_sets(data, origins, sets)
    except ValueError as exc:
        raise ProfileError(Problem(SET_ORIGIN, None, "", str(exc))) from None
    profile = validate(data, origins, file)
    return LoadedProfile(
        profile=profile,
        origins=types.MappingProxyType(origins),
        path=os.fspath(path) if path is not None else None,
        files=files,
        raw=types.MappingProxyType(data),
    )


def load_profile(path: str | os.PathLike[str], sets: Iterable[tuple[str, Any] | str] = ()) -> LoadedProfile:
    """Load the profile file ``path`` with its ``extends`` chain and ``--set`` overrides."""
    file = os.fspath(path)
    return load_profile_text(_read(file, None, ""), file, sets)
