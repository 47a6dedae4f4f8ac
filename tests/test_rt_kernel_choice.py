"""Which decode GEMV a projection takes, without a GPU.

A row's result must not depend on the window it is in (greedy text is the same solo, serial, pipelined and
with batch MTP), so the kernel may depend on the weights' shape and the device, never on the row count. So
must the tensor-core kernel's block shape, which decides how a row's sum is cut. The CUDA-core kernel's
features per warp may change with the rows: each choice sums a row in the same order
(`tests/test_cuda_kernels.py` checks both bit for bit on a GPU).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from strata_runtime.cuda.choices import gemv_expression, gemv_launch

SHAPES = [
    (5120, 2048, True),  # q/k/v
    (2048, 4096, False),  # output projection
    (128, 2048, True),  # router
    (256, 2048, True),
    (255, 4096, False),  # an odd router-sized output
    (257, 2048, True),
    (151936, 2048, True),  # LM head
    (1536, 2048, True),  # a dense MLP's gate/up
    (2048, 768, False),  # its down
    (1, 2048, True),  # a shared expert's gate
    (4096, 4096, False),
    (96, 200, False),  # a reduction gemv_wide cannot take
]


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize(("n", "k", "norm"), SHAPES)
def test_the_kernel_and_its_block_shape_do_not_depend_on_the_row_count(n, k, norm, tensor_cores) -> None:
    def without_rows(expr: str) -> str:
        expr = re.sub(r"<\d+,", "<R,", expr)
        return re.sub(r"^(gemv_wide<R,\d+,)\d+", r"\1NR", expr)

    chosen = {without_rows(gemv_expression(rows, n, k, norm, tensor_cores)) for rows in range(1, 9)}
    assert len(chosen) == 1, chosen


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize(("n", "k", "norm"), SHAPES)
def test_the_launch_covers_every_output_feature(n, k, norm, tensor_cores) -> None:
    for rows in (1, 8):
        expr, blocks, threads = gemv_launch(rows, n, k, norm, tensor_cores)
        kind = expr.split("<")[0]
        if kind == "gemv_split":
            covered = blocks * int(expr.split(",")[2])
        elif kind == "gemv_mma":
            covered = blocks * 16 * int(expr.split(",")[2])
        elif kind == "gemv_wide":
            covered = blocks * threads // 32 * int(expr.split(",")[2])
        else:
            covered = blocks * threads // 32
        assert threads % 32 == 0 and covered >= n > covered - (covered // blocks), (expr, blocks, threads)


def test_tensor_cores_take_every_projection_but_a_router_sized_one() -> None:
    assert gemv_expression(8, 5120, 2048, True, True).startswith("gemv_mma<8,2048,")
    assert gemv_expression(8, 151936, 2048, True, True).startswith("gemv_mma<8,2048,")
    assert gemv_expression(8, 128, 2048, True, True).startswith("gemv_split<8,2048,")
    assert gemv_expression(1, 1, 2048, True, False).startswith("gemv_split<1,2048,")
    assert gemv_expression(1, 256, 768, False, True).startswith("gemv_wide<1,768,")
    assert gemv_expression(1, 5120, 2048, False, False).startswith("gemv_wide<1,2048,")
    assert gemv_expression(1, 96, 200, False, True) == "gemv_any"


@pytest.mark.parametrize(
    ("head_dim", "takes"), [(16, True), (128, True), (256, True), (96, False), (48, False)]
)
def test_the_cuda_path_takes_only_head_dims_its_attention_kernel_splits_evenly(head_dim, takes) -> None:
    """The decode attention kernel sums a chunk's positions in groups of D / 8 lanes, which must divide a
    warp; other head dims run on the array path, and the reason names the head dim."""
    import dataclasses

    import numpy as np

    from strata_cfg.schema.presets import preset_config
    from strata_runtime.cuda.layers import supported
    from strata_runtime.models.qwen3_moe import ModelArgs

    args = dataclasses.replace(ModelArgs.from_config(preset_config("tiny")), head_dim=head_dim)
    why = supported(args, np.float16, np.float16)
    assert (why is None) is takes, why
    if not takes:
        assert f"head dim {head_dim}" in why


def _attention_shapes() -> list[tuple[int, int]]:
    """(head dim, query heads per KV head) of every preset, and of the shapes the CUDA kernels take."""
    from strata_cfg.schema.presets import preset_config, preset_names

    shapes = {(d, g) for d in (16, 32, 64, 128, 256) for g in (1, 2, 4, 8, 16)}
    for name in preset_names():
        cfg = preset_config(name)
        d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        shapes.add((d, cfg["num_attention_heads"] // cfg["num_key_value_heads"]))
    return sorted(shapes)


@pytest.mark.parametrize(("d", "g"), _attention_shapes())
def test_attention_sums_in_one_order_at_every_row_count(d: int, g: int) -> None:
    """`attn_split`'s threads may change with the row count, its canonical warps (the order a row's sums
    take) may not; its static shared memory (q, scores, the warps' sums) must fit in 48 KiB; 256 threads
    need four 16-byte pieces of a head per position; and the decode graphs compile every shape a window
    of 1-8 rows launches."""
    from strata_runtime.cuda.choices import ATTN_CHUNK, attention_expressions, attention_fits, attention_shape

    if not attention_fits(d, g):  # the CUDA path refuses the model (`layers.supported`)
        assert 4 * (4 * g * d + g * d + g * ATTN_CHUNK) > 48 * 1024
        return
    shapes = {attention_shape(d, g, rows) for rows in range(1, 9)}
    assert len({w for _, w in shapes}) == 1, shapes
    for b, w in shapes:
        assert b in (128, 256) and w * 32 >= b
        assert 4 * (w * g * d + g * d + g * ATTN_CHUNK) + 4 <= 48 * 1024, (b, w)
        assert b == 128 or d >= 32
    split = {f"attn_split<{d},{g},{b},{w}>" for b, w in shapes}
    assert split == set(attention_expressions(d, g, tensor_cores=False))
    if d in (16, 32, 64, 128) and g <= 16:  # `attn_tc` takes the shape: one kernel, compiled twice
        assert attention_expressions(d, g) == (f"attn_tc<{d},{g},1>", f"attn_tc<{d},{g},0>")
    else:
        assert set(attention_expressions(d, g)) == split


def test_the_cuda_path_refuses_attention_whose_block_would_not_fit_in_shared_memory() -> None:
    from strata_cfg.schema.presets import preset_config
    from strata_runtime.cuda.layers import supported
    from strata_runtime.models.qwen3_moe import ModelArgs

    base = preset_config("tiny")
    fits = ModelArgs.from_config(
        {**base, "head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 1}
    )
    assert supported(fits, np.float16, np.float16) is None
    wide = ModelArgs.from_config(
        {**base, "head_dim": 256, "num_attention_heads": 16, "num_key_value_heads": 1}
    )
    why = supported(wide, np.float16, np.float16)
    assert why is not None and "16 query heads per KV head at head dim 256" in why and "84 KiB" in why


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize(
    ("n_q", "n_kv", "d", "hidden"), [(32, 4, 128, 2048), (16, 2, 64, 1024), (144, 8, 32, 2048)]
)
def test_the_q_k_v_projection_fuses_rope_exactly_where_it_runs_on_tensor_cores(
    n_q, n_kv, d, hidden, tensor_cores
):
    """`Kernels.qkv_rope` takes ``gemv_mma`` with the head dim appended, the projection's own instantiation
    otherwise unchanged (so it sums as `Kernels.gemv` does, at any row count), with blocks that hold whole
    heads or parts of one; without tensor cores the projection and ``qk_norm_rope_kv`` run apart. The
    decode graphs compile the fused kernel at every row count."""
    from strata_runtime.cuda.choices import decode_expressions, qkv_rope_launch
    from strata_runtime.models.qwen3_moe import ModelArgs

    n = (n_q + 2 * n_kv) * d
    args = ModelArgs(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=n_q,
        num_key_value_heads=n_kv, head_dim=d, intermediate_size=512, moe_intermediate_size=256,
        num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    compiled = decode_expressions(args, [], tensor_cores=tensor_cores)
    for rows in range(1, 9):
        fused = qkv_rope_launch(rows, n, hidden, d, tensor_cores)
        plain = gemv_launch(rows, n, hidden, True, tensor_cores)
        if not tensor_cores:
            assert fused is None and not any(e.endswith(f",{d}>") and "gemv_mma" in e for e in compiled)
            continue
        assert fused is not None
        assert fused[0] == f"{plain[0][:-1]},{d}>" and fused[1:] == plain[1:]
        features = 16 * int(plain[0].split(",")[2])
        assert features % d == 0 or d % features == 0
        assert fused[0] in compiled


@pytest.mark.parametrize(
    ("n", "k", "warps"), [(2048, 4096, 32), (1024, 8192, 32), (2048, 2048, 16), (1536, 6144, 16)]
)
def test_a_short_output_over_a_reduction_of_whole_4096s_takes_a_warp_per_unit(n, k, warps) -> None:
    """Outputs under 4,096 features take 16 features a block; where the reduction is a multiple of 4,096 the
    block has 32 warps, so that every warp sums whole 128-wide units evenly (the 30B preset's output
    projection ran fastest so inside the whole step), and 16 otherwise. The tiles decide the order of a row's
    sums, so the shape must not change with the rows either."""
    from strata_runtime.cuda.choices import gemv_mma_shape

    assert gemv_mma_shape(n, k) == (1, warps)
    exprs = {gemv_launch(rows, n, k, False, True) for rows in range(1, 9)}
    assert {(e.split(",", 1)[1], b, t) for e, b, t in exprs} == {
        (f"{k},1,{warps},false>", n // 16, 32 * warps)
    }


@pytest.mark.parametrize("sm_shared", [233_472, 167_936, 102_400])  # H100/H200, A100, the consumer chips
@pytest.mark.parametrize(("d", "g"), [(128, 8), (128, 16), (64, 8), (16, 2)])
def test_attention_on_tensor_cores_leaves_few_row_windows_two_blocks_an_sm(
    sm_shared: int, d: int, g: int
) -> None:
    """Windows of 1-2 rows prefer a carveout with room for two ``attn_tc`` blocks an SM, not three (which
    leaves the kernels around attention a small L1); the percentage is of the SM's own shared memory."""
    from strata_runtime.cuda.choices import (
        ATTENTION_FEW_BLOCKS,
        attention_tc_carveout,
        attention_tc_shared_bytes,
    )

    block = attention_tc_shared_bytes(d, g) + 1024
    pct = attention_tc_carveout(attention_tc_shared_bytes(d, g), sm_shared)
    assert 0 < pct <= 100
    if ATTENTION_FEW_BLOCKS * block <= sm_shared:
        assert pct * sm_shared / 100 >= ATTENTION_FEW_BLOCKS * block
        assert (pct - 1) * sm_shared / 100 < ATTENTION_FEW_BLOCKS * block
    assert attention_tc_shared_bytes(128, 8) == (4 * 64 + 2 * 9) * 136 * 2  # K, V in two buffers; q's parts
    if (d, g, sm_shared) == (128, 8, 233_472):  # the H200: two blocks an SM, not the three that were slower
        room = pct * sm_shared / 100
        assert 2 * block <= room < 3 * block


@pytest.mark.parametrize(
    ("context", "cuda_cores", "tensor_cores"),
    [(1, 1, 1), (300, 5, 5), (4096, 64, 64), (4097, 65, 64), (8192, 128, 64), (32768, 512, 64)],
)
def test_attention_on_tensor_cores_keeps_at_most_64_partials_at_any_context(
    context, cuda_cores, tensor_cores
):
    """Decode attention's scratch holds a partial result per 64 positions of the context on CUDA cores, and
    at most `ATTN_SPLITS` = 64 on tensor cores, whose runs never outnumber them (`ATTN_SHORT_SPLITS`); the
    plan counts the same floats as the runtime allocates."""
    from strata_cfg.schema.windows import decode_attention_partials, decode_attention_scratch_floats
    from strata_runtime.cuda.choices import ATTN_SHORT_SPLITS, ATTN_SPLITS, attention_scratch_size

    assert ATTN_SHORT_SPLITS <= ATTN_SPLITS == 64
    assert decode_attention_partials(context) == cuda_cores
    assert decode_attention_partials(context, tensor_cores=True) == tensor_cores
    for tc, partials in ((False, cuda_cores), (True, tensor_cores)):
        floats = attention_scratch_size(3, 32, 4, 128, context, tc)
        assert (
            floats
            == 3 * 32 * partials * 130
            == decode_attention_scratch_floats(3, 32, 128, context, tensor_cores=tc)
        )


def test_attn_tc_launches_with_the_split_in_force_in_the_kernels_argument_order() -> None:
    """`Kernels.attention` gives ``attn_tc`` the engine's split of a row (`ATTN_SPLIT`) outside
    `attention_split` and the given one inside it, as the kernel's last integer arguments (splits,
    short_splits, short_chunks, one_run_chunks), with a grid of at most ``splits`` runs a row and head."""
    from types import SimpleNamespace

    from strata_runtime.cuda.choices import ATTN_SPLIT, AttentionSplit, attention_split
    from strata_runtime.cuda.ops import Kernels

    launches: list[tuple[str, tuple, tuple]] = []
    stub = SimpleNamespace(
        attention_on_tc=lambda d, g, tc: tc,
        allow_shared=lambda expr, smem: None,
        prefer_carveout=lambda expr, pct: None,
        sm_shared=228 * 1024,
        fn=lambda expr: lambda grid, block, args, shared_mem=0: launches.append((expr, grid, args)),
    )
    rows, n_q, n_kv, d, t = 2, 8, 2, 64, 9000
    q = np.zeros((rows, n_q, d), np.float32)
    kc = np.zeros((3, n_kv, t, d), np.float16)
    big = np.zeros(10**7, np.float32)
    done = np.zeros((rows, 1000), np.int32)
    pos, slot = np.zeros(rows, np.int32), np.arange(rows, dtype=np.int32)

    def launch() -> tuple[str, tuple, list[int]]:
        Kernels.attention(stub, q, kc, kc, pos, slot, q, big, done, tensor_cores=True)  # type: ignore[arg-type]
        expr, grid, args = launches.pop()
        return expr, grid, [int(a) for a in args[12:16]]

    expr, grid, counts = launch()
    assert expr.startswith("attn_tc<64,4,")
    assert counts == [
        ATTN_SPLIT.splits,
        ATTN_SPLIT.short_splits,
        ATTN_SPLIT.short_chunks,
        ATTN_SPLIT.one_run_chunks,
    ]
    assert grid == (rows, n_kv, ATTN_SPLIT.splits)
    other = AttentionSplit(one_run_chunks=0, short_splits=4, short_chunks=32, splits=8)
    with attention_split(other):
        assert launch()[1:] == ((rows, n_kv, 8), [8, 4, 32, 0])
    assert launch()[2] == counts  # the engine's split again
