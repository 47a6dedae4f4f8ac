"""`python -m strata_runtime gguf --plan plan.json --out model.gguf`: the plan's model as a GGUF file.

The weights are the engine's own (an engine of the plan is built, so a synthetic preset is generated exactly
as it would be served), written by `strata_runtime.bench.gguf_export`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata_cfg.schema.plan_file import read_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, type=Path, help="a resolved plan (strata plan --json)")
    parser.add_argument("--out", required=True, type=Path, help="the GGUF file to write")


def run(args: argparse.Namespace) -> int:
    from ..api import PlanMismatch
    from ..bench.gguf_export import ExportError, fingerprint, vocabulary_of, write_model
    from ..engine import Engine
    from ..model.placed import WeightStore
    from ..weights.progress import stderr_progress

    plan = read_plan(args.plan)
    weights = WeightStore()
    try:
        Engine(plan, progress=stderr_progress, weights=weights)
        size = write_model(args.out, plan, weights, progress=stderr_progress)
    except (ExportError, PlanMismatch, OSError, ValueError) as exc:
        args.out.unlink(missing_ok=True)
        print(f"strata_runtime gguf: {exc}", file=sys.stderr)
        return 1
    vocabulary = {
        "bytes": "the engine's byte-level vocabulary (llama.cpp reads and writes its ids and text)",
        "none": "no vocabulary (its size only: enough for llama-bench; convert the checkpoint with "
        "llama.cpp's converter to serve it there)",
    }[vocabulary_of(plan)]
    print(f"{args.out}: {plan.model.label()} as llama.cpp's qwen3moe, {size / 2**20:,.1f} MiB of tensors")
    print(f"  with {vocabulary}")
    print(f"  weights {fingerprint(plan)}: `strata bench --gguf` reuses the file for these weights only")
    return 0
