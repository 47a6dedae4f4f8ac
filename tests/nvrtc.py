"""NVRTC without a GPU: compile a CUDA source for one architecture and read ptxas's report of each kernel,
or a kernel's machine code (SASS).

The library and the CUDA headers come from NVIDIA's wheels (``nvidia-cuda-nvrtc-cu12`` and
``nvidia-cuda-runtime-cu12``, in the test extra), and the disassembler from ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm``. `available` and `disassembler` say why they cannot be used, or None.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import subprocess
import tempfile
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


def _disassembler_dir() -> Path | None:
    tools = _package_dir("nvidia.cu13")
    bin_dir = tools / "bin" if tools else None
    return (
        bin_dir if bin_dir and (bin_dir / "cuobjdump").exists() and (bin_dir / "nvdisasm").exists() else None
    )


def disassembler() -> str | None:
    """Why `sass` cannot disassemble here (None when it can)."""
    if _disassembler_dir() is None:
        return "cuobjdump and nvdisasm are not installed (the test extra: nvidia-cuda-cuobjdump, -nvdisasm)"
    return available()


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
    return _compile(code, expressions, options, arch)[0]


def sass(
    code: str, expressions: list[str], options: tuple[str, ...], arch: str = "sm_90"
) -> dict[str, list[str]]:
    """The machine code of each kernel of ``expressions`` of ``code`` compiled for ``arch``: one instruction a
    line, as cuobjdump prints it (``/*0a40*/  LDG.E.128.CONSTANT R8, desc[UR4][R2.64] ;``), no encodings."""
    _, cubin, names = _compile(code, expressions, options, arch)
    bin_dir = _disassembler_dir()
    assert bin_dir is not None, disassembler()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cubin"
        path.write_bytes(cubin)
        env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        cmd = [str(bin_dir / "cuobjdump"), "-sass", str(path)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    functions: dict[str, list[str]] = {}
    code_of: list[str] = []
    for line in out.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            code_of = functions.setdefault(m.group(1), [])
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            code_of.append(line.split(";")[0].strip() + " ;")
    return {e: functions[names[e]] for e in expressions}


def _compile(
    code: str, expressions: list[str], options: tuple[str, ...], arch: str
) -> tuple[dict[str, Kernel], bytes, dict[str, str]]:
    """Each expression's ptxas report, the CUBIN, and each expression's lowered (mangled) name."""
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
        out, names = {}, {}
        for e in expressions:
            name = ctypes.c_char_p()
            lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(name))
            names[e] = name.value.decode()
            out[e] = reports[names[e]]
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return out, cubin.raw, names
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
