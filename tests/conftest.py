"""Markers, skips and fixtures shared by the cufuse tests.

Tolerances, the float64 reference and the backend helpers live in
``tests/_reference.py`` (a plain module, so test files can import them).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from typing import NamedTuple

import pytest


def _compile_cache_dir():
    """torch.compile's on-disk caches for this suite, one per version of cufuse's operators: its
    autograd cache keys a graph by its forward, not by the backward formula a custom operator
    registers, so a graph compiled before an operator's backward changed would be replayed with the
    old backward's arguments (docs/pytorch.md)."""
    src = pathlib.Path(__file__).resolve().parent.parent / "cufuse"
    h = hashlib.sha1()
    for f in sorted(src.rglob("*.py")):
        h.update(f.read_bytes())
    return os.path.join(tempfile.gettempdir(), f"cufuse-tests-inductor-{h.hexdigest()[:12]}")


os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _compile_cache_dir())  # (before torch is imported)

import cufuse
from cufuse import _driver as D
from cufuse import _runtime as R

from _reference import BACKEND_PARAMS, Backend


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so that the suite runs from any rootdir.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and CuPy; deselected without one")
    config.addinivalue_line("markers", "slow: long-running (large sizes)")


def pytest_collection_modifyitems(config, items):
    """Without a GPU the tests marked cuda are deselected (the summary line
    counts them): as skips, their 13 000 items cost the CPU suite about 10 s
    (issue 32: under 4 minutes on 2 cores)."""
    if cufuse.CUDA_AVAILABLE:
        return
    gpu = [item for item in items if item.get_closest_marker("cuda") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("cuda") is None]


def pytest_report_header(config):
    if not cufuse.CUDA_AVAILABLE:
        return "cufuse: no CUDA GPU (or no CuPy): the tests marked cuda are deselected"


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    """numpy (always), torch_cpu (needs torch), cupy and torch_cuda (marked cuda)."""
    return Backend(request.param)


class Launch(NamedTuple):
    grid: tuple
    block: tuple
    stream: object  # None: CuPy's current stream
    kernel: str = ""  # the name expression launched (e.g. "ew1<QuantizeCh<float, 1, false, 8>, ...>")


class _CountingFunction:
    """Wraps a compiled kernel (cupy.cuda.Function) and records every call."""

    def __init__(self, fn, calls, kernel=""):
        self._fn = fn
        self._calls = calls
        self._kernel = kernel

    def __getattr__(self, name):  # the kernel's own attributes (ptr: _runtime.resident_threads)
        return getattr(self._fn, name)

    def __call__(self, *args, **kwargs):
        stream = args[4] if len(args) > 4 else kwargs.get("stream")
        self._calls.append(Launch(args[0], args[1], stream, self._kernel))
        return self._fn(*args, **kwargs)


@pytest.fixture
def launches(monkeypatch):
    """Records every kernel launch cufuse makes, as a list of ``Launch``.

    Every kernel comes from ``cufuse._runtime.get_function``, which is wrapped
    here; the recipes of the driver's fast paths (which hold kernels) are
    forgotten before and after the test, so that the test's recipes hold
    wrapped kernels and later tests' do not."""
    calls = []
    real = R.get_function

    def counting_get_function(family, expression, *args, **kwargs):
        return _CountingFunction(real(family, expression, *args, **kwargs), calls, expression)

    monkeypatch.setattr(R, "get_function", counting_get_function)
    D.clear_fast_paths()
    yield calls
    D.clear_fast_paths()
