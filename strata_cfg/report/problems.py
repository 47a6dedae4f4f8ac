"""A refused profile's problems, for people (one per line) and for programs (the JSON contract)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..schema.errors import Problem


def problems_text(problems: Iterable[Problem]) -> str:
    """Problems one per line: ``file:line: key: message [rule]``."""
    return "\n".join(str(p) + (f"  [{p.rule}]" if p.rule else "") for p in problems) + "\n"


def problems_json(problems: Iterable[Problem]) -> dict[str, Any]:
    """The JSON a refused profile prints: ``{"errors": [{file, line, key, message}, ...]}``."""
    return {"errors": [p.to_json() for p in problems]}
