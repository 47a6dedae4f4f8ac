"""`strata schema`: the profile JSON Schema, for editors that complete and check TOML.

Profiles point at it with a first line ``#:schema ./strata-profile.schema.json`` (taplo / Even Better TOML).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..schema.profile import Profile

SCHEMA_ID = "https://strata.invalid/strata-profile.schema.json"


def _without_null(node: Any) -> Any:
    """Drop pydantic's ``null`` alternatives: TOML has no null, an unset key is simply absent."""
    if isinstance(node, list):
        return [_without_null(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _without_null(v) for k, v in node.items() if not (k == "default" and v is None)}
    any_of = out.get("anyOf")
    if isinstance(any_of, list):
        kept = [n for n in any_of if n != {"type": "null"}]
        if len(kept) == 1:
            del out["anyOf"]
            out = {**kept[0], **out}
        else:
            out["anyOf"] = kept
    return out


def profile_json_schema() -> dict[str, Any]:
    """The JSON Schema of a profile file, with every field's docstring as its description."""
    schema = _without_null(Profile.model_json_schema())
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def schema_text() -> str:
    """The schema as `strata schema` prints it (stable key order, trailing newline)."""
    return json.dumps(profile_json_schema(), indent=2, ensure_ascii=False) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", type=Path, help="write the schema to this file instead of stdout")


def run(args: argparse.Namespace) -> int:
    text = schema_text()
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0
