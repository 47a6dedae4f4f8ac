"""`python -m strata_runtime bench --arm NAME=plan.json ... --workload W`: the bench harness in process.

`strata bench PROFILE` resolves one plan per arm and starts this command with them. Arms that share a stage
layout share one copy of the weights. The table (or ``--json``) gives medians over the repeats, the gain
over ``serial`` with a bootstrap 95% interval, and whether each arm's greedy tokens equal ``serial``'s.

On a GPU the figures come with their ceiling, measured in the same run before the engines are built: ``solo``
and ``two-decodes`` against the one-row byte roofline (copy bandwidth), ``prompt`` against the fp16 matrix
rate (`strata_runtime.bench.ceilings`). ``step``, ``vram`` and ``handoff`` take one plan and build no arms.

Every arm is warmed before the first measured repeat: it reads a prompt of two chunks and decodes as many
streams at once as the workload will, then captures every decode window shape those did not, so that no
repeat pays for compiling kernels or capturing graphs. Where experts do not all fit and the expert cache
adapts, warm-up requests on other prompts then settle the cache (`settle`), and every repeat starts from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.plan_file import read_plan
from strata_cfg.schema.sampling_options import (
    add_json_arguments,
    add_sampling_arguments,
    describe_sampling,
    sampling_options,
    shape_words,
)
from strata_cfg.schema.workloads import (
    CLIENT_COUNTS,
    CONTEXT_WORKLOADS,
    GPU_WORKLOADS,
    PEERS,
    WORKLOADS,
    bench_option_problem,
    context_problem,
)

from ..api import SamplingParams
from ..backend import Device
from ..bench.harness import (
    Arm,
    ArmRuns,
    Taught,
    adaptive_caches,
    cuda_devices,
    driver_for,
    mean_prompt_tokens,
    references,
    run_bench,
    summarise,
)
from ..bench.preparing import WARM_STREAMS, settle, settling_line, taught_line, teach, warm_up
from ..bench.table import render_table
from ..bench.versus_ceilings import ceiling_report, measure_rates
from ..model.placed import WeightStore, plan_tokenizer
from .generate import grammar_of_options

if TYPE_CHECKING:
    pass

EXIT_REFUSED = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arm", action="append", required=True, metavar="NAME=PLAN", help="an arm and its plan"
    )
    parser.add_argument(
        "--note", action="append", default=[], metavar="NAME=TEXT", help="a note shown with an arm"
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="two-decodes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=300, help="tokens generated per request (default 300)")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=4096,
        help="prompt: the prompt's length in tokens; turns: the conversation's first context; shared: the "
        "context every request begins with (default 4096)",
    )
    parser.add_argument(
        "--position", type=int, default=300, help="step: the KV position the rows decode at (default 300)"
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=0,
        help="solo, two-decodes, clients: each decoding request first reads a prompt of this many fresh "
        "token ids (default 0: a short text prompt)",
    )
    parser.add_argument("--json", action="store_true")
    add_sampling_arguments(parser, seeded="its index")
    add_json_arguments(parser)
    parser.add_argument("--unseeded", action="store_true", help="sampled requests carry no seed")
    parser.add_argument(
        "--cold-experts",
        action="store_true",
        help="start every repeat from the expert caches' first contents instead of from caches settled on "
        "warm-up requests",
    )
    parser.add_argument(
        "--cold-drafting",
        action="store_true",
        help="start every repeat's drafting from no estimate of how often proposals hold, as a fresh "
        "server's first request does, instead of from what a warm-up request on other text taught",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=PEERS,
        help="also run a peer engine on the same weights (transformers: one GPU, one stage; llama.cpp: its "
        "llama-bench and llama-batched-bench from PATH on the model written as GGUF, llama-server for a "
        "case whose tool is missing, skipped without any of them)",
    )
    parser.add_argument(
        "--gguf",
        metavar="PATH",
        help="llama.cpp peer: the GGUF file it runs, written there from the plan's model unless it exists "
        "(default: a temporary file, removed afterwards)",
    )
    parser.add_argument(
        "--windows",
        metavar="PATH",
        help="also write every window the arms ran, repeat by repeat, to PATH as JSON Lines",
    )


def open_trace(path: str | None) -> TextIO | None:
    """``--windows``' file, opened for writing before anything runs, so that a path that cannot be written
    is refused at once rather than after the run."""
    if path is None:
        return None
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed once the run has written it
    except OSError as exc:
        raise SystemExit(f"bench: --windows {path}: {exc.strerror or exc}") from exc


def write_window_records(out: TextIO, runs: dict[str, ArmRuns]) -> None:
    """Every window of every arm's runs, one JSON object a line, in the order each repeat ran them: the
    arm, the case and the repeat (from 1), then `window_records`' fields."""
    for name, arm in runs.items():
        for case, repeats in arm.records.items():
            for r, records in enumerate(repeats):
                for w in records:
                    out.write(json.dumps({"arm": name, "case": case, "repeat": r + 1, **w}) + "\n")


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--{what}: expected NAME=VALUE, got {item!r}")
        out.setdefault(name, "")
        out[name] = (out[name] + "; " + value) if out[name] else value
    return out


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Every request's sampling, from the bench's options (each request gets its own seed)."""
    return SamplingParams(**sampling_options(args))


def run(args: argparse.Namespace) -> int:
    from ..engine import Engine
    from ..weights.progress import stderr_progress

    problem = bench_option_problem(args)
    if problem:
        raise SystemExit(f"bench: {problem}")
    grammar, problem = grammar_of_options(args)
    if problem:
        raise SystemExit(f"bench: {problem}")
    sampling = dataclasses.replace(sampling_params(args), grammar=grammar)
    trace = open_trace(args.windows)
    arms = _pairs(args.arm, "arm")
    notes = _pairs(args.note, "note")
    plans = {name: read_plan(path) for name, path in arms.items()}
    if args.workload in GPU_WORKLOADS:
        return run_gpu_workload(args, plans)
    for name, plan in plans.items():
        problem = context_problem(
            args.workload, args.prompt_tokens, args.depth, args.tokens, plan.memory.context
        )
        if problem:
            print(f"strata bench: arm {name}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    rates = measure_rates(args.workload, plans)
    ran: dict[str, Any] = {}
    if "llama.cpp" in args.peer:  # where its file is ready, llama.cpp runs first, on a GPU nothing else holds
        ran = llama_cpp_peer(
            args, plans, peer_prompt(args, plans, plan_tokenizer(next(iter(plans.values()))))
        )
    weights = WeightStore()
    engines = {name: Engine(plan, progress=stderr_progress, weights=weights) for name, plan in plans.items()}
    report_engines(engines)
    startup = {name: engine.startup for name, engine in engines.items()}  # a peer may release the engines
    context = min(p.memory.context for p in plans.values())
    contenders: dict[str, Arm] = dict(engines)
    if args.peer:
        from ..bench.peer import make_peer

        first = next(iter(plans))
        for peer in (p for p in args.peer if p != "llama.cpp"):
            contenders[peer] = make_peer(peer, plans[first], engines[first].tokenizer, weights)
            print(
                f"[{peer}] peer arm on the weights of arm {first!r}, shared through DLPack", file=sys.stderr
            )

    def progress(arm: str, case: str, r: int, fig: dict[str, float]) -> None:
        print(f"  repeat {r + 1} {case:>14} {arm:>10}: {fig['tok_s']:9.1f} tok/s", file=sys.stderr)

    vocab = next(iter(plans.values())).model.facts.vocab_size
    # Two prefill chunks take the long-prompt path as a long prompt does, at a fraction of its cost.
    chunk = max(p.memory.prefill_chunk for p in plans.values())
    long_prompt = args.workload == "prompt" or args.workload in CONTEXT_WORKLOADS
    length = min(args.prompt_tokens, 2 * chunk) if long_prompt else 2 * chunk
    warm_up(engines, min(length, context - 2), vocab, streams=WARM_STREAMS.get(args.workload, 0))
    tokenizer = next(iter(engines.values())).tokenizer
    settling = {} if args.cold_experts else settle(engines, args.workload, args.tokens, tokenizer)
    slots = {n: sum(c.slots for c in adaptive_caches(engines[n])) for n in settling}
    for name, steps in settling.items():
        print(f"[{name}] {settling_line(steps, slots[name], args.tokens)}", file=sys.stderr)
    taught: dict[str, Taught] = {}
    if not args.cold_drafting:
        learned = teach(engines, args.workload, args.tokens, tokenizer, sampling, not args.unseeded)
        taught = {n: t for n, t in learned.items() if t is not None}
    for name, t in taught.items():
        print(f"[{name}] {taught_line(t, args.tokens)}", file=sys.stderr)
    runs = run_bench(
        contenders,
        args.workload,
        tokens=args.tokens,
        repeats=args.repeats,
        context=context,
        driver=driver_for,
        on_run=progress,
        prompt_tokens=args.prompt_tokens,
        vocab=vocab,
        sampling=sampling,
        seeded=not args.unseeded,
        depth=args.depth,
    )
    if trace is not None:
        with trace:
            write_window_records(trace, runs)
        print(f"strata bench: every window written to {args.windows}", file=sys.stderr)
    base = "serial" if "serial" in plans else next(iter(plans))
    refs = references(plans, base)
    summary = summarise(runs, base=base, compare_text=sampling.temperature <= 0, refs=refs)
    ceiling = ceiling_report(args.workload, plans, summary, rates, args, tokenizer)
    budgets = {
        name: {g.device: g.budget_mib for g in plan.gpus if g.role != "idle"} for name, plan in plans.items()
    }
    llama = None
    if "llama.cpp" in args.peer:
        if not ran:  # its file is written from the arms' weights, and it runs once they are closed
            release = functools.partial(release_devices, engines, contenders, weights)
            ran = llama_cpp_peer(args, plans, peer_prompt(args, plans, tokenizer), weights, release)
        llama = llama_cpp_figures(ran, plans, summary)
    if args.json:
        out = {
            "workload": args.workload,
            "repeats": args.repeats,
            "tokens": args.tokens,
            "sampling": sampling_options(args),
            "held_to": None if grammar is None else shape_words(args),
            "seeded": args.temperature > 0 and not args.unseeded,
            "base": base,
            "arms": {
                n: {
                    "plan": {
                        "mode": p.batch.mode,
                        "groups": p.batch.groups,
                        "batch_mtp": p.batch.mtp,
                        "mtp_in_groups": p.batch.mtp_in_groups,
                        "slots": p.batch.slots,
                        "draft_tokens": p.spec.draft_tokens,
                        "adaptive_depth": p.spec.adaptive_depth,
                        "draft_head": p.spec.draft_head,
                    },
                    "note": notes.get(n),
                    "startup": startup[n],
                    "budget_mib": budgets[n],
                    **summary[n],
                }
                for n, p in plans.items()
            },
            "peers": {peer: summary[peer] for peer in args.peer if peer in summary},
        }
        if args.workload == "prompt":
            out["prompt_tokens"] = args.prompt_tokens
        if args.depth:
            out["depth"] = args.depth
        if ceiling:
            out["ceiling"] = {k: v for k, v in ceiling.items() if k != "lines"}
        if llama is not None:
            out["peers"]["llama.cpp"] = llama["json"]
        out["settling"] = {n: [dataclasses.asdict(x) for x in steps] for n, steps in settling.items()}
        out["drafting_taught"] = {n: dataclasses.asdict(t) for n, t in taught.items()}
        print(json.dumps(out, indent=2))
    else:
        sampled = describe_sampling(sampling_options(args))
        if args.temperature > 0 and args.unseeded:
            sampled += ", unseeded"
        if grammar is not None:
            sampled += f", every reply held to {shape_words(args)}"
        print(
            render_table(
                args.workload, plans, summary, notes, args.repeats, args.tokens, sampled, base, args.depth
            )
        )
        if ceiling:
            print("\n" + "\n".join(ceiling["lines"]))
        if settling:
            lines = [f"{n}: {settling_line(steps, slots[n], args.tokens)}" for n, steps in settling.items()]
            print("\n" + "\n".join(lines))
        if taught:
            print("\n" + "\n".join(f"{n}: {taught_line(t, args.tokens)}" for n, t in taught.items()))
        if llama is not None and llama["lines"]:
            print("\n" + "\n".join(llama["lines"]))
    # A peer computes in other precision and order, so its text may drift; only the runtime's arms must agree.
    equal = all(
        case.get(f"text_equal_to_{refs[n]}") is not False for n in plans for case in summary[n].values()
    )
    return 0 if equal else 1


def peer_prompt(args: argparse.Namespace, plans: dict[str, LaunchPlan], tokenizer: Any) -> int:
    """The prompt each of a peer's decode streams reads first: our requests' mean, so that both decode from KV
    of the same length."""
    vocab = next(iter(plans.values())).model.facts.vocab_size
    context = min(p.memory.context for p in plans.values())
    return mean_prompt_tokens(
        args.workload, tokenizer, args.tokens, context, max(CLIENT_COUNTS), args.depth, vocab
    )


def report_engines(engines: dict[str, Any]) -> None:
    """Each arm's start-up lines, and the device memory its engine holds after loading."""
    for name, engine in engines.items():
        print(f"[{name}] " + " | ".join(engine.startup), file=sys.stderr)
        vram = [d.memory_used() for d in dict.fromkeys(s.device for s in engine.model.stages)]
        if any(v is not None for v in vram):
            print(
                f"[{name}] device memory in use after load (MiB): {[round(v / 2**20) for v in vram if v]}",
                file=sys.stderr,
            )


def release_devices(
    engines: dict[str, Any], contenders: dict[str, Any], weights: WeightStore
) -> dict[str, tuple[int, int]]:
    """Close the arms' engines and drop them, their peer arms and the weights they shared, and give every
    GPU's pooled memory back to the driver: a peer that loads the model itself (llama.cpp, in a process of
    its own) would not fit beside the runtime's copy of a model over half the GPU's memory. The arms have
    run by then, and everything printed after comes from their figures. Returns each GPU's (free, total)
    bytes after."""
    devices = {Device.parse(g.device) for e in engines.values() for g in e.plan.gpus if g.role != "idle"}
    contenders.clear()
    while engines:  # no name is left holding the last engine (a loop's would, and with it every weight)
        engines.popitem()[1].close()
    weights.stages.clear()
    gc.collect()  # engines hold reference cycles (stages, slots, flights)
    out: dict[str, tuple[int, int]] = {}
    for device in sorted(devices, key=str):
        device.release_memory()
        free = device.memory_free()
        if free is not None:
            out[str(device)] = free
            gib = f"{free[0] / 2**30:.1f} of {free[1] / 2**30:.1f} GiB"
            print(f"[llama.cpp] the arms are closed: {device} has {gib} free", file=sys.stderr)
    return out


def llama_cpp_peer(
    args: argparse.Namespace,
    plans: dict[str, LaunchPlan],
    stream_prompt: int,
    weights: WeightStore | None = None,
    release: Callable[[], dict[str, tuple[int, int]]] = dict,
) -> dict[str, Any]:
    """Run the llama.cpp peer for the first arm: {"peer": what it measured} or {"skipped": why} (printed to
    stderr). ``stream_prompt``: each of its decode streams' prompt length (our requests' mean).

    Without ``weights`` (before any arm is loaded) it runs only where its GGUF file exists and holds the
    plan's weights, and returns {} otherwise (it runs after the arms). With them it writes the file where
    it is missing, then ``release`` gives the runtime's device memory back before llama.cpp loads its own
    copy (`release_devices`)."""
    import tempfile

    from ..bench import llamacpp
    from ..bench.gguf_export import ExportError, kept_file, write_model

    plan = plans[next(iter(plans))]
    kept = kept_file(args.gguf, plan) if args.gguf is not None and Path(args.gguf).exists() else None
    if weights is None and not (kept is not None and kept[0]):
        return {}
    tools = llamacpp.find_tools()
    skipped = llamacpp.skip_reason(tools, args.workload)
    if skipped:
        print(f"[llama.cpp] {skipped}", file=sys.stderr)
        return {"skipped": skipped}
    try:
        placement = llamacpp.Placement.of_plan(plan)
    except ValueError as exc:
        print(f"[llama.cpp] skipped: {exc}", file=sys.stderr)
        return {"skipped": str(exc)}
    with tempfile.TemporaryDirectory(prefix="strata-gguf-") as tmp:
        path = args.gguf or str(Path(tmp) / f"{plan.profile}.gguf")
        if kept is not None:  # the file --gguf names
            usable, line = kept
            if not usable:
                print(f"[llama.cpp] skipped: {line}", file=sys.stderr)
                return {"skipped": line}
            when = "before the arms load" if weights is None else "after the arms"
            print(f"[llama.cpp] {line}; llama.cpp runs {when}", file=sys.stderr)
        else:
            assert weights is not None
            try:
                size = write_model(path, plan, weights)
            except ExportError as exc:
                print(f"[llama.cpp] skipped: {exc}", file=sys.stderr)
                return {"skipped": str(exc)}
            print(f"[llama.cpp] wrote {path} ({size / 2**20:,.1f} MiB of tensors)", file=sys.stderr)
        asked = llamacpp.Workload(
            args.workload,
            args.tokens,
            args.prompt_tokens,
            args.repeats,
            CLIENT_COUNTS,
            stream_prompt,
            placement,
            args.depth,
        )
        room = sum(free for free, _ in release().values())
        size = Path(path).stat().st_size
        if weights is not None and 0 < room < size:  # what llama.cpp would load could not fit
            again = f"--gguf {path}" if args.gguf else "--gguf FILE, after `strata gguf PROFILE FILE`"
            why = (
                f"skipped: with the arms closed the plan's GPUs have {room / 2**30:.1f} GiB free, less than "
                f"the model's {size / 2**30:.1f} GiB; run again with {again}: a ready file runs llama.cpp "
                "before the arms load"
            )
            print(f"[llama.cpp] {why}", file=sys.stderr)
            return {"skipped": why}
        return {"peer": llamacpp.run_peer(tools, path, asked)}


def llama_cpp_figures(
    ran: dict[str, Any], plans: dict[str, LaunchPlan], summary: dict[str, Any]
) -> dict[str, Any]:
    """What `llama_cpp_peer` ran, beside every arm's figures: lines and JSON."""
    from ..bench import llamacpp

    if "peer" not in ran:
        return {"lines": [], "json": {"skipped": ran["skipped"]}}
    peer, first = ran["peer"], next(iter(plans))
    figures = [{"case": f.case, "what": f.what, "tok_s": f.tok_s} for f in peer.figures]
    arms = {name: summary[name] for name in plans}
    return {
        "lines": llamacpp.render(peer, arms),
        "json": {
            "figures": figures,
            "commands": peer.commands,
            "notes": peer.notes,
            "beside": first,
            "ratios": llamacpp.ratios(peer, arms),
        },
    }


def run_gpu_workload(args: argparse.Namespace, plans: dict[str, LaunchPlan]) -> int:
    """``step``, ``vram`` or ``handoff`` on the first plan's GPUs, refused in one line where there are none.
    ``step`` also compares the decode attention of several plans (`strata_runtime.bench.step.run_step`)."""
    from ..backend import DeviceError

    plan = next(iter(plans.values()))
    try:
        devices = cuda_devices(plan, args.workload)
    except DeviceError as exc:
        print(f"strata bench: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.workload == "step":
        from ..bench.step import run_step
        from ..bench.step_table import render_step

        try:
            res = run_step(
                plan,
                plan.stages[0].gpu,
                position=args.position,
                versus=plans,
                progress=lambda line: print(f"[step] {line}", file=sys.stderr, flush=True),
            )
        except (MemoryError, ValueError) as exc:
            print(f"strata bench: {exc}", file=sys.stderr)
            return EXIT_REFUSED
        print(json.dumps(res, indent=2) if args.json else render_step(res))
        return 0
    if args.workload == "handoff":
        from ..bench.handoff import render_handoff, run_handoff

        try:
            res = run_handoff(plan)
        except ValueError as exc:
            print(f"strata bench: {exc}", file=sys.stderr)
            return EXIT_REFUSED
        print(json.dumps(res, indent=2) if args.json else render_handoff(res))
        return 0
    from ..bench.vram import render_vram, run_vram

    res = run_vram(plan, devices)
    print(json.dumps(res, indent=2) if args.json else render_vram(res))
    return 0
