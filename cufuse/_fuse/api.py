"""``cufuse.fuse``: trace once per signature, generate one kernel, launch it.

A signature is the kinds of the arguments: each array's dtype and number of
dimensions, each scalar's type (Python float, Python int, bool, or a NumPy
scalar's dtype). Layout (strides, broadcasting, offsets) and scalar values are
not part of it: the generated functor runs on the driver's contiguous,
strided and segmented (horizontal) paths, and scalars are kernel arguments.
"""
from __future__ import annotations

import functools
import itertools
import logging
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import _arrays as A
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _autograd as AG
from .. import _torch_ops as TO
from . import codegen, grad, graph as G
from .numpy_eval import evaluate

_log = logging.getLogger("cufuse")
_PLANS_MAX = 8           # foreach launch plans kept per Fused
# An object's address (rotated; distinct for live objects), for the keys of
# foreach's plans. Not id(): id() raises an audit event, and once a Python
# audit hook is installed (torch.compile installs one) the key of 192 arrays
# took 30 µs instead of 5 (Python 3.12, H200 host); this takes ~10 either way.
_address = object.__hash__
# Packs per thread of the horizontal kernel: the fastest of 1-16
# (bench/NOTES.md, "Figures from code comments").
SEGMENT_PACKS = 4


class _Signature:
    """One traced signature: its graph, and its kernels per device."""

    def __init__(self, fused, spec, torch_float=None):
        self.fused = fused
        self.graph = G.trace(fused.fn, spec, torch_float)
        # a recipe of this signature serves a call only under the same torch default dtype
        self.default_float = torch_float if self.graph.uses_default else None
        self.in_dtypes = [d for _, d, _ in self.graph.inputs]
        self.in_pos = [p for p, _, _ in self.graph.inputs]
        self.out_dtypes = [o[3] for o in self.graph.outputs]
        self.V = codegen.pack_width(self.graph, self.in_dtypes)
        # per parameter: (argument position, converter, None), (-1, converter, constant value) or
        # (-2, converter, HostExpr: a Python number Python computes from the arguments at each call)
        conv = {"double": float, "long long": int}
        self.params = [(src[1], conv[ck], None) if src[0] == "arg" else
                       (-2, conv[ck], src[1]) if src[0] == "host" else (-1, conv[ck], conv[ck](src[1]))
                       for src, ck in self.graph.params]
        # NumPy 2's checks of scalar values (graph.checks), and every int in int64; the
        # literals' are done here, once
        checks = [(k, _I64, "both") for k, (_, ck) in enumerate(self.graph.params) if ck == "long long"]
        checks += self.graph.checks
        self._check_params([c for _, _, c in self.params], [c for c in checks if self.params[c[0]][0] == -1])
        self.checks = [c for c in checks if self.params[c[0]][0] != -1]
        self._source = None
        self._sources = {}
        self._fns = {}
        self.backwards: dict = {}  # positions differentiated -> the backward's Fused (cufuse/_fuse/grad.py)

    @property
    def source(self):
        if self._source is None:
            self._source = codegen.source(self.graph, self.in_dtypes)
        return self._source

    def function(self, name, device):
        fn = self._fns.get((name, device))
        if fn is None:
            src = self._sources.get(name)
            if src is None:
                src = self._sources[name] = codegen.source(self.graph, self.in_dtypes, name)
            mod, how = R.generated_module(src, device, what=f"cufuse.fuse({self.fused.__name__}) {name}")
            st = self.fused.stats
            st[{"compiled": "compiles", "disk": "disk_loads", "memory": "shared"}[how]] += 1
            with R._cp.cuda.Device(device):
                fn = self._fns[(name, device)] = mod.get_function(name)
        return fn

    def param_values(self, args):
        vals = [conv(args[i]) if i >= 0 else c if i == -1 else self._host_value(c, conv, args)
                for i, conv, c in self.params]
        if self.checks:
            self._check_params(vals, self.checks)
        return vals

    def _host_value(self, h, conv, args):
        """The value of the HostExpr ``h`` at this call, as Python computes it, in the type it was traced
        with (a kernel's parameter has one type); ValueError where Python's result has another."""
        v = h.fn(args)
        if type(v) is not h.kind:
            hint = ("; in Python an integer to a negative integer power is a float: write a float base or "
                    "exponent (2.0 ** k)" if h.kind is int and isinstance(v, float) else "")
            text = h.text[1:-1] if h.text.startswith("(") else h.text
            raise ValueError(f"cufuse.{self.fused._name}: {text} is {v!r} ({type(v).__name__}) at this call, "
                             f"where the fused function computes it as a Python {h.kind.__name__} (Python's type "
                             f"for operands of these types): a kernel parameter has one type at every call{hint}")
        return conv(v)

    def _check_params(self, vals, checks):
        for k, dt, side in checks:
            v = vals[k]
            if dt is None:
                if v < 0:
                    raise ValueError(f"cufuse.{self.fused._name}: integers to negative integer powers are not "
                                     f"allowed (exponent {v}), as in NumPy; use a float base or exponent")
            else:
                lo, hi = _INT_RANGE[dt]
                if (side != "lo" and v < lo) or (side != "hi" and v > hi):
                    if dt == _I64:
                        why = "; int64 is the widest integer a fused kernel computes with"
                    elif self.graph.torch_float is not None:
                        why = (" (torch.clip and torch.where take a scalar that fits the tensor's type); "
                               "cast the tensor first for a wider result")
                    else:
                        why = (", as in NumPy 2 (a Python int takes the array's type); cast the array first "
                               "(x.astype(numpy.int64)) for a wider result")
                    raise OverflowError(f"cufuse.{self.fused._name}: Python integer {v} out of bounds for "
                                        f"{dt.name}{why}")


_I64, _F64 = np.dtype(np.int64), np.dtype(np.float64)
_INT_RANGE = {dt: (-(1 << (8 * dt.itemsize - 1)), (1 << (8 * dt.itemsize - 1)) - 1) if dt.kind == "i"
              else (0, (1 << (8 * dt.itemsize)) - 1) for dt in G.INPUT_DTYPES if dt.kind in "iu"}


def _type_name(x):
    """``x``'s type as an error names it: ``bool``, ``numpy.bool``, ``numpy.float32``."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _scalar_spec(x):
    """("scalar", dtype, weak, whether it is a Python number: Python's operators compute with it), or
    None for a value that is no scalar fuse takes."""
    if isinstance(x, (bool, np.bool_)):
        return ("scalar", np.dtype(np.bool_), False, type(x) is bool)
    if isinstance(x, A.NP_SCALARS):  # before float: numpy.float64 is a float
        dt = np.dtype(type(x))
        return ("scalar", dt, False, False) if dt in G.INPUT_DTYPES else None
    if isinstance(x, int):
        return ("scalar", np.dtype(np.int64), True, True)
    if isinstance(x, float):
        return ("scalar", np.dtype(np.float64), True, True)
    return None


class _BackwardPlan(NamedTuple):
    fn: object         # the backward Fused (None: no position in ``need`` is differentiable)
    wrt: tuple         # the argument positions it writes gradients of
    n: float           # the last dim of the broadcast shape (the backward's row length argument)
    unsqueeze: tuple   # per output: its incoming gradient gets a trailing 1 (a reduction without keepdims)
    into: bool         # each gradient may be written into its argument (contiguous CUDA tensors of its shape, dtype)
    # where ``into``: per tensor argument (its index among the call signature's pointers, its view's
    # [lo, hi) bytes from its address), and the index in that list of each ``wrt`` position
    spans: tuple = ()
    wrt_tensors: tuple = ()


def _shares_bytes(plan, ptrs):
    """A tensor argument a gradient would be written into shares a byte with
    another argument (the same tensor given twice included), from the call's
    pointers and the plan's byte spans: the gradients then get memory of
    their own."""
    ext = [(ptrs[k] + lo, ptrs[k] + hi) for k, lo, hi in plan.spans]
    return any(ext[i][0] < ext[j][1] and ext[j][0] < ext[i][1]
               for i in plan.wrt_tensors for j in range(len(ext)) if j != i)


class Fused:
    """A function traced and compiled by ``cufuse.fuse``; see ``cufuse.fuse``."""

    def __init__(self, fn, name=None):
        if not callable(fn):
            raise TypeError(f"cufuse.fuse: expected a function, got {type(fn).__module__}.{type(fn).__name__}")
        self.fn = fn
        try:
            functools.update_wrapper(self, fn)
        except AttributeError:  # pragma: no cover - exotic callables
            pass
        self.__name__ = name or getattr(fn, "__name__", "fused")
        # traces; kernel modules compiled, loaded from disk, or shared with another Fused of
        # the same structure in this process; launches (GPU)
        self.stats = {"traces": 0, "compiles": 0, "disk_loads": 0, "shared": 0, "launches": 0, "foreach_checks": 0}
        self._sigs: dict = {}
        self.fast = D.FastPath(f"fuse({self.__name__})")
        self._plans: dict = {}
        self._bwd_plans: dict = {}  # (call signature, positions) -> _BackwardPlan
        self._grad_ok: set = set()  # call signatures (grad mode off) whose function is differentiable
        self._op_key = TO.fused_key(self)  # its name for torch.ops.cufuse.fused (torch.compile)

    def __repr__(self):
        return f"<cufuse.fuse of {getattr(self.fn, '__qualname__', self.fn)!r}>"

    @property
    def _name(self):
        return f"fuse({self.__name__})"

    # ------------------------------------------------------------ classify
    def _classify(self, args):
        """(kind, spec, arrays, device): the arguments' array kind, the signature,
        [(position, array)], the GPU. Raises before anything runs. (Tensors
        that require grad pass: a call records its gradient before it gets
        here, the others read only dtypes and shapes, or refuse them first.)"""
        name = self._name
        kind, first, spec, arrays = None, None, [], []
        for i, x in enumerate(args):
            s = _scalar_spec(x)
            if s is not None:
                spec.append(s)
                continue
            try:
                k = A.kind_of(x)
            except TypeError as e:
                raise TypeError(f"cufuse.{name}: argument {i + 1}: {e}") from None
            except ValueError as e:  # (a structured array's field)
                raise ValueError(f"cufuse.{name}: argument {i + 1}: {e}") from None
            if k in (A.TORCH_CPU, A.TORCH_CUDA) and A.functorch_wrapped(x):
                raise TypeError(f"cufuse.{name}: argument {i + 1} is a tensor of a torch.func transform (vmap, "
                                "grad, ...), which cufuse.fuse does not support")
            if k is None:  # a scalar kind_of accepts but we do not (e.g. np.float128)
                raise TypeError(f"cufuse.{name}: argument {i + 1}: {type(x).__name__} scalars are not accepted; "
                                f"pass a Python int, float or bool, or a NumPy scalar of {G.DTYPE_NAMES}")
            dt = A.dtype_of(x, k)
            if not isinstance(dt, np.dtype) or dt not in G.INPUT_DTYPES:
                raise TypeError(f"cufuse.{name}: argument {i + 1} is {A.describe(x, k)}; accepted dtypes are "
                                f"{G.DTYPE_NAMES}")
            if kind is None:
                kind, first = k, i
            elif k != kind:
                raise TypeError(f"cufuse.{name}: mixed array kinds: argument {first + 1} is "
                                f"{A.describe(args[first], kind)} and argument {i + 1} is {A.describe(x, k)}; "
                                "convert one (cufuse.from_torch / cufuse.to_torch, cupy.asarray, .get())")
            spec.append(("array", dt, x.ndim))
            arrays.append((i, x))
        if kind is None:
            raise TypeError(f"cufuse.{name}: at least one argument must be an array (numpy.ndarray, "
                            "cupy.ndarray or torch.Tensor); got only scalars")
        device = None
        if kind in A.GPU_KINDS:
            device = A.device_of(arrays[0][1], kind)
            for i, x in arrays[1:]:
                if A.device_of(x, kind) != device:
                    raise ValueError(f"cufuse.{name}: arguments on different GPUs: argument {arrays[0][0] + 1} "
                                     f"on GPU {device}, argument {i + 1} on GPU {A.device_of(x, kind)}")
        if kind in (A.TORCH_CPU, A.TORCH_CUDA):
            # torch's rules: a NumPy scalar is a number, as a Python one (but NumPy's operators compute with it)
            spec = [("scalar", _I64 if s[1].kind in "iu" else _F64, True, False)
                    if s[0] == "scalar" and not s[2] and s[1].kind in "iuf" else s for s in spec]
        return kind, tuple(spec), arrays, device

    def _signature(self, spec, nargs, kind):
        """The traced signature of ``spec``: NumPy's type rules, or torch's with
        torch's default float dtype for torch tensors."""
        torch_float = (A.torch_to_numpy_dtype(A.torch().get_default_dtype())
                       if kind in (A.TORCH_CPU, A.TORCH_CUDA) else None)
        key = (spec, torch_float)
        sig = self._sigs.get(key)
        if sig is None:
            try:
                import inspect
                inspect.signature(self.fn).bind(*range(nargs))
            except TypeError as e:
                raise TypeError(f"cufuse.{self._name}: {e}") from None
            except ValueError:  # builtins without a signature: let the call say
                pass
            sig = _Signature(self, spec, torch_float)
            self.stats["traces"] += 1
            _log.debug("cufuse: traced %s for %s", self._name, spec)
            self._sigs[key] = sig
        return sig

    # -------------------------------------------------------------- calls
    def source(self, *args: Any) -> str:
        """The generated CUDA source for these arguments' signature (no GPU needed)."""
        kind, spec, _, _ = self._classify(args)
        return self._signature(spec, len(args), kind).source

    def __call__(self, *args: Any, out: Any = None, **kwargs: Any) -> Any:
        if kwargs:  # (the signature and the trace are positional)
            raise TypeError(f"cufuse.{self._name}: pass the arguments positionally (out= is the one keyword); got "
                            f"{', '.join(sorted(kwargs))}=")
        if TO.compiling():  # torch.compile: the registered operator (cufuse/_torch_ops.py)
            return TO.fused_call(self, args, out)
        # Fast path: a signature seen before (arrays' dtypes, shapes, strides,
        # alignment, devices; scalars' types; out's) launches its recipe with
        # this call's pointers and scalar values.
        multi = type(out) is tuple or type(out) is list
        s = D.signature((*args, *out) if multi else (*args, out))
        if s is None:
            return self._call(args, out, None)
        key, ptrs = (s[0], multi), s[1]
        nout = len(out) if multi else (out is not None)
        outs = (tuple(out) if multi else (out,)) if nout else None
        rec = self.fast.lookup(key, ptrs, len(ptrs) - nout, outs)
        if rec is None:
            return self._call(args, out, key)
        sig = rec.extra
        if sig.default_float is not None and A.torch_to_numpy_dtype(A.torch().get_default_dtype()) != sig.default_float:
            return self._call(args, out, None)  # torch.set_default_dtype since: traced again
        try:
            values = sig.param_values(args)
        except (OverflowError, TypeError, ValueError):
            return self._call(args, out, None)
        res = D.execute(rec, outs, ptrs[:len(ptrs) - nout], values, args[0] if args else None)
        self.stats["launches"] += len(rec.steps)
        return tuple(res) if rec.extra.graph.tuple_out else res[0]

    def _shapes(self, arrays, sig, broadcast=np.broadcast_shapes):
        """(the broadcast shape, the outputs' shapes); ``broadcast``: how to
        broadcast the arrays' shapes (torch's for symbolic shapes)."""
        try:
            shape = tuple(broadcast(*[tuple(x.shape) for _, x in arrays]))
        except (ValueError, RuntimeError):
            shapes = ", ".join(f"{tuple(x.shape)} (argument {i + 1})" for i, x in arrays)
            raise ValueError(f"cufuse.{self._name}: argument shapes {shapes} do not broadcast together") from None
        g = sig.graph
        if not g.reduction:
            return shape, [shape] * len(g.outputs)
        outs = []
        for k, (node, kind, keep, _) in enumerate(g.outputs):
            if kind in ("max", "min") and shape[-1] == 0 and A.count(shape[:-1]):
                raise ValueError(f"cufuse.{self._name}: {kind} over an empty last axis (size 0): a zero-size "
                                 "reduction has no identity")
            if kind == "sum":
                self._check_summed_axis(g, k, node, arrays, shape)
            outs.append(shape[:-1] + ((1,) if keep else ()))
        return shape, outs

    def _check_summed_axis(self, g, k, node, arrays, shape):
        """ValueError where output ``k`` sums values whose arguments all have
        size 1 on the last axis while the broadcast shape does not: the kernel
        reduces the broadcast shape's last axis, so each value would count once
        per column, where NumPy and torch count it once."""
        if shape[-1] == 1 or not A.count(shape[:-1]):  # (no rows: nothing is summed)
            return
        given = dict(arrays)
        own = [tuple(given[g.inputs[i][0]].shape) for i in G.input_deps(g, node)]
        if any(s and s[-1] != 1 for s in own):
            return
        which = f"output {k}" if g.tuple_out else "the result"
        raise ValueError(f"cufuse.{self._name}: {which} sums over the last axis values that do not vary along "
                         f"it: the arguments they are computed from have size 1 there (shapes "
                         f"{', '.join(str(s) for s in own)}), the broadcast shape {tuple(shape)} has "
                         f"{shape[-1]}, and each value would count {shape[-1]} times (NumPy and torch count it "
                         "once); sum them apart, or broadcast them first")

    def _outs(self, sig, out, kind, shapes, device):
        g = sig.graph
        nout = len(g.outputs)
        if out is None:
            return [None] * nout
        if g.tuple_out:
            if not isinstance(out, (tuple, list)) or len(out) != nout:
                raise TypeError(f"cufuse.{self._name}: out must be a tuple of {nout} arrays (the function "
                                f"returns {nout}); got {type(out).__name__}")
            outs = list(out)
        else:
            if isinstance(out, (tuple, list)):
                if len(out) != 1:
                    raise TypeError(f"cufuse.{self._name}: out must be one array; got {len(out)}")
                out = out[0]
            outs = [out]
        for o, shape, dt in zip(outs, shapes, sig.out_dtypes):
            A.check_out(self._name, o, kind, dt, shape, device)
        return outs

    def _call(self, args, out, key=None):
        if G.tracing() is not None and any(isinstance(a, G.Traced) for a in args):
            # called inside another fused function: traced inline, into its kernel
            if out is not None:
                raise G.TraceError(f"cufuse.{self._name}: out= is not supported when a fused function is "
                                   "called inside another one")
            return self.fn(*args)
        if DK.any_dask(args):
            return self._dask(args, out)
        if AG.wants_grad(args):  # recorded for backward: cufuse/_autograd.py fused_apply
            AG.no_out(self._name, out)
            return self._recorded(args)
        kind, spec, arrays, device = self._classify(args)
        sig = self._signature(spec, len(args), kind)
        shape, out_shapes = self._shapes(arrays, sig)
        outs = self._outs(sig, out, kind, out_shapes, device)
        params = sig.param_values(args)
        if kind in A.GPU_KINDS:
            res = self._run_gpu(sig, kind, device, arrays, params, shape, out_shapes, outs, key)
        else:
            res = self._run_numpy(sig, kind, arrays, params, shape, outs)
        return tuple(res) if sig.graph.tuple_out else res[0]

    def _check_item(self, args, out):
        """A call's checks on ``args`` and ``out`` (its errors), running nothing."""
        kind, spec, arrays, device = self._classify(args)
        sig = self._signature(spec, len(args), kind)
        _, out_shapes = self._shapes(arrays, sig)
        self._outs(sig, out, kind, out_shapes, device)

    def _result_meta(self, args, broadcast=np.broadcast_shapes):
        """[(shape, NumPy dtype)] of the outputs of a call on ``args`` (tensors
        may be fake: only their dtypes, ranks, shapes and devices are read),
        and whether the function returns a tuple."""
        kind, spec, arrays, _ = self._classify(args)
        sig = self._signature(spec, len(args), kind)
        _, shapes = self._shapes(arrays, sig, broadcast)
        return list(zip(shapes, sig.out_dtypes)), sig.graph.tuple_out

    # ------------------------------------------------------------ autograd
    def _recorded(self, args, into_inputs=False):
        """The call recorded for autograd (cufuse/_autograd.py fused_apply,
        whose forward asks ``_differentiable_once`` first); ``into_inputs``:
        its backward writes each gradient into its argument's memory where it
        can."""
        return AG.fused_apply(self, args, into_inputs)

    def _differentiable(self, args):
        """The argument positions the outputs depend on through differentiable
        operations (grad.differentiable_inputs); NotImplementedError where the
        function of these argument types has no gradient (max / min
        reductions), before anything runs."""
        kind, spec, _, _ = self._classify([a.detach() if A.is_torch_tensor(a) else a for a in args])
        return grad.differentiable_inputs(self._signature(spec, len(args), kind).graph)

    def _differentiable_once(self, args):
        """``_differentiable`` of an eager call made with grad mode off (a
        Function's forward), asked once per CUDA call signature."""
        s = D.signature(args)
        if s is not None and s[0] in self._grad_ok:
            return
        self._differentiable(args)
        if s is not None:
            if len(self._grad_ok) >= D.FastPath.MAX:
                self._grad_ok.clear()
            self._grad_ok.add(s[0])

    def _backward(self, args, gouts, need, into_inputs=False):
        """{argument position: gradient} for the positions in ``need`` that
        the outputs depend on, from the incoming gradients ``gouts`` (one per
        output): ONE generated kernel per signature (cufuse/_fuse/grad.py)
        that recomputes the forward, then each gradient summed down to its
        argument's shape (torch's sum_to_size) where it was broadcast. What
        the arguments' classification decides is kept per call signature.
        ``into_inputs``: the gradients go into the arguments themselves where
        each has its gradient's shape and dtype (``_BackwardPlan.into``; the
        kernel reads an element's arguments before it writes its gradients)."""
        s = D.signature((*args, *gouts))
        # (torch's default dtype too: the forward's types of Python floats follow it)
        key = None if s is None else (s[0], tuple(need), A.torch().get_default_dtype())
        plan = self._bwd_plans.get(key) if key is not None else None
        if plan is None:
            plan = self._backward_plan(args, need, gouts)
            if key is not None:
                if len(self._bwd_plans) >= D.FastPath.MAX:
                    self._bwd_plans.clear()
                self._bwd_plans[key] = plan
        if plan.fn is None:
            return {}
        gl = [go.unsqueeze(-1) if u else go for u, go in zip(plan.unsqueeze, gouts)]
        into = into_inputs and plan.into and key is not None and not _shares_bytes(plan, s[1])
        res = plan.fn(*gl, plan.n, *args, out=tuple(args[p] for p in plan.wrt) if into else None)
        res = res if isinstance(res, tuple) else (res,)
        return {p: r if r.shape == args[p].shape else r.sum_to_size(args[p].shape)
                for p, r in zip(plan.wrt, res)}

    def _backward_plan(self, args, need, gouts):
        """The ``_BackwardPlan`` of a backward call: the classification of ``args``."""
        kind, spec, arrays, _ = self._classify(args)
        sig = self._signature(spec, len(args), kind)
        g = sig.graph
        wrt = tuple(p for p in grad.differentiable_inputs(g) if p in need)
        if not wrt:
            return _BackwardPlan(None, (), 1.0, (), False)
        bwd = sig.backwards.get(wrt)
        if bwd is None:
            bwd = sig.backwards[wrt] = Fused(grad.backward_function(g, wrt), name=f"{self.__name__}_backward")
        shape = tuple(np.broadcast_shapes(*[tuple(x.shape) for _, x in arrays]))
        unsqueeze = tuple(red is not None and not keep for (_, red, keep, _) in g.outputs)
        # the gradients can go into the arguments: contiguous CUDA tensors (no element twice), each of its
        # gradient's shape and dtype
        into = kind == A.TORCH_CUDA and all(A.is_torch_tensor(args[p]) and args[p].is_contiguous() for p in wrt)
        if into:
            gl = [go.unsqueeze(-1) if u else go for u, go in zip(unsqueeze, gouts)]
            meta, _ = bwd._result_meta((*gl, float(shape[-1]) if shape else 1.0, *args))
            into = all((tuple(args[p].shape), A.torch_to_numpy_dtype(args[p].dtype)) == (tuple(s), dt)
                       for p, (s, dt) in zip(wrt, meta))
        spans, wrt_tensors = (), ()
        if into:  # every argument is a CUDA tensor or a number: the k-th tensor is the k-th pointer
            pos = [p for p, a in enumerate(args) if A.is_torch_tensor(a)]
            spans = tuple((k, *A.extent(0, tuple(args[p].shape), args[p].stride(), args[p].element_size()))
                          for k, p in enumerate(pos))
            wrt_tensors = tuple(pos.index(p) for p in wrt)
        return _BackwardPlan(bwd, wrt, float(shape[-1]) if shape else 1.0, unsqueeze, into, spans, wrt_tensors)

    # ------------------------------------------------------------ Dask
    def _dask(self, args, out):
        """Dask arrays: chunk by chunk (a trailing reduction: on whole rows)."""
        if out is not None:
            DK._reject(self._name, "out=")
        arrays = [a for a in args if A.is_torch_tensor(a) or isinstance(a, (np.ndarray, A.CupyArray))]
        if arrays:
            raise TypeError(f"cufuse.{self._name}: Dask arrays mixed with other arrays "
                            f"({type(arrays[0]).__module__}.{type(arrays[0]).__name__}); wrap them in Dask arrays too")
        metas = [a._meta if DK.is_dask(a) else a for a in args]
        kind, spec, _, _ = self._classify(metas)
        sig = self._signature(spec, len(args), kind)
        g = sig.graph
        outs = range(len(g.outputs))

        def pick(k):
            def f(*a):
                r = self(*a)
                return r[k] if g.tuple_out else r
            return f

        if not g.reduction:
            res = [DK.elementwise(self._name, pick(k), args, None, sig.out_dtypes[k]) for k in outs]
        else:
            import dask.array as da
            darr = [a for a in args if DK.is_dask(a)]
            shape = np.broadcast_shapes(*[a.shape for a in darr])
            for k, (node, kind, _, _) in enumerate(g.outputs):  # (before the broadcast below hides it)
                if kind == "sum":
                    self._check_summed_axis(g, k, node, [(i, a) for i, a in enumerate(args) if DK.is_dask(a)],
                                            shape)
            bargs = [da.broadcast_to(a, shape) if DK.is_dask(a) else a for a in args]
            first = next(a for a in bargs if DK.is_dask(a))
            DK._whole(self._name, first, [len(shape) - 1], "the reduced (last)")
            # one chunking for all (map_blocks pairs blocks by position: inputs chunked otherwise gave
            # other rows' values, and more of them)
            bargs = [a.rechunk(first.chunks) if DK.is_dask(a) and a.chunks != first.chunks else a for a in bargs]
            res = [da.map_blocks(pick(k), *bargs, dtype=sig.out_dtypes[k],  # scalars pass through as they are
                                 drop_axis=None if g.outputs[k][2] else len(shape) - 1,
                                 chunks=first.chunks[:-1] + ((1,),) if g.outputs[k][2] else None)
                   for k in outs]
        return tuple(res) if g.tuple_out else res[0]

    # ------------------------------------------------------------ fallback
    def _run_numpy(self, sig, kind, arrays, params, shape, outs):
        torch_cpu = kind == A.TORCH_CPU
        vals = [A.torch_numpy(x) if torch_cpu else x for _, x in arrays]
        res = evaluate(sig.graph, vals, params, shape)
        final = []
        for r, o in zip(res, outs):
            if o is not None:
                np.copyto(A.torch_numpy(o) if torch_cpu else o, r)
                final.append(o)
            else:
                final.append(A.torch_result(r) if torch_cpu else r)
        return final

    # ----------------------------------------------------------------- GPU
    def _run_gpu(self, sig, kind, dev, arrays, params, shape, out_shapes, outs, key):
        with R._cp.cuda.Device(dev):
            n = A.count(shape)
            if n == 0 or (sig.graph.reduction and not all(A.count(s) for s in out_shapes)):
                return [o if o is not None else D.empty(s, dt, kind, dev)
                        for o, s, dt in zip(outs, out_shapes, sig.out_dtypes)]
            ins = [x for _, x in arrays]
            keep = key is not None
            targets = list(outs)
            for k, o in enumerate(outs):
                if o is None:
                    continue
                if sig.graph.reduction:
                    bad = any(D.overlaps(o, x, kind) for x in ins)
                else:
                    bad = D.needs_temporary(o, sig.out_dtypes[k], ins, sig.in_dtypes, kind, shape)
                if bad or any(D.overlaps(o, p, kind) for p in outs[:k] if p is not None):
                    targets[k], keep = None, False
            given = [t for t in targets if t is not None]
            if given and len(given) < len(targets):
                # Some outputs given, some new: all new for the launch, the given ones copied into.
                targets, keep = [None] * len(targets), False
            if sig.graph.reduction:
                rec = self._rows_recipe(sig, kind, dev, ins, targets, shape, out_shapes)
            else:
                rec = self._elementwise_recipe(sig, kind, dev, ins, targets, shape, n)
            if rec is None:  # more dims than the strided kernel indexes: dense copies
                ins, keep = [D.dense(x, shape, kind) for x in ins], False
                targets = [None] * len(targets)
                rec = (self._rows_recipe(sig, kind, dev, ins, targets, shape, out_shapes) if sig.graph.reduction
                       else self._elementwise_recipe(sig, kind, dev, ins, targets, shape, n))
            self.stats["launches"] += len(rec.steps)
            return D.run_general(rec, None if targets[0] is None else targets, outs, [A.pointer_of(x, kind) for x in ins],
                                 params, ins[0] if sig.in_pos[:1] == [0] else None, self.fast, key if keep else None)

    def _spans(self, sig, kind, ins, targets, out_shapes, out_strides):
        """(output spans, input spans, same-view inputs per output) of a recipe."""
        ospans = [(0, 0) if t is None else D.view_span(s, A.strides_of(t, kind), dt.itemsize)
                  for t, s, dt in zip(targets, out_shapes, sig.out_dtypes)]
        ispans = [D.view_span(tuple(x.shape), A.strides_of(x, kind), dt.itemsize) for x, dt in zip(ins, sig.in_dtypes)]
        same = [tuple(j for j, (st, idt) in enumerate(out_strides[1]) if idt == odt and st == ost)
                for ost, odt in zip(out_strides[0], sig.out_dtypes)] if out_strides else [()] * len(targets)
        return ospans, ispans, same

    def _elementwise_recipe(self, sig, kind, dev, ins, targets, shape, n):
        """The contiguous, strided or tiled launch for these operands (targets
        None: new C-contiguous outputs); None beyond the strided kernel's dims."""
        V = sig.V
        ost = [A.c_strides(shape) if t is None else list(A.strides_of(t, kind)) for t in targets]
        ist = [A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape) for x in ins]
        cshape, cstrides = A.collapse(shape, ost + ist)
        if len(cshape) > D.STRIDED_NDIM:
            return None
        nout = len(targets)
        b = D.RecipeBuilder(kind, dev, nout, len(ins))
        slots = [D.out_(k) for k in range(nout)] + [D.in_(j) for j in range(len(ins))]
        vals = [D.val(i) for i in range(len(sig.params))]
        if len(cshape) == 1 and all(st[0] == 1 for st in cstrides):
            fn = sig.function("fused_contig", dev)
            b.launch(fn, (R.grid_for(n // V or 1, dev) or 1,), (codegen.BLOCK,), (*slots, n, *vals))
        else:
            ptrs = [0 if t is None else A.pointer_of(t, kind) for t in targets] + [A.pointer_of(x, kind) for x in ins]
            parts = [(p, st, dt.itemsize) for p, st, dt in zip(ptrs, cstrides, sig.out_dtypes + sig.in_dtypes)]
            L, work = D.strided_layout(len(ptrs), cshape, parts, V, n, nout=nout)
            fn = sig.function("fused_tiled" if L["vec"] == 2 else "fused_strided", dev)
            b.launch(fn, (R.grid_for(work, dev) or 1,), (codegen.BLOCK,), (*slots, n, L, *vals))
        spans = self._spans(sig, kind, ins, targets, [shape] * nout,
                            (ost, list(zip(ist, sig.in_dtypes))))
        return b.build([D.output(shape, dt, kind) for dt in sig.out_dtypes], *spans, extra=sig,
                       like=ins[0] if sig.in_pos[:1] == [0] else None)

    def _rows_recipe(self, sig, kind, dev, ins, targets, shape, out_shapes):
        """The launch of a trailing reduction over rows of ``shape[-1]``; None
        beyond the strided kernel's dims."""
        cols = shape[-1]
        lead = shape[:-1]
        rows = A.count(lead)
        nlead = len(lead)
        nout = len(targets)
        ptrs = [0 if t is None else A.pointer_of(t, kind) for t in targets] + [A.pointer_of(x, kind) for x in ins]
        out_st = [A.c_strides(s)[:nlead] if t is None else list(A.strides_of(t, kind))[:nlead]
                  for t, s in zip(targets, out_shapes)]
        in_st = [A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape) for x in ins]
        col_st = [0] * nout + [st[-1] if cols != 1 else 0 for st in in_st]
        if lead:
            cshape, cstr = A.collapse(lead, out_st + [st[:-1] for st in in_st])
        else:
            cshape, cstr = [1], [[0] for _ in ptrs]
        if len(cshape) + 1 > D.STRIDED_NDIM:
            return None
        V = sig.V
        vec = int(cols % V == 0 and cols > 0)
        if vec:
            for p, st, cs, dt in zip(ptrs[nout:], cstr[nout:], col_st[nout:], sig.in_dtypes):
                align = min(V * dt.itemsize, 16)
                if cs == 0:
                    continue
                if cs != 1 or p % align or any((s * dt.itemsize) % align for s in st):
                    vec = 0
                    break
        L = D.layout(len(ptrs), [cols] + list(cshape), [[c] + list(s) for c, s in zip(col_st, cstr)], vec)[()]
        units = cols // V if vec else cols
        tpr = 1
        while tpr < 256 and tpr * 4 < units:
            tpr *= 2
        rpb = codegen.BLOCK // tpr
        grid = min((rows + rpb - 1) // rpb, R.sm_count(dev) * 32) or 1
        fn = sig.function("fused_rows", dev)
        b = D.RecipeBuilder(kind, dev, nout, len(ins))
        slots = [D.out_(k) for k in range(nout)] + [D.in_(j) for j in range(len(ins))]
        b.launch(fn, (grid,), (codegen.BLOCK,), (*slots, rows, np.int32(tpr), L,
                                                 *[D.val(i) for i in range(len(sig.params))]))
        spans = self._spans(sig, kind, ins, targets, out_shapes, None)
        return b.build([D.output(s, dt, kind) for s, dt in zip(out_shapes, sig.out_dtypes)], *spans, extra=sig)

    # ---------------------------------------------------------- horizontal
    def foreach(self, *args: Any, out: Any = None) -> list:
        """Apply the function to lists of arrays in one launch (horizontal fusion).

        Each argument is a list (or tuple) of arrays, all lists of one length
        L, or a scalar shared by every item. Returns a list of L results:
        item i is ``f(args0[i], args1[i], ...)`` (a tuple when the function
        returns several arrays). Arrays of one item have one shape (no
        broadcasting between them); items may differ in size, 0 included.
        ``out``: a list of L arrays, or for several outputs a tuple of such
        lists; they may be the inputs themselves (an in-place update). On the
        GPU every C-contiguous, 16-byte-aligned item runs in ONE launch; any
        other item runs as its own call. For the same call repeated (an
        optimizer step), ``foreach_plan`` checks once and launches for less.
        """
        list_pos, count = self._foreach_lists(args, "foreach")
        if count == 0:
            return []
        key = None
        if out is not None:
            # The same arrays as a previous call (an optimizer step): its checked
            # launch table is reused, with this call's scalars. The plan holds
            # weak references whose callbacks drop it when any of its arrays
            # dies, so an address in its key is always the very array it was;
            # torch tensors must also still be on the same storage.
            outs_ = _out_lists(out)
            t = A.torch()
            try:
                key = (tuple(map(_address, itertools.chain(*[args[p] for p in list_pos], *outs_))),
                       tuple(type(a) if p not in list_pos else None for p, a in enumerate(args)), len(outs_),
                       t.get_default_dtype() if t is not None else None)
            except TypeError:
                key = None
            ent = self._plans.get(key) if key is not None else None
            if ent is not None and (ent[1] is None or ent[1] == [
                    a.data_ptr() for a in itertools.chain(*[args[p] for p in list_pos], *outs_)]):
                sig, plan, kind, device = ent[2:]
                if plan is not None:
                    self._launch_table(kind, device, plan, sig.param_values(_item(args, list_pos, 0)))
                if sig.graph.tuple_out:
                    return [tuple(ol[i] for ol in outs_) for i in range(count)]
                return list(outs_[0])

        self.stats["foreach_checks"] += 1
        kind, device, sig, out_lists = self._foreach_signature(args, list_pos, out, count, "foreach")

        def item_out(i):
            if out_lists is None:
                return None
            return tuple(ol[i] for ol in out_lists) if sig.graph.tuple_out else out_lists[0][i]

        def checked(items):
            """``items``, each item's call checked first where they write into out= (an error in a
            later item must not come after earlier ones were written: an optimizer step half applied)."""
            if out_lists is not None:
                for i in items:
                    self._check_item(_item(args, list_pos, i), item_out(i))
            return items

        if kind not in A.GPU_KINDS:
            return [self._call(_item(args, list_pos, i), item_out(i)) for i in checked(range(count))]
        lists = [args[p] for p in list_pos]
        params = sig.param_values(_item(args, list_pos, 0))
        try:
            fast, slow, plan = self._foreach_plan(sig, kind, device, lists, out_lists, count, None)
        except _InOrder:
            # an item writes what another item reads or writes: item by item, in
            # order, as the NumPy path does (one launch would race between them)
            return [self._call(_item(args, list_pos, i), item_out(i)) for i in checked(range(count))]
        checked(slow)
        if plan is not None:
            self._launch_table(kind, device, plan, params)
        results = [None] * count
        for i, outs in fast:
            results[i] = tuple(outs) if sig.graph.tuple_out else outs[0]
        for i in slow:  # full checks (and their errors), one launch each
            results[i] = self._call(_item(args, list_pos, i), item_out(i))
        if key is not None and not slow:
            if len(self._plans) >= _PLANS_MAX:
                self._plans.clear()
            flat = list(itertools.chain(*lists, *out_lists))
            ptrs = [a.data_ptr() for a in flat] if kind == A.TORCH_CUDA else None
            plans = self._plans

            def drop(_ref, key=key):
                plans.pop(key, None)

            self._plans[key] = ([weakref.ref(a, drop) for a in flat], ptrs, sig, plan, kind, device)
        return results

    def foreach_plan(self, *args: Any, out: Any) -> ForeachPlan:
        """Check a ``foreach`` call once and keep its launch: returns a
        ``ForeachPlan``; calling it, ``plan(*scalars)``, applies the function
        again to the same arrays, with new values for the scalar arguments (in
        their order; none if the call has none), and returns ``out`` as
        ``foreach`` does. Nothing runs until the plan is called.

        Meant for a step repeated on the same arrays (an optimizer's), where
        ``foreach`` itself re-checks every array each call. The plan holds its
        arrays (lists changed afterwards do not change it). ``out`` is
        required. On the GPU every item must join the one launch
        (C-contiguous, 16-byte aligned, each output an input itself or apart
        from them), else ValueError names the items that cannot. torch tensors
        are checked to still be on the same storage at each call.
        """
        list_pos, count = self._foreach_lists(args, "foreach_plan")
        if out is None:
            raise TypeError(f"cufuse.{self._name}.foreach_plan: out= is required (a plan writes into fixed "
                            "outputs); got None")
        if not isinstance(out, (list, tuple)):
            raise TypeError(f"cufuse.{self._name}.foreach_plan: out must be a list of arrays, or a tuple of "
                            f"such lists for several outputs; got {type(out).__name__}")
        outs_ = _out_lists(out)
        if count == 0:
            return ForeachPlan(self, args, out, list_pos, None)
        kind, device, sig, out_lists = self._foreach_signature(args, list_pos, out, count, "foreach_plan")
        if kind not in A.GPU_KINDS:  # NumPy: each call is a foreach call
            return ForeachPlan(self, args, out, list_pos, None)
        lists = [args[p] for p in list_pos]
        try:
            _, slow, plan = self._foreach_plan(sig, kind, device, lists, out_lists, count, None)
        except _InOrder:
            raise ValueError(f"cufuse.{self._name}.foreach_plan: an item's output is another item's input or "
                             "output; in one launch they would race: use foreach, which runs such lists "
                             "item by item, in order") from None
        if slow:
            raise ValueError(f"cufuse.{self._name}.foreach_plan: item(s) {slow[:8]}{' ...' if len(slow) > 8 else ''} "
                             "cannot join the one launch (every array C-contiguous, 16-byte aligned, of its "
                             "item's shape and the signature's dtype, on one device; each output an input "
                             "itself or apart from them): use foreach for such lists")
        flat = list(itertools.chain(*lists, *outs_))
        ptrs = [a.data_ptr() for a in flat] if kind == A.TORCH_CUDA else None
        return ForeachPlan(self, args, out, list_pos, (sig, plan, kind, device, flat, ptrs))

    def _foreach_lists(self, args, what):
        """(positions of the list arguments, their common length)."""
        list_pos = [p for p, a in enumerate(args) if isinstance(a, (list, tuple))]
        if not list_pos:
            raise TypeError(f"cufuse.{self._name}.{what}: at least one argument must be a list of arrays")
        lens = [len(args[p]) for p in list_pos]
        if len(set(lens)) > 1:
            given = ", ".join(f"argument {p + 1} has {n}" for p, n in zip(list_pos, lens))
            raise ValueError(f"cufuse.{self._name}.{what}: the lists have different lengths ({given})")
        return list_pos, lens[0]

    def _foreach_signature(self, args, list_pos, out, count, what):
        """(kind, device, signature, output lists or None) of a foreach call,
        from its first item; raises for scalars in lists, bare arrays, reductions."""
        t = A.torch()
        if t is not None and t.is_grad_enabled():  # (every item: each runs in the launch table, unrecorded)
            for p, a in enumerate(args):
                for x in (a if p in list_pos else [a]):
                    if A.is_torch_tensor(x) and x.requires_grad:
                        raise NotImplementedError(
                            f"cufuse.{self._name}.{what}: argument {p + 1} holds a tensor that requires grad, and "
                            f"{what} records no gradient (calls of the function itself do); call it under "
                            "torch.no_grad() or pass tensor.detach()")
        kind, spec, _, device = self._classify(_item(args, list_pos, 0))
        for p, s in enumerate(spec):
            if s[0] == "scalar" and p in list_pos:
                raise TypeError(f"cufuse.{self._name}.{what}: argument {p + 1} is a list of scalars; a scalar is "
                                "shared by every item: pass one scalar")
            if s[0] == "array" and p not in list_pos:
                raise TypeError(f"cufuse.{self._name}.{what}: argument {p + 1} is an array; pass arrays as "
                                "lists, one per item")
        # One signature for every item: arrays taken as 1-d.
        sig = self._signature(tuple(("array", s[1], 1) if s[0] == "array" else s for s in spec), len(args), kind)
        if sig.graph.reduction:
            raise ValueError(f"cufuse.{self._name}.{what}: reductions are not supported in foreach; call the "
                             "function on each array")
        return kind, device, sig, self._foreach_outs(out, count, len(sig.out_dtypes), sig.graph.tuple_out, what)

    def _foreach_outs(self, out, count, nout, tuple_out, what):
        if out is None:
            return None
        lists = tuple(out) if tuple_out else (out,)
        if len(lists) != nout or any(not isinstance(ol, (list, tuple)) or len(ol) != count for ol in lists):
            need = f"a tuple of {nout} lists of {count} arrays" if tuple_out else f"a list of {count} arrays"
            raise ValueError(f"cufuse.{self._name}.{what}: out must be {need}")
        return lists

    def _foreach_plan(self, sig, kind, dev, lists, out_lists, count, params):
        """Check every item with a few attribute reads; launch the items that
        qualify (C-contiguous, aligned, one shape, outputs either an input
        itself or apart from them) in one kernel (params None: no launch, for
        a plan). Returns ([(item, outputs)], [items left for a call of their
        own], the launch plan or None)."""
        V, dts, odts = sig.V, sig.in_dtypes, sig.out_dtypes
        is_cupy = kind == A.CUPY
        if not is_cupy:
            dts_k = [A.numpy_to_torch_dtype(d) for d in dts]
            odts_k = [A.numpy_to_torch_dtype(d) for d in odts]
        else:
            dts_k, odts_k = dts, odts
        al_in = [min(V * d.itemsize, 16) for d in dts]
        al_out = [min(V * d.itemsize, 16) for d in odts]
        CupyArray = A.CupyArray
        Tensor = A.torch().Tensor if not is_cupy else None

        def ptr_of(a, dt, al, shape):
            """a's pointer if a qualifies, else None."""
            if is_cupy:
                if type(a) is not CupyArray or a.dtype != dt or not a._c_contiguous or a.shape != shape:
                    return None
                d = a.data
                p, ok = d.ptr, d.device_id == dev
            else:
                if (not isinstance(a, Tensor) or a.dtype != dt or a.requires_grad or not a.is_contiguous()
                        or a.shape != shape or not a.is_cuda or a.get_device() != dev):
                    return None
                p, ok = a.data_ptr(), True
            return p if ok and p % al == 0 else None

        fast, slow, rows, pending = [], [], [], []
        spans = []  # with out=: (lo, hi, item, written) of every array, for the check across items
        for i in range(count):
            arrs = [lst[i] for lst in lists]
            shape = arrs[0].shape if hasattr(arrs[0], "shape") else None
            ptrs = [ptr_of(a, dt, al, shape) for a, dt, al in zip(arrs, dts_k, al_in)]
            if shape is None or None in ptrs:
                slow.append(i)
                if out_lists is not None:
                    _item_spans(spans, i, kind, [ol[i] for ol in out_lists], arrs)
                continue
            n = arrs[0].size if is_cupy else arrs[0].numel()
            if out_lists is not None:
                outs = [ol[i] for ol in out_lists]
                optrs = [ptr_of(o, dt, al, shape) for o, dt, al in zip(outs, odts_k, al_out)]
                if None in optrs or not _apart(optrs, odts, ptrs, dts, n):
                    slow.append(i)
                    _item_spans(spans, i, kind, outs, arrs)
                    continue
                fast.append((i, outs))
                if n:
                    rows.append(optrs + ptrs + [n])
                    spans.extend((p, p + n * d.itemsize, i, True) for p, d in zip(optrs, odts))
                    spans.extend((p, p + n * d.itemsize, i, False) for p, d in zip(ptrs, dts))
            else:
                pending.append((i, tuple(shape), n, ptrs))
        if spans and _across_items(spans):
            raise _InOrder()
        if pending:  # new outputs: one buffer per output, a view per item
            for i, shape, n, ptrs in pending:
                fast.append((i, []))
            offsets, total = [], 0
            for _, _, n, _ in pending:
                offsets.append(total)
                total += -(-n // 16) * 16  # every view starts 16-byte aligned
            bufs = [D.empty((total,), dt, kind, dev) for dt in odts]
            views = fast[len(fast) - len(pending):]
            # CuPy: an array on the buffer's memory at the item's offset, less
            # host time than a slice and a reshape (64 x 100K float32, back to
            # back, H200 host: 377 -> 320 us per foreach call)
            bases = [(b.data if is_cupy else None, A.pointer_of(b, kind), dt, dt.itemsize)
                     for b, dt in zip(bufs, odts)]
            for (i, shape, n, ptrs), off, (_, outs) in zip(pending, offsets, views):
                optrs = []
                for b, (mp, base, dt, size) in zip(bufs, bases):
                    if is_cupy:
                        outs.append(CupyArray(shape, dt, memptr=mp + off * size))
                    else:
                        outs.append(b[off:off + n].view(shape))
                    optrs.append(base + off * size)
                if n:
                    rows.append(optrs + ptrs + [n])
        plan = self._launch_segments(sig, kind, dev, rows, params) if rows else None
        return fast, slow, plan

    def _launch_segments(self, sig, kind, dev, rows, params):
        """One launch over every row (output pointers, input pointers, n): the
        table gains each row's first block; blocks of BLOCK threads, SEGMENT_PACKS
        packs each; launched now unless params is None. Returns the plan
        (table, blocks, rows, kernel, packs per thread) for _launch_table."""
        V, B = sig.V, codegen.BLOCK * SEGMENT_PACKS
        first = 0
        for r in rows:
            packs = -(-r[-1] // V)
            r.append(first)
            first += -(-packs // B)
        flat = np.array([v for r in rows for v in r], dtype=np.int64)
        table = D.Held(dev, D.uploaded(flat, kind, dev, f"the launch table of {self._name}.foreach (the first "
                                                        "call with these arrays)"))
        plan = (table, first, np.int32(len(rows)), sig.function("fused_segments", dev), np.int32(SEGMENT_PACKS))
        if params is not None:
            self._launch_table(kind, dev, plan, params)
        return plan

    def _launch_table(self, kind, dev, plan, params):
        held, blocks, nrows, fn, upt = plan
        stream = _stream(kind, dev) if kind == A.TORCH_CUDA else None  # None: CuPy's current stream
        if dev == D.get_device():
            held.on(stream)
            R.launch_grid(fn, (blocks,), (codegen.BLOCK,), (held.arrs[0], nrows, upt, *params), stream)
        else:
            with R._cp.cuda.Device(dev):
                held.on(stream)
                R.launch_grid(fn, (blocks,), (codegen.BLOCK,), (held.arrs[0], nrows, upt, *params), stream)
        self.stats["launches"] += 1


def _out_lists(out):
    """``out`` of a foreach call as a tuple of lists, one per output: several
    outputs come as a tuple (or list) of lists, one output as a list of arrays."""
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], (list, tuple)):
        return tuple(out)
    return (out,)


def _item(args, list_pos, i):
    """The arguments of item i of a foreach call."""
    return tuple(a[i] if p in list_pos else a for p, a in enumerate(args))


class ForeachPlan:
    """A ``foreach`` call checked once, for repeated calls: ``Fused.foreach_plan``."""

    def __init__(self, fused, args, out, list_pos, gpu):
        self._fused = fused
        self._args = tuple(list(a) if p in list_pos else a for p, a in enumerate(args))  # its own lists
        self._multi = isinstance(out, (list, tuple)) and bool(out) and isinstance(out[0], (list, tuple))
        self._outs = tuple(list(o) for o in _out_lists(out))
        self._list_pos = list_pos
        self._scalar_pos = [p for p in range(len(args)) if p not in list_pos]
        self._specs = [_scalar_spec(args[p]) for p in self._scalar_pos]
        self._gpu = gpu  # (signature, launch plan or None, kind, device, arrays held, torch pointers) or None
        count = len(self._outs[0])
        self._result = ([tuple(ol[i] for ol in self._outs) for i in range(count)] if self._multi
                        else list(self._outs[0]))

    def __repr__(self):
        return (f"<cufuse foreach plan of {self._fused!r}: {len(self._result)} items, scalars at arguments "
                f"{[p + 1 for p in self._scalar_pos]}>")

    def __call__(self, *scalars):
        name = self._fused._name
        if len(scalars) != len(self._scalar_pos):
            raise TypeError(f"cufuse.{name} foreach plan: takes {len(self._scalar_pos)} scalar(s) (arguments "
                            f"{[p + 1 for p in self._scalar_pos]} of the planned call), got {len(scalars)}")
        args = self._args
        if scalars:
            args = list(args)
            for p, v, spec in zip(self._scalar_pos, scalars, self._specs):
                if _scalar_spec(v) != spec:
                    raise TypeError(f"cufuse.{name} foreach plan: argument {p + 1} was planned as "
                                    f"{_type_name(self._args[p])} ({spec[1]}), got {_type_name(v)}; "
                                    "make a new plan for another scalar type")
                args[p] = v
        if self._gpu is None:  # no items, or NumPy arrays: a foreach call
            if not self._result:
                return []
            return self._fused.foreach(*args, out=self._outs if self._multi else self._outs[0])
        sig, plan, kind, device, flat, ptrs = self._gpu
        if ptrs is not None and ptrs != [a.data_ptr() for a in flat]:
            raise RuntimeError(f"cufuse.{name} foreach plan: a tensor of the plan is no longer on the storage it "
                               "was planned on (resized or set_); make a new plan")
        if plan is not None:
            self._fused._launch_table(kind, device, plan, sig.param_values(_item(args, self._list_pos, 0)))
        return list(self._result)


def _stream(kind, dev):
    if kind == A.TORCH_CUDA:
        return D.stream_for(kind, dev)
    return R._cp.cuda.get_current_stream()


class _InOrder(Exception):
    """A foreach whose items must run one after another (see _across_items)."""


def _item_spans(spans, i, kind, outs, ins):
    """Append (lo, hi, i, written) of item i's arrays (any views) to ``spans``."""
    for arrs, written in ((outs, True), (ins, False)):
        for a in arrs:
            try:
                lo, hi = D.span(a, A.kind_of(a))
            except (TypeError, AttributeError, ValueError):
                continue  # not an array: its own call will say so
            if hi > lo:
                spans.append((lo, hi, i, written))


def _across_items(spans):
    """True when memory one item writes is read or written by another item."""
    spans.sort()
    active = []  # (hi, item, written) of spans that may still overlap what follows
    for lo, hi, i, written in spans:
        active = [a for a in active if a[0] > lo]
        for _, j, w in active:
            if j != i and (written or w):
                return True
        active.append((hi, i, written))
    return False


def _apart(optrs, odts, iptrs, idts, n):
    """Each output is an input itself (same pointer and dtype: element-for-element,
    safe) or shares no byte with any input or other output."""
    spans = [(p, p + n * d.itemsize) for p, d in zip(iptrs, idts)]
    for k, (p, d) in enumerate(zip(optrs, odts)):
        lo, hi = p, p + n * d.itemsize
        for (ilo, ihi), ip, idt in zip(spans, iptrs, idts):
            if ilo < hi and lo < ihi and not (ip == p and idt == d):
                return False
        for q, qd in zip(optrs[k + 1:], odts[k + 1:]):
            if q < hi and lo < q + n * qd.itemsize:
                return False
    return True


def fuse(fn: Callable[..., Any] | None = None) -> Any:
    """Trace ``fn`` once per argument signature and run it as one generated kernel.

    ``fn`` takes arrays and scalars and returns an array or a tuple of arrays,
    computed with Python operators, ``cufuse.where``/``exp``/... (or NumPy
    ufuncs) and ``astype``; a trailing ``sum``/``mean``/``max``/``min`` over
    the last axis may end it. Works as ``@cufuse.fuse`` or ``cufuse.fuse(fn)``
    (lambdas included). See docs/fuse.md.
    """
    if fn is None:
        return fuse
    return Fused(fn)
