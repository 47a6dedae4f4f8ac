"""`strata generate (PROFILE | --model DIR) ...`: resolve, then run one request in the engine process.

The profile is resolved here (with ``--set`` overrides), written as a plan, and handed to
``python -m strata_runtime generate``, which replaces this process. ``--model DIR`` resolves a minimal
profile for a model directory: the GPUs nvidia-smi finds, or one virtual CPU device when there is none.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..launch.engine_process import exec_runtime
from ..plan.from_profile import resolve_text
from ..schema.errors import ProfileError
from ..schema.plan import LaunchPlan
from ..schema.sampling_options import (
    add_generate_arguments,
    generation_problem,
    json_schema_of,
    logprobs_problem,
    options_problem,
    sampling_options,
    shape_problem,
)
from ._common import EXIT_USAGE, add_resolve_options, refused, resolve_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "profile", nargs="?", default=None, help="profile TOML file (default: the demo profile)"
    )
    parser.add_argument("--model", type=Path, help="a model directory instead of a profile")
    add_resolve_options(parser)
    add_generate_arguments(parser, None, "print token_ids, text and accepted_proposals")


def model_profile_text(directory: Path) -> str:
    """A one-shot profile for a model directory on this machine."""
    cpu = '{ name = "virtual CPU device", vram_mib = 262144, bandwidth_gbs = 20 }'
    machine = "probe = true" if shutil.which("nvidia-smi") else f'backend = "cpu"\ngpus = [{cpu}]'

    name = json.dumps(directory.resolve().name or "model")
    return (
        f"name = {name}\n\n[machine]\n{machine}\n\n[model]\npath = {json.dumps(str(directory.resolve()))}\n"
    )


def runtime_args(args: argparse.Namespace) -> list[str]:
    """The runtime command's own options, passed through."""
    out = ["--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    if args.prompt_ids is not None:
        out += ["--prompt-ids", args.prompt_ids]
    elif args.prompt is not None:
        out += ["--prompt", args.prompt]
    for key, value in sampling_options(args).items():  # the temperature, top-p, top-k and penalties
        out += ["--" + key.replace("_", "-"), repr(value)]
    for s in args.stop:
        out += ["--stop", s]
    for word in args.bad_word:
        out += ["--bad-word", word]
    if args.logprobs is not None:
        out += ["--logprobs", str(args.logprobs)]
    if args.json_schema is not None:
        out += ["--json-schema", str(Path(args.json_schema).resolve())]
    if args.regex is not None:
        out += ["--regex", args.regex]
    for text in args.choice or []:
        out += ["--choice", text]
    out += [
        flag
        for flag, on in (
            ("--chat", args.chat),
            ("--json", args.json),
            ("--quiet", args.quiet),
            ("--ignore-eos", args.ignore_eos),
            ("--json-object", args.json_object),
        )
        if on
    ]
    return out


def run(args: argparse.Namespace) -> int:
    if args.model is not None and args.profile is not None:
        print("strata generate: give a PROFILE or --model DIR, not both")
        return EXIT_USAGE
    problem = (
        generation_problem(args.max_tokens, args.seed, args.stop, args.bad_word)
        or options_problem(args)
        or logprobs_problem(args.logprobs)
        or (None if args.json_schema is None else json_schema_of(args.json_schema)[1])
        or shape_problem(args)
    )
    if problem:
        print(f"strata generate: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        plan = plan_of(args)
    except ProfileError as exc:
        return refused(exc, as_json=args.json)
    exec_runtime("generate", plan, runtime_args(args))


def plan_of(args: argparse.Namespace) -> LaunchPlan:
    """The plan of the command's PROFILE (with its ``--set`` overrides), or of a minimal profile for
    ``--model DIR``. Raises `ProfileError`."""
    if args.model is not None:
        return resolve_text(model_profile_text(args.model), None, args.sets, strict=args.strict).plan
    return resolve_args(args).plan
