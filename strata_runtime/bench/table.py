"""The bench's table (`render_table`): each arm's medians, its gain over the base arm with a 95% interval,
whether its text equals the base's, and the notes under it (repeats far apart, kernels compiled during a
repeat, each arm's windows by kind and its slowest windows)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.workloads import SHARED_REQUESTS, TURN_MESSAGE, TURNS, gap_text, turns_text

if TYPE_CHECKING:
    pass


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
    where two arms' time went; under it, where a request alone both drafted and did not, what drafting
    saved or cost (`strata_runtime.bench.harness.drafting_balance`), and where the adaptive depth chose its
    windows, what each depth was expected to give against what it gave
    (`strata_runtime.bench.harness.depth_calibration`)."""
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
        drafting = summary[name][case].get("drafting")
        if drafting is not None:
            verb = "saved" if drafting["saved_ms"] >= 0 else "cost"
            out.append(
                f"  drafting {verb} {abs(drafting['saved_ms']):,.0f} ms ({abs(drafting['share']):.1%} of the "
                f"windows' time) against its tokens at the {drafting['base_ms_per_token']:.2f} ms a token of "
                "the windows without proposals"
            )
        calibration = summary[name][case].get("depth_calibration")
        if calibration:
            out.append(
                "  the adaptive depth, expected when chosen against given: "
                + "; ".join(
                    f"{k}: {c['expected_tok_per_ms']:.3f} -> {c['tok_per_ms']:.3f} tok/ms "
                    f"({c['windows']} windows)"
                    for k, c in calibration.items()
                )
            )
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
    """The bench's table: each arm's medians, its gain over its reference (``base``, ``serial`` where it
    ran, else the first arm; for an arm on other weights or routing, the arm of ``base``'s kind on its own,
    `references`) and whether its text equals the reference's."""
    what = f"{tokens} tokens per request, {sampling}"
    if depth:
        what += f", each after a prompt of {depth} tokens (decoding from KV that deep; tok/s counts its read)"
    if workload == "prompt":
        n = next(iter(summary.values()))["prompt"]["median"]["prompt_tokens"]
        what = f"one prompt of {n:.0f} tokens alone on the engine, 1 token generated; tok/s = prompt tokens/s"
    if workload == "turns":
        what = (
            f"one conversation of {TURNS} turns, each sending what was sent before and {TURN_MESSAGE} new "
            f"tokens, {tokens} generated each, {sampling}; tok/s = the conversation's tokens over its time"
        )
    if workload == "conversations":
        what = (
            f"conversations of {TURNS} turns, one more than the arm with the most slots has, taking turns "
            f"one request at a time; each turn sends what was sent before and {TURN_MESSAGE} new tokens, "
            f"{tokens} generated each, {sampling}; tok/s = all their tokens over their time"
        )
    if workload == "shared":
        what = (
            f"{SHARED_REQUESTS} requests with the same context and a question of {TURN_MESSAGE} tokens each, "
            f"all sent at once, {tokens} generated each, "
            f"{sampling}; tok/s = all their tokens over their time"
        )
    lines = [f"workload {workload}: {what}, medians of {repeats} interleaved repeats", ""]
    aw = max(10, *(len(n) for n in summary))  # arm names of --vary variants run longer
    refs = {e.get("reference", base) for cases in summary.values() for e in cases.values()}
    gain_head = f"gain vs {base} [95% CI]" if refs <= {base} else "gain vs its reference [95% CI]"
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
            ref = e.get("reference", base)
            text = (
                {True: f"= {ref}", False: "differs (peer)" if name not in plans else "DIFFERS", None: ""}[
                    e.get(f"text_equal_to_{ref}")
                ]
                if name != ref
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
            extra = turns_text(m, workload) + extra
            if "decode_tok_s" in m:
                extra = (
                    f"  prompt read {m['prompt_read_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s"
                )
            lines.append(
                f"{name:<{aw}} {case:<18} {m['tok_s']:9.1f} {gain:>{gw}} {m['ms_per_window']:8.2f} "
                f"{m['rows_per_window']:8.2f} {m['accepted_pct']:6.1f}%  {text}{extra}"
            )
    if not refs <= {base}:
        lines.append(
            "each arm against the arm of its kind on the same weights and routing (other models give other "
            "text)"
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
