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
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.plan_file import read_plan
from strata_cfg.schema.sampling_options import add_sampling_arguments, describe_sampling, sampling_options
from strata_cfg.schema.windows import warm_prompt_lengths
from strata_cfg.schema.workloads import (
    CLIENT_COUNTS,
    GPU_WORKLOADS,
    PEERS,
    PROMPTS,
    WARM_PROMPTS,
    WORKLOADS,
    bench_option_problem,
    context_problem,
    gap_text,
    prompt_ids,
)

from ..api import Request, SamplingParams, Tokenizer
from ..bench.ceilings import copy_bandwidth, decode_step_bytes, host_link_rate, matrix_rate, prompt_flops, si
from ..bench.harness import (
    SETTLE_MOST,
    Arm,
    ArmRuns,
    Arrival,
    InProcessDriver,
    Settling,
    Taught,
    adaptive_caches,
    cuda_devices,
    driver_for,
    mean_prompt_tokens,
    run_bench,
    settle_experts,
    settled,
    summarise,
    teach_drafting,
)
from ..bench.window_roofline import table
from ..model.placed import WeightStore

if TYPE_CHECKING:
    from ..engine import Engine

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
        "--prompt-tokens", type=int, default=4096, help="prompt: the prompt's length in tokens (default 4096)"
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
    sampling = sampling_params(args)
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
    weights = WeightStore()
    engines = {name: Engine(plan, progress=stderr_progress, weights=weights) for name, plan in plans.items()}
    for name, engine in engines.items():
        print(f"[{name}] " + " | ".join(engine.startup), file=sys.stderr)
        vram = [d.memory_used() for d in dict.fromkeys(s.device for s in engine.model.stages)]
        if any(v is not None for v in vram):
            print(
                f"[{name}] device memory in use after load (MiB): {[round(v / 2**20) for v in vram if v]}",
                file=sys.stderr,
            )
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
    length = min(args.prompt_tokens, 2 * chunk) if args.workload == "prompt" else 2 * chunk
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
    summary = summarise(runs, base=base, compare_text=sampling.temperature <= 0)
    ceiling = ceiling_report(args.workload, plans, summary, rates, args, tokenizer)
    budgets = {
        name: {g.device: g.budget_mib for g in plan.gpus if g.role != "idle"} for name, plan in plans.items()
    }
    llama = None
    if "llama.cpp" in args.peer:
        stream_prompt = mean_prompt_tokens(
            args.workload, tokenizer, args.tokens, context, max(CLIENT_COUNTS), args.depth, vocab
        )
        llama = llama_cpp_figures(args, plans, summary, weights, stream_prompt)
    if args.json:
        out = {
            "workload": args.workload,
            "repeats": args.repeats,
            "tokens": args.tokens,
            "sampling": sampling_options(args),
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
                    },
                    "note": notes.get(n),
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
    equal = all(case.get(f"text_equal_to_{base}") is not False for n in plans for case in summary[n].values())
    return 0 if equal else 1


def llama_cpp_figures(
    args: argparse.Namespace,
    plans: dict[str, LaunchPlan],
    summary: dict[str, Any],
    weights: WeightStore,
    stream_prompt: int,
) -> dict[str, Any]:
    """The llama.cpp peer beside the first arm: its figures as lines and as JSON, or the one line that says
    why it was skipped (printed to stderr). ``stream_prompt``: each of its decode streams' prompt length (our
    requests' mean)."""
    import tempfile

    from ..bench import llamacpp
    from ..bench.gguf_export import ExportError, kept_file, write_model

    first = next(iter(plans))
    plan = plans[first]
    tools = llamacpp.find_tools()
    skipped = llamacpp.skip_reason(tools, args.workload)
    if skipped:
        print(f"[llama.cpp] {skipped}", file=sys.stderr)
        return {"lines": [], "json": {"skipped": skipped}}
    try:
        placement = llamacpp.Placement.of_plan(plan)
    except ValueError as exc:
        print(f"[llama.cpp] skipped: {exc}", file=sys.stderr)
        return {"lines": [], "json": {"skipped": str(exc)}}
    with tempfile.TemporaryDirectory(prefix="strata-gguf-") as tmp:
        path = args.gguf or str(Path(tmp) / f"{plan.profile}.gguf")
        if Path(path).exists():
            usable, line = kept_file(path, plan)
            if not usable:
                print(f"[llama.cpp] skipped: {line}", file=sys.stderr)
                return {"lines": [], "json": {"skipped": line}}
            print(f"[llama.cpp] {line}", file=sys.stderr)
        else:
            try:
                size = write_model(path, plan, weights)
            except ExportError as exc:
                print(f"[llama.cpp] skipped: {exc}", file=sys.stderr)
                return {"lines": [], "json": {"skipped": str(exc)}}
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
        peer = llamacpp.run_peer(tools, path, asked)
    figures = [{"case": f.case, "what": f.what, "tok_s": f.tok_s} for f in peer.figures]
    return {
        "lines": llamacpp.render(peer, summary[first], first),
        "json": {"figures": figures, "commands": peer.commands, "notes": peer.notes, "beside": first},
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
        from ..bench.step import render_step, run_step

        try:
            res = run_step(plan, plan.stages[0].gpu, position=args.position, versus=plans)
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


def _first_gpu(plans: dict[str, LaunchPlan]) -> int | None:
    stage = next(iter(plans.values())).stages[0]
    return stage.gpu if stage.device.startswith("cuda:") else None


def measure_rates(workload: str, plans: dict[str, LaunchPlan]) -> dict[str, float]:
    """The ceiling a workload's figures are compared with, measured on the first stage's GPU before any
    engine takes its memory; nothing on virtual CPU devices."""
    gpu = _first_gpu(plans)
    if gpu is None:
        return {}
    if workload == "prompt":
        return {"matrix_flop_s": matrix_rate(gpu)}
    if workload in ("solo", "two-decodes"):
        rates = {"copy_bytes_s": copy_bandwidth(gpu)}
        if any(g.experts_resident < g.experts_total for p in plans.values() for g in p.gpus):
            rates["host_link_bytes_s"] = host_link_rate(gpu)
        return rates
    return {}


WARM_STREAMS = {"two-decodes": 2, "clients": max(CLIENT_COUNTS), "read-beside-decode": 1, "solo": 1}
"""Streams each workload decodes at once, which the warm-up runs too (every window shape it will use)."""
WARM_TOKENS = 24


def warm_up(engines: dict[str, Engine], length: int, vocab: int, streams: int = 0) -> None:
    """Before the first measured repeat, on every arm: read one prompt of ``length``, one of each size of
    prefill graph the arm replays (`strata_cfg.schema.windows.warm_prompt_lengths`: each is captured
    then) and one of `PROMPT_GRAPH_MAX` rows where the arm's prefill path also reads short prompts (its
    products at a few dozen rows load other kernels than a long chunk's), then decode ``streams`` requests
    at once, joining one at a time (so every group runs), then capture the graph of every decode window
    shape these did not (`strata_runtime.model.placed.Model.capture_window_graphs`), so that no repeat pays
    for compiling kernels or capturing graphs; then forget the warm-up's requests
    (`strata_runtime.engine.Engine.forget_requests`), as `strata serve`'s warm-up does: their window
    statistics and what their proposals did (the window times, which count only replayed windows, are
    kept)."""
    greedy = SamplingParams(temperature=0.0)
    ids = prompt_ids(length, vocab, seed=1 << 20)  # not a seed any repeat uses
    for engine in engines.values():
        InProcessDriver(engine).run([Arrival(Request(ids, 1, greedy))])
        mem = engine.plan.memory
        lengths = warm_prompt_lengths(mem.prefill_graph_rows, mem.prompt_graph_rows, mem.context)
        for k, n in enumerate(lengths):
            once = prompt_ids(n, vocab, seed=(1 << 20) - 1 - k)
            InProcessDriver(engine).run([Arrival(Request(once, 1, greedy))])
        if streams:
            short = [prompt_ids(4, vocab, seed=(1 << 20) + i) for i in range(streams)]
            arrivals = [
                Arrival(Request(p, WARM_TOKENS, greedy), after_tokens=2 * i) for i, p in enumerate(short)
            ]
            InProcessDriver(engine).run(arrivals)
        engine.model.capture_window_graphs()
        engine.forget_requests()


def settle(
    engines: dict[str, Engine], workload: str, tokens: int, tokenizer: Tokenizer
) -> dict[str, list[Settling]]:
    """Settle the arms' adaptive expert caches before the first repeat (`settle_experts`), on requests of the
    workload's streams and ``tokens`` each, greedy, on prompts no repeat uses (`WARM_PROMPTS`): every repeat
    then starts from a cache that has served other text, as a server's has. Arms of one layout share their
    caches, so each set of caches settles once. The engines then forget the warm-up's requests. {} for the
    workloads that decode nothing."""
    if workload not in WARM_STREAMS:
        return {}
    greedy = SamplingParams(temperature=0.0)

    def arrivals(k: int) -> list[Arrival]:
        return warm_arrivals(workload, k, tokens, tokenizer, greedy)

    out: dict[str, list[Settling]] = {}
    done: set[int] = set()
    for name, engine in engines.items():
        caches = adaptive_caches(engine)
        if not caches or all(id(c) in done for c in caches):
            continue
        out[name] = settle_experts(engine, arrivals)
        done.update(id(c) for c in caches)
        engine.forget_requests()
    return out


def teach(
    engines: dict[str, Engine],
    workload: str,
    tokens: int,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    seeded: bool = True,
) -> dict[str, Taught | None]:
    """Before the first repeat, each arm whose drafting depth learns (`teach_drafting`) decodes requests
    like the workload's (its streams, ``tokens`` each, the bench's sampling) on prompts no repeat uses
    (`WARM_PROMPTS`), so that every repeat starts from an estimate of how often proposals hold that other
    text taught, as a server's next request does. A seeded sampled request drafts at a fixed depth (its
    text must not depend on window times), so nothing is taught for those. {} for the workloads that
    decode nothing."""
    if workload not in WARM_STREAMS or (sampling.temperature > 0 and seeded):
        return {}
    arrivals = warm_arrivals(workload, SETTLE_MOST, tokens, tokenizer, sampling)  # after settling's
    return {name: teach_drafting(engine, arrivals) for name, engine in engines.items()}


def warm_arrivals(
    workload: str, k: int, tokens: int, tokenizer: Tokenizer, sampling: SamplingParams
) -> list[Arrival]:
    """The k-th set of warm-up requests on text no repeat uses (`WARM_PROMPTS`): one per stream the
    workload decodes at once, ``tokens`` each, choosing by ``sampling``."""
    streams = max(WARM_STREAMS[workload], 1)
    texts = [WARM_PROMPTS[(k * streams + i) % len(WARM_PROMPTS)] for i in range(streams)]
    return [Arrival(Request(tuple(tokenizer.encode(t)), tokens, sampling)) for t in texts]


def taught_line(t: Taught, tokens: int) -> str:
    """One line on what warm-up requests taught an arm's drafting before the first repeat."""
    held = f"{t.accepted} of {t.proposals} proposals held" if t.proposals else "no proposal drafted"
    kinds = "; ".join(
        f"{kind}: " + " / ".join(f"{c:.0%}" for c in chances)
        for kind, chances in t.chances.items()
        if chances
    )
    where = f", by position: {kinds}" if kinds else ""
    return (
        f"drafting: every repeat starts from what {t.requests} warm-up request(s) of {tokens} tokens on "
        f"other text taught ({held}{where}; --cold-drafting starts from nothing)"
    )


def settling_line(steps: list[Settling], slots: int, tokens: int) -> str:
    """One line on how an arm's expert caches (``slots`` slots in all) settled before the first repeat."""
    shares = " -> ".join(f"{x.from_vram:.1%}" for x in steps)
    swaps = sum(x.swaps for x in steps)
    how = "settled" if settled(steps, slots) else "still learning"
    return (
        f"expert cache {how} after {len(steps)} warm-up request(s) of {tokens} tokens, which every repeat "
        f"starts from: {shares} of expert work from VRAM, {swaps:,} experts swapped in for {slots:,} slots "
        "(--cold-experts skips this)"
    )


def ceiling_report(
    workload: str,
    plans: dict[str, LaunchPlan],
    summary: dict[str, Any],
    rates: dict[str, float],
    args: argparse.Namespace,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    """Each arm's rate against its ceiling, the arithmetic written out (``lines``); {} when none applies."""
    plan = next(iter(plans.values()))
    facts = plan.model.facts
    device = f"cuda:{_first_gpu(plans)}"
    if workload == "prompt":
        flops = prompt_flops(facts, args.prompt_tokens)
        matrix = rates.get("matrix_flop_s")
        head = f"prompt of {args.prompt_tokens} tokens: {flops.arithmetic()}"
        if matrix:
            head += f"; fp16 matrix rate {si(matrix, 'FLOP/s')} measured in this run on {device}"
        lines, arms = [head], {}
        for name, cases in summary.items():
            e = cases["prompt"]
            rate = e["median"]["tok_s"]
            each = ", ".join(f"{r:,.0f}" for r in e["tok_s_repeats"])
            line = f"  {name}: {rate:,.1f} prompt tok/s (repeats: {each})"
            line += f" = {si(rate * flops.total, 'FLOP/s')}"
            arm = {"tok_s": rate, "flop_s": rate * flops.total}
            if matrix:
                arm["of_matrix_rate"] = rate * flops.total / matrix
                line += f" = {100 * arm['of_matrix_rate']:.2f}% of the matrix rate"
            lines.append(line)
            arms[name] = arm
        return {"flops_per_token": flops.total, "matrix_flop_s": matrix, "arms": arms, "lines": lines}
    copy = rates.get("copy_bytes_s")
    if workload not in ("solo", "two-decodes") or not copy:
        return {}
    # The streams' KV grows from the prompt to prompt + tokens: on average it reads half way. At a depth
    # the prompt's read is left out of the rate compared (the generating rate), as the roofline has none.
    depth = getattr(args, "depth", 0)
    prompt = depth or len(tokenizer.encode(PROMPTS[0]))
    positions = prompt + args.tokens // 2
    step = decode_step_bytes(facts, rows=1, positions=positions, kv_dtype=plan.memory.kv_dtype)
    roof = copy / step.total
    lines = [
        f"one-row roofline on {device} (copy rate measured in this run): {step.arithmetic(copy)}",
        f"= {roof:,.0f} tok/s for one stream without drafting",
    ]
    arms = {}
    link = rates.get("host_link_bytes_s")
    for name, cases in summary.items():
        m = cases[workload]["median"]
        rate = m.get("generation_tok_s", m["tok_s"]) if depth else m["tok_s"]
        arms[name] = {"tok_s": rate, "of_one_row_roofline": rate / roof}
        what = "tok/s generating" if depth else "tok/s"
        lines.append(f"  {name}: {rate:,.1f} {what} = {100 * rate / roof:.0f}% of the one-row roofline")
        if link and "host_mb_per_token" in m:
            cache = cache_ceiling(facts, m, positions, plan.memory.kv_dtype, copy, link)
            arms[name].update({k: v for k, v in cache.items() if k != "line"})
            lines.append(f"    {cache['line']}")
    if link:
        lines.append(f"host link (pinned host to {device}) measured in this run: {si(link, 'B/s')}")
    out = {
        "step_bytes": step.total,
        "copy_bytes_s": copy,
        "roofline_tok_s": roof,
        "arms": arms,
        "lines": lines,
    }
    if workload == "two-decodes":
        windows = batch_mtp_roofline(plans, summary, positions, copy)
        if windows:
            out["batch_mtp_roofline"] = windows
            lines.extend(windows.pop("lines"))
    return out


ROOFLINE_SAMPLES = 16
"""Windows of random prompts and positions over which calibrated routing's distinct experts are averaged."""


def batch_mtp_roofline(
    plans: dict[str, LaunchPlan], summary: dict[str, Any], positions: int, copy: float
) -> dict[str, Any]:
    """Two streams' serial and batch-MTP windows at their byte time (`strata_runtime.bench.window_roofline`),
    at the acceptance the run's batch-MTP arm measured, under both routings, beside what each arm's windows
    took: what batch MTP can gain once both windows run at the roofline. {} without a serial and a batch-MTP
    arm, or a model without routed experts."""

    def first(name: str, mtp: bool) -> str | None:  # the arm of that name, else the first of its kind
        kind = [n for n, p in plans.items() if p.batch.mtp == mtp and n in summary]
        return name if name in kind else next(iter(kind), None)

    serial, batch = first("serial", False), first("batch-mtp", True)
    if serial is None or batch is None or not plans[batch].model.facts.num_experts:
        return {}
    plan = plans[batch]
    accepted = summary[batch]["two-decodes"]["median"]["accepted_pct"] / 100
    rows = table(
        plan.model.facts,
        seed=plan.model.seed,
        streams=[WARM_STREAMS["two-decodes"]],
        acceptances=[accepted],
        positions=positions,
        copy=copy,
        samples=ROOFLINE_SAMPLES,
    )
    by = {r["routing"]: r for r in rows}
    key = f"{accepted:g}"
    used = by[plan.model.routing]
    s_win, b_win = used["serial"], used["batch_mtp"]
    measured = {
        kind: summary[arm]["two-decodes"].get("windows_by_kind", {}).get(kind, {}).get("ms_per_window")
        for arm, kind in ((serial, "serial"), (batch, "batch-mtp"))
    }
    lines = [
        f"batch MTP at the byte rooflines, two streams, {accepted:.1%} accepted as measured "
        f"({plan.model.routing} routing, this plan's): serial windows {s_win['rows']} rows, "
        f"{s_win['distinct_experts']:.1f} experts a layer, {s_win['ms']:.3f} ms; batch-MTP windows "
        f"{b_win['rows']} rows and the drafting head, {b_win['distinct_experts']:.1f} experts, "
        f"{b_win['ms']:.3f} ms: {100 * used['gain'][key]:+.1f}%"
    ]
    for name, r in by.items():
        if name != plan.model.routing:
            lines.append(
                f"  under {name} routing: {r['serial']['distinct_experts']:.1f} and "
                f"{r['batch_mtp']['distinct_experts']:.1f} experts a layer, {100 * r['gain'][key]:+.1f}%"
            )
    if measured["serial"] and measured["batch-mtp"]:
        lines.append(
            f"  measured: serial windows {measured['serial']:.2f} ms = "
            f"{s_win['ms'] / measured['serial']:.0%} of their byte time, batch-MTP windows "
            f"{measured['batch-mtp']:.2f} ms = {b_win['ms'] / measured['batch-mtp']:.0%}"
        )
    return {"accepted": accepted, "routings": by, "measured_ms": measured, "lines": lines}


def cache_ceiling(
    facts: ModelFacts, m: dict[str, float], positions: int, kv_dtype: str, copy: float, link: float
) -> dict[str, Any]:
    """The tok/s an arm's windows allow at the hit rate it measured, VRAM and host link read side by side.

    A window of R rows reads the step's bytes from VRAM, less the experts it read from host memory (the
    measured miss share), and moves the measured host bytes per token times the window's tokens over the
    link; the two links work at once, so the slower of the two bounds the window.
    """
    rows = max(1, round(m["rows_per_window"]))
    tokens = m["tok_s"] * m["ms_per_window"] / 1000  # tokens each window yields, measured
    step = decode_step_bytes(facts, rows=rows, positions=positions, kv_dtype=kv_dtype)
    hit = m["expert_vram_pct"] / 100
    vram = step.total - (1 - hit) * step.experts
    host = m["host_mb_per_token"] * 1e6 * tokens
    floor = max(vram / copy, host / link)
    ceiling = tokens / floor if floor > 0 else 0.0
    line = (
        f"expert cache: {100 * hit:.1f}% of expert work from VRAM, {m['host_mb_per_token']:.1f} MB/token "
        f"over the host link; a {rows}-row window ({tokens:.2f} tokens) reads {si(vram, 'B')} from VRAM "
        f"({si(vram / copy, 's')}) and {si(host, 'B')} over the link ({si(host / link, 's')}): ceiling "
        f"{ceiling:,.1f} tok/s, measured {m['tok_s']:,.1f} = {100 * m['tok_s'] / ceiling:.0f}% of it"
    )
    return {
        "expert_vram_pct": m["expert_vram_pct"],
        "host_mb_per_token": m["host_mb_per_token"],
        "cache_ceiling_tok_s": ceiling,
        "of_cache_ceiling": m["tok_s"] / ceiling if ceiling else 0.0,
        "line": line,
    }


SPREAD = 1.5
"""Repeats of one arm and case whose fastest is this many times the slowest are named under the table."""


def spread_notes(summary: dict[str, Any]) -> list[str]:
    """A line under the table for each arm and case whose repeats differ by `SPREAD` times or more: its median
    and interval then hold a one-off stall (a first use that compiles or captures) or a noisy machine."""
    out = []
    for name, cases in summary.items():
        for case, e in cases.items():
            rates = e.get("tok_s_repeats") or []
            if len(rates) > 1 and min(rates) > 0 and max(rates) / min(rates) >= SPREAD:
                each, apart = ", ".join(f"{r:,.1f}" for r in rates), max(rates) / min(rates)
                out.append(
                    f"note: {name} {case}: repeats of {each} tok/s, {apart:.1f}x apart; its median and "
                    "interval hold a one-off stall or a noisy machine (more --repeats narrow them)"
                )
    return [""] + out if out else []


def compile_notes(summary: dict[str, Any]) -> list[str]:
    """A line under the table for each repeat during which kernels were compiled at their first launch: its
    figures hold that wait, which a server meets once, on its first such window."""
    out = []
    for name, cases in summary.items():
        for case, e in cases.items():
            for r, each in enumerate(e.get("compiled_in_repeats") or []):
                if each:
                    seconds = sum(c["seconds"] for c in each)
                    kernels = ", ".join(dict.fromkeys(c["kernel"] for c in each))
                    out.append(
                        f"note: {name} {case}, repeat {r + 1}: {len(each)} kernel compile(s) at first "
                        f"launch, {seconds:.2f} s in all, held in its figures ({kernels})"
                    )
    return [""] + out if out else []


def window_mix_lines(summary: dict[str, Any]) -> list[str]:
    """Under a decode table: each arm's windows by kind (solo windows by their proposals), with what each
    kind took and gave (ms a window, tokens a window, ms a token), then all of them together: the depths an
    adaptive request alone chose, how often drafting paused, which of serial and batch-MTP windows ran, and
    where two arms' time went."""
    out = []
    for name, case, mix in _each_case(summary, "windows_by_kind"):
        parts = []
        windows, ms, tokens = 0, 0.0, 0.0
        for k, m in mix.items():
            per_token = m["ms_per_window"] / m["tokens_per_window"] if m["tokens_per_window"] else 0.0
            parts.append(
                f"{k}: {m['windows']} x {m['ms_per_window']:.2f} ms, {m['tokens_per_window']:.2f} tok "
                f"({per_token:.2f} ms/tok)"
            )
            windows += m["windows"]
            ms += m["windows"] * m["ms_per_window"]
            tokens += m["windows"] * m["tokens_per_window"]
        parts.append(f"all: {windows} windows, {ms:,.0f} ms, {tokens:,.0f} tok")
        out.append(f"{name} {case} windows (all repeats): " + "; ".join(parts))
    return [""] + out if out else []


def _each_case(summary: dict[str, Any], key: str) -> Iterator[tuple[str, str, Any]]:
    """(arm, case, its entry's ``key``) for every case of every arm whose entry has a non-empty ``key``."""
    for name, cases in summary.items():
        for case, e in cases.items():
            if e.get(key):
                yield name, case, e[key]


def slowest_lines(summary: dict[str, Any]) -> list[str]:
    """Under a decode table: each arm's slowest decode windows over all repeats (`slowest_windows`): where
    its longest waits between deliveries came from, and at which window of the run (window 2 is the first
    after the prompt's)."""
    out = []
    for name, case, slow in _each_case(summary, "slowest_windows"):
        parts = [
            f"{w['ms']:.1f} ms, {w['window']} ({w['rows']} rows, {w['tokens']} tok"
            + (f", head caught up on {w['caught_up']} rows" if w.get("caught_up") else "")
            + f"; host: drafting {w.get('draft_ms', 0.0):.1f} ms before launch, "
            f"finishing {w.get('finish_ms', 0.0):.1f} ms" + f"; window {w['index']} of repeat {w['repeat']})"
            for w in slow
        ]
        out.append(f"{name} {case} slowest decode windows: " + "; ".join(parts))
    return out


def render_table(
    workload: str,
    plans: dict[str, LaunchPlan],
    summary: dict[str, Any],
    notes: dict[str, str],
    repeats: int,
    tokens: int,
    sampling: str = "greedy",
    base: str = "serial",
    depth: int = 0,
) -> str:
    """The bench's table: each arm's medians, its gain over ``base`` (``serial`` where it ran, else the
    first arm) and whether its text equals ``base``'s."""
    what = f"{tokens} tokens per request, {sampling}"
    if depth:
        what += f", each after a prompt of {depth} tokens (decoding from KV that deep; tok/s counts its read)"
    if workload == "prompt":
        n = next(iter(summary.values()))["prompt"]["median"]["prompt_tokens"]
        what = f"one prompt of {n:.0f} tokens alone on the engine, 1 token generated; tok/s = prompt tokens/s"
    lines = [f"workload {workload}: {what}, medians of {repeats} interleaved repeats", ""]
    aw = max(10, *(len(n) for n in summary))  # arm names of --vary variants run longer
    gain_head = f"gain vs {base} [95% CI]"
    gw = max(28, len(gain_head))
    head = f"{'arm':<{aw}} {'case':<18} {'tok/s':>9} {gain_head:>{gw}} "
    head += f"{'ms/win':>8} {'rows/win':>8} {'accept':>7}  text"
    lines += [head, "-" * len(head)]
    for name, cases in summary.items():
        for case, e in cases.items():
            m = e["median"]
            gain = ""
            if "gain" in e:
                lo, hi = e["gain_ci95"]
                gain = f"{100 * e['gain']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            text = (
                {True: f"= {base}", False: "differs (peer)" if name not in plans else "DIFFERS", None: ""}[
                    e.get(f"text_equal_to_{base}")
                ]
                if name != base
                else "(reference)"
            )
            extra = ""
            if "p50_s" in m:
                extra = f"  p50 {m['p50_s']:.3f}s p95 {m['p95_s']:.3f}s"
            if "generation_tok_s" in m:
                extra += f", generating {m['generation_tok_s']:.1f} tok/s"
            extra += gap_text(m)
            if "expert_vram_pct" in m:
                per = "prompt tok" if workload == "prompt" else "tok"
                extra += (
                    f"  experts {m['expert_vram_pct']:.1f}% from VRAM, {m['host_mb_per_token']:.1f} MB/{per}"
                )
            if "decode_tok_s" in m:
                extra = (
                    f"  prompt read {m['prompt_read_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s"
                )
            lines.append(
                f"{name:<{aw}} {case:<18} {m['tok_s']:9.1f} {gain:>{gw}} {m['ms_per_window']:8.2f} "
                f"{m['rows_per_window']:8.2f} {m['accepted_pct']:6.1f}%  {text}{extra}"
            )
    lines += spread_notes(summary)
    lines += compile_notes(summary)
    if workload != "prompt":
        lines += window_mix_lines(summary)
        lines += slowest_lines(summary)
    for name in summary:
        if name not in plans:
            lines.append(f"\n{name}: peer engine on the same weights (greedy generate, one batch)")
    for name, plan in plans.items():
        b = plan.batch
        desc = f"{b.mode}, {b.groups} group(s), batch MTP {'on' if b.mtp else 'off'}, {b.slots} slot(s)"
        lines.append(f"\n{name}: {desc}" + (f"\n  note: {notes[name]}" if name in notes else ""))
    return "\n".join(lines)
