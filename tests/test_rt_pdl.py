"""Programmatic dependent launch without a GPU: the driver structures' layout, the arguments' C values, the
switch, and that every kernel launched with PDL waits for the kernel before it.

A kernel launched with the attribute that read the previous kernel's output before ``griddepcontrol.wait``
would race with it; on the GPU that shows only now and then, so the source itself is checked here.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from strata_runtime.cuda import pdl
from strata_runtime.cuda.choices import PDL_KERNELS
from strata_runtime.cuda.compile import source

KERNELS = source("kernels.cu")


def test_the_launch_structures_have_the_driver_headers_layout() -> None:
    """cuda.h: CUlaunchAttribute is an id, padding to 8 bytes and a 64-byte union; CUlaunchConfig is six
    grid/block dimensions, the shared bytes, a stream, the attributes and their count (64-bit)."""
    assert ctypes.sizeof(pdl._Attribute) == 72
    assert pdl._Attribute.value.offset == 8
    assert ctypes.sizeof(pdl._Config) == 56
    assert pdl._Config.shared_bytes.offset == 24
    assert pdl._Config.stream.offset == 32
    assert pdl._Config.attrs.offset == 40
    assert pdl._Config.num_attrs.offset == 48
    assert pdl.PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_arguments_become_the_c_values_the_kernels_take() -> None:
    class DeviceArray:  # what the launcher reads of a CuPy array
        data = type("Pointer", (), {"ptr": 0x7F00_1234})()

    assert pdl._arg(DeviceArray()).value == 0x7F00_1234
    assert isinstance(pdl._arg(np.int32(-3)), ctypes.c_int32) and pdl._arg(np.int32(-3)).value == -3
    assert pdl._arg(np.float32(0.5)).value == 0.5
    assert pdl._arg(np.uint64(0)).value == 0  # a null pointer argument
    with pytest.raises(TypeError, match="PDL kernel argument"):
        pdl._arg(3)  # a bare Python int has no size the kernel could agree with


def test_strata_pdl_0_turns_it_off(monkeypatch) -> None:
    pdl.available.cache_clear()
    monkeypatch.setenv("STRATA_PDL", "0")
    try:
        assert pdl.available(0) is False
    finally:
        pdl.available.cache_clear()


def _body(name: str) -> str:
    """The source of kernel ``name``'s body (its first definition)."""
    bounds = r"__launch_bounds__\((?:[^()]|\([^()]*\))*\)"  # its arguments may hold one level of calls
    start = re.search(rf"__global__ void(?:\s+{bounds})?\s+{name}\(", KERNELS)
    assert start is not None, f"kernel {name} not found in kernels.cu"
    depth, i = 0, KERNELS.index("{", start.end())
    for j in range(i, len(KERNELS)):
        depth += {"{": 1, "}": -1}.get(KERNELS[j], 0)
        if depth == 0:
            return KERNELS[i : j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


@pytest.mark.parametrize("name", sorted(PDL_KERNELS))
def test_every_pdl_kernel_waits_before_it_reads_the_previous_kernels_output(name) -> None:
    body = _body(name)
    assert "STRATA_PDL_LAUNCH();" in body and "STRATA_PDL_WAIT();" in body
    before_wait = body[: body.index("STRATA_PDL_WAIT();")]
    # Before the wait only weights may be read (W, through __ldg): no buffer the kernels pass along to each
    # other (their activations, outputs and the KV cache) is named there at all, to be read or written.
    names = r"(?<![.\w])(x|q|h|qkv|idx|wts|logits|resid|gu|y|delta|out|q_out|kc|vc)\b"
    used = re.findall(names, before_wait)
    assert not used, f"{name} touches {used} before it waits"
