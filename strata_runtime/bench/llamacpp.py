"""llama.cpp as a peer of `strata bench` (``--peer llama.cpp``), on the very same weights.

The plan's model is written as GGUF (`strata_runtime.bench.gguf_export`) and run by llama.cpp's own
benchmark tools, found on PATH: ``llama-bench`` for one stream (``tg``: generating N tokens) and for a
prompt (``pp``: reading N tokens), ``llama-batched-bench`` for several streams decoding at once (each
stream's prompt as long as the runtime's requests' prompts on average, then N tokens each). Where a case's
tool is missing and ``llama-server`` is on PATH, the server runs that case instead
(`strata_runtime.bench.llamacpp_server`). Each figure is matched with the runtime's case of the same
workload and their ratio reported. Where none of the three is on PATH the peer is skipped in one line.

llama.cpp runs on the plan's devices (`Placement`): its GPUs alone are visible to it, in stage order, and a
plan of several stages is split by layer in the plan's proportions; a plan on CPU devices hides every GPU.
Where a GPU cannot hold its stages' routed experts (the plan's expert cache), llama.cpp keeps whole layers'
routed experts in host memory (``-ot``, its expert offload): on each GPU as many layers' experts stay in
VRAM as its cache has slots for, and the rest of its layers' experts are read from host memory.

llama.cpp draws random token ids and runs its own loop; the runtime's arms run real requests through the
engine. So the figures compare decode and prompt speed on identical weights, not text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .llamacpp_server import FULL_OFFLOAD, SERVER, ServerCase, run_server

TOOLS = ("llama-bench", "llama-batched-bench", SERVER)
BATCHED_PROMPT = 128
"""Tokens of each stream's prompt in llama-batched-bench, unless the workload gives the runtime's own."""
NEEDS = {"solo": "llama-bench", "prompt": "llama-bench", "two-decodes": "llama-batched-bench"}
"""The benchmark tool each workload's figures come from (``clients``: both), where it is on PATH."""

if TYPE_CHECKING:
    from strata_cfg.schema.plan import LaunchPlan


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp runs, to match the plan: the stages' GPUs in stage order and the main-model layers
    each holds (stages on one GPU count once, their layers together), and ``visible``, the value of
    ``CUDA_VISIBLE_DEVICES`` that shows llama.cpp those GPUs alone ("": the plan runs on CPU devices, no
    GPU). Unknown (the default): llama.cpp chooses, every GPU visible to it."""

    gpus: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    visible: str | None = None
    host_experts: tuple[int, ...] = ()
    """Model layers whose routed experts llama.cpp keeps in host memory: on each GPU whose routed experts
    do not all fit, its last sparse layers beyond the whole layers its expert cache has slots for."""

    @classmethod
    def of_plan(cls, plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> Placement:
        """The plan's placement, its GPUs named as this process sees them (``environ``, default
        ``os.environ``: through its own ``CUDA_VISIBLE_DEVICES`` where that is set). Raises ValueError when
        a GPU of the plan is not among those."""
        if not all(s.device.startswith("cuda") for s in plan.stages):
            return cls(visible="")
        held: dict[int, int] = {}
        sparse: dict[int, list[int]] = {}
        facts = plan.model.facts
        for s in plan.stages:
            held[s.gpu] = held.get(s.gpu, 0) + s.layers[1] - s.layers[0]
            sparse.setdefault(s.gpu, []).extend(j for j in range(*s.layers) if facts.is_sparse(j))
        host: list[int] = []
        for g in plan.gpus:
            if g.index in sparse and g.experts_resident < g.experts_total:
                host += sparse[g.index][g.experts_resident // max(facts.num_experts, 1) :]
        environ = os.environ if environ is None else environ
        names = [str(g) for g in held]
        if "CUDA_VISIBLE_DEVICES" in environ:
            seen = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
            if any(g >= len(seen) for g in held):
                raise ValueError(
                    f"the plan's GPUs {list(held)} are not all among CUDA_VISIBLE_DEVICES={','.join(seen)}"
                )
            names = [seen[g] for g in held]
        return cls(tuple(held), tuple(held.values()), ",".join(names), tuple(sorted(host)))

    def offload(self) -> list[str]:
        """The arguments that keep `host_experts` in host memory (llama.cpp's tensor override, in the
        names the GGUF export gives them); none where every routed expert fits."""
        if not self.host_experts:
            return []
        blocks = "|".join(str(j) for j in self.host_experts)
        return ["-ot", f"blk\\.({blocks})\\.ffn_(up|down|gate)_exps=CPU"]

    def environment(self) -> dict[str, str]:
        """What to set in llama.cpp's environment: ``CUDA_VISIBLE_DEVICES``, or nothing when unknown."""
        return {} if self.visible is None else {"CUDA_VISIBLE_DEVICES": self.visible}

    def split(self, separator: str) -> list[str]:
        """The split arguments: by layer, in the plan's proportions, over several GPUs (``separator``
        between the shares: ``/`` for llama-bench, ``,`` for the other tools); none on one GPU."""
        if len(self.gpus) < 2:
            return []
        return ["-sm", "layer", "-ts", separator.join(str(n) for n in self.layers)]

    def shown(self, cmd: list[str]) -> list[str]:
        """``cmd`` as a shell line would run it, its environment first."""
        return [f"{k}={v}" for k, v in self.environment().items()] + cmd


@dataclass(frozen=True)
class Workload:
    """What the runtime's arms ran, for llama.cpp to run its counterpart of."""

    name: str
    tokens: int
    """Tokens generated per stream."""
    prompt_tokens: int
    """The ``prompt`` workload's prompt length."""
    repeats: int
    clients: tuple[int, ...]
    """The ``clients`` workload's stream counts."""
    stream_prompt: int = BATCHED_PROMPT
    """Each stream's prompt in llama-batched-bench: the runtime's requests' mean prompt length, so that
    both decode from KV of the same length."""
    placement: Placement = Placement()
    """The plan's devices, which llama.cpp runs on."""
    depth: int = 0
    """The decoding requests' prompt length at ``--depth`` (0: short prompts): llama-bench then generates
    after a KV cache that deep (its ``-d``)."""


@dataclass
class Figure:
    """One llama.cpp figure and the runtime case it stands beside."""

    case: str
    what: str
    tok_s: float


@dataclass
class PeerRun:
    """What llama.cpp measured, the commands it ran, and why a case was left out."""

    figures: list[Figure] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_tools(which: Callable[[str], str | None] = shutil.which) -> dict[str, str]:
    """The llama.cpp benchmark tools on PATH, by name."""
    return {tool: path for tool in TOOLS if (path := which(tool)) is not None}


def skip_reason(tools: dict[str, str], workload: str) -> str | None:
    """Why llama.cpp cannot run beside ``workload`` here, or None."""
    if not tools:
        return "skipped: none of llama-bench, llama-batched-bench or llama-server is on PATH"
    if workload == "clients":
        return None
    if workload not in NEEDS:
        return f"skipped: llama.cpp has no counterpart of the {workload} workload"
    if NEEDS[workload] not in tools and SERVER not in tools:
        return f"skipped: {workload} needs {NEEDS[workload]} or {SERVER}, and neither is on PATH"
    return None


def server_cases(tools: dict[str, str], w: Workload) -> list[ServerCase]:
    """The cases of workload ``w`` that ``llama-server`` runs: those whose benchmark tool is not on PATH
    (none without the server)."""
    if SERVER not in tools:
        return []
    out: list[ServerCase] = []
    if w.name == "prompt" and "llama-bench" not in tools:
        out.append(ServerCase("prompt", 1, w.prompt_tokens, 1))
    if w.name in ("solo", "clients") and "llama-bench" not in tools:
        out.append(ServerCase("solo" if w.name == "solo" else "1 clients", 1, w.stream_prompt, w.tokens))
    streams = {"two-decodes": [2], "clients": [c for c in w.clients if c > 1]}.get(w.name, [])
    if "llama-batched-bench" not in tools:
        for n in streams:
            case = "two-decodes" if w.name == "two-decodes" else f"{n} clients"
            out.append(ServerCase(case, n, w.stream_prompt, w.tokens))
    return out


def commands(tools: dict[str, str], gguf: str, w: Workload) -> list[tuple[str, list[str]]]:
    """(tool, command line) of each llama.cpp run a workload needs (tools missing from PATH: none)."""
    workload, tokens = w.name, w.tokens
    out: list[tuple[str, list[str]]] = []
    bench = tools.get("llama-bench")
    batched = tools.get("llama-batched-bench")
    single = [bench, "-m", gguf, "-ngl", FULL_OFFLOAD, "-r", str(w.repeats), "-o", "json"] if bench else None
    if single:
        single += w.placement.split("/") + w.placement.offload()
    if workload == "prompt" and single:
        out.append(("llama-bench", [*single, "-p", str(w.prompt_tokens), "-n", "0"]))
    if workload in ("solo", "clients") and single:
        depth = ["-d", str(w.depth)] if w.depth else []
        out.append(("llama-bench", [*single, "-p", "0", "-n", str(tokens), *depth]))
    streams = {"two-decodes": [2], "clients": [c for c in w.clients if c > 1]}.get(workload, [])
    if streams and batched:
        ctx = max(streams) * (w.stream_prompt + tokens) + 16
        out.append(
            (
                "llama-batched-bench",
                [batched, "-m", gguf, "-ngl", FULL_OFFLOAD, "-c", str(ctx), "-npp", str(w.stream_prompt)]
                + ["-ntg", str(tokens), "-npl", ",".join(map(str, streams)), "--output-format", "jsonl"]
                + w.placement.split(",")
                + w.placement.offload(),
            )
        )
    return out


def parse_llama_bench(text: str) -> list[Figure]:
    """Figures of ``llama-bench -o json``: one per test, a prompt test (``pp``) or a generation (``tg``)."""
    figures = []
    for test in json.loads(text):
        n_prompt, n_gen, rate = int(test["n_prompt"]), int(test["n_gen"]), float(test["avg_ts"])
        depth = int(test.get("n_depth", 0))
        at = f" @ d{depth}" if depth else ""  # llama-bench's own name of a test at a depth
        if n_gen == 0:
            figures.append(Figure("prompt", f"pp{n_prompt}{at}", rate))
        else:
            figures.append(Figure("solo", f"tg{n_gen}{at}", rate))
    return figures


def parse_batched(text: str, workload: str) -> list[Figure]:
    """Figures of ``llama-batched-bench --output-format jsonl``: the decode rate (``speed_tg``: tokens
    generated by all streams per second of generation) at each stream count."""
    figures = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        streams = int(row["pl"])
        case = "two-decodes" if workload == "two-decodes" else f"{streams} clients"
        what = f"{streams} streams, pp{int(row['pp'])} tg{int(row['tg'])}"
        figures.append(Figure(case, what, float(row["speed_tg"])))
    return figures


def run_peer(
    tools: dict[str, str],
    gguf: str,
    w: Workload,
    run: Callable[..., Any] = subprocess.run,
    serve: Callable[..., Any] = run_server,
) -> PeerRun:
    """Run llama.cpp's tools for workload ``w`` on the GGUF file ``gguf``, and ``llama-server`` for the
    cases whose tool is missing (`server_cases`); a failed tool or server becomes a note."""
    workload = w.name
    out = PeerRun()
    env = None if w.placement.visible is None else {**os.environ, **w.placement.environment()}
    if w.placement.host_experts:
        n = len(w.placement.host_experts)
        out.notes.append(
            f"the routed experts of {n} layers stay in host memory in llama.cpp (-ot): on each GPU as many "
            "layers' experts in VRAM as the plan's expert cache has slots for"
        )
    for tool, cmd in commands(tools, gguf, w):
        out.commands.append(w.placement.shown(cmd))
        done = run(cmd, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
            out.notes.append(f"{tool} exited {done.returncode}: {tail[0]}")
            continue
        parse = parse_llama_bench if tool == "llama-bench" else lambda t: parse_batched(t, workload)
        try:
            found = parse(done.stdout)
        except (ValueError, KeyError, TypeError) as exc:
            out.notes.append(f"{tool}: unreadable output ({exc})")
            continue
        if workload == "clients":  # one stream is the first client count
            found = [Figure("1 clients", f.what, f.tok_s) if f.case == "solo" else f for f in found]
        out.figures += [f for f in found if f.case == workload or workload == "clients"]
    cases = server_cases(tools, w)
    if cases:
        split = w.placement.split(",") + w.placement.offload()
        served = serve(tools[SERVER], gguf, cases, w.repeats, split, env)
        out.commands.append(w.placement.shown(served.command))
        out.figures += [Figure(c.case, c.what, tok_s) for c, tok_s in served.figures]
        out.notes += served.notes
    if workload == "clients":  # in the order of the stream counts, whichever tool measured each
        order = {f"{n} clients": i for i, n in enumerate(w.clients)}
        out.figures.sort(key=lambda f: order.get(f.case, len(order)))
    return out


def beside(figure: Figure, ours: dict[str, dict[str, Any]]) -> tuple[float, str] | None:
    """An arm's figure for ``figure``'s case (``ours``: the arm's summary by case, each with its median
    figures), and what it is: beside llama.cpp's decode figures, which leave out reading the prompt, our
    generation rate where the arm has one; None where the arm has no figure for the case."""
    median = ours.get(figure.case, {}).get("median", {})
    key = "tok_s" if figure.case == "prompt" or "generation_tok_s" not in median else "generation_tok_s"
    mine = median.get(key)
    if not mine or figure.tok_s <= 0:
        return None
    return float(mine), " generating" if key == "generation_tok_s" else ""


def ratios(peer: PeerRun, arms: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each arm's figure over llama.cpp's, by case (``arms``: each arm's summary by case)."""
    out: dict[str, dict[str, float]] = {}
    for arm, ours in arms.items():
        for f in peer.figures:
            mine = beside(f, ours)
            if mine is not None:
                out.setdefault(arm, {})[f.case] = round(mine[0] / f.tok_s, 3)
    return out


def render(peer: PeerRun, arms: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Lines of llama.cpp's figures, each with every arm's figure for the case beside it and the ratio
    (``arms``: each arm's summary by case, in the order they ran)."""
    names = ", ".join(repr(a) for a in arms)
    lines = [f"llama.cpp on the same weights (GGUF, fp16), beside arm{'s' if len(arms) > 1 else ''} {names}:"]
    width = max((len(f.what) for f in peer.figures), default=0)
    for f in peer.figures:
        head = f"  {f.case:>12} {f.what:>{width}}: {f.tok_s:10,.1f} tok/s"
        besides = [(arm, mine) for arm, ours in arms.items() if (mine := beside(f, ours)) is not None]
        if not besides:
            lines.append(head)
        for i, (arm, (tok_s, what)) in enumerate(besides):
            lead = head if i == 0 else " " * len(head)
            lines.append(f"{lead} -> {arm} {tok_s:,.1f} tok/s{what} = {tok_s / f.tok_s:.2f}x")
    lines += [f"  note: {n}" for n in peer.notes]
    lines += ["  ran: " + " ".join(c) for c in peer.commands]
    return lines
