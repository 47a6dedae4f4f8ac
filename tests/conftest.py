"""Shared test configuration: the `gpu` marker skips without a CUDA device, `gpu2` with fewer than two; the
server tests' demo `engine`, launched once a module, and its openai `client`."""

from __future__ import annotations

import importlib.util
import os
import secrets
from typing import Any

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One BLAS and OpenMP thread a worker (set before NumPy or torch is imported): `-n auto` runs a worker a
    # core, and threads beyond that would spin against each other, slowing every worker and making the
    # tests that time windows (adaptive drafting) see noise.
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")


def _gpu_count() -> int:
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


MAX_WORKERS = 8
"""The most processes `pytest -n auto` starts: each loads torch and launches demo engines, and past a few
the suite is bound by its slowest tests, not by the cores."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one process a core this process may run on, at most `MAX_WORKERS`; one where CuPy is
    installed, since the GPU tests would share a device."""
    if importlib.util.find_spec("cupy") is not None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


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


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """The demo engine started by `strata launch` (CPU) with an API key, once for a test module."""
    from srv_helpers import launch

    launched = launch(tmp_path_factory.mktemp(request.module.__name__), key=secrets.token_urlsafe(16))
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def client(engine: Any) -> Any:
    """The openai SDK's client of the module's `engine`, retrying nothing."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key=engine.key, max_retries=0, timeout=60)
