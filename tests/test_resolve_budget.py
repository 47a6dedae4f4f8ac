"""The VRAM budget counts what the engine really allocates: built on virtual CPU devices (float32), every
stage's weights and experts, its KV, and the last stage's drafters match the plan's budget to the byte; and
the workspace holds a tile of attention scores only where prompt attention stores one."""

from __future__ import annotations

import pytest
from cfg_fixtures import FIXTURES, PROFILES, RULES_DIR, plan_of

from strata_cfg.resolve import layer_split, sizes
from strata_cfg.schema.windows import decode_attention_counters
from strata_runtime.model import Model

CASES = {
    "demo: 2 stages, 2 slots, batch MTP": (None, []),
    "no drafting: no MTP head, no drafters": (None, ["batch.mtp=false", "spec.draft_tokens=0"]),
    "solo with spec: one drafter": (None, ["batch.slots=1", "batch.mtp=false"]),
    "3 stages, 3 slots, longer context": (
        RULES_DIR / "pipeline-windows.two-stages.toml",
        ["split.pipeline_windows=0", "batch.slots=3", "memory.context=300"],
    ),
    "small preset: dense and MoE layers, shared expert": (
        RULES_DIR / "split.auto.toml",
        ["memory.context=128", "batch.slots=2"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_budget_matches_what_the_engine_allocates(case):
    path, sets = CASES[case]
    plan = plan_of(path, sets)
    assert all(g.experts_resident == g.experts_total for g in plan.gpus)
    model = Model.from_plan(plan)
    by_gpu = {g.index: g.budget for g in plan.gpus}
    for stage, sp in zip(model.stages, plan.stages, strict=True):
        budget = by_gpu[sp.gpu]
        assert stage.weight_bytes == budget.weights + budget.experts, f"stage {sp.index} weights"
        assert stage.kv.nbytes == budget.kv, f"stage {sp.index} KV"
    drafters = sum(d.nbytes for d in model.drafters.values())
    assert drafters == by_gpu[plan.stages[-1].gpu].drafters
    assert sorted(model.drafters) == list(plan.stages[-1].drafters)


def _score_tile(plan) -> int:
    """The bytes of one tile of stored attention scores that the plan's prompt windows would take."""
    rows = sizes.prefill_rows(plan.memory.prefill_chunk, plan.memory.prefill_chunk_alone)
    return sizes.attention_scores_bytes(plan.model.facts, context=plan.memory.context, rows=rows)


def _counting_the_tile(monkeypatch, path, sets, stores: bool):
    """The plan of ``path`` with the tile counted (or not) whatever the backend and head dim."""
    with monkeypatch.context() as m:
        m.setattr(layer_split, "stores_attention_scores", lambda backend, model: stores)
        return plan_of(path, sets)


def _cublas_attention_less_graphs(plan, gpu) -> int:
    """What a GPU's prefill paths hold more where prompt attention is cuBLAS products over stored scores
    than through the fused kernel, besides the tile: q's two parts regrouped by KV head, less the graphs
    that only the fused kernel's chunks replay (the stage's, and the MTP head's where it drafts there)."""
    m = plan.model.facts
    rows = sizes.prefill_rows(plan.memory.prefill_chunk, plan.memory.prefill_chunk_alone)
    paths = 2 if gpu.index == plan.stages[-1].gpu and (plan.spec.mtp or plan.batch.mtp) else 1
    graphs = plan.memory.prefill_graph_rows if gpu.all_experts_resident else 0
    graph_bytes = sizes.prefill_graph_bytes(m, graphs)
    if paths == 2:
        graph_bytes += sizes.prefill_graph_bytes(m, graphs, mtp=True)
    return paths * rows * 2 * sizes.HALF * m.num_attention_heads * m.head_dim - graph_bytes


@pytest.mark.parametrize(
    ("profile", "sets"),
    [
        ("h200.toml", []),  # every expert resident: the tile's bytes are free
        ("emulate/h200-24g.toml", [("memory.prefill_chunk_alone", 4096)]),  # cached: they are slots
        ("rtx3080-20g-x2.toml", [("memory.prefill_chunk_alone", 1024)]),  # two cached stage GPUs
    ],
)
def test_a_gpu_reading_prompts_through_the_fused_kernel_plans_no_score_tile(monkeypatch, profile, sets):
    """At the presets' head dim (128) a GPU's prefill path stores no scores: the workspace is the tile
    smaller than with it (and than the cuBLAS path's q regrouped by KV head, though without the graphs that
    only the fused kernel replays), and every byte of it is free or holds experts (as many more slots as
    fit)."""
    plan = plan_of(PROFILES / profile, sets)
    m = plan.model.facts
    assert plan.machine.backend == "cuda" and m.head_dim == 128
    tile = _score_tile(plan)
    assert tile > 0
    with_tile = _counting_the_tile(monkeypatch, PROFILES / profile, sets, stores=True)
    assert plan.memory == with_tile.memory and len(plan.gpus) == len(with_tile.gpus)
    eb = m.expert_bytes()
    for fused, stored in zip(plan.gpus, with_tile.gpus, strict=True):
        a, b = fused.budget, stored.budget
        extra = tile + _cublas_attention_less_graphs(plan, fused)
        assert b.workspace - a.workspace == extra > 0
        assert (a.free + a.experts) - (b.free + b.experts) == extra
        if fused.experts_resident < fused.experts_total:  # a cache holds every slot its bytes fit
            assert fused.experts_resident == (a.free + a.experts) // eb
            assert stored.experts_resident == (b.free + b.experts) // eb
            assert fused.experts_resident > stored.experts_resident
        else:
            assert a.free - b.free == extra


def test_a_gpu_at_a_head_dim_the_fused_kernel_lacks_and_cpu_devices_plan_the_score_tile(
    monkeypatch, tmp_path
):
    """Head dim 8 on a GPU (not one of the fused kernel's) and virtual CPU devices store prompt scores: their
    plans count the tile (and the GPU's the cuBLAS path's regrouped q, where it replays no graphs)."""
    model = (FIXTURES / "models" / "mtp-micro").resolve()
    gpu = tmp_path / "micro-gpu.toml"
    gpu.write_text(
        f'[machine]\nbackend = "cuda"\ngpus = [{{ name = "G", vram_mib = 4096, bandwidth_gbs = 1000 }}]\n'
        f'[model]\npath = "{model}"\n'
    )
    demo = PROFILES / "demo.toml"
    for path in (gpu, demo):
        plan = plan_of(path)
        assert (plan.machine.backend, plan.model.facts.head_dim) == (
            ("cuda", 8) if path == gpu else ("cpu", 32)
        )
        tile = _score_tile(plan)
        assert tile > 0
        without = _counting_the_tile(monkeypatch, path, [], stores=False)
        for stored, fused in zip(plan.gpus, without.gpus, strict=True):
            cublas = _cublas_attention_less_graphs(plan, stored) if path == gpu else 0
            assert stored.budget.workspace - fused.budget.workspace == tile + cublas, path.name


@pytest.mark.parametrize("kernel", ["auto", "cuda_cores"])
def test_the_workspace_by_part_adds_up_and_its_decode_windows_grow_with_the_context(kernel):
    """Every stage GPU's workspace is given by part, and the parts add up to it. The decode windows' part
    is a set of window buffers on each GPU, and two more for the MTP head on the last stage where it drafts;
    quadrupling the context grows it by three times the attention scratch of each set on CUDA cores, and
    not at all on tensor cores (whose scratch stops at 64 partials a row and head, reached at 4,096
    positions); attention's counters grow either way, and the expert cache pays for it. The plan's text
    gives the parts."""
    from strata_cfg.report.plan_text import plan_text

    path = PROFILES / "rtx3080-20g-x2.toml"
    sets = [("model.decode_attention", kernel)]
    short, long = plan_of(path, sets), plan_of(path, [*sets, ("memory.context", 16384)])
    assert short.memory.context == 4096
    tc = kernel == "auto"
    assert short.model.decode_attention == ("tensor_cores" if tc else "cuda_cores")
    m = short.model.facts
    for plan in (short, long):
        context = plan.memory.context
        *firsts, last = plan.gpus
        for g in plan.gpus:
            parts = g.budget.workspace_parts
            assert list(parts) == [k for k in ("prompt", "windows", "logits", "headroom") if k in parts]
            assert sum(parts.values()) == g.budget.workspace and parts["headroom"] == sizes.GPU_POOL_HEADROOM
        windows = sizes.decode_window_bytes(m, context=context, attention_tc=tc)
        assert all(g.budget.workspace_parts["windows"] == windows for g in firsts)
        head = sizes.MTP_WINDOW_SETS * sizes.decode_window_bytes(
            m, context=context, mtp=True, attention_tc=tc
        )
        assert plan.batch.mtp and last.budget.workspace_parts["windows"] == windows + head
        assert "logits" in last.budget.workspace_parts and not any(
            "logits" in g.budget.workspace_parts for g in firsts
        )
    grown = 0 if tc else 3 * sizes.decode_attention_scratch_bytes(m, context=short.memory.context, rows=8)
    # Attention's counters, in each of the 36 rows of a set's windows (1 + 2 + ... + 8), grow too.
    nkv, contexts = m.num_key_value_heads, (short.memory.context, long.memory.context)
    counters = [decode_attention_counters(nkv, c) for c in contexts]
    grown += 36 * 4 * (counters[1] - counters[0])
    assert (
        long.gpus[0].budget.workspace_parts["windows"] - short.gpus[0].budget.workspace_parts["windows"]
        == grown
    )
    assert (
        long.gpus[1].budget.workspace_parts["windows"] - short.gpus[1].budget.workspace_parts["windows"]
        == 3 * grown
    )
    assert all(b.experts_resident < a.experts_resident for a, b in zip(short.gpus, long.gpus, strict=True))
    text = plan_text(short)
    mib = short.gpus[1].budget.mib()["workspace"]
    assert "workspace of GPU 1: prompt chunk " in text and f"headroom 256.0 = {mib} MiB" in text


def test_a_budget_whose_workspace_parts_do_not_add_up_is_refused():
    from pydantic import ValidationError

    from strata_cfg.schema.plan import Budget

    ok = dict(total=100, weights=10, kv=10, drafters=0, workspace=30, reserve=10, experts=20, free=20)
    assert Budget(**ok, workspace_parts={"prompt": 20, "headroom": 10}).workspace == 30
    with pytest.raises(ValidationError, match="do not add up"):
        Budget(**ok, workspace_parts={"prompt": 20, "headroom": 5})


@pytest.mark.parametrize("slots", [1, 3])
def test_lookup_drafting_counts_the_token_histories_the_engine_allocates(slots):
    """Under ``spec.method = "ngram"`` the last stage's workspace counts each slot's token history, which
    windows decided on the device look their proposals up in: the engine allocates exactly that, and the
    last stage's logits part is that much more than the same plan's with the MTP head's drafting."""
    from strata_runtime.engine import Engine

    common = [f"batch.slots={slots}", "batch.mtp=false", "memory.context=300"]
    lookup = plan_of(None, [*common, 'spec.method="ngram"'])
    mtp = plan_of(None, common)
    want = sizes.lookup_history_bytes(context=300, slots=slots)
    last = {g.index: g.budget for g in lookup.gpus}[lookup.stages[-1].gpu]
    with_mtp = {g.index: g.budget for g in mtp.gpus}[mtp.stages[-1].gpu]
    assert dict(last.workspace_parts)["logits"] - dict(with_mtp.workspace_parts)["logits"] == want
    assert Engine(lookup).executor.lookup_history.nbytes == want
