"""NVRTC without a GPU: compile a CUDA source for one architecture and read ptxas's report of each kernel.

The library and the CUDA headers come from NVIDIA's wheels (``nvidia-cuda-nvrtc-cu12`` and
``nvidia-cuda-runtime-cu12``, in the test extra). `available` says why they cannot be used, or None.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _paths() -> tuple[Path | None, Path | None]:
    nvrtc, runtime = _package_dir("nvidia.cuda_nvrtc"), _package_dir("nvidia.cuda_runtime")
    lib = next(iter(sorted((nvrtc / "lib").glob("libnvrtc.so*"))), None) if nvrtc else None
    include = runtime / "include" if runtime and (runtime / "include" / "cuda_fp16.h").exists() else None
    return lib, include


def available() -> str | None:
    """Why NVRTC cannot compile here (None when it can)."""
    lib, include = _paths()
    if lib is None:
        return "NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12)"
    if include is None:
        return "the CUDA headers are not installed (pip install nvidia-cuda-runtime-cu12)"
    return None


@dataclass(frozen=True)
class Kernel:
    """ptxas's report of one compiled kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


class CompileError(RuntimeError):
    pass


def compile_source(
    code: str, expressions: list[str], options: tuple[str, ...], arch: str = "sm_90"
) -> dict[str, Kernel]:
    """Compile ``code`` with NVRTC for ``arch``, instantiating ``expressions``: each expression's ptxas
    report. Raises `CompileError` with NVRTC's log when it does not compile."""
    lib_path, include = _paths()
    if lib_path is None or include is None:
        raise CompileError(available())
    lib = ctypes.CDLL(str(lib_path))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"source.cu", 0, None, None) != 0:
        raise CompileError("nvrtcCreateProgram failed")
    try:
        for e in expressions:
            lib.nvrtcAddNameExpression(prog, e.encode())
        opts = [o.encode() for o in options]
        opts += [f"-arch={arch}".encode(), b"-Xptxas=-v", f"-I{include}".encode()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise CompileError(log)
        reports = _ptxas_reports(log)
        out = {}
        for e in expressions:
            name = ctypes.c_char_p()
            lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(name))
            out[e] = reports[name.value.decode()]
        return out
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _ptxas_reports(log: str) -> dict[str, Kernel]:
    """Each kernel's registers, spills and static shared memory from ptxas's verbose log."""
    out: dict[str, Kernel] = {}
    name, spills = None, (0, 0)
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            spills = (int(m.group(1)), int(m.group(2)))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            smem = re.search(r"(\d+) bytes smem", line)
            out[name] = Kernel(int(m.group(1)), *spills, int(smem.group(1)) if smem else 0)
            name, spills = None, (0, 0)
    return out
