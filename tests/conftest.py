"""Shared test configuration: the `gpu` marker skips without a CUDA device, `gpu2` with fewer than two."""

from __future__ import annotations

import importlib.util

import pytest


def _gpu_count() -> int:
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {"gpu": 1, "gpu2": 2}
    wanted = [(item, n) for item in items for marker, n in needs.items() if marker in item.keywords]
    if not wanted:
        return
    count = _gpu_count()
    for item, n in wanted:
        if count < n:
            reason = (
                "needs a CUDA GPU with CuPy" if n == 1 else f"needs {n} CUDA GPUs with CuPy ({count} here)"
            )
            item.add_marker(pytest.mark.skip(reason=reason))
