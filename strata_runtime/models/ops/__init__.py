"""The array path's fused ops, written once for NumPy and CuPy arrays.

Every public function here takes arrays of one device and dispatches on their type: NumPy arrays run the
NumPy reference, CuPy arrays run a small CuPy kernel. `tests/test_rt_kernels.py` checks each kernel against
its reference on fresh random inputs of several shapes (``gpu``-marked).
"""

from __future__ import annotations

from typing import Any


def on_gpu(arr: Any) -> bool:
    """Whether ``arr`` is a CuPy array."""
    return type(arr).__module__.startswith("cupy")
