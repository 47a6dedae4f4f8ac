"""Validation: merged TOML data -> `Profile`, or one `Problem` per offending key that speaks TOML.

Each problem names the file and line the key was written on, the dotted key, what was expected (in the
words of a profile, not pydantic's), and a did-you-mean for an unknown key.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin, find_origin
from ..schema.profile import Profile
from .overrides import SET_ORIGIN

_DEVICE_EXPECTED = 'expected a GPU index or "host:index"'


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
    """A value as TOML writes it (``true``, ``"2"``, ``8000.0``), cut to 40 characters."""
    if isinstance(value, bool):
        return "true" if value else "false"
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
