"""The CUDA path's Python, run without a GPU: CuPy is a NumPy stand-in and the kernels are their references.

The kernels themselves are held to their references on a GPU (test_cuda_kernels.py, test_cuda_flash.py).
What is checked here is everything around them, which changes as the runtime grows: the layer stack and
its fused weights, a window's buffers, the order of a layer's steps, CUDA graph capture and replay, the
prefill path (flash and cuBLAS attention), the head and the MTP head, and the engine driving them. A window
through that path must give the logits of the float32 array path; a replayed graph the same numbers as
the eager run; greedy text must not depend on drafting.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from fake_cupy import installed
from rt_engine_helpers import record_unreplayed
from rt_plans import float16_profile_text

from strata_cfg.plan.from_profile import resolve_text
from strata_runtime.api import Request
from strata_runtime.engine.depth import WindowCosts
from strata_runtime.layout import Layout


@pytest.fixture(scope="module")
def fake_gpu():
    # Rows no kernel writes are NaN (the expert groups' unused rows go through the products too): quiet.
    with installed(), np.errstate(all="ignore"):
        yield


def _plan(backend: str, preset: str = "small", **kw):
    """``small`` has dense layers, a shared expert and routed experts; ``tiny`` only routed experts."""
    text = float16_profile_text(backend=backend, preset=preset, slots=2, context=256, **kw)
    return resolve_text(text, "cuda-path.toml").plan


def _logits(model, runs, tokens) -> np.ndarray:
    normed = model.forward(np.asarray(tokens, np.int64), Layout.of(runs))
    return np.asarray(model.logits(normed))


def _far_rows(a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray]:
    """``a`` against ``b`` row by row: the relative error of the rows within 2e-2 of ``b``'s, and which rows
    are further. fp16 weights, KV and activations move a row by a few 1e-3; but where a router's top-k is
    a near tie (a k-th/k+1-th margin of 2e-5 to 1e-3 measured) fp16 may swap one expert of the row, which
    moves it by 0.05 to 0.25 (and its slot's later rows, through its KV, by up to 7e-3). Which rows swap
    depends on the BLAS's order of summation (its kernels, its threads), so a norm over the whole chunk
    may pass on one machine and fail on another; a misplaced weight, buffer, slot or position moves every
    row of a run by O(1)."""
    err = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    far = err > 2e-2
    return float(np.linalg.norm((a - b)[~far]) / np.linalg.norm(b[~far])), far


def test_windows_through_the_cuda_path_give_the_array_paths_logits(fake_gpu):
    from strata_runtime.model import Model

    gpu = Model.from_plan(_plan("cuda", draft_tokens=3))
    cpu = Model.from_plan(_plan("cpu", draft_tokens=3))
    assert gpu.stages[0].cuda is not None and gpu.mtp is not None and gpu.mtp.cuda is not None
    g = np.random.default_rng(1)
    vocab = gpu.args.vocab_size
    windows = [
        ([(0, 20, 0)], g.integers(1, vocab, 20)),  # 8-row graph windows
        ([(0, 100, 20)], g.integers(1, vocab, 100)),  # the prefill path (flash attention)
        ([(0, 3, 120), (1, 1, 0)], g.integers(1, vocab, 4)),  # decode rows of two slots
        ([(1, 80, 1), (0, 70, 123)], g.integers(1, vocab, 150)),  # two slots' chunks: flash per segment
        ([(1, 20, 81), (0, 15, 193)], g.integers(1, vocab, 35)),  # two short prompts: 8-row graph windows
    ]
    for runs, tokens in windows:
        a, b = _logits(gpu, runs, tokens), _logits(cpu, runs, tokens)
        # fp16 weights and KV against float32: a few 1e-3 relative (measured 1e-3 to 7e-3), but a row whose
        # router is a near tie may swap an expert (`_far_rows`); a misplaced weight, buffer or step gives
        # O(1) on every row of a run.
        rel, far = _far_rows(a, b)
        assert rel < 1e-2 and far.mean() <= 0.05, (runs, rel, np.flatnonzero(far))
        # The same token wherever the reference's two best logits are not a near tie: fp16 moves a logit
        # by up to a few 1e-3 here (99th percentile 3.6e-3 in the two slots' chunks, where one row's best
        # two are 2e-3 apart and swap).
        top2 = np.sort(b, axis=-1)[:, -2:]
        decided = top2[:, 1] - top2[:, 0] > 5e-3
        assert decided.mean() > 0.9 and (a.argmax(-1) == b.argmax(-1))[decided & ~far].all(), runs

    replays = []
    for _ in range(3):  # eager, captured, replayed
        gpu.rewind(0, 120)
        replays.append(_logits(gpu, [(0, 3, 120)], windows[2][1][:3]))
    assert np.array_equal(replays[0], replays[1]) and np.array_equal(replays[0], replays[2])
    assert gpu.stages[0].cuda._graphs  # a graph was captured and replayed


def test_a_prompt_chunk_allocates_its_temporaries_once_for_all_layers(fake_gpu, monkeypatch):
    """The prefill path is launched from Python layer by layer, and for a short chunk that host time is its
    cost: each layer reuses the chunk's temporaries (`Temps`) instead of allocating its own."""
    import cupy

    from strata_runtime.model import Model

    model = Model.from_plan(_plan("cuda", "small"))
    stage = model.stages[0]
    assert stage.cuda_prefill is not None
    made: list[tuple[int, ...]] = []
    empty = cupy.empty

    def counting(shape, dtype=float, **kw):
        made.append(tuple(np.atleast_1d(shape)))
        return empty(shape, dtype, **kw)

    monkeypatch.setattr(cupy, "empty", counting)
    tokens = np.random.default_rng(2).integers(1, model.args.vocab_size, 100)
    _logits(model, [(0, 100, 0)], tokens)  # 100 rows: the prefill path
    layers = len(stage.layers)
    assert layers == 8 and 0 < len(made) < 40, len(made)  # a layer's 15 or so each would be over 100


def _prefill_graphs(model, rows: int) -> list:
    """Every prefill path of ``model`` (its stages' and the MTP head's), set to replay graphs up to
    ``rows`` rows."""
    paths = [stage.cuda_prefill for stage in model.stages]
    if model.mtp is not None and model.mtp.cuda is not None:
        paths.append(model.mtp.cuda._prefill)
    for path in paths:
        path.graph_rows = rows
    return paths


def test_prompt_chunks_replay_prefill_graphs_with_the_launched_paths_logits(fake_gpu):
    """A chunk of one prompt through the prefill path, padded to a graph's rows and replayed as a
    graph: the first chunk of a size runs padded and is captured, the next replays it in another slot and
    at another position (read from the device), and each gives the float32 array path's logits, with
    drafting (the MTP head's prefill replays too); the replay gives the first run's bits. Two prompts in
    one chunk, or padding past the context, run launched."""
    from strata_cfg.schema.windows import prefill_graph_rows_for
    from strata_runtime.engine import Engine
    from strata_runtime.model import Model

    sizes = [prefill_graph_rows_for(n) for n in (1, 16, 17, 33, 100, 128, 129, 257)]
    assert sizes == [16, 16, 32, 64, 128, 128, 192, 320]
    graphed = Model.from_plan(_plan("cuda", draft_tokens=2))
    reference = Model.from_plan(_plan("cpu", draft_tokens=2))
    paths = _prefill_graphs(graphed, 128)
    g = np.random.default_rng(12)
    vocab = graphed.args.vocab_size
    prompt, more = g.integers(1, vocab, 100), g.integers(1, vocab, 30)
    windows = [
        ([(0, 100, 0)], prompt),  # a 128-row graph: run padded, then captured
        ([(0, 30, 100)], more),  # a 32-row graph, later in the slot
        ([(1, 100, 0)], prompt),  # the 128-row graph replayed in slot 1: slot 0's first logits
        ([(1, 30, 100)], g.integers(1, vocab, 30)),  # the 32-row graph replayed
        ([(0, 40, 130), (1, 40, 130)], g.integers(1, vocab, 80)),  # two prompts: launched
        ([(0, 86, 170)], g.integers(1, vocab, 86)),  # 128 rows would reach past the 256 positions: launched
    ]
    first = None
    for runs, tokens in windows:
        a, b = _logits(graphed, runs, tokens), _logits(reference, runs, tokens)
        # As the launched path against the float32 array path (`test_windows_through_...` above): padding
        # moves a row only by rounding (a product's sums over more rows), which may flip a near tie, of
        # the logits or of a router (`_far_rows`: measured 0.0012 to 0.0056 for the other rows, and up
        # to 4 of 86 rows swapping an expert, depending on the BLAS).
        rel, far = _far_rows(a, b)
        assert rel < 1e-2 and far.mean() <= 0.05, (runs, rel, np.flatnonzero(far))
        top2 = np.sort(b, axis=-1)[:, -2:]
        decided = top2[:, 1] - top2[:, 0] > 5e-3
        assert decided.mean() > 0.9 and (a.argmax(-1) == b.argmax(-1))[decided & ~far].all(), runs
        first = a if first is None else first
        if runs == [(1, 100, 0)]:
            assert np.array_equal(a, first)  # the replay reads slot and positions from the device
    assert [path.captured for path in paths[:-1]] == [{32, 128}], [p.captured for p in paths]

    def generate(rows: int) -> tuple[list[list[int]], list]:
        """Two requests one after the other on the same prompt, with drafting: the second replays."""
        engine = Engine(_plan("cuda", draft_tokens=2))
        paths = _prefill_graphs(engine.model, rows)
        texts = []
        for _ in range(2):
            handle = engine.submit(Request(tuple(int(t) for t in prompt), 8, ignore_eos=True))
            while engine.step():
                pass
            texts.append([t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids])
        return texts, paths

    (text, again), paths = generate(128)
    assert len(text) == 8 and text == again and [text, again] == generate(0)[0]
    # The engine reads the prompt in chunks of `prefill_chunk` rows (64, then 36): one 64-row graph each, the
    # stage's and the MTP head's.
    assert _plan("cuda").memory.prefill_chunk == 64
    assert [path.captured for path in paths] == [{64}] * 2


def test_products_call_cublas_itself_only_while_a_graph_captures(fake_gpu, monkeypatch):
    """CuPy refuses to set a cuBLAS stream while any stream captures, so inside `blas.capturing` a product
    calls the library itself, on the capturing stream; outside it takes CuPy's wrapper, which costs less
    host time per call. A failed call names itself."""
    import types

    import cupy

    from strata_runtime.cuda import blas

    calls: list[tuple] = []
    wrapper = types.SimpleNamespace(
        setStream=lambda h, stream: calls.append(("cupy stream", h, stream)),
        gemmStridedBatchedEx=lambda h, *a: calls.append(("cupy", h, a[2:5])),
    )
    status = [0]

    def gemm(h, *a):
        calls.append(("library", h, a[2:5]))
        return status[0]

    library = types.SimpleNamespace(
        cublasSetStream_v2=lambda h, stream: calls.append(("stream", h, stream)) or 0,
        cublasGemmStridedBatchedEx=gemm,
    )
    monkeypatch.setattr(blas, "cublas", wrapper)
    monkeypatch.setattr(blas, "_library", lambda: library)
    monkeypatch.setattr(
        cupy.cuda, "device", types.SimpleNamespace(get_cublas_handle=lambda: 7), raising=False
    )
    x, w = cupy.empty((5, 16), np.float16), cupy.empty((3, 16), np.float16)
    y = cupy.empty((5, 3), np.float32)
    blas._gemm(True, x, w, y, 1.0, 0.0)  # (the stand-in replaces matmul_nt itself)
    cap = cupy.cuda.Stream(non_blocking=True)
    with cap, blas.capturing():
        blas._gemm(True, x, w, y, 1.0, 0.0)
    first = ("cupy stream", 7, cupy.cuda.get_current_stream().ptr)  # the stream current outside
    assert calls == [first, ("cupy", 7, (3, 5, 16)), ("stream", 7, cap.ptr), ("library", 7, (3, 5, 16))]
    status[0] = 13
    with cap, blas.capturing(), pytest.raises(RuntimeError, match="cublasGemmStridedBatchedEx failed: .* 13"):
        blas._gemm(True, x, w, y, 1.0, 0.0)


def test_each_stage_of_a_split_replays_its_own_prefill_graph(fake_gpu):
    """Two stages on two GPUs: each stage's prefill path captures and replays its own graph over its own
    layers and KV, and the chunk's logits are the float32 array path's."""
    from strata_runtime.model import Model

    text = float16_profile_text(backend="cuda", preset="small", stages=2, slots=2, context=256)
    plan = resolve_text(text, "cuda-split.toml").plan
    assert len(plan.stages) == 2 and plan.memory.prefill_graph_rows == 64
    graphed = Model.from_plan(plan)
    reference = Model.from_plan(
        resolve_text(text.replace('backend = "cuda"', 'backend = "cpu"'), "c.toml").plan
    )
    paths = _prefill_graphs(graphed, 64)
    g = np.random.default_rng(4)
    vocab = graphed.args.vocab_size
    for runs in ([(0, 50, 0)], [(1, 50, 0)], [(0, 30, 50)]):
        tokens = g.integers(1, vocab, runs[0][1])
        a, b = _logits(graphed, runs, tokens), _logits(reference, runs, tokens)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2, runs
    assert [path.captured for path in paths] == [{32, 64}, {32, 64}]
    assert {stage.device.index for stage in graphed.stages} == {0, 1}


def test_the_cublas_prefill_attention_matches_the_flash_path(fake_gpu):
    from strata_runtime.cuda.prefill import CudaPrefill
    from strata_runtime.model import Model

    model = Model.from_plan(_plan("cuda"))
    stage = model.stages[0]
    hidden = np.random.default_rng(2).standard_normal((130, model.args.hidden_size)).astype(np.float32)
    outs = []
    for flash in (True, False):
        layout = Layout.of([(1, 90, 0), (0, 40, 0)])  # two slots' prompts in one window
        stage.kv.begin(layout.segments)
        outs.append(np.asarray(CudaPrefill(stage.cuda.stack, flash=flash).forward(hidden, layout)))
        model.rewind(1, 0)
        model.rewind(0, 0)
    # Both attend in fp16 products (the references round as the kernels do), in different orders.
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 1e-2


def test_every_prefill_path_of_a_gpu_plan_without_a_score_tile_takes_the_fused_kernel(fake_gpu):
    """Where the plan counts no tile of attention scores (a GPU at one of `FLASH_HEAD_DIMS`, which
    test_rt_flash_reference.py holds equal to the kernel's), each stage's prefill path and the MTP head's
    read prompts through the fused kernel, which stores none: nothing the plan does not know turns it off."""
    from strata_cfg.resolve.sizes import stores_attention_scores
    from strata_runtime.model import Model

    plan = _plan("cuda", draft_tokens=2)
    assert not stores_attention_scores(plan.machine.backend, plan.model.facts)
    model = Model.from_plan(plan)
    assert model.mtp is not None and model.mtp.cuda is not None
    paths = [stage.cuda_prefill for stage in model.stages] + [model.mtp.cuda._prefill]
    assert len(paths) > 1 and all(p is not None and p.flash for p in paths)


def test_fp16_q_prompt_attention_reaches_the_flash_calls(fake_gpu, monkeypatch):
    """``model.prefill_q = "fp16"``: every flash call of the stage's prefill gets no q_lo, and a chunk's
    output moves from the split's by q's fp16 rounding (not more); the MTP head's prefill takes the same
    precision; the default passes both parts."""
    from strata_runtime.cuda import prefill as prefill_module
    from strata_runtime.model import Model

    real = prefill_module.flash_prefill
    seen: list[bool] = []

    def spy(q_hi, q_lo, *rest, **kw):
        seen.append(q_lo is not None)
        real(q_hi, q_lo, *rest, **kw)

    monkeypatch.setattr(prefill_module, "flash_prefill", spy)
    text = float16_profile_text(backend="cuda", preset="small", slots=2, context=256, draft_tokens=2)
    outs = {}
    for q in ("split", "fp16"):
        plan = resolve_text(text.replace("[model]", f'[model]\nprefill_q = "{q}"'), "q.toml").plan
        assert plan.model.prefill_q == q
        model = Model.from_plan(plan)
        stage = model.stages[0]
        assert stage.cuda_prefill.split_q == (q == "split")
        assert model.mtp is not None and model.mtp.cuda is not None  # the MTP head reads prompts alike
        assert model.mtp.cuda._prefill.split_q == (q == "split")
        layout = Layout.of([(1, 120, 0)])
        stage.kv.begin(layout.segments)
        seen.clear()
        hidden = np.random.default_rng(5).standard_normal((120, model.args.hidden_size)).astype(np.float32)
        outs[q] = np.asarray(stage.cuda_prefill.forward(hidden, layout))
        assert seen and all(seen) == (q == "split") and any(seen) == (q == "split")
    # fp16 q moves a row by about 2e-3, and may swap an expert where a router's top-k is a near tie
    # (`_far_rows`: 3 of the 120 rows here, by 0.05 to 0.07; the chunk's norm measured 0.005 to 0.019,
    # depending on the BLAS).
    rel, far = _far_rows(outs["fp16"], outs["split"])
    assert 0 < rel < 5e-3 and far.mean() <= 0.05, (rel, np.flatnonzero(far))


def test_the_padded_expert_products_match_the_grouped_ones(fake_gpu):
    """A model whose widths the grouped kernels do not take reads its prompts through cuBLAS products over
    groups padded to the largest: both give a chunk's rows the same experts' outputs."""
    from strata_runtime.cuda.prefill import CudaPrefill
    from strata_runtime.model import Model

    model = Model.from_plan(_plan("cuda", "tiny"))
    stage = model.stages[0]
    hidden = np.random.default_rng(3).standard_normal((100, model.args.hidden_size)).astype(np.float32)
    outs = []
    for grouped in (True, False):
        prefill = CudaPrefill(stage.cuda.stack, grouped=grouped)
        assert (prefill.grouped is not None) == grouped
        layout = Layout.of([(0, 100, 0)])
        stage.kv.begin(layout.segments)
        outs.append(np.asarray(prefill.forward(hidden, layout)))
        model.rewind(0, 0)
    # The same fp16 products, rounded differently (the grouped SwiGLU reads fp32 gate/up, the padded one
    # fp16): measured 6.5e-4.
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 3e-3
    assert np.isfinite(outs[0]).all() and np.abs(outs[0] - hidden).max() > 0.1  # the layers did something


def test_greedy_text_on_the_cuda_path_does_not_depend_on_drafting(fake_gpu):
    from strata_runtime.engine import Engine

    def generate(plan) -> list[list[int]]:
        engine = Engine(plan)
        assert engine.model.stages[0].cuda is not None
        prompts = [(72, 101, 108, 108, 111), tuple(range(40, 70))]
        handles = [engine.submit(Request(p, 10)) for p in prompts]
        while engine.step():
            pass
        assert engine.model.stages[0].cuda._graphs  # decode windows replayed graphs
        assert not plan.batch.mtp or engine.totals["accepted"] > 0
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    plain = generate(_plan("cuda", "tiny"))
    drafted = generate(_plan("cuda", "tiny", batch_mtp=True, draft_tokens=4))
    assert all(len(t) == 10 for t in plain) and drafted == plain


def test_calibrated_routing_through_the_cuda_path_gives_the_array_paths_logits(fake_gpu, monkeypatch):
    """The route_bias step runs in the graph windows (eager, captured and replayed) and before the prefill
    path's top-k, biased by each layer's model layer (a second stage starts at a later one), with the tables
    of the request each slot was given: the logits of the array path, which biases through the twin."""
    import sys

    from strata_runtime.model import Model

    monkeypatch.setattr(sys.modules["cupy"].cuda.runtime, "getDeviceCount", lambda: 2)
    gpu = Model.from_plan(_plan("cuda", stages=2, routing="calibrated"))
    cpu = Model.from_plan(_plan("cpu", stages=2, routing="calibrated"))
    assert all(s.cuda_routing is not None for s in gpu.stages)
    assert gpu.stages[1].layer_range[0] == 2
    g = np.random.default_rng(3)
    vocab = gpu.args.vocab_size
    prompts = {0: g.integers(1, vocab, 100), 1: g.integers(1, vocab, 20)}
    for model in (gpu, cpu):
        for slot, prompt in prompts.items():
            model.admit(slot, tuple(prompt.tolist()))
    windows = [
        ([(0, 100, 0)], prompts[0]),  # the prefill path
        ([(1, 20, 0)], prompts[1]),  # 8-row graph windows
        ([(0, 3, 100), (1, 1, 20)], g.integers(1, vocab, 4)),  # decode rows of two slots: eager
        ([(0, 3, 103), (1, 1, 21)], g.integers(1, vocab, 4)),  # captured
        ([(0, 3, 106), (1, 1, 22)], g.integers(1, vocab, 4)),  # replayed
    ]
    for runs, tokens in windows:
        a, b = _logits(gpu, runs, tokens), _logits(cpu, runs, tokens)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2, runs  # as above: fp16 against float32
        assert (a.argmax(-1) == b.argmax(-1)).all(), runs
    assert gpu.stages[0].cuda._graphs


def _two_prompts(plan, tokens: int) -> tuple[list[list[int]], Any]:
    """Greedy text of two prompts (the first a chunk past the graph windows) through an engine of ``plan``,
    and the engine."""
    from strata_runtime.engine import Engine

    engine = Engine(plan)
    prompts = [tuple(range(40, 140)), (72, 101, 108, 108, 111) * 3]
    handles = [engine.submit(Request(p, tokens)) for p in prompts]
    while engine.step():
        pass
    return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles], engine


def test_an_expert_cache_on_the_cuda_path_changes_no_token(fake_gpu):
    """The CUDA path with a cache that swaps: the kernels read experts through address tables (slots and host
    memory), the prefill path copies misses into staging, the MTP head's experts share the cache, the upkeep
    runs between windows; greedy text equals the all-resident run's, and the cache moved experts."""
    kw = {"preset": "small", "batch_mtp": True, "draft_tokens": 3, "stages": 2, "prefill_chunk": 96}
    resident, _ = _two_prompts(_plan("cuda", **kw), 12)
    cached, engine = _two_prompts(
        _plan("cuda", expert_cache=5, cache_policy={"keep_misses": False}, **kw), 12
    )
    assert cached == resident
    for stage in engine.model.stages:
        assert stage.cuda_experts is not None and stage.experts.cached
        lay = next(lay for lay in stage.cuda.stack.layers if lay.router is not None)
        assert lay.gate_up is None  # read only through the tables
        stats = stage.experts.stats
        assert stats.misses > 0 and stats.hits > 0 and stats.swaps > 0
        # The device tables are what the kernels read: each address is the expert's slot or host copy.
        store, tables = stage.experts, stage.cuda_experts
        assert (np.asarray(tables.slot_of) == store.residency.slot_of).all()
        for j in range(len(store)):
            for e in range(store.n_experts):
                gate_up, down = store.weights(j, e) if store.resident(j, e) else store.host_weights(j, e)
                assert int(tables.gate_up[j, e]) == gate_up.ctypes.data
                assert int(tables.down[j, e]) == down.ctypes.data
    assert engine.model.mtp is not None and engine.model.mtp.stage is engine.model.stages[-1]


def _greedy(plan, prompts: list[tuple[int, ...]], tokens: int) -> tuple[list[list[int]], object]:
    from strata_runtime.engine import Engine

    engine = Engine(plan)
    handles = []
    for i, p in enumerate(prompts):
        handles.append(engine.submit(Request(p, tokens)))
        engine.step()  # staggered: each request arrives a step after the one before
        if i == 0:
            engine.step()
    while engine.step():
        pass
    assert engine.model.stages[-1].cuda is not None
    return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles], engine


def test_the_continuous_pipeline_on_the_cuda_path_stages_uploads_in_pinned_memory(fake_gpu):
    """Two stage threads, peer copies between the stages, uploads and read-backs through pinned memory:
    greedy text as in serial windows, and no upload from pageable memory."""
    import fake_cupy
    from rt_plans import with_mtp_in_groups

    prompts = [tuple(range(40, 110)), (72, 101, 108, 108, 111), tuple(range(60, 75))]  # 70 rows: prefill path
    alone, _ = _greedy(_plan("cuda", "tiny", draft_tokens=3), prompts, 8)  # one GPU: no hand-off
    serial, _ = _greedy(_cuda_split(slots=4, groups=1, draft_tokens=3), prompts, 8)
    fake_cupy.UPLOADS.clear()
    pipelined, eng = _greedy(_cuda_split(slots=4, groups=2, draft_tokens=3), prompts, 8)
    assert eng.executor._workers is not None and len(eng.executor._workers) == 2  # one thread per stage
    assert "peer access cuda:0 -> cuda:1: enabled" in eng.startup
    assert fake_cupy.UPLOADS and all(fake_cupy.UPLOADS), "an upload came from pageable memory"
    fake_cupy.UPLOADS.clear()
    in_groups, eng = _greedy(with_mtp_in_groups(_cuda_split(slots=4, groups=2, draft_tokens=3)), prompts, 8)
    assert all(fake_cupy.UPLOADS)
    assert any(w.kind == "pipelined-mtp" for w in eng.windows) and eng.totals["accepted"] > 0
    assert all(len(t) == 8 for t in alone) and serial == alone and pipelined == alone and in_groups == alone


def _cuda_split(**kw):
    text = float16_profile_text(preset="tiny", stages=2, context=256, **kw)
    return resolve_text(text, "cuda-split.toml").plan


def test_peer_access_counts_as_enabled_only_when_the_driver_says_it_already_is(fake_gpu):
    import cupy

    from strata_runtime.backend import Device, enable_peer_access

    pair = [Device.parse("cuda:2"), Device.parse("cuda:3")]
    assert enable_peer_access(pair) == [
        "peer access cuda:2 -> cuda:3: enabled",
        "peer access cuda:3 -> cuda:2: enabled",
    ]
    runtime = cupy.cuda.runtime
    enable = runtime.deviceEnablePeerAccess
    runtime.deviceEnablePeerAccess = lambda peer: None  # answers success and enables nothing
    try:
        pair = [Device.parse("cuda:0"), Device.parse("cuda:3")]
        assert all("NOT enabled" in line for line in enable_peer_access(pair))
    finally:
        runtime.deviceEnablePeerAccess = enable


def test_windows_running_ahead_on_the_cuda_path_give_the_array_paths_text(fake_gpu):
    """Greedy and seeded plain sampling through the CUDA path's head (the device's choice, the chained
    window's tokens crossing from the last stage to the first) give the same tokens running ahead on a split
    as one at a time on one stage; a hot request at min-p 1 gives the greedy text."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine

    requests = [
        Request((72, 101, 108, 108, 111), 12),
        Request(tuple(range(40, 60)), 12, sampling=SamplingParams(temperature=0.8, seed=9)),
        Request(tuple(range(60, 75)), 12, sampling=SamplingParams(temperature=1.5, min_p=1.0, seed=4)),
        Request(tuple(range(60, 75)), 12),
    ]

    def generate(plan, run_ahead: int) -> list[list[int]]:
        plan = plan.model_copy(update={"batch": plan.batch.model_copy(update={"run_ahead": run_ahead})})
        engine = Engine(plan)
        handles = [engine.submit(r) for r in requests]
        while engine.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    cpu = generate(_plan("cpu", "tiny"), 1)
    alone = generate(_plan("cuda", "tiny"), 1)
    assert all(len(t) == 12 for t in alone)
    assert generate(_cuda_split(slots=2, groups=1), 3) == alone
    # Greedy text is the array path's. A draw can land on the other side of a boundary the two paths'
    # float32 logits place a rounding apart, so the sampled text is compared within the CUDA path only.
    assert alone[0] == cpu[0]
    assert alone[2] == alone[3]  # min-p 1, through the head's upload of the cut: the top token alone


def test_a_reply_with_a_grammar_on_the_cuda_path_is_chosen_by_the_host_beside_windows_that_run_ahead(
    fake_gpu,
):
    """On a split whose serial windows run ahead (the device choosing tokens and the next window reading
    them), a request with a JSON schema gets its tokens chosen by the host over the allowed ones: its reply
    is the schema's JSON, the same greedy reply as on the array path, and the request beside it (greedy, its
    tokens chosen on the device) gets the text it gets alone. With batch MTP the replies are the same, with
    the schema's forced tokens read as proposals and, with that off, with both requests drafting."""
    import json

    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine
    from strata_runtime.structured import json_grammar

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    }
    shaped = Request(tuple(b"Give me JSON: "), 40, sampling=SamplingParams(grammar=json_grammar(schema)))
    plain = Request((72, 101, 108, 108, 111), 14)

    engines: list[Engine] = []

    def generate(plan, requests, forcing: bool = True) -> list[list[int]]:
        engine = Engine(plan)
        engine.forcing = forcing
        engines.append(engine)
        handles = [engine.submit(r) for r in requests]
        while engine.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    split = _cuda_split(slots=2, groups=1)
    split = split.model_copy(update={"batch": split.batch.model_copy(update={"run_ahead": 3})})
    reply, beside = generate(split, [shaped, plain])
    value = json.loads(bytes(reply))
    assert set(value) == {"id", "ok"} and 0 <= value["id"] <= 99 and isinstance(value["ok"], bool)
    assert [reply] == generate(_plan("cpu", "tiny"), [shaped])
    assert [beside] == generate(split, [plain]) and len(beside) == 14
    # Batch MTP: the window that holds both drafts, and is decided on the host, not the device.
    text = float16_profile_text(
        backend="cuda", preset="tiny", context=256, slots=2, batch_mtp=True, draft_tokens=4
    )
    mtp = resolve_text(text, "cuda-mtp.toml").plan
    assert mtp.batch.mtp
    assert generate(mtp, [shaped, plain]) == [reply, beside]  # the schema's keys read as forced proposals
    assert engines[-1].totals["forced"] > 0
    assert generate(mtp, [shaped, plain], forcing=False) == [reply, beside]  # and drafted
    kinds = {w.kind for w in engines[-1].windows}
    assert "batch-mtp" in kinds and engines[-1].totals["accepted"] > 0


def test_sampled_drafting_on_the_cuda_path_takes_every_distribution_from_the_kernel(fake_gpu, monkeypatch):
    """A sampled request that drafts on the CUDA path, seeded or not, with top-k and top-p: every distribution
    its windows draw proposals from and verify them against comes from the ``distribution_rows`` launcher (its
    NumPy twin here), for the target's rows and the drafts' alike, never from the rule's array steps (on a
    GPU, CuPy's partition and whole-row sorts); its drafts are verified by the ``verify_sampled_rows``
    launcher and the next ones drawn by ``inverse_cdf_rows`` (not by the rule's dozen CuPy steps), and a seed
    gives the same text on every run."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine
    from strata_runtime.model import stage
    from strata_runtime.reference import kernels as reference

    shapes: list[tuple[int, ...]] = []
    twin = reference.distribution

    def counted(logits, *args, **kw):
        shapes.append(tuple(logits.shape))
        twin(logits, *args, **kw)

    def array_steps(*args, **kw):
        raise AssertionError("a distribution on the CUDA path ran the rule's array steps")

    launched: list[str] = []

    def count(name: str, launcher, *args):
        launched.append(name)
        launcher(*args)

    for name in ("verify_sampled", "inverse_cdf"):  # the launchers' twins, counted
        monkeypatch.setattr(reference, name, functools.partial(count, name, getattr(reference, name)))
        monkeypatch.setattr(stage, name, array_steps)
    monkeypatch.setattr(reference, "distribution", counted)
    monkeypatch.setattr(stage, "distribution", array_steps)

    def generate(seed: int | None) -> tuple[list[int], int]:
        engine = Engine(_plan("cuda", "tiny", draft_tokens=4))
        sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=seed)
        handle = engine.submit(Request((72, 101, 108, 108, 111), 24, sampling=sampling))
        while engine.step():
            pass
        tokens = [t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids]
        return tokens, engine.totals["proposals"]

    first, proposed = generate(seed=5)
    assert len(first) == 24 and proposed > 0
    assert {rows for rows, _ in shapes} >= {1, 3, 4}  # a draft's row, and a 4-row window's q and p
    assert {"verify_sampled", "inverse_cdf"} <= set(launched)
    assert generate(seed=5)[0] == first
    shapes.clear()
    tokens, proposed = generate(seed=None)  # its text, and where an end token falls, follow window times
    assert tokens and (proposed == 0 or shapes)


def test_host_launched_drafts_decided_on_the_device_are_drawn_by_the_draw_launcher(fake_gpu, monkeypatch):
    """A host-launched window decided on the device (`speculative.draft` with ``on_device``) draws each
    sampled proposal through the ``inverse_cdf_rows`` launcher (its NumPy twin here), as windows decided on
    the device do, never by the rule's array steps; a host draw keeps its q instead, and both give the same
    tokens at the same uniforms."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import speculative
    from strata_runtime.engine.sampling import Sampler
    from strata_runtime.model import Model, stage
    from strata_runtime.reference import kernels as reference

    draws: list[int] = []
    twin = reference.inverse_cdf

    def counted(probs, *args):
        draws.append(probs.shape[0])
        twin(probs, *args)

    def array_steps(*args, **kw):
        raise AssertionError("a draw on the CUDA path ran the rule's array steps")

    monkeypatch.setattr(reference, "inverse_cdf", counted)
    monkeypatch.setattr(stage, "inverse_cdf", array_steps)
    model = Model.from_plan(_plan("cuda", "tiny", draft_tokens=4))
    prompt = np.array([72, 101, 108, 108, 111, 32, 119])
    normed = model.forward(prompt, Layout.of([(0, len(prompt), 0)]))
    speculative.commit(model, 0, 0, len(prompt), normed, [*prompt[1:].tolist(), 111], tracked=True)
    drafter = model.drafters[0]
    kept = drafter.length
    sampling = SamplingParams(temperature=1.3, top_k=40, top_p=0.95)
    on_host = speculative.draft(model, 0, 111, 3, Sampler(sampling, 9), on_device=False)
    drafter.rewind(kept)
    assert not draws and len(on_host.q) == 3
    on_device = speculative.draft(model, 0, 111, 3, Sampler(sampling, 9), on_device=True)
    assert draws == [1, 1, 1] and not on_device.q
    assert on_device.tokens == on_host.tokens


def _int8_head(plan):
    """``plan`` with the MTP head drafting through its 8-bit LM head (``spec.draft_head = "int8"``)."""
    return plan.model_copy(update={"spec": plan.spec.model_copy(update={"draft_head": "int8"})})


def test_no_window_waits_for_a_gemv_to_compile(fake_gpu):
    """Every GEMV a window launches (the layers', the LM head's on normalised rows, the MTP head's input
    projections) at every row count the engine runs (solo drafting, serial and batch-MTP windows, greedy
    and sampled, decided on the host and on the device) was listed for compiling when the engine was built.
    On a GPU an instantiation compiled at its first launch stalls that window for a second or more."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.cuda import ops
    from strata_runtime.engine import Engine

    kernels = ops.kernels_for(0)
    sampled = SamplingParams(temperature=0.8, seed=3)
    for plan in (
        _plan("cuda", "tiny", draft_tokens=3),
        _plan("cuda", "tiny", batch_mtp=True, draft_tokens=4),
        _plan("cuda", "small", batch_mtp=True, draft_tokens=2),
        _int8_head(_plan("cuda", "tiny", batch_mtp=True, draft_tokens=4)),  # drafts through gemv_i8
    ):
        kernels.prepared.clear()
        kernels.unprepared.clear()
        engine = Engine(plan)
        lone = [Request((72, 101, 108, 108, 111), 12)]  # alone in the engine: solo drafting
        pair = [Request(tuple(range(40, 60)), 12), Request((3, 4, 5), 12, sampling=sampled)]
        handles = []
        for requests in (lone, pair):
            handles += [engine.submit(r) for r in requests]
            while engine.step():
                pass
        assert all(h.events.qsize() for h in handles)
        assert engine.totals["accepted"] > 0  # drafts were verified
        assert kernels.prepared and kernels.unprepared == [], sorted(set(kernels.unprepared))
        assert any(e.startswith("gemv_i8<") for e in kernels.prepared) == (plan.spec.draft_head == "int8")


def test_a_gpu_older_than_ampere_runs_the_array_path_and_says_why(fake_gpu, monkeypatch):
    """The kernels need compute capability 8.0 (they would not compile for a Turing or Volta GPU): on an
    older GPU each stage and the MTP head run the array path on CuPy, the reason names the capability, and
    the greedy text is the array path's."""
    import cupy

    from strata_runtime.engine import Engine

    def generate(plan) -> tuple[list[list[int]], Engine]:
        engine = Engine(plan)
        handles = [engine.submit(Request((72, 101, 108, 108, 111), 12))]  # alone: solo drafting
        while engine.step():
            pass
        text = [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]
        return text, engine

    cpu, _ = generate(_plan("cpu", "tiny", draft_tokens=2))
    monkeypatch.setattr(type(cupy.cuda.Device()), "compute_capability", "75")
    text, engine = generate(_plan("cuda", "tiny", draft_tokens=2))
    stage = engine.model.stages[0]
    assert stage.cuda is None and stage.cuda_head is None
    assert stage.cuda_refused == "cuda:0 has compute capability 7.5; the kernels need 8.0 (Ampere) or later"
    assert engine.totals["accepted"] > 0  # the drafters ran too
    assert text == cpu and len(text[0]) == 12


def test_logprobs_on_the_cuda_path_are_the_array_paths(fake_gpu):
    """A request's token and prompt log-probabilities through the CUDA path's head (the raw logits copied to
    pinned memory before the device adjusts them for a penalty, windows running ahead and drafted windows
    decided on the device) are the array path's, within the fp16 weights' rounding."""
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine

    params = SamplingParams(presence_penalty=2.0, frequency_penalty=1.0, logprobs=2, prompt_logprobs=1)
    request = Request(tuple(range(40, 60)), 10, sampling=params)

    def figures(plan) -> tuple[list[int], list[float], list[float]]:
        engine = Engine(plan)
        handle = engine.submit(request)
        while engine.step():
            pass
        events = [handle.events.get() for _ in range(handle.events.qsize())]
        tokens = [t for ev in events for t in ev.token_ids]
        lps = [lp for ev in events for lp in ev.logprobs]
        assert [lp.token for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
        prompt = [lp for ev in events for lp in ev.prompt_logprobs]
        assert [lp.token for lp in prompt] == list(request.prompt_ids[1:])
        return tokens, [lp.logprob for lp in lps], [lp.logprob for lp in prompt]

    plan = _plan("cuda", "tiny", batch_mtp=True, draft_tokens=4)
    cpu = figures(_plan("cpu", "tiny", batch_mtp=True, draft_tokens=4))
    gpu = figures(plan)
    assert gpu[0] == cpu[0]
    np.testing.assert_allclose(gpu[1], cpu[1], atol=2e-2)
    np.testing.assert_allclose(gpu[2], cpu[2], atol=2e-2)
    # The reply read back as a prompt, with no penalty: its tokens' figures are the ones decoding reported.
    engine = Engine(plan)
    whole = Request((*request.prompt_ids, *gpu[0]), 1, sampling=SamplingParams(prompt_logprobs=0))
    handle = engine.submit(whole)
    while engine.step():
        pass
    read = [
        lp.logprob
        for ev in [handle.events.get() for _ in range(handle.events.qsize())]
        for lp in ev.prompt_logprobs
    ]
    np.testing.assert_allclose(read[len(request.prompt_ids) - 1 :], gpu[1], atol=2e-2)


@pytest.mark.parametrize("shape", ["drafting", "three slots"])
def test_the_warm_up_captures_the_graphs_requests_then_replay(fake_gpu, monkeypatch, shape):
    """`Engine.warm_up` runs every window shape a request mix takes at least twice, so that no graph is
    captured once requests run: one request alone (drafting at its full depth), then two together in
    batch-MTP windows; or without drafting, one, two and three slots together in serial windows. It forgets
    its requests' statistics, and a request's greedy text is what an engine that never warmed up gives."""
    import fake_cupy

    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine

    captures: list[int] = []
    end_capture = fake_cupy._Stream.end_capture
    monkeypatch.setattr(fake_cupy._Stream, "end_capture", lambda s: captures.append(1) or end_capture(s))
    if shape == "drafting":
        plan = _plan("cuda", "tiny", batch_mtp=True, draft_tokens=4, adaptive_depth=False)
    else:
        text = float16_profile_text(backend="cuda", preset="tiny", slots=3, context=256)
        plan = resolve_text(text, "cuda-path.toml").plan
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=3)
    later = [Request(tuple(range(40, 70)), 10), Request((5, 6, 7), 10, sampled), Request((9, 8), 10)]

    def serve(engine: Engine) -> list[list[int]]:
        """One request alone for 12 tokens, then the others together (greedy and sampled)."""
        handles = [engine.submit(Request((72, 101, 108, 108, 111), 12))]
        while engine.step():
            pass
        handles += [engine.submit(r) for r in later[: plan.batch.slots]]
        while engine.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    from strata_runtime.model.kvcache import KVCache

    copies: list[int] = []
    copy_rows = KVCache.copy_rows
    monkeypatch.setattr(KVCache, "copy_rows", lambda kv, *a: copies.append(a[-1]) or copy_rows(kv, *a))
    warmed = Engine(plan)
    assert warmed.stats()["warm_up"] is None
    assert warmed.warm_up() > 0 and captures
    # It copied one position between two slots (the copy's kernels compiled), then forgot it: every slot
    # holds nothing, and no request counts a copy.
    drafting = 1 if warmed.model.drafters else 0  # the drafters' copy: one slot's drafter to another's
    assert copies == [1] * (len(warmed.model.stages) + drafting) and warmed.totals["prefix_copies"] == 0
    assert all(warmed.model.kv_lengths(i) == [0] * len(warmed.model.stages) for i in range(warmed.n_slots))
    assert all(d.length == 0 for d in warmed.model.drafters.values())
    assert warmed.stats()["warm_up"]["windows"] > 0 and warmed.stats()["warm_up"]["seconds"] > 0
    assert warmed.totals["windows"] == 0 and warmed.totals["tokens"] == 0  # the warm-up is forgotten
    held = len(captures)
    texts = serve(warmed)
    assert len(captures) == held  # every window the requests ran was captured during the warm-up
    assert warmed.totals["windows"] > 0 and (shape != "drafting" or warmed.totals["accepted"] > 0)
    greedy = [0, 1] if shape == "drafting" else [0, 1, 3]
    fresh = serve(Engine(plan))
    assert [texts[i] for i in greedy] == [fresh[i] for i in greedy]  # the warm-up changes no greedy token


@pytest.mark.parametrize("slots", [1, 3])
def test_after_the_warm_up_no_window_runs_eagerly_or_is_captured(fake_gpu, monkeypatch, slots):
    """Whatever rows a window takes (a short prompt's last window, the first draft after a prompt, a
    request's last window, batch MTP beside solo windows), it replays a graph the warm-up captured: every
    row count of 1 to 8 through the layers and through the drafting head, at host positions and at
    positions decided on the device. The KV lengths it leaves are zero, and greedy text is what an engine
    that never warmed up gives."""
    from strata_cfg.schema.windows import MAX_WINDOW_ROWS
    from strata_runtime.api import SamplingParams
    from strata_runtime.engine import Engine

    unreplayed = record_unreplayed(monkeypatch)
    text = float16_profile_text(
        backend="cuda",
        preset="tiny",
        slots=slots,
        context=512,
        batch_mtp=slots > 1,
        draft_tokens=3,
        adaptive_depth=False,
    )
    plan = resolve_text(text, "cuda-path.toml").plan
    g = np.random.default_rng(31)
    prompts = [tuple(g.integers(1, 250, int(n)).tolist()) for n in (17, 11, 29)[:slots]]
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5)

    def serve(engine: Engine) -> list[list[int]]:
        reqs = [Request(p, 20 + i, sampled if i == 1 else SamplingParams()) for i, p in enumerate(prompts)]
        handles = [engine.submit(r) for r in reqs]
        while engine.step():
            pass
        return [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]

    warmed = Engine(plan)
    assert warmed.warm_up() > 0
    model = warmed.model
    every = frozenset(range(1, MAX_WINDOW_ROWS + 1))
    assert model.stages[0].cuda.captured == every
    assert model.mtp.cuda.layers.captured == every and model.mtp.cuda.device_layers.captured == every
    assert all(model.kv_lengths(s) == [0] for s in range(slots))
    assert all(d.length == 0 for d in model.drafters.values())
    unreplayed.clear()
    texts = serve(warmed)
    assert warmed.totals["accepted"] > 0
    assert unreplayed == []
    fresh = serve(Engine(plan))
    assert unreplayed  # without the warm-up, the first windows of each shape run eagerly, then capture
    greedy = [i for i in range(slots) if i != 1]
    assert [texts[i] for i in greedy] == [fresh[i] for i in greedy]


def test_only_windows_that_replayed_their_graph_are_timed_and_the_warm_up_keeps_their_times(fake_gpu):
    """A window during which a window shape ran eagerly or was captured is no measure of its shape: its time
    does not count in the window times that choose the solo depth and batch MTP. So a fresh engine times
    fewer windows than it runs, one warmed up times every window of a request; and the warm-up keeps the
    times it measured, while forgetting its windows and what its proposals did."""
    from strata_runtime.engine import Engine

    timed: list[int] = []
    observe = WindowCosts.observe

    def serve(engine: Engine) -> tuple[int, int]:
        """One request alone: (its solo windows, those timed)."""
        timed.clear()
        before = sum(1 for w in engine.windows if w.kind == "solo")
        engine.submit(Request(tuple(range(40, 70)), 24))
        while engine.step():
            pass
        return sum(1 for w in engine.windows if w.kind == "solo") - before, len(timed)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            WindowCosts, "observe", lambda self, rows, ms: timed.append(rows) or observe(self, rows, ms)
        )
        fresh = Engine(_plan("cuda", "tiny", batch_mtp=True, draft_tokens=4))
        assert fresh.choice.adaptive and fresh.choice.adaptive_batch
        ran, counted = serve(fresh)
        assert 0 < counted < ran  # the first windows of each shape ran eagerly or were captured
        warmed = Engine(_plan("cuda", "tiny", batch_mtp=True, draft_tokens=4))
        assert warmed.warm_up() > 0
        kept = {kind: dict(costs.ms) for kind, (costs, _) in warmed.choice.solo.items()}
        assert kept["greedy"]  # measured by windows that replayed graphs
        assert all(not holds.reached for _, holds in warmed.choice.solo.values())  # proposals forgotten
        assert warmed.totals["windows"] == 0
        ran, counted = serve(warmed)
        assert ran > 0 and counted == ran  # every window replayed a graph captured in the warm-up


def test_the_warm_up_fits_a_short_context(fake_gpu):
    """A context shorter than the warm-up's prompt and replies: they are cut to fit, so its prompt is read
    rather than refused, and every number of slots still decodes together."""
    from strata_runtime.engine import Engine

    text = float16_profile_text(backend="cuda", preset="tiny", slots=3, context=24)
    engine = Engine(resolve_text(text, "cuda-path.toml").plan)
    assert engine.warm_up() > 0
    assert engine._admitted == 4  # the prompt and a request per slot, none refused
    assert {1, 2, 3} <= set(engine.model.stages[0].cuda._graphs)  # rows: each count of slots together


def test_the_warm_up_reads_a_prompt_through_the_prefill_path_where_the_context_allows(fake_gpu, monkeypatch):
    """Its first prompt is two prefill chunks long where a chunk is more than ``memory.prompt_graph_rows``
    (64 here), the prompt fits a quarter of the context and every expert is in VRAM: the
    stage's and the drafting head's prefill path then run before a long prompt needs them. Otherwise it stays
    at 32 tokens, which the graph windows read (with an expert cache a long prompt would read most experts
    over the host link and teach the cache random routing). Where the prefill path also reads short prompts
    (``memory.prompt_graph_rows`` below 64), one prompt of each prefill graph's rows takes it as well, so
    that each graph is captured (`strata_cfg.schema.windows.warm_prompt_lengths`)."""
    from strata_cfg.schema.windows import prefill_graph_rows_for
    from strata_runtime.cuda.mtp import CudaMtp
    from strata_runtime.cuda.prefill import CudaPrefill
    from strata_runtime.engine import Engine

    ran: list[tuple[str, int]] = []
    stage_run, head_run = CudaPrefill.run, CudaMtp.prefill

    def stage(self, resid, layout):
        ran.append(("stage", layout.rows))
        return stage_run(self, resid, layout)

    def head(self, emb, hidden, layout):
        ran.append(("head", layout.rows))
        return head_run(self, emb, hidden, layout)

    monkeypatch.setattr(CudaPrefill, "run", stage)
    monkeypatch.setattr(CudaMtp, "prefill", head)
    for context, chunk, cache, graph_rows, expected in (
        (1024, 128, None, None, [128]),
        (1024, 64, None, None, []),
        (256, 128, None, None, []),
        (1024, 128, 4, None, []),  # an expert cache
        # The long prompt's chunks, then one prompt of each prefill graph's rows past 24: 128, 64 and 32.
        (1024, 128, None, 24, [128, 64, 32]),
        (256, 128, None, 24, [64, 32]),  # a quarter of the context: one 64-row chunk, then 64 and 32 rows
    ):
        ran.clear()
        text = float16_profile_text(
            backend="cuda",
            preset="tiny",
            slots=2,
            context=context,
            draft_tokens=4,
            prefill_chunk=chunk,
            expert_cache=cache,
        )
        plan = resolve_text(text, "cuda-path.toml").plan
        # 64 rows of graph windows (the rule gives 16 on these 20 GB/s devices), unless the case says
        memory = plan.memory.model_copy(update={"prompt_graph_rows": graph_rows or 64})
        plan = plan.model_copy(update={"memory": memory})
        engine = Engine(plan)
        assert engine.warm_up() > 0
        assert sorted({rows for kind, rows in ran if kind == "head"}, reverse=True) == expected, ran
        assert sorted({rows for kind, rows in ran if kind == "stage"}, reverse=True) == expected, ran
        # Every chunk of one prompt that the prefill path read replays a graph from then on.
        graphs = {prefill_graph_rows_for(rows) for rows in expected} if cache is None else set()
        assert engine.model.stages[0].cuda_prefill.captured == graphs
        assert engine.model.mtp is not None and engine.model.mtp.cuda._prefill.captured == graphs


def test_the_warm_up_runs_nothing_on_cpu_devices():
    from strata_runtime.engine import Engine

    engine = Engine(_plan("cpu", "tiny", draft_tokens=4))
    assert engine.warm_up() == 0 and engine.totals["windows"] == 0


def test_the_server_warms_the_engine_up_before_it_answers(fake_gpu):
    """`strata serve` builds the engine, then warms it up while ``/health`` still says loading, with the
    warm-up's label and fraction as its progress."""
    from strata_runtime.commands.serve import _factory
    from strata_runtime.server.engine_loop import LoadProgress

    progress = LoadProgress()
    seen: list[tuple[str, float]] = []
    report = progress.report
    progress.report = lambda label, fraction: seen.append((label, fraction)) or report(label, fraction)  # type: ignore[method-assign]
    plan = _plan("cuda", "tiny", draft_tokens=4, serve=True)
    assert plan.serve is not None and plan.serve.warm_up
    engine = _factory(plan)(progress)
    assert seen and all(label.startswith("warming up") for label, _ in seen)
    assert [f for _, f in seen] == sorted(f for _, f in seen) and seen[-1][1] == 1.0
    assert (progress.progress, progress.fraction) == seen[-1]
    assert engine.totals["windows"] == 0 and engine.stats()["queue"] == 0
    # serve.warm_up = false: the engine answers at once, its graphs left to the first requests
    seen.clear()
    text = float16_profile_text(
        backend="cuda", preset="tiny", slots=2, context=256, draft_tokens=4, serve=True
    )
    cold = resolve_text(text.replace("[serve]", "[serve]\nwarm_up = false"), "cuda-path.toml").plan
    assert cold.serve is not None and not cold.serve.warm_up
    engine = _factory(cold)(progress)
    assert not seen and not engine.model.stages[0].cuda._graphs


def test_the_bench_warm_up_captures_every_window_shape(fake_gpu):
    """`strata bench` warms each arm up before its first repeat: after its requests, every row count of 1 to
    8 replays a graph through the layers and the drafting head, so no measured repeat captures one; and the
    warm-up's windows and what its proposals did are forgotten."""
    from strata_cfg.schema.windows import MAX_WINDOW_ROWS
    from strata_runtime.bench.preparing import warm_up
    from strata_runtime.engine import Engine

    engine = Engine(_plan("cuda", "tiny", draft_tokens=3))
    assert engine.choice.adaptive
    observed: list[int] = []
    observe = WindowCosts.observe
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            WindowCosts, "observe", lambda self, rows, ms: observed.append(rows) or observe(self, rows, ms)
        )
        warm_up({"solo": engine}, 20, engine.model.args.vocab_size, streams=1)
    assert observed and engine.choice.solo
    assert all(not holds.reached for _, holds in engine.choice.solo.values())
    assert engine.totals["windows"] == 0
    every = frozenset(range(1, MAX_WINDOW_ROWS + 1))
    mtp = engine.model.mtp.cuda
    assert engine.model.stages[0].cuda.captured == every
    assert mtp.layers.captured == every and mtp.device_layers.captured == every


def test_a_window_shape_the_warm_up_missed_is_named_in_the_log(fake_gpu, caplog):
    """After the warm-up, a window that runs a shape for the first time (here: one whose graph is dropped
    on purpose) says so in the log, with its kind and rows; windows that replay say nothing."""
    import logging

    from strata_runtime.engine import Engine

    plan = _plan("cuda", "tiny", draft_tokens=3)  # a 30-token prompt in 8-row windows, not a prefill graph
    engine = Engine(
        plan.model_copy(update={"memory": plan.memory.model_copy(update={"prompt_graph_rows": 64})})
    )
    assert engine.warm_up() > 0
    with caplog.at_level(logging.INFO, logger="strata_runtime"):
        engine.submit(Request(tuple(range(40, 70)), 8))
        while engine.step():
            pass
        assert not [r for r in caplog.records if "after the warm-up" in r.getMessage()]
        stage = engine.model.stages[0].cuda
        stage._graphs.clear()  # as if the warm-up had not captured any of them
        stage._seen.clear()
        engine.submit(Request(tuple(range(41, 71)), 8))  # no prefix to reuse: the whole prompt is read
        while engine.step():
            pass
    missed = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
    assert missed and all("window shape or kernel for the first time" in m for m in missed)
    # the prompt's 8-row windows ran eagerly, then the first solo window of each depth eagerly and captured
    # (the depth a window drafts follows the window times measured, so which depths run is not fixed)
    assert missed[0].startswith("a prefill window of 30 rows")
    assert [m for m in missed if m.startswith("a solo window of ")]


def test_a_short_prompt_reaches_the_drafting_head_through_its_graphs(fake_gpu, monkeypatch):
    """A prompt chunk of 9 to ``memory.prompt_graph_rows`` rows runs the MTP head in 8-row graph windows, as
    the stages read it, not through the prefill path (cuBLAS products launched layer by layer, whose first
    run at a new row count also loads kernels); the drafters' KV it writes is the prefill path's to fp16
    rounding, and a longer chunk takes the prefill path, in the head and in every stage."""
    from strata_cfg.schema.windows import MAX_WINDOW_ROWS
    from strata_runtime.cuda.mtp import CudaMtp
    from strata_runtime.cuda.prefill import CudaPrefill
    from strata_runtime.engine import Engine

    calls: list[int] = []
    stage_calls: list[int] = []
    prefill, stage_prefill = CudaMtp.prefill, CudaPrefill.forward

    def spy(self, emb, hidden, layout):
        calls.append(layout.rows)
        return prefill(self, emb, hidden, layout)

    def stage_spy(self, hidden, layout):
        stage_calls.append(layout.rows)
        return stage_prefill(self, hidden, layout)

    monkeypatch.setattr(CudaMtp, "prefill", spy)
    monkeypatch.setattr(CudaPrefill, "forward", stage_spy)

    def drafter_kv(*prompts: tuple[int, ...], graph_rows: int = 64, head_only: bool = False):
        """The drafters' KV after reading ``prompts`` together (each in a slot of its own) and one token, with
        ``memory.prompt_graph_rows = graph_rows`` (``head_only``: the stages keep 64, so that the head's
        two paths read the same hidden rows); and the rows the head read through the prefill path."""
        calls.clear()
        stage_calls.clear()
        plan = _plan("cuda", "tiny", draft_tokens=4, prefill_chunk=128)
        assert plan.memory.prefill_graph_rows == 128  # the prefill path replays its chunks as graphs
        memory = plan.memory.model_copy(update={"prompt_graph_rows": graph_rows})
        engine = Engine(plan.model_copy(update={"memory": memory}))
        stage_rows = 64 if head_only else graph_rows
        for stage in engine.model.stages:
            stage.prompt_graph_rows = stage_rows
        handles = [engine.submit(Request(p, 1)) for p in prompts]
        while engine.step():
            pass
        assert all(h.events.qsize() > 0 for h in handles)
        cuda = engine.model.mtp.cuda
        kv = np.stack([np.asarray(cuda.stack.k_cache), np.asarray(cuda.stack.v_cache)])
        # The stages read the window's chunk whole (both prompts' rows), the head each slot's rows.
        rows = sum(map(len, prompts))
        assert stage_calls == ([rows] if rows > max(stage_rows, MAX_WINDOW_ROWS) else []), stage_calls
        return kv[..., : max(map(len, prompts)), :].astype(np.float32), list(calls)

    def close(graphs: np.ndarray, products: np.ndarray) -> None:
        written = np.isfinite(products) & (products != 0)
        assert written.any() and np.isfinite(graphs[written]).all()
        err = np.linalg.norm(graphs[written] - products[written]) / np.linalg.norm(products[written])
        assert err < 2e-2, err  # fp16 KV from gemv and cuBLAS products in different orders

    short = tuple(40 + (7 * i) % 50 for i in range(30))
    pair = (tuple(40 + (5 * i) % 50 for i in range(20)), tuple(40 + (3 * i) % 50 for i in range(25)))
    graphs, through = drafter_kv(short)
    assert through == []  # 30 rows: 8-row graph windows, no prefill path
    two_graphs, through = drafter_kv(*pair)
    assert through == []  # two prompts at once, each in its own slot
    # every chunk of more than 8 rows of the head through the prefill path
    products, through = drafter_kv(short, graph_rows=MAX_WINDOW_ROWS, head_only=True)
    assert through == [30]
    close(graphs, products)
    two_products, through = drafter_kv(*pair, graph_rows=MAX_WINDOW_ROWS, head_only=True)
    assert sum(through) == 45
    close(two_graphs, two_products)
    _, through = drafter_kv(short, graph_rows=24)
    assert through == [30]  # more than 24 rows, in the head and the stages
    _, through = drafter_kv(*pair, graph_rows=24)
    assert through == [25]  # the 20-row prompt in graph windows, the 25-row one through the prefill path
    _, through = drafter_kv(tuple(40 + (7 * i) % 50 for i in range(100)))
    assert through == [100]  # longer than 64 rows: the prefill path


def test_the_decode_attention_choice_reaches_every_stack_and_its_graphs(fake_gpu, monkeypatch):
    """``model.decode_attention``: ``"auto"`` runs a preset's decode attention on tensor cores in the stage's
    layers and in the MTP head's, ``"cuda_cores"`` on CUDA cores in both, and their graphs compile that
    kernel (and not the other) before the first window."""
    import inspect

    from strata_runtime.cuda import layers
    from strata_runtime.model import Model

    real = layers.LayerStack.of.__func__
    asked_of: list[bool] = []

    def spy(cls, *args, **kw):
        bound = inspect.signature(real).bind(cls, *args, **kw)
        bound.apply_defaults()
        asked_of.append(bound.arguments["attention_tc"])
        return real(cls, *args, **kw)

    monkeypatch.setattr(layers.LayerStack, "of", classmethod(spy))
    text = float16_profile_text(backend="cuda", preset="small", slots=2, context=256, draft_tokens=2)
    for asked, tc in (("auto", True), ("cuda_cores", False)):
        plan = resolve_text(text.replace("[model]", f'[model]\ndecode_attention = "{asked}"'), "a.toml").plan
        assert plan.model.decode_attention == ("tensor_cores" if tc else "cuda_cores")
        asked_of.clear()
        model = Model.from_plan(plan)
        assert model.mtp is not None and model.mtp.cuda is not None
        assert asked_of == [tc] * (len(model.stages) + 1)  # each stage's layers, then the MTP head's
        for cuda in [stage.cuda for stage in model.stages] + [model.mtp.cuda.layers]:
            names = {e.split("<")[0] for e in cuda.expressions()}
            assert ("attn_tc" in names, "attn_split" in names) == (tc, not tc)


def test_two_engines_of_one_device_each_run_the_decode_attention_their_plan_chose(fake_gpu):
    """The device's kernels are one object that every stack on it shares, so the choice of decode attention
    is each layer's: two engines built in one process (as `strata bench --vary model.decode_attention=...`
    builds its arms) each launch their own plan's kernel, whichever was built last."""
    from strata_runtime.engine import Engine

    text = float16_profile_text(backend="cuda", preset="small", slots=2, context=256, draft_tokens=2)
    engines = {  # both built before either runs a window; "cuda_cores" last
        asked: Engine(
            resolve_text(text.replace("[model]", f'[model]\ndecode_attention = "{asked}"'), "a.toml").plan
        )
        for asked in ("auto", "cuda_cores")
    }
    kern = engines["auto"].model.stages[0].cuda.stack.kern
    assert kern is engines["cuda_cores"].model.stages[0].cuda.stack.kern  # one device, one kernel set
    texts = []
    for asked, kernel in (("auto", "attn_tc"), ("cuda_cores", "attn_split"), ("auto", "attn_tc")):
        kern.attention_kernels.clear()
        handle = engines[asked].submit(Request((5, 9, 2, 7, 11), 6, ignore_eos=True))
        while engines[asked].step():
            pass
        texts.append([t for _ in range(handle.events.qsize()) for t in handle.events.get().token_ids])
        assert kern.attention_kernels and set(kern.attention_kernels) == {kernel}, asked
    assert len(texts[0]) == 6 and texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_text_does_not_depend_on_which_depths_the_adaptive_depth_picks(fake_gpu, monkeypatch, seed):
    """Whatever depth each solo window drafts at, and whenever a run of windows ends (here drawn at random,
    seeded, where the adaptive depth chooses by measured times), including windows without proposals and
    the silent probes of a paused greedy request, the text is the fixed depth's, as greedy verification
    promises."""
    from strata_runtime.engine import Engine, speculative

    def text(plan) -> tuple[list[list[int]], Engine]:
        engine = Engine(plan)
        handles = [engine.submit(Request(tuple(p), 48)) for p in prompts]
        while engine.step():
            pass
        out = [[t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in handles]
        return out, engine

    g = np.random.default_rng(24)
    prompts = [g.integers(1, 250, int(n)).tolist() for n in g.integers(3, 30, 3)]
    fixed, _ = text(_plan("cuda", "tiny", draft_tokens=4))
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(speculative, "best_depth", lambda holds, costs, most: int(rng.integers(0, most + 1)))
    monkeypatch.setattr(speculative, "worth_switching", lambda *a: bool(rng.random() < 0.5))
    adaptive, engine = text(_plan("cuda", "tiny", draft_tokens=4, adaptive_depth=True))
    assert engine.choice.adaptive and [len(t) for t in fixed] == [48] * 3
    assert adaptive == fixed
    assert len({w.rows for w in engine.windows if w.kind == "solo"}) >= 3  # several depths ran


def test_prefix_reuse_on_the_cuda_path_gives_the_text_of_whole_prompts(fake_gpu):
    """A conversation's next turns on the CUDA path (graph windows, drafting decided on the device): each
    later turn reads only what is new, and its tokens are those of an engine that reads every prompt whole.
    The kept positions of a reply were written by decode windows, the whole-prompt engine's by the prefill
    path; on the fake GPU both compute alike."""
    from strata_runtime.engine import Engine

    def conversation(plan) -> tuple[list[list[int]], int]:
        engine = Engine(plan)
        assert engine.model.stages[0].cuda is not None
        said, replies = list(range(40, 70)), []
        for _ in range(3):
            h = engine.submit(Request(tuple(said), 10))
            while engine.step():
                pass
            reply = [t for _ in range(h.events.qsize()) for t in h.events.get().token_ids]
            replies.append(reply)
            said += reply + [33, 34, 35]
        return replies, engine.totals["prefix_tokens"]

    kw = dict(batch_mtp=True, draft_tokens=4)
    reused, kept = conversation(_plan("cuda", "tiny", **kw))
    assert kept > 0
    off = _plan("cuda", "tiny", **kw)
    off = off.model_copy(update={"memory": off.memory.model_copy(update={"prefix_reuse": False})})
    whole, none = conversation(off)
    assert none == 0 and reused == whole and all(len(r) == 10 for r in reused)


@pytest.mark.parametrize("pitch", [None, 3000])
def test_the_prefix_stores_strided_copies_move_exactly_a_slots_runs_of_positions(
    fake_gpu, monkeypatch, pitch
):
    """`KVCache.save_rows` and `load_rows` on the CUDA path (one 2D copy per KV head, or per layer where a
    layer's pitch is wider than a copy takes) against NumPy's slices: runs of a slot's positions at other
    places in the host rows, and back into another slot, of a cache that is a view of a wider one (as the
    drafters' are) whose slot stride is not the cache's own."""
    import fake_cupy

    from strata_runtime.backend import Device
    from strata_runtime.model import kvcache
    from strata_runtime.model.kvcache import HostRows, KVCache

    if pitch is not None:
        monkeypatch.setattr(kvcache, "MAX_PITCH", pitch)  # a layer's pitch (3 slots x 2 heads x 40 x 8 x 2 B)
    layers, heads, context, dim = 3, 2, 40, 8
    rng = np.random.default_rng(11)
    shape = (layers, 3, heads, context, dim)
    wide = [(rng.standard_normal(shape) + 1).astype(np.float16).view(fake_cupy.FakeArray) for _ in range(2)]
    views = (wide[0][:, 1:], wide[1][:, 1:])  # slots 1 and 2 of the wider cache
    kv = KVCache(Device("cuda", 0), layers, 2, heads, context, dim, np.float16, views)
    assert kv.k.strides[1] == heads * context * dim * 2 and kv.k.strides[0] == 3 * heads * context * dim * 2
    host = HostRows(kv, 64)
    assert fake_cupy.is_pinned(host.keys) and fake_cupy.is_pinned(host.values)
    host.keys[...] = host.values[...] = 0
    runs = [(50, 0, 7), (3, 7, 20)]  # 27 positions of slot 1: the first 7 at 50, the rest at 3
    copies = fake_cupy._Runtime.COPIES_2D
    copies.clear()
    kv.save_rows(1, host, runs)
    for cache, rows in ((kv.k, host.keys), (kv.v, host.values)):
        np.testing.assert_array_equal(rows[:, :, 50:57], cache[:, 1, :, 0:7])
        np.testing.assert_array_equal(rows[:, :, 3:23], cache[:, 1, :, 7:27])
        assert not rows[:, :, 23:50].any() and not rows[:, :, 57:].any()  # nothing else written
    keys, values = host.rows(runs)
    np.testing.assert_array_equal(keys, kv.k[:, 1, :, :27])
    np.testing.assert_array_equal(values, kv.v[:, 1, :, :27])
    # Per head, a row for each of 3 layers; past the pitch, per layer, a row for each of 2 heads.
    assert [rows for rows, _ in copies] == ([layers] * heads if pitch is None else [heads] * layers) * 4
    assert all(pinned for _, pinned in copies)
    # The copies go through raw addresses: one past either array is refused before anything moves.
    for bad in ([(60, 0, 5)], [(0, 36, 5)]):
        copies.clear()
        with pytest.raises(ValueError, match="falls outside the cache"):
            kv.save_rows(1, host, bad)
        assert not copies
    before = [w.copy() for w in wide]
    kv.load_rows(0, host, runs)
    for cache in (kv.k, kv.v):
        np.testing.assert_array_equal(cache[:, 0, :, :27], cache[:, 1, :, :27])
    for w, b in zip(wide, before, strict=True):  # the wider cache's other slots, and positions past 27
        np.testing.assert_array_equal(w[:, 0], b[:, 0])
        np.testing.assert_array_equal(w[:, 1:, :, 27:], b[:, 1:, :, 27:])


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_mtp=True, draft_tokens=4),  # one stage, drafting decided on the device
        dict(stages=2, slots=4, groups=2, draft_tokens=4),  # pipelined groups: each stage's own thread
    ],
)
def test_a_prefix_copied_between_slots_on_the_cuda_path_gives_the_text_of_whole_prompts(fake_gpu, kw):
    """Two requests that begin with the same instructions, the second sent while the first decodes: on the
    CUDA path the second's slot copies the prefix's KV from the first's on every stage's stream (and its
    drafter's on the drafters' stream), and both get the tokens of an engine that reads every prompt whole."""
    from strata_runtime.engine import Engine

    system = list(range(40, 90))

    def serve(plan) -> tuple[list[list[int]], Engine, int]:
        engine = Engine(plan)
        assert engine.model.stages[0].cuda is not None
        first = engine.submit(Request((*system, 7, 8), 12))
        engine.step()  # admitted
        while not engine.slots[first.slot].decoding:
            engine.step()
        second = engine.submit(Request((*system, 9, 10, 11), 12))
        while engine.step():
            pass
        out = [
            [t for _ in range(h.events.qsize()) for t in h.events.get().token_ids] for h in (first, second)
        ]
        return out, engine, second.slot

    text = float16_profile_text(backend="cuda", preset="tiny", context=256, **{"slots": 2, **kw})
    plan = resolve_text(text, "a.toml").plan
    copied, eng, second = serve(plan)
    n = len(system) - 1  # a drafter's row less
    assert eng.totals["prefix_copies"] == 1 and eng.totals["prefix_tokens"] == n
    off = plan.model_copy(update={"memory": plan.memory.model_copy(update={"prefix_reuse": False})})
    whole, other, slot = serve(off)
    assert other.totals["prefix_tokens"] == 0 and copied == whole and all(len(r) == 12 for r in copied)
    # The second request's slot holds what reading its prompt wrote: every stage's KV and its drafter's,
    # to fp16's last bit (the prefill path's sums for a row depend on the length of the prompt it reads, so
    # the first request's rows may differ by one unit from what the second's own prompt writes). The
    # whole-prompt engine's slot keeps nothing, but its arrays still hold what the request wrote.
    assert slot == second
    pairs = [(a.kv, b.kv, second) for a, b in zip(eng.model.stages, other.model.stages, strict=True)]
    pairs.append((eng.model.drafters[second].kv, other.model.drafters[second].kv, 0))
    for mine, theirs, at in pairs:
        for a, b in ((mine.k, theirs.k), (mine.v, theirs.v)):
            x, y = np.asarray(a[:, at, :, :n]), np.asarray(b[:, at, :, :n])
            np.testing.assert_allclose(x, y, rtol=4e-3, atol=4e-3)
            assert x.any()


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_mtp=True, draft_tokens=4),  # one stage, drafting decided on the device
        dict(stages=2, slots=4, groups=2, draft_tokens=4),  # pipelined groups: each stage's own thread
    ],
)
def test_a_history_stored_in_host_memory_comes_back_on_the_cuda_path_with_the_text_of_whole_prompts(
    fake_gpu, kw
):
    """One conversation more than the slots, one request at a time: the first conversation's slot is taken,
    so its history goes to the host's prefix store (pinned copies queued on every stage's stream, its
    drafter's on the drafters' stream), and its next turn copies it back from pinned memory. The slot then
    holds the stored rows bit for bit, and every turn's tokens are an engine's without a store."""
    import fake_cupy

    from strata_runtime.engine import Engine

    def serve(plan) -> tuple[list[list[int]], Engine]:
        engine = Engine(plan)
        stages = engine.model.stages
        assert stages[0].cuda is not None
        said = [[40 + c] + list(range(50 + c, 120 + c)) for c in range(engine.n_slots + 1)]
        out = []
        for conv in [*range(len(said)), 0]:
            h = engine.submit(Request(tuple(said[conv]), 6))
            copies = fake_cupy._Runtime.COPIES_2D
            copies.clear()
            while engine.step():
                pass
            if engine.totals["prefix_store_saved"] or engine.totals["prefix_restores"]:
                assert copies and all(pinned for _, pinned in copies), "a store's copy used pageable memory"
                # Keys and values of a run of pages: a stage's in one strided copy per KV head (a row per
                # layer) or per layer (a row per head), whichever are fewer; the drafter's one layer in one.
                heads, layers = engine.plan.model.facts.num_key_value_heads, [len(s.kv.k) for s in stages]
                assert {rows for rows, _ in copies} <= {*layers, heads}
                assert len(copies) % (sum(2 * min(heads, n) for n in layers) + 2) == 0
            reply = [t for _ in range(h.events.qsize()) for t in h.events.get().token_ids]
            out.append(reply)
            said[conv] += reply + [33, 34]
        return out, engine

    text = float16_profile_text(backend="cuda", preset="tiny", context=256, **{"slots": 2, **kw})
    plan = resolve_text(text, "a.toml").plan
    store = plan.model_copy(update={"memory": plan.memory.model_copy(update={"prefix_store_mib": 16})})
    stored, eng = serve(store)
    assert eng.totals["prefix_store_saved"] >= 1 and eng.totals["prefix_restores"] == 1
    (entry,) = [e for e in eng.store.entries if e.kept.tokens[0] == 40]
    slot = next(i for i, k in enumerate(eng.prefixes.kept) if k is not None and k.tokens[0] == 40)
    n = eng.totals["prefix_tokens"]  # the turn copied back this many positions, of every stage and drafter
    assert n >= 70
    *stages, (dk, dv) = eng.executor.stored_rows(entry)
    for stage, (keys, values) in zip(eng.model.stages, stages, strict=True):
        assert np.array_equal(np.asarray(stage.kv.k[:, slot, :, :n]), keys[:, :, :n])
        assert np.array_equal(np.asarray(stage.kv.v[:, slot, :, :n]), values[:, :, :n])
    drafter = eng.model.drafters[slot].kv
    assert np.array_equal(np.asarray(drafter.k[:, 0, :, :n]), dk[:, :, :n])
    assert np.array_equal(np.asarray(drafter.v[:, 0, :, :n]), dv[:, :, :n])
    whole, _ = serve(plan)
    assert stored == whole and all(len(r) == 6 for r in stored)


def test_a_cache_that_keeps_its_misses_on_the_cuda_path_changes_no_token_and_fills_its_slots(fake_gpu):
    """With ``experts.keep_misses`` the admission (``moe_admit``'s NumPy twin) picks slots between the routing
    and the expert kernels, which write what they read from host memory there: greedy text equals the
    all-resident run's, nothing is swapped, experts are kept, and every slot the device's tables or ``fill``
    give an expert holds that expert's weights, byte for byte."""
    from strata_runtime.reference.keep import held

    kw = {"preset": "small", "batch_mtp": True, "draft_tokens": 3, "stages": 2, "prefill_chunk": 96}
    resident, _ = _two_prompts(_plan("cuda", **kw), 16)
    cached, engine = _two_prompts(_plan("cuda", expert_cache=5, cache_policy={"keep_misses": True}, **kw), 16)
    assert cached == resident
    for stage in engine.model.stages:
        store, tables = stage.experts, stage.cuda_experts
        assert tables is not None and tables.keeping
        tables.settle()
        stats = store.stats
        assert stats.swaps == 0 and stats.swap_bytes == 0
        assert stats.kept > 0 and stats.misses > 0
        slots = held(np.asarray(tables.slot_of), np.asarray(tables.fill))
        assert (slots == store.residency.slot_of).all()  # the host learned the device's tables
        assert sorted(slots[slots >= 0].tolist()) == list(range(store.slots))  # each slot held once
        for j, e in zip(*np.nonzero(slots >= 0), strict=True):
            s = int(slots[j, e])
            gate_up, down = store.host_weights(int(j), int(e))
            assert np.array_equal(store.pool_gate_up[s], gate_up) and np.array_equal(store.pool_down[s], down)
            if int(tables.fill[j, e]) < 0:  # committed: the tables read the slot
                assert int(tables.gate_up[j, e]) == store.pool_gate_up[s].ctypes.data
        for j, e in zip(*np.nonzero(slots < 0), strict=True):
            assert int(tables.gate_up[j, e]) == store.host_weights(int(j), int(e))[0].ctypes.data


def test_a_cache_that_keeps_misses_on_the_cuda_path_renews_its_queue_once_the_windows_took_half(fake_gpu):
    """Keeping misses, the host reads the device's counters and tables every window, so that it sees how far
    the windows went through the queue of victims: with a queue of two and rebalances 1,000 windows apart,
    a new queue comes whenever a window has taken one, and the windows go on keeping misses long after the
    prompt's queue was used up. The text is the all-resident run's."""
    kw = {"preset": "small", "stages": 1, "prefill_chunk": 96}
    policy = {"keep_misses": True, "max_swaps": 2, "rebalance_every": 1000}
    resident, _ = _two_prompts(_plan("cuda", **kw), 24)
    cached, engine = _two_prompts(_plan("cuda", expert_cache=5, cache_policy=policy, **kw), 24)
    assert cached == resident
    stage = engine.model.stages[0]
    stage.cuda_experts.settle()
    assert stage.experts.residency.policy.max_swaps == 2
    assert stage.experts.stats.kept >= 8, stage.experts.stats.kept  # four queues' worth (one, read every 4)


def test_arms_sharing_a_cache_that_keeps_misses_may_queue_more_victims_than_the_first_arm(fake_gpu):
    """Benchmark arms share a stage's cache and each hands it its own policy: a queue as long as the
    cache's slots must reach the device whatever the first arm's ``experts.max_swaps`` was."""
    from strata_runtime.engine import Engine
    from strata_runtime.experts.cache import Policy

    engine = Engine(_plan("cuda", expert_cache=5, cache_policy={"keep_misses": True, "max_swaps": 1}))
    stage = engine.model.stages[0]
    tables, r = stage.cuda_experts, stage.experts.residency
    r.policy = Policy(keep_misses=True, max_swaps=512)
    r.scores[...] = np.arange(r.scores.size).reshape(r.scores.shape)
    r.queue = r.victims()
    movable = int((r.slot_of[[j for j in range(r.layers) if j not in r.fixed]] >= 0).sum())
    assert len(r.queue.slot) == movable > 1
    tables._upload_queue(tables.copy_stream)
    np.testing.assert_array_equal(np.asarray(tables.victims[:movable]), r.queue.slot)
    assert list(np.asarray(tables.queue)) == [0, movable]


def test_prompts_through_per_expert_products_read_the_devices_tables_where_the_cache_keeps_misses(
    fake_gpu, monkeypatch
):
    """A model whose widths the grouped kernels do not take reads a prompt chunk through one product per
    expert, where the host's tables say each expert is. Keeping misses changes the tables on the device, so
    that path first takes the device's: a request whose prompt follows another's decode gets the same text
    whether the cache keeps its misses or swaps."""
    from strata_runtime.cuda import prefill

    monkeypatch.setattr(prefill, "supported", lambda *shape: False)
    prompts = [tuple(range(40, 140)), tuple(range(150, 250))]
    kw = {"preset": "small", "stages": 1, "prefill_chunk": 96, "expert_cache": 5}
    texts = {}
    for keep in (False, True):
        text, engine = _greedy(_plan("cuda", cache_policy={"keep_misses": keep}, **kw), prompts, 16)
        assert engine.model.stages[0].cuda_prefill.grouped is None
        texts[keep] = text
        assert engine.model.stages[0].experts.stats.kept > 0 or not keep
    assert texts[True] == texts[False]


def test_the_engine_says_when_its_expert_kernels_warm_l2(fake_gpu, monkeypatch):
    """A stage whose windows warm L2 (the policy in force as its graphs are prepared, on expert kernels that
    can) says so in its start-up line, with the setting that asked for it; a stage whose kernels cannot
    (the tiny preset's narrow experts) or under the default policy says nothing of it."""
    from strata_runtime.cuda import decode
    from strata_runtime.cuda.choices import L2Warm, l2_warm
    from strata_runtime.engine import Engine

    def line(eng) -> str:
        (found,) = [x for x in eng.startup if x.startswith("decode windows on cuda:0")]
        return found

    plan = _plan("cuda", "tiny")
    assert line(Engine(plan)) == "decode windows on cuda:0: CUDA graphs"
    with l2_warm(L2Warm(2, early=True)):
        assert line(Engine(plan)) == "decode windows on cuda:0: CUDA graphs"  # narrow: nothing warms
        monkeypatch.setattr(decode, "moe_wide", lambda h, i, k: True)
        assert line(Engine(plan)) == (
            "decode windows on cuda:0: CUDA graphs; the expert kernels bring the next layer's q/k/v into L2 "
            "in windows of up to 2 row(s), before they wait (STRATA_L2_WARM=2/early)"
        )
