"""Shared test configuration: the `gpu` marker skips cleanly without a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest


def _have_gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _have_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
