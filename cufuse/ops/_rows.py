"""What the row kernels (kernels/rows.cuh: reductions, norms, softmax) need
from an array: validation of the data operand, a [rows][cols] view with a row
stride, NumPy values for the fallback, and the group size for a row length.
Allocation, copies, streams and aliasing are the driver's (``_driver``)."""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .. import _driver as D

FLOATS = A.FLOAT_DTYPES


def data_arg(name, x, what="x"):
    """(kind, dtype, device) of the data operand (named ``what`` in errors); TypeError for anything
    but a float array (or a tensor that requires grad)."""
    kind = A.array_kind(name, x, what)
    dt = A.dtype_of(x, kind)
    if dt not in FLOATS:
        raise TypeError(f"cufuse.{name}: {what} is {A.describe(x, kind)}; accepted dtypes are {A.FLOAT_NAMES}")
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        A.check_grad(x, name)
    return kind, dt, A.device_of(x, kind)


def to_numpy(x, kind):
    return A.torch_numpy(x) if kind == A.TORCH_CPU else np.asarray(x)


def from_numpy(res, kind, out):
    """A fallback result in the caller's kind, or written into ``out``."""
    if out is not None:
        np.copyto(to_numpy(out, kind), res)
        if kind == A.TORCH_CPU:
            D.written((out,))
        return out
    if kind == A.TORCH_CPU:
        return A.torch_result(res)
    return res


def row_stride(x, kind, lead):
    """Row stride (elements) when ``x`` is [rows][cols] with its first
    ``lead`` dims as rows and each row's elements contiguous; None otherwise."""
    shape, st = tuple(x.shape), A.strides_of(x, kind)
    if A.pointer_of(x, kind) % A.dtype_of(x, kind).itemsize:
        return None
    if not A.is_c_contiguous(shape[lead:], st[lead:]):
        return None
    cols = A.count(shape[lead:])
    ld, expect = None, None
    for n, s in zip(reversed(shape[:lead]), reversed(st[:lead])):
        if n == 1:
            continue
        if ld is None:
            ld, expect = s, s * n
        elif s != expect:
            return None
        else:
            expect = s * n
    if ld is None:
        return cols
    return ld if ld >= cols else None  # rows that overlap (a broadcast row) are copied


def pow2_at_least(n):
    return 1 << max(0, int(n) - 1).bit_length()

