"""`strata bench PROFILE --workload W [--arms ...]`: the bench harness over arms of one profile.

The workloads and arms are described in docs/PERFORMANCE.md.

Each arm is the profile plus ``--set`` overrides, resolved here like any profile. An arm the resolver
refuses is reported and skipped; an arm a rule changed (so it does not run what its name says) is run and
reported as forced, with the rule's sentence. The plans go to ``python -m strata_runtime bench``, which runs
the arms interleaved in one engine process and prints the table (or ``--json``).

With ``--url`` it measures a launched engine over HTTP instead, as its clients see it
(`strata_cfg.bench`): the same workloads and figures, for the one plan that engine runs.

``prompt`` reads one prompt of ``--prompt-tokens`` alone on the engine (arms: ``serial`` unless given; over
``--url``, its read rate and time to first token). ``turns`` sends one conversation, each turn everything
sent before and a new message, so that it measures prefix reuse (``--vary memory.prefix_reuse=true,false``);
``shared`` sends four requests with the same context at once, so that it measures a prefix copied between
slots; ``conversations`` sends one conversation more than the arms (or over ``--url``, the strata servers)
have slots, taking turns, so that it measures the prefix store (``--vary memory.prefix_store_mib=0,512``).
``step`` (the decode kernels against the byte roofline),
``vram`` (what the engine holds against the plan's budget) and ``handoff`` (the copies between two stages'
GPUs) measure the profile's own plan on its GPUs, without arms. These three run in process only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..bench.arms import ARMS, DEFAULT_ARMS, SEEDED_NOTE, arm_note
from ..launch.engine_process import runtime_argv
from ..profile.overrides import SET_ORIGIN, parse_set
from ..schema.errors import ProfileError
from ..schema.plan_file import write_plan
from ..schema.sampling_options import (
    add_json_arguments,
    add_sampling_arguments,
    json_schema_of,
    sampling_options,
    shape_problem,
    shaped,
    structured_outputs,
)
from ..schema.workloads import (
    CONTEXT_WORKLOADS,
    GPU_WORKLOADS,
    HTTP_WORKLOADS,
    PEERS,
    STEP_VARY_KEYS,
    WORKLOADS,
    bench_option_problem,
    context_problem,
    depth_problem,
)
from ._common import (
    EXIT_REFUSED,
    EXIT_USAGE,
    add_profile_argument,
    add_resolve_options,
    refused,
    resolve_args,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_argument(parser)
    add_resolve_options(parser)
    parser.add_argument("--workload", choices=WORKLOADS, default="two-decodes")
    parser.add_argument(
        "--arms",
        help=f"comma-separated arms of {', '.join(ARMS)} (default: {', '.join(DEFAULT_ARMS)}; for prompt "
        "turns, shared and conversations: serial; step, vram and handoff take no arms)",
    )
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        type=_vary_item,
        metavar="KEY=V1,V2,...",
        help="run each arm once per value of KEY, interleaved (--vary spec.draft_tokens=2,3,4 runs "
        "solo@draft_tokens:2, ...); repeat --vary for more variants; a value with brackets or quotes is one "
        "TOML value; --workload step takes only model.decode_attention, and times each value's kernel in "
        "one model",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per arm (default 3)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per request (default 300)")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=4096,
        help="prompt: the prompt's length; it and one generated token must fit memory.context; turns: the "
        "conversation's first context, before its messages; shared: the context every request begins with; "
        "conversations: each conversation's first context (default 4096)",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=0,
        metavar="N",
        help="solo, two-decodes and clients: each decoding request first reads a prompt of N fresh token "
        "ids, so its tokens decode from KV N positions deep, as llama-bench's -d N (and the llama.cpp peer "
        "runs so); step: the rows' KV position (default 0: the short prompts, and position 300 for step)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_sampling_arguments(parser, seeded="its index")
    add_json_arguments(parser)
    parser.add_argument(
        "--unseeded",
        action="store_true",
        help="with --temperature: send sampled requests without a seed, as most API clients do (their text "
        "then differs from run to run, and a request alone may draft at the depth spec.adaptive_depth "
        "chooses)",
    )
    parser.add_argument(
        "--cold-experts",
        action="store_true",
        help="where experts do not all fit: start every repeat from the expert cache's first contents (by "
        "default warm-up requests on other prompts settle the cache first, as a server's has settled)",
    )
    parser.add_argument(
        "--cold-drafting",
        action="store_true",
        help="start every repeat's drafting from no estimate of how often proposals hold, as a fresh "
        "server's first request does (by default a warm-up request on other text teaches it first, as "
        "earlier requests teach a server)",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=PEERS,
        help="also run a peer on the same weights: transformers' generate (needs torch and transformers; one "
        "stage), or llama.cpp's llama-bench / llama-batched-bench from PATH on the model written as GGUF, "
        "and llama-server for a case whose tool is missing (needs the gguf package; skipped in one line "
        "without any of them)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        metavar="PATH",
        help="llama.cpp peer: the GGUF file to run, written there from the model unless it exists "
        "(default: a temporary file)",
    )
    parser.add_argument(
        "--windows",
        type=Path,
        metavar="PATH",
        help="also write every window the arms ran to PATH, one JSON object a line: arm, case, repeat, the "
        "window's place in the run, kind, rows, ms, tokens, proposals and how many held, rows the drafting "
        "heads caught up on for it, and the host's ms drafting it before launch and finishing it (not with "
        "--url, nor the step, vram and handoff workloads)",
    )
    parser.add_argument(
        "--run-dir", type=Path, help="where the arms' plans are written (default: a temp dir)"
    )
    parser.add_argument(
        "--url",
        action="append",
        default=[],
        type=_url_item,
        metavar="[NAME=]URL",
        help="measure a launched engine over HTTP (strata launch, or any OpenAI-compatible server such as "
        "llama-server or vLLM) instead of arms in process; repeat --url to measure several interleaved, "
        "each against the first; an engine runs its one plan, so --arms does not apply",
    )
    parser.add_argument("--api-key-env", help="with --url: the variable holding the engine's API key")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="with --url: ask every server to generate past end-of-text, so every reply is --tokens long "
        "(the ignore_eos extension strata, vLLM and llama.cpp's server take)",
    )


def _url_item(text: str) -> tuple[str, str]:
    """``NAME=URL`` or a bare URL (named by its host and port)."""
    name, sep, url = text.partition("=")
    if not sep or "/" in name or ":" in name:
        name, url = "", text
    if not url.startswith("http://"):
        raise argparse.ArgumentTypeError(f"expected [NAME=]http://HOST:PORT, got {text!r}")
    return name or url.removeprefix("http://").split("/", 1)[0], url


def run_url(args: argparse.Namespace) -> int:
    """The workload against launched engines, through the HTTP driver."""
    import json
    import os

    from ..bench.http_workloads import bench_lines, bench_url, bench_urls

    urls = dict(args.url)
    if len(urls) < len(args.url):
        print("strata bench: two --url share a name; name them NAME=URL", file=sys.stderr)
        return EXIT_USAGE
    key = os.environ.get(args.api_key_env) if args.api_key_env else None

    def progress(name: str, case: str, repeat: int, figures: dict[str, float]) -> None:
        who = f" {name:>10}" if len(urls) > 1 else ""
        print(f"  repeat {repeat + 1} {case:>14}{who}: {figures['tok_s']:9.1f} tok/s", file=sys.stderr)

    try:
        kw: dict[str, Any] = dict(
            tokens=args.tokens,
            repeats=args.repeats,
            api_key=key,
            sampling=sampling_options(args),
            prompt_tokens=args.prompt_tokens,
            depth=args.depth,
            seeded=not args.unseeded,
            ignore_eos=args.ignore_eos,
            shape=structured_outputs(args),
            on_run=progress,
        )
        if len(urls) == 1:
            result = bench_url(next(iter(urls.values())), args.workload, **kw)
        else:
            result = bench_urls(urls, args.workload, **kw)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"strata bench: {', '.join(urls.values())}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps(result, indent=2) if args.json else "\n".join(bench_lines(result)))
    return 0


def usage_problem(args: argparse.Namespace) -> str | None:
    """A combination of options the workload cannot run with."""
    if args.url and args.workload not in HTTP_WORKLOADS:
        return (
            f"--workload {args.workload} runs in the engine's own process (it needs the plan and the GPU), "
            f"not over --url; over HTTP: {', '.join(HTTP_WORKLOADS)}"
        )
    if args.ignore_eos and not args.url:
        return "--ignore-eos asks launched servers (--url); the in-process arms stop at end-of-text"
    if args.url and (args.arms or args.peer or args.vary or args.sets or args.profile):
        return (
            "--url measures launched servers as they run: a profile, --set, --arms, --vary and --peer do not "
            "apply (to compare with another server, give it as one more --url NAME=URL)"
        )
    if args.url and (args.cold_experts or args.cold_drafting):
        flag = "--cold-experts" if args.cold_experts else "--cold-drafting"
        return (
            "--url measures launched servers as they run, their expert caches and what their drafting has "
            f"learned as they are: {flag} does not apply"
        )
    if args.workload in GPU_WORKLOADS:
        step = args.workload == "step"
        if args.arms or args.peer or (args.vary and not step):
            what = "--arms and --peer" if step else "--arms, --vary and --peer"
            also = f"; --vary {'/'.join(STEP_VARY_KEYS)}=V1,V2 compares its kernels" if step else ""
            return (
                f"--workload {args.workload} measures the profile's own plan: {what} do not apply (--set "
                f"changes the plan{also})"
            )
        keys = sorted({key for item in args.vary for key, _ in item} - set(STEP_VARY_KEYS))
        if keys:
            return (
                f"--workload step varies only {', '.join(STEP_VARY_KEYS)}, which it switches in one model on "
                f"the same weights, not {', '.join(keys)} (--set changes the plan)"
            )
    if args.windows is not None and (args.url or args.workload in GPU_WORKLOADS):
        where = "over --url (a launched engine lists its last windows in /v1/status)"
        if not args.url:
            where = f"of --workload {args.workload}, which runs no requests"
        return f"--windows lists the windows of arms run in process, not {where}"
    problem = bench_option_problem(args) or depth_problem(args.workload, args.depth, args.tokens, None)
    if problem:
        return problem
    if shaped(args):
        where = "by a --peer" if args.peer else ""
        if not where and args.workload in GPU_WORKLOADS:
            where = f"by --workload {args.workload}"
        if where:
            flags = "--json-schema, --json-object, --regex, --choice"
            return f"replies held to a shape ({flags}) are not measured {where}"
        problem = shape_problem(args)
        if problem is None and args.json_schema is not None:
            problem = json_schema_of(args.json_schema)[1]
        if problem:
            return problem
    if (args.temperature > 0 or args.presence_penalty or args.frequency_penalty) and args.peer:
        return (
            "--peer runs greedy decoding only: leave out --temperature and the penalties, or run the peer "
            "without them"
        )
    return None


def _vary_item(text: str) -> list[tuple[str, Any]]:
    try:
        return parse_vary(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_vary(item: str) -> list[tuple[str, Any]]:
    """``"spec.draft_tokens=2,3"`` -> ``[("spec.draft_tokens", 2), ("spec.draft_tokens", 3)]``: one variant
    per comma-separated value, each a TOML value as ``--set`` reads it; a value that opens with a bracket,
    a brace or a quote is one value (``split.layers=[20, 30]``)."""
    key, sep, text = item.partition("=")
    text = text.strip()
    if not sep:
        raise ValueError(
            f"--vary wants KEY=V1,V2,... with a dotted key (spec.draft_tokens=2,3), not {item!r}"
        )
    pieces = [text] if text[:1] in "[{\"'" else [p.strip() for p in text.split(",")]
    if not all(pieces):
        raise ValueError(f"--vary {key.strip()}: an empty value in {text!r}")
    try:
        return [parse_set(f"{key}={p}") for p in pieces]
    except ValueError as exc:
        raise ValueError(str(exc).replace("--set", "--vary", 1)) from None


def from_vary(exc: ProfileError, varied: list[tuple[str, Any]]) -> ProfileError:
    """``exc`` with each problem of a key that ``--vary`` set (``varied``) said to come from ``--vary``,
    not ``--set``, so that the message points at the value the user wrote there."""
    keys = {key for key, _ in varied}
    return ProfileError(
        [
            dataclasses.replace(p, file="--vary") if p.file == SET_ORIGIN and p.key in keys else p
            for p in exc.problems
        ]
    )


def variants(args: argparse.Namespace) -> list[tuple[str, list[tuple[str, Any]]]]:
    """Each variant's name suffix and overrides: ``@draft_tokens:2`` and ``[("spec.draft_tokens", 2)]``
    for each ``--vary`` value, or one unnamed variant without any."""
    out: list[tuple[str, list[tuple[str, Any]]]] = [
        (f"@{key.rsplit('.', 1)[-1]}:{_value_text(v)}", [(key, v)]) for item in args.vary for key, v in item
    ]
    return out or [("", [])]


def _value_text(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def arm_names(args: argparse.Namespace) -> list[str]:
    """The arms to run: as given, else ``serial`` for ``prompt`` and the workloads on a context
    (`CONTEXT_WORKLOADS`) and the default arms for the others."""
    if args.arms is not None:
        return [a.strip() for a in args.arms.split(",") if a.strip()]
    return (
        ["serial"] if args.workload == "prompt" or args.workload in CONTEXT_WORKLOADS else list(DEFAULT_ARMS)
    )


def run(args: argparse.Namespace) -> int:
    problem = usage_problem(args)
    if problem:
        print(f"strata bench: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.url:
        return run_url(args)
    if args.workload in GPU_WORKLOADS:
        return run_plan(args)
    names = arm_names(args)
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        print(f"strata bench: unknown arm(s) {unknown}; known: {', '.join(ARMS)}", file=sys.stderr)
        return EXIT_USAGE
    base_sets = list(args.sets)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="strata-bench-"))
    argv = bench_argv(args)
    ran = 0
    for arm, (suffix, varied) in itertools.product(names, variants(args)):
        name = arm + suffix
        args.sets = [*base_sets, *ARMS[arm], *varied]
        try:
            plan = resolve_args(args).plan
        except ProfileError as exc:
            print(f"strata bench: arm {name} refused:", file=sys.stderr)
            for p in from_vary(exc, varied).problems:
                print(f"  {p}", file=sys.stderr)
            continue
        problem = context_problem(
            args.workload, args.prompt_tokens, args.depth, args.tokens, plan.memory.context
        )
        if problem:
            print(f"strata bench: arm {name}: {problem}", file=sys.stderr)
            return EXIT_USAGE
        path = write_plan(plan, run_dir / f"{name}.json")
        argv += ["--arm", f"{name}={path}"]
        note = arm_note(arm, plan)
        if note is None and arm == "solo-adaptive" and args.temperature > 0 and not args.unseeded:
            note = SEEDED_NOTE
        if note:
            print(f"strata bench: arm {name} {note}", file=sys.stderr)
            argv += ["--note", f"{name}={note}"]
        ran += 1
    if not ran:
        return EXIT_REFUSED
    for peer in args.peer:
        argv += ["--peer", peer]
    if args.gguf is not None:
        argv += ["--gguf", str(args.gguf)]
    if args.windows is not None:
        argv += ["--windows", str(args.windows.resolve())]
    return subprocess.run(argv, check=False).returncode


def bench_argv(args: argparse.Namespace) -> list[str]:
    """``python -m strata_runtime bench`` with the workload's options, before the arms."""
    argv = runtime_argv("bench", "--workload", args.workload)
    argv += ["--repeats", str(args.repeats), "--tokens", str(args.tokens)]
    argv += ["--prompt-tokens", str(args.prompt_tokens)]
    if args.depth:
        argv += ["--position" if args.workload == "step" else "--depth", str(args.depth)]
    argv += ["--temperature", repr(args.temperature), "--top-p", repr(args.top_p), "--top-k", str(args.top_k)]
    argv += [
        "--presence-penalty",
        repr(args.presence_penalty),
        "--frequency-penalty",
        repr(args.frequency_penalty),
        "--min-p",
        repr(args.min_p),
        "--repetition-penalty",
        repr(args.repetition_penalty),
    ]
    argv += ["--unseeded"] if args.unseeded else []
    argv += ["--json-schema", str(Path(args.json_schema).resolve())] if args.json_schema is not None else []
    argv += ["--json-object"] if args.json_object else []
    argv += ["--regex", args.regex] if args.regex is not None else []
    argv += [a for text in args.choice or [] for a in ("--choice", text)]
    argv += ["--cold-experts"] if args.cold_experts else []
    argv += ["--cold-drafting"] if args.cold_drafting else []
    return argv + (["--json"] if args.json else [])


def run_plan(args: argparse.Namespace) -> int:
    """``step``, ``vram`` or ``handoff``: the profile's plan as resolved, in the runtime, which refuses where
    no GPU is; ``step`` with ``--vary`` (`STEP_VARY_KEYS`) one plan per value, ``profile@KEY:VALUE``."""
    base_sets = list(args.sets)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="strata-bench-"))
    argv = bench_argv(args)
    for suffix, varied in variants(args):
        args.sets = [*base_sets, *varied]
        try:
            plan = resolve_args(args).plan
        except ProfileError as exc:
            return refused(from_vary(exc, varied))
        problem = depth_problem(args.workload, args.depth, args.tokens, plan.memory.context)
        if problem:
            print(f"strata bench: {problem}", file=sys.stderr)
            return EXIT_USAGE
        name = f"profile{suffix}"
        argv += ["--arm", f"{name}={write_plan(plan, run_dir / f'{name}.json')}"]
    return subprocess.run(argv, check=False).returncode
