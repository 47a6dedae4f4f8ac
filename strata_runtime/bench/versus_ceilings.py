"""Each arm's rate against its ceiling, measured on the same GPU in the same run before the engines load
(`measure_rates`): the one-row byte roofline for ``solo`` and ``two-decodes`` (with batch MTP's windows at
their byte time, `batch_mtp_roofline`, and an expert cache's VRAM and host-link bound, `cache_ceiling`), and
the fp16 matrix rate for ``prompt`` (`ceiling_report`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from strata_cfg.schema.facts import ModelFacts
from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.workloads import (
    PROMPTS,
)

from ..api import Tokenizer
from .ceilings import (
    copy_bandwidth,
    decode_step_bytes,
    host_link_rate,
    host_read_rate,
    matrix_rate,
    prompt_flops,
    si,
)
from .harness import same_model
from .preparing import WARM_STREAMS
from .window_roofline import table

if TYPE_CHECKING:
    pass


def first_gpu(plans: dict[str, LaunchPlan]) -> int | None:
    """The GPU of the first plan's first stage, where it is on a GPU."""
    stage = next(iter(plans.values())).stages[0]
    return stage.gpu if stage.device.startswith("cuda:") else None


def measure_rates(workload: str, plans: dict[str, LaunchPlan]) -> dict[str, float]:
    """The ceiling a workload's figures are compared with, measured on the first stage's GPU before any
    engine takes its memory; nothing on virtual CPU devices."""
    gpu = first_gpu(plans)
    if gpu is None:
        return {}
    if workload == "prompt":
        return {"matrix_flop_s": matrix_rate(gpu)}
    if workload in ("solo", "two-decodes"):
        rates = {"copy_bytes_s": copy_bandwidth(gpu)}
        if any(g.experts_resident < g.experts_total for p in plans.values() for g in p.gpus):
            rates["host_link_bytes_s"] = host_link_rate(gpu)
            f = next(iter(plans.values())).model.facts  # a miss reads an expert's fp16 gate/up, then down
            rates["host_read_bytes_s"] = host_read_rate(gpu, 2 * f.moe_intermediate_size * f.hidden_size * 2)
        return rates
    return {}


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
    device = f"cuda:{first_gpu(plans)}"
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
            read = rates.get("host_read_bytes_s")
            cache = cache_ceiling(facts, m, positions, plan.memory.kv_dtype, copy, link, read)
            arms[name].update({k: v for k, v in cache.items() if k != "line"})
            lines.append(f"    {cache['line']}")
    if link:
        line = (
            f"host link (pinned host to {device}) measured in this run: {si(link, 'B/s')} by the copy engine"
        )
        if rates.get("host_read_bytes_s"):
            line += f", {si(rates['host_read_bytes_s'], 'B/s')} read by kernels in place (a miss's rate)"
        lines.append(line)
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
    took: what batch MTP can gain once both windows run at the roofline. Each batch-MTP arm is set beside the
    serial arm on its model (``serial`` where it is one, else the first; under ``--vary model.routing`` one
    pair per routing); the first pair's figures are the result's, each pair's under ``by_arm`` where there
    are several. {} without a serial and a batch-MTP arm on one model, or a model without routed experts."""
    pairs = []
    for batch, plan in plans.items():
        if not plan.batch.mtp or batch not in summary or not plan.model.facts.num_experts:
            continue
        kind = [n for n, p in plans.items() if not p.batch.mtp and n in summary and same_model(p, plan)]
        serial = next((n for n in kind if n.split("@", 1)[0] == "serial"), next(iter(kind), None))
        if serial is not None:
            pairs.append((serial, batch))
    if not pairs:
        return {}
    named = len(pairs) > 1
    each = {
        batch: _pair_roofline(plans, summary, serial, batch, positions, copy, named)
        for serial, batch in pairs
    }
    out = dict(next(iter(each.values())))
    out["lines"] = [line for r in each.values() for line in r["lines"]]
    if named:
        out["by_arm"] = {b: {k: v for k, v in r.items() if k != "lines"} for b, r in each.items()}
    return out


def _pair_roofline(
    plans: dict[str, LaunchPlan],
    summary: dict[str, Any],
    serial: str,
    batch: str,
    positions: int,
    copy: float,
    named: bool,
) -> dict[str, Any]:
    """`batch_mtp_roofline` for one batch-MTP arm and the serial arm beside it (``named``: its lines name
    both)."""
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
        int8_head=plan.spec.draft_head == "int8",
    )
    by = {r["routing"]: r for r in rows}
    key = f"{accepted:g}"
    used = by[plan.model.routing]
    s_win, b_win = used["serial"], used["batch_mtp"]
    measured = {
        kind: summary[arm]["two-decodes"].get("windows_by_kind", {}).get(kind, {}).get("ms_per_window")
        for arm, kind in ((serial, "serial"), (batch, "batch-mtp"))
    }
    which = f" ({batch} against {serial})" if named else ""
    lines = [
        f"batch MTP at the byte rooflines{which}, two streams, {accepted:.1%} accepted as measured "
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
    facts: ModelFacts,
    m: dict[str, float],
    positions: int,
    kv_dtype: str,
    copy: float,
    link: float,
    read: float | None = None,
) -> dict[str, Any]:
    """The tok/s an arm's windows allow at the hit rate it measured, VRAM and host link read side by side.

    A window of R rows reads the step's bytes from VRAM, less the experts it read from host memory (the
    measured miss share), and moves the measured host bytes per token times the window's tokens over the
    link; the two links work at once, so the slower of the two bounds the window. With ``read`` (the rate
    kernels read pinned host memory at, `strata_runtime.bench.ceilings.host_read_rate`) and the swaps'
    share of the host bytes measured, the misses cross the link at ``read`` and the swaps' copies at
    ``link`` (the copy engine's rate), one after the other; else all of it at ``link``. The share and the
    bytes are the decode windows' (`strata_runtime.bench.harness.cache_figures`), and so are the tokens a
    window yields and the rate set against the ceiling where the run counted its windows by kind
    (``decode_window_ms``); a run that read prompts through the prefill path has the prompts' own figures
    beside them.
    """
    rows = max(1, round(m["rows_per_window"]))
    if m.get("decode_window_ms"):  # the decode windows' own tokens and time, without the prompts'
        tokens = m["decode_window_tokens"]
        rate, what = 1000 * tokens / m["decode_window_ms"], " (the decode windows')"
    else:
        tokens = m["tok_s"] * m["ms_per_window"] / 1000  # tokens each window yields, measured
        rate, what = m["tok_s"], ""
    step = decode_step_bytes(facts, rows=rows, positions=positions, kv_dtype=kv_dtype)
    hit = m["expert_vram_pct"] / 100
    vram = step.total - (1 - hit) * step.experts
    host = m["host_mb_per_token"] * 1e6 * tokens
    if read and "swap_mb_per_token" in m:
        swaps = m["swap_mb_per_token"] * 1e6 * tokens
        host_s = (host - swaps) / read + swaps / link
        how = f"misses {si(host - swaps, 'B')} at the kernels' read rate, swaps {si(swaps, 'B')} copied"
    else:
        host_s, how = host / link, ""
    floor = max(vram / copy, host_s)
    ceiling = tokens / floor if floor > 0 else 0.0
    line = (
        f"expert cache: {100 * hit:.1f}% of expert work from VRAM, {m['host_mb_per_token']:.1f} MB/token "
        f"over the host link; a {rows}-row window ({tokens:.2f} tokens) reads {si(vram, 'B')} from VRAM "
        f"({si(vram / copy, 's')}) and {si(host, 'B')} over the link ({si(host_s, 's')}"
        f"{': ' + how if how else ''}): ceiling {ceiling:,.1f} tok/s, measured {rate:,.1f}{what} = "
        f"{100 * rate / ceiling:.0f}% of it"
    )
    extra: dict[str, float] = {
        k: m[k] for k in ("prompt_expert_vram_pct", "prompt_host_mb_per_token", "late_read_pct") if k in m
    }
    if "prompt_expert_vram_pct" in extra:
        line += (
            f" (decode windows; the prompts' chunks: {extra['prompt_expert_vram_pct']:.1f}% from VRAM, "
            f"{extra['prompt_host_mb_per_token']:.1f} MB a prompt token)"
        )
    if "late_read_pct" in extra:
        line += (
            f"; {extra['late_read_pct']:.0f}% of the decode windows' misses read experts a rebalance had "
            "already sent for"
        )
    return {
        **extra,
        "expert_vram_pct": m["expert_vram_pct"],
        "host_mb_per_token": m["host_mb_per_token"],
        "cache_ceiling_tok_s": ceiling,
        "of_cache_ceiling": rate / ceiling if ceiling else 0.0,
        "line": line,
    }
