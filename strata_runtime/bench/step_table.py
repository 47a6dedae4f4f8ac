"""The step workload's table (`render_step`): the whole step by row count against its roofline, each
kernel group alone and inside the step, the token choices, and with several plans each plan's kernels
(`strata_runtime.bench.step.run_step` measures them)."""

from __future__ import annotations

from typing import Any


def render_step(res: dict[str, Any]) -> str:
    m = res["model"]
    lines = [
        f"step: {m['source']} ({m['layers']} layers, hidden {m['hidden']}, "
        f"{m['heads']}/{m['kv_heads']} heads x {m['head_dim']}, {m['experts']} experts top-{m['top_k']} "
        f"of width {m['expert_width']}, "
        f"vocab {m['vocab']}) on {res['device']} ({res['gpu']}), KV at position {res['position']} "
        f"of {res['context']}, random fp16 weights, {res['routing']} routing"
        + (f", decode attention on {res['attention']}" if "attention" in res else ""),
        f"device-to-device copy measured in this run: {res['copy_gbs']:,.0f} GB/s (read + write)",
        "roofline = bytes one step must read / copy rate:",
        *(f"  {r['arithmetic']}" for r in res["rows"]),
        "",
        f"{'rows':>4} {'eager ms':>9} {'graph ms':>9} {'roofline ms':>12} {'graph/roofline':>15} "
        f"{'distinct experts (last layer)':>30}",
    ]
    for r in res["rows"]:
        lines.append(
            f"{r['rows']:>4} {r['eager_ms']:9.2f} {r['graph_ms']:9.2f} {r['roofline_ms']:12.2f} "
            f"{100 * r['graph_of_roofline']:14.0f}% {r['distinct_experts_last_layer']:>30}"
        )
    lines += [
        "",
        "µs per layer (each kernel group timed alone in a graph over its layers), and in brackets the share",
        "of the copy rate at which it reads the bytes it must (weights, and KV for attention):",
    ]
    copy = res["copy_gbs"]
    for rows, kernels in res["per_kernel_us_per_layer"].items():
        rates = res.get("per_kernel_gbs", {}).get(rows, {})
        share = {k: rates[k] / copy for k in kernels if rates.get(k) and copy > 0}
        lines.append(_groups_line(rows, kernels, share))
    if res.get("in_step_us_per_layer"):
        lines += [
            "",
            "what each group costs inside the whole step, µs per layer: the step less the same step with",
            "the group left out, launched as the decode graphs launch it (a group that overlaps others costs",
            "less here than alone), and in brackets the share of the copy rate at which its bytes move",
            "there:",
        ]
        for rows, groups in res["in_step_us_per_layer"].items():
            nbytes = res.get("per_kernel_bytes_per_layer", {}).get(rows, {})
            share = {
                k: nbytes[k] / v / 1e3 / copy for k, v in groups.items() if nbytes.get(k) and v > 0 < copy
            }
            lines.append(_groups_line(rows, groups, share))
    if res.get("choice_us"):
        lines += [
            "",
            "choosing the window's tokens from the step's logits, µs (each alone in a graph; in brackets",
            "the same choice by one block per row, before the passes over the row were split):",
        ]
        lines += _choice_lines(res["choice_us"], res.get("one_block_us", {}))
    if res.get("distribution_us"):
        lines += ["", "the whole distribution each draw takes (a sampled drafted window's p and q), µs:"]
        lines += _choice_lines(res["distribution_us"], res.get("one_block_distribution_us", {}))
    if res.get("kernel_arms"):
        lines += ["", *_kernel_arm_lines(res["kernel_arms"])]
    return "\n".join(lines)


def _kernel_arm_lines(arms: dict[str, Any]) -> list[str]:
    """The whole step with each plan's kernels: ms by row count, each arm's change from the first, and
    whether the arms chose the same tokens."""
    names = list(arms["kernels"])
    width = max(16, *(len(n) for n in names), *(len(k) for k in arms["kernels"].values()))
    lines = [
        f"the whole step with each plan's kernels, ms (graph; the median of {arms['rounds']} "
        "interleaved rounds in one process, on the same weights and window):",
        f"{'rows':>4}  " + "  ".join(f"{n:>{width}}" for n in names),
        f"{'':>4}  " + "  ".join(f"{arms['kernels'][n]:>{width}}" for n in names),
    ]
    differ = []
    for r in arms["rows"]:
        ms, base = r["ms"], r["ms"][names[0]]
        cells = [f"{base:.3f}"] + [f"{ms[n]:.3f} ({100 * (ms[n] / base - 1):+.1f}%)" for n in names[1:]]
        lines.append(f"{r['rows']:>4}  " + "  ".join(f"{c:>{width}}" for c in cells))
        if any(r["tokens"][n] != r["tokens"][names[0]] for n in names[1:]):
            differ.append(str(r["rows"]))
    if differ:
        lines.append(
            f"argmax tokens: a row's differs between arms at {', '.join(differ)} rows (random weights: near "
            "ties may differ)"
        )
    else:
        lines.append("argmax tokens: every row's the same in every arm")
    return lines


def _choice_lines(times: dict[str, dict[str, float]], one_block: dict[str, dict[str, float]]) -> list[str]:
    """One line per row count: each case's µs, and in brackets its one-block µs where timed."""
    lines = []
    for rows, cases in times.items():
        before = one_block.get(rows, {})
        parts = ", ".join(
            f"{k} {v:.1f}" + (f" ({before[k]:.1f})" if k in before else "") for k, v in cases.items()
        )
        lines.append(f"  {rows} row{'s' if rows != '1' else ''}: {parts}")
    return lines


def _groups_line(rows: str, us: dict[str, float], share: dict[str, float]) -> str:
    """One row count's kernel groups, µs a layer each, and in brackets its share of the copy rate where
    known."""
    parts = ", ".join(f"{k} {v:.1f}" + (f" ({share[k]:.0%})" if k in share else "") for k, v in us.items())
    return f"  {rows} row{'s' if rows != '1' else ''}: {parts}"
