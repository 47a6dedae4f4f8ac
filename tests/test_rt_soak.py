"""A soak of the engine loop: random mixes of requests on random plans, checked after every step.

Each scenario is drawn from its number alone (`draw`), so a failure reproduces by that number:
``STRATA_SOAK_FROM=<n> STRATA_SOAK_SCENARIOS=1 pytest tests/test_rt_soak.py``. CI runs the first
`SCENARIOS` of them, and ``STRATA_SOAK_SCENARIOS`` runs more (a thousand take about 7 minutes on two
cores). On a GPU (``-m gpu``) the first `GPU_SCENARIOS` run again in float16 through the CUDA path
(``STRATA_SOAK_GPU_SCENARIOS``).

A scenario picks a plan (1 to 3 virtual CPU stages, a window mode, drafting by the MTP head, through the
model's LM head or its 8-bit copy, or by lookup in the request's own text, the slots, the context, the prompt
chunk, prefix reuse and a prefix store, the adaptive depth, how many windows run ahead, an expert cache that
keeps half or three quarters of each layer's experts in VRAM, with a helper device holding more of them or
not, uniform or calibrated routing) and 1 to 6 requests arriving at random steps: short prompts and prompts
that fill most of the context, prompts that share a beginning or repeat a stretch, greedy and sampled
requests, presence and frequency penalties, logit biases, stop tokens and stop strings, end-of-text ignored,
log-probabilities of the reply and of the prompt, a JSON schema, a think budget, priorities, cache salts, and
cancellations at random steps.

Checked after every step: each stage's KV, and each drafter's, holds exactly what its slot committed
(`assert_kv_consistent`; on GPUs with pipelined groups, whose stages run on threads of their own, within
the rows of its windows in flight, and exactly once they have finished). Checked at the end:

* no request got an error, and each finished once, with no more tokens than its ``max_tokens`` allows and
  no more than its context holds (the prompt and every token but the last);
* a reply that finished at a stop token ends there without emitting it, and the text of one that
  finished at a stop string holds none of them; a reply under the schema that stopped is complete JSON; a
  think block closes where its budget runs out; a prompt's log-probabilities come one per token but the
  first;
* a greedy request that was not cancelled gives the tokens it gives alone, on one stage, without drafting,
  and one that was cancelled gives a beginning of them;
* every slot is free again, and the engine serves a request after the mix as it would alone.

The first `FAULT_SCENARIOS` (``STRATA_SOAK_FAULT_SCENARIOS``) run again with a fault planted (`draw_fault`):
the host's queuing of a window, or a stage's layers, raises once at a drawn call. The engine recovers
(`Engine.recover`), carrying the requests that held a slot on; every request is checked as above (but one
whose admission the fault broke, which ends with an error), where the plan does not draft a seeded sampled
request that is not cancelled gives the tokens it gives in the mix without the fault, and the self-check
agrees with its reading before the mix.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass, replace
from typing import Any

import pytest
from rt_engine_helpers import Planted, assert_kv_consistent, collect, mode_plan, plant
from rt_plans import float16_profile_text, make_plan

from strata_cfg.plan.from_profile import resolve_text
from strata_cfg.schema.plan import LaunchPlan
from strata_runtime.api import Reasoning, Recovery, Request, RequestHandle, SamplingParams, TokenEvent
from strata_runtime.bad_words import word_ids
from strata_runtime.engine import Engine
from strata_runtime.structured import json_grammar
from strata_runtime.weights.tokenizer import ByteTokenizer

SCENARIOS = int(os.environ.get("STRATA_SOAK_SCENARIOS", "48"))
FAULT_SCENARIOS = int(os.environ.get("STRATA_SOAK_FAULT_SCENARIOS", "24"))
GPU_FAULT_SCENARIOS = int(os.environ.get("STRATA_SOAK_GPU_FAULT_SCENARIOS", "16"))
GPU_SCENARIOS = int(os.environ.get("STRATA_SOAK_GPU_SCENARIOS", "24"))
FIRST = int(os.environ.get("STRATA_SOAK_FROM", "0"))

PRINTABLE = range(32, 127)
"""Prompt tokens (the tiny preset's byte tokenizer reads them as printable text)."""
VOCAB = 384
"""The tiny preset's vocabulary: what a reply's tokens, and so stop tokens, are drawn from."""
EOS = ByteTokenizer(VOCAB).eos_ids
"""End-of-text ids: a reply that chooses one ends there, as at a stop token."""
THINK = (299, 300)
"""A think block's open and close (ids the synthetic vocabulary holds and the model does not favour)."""
GRAMMAR = json_grammar(
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "t": {"enum": ["a", "bc"]}},
        "required": ["n", "t"],
        "additionalProperties": False,
    }
)
"""A small JSON schema: replies under it are complete JSON by the time they stop."""


@dataclass(frozen=True)
class Arrival:
    at: int
    """The engine step before which the request is submitted."""
    request: Request
    cancel_at: int | None
    """The step before which it is cancelled (None: never)."""


@dataclass(frozen=True)
class Scenario:
    number: int
    stages: int
    mode: str
    lookup: bool
    """Drafting by n-gram lookup (``spec.method = "ngram"``) where the mode drafts alone."""
    draft_tokens: int
    slots: int | None
    """Slots where the mode's own number is not kept (None: kept)."""
    context: int
    chunk: int
    prefix_reuse: bool
    adaptive_depth: bool
    run_ahead: int
    expert_cache: int | None
    """Experts of each layer kept in VRAM, of the preset's 8 (None: all)."""
    helper: bool
    """A helper device holding some of the experts the expert cache leaves out (the second tier; on virtual
    CPU devices only, since the GPU run has one card)."""
    routing: str
    prefix_store_mib: int | None
    """Host memory for prompts kept past their slot (`memory.prefix_store_mib`; None: no store)."""
    arrivals: tuple[Arrival, ...]
    int8_head: bool = False
    keep_misses: bool | None = None
    """Whether the cache keeps its misses, written into the plan (None: as the plan resolves, which swaps
    where a cache holds fewer than twice a token's experts a layer, as every cache drawn here does)."""
    """The MTP head drafts through its 8-bit LM head (``spec.draft_head = "int8"``) where it drafts; else as
    the plan resolves (the shared head on virtual CPU devices, the 8-bit one on a GPU holding every
    expert)."""

    def plan(self, vram_mib: int | None = None) -> LaunchPlan:
        """The scenario's plan on virtual CPU devices, or with ``vram_mib`` (the card's) in float16 on the
        one GPU, every stage on it."""
        kw: dict[str, Any] = {
            "preset": "tiny",
            "context": self.context,
            "prefill_chunk": self.chunk,
            "prefix_reuse": self.prefix_reuse,
            "adaptive_depth": self.adaptive_depth,
            "run_ahead": self.run_ahead,
            "expert_cache": self.expert_cache,
            "routing": self.routing,
            "prefix_store_mib": self.prefix_store_mib,
        }
        if self.keep_misses is not None:
            kw["cache_policy"] = {"keep_misses": self.keep_misses}
        if self.mode in ("solo", "serial", "pipelined"):
            kw["draft_tokens"] = self.draft_tokens
        if self.slots is not None:
            kw["slots"] = self.slots
        if self.helper and vram_mib is None:
            kw.update(helpers=1, helper_vram_mib=1)
        make = make_plan if vram_mib is None else functools.partial(on_one_gpu, vram_mib)
        plan = mode_plan(self.mode, self.stages, make, **kw)
        if self.lookup:
            spec = plan.spec.model_copy(update={"mtp": False, "ngram": True, "ngram_min": 2, "ngram_max": 4})
            plan = plan.model_copy(update={"spec": spec})
        elif self.int8_head and (plan.spec.mtp or plan.batch.mtp):
            plan = plan.model_copy(update={"spec": plan.spec.model_copy(update={"draft_head": "int8"})})
        return plan


def on_one_gpu(vram_mib: int, **kw: Any) -> LaunchPlan:
    """`make_plan`'s plan of keywords ``kw`` in float16 on a GPU of ``vram_mib``, each stage resolved as a
    GPU of its own and then placed on the one (a pipelined plan is resolved for as many GPUs, as the
    resolver runs a split of one GPU one request at a time)."""
    plan = resolve_text(float16_profile_text(vram_mib=vram_mib, **kw), "soak.toml").plan
    text = plan.model_dump_json()
    for device in range(1, kw.get("stages", 1)):
        text = text.replace(f'"cuda:{device}"', '"cuda:0"')
    return LaunchPlan.model_validate_json(text)


def _prompt(g: random.Random, context: int, shared: list[int], loop: list[int]) -> tuple[int, ...]:
    """Short (most), long (up to the context less one), or built from the scenario's shared beginning and
    a stretch repeated (what lookups and prefix copies read)."""
    kind = g.random()
    if kind < 0.45:
        return tuple(g.choice(PRINTABLE) for _ in range(g.randint(1, 24)))
    if kind < 0.65:
        n = g.randint(context // 2, context - 1)
        return tuple(g.choice(PRINTABLE) for _ in range(n))
    head = shared[: g.randint(1, len(shared))]
    body = loop * g.randint(1, 4) + [g.choice(PRINTABLE) for _ in range(g.randint(0, 6))]
    return tuple((head + body)[: context - 1])


def _sampling(g: random.Random) -> SamplingParams:
    kw: dict[str, Any] = {}
    if g.random() < 0.4:
        kw["temperature"] = g.choice([0.3, 0.7, 1.0, 1.3])
        kw["top_k"] = g.choice([0, 0, 3, 20])
        kw["top_p"] = g.choice([1.0, 1.0, 0.8])
        kw["seed"] = g.choice([None, g.randrange(1 << 30)])
    if g.random() < 0.2:
        kw["presence_penalty"] = g.choice([0.5, 1.5])
        kw["frequency_penalty"] = g.choice([0.0, 0.4])
    if g.random() < 0.2:
        kw["logit_bias"] = tuple((g.choice(PRINTABLE), g.choice([-100.0, -2.0, 3.0])) for _ in range(2))
    if g.random() < 0.15:
        kw["logprobs"] = g.choice([0, 2])
    if g.random() < 0.08:
        kw["prompt_logprobs"] = g.choice([0, 1])
    if g.random() < 0.1:
        kw["grammar"] = GRAMMAR
    elif g.random() < 0.08:  # a think block opened by the prompt, closed when its budget runs out
        kw["reasoning"] = Reasoning(THINK[0], THINK[1], True, g.choice([None, 1, 4, 9]))
    return SamplingParams(**kw)


def _extras(
    g: random.Random, sampling: SamplingParams, max_tokens: int, stop_ids: tuple[int, ...] = ()
) -> SamplingParams:
    """The sampling controls added after the scenarios were first numbered, drawn from a stream of their own
    (so every other draw of a numbered scenario stays as it was): min-p, a repetition penalty, a reply held
    off its stop tokens for its first tokens (``min_tokens``), bad words of one to three printable bytes,
    and ``allowed_token_ids`` (printable bytes, one at least neither a stop token nor a one-byte bad word,
    and sometimes end-of-text)."""
    kw: dict[str, Any] = {}
    if sampling.temperature > 0 and g.random() < 0.3:
        kw["min_p"] = g.choice([0.05, 0.3, 1.0])
    if g.random() < 0.15:
        kw["repetition_penalty"] = g.choice([0.8, 1.3, 5.0])
    if g.random() < 0.2:
        kw["min_tokens"] = g.randint(1, max_tokens)
    if g.random() < 0.2:
        kw["bad_words"] = tuple(
            "".join(chr(g.choice(range(33, 127))) for _ in range(g.randint(1, 3)))
            for _ in range(g.randint(1, 3))
        )
    if g.random() < 0.12:
        banned = {ord(w) for w in kw.get("bad_words", ()) if len(w) == 1} | set(stop_ids)
        some = [t for t in PRINTABLE if t not in banned and t != 32]
        allowed = {g.choice(some)} | {g.choice(PRINTABLE) for _ in range(g.randint(2, 12))}
        kw["allowed_token_ids"] = tuple(sorted(allowed | ({EOS[0]} if g.random() < 0.5 else set())))
    return replace(sampling, **kw)


def draw(number: int) -> Scenario:
    """Scenario ``number``: the same plan and requests every time."""
    g, helper_draw = random.Random(number), random.Random(f"{number} helper")
    head_draw = random.Random(f"{number} draft head")  # apart too, as the helper's
    keep_draw = random.Random(f"{number} keep misses")
    stages = g.choice([1, 1, 2, 3])
    modes = ["solo", "serial", "pipelined", "batch-mtp"] + (["pipelined-mtp"] if stages > 1 else [])
    mode = g.choice(modes)
    lookup = mode in ("solo", "serial", "pipelined") and g.random() < 0.5
    draft_tokens = g.choice([0, 3, 5]) if mode in ("solo", "serial", "pipelined") else 3
    lookup = lookup and draft_tokens > 0
    slots = g.choice([None, None, 2, 8]) if mode in ("serial", "pipelined", "batch-mtp") else None
    context = g.choice([64, 96, 128])
    chunk = g.choice([8, 16, 32])
    shared = [g.choice(PRINTABLE) for _ in range(g.randint(4, 40))]
    loop = [g.choice(PRINTABLE) for _ in range(g.randint(2, 6))]
    arrivals = []
    for i in range(g.randint(1, 6)):
        at = g.randint(0, 24)
        stops: dict[str, Any] = {}
        if g.random() < 0.2:
            stops["stop_ids"] = tuple(g.randrange(VOCAB) for _ in range(g.randint(1, 8)))
        if g.random() < 0.2:
            stops["stop_strings"] = tuple(
                "".join(chr(g.choice(PRINTABLE)) for _ in range(g.randint(1, 2)))
                for _ in range(g.randint(1, 2))
            )
        prompt, max_tokens, sampling = (
            _prompt(g, context, shared, loop),
            g.choice([1, 2, 5, 16, 40, 90]),
            _sampling(g),
        )
        sampling = _extras(
            random.Random(f"{number} {i} sampling extras"), sampling, max_tokens, stops.get("stop_ids", ())
        )
        request = Request(
            prompt,
            max_tokens,
            sampling,
            request_id=f"s{number}-{i}",
            priority=g.choice([0, 0, 0, 1]),
            ignore_eos=g.random() < 0.1,
            cache_salt=g.choice(["", "", "", "other party"]),
            **stops,
        )
        cancel_at = at + g.randint(0, 30) if g.random() < 0.15 else None
        arrivals.append(Arrival(at, request, cancel_at))
    return Scenario(
        number,
        stages,
        mode,
        lookup,
        draft_tokens,
        slots,
        context,
        chunk,
        prefix_reuse=g.random() < 0.7,
        adaptive_depth=g.random() < 0.5,
        run_ahead=g.choice([1, 2, 2, 4]),
        expert_cache=(cache := g.choice([None, None, None, 4, 6])),
        # drawn apart, so that adding the helper left every other draw of a numbered scenario as it was
        helper=cache is not None and mode in ("solo", "serial", "pipelined") and helper_draw.random() < 0.3,
        routing=g.choice(["uniform", "uniform", "calibrated"]),
        prefix_store_mib=g.choice([None, None, 1]),
        arrivals=tuple(arrivals),
        int8_head=head_draw.random() < 0.5,
        keep_misses=True if keep_draw.random() < 0.5 else None,
    )


@functools.cache
def _alone_engine(context: int, chunk: int, routing: str, vram_mib: int | None) -> Engine:
    kw: dict[str, Any] = {
        "context": context,
        "prefill_chunk": chunk,
        "prefix_reuse": False,
        "routing": routing,
    }
    if vram_mib is None:
        return Engine(make_plan(stages=1, **kw))
    return Engine(on_one_gpu(vram_mib, preset="tiny", stages=1, **kw))


def alone(request: Request, s: Scenario, vram_mib: int | None = None) -> tuple[int, ...]:
    """The request's tokens alone on scenario ``s``'s model and context: one stage, one slot, no drafting, no
    prefix kept. On virtual CPU devices its prompt is read in chunks of 16 whatever the scenario's chunk (the
    array path's rows do not depend on the rows beside them); on the GPU (``vram_mib``) in the scenario's
    chunks, since fp16 products there may route a prompt row whose experts nearly tie otherwise."""
    chunk = 16 if vram_mib is None else s.chunk
    return tuple(collect(_alone_engine(s.context, chunk, s.routing, vram_mib), [(0, request)])[0])


@dataclass
class Reply:
    tokens: list[int]
    text: str
    finished: list[str]
    events: list[TokenEvent]


def assert_kv_within_flights(eng: Engine) -> None:
    """The KV check of pipelined groups on GPUs, whose stages each run a window on a thread of their own and
    write its KV as they do: between two steps a stage may already hold rows that a later stage has not
    reached. Each stage holds at least what the slot committed (or, free, kept for prefix reuse) and at most
    that and every row of the slot's windows in flight."""
    flying = (*eng._chain, *eng._flights)
    for i, slot in enumerate(eng.slots):
        if slot is None:
            kept = eng.prefixes.kept[i]
            base = 0 if kept is None else len(kept.tokens)
        else:
            base = slot.length
        rows = sum(len(e.tokens) for f in flying for e in f.job.entries if e.slot.id == i)
        lengths = eng.model.kv_lengths(i)
        assert all(base <= n <= base + rows for n in lengths), (i, base, rows, lengths)


@dataclass(frozen=True)
class Fault:
    where: str
    """``launch`` (the host queuing a window), ``forward`` (a stage's layers, while a window runs) or
    ``admit`` (a request taking its slot)."""
    stage: int
    at: int
    """The call, from 1, that raises."""


def draw_fault(s: Scenario) -> Fault:
    g = random.Random(f"{s.number} fault")
    where = g.choice(["launch", "launch", "forward", "forward", "admit"])
    return Fault(where, g.randrange(s.stages), g.randint(1, 14 if where != "admit" else 4))


def plant_fault(eng: Engine, fault: Fault) -> list[int]:
    """`plant` ``fault`` (`unplant` takes it out)."""
    return plant(_owner(eng, fault), fault.where, fault.at)


def unplant(eng: Engine, fault: Fault) -> None:
    delattr(_owner(eng, fault), fault.where)


def _owner(eng: Engine, fault: Fault) -> Any:
    return eng.executor if fault.where in ("launch", "admit") else eng.model.stages[fault.stage]


def run(eng: Engine, arrivals: tuple[Arrival, ...], held: set[int] | None = None) -> list[Reply]:
    """Submit and cancel each request at its step, run to the end, checking the KV after every step (on GPUs
    with pipelined groups, within the windows in flight: `assert_kv_within_flights`; once every request has
    finished, exactly). With ``held``, a step that raises `Planted` is recovered from (`Engine.recover`,
    which must carry every request on), and the arrivals whose requests held a slot then are added to it;
    without, it fails the run."""
    threaded = eng.pipelined and any(stage.device.is_cuda for stage in eng.model.stages)
    check_kv = assert_kv_within_flights if threaded else assert_kv_consistent
    handles: list[RequestHandle | None] = [None] * len(arrivals)
    replies = [Reply([], "", [], []) for _ in arrivals]
    step = 0
    while True:
        for i, a in enumerate(arrivals):
            if handles[i] is None and a.at <= step:
                handles[i] = eng.submit(a.request)
            handle = handles[i]
            if handle is not None and a.cancel_at is not None and a.cancel_at <= step:
                handle.cancel()
        try:
            busy = eng.step()
        except Planted as exc:
            if held is None:
                raise
            holding = [slot for slot in eng.slots if slot is not None and not slot.told]
            held |= {i for i, h in enumerate(handles) if any(h is slot.handle for slot in holding)}
            ending = sum(slot.finished is not None for slot in holding)  # (its end decided, not yet sent)
            assert eng.recover(exc) == Recovery(resumed=len(holding) - ending, ended=0)
            assert eng.self_check() is None, "the model computes what it did at start"
            busy = True
        step += 1
        assert step < 20_000, "the engine keeps stepping"
        if not any(f.error is not None for f in (*eng._chain, *eng._flights)):  # (a failed window's
            check_kv(eng)  # stages hold what they wrote before it failed, until its finish raises)
        for handle, reply in zip(handles, replies, strict=True):
            while handle is not None and not handle.events.empty():
                ev = handle.events.get()
                reply.events.append(ev)
                reply.tokens += ev.token_ids
                reply.text += ev.text
                if ev.finished is not None:
                    reply.finished.append(ev.finished)
        if not busy and all(h is not None for h in handles):
            break
    assert all(s is None for s in eng.slots), "every slot is free at the end"
    assert_kv_consistent(eng)
    return replies


def check_reply(a: Arrival, reply: Reply, context: int) -> None:
    req = a.request
    assert all(ev.error is None for ev in reply.events), [ev.error for ev in reply.events]
    assert len(reply.finished) == 1, reply.finished
    (finished,) = reply.finished
    assert finished in ("stop", "length", "cancelled")
    assert len(reply.tokens) <= req.max_tokens
    # The context holds the prompt and every token but the last, which no window needs to read.
    assert len(req.prompt_ids) + len(reply.tokens) <= context + 1
    if finished == "cancelled":
        assert a.cancel_at is not None
    if finished == "length":
        assert len(reply.tokens) == req.max_tokens or len(req.prompt_ids) + len(reply.tokens) == context + 1
    stop = reply.events[-1].stop
    if isinstance(stop, int):
        assert finished == "stop" and (stop in req.stop_ids or stop in EOS), stop
    if isinstance(stop, str):
        assert finished == "stop" and stop in req.stop_strings, stop
    assert not any(t in req.stop_ids for t in reply.tokens), "a stop token ends a reply and is not emitted"
    # No stop string is emitted, but within the text of the first min_tokens tokens, where none counts.
    held = len(ByteTokenizer(VOCAB).decode(reply.tokens[: req.sampling.min_tokens]))
    ends = [
        i + len(s) for s in req.stop_strings for i in range(len(reply.text)) if reply.text.startswith(s, i)
    ]
    assert all(end <= held for end in ends), "no stop string is emitted past the held text"
    if req.sampling.logprobs is not None:
        for ev in reply.events:
            assert len(ev.logprobs) == len(ev.token_ids)
    if req.sampling.prompt_logprobs is not None and finished != "cancelled":
        assert len(reply.events[0].prompt_logprobs) == len(req.prompt_ids) - 1, (
            "one per prompt token but the first"
        )
    if req.ignore_eos:
        assert not isinstance(stop, int) or stop not in EOS or stop in req.stop_ids
    if req.sampling.grammar is not None and finished == "stop" and not req.stop_ids and not req.stop_strings:
        assert json.loads(reply.text).keys() == {"n", "t"}, "the grammar's reply is complete"
    if isinstance(stop, int) and req.sampling.grammar is None:  # no stop token before min_tokens (a
        # grammar's end wins over it: `HoldStops`)
        assert len(reply.tokens) >= req.sampling.min_tokens, (len(reply.tokens), req.sampling.min_tokens)
    allowed = req.sampling.allowed_token_ids
    if allowed is not None and req.sampling.grammar is None:  # (a spent think budget's close is forced)
        closes = {THINK[1]} if req.sampling.reasoning is not None else set()
        assert set(reply.tokens) <= set(allowed) | closes, sorted(set(reply.tokens) - set(allowed))
    words = word_ids(req.sampling.bad_words, ByteTokenizer(VOCAB)) if req.sampling.grammar is None else []
    for word in words:  # (where a grammar allows only a banned token, the grammar wins)
        n = len(word)
        assert all(tuple(reply.tokens[i : i + n]) != word for i in range(len(reply.tokens) - n + 1)), word
    budget = req.sampling.reasoning.budget if req.sampling.reasoning is not None else None
    if budget is not None and len(reply.tokens) > budget and finished != "cancelled":
        assert THINK[1] in reply.tokens[: budget + 1], "the think block closes where its budget runs out"


def soak(s: Scenario, vram_mib: int | None = None) -> None:
    """Run scenario ``s`` (on the GPU with ``vram_mib``) and check what the module's docstring says."""
    eng = Engine(s.plan(vram_mib))
    replies = run(eng, s.arrivals)
    for a, reply in zip(s.arrivals, replies, strict=True):
        check_reply(a, reply, s.context)
        if a.request.sampling.temperature > 0:
            continue
        reference = alone(a.request, s, vram_mib)
        if reply.finished == ["cancelled"]:
            assert tuple(reply.tokens) == reference[: len(reply.tokens)], a.request.request_id
        else:
            assert tuple(reply.tokens) == reference, (a.request.request_id, s)
    # After the mix, the engine serves a greedy request as it would alone (nothing left behind).
    after = Request(s.arrivals[0].request.prompt_ids, 12, request_id="after")
    (reply,) = run(eng, (Arrival(0, after, None),))
    assert tuple(reply.tokens) == alone(after, s, vram_mib)
    eng.close()


@pytest.mark.parametrize("number", range(FIRST, FIRST + SCENARIOS))
def test_a_random_mix_of_requests_runs_as_each_would_alone(number: int) -> None:
    soak(draw(number))


@pytest.mark.parametrize("number", range(FIRST, FIRST + FAULT_SCENARIOS))
def test_a_random_mix_with_a_failed_step_carries_what_it_held_on_and_serves_every_request_as_alone(
    number: int,
) -> None:
    """The scenario with a fault planted where a bug would raise (`draw_fault`): the requests that held a
    slot when it came are carried on, and every request is served as in the soak (greedy ones with their
    text alone), but one whose admission the fault broke, which ends with an error; the engine after them
    serves as alone; the self-check agrees after the recovery."""
    fault_soak(draw(number))


@pytest.mark.gpu
@pytest.mark.parametrize("number", range(FIRST, FIRST + GPU_FAULT_SCENARIOS))
def test_a_random_mix_on_the_gpu_with_a_failed_step_carries_what_it_held_on_and_serves_every_request(
    number: int,
) -> None:
    """The same on the one GPU: the recovery waits for windows queued ahead on the streams."""
    cp = pytest.importorskip("cupy")
    fault_soak(draw(number), cp.cuda.runtime.memGetInfo()[1] // (1 << 20))


def fault_soak(s: Scenario, vram_mib: int | None = None) -> None:
    fault = draw_fault(s)
    plan = s.plan(vram_mib)
    # Without drafting, a seeded reply's tokens follow its own draws alone: the run without the fault gives
    # them too (with drafting, which windows carry proposals can differ after the recovery).
    drafts = plan.batch.mtp or plan.windows.solo_rows > 1
    sound = None if drafts else run(Engine(plan), s.arrivals)
    eng = Engine(plan)
    assert eng.self_check() is None
    calls = plant_fault(eng, fault)
    held: set[int] = set()
    replies = run(eng, s.arrivals, held)
    unplant(eng, fault)
    assert bool(held) <= (calls[0] >= fault.at), "only the planted fault stops requests"
    for i, (a, reply) in enumerate(zip(s.arrivals, replies, strict=True)):
        sampling = a.request.sampling
        reference = alone(a.request, s, vram_mib) if sampling.temperature == 0 else None
        error = reply.events[-1].error or ""
        if reply.finished == ["error"] and "while admitting this request" in error:
            assert "planted" in error and not reply.tokens
            continue
        check_reply(a, reply, s.context)
        if reference is not None and reply.finished != ["cancelled"]:
            assert tuple(reply.tokens) == reference, (a.request.request_id, s, fault)
        if sound is not None and reference is None and sampling.seed is not None and a.cancel_at is None:
            assert reply.tokens == sound[i].tokens, (a.request.request_id, s, fault)
    after = Request(s.arrivals[0].request.prompt_ids, 12, request_id="after")
    (reply,) = run(eng, (Arrival(0, after, None),))
    assert tuple(reply.tokens) == alone(after, s, vram_mib)


@pytest.mark.gpu
@pytest.mark.parametrize("number", range(FIRST, FIRST + GPU_SCENARIOS))
def test_a_random_mix_of_requests_on_the_gpu_runs_as_each_would_alone(number: int) -> None:
    """The same scenarios in float16 through the CUDA path, every stage on the one GPU: windows replayed as
    CUDA graphs, decided on the device and run ahead of the host."""
    cp = pytest.importorskip("cupy")
    soak(draw(number), cp.cuda.runtime.memGetInfo()[1] // (1 << 20))
