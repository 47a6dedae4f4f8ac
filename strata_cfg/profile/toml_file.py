"""One profile file: its text, read with errors that name who referred to it, and parsed with the origin
(file and line) of every key it writes.

Every read is bounded: a profile is a regular file of at most `MAX_PROFILE_BYTES`, and its arrays and tables
nest at most `MAX_NESTING` levels, so no input can hang the loader or exhaust its stack.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

from ..schema.bounded_read import read_bounded
from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin
from .toml_lines import index_keys

MAX_PROFILE_BYTES = 1 << 20
"""A profile is a small text file; anything larger is refused before it is parsed."""
MAX_NESTING = 16
"""Tables and arrays nest at most this deep (a profile needs four: ``machine.gpus.0.name``)."""

_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


def _too_deep(file: str, line: int | None, key: str = "") -> ProfileError:
    return ProfileError(
        Problem(file, line, key, f"not a profile: tables or arrays nested more than {MAX_NESTING} deep")
    )


def parse_toml(text: str, file: str) -> tuple[dict[str, Any], dict[str, Origin]]:
    """TOML text -> (data, origins of every key written in it)."""
    lines, deep = index_keys(text, MAX_NESTING)
    if deep is not None:
        raise _too_deep(file, deep)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = _TOML_POS.search(msg)
        line = int(m.group(1)) if m else None
        message = _TOML_POS.sub("", msg).strip()
        raise ProfileError(Problem(file, line, "", f"not valid TOML: {message}")) from None
    except RecursionError:  # nesting the line scanner could not follow
        raise _too_deep(file, None) from None
    path = _deep_path(data, MAX_NESTING)
    if path is not None:  # deep dotted keys or table headers
        key = ".".join(path)
        raise _too_deep(file, lines.get(key), key)
    origins = {k: Origin(file=file, line=n) for k, n in lines.items()}
    return data, origins


def _deep_path(data: Mapping[str, Any], limit: int) -> list[str] | None:
    """The path of the first value nested deeper than ``limit`` tables and arrays (walked without
    recursion), else None."""
    stack: list[tuple[list[str], Any]] = [([], data)]
    while stack:
        path, node = stack.pop()
        if len(path) > limit:
            return path
        if isinstance(node, dict):
            stack += [([*path, str(k)], v) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [([*path, str(i)], v) for i, v in enumerate(node)]
    return None


def display_path(base_display: str, relative: str) -> str:
    """Name a file the way the user would: relative to the one that referred to it."""
    if os.path.isabs(relative):
        return relative
    return os.path.normpath(os.path.join(os.path.dirname(base_display), relative))


def read_text(path: str, referrer: Origin | None, key: str) -> str:
    """The text of profile file ``path``; a file that cannot be read is a problem at ``referrer``'s
    ``key`` (the ``extends`` line that named it), or at the file itself when nothing referred to it.

    Only a regular file of at most `MAX_PROFILE_BYTES` is read: ``/dev/zero`` would never end, and a FIFO
    would wait for a writer."""
    where = referrer or Origin(file=path)
    try:
        return read_bounded(path, MAX_PROFILE_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ProfileError(Problem(where.file, where.line, key, f"no such profile file: {path}")) from None
    except UnicodeDecodeError as exc:
        raise ProfileError(
            Problem(where.file, where.line, key, f"cannot read {path}: not UTF-8 text ({exc.reason})")
        ) from None
    except (OSError, ValueError) as exc:
        raise ProfileError(Problem(where.file, where.line, key, f"cannot read {path}: {exc}")) from None
