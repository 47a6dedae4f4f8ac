"""Stream order on the CuPy stand-in: the engine's races between CUDA streams, found on the CPU.

The stand-in (`fake_cupy`) runs work when it is queued, so a window that a GPU could run before its inputs
are written still computes the right numbers here. `tracking` follows what a GPU guarantees instead, as
vector clocks:

* each stream runs its work in the order it was queued;
* a stream that waits for an event runs after the work its stream had queued when the event was recorded;
* once the host has waited for a stream or an event (a synchronisation, a query that answered done, a
  blocking read of a device value, a pool release, which frees memory and so waits for the device), whatever
  it queues next runs after that work.

Every kernel, copy and array operation is an access to the device memory it reads and writes, element by
element (a kernel's writes are the elements it changed; its reads, every element of the arrays it was
given). Two accesses on different streams, one of them a write, race unless one is ordered before the
other. A device array the host lets go of returns to the memory pool of the stream it was allocated on
(CuPy keeps one pool per stream), whose next allocation may take it at once: every other stream's access to
it must be ordered before that stream's later work, or the memory is written while another stream may still
use it.

Each race is noted once per pair of places in `Order.races`.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import fake_cupy
import numpy as np

_HERE = ("/tests/", "/strata_runtime/reference/")
FRAMES = int(os.environ.get("STRATA_ORDER_FRAMES", "2"))
"""The runtime's frames that name where a race's work was queued (more: ``STRATA_ORDER_FRAMES``)."""


def _site(depth: int = 2) -> str:
    """Where the runtime queued the work: its innermost frames outside the stand-in and the references."""
    frame: Any = sys._getframe(depth)
    out: list[str] = []
    while frame is not None and len(out) < FRAMES:
        name = frame.f_code.co_filename
        if "/strata_runtime/" in name and not any(h in name for h in _HERE):
            out.append(f"{name.split('/strata_runtime/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(out) or "(outside the runtime)"


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class _Buf:
    """One allocation's history: the stream it came from, and for each element the last write (stream,
    step) and each stream's last read."""

    def __init__(self, root: np.ndarray, alloc: Any, site: str) -> None:
        self.alloc, self.site = alloc, site
        self.shape, self.dtype = root.shape, root.dtype
        self.start, self.itemsize = root.ctypes.data, root.itemsize
        self.end = self.start + root.nbytes
        self.w_sid = np.zeros(root.size, np.int64)
        self.w_n = np.zeros(root.size, np.int64)
        self.reads: dict[int, np.ndarray] = {}

    def describe(self) -> str:
        return f"an array {list(self.shape)} {self.dtype} allocated at {self.site}"


class Order:
    """The vector clocks of the streams and the host, and the accesses of every live device array."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the engine queues from several threads
        self.host: dict[int, int] = {}
        """The host's clock: each stream's last step the host has waited for."""
        self.bufs: dict[int, _Buf] = {}
        """Every live device allocation seen, by the id of its root array."""
        self.sites: dict[tuple[int, int], str] = {}
        """What each (stream, step) was and where it was queued."""
        self.races: list[str] = []
        self._seen: set[tuple[str, str, str]] = set()
        self._sids = 0
        self._streams: list[Any] = []
        self._by_stream: dict[int, tuple[int, dict[int, int]]] = {}
        """Each stream's number and clock, by its id (the stream is held in `_streams`)."""
        self._events: dict[int, tuple[Any, dict[int, int]]] = {}
        """Each recorded event's clock, by its id (with the event, so that no other takes the id)."""
        self._starts: list[int] = []
        self._by_start: dict[int, _Buf] = {}
        """The allocations by their first address (sorted in `_starts`), for copies between addresses."""
        self.local = threading.local()
        """``inside``: this thread runs a kernel's reference, whose own array operations are not accesses."""
        self.on = True
        self._filled: dict[int, tuple[Any, int, int]] = {}
        """Page-locked host arrays a copy from a device fills, by their memory's id: (a reference to it, the
        copy's stream and step)."""

    # ---- clocks -------------------------------------------------------------------------------------

    def _state(self, stream: Any) -> tuple[int, dict[int, int]]:
        state = self._by_stream.get(id(stream))
        if state is None:
            self._sids += 1
            state = self._by_stream[id(stream)] = (self._sids, {})
            self._streams.append(stream)  # (held: no other stream takes its id meanwhile)
        return state

    def made_here(self) -> str:
        """Where a stream is being made (to name it in a race)."""
        return _site(3)

    def name(self, sid: int) -> str:
        for s in self._streams:
            if self._by_stream[id(s)][0] == sid:
                return f"stream {sid} (made at {getattr(s, 'made_at', '') or 'the start'})"
        return f"stream {sid}"

    def sid(self, stream: Any) -> int:
        return self._state(stream)[0]

    def clock(self, stream: Any) -> dict[int, int]:
        return self._state(stream)[1]

    def _enqueue(self, stream: Any, what: str) -> tuple[int, int, dict[int, int]]:
        sid, c = self.sid(stream), self.clock(stream)
        _merge(c, self.host)
        c[sid] = c.get(sid, 0) + 1
        self.sites[(sid, c[sid])] = f"{what} [{threading.current_thread().name}]"
        return sid, c[sid], c

    def record(self, stream: Any, event: Any) -> None:
        with self.lock:
            c = self.clock(stream)
            _merge(c, self.host)
            self._events[id(event)] = (event, dict(c))

    def _event_clock(self, event: Any) -> dict[int, int]:
        return self._events.get(id(event), (None, {}))[1]

    def wait(self, stream: Any, event: Any) -> None:
        with self.lock:
            _merge(self.clock(stream), self._event_clock(event))

    def synced(self, stream_or_event: Any) -> None:
        """The host waited for a stream (all it queued) or an event (the work before it)."""
        with self.lock:
            if hasattr(stream_or_event, "ptr"):
                _merge(self.host, self.clock(stream_or_event))
            else:
                _merge(self.host, self._event_clock(stream_or_event))

    def device_synced(self, device_id: int) -> None:
        with self.lock:
            for s in self._streams:
                if s.device_id == device_id or s is fake_cupy._NULL_STREAM:
                    _merge(self.host, self.clock(s))

    # ---- buffers ------------------------------------------------------------------------------------

    def _buf(self, root: np.ndarray, stream: Any, site: str) -> _Buf:
        buf = self.bufs.get(id(root))
        if buf is None:
            buf = self.bufs[id(root)] = _Buf(root, stream, site)
            weakref.finalize(root, self._freed, id(root), buf)
            bisect.insort(self._starts, buf.start)
            self._by_start[buf.start] = buf
        return buf

    def allocated(self, arr: Any) -> None:
        """A new device array, from the pool of the current stream."""
        if self.on and isinstance(arr, np.ndarray) and arr.size:
            with self.lock:
                self._buf(_root(arr), fake_cupy.get_current_stream(), _site(3))

    def _freed(self, key: int, buf: _Buf) -> None:
        with self.lock:
            if self.bufs.get(key) is buf:
                del self.bufs[key]
            if self._by_start.get(buf.start) is buf:
                del self._by_start[buf.start]
                i = bisect.bisect_left(self._starts, buf.start)
                if i < len(self._starts) and self._starts[i] == buf.start:
                    del self._starts[i]
            if not self.on:
                return
            a = buf.alloc
            after = dict(self.clock(a))
            _merge(after, self.host)
            mine = self.sid(a)
            later = "freed to the pool of its stream"
            for sid in np.unique(buf.w_sid):
                if sid in (0, mine):
                    continue
                n = int(buf.w_n[buf.w_sid == sid].max())
                if n > after.get(int(sid), 0):
                    self._race(self.sites.get((int(sid), n), "?"), "writes", later, buf)
            for sid, rn in buf.reads.items():
                n = int(rn.max())
                if sid != mine and n > after.get(sid, 0):
                    self._race(self.sites.get((sid, n), "?"), "reads", later, buf)

    def _elements(self, v: np.ndarray, buf: _Buf) -> Any:
        """The elements of ``buf`` that view ``v`` covers (a slice, or indices in ``v``'s C order)."""
        isz = buf.itemsize
        off = v.ctypes.data - buf.start
        if v.shape == buf.shape and v.dtype == buf.dtype and v.flags.c_contiguous and off == 0:
            return slice(None)
        if v.itemsize != isz or off % isz or any(s % isz for s in v.strides):
            lo = max(off // isz, 0)
            return slice(lo, lo + max(v.nbytes // isz, 1))
        index: Any = np.int64(off // isz)
        for n, stride in zip(v.shape, v.strides, strict=True):
            index = np.add.outer(index, np.arange(n, dtype=np.int64) * (stride // isz))
        return np.ravel(index)

    def _race(self, first: str, verb: str, second: str, buf: _Buf, detail: str = "") -> None:
        second = f"{second} [{threading.current_thread().name}]"
        self._note((first, verb, second), f"{second} races {first}, which {verb} {buf.describe()} ({detail})")

    def _note(self, key: tuple[str, str, str], message: str) -> None:
        """A race, noted once per pair of places (``key``)."""
        if key not in self._seen:
            self._seen.add(key)
            self.races.append(message)

    def access(
        self, stream: Any, reads: list[tuple[Any, Any]], writes: list[tuple[Any, Any]], what: str
    ) -> None:
        """``what`` on ``stream`` reads ``reads`` and writes ``writes``: (array, mask of the elements or None
        for every one)."""
        with self.lock:
            step = self._enqueue(stream, what)
            for arr, mask in writes:
                self._write(*self._covered(arr, mask, stream, what), step, what)
            for arr, mask in reads:
                self._read(*self._covered(arr, mask, stream, what), step, what)

    def _covered(self, arr: Any, mask: Any, stream: Any, what: str) -> tuple[_Buf, Any]:
        """The allocation under ``arr`` and the elements of it that ``arr`` (where ``mask`` holds) covers."""
        buf = self._buf(_root(arr), stream, what)
        el = self._elements(arr, buf)
        if mask is not None:
            el = (np.arange(buf.w_n.size)[el] if isinstance(el, slice) else el)[mask.ravel()]
        return buf, el

    def _write(self, buf: _Buf, el: Any, step: tuple[int, int, dict[int, int]], what: str) -> None:
        """A write of elements ``el``: after every other stream's last write and reads of them."""
        sid, n, clock = step
        self._check(buf.w_sid[el], buf.w_n[el], sid, clock, what, "writes", buf)
        for r, rn in buf.reads.items():
            if r != sid:
                last = rn[el].max(initial=0, keepdims=True)
                self._check(np.full(1, r), last, sid, clock, what, "reads", buf)
            rn[el] = 0
        buf.w_sid[el], buf.w_n[el] = sid, n

    def _read(self, buf: _Buf, el: Any, step: tuple[int, int, dict[int, int]], what: str) -> None:
        """A read of elements ``el``: after every other stream's last write of them."""
        sid, n, clock = step
        self._check(buf.w_sid[el], buf.w_n[el], sid, clock, what, "writes", buf)
        reads = buf.reads.get(sid)
        if reads is None:
            reads = buf.reads[sid] = np.zeros(buf.w_n.size, np.int64)
        reads[el] = n

    def _check(
        self, ws: np.ndarray, wn: np.ndarray, sid: int, clock: dict[int, int], what: str, verb: str, buf: _Buf
    ) -> None:
        other = (ws != 0) & (ws != sid)
        if not other.any():
            return
        ws, wn = ws[other], wn[other]
        one = int(ws[0])
        if (ws == one).all():  # most often one stream
            last = [(one, int(wn.max()))]
        else:
            last = [(s, int(wn[ws == s].max())) for s in np.unique(ws).tolist()]
        for s, n in last:
            if n > clock.get(s, 0):
                first = self.sites.get((s, n), "?")
                self._race(first, verb, what, buf, f"{self.name(s)} step {n}; on {self.name(sid)}")

    # ---- the host's reads of what copies from a device fill -------------------------------------------

    def filled(self, host: np.ndarray, stream: Any) -> None:
        """``host`` (page-locked) is filled by the copy just queued on ``stream``."""
        with self.lock:
            sid = self.sid(stream)
            root = _root(host)
            self._filled[id(root)] = (weakref.ref(root), sid, self.clock(stream)[sid])

    def host_read(self, host: np.ndarray, name: str) -> None:
        """The host reads ``host`` (by ``name``, a method or ufunc): it must have waited for the copy that
        fills it."""
        if not self.on:
            return
        with self.lock:
            root = _root(host)
            entry = self._filled.get(id(root))
            if entry is None or entry[0]() is not root:
                return
            _, sid, n = entry
            if self.host.get(sid, 0) < n:
                what = f"{name} at {_site(3)}"
                first = self.sites.get((sid, n), "?")
                self._note(
                    (first, "fills", what),
                    f"{what} on the host reads an array {list(host.shape)} {host.dtype} that {first} "
                    f"fills ({self.name(sid)} step {n}) before the host waited for it",
                )

    # ---- the operations -----------------------------------------------------------------------------

    @property
    def quiet(self) -> bool:
        return not self.on or getattr(self.local, "inside", False)

    def kernel(
        self, fn: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any], stream: Any, what: str
    ) -> Any:
        """Run a kernel's reference, noting what it read (every array given) and wrote (what changed)."""
        if self.quiet:
            return fn(*a, **k)
        arrays = _device_arrays([*a, *k.values()])
        before = [x.tobytes() for x in arrays]
        touched: list[tuple[Any, bytes]] = []
        a = tuple(_Touching(x, touched) if _holds_experts(x) else x for x in a)
        self.local.inside = True
        try:
            out = fn(*a, **k)
        finally:
            self.local.inside = False
        for x, b in touched:  # the experts' weights the kernel read through its tables (and kept)
            if all(x is not y for y in arrays):
                arrays.append(x)
                before.append(b)
        writes = []
        for x, b in zip(arrays, before, strict=True):
            if x.tobytes() != b:
                old, now = np.frombuffer(b, x.dtype).reshape(x.shape), x.view(np.ndarray)
                changed = old != now
                if x.dtype.kind == "f":
                    changed &= ~(np.isnan(old) & np.isnan(now))
                writes.append((x, changed))
        reads = [(x, None) for x in arrays]
        for at, index in getattr(fn, "rows_read", {}).items():  # tables read only at the rows indexed
            table, rows = a[at], np.asarray(a[index]).ravel()
            mask = np.zeros(table.shape, bool)
            mask[rows[(rows >= 0) & (rows < table.shape[0])]] = True
            reads = [(x, mask) if x is table else (x, m) for x, m in reads]
        self.access(stream, reads, writes, what)
        return out

    def label(self, fn: Callable[..., Any]) -> str:
        """A kernel's name and where the runtime launched it."""
        return f"{getattr(fn, '__name__', 'kernel')} at {_site(3)}"

    def op(self, stream: Any, reads: list[Any], writes: list[Any], what: str) -> None:
        """An array operation or copy: reads and writes whole arrays, or (array, mask) pairs."""
        if self.quiet:
            return
        self.access(stream, _masked(reads), _masked(writes), f"{what} at {_site(3)}")

    def raw_copy(self, rows: list[tuple[int, int, int]], stream: Any, what: str) -> None:
        """A copy between device addresses (``rows``: (dst, src, bytes) runs); host addresses are skipped."""
        if self.quiet:
            return
        what = f"{what} at {_site(3)}"
        with self.lock:
            reads, writes = [], []
            for d, s, size in rows:
                for at, into in ((s, reads), (d, writes)):
                    buf = self._at(at)
                    if buf is not None:
                        into.append(_span(buf, at, size))
            step = self._enqueue(stream, what)
            for buf, el in writes:
                self._write(buf, el, step, what)
            for buf, el in reads:
                self._read(buf, el, step, what)

    def _at(self, address: int) -> _Buf | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        buf = self._by_start.get(self._starts[i])
        return buf if buf is not None and address < buf.end else None


def _span(buf: _Buf, address: int, size: int) -> tuple[_Buf, slice]:
    lo = (address - buf.start) // buf.itemsize
    return buf, slice(lo, lo + max(size // buf.itemsize, 1))


def _holds_experts(x: Any) -> bool:
    """An expert kernel's view of a layer's experts (`strata_runtime.cuda.experts.LayerExperts`)."""
    return callable(getattr(x, "weights", None)) and not isinstance(x, np.ndarray)


class _Touching:
    """A layer's experts as a kernel's reference reads them: each expert's weights it takes through the
    tables (``weights``) and each cache slot it writes a kept expert into (``keep.slot``) are noted, with
    their bytes then, as accesses of the kernel (which reads them through addresses, not arguments)."""

    def __init__(self, inner: Any, touched: list[tuple[Any, bytes]]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_touched", touched)

    def _touch(self, arrays: Any) -> Any:
        for x in arrays:
            if isinstance(x, fake_cupy.FakeArray) and x.size:
                self._touched.append((x, x.tobytes()))
        return arrays

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name in ("weights", "slot"):
            return lambda i: self._touch(value(i))
        if name == "keep" and value is not None:
            return _Touching(value, self._touched)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def _masked(values: list[Any]) -> list[tuple[np.ndarray, Any]]:
    """(array, mask) pairs of ``values``' device arrays: pairs as given, other arrays with no mask."""
    out = []
    for v in values:
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], fake_cupy.FakeArray):
            if v[0].size:
                out.append(v)
        else:
            out += [(a, None) for a in _device_arrays([v])]
    return out


def _device_arrays(values: list[Any]) -> list[np.ndarray]:
    """The device arrays among ``values``: themselves, in lists and tuples, or attributes of an object."""
    out: dict[int, np.ndarray] = {}
    todo = [(v, 0) for v in values]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, fake_cupy.FakeArray):
            if v.size:
                out.setdefault(id(v), v)
        elif isinstance(v, (list, tuple)) and depth < 2:
            todo += [(x, depth + 1) for x in v]
        elif depth == 0 and hasattr(v, "__dict__") and not isinstance(v, type):
            todo += [(x, 1) for x in vars(v).values()]
    return list(out.values())


# ---- the stand-in's arrays and module, followed --------------------------------------------------------

FakeArray = fake_cupy.FakeArray


def _order() -> Order | None:
    o = fake_cupy.ORDER
    return None if o is None or o.quiet else o


def _plain(x: Any) -> Any:
    return x.view(np.ndarray) if isinstance(x, FakeArray) else x


def _new(result: Any, inputs: list[Any]) -> bool:
    """Whether ``result`` is a new device array, not a view of one of ``inputs``."""
    if not isinstance(result, np.ndarray) or not result.size:
        return False
    root = _root(result)
    return all(not isinstance(x, np.ndarray) or _root(x) is not root for x in inputs)


def _ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, out: Any = None, **kw: Any) -> Any:
    if out is not None:
        kw["out"] = tuple(_plain(x) for x in out)
    result = getattr(ufunc, method)(*[_plain(x) for x in inputs], **kw)
    if out is not None:
        result = out[0] if len(out) == 1 else out
    elif isinstance(result, np.ndarray):
        result = fake_cupy._wrap(result)
    elif isinstance(result, tuple):
        result = tuple(fake_cupy._wrap(r) if isinstance(r, np.ndarray) else r for r in result)
    o = _order()
    if o is not None:
        writes = list(out or ()) + ([inputs[0]] if method == "at" else [])
        if out is None:
            writes += [
                r for r in (result if isinstance(result, tuple) else (result,)) if _new(r, list(inputs))
            ]
        o.op(fake_cupy.get_current_stream(), list(inputs), writes, f"{ufunc.__name__}.{method}")
    return result


def _index_arrays(idx: Any) -> list[Any]:
    return [i for i in (idx if isinstance(idx, tuple) else (idx,)) if isinstance(i, np.ndarray)]


def _mask(a: np.ndarray, idx: Any) -> np.ndarray:
    plain = tuple(_plain(i) for i in idx) if isinstance(idx, tuple) else _plain(idx)
    mask = np.zeros(a.shape, bool)
    mask[plain] = True
    return mask


def _setitem(self: Any, idx: Any, value: Any) -> None:
    np.ndarray.__setitem__(self, idx, value)
    o = _order()
    if o is not None:
        o.op(
            fake_cupy.get_current_stream(),
            [value, *_index_arrays(idx)],
            [(self, _mask(self, idx))],
            "setitem",
        )


def _getitem(self: Any, idx: Any) -> Any:
    result = np.ndarray.__getitem__(self, idx)
    o = _order()
    if o is not None and _new(result, [self]):
        o.op(
            fake_cupy.get_current_stream(),
            [(self, _mask(self, idx)), *_index_arrays(idx)],
            [result],
            "gather",
        )
    return result


def _copying(name: str) -> Callable[..., Any]:
    method = getattr(np.ndarray, name)

    def run(self: Any, *a: Any, **k: Any) -> Any:
        result = method(self, *a, **k)
        o = _order()
        if o is not None and _new(result, [self]):
            o.op(fake_cupy.get_current_stream(), [self], [result], name)
        return result

    return run


def _fill(self: Any, value: Any) -> None:
    np.ndarray.fill(self, value)
    o = _order()
    if o is not None:
        o.op(fake_cupy.get_current_stream(), [], [self], "fill")


def _reading(name: str) -> Callable[..., Any]:
    """A method that reads a device value on the host: a copy on the current stream, waited for."""
    method = getattr(np.ndarray, name)

    def run(self: Any, *a: Any, **k: Any) -> Any:
        o = _order()
        if o is not None:
            stream = fake_cupy.get_current_stream()
            o.op(stream, [self], [], f"{name} (read on the host)")
            o.synced(stream)
        return method(self, *a, **k)

    return run


class _Pending(np.ndarray):
    """A page-locked host array (`strata_runtime.backend.pinned_empty`), whose reads on the host are checked
    against the copies from a device that fill it (`Order.host_read`)."""


def _host_reading(name: str) -> Callable[..., Any]:
    method = getattr(np.ndarray, name)

    def run(self: Any, *a: Any, **k: Any) -> Any:
        o = fake_cupy.ORDER
        if o is not None:
            o.host_read(self, name)
        return method(self, *a, **k)

    return run


def _pending_ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, out: Any = None, **kw: Any) -> Any:
    o = fake_cupy.ORDER
    if o is not None:
        for x in inputs:
            if isinstance(x, _Pending):
                o.host_read(x, ufunc.__name__)
    if out is not None:
        kw["out"] = tuple(x.view(np.ndarray) if isinstance(x, _Pending) else x for x in out)
    plain = [x.view(np.ndarray) if isinstance(x, _Pending) else x for x in inputs]
    result = getattr(ufunc, method)(*plain, **kw)
    return (out[0] if len(out) == 1 else out) if out is not None else result


_HOST_READS = ("__getitem__", "__int__", "__float__", "__index__", "__bool__", "__iter__")
for _name in (*_HOST_READS, "item", "tolist", "copy"):
    setattr(_Pending, _name, _host_reading(_name))
_Pending.__array_ufunc__ = _pending_ufunc  # type: ignore[method-assign]


def _pending(make: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def run(*a: Any, **k: Any) -> np.ndarray:
        return make(*a, **k).view(_Pending)

    return run


_METHODS: dict[str, Any] = {
    "__array_ufunc__": _ufunc,
    "__setitem__": _setitem,
    "__getitem__": _getitem,
    "copy": _copying("copy"),
    "astype": _copying("astype"),
    "fill": _fill,
    **{name: _reading(name) for name in ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")},
}

_IN_PLACE = {"copyto": 0, "put": 0, "place": 0, "putmask": 0}
"""Module functions that write into an argument, and which."""


def _module_function(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        o = _order()
        if o is None:
            return fn(*a, **k)
        o.local.inside = True
        try:
            result = fn(*a, **k)
        finally:
            o.local.inside = False
        inputs = [*a, *k.values()]
        writes = [k["out"]] if isinstance(k.get("out"), np.ndarray) else []
        if name in _IN_PLACE:
            writes.append(a[_IN_PLACE[name]])
        if name == "empty" or name == "empty_like":
            o.allocated(result)
        elif _new(result, inputs):
            writes.append(result)
        o.op(fake_cupy.get_current_stream(), inputs, writes, f"cupy.{name}")
        return result

    return run


@contextlib.contextmanager
def tracking() -> Iterator[Order]:
    """Follow stream order while the stand-in is installed (`fake_cupy.installed`)."""
    order = Order()
    saved = fake_cupy.ORDER
    cp = sys.modules["cupy"]
    module_saved = {n: cp.__dict__.get(n) for n in ("__getattr__", "empty", "empty_like", "asarray")}
    pool = cp.get_default_memory_pool
    getattr_ = cp.__getattr__

    def attribute(name: str) -> Any:
        value = getattr_(name)
        return _module_function(name, value) if callable(value) and not isinstance(value, type) else value

    def released(stream: Any = None) -> None:  # freeing memory waits for the device
        order.device_synced(fake_cupy._CURRENT.devices[-1])

    cp.__getattr__ = attribute
    for n in ("empty", "empty_like", "asarray"):
        setattr(cp, n, _module_function(n, module_saved[n]))
    cp.get_default_memory_pool = lambda: _Pool(pool(), released)
    for n, m in _METHODS.items():
        setattr(FakeArray, n, m)
    from strata_runtime import backend
    from strata_runtime.cuda import experts

    host_arrays = [(backend, "pinned_empty"), (experts, "_pinned")]
    made = [getattr(mod, n) for mod, n in host_arrays]
    for (mod, n), make in zip(host_arrays, made, strict=True):
        setattr(mod, n, _pending(make))
    fake_cupy.ORDER = order
    try:
        yield order
    finally:
        order.on = False
        fake_cupy.ORDER = saved
        for (mod, n), make in zip(host_arrays, made, strict=True):
            setattr(mod, n, make)
        for n in _METHODS:
            delattr(FakeArray, n)
        for n, v in module_saved.items():
            setattr(cp, n, v)
        cp.get_default_memory_pool = pool


class _Pool:
    def __init__(self, pool: Any, released: Callable[..., None]) -> None:
        self._pool, self.free_all_blocks = pool, released

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)
