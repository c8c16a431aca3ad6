"""Markers, skips and fixtures shared by the cufuse tests.

Tolerances, the float64 reference and the backend helpers live in
``tests/_reference.py`` (a plain module, so test files can import them).
"""
from __future__ import annotations

import pytest

import cufuse
from cufuse import _runtime as R

from _reference import BACKEND_PARAMS, Backend


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so that the suite runs from any rootdir.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and CuPy; skipped without one")
    config.addinivalue_line("markers", "slow: long-running (large sizes)")


def pytest_collection_modifyitems(config, items):
    if cufuse.CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    """numpy (always), torch_cpu (needs torch), cupy and torch_cuda (marked cuda)."""
    return Backend(request.param)


@pytest.fixture
def launches(monkeypatch):
    """Records every kernel launch that goes through cufuse._runtime.launch."""
    calls = []
    real = R.launch

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "launch", counting)
    return calls

