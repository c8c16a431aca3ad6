"""Tile mode of the strided kernels (kernels/elementwise.cuh LayoutT, vec 2):
when the output is C-contiguous and every input repeats a contiguous block
(a row bias, a per-row scale, a middle-axis vector), a pack's input element is
(i / div) % mod. The host picks it in ``strided_layout``; the CPU tests below
check that choice, the GPU tests check the results of the tiled kernels (the
hand-written ``ewN_tiled`` and the generated ``fused_tiled``) against float64
NumPy, and that those kernels really ran.

Tolerances: ``TOL`` of tests/_reference.py (through assert_close).
"""
from __future__ import annotations

import numpy as np
import pytest

import cufuse
from cufuse import _driver as D

from _reference import DTYPES, assert_close, rand
from _reference_fused import bias_gelu_ref

ALIGNED = 1 << 20  # a pointer at a 16-byte boundary


def _parts(shape, operands):
    """(collapsed shape, parts) as the launch paths build them: the output
    C-contiguous at ALIGNED, then each input given as (shape, pointer) with
    contiguous strides broadcast to ``shape``."""
    from cufuse import _arrays as A
    full = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    strides = [full]
    ptrs = [ALIGNED]
    for ishape, ptr in operands:
        own = [int(np.prod(ishape[d + 1:], dtype=np.int64)) for d in range(len(ishape))]
        strides.append(A.broadcast_strides(tuple(ishape), own, tuple(shape)))
        ptrs.append(ptr)
    cshape, cstrides = A.collapse(tuple(shape), strides)
    return cshape, cstrides, ptrs


def _layout(shape, operands, itemsize=4, vec=4, scalar_slot=False):
    cshape, cstrides, ptrs = _parts(shape, operands)
    parts = [(p, st, itemsize) for p, st in zip(ptrs, cstrides)]
    if scalar_slot:
        parts.append(None)
    n = int(np.prod(shape))
    return D.strided_layout(4, cshape, parts, vec, n)


@pytest.mark.parametrize("shape,ishape,div,mod,pack", [
    ((64, 1024), (1024,), 1, 1024, 1),        # row bias: V consecutive elements of it
    ((64, 1024), (64, 1), 1024, 64, 0),       # per-row value: one per pack
    ((6, 5, 8), (5, 1), 8, 5, 0),             # middle axis
    ((6, 5, 8), (1, 5, 8), 1, 40, 1),         # trailing block repeated over dim 0
    ((3, 4, 8), (1, 1, 1), 96, 1, 0),         # one element
])
def test_tile_parameters(shape, ishape, div, mod, pack):
    L, work = _layout(shape, [(shape, ALIGNED), (ishape, ALIGNED)])
    assert int(L["vec"]) == 2
    n = int(np.prod(shape))
    assert work == n // 4
    assert list(L["stride"][0, :3]) == [1, 1, n]   # output: at i (i / 1 % n)
    assert list(L["stride"][1, :3]) == [1, 1, n]   # same-shape input: likewise
    assert list(L["stride"][2, :3]) == [pack, div, mod]


@pytest.mark.parametrize("why,shape,operands,kw", [
    ("row not a multiple of the pack", (64, 1022), [((1022,), ALIGNED)], {}),
    ("misaligned bias", (64, 1024), [((1024,), ALIGNED + 4)], {}),
    ("per-row value over 2 elements", (64, 2), [((64, 1), ALIGNED)], {}),
    ("two separate runs of dims", (4, 6, 8), [((4, 1, 8), ALIGNED)], {}),
    ("a scalar operand", (64, 1024), [((1024,), ALIGNED)], {"scalar_slot": True}),
    ("2**31 elements", (2**21, 1024), [((1024,), ALIGNED)], {}),
])
def test_not_tiles(why, shape, operands, kw):
    L, _ = _layout(shape, operands, **kw)
    assert int(L["vec"]) != 2, why


def test_output_must_be_c_contiguous():
    from cufuse import _arrays as A
    shape = (64, 1024)
    out_st = [1, 64]  # a transposed output
    bias = A.broadcast_strides((1024,), [1], shape)
    cshape, cstrides = A.collapse(shape, [out_st, bias])
    L, _ = D.strided_layout(4, cshape, [(ALIGNED, cstrides[0], 4), (ALIGNED, cstrides[1], 4)], 4, 64 * 1024)
    assert int(L["vec"]) != 2


# ------------------------------------------------------------------- GPU
CASES = [  # (x shape, broadcast operand shape)
    ((333, 1024), (1024,)),
    ((7, 5, 64), (5, 1)),
    ((7, 5, 64), (1, 5, 64)),
    ((300, 64), (300, 1)),
    ((9, 40), (1, 1)),
]


@pytest.fixture
def modes(monkeypatch):
    """The Layout.vec of every strided launch (recipes kept by earlier tests forgotten)."""
    from cufuse import _driver as D
    seen = []
    real = D.strided_layout

    def spy(*a, **k):
        L, work = real(*a, **k)
        seen.append(int(L["vec"]))
        return L, work

    monkeypatch.setattr(D, "strided_layout", spy)
    D.clear_fast_paths()
    yield seen
    D.clear_fast_paths()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape,bshape", CASES)
def test_bias_gelu_tiled(modes, dtype, shape, bshape):
    import cupy as cp
    x, b = rand(shape, dtype, 1), rand(bshape, dtype, 2)
    out = cp.full(shape, np.nan, dtype)            # poisoned
    got = cufuse.bias_gelu(cp.asarray(x), cp.asarray(b), out=out)
    assert modes == [2]
    assert_close(cp.asnumpy(got), bias_gelu_ref(x, b, "none", dtype), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape,bshape", CASES)
def test_fused_tiled_two_outputs(modes, dtype, shape, bshape):
    import cupy as cp
    f = cufuse.fuse(lambda x, b, c: (x * b + c, cufuse.relu(x - b)))
    x, b, c = rand(shape, dtype, 3), rand(bshape, dtype, 4), rand(shape[-1:], dtype, 5)
    o1, o2 = cp.full(shape, np.nan, dtype), cp.full(shape, np.nan, dtype)
    f(cp.asarray(x), cp.asarray(b), cp.asarray(c), out=(o1, o2))
    assert modes == [2]  # every case's last dim is a multiple of the pack, so c is a tile too
    x64, b64, c64 = (a.astype(np.float64) for a in (x, b, c))
    assert_close(cp.asnumpy(o1), x64 * b64 + c64, dtype)
    assert_close(cp.asnumpy(o2), np.maximum(x64 - b64, 0), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_tiled_large_row_index(modes, dtype):
    """Enough rows that the pack index needs the full magic-number range."""
    import cupy as cp
    shape = (40_000, 136)
    x, b = rand(shape, dtype, 6), rand((136,), dtype, 7)
    got = cufuse.add_relu(cp.asarray(x), cp.asarray(b), out=cp.full(shape, np.nan, dtype))
    assert modes == [2]
    assert_close(cp.asnumpy(got), np.maximum(x.astype(np.float64) + b.astype(np.float64), 0), dtype)
