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

import inspect

import numpy as np

from .. import _arrays as A
from .. import _random
from .. import _runtime as R

FAMILY = "elementwise"  # kernels/elementwise.cu; ops may name another family that includes the driver
_STRIDED_NDIM = 8     # kernels/elementwise.cuh: kMaxDims
_SCALAR_SHIFT = 56    # kernels/elementwise.cuh: kScalarShift
_MAX_OPERANDS = 4     # kernels/elementwise.cuh: kMaxOperands
_LAYOUTS: dict = {}  # operand count -> numpy twin of LayoutT<n>
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _compute_dtype(dtype):
    """float16 is computed in float32, like the kernels."""
    return _F32 if dtype == _F16 else dtype


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
                 family=FAMILY, pack_bytes=None, np_dtype=False, packs_per_thread=1, one_wave=False):
        self.name = name
        self.np_dtype = np_dtype
        self.family = family
        self.arity = arity
        self.numpy_impl = numpy_impl
        self.indexed = indexed
        self.signatures = signatures or [(dt, dt) for dt in R.FLOAT_CTYPES]
        self.in_dtypes = tuple(dict.fromkeys(i for i, _ in self.signatures))
        self._pack = {}
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
            if in_dt == out_dt:
                self._expr[in_dt] = self._expr[(in_dt, out_dt)]
                self._pack[in_dt] = self._width[(in_dt, out_dt)]
        self._fast = {}  # (dtype, device) and dtype -> contiguous kernel entry, for same-dtype ops

    def width(self, in_dt, out_dt):
        """Elements per pack of the (input dtype, output dtype) kernels."""
        return self._width[(in_dt, out_dt)]

    # ------------------------------------------------------------ hot path
    def _fn(self, key, device, entry=0):
        """Kernel for ``key`` (an input dtype, or an (input, output) dtype
        pair): ``entry`` 0 contiguous, 1 strided, 2 tiled (Layout.vec)."""
        return R.get_function(*self._expr[key][entry], device)

    def _fast_entry(self, dt, dev):
        """(device, Function, elements per thread (pack width x packs per thread), grid cap,
        itemsize) of the contiguous kernel for
        ``dt`` on ``dev``, or None for a dtype the kernels do not take. Cached
        in ``_fast`` under (dt, dev) and, for the hot path, under dt alone."""
        if dt not in self._pack or self._one_wave[(dt, dt)]:
            return None  # one_wave kernels size their grid on the general path only
        key = (dt, dev)
        ent = self._fast.get(key)
        if ent is None:
            ent = self._fast[key] = (dev, self._fn(dt, dev), self._pack[dt] * self._ppt(dt, dt), R.grid_cap(dev),
                                     dt.itemsize)
        self._fast[dt] = ent
        return ent

    def public(self, params, doc):
        """The public function: a closure holding the fast paths, written flat
        (locals only, one pass over the operands, no helper calls) because at
        100K elements every attribute read counts. Same-shape C-contiguous
        CuPy arrays, or contiguous CUDA tensors, of one float dtype on the
        current device launch straight away; everything else, errors
        included, goes to the general path."""
        arity, fast, general = self.arity, self._fast, self._general
        fast_entry = self._fast_entry
        CupyArray, get_device = A.CupyArray, _get_device
        new_array = R._cp.ndarray if R._cp is not None else None
        torch_dtypes, torch_streams, TORCH = _TORCH_DTYPES, _TORCH_STREAMS, _TORCH

        def op(*args, out=None):
            if len(args) != arity:
                return general(args, out)
            a0 = args[0]
            ta0 = type(a0)
            if ta0 is CupyArray:
                dt = a0.dtype
                a0d = a0.data
                dev = a0d.device_id
                ent = fast.get(dt)
                if ent is None or ent[0] != dev:
                    ent = fast_entry(dt, dev)
                if ent is None or not a0._c_contiguous or dev != get_device():
                    return general(args, out)
                shape = a0.shape
                n = a0.size
                if out is not None:
                    if not (type(out) is CupyArray and (out.dtype is dt or out.dtype == dt) and out._c_contiguous
                            and out.shape == shape):
                        return general(args, out)
                    od = out.data
                    optr, nbytes = od.ptr, n * ent[4]
                    d = a0d.ptr - optr
                    if od.device_id != dev or (d and -nbytes < d < nbytes):  # partial overlap: a temporary
                        return general(args, out)
                for x in args[1:]:
                    if (type(x) is not CupyArray or (x.dtype is not dt and x.dtype != dt)
                            or not x._c_contiguous or x.shape != shape):
                        return general(args, out)
                    xd = x.data
                    if xd.device_id != dev:
                        return general(args, out)
                    if out is not None:
                        d = xd.ptr - optr
                        if d and -nbytes < d < nbytes:
                            return general(args, out)
                if out is None:
                    out = new_array(shape, dt)
                if n:
                    blocks = ((n // ent[2]) + 255) >> 8 or 1
                    ent[1]((blocks if blocks < ent[3] else ent[3],), (256,), (out, *args, n))
                return out
            if ta0 is TORCH[0] and a0.is_cuda:
                # Raw pointers on torch's current stream: no DLPack, no CuPy array.
                dt = torch_dtypes.get(a0.dtype)
                dev = a0.get_device()
                if dt is None or a0.requires_grad or not a0.is_contiguous() or dev != get_device():
                    return general(args, out)
                ent = fast.get(dt)
                if ent is None or ent[0] != dev:
                    ent = fast_entry(dt, dev)
                tdt, shape = a0.dtype, a0.shape
                ptrs = [a0.data_ptr()]
                for x in args[1:]:
                    if (type(x) is not ta0 or x.dtype != tdt or x.requires_grad or not x.is_contiguous()
                            or x.shape != shape or x.get_device() != dev):
                        return general(args, out)
                    ptrs.append(x.data_ptr())
                n = a0.numel()
                if out is None:
                    out = TORCH[1](a0)
                elif (type(out) is ta0 and out.dtype == tdt and not out.requires_grad and out.is_contiguous()
                      and out.shape == shape and out.get_device() == dev):
                    optr, nbytes = out.data_ptr(), n * ent[4]
                    for p in ptrs:
                        d = p - optr
                        if d and -nbytes < d < nbytes:
                            return general(args, out)
                else:
                    return general(args, out)
                if n:
                    raw = TORCH[2](dev)
                    stream = torch_streams.get(raw) or _torch_stream_for(raw, dev)
                    blocks = ((n // ent[2]) + 255) >> 8 or 1
                    ent[1]((blocks if blocks < ent[3] else ent[3],), (256,), (out.data_ptr(), *ptrs, n), 0, stream)
                return out
            if TORCH[0] is None and A.is_torch_tensor(a0):
                _bind_torch()  # first tensor seen: bind torch's fast-path helpers, then retry
                return op(*args, out=out)
            return general(args, out)

        op.__name__ = op.__qualname__ = self.name
        op.__module__ = "cufuse"
        op.__doc__ = doc
        op.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_ONLY) for p in params]
            + [inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None)])
        return op

    def __call__(self, *args, out=None):
        return self._general(args, out)

    # ------------------------------------------------------- general path
    def _general(self, args, out, out_dtype=None, params=(), np_params=None):
        """Validate, then run the kernels or the NumPy fallback. ``out_dtype``
        (default: the promoted input dtype) picks the signature; ``params``
        go to the kernel, ``np_params`` to ``numpy_impl``."""
        if len(args) != self.arity:
            raise TypeError(f"cufuse.{self.name} takes {self.arity} operands, got {len(args)} positional arguments")
        plan = A.plan_elementwise(self.name, args, out, accepted=self.in_dtypes, out_dtype=out_dtype)
        if plan.kind in A.GPU_KINDS:
            return self._run_gpu(plan, params)
        return self._run_fallback(plan, np_params or {})

    def _run_fallback(self, plan, np_params):
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
        with np.errstate(all="ignore"):  # overflow to inf is the answer, as on the GPU
            if self.np_dtype:
                np_params = {**np_params, "dtype": plan.out_dtype}
            res = np.asarray(self.numpy_impl(*vals, **np_params))
            if res.shape != plan.shape:  # all-scalar-but-one 0-d operands
                res = np.array(np.broadcast_to(res, plan.shape))
            res = res.astype(plan.out_dtype, copy=False)
        if plan.out is not None:
            target = plan.out.numpy() if torch_cpu else plan.out
            np.copyto(target, res)
            return plan.out
        return A.torch().from_numpy(res) if torch_cpu else res

    def _run_gpu(self, plan, params):
        cp = R._cp
        kind, dt, odt, dev, shape = plan.kind, plan.dtype, plan.out_dtype, plan.device, plan.shape
        is_torch = kind == A.TORCH_CUDA
        keep = []  # temporaries that must outlive the launch call
        with cp.cuda.Device(dev):
            out = plan.out
            if out is None:
                out = _empty(shape, odt, kind, dev)
            if plan.size == 0:
                return out
            ins = []
            for x in plan.operands:
                if x is not None and A.dtype_of(x, kind) != dt:  # mixed float dtypes: cast once
                    x = x.to(A.numpy_to_torch_dtype(dt)) if is_torch else x.astype(dt)
                    keep.append(x)
                ins.append(x)
            target = out
            if self._needs_temporary(out, ins, kind, dt, odt, shape):
                target = _empty(shape, odt, kind, dev)
            stream = R.external_stream(_torch_stream(dev), dev) if is_torch else None
            self._launch(target, ins, plan, params, stream)
            if target is not out:
                _copy_into(out, target, kind)
            return out

    @staticmethod
    def _needs_temporary(out, ins, kind, dt, odt, shape):
        return needs_temporary(out, odt, ins, [dt] * len(ins), kind, shape)

    def _launch(self, out, ins, plan, params, stream):
        kind, dt, odt, dev, shape, n = plan.kind, plan.dtype, plan.out_dtype, plan.device, plan.shape, plan.size
        optr = A.pointer_of(out, kind)
        # The kernels' calling convention (kernels/elementwise.cuh): a scalar
        # travels as the bits of a double in its input's pointer slot, flagged
        # in the high bits of the count.
        ptrs = tuple(int(np.float64(s).view(np.int64)) if x is None else A.pointer_of(x, kind)
                     for x, s in zip(ins, plan.scalars))
        nm = n
        for k, x in enumerate(ins):
            if x is None:
                nm |= 1 << (_SCALAR_SHIFT + k)
        ost = A.strides_of(out, kind)
        strides = [list(ost)] + [A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape)
                                 for x in ins if x is not None]
        cshape, cstrides = A.collapse(shape, strides)
        contiguous = len(cshape) == 1 and all(st[0] == 1 for st in cstrides)
        if contiguous and (not self.indexed or A.is_c_contiguous(shape, ost)):
            fn = self._fn((dt, odt), dev)  # one dense run (indexed ops: in C order)
            work = n // (self._width[(dt, odt)] * self._ppt(dt, odt)) or 1
            if self._one_wave[(dt, odt)]:
                work = min(work, R.resident_threads(fn, dev))
            R.launch(fn, work, dev, (optr, *ptrs, nm, *params), stream)
            return
        if len(cshape) > _STRIDED_NDIM:
            # More dims than the strided kernel indexes: copy the operands to
            # C-contiguous arrays of the result shape, compute, copy back.
            dense = [None if x is None else _dense(x, shape, kind) for x in ins]
            tmp = _empty(shape, odt, kind, dev)
            self._launch(tmp, dense, plan, params, stream)
            _copy_into(out, tmp, kind)
            return
        it = iter(cstrides)
        parts = [(optr, next(it), odt.itemsize)]
        parts += [None if x is None else (ptrs[k], next(it), dt.itemsize) for k, x in enumerate(ins)]
        layout, work = strided_layout(_MAX_OPERANDS, cshape, parts, self._width[(dt, odt)], n)
        fn = self._fn((dt, odt), dev, 2 if layout["vec"] == 2 else 1)
        R.launch(fn, -(-work // self._ppt(dt, odt)), dev, (optr, *ptrs, nm, layout, *params), stream)

    def _ppt(self, in_dt, out_dt):
        """Packs per thread of the (input dtype, output dtype) kernels."""
        return self._per_thread[(in_dt, out_dt)]


def needs_temporary(out, odt, ins, in_dtypes, kind, shape):
    """True when ``out`` (dtype ``odt``, the result ``shape``) shares memory with
    an input (``None`` entries are scalars) in any way other than
    element-for-element identity, which is safe in an elementwise kernel."""
    ost = A.strides_of(out, kind)
    optr = A.pointer_of(out, kind)
    lo, hi = A.extent(optr, shape, ost, odt.itemsize)
    for x, dt in zip(ins, in_dtypes):
        if x is None:
            continue
        xst = A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape)
        xptr = A.pointer_of(x, kind)
        xlo, xhi = A.extent(xptr, shape, xst, dt.itemsize)
        if xlo < hi and lo < xhi and not (xptr == optr and list(xst) == list(ost) and dt == odt):
            return True
    return False


def layout_dtype(nops):
    """numpy twin of kernels/elementwise.cuh LayoutT<nops> (the hand-written
    kernels: nops = 4, kMaxOperands; a generated kernel: its operand count)."""
    dt = _LAYOUTS.get(nops)
    if dt is None:
        nd = _STRIDED_NDIM
        dt = _LAYOUTS[nops] = np.dtype({"names": ["shape", "stride", "magic", "ndim", "vec"],
                                        "formats": [(np.int64, (nd,)), (np.int64, (nops, nd)), (np.uint64, (nd,)),
                                                    np.int32, np.int32]}, align=True)
    return dt


def layout(nops, cshape, cstrides, vec):
    """A LayoutT<nops> record: collapsed shape and per-operand strides (dim 0
    innermost; rows of None stay zero), traversal ``vec``."""
    L = np.zeros((), dtype=layout_dtype(nops))
    nd = len(cshape)
    L["ndim"] = nd
    L["shape"][:nd] = cshape
    L["magic"][:nd] = [A.fast_div_magic(d) for d in cshape]
    for k, st in enumerate(cstrides):
        if st is not None:
            L["stride"][k, :nd] = st
    L["vec"] = vec
    return L


def strided_layout(nops, cshape, parts, vec, n, nout=1):
    """(LayoutT<nops> record, threads) for the strided kernels. ``parts``: per
    operand (pointer, collapsed strides, itemsize), the ``nout`` outputs
    first; None for a scalar input's slot. The traversal (kernels/
    elementwise.cuh, LayoutT): tiles (2) when the outputs are C-contiguous and
    every input an array that repeats a contiguous block, else packs along dim 0 (1) when
    they fit, else one element per thread (0). A thread per pack, not per
    element: bias_gelu with a (1024,) bias at 50M went from 168 to 154 µs
    (float32) on an H200 with packs, and to 105 µs with tiles."""
    tiles = _tiles(cshape, parts, vec, n, nout)
    if tiles is not None:
        L = layout(nops, cshape, [], 2)
        for k, row in enumerate(tiles):
            L["stride"][k, :5] = row
        return L[()], n // vec
    strides = [None if p is None else p[1] for p in parts]
    if any(p[1][0] == 0 for p in parts[:nout]) or not _packs_fit(cshape, parts, vec):
        return layout(nops, cshape, strides, 0)[()], n
    return layout(nops, cshape, strides, 1)[()], n // vec


def _tiles(cshape, parts, vec, n, nout):
    """Per operand [pack, div, mod, magic(div), magic(mod)] for tile mode, or
    None. Operand k's element for logical index i is (i / div) % mod: the
    outputs are C-contiguous (div 1, mod n) and each input's
    strides are 0 on the dims inside and outside one run of dims over which
    it is contiguous. A pack of ``vec`` elements then reads ``vec``
    consecutive elements (div 1, and the block a multiple of ``vec`` long,
    aligned) or one (div a multiple of ``vec``)."""
    if n % vec or n >= 2**31:  # the kernels index tiles in 32 bits
        return None
    if any(p is None for p in parts):
        return None  # the tiled kernels take arrays only (no scalar decoding in them)
    rows = []
    for k, (ptr, st, itemsize) in enumerate(parts):
        a = 0
        while a < len(cshape) and st[a] == 0:
            a += 1
        b, expect = a, 1
        while b < len(cshape) and st[b] == expect:
            expect *= cshape[b]
            b += 1
        if any(st[d] for d in range(b, len(cshape))):
            return None
        div, mod = A.count(cshape[:a]), expect  # mod: the block's length (n // div: no wrap)
        if k < nout and (a or b < len(cshape)):
            return None
        if div == 1 and a < len(cshape):
            if mod % vec or ptr % min(vec * itemsize, 16):
                return None
            pack = 1
        elif div % vec == 0 or a == len(cshape):
            pack = 0
        else:
            return None
        rows.append([pack, div, mod, A.fast_div_magic(div), A.fast_div_magic(mod)])
    return rows


def _packs_fit(cshape, parts, vec):
    """Can the strided kernel walk dim 0 in packs of ``vec``? Its size must be
    a multiple of ``vec``; the output and each input must be contiguous (or,
    for inputs, broadcast) along it, with every pack start aligned as the
    kernel's Pack type is (its size, at most 16 bytes)."""
    if cshape[0] % vec:
        return 0
    for k, part in enumerate(parts):
        if part is None:
            continue  # a scalar
        ptr, st, itemsize = part
        if st[0] == 0 and k > 0:
            continue  # one value broadcast over each pack
        align = min(vec * itemsize, 16)
        if st[0] != 1 or ptr % align or any((s * itemsize) % align for s in st[1:]):
            return 0
    return 1


def _empty(shape, dtype, kind, dev):
    if kind == A.TORCH_CUDA:
        return A.torch().empty(shape, dtype=A.numpy_to_torch_dtype(dtype), device=f"cuda:{dev}")
    return R._cp.ndarray(shape, dtype)


def _dense(x, shape, kind):
    """``x`` broadcast to ``shape`` as a C-contiguous copy."""
    if kind == A.TORCH_CUDA:
        return x.expand(shape).contiguous()
    return R._cp.ascontiguousarray(R._cp.broadcast_to(x, shape))


def _copy_into(out, src, kind):
    if kind == A.TORCH_CUDA:
        out.copy_(src)
    else:
        out[...] = src


_get_device = R._cp.cuda.runtime.getDevice if R._cp is not None else None

# torch fast-path helpers, bound when the first tensor is seen (cufuse never
# imports torch itself): [torch.Tensor, torch.empty_like, raw current stream getter, torch.empty].
_TORCH = [None, None, None, None]
_TORCH_DTYPES: dict = {}   # torch float dtype -> numpy dtype
_TORCH_STREAMS: dict = {}  # raw stream handle -> CuPy stream object


def _bind_torch():
    t = A.torch()
    _TORCH_DTYPES.update({t.float16: np.dtype(np.float16), t.float32: np.dtype(np.float32),
                          t.float64: np.dtype(np.float64)})
    _TORCH[1] = t.empty_like
    _TORCH[3] = t.empty
    _TORCH[2] = getattr(t._C, "_cuda_getCurrentRawStream", None) or (
        lambda dev: t.cuda.current_stream(dev).cuda_stream)
    _TORCH[0] = t.Tensor


def _torch_stream_for(raw, dev):
    s = _TORCH_STREAMS[raw] = R.external_stream(raw, dev)
    return s


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


add_relu = _add_relu.public("ab", "relu(a + b), fused: one pass over memory.\n" + _COMMON)
mul_tanh = _mul_tanh.public("ab", "tanh(a * b), fused: one pass over memory.\n" + _COMMON)
add_mul_exp = _add_mul_exp.public("xy", "exp((x + y) * 2), fused: one pass over memory.\n" + _COMMON)
fma = _fma.public("qkv", "q * k + v, fused (a fused multiply-add): one pass over memory.\n" + _COMMON)


# ------------------------------------------------------------ GELU family
_SQRT_2_OVER_PI = 0.79788456080286535588


def _special(name, v):
    """erf / erfc on NumPy arrays: SciPy's when installed, else math's per element."""
    try:
        import scipy.special as lib
    except ImportError:
        import math
        f = np.frompyfunc(getattr(math, name), 1, 1)
    else:
        f = getattr(lib, name)
    return np.asarray(f(v), dtype=v.dtype)  # (math's: per element, in float64)


def _erf(v):
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


def _mask_bits(dtype, lanes16):
    """Bits of Philox output per element of gelu_dropout's mask (kernels/dropout.cu Bits)."""
    return 16 if lanes16 and dtype == _F16 else 32


def _dropout_numpy(x, *, approximate, seed, threshold, scale, dtype, lanes16):
    g = gelu_numpy(x, approximate)
    bits = _mask_bits(dtype, lanes16)
    keep = (_random.philox_lanes(seed, x.size, bits) >= threshold >> (32 - bits)).reshape(x.shape)
    return np.where(keep, g * x.dtype.type(scale), x.dtype.type(0))


# Packs per thread (ElementwiseOp's packs_per_thread): 4 for float16, else 1.
# H200, 50M as (rows, 1024), % of copy, 1 -> 4 (scratch/ew_probe.py, two
# rounds alike): bias_gelu with a row bias, float16 erf 76.3 -> 82.6, tanh
# 87.8 -> 92.2 (float32 96.8 / 98.4 at 1, 95.9 / 96.2 at 4); gelu_dropout
# float16 62.6 -> 67.8, float32 85.3 -> 92.6.
def _bias_gelu_ppt(in_dt, out_dt):
    return 4 if out_dt == _F16 else 1


_bias_gelu_ops = {
    False: ElementwiseOp("bias_gelu", lambda i, o: f"BiasGeluErf<{R.CTYPES[o]}>", 2,
                         lambda x, b: gelu_numpy(x + b, "none"), packs_per_thread=_bias_gelu_ppt),
    True: ElementwiseOp("bias_gelu", "BiasGeluTanh", 2, lambda x, b: gelu_numpy(x + b, "tanh"),
                        packs_per_thread=_bias_gelu_ppt),
}
_bias_gelu = {t: op.public("xb", "") for t, op in _bias_gelu_ops.items()}
_dropout_ops = {  # (tanh, lanes16): float32/float64 results take 32-bit lanes either way
    (t, l16): ElementwiseOp(
        "gelu_dropout",
        lambda i, o, t=t, l16=l16: f"GeluDropout<{'true' if t else 'false'}, {R.CTYPES[o]}, {_mask_bits(o, l16)}>",
        1, _dropout_numpy, params=("unsigned long long", "unsigned long long", "double", "float", "float"),
        indexed=True,
        family="dropout", np_dtype=True, packs_per_thread=lambda i, o: 1 if o == _F64 else 4)
    for t in (False, True) for l16 in (False, True)
}


def bias_gelu(x, bias, /, approximate="none", *, out=None):
    """gelu(x + bias), fused: one pass over memory.

    ``approximate``: "none" (0.5 v (1 + erf(v / sqrt 2))) or "tanh"
    (0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v**3)))), PyTorch's definitions.
    ``bias`` broadcasts (usually along the last axis).
    """
    return _bias_gelu[_check_approximate("bias_gelu", approximate)](x, bias, out=out)


def gelu_dropout(x, /, p=0.1, training=True, seed=None, approximate="none", *, out=None):
    """dropout(gelu(x)), fused: one pass over memory.

    Each element is kept with probability 1 - p and scaled by 1 / (1 - p);
    dropped elements are exactly 0. ``training=False`` or ``p=0`` gives plain
    GELU. The mask is a function of (seed, element index, result dtype) only:
    element i (its C-order position in ``x``) is kept iff lane i % L of
    Philox4x32-10 at counter i // L under the 64-bit key ``seed`` is
    >= floor(p * 2**B), the same on the GPU and in the NumPy fallback. The
    lanes are B-bit: B = 16 (L = 8, each word's low half, then its high
    half) for float16 results with 1/32 <= p <= 31/32, whose speed is bound
    by the generator's arithmetic; B = 32 (L = 4, the four words) otherwise.
    ``seed=None`` draws the next
    seed from cufuse's generator (``cufuse.manual_seed`` makes it reproducible).
    ``approximate`` as in ``bias_gelu``. Takes one array; ``out=`` as in the other ops.
    """
    tanh = _check_approximate("gelu_dropout", approximate)
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"cufuse.gelu_dropout: p must be a float in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"cufuse.gelu_dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return _bias_gelu[tanh](x, 0.0, out=out)
    seed = _random.next_seed() if seed is None else _random.check_seed(seed, "cufuse.gelu_dropout")
    # floor(p * 2**32): exact, p * 2**32 is a scaled double; 16-bit lanes
    # compare with threshold >> 16 = floor(p * 2**16)
    threshold = int(p * 4294967296.0)
    scale = 1.0 / (1.0 - p)
    # the float kernels' scale and its log2, which they fold into the erf
    # tail's exponent (kernels/common.cuh: gelu_normal): once here rather than
    # a conversion and a log2f in every thread
    scale_f = np.float32(scale)
    lift = np.float32(np.log2(float(scale_f)))
    lanes16 = _LANE16_P[0] <= p <= _LANE16_P[1]
    return _dropout_ops[tanh, lanes16]._general(
        (x,), out, params=(np.uint64(seed), np.uint64(threshold), scale, scale_f, lift),
        np_params={"approximate": approximate, "seed": seed, "threshold": threshold, "scale": scale,
                   "lanes16": lanes16})


bias_gelu.__doc__ += _COMMON

OPS = {"add_relu": _add_relu, "mul_tanh": _mul_tanh, "add_mul_exp": _add_mul_exp, "fma": _fma,
       "bias_gelu": _bias_gelu_ops[False], "bias_gelu_tanh": _bias_gelu_ops[True],
       "gelu_dropout": _dropout_ops[False, False], "gelu_dropout_tanh": _dropout_ops[True, False],
       "gelu_dropout_lanes16": _dropout_ops[False, True], "gelu_dropout_tanh_lanes16": _dropout_ops[True, True]}
