"""Fused elementwise ops: functors in kernels/elementwise.cu on the one driver.

An ``ElementwiseOp`` names its functor, its arity and a NumPy implementation
of the same function (the fallback). Calling it validates the operands
(``_arrays.plan_elementwise``) and then either launches the contiguous or the
strided kernel through ``_runtime``, or runs the fallback. A lean fast path in
front of the validation serves the common case (same-shape C-contiguous
CuPy arrays or CUDA tensors of one float dtype) with a handful of attribute
reads, so small calls cost little more than the launch itself.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .. import _runtime as R

FAMILY = "elementwise"
_STRIDED_NDIM = 8     # kernels/elementwise.cuh: kMaxDims
_MAX_OPERANDS = 4     # kernels/elementwise.cuh: kMaxOperands
_LAYOUT = np.dtype({"names": ["shape", "stride", "ndim"],
                    "formats": [(np.int64, (_STRIDED_NDIM,)), (np.int64, (_MAX_OPERANDS, _STRIDED_NDIM)), np.int32]},
                   align=True)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)


def _compute_dtype(dtype):
    """float16 is computed in float32, like the kernels."""
    return _F32 if dtype == _F16 else dtype


class ElementwiseOp:
    def __init__(self, name, functor, arity, numpy_impl):
        self.name = name
        self.functor = functor
        self.arity = arity
        self.numpy_impl = numpy_impl
        self._pack = {}
        self._expr = {}
        for dt, ctype in R.CTYPES.items():
            contig = R.name_expression(f"ew{arity}", functor, ctype, ctype)
            strided = R.name_expression(f"ew{arity}_strided", functor, ctype, ctype)
            R.register(FAMILY, contig, name, dt.name)
            R.register(FAMILY, strided, f"{name} (strided)", dt.name)
            self._expr[dt] = (contig, strided)
            self._pack[dt] = 16 // dt.itemsize
        self._zeros = (0.0,) * arity
        self._fast = {}  # (dtype, device) -> contiguous Function

    # ------------------------------------------------------------ hot path
    def _fn(self, dtype, device, strided=False):
        return R.get_function(FAMILY, self._expr[dtype][strided], device)

    def __call__(self, *args, out=None):
        if len(args) != self.arity:
            raise TypeError(f"cufuse.{self.name} takes {self.arity} operands, got {len(args)}")
        a0 = args[0]
        if type(a0) is A.CupyArray:
            res = self._fast_cupy(a0, args, out)
        elif A.is_torch_tensor(a0) and a0.is_cuda:
            res = self._fast_torch(a0, args, out)
        else:
            res = None
        return res if res is not None else self._general(args, out)

    def _fast_cupy(self, a0, args, out):
        """Same-shape C-contiguous CuPy arrays of one float dtype on the current device."""
        dt = a0.dtype
        if dt not in self._pack or not a0._c_contiguous:
            return None
        shape = a0.shape
        dev = a0.data.device_id
        for x in args:
            if (type(x) is not A.CupyArray or x.dtype != dt or not x._c_contiguous or x.shape != shape
                    or x.data.device_id != dev):
                return None
        if dev != R._cp.cuda.runtime.getDevice():
            return None
        n = a0.size
        if out is None:
            out = R._cp.ndarray(shape, dt)
        else:
            if (type(out) is not A.CupyArray or out.dtype != dt or not out._c_contiguous
                    or out.shape != shape or out.data.device_id != dev):
                return None
            optr, nbytes = out.data.ptr, n * dt.itemsize
            for x in args:  # partial overlap with an input needs the general path's temporary
                d = x.data.ptr - optr
                if d != 0 and -nbytes < d < nbytes:
                    return None
        if n == 0:
            return out
        fn = self._fast.get((dt, dev))
        if fn is None:
            fn = self._fast[(dt, dev)] = self._fn(dt, dev)
        R.launch(fn, n // self._pack[dt] or 1, dev, (out, *args, *self._zeros, n))
        return out

    def _fast_torch(self, a0, args, out):
        """Same-shape contiguous CUDA tensors: raw pointers, torch's current stream, no DLPack."""
        if a0.requires_grad or not a0.is_contiguous():
            return None
        tdt = a0.dtype
        dt = A.torch_to_numpy_dtype(tdt)
        if dt not in self._pack:
            return None
        shape = a0.shape
        dev = a0.get_device()
        tensor = type(a0)
        for x in args:
            if (type(x) is not tensor or x.dtype != tdt or x.requires_grad or not x.is_contiguous()
                    or x.shape != shape or x.get_device() != dev):
                return None
        if dev != R._cp.cuda.runtime.getDevice():
            return None
        n = a0.numel()
        if out is None:
            out = A.torch().empty(shape, dtype=tdt, device=a0.device)
        else:
            if (type(out) is not tensor or out.dtype != tdt or out.requires_grad or not out.is_contiguous()
                    or out.shape != shape or out.get_device() != dev):
                return None
            optr, nbytes = out.data_ptr(), n * dt.itemsize
            for x in args:
                d = x.data_ptr() - optr
                if d != 0 and -nbytes < d < nbytes:
                    return None
        if n == 0:
            return out
        fn = self._fast.get((dt, dev))
        if fn is None:
            fn = self._fast[(dt, dev)] = self._fn(dt, dev)
        stream = R.external_stream(_torch_stream(dev), dev)
        ptrs = tuple(x.data_ptr() for x in args)
        R.launch(fn, n // self._pack[dt] or 1, dev, (out.data_ptr(), *ptrs, *self._zeros, n), stream)
        return out

    # ------------------------------------------------------- general path
    def _general(self, args, out):
        plan = A.plan_elementwise(self.name, args, out)
        if plan.kind in A.GPU_KINDS:
            return self._run_gpu(plan)
        return self._run_fallback(plan)

    def _run_fallback(self, plan):
        """NumPy: the same function, float16 computed in float32."""
        cdt = _compute_dtype(plan.dtype)
        torch_cpu = plan.kind == A.TORCH_CPU
        vals = []
        for x, s in zip(plan.operands, plan.scalars):
            if x is None:  # a scalar is rounded to the result dtype first, as NumPy does
                vals.append(np.asarray(s, dtype=plan.dtype).astype(cdt))
            else:
                arr = x.numpy() if torch_cpu else x
                vals.append(arr.astype(cdt, copy=False))
        with np.errstate(all="ignore"):
            res = np.asarray(self.numpy_impl(*vals), dtype=cdt)
        if res.shape != plan.shape:  # all-scalar-but-one 0-d operands
            res = np.array(np.broadcast_to(res, plan.shape))
        res = res.astype(plan.dtype, copy=False)
        if plan.out is not None:
            target = plan.out.numpy() if torch_cpu else plan.out
            np.copyto(target, res)
            return plan.out
        return A.torch().from_numpy(res) if torch_cpu else res

    def _run_gpu(self, plan):
        cp = R._cp
        kind, dt, dev, shape, n = plan.kind, plan.dtype, plan.device, plan.shape, plan.size
        is_torch = kind == A.TORCH_CUDA
        keep = []  # temporaries that must outlive the launch call
        with cp.cuda.Device(dev):
            out = plan.out
            if out is None:
                out = (A.torch().empty(shape, dtype=A.numpy_to_torch_dtype(dt), device=f"cuda:{dev}")
                       if is_torch else cp.ndarray(shape, dt))
            if n == 0:
                return out
            ins = []
            for x in plan.operands:
                if x is not None and A.dtype_of(x, kind) != dt:  # mixed float dtypes: cast once
                    x = x.to(A.numpy_to_torch_dtype(dt)) if is_torch else x.astype(dt)
                    keep.append(x)
                ins.append(x)
            target = out
            if self._needs_temporary(out, ins, kind, dt, shape):
                target = (A.torch().empty(shape, dtype=out.dtype, device=out.device)
                          if is_torch else cp.ndarray(shape, dt))
            stream = R.external_stream(_torch_stream(dev), dev) if is_torch else None
            self._launch(target, ins, plan.scalars, kind, dt, dev, shape, n, stream)
            if target is not out:
                if is_torch:
                    out.copy_(target)
                else:
                    out[...] = target
            return out

    @staticmethod
    def _needs_temporary(out, ins, kind, dt, shape):
        """True when out shares memory with an input in any way other than
        element-for-element identity (which is safe in an elementwise kernel)."""
        ost = A.strides_of(out, kind)
        optr = A.pointer_of(out, kind)
        lo, hi = A.extent(optr, shape, ost, dt.itemsize)
        for x in ins:
            if x is None:
                continue
            xst = A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape)
            xptr = A.pointer_of(x, kind)
            xlo, xhi = A.extent(xptr, shape, xst, dt.itemsize)
            if xlo < hi and lo < xhi and not (xptr == optr and list(xst) == list(ost)):
                return True
        return False

    def _launch(self, out, ins, scalars, kind, dt, dev, shape, n, stream):
        optr = A.pointer_of(out, kind)
        ptrs = tuple(0 if x is None else A.pointer_of(x, kind) for x in ins)
        svals = tuple(0.0 if s is None else float(s) for s in scalars)
        ost = A.strides_of(out, kind)
        strides = [list(ost)] + [A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape)
                                 for x in ins if x is not None]
        cshape, cstrides = A.collapse(shape, strides)
        if len(cshape) == 1 and all(st[0] == 1 for st in cstrides):
            fn = self._fn(dt, dev)  # contiguous after collapsing (no broadcast among arrays)
            R.launch(fn, n // self._pack[dt] or 1, dev, (optr, *ptrs, *svals, n), stream)
            return
        if len(cshape) > _STRIDED_NDIM:
            raise ValueError(f"cufuse.{self.name}: the layout needs {len(cshape)} dims after merging "
                             f"contiguous ones; at most {_STRIDED_NDIM} are supported (make an operand contiguous)")
        layout = np.zeros((), dtype=_LAYOUT)
        layout["ndim"] = len(cshape)
        layout["shape"][:len(cshape)] = cshape
        it = iter(cstrides)
        layout["stride"][0, :len(cshape)] = next(it)
        for k, x in enumerate(ins):
            if x is not None:
                layout["stride"][k + 1, :len(cshape)] = next(it)
        fn = self._fn(dt, dev, strided=True)
        R.launch(fn, n, dev, (optr, *ptrs, *svals, n, layout[()]), stream)


def _torch_stream(dev):
    t = A.torch()
    try:
        return t._C._cuda_getCurrentRawStream(dev)
    except Exception:  # private API moved: the public one costs a little more
        return t.cuda.current_stream(dev).cuda_stream


# ------------------------------------------------------------------ the ops
def _relu(v):
    return np.where(v < 0, np.zeros((), v.dtype), v)  # NaN stays NaN, like the kernel


_add_relu = ElementwiseOp("add_relu", "AddRelu", 2, lambda a, b: _relu(a + b))
_mul_tanh = ElementwiseOp("mul_tanh", "MulTanh", 2, lambda a, b: np.tanh(a * b))
_add_mul_exp = ElementwiseOp("add_mul_exp", "AddMulExp", 2, lambda x, y: np.exp((x + y) * 2))
_fma = ElementwiseOp("fma", "Fma", 3, lambda q, k, v: q * k + v)

_COMMON = """
    Operands broadcast as in NumPy and may be Python or NumPy scalars; float16,
    float32 and float64 promote as ``numpy.result_type`` does (float16 is
    computed in float32). Returns the operands' kind: CuPy in, CuPy out; torch
    CUDA in, torch CUDA out (queued on torch's current stream); NumPy or torch
    CPU in, the NumPy fallback. ``out=`` (same kind, result shape and dtype)
    receives the result and may alias an input.
"""


def add_relu(a, b, /, *, out=None):
    return _add_relu(a, b, out=out)


def mul_tanh(a, b, /, *, out=None):
    return _mul_tanh(a, b, out=out)


def add_mul_exp(x, y, /, *, out=None):
    return _add_mul_exp(x, y, out=out)


def fma(q, k, v, /, *, out=None):
    return _fma(q, k, v, out=out)


add_relu.__doc__ = "relu(a + b), fused: one pass over memory.\n" + _COMMON
mul_tanh.__doc__ = "tanh(a * b), fused: one pass over memory.\n" + _COMMON
add_mul_exp.__doc__ = "exp((x + y) * 2), fused: one pass over memory.\n" + _COMMON
fma.__doc__ = "q * k + v, fused (a fused multiply-add): one pass over memory.\n" + _COMMON

OPS = {"add_relu": _add_relu, "mul_tanh": _mul_tanh, "add_mul_exp": _add_mul_exp, "fma": _fma}
