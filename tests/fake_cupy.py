"""A NumPy stand-in for CuPy: enough of it to run the CUDA path's Python without a GPU.

The CUDA path (`strata_runtime.cuda`) is Python that allocates buffers, fuses weights, captures and replays
CUDA graphs and calls kernel launchers. With this module installed as ``cupy``, and the kernels' NumPy
references (`strata_runtime.reference`) standing in for the launchers, that Python runs on the CPU: a
mistake in it (a wrong buffer, weight, step order or graph replay) shows up as wrong logits. Capture is
modelled as recording the launches and replay as running them again, which is what a CUDA graph does.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from strata_runtime.reference import flash as reference_flash
from strata_runtime.reference import kernels as reference_kernels
from strata_runtime.reference import routing as reference_routing

CUDA_MODULES = tuple(f"strata_runtime.cuda.{m}" for m in ("decode", "prefill", "head", "mtp", "blas"))
"""The modules of the CUDA path that import CuPy when they are imported."""


class FakeArray(np.ndarray):
    """A host array with CuPy's ``get``/``set`` (copies happen at once, whatever the stream)."""

    def get(self, stream: Any = None, out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        if out is None:
            return np.array(self)
        out[...] = self
        return out

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        self[...] = host


def _wrap(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, FakeArray):
        return x.view(FakeArray)
    return x


class _Recorder:
    """Launches made while a stream captures are recorded instead of run."""

    def __init__(self) -> None:
        self.capturing: list[list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]]] = []

    def launch(self, fn: Callable[..., None], *a: Any, **k: Any) -> None:
        if self.capturing:
            self.capturing[-1].append((fn, a, k))
        else:
            fn(*a, **k)


RECORDER = _Recorder()


class _Graph:
    def __init__(self, calls: list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]]) -> None:
        self.calls = calls

    def launch(self, stream: Any = None) -> None:
        for fn, a, k in self.calls:
            fn(*a, **k)


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def begin_capture(self) -> None:
        RECORDER.capturing.append([])

    def end_capture(self) -> _Graph:
        return _Graph(RECORDER.capturing.pop())

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    """Work is done when it is launched, so every event has happened."""

    done = True

    def __init__(self, disable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


_HOST: dict[int, np.ndarray] = {}
"""The stand-in's page-locked host allocations by address (``hostAlloc``)."""


def _host_alloc(size: int, flags: int) -> int:
    buf = np.empty(max(size, 1), np.uint8)
    _HOST[buf.ctypes.data] = buf
    return int(buf.ctypes.data)


class _Device(_Stream):
    def __init__(self, index: int = 0) -> None:
        self.id = index


class ReferenceKernels:
    """The launchers of `strata_runtime.cuda.ops.Kernels`, run by the NumPy references."""

    def __init__(self) -> None:
        from strata_runtime.cuda.ops import Kernels

        self.gemv_expr, self.moe_exprs, self.attn_exprs = (
            Kernels.gemv_expr,
            Kernels.moe_exprs,
            Kernels.attn_exprs,
        )

    def prepare(self, expressions: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        fn = getattr(reference_kernels, name)
        return lambda *a, **k: RECORDER.launch(fn, *a, **k)


def _matmul(transpose_b: bool) -> Callable[..., Any]:
    def product(a: Any, b: Any, c: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
        bb = np.swapaxes(b, -1, -2) if transpose_b else b
        y = alpha * np.matmul(np.asarray(a, np.float32), np.asarray(bb, np.float32))
        c[...] = (y + beta * np.asarray(c, np.float32) if beta else y).astype(c.dtype)  # beta 0 reads no c
        return c

    return product


def module() -> types.ModuleType:
    """The stand-in ``cupy`` module."""
    cp = types.ModuleType("cupy")
    cp.__getattr__ = lambda name: (  # type: ignore[method-assign]
        (lambda *a, **k: _wrap(getattr(np, name)(*a, **k)))
        if callable(getattr(np, name)) and not isinstance(getattr(np, name), type)
        else getattr(np, name)
    )
    cp.ndarray = FakeArray

    def empty(shape: Any, dtype: Any = float, **kw: Any) -> FakeArray:
        """Unwritten memory is NaN (integers: -1), so a read of an element no kernel wrote shows."""
        fill = np.nan if np.dtype(dtype).kind == "f" else -1
        return _wrap(np.full(shape, fill, dtype=dtype))

    cp.empty = empty
    cp.empty_like = lambda a, dtype=None: empty(a.shape, a.dtype if dtype is None else dtype)
    cp.asarray = lambda a, dtype=None: _wrap(np.array(a, dtype=dtype))  # a copy, as host to device is
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(
        free_all_blocks=lambda: None, used_bytes=lambda: 0, total_bytes=lambda: 0, set_limit=lambda size: None
    )
    cp.cuda = types.SimpleNamespace(
        Device=_Device,
        Stream=_Stream,
        Event=_Event,
        get_current_stream=_Stream,
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 4,
            deviceCanAccessPeer=lambda a, b: False,
            CUDARuntimeError=RuntimeError,
            memGetInfo=lambda: (80 << 30, 80 << 30),
            hostAlloc=_host_alloc,
            freeHost=lambda ptr: _HOST.pop(ptr, None),
            hostAllocPortable=1,
            hostAllocMapped=2,
        ),
    )
    return cp


@contextmanager
def installed() -> Iterator[None]:
    """``cupy`` is the stand-in and the CUDA path launches the references, until the block ends."""
    stubs = {"cupy": module(), "cupy_backends": types.ModuleType("cupy_backends")}
    stubs["cupy_backends.cuda"] = types.ModuleType("cupy_backends.cuda")
    stubs["cupy_backends.cuda.libs"] = types.ModuleType("cupy_backends.cuda.libs")
    stubs["cupy_backends.cuda.libs"].cublas = None  # type: ignore[attr-defined]
    import strata_runtime.cuda as package

    saved = {name: sys.modules.get(name) for name in [*stubs, *CUDA_MODULES]}
    attributes = {name: getattr(package, name.rsplit(".", 1)[1], None) for name in CUDA_MODULES}
    patched: list[tuple[Any, str, Any]] = []

    def patch(mod: Any, name: str, value: Any) -> None:
        patched.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    sys.modules.update(stubs)
    for name in CUDA_MODULES:  # imported afresh, against the stand-in
        sys.modules.pop(name, None)
        if hasattr(package, name.rsplit(".", 1)[1]):
            delattr(package, name.rsplit(".", 1)[1])
    try:
        from strata_runtime.cuda import blas, head, layers, mtp, ops, prefill, routing

        kernels = ReferenceKernels()
        for m in (layers, head, ops):
            patch(m, "kernels_for", lambda device_id: kernels)
        for m in (head, prefill, mtp, blas):
            for name, transpose_b in (("matmul_nt", True), ("matmul_nn", False)):
                if hasattr(m, name):
                    patch(m, name, _matmul(transpose_b))
        patch(prefill, "flash_prefill", reference_flash.flash_prefill)
        patch(prefill, "flash_kernels_for", lambda device_id: kernels)
        patch(routing, "routing_kernels_for", lambda device_id: kernels)
        patch(routing, "route_bias", lambda *a, **k: RECORDER.launch(reference_routing.route_bias, *a, **k))
        yield
    finally:
        for mod, name, value in reversed(patched):
            setattr(mod, name, value)
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        for name, attribute in attributes.items():
            short = name.rsplit(".", 1)[1]
            if attribute is not None:
                setattr(package, short, attribute)
            elif hasattr(package, short):
                delattr(package, short)
