"""The engine's warm-up before serving: the requests that run every window shape serving will run
(`warm_requests`), and how they run (`run_staggered`), so that the first real requests' windows neither
compile kernels nor capture graphs (`strata_runtime.engine.scheduler.Engine.warm_up`)."""

from __future__ import annotations

from collections.abc import Callable

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.windows import warm_prompt_lengths

from ..api import EngineCore, Request, RequestHandle, SamplingParams

WARM_LABEL = "warming up: the decode windows' graphs"
"""What the warm-up's progress reports are labelled."""
WARM_PROMPT = 32
"""Tokens of the prompt the warm-up reads first where it reads no long one."""
WARM_TOKENS = 24
"""Tokens the last of the warm-up's decoding requests generates (each earlier one two more per request after
it, so that all end together): enough for a request alone to try each solo depth."""


def warm_requests(plan: LaunchPlan, vocab: int, cached: bool) -> list[Request]:
    """The requests `Engine.warm_up` runs, in order, for a plan whose model has ``vocab`` tokens; ``cached``:
    whether a stage keeps its routed experts in an expert cache.

    One prompt alone (two prefill chunks, cut to a quarter of the context, where a chunk and that prompt are
    each more than ``memory.prompt_graph_rows`` rows and every expert is in VRAM, so that the prefill path
    runs once before a long prompt needs it, as the bench's warm-up does; else `WARM_PROMPT` tokens); then
    one prompt of each size of prefill graph the stages replay, largest first, each captured then
    (`strata_cfg.schema.windows.warm_prompt_lengths`; none under an expert cache); with n-gram lookup, a
    request alone whose prompt repeats, so that its lookups propose; then a request for every
    slot, greedy, sampled and penalised in turn, each generating two tokens more than the next so that all
    end together (`WARM_TOKENS` the last)."""
    mem = plan.memory
    context, chunk = mem.context, mem.prefill_chunk
    length = min(2 * chunk, context // 4)
    # A short prompt where its chunks would take the graph windows anyway, or where experts stay off
    # VRAM: a long one would read most of them over the host link and teach the cache random routing.
    if cached or min(chunk, length) <= mem.prompt_graph_rows:
        length = min(WARM_PROMPT, max(1, context // 4))
    prompts = [tuple(1 + (7 * i + 3) % (vocab - 1) for i in range(length))]
    lengths = [] if cached else warm_prompt_lengths(mem.prefill_graph_rows, mem.prompt_graph_rows, context)
    prompts += [tuple(1 + (5 * i + 2 + k) % (vocab - 1) for i in range(n)) for k, n in enumerate(lengths)]
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=20, seed=1),
        SamplingParams(presence_penalty=0.5),
    ]
    requests = [Request(p, 1) for p in prompts]
    if plan.spec.ngram:  # a prompt that repeats: lookups find it, so solo windows with proposals run too
        loop = tuple(1 + (13 * j + 5) % (vocab - 1) for j in range(3))
        requests.append(Request(loop * 8, WARM_TOKENS, ignore_eos=True))
    slots = max(plan.batch.slots, 1)
    for i in range(slots):
        ids = tuple(1 + (11 * (i + 1) + j) % (vocab - 1) for j in range(4))
        length = WARM_TOKENS + 2 * (slots - 1 - i)  # every request decodes to about the same end
        length = max(1, min(length, context - len(ids) - 1))
        requests.append(Request(ids, length, kinds[i % len(kinds)], ignore_eos=True))
    return requests


def run_staggered(
    core: EngineCore,
    requests: list[Request],
    report: Callable[[str, float], None] | None = None,
    label: str = WARM_LABEL,
) -> None:
    """Run ``requests`` on ``core`` to their ends, the first alone and each later one joining once the one
    before it has two tokens, so that windows of one request alone and of every number of requests together
    run. ``report`` is told (``label``, fraction done) as each request joins (the caller reports the end).
    Raises RuntimeError if the engine runs out of work before every request finished."""
    handles: list[RequestHandle] = []
    tokens: list[int] = []
    done: list[bool] = []

    def read_events() -> None:
        for i, handle in enumerate(handles):
            while not handle.events.empty():
                event = handle.events.get_nowait()
                tokens[i] += len(event.token_ids)
                done[i] = done[i] or event.finished is not None

    for k, request in enumerate(requests):
        handles.append(core.submit(request))
        tokens.append(0)
        done.append(False)
        # the prompt alone to its end; each later request until it has two tokens, when the next joins
        while not (done[-1] or (k > 0 and tokens[-1] >= 2)) and core.step():
            read_events()
        if report is not None:
            report(label, k / len(requests))
    while core.step():
        read_events()
    read_events()
    if not all(done):
        raise RuntimeError("the warm-up requests did not finish")
