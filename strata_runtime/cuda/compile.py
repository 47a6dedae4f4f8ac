"""Compile-on-demand kernel sets: the template instantiations of one ``.cu`` source, per device.

NVRTC compiles one module per call, so a path compiles every instantiation it needs in one batch
(`KernelCache.prepare`, before a graph is captured) and looks them up by expression afterwards; anything not
prepared is compiled on first use. Compiled functions belong to the CUDA context they were loaded in, so each
device keeps its own cache (`ops.kernels_for`, `flash.flash_kernels_for`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backend import cupy_module
from ..models.ops import COMPILE_LOCK

log = logging.getLogger("strata_runtime")

OPTIONS = ("-std=c++17", "--use_fast_math")
"""NVRTC options of every kernel source."""


_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def source(name: str) -> str:
    """The text of a kernel source beside this module (``kernels.cu``, ``flash.cu``, ``routing.cu``), with
    each ``#include "FILE"`` of a file beside it replaced by that file's text (NVRTC gets one string)."""
    text = Path(__file__).with_name(name).read_text()
    return _INCLUDE.sub(lambda m: source(m.group(1)), text)


@dataclass(frozen=True)
class LateCompile:
    """An instantiation compiled when it was first launched, not by a `KernelCache.prepare` before: the
    launch, and the window it belongs to, waited ``seconds`` for NVRTC."""

    expression: str
    seconds: float


_LATE: list[LateCompile] = []
_LATE_LOCK = threading.Lock()


def late_compiles() -> list[LateCompile]:
    """Every `LateCompile` of this process so far, in order (`strata bench` names those of a timed run)."""
    with _LATE_LOCK:
        return list(_LATE)


_GRAPH_BUILDS = [0]


def record_graph_build() -> None:
    """A decode window ran eagerly or was captured as a graph (`strata_runtime.cuda.decode`), rather than
    replaying one."""
    with _LATE_LOCK:
        _GRAPH_BUILDS[0] += 1


def first_runs() -> int:
    """How many times this process has run something for the first time on a GPU: a kernel compiled at its
    first launch (`LateCompile`) or a decode window run eagerly or captured. A window during which this
    grew took longer than its shape takes."""
    with _LATE_LOCK:
        return len(_LATE) + _GRAPH_BUILDS[0]


def late_compile_summary(recent: int = 8) -> dict[str, object]:
    """How many `LateCompile` s this process has had, their seconds in all, and the last ``recent``
    expressions: the engine's status and ``/metrics`` report it."""
    late = late_compiles()
    return {
        "kernels": len(late),
        "seconds": sum(c.seconds for c in late),
        "recent": [c.expression for c in late[-recent:]],
    }


class KernelCache:
    """The compiled functions of one kernel source on one device, by template expression.

    Create it with that device current.
    """

    def __init__(self, code: str, options: tuple[str, ...] = OPTIONS) -> None:
        """``options``: NVRTC's, `OPTIONS` unless the source's results must round as NumPy's do."""
        self._code, self._options = code, options
        self._fns: dict[str, Any] = {}
        self._shared: dict[str, int] = {}
        self._modules: list[Any] = []
        """Every module loaded, kept for the cache's life: none is unloaded while a kernel of it may run."""

    def prepare(self, expressions: Iterable[str]) -> None:
        """Compile every listed template instantiation not yet compiled, in one module (one NVRTC run)."""
        with COMPILE_LOCK:
            todo = [e for e in dict.fromkeys(expressions) if e not in self._fns]
            if not todo:
                return
            mod = cupy_module().RawModule(code=self._code, options=self._options, name_expressions=todo)
            self._modules.append(mod)
            for e in todo:
                self._fns[e] = mod.get_function(e)

    def fn(self, expression: str) -> Any:
        """The compiled function of ``expression``, compiling it now if it was not prepared (which is
        recorded as a `LateCompile`)."""
        fn = self._fns.get(expression)
        if fn is not None:
            return fn
        with COMPILE_LOCK:
            if expression not in self._fns:  # (another thread may have compiled it meanwhile)
                t0 = time.perf_counter()
                self.prepare([expression])
                late = LateCompile(expression, time.perf_counter() - t0)
                with _LATE_LOCK:
                    _LATE.append(late)
                log.info("compiled %s at its first launch (%.2f s)", expression, late.seconds)
            return self._fns[expression]

    def fn_with_shared(self, expression: str, shared_bytes: int) -> Any:
        """The compiled function of ``expression``, allowed ``shared_bytes`` of dynamic shared memory (a
        block may take more than the default 48 KiB only with this attribute set); set once per size."""
        fn = self.fn(expression)
        if self._shared.get(expression) != shared_bytes:
            with COMPILE_LOCK:
                fn.max_dynamic_shared_size_bytes = shared_bytes  # CuPy's RawKernel sets the attribute
                self._shared[expression] = shared_bytes
        return fn
