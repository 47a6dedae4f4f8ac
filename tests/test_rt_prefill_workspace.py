"""The plan's workspace against what a GPU's prefill path really holds during a prompt, on the fake GPU.

The fake GPU (tests/fake_cupy.py) makes every device array a host array, so the bytes the runtime holds can
be counted: every array the CUDA path's Python makes is tracked from its birth to its death, except what the
stand-in kernels make while they run (on a GPU those are registers and shared memory). The high-water mark
of a lone prompt's chunks, above what the engine held before the prompt, must fit the plan's workspace
(`strata_cfg.resolve.sizes.workspace_bytes`) and not fall far short of it, so that a buffer the runtime
gains and the plan misses fails here. The temporaries of each prefill path (the stage's and the MTP head's)
must be exactly `prefill_temp_bytes` of the chunk's rows.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from rt_plans import float16_profile_text

from strata_cfg.plan.from_profile import resolve_text
from strata_cfg.resolve import sizes
from strata_cfg.resolve.sizes import GPU_POOL_HEADROOM
from strata_cfg.schema.presets import preset_config

CHUNK = 128
"""Rows of a lone prompt's chunks (``memory.prefill_chunk_alone``)."""


class LiveBytes:
    """Bytes of the fake GPU's arrays alive now, and their high-water mark: each array that owns its memory
    is counted from the first device array made on it until it is freed; arrays made inside a stand-in
    kernel are not."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}
        self._kernel = threading.local()

    def in_kernel(self) -> bool:
        return getattr(self._kernel, "depth", 0) > 0

    def kernel(self, run: Any) -> None:
        self._kernel.depth = getattr(self._kernel, "depth", 0) + 1
        try:
            run()
        finally:
            self._kernel.depth -= 1

    def made(self, array: np.ndarray) -> None:
        root = array
        while isinstance(root.base, np.ndarray):
            root = root.base
        key = id(root)
        if key in self._sizes or self.in_kernel():
            return
        self._sizes[key] = int(root.nbytes)
        self.live += int(root.nbytes)
        self.peak = max(self.peak, self.live)
        weakref.finalize(root, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def reset_peak(self) -> int:
        """Start a new high-water mark from what is alive now; returns that."""
        self.peak = self.live
        return self.live


@pytest.fixture
def live_gpu(monkeypatch) -> Iterator[LiveBytes]:
    """The fake GPU, with every array it holds counted (`LiveBytes`)."""
    import fake_cupy

    counter = LiveBytes()
    monkeypatch.setattr(fake_cupy.FakeArray, "__array_finalize__", lambda self, obj: counter.made(self))
    launch, replay = fake_cupy._Recorder.launch, fake_cupy._Graph.launch

    def launching(self: Any, fn: Any, *a: Any, **k: Any) -> None:
        if self.capturing:
            launch(self, fn, *a, **k)
        else:
            counter.kernel(lambda: fn(*a, **k))

    monkeypatch.setattr(fake_cupy._Recorder, "launch", launching)
    monkeypatch.setattr(
        fake_cupy._Graph, "launch", lambda self, stream=None: counter.kernel(lambda: replay(self))
    )
    with fake_cupy.installed(), np.errstate(all="ignore"):  # rows no kernel writes are NaN: quiet
        yield counter


def _held(temps: Any) -> int:
    return sum(int(a.nbytes) for a in temps._arrays.values())


def _temps_peaks(monkeypatch) -> list[int]:
    """The most bytes each chunk's `Temps` held at once, in the order they were made (an `Arena`, which
    keeps its flat buffers, is not among them)."""
    from strata_runtime.cuda import prefill

    peaks: list[int] = []
    call = prefill.Temps.__call__

    def counting(self: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        out = call(self, name, shape, dtype)
        if not hasattr(self, "peak_index"):
            self.peak_index = len(peaks)
            peaks.append(0)
        peaks[self.peak_index] = max(peaks[self.peak_index], _held(self))
        return out

    monkeypatch.setattr(prefill.Temps, "__call__", counting)
    return peaks


def _plan(graphs: bool, context: int = 512, decode_attention: str = "auto"):
    """One GPU drafting with batch MTP, the small preset (dense layers, a shared expert, routed experts): a
    lone prompt reads in chunks of `CHUNK` rows. ``graphs``: chunks of up to 64 rows replay prefill graphs
    (every expert in VRAM); else an expert cache, under which chunks are launched."""
    kw: dict[str, Any] = dict(preset="small", slots=2, batch_mtp=True, draft_tokens=3, context=context)
    kw |= dict(prefill_chunk=32, prefill_chunk_alone=CHUNK)
    text = float16_profile_text(**kw, expert_cache=None if graphs else 6)
    text = text.replace("[model]", f'[model]\ndecode_attention = "{decode_attention}"')
    if graphs:
        text = text.replace("[memory]\n", "[memory]\nprefill_graph_rows = 64\nprompt_graph_rows = 8\n")
    plan = resolve_text(text, "workspace.toml").plan
    assert plan.memory.prefill_chunk_alone == CHUNK
    assert plan.memory.prefill_graph_rows == (64 if graphs else 0)
    assert plan.batch.mtp and len(plan.gpus) == 1
    return plan


@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "graphs"])
def test_a_lone_prompt_holds_what_the_plans_workspace_counts(live_gpu, monkeypatch, graphs):
    from strata_runtime.api import Request
    from strata_runtime.engine import Engine

    plan = _plan(graphs)
    [budget] = [g.budget for g in plan.gpus]
    engine = Engine(plan)
    model = engine.model
    [stage] = model.stages
    assert model.mtp is not None and model.mtp.cuda is not None and stage.cuda_prefill is not None
    paths = {"stage": stage.cuda_prefill, "mtp": model.mtp.cuda._prefill}
    assert all(p.graph_rows == (64 if graphs else 0) for p in paths.values())
    temps = _temps_peaks(monkeypatch)
    before = live_gpu.reset_peak()
    vocab = model.args.vocab_size
    prompts = [60] if graphs else []  # a chunk of a graph's rows first, whose arena and inputs stay
    for n in [*prompts, 3 * CHUNK + 100]:  # chunks of 128, 128, 128 and 100 rows
        engine.submit(Request(tuple(1 + (7 * i + n) % (vocab - 1) for i in range(n)), 2))  # no shared prefix
        while engine.step():
            pass
    if graphs:
        assert all(p.captured == {64} for p in paths.values())
    held = live_gpu.peak - before
    # The headroom is for what the fake GPU has none of; the decode windows' buffers were made when the
    # engine started, before the prompt (the test below counts them).
    facts, context = plan.model.facts, plan.memory.context
    windows = sizes.decode_window_bytes(facts, context=context)
    windows += sizes.MTP_WINDOW_SETS * sizes.decode_window_bytes(facts, context=context, mtp=True)
    counted = budget.workspace - GPU_POOL_HEADROOM - windows
    assert 0.9 * counted <= held <= counted, (held, counted)

    # Each path's temporaries are exactly what the plan counts for a chunk's rows: the stage's, and the MTP
    # head's own, kept beside them (and their graphs' arenas, which keep theirs).
    facts = plan.model.facts
    assert max(temps) == sizes.prefill_temp_bytes(facts, CHUNK)
    for name, path in paths.items():
        mtp = name == "mtp"
        assert temps[path._temps.peak_index] == sizes.prefill_temp_bytes(facts, 100, mtp=mtp)  # the last
        assert _held(path._arena) == (sizes.prefill_temp_bytes(facts, 64, mtp=mtp) if graphs else 0)


def test_the_30b_shapes_prefill_row_on_a_gpu():
    """The prefill path's bytes a row for the Qwen3-30B-A3B shape, by buffer (`strata_runtime.cuda.prefill`):
    what the plan counts where a GPU reads a prompt, against the array path's `row_activation_bytes`."""
    from strata_cfg.schema.facts import ModelFacts

    m = ModelFacts.from_config(preset_config("qwen3-30b-a3b"), source="preset", dtype="float16")
    h, q, kv, e, k, i = 2048, 32 * 128, 4 * 128, 128, 8, 768
    attention = 2 * h + 4 * (q + 2 * kv) + 3 * 2 * q  # x; qkv (fp32); q_hi, q_lo, attn
    routed = 4 * h + 4 * e + 4 * 4 * k + 2 * k * i + 2 * k * h  # xf, logits, idx/wts/rank/order, hid, ys
    assert attention + routed == sizes.prefill_temp_row_bytes(m) == 103_040
    assert sizes.prefill_temp_row_bytes(m, mtp=True) == 103_040  # no dense MLP, no shared expert
    assert sizes.prefill_temp_row_bytes(m, flash=False) == 103_040 + 4 * q  # q's parts by KV head
    assert sizes.row_activation_bytes(m) == 88_576  # the array path's, unchanged
    # 32,768 assignments in 4096 rows: 256 full tiles and each expert's partial one, 16 bytes each.
    assert sizes.prefill_tile_table_bytes(m, 4096) == 16 * (256 + 128) + 4
    assert sizes.chunk_row_bytes(m, last=False) == 3 * 4 * h + 8
    assert sizes.chunk_row_bytes(m, last=True) == 4 * 4 * h + 8
    assert sizes.mtp_chunk_row_bytes(m) == 3 * 2 * h + 2 * 4 * h
    rows, ctx = 4096, 8192
    stage = sizes.prefill_temp_bytes(m, rows) + rows * (4 * 4 * h + 8)
    head = 8 * m.vocab_size * 4 + 2 * m.vocab_size * sizes.TOKEN_COUNT_BYTES
    kw: dict[str, Any] = dict(context=ctx, prefill_rows=rows, stores_scores=False, slots=2, gpu=True)
    alone = sizes.workspace_bytes(m, last=True, **kw)
    # A decode window's row: positions and slots; residual, MLP output, the head's rows and the gate; q/k/v,
    # q and attention's output; router logits, routing, the experts' activations; and the (absent) dense
    # MLP's three floats. The scratch the sizes share: 8 rows of 32 heads x 128 chunks. Attention's counters
    # a row: for each of the 4 KV heads, the row's merge and one per 16 chunks (8 groups, 32 at 4 x ctx).
    row = 2 * 4 + 4 * (4 * h + 1) + 4 * (q + 2 * kv + 2 * q) + 4 * e + 4 * 2 * k + 4 * k * i + 4 * 3
    assert sizes.decode_window_row_bytes(m) == sizes.decode_window_row_bytes(m, mtp=True) == row == 111_192
    scratch = 4 * 8 * 32 * (ctx // 64) * (128 + 2)
    windows = 36 * (row + 4 * 4 * (1 + 8)) + 8 * 4 * (32 + 8) + scratch
    assert sizes.decode_window_bytes(m, context=ctx) == windows  # about 20 MiB
    assert sizes.decode_window_bytes(m, context=4 * ctx) == windows + 3 * scratch + 36 * 4 * 4 * 24
    assert alone == stage + head + windows + sizes.GPU_POOL_HEADROOM  # the measured, unexplained pool use
    drafting = sizes.workspace_bytes(m, last=True, mtp=True, **kw)
    mtp = sizes.prefill_temp_bytes(m, rows, mtp=True) + rows * (3 * 2 * h + 2 * 4 * h)
    assert drafting - alone == mtp + 2 * windows  # the MTP head's temporaries and rows, and its windows
    assert 514 * 2**20 < mtp < 515 * 2**20
    # The array path (virtual CPU devices) keeps its own count: no MTP set, a tile of stored scores.
    cpu = sizes.workspace_bytes(m, last=True, mtp=True, **{**kw, "gpu": False, "stores_scores": True})
    scores = sizes.attention_scores_bytes(m, context=ctx, rows=rows)
    assert cpu == rows * 88_576 + scores + head


def _window_set_bytes(layers: Any) -> int:
    """Bytes a `CudaLayers` holds for its decode windows: every array of each size's buffers, counting the
    attention scratch they share once."""
    roots: dict[int, int] = {}
    for b in layers._bufs.values():
        for a in vars(b).values():
            if isinstance(a, np.ndarray):
                root = a
                while isinstance(root.base, np.ndarray):
                    root = root.base
                roots[id(root)] = int(root.nbytes)
    return sum(roots.values())


@pytest.mark.parametrize(("context", "kernel"), [(512, "auto"), (5000, "auto"), (5000, "cuda_cores")])
def test_every_decode_window_holds_what_the_plan_counts(live_gpu, context, kernel):
    """Decode windows of 1 to 8 rows through the stage's layers and through the MTP head (its two sets:
    positions from the host, positions decided on the device) hold exactly the plan's
    `decode_window_bytes` for each set: each size's own buffers, and one attention
    scratch of 8 rows that the sizes of a set share, which grows with the context on CUDA cores and stops
    at 64 partials a row and head (4,096 positions) on tensor cores."""
    from strata_runtime.cuda.choices import attention_scratch_size
    from strata_runtime.engine import Engine

    plan = _plan(True, context, kernel)
    tc = kernel == "auto"
    assert plan.model.decode_attention == ("tensor_cores" if tc else "cuda_cores")
    engine = Engine(plan)
    model = engine.model
    [stage] = model.stages
    assert stage.cuda is not None and model.mtp is not None and model.mtp.cuda is not None
    model.capture_window_graphs()
    sets = [stage.cuda, model.mtp.cuda.layers, model.mtp.cuda.device_layers]
    facts = plan.model.facts
    assert plan.memory.context == context
    assert all(s.stack.context == context and set(s._bufs) == set(range(1, 9)) for s in sets)
    assert len(sets) == 1 + sizes.MTP_WINDOW_SETS
    stage_set = sizes.decode_window_bytes(facts, context=context, attention_tc=tc)
    head_set = sizes.decode_window_bytes(facts, context=context, mtp=True, attention_tc=tc)
    assert head_set < stage_set  # the preset's dense layers are wider than the head's shared expert
    assert [_window_set_bytes(s) for s in sets] == [stage_set, head_set, head_set]
    # One scratch a set, of 8 rows, which every size's window reads.
    a = model.args
    scratch = attention_scratch_size(8, a.num_attention_heads, a.num_key_value_heads, a.head_dim, context, tc)
    for s in sets:
        assert len({id(b.scratch) for b in s._bufs.values()}) == 1
        assert s._bufs[1].scratch.size == scratch
    assert 4 * scratch == sizes.decode_attention_scratch_bytes(
        facts, context=context, rows=8, tensor_cores=tc
    )
    partials = min(-(-context // 64), 64) if tc else -(-context // 64)
    assert scratch == 8 * a.num_attention_heads * partials * (a.head_dim + 2)


def test_decode_attention_blocks_read_the_chunk_the_plan_sizes_scratch_by():
    """The kernel's ATTN_CHUNK (positions a decode attention chunk reads) and ATTN_MERGE_GROUP (chunks a
    merge takes together) are what the plan sizes each window's scratch and counters by."""
    import re

    from strata_cfg.schema.windows import DECODE_ATTENTION_CHUNK, DECODE_ATTENTION_MERGE_GROUP
    from strata_runtime.cuda.compile import source

    src = source("kernels.cu")
    [chunk] = re.findall(r"constexpr int ATTN_CHUNK = (\d+);", src)
    [group] = re.findall(r"constexpr int ATTN_MERGE_GROUP = (\d+);", src)
    assert int(chunk) == DECODE_ATTENTION_CHUNK
    assert int(group) == DECODE_ATTENTION_MERGE_GROUP
