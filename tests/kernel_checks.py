"""Checks shared by the kernel tests (CUDA kernels against their NumPy references): inputs, relative error."""

from __future__ import annotations

import os
import zlib

import numpy as np


def rel_err(a, b) -> float:
    """Relative Frobenius error of ``a`` against ``b``; a non-finite ``a`` (a NaN-poisoned element the kernel
    never wrote) fails at once."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "kernel left unwritten (NaN) or non-finite output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rng() -> np.random.Generator:
    """A generator seeded by the running test's id (its parameters included): each test case gets inputs of
    its own, the same on every run."""
    return np.random.default_rng(zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode()))
