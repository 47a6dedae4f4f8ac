"""A NumPy stand-in for CuPy: enough of it to run the CUDA path's Python without a GPU.

The CUDA path (`strata_runtime.cuda`) is Python that allocates buffers, fuses weights, captures and replays
CUDA graphs and calls kernel launchers. With this module installed as ``cupy``, and the kernels' NumPy
references (`strata_runtime.reference`) standing in for the launchers, that Python runs on the CPU: a
mistake in it (a wrong buffer, weight, step order or graph replay) shows up as wrong logits. Capture is
modelled as recording the launches and replay as running them again, which is what a CUDA graph does.

Streams and events run everything at once: work is done when it is queued, every event is done, and a
stream's wait for an event has nothing to wait for. What a GPU would order instead is followed, where a test
asks, by `stream_order` (every queued operation is reported to `ORDER`).

Pinned host memory is a host buffer this module remembers, so that a test can tell whether an upload
(``ndarray.set``) came from pinned or pageable memory (`UPLOADS`). Peer copies and the runtime's
asynchronous copies move the bytes between the addresses given.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from strata_runtime.reference import flash as reference_flash
from strata_runtime.reference import grouped as reference_grouped
from strata_runtime.reference import kernels as reference_kernels
from strata_runtime.reference import routing as reference_routing

CUDA_MODULES = tuple(f"strata_runtime.cuda.{m}" for m in ("decode", "prefill", "head", "mtp", "blas"))
"""The modules of the CUDA path that import CuPy when they are imported."""


UPLOADS: list[bool] = []
"""For every ``ndarray.set`` since the list was last cleared: whether its source was pinned memory."""
_PINNED: dict[int, tuple[int, bytearray]] = {}  # address: (size, buffer), kept so that no address is reused
_PINNED_STARTS: list[int] = []  # the addresses of _PINNED, sorted


def _pinned_region(address: int) -> tuple[int, int] | None:
    """(start, size) of the pinned buffer that holds ``address``, if any."""
    i = bisect.bisect_right(_PINNED_STARTS, address) - 1
    if i < 0:
        return None
    start = _PINNED_STARTS[i]
    size = _PINNED[start][0]
    return (start, size) if address < start + size else None


def is_pinned(host: np.ndarray) -> bool:
    at = host.ctypes.data
    region = _pinned_region(at)
    return region is not None and at + host.nbytes <= region[0] + region[1]


def _pinned_at(address: int) -> bool:
    return _pinned_region(address) is not None


def alloc_pinned_memory(size: int) -> bytearray:
    buf = bytearray(size)
    at = np.frombuffer(buf, np.uint8).ctypes.data
    if at not in _PINNED:  # (an empty buffer's address may be another's)
        bisect.insort(_PINNED_STARTS, at)
    _PINNED[at] = (size, buf)
    return buf


ORDER: Any = None
"""Where a test follows stream order (`stream_order.tracking`): the `stream_order.Order` that every queued
operation is reported to; None otherwise."""


class FakeArray(np.ndarray):
    """A host array with CuPy's ``get``/``set`` and ``data.ptr``."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self, stream: Any = None, out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        if ORDER is not None:
            on = stream or get_current_stream()
            ORDER.op(on, [self], [], "ndarray.get")
            if out is not None:
                ORDER.filled(out, on)
            if blocking:
                ORDER.synced(on)
        if out is None:
            return np.array(self)
        np.copyto(out.view(np.ndarray), self)  # (the host does not read ``out`` here: the device writes it)
        return out

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        UPLOADS.append(is_pinned(host))
        np.ndarray.__setitem__(self, Ellipsis, host)
        if ORDER is not None:
            ORDER.op(stream or get_current_stream(), [], [self], "ndarray.set")


def _wrap(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, FakeArray):
        return x.view(FakeArray)
    if isinstance(x, np.generic):  # CuPy's reductions give 0-d device arrays, not host scalars
        return np.asarray(x).view(FakeArray)
    return x


class _Recorder(threading.local):
    """Launches made while a stream captures are recorded instead of run (per thread: each stage's thread
    captures on its own stream)."""

    def __init__(self) -> None:
        self.capturing: list[list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]]] = []

    def launch(self, fn: Callable[..., None], *a: Any, **k: Any) -> None:
        if self.capturing:
            self.capturing[-1].append((fn, a, k))
        elif ORDER is not None:
            ORDER.kernel(fn, a, k, get_current_stream(), ORDER.label(fn))
        else:
            fn(*a, **k)


RECORDER = _Recorder()


NAN_CHOICES: list[str] = []
"""Each run of a kernel that picks indices (experts, tokens) from rows holding NaN, by name. Unwritten memory
is NaN here (`empty`), so an entry means a window chose from memory nothing wrote: on a GPU that memory holds
whatever was there, and a choice from it is wrong, or (NaN) made no index at all before the kernels learned to
make one."""

CHOOSING = {"moe": 2, "route_topk": 0, "argmax": 0, "choose": 0, "distribution": 0}
"""The references that pick indices, and where their rows of logits are among their arguments."""


def _choosing(name: str, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, noting in `NAN_CHOICES` each run whose rows of logits hold NaN."""
    at = CHOOSING[name]

    @functools.wraps(fn)  # (named as the kernel in `stream_order`'s reports)
    def run(*a: Any, **k: Any) -> None:
        if np.isnan(a[at]).any():  # (float rows: no copy)
            NAN_CHOICES.append(name)
        fn(*a, **k)

    return run


class _Graph:
    def __init__(self, calls: list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]]) -> None:
        self.calls = calls

    def launch(self, stream: Any = None) -> None:
        replayed = "" if ORDER is None else ORDER.made_here()
        for fn, a, k in self.calls:
            if ORDER is not None:
                what = f"{getattr(fn, '__name__', 'kernel')} in a graph at {replayed}"
                ORDER.kernel(fn, a, k, stream or get_current_stream(), what)
            else:
                fn(*a, **k)


class _Event:
    """Done as soon as it is recorded: the stand-in runs work when it is queued. Like a CUDA event it belongs
    to the device that was current when it was made, and may be recorded only on that device's streams."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.device_id = _CURRENT.devices[-1]

    @property
    def done(self) -> bool:
        if ORDER is not None:
            ORDER.synced(self)
        return True

    def record(self, stream: Any = None) -> None:
        (stream or get_current_stream()).record(self)

    def synchronize(self) -> None:
        if ORDER is not None:
            ORDER.synced(self)


class _Current(threading.local):
    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        self.devices: list[int] = [0]


_CURRENT = _Current()


class _Stream:
    ptr = 0
    _made = [0]
    BY_PTR: weakref.WeakValueDictionary[int, _Stream] = weakref.WeakValueDictionary()

    def __init__(self, non_blocking: bool = False) -> None:
        self.device_id = _CURRENT.devices[-1]
        self._made[0] += 1
        self.ptr = self._made[0]  # the null stream keeps 0
        self.BY_PTR[self.ptr] = self
        self.made_at = "" if ORDER is None else ORDER.made_here()

    @property
    def done(self) -> bool:
        if ORDER is not None:
            ORDER.synced(self)
        return True

    def __enter__(self) -> _Stream:
        assert self.device_id == _CURRENT.devices[-1], "a stream made current on another device"
        _CURRENT.streams.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.streams.pop()

    def record(self, event: _Event | None = None) -> _Event:
        event = event if event is not None else _Event()
        device = _CURRENT.devices[-1] if self is _NULL_STREAM else self.device_id
        assert event.device_id == device, (
            f"an event of device {event.device_id} recorded on a stream of device {device}"
        )
        if ORDER is not None:
            ORDER.record(self, event)
        return event

    def wait_event(self, event: _Event) -> None:
        assert event is not None, "a stream waits for an event that was never recorded"
        if ORDER is not None:
            ORDER.wait(self, event)

    def begin_capture(self) -> None:
        RECORDER.capturing.append([])

    def end_capture(self) -> _Graph:
        return _Graph(RECORDER.capturing.pop())

    def synchronize(self) -> None:
        if ORDER is not None:
            ORDER.synced(self)


_NULL_STREAM = _Stream()


def _stream_at(ptr: int) -> _Stream:
    return _Stream.BY_PTR.get(ptr, _NULL_STREAM) if ptr else _NULL_STREAM


def get_current_stream() -> _Stream:
    """The innermost stream made current on the current device (CuPy keeps one per device), else null."""
    device = _CURRENT.devices[-1]
    return next((s for s in reversed(_CURRENT.streams) if s.device_id == device), _NULL_STREAM)


class _Device:
    compute_capability = "90"  # an H200's: the launchers choose tensor-core kernels

    def __init__(self, index: int | None = None) -> None:
        self.id = _CURRENT.devices[-1] if index is None else index

    def __enter__(self) -> _Device:
        _CURRENT.devices.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.devices.pop()

    def synchronize(self) -> None:
        if ORDER is not None:
            ORDER.device_synced(self.id)


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA error {status}")
        self.status = status


class _Runtime:
    """The driver calls the runtime makes, with peer access as a table of enabled pairs."""

    CUDARuntimeError = CUDARuntimeError

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.peer: set[tuple[int, int]] = set()

    def getDeviceCount(self) -> int:  # noqa: N802 (CuPy's names)
        return self.devices

    def deviceCanAccessPeer(self, a: int, b: int) -> bool:  # noqa: N802
        return a != b

    def deviceEnablePeerAccess(self, peer: int) -> None:  # noqa: N802
        pair = (_CURRENT.devices[-1], peer)
        if pair in self.peer:
            raise CUDARuntimeError(704)  # cudaErrorPeerAccessAlreadyEnabled
        self.peer.add(pair)

    def memcpyPeerAsync(self, dst: int, dst_dev: int, src: int, src_dev: int, size: int, stream: int) -> None:  # noqa: N802
        if ORDER is not None:
            ORDER.raw_copy([(dst, src, size)], _stream_at(stream), "memcpyPeerAsync")
        ctypes.memmove(dst, src, size)

    memcpyHostToDevice, memcpyDefault = 1, 4  # noqa: N815

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:  # noqa: N802
        if ORDER is not None:
            ORDER.raw_copy([(dst, src, size)], _stream_at(stream), "memcpyAsync")
        ctypes.memmove(dst, src, size)

    COPIES_2D: list[tuple[int, bool]] = []
    """For every ``memcpy2DAsync``: its rows, and whether its host side (the one not in a device array) is
    pinned memory."""

    def memcpy2DAsync(  # noqa: N802
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int, stream: int
    ) -> None:
        if width > min(dpitch, spitch):
            raise CUDARuntimeError(1)  # cudaErrorInvalidValue: rows would overlap
        self.COPIES_2D.append((height, any(_pinned_at(p) for p in (dst, src))))
        if ORDER is not None:
            runs = [(dst + r * dpitch, src + r * spitch, width) for r in range(height)]
            ORDER.raw_copy(runs, _stream_at(stream), "memcpy2DAsync")
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def memGetInfo(self) -> tuple[int, int]:  # noqa: N802
        return (80 << 30, 80 << 30)

    def getDeviceProperties(self, device: int) -> dict[str, Any]:  # noqa: N802
        """An H200's, as far as the CUDA path asks."""
        return {"major": 9, "minor": 0, "name": b"NVIDIA H200", "sharedMemPerMultiprocessor": 233472}

    hostAllocPortable, hostAllocMapped = 1, 2  # noqa: N815

    def hostAlloc(self, size: int, flags: int) -> int:  # noqa: N802
        """Page-locked host memory (the expert cache's host tier): pinned, as uploads from it count."""
        return int(np.frombuffer(alloc_pinned_memory(max(size, 1)), np.uint8).ctypes.data)

    def freeHost(self, ptr: int) -> None:  # noqa: N802
        if _PINNED.pop(ptr, None) is not None:
            _PINNED_STARTS.remove(ptr)


class ReferenceKernels:
    """The launchers of `strata_runtime.cuda.ops.Kernels`, run by the NumPy references."""

    def __init__(self) -> None:
        from strata_runtime.cuda.choices import gemv_expression

        self.tensor_cores = True  # as on an H200
        self.attention_kernels: list[str] = []
        """The decode attention kernel of each launch (or capture), in order."""
        self.gemv_expr = functools.partial(gemv_expression, tensor_cores=True)
        self.prepared: set[str] = set()
        """Every instantiation a `prepare` call listed (on a GPU: compiled before any window runs)."""
        self.unprepared: list[str] = []
        """The instantiations launched (GEMVs, q/k/v, experts) that no `prepare` call listed: on a GPU each is
        compiled when it is first launched, and the window that launches it waits a second or more."""

    def prepare(self, expressions: Any) -> None:
        self.prepared.update(expressions)

    def gemv(
        self, w: Any, x: Any, out: Any, accumulate: bool = False, norm: Any = None, eps: float = 1e-6
    ) -> None:
        self._launched(self.gemv_expr(x.shape[0], *w.shape, norm is not None))
        RECORDER.launch(reference_kernels.gemv, w, x, out, accumulate, norm, eps)

    def gemv_i8(self, q: Any, scale: Any, x: Any, out: Any) -> None:
        from strata_runtime.cuda.choices import gemv_i8_launch

        self._launched(gemv_i8_launch(x.shape[0], q.shape[0])[0])
        from strata_runtime.models.ops.int8 import linear_int8

        RECORDER.launch(linear_int8, np, q, scale, x, out)

    def qkv_rope(self, w: Any, x: Any, qkv: Any, norm: Any, eps: float, *rest: Any) -> None:
        """As the launcher: the fused projection's instantiation, or the projection's where it fuses none."""
        from strata_runtime.cuda.choices import qkv_rope_launch

        q_out = rest[4]
        launch = qkv_rope_launch(x.shape[0], *w.shape, q_out.shape[2], self.tensor_cores)
        self._launched(launch[0] if launch else self.gemv_expr(x.shape[0], *w.shape, True))
        RECORDER.launch(reference_kernels.qkv_rope, w, x, qkv, norm, eps, *rest)

    def moe(self, x: Any, norm: Any, logits: Any, *rest: Any, warm: Any = None) -> None:
        """As the launcher: the expert kernels' instantiations (``warm`` only moves weights into L2)."""
        from strata_runtime.cuda.choices import l2_warm_in_force, moe_expressions

        experts, idx, h_buf = rest[2], rest[4], rest[6]  # after logits: norm_topk, eps, experts, resid, ...
        keep = getattr(experts, "keep", None) is not None
        mode = l2_warm_in_force().mode(x.shape[0]) if warm is not None else 0
        for expr in moe_expressions(x.shape[1], h_buf.shape[1], idx.shape[1], keep, mode):
            self._launched(expr)
        RECORDER.launch(_choosing("moe", reference_kernels.moe), x, norm, logits, *rest)

    def attention(self, q: Any, k_cache: Any, *rest: Any, tensor_cores: bool = True) -> None:
        """As the launcher: records the kernel it would launch in `attention_kernels`."""

        tc = self.attention_on_tc(q.shape[2], q.shape[1] // k_cache.shape[1], tensor_cores)
        self.attention_kernels.append("attn_tc" if tc else "attn_split")
        RECORDER.launch(reference_kernels.attention, q, k_cache, *rest)

    def attention_on_tc(self, head_dim: int, group: int, tensor_cores: bool = True) -> bool:
        from strata_runtime.cuda.ops import Kernels

        return Kernels.attention_on_tc(self, head_dim, group, tensor_cores)  # type: ignore[arg-type]

    def _launched(self, expr: str) -> None:
        if expr not in self.prepared:
            self.unprepared.append(expr)

    def programmatic(self, on: bool = True) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Callable[..., None]:
        fn = getattr(reference_kernels, name)
        if name in CHOOSING:
            fn = _choosing(name, fn)
        return lambda *a, **k: RECORDER.launch(fn, *a, **k)


class ReferenceGrouped:
    """The launchers of `strata_runtime.cuda.grouped.GroupedKernels`, run by the NumPy references."""

    def prepare_all(self) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        fn = getattr(reference_grouped, name)
        return lambda *a, **k: RECORDER.launch(fn, *a, **k)


def _matmul(transpose_b: bool) -> Callable[..., Any]:
    def run(a: Any, b: Any, c: Any, alpha: float, beta: float) -> None:
        bb = np.swapaxes(b, -1, -2) if transpose_b else b
        y = alpha * np.matmul(np.asarray(a, np.float32), np.asarray(bb, np.float32))
        c[...] = (y + beta * np.asarray(c, np.float32) if beta else y).astype(c.dtype)  # beta 0 reads no c

    def product(a: Any, b: Any, c: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
        RECORDER.launch(run, a, b, c, alpha, beta)  # a graph captures cuBLAS products too
        return c

    return product


def _flash_prefill(
    q_hi: Any, q_lo: Any, kc: Any, vc: Any, slot: int, pos0: int, scale: float, out: Any, where: Any = None
) -> None:
    """The launcher on the reference: with ``where``, the slot and first position read when it runs."""

    def run() -> None:
        s, p = (int(where[0]), int(where[1])) if where is not None else (slot, pos0)
        reference_flash.flash_prefill(q_hi, q_lo, kc, vc, s, p, scale, out)

    RECORDER.launch(run)


def _route_bias(*a: Any, **k: Any) -> None:
    reference_routing.route_bias(*a, **k)


_route_bias.rows_read = {3: 2, 4: 2}  # type: ignore[attr-defined]
"""Each slot's tables (cdf, seeds) are read at the rows' slots only (`stream_order` reads it)."""


def module(devices: int = 4) -> types.ModuleType:
    """The stand-in ``cupy`` module, with ``devices`` GPUs."""
    cp = types.ModuleType("cupy")
    cp.__getattr__ = lambda name: (  # type: ignore[method-assign]
        (lambda *a, **k: _wrap(getattr(np, name)(*a, **k)))
        if callable(getattr(np, name)) and not isinstance(getattr(np, name), type)
        else getattr(np, name)
    )
    cp.ndarray = FakeArray

    def empty(shape: Any, dtype: Any = float, **kw: Any) -> FakeArray:
        """Unwritten memory is NaN (integers: -1, unsigned ones all bits set), so a read of an element no
        kernel wrote shows."""
        kind = np.dtype(dtype).kind
        fill = np.nan if kind == "f" else np.iinfo(dtype).max if kind == "u" else -1
        return _wrap(np.full(shape, fill, dtype=dtype))

    cp.empty = empty
    cp.empty_like = lambda a, dtype=None: empty(a.shape, a.dtype if dtype is None else dtype)
    cp.asarray = lambda a, dtype=None: _wrap(np.array(a, dtype=dtype))  # a copy, as host to device is
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(
        free_all_blocks=lambda stream=None: None,
        used_bytes=lambda: 0,
        total_bytes=lambda: 0,
        set_limit=lambda size: None,
    )
    cp.cuda = types.SimpleNamespace(
        Device=_Device,
        Stream=_Stream,
        Event=_Event,
        get_current_stream=get_current_stream,
        alloc_pinned_memory=alloc_pinned_memory,
        runtime=_Runtime(devices),
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
        patch(prefill, "flash_prefill", _flash_prefill)
        patch(prefill, "flash_kernels_for", lambda device_id: kernels)
        grouped = ReferenceGrouped()
        patch(prefill, "grouped_kernels_for", lambda device_id: grouped)
        patch(routing, "routing_kernels_for", lambda device_id: kernels)
        patch(routing, "route_bias", lambda *a, **k: RECORDER.launch(_route_bias, *a, **k))
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
