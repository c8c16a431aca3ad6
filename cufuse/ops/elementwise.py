"""Fused elementwise ops: functors in kernels/elementwise.cu on the one driver.

An ``ElementwiseOp`` names its functor, its arity and a NumPy implementation
of the same function (the fallback). A call looks its signature up in the
op's ``FastPath`` (``_driver``): a signature seen before launches its recipe
straight away. Otherwise the operands are validated
(``_arrays.plan_elementwise``) and the op either builds the recipe of the
contiguous, strided or tiled kernel, runs it and keeps it, or runs the
fallback.
"""
from __future__ import annotations

import copy
import inspect
import struct
from typing import Callable

import numpy as np

from .. import _arrays as A
from .._arrays import Array, Operand
from .. import _autograd as AG
from .. import _torch_ops as TO
from .. import _dask as DK
from .. import _driver as D
from .. import _random
from .. import _runtime as R

FAMILY = "elementwise"  # kernels/elementwise.cu; ops may name another family that includes the driver
_SCALAR_SHIFT = 56    # kernels/elementwise.cuh: kScalarShift
_MAX_OPERANDS = 4     # kernels/elementwise.cuh: kMaxOperands
_F16, _F32, _F64 = A.F16, A.F32, A.F64
_bits = struct.Struct("<d").pack
_as_int = struct.Struct("<q").unpack


def scalar_bits(s) -> int:
    """A scalar operand as the kernels take it: the bits of a double, in its pointer slot."""
    return _as_int(_bits(float(s)))[0]


def pack_width(in_dt, out_dt, pack_bytes=None):
    """Elements per pack (kernels/elementwise.cuh PackWidth): one store of
    ``pack_bytes(in_dt, out_dt)`` bytes (16 when the functor does not say)."""
    return (pack_bytes(in_dt, out_dt) if pack_bytes else 16) // out_dt.itemsize


class ElementwiseOp:
    """One functor of kernels/elementwise.cu on the elementwise driver.

    ``functor`` is the C++ functor name, or a function of (input dtype, output
    dtype) giving it (e.g. a template instantiated per precision).
    ``signatures`` lists the (input dtype, output dtype) pairs instantiated
    (default: each float dtype to itself); ``params`` the C++ types of the
    functor's constructor arguments, passed after the count at each launch.
    ``numpy_impl(*values, **np_params)`` is the fallback, on values already in
    the compute dtype. ``indexed`` ops see each element's logical C-order
    index, so they only take the contiguous kernel for C-contiguous output.
    ``pack_bytes(in_dtype, out_dtype)``: the bytes of a pack's store, as the
    functor's ``pack_bytes`` says (default 16). ``np_dtype``: ``numpy_impl``
    also gets ``dtype=``, the result's storage dtype (its values come in the
    compute dtype: float16 as float32). ``packs_per_thread`` (an int, or a
    function of (input dtype, output dtype) giving one): the grid covers the
    packs (or elements) in that many grid strides instead of one, which
    spreads a functor's per-thread setup over more packs. ``one_wave`` (a
    bool, or such a function): the contiguous kernel's grid is at most what
    the GPU runs at once (``_runtime.resident_threads``), each thread taking
    packs one grid stride apart, with no partly filled last wave (for a
    periodic functor, kernels/elementwise.cuh op_periodic).
    """

    def __init__(self, name, functor, arity, numpy_impl, *, signatures=None, params=(), indexed=False,
                 family=FAMILY, pack_bytes=None, np_dtype=False, packs_per_thread=1, one_wave=False, fast=None):
        self.name = name
        self.np_dtype = np_dtype
        self.family = family
        self.arity = arity
        self.numpy_impl = numpy_impl
        self.indexed = indexed
        self.signatures = signatures or [(dt, dt) for dt in R.FLOAT_CTYPES]
        self.in_dtypes = tuple(dict.fromkeys(i for i, _ in self.signatures))
        self._width = {}  # (input dtype, output dtype) -> elements per pack
        self._per_thread = {}  # (input dtype, output dtype) -> packs per thread
        self._one_wave = {}  # (input dtype, output dtype) -> contiguous grid of one wave at most
        self._expr = {}
        for in_dt, out_dt in self.signatures:
            self._width[(in_dt, out_dt)] = pack_width(in_dt, out_dt, pack_bytes)
            ppt = packs_per_thread(in_dt, out_dt) if callable(packs_per_thread) else packs_per_thread
            if not isinstance(ppt, int) or ppt < 1:
                raise ValueError(f"{name}: packs_per_thread gave {ppt!r} for {in_dt}->{out_dt}; "
                                 "a positive int is needed")
            self._per_thread[(in_dt, out_dt)] = ppt
            self._one_wave[(in_dt, out_dt)] = bool(one_wave(in_dt, out_dt) if callable(one_wave) else one_wave)
            fname = functor(in_dt, out_dt) if callable(functor) else functor
            targs = (fname, R.CTYPES[out_dt], R.CTYPES[in_dt], *params)
            label = in_dt.name if in_dt == out_dt else f"{in_dt.name}->{out_dt.name}"
            # (family, expression) per entry: contiguous, strided, tiled. The
            # tiled kernels are a family part of their own, compiled on the
            # first call that needs one.
            entries = []
            for suffix, fam, what in (("", family, ""), ("_strided", family, " (strided)"),
                                      ("_tiled", f"{family}:tiled", " (tiled)")):
                expr = R.name_expression(f"ew{arity}{suffix}", *targs)
                R.register(fam, expr, name + what, label)
                entries.append((fam, expr))
            self._expr[(in_dt, out_dt)] = tuple(entries)
        self.nparams = len(params)
        self.grad = None  # the key of its backward in cufuse/_autograd.py, where it has one
        self.torch_op = None  # (name, approximate) of its torch.ops.cufuse operator, where it has one
        self.fast = fast or D.FastPath(name)  # ops chosen by a call's values may share one (key_extra tells)

    def renamed(self, name):
        """The same op (kernels, gradient, registered operator) under another
        public name, which its errors give, with a fast path of its own."""
        op = copy.copy(self)
        op.name = name
        op.fast = D.FastPath(name)
        return op

    def width(self, in_dt, out_dt):
        """Elements per pack of the (input dtype, output dtype) kernels."""
        return self._width[(in_dt, out_dt)]

    def _fn(self, key, device, entry=0):
        """Kernel for the (input, output) dtype pair ``key``: ``entry`` 0
        contiguous, 1 strided, 2 tiled (Layout.vec)."""
        return R.get_function(*self._expr[key][entry], device)

    def _ppt(self, in_dt, out_dt):
        """Packs per thread of the (input dtype, output dtype) kernels."""
        return self._per_thread[(in_dt, out_dt)]

    # ------------------------------------------------------------ the call
    def public(self, params: str, doc: str) -> Callable[..., Array]:
        """The public function of an op whose every argument is an operand."""
        call = self.call

        def op(*args, out=None):
            if self.torch_op is not None and TO.compiling():  # torch.compile: the registered operator
                return TO.call(*self.torch_op, args, out)
            return call(args, out)

        op.__name__ = op.__qualname__ = self.name
        op.__module__ = "cufuse"
        op.__doc__ = doc
        op.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_ONLY, annotation="Operand") for p in params]
            + [inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Array | None")],
            return_annotation="Array")
        return op

    def call(self, args, out, out_dtype=None, params=(), np_params=None, key_extra=None, sig=False):
        """The one entry of every call: the fast path when this signature (and
        ``key_extra``: what else selects the recipe) has a recipe, else the
        general path. ``params``: per-call values passed after the count;
        ``sig``: ``D.signature((*args, out))`` where the caller has it."""
        if len(args) == self.arity:
            s = D.signature((*args, out)) if sig is False else sig
            if s is not None:
                key, ptrs = s
                key = (key, key_extra)
                nin = len(ptrs) - (out is not None)
                values = params
                if nin < self.arity:  # scalar operands: their bits, this call's values
                    try:
                        values = (*[scalar_bits(a) for a in args if type(a) in D.SCALAR_TYPES], *params)
                    except (OverflowError, TypeError, ValueError):
                        return self._general(args, out, out_dtype, params, np_params, None)
                res = self.fast.run(key, ptrs, nin, None if out is None else (out,), values, args[0])
                if res is not None:
                    return res[0]
                return self._general(args, out, out_dtype, params, np_params, key)
        return self._general(args, out, out_dtype, params, np_params, None)

    def __call__(self, *args, out=None):
        return self.call(args, out)

    # ------------------------------------------------------- general path
    def _general(self, args, out, out_dtype=None, params=(), np_params=None, key=None):
        """Validate, then run the kernels (keeping the recipe under ``key``)
        or the NumPy fallback. ``out_dtype`` (default: the promoted input
        dtype) picks the signature; ``params`` go to the kernel,
        ``np_params`` to ``numpy_impl``."""
        if len(args) != self.arity:
            raise TypeError(f"cufuse.{self.name} takes {self.arity} operands, got {len(args)} positional arguments")
        if self.grad is not None and AG.wants_grad(args):  # recorded: the registered operator
            return TO.call(*self.torch_op, args, out)
        if DK.any_dask(args):
            if self.indexed:  # each element's position in the whole array (dropout's mask)
                raise TypeError(f"cufuse.{self.name} is not supported for Dask arrays (its result depends on "
                                "each element's position in the whole array)")
            return DK.elementwise(self.name, lambda *a: self._general(a, None, out_dtype, params, np_params), args,
                                  out, out_dtype)
        plan = A.plan_elementwise(self.name, args, out, accepted=self.in_dtypes, out_dtype=out_dtype)
        if plan.kind in A.GPU_KINDS:
            return self._run_gpu(plan, params, key)
        return self._run_fallback(plan, np_params or {})

    def _run_fallback(self, plan, np_params):
        """NumPy: the same function, float16 and bfloat16 computed in float32."""
        cdt = A.compute_dtype(plan.dtype)
        torch_cpu = plan.kind == A.TORCH_CPU
        vals = []
        for x, s in zip(plan.operands, plan.scalars):
            if x is None:  # a scalar is rounded to the result dtype first, as NumPy does
                vals.append(np.asarray(s, dtype=plan.dtype).astype(cdt))
            else:
                arr = A.torch_numpy(x) if torch_cpu else x
                # an operand the result dtype cannot hold exactly (torch's zero-dim rule: a float32 or, for a
                # bfloat16 result, a float16 zero-dim tensor) is rounded to the result dtype first, as on the GPU
                if arr.dtype != plan.dtype and not np.can_cast(arr.dtype, plan.dtype, "safe"):
                    arr = arr.astype(plan.dtype)
                vals.append(arr.astype(cdt, copy=False))
        with np.errstate(all="ignore"):  # overflow to inf is the answer, as on the GPU
            if self.np_dtype:
                np_params = {**np_params, "dtype": plan.out_dtype}
            res = np.asarray(self.numpy_impl(*vals, **np_params))
            if res.shape != plan.shape:  # all-scalar-but-one 0-d operands
                res = np.array(np.broadcast_to(res, plan.shape))
            res = res.astype(plan.out_dtype, copy=False)
        if plan.out is not None:
            target = A.torch_numpy(plan.out) if torch_cpu else plan.out
            np.copyto(target, res)
            if torch_cpu:
                D.written((plan.out,))
            return plan.out
        return A.torch_result(res) if torch_cpu else res

    def _run_gpu(self, plan, params, key):
        kind, dt, odt, dev, shape = plan.kind, plan.dtype, plan.out_dtype, plan.device, plan.shape
        out = plan.out
        with R._cp.cuda.Device(dev):
            if plan.size == 0:
                return out if out is not None else D.empty(shape, odt, kind, dev)
            keep = key is not None  # the recipe serves later calls unless this call needed copies
            ins = []
            for x in plan.operands:
                if x is not None:
                    if A.dtype_of(x, kind) != dt:  # mixed float dtypes: cast once
                        x, keep = D.astype(x, dt, kind), False
                ins.append(x)
            target = out
            if out is not None and D.needs_temporary(out, odt, ins, [dt] * len(ins), kind, shape):
                target, keep = D.empty(shape, odt, kind, dev), False
            rec = self.recipe(kind, dev, dt, odt, shape, target, ins)
            if rec is None:
                # More dims than the strided kernel indexes: C-contiguous copies of
                # the operands and a C-contiguous result, copied back.
                ins = [None if x is None else D.dense(x, shape, kind) for x in ins]
                keep = False
                if target is not None:
                    target = D.empty(shape, odt, kind, dev)
                rec = self.recipe(kind, dev, dt, odt, shape, target, ins)
            values = (*[scalar_bits(s) for x, s in zip(ins, plan.scalars) if x is None], *params)
            return D.run_general(rec, None if target is None else [target], None if out is None else [out],
                                 [A.pointer_of(x, kind) for x in ins if x is not None], values, ins[0],
                                 self.fast, key if keep else None)[0]

    def recipe(self, kind, dev, dt, odt, shape, out, ins):
        """The launch of this op for operands ``ins`` (None: a scalar) of dtype
        ``dt`` into ``out`` (None: a new C-contiguous array), from their
        shapes, strides and alignment only. Per-call values: each scalar
        operand's bits, then the op's params."""
        n = A.count(shape)
        nin = sum(x is not None for x in ins)
        b = D.RecipeBuilder(kind, dev, 1, nin)
        if out is None:
            optr, ost = 0, A.c_strides(shape)
        else:
            optr, ost = A.pointer_of(out, kind), list(A.strides_of(out, kind))
        # The kernels' calling convention (kernels/elementwise.cuh): a scalar
        # travels as the bits of a double in its input's pointer slot, flagged
        # in the high bits of the count.
        slots, ptrs, strides, nm, j, v = [], [], [ost], n, 0, 0
        for k, x in enumerate(ins):
            if x is None:
                slots.append(D.val(v))
                ptrs.append(None)
                v += 1
                nm |= 1 << (_SCALAR_SHIFT + k)
            else:
                slots.append(D.in_(j))
                ptrs.append(A.pointer_of(x, kind))
                strides.append(A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape))
                j += 1
        tail = [D.val(v + i) for i in range(self.nparams)]
        cshape, cstrides = A.collapse(shape, strides)
        if len(cshape) > D.STRIDED_NDIM:
            return None
        width, ppt = self._width[(dt, odt)], self._ppt(dt, odt)
        contiguous = len(cshape) == 1 and all(st[0] == 1 for st in cstrides)
        if contiguous and (not self.indexed or A.is_c_contiguous(shape, ost)):
            fn = self._fn((dt, odt), dev)  # one dense run (indexed ops: in C order)
            work = n // (width * ppt) or 1
            if self._one_wave[(dt, odt)]:
                work = min(work, R.resident_threads(fn, dev))
            args = (D.out_(0), *slots, nm, *tail)
        else:
            it = iter(cstrides)
            parts = [(optr, next(it), odt.itemsize)]
            parts += [None if p is None else (p, next(it), dt.itemsize) for p in ptrs]
            lay, work = D.strided_layout(_MAX_OPERANDS, cshape, parts, width, n)
            fn = self._fn((dt, odt), dev, 2 if lay["vec"] == 2 else 1)
            work = -(-work // ppt)
            args = (D.out_(0), *slots, nm, lay, *tail)
        b.launch(fn, (R.grid_for(work, dev) or 1,), (R.BLOCK,), args)
        arrays = [x for x in ins if x is not None]
        return b.build([D.output(shape, odt, kind)],
                       [D.view_span(shape, ost, odt.itemsize)],
                       [D.view_span(tuple(x.shape), A.strides_of(x, kind), dt.itemsize) for x in arrays],
                       [tuple(j for j, (x, st) in enumerate(zip(arrays, strides[1:]))
                              if dt == odt and list(st) == list(ost))], like=ins[0])


# ------------------------------------------------------------------ the ops
# The fallbacks work in place on the first step's new array: one allocation
# per call, as many passes as the NumPy chain, so never slower than it.
def _into(ufunc, t, *more):
    """ufunc(t, *more) into ``t`` when it is an array (a step's own result)
    of the whole result's shape (a later operand may broadcast it larger)."""
    if type(t) is np.ndarray and all(np.ndim(m) <= t.ndim for m in more) and \
            np.broadcast_shapes(t.shape, *[np.shape(m) for m in more]) == t.shape:
        return ufunc(t, *more, out=t)
    return ufunc(t, *more)


def _relu(v):
    return _into(np.maximum, v, v.dtype.type(0))  # NaN stays NaN (np.maximum propagates it), like the kernel


_add_relu = ElementwiseOp("add_relu", "AddRelu", 2, lambda a, b: _relu(a + b))
_mul_tanh = ElementwiseOp("mul_tanh", "MulTanh", 2, lambda a, b: _into(np.tanh, a * b))
_add_mul_exp = ElementwiseOp("add_mul_exp", "AddMulExp", 2,
                             lambda x, y: _into(np.exp, _into(np.multiply, x + y, x.dtype.type(2))))
_fma = ElementwiseOp("fma", "Fma", 3, lambda q, k, v: _into(np.add, q * k, v))
for _op in (_add_relu, _mul_tanh, _add_mul_exp, _fma):
    _op.grad, _op.torch_op = _op.name, (_op.name, None)  # differentiable: cufuse/_autograd.py, _torch_ops.py

_COMMON = """
    Operands broadcast as in NumPy and may be Python or NumPy scalars; float16,
    float32 and float64 promote as ``numpy.result_type`` does (float16 is
    computed in float32). Returns the operands' kind: CuPy in, CuPy out; torch
    CUDA in, torch CUDA out (queued on torch's current stream); NumPy or torch
    CPU in, the NumPy fallback. ``out=`` (same kind, result shape and dtype)
    receives the result and may alias an input.
"""


add_relu = _add_relu.public("ab", "relu(a + b), fused: one pass over memory.\n" + _COMMON)
mul_tanh = _mul_tanh.public("ab", "tanh(a * b), fused: one pass over memory.\n" + _COMMON)
add_mul_exp = _add_mul_exp.public("xy", "exp((x + y) * 2), fused: one pass over memory.\n" + _COMMON)
fma = _fma.public("qkv", "q * k + v, fused: one pass over memory. On the GPU one rounding (fmaf / fma: the\n"
                  "product is not rounded first); the NumPy fallback rounds the product, then the sum, as\n"
                  "NumPy's ``q * k + v`` (float16 and bfloat16: exact products in float32 either way).\n" + _COMMON)


# ------------------------------------------------------------ GELU family
_SQRT_2_OVER_PI = 0.79788456080286535588


def _special(name, v):
    """erf / erfc on NumPy arrays, in v's dtype: SciPy's when installed, else
    _erf_cody (vectorized: no Python call per element)."""
    try:
        import scipy.special as lib
    except ImportError:
        return _erf_cody(v, name == "erfc").astype(v.dtype)
    return np.asarray(getattr(lib, name)(v), dtype=v.dtype)


# W. J. Cody's rational Chebyshev approximations of erf and erfc (Math. Comp.
# 23 (1969); the specfun CALERF constants): |x| <= 0.46875 erf = x P(x^2) /
# Q(x^2); up to 4 erfc = exp(-x^2) R(x) / S(x); beyond, erfc = exp(-x^2) / x
# (1 / sqrt(pi) - T(1 / x^2) / (x^2 U(1 / x^2))). Within a few ulps of
# math.erf / math.erfc in float64 (tests/test_gelu.py).
_CODY_A = (3.1611237438705656, 113.864154151050156, 377.485237685302021, 3209.37758913846947,
           0.185777706184603153)
_CODY_B = (23.6012909523441209, 244.024637934444173, 1282.61652607737228, 2844.23683343917062)
_CODY_C = (0.564188496988670089, 8.88314979438837594, 66.1191906371416295, 298.635138197400131,
           881.95222124176909, 1712.04761263407058, 2051.07837782607147, 1230.33935479799725,
           2.15311535474403846e-8)
_CODY_D = (15.7449261107098347, 117.693950891312499, 537.181101862009858, 1621.38957456669019,
           3290.79923573345963, 4362.61909014324716, 3439.36767414372164, 1230.33935480374942)
_CODY_P = (0.305326634961232344, 0.360344899949804439, 0.125781726111229246, 0.0160837851487422766,
           6.58749161529837803e-4, 0.0163153871373020978)
_CODY_Q = (2.56852019228982242, 1.87295284992346047, 0.527905102951428412, 0.0605183413124413191,
           0.00233520497626869185)


def _horner(z, num_top, nums, dens):
    """(num_top z + nums[0]) z + ... and (z + dens[0]) z + ... (in place: no
    new array per step), each without its constant term."""
    num, den = num_top * z, z.copy()
    for a, b in zip(nums, dens):
        num += a
        num *= z
        den += b
        den *= z
    return num, den


def _erf_cody(v, complement):
    """erf (erfc where ``complement``) of a NumPy array, in float64."""
    x = np.asarray(v, dtype=np.float64)
    y = np.abs(x)
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        small = y <= 0.46875
        xs = x[small]
        z = xs * xs
        z[np.abs(xs) <= 1.11e-16] = 0.0
        num, den = _horner(z, _CODY_A[4], _CODY_A[:3], _CODY_B[:3])
        num += _CODY_A[3]
        den += _CODY_B[3]
        num *= xs
        num /= den
        out[small] = 1.0 - num if complement else num
        # erfc(|x|) beyond: a rational function times exp(-x^2), taken as
        # exp(-t^2) exp(-(y - t)(y + t)) with t = y rounded down to 1/16 (exact squares)
        big = ~small
        yb = y[big]
        mid = yb <= 4.0
        r = np.empty_like(yb)
        ym = yb[mid]
        num, den = _horner(ym, _CODY_C[8], _CODY_C[:7], _CODY_D[:7])
        num += _CODY_C[7]
        den += _CODY_D[7]
        r[mid] = num / den
        yt = yb[~mid]
        z = 1.0 / (yt * yt)
        num, den = _horner(z, _CODY_P[5], _CODY_P[:4], _CODY_Q[:4])
        num += _CODY_P[4]
        den += _CODY_Q[4]
        r[~mid] = (0.56418958354775628695 - z * num / den) / yt
        t = np.trunc(yb * 16.0) / 16.0
        e = np.exp(-t * t)
        e *= np.exp(-(yb - t) * (yb + t))
        r *= e
        r[yb >= 27.3] = 0.0  # (erfc underflows from there on)
        r[np.isnan(yb)] = np.nan
        neg = x[big] < 0
        if complement:
            out[big] = np.where(neg, 2.0 - r, r)
        else:
            r = 0.5 - r + 0.5
            out[big] = np.where(neg, -r, r)
    return out


def erf_numpy(v):
    """erf of a NumPy array in its dtype (the fallbacks': SciPy's when installed)."""
    return _special("erf", v)


def gelu_numpy(v, approximate):
    """PyTorch's GELU definitions on a NumPy array, in its dtype."""
    half, one = v.dtype.type(0.5), v.dtype.type(1)
    if approximate == "tanh":
        c, k = v.dtype.type(_SQRT_2_OVER_PI), v.dtype.type(0.044715)
        return half * v * (one + np.tanh(c * (v + k * v * v * v)))
    # v Phi(v) with Phi(v) = erfc(-v / sqrt 2) / 2, which keeps its relative
    # accuracy in the left tail, where 1 + erf(v / sqrt 2) cancels (as the
    # kernels), computed in float64 and rounded once to v's dtype (rounding
    # erfc's argument to float32 would cost 2 z**2 ulps of erfc(z): 1e-5
    # relative at v = -12).
    v64 = v.astype(np.float64)
    with np.errstate(invalid="ignore"):   # -inf * 0 = NaN, as the kernels give
        return (0.5 * v64 * _special("erfc", v64 * -0.70710678118654752440)).astype(v.dtype)


_APPROXIMATE = ("none", "tanh")


def _check_approximate(name, approximate):
    if approximate not in _APPROXIMATE:
        raise ValueError(f"cufuse.{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


# p in [1/32, 31/32]: float16 masks may use 16-bit lanes, whose resolution
# of p (2**-16) moves the keep rate by at most 2**-11 relative (half an ulp
# of float16) there. Outside, a 16-bit lane would drop nothing for p < 2**-16
# and bias the expected value by percents for p near 1.
_LANE16_P = (1 / 32, 31 / 32)
# The largest p: the 32-bit lanes' keep rate is (2**32 - floor(p 2**32)) / 2**32, so 1 / (1 - p) scales the
# kept values by up to 2**-32 / (1 - p) too much; at most 2**-11 (the 16-bit lanes' bound) up to here.
_P_MAX = 1.0 - 2.0 ** -21


def _mask_bits(dtype, lanes16):
    """Bits of Philox output per element of gelu_dropout's mask (kernels/dropout.cu Bits)."""
    return 16 if lanes16 and dtype == _F16 else 32


def _dropout_numpy(x, *, approximate, seed, threshold, scale, dtype, lanes16):
    g = gelu_numpy(x, approximate)
    bits = _mask_bits(dtype, lanes16)
    keep = (_random.philox_lanes(seed, x.size, bits) >= threshold >> (32 - bits)).reshape(x.shape)
    return np.where(keep, g * x.dtype.type(scale), x.dtype.type(0))


# Packs per thread (ElementwiseOp's packs_per_thread): 4 for float16 (and
# bfloat16, the same bytes per element), else 1: the faster (bench/NOTES.md,
# "Figures from code comments").
def _bias_gelu_ppt(in_dt, out_dt):
    return 4 if out_dt in A.HALVES else 1


_bias_gelu_ops = {
    False: ElementwiseOp("bias_gelu", lambda i, o: f"BiasGeluErf<{R.CTYPES[o]}>", 2,
                         lambda x, b: gelu_numpy(x + b, "none"), packs_per_thread=_bias_gelu_ppt),
    True: ElementwiseOp("bias_gelu", "BiasGeluTanh", 2, lambda x, b: gelu_numpy(x + b, "tanh"),
                        packs_per_thread=_bias_gelu_ppt),
}
_bias_gelu_ops[False].grad, _bias_gelu_ops[True].grad = "bias_gelu", "bias_gelu_tanh"
_bias_gelu_ops[False].torch_op, _bias_gelu_ops[True].torch_op = ("bias_gelu", "none"), ("bias_gelu", "tanh")
_bias_gelu = {t: op.public("xb", "") for t, op in _bias_gelu_ops.items()}
_gelu_eval = {t: op.renamed("gelu_dropout").public("xb", "") for t, op in _bias_gelu_ops.items()}  # (errors: its name)
_dropout_ops = {  # (tanh, lanes16): float32/float64 results take 32-bit lanes either way
    (t, l16): ElementwiseOp(
        "gelu_dropout",
        lambda i, o, t=t, l16=l16: f"GeluDropout<{'true' if t else 'false'}, {R.CTYPES[o]}, {_mask_bits(o, l16)}>",
        1, _dropout_numpy, params=("unsigned long long", "unsigned long long", "double", "float", "float"),
        indexed=True,
        family="dropout", np_dtype=True, packs_per_thread=lambda i, o: 1 if o == _F64 else 4)
    for t in (False, True) for l16 in (False, True)
}


def _dgelu_numpy(v, approximate):
    """gelu'(v) in v's dtype: the tanh form's derivative in v's dtype, the erf
    form's, Phi(v) + v phi(v), in float64 rounded once."""
    if approximate == "tanh":
        half, one = v.dtype.type(0.5), v.dtype.type(1)
        c, k = v.dtype.type(_SQRT_2_OVER_PI), v.dtype.type(0.044715)
        t = np.tanh(c * (v + k * v * v * v))
        return half * (one + t) + half * v * (one - t * t) * c * (one + v.dtype.type(3) * k * v * v)
    v64 = v.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        d = 0.5 * _special("erfc", v64 * -0.70710678118654752440) + v64 * np.exp(-0.5 * v64 * v64) * 0.3989422804014327
    return d.astype(v.dtype)


def _dropout_grad_numpy(g, x, *, approximate, seed, threshold, scale, dtype, lanes16):
    """gelu_dropout's gradient: the forward's mask drawn again (_dropout_numpy)."""
    shape = np.broadcast_shapes(g.shape, x.shape)
    bits = _mask_bits(dtype, lanes16)
    n = int(np.prod(shape))
    keep = (_random.philox_lanes(seed, n, bits) >= threshold >> (32 - bits)).reshape(shape)
    return np.where(keep, g * _dgelu_numpy(x, approximate) * x.dtype.type(scale), x.dtype.type(0))


# gelu_dropout's backward (autograd): dx from (g, x) and the forward's seed and p
_dropout_grad_ops = {
    (t, l16): ElementwiseOp(
        "gelu_dropout_backward",
        lambda i, o, t=t, l16=l16: f"GeluDropoutGrad<{'true' if t else 'false'}, {R.CTYPES[o]}, {_mask_bits(o, l16)}>",
        2, _dropout_grad_numpy, params=("unsigned long long", "unsigned long long", "double", "float", "float"),
        indexed=True, family="dropout", np_dtype=True)
    for t in (False, True) for l16 in (False, True)
}


def bias_gelu(x: Array, bias: Operand, /, approximate: str = "none", *, out: Array | None = None) -> Array:
    """gelu(x + bias), fused: one pass over memory.

    ``approximate``: "none" (0.5 v (1 + erf(v / sqrt 2))) or "tanh"
    (0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v**3)))), PyTorch's definitions.
    ``bias`` broadcasts (usually along the last axis).
    """
    return _bias_gelu[_check_approximate("bias_gelu", approximate)](x, bias, out=out)


def check_dropout_p(who, p):
    """p as a float, checked: a number in [0, 1 - 2**-21]."""
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"{who}: p must be a float in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"{who}: p must be in [0, 1), got {p}")
    if p > _P_MAX:
        raise ValueError(f"{who}: p = {p!r} is closer to 1 than the mask resolves (a keep rate of "
                         f"1 - p is drawn in steps of 2**-32: the expected value would be off by more than 2**-11); "
                         f"p must be at most 1 - 2**-21")
    return p


def gelu_dropout(x: Array, /, p: float = 0.1, training: bool = True, seed: int | None = None,
                 approximate: str = "none", *, out: Array | None = None) -> Array:
    """dropout(gelu(x)), fused: one pass over memory.

    Each element is kept with probability 1 - p and scaled by 1 / (1 - p);
    dropped elements are exactly 0. ``training=False`` or ``p=0`` gives plain
    GELU. The mask is a function of (seed, element index, result dtype) only:
    element i (its C-order position in ``x``) is kept iff lane i % L of
    Philox4x32-10 at counter i // L under the 64-bit key ``seed`` is
    >= floor(p * 2**B), the same on the GPU and in the NumPy fallback. The
    lanes are B-bit: B = 16 (L = 8, each word's low half, then its high
    half) for float16 results with 1/32 <= p <= 31/32, whose speed is bound
    by the generator's arithmetic; B = 32 (L = 4, the four words) otherwise
    (bfloat16 results included).
    ``seed=None`` draws a seed:
    for torch tensors from torch's default generator, as torch's dropout
    (``torch.manual_seed`` makes it reproducible, and torch.utils.checkpoint
    recomputes the same mask), else the next of cufuse's generator
    (``cufuse.manual_seed`` makes it reproducible).
    ``approximate`` as in ``bias_gelu``. Takes one array; ``out=`` as in the other ops.
    """
    tanh = _check_approximate("gelu_dropout", approximate)
    p = check_dropout_p("cufuse.gelu_dropout", p)
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"cufuse.gelu_dropout: training must be a bool, got {type(training).__name__}")
    if seed is not None:
        seed = _random.check_seed(seed, "cufuse.gelu_dropout")
    if not training or p == 0.0:
        return _gelu_eval[tanh](x, 0.0, out=out)
    if TO.compiling():  # torch.compile: the registered operator; seed=None drawn by torch, in the graph
        AG.no_out("gelu_dropout", out)
        return TO.gelu_dropout(x, p, seed, approximate)
    grad = AG.wants_grad((x,))
    if grad:
        AG.no_out("gelu_dropout", out)
    sig = False
    if seed is None:
        sig = _check_before_draw(tanh, p, x, out, grad)
        # torch tensors: from torch's generator, as torch's dropout (torch.utils.checkpoint's recompute,
        # which restores that generator, draws the same mask; DataLoader workers reseed it)
        seed = _random.torch_seed() if A.is_torch_tensor(x) else _random.next_seed()
    fwd, bwd, params, np_params = _dropout_call(tanh, p, seed, approximate)
    if grad:  # recorded: the backward draws the mask again from (seed, p)
        return AG.dropout_apply(fwd, bwd, x, params, np_params)
    return fwd.call((x,), out, params=params, np_params=np_params, sig=sig)


def _check_before_draw(tanh, p, x, out, grad):
    """gelu_dropout's checks of x and out where the call will not find a kept recipe (the general path:
    the CPU, a first call of its signature, autograd), before a seed is drawn: a call that raises leaves
    torch's and cufuse's generators as they were. A signature with a recipe was checked when it was kept.
    Returns the call's signature (ElementwiseOp.call's ``sig``), or False where it was not taken."""
    fwd = _dropout_ops[tanh, _dropout_p(p)[4]]
    xs = x.detach() if grad else x  # (recorded: the Function's forward launches on x detached, out None)
    sig = D.signature((xs, out))
    if sig is not None and (sig[0], None) in fwd.fast.recipes:
        return False if grad else sig
    if DK.is_dask(x):
        fwd.call((x,), out)  # (its refusal: the mask depends on each element's place in the whole array)
    A.plan_elementwise(fwd.name, (xs,), out, accepted=fwd.in_dtypes)
    return False if grad else sig


def _dropout_call(tanh, p, seed, approximate):
    """(forward op, backward op, kernel parameters, NumPy parameters) of gelu_dropout's p and seed."""
    threshold, scale, scale_f, lift, lanes16 = _dropout_p(p)
    params = (np.uint64(seed), threshold, scale, scale_f, lift)
    np_params = {"approximate": approximate, "seed": seed, "threshold": int(threshold), "scale": scale,
                 "lanes16": lanes16}
    return _dropout_ops[tanh, lanes16], _dropout_grad_ops[tanh, lanes16], params, np_params


def gelu_dropout_grad(g, x, p, seed, approximate):
    """gelu_dropout's gradient with respect to x (its custom operator's backward)."""
    _, bwd, params, np_params = _dropout_call(approximate == "tanh", p, seed, approximate)
    return bwd.call((g, x), None, params=params, np_params=np_params)


_DROPOUT_P: dict = {}  # p -> its kernel constants (_dropout_constants)


def _dropout_p(p):
    """gelu_dropout's kernel constants of p (_dropout_constants), kept per p."""
    c = _DROPOUT_P.get(p)
    return c if c is not None else _dropout_constants(p)


def _dropout_constants(p):
    """(threshold, scale, float32 scale, its log2, lanes16) of gelu_dropout's p, kept per p."""
    # floor(p * 2**32): exact, p * 2**32 is a scaled double; 16-bit lanes
    # compare with threshold >> 16 = floor(p * 2**16)
    threshold = np.uint64(int(p * 4294967296.0))
    scale = 1.0 / (1.0 - p)
    # the float kernels' scale and its log2, which they fold into the erf
    # tail's exponent (kernels/common.cuh: gelu_normal): once here rather than
    # a conversion and a log2f in every thread
    scale_f = np.float32(scale)
    lift = np.float32(np.log2(float(scale_f)))
    c = (threshold, scale, scale_f, lift, _LANE16_P[0] <= p <= _LANE16_P[1])
    if len(_DROPOUT_P) >= 256:
        _DROPOUT_P.clear()
    _DROPOUT_P[p] = c
    return c


bias_gelu.__doc__ = (bias_gelu.__doc__ or "") + _COMMON

OPS = {"add_relu": _add_relu, "mul_tanh": _mul_tanh, "add_mul_exp": _add_mul_exp, "fma": _fma,
       "bias_gelu": _bias_gelu_ops[False], "bias_gelu_tanh": _bias_gelu_ops[True],
       "gelu_dropout": _dropout_ops[False, False], "gelu_dropout_tanh": _dropout_ops[True, False],
       "gelu_dropout_lanes16": _dropout_ops[False, True], "gelu_dropout_tanh_lanes16": _dropout_ops[True, True]}
