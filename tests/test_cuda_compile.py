"""The CUDA sources compile for sm_90 without a GPU, for every instantiation the engine prepares.

The GPU tests run the kernels against their NumPy twins; these run in CI, where there is no GPU, and catch
a source that no longer compiles, a block over the 48 KiB of static shared memory, and a kernel whose
registers spill to local memory (read from ptxas's report). They compile what the engine compiles when it
starts: the decode kernels of every preset's shapes at 1 to 8 rows (with the LM head and MTP head GEMVs),
the prefill path's kernels, flash attention at each head dim it takes, the grouped expert products and
calibrated routing. NVRTC and the CUDA headers come from NVIDIA's wheels in the test extra (`nvrtc`).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import nvrtc
import pytest

from strata_cfg.schema.presets import preset_config, preset_names
from strata_runtime.cuda import grouped, routing
from strata_runtime.cuda.choices import (
    PDL_KERNELS,
    L2Warm,
    decode_expressions,
    mtp_gemv_shapes,
    prefill_expressions,
)
from strata_runtime.cuda.compile import OPTIONS, source
from strata_runtime.cuda.flash import HOPPER_SM_SHARED, NARROW, kernel_expr, shared_bytes, tile_shape
from strata_runtime.cuda.layers import MIN_COMPUTE_CAPABILITY, supported
from strata_runtime.models.qwen3_moe import ModelArgs
from strata_runtime.reference.flash import HEAD_DIMS

HOPPER_BLOCK_SHARED = 227 * 1024
"""Shared memory a block may take on an H100 or H200 (with the function attribute)."""

pytestmark = pytest.mark.skipif(nvrtc.available() is not None, reason=str(nvrtc.available()))


def _decode_expressions() -> list[str]:
    """What the decode graphs of every preset the CUDA path takes compile (`CudaLayers.expressions`), with
    the head's and the MTP head's GEMVs."""
    out: dict[str, None] = {}
    for name in preset_names():
        a = ModelArgs.from_config(preset_config(name))
        if supported(a, "float16", "float16") is not None:
            continue
        h, v = a.hidden_size, a.vocab_size
        widths = [w for w in (a.intermediate_size, a.shared_expert_intermediate_size) if w]
        head = mtp_gemv_shapes(v, h)  # the MTP head's input projections and the LM head
        for warm in (L2Warm(), L2Warm(8), L2Warm(8, early=True)):  # and the expert kernels warming L2
            out |= dict.fromkeys(decode_expressions(a, widths, head, warm=warm))
    return list(out)


KNOWN_SPILLS: dict[str, int] = {r"moe_down<\d+,768,8,(true|false),[12]>": 8}
"""Kernels known to spill, as a pattern of their instantiation and the most bytes (stores + loads) of it:
anything else that spills, or spills more, fails. Removing a spill means measuring the variant without it
on a GPU; an entry that no longer matches a spilling kernel fails too, so the list stays true.

``moe_down`` warming L2 at the 30B preset's widths (an engine's policy, off by default): its 24 weight loads
of 16 bytes a lane hold 96 of its 128 registers, and the warming loop beside them costs one value stored and
loaded once (4 + 4 bytes) after the loads (WARM 1), and under an expert cache that keeps its misses before
the wait too (WARM 2). The plain kernels spill nothing."""


def _check(
    name: str, expressions: list[str], options: tuple[str, ...], arch: str = "sm_90"
) -> dict[str, nvrtc.Kernel]:
    """Compile ``expressions`` of kernel source ``name`` for ``arch`` (in parts, one per core: NVRTC runs
    outside the GIL) and, for sm_90, check every kernel's spills against `KNOWN_SPILLS`."""

    code, parts = source(name), max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(parts) as pool:
        done = pool.map(partial(_compile_part, code, expressions, options, arch, parts), range(parts))
        kernels = {e: k for part in done for e, k in part.items()}
    if arch != "sm_90":
        return kernels
    for e, k in kernels.items():
        if k.spill_stores or k.spill_loads:
            budget = [b for pattern, b in KNOWN_SPILLS.items() if re.fullmatch(pattern, e)]
            assert budget, f"{name}: {e} spills registers to local memory: {k}"
            assert k.spill_stores + k.spill_loads <= budget[0], f"{name}: {e} spills more than before: {k}"
    return kernels


FLASH_EXPRESSIONS = sorted(
    {kernel_expr(d, q, sm) for d in HEAD_DIMS for q in (True, False) for sm in (HOPPER_SM_SHARED, 0)}
)
"""Every flash instantiation: each head dim, q in two parts and fp16 q, Hopper's shape and the narrow one."""


def test_the_decode_kernels_compile_for_every_preset_without_spilling() -> None:

    exprs = _decode_expressions()
    assert {"attn_tc<128,8,1>", "attn_tc<128,8,0>"} <= set(exprs)  # qwen3-30b-a3b's attention
    kernels = _check("kernels.cu", [*exprs, *prefill_expressions(True), *prefill_expressions(False)], OPTIONS)
    assert all(k.shared_bytes <= 48 * 1024 for k in kernels.values())
    for pattern in KNOWN_SPILLS:  # each known spill is still there (else: remove it from the list)
        assert any(re.fullmatch(pattern, e) and (k.spill_stores or k.spill_loads) for e, k in kernels.items())
    # moe_down's launch bound (`moe_down_blocks`) lets the 30B preset's 24 expert-row loads of 16 bytes a
    # lane (96 registers) all be held in registers, so ptxas issues them before the first is used; without
    # the bound it keeps the kernel at about 60 registers and places the loads beside their uses.
    # Windows of more than two rows fit three attn_tc blocks of 128 threads to an SM (74.5 KiB of shared
    # memory each at head dim 128): that takes at most 170 registers a thread.
    assert kernels["attn_tc<128,8,0>"].registers * 128 * 3 <= 65536, kernels["attn_tc<128,8,0>"]
    down = kernels["moe_down<2048,768,8>"]
    assert 96 < down.registers <= 128, down


def test_the_prefill_and_routing_kernels_compile_without_spilling() -> None:

    _check("flash.cu", FLASH_EXPRESSIONS, OPTIONS)
    # The narrow shape launches on every GPU from Ampere on (99 KiB of shared memory a block on the
    # consumer chips), two blocks to an A100's SM (164 KiB, 1 KiB of each block's the hardware's); the
    # wide one fits two blocks to a Hopper SM.
    for d in HEAD_DIMS:
        for split_q in (True, False):
            assert tile_shape(d, split_q, 0) == NARROW
            assert 2 * (shared_bytes(d, split_q, 0) + 1024) <= 164 * 1024, (d, split_q)
            assert 2 * (shared_bytes(d, split_q) + 1024) <= HOPPER_SM_SHARED, (d, split_q)
    assert tile_shape(128, True) == tile_shape(128, False) == (2, 32)  # what the H200 figures measure
    assert tile_shape(128, False, 164 * 1024) == (2, 32) and tile_shape(128, True, 164 * 1024) == NARROW
    _check("grouped.cu", grouped.expressions(), OPTIONS)
    _check("routing.cu", [routing.KERNEL], routing.EXACT_OPTIONS)


def test_every_source_compiles_for_the_oldest_gpus_the_cuda_path_takes() -> None:
    """`layers.MIN_COMPUTE_CAPABILITY` (8.0, Ampere) is the oldest GPU the kernels run on: each source
    compiles for it (each kernel template once, the GEMVs at 1 and 8 rows), and, to show the limit is
    real, the decode kernels do not compile for 7.5."""

    arch = f"sm_{MIN_COMPUTE_CAPABILITY}"
    exprs = [e for e in _decode_expressions() if not e.startswith("gemv_") or re.match(r"gemv_\w+<[18],", e)]
    kernels = _check("kernels.cu", [*exprs, *prefill_expressions(False)], OPTIONS, arch)
    assert all(k.shared_bytes <= 48 * 1024 for k in kernels.values())
    _check("flash.cu", FLASH_EXPRESSIONS, OPTIONS, arch)
    _check("grouped.cu", grouped.expressions(), OPTIONS, arch)
    _check("routing.cu", [routing.KERNEL], routing.EXACT_OPTIONS, arch)
    with pytest.raises(nvrtc.CompileError, match="__reduce_add_sync"):
        nvrtc.compile_source(source("kernels.cu"), ["choose_rows"], OPTIONS, "sm_75")


def _weight_loads_before_wait(expr: str) -> int:
    """The 16-byte weight loads a lane of one-row kernel ``expr`` issues before it waits for the kernel before
    it, as kernels.cu's loops count them (0 for the kernels that issue none). ptxas may move the wait above
    some or all of them, never other loads."""
    name, _, rest = expr.partition("<")
    t = [int(v) if v.isdigit() else v == "true" for v in rest.rstrip(">").split(",")] if rest else []
    if name == "gemv_mma":  # the first GROUP = 2 units of PER a warp: MT tiles x J pieces x 2 bands each
        k, mt, warps = t[1], t[2], t[3]
        j = 4 // mt
        return min(2, -(-(k // (32 * j)) // warps)) * mt * j * 2
    if name == "gemv_wide":  # one feature a warp: its K / 256 pieces
        return t[1] // 256 if t[2] == 1 else 0
    if name == "gemv_split":  # F features x K / 2048 pieces
        return t[2] * (t[1] // 2048)
    return 0


@pytest.mark.skipif(nvrtc.disassembler() is not None, reason=str(nvrtc.disassembler()))
def test_one_row_kernels_issue_only_weight_loads_before_waiting_for_the_kernel_before() -> None:
    """A one-row decode kernel launches with programmatic dependent launch, so it may start while the kernel
    before it still runs: what it loads before ``griddepcontrol.wait`` (ACQBULK in the machine code) must be
    what no kernel writes. In the machine code of every such kernel of every preset: one wait, and before it
    only read-only 16-byte loads, no more than the weight loads its source issues there.

    The activations are read through ``const __restrict__`` pointers, which the compiler also loads on the
    read-only path; ptxas kept those after the wait here, but moved them above it once the weight loads sat
    in a branch of their own before the wait (a variant tried for the router). This test fails on that."""
    exprs: dict[str, None] = {}
    for name in preset_names():
        a = ModelArgs.from_config(preset_config(name))
        if supported(a, "float16", "float16") is not None:
            continue
        widths = [w for w in (a.intermediate_size, a.shared_expert_intermediate_size) if w]
        shapes = mtp_gemv_shapes(a.vocab_size, a.hidden_size)
        for warm in (L2Warm(), L2Warm(1), L2Warm(1, early=True)):
            one_row = decode_expressions(a, widths, shapes, max_rows=1, warm=warm)
            exprs |= dict.fromkeys(e for e in one_row if e.split("<")[0] in PDL_KERNELS)
    assert {"moe_down<2048,768,8,false,1>", "moe_down<2048,768,8,false,2>"} <= set(exprs)
    assert "gemv_mma<1,4096,1,32,false>" in exprs  # the 30B preset's output projection
    for expr, code in nvrtc.sass(source("kernels.cu"), list(exprs), OPTIONS).items():
        waits = [i for i, line in enumerate(code) if "ACQBULK" in line]
        assert len(waits) == 1, expr
        loads = [line for line in code[: waits[0]] if re.search(r"\bLD(G|S)?\.", line)]
        assert all(re.search(r"\bLDG\.E\.128\.CONSTANT\b", line) for line in loads), (expr, loads)
        assert len(loads) <= _weight_loads_before_wait(expr), (expr, len(loads))
    # The output projection's weights do go out before its wait (8 loads a lane).
    out_proj = nvrtc.sass(source("kernels.cu"), ["gemv_mma<1,4096,1,32,false>"], OPTIONS)
    code = out_proj["gemv_mma<1,4096,1,32,false>"]
    assert sum("LDG" in line for line in code[: next(i for i, x in enumerate(code) if "ACQBULK" in x)]) == 8


def _compile_part(
    code: str, expressions: list[str], options: tuple[str, ...], arch: str, parts: int, i: int
) -> dict[str, nvrtc.Kernel]:
    return nvrtc.compile_source(code, expressions[i::parts], options, arch)


def test_a_source_that_does_not_compile_is_reported_with_nvrtcs_log() -> None:
    with pytest.raises(nvrtc.CompileError, match="undefined"):
        nvrtc.compile_source("__global__ void k(float* y) { y[0] = undefined_name; }", ["k"], ("-std=c++17",))
