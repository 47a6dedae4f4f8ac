"""`strata gguf PROFILE OUT.gguf`: the profile's model written as GGUF, for llama.cpp.

The profile is resolved here (with ``--set`` overrides) and handed to ``python -m strata_runtime gguf``,
which builds the model's weights as the engine would (a synthetic preset is generated, a checkpoint read)
and writes them in llama.cpp's ``qwen3moe`` layout (`strata_runtime.bench.gguf_export`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launch.engine_process import exec_runtime
from ..schema.errors import ProfileError
from ._common import add_resolve_options, refused, resolve_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile TOML file")
    parser.add_argument("out", type=Path, help="the GGUF file to write (refused if it exists)")
    add_resolve_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.out.exists():
        print(f"strata gguf: {args.out} exists; remove it or name another file", file=sys.stderr)
        return 2
    try:
        plan = resolve_args(args).plan
    except ProfileError as exc:
        return refused(exc)
    exec_runtime("gguf", plan, ["--out", str(args.out)])
