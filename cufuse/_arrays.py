"""What came in and how to give it back.

Every op validates its operands here, before anything is launched: the array
kind (NumPy, CuPy, torch CPU, torch CUDA), the dtype rules, broadcasting, the
device, and ``out=``. The result is a ``Plan`` that the op's GPU path or its
NumPy fallback carries out.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import numpy as np

try:
    import cupy as _cp
    CupyArray = _cp.ndarray
except Exception:  # pragma: no cover - depends on the machine
    _cp = None

    class CupyArray:  # type: ignore[no-redef]  # placeholder: no instance ever matches
        pass

# Type names of the public API: an array is a numpy.ndarray, a cupy.ndarray or a
# torch.Tensor (every op returns the kind it was given); a scalar a Python or
# NumPy int or float. (Any: CuPy and torch are optional imports.)
Array = Any
Operand = Any   # an Array or a scalar
DType = Any     # a NumPy dtype, its name or type, or a torch dtype

NUMPY = "numpy.ndarray"
CUPY = "cupy.ndarray"
TORCH_CPU = "torch.Tensor (CPU)"
TORCH_CUDA = "torch.Tensor (CUDA)"
GPU_KINDS = (CUPY, TORCH_CUDA)

# bfloat16's NumPy dtype is ml_dtypes.bfloat16 (as CuPy and JAX use it); without
# ml_dtypes installed there is no bfloat16 (BF16 None; torch bfloat16 tensors are
# refused with a message saying so).
try:
    import ml_dtypes as _ml_dtypes
    BF16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except Exception:  # pragma: no cover - depends on the machine
    BF16 = None
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
# The 16-bit floats: stored in 16 bits, computed in float32 and rounded once.
HALVES = (F16,) if BF16 is None else (F16, BF16)
FLOAT_DTYPES = (F16, F32, F64) if BF16 is None else (F16, BF16, F32, F64)
FLOAT_NAMES = ", ".join(d.name for d in FLOAT_DTYPES)
_NONSTANDARD_FLOATS = () if BF16 is None else (BF16,)  # floats whose NumPy kind is not "f"
# NumPy scalar types taken as scalar operands (bfloat16's is not a np.floating)
NP_SCALARS = (np.integer, np.floating) + (() if BF16 is None else (BF16.type,))
NO_BF16 = "bfloat16 needs the ml_dtypes package (pip install ml_dtypes), whose dtype stands for it on the NumPy side"


def is_float(dt) -> bool:
    """A floating dtype (bfloat16 included, whose NumPy kind is "V")."""
    return dt.kind == "f" or dt in _NONSTANDARD_FLOATS


def compute_dtype(dt):
    """The dtype arithmetic is done in: float32 for float16 and bfloat16."""
    return F32 if dt in HALVES else dt


def result_type(*items):
    """numpy.result_type (NumPy 2 rules: Python scalars weak) over dtypes and
    scalars, with bfloat16 promoting as float16 does, except that bfloat16
    with float16 gives float32 (as in torch; ml_dtypes has no common type)."""
    if BF16 is None:
        return np.result_type(*items)
    bf = f16 = False
    mapped = []
    for it in items:
        d = it if isinstance(it, np.dtype) else it.dtype if isinstance(it, np.generic) else None
        if d is not None:
            if d == BF16:
                bf, it = True, F16
            elif d == F16:
                f16, it = True, F16
            else:
                it = d
        mapped.append(it)
    dt = np.result_type(*mapped)
    if bf and dt == F16:
        return F32 if f16 else BF16
    return dt


def promote_types(a, b):
    """numpy.promote_types with bfloat16 as in ``result_type``."""
    return result_type(np.dtype(a), np.dtype(b))


# ----------------------------------------------------------------- torch dtypes
def torch():
    """The torch module if the user has imported it (cufuse never imports it)."""
    return sys.modules.get("torch")


_TORCH_TO_NP: dict = {}
_NP_TO_TORCH: dict = {}


def _torch_tables(t):
    if not _TORCH_TO_NP:
        pairs = [(t.float16, np.float16), (t.float32, np.float32), (t.float64, np.float64),
                 (t.int8, np.int8), (t.uint8, np.uint8), (t.int16, np.int16), (t.int32, np.int32),
                 (t.int64, np.int64), (t.bool, np.bool_), (t.complex64, np.complex64),
                 (t.complex128, np.complex128)]
        if BF16 is not None:
            pairs.append((t.bfloat16, BF16))
        for name in ("uint16", "uint32", "uint64"):  # (torch 2.3 and later)
            if isinstance(getattr(t, name, None), t.dtype):
                pairs.append((getattr(t, name), np.dtype(name)))
        for td, nd in pairs:
            _TORCH_TO_NP[td] = np.dtype(nd)
            _NP_TO_TORCH[np.dtype(nd)] = td
    return _TORCH_TO_NP, _NP_TO_TORCH


def torch_to_numpy_dtype(td):
    t2n, _ = _torch_tables(torch())
    return t2n.get(td)


def numpy_to_torch_dtype(nd):
    _, n2t = _torch_tables(torch())
    return n2t[np.dtype(nd)]


def torch_numpy(t):
    """A CPU tensor's data as a NumPy array, sharing memory (bfloat16 through
    an int16 view, which Tensor.numpy() does not take)."""
    t = t.detach()
    if BF16 is not None and t.dtype == torch().bfloat16:
        return t.view(torch().int16).numpy().view(BF16)
    return t.numpy()


def torch_from_numpy(a):
    """torch.from_numpy, bfloat16 included (sharing memory)."""
    t = torch()
    if BF16 is not None and a.dtype == BF16:
        return t.from_numpy(a.view(np.int16)).view(t.bfloat16)
    return t.from_numpy(a)


def torch_result(a):
    """A NumPy fallback's result as a torch CPU tensor in C order, as the GPU
    kernels write theirs and the registered operators' fakes say (NumPy keeps
    the inputs' layout); 0-d stays 0-d."""
    a = np.asarray(a)
    return torch_from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))


def is_torch_tensor(x) -> bool:
    t = torch()
    return t is not None and isinstance(x, t.Tensor)


# ----------------------------------------------------------------- classifying
class RefusedArray(TypeError):
    """An array cufuse does not compute on (masked, matrix, a torch tensor's negative bit); the message
    says what to pass instead."""


def kind_of(x):
    """The array kind of ``x``, or None for a scalar. TypeError for anything else."""
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray and isinstance(x, np.ma.MaskedArray):
            raise RefusedArray("got a numpy.ma.MaskedArray; its mask would be ignored: pass x.filled(value) "
                            "(or x.data to compute on the masked values too)")
        if type(x) is not np.ndarray and isinstance(x, np.matrix):  # (its * is a matrix product: the fallbacks'
            raise RefusedArray("got a numpy.matrix, whose * is a matrix product; pass np.asarray(m)")  # math differs)
        _whole_strides(x)
        return NUMPY
    t = torch()
    if t is not None and isinstance(x, t.Tensor) and x.is_neg():
        raise RefusedArray("got a torch tensor with its negative bit set (a lazy negation, such as z.conj().imag), "
                        "whose memory holds the values negated; pass x.resolve_neg()")
    if isinstance(x, CupyArray):
        _whole_strides(x)
        return CUPY
    if is_torch_tensor(x):
        if x.is_nested or x.layout is not t.strided:
            raise RefusedArray(_unstrided(x))
        return TORCH_CUDA if x.is_cuda else TORCH_CPU
    if isinstance(x, (bool, np.bool_)):
        raise TypeError("bool scalars are not accepted; pass a float (or int) scalar")
    if isinstance(x, (int, float, *NP_SCALARS)):
        return None
    if isinstance(x, Number):
        raise TypeError(f"{type(x).__name__} scalars are not accepted; pass a float (or int) scalar")
    raise TypeError(f"got {type(x).__module__}.{type(x).__name__}; accepted are numpy.ndarray, "
                    "cupy.ndarray, torch.Tensor and Python/NumPy int or float scalars")


def _unstrided(x):
    """Why a torch tensor without strided memory (nested, sparse) is refused."""
    if x.is_nested:
        return ("got a nested torch tensor; cufuse computes on strided tensors: pad the sequences to one length "
                "(torch.nested.to_padded_tensor), or run each one")
    return f"got a torch tensor of layout {x.layout}; pass x.to_dense()"


_WRAPPED: list = []  # torch's is_functorch_wrapped_tensor, once bound


def functorch_wrapped(t) -> bool:
    """A torch tensor of a torch.func transform (vmap, grad: a wrapper without memory of its own)."""
    if not _WRAPPED:  # (bound once: the attribute chain cost about 1 µs a tensor)
        _WRAPPED.append(torch()._C._functorch.is_functorch_wrapped_tensor)
    return _WRAPPED[0](t)


def _no_meta(name, what, x, kind):
    """TypeError for a meta tensor given to an op (it holds no data), or a tensor of a torch.func
    transform (vmap, grad: a wrapper without memory of its own). Not kind_of's: cufuse.fuse traces its
    graphs under torch.compile on meta tensors."""
    if kind not in (TORCH_CPU, TORCH_CUDA):
        return
    if x.is_meta:
        raise TypeError(f"cufuse.{name}: {what} is a meta tensor, which holds no data")
    if functorch_wrapped(x):
        raise TypeError(f"cufuse.{name}: {what} is a tensor of a torch.func transform (vmap, grad, jacrev, ...), "
                        "which cufuse's ops do not support; call them on plain tensors (torch.autograd for "
                        "gradients)")


def _whole_strides(x):
    """ValueError for a NumPy or CuPy view whose byte strides are not whole
    items (a field of a structured array, a view into bytes): kernels and the
    NumPy paths step in elements."""
    item = x.itemsize
    if item > 1 and x.size and any(s % item for s, n in zip(x.strides, x.shape) if n > 1):  # (others not stepped)
        raise ValueError(f"got a {type(x).__module__.split('.')[0]} array of {x.dtype} with byte strides "
                         f"{tuple(x.strides)}, not multiples of its {item}-byte items (a structured array's "
                         "field?); pass a copy (numpy.ascontiguousarray / cupy.ascontiguousarray)")


def dtype_of(x, kind):
    if kind in (TORCH_CPU, TORCH_CUDA):
        d = torch_to_numpy_dtype(x.dtype)
        return d if d is not None else x.dtype
    d = x.dtype
    return d if d.isnative else d.newbyteorder("=")  # big-endian NumPy input: same values


def device_of(x, kind):
    if kind == CUPY:
        return x.data.device_id
    if kind == TORCH_CUDA:
        return x.get_device()
    return None


def strides_of(x, kind):
    """Strides in elements."""
    if kind in (TORCH_CPU, TORCH_CUDA):
        return tuple(x.stride())
    item = x.itemsize
    return tuple(s // item for s in x.strides)


def pointer_of(x, kind):
    return x.data.ptr if kind == CUPY else x.data_ptr()


def describe(x, kind=None) -> str:
    kind = kind if kind is not None else kind_of(x)
    if kind is None:
        return f"scalar {x!r}"
    dev = device_of(x, kind)
    where = f", GPU {dev}" if dev is not None else ""
    dt = dtype_of(x, kind)
    why = f"; {NO_BF16}" if BF16 is None and "bfloat16" in str(dt) else ""
    return f"{kind} ({dt}, shape {tuple(x.shape)}{where}{why})"


def array_kind(name, x, what):
    """The kind of ``x``, which must be an array (not a scalar or another object)."""
    try:
        kind = kind_of(x)
        why = ""
    except RefusedArray as e:  # its reason says what to pass instead
        kind, why = None, str(e)
    except TypeError:
        kind, why = None, ""
    except ValueError as e:  # (_whole_strides)
        raise ValueError(f"cufuse.{name}: {what}: {e}") from None
    if kind is None:
        raise TypeError(f"cufuse.{name}: {what} must be an array (numpy.ndarray, cupy.ndarray or "
                        f"torch.Tensor), {why or f'got {type(x).__module__}.{type(x).__name__}'}")
    _no_meta(name, what, x, kind)
    return kind


def float_dtype_arg(name, dtype, what="dtype"):
    """A float16/float32/float64 NumPy dtype from a NumPy or torch dtype spelling."""
    t = torch()
    if t is not None and isinstance(dtype, t.dtype):
        d = torch_to_numpy_dtype(dtype)  # None for torch-only dtypes (bfloat16)
    else:
        try:
            d = np.dtype(dtype) if dtype is not None else None
        except TypeError:
            d = None
    if d is None or d not in FLOAT_DTYPES:  # (np.dtype == None is True for float64)
        extra = f" ({NO_BF16})" if BF16 is None and "bfloat16" in str(dtype) else ""
        raise TypeError(f"cufuse.{name}: {what} must be one of {FLOAT_NAMES}, got {dtype!r}{extra}")
    return d


def torch_floats():
    """torch's float dtypes that cufuse takes, for checks that torch.compile
    traces (no NumPy dtypes, which torch 2.11's Dynamo cannot hash)."""
    t = torch()
    return (t.float16, t.bfloat16, t.float32, t.float64)


def torch_float_dtype_arg(name, dtype):
    """float_dtype_arg as a torch dtype. A torch dtype is checked without NumPy, so torch.compile
    (whose older releases cannot hash NumPy dtypes) traces it."""
    t = torch()
    if isinstance(dtype, t.dtype) and dtype in torch_floats():
        if dtype is t.bfloat16 and BF16 is None:
            float_dtype_arg(name, dtype)  # raises, naming ml_dtypes
        return dtype
    return numpy_to_torch_dtype(float_dtype_arg(name, dtype))


def check_grad(x, name):
    t = torch()
    if x.requires_grad and t.is_grad_enabled():
        raise NotImplementedError(
            f"cufuse.{name}: a tensor that requires grad was given and cufuse.{name} has no autograd yet "
            "(add_relu, mul_tanh, add_mul_exp, fma, bias_gelu, gelu_dropout, layer_norm, layer_norm_relu, "
            "rms_norm, add_rms_norm, add_layer_norm, softmax, log_softmax, sum_squared, mean_abs, cross_entropy, "
            "rope, scatter_add, fake_quantize_int8 and cufuse.fuse functions have); call it "
            "under torch.no_grad() or pass tensor.detach()")


# ----------------------------------------------------------------------- plans
@dataclass
class Plan:
    name: str
    kind: str                  # one of the kinds above
    dtype: np.dtype            # result dtype
    shape: tuple               # broadcast result shape
    operands: list             # per operand: the array, or None for a scalar
    scalars: list              # per operand: the scalar value, or None for an array
    device: int | None = None  # GPU ordinal for GPU kinds
    out: object = None
    size: int = field(default=0)
    out_dtype: np.dtype | None = None  # result dtype when it differs from the computed one (e.g. int8)


def dtype_names(dtypes) -> str:
    """"float16, float32" for an error message (built only when one is raised)."""
    return ", ".join(np.dtype(d).name for d in dtypes)


def count(shape) -> int:
    """Elements of ``shape`` (1 for ()): math.prod, a tenth of np.prod's host time."""
    return int(math.prod(shape))


def plan_elementwise(name: str, args, out, accepted=FLOAT_DTYPES, out_dtype=None) -> Plan:
    """Validate the operands of an elementwise op; raises before any launch.

    ``accepted``: the array dtypes taken; ``out_dtype``: the result dtype
    when it is not the promoted operand dtype."""
    kinds, dtypes, arrays = [], [], []
    for i, x in enumerate(args):
        try:
            k = kind_of(x)
        except TypeError as e:
            raise TypeError(f"cufuse.{name}: operand {i + 1}: {e}") from None
        except ValueError as e:  # (_whole_strides)
            raise ValueError(f"cufuse.{name}: operand {i + 1}: {e}") from None
        _no_meta(name, f"operand {i + 1}", x, k)
        kinds.append(k)
        if k is not None:
            d = dtype_of(x, k)
            if d not in accepted:
                raise TypeError(f"cufuse.{name}: operand {i + 1} is {describe(x, k)}; "
                                f"accepted dtypes are {dtype_names(accepted)}")
            if k in (TORCH_CPU, TORCH_CUDA):
                check_grad(x, name)
            dtypes.append(d)
            arrays.append((i, x, k))
    if not arrays:
        raise TypeError(f"cufuse.{name}: at least one operand must be an array "
                        "(numpy.ndarray, cupy.ndarray or torch.Tensor); got only scalars")
    kind = arrays[0][2]
    for i, x, k in arrays[1:]:
        if k != kind:
            raise TypeError(f"cufuse.{name}: mixed array kinds: operand {arrays[0][0] + 1} is "
                            f"{describe(arrays[0][1], kind)} and operand {i + 1} is {describe(x, k)}; "
                            "convert one (cufuse.from_torch / cufuse.to_torch, cupy.asarray, .get())")
    scalars = [None if k is not None else x for x, k in zip(args, kinds)]
    for i, s in enumerate(scalars):
        if s is not None:
            check_scalar_fits(name, i, s)
    try:
        if kind in (TORCH_CPU, TORCH_CUDA):
            # torch's rules: numbers (Python or NumPy scalars) and zero-dim tensors
            # do not widen the tensors' float type (float32 * numpy.float64(2) is float32)
            dims = [d for (_, x, _), d in zip(arrays, dtypes) if x.dim()]
            dtype = result_type(*(dims or dtypes))
        else:
            dtype = result_type(*dtypes, *[s for s in scalars if s is not None])
    except (OverflowError, TypeError) as e:
        raise TypeError(f"cufuse.{name}: cannot combine the operands' types ({e})") from None
    if dtype not in accepted:  # e.g. an int64 NumPy scalar that promotes float16 to float64 stays valid
        raise TypeError(f"cufuse.{name}: operands promote to {dtype}; accepted dtypes are {dtype_names(accepted)}")
    try:
        shape = np.broadcast_shapes(*[tuple(x.shape) for _, x, _ in arrays])
    except ValueError:
        shapes = ", ".join(str(tuple(x.shape)) for _, x, _ in arrays)
        raise ValueError(f"cufuse.{name}: operand shapes {shapes} do not broadcast together") from None

    device = None
    if kind in GPU_KINDS:
        device = device_of(arrays[0][1], kind)
        for i, x, k in arrays[1:]:
            d = device_of(x, k)
            if d != device:
                raise ValueError(f"cufuse.{name}: operands on different GPUs: operand {arrays[0][0] + 1} "
                                 f"on GPU {device}, operand {i + 1} on GPU {d}")

    out_dtype = np.dtype(out_dtype) if out_dtype is not None else dtype
    if out is not None:
        check_out(name, out, kind, out_dtype, shape, device)
    plan = Plan(name, kind, dtype, shape, [x if k is not None else None for x, k in zip(args, kinds)],
                scalars, device, out, out_dtype=out_dtype)
    plan.size = count(shape)
    return plan


def check_scalar_fits(name, i, s):
    """OverflowError where scalar operand ``i`` (from 0) does not convert to a float (a huge int)."""
    if not _fits_a_float(s):
        raise OverflowError(f"cufuse.{name}: operand {i + 1} is an int of {int(s).bit_length()} bits, "
                            "beyond the largest float (2**1024); NumPy raises too")


def _fits_a_float(s) -> bool:
    """A scalar converts to a Python float (huge Python ints do not)."""
    try:
        float(s)
    except OverflowError:
        return False
    return True


def check_out(name, out, kind, dtype, shape, device):
    try:
        ok, why = kind_of(out), ""
    except RefusedArray as e:  # its reason says what to pass instead
        ok, why = None, str(e)
    except TypeError:
        ok, why = None, ""
    except ValueError as e:  # (_whole_strides)
        raise ValueError(f"cufuse.{name}: out: {e}") from None
    if ok is None:
        raise TypeError(f"cufuse.{name}: out must be a {kind}; "
                        f"{why or f'got {type(out).__module__}.{type(out).__name__}'}")
    if ok != kind:
        raise TypeError(f"cufuse.{name}: out is {describe(out, ok)} but the operands are {kind}")
    od = dtype_of(out, ok)
    if od != dtype:
        raise TypeError(f"cufuse.{name}: out has dtype {od}; the result dtype is {dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"cufuse.{name}: out has shape {tuple(out.shape)}; the result shape is {tuple(shape)}")
    if kind in GPU_KINDS and device_of(out, ok) != device:
        raise ValueError(f"cufuse.{name}: out is on GPU {device_of(out, ok)} but the operands are on GPU {device}")
    if kind in (TORCH_CPU, TORCH_CUDA) and out.requires_grad and torch().is_grad_enabled():
        raise RuntimeError(f"cufuse.{name}: out requires grad; a result written into out= is not recorded for "
                           "autograd (as with torch's out= functions): pass out.detach(), or call under "
                           "torch.no_grad()")
    if kind == NUMPY and not out.flags.writeable:
        raise ValueError(f"cufuse.{name}: out is a read-only numpy array")
    st = strides_of(out, ok)
    if 0 not in tuple(out.shape) and any(s == 0 and n > 1 for s, n in zip(st, out.shape)):
        raise ValueError(f"cufuse.{name}: out is a broadcast view (a stride is 0); it must own each element")


# ------------------------------------------------------------------- layouts
def broadcast_strides(shape, strides, out_shape):
    """Element strides of an operand broadcast to ``out_shape`` (0 on broadcast dims)."""
    pad = len(out_shape) - len(shape)
    res = [0] * pad
    for n, s, on in zip(shape, strides, out_shape[pad:]):
        res.append(0 if (n == 1 and on != 1) else s)
    return res


def collapse(shape, strides_list):
    """Drop size-1 dims and merge dims that are contiguous for every operand.

    Returns (shape, strides_list), innermost dim first.
    """
    dims = [(n, [st[d] for st in strides_list]) for d, n in enumerate(shape) if n != 1]
    dims.reverse()  # innermost first
    merged: list = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            # previous (inner) dim pn with strides pst; this outer dim n with st
            if all(s == ps * pn for s, ps in zip(st, pst)):
                merged[-1] = (pn * n, pst)
                continue
        merged.append((n, st))
    if not merged:
        merged = [(1, [0] * len(strides_list))]
    shp = [n for n, _ in merged]
    sts = [[st[k] for _, st in merged] for k in range(len(strides_list))]
    return shp, sts


def c_strides(shape) -> list:
    """Element strides of a C-contiguous array of ``shape``."""
    res, acc = [], 1
    for n in reversed(shape):
        res.append(acc)
        acc *= n
    return res[::-1]


def is_c_contiguous(shape, strides) -> bool:
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def extent(ptr, shape, strides, itemsize):
    """[lo, hi) bytes touched by an array view."""
    lo = hi = ptr
    for n, s in zip(shape, strides):
        if n == 0:
            return ptr, ptr
        span = (n - 1) * s * itemsize
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + itemsize


def fast_div_magic(d: int) -> int:
    """Magic multiplier (low 32 bits) and shift (high 32 bits) with which the
    kernels divide n < 2**31 by d < 2**31 as a multiply-high (kernels/common.cuh
    fast_div); 0 for other divisors, which the kernels divide directly."""
    if not 1 <= d < 2**31:
        return 0
    shift = (d - 1).bit_length()
    m = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return m | (shift << 32)
