"""One profile file: its text, read with errors that name who referred to it, and parsed with the origin
(file and line) of every key it writes."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

from ..schema.errors import Problem, ProfileError
from ..schema.plan import Origin
from .toml_lines import key_lines

_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


def parse_toml(text: str, file: str) -> tuple[dict[str, Any], dict[str, Origin]]:
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


def display_path(base_display: str, relative: str) -> str:
    """Name a file the way the user would: relative to the one that referred to it."""
    if os.path.isabs(relative):
        return relative
    return os.path.normpath(os.path.join(os.path.dirname(base_display), relative))


def read_text(path: str, referrer: Origin | None, key: str) -> str:
    """The text of profile file ``path``; a file that cannot be read is a problem at ``referrer``'s
    ``key`` (the ``extends`` line that named it), or at the file itself when nothing referred to it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        where = referrer or Origin(file=path)
        raise ProfileError(Problem(where.file, where.line, key, f"no such profile file: {path}")) from None
    except (OSError, UnicodeDecodeError) as exc:
        where = referrer or Origin(file=path)
        raise ProfileError(Problem(where.file, where.line, key, f"cannot read {path}: {exc}")) from None
