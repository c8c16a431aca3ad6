"""Scatter-add with a fused activation (message passing): ``out[index[e]] +=
act(values[e])`` over the rows e of ``values``, and its backward, a gather
``dvalues[e] = act'(values[e]) * gout[index[e]]`` (kernels/scatter.cu: one
pass each). On the CPU backends: the activation as a fused function and
NumPy's ``add.at``."""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays as A
from .._arrays import Array
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from .._fuse import functions as F
from .._fuse.api import Fused
from . import _rows

FAMILY = "scatter"
# activation -> its code in kernels/scatter.cu (ScatterAct)
ACTIVATIONS = {None: 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4}
_EXPRS = {(dt, a, d): R.register(FAMILY, R.name_expression(f"scatter_add_{d}", ct, str(code)), f"scatter_add {d}",
                                 dt.name)
          for dt, ct in R.FLOAT_CTYPES.items() for a, code in ACTIVATIONS.items() for d in ("forward", "backward")}
_BLOCK = (32, 8)


def _check_activation(name, activation):
    """TypeError unless ``activation`` is None or a str (a list, say, is not even hashable), ValueError
    unless it is one of ACTIVATIONS."""
    if not (activation is None or isinstance(activation, str)):
        raise TypeError(f"cufuse.{name}: activation must be None or a str (one of {list(ACTIVATIONS)}), got "
                        f"{activation!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"cufuse.{name}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def _check_dim_size(name, dim_size):
    """TypeError unless ``dim_size`` is an int (not a bool, a float or a tensor), ValueError if negative."""
    if isinstance(dim_size, (bool, np.bool_)) or not isinstance(dim_size, (int, np.integer)):
        raise TypeError(f"cufuse.{name}: dim_size must be an int >= 0, got {type(dim_size).__name__}")
    if dim_size < 0:
        raise ValueError(f"cufuse.{name}: dim_size must be an int >= 0, got {dim_size!r}")


_R2, _RPI2, _K0, _K1 = 1 / math.sqrt(2), 1 / math.sqrt(2 * math.pi), math.sqrt(2 / math.pi), 0.044715
# The activation and its derivative times g, as fused functions (the CPU backends' path)
_ACT = {"relu": Fused(lambda v: F.relu(v), name="scatter_relu"),
        "silu": Fused(lambda v: F.silu(v), name="scatter_silu"),
        "gelu": Fused(lambda v: F.gelu(v), name="scatter_gelu"),
        "gelu_tanh": Fused(lambda v: F.gelu(v, approximate="tanh"), name="scatter_gelu_tanh")}
_ACT_GRAD = {
    "relu": Fused(lambda v, g: F.where(v <= 0, 0.0, g), name="scatter_relu_grad"),  # (NaN passes, as torch's)
    "silu": Fused(lambda v, g: g * F.sigmoid(v) * (1 + v * (1 - F.sigmoid(v))), name="scatter_silu_grad"),
    "gelu": Fused(lambda v, g: g * (0.5 * (1 + F.erf(v * _R2)) + v * _RPI2 * F.exp(-0.5 * v * v)),
                  name="scatter_gelu_grad"),
    "gelu_tanh": Fused(lambda v, g: g * (0.5 * (1 + F.tanh(_K0 * (v + _K1 * v * v * v)))
                                         + 0.5 * v * (1 - F.tanh(_K0 * (v + _K1 * v * v * v)) ** 2) * _K0
                                         * (1 + 3 * _K1 * v * v)), name="scatter_gelu_tanh_grad"),
}


def _check(name, values, index, dim_size, activation):
    """(kind, dtype, device, index as int64 of the kind) after the checks."""
    kind = A.array_kind(name, values, "values")
    dt = A.dtype_of(values, kind)
    if dt not in A.FLOAT_DTYPES:
        raise TypeError(f"cufuse.{name}: values is {A.describe(values, kind)}; accepted dtypes are {A.FLOAT_NAMES}")
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        A.check_grad(values, name)
    if len(values.shape) < 1:
        raise ValueError(f"cufuse.{name}: values must have a first (row) dim, got a 0-d array")
    dev = A.device_of(values, kind)
    ik = A.array_kind(name, index, "index")
    if ik != kind:
        raise TypeError(f"cufuse.{name}: index is {A.describe(index, ik)} but values is a {kind}; pass the same "
                        "array kind")
    idt = A.dtype_of(index, ik)
    if idt.kind not in "iu":
        raise TypeError(f"cufuse.{name}: index must hold integers, got dtype {idt}")
    if tuple(index.shape) != (values.shape[0],):
        raise ValueError(f"cufuse.{name}: index must be 1-d with one entry per row of values ({values.shape[0]}), "
                         f"got shape {tuple(index.shape)}")
    if kind in A.GPU_KINDS and A.device_of(index, ik) != dev:
        raise ValueError(f"cufuse.{name}: index is on GPU {A.device_of(index, ik)} but values on GPU {dev}")
    _check_dim_size(name, dim_size)
    _check_activation(name, activation)
    # (a uint64 index beyond int64 would wrap negative in the int64 copy; others (torch's uint64 has no max):
    # that copy's range check)
    if idt == np.uint64 and ik == A.NUMPY and A.count(tuple(index.shape)) and \
            int(index.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"cufuse.{name}: index holds values up to {int(index.max())}; they must lie in "
                         f"[0, dim_size) = [0, {dim_size})")
    with D.on_device(kind, dev):
        idx = D.astype(index, np.dtype(np.int64), kind) if idt != np.int64 else index
        idx = D.contiguous(idx, kind)  # (the kernels read it as one int64 per row)
        if A.count(tuple(index.shape)):  # one synchronization: an index outside [0, dim_size) would write anywhere
            if kind in A.GPU_KINDS and D.capturing(kind, dev):
                raise RuntimeError(f"cufuse.{name}: the index range is checked on the host (a synchronization), "
                                   "which a CUDA graph capture cannot hold; call it outside the capture")
            lo, hi = (int(v) for v in (idx.min(), idx.max()))
            if lo < 0 or hi >= dim_size:
                raise ValueError(f"cufuse.{name}: index holds values in [{lo}, {hi}]; they must lie in "
                                 f"[0, {dim_size})")
    return kind, dt, dev, idx


def _rows_view(x, kind):
    """(x with its trailing dims as contiguous rows, its row stride, columns)."""
    cols = A.count(tuple(x.shape[1:]))
    ld = _rows.row_stride(x, kind, 1)  # (None too for a pointer off its element alignment)
    if ld is None:
        x, ld = D.fresh_copy(x, kind), cols
    return x, ld, cols


def _launch(kind, dev, expr, rows, args):
    fn = R.get_function(FAMILY, expr, dev)
    grid = max(1, min(-(-rows // _BLOCK[1]), R.sm_count(dev) * 8 * 4))
    with R._cp.cuda.Device(dev):
        fn((grid,), _BLOCK, args, stream=D.stream_for(kind, dev))


def _zeros(shape, dt, kind, dev):
    """A zeroed GPU array (called on the array's device: D.on_device)."""
    if kind == A.TORCH_CUDA:
        return A.torch().zeros(shape, dtype=A.numpy_to_torch_dtype(dt), device=D.torch_device(dev))
    return R._cp.zeros(shape, dt)


def _forward(kind, dt, dev, values, idx, dim_size, activation):
    out_shape = (int(dim_size),) + tuple(values.shape[1:])
    cdt = A.compute_dtype(dt)
    if kind not in A.GPU_KINDS:  # (the activation in the compute dtype: 16-bit values are rounded once, in the sum)
        v = _rows.to_numpy(values, kind).astype(cdt)
        v = v if activation is None else _ACT[activation](v)
        acc = np.zeros(out_shape, cdt)
        np.add.at(acc, _rows.to_numpy(idx, kind), v)
        return _rows.from_numpy(acc.astype(dt), kind, None)
    with D.on_device(kind, dev):
        acc = _zeros(out_shape, cdt, kind, dev)
        v, ld, cols = _rows_view(values, kind)
        rows = values.shape[0]
        if rows and cols:
            _launch(kind, dev, _EXPRS[(dt, activation, "forward")], rows,
                    (A.pointer_of(acc, kind), A.pointer_of(v, kind), A.pointer_of(idx, kind), np.int64(rows),
                     np.int64(cols), np.int64(ld)))
        return acc if cdt == dt else D.astype(acc, dt, kind)


def _backward(kind, dt, dev, values, idx, g, activation):
    """d values of the scatter-add's output gradient ``g``."""
    if kind not in A.GPU_KINDS:
        gv = g[idx]
        return gv if activation is None else _ACT_GRAD[activation](values, gv)
    with D.on_device(kind, dev):
        v, ldv, cols = _rows_view(values, kind)
        g, ldg, _ = _rows_view(g, kind)
        idx = D.contiguous(idx, kind)
        rows = values.shape[0]
        dv = D.empty(tuple(values.shape), dt, kind, dev)
        if rows and cols:
            _launch(kind, dev, _EXPRS[(dt, activation, "backward")], rows,
                    (A.pointer_of(dv, kind), A.pointer_of(v, kind), A.pointer_of(g, kind), A.pointer_of(idx, kind),
                     np.int64(rows), np.int64(cols), np.int64(ldv), np.int64(ldg)))
        return dv


def scatter_add(values: Array, index: Array, dim_size: int, *, activation: str | None = None) -> Array:
    """``out[index[e]] += act(values[e])`` for every row ``e`` of ``values``
    (shape ``(rows, *features)``), ``out`` of shape ``(dim_size,
    *features)`` and zeros where no row lands: the aggregation of message
    passing (``values`` the per-edge messages, ``index`` each edge's target
    node), with the messages' activation (None, "relu", "silu", "gelu",
    "gelu_tanh") fused in. ``index`` holds integers in ``[0, dim_size)``
    (checked: one synchronization). 16-bit data accumulate in float32,
    rounded once. On the GPU the sums are atomic adds, so the last bits of
    a node's sum may differ between runs (as ``torch.index_add_``).
    Differentiable with respect to ``values`` for torch tensors: the
    backward gathers the output gradient per row, times act' (one pass)."""
    name = "scatter_add"
    if TO.compiling():  # the registered operator (the index range is checked in it, on real tensors)
        _check_dim_size(name, dim_size)
        _check_activation(name, activation)
        return TO.scatter_add(values, index, dim_size, activation)
    if DK.is_dask(values) or DK.is_dask(index):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported")
    kind = A.array_kind(name, values, "values")
    if kind in (A.TORCH_CPU, A.TORCH_CUDA) and AG.wants_grad((values,)):
        return AG.apply(name, _function, values, index, dim_size, activation)
    kind, dt, dev, idx = _check(name, values, index, dim_size, activation)
    return _forward(kind, dt, dev, values, idx, dim_size, activation)


def forward_op(values, index, dim_size, activation):
    """The registered operator's forward (torch.compile); activation "" is none."""
    act = activation or None
    kind, dt, dev, idx = _check("scatter_add", values, index, dim_size, act)
    return _forward(kind, dt, dev, values, idx, dim_size, act)


def backward_op(g, values, index, activation):
    act = activation or None
    kind = A.TORCH_CUDA if values.is_cuda else A.TORCH_CPU
    idx = index if index.dtype == A.torch().int64 else index.long()
    return _backward(kind, A.dtype_of(values, kind), A.device_of(values, kind), values, idx, g, act)


def _function(torch):
    class ScatterAddFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, values, index, dim_size, activation):
            kind, dt, dev, idx = _check("scatter_add", values, index, dim_size, activation)
            ctx.args = (kind, dt, dev, activation)
            ctx.save_for_backward(values, idx)
            return _forward(kind, dt, dev, values, idx, dim_size, activation)

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, g):
            values, idx = ctx.saved_tensors
            kind, dt, dev, activation = ctx.args
            return _backward(kind, dt, dev, values, idx, g, activation), None, None, None

    return ScatterAddFn
