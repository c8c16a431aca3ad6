"""int8 quantization and dequantization, per tensor or per channel.

Functors ``Quantize``/``QuantizeCh``/``Dequantize``/``DequantizeCh`` in
kernels/elementwise.cu, on the elementwise driver. Arithmetic is float32
(float64 for float64 data), with a true division, so results equal NumPy's
``np.clip(np.rint(x / scale + zero_point), -128, 127)`` in that precision bit
for bit; NaN quantizes to 0, +inf to 127, -inf to -128.
"""
from __future__ import annotations

import math
import reprlib
from numbers import Real

import numpy as np

from .. import _arrays as A
from .._arrays import Array, DType, Operand
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from .._fuse import functions as _F
from .._fuse.api import Fused
from .elementwise import ElementwiseOp, pack_width

_F16, _F32, _F64, _I8 = A.F16, A.F32, A.F64, np.dtype(np.int8)
_FLOATS = A.FLOAT_DTYPES
# Launch shapes below were measured for float16; bfloat16 (the same bytes per
# element, the same float32 arithmetic) takes float16's.
_CHANNEL_PARAMS = ("unsigned long long", "unsigned long long", "long long", "unsigned long long",
                   "long long", "unsigned long long")


def _real(dt):
    """Arithmetic precision for data of dtype ``dt``: float64 stays, the rest is float32."""
    return _F64 if dt == _F64 else _F32


def _rname(dt):
    return "double" if dt == _F64 else "float"


def _quantize_np(x, scale, zero_point):
    # in place on the one new array where the dtypes allow it (fresh temporaries cost page faults)
    v = np.asarray(x / scale)
    if np.ndim(zero_point) == 0 and zero_point == 0 and v.flags.writeable:
        pass  # (x / s + 0 is x / s, -0.0 included after rint and the int8 cast)
    elif np.result_type(v, zero_point) == v.dtype and v.flags.writeable:
        v += zero_point
    else:
        v = np.asarray(v + zero_point)
    np.rint(v, out=v)
    np.clip(v, -128, 127, out=v)
    np.copyto(v, 0, where=np.isnan(v))
    return v.astype(np.int8)


def _dequantize_np(q, scale, zero_point, real):
    v = q.astype(real)
    if np.result_type(v, zero_point, scale) == v.dtype:
        if np.ndim(zero_point) or zero_point != 0:
            v -= zero_point
        v *= scale
        return v
    return (v - zero_point) * scale


# Packs per thread of each kernel (ElementwiseOp's packs_per_thread), where
# more than one was faster. Quantize on the last axis (ACROSS) sets up each
# thread's channels once for all its packs (kernels/quantize.cu), so its grid
# is one wave (ElementwiseOp's one_wave), each thread looping over packs one
# grid stride apart (bench/NOTES.md, "Figures from code comments").
# The per-tensor quantize ops share one fast path: which of them a call takes
# depends on its dtype (in the signature) and on its scale and zero point
# (reciprocal_ok, in the key's extra part).
_QUANT_FAST = D.FastPath("quantize_int8")
_quant = ElementwiseOp("quantize_int8", lambda i, o: f"Quantize<{_rname(i)}, {'false' if i == _F64 else 'true'}>", 1,
                       _quantize_np, signatures=[(d, _I8) for d in _FLOATS], params=("double", "double"),
                       family="quantize", packs_per_thread=lambda i, o: 4 if i in A.HALVES else 1, fast=_QUANT_FAST)
# float scales outside reciprocal_ok's range divide per element (kernels/quantize.cu: Quantize)
_quant_div = ElementwiseOp("quantize_int8", "Quantize<float, false>", 1, _quantize_np,
                           signatures=[(d, _I8) for d in _FLOATS if d != _F64], params=("double", "double"),
                           family="quantize:div",
                           fast=_QUANT_FAST)


def _reciprocal_ok(s, z):
    """kernels/common.cuh math::reciprocal_ok of the float32 scale and zero
    point the kernel uses: a scale within [2**-60, 2**60] and |zero point| <=
    2**20, where the quotient as a corrected product with the reciprocal gives
    the same int8 codes as a division."""
    return 2.0 ** -60 <= np.float32(s) <= 2.0 ** 60 and abs(np.float32(z)) <= 2.0 ** 20


def _quant_per_tensor(in_dt, s, z):
    return _quant if in_dt == _F64 or _reciprocal_ok(s, z) else _quant_div


# Per channel: one op per walk (kernels/quantize.cu ChannelWalk: how a pack of
# V elements meets the channels), each a family of its own, compiled by the
# first call that needs it; Wide ones index beyond 2**31 elements.
IN_CHANNEL, ACROSS, ANY = 0, 1, 2
_WALKS = ((IN_CHANNEL, False), (ACROSS, False), (ANY, False), (ANY, True))


def _channel_ops(name, functor, real_of, numpy_impl, signatures, pack_bytes=None, ppt=None, one_wave=None):
    """{(walk, wide): ElementwiseOp} of the functor template ``functor<R, Walk,
    Wide[, PackBytes]>`` (PackBytes when ``pack_bytes(walk, in, out)`` is
    given); ACROSS reads parameters in packs of 4, so it has only the
    signatures whose packs are a multiple of 4 elements. ``ppt(walk, in,
    out)``: packs per thread (default 1); ``one_wave(walk, in, out)``:
    ElementwiseOp's one_wave (default False)."""
    ops = {}
    for walk, wide in _WALKS:
        pbw = (lambda i, o, w=walk: pack_bytes(w, i, o)) if pack_bytes else None

        def fname(i, o, walk=walk, wide=wide, pbw=pbw):
            pb = f", {pbw(i, o)}" if pbw else ""
            return f"{functor}<{_rname(real_of(i, o))}, {walk}, {'true' if wide else 'false'}{pb}>"

        sigs = [sg for sg in signatures if walk != ACROSS or pack_width(*sg, pbw) % 4 == 0]
        ops[walk, wide] = ElementwiseOp(name, fname, 1, numpy_impl,
                                        signatures=sigs, params=_CHANNEL_PARAMS, indexed=True,
                                        family=f"quantize:ch{'wide' if wide else walk}", pack_bytes=pbw,
                                        packs_per_thread=(lambda i, o, w=walk: ppt(w, i, o)) if ppt else 1,
                                        one_wave=(lambda i, o, w=walk: one_wave(w, i, o)) if one_wave else False)
    return ops


def _quant_pack_bytes(walk, in_dt, out_dt):
    """Codes per pack of the per-channel quantize (kernels/quantize.cu
    QuantizeCh's PackBytes): 8 for float32 data and for float16 on the last
    axis (ACROSS), 16 otherwise: the faster of the two for each (bench/NOTES.md,
    "Figures from code comments")."""
    return 8 if in_dt == _F32 or (walk == ACROSS and in_dt in A.HALVES) else 16


def _walk(n, inner, nch, width, ptrs, itemsize):
    """(walk, wide) for ``n`` elements, ``inner`` elements per channel step,
    ``nch`` channels, packs of ``width(walk)`` elements (an int: every walk's)
    and parameters at ``ptrs`` (``itemsize`` bytes each): the conditions of
    kernels/quantize.cu Channels."""
    if not callable(width):
        width = lambda walk, v=width: v  # noqa: E731
    if n >= 2**31:
        return ANY, True
    if inner % width(IN_CHANNEL) == 0:
        return IN_CHANNEL, False
    v = width(ACROSS)
    if inner == 1 and nch % v == 0 and v % 4 == 0 and all(p % (4 * itemsize) == 0 for p in ptrs):
        return ACROSS, False
    return ANY, False


_quant_ch = _channel_ops("quantize_int8", "QuantizeCh", lambda i, o: i, _quantize_np, [(d, _I8) for d in _FLOATS],
                         _quant_pack_bytes,
                         lambda w, i, o: 4 if w == IN_CHANNEL and i in A.HALVES else 1,
                         lambda w, i, o: w == ACROSS and i != _F64)
_dequant = ElementwiseOp("dequantize_int8", lambda i, o: f"Dequantize<{_rname(o)}>", 1, _dequantize_np,
                         signatures=[(_I8, d) for d in _FLOATS], params=("double", "double"), family="quantize",
                         packs_per_thread=lambda i, o: 2 if o == _F32 else 1)
_dequant_ch = _channel_ops("dequantize_int8", "DequantizeCh", lambda i, o: o, _dequantize_np,
                           [(_I8, d) for d in _FLOATS],
                           ppt=lambda w, i, o: 2 if w in (IN_CHANNEL, ACROSS) and o != _F64 else 1)


def _scalar_param(name, what, v, positive, real, axis=None):
    """A scalar parameter as a float, checked in ``real`` (the dtype the kernel
    computes in): 1e-46 is a positive float64 but 0 in float32. ``axis``: the
    per-channel axis, where one value stands for every channel."""
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iuf":  # a 0-d array: its number
        v = v.item()
    elif A.is_torch_tensor(v) and v.dim() == 0 and not v.is_cuda and not v.dtype.is_complex and \
            v.dtype != A.torch().bool:  # (a CUDA one would be read by waiting for the GPU: refused below)
        _no_param_grad(name, what, v)
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (Real, np.integer, np.floating)):
        zero_d = len(getattr(v, "shape", (1,))) == 0
        if axis is not None:
            raise TypeError(f"cufuse.{name}: {what} must be a real number (one for every channel) or an array of "
                            f"one per channel along axis {axis}, got {type(v).__module__}.{type(v).__name__}")
        raise TypeError(f"cufuse.{name}: {what} must be a real scalar when axis is None, got "
                        f"{type(v).__module__}.{type(v).__name__}" +
                        (f" ({A.describe(v, A.kind_of(v))}: pass a Python number)" if zero_d else
                         "; pass axis= for per-channel parameters"))
    need = "finite and > 0" if positive else "finite"
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"cufuse.{name}: {what} must be {need}, got an int of {int(v).bit_length()} bits") from None
    if not math.isfinite(f) or (positive and f <= 0):
        raise ValueError(f"cufuse.{name}: {what} must be {need}, got {v!r}")
    with np.errstate(over="ignore", under="ignore"):
        r = real.type(f)
    if not np.isfinite(r) or (positive and r <= 0):
        raise ValueError(f"cufuse.{name}: {what} {v!r} is {r} in {real.name}, the type the data is computed in; "
                         f"it must be {need} there")
    return f


def _no_param_grad(name, what, t):
    """NotImplementedError for a torch quantization parameter that requires grad (it gets none)."""
    if t.requires_grad and A.torch().is_grad_enabled():
        raise NotImplementedError(f"cufuse.{name}: {what} requires grad; the quantization parameters get no "
                                  f"gradient (pass {what}.detach(), or use torch's fake quantization)")


def _channel_param(name, what, v, x, kind, axis, real, positive):
    """A per-channel parameter as a 1-D array of ``real``: NumPy, or the data's own kind."""
    nch = x.shape[axis]
    if not isinstance(v, (np.ndarray, A.CupyArray, list, tuple)) and not A.is_torch_tensor(v):
        if positive:  # a scale: one per channel (a zero point may be one for every channel)
            raise TypeError(f"cufuse.{name}: {what} is a scalar ({type(v).__name__}) but axis={axis} asks for "
                            f"one {what} per channel: pass {nch} values (shape ({nch},)), or axis=None for one "
                            f"{what} for the whole tensor")
        f = _scalar_param(name, what, v, positive, real, axis)  # one value for every channel
        return np.full(nch, f, dtype=real)
    try:
        vk = A.kind_of(v) if not isinstance(v, (list, tuple)) else A.NUMPY
    except A.RefusedArray as e:  # (masked, matrix, a negative bit: its reason says what to pass)
        raise A.RefusedArray(f"cufuse.{name}: {what} is refused: {e}") from None
    arr = _param_list(name, what, v, nch) if isinstance(v, (list, tuple)) else v  # a list of numbers
    if vk not in (A.NUMPY, kind):
        raise TypeError(f"cufuse.{name}: {what} is {A.describe(arr, vk)}; pass a NumPy array or the same "
                        f"array kind as the data ({kind})")
    dt = A.dtype_of(arr, vk)
    if vk in (A.TORCH_CPU, A.TORCH_CUDA):
        _no_param_grad(name, what, arr)
    if dt not in _FLOATS and not (not positive and dt.kind in "iu"):  # (zero points: torch's are int64 tensors)
        raise TypeError(f"cufuse.{name}: {what} has dtype {dt}; accepted dtypes are {A.FLOAT_NAMES}"
                        + ("" if positive else " and the integer ones"))
    if tuple(arr.shape) != (nch,):
        raise ValueError(f"cufuse.{name}: {what} has shape {tuple(arr.shape)}; axis {axis} of the data "
                         f"has length {nch}, so ({nch},) is needed")
    if vk in (A.NUMPY, A.TORCH_CPU):  # (GPU arrays are not read: that would wait for the device; docs/ops.md)
        chk = np.asarray(arr if vk == A.NUMPY else arr.detach().double().numpy(), dtype=np.float64)
        with np.errstate(over="ignore", under="ignore"):
            chk = chk.astype(real)  # checked where the data is computed: 1e-46 is 0 in float32
        if positive and not np.all(chk > 0) or not np.all(np.isfinite(chk)):
            need = "finite and > 0" if positive else "finite"
            raise ValueError(f"cufuse.{name}: every {what} must be {need} (in {real.name}, the type the data is "
                             "computed in)")
        if vk == A.NUMPY:
            return np.ascontiguousarray(arr, dtype=real)  # the kernels index scale[c]: no strides
        return arr.to(A.numpy_to_torch_dtype(real)).contiguous()
    dev = A.device_of(arr, vk)
    if dev != A.device_of(x, kind):  # the kernel would read a pointer of another device
        raise ValueError(f"cufuse.{name}: {what} is on GPU {dev} but the data is on GPU "
                         f"{A.device_of(x, kind)}; per-channel parameters must be on the data's GPU")
    if vk == A.CUPY:
        with R._cp.cuda.Device(dev):
            return _cupy_cast(arr, real) if dt in _FLOATS else arr.astype(real)
    return arr.to(A.numpy_to_torch_dtype(real)).contiguous()  # torch: the data's device (checked above)


def _param_list(name, what, v, nch):
    """A list or tuple of per-channel parameters as float64 NumPy (its checks are the caller's)."""
    if any(isinstance(e, (bool, np.bool_)) for e in v):
        raise TypeError(f"cufuse.{name}: {what} must hold real numbers, got a bool")
    try:
        return np.asarray(v, dtype=np.float64)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"cufuse.{name}: every {what} must be finite; an int is beyond any float") from None
    except (TypeError, ValueError):  # (a str, a complex, a nested list)
        raise TypeError(f"cufuse.{name}: {what} must be {nch} real numbers (one per channel), got "
                        f"{reprlib.repr(v)}") from None


def _cupy_cast(arr, real):
    """A CuPy float array as a contiguous array of ``real`` (the kernels index scale[c]: no strides),
    rounded as NumPy rounds. CuPy compiles its kernels with -ftz, so its float32 conversions flush a
    subnormal to zero: a float32 scale of 1e-40 became 0 for float64 data, a float64 one of 1e-40 0
    for float32 data. Subnormal float32 values are built here from their bits, in float64 and uint32
    arithmetic, which -ftz leaves alone."""
    cp = R._cp
    res = cp.ascontiguousarray(arr, dtype=real)
    src = np.dtype(arr.dtype)
    if src == _F32 and real == _F64:
        bits = cp.ascontiguousarray(arr).view(cp.uint32)
        mag = (bits & 0x007FFFFF).astype(_F64) * 2.0**-149  # what the bits are when the exponent is 0
        return cp.where((bits & 0x7F800000) == 0, cp.where(bits >> 31 != 0, -mag, mag), res)
    if src == _F64 and real == _F32:
        a = cp.abs(arr)
        m = cp.rint(a * 2.0**149).astype(cp.uint32) | (cp.signbit(arr).astype(cp.uint32) << 31)
        return cp.where(a < 2.0**-126, m, res.view(cp.uint32)).view(_F32)  # (2**23: the least normal)
    return res


def _on_device(v, given, kind, dev):
    """(array, address) of a per-channel parameter (``_channel_param``'s
    result) on the data's device. A NumPy array (one scalar for every channel
    too) is copied once per content and kept (``_driver.uploaded``), so a
    repeated call copies nothing and can be captured in a CUDA graph; a device
    array made here (a cast or contiguous copy) is kept by a graph being captured."""
    if isinstance(v, np.ndarray):
        what = "a per-channel scale or zero point given as a NumPy array (or one scalar zero point)"
        c = D.uploaded(v, kind, dev, what)
        return c, c.data.ptr
    if v is not given and D.capturing(kind, dev):
        D.keep_captured(v)
    return v, A.pointer_of(v, kind)


_CHOICE: dict = {}  # (scale, zero point) valid in float32 and float64 -> reciprocal_ok of them


def _per_tensor_fast(fast, x, scale, zero_point, out, out_dtype):
    """A per-tensor call with float parameters seen before (valid, their
    choice of op known) whose signature has a recipe: its result, else None."""
    if type(zero_point) is int and -2**53 <= zero_point <= 2**53:  # exactly a float
        zero_point = float(zero_point)
    if type(scale) is not float or type(zero_point) is not float:
        return None
    ok = _CHOICE.get((scale, zero_point))
    if ok is None:
        return None
    s = D.signature((x, out))
    if s is None:
        return None
    key, ptrs = s
    res = fast.run((key, (out_dtype, ok)), ptrs, len(ptrs) - (out is not None), None if out is None else (out,),
                   (scale, zero_point), x)
    return None if res is None else res[0]


def _channel_axis(name, axis, ndim):
    """The per-channel ``axis`` (an int) in [0, ndim)."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"cufuse.{name}: axis must be an int or None, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"cufuse.{name}: axis {axis} is out of range for data with {ndim} dimensions")
    return int(axis) % ndim


def _run(name, ops, x, scale, zero_point, axis, out, out_dtype):
    """Shared driver of quantize/dequantize: validates the parameters, picks
    the per-tensor op (``ops[0](in_dtype, scale, zero_point)``) or the
    per-channel one (``ops[1]``) and launches it (or the fallback)."""
    per_tensor, per_channel = ops
    if DK.is_dask(x):
        if axis is None:
            return DK.elementwise(name, lambda b: _run(name, ops, b, scale, zero_point, None, None, out_dtype), [x],
                                  out, out_dtype)
        # lists as the whole-array path reads them (float64: integer zero points are numbers there too)
        params = [np.asarray(p, dtype=np.float64) if isinstance(p, (list, tuple)) else p for p in (scale, zero_point)]
        return DK.per_channel(name, lambda b, s, z: _run(name, ops, b, s, z, axis, None, out_dtype), x,
                              _channel_axis(name, axis, x.ndim), params, out_dtype, out)
    kind = A.array_kind(name, x, "the data")
    in_dt = A.dtype_of(x, kind)
    real = _real(out_dtype if in_dt == _I8 else in_dt)
    if axis is None:
        s = _scalar_param(name, "scale", scale, True, real)
        z = _scalar_param(name, "zero_point", zero_point, False, real)
        rt = real.type
        op = per_tensor(in_dt, s, z)
        ok = _reciprocal_ok(s, z)
        if len(_CHOICE) >= 4096:
            _CHOICE.clear()
        with np.errstate(over="ignore", under="ignore"):  # the fast path skips the checks for every dtype: kept
            if np.isfinite(np.float32(s)) and np.float32(s) > 0 and np.isfinite(np.float32(z)):  # if valid in all
                _CHOICE[(s, z)] = ok
        return op.call((x,), out, out_dtype=out_dtype, params=(s, z),
                       np_params={"scale": rt(s), "zero_point": rt(z)} | ({"real": real} if in_dt == _I8 else {}),
                       key_extra=(out_dtype, ok))
    ndim = len(x.shape)
    axis = _channel_axis(name, axis, ndim)
    sc = _channel_param(name, "scale", scale, x, kind, axis, real, True)
    zp = _channel_param(name, "zero_point", zero_point, x, kind, axis, real, False)
    params, np_params, walk = (), {}, (ANY, False)  # the fallback takes any walk's op
    if kind in A.GPU_KINDS:
        dev = A.device_of(x, kind)
        with R._cp.cuda.Device(dev):
            (sc, psc), (zp, pzp) = (_on_device(v, given, kind, dev) for v, given in ((sc, scale), (zp, zero_point)))
        inner = A.count(x.shape[axis + 1:])
        nch = x.shape[axis]
        ptrs = (psc, pzp)
        params = (np.uint64(ptrs[0]), np.uint64(ptrs[1]),
                  inner, np.uint64(A.fast_div_magic(inner)), nch, np.uint64(A.fast_div_magic(nch)))
        def width(w):
            op = per_channel[w, False]
            # ACROSS lacks the signatures whose packs are not a multiple of 4
            return op.width(in_dt, out_dtype) if (in_dt, out_dtype) in op.signatures else 1

        walk = _walk(A.count(x.shape), inner, nch, width, ptrs, real.itemsize)
    else:  # the fallback broadcasts the parameters along ``axis``
        bshape = (x.shape[axis],) + (1,) * (ndim - axis - 1)
        for key, v in (("scale", sc), ("zero_point", zp)):
            np_params[key] = (A.torch_numpy(v) if A.is_torch_tensor(v) else np.asarray(v)).astype(real).reshape(bshape)
        if in_dt == _I8:
            np_params["real"] = real
    res = per_channel[walk].call((x,), out, out_dtype=out_dtype, params=params, np_params=np_params,
                                 key_extra=out_dtype)
    del sc, zp  # kept alive until the launch was queued (stream-ordered allocators)
    return res


def quantize_int8(x: Array, /, scale: Operand, zero_point: Operand = 0.0, axis: int | None = None, *,
                  out: Array | None = None) -> Array:
    """int8 quantization: clamp(rint(x / scale + zero_point), -128, 127).

    ``x``: a float16/bfloat16/float32/float64 array (NumPy, CuPy or torch). Rounding is
    half to even and the division is a true division, computed in float32
    (float64 for float64 data), so results equal NumPy's
    ``np.clip(np.rint(x / scale + zero_point), -128, 127)`` bit for bit. NaN
    maps to 0, +inf to 127, -inf to -128.

    Per tensor (``axis=None``): ``scale`` and ``zero_point`` are scalars,
    checked before launch (finite, scale > 0). Per channel (``axis=k``):
    ``scale`` is a 1-D array of length ``x.shape[k]`` (NumPy, or x's own kind),
    ``zero_point`` a scalar or such an array. Returns int8 of x's shape and
    kind; ``out=`` (int8, x's shape and kind) receives it.
    """
    if axis is None:
        res = _per_tensor_fast(_QUANT_FAST, x, scale, zero_point, out, _I8)
        if res is not None:
            return res
    return _run("quantize_int8", (_quant_per_tensor, _quant_ch), x, scale, zero_point, axis, out, _I8)


def dequantize_int8(q: Array, /, scale: Operand, zero_point: Operand = 0.0, axis: int | None = None,
                    dtype: DType = np.float32, *, out: Array | None = None) -> Array:
    """int8 dequantization: (q - zero_point) * scale, in ``dtype``.

    ``q``: an int8 array. Computed in float32 (float64 when ``dtype`` is
    float64) and rounded once to ``dtype`` (float16, bfloat16, float32 or float64; a
    torch dtype is accepted too). ``scale``/``zero_point``/``axis`` as in
    ``quantize_int8``.
    """
    try:
        odt = _DTYPES.get((type(dtype), dtype))
    except TypeError:  # unhashable: float_dtype_arg says what is wrong
        odt = None
    if odt is None:
        odt = A.float_dtype_arg("dequantize_int8", dtype)
        if len(_DTYPES) < 64:
            _DTYPES[(type(dtype), dtype)] = odt
    if axis is None:
        res = _per_tensor_fast(_dequant.fast, q, scale, zero_point, out, odt)
        if res is not None:
            return res
    return _run("dequantize_int8", (lambda in_dt, s, z: _dequant, _dequant_ch), q, scale, zero_point, axis, out, odt)


_DTYPES: dict = {}  # dequantize_int8's dtype arguments seen -> the NumPy dtype they name


# ------------------------------------------------------------ fake quantization
def _fq(x, s, z):
    # clamp(rint(x / s + z), -128, 127) in the parameters' dtype (float32, float64 for float64
    # data), back to real values, rounded once to x's dtype; NaN stays NaN (as torch's). The + 0.0
    # makes a code of -0.0 (rint of a small negative) +0.0, as an int8 code is: the round trip's bits.
    # qdiv, qsub and qmul keep subnormal scales and zero points, as the round trip's kernels do
    return _F.qmul(_F.qsub(_F.clip(np.rint(_F.qdiv(x, s) + z), -128.0, 127.0) + 0.0, z), s).astype(x.dtype)


def _fq_grad(g, x, s, z):
    # straight-through: the gradient where the code was not clamped, 0 where it was
    v = np.rint(_F.qdiv(x, s) + z)
    return _F.where((v >= -128.0) & (v <= 127.0), g, 0.0).astype(g.dtype)


_FQ = Fused(_fq, name="fake_quantize_int8")
_FQ_GRAD = Fused(_fq_grad, name="fake_quantize_int8_backward")


def _fq_params(name, x, kind, scale, zero_point, axis):
    """scale and zero point as arrays of x's kind in the compute dtype, shaped
    to broadcast against x (along ``axis``, or (1,) * ndim per tensor)."""
    in_dt = A.dtype_of(x, kind)
    real = _real(in_dt)
    nd = len(x.shape)
    if axis is None:
        vals = [np.full((1,) * nd, _scalar_param(name, what, v, pos, real), dtype=real)
                for what, v, pos in (("scale", scale, True), ("zero_point", zero_point, False))]
        shape = (1,) * nd
    else:
        axis = _channel_axis(name, axis, nd)
        vals = [_channel_param(name, what, v, x, kind, axis, real, pos)
                for what, v, pos in (("scale", scale, True), ("zero_point", zero_point, False))]
        shape = tuple(x.shape[axis] if i == axis else 1 for i in range(nd))
    out = []
    for v in vals:
        if isinstance(v, np.ndarray) and kind in A.GPU_KINDS:
            v = D.uploaded(np.ascontiguousarray(v), kind, A.device_of(x, kind), "a fake-quantization parameter")
            if kind == A.TORCH_CUDA:
                v = A.torch().as_tensor(v, device=x.device)
        elif isinstance(v, np.ndarray) and kind == A.TORCH_CPU:
            v = A.torch_from_numpy(v)
        out.append(v.reshape(shape))
    return out


def _fq_params_traced(name, x, scale, zero_point, axis):
    """_fq_params for a torch tensor under torch.compile: Python numbers (per
    tensor) or 1-D tensors (per channel), no NumPy."""
    import torch
    real = torch.float64 if x.dtype == torch.float64 else torch.float32
    nd = x.dim()
    if axis is None:
        out = []
        for what, v, positive in (("scale", scale, True), ("zero_point", zero_point, False)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"cufuse.{name}: under torch.compile, {what} must be a Python number per tensor")
            if not math.isfinite(v) or (positive and v <= 0):
                raise ValueError(f"cufuse.{name}: {what} must be finite{' and > 0' if positive else ''}, got {v!r}")
            r = torch.tensor(float(v), dtype=real)  # (checked where the data is computed: 1e-46 is 0 in float32)
            if not bool(torch.isfinite(r)) or (positive and not bool(r > 0)):
                raise ValueError(f"cufuse.{name}: {what} {v!r} is {float(r)} in {real}, the type the data is "
                                 "computed in; it must be finite" + (" and > 0 there" if positive else " there"))
            out.append(torch.full((1,) * nd, float(v), dtype=real, device=x.device))
        return out
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"cufuse.{name}: axis must be an int or None, got {type(axis).__name__}")
    if not -nd <= axis < nd:
        raise ValueError(f"cufuse.{name}: axis {axis} is out of range for data with {nd} dimensions")
    axis = axis % nd
    shape = [1] * nd
    shape[axis] = x.shape[axis]
    out = []
    for what, v in (("scale", scale), ("zero_point", zero_point)):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and what == "zero_point":
            out.append(torch.full(shape, float(v), dtype=real, device=x.device))
            continue
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.shape[0] != x.shape[axis]:
            raise TypeError(f"cufuse.{name}: under torch.compile, a per-channel {what} must be a 1-D tensor of "
                            f"length {x.shape[axis]}")
        _no_param_grad(name, what, v)  # as eager: it would get no gradient, silently
        c = v.detach().to(dtype=real)
        if v.device.type == "cpu":  # checked (on the CPU) when the graph runs, as eager checks CPU values;
            # GPU ones neither (a check would synchronize, a device assert would end the process's CUDA)
            ok = torch.isfinite(c).all() if what == "zero_point" else (torch.isfinite(c) & (c > 0)).all()
            torch._assert_async(ok, f"cufuse.{name}: a per-channel {what} must be finite"
                                + ("" if what == "zero_point" else f" and > 0 in {real}"))
        out.append(c.to(device=x.device).reshape(shape))
    return out


def fake_quantize_int8(x: Array, /, scale: Operand, zero_point: Operand = 0.0, axis: int | None = None) -> Array:
    """dequantize_int8(quantize_int8(x, ...), ...) in one pass, in x's dtype:
    (clamp(rint(x / scale + zero_point), -128, 127) - zero_point) * scale,
    computed in float32 (float64 for float64 data) and rounded once, for
    quantization-aware training. ``scale``, ``zero_point`` and ``axis`` as in
    ``quantize_int8`` (per tensor, or per channel along ``axis``). Equal to
    the round trip bit for bit for finite values and ±inf; NaN stays NaN (as
    torch's fake quantization; the int8 code of NaN is 0).

    Differentiable for torch tensors with the straight-through estimator:
    the gradient passes where the code was not clamped and is 0 where it was
    (torch's ``fake_quantize_per_tensor_affine``); one kernel. scale and
    zero point get no gradient (NotImplementedError if they require one).
    """
    name = "fake_quantize_int8"
    if TO.compiling():  # torch.compile: checked with torch's attributes only (Dynamo traces this)
        s, z = _fq_params_traced(name, x, scale, zero_point, axis)
        TO.register()  # (its Function class with the operators)
        if x.requires_grad:
            return AG.apply("fake_quantize", _fq_function, x, s, z)
        return _FQ(x, s, z)
    if DK.is_dask(x):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported; use quantize_int8 and dequantize_int8")
    kind = A.array_kind(name, x, "the data")
    if A.dtype_of(x, kind) not in _FLOATS:
        raise TypeError(f"cufuse.{name}: the data is {A.describe(x, kind)}; accepted dtypes are {A.FLOAT_NAMES}")
    grad = AG.wants_grad((x,))
    s, z = _fq_params(name, x.detach() if grad else x, kind, scale, zero_point, axis)
    if grad:
        return AG.apply("fake_quantize", _fq_function, x, s, z)
    return _FQ(x, s, z)


def _fq_function(torch):
    class FakeQuantizeFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s, z):
            ctx.save_for_backward(x, s, z)
            return _FQ(x.detach(), s, z)

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, g):
            x, s, z = ctx.saved_tensors
            return _FQ_GRAD(g, x.detach(), s, z), None, None

    return FakeQuantizeFn
