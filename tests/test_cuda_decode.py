"""The CUDA decode path against the float32 reference path, and greedy exactness on the GPU.

The reference is the same model on a virtual CPU device (the NumPy array path in float32, from the same
weights): a window through the CUDA graphs must give the same logits within fp16 KV tolerance, replaying a
captured graph must give bit-identical results, and greedy text on the GPU must not depend on drafting or on
which slots share a window.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from rt_engine_helpers import record_unreplayed

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _wide_model_dir(tmp_path, seed: int) -> str:
    """A small checkpoint whose widths take the kernels' vectorised paths (multiples of 256)."""
    from safetensors.numpy import save_file

    from strata_runtime.models.qwen3_moe import ModelArgs, stage_shapes

    config = {
        "model_type": "qwen3_moe",
        "vocab_size": 1000,
        "hidden_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "moe_intermediate_size": 256,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_nextn_predict_layers": 1,
    }
    args = ModelArgs.from_config(config)
    g = np.random.default_rng(seed)
    tensors = {}
    for name, shape in stage_shapes(args, (0, 3), first=True, last=True, mtp=True).items():
        base = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.0
        tensors[name] = (base + 0.05 * g.standard_normal(shape)).astype(np.float16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _plan(
    cp,
    *,
    model: str,
    slots=1,
    batch_mtp=False,
    draft_tokens=0,
    backend="cuda",
    chunk=64,
    context=512,
    routing="uniform",
    split=None,
    adaptive_depth=False,
    method="mtp",
):
    """``split``: the first layer of a second stage on the same GPU (a solo-mode test split).
    ``adaptive_depth`` is off unless asked for: with it, the solo depth follows measured window times, so
    which windows run (not the greedy text) differs from run to run."""
    from strata_cfg.plan.from_profile import resolve_text

    vram = cp.cuda.runtime.memGetInfo()[1] // (1 << 20)
    src = f'synthetic = "{model}"' if not model.startswith("/") else f"path = {json.dumps(model)}"
    text = f"""name = "gpu-test"
[machine]
backend = "{backend}"
gpus = [{{ name = "GPU", vram_mib = {vram}, bandwidth_gbs = 1000 }}]
[model]
{src}
dtype = "float16"
routing = "{routing}"
[batch]
slots = {slots}
mtp = {"true" if batch_mtp else "false"}
[spec]
method = "{method}"
draft_tokens = {draft_tokens}
adaptive_depth = {"true" if adaptive_depth else "false"}
[memory]
context = {context}
prefill_chunk = {chunk}
[serve]
"""
    if split is not None:
        text += f"[split]\nlayers = [{split}]\ntest_shared_gpu = true\n"
    return resolve_text(text, "gpu-test.toml").plan


@pytest.fixture(params=["tiny", "small", "wide"])
def model_src(request, tmp_path):
    return _wide_model_dir(tmp_path, seed=11) if request.param == "wide" else request.param


class RoutingMargins:
    """Records, for each row of the windows a CPU reference model runs, the smallest margin of its routing:
    over every MoE layer, the k-th largest router logit minus the (k+1)-th (float64, from the layer's
    input). A row whose margin is small may route to other experts under a few 1e-3 of rounding."""

    def __init__(self, model) -> None:
        self.rows: np.ndarray | None = None
        for stage in model.stages:
            for layer in stage.layers:
                if hasattr(layer.mlp, "route"):
                    layer.mlp.route = self._recording(layer.mlp)

    def _recording(self, block):
        real = block.route

        def route(xp, x, bias=None):
            logits = np.asarray(x, np.float64) @ np.asarray(block.gate, np.float64).T  # [R, E]
            if bias is not None:  # calibrated routing: the margin of the biased logits
                logits += bias(np.zeros(logits.shape, np.float32))
            top = -np.sort(-logits, axis=-1)
            gap = top[:, block.top_k - 1] - top[:, block.top_k]  # [R]
            self.rows = gap if self.rows is None else np.minimum(self.rows, gap)
            return real(xp, x, bias)

        return route

    def take(self, rows: int) -> np.ndarray:
        """The margins of the last window's rows, and start afresh."""
        out, self.rows = self.rows, None
        return np.full(rows, np.inf) if out is None else out


DECIDED = 1e-2
"""A routing margin at or above this is decided: rounding does not flip it. The CUDA paths' products read
fp16 and accumulate in fp32, which moves each layer's output by ~1e-3 relative and the router logits by a few
1e-3 over a few layers; rows whose top-k was flipped had margins up to 8e-3 (measured on tiny, small and the
wide checkpoint with the kernels' NumPy references standing in for the kernels)."""
ROW_TOLERANCE = 5e-3
"""Relative error of a row's logits when it and every earlier row of its slot routed as the reference: fp16
products cost ~1e-3 per layer (measured at most 2e-3 on these models with the references as kernels)."""
MEDIAN_TOLERANCE = 5e-3
"""The median row: a row that follows a row routed differently attends over keys and values that differ
(its logits by up to 0.1 on the wide checkpoint), so rows are compared one by one only where nothing before
them in their slot was undecided; the median over all rows bounds the rest (measured 1e-3 to 2.4e-3)."""


def clean_rows(layout, margins: np.ndarray, first_undecided: dict[int, int]) -> np.ndarray:
    """Rows whose routing is decided and that follow no undecided row of their slot (in any window so far,
    kept in ``first_undecided``: slot -> first such position)."""
    from strata_runtime.layout import Layout

    segments = Layout.of(layout).segments
    slots = np.concatenate([np.full(s.n, s.slot) for s in segments])
    positions = Layout.of(layout).positions()
    for slot, pos, m in zip(slots, positions, margins, strict=True):
        if m < DECIDED:
            first_undecided[int(slot)] = min(first_undecided.get(int(slot), 1 << 62), int(pos))
    limit = np.array([first_undecided.get(int(s), 1 << 62) for s in slots])
    return (margins >= DECIDED) & (positions < limit)


def _window(model, layout_runs, tokens):
    from strata_runtime.layout import Layout

    layout = Layout.of(layout_runs)
    normed = model.forward(np.asarray(tokens, np.int64), layout)
    logits = model.logits(normed)
    return np.asarray(logits.get() if hasattr(logits, "get") else logits)


def test_cuda_window_matches_the_float32_reference_and_replays_exactly(cp, model_src):
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model=model_src, slots=2))
    reference = Model.from_plan(_plan(cp, model=model_src, slots=2, backend="cpu"))
    assert model.stages[0].cuda is not None, model.stages[0].cuda_refused
    g = np.random.default_rng(21)
    vocab = model.args.vocab_size
    prompt = g.integers(1, vocab, 20).tolist()
    for m in (model, reference):
        _window(m, [(0, 20, 0)], prompt)  # a short prompt: 8-row CUDA windows on the GPU
    rows = g.integers(1, vocab, 3).tolist()

    results = []
    for _ in range(3):  # eager, captured, replayed
        model.rewind(0, 20)
        results.append(_window(model, [(0, 3, 20)], rows))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])

    expected = _window(reference, [(0, 3, 20)], rows)
    err = np.linalg.norm(results[0] - expected) / np.linalg.norm(expected)
    assert err < 1e-2, err


def _generate(plan, prompts, max_tokens=24):
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    engine = Engine(plan)
    handles = [engine.submit(Request(tuple(p), max_tokens)) for p in prompts]
    while engine.step():
        pass
    out = []
    for h in handles:
        ids = []
        while not h.events.empty():
            ids += list(h.events.get().token_ids)
        out.append(ids)
    return out, engine


def test_greedy_text_on_gpu_does_not_depend_on_drafting_or_batching(cp):
    g = np.random.default_rng(22)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 2)]
    plain, _ = _generate(_plan(cp, model="tiny", slots=2), prompts)
    drafted, engine = _generate(_plan(cp, model="tiny", slots=2, batch_mtp=True, draft_tokens=4), prompts)
    assert all(len(t) == 24 for t in plain)
    assert drafted == plain
    assert engine.totals["accepted"] > 0
    solo = [_generate(_plan(cp, model="tiny", slots=1, draft_tokens=6), [p])[0][0] for p in prompts]
    assert solo == plain


@pytest.mark.parametrize("split", [None, 2])
def test_greedy_text_drafted_by_lookup_on_gpu_is_the_text_without_drafting(cp, split):
    """``spec.method = "ngram"`` on the GPU (one stage and two): prompts that end in a loop, so that lookups
    propose from the first window; the host verifies the proposals by the device's choices, and the text is
    the plain text. A seeded sampled request drafted so repeats its text."""
    from strata_runtime.api import Request, SamplingParams

    g = np.random.default_rng(26)
    loop = g.integers(1, 250, 5).tolist()
    prompts = [g.integers(1, 250, 8).tolist() + loop * 4 for _ in range(3)]
    plain, _ = _generate(_plan(cp, model="tiny", split=split), prompts, 64)
    plan = _plan(cp, model="tiny", split=split, draft_tokens=5, method="ngram", adaptive_depth=True)
    looked, engine = _generate(plan, prompts, 64)
    assert plan.spec.ngram and not plan.spec.mtp and engine.model.mtp is None
    assert looked == plain
    assert engine.totals["accepted"] > 0, engine.totals
    sampled = SamplingParams(temperature=0.8, seed=3)
    texts = []
    for _ in range(2):
        h = engine.submit(Request(tuple(prompts[0]), 40, sampled))
        while engine.step():
            pass
        texts.append([t for _ in range(h.events.qsize()) for t in h.events.get().token_ids])
    assert texts[0] == texts[1] and len(texts[0]) == 40


@pytest.mark.parametrize("split", [None, 2])
def test_the_adaptive_solo_depth_on_gpu_keeps_the_greedy_text_and_measures_its_windows(cp, split):
    """With ``spec.adaptive_depth`` each solo window's depth follows the measured window times on the GPU
    (on one stage and across two): the text is the fixed depth's, and the times it chose by are those of
    the windows it ran."""
    g = np.random.default_rng(24)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 3)]
    fixed, _ = _generate(_plan(cp, model="tiny", draft_tokens=4, split=split), prompts, 48)
    adaptive, engine = _generate(
        _plan(cp, model="tiny", draft_tokens=4, split=split, adaptive_depth=True), prompts, 48
    )
    assert adaptive == fixed and engine.choice.adaptive
    measured = engine.stats()["solo_window_ms"]["greedy"]
    ran = Counter(w.rows for w in engine.windows if w.kind == "solo")
    # A window in flight while some shape ran for the first time (its graph captured) is not timed, so a
    # row count that ran only then has no time; the row count that ran most has some window timed.
    assert set(measured) <= {str(r) for r in ran} and all(ms > 0 for ms in measured.values())
    most = max(ran, key=lambda r: ran[r])
    assert ran[most] >= 6 and str(most) in measured, (measured, ran)  # 48 tokens x 3 in <= 5-row windows
    solo = sum(1 for w in engine.windows if w.kind == "solo")
    assert sum(engine.totals["solo_by_proposals"].values()) == solo


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_text_on_gpu_does_not_depend_on_the_depths_drafted(cp, monkeypatch, split, seed):
    """Solo windows at random, seeded depths and run ends (where the adaptive depth chooses by measured
    times, which differ from run to run) give the fixed depth's greedy text on the GPU: every kernel gives a
    row the same result whatever the window's row count, and verification holds only what greedy windows
    would have chosen. The first differing token is named, with the windows that ran."""
    from strata_runtime.engine import speculative

    g = np.random.default_rng(24)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 3)]
    fixed, _ = _generate(_plan(cp, model="tiny", draft_tokens=4, split=split), prompts, 48)
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(speculative, "best_depth", lambda holds, costs, most: int(rng.integers(0, most + 1)))
    monkeypatch.setattr(speculative, "worth_switching", lambda *a: bool(rng.random() < 0.5))
    adaptive, engine = _generate(
        _plan(cp, model="tiny", draft_tokens=4, split=split, adaptive_depth=True), prompts, 48
    )
    for i, (a, f) in enumerate(zip(adaptive, fixed, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, f, strict=False)) if x != y), None)
        assert first is None and len(a) == len(f) == 48, (
            f"prompt {i}: first differing token {first} ({a[first] if first is not None else '-'} against "
            f"{f[first] if first is not None else '-'}); solo windows' rows: "
            f"{[w.rows for w in engine.windows if w.kind == 'solo']}"
        )
    assert len({w.rows for w in engine.windows if w.kind == "solo"}) >= 3  # several depths ran


def _run_ahead(plan, run_ahead: int):
    return plan.model_copy(update={"batch": plan.batch.model_copy(update={"run_ahead": run_ahead})})


@pytest.mark.parametrize("split", [None, 2])
def test_windows_running_ahead_on_gpu_give_the_text_of_windows_one_at_a_time(cp, split):
    """Greedy and seeded sampling (with top-k and top-p too, and min-p), one and several slots, on one stage
    and on two stages of one GPU (the chained window's tokens then cross from the last stage's stream to the
    first's). Min-p 1 leaves a hot request the greedy text."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine

    g = np.random.default_rng(23)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 3)]
    samplings = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=1.2, top_p=0.9, top_k=50, seed=6),
        SamplingParams(temperature=1.3, min_p=0.1, top_p=0.95, seed=7),
    ]
    for slots in (1, 3):
        plan = _plan(cp, model="tiny", slots=slots, split=split)
        texts = []
        for ahead in (1, 3):
            engine = Engine(_run_ahead(plan, ahead))
            handles = [
                engine.submit(Request(tuple(p), 30, sampling=samplings[(i + slots) % 4]))
                for i, p in enumerate(prompts[:slots])
            ]
            most = 0
            while engine.step():
                most = max(most, len(engine._chain))
            assert most == (ahead if ahead > 1 else 0)  # after a step: run_ahead windows queued, or none
            texts.append([[t for ev in list(h.events.queue) for t in ev.token_ids] for h in handles])
        assert texts[0] == texts[1]
        assert all(len(t) == 30 for t in texts[0])
    greedy, _ = _generate(_plan(cp, model="tiny", slots=1, split=split), prompts[:1], max_tokens=30)
    pinned = SamplingParams(temperature=1.5, min_p=1.0, seed=8)
    engine = Engine(_plan(cp, model="tiny", slots=1, split=split))
    handle = engine.submit(Request(tuple(prompts[0]), 30, sampling=pinned))
    while engine.step():
        pass
    assert [t for ev in list(handle.events.queue) for t in ev.token_ids] == greedy[0]


@pytest.mark.parametrize(("split", "slots", "batch_mtp"), [(None, 3, False), (2, 2, True), (None, 1, False)])
def test_a_failed_step_on_gpu_is_recovered_from_and_the_self_check_agrees(cp, split, slots, batch_mtp):
    """A fault planted in the host's queuing of a window, while windows run ahead on the streams: `recover`
    waits for the GPU and carries the admitted requests on (each reads its prompt and tokens again, through
    the prompt kernels), and they and the queued ones get their greedy text alone; the self-check
    agrees with its first reading (the GPU's windows of other row counts stay within its tolerance), and
    finds the final norm's weight scaled."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    g = np.random.default_rng(24)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, slots + 2)]
    draft = 4 if batch_mtp or slots == 1 else 0
    plan = _plan(cp, model="tiny", slots=slots, split=split, batch_mtp=batch_mtp, draft_tokens=draft)
    alone = [_generate(plan, [p])[0][0] for p in prompts]
    engine = Engine(plan)
    assert engine.self_check() is None
    handles = [engine.submit(Request(tuple(p), 24)) for p in prompts]
    launch, calls = engine.executor.launch, [0]

    def planted(job, after=None):
        calls[0] += 1
        if calls[0] == 6:
            raise RuntimeError("planted")
        return launch(job, after)

    engine.executor.launch = planted
    with pytest.raises(RuntimeError, match="planted"):
        while engine.step():
            pass
    del engine.executor.launch
    recovery = engine.recover(RuntimeError("planted"))
    assert recovery.resumed >= 1 and recovery.ended == 0
    assert engine.self_check() is None
    while engine.step():
        pass
    for h, text in zip(handles, alone, strict=True):  # carried on or queued, each as alone
        events = list(h.events.queue)
        assert events[-1].finished == "length" and [t for ev in events for t in ev.token_ids] == text
    norm = engine.model.stages[-1].norm
    norm *= 1.5
    assert (engine.self_check() or "").startswith("position")


def test_a_think_budget_on_gpu_closes_the_block_where_it_runs_out_while_windows_run_ahead(cp):
    """Greedy replies whose prompt opened a think block, with budgets and no grammar, serial and drafting
    (solo windows decided on the GPU), three windows running ahead: each block is the free reply's first
    ``budget`` tokens, the close comes at the budget, and the reply runs to its length without an error."""
    from strata_runtime.api import Reasoning, Request, SamplingParams
    from strata_runtime.engine import Engine

    g = np.random.default_rng(31)
    prompt = tuple(g.integers(1, 250, 12).tolist())
    for plan in (_plan(cp, model="tiny", slots=1), _plan(cp, model="tiny", slots=1, draft_tokens=4)):
        engine = Engine(_run_ahead(plan, 3))
        free = engine.submit(Request(prompt, 32))
        while engine.step():
            pass
        free_tokens = [t for ev in list(free.events.queue) for t in ev.token_ids]
        unused = [t for t in range(300, 384) if t not in free_tokens and t not in engine.tokenizer.eos_ids]
        close = unused[0]  # a token the free reply never chooses: only the budget puts it there
        for budget in (3, 9, 17):
            reasoning = Reasoning(unused[1], close, opened=True, budget=budget)
            handle = engine.submit(Request(prompt, 32, SamplingParams(reasoning=reasoning)))
            while engine.step():
                pass
            events = list(handle.events.queue)
            tokens = [t for ev in events for t in ev.token_ids]
            assert events[-1].error is None and len(tokens) == 32
            assert tokens[:budget] == free_tokens[:budget] and tokens[budget] == close


def test_schema_replies_on_gpu_read_what_the_grammar_forces_as_proposals_and_keep_their_text(cp):
    """Greedy and seeded sampled replies under a JSON schema on the GPU (end-of-text ignored), alone in
    solo windows, drafting or not, and together in serial windows, windows running ahead: masked and
    chosen on the device (running ahead where they do not draft), greedy text is the host's choice from the
    logits; with the grammar's forced tokens read as proposals (several rows a window) the text is the
    text with forcing off, one token a window; every reply is JSON of the schema, ending with it."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine
    from strata_runtime.structured import json_grammar

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    grammar = json_grammar(schema)
    g = np.random.default_rng(37)
    prompt = tuple(g.integers(33, 126, 14).tolist())
    samplings = [SamplingParams(grammar=grammar), SamplingParams(temperature=0.8, seed=4, grammar=grammar)]
    plans = [_plan(cp, model="tiny", slots=n, draft_tokens=d) for n, d in ((1, 0), (1, 4), (2, 0))]
    for plan in plans:
        engine = Engine(_run_ahead(plan, 3))
        texts = {}
        for forcing, on_device in ((False, False), (False, True), (True, True)):
            engine.forcing, engine.masks_on_device = forcing, on_device
            before = engine.totals["forced"]
            handles = []
            for sampling in samplings:  # two slots: both at once, in serial windows of spare rows
                handles.append(engine.submit(Request(prompt, 60, sampling, ignore_eos=True)))
                while plan.batch.slots == 1 and engine.step():
                    pass
            while engine.step():
                pass
            replies = []
            for handle in handles:
                events = list(handle.events.queue)
                assert events[-1].error is None and events[-1].finished == "stop"
                replies.append([t for ev in events for t in ev.token_ids])
            texts[forcing, on_device] = replies
            assert (engine.totals["forced"] > before) == forcing
        host, device, forced = texts[False, False], texts[False, True], texts[True, True]
        assert host[0] == device[0] == forced[0]  # greedy: chosen on the host, on the device, forced
        if not plan.spec.draft_tokens:  # drafted under a grammar, a sampled reply draws in another order
            assert forced[1] == device[1]
        for tokens in (*forced, *device):
            assert set(json.loads(bytes(tokens))) == {"name", "n"}


@pytest.mark.parametrize("penalised", [False, True])
@pytest.mark.parametrize("slots", [1, 2])
def test_drafted_schema_replies_on_gpu_are_decided_there_running_ahead_with_the_undrafted_text(
    cp, slots, penalised
):
    """Greedy replies under a JSON schema, drafting (solo windows, or batch MTP for two), with penalties or
    not: where the grammar forces nothing their speculative windows are masked (and adjusted) and decided on
    the GPU, and the windows chained to them compute their masks from the tokens the GPU kept and drafted;
    the text is the text of the same replies without drafting, and JSON of the schema."""
    from rt_engine_helpers import collect, launches

    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine
    from strata_runtime.structured import json_grammar

    schema = {
        "type": "object",
        "properties": {
            "story": {"type": "string", "maxLength": 24},
            "n": {"type": "integer", "maximum": 999},
        },
        "required": ["story", "n"],
        "additionalProperties": False,
    }
    penalties = (
        {"presence_penalty": 0.6, "frequency_penalty": 0.8, "repetition_penalty": 1.2} if penalised else {}
    )
    g = np.random.default_rng(41)
    reqs = [
        (
            0,
            Request(
                tuple(g.integers(33, 126, 12 + 5 * i).tolist()),
                50,
                SamplingParams(grammar=json_grammar(schema), **penalties),
            ),
        )
        for i in range(slots)
    ]
    drafted = _plan(cp, model="tiny", slots=slots, batch_mtp=slots > 1, draft_tokens=3)
    engine = Engine(drafted)
    seen = launches(engine)
    got = collect(engine, reqs, check_kv=False)
    plain = Engine(_plan(cp, model="tiny", slots=slots))
    assert got == collect(plain, reqs, check_kv=False)
    decided = [(after, f) for job, after, f in seen if job.spec_on_device and job.entries[0].masked]
    assert any(a is None for a, _ in decided) and any(a is not None for a, _ in decided), decided
    assert all((f.adjusts is not None) == penalised for _, f in decided)
    for tokens in got:
        assert set(json.loads(bytes(tokens))) == {"story", "n"}


def test_penalised_requests_on_gpu_run_ahead_with_the_text_the_host_verifies(cp):
    """Requests with a logit bias and penalties (a repetition penalty over the prompt and the reply among
    them) have their rows adjusted and chosen on the GPU, so their windows run ahead; greedy, their text is
    the text of solo drafting, whose windows the host verifies with its own arithmetic, and sampled (seeded)
    it is the same one window at a time or run ahead. ``min_tokens`` holds off an end-of-text pushed to the
    top, drafting and running ahead."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine

    g = np.random.default_rng(29)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 3)]
    plan = _plan(cp, model="tiny", slots=3)
    engine = Engine(plan)
    endless = tuple((t, -100.0) for t in engine.tokenizer.eos_ids)  # every reply runs to its 40 tokens
    adjust = {
        "presence_penalty": 1.2,
        "frequency_penalty": 0.6,
        "repetition_penalty": 1.3,
        "logit_bias": ((65, 2.0), *endless),
    }
    samplings = [
        SamplingParams(temperature=0.0, **adjust),
        SamplingParams(temperature=0.9, seed=5, **adjust),
        SamplingParams(temperature=1.2, top_p=0.9, top_k=50, seed=6, logit_bias=endless),
    ]
    texts = []
    for ahead in (1, 3):
        engine = Engine(_run_ahead(plan, ahead))
        handles = [
            engine.submit(Request(tuple(p), 40, sampling=s)) for p, s in zip(prompts, samplings, strict=True)
        ]
        most = 0
        while engine.step():
            most = max(most, len(engine._chain))
        assert most == (ahead if ahead > 1 else 0)
        texts.append([[t for ev in list(h.events.queue) for t in ev.token_ids] for h in handles])
    assert texts[0] == texts[1]
    assert all(len(t) == 40 for t in texts[0])
    solo = Engine(_plan(cp, model="tiny", slots=1, draft_tokens=6))
    handle = solo.submit(Request(tuple(prompts[0]), 40, sampling=samplings[0]))
    while solo.step():
        pass
    assert [t for ev in list(handle.events.queue) for t in ev.token_ids] == texts[0][0]
    assert solo.totals["proposals"] > 0
    plain, _ = _generate(_plan(cp, model="tiny", slots=1), prompts[:1], max_tokens=40)
    assert plain[0] != texts[0][0]  # the penalties changed the greedy reply
    pushed = tuple((t, 100.0) for t in engine.tokenizer.eos_ids)
    held = solo.submit(
        Request(tuple(prompts[1]), 40, sampling=SamplingParams(logit_bias=pushed, min_tokens=7))
    )
    while solo.step():
        pass
    events = list(held.events.queue)
    assert len([t for ev in events for t in ev.token_ids]) == 7 and events[-1].finished == "stop"
    held_texts = []
    for ahead in (1, 3):  # held off on the GPU's bias, windows running ahead up to the 7th token
        engine = Engine(_run_ahead(plan, ahead))
        sampling = SamplingParams(temperature=0.8, seed=3, logit_bias=pushed, min_tokens=7)
        held = engine.submit(Request(tuple(prompts[1]), 40, sampling=sampling))
        most = 0
        while engine.step():
            most = max(most, len(engine._chain))
        assert (most > 0) == (ahead > 1)
        events = list(held.events.queue)
        held_texts.append([t for ev in events for t in ev.token_ids])
        assert len(held_texts[-1]) == 7 and events[-1].finished == "stop"
    assert held_texts[0] == held_texts[1]
    allowed = (65, 66, 67, 32)  # every other token's logit minus infinity, on the GPU's bias
    engine = Engine(_run_ahead(plan, 3))
    only = engine.submit(
        Request(
            tuple(prompts[2]), 30, sampling=SamplingParams(temperature=1.5, seed=4, allowed_token_ids=allowed)
        )
    )
    while engine.step():
        pass
    drawn = [t for ev in list(only.events.queue) for t in ev.token_ids]
    assert len(drawn) == 30 and set(drawn) <= set(allowed) and len(set(drawn)) > 1


@pytest.mark.parametrize("slots", [1, 3])
def test_first_tokens_chosen_on_gpu_are_the_ones_the_host_chooses_from_the_logits(cp, slots):
    """A prompt's first token is the GPU's choice for sampled, penalised and grammar requests (its logits
    never reach the host), and every reply is the one the host's own choice of that token gives."""
    from rt_engine_helpers import collect, launches
    from test_rt_first_token import KINDS

    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    g = np.random.default_rng(31)
    schedule = [
        (i % 2, Request(tuple(g.integers(1, 250, int(n)).tolist()), 24, sampling, request_id=name))
        for i, ((name, sampling), n) in enumerate(
            zip(KINDS.items(), g.integers(3, 90, len(KINDS)), strict=True)
        )
    ]
    plan = _plan(cp, model="tiny", slots=slots, draft_tokens=3 if slots == 1 else 0)
    engine = Engine(plan)
    seen = launches(engine)
    replies = collect(engine, schedule, check_kv=False)
    ends = [(e, flight) for job, _, flight in seen for e in job.entries if e.ends_prompt]
    assert len(ends) == len(schedule)
    assert all(e.chosen_on_device and flight.logits is None for e, flight in ends)
    reference = Engine(plan)
    reference.first_tokens_on_device = False
    assert replies == collect(reference, schedule, check_kv=False)


def test_bad_words_on_gpu_keep_the_free_text_until_a_word_would_come(cp):
    """A word of three tokens from the free greedy reply, and one of one token: masked and chosen on the GPU
    (the longer word as a grammar is, windows running ahead; the shorter in the bias), the reply is the free
    one up to where it would complete the word, and neither word comes; solo drafting gives the same text."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine

    g = np.random.default_rng(41)
    prompt = tuple(g.integers(1, 250, 12).tolist())
    plan = _plan(cp, model="tiny", slots=2)
    free, _ = _generate(plan, [prompt], max_tokens=40)
    free = free[0]
    printable = [i for i in range(len(free) - 2) if all(33 <= t <= 126 for t in free[i : i + 3])]
    assert printable, "the free reply holds three printable bytes in a row"
    word = tuple(free[printable[0] : printable[0] + 3])  # the byte-level tokenizer spells it so
    first = printable[0]
    single = next(t for t in free[first + 3 :] if 33 <= t <= 126 and t not in word)
    words = (bytes(word).decode(), chr(single))
    texts = []
    for p in (_run_ahead(plan, 3), _plan(cp, model="tiny", slots=1, draft_tokens=6)):
        engine = Engine(p)
        handle = engine.submit(Request(prompt, 40, SamplingParams(bad_words=words), ignore_eos=True))
        while engine.step():
            pass
        texts.append([t for ev in list(handle.events.queue) for t in ev.token_ids])
    got = texts[0]
    assert texts[1] == got and len(got) == 40 and single not in got
    assert not any(tuple(got[i : i + 3]) == word for i in range(len(got) - 2))
    cut = min(first + 2, free.index(single))
    assert got[:cut] == free[:cut] and got[cut] != free[cut]


def test_leading_matches_on_gpu_equal_numpy(cp):
    from strata_runtime.engine.device_spec import leading_matches

    g = np.random.default_rng(31)
    for n in (2, 3, 5, 8):
        tokens, picks = g.integers(1, 4, (32, n)), g.integers(1, 4, (32, n))
        want = leading_matches(np, tokens, picks)
        assert want.sum() > 0
        got = leading_matches(cp, cp.asarray(tokens), cp.asarray(picks))
        assert cp.asnumpy(got).tolist() == want.tolist()


@pytest.mark.parametrize("split", [None, 2])
def test_speculative_windows_decided_on_gpu_draft_accept_and_read_as_host_decisions_do(
    cp, split, monkeypatch
):
    """Solo drafting and batch MTP, greedy: deciding each window on the GPU, the windows chained without the
    host, gives the text of deciding them on the host, and for one slot (the same windows either way) the
    same proposals and acceptance (the kernels give a row the same bits in any window, so the drafts are the
    same), on one stage and on two stages of one GPU (the next window's positions then cross from the last
    stage's stream to the first's). With two slots, the windows queued ahead when one request ends differ
    from what the host would launch, so only the text is compared. Drafting never pauses here (floor 0):
    the windows chained ahead would draft past the point where host decisions pause (the tiny model's
    drafts hold about a third of the time on a GPU, near the floor)."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    g = np.random.default_rng(29)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 2)]
    for slots, batch_mtp in ((1, False), (2, True)):
        plan = _plan(cp, model="tiny", slots=slots, batch_mtp=batch_mtp, draft_tokens=4, split=split)
        plan = plan.model_copy(
            update={"spec": plan.spec.model_copy(update={"draft_floor": 0.0, "adaptive_depth": False})}
        )
        outs, chained = [], 0
        for on_device in (False, True):
            engine = Engine(plan)
            if not on_device:
                engine._decided_on_device = lambda *args: False
            handles = [engine.submit(Request(tuple(p), 40)) for p in prompts[:slots]]
            while engine.step():
                chained += sum(1 for f in engine._chain if f.spec is not None and f.after is not None)
            text = [[t for ev in list(h.events.queue) for t in ev.token_ids] for h in handles]
            outs.append((text, engine.totals["proposals"], engine.totals["accepted"]))
        assert outs[0][0] == outs[1][0]
        if slots == 1:
            assert outs[0][1:] == outs[1][1:]
        assert outs[0][2] > 0 and chained > 0


def test_sampled_verification_on_gpu_equals_numpy(cp):
    """`verify_sampled` on CuPy arrays, with the distributions of the ``distribution_rows`` kernel, decides as
    on NumPy ones with its twin's, for temperature, top-k and top-p, over windows whose proposals are
    sometimes accepted and sometimes not."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.cuda.ops import kernels_for
    from strata_runtime.model import verify_sampled
    from strata_runtime.models.ops.distribution import inverse_cdf
    from strata_runtime.reference import kernels as ref

    kern = kernels_for(0)

    def on_gpu(logits: np.ndarray, params: SamplingParams):
        out = cp.empty(logits.shape, cp.float64)
        kern.distribution(cp.asarray(logits), 1 / params.temperature, params.top_k, params.top_p, out)
        return out

    def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        out = np.empty(logits.shape)
        ref.distribution(logits, 1 / params.temperature, params.top_k, params.top_p, out)
        return out

    g = np.random.default_rng(37)
    vocab, n = 4096, 4
    kept = []
    for params in (
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.1, top_k=40),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
    ):
        for _ in range(24):
            target = (g.standard_normal((n, vocab)) * 3).astype(np.float32)
            draft = target[:-1] + g.standard_normal((n - 1, vocab)).astype(np.float32)
            p, q = distribution(target, params), distribution(draft, params)
            tokens = np.array([7, *(int(inverse_cdf(q[j], g.random())) for j in range(n - 1))])
            u = g.random(n)
            a, after = verify_sampled(np, p, q, tokens, u)
            p_d, q_d = on_gpu(target, params), on_gpu(draft, params)
            got = verify_sampled(cp, p_d, q_d, cp.asarray(tokens), cp.asarray(u))
            assert (int(got[0]), int(got[1])) == (int(a), int(after))
            kept.append(int(a))
    assert min(kept) == 0 and max(kept) > 0


def test_sampled_speculative_windows_on_gpu_are_seeded_and_greedy_when_cold(cp):
    """Sampled requests with drafting are decided on the GPU: chained, reproducible from their seeds, and at a
    temperature low enough that every row's distribution is its argmax, the greedy text."""
    from strata_runtime.api import SamplingParams

    g = np.random.default_rng(41)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 2)]

    def run(plan, asked, sampling):
        texts, engine = _sampled(plan, asked, sampling, 32)
        assert engine.totals["decided_on_device"] > 0
        return texts

    for slots, batch_mtp in ((1, False), (2, True)):
        plan = _plan(cp, model="tiny", slots=slots, batch_mtp=batch_mtp, draft_tokens=4)
        asked = prompts[:slots]
        greedy = run(plan, asked, SamplingParams())
        assert run(plan, asked, SamplingParams(temperature=1e-4, seed=3)) == greedy
        hot = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
        first = run(plan, asked, hot)
        assert first == run(plan, asked, hot) and first != greedy


@pytest.mark.parametrize(
    "edge",
    [
        {"temperature": 1e-300},
        {"temperature": 1.0, "top_p": 1e-30},
        {"temperature": 2.0, "top_p": 1e-30, "top_k": 1},
    ],
    ids=["temperature-1e-300", "top-p-1e-30", "top-k-1"],
)
def test_sampling_at_the_edges_of_the_schema_on_gpu_gives_the_greedy_text(cp, edge):
    """Sampled requests whose sampling leaves only each row's top token, at the edges of what the API allows,
    alone and two in one window with batch MTP: the greedy text. A temperature of 1e-300 made the device's
    1 / temperature a float32 infinity; a top-p of 1e-30 rounded to a cut that kept no token."""
    from strata_runtime.api import SamplingParams

    g = np.random.default_rng(43)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 2)]
    for slots, batch_mtp in ((1, False), (2, True)):
        plan = _plan(cp, model="tiny", slots=slots, batch_mtp=batch_mtp, draft_tokens=4)
        asked = prompts[:slots]
        edged, greedy = (
            _sampled(plan, asked, s, 24)[0] for s in (SamplingParams(seed=9, **edge), SamplingParams())
        )
        assert edged == greedy


def _sampled(plan, prompts, sampling, max_tokens):
    """Each prompt's tokens from a fresh engine of ``plan``, every request at ``sampling``, run to the end
    (none may end in an error), and the engine."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    engine = Engine(plan)
    handles = [engine.submit(Request(tuple(p), max_tokens, sampling)) for p in prompts]
    while engine.step():
        pass
    events = [list(h.events.queue) for h in handles]
    assert all(ev.error is None for evs in events for ev in evs), events
    return [[t for ev in evs for t in ev.token_ids] for evs in events], engine


def test_batch_mtp_in_pipelined_groups_on_gpu_is_decided_there_with_the_serial_text(cp):
    """Two stages of one GPU, two groups with batch MTP inside: each group's windows are decided on the GPU
    by the last stage's thread, on the MTP head's own graphs, while the engine thread drafts on the host for
    the others; the greedy text is serial windows' text."""
    from rt_plans import with_mtp_in_groups

    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    g = np.random.default_rng(43)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 4)]
    serial, _ = _generate(_plan(cp, model="tiny", slots=4, split=2), prompts)
    # The resolver keeps a split of one GPU (a test construct) in serial windows; pipeline it by hand.
    base = _plan(cp, model="tiny", slots=4, draft_tokens=4, split=2)
    piped = base.batch.model_copy(update={"mode": "pipelined", "groups": 2})
    plan = with_mtp_in_groups(base.model_copy(update={"batch": piped}))
    engine = Engine(plan)
    chained = 0
    launch = engine.executor.launch

    def spy(job, after=None):
        nonlocal chained
        chained += after is not None and after.rows is None
        return launch(job, after)

    engine.executor.launch = spy
    handles = [engine.submit(Request(tuple(p), 24)) for p in prompts]
    while engine.step():
        pass
    engine.close()
    assert [[t for ev in list(h.events.queue) for t in ev.token_ids] for h in handles] == serial
    assert engine.totals["decided_on_device"] > 0 and chained > 0


def test_long_prefill_chunks_match_the_float32_reference(cp, model_src):
    """Chunks of more than 64 rows take the CUDA prefill path (cuBLAS products, fp16 scores): their logits,
    and the KV they leave for the decode windows after them, must match the float32 reference on every row
    that routed as the reference did (`clean_rows`), and on the median row (`MEDIAN_TOLERANCE`): rounding
    may flip a near-tie of the router, and later rows of that slot then read different keys."""
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model=model_src, slots=2))
    reference = Model.from_plan(_plan(cp, model=model_src, slots=2, backend="cpu"))
    margins = RoutingMargins(reference)
    calls = []
    real = model.stages[0].cuda_prefill.forward
    model.stages[0].cuda_prefill.forward = lambda h, lay: calls.append(lay.rows) or real(h, lay)
    g = np.random.default_rng(7)
    vocab = model.args.vocab_size
    a, b = g.integers(1, vocab, 150).tolist(), g.integers(1, vocab, 90).tolist()
    runs = [
        ([(0, 150, 0)], a),  # one slot's first chunk
        ([(0, 100, 150), (1, 90, 0)], g.integers(1, vocab, 100).tolist() + b),  # a later chunk beside another
        ([(0, 2, 250), (1, 1, 90)], g.integers(1, vocab, 3).tolist()),  # decode rows over that KV
    ]
    first_undecided: dict[int, int] = {}
    compared, every_row = 0, []
    for layout, tokens in runs:
        got, expected = _window(model, layout, tokens), _window(reference, layout, tokens)
        clean = clean_rows(layout, margins.take(len(tokens)), first_undecided)
        row_err = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
        assert (row_err[clean] < ROW_TOLERANCE).all(), (layout, np.sort(row_err[clean])[-5:])
        compared += int(clean.sum())
        every_row += list(row_err)
    assert (
        compared >= 3
    )  # rows before each slot's first near-tie (measured 5 on small, 63 to 74 on the others)
    assert np.median(every_row) < MEDIAN_TOLERANCE, np.median(every_row)
    assert calls == [150, 190]


def test_prefill_graphs_on_gpu_replay_a_padded_chunk_as_it_ran_and_match_the_float32_reference(cp, model_src):
    """A chunk of one prompt padded to a graph's rows and replayed as a CUDA graph (cuBLAS products, the
    flash kernel reading its slot and position from the device): the first chunk of 150 rows runs padded
    to 192 and is captured, the same prompt in the other slot replays it and must give the same
    bits, and both, and decode rows over the KV they wrote, must match the float32 reference as the
    launched path does (`test_long_prefill_chunks_match_the_float32_reference`)."""
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model=model_src, slots=2))
    reference = Model.from_plan(_plan(cp, model=model_src, slots=2, backend="cpu"))
    path = model.stages[0].cuda_prefill
    path.graph_rows = 256
    margins = RoutingMargins(reference)
    g = np.random.default_rng(7)  # the prompt of `test_long_prefill_chunks_...`, whose routing margins allow
    vocab = model.args.vocab_size  # rows to be compared one by one on every model
    prompt = g.integers(1, vocab, 150).tolist()
    runs = [
        ([(0, 150, 0)], prompt),  # run padded to 256 rows, then captured
        ([(1, 150, 0)], prompt),  # replayed in slot 1
        ([(0, 2, 150), (1, 1, 150)], g.integers(1, vocab, 3).tolist()),  # decode rows over both slots' KV
    ]
    first_undecided: dict[int, int] = {}
    outputs, compared = [], 0
    for layout, tokens in runs:
        got, expected = _window(model, layout, tokens), _window(reference, layout, tokens)
        clean = clean_rows(layout, margins.take(len(tokens)), first_undecided)
        row_err = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
        assert (row_err[clean] < ROW_TOLERANCE).all(), (layout, np.sort(row_err[clean])[-5:])
        assert np.median(row_err) < MEDIAN_TOLERANCE, (layout, np.median(row_err))
        compared += int(clean.sum())
        outputs.append(got)
    assert compared >= 2  # rows before each slot's first near-tie (measured 2 on small)
    assert np.array_equal(outputs[0], outputs[1])
    assert path.captured == {192}


def test_long_prompts_keep_greedy_text_exact_with_drafting(cp):
    """Prompts read in long chunks (the prefill path, MTP head included) then decoded: drafting must not
    change greedy text."""
    g = np.random.default_rng(23)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(140, 300, 2)]
    plain, _ = _generate(_plan(cp, model="tiny", slots=2, chunk=128), prompts)
    drafted, engine = _generate(
        _plan(cp, model="tiny", slots=2, batch_mtp=True, draft_tokens=4, chunk=128), prompts
    )
    assert all(len(t) == 24 for t in plain)
    assert drafted == plain
    assert engine.totals["accepted"] > 0


def test_flash_and_cublas_attention_each_match_the_float32_reference(cp):
    """The fused attention kernel (q in two parts, and fp16 q) and the cuBLAS products over materialised
    scores each compute what the float32 reference does for a long chunk through small's first layer
    (attention and a dense MLP: no routing, so every row is compared, at `ROW_TOLERANCE`)."""
    from strata_runtime.cuda.layers import LayerStack
    from strata_runtime.cuda.prefill import CudaPrefill
    from strata_runtime.layout import Layout
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model="small", slots=2))
    reference = Model.from_plan(_plan(cp, model="small", slots=2, backend="cpu"))
    assert not model.args.is_sparse(0)
    stack, ref_stage = model.stages[0].cuda.stack, reference.stages[0]
    first = LayerStack(
        stack.device_id, stack.args, stack.layers[:1], stack.k_cache[:1], stack.v_cache[:1], stack.kern
    )
    g = np.random.default_rng(8)
    hidden = g.standard_normal((200, model.args.hidden_size)).astype(np.float32)
    layout = Layout.of([(1, 200, 0)])
    ref_stage.kv.begin(layout.segments)
    cos, sin = ref_stage.rope.at(layout)
    expected = ref_stage.layers[0](np, hidden, layout, ref_stage.kv, 0, cos, sin)  # [200, H] float32
    for flash, split_q in ((True, True), (True, False), (False, True)):
        model.stages[0].kv.begin(layout.segments)
        got = CudaPrefill(first, flash=flash, split_q=split_q).forward(cp.asarray(hidden), layout).get()
        model.rewind(1, 0)
        row_err = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
        assert row_err.max() < ROW_TOLERANCE, (flash, split_q, np.sort(row_err)[-5:])


def _windows_match_row_by_row(model, reference, runs, prompts):
    """Admit each prompt to its slot in both models, then run ``runs`` (window layout, tokens) through both:
    every row's logits within `ROW_TOLERANCE` of the reference's."""
    for m in (model, reference):
        for slot, prompt in prompts.items():
            m.admit(slot, tuple(prompt))
    for layout, tokens in runs:
        got, expected = _window(model, layout, tokens), _window(reference, layout, tokens)
        row_err = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
        assert row_err.max() < ROW_TOLERANCE, (layout, np.sort(row_err)[-5:])


@pytest.mark.parametrize("model_name", ["tiny", "small"])
def test_calibrated_routing_on_gpu_matches_the_float32_reference_row_by_row(cp, model_name):
    """The router-bias step in the decode graphs and the prefill path chooses what the array path's NumPy
    bias chooses: with every row's experts forced, no near-tie can flip a row, so every row is compared."""
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model=model_name, slots=2, routing="calibrated"))
    reference = Model.from_plan(_plan(cp, model=model_name, slots=2, backend="cpu", routing="calibrated"))
    assert model.stages[0].cuda_routing is not None
    g = np.random.default_rng(31)
    vocab = model.args.vocab_size
    a, b = g.integers(1, vocab, 150).tolist(), g.integers(1, vocab, 20).tolist()
    runs = [
        ([(0, 150, 0)], a),  # the prefill path
        ([(1, 20, 0)], b),  # 8-row graph windows
        ([(0, 3, 150), (1, 1, 20)], g.integers(1, vocab, 4).tolist()),  # a decode window of two slots
        ([(0, 2, 153), (1, 2, 21)], g.integers(1, vocab, 4).tolist()),  # again: now a replayed graph
    ]
    _windows_match_row_by_row(model, reference, runs, {0: a, 1: b})


def test_calibrated_routing_on_a_later_stage_biases_by_the_model_layer(cp):
    """Two stages on one GPU: the second stage's layers route by their model layer, not their index in the
    stage (a one-stage float32 reference routes every layer by its own)."""
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model="small", split=3, routing="calibrated"))
    reference = Model.from_plan(_plan(cp, model="small", backend="cpu", routing="calibrated"))
    assert len(model.stages) == 2 and model.stages[1].layer_range[0] == 3
    assert model.stages[1].cuda_routing is not None
    g = np.random.default_rng(32)
    vocab = model.args.vocab_size
    a = g.integers(1, vocab, 90).tolist()
    runs = [([(0, 90, 0)], a), ([(0, 4, 90)], g.integers(1, vocab, 4).tolist())]
    _windows_match_row_by_row(model, reference, runs, {0: a})


def test_greedy_text_on_gpu_with_calibrated_routing_does_not_depend_on_drafting_or_batching(cp):
    g = np.random.default_rng(33)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in (5, 90)]
    plain, _ = _generate(_plan(cp, model="small", slots=2, routing="calibrated"), prompts)
    drafted, _ = _generate(
        _plan(cp, model="small", slots=2, batch_mtp=True, draft_tokens=4, routing="calibrated"), prompts
    )
    assert all(len(t) == 24 for t in plain)
    assert drafted == plain
    solo = [
        _generate(_plan(cp, model="small", slots=1, draft_tokens=6, routing="calibrated"), [p])[0][0]
        for p in prompts
    ]
    assert solo == plain


def test_sampled_drafts_drawn_on_gpu_equal_the_host_draws(cp):
    """A host-launched window decided on the GPU draws its sampled proposals there (`speculative._choose`
    with ``on_device``): at the same uniforms, the same tokens as drawing on the host from the row copied
    back, for temperature, top-k and top-p, without a host q."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine.sampling import Sampler
    from strata_runtime.engine.speculative import commit, draft
    from strata_runtime.layout import Layout
    from strata_runtime.model import Model

    model = Model.from_plan(_plan(cp, model="tiny", draft_tokens=4, context=64))
    g = np.random.default_rng(41)
    prompt = g.integers(32, 127, size=9)
    nxt = int(g.integers(32, 127))
    normed = model.forward(prompt, Layout.of([(0, len(prompt), 0)]))
    commit(model, 0, 0, len(prompt), normed, [*prompt[1:].tolist(), nxt], tracked=True)
    drafter = model.drafters[0]
    kept = drafter.length
    params = [
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.2, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=2.0, top_k=60, top_p=0.95),
    ]
    varied = set()
    for seed, p in enumerate(params):
        outs = []
        for on_device in (False, True):
            outs.append(draft(model, 0, nxt, 3, Sampler(p, seed), on_device))
            drafter.rewind(kept)
        assert outs[1].tokens == outs[0].tokens, p
        assert len(outs[0].q) == 3 and not outs[1].q
        varied.update(outs[0].tokens)
    assert len(varied) > 3  # the draws really vary


@pytest.mark.parametrize("mode", ["run-ahead", "batch-mtp"])
def test_logprobs_on_gpu_are_the_array_paths_and_read_back_the_same_as_a_prompt(cp, mode):
    """Token and prompt log-probabilities through the GPU (the raw logits copied to pinned memory before the
    device adjusts them for a penalty; windows run ahead, or drafted windows decided on the device): the
    float32 array path's figures within fp16 rounding, and the reply read back as a prompt gives them too."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine

    g = np.random.default_rng(43)
    prompt = tuple(g.integers(1, 250, 17).tolist())
    params = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logprobs=3, prompt_logprobs=2)
    kw = {"slots": 2, "batch_mtp": True, "draft_tokens": 3} if mode == "batch-mtp" else {"slots": 1}

    def figures(plan) -> tuple[list[int], list[float], list[float]]:
        engine = Engine(plan)
        handle = engine.submit(Request(prompt, 24, sampling=params, ignore_eos=True))
        while engine.step():
            pass
        events = list(handle.events.queue)
        tokens = [t for ev in events for t in ev.token_ids]
        lps = [lp for ev in events for lp in ev.logprobs]
        assert [lp.token for lp in lps] == tokens and all(len(lp.top) == 3 for lp in lps)
        read = [lp for ev in events for lp in ev.prompt_logprobs]
        assert [lp.token for lp in read] == list(prompt[1:])
        return tokens, [lp.logprob for lp in lps], [lp.logprob for lp in read]

    gpu = figures(_plan(cp, model="tiny", **kw))
    cpu = figures(_plan(cp, model="tiny", backend="cpu", **kw))
    assert gpu[0] == cpu[0]
    np.testing.assert_allclose(gpu[1], cpu[1], atol=2e-2)
    np.testing.assert_allclose(gpu[2], cpu[2], atol=2e-2)
    engine = Engine(_plan(cp, model="tiny", **kw))
    whole = engine.submit(Request((*prompt, *gpu[0]), 1, sampling=SamplingParams(prompt_logprobs=0)))
    while engine.step():
        pass
    back = [lp.logprob for ev in list(whole.events.queue) for lp in ev.prompt_logprobs]
    np.testing.assert_allclose(back[len(prompt) - 1 :], gpu[1], atol=2e-2)


@pytest.mark.parametrize("slots", [1, 3])
def test_after_the_warm_up_requests_on_gpu_only_replay_graphs(cp, monkeypatch, slots):
    """`Engine.warm_up` on a real GPU: every decode window (of the layers and of the drafting head) that
    requests then run replays a graph captured during the warm-up, none runs eagerly or is captured; and
    greedy text is what an engine that never warmed up gives. One slot drafts alone at its full depth; three
    slots run batch-MTP windows, greedy beside sampled."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine

    unreplayed = record_unreplayed(monkeypatch)
    plan = _plan(cp, model="tiny", slots=slots, batch_mtp=slots > 1, draft_tokens=3)
    g = np.random.default_rng(31)
    prompts = [tuple(g.integers(1, 250, int(n)).tolist()) for n in g.integers(3, 30, slots)]
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5)

    def serve(engine: Engine) -> list[list[int]]:
        reqs = [Request(p, 20, sampled if i == 1 else SamplingParams()) for i, p in enumerate(prompts)]
        handles = [engine.submit(r) for r in reqs]
        while engine.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    warmed = Engine(plan)
    assert warmed.warm_up() > 0 and unreplayed
    unreplayed.clear()
    texts = serve(warmed)
    assert warmed.totals["windows"] > 0 and warmed.totals["accepted"] > 0
    assert unreplayed == []
    fresh = serve(Engine(plan))
    assert unreplayed  # the engine that did not warm up ran its first windows eagerly
    greedy = [i for i in range(slots) if i != 1]
    assert [texts[i] for i in greedy] == [fresh[i] for i in greedy]


@pytest.mark.parametrize("mode", ["solo", "batch-mtp"])
def test_prefix_reuse_on_gpu_gives_the_float32_text_and_log_probabilities(cp, mode):
    """A conversation of three turns on the GPU, each turn its whole history and a new message, with prefix
    reuse (the default): the later turns read only what is new (their kept positions were written by decode
    windows, not the prefill path), and each turn's tokens and log-probabilities are the float32 array
    path's, which reads every prompt whole."""
    from strata_runtime.api import Request, SamplingParams
    from strata_runtime.engine import Engine

    start = np.random.default_rng(47).integers(1, 250, 40).tolist()
    kw = {"slots": 2, "batch_mtp": True, "draft_tokens": 3} if mode == "batch-mtp" else {"slots": 1}

    def conversation(plan) -> tuple[list[list[int]], list[list[float]], int]:
        engine = Engine(plan)
        said, replies, lps = list(start), [], []
        for message in ([7, 8, 9], [11, 12, 13, 14]):
            h = engine.submit(Request(tuple(said), 16, sampling=SamplingParams(logprobs=1), ignore_eos=True))
            while engine.step():
                pass
            events = list(h.events.queue)
            replies.append([t for ev in events for t in ev.token_ids])
            lps.append([lp.logprob for ev in events for lp in ev.logprobs])
            said += replies[-1] + message
        return replies, lps, engine.totals["prefix_tokens"]

    gpu = conversation(_plan(cp, model="tiny", **kw))
    cpu_plan = _plan(cp, model="tiny", backend="cpu", **kw)
    cpu = conversation(
        cpu_plan.model_copy(update={"memory": cpu_plan.memory.model_copy(update={"prefix_reuse": False})})
    )
    assert gpu[2] > 0 and cpu[2] == 0
    assert gpu[0] == cpu[0]
    for a, b in zip(gpu[1], cpu[1], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2)


def _drafting_plan(cp, mode: str):
    """The tiny preset on this GPU with a drafter per slot: batch MTP over 2 slots, or pipelined groups with
    MTP inside each over 4 slots on a split of the one GPU."""
    from rt_plans import float16_profile_text, with_mtp_in_groups

    from strata_cfg.plan.from_profile import resolve_text
    from strata_cfg.schema.plan import LaunchPlan

    if mode == "batch-mtp":
        return _plan(cp, model="tiny", slots=2, batch_mtp=True, draft_tokens=3)
    # The resolver runs a split of one GPU one request at a time (batch.test-split): resolve the pipelined
    # plan for two GPUs of this one's size, then place its second stage (and the drafters) on this GPU too.
    vram = cp.cuda.runtime.memGetInfo()[1] // (1 << 20)
    text = float16_profile_text(
        vram_mib=vram,
        preset="tiny",
        stages=2,
        slots=4,
        groups=2,
        draft_tokens=4,
        context=512,
        routing="uniform",
    )
    plan = with_mtp_in_groups(resolve_text(text, "gpu-test.toml").plan)
    assert (plan.batch.slots, plan.batch.groups, plan.batch.mode) == (4, 2, "pipelined")
    return LaunchPlan.model_validate_json(plan.model_dump_json().replace('"cuda:1"', '"cuda:0"'))


@pytest.mark.parametrize("mode", ["batch-mtp", "pipelined-mtp"])
def test_a_prefix_copied_between_slots_on_gpu_gives_the_float32_text(cp, mode):
    """Two requests that begin with the same 60 tokens, the second sent while the first decodes: on the GPU
    the second's slot copies the prefix's KV from the first's (each stage's on its own stream; with
    pipelined groups, from each stage's thread) and its drafter's on the drafters' stream, and both requests
    get the float32 array path's tokens, which reads every prompt whole."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    system = np.random.default_rng(48).integers(1, 250, 60).tolist()

    def serve(plan) -> tuple[list[list[int]], dict[str, int]]:
        engine = Engine(plan)
        first = engine.submit(Request((*system, 7, 8), 24, ignore_eos=True))
        engine.step()  # admitted
        while not engine.slots[first.slot].decoding:
            engine.step()
        second = engine.submit(Request((*system, 9, 10, 11), 24, ignore_eos=True))
        while engine.step():
            pass
        engine.close()
        return [
            [t for ev in list(h.events.queue) for t in ev.token_ids] for h in (first, second)
        ], engine.totals

    plan = _drafting_plan(cp, mode)
    gpu, totals = serve(plan)
    assert totals["prefix_copies"] == 1 and totals["prefix_tokens"] == len(system) - 1
    cpu_plan = _plan(cp, model="tiny", backend="cpu", slots=2)
    cpu, none = serve(
        cpu_plan.model_copy(update={"memory": cpu_plan.memory.model_copy(update={"prefix_reuse": False})})
    )
    assert none["prefix_tokens"] == 0 and gpu == cpu and all(len(t) == 24 for t in gpu)


@pytest.mark.parametrize("mode", ["batch-mtp", "pipelined-mtp"])
def test_a_history_stored_in_host_memory_comes_back_on_gpu_with_the_float32_text(cp, mode):
    """One conversation more than the slots, one request at a time, with a prefix store: the first
    conversation's history goes to pinned host memory when another takes its slot (copies queued on each
    stage's stream, from each stage's thread under pipelined groups, the drafter's on the drafters' stream)
    and comes back for its next turn, and every turn's tokens are the float32 array path's, which reads every
    prompt whole."""
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    def serve(plan) -> tuple[list[list[int]], dict[str, int]]:
        engine = Engine(plan)
        said = np.random.default_rng(49).integers(1, 250, (engine.n_slots + 1, 80)).tolist()
        out = []
        for conv in [*range(len(said)), 0]:
            h = engine.submit(Request(tuple(said[conv]), 16, ignore_eos=True))
            while engine.step():
                pass
            reply = [t for ev in list(h.events.queue) for t in ev.token_ids]
            out.append(reply)
            said[conv] += reply + [33, 34]
        engine.close()
        return out, engine.totals

    plan = _drafting_plan(cp, mode)
    plan = plan.model_copy(update={"memory": plan.memory.model_copy(update={"prefix_store_mib": 64})})
    gpu, totals = serve(plan)
    assert totals["prefix_store_saved"] >= 1 and totals["prefix_restores"] == 1
    cpu_plan = _plan(cp, model="tiny", backend="cpu", slots=plan.batch.slots)
    cpu, none = serve(
        cpu_plan.model_copy(update={"memory": cpu_plan.memory.model_copy(update={"prefix_reuse": False})})
    )
    assert none["prefix_tokens"] == 0 and gpu == cpu and all(len(t) == 16 for t in gpu)


@pytest.mark.parametrize("pitch", [None, 3000])
def test_the_prefix_stores_strided_copies_on_gpu_move_exactly_a_slots_runs_of_positions(
    cp, monkeypatch, pitch
):
    """`KVCache.save_rows` and `load_rows` through ``cudaMemcpy2DAsync`` on a real GPU: runs of a slot's
    positions of a cache that is a view of a wider one go to other places in pinned host rows, and back into
    another slot, exactly; nothing else is written. With a narrow pitch limit, a copy per layer."""
    from strata_runtime.backend import Device
    from strata_runtime.model import kvcache
    from strata_runtime.model.kvcache import HostRows, KVCache

    if pitch is not None:
        monkeypatch.setattr(kvcache, "MAX_PITCH", pitch)
    layers, heads, context, dim = 3, 2, 40, 8
    rng = np.random.default_rng(11)
    host_wide = [
        (rng.standard_normal((layers, 3, heads, context, dim)) + 1).astype(np.float16) for _ in range(2)
    ]
    wide = [cp.asarray(w) for w in host_wide]
    kv = KVCache(
        Device("cuda", 0), layers, 2, heads, context, dim, np.float16, (wide[0][:, 1:], wide[1][:, 1:])
    )
    host = HostRows(kv, 64)
    host.keys[...] = host.values[...] = 0
    runs = [(50, 0, 7), (3, 7, 20)]
    kv.save_rows(1, host, runs)
    cp.cuda.get_current_stream().synchronize()
    for w, rows in zip(host_wide, (host.keys, host.values), strict=True):
        np.testing.assert_array_equal(rows[:, :, 50:57], w[:, 2, :, 0:7])
        np.testing.assert_array_equal(rows[:, :, 3:23], w[:, 2, :, 7:27])
        assert not rows[:, :, 23:50].any() and not rows[:, :, 57:].any()
    kv.load_rows(0, host, runs)
    cp.cuda.get_current_stream().synchronize()
    for w, before in zip(wide, host_wide, strict=True):
        after = w.get()
        np.testing.assert_array_equal(after[:, 1, :, :27], before[:, 2, :, :27])
        np.testing.assert_array_equal(after[:, 1, :, 27:], before[:, 1, :, 27:])
        np.testing.assert_array_equal(after[:, [0, 2]], before[:, [0, 2]])
