"""Dask arrays: the ops that take them (docs/dask.md), on arrays whose chunks are NumPy or CuPy arrays.

A call with a Dask array returns a Dask array (lazy, as Dask's own
operations): elementwise ops, quantize and fused functions run chunk by
chunk (broadcasting and chunk alignment as ``dask.array`` does), reductions
through Dask's reduction tree (chunk partials in float64, combined, rounded
once), row ops (norms, softmax, a fused function's trailing reduction) on
each chunk when the rows lie within one chunk, with a clear error otherwise.
Each chunk runs where its data is: the NumPy path for NumPy chunks, the GPU
holding a CuPy chunk for CuPy chunks.

Dask is not imported unless a Dask array is given (the ``dask`` extra).
"""
from __future__ import annotations

import math

import numpy as np


def is_dask(x) -> bool:
    t = type(x)
    return t.__name__ == "Array" and t.__module__.startswith("dask.array")


def any_dask(args) -> bool:
    return any(is_dask(a) for a in args)


def _reject(name, what):
    raise TypeError(f"cufuse.{name}: {what} is not supported for Dask arrays")


def _no_out(name, out):
    if out is not None:
        _reject(name, "out=")


def _concrete(name, what, v):
    if is_dask(v):
        raise TypeError(f"cufuse.{name}: {what} is a Dask array; pass a NumPy or CuPy array (x.compute())")
    return v


def _whole(name, x, axes, why):
    """Rows must lie within one chunk along ``axes``."""
    for a in axes:
        if len(x.chunks[a]) > 1:
            raise ValueError(f"cufuse.{name}: {why} axis {a} of the Dask array is split into {len(x.chunks[a])} "
                             f"chunks; rows must lie within one chunk: x.rechunk({{{a}: -1}})")


# ------------------------------------------------------------------ elementwise
def elementwise(name, fn, args, out=None, dtype=None):
    """``fn`` (a cufuse call on concrete arrays) chunk by chunk, with NumPy's
    broadcasting; scalars are passed through. ``fn`` runs first on one-element
    NumPy arrays of the Dask arrays' dtypes: its errors (dtypes, scalar kinds)
    raise here, and its result's dtype is the result's (Dask's own probe of
    ``fn`` turns an error into a result of NotImplemented)."""
    _no_out(name, out)
    for a in args:
        if not is_dask(a) and hasattr(a, "shape") and hasattr(a, "dtype") and getattr(a, "ndim", 0) > 0:
            raise TypeError(f"cufuse.{name}: Dask arrays mixed with another array ({type(a).__module__}."
                            f"{type(a).__name__}); pass Dask arrays and scalars only (da.from_array(...))")
    probe = fn(*[np.ones((1,) * a.ndim, dtype=a.dtype) if is_dask(a) else a for a in args])
    from dask.array.core import elemwise
    return elemwise(fn, *args, dtype=dtype if dtype is not None else probe.dtype)


# ------------------------------------------------------------------ row ops
def _probe(fn, x, shape, *args):
    """``fn(ones, *args)``: ones of x's dtype and ``shape``, of its chunks' kind (NumPy, or CuPy on the
    current GPU), so that the op's checks raise before the graph is built (at compute they named a chunk);
    its errors say which Dask array they are about."""
    meta = getattr(x, "_meta", None)
    if meta is not None and type(meta).__module__.startswith("cupy"):
        import cupy as cp
        ones = cp.ones(shape, dtype=x.dtype)
    else:
        ones = np.ones(shape, dtype=x.dtype)
    try:
        return fn(ones, *args)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} (checked on a block of ones of the Dask array's dtype; the array: {x.dtype}, shape "
                      f"{x.shape})") from None


def rows(name, fn, x, axes, dtype, out=None):
    """``fn`` on each chunk; the rows (``axes``) must be one chunk each. ``fn`` runs first on one row of
    ones (its dtype and weights checked: an int array gave a lazy result of its dtype, and the error at
    compute), whose result's dtype is the lazy result's."""
    _no_out(name, out)
    nd = x.ndim
    rows_axes = [a % nd for a in axes]
    _whole(name, x, rows_axes, "the normalized / reduced")
    if not any(math.isnan(x.shape[a]) for a in rows_axes):
        dtype = _probe(fn, x, tuple(x.shape[i] if i in rows_axes else 1 for i in range(nd))).dtype
    return x.map_blocks(fn, dtype=dtype)


# ---------------------------------------------------------------- reductions
def reduction(name, x, axis, keepdims, dtype, mean, chunk_fn, out=None):
    """A reduction through Dask's tree: ``chunk_fn(block, axis, keepdims=True,
    dtype=float64)`` gives a chunk's partial (a sum, or for ``mean`` a mean,
    weighted back to a sum by the chunk's count); partials are summed and
    the result (divided by the count for ``mean``) rounded once to ``dtype``."""
    _no_out(name, out)
    import dask.array as da
    nd = x.ndim
    axes = tuple(range(nd)) if axis is None else tuple(a % nd for a in ((axis,) if np.isscalar(axis) else axis))
    total = math.prod(x.shape[a] for a in axes)
    if mean and math.isnan(total):  # (a boolean mask's result: its chunk sizes are known after a compute)
        raise ValueError(f"cufuse.{name}: a mean over axes of unknown length (a Dask array of shape {x.shape}): "
                         "call x.compute_chunk_sizes() first")
    _probe(chunk_fn, x, (1,) * nd, axes, True, np.float64)

    def chunk(b, axis, keepdims):
        n = math.prod(b.shape[a] for a in axis)
        if n == 0:  # an empty chunk adds nothing (its mean would be NaN)
            shape = tuple(1 if i in axis else s for i, s in enumerate(b.shape))
            if isinstance(b, np.ndarray):
                return np.zeros(shape)
            import cupy as cp
            with b.device:
                return cp.zeros(shape)
        p = chunk_fn(b, axis, True, np.float64)
        return p * n if mean else p

    def combine(p, axis, keepdims):  # a level of the tree: partial sums stay sums
        return p.sum(axis=axis, keepdims=keepdims)

    def aggregate(p, axis, keepdims):
        s = p.sum(axis=axis, keepdims=keepdims)
        if mean:
            s = s / total if total else s * np.nan
        return s.astype(dtype)

    return da.reduction(x, chunk, aggregate, combine=combine, axis=axes, keepdims=keepdims, dtype=dtype,
                        concatenate=True)


# ---------------------------------------------------------------- per channel
def per_channel(name, fn, x, axis, params, dtype, out=None):
    """``fn(block, *block_params)``: per-channel parameters (1-D NumPy or CuPy
    arrays along ``axis``) sliced to each chunk's channels."""
    _no_out(name, out)
    params = [_concrete(name, "a per-channel parameter", p) for p in params]
    n = x.shape[axis]
    for p in params:  # (each chunk takes its slice: a wrong length would pass, or fail inside a chunk)
        shape = tuple(getattr(p, "shape", ()))
        if shape and shape != (n,):
            raise ValueError(f"cufuse.{name}: a per-channel parameter has shape {shape}; axis {axis} of the data "
                             f"has length {n}, so ({n},) is needed")

    def block(b, block_info=None):
        lo, hi = block_info[0]["array-location"][axis]
        return fn(b, *[p[lo:hi] if getattr(p, "ndim", 0) == 1 else p for p in params])

    return x.map_blocks(block, dtype=dtype)
