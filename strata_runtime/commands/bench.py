"""`python -m strata_runtime bench --arm NAME=plan.json ... --workload W`: the BENCH.md harness in process.

`strata bench PROFILE` resolves one plan per arm and starts this command with them. Arms that share a stage
layout share one copy of the weights. The table (or ``--json``) gives medians over the repeats, the gain
over ``serial`` with a bootstrap 95% interval, and whether each arm's greedy tokens equal ``serial``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..bench import WORKLOADS, InProcessDriver, run_bench, summarise
from .generate import load_plan


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
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=("transformers",),
        help="also run a peer engine on the same weights (transformers: one GPU, one stage)",
    )


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--{what}: expected NAME=VALUE, got {item!r}")
        out.setdefault(name, "")
        out[name] = (out[name] + "; " + value) if out[name] else value
    return out


def run(args: argparse.Namespace) -> int:
    from ..engine import Engine
    from ..loader import stderr_progress

    arms = _pairs(args.arm, "arm")
    notes = _pairs(args.note, "note")
    plans = {name: load_plan(Path(path)) for name, path in arms.items()}
    weights: dict[Any, Any] = {}
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
    arms: dict[str, Any] = dict(engines)
    if args.peer:
        from ..peer import make_peer

        first = next(iter(plans))
        for peer in args.peer:
            arms[peer] = make_peer(peer, plans[first], engines[first], weights)
            print(
                f"[{peer}] peer arm on the weights of arm {first!r}, shared through DLPack", file=sys.stderr
            )

    def progress(arm: str, case: str, r: int, fig: dict[str, float]) -> None:
        print(f"  repeat {r + 1} {case:>14} {arm:>10}: {fig['tok_s']:9.1f} tok/s", file=sys.stderr)

    runs = run_bench(
        arms,
        args.workload,
        tokens=args.tokens,
        repeats=args.repeats,
        context=context,
        driver=lambda e: e.driver() if hasattr(e, "driver") else InProcessDriver(e),
        on_run=progress,
    )
    summary = summarise(runs)
    budgets = {
        name: {g.device: g.budget_mib for g in plan.gpus if g.role != "idle"} for name, plan in plans.items()
    }
    if args.json:
        out = {
            "workload": args.workload,
            "repeats": args.repeats,
            "tokens": args.tokens,
            "arms": {
                n: {
                    "plan": {
                        "mode": p.batch.mode,
                        "groups": p.batch.groups,
                        "batch_mtp": p.batch.mtp,
                        "slots": p.batch.slots,
                        "draft_tokens": p.spec.draft_tokens,
                    },
                    "note": notes.get(n),
                    "budget_mib": budgets[n],
                    **summary[n],
                }
                for n, p in plans.items()
            },
            "peers": {peer: summary[peer] for peer in args.peer},
        }
        print(json.dumps(out, indent=2))
    else:
        print(render_table(args.workload, plans, summary, notes, args.repeats, args.tokens))
    # A peer computes in other precision and order, so its text may drift; only the runtime's arms must agree.
    equal = all(case.get("text_equal_to_serial", True) for n in plans for case in summary[n].values())
    return 0 if equal else 1


def render_table(
    workload: str,
    plans: dict[str, Any],
    summary: dict[str, Any],
    notes: dict[str, str],
    repeats: int,
    tokens: int,
) -> str:
    lines = [
        f"workload {workload}: {tokens} tokens per request, medians of {repeats} interleaved repeats",
        "",
    ]
    head = f"{'arm':<10} {'case':<18} {'tok/s':>9} {'gain vs serial [95% CI]':>28} "
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
                {True: "= serial", False: "differs (peer)" if name not in plans else "DIFFERS", None: ""}[
                    e.get("text_equal_to_serial")
                ]
                if name != "serial"
                else "(reference)"
            )
            extra = ""
            if "p50_s" in m:
                extra = f"  p50 {m['p50_s']:.3f}s p95 {m['p95_s']:.3f}s"
            if "decode_tok_s" in m:
                extra = (
                    f"  prompt read {m['prompt_read_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s"
                )
            lines.append(
                f"{name:<10} {case:<18} {m['tok_s']:9.1f} {gain:>28} {m['ms_per_window']:8.2f} "
                f"{m['rows_per_window']:8.2f} {m['accepted_pct']:6.1f}%  {text}{extra}"
            )
    for name in summary:
        if name not in plans:
            lines.append(f"\n{name}: peer engine on the same weights (greedy generate, one batch)")
    for name, plan in plans.items():
        b = plan.batch
        desc = f"{b.mode}, {b.groups} group(s), batch MTP {'on' if b.mtp else 'off'}, {b.slots} slot(s)"
        lines.append(f"\n{name}: {desc}" + (f"\n  note: {notes[name]}" if name in notes else ""))
    return "\n".join(lines)
