"""The array path's fused ops, written once for NumPy and CuPy arrays.

Every public function here takes arrays of one device and dispatches on their type: NumPy arrays run the
NumPy reference, CuPy arrays run a small CuPy kernel. `tests/test_rt_kernels.py` checks each kernel against
its reference on fresh random inputs of several shapes (``gpu``-marked).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

COMPILE_LOCK = threading.RLock()
"""Held while a kernel is compiled and loaded, and while a per-device kernel set is made. Stage threads
launch kernels of one device at once; two that compiled the same kernel at once would each load a module,
and the one whose module was dropped would unload it while the kernel it launched still runs (an illegal
memory access on the GPU, and only where a kernel is first used while another thread is busy)."""


def locked_cache(make: Callable[..., T]) -> Callable[..., T]:
    """``functools.cache`` for the makers of kernels and kernel sets, made once under `COMPILE_LOCK`: the
    first caller makes it, any other waits and gets the same object (``functools.cache`` alone may make it
    twice and drop one, whose module then unloads)."""
    made: dict[tuple[Any, ...], T] = {}

    @functools.wraps(make)
    def cached(*args: Any) -> T:
        try:
            return made[args]
        except KeyError:
            pass
        with COMPILE_LOCK:
            if args not in made:
                made[args] = make(*args)
            return made[args]

    return cached


def on_gpu(arr: Any) -> bool:
    """Whether ``arr`` is a CuPy array."""
    return type(arr).__module__.startswith("cupy")
