"""cufuse's differentiable ops as PyTorch custom operators (``torch.ops.cufuse``).

Registered with ``torch.library.custom_op`` once torch is imported (at
cufuse's import if torch already is, else at the first call on a tensor),
each with a fake (meta) implementation and an autograd formula whose
backward is itself a custom operator (one generated kernel). Used where
they are needed:

- under ``torch.compile`` (Dynamo traces the public function's first branch
  into ``torch.ops.cufuse.<op>``: no graph break, ``fullgraph=True`` works);
- in eager mode when an operand requires grad (the op is recorded).

Plain eager calls keep cufuse's direct path (no dispatcher cost).

A custom operator's arguments have fixed types, so each operand travels as a
pair (tensor or None, float or None): a Python number stays a number, with
torch's promotion rules (it never widens a tensor's float type).
"""
from __future__ import annotations

import itertools
import sys
import weakref

import numpy as np

from . import _arrays as A
from . import _autograd as AG
from . import _random

_OPS: dict = {}   # name -> the custom op (torch.ops.cufuse.<name>)
# distinct gradient tensors the backward operator returns, per op (default 1: shared by every operand)
_DISTINCT = {"mul_tanh": 2, "fma": 2}


_is_compiling = None  # torch.compiler.is_compiling, once torch is imported


def compiling() -> bool:
    """True while torch.compile traces (Dynamo reads it as a constant). Every eager call of an op
    asks first: the function is looked up once (the lookups were a third of the question's cost)."""
    f = _is_compiling
    if f is None:
        t = sys.modules.get("torch")
        if t is None:
            return False
        f = _cache_is_compiling(t)
    return f()


def _cache_is_compiling(t):
    global _is_compiling
    _is_compiling = t.compiler.is_compiling
    return _is_compiling


def _pairs(args):
    """(tensor or None, number or None) per argument: a Python or NumPy number (NumPy's are weak under
    torch's rules, as Python's) goes as a float, never into the tensor slot (saved for backward, cast)."""
    out = []
    for a in args:
        if a is None or isinstance(a, (int, float, *A.NP_SCALARS)) and not isinstance(a, bool):
            out += [None, None if a is None else float(a)]
        else:
            out += [a, None]
    return out


def _unpair(flat):
    return [t if t is not None else s for t, s in zip(flat[0::2], flat[1::2])]


def call(name, approximate, args, out=None):
    """``cufuse.<name>(*args)`` through the registered operator (``out=``
    cannot be recorded, as torch's out= arguments)."""
    AG.no_out(name, out)
    for i, a in enumerate(args):
        if isinstance(a, int):
            A.check_scalar_fits(name, i, a)
    register()
    flat = _pairs(args)
    return _dispatch(_OPS[name], *flat) if approximate is None else _dispatch(_OPS[name], *flat, approximate)


def _dispatch(opdef, *inputs):
    """The registered operator under torch.compile; in eager mode its own
    forward, setup and backward through one torch.autograd.Function, which
    skips the dispatcher's per-call cost (about 0.4 ms per forward + backward
    on an H200 host, against 0.1 ms for torch's own ops)."""
    if compiling():
        return opdef(*inputs)
    return AG.apply("eager", _eager_class, opdef, *inputs)


def _eager_class(torch):
    class EagerOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, opdef, *inputs):
            # the op's direct path: grad mode is off in here, so tensors that require grad take its
            # per-signature fast path as they are (no detached copies to make); the saved ones are the inputs
            out = opdef._init_fn(*inputs)
            ctx.opdef, ctx.eager = opdef, True
            opdef._setup_context_fn(ctx, inputs, out)
            return out

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, *grads):
            return (None, *ctx.opdef._backward_fn(ctx, *grads))

    return EagerOp


def _direct(ctx, opdef):
    """A backward operator as a plain call where the forward ran eagerly
    (EagerOp), else the registered operator (traced by torch.compile). The
    backward runs with grad mode off (once_differentiable), where the saved
    tensors, which require grad, take an op's per-signature fast path as they
    are (with grad mode on they never do)."""
    if not getattr(ctx, "eager", False):
        return opdef
    return opdef._init_fn


def _meta_result(*operands):
    """(shape, dtype, device) of an elementwise result under torch's rules,
    from meta tensors (numbers stay numbers)."""
    import torch
    metas = [torch.empty(o.shape, dtype=o.dtype, device="meta") if isinstance(o, torch.Tensor) else o
             for o in operands if o is not None]
    acc = metas[0]
    for m in metas[1:]:
        acc = acc + m
    dev = next(o.device for o in operands if isinstance(o, torch.Tensor))
    return tuple(acc.shape), acc.dtype, dev


_KERNELS: list = []  # the torch.library.Library holding the direct kernels (registrations last as long as it)


def _custom_op(qualname, schema, tags=()):
    """``torch.library.custom_op`` (schema, fake, autograd, opcheck) of an op
    that mutates nothing, with the function itself as its CPU and CUDA
    kernel, skipping custom_op's own kernel wrapper: its per-call aliasing
    check (for ops that return their inputs, which cufuse's never do) is host
    time every cufuse op in a compiled graph paid (figures in
    bench/NOTES.md). The function stays out of Dynamo's reach as custom_op
    keeps it (a call from a frame Dynamo skips would otherwise compile
    cufuse's own code)."""
    import torch

    def make(fn):
        opdef = torch.library.custom_op(qualname, mutates_args=(), schema=schema, tags=tags)(fn)
        if not _KERNELS:
            _KERNELS.append(torch.library.Library("cufuse", "IMPL"))
        kernel = torch._disable_dynamo(fn)
        for key in ("CPU", "CUDA"):
            _KERNELS[0].impl(qualname.split("::")[1], kernel, key)
        return opdef
    return make


def register():
    """Define the operators (once; needs torch)."""
    if _OPS:
        return
    import torch

    from .ops import elementwise as E

    # schemas written out (this module's annotations are strings): each operand a (tensor, number) pair
    S2 = "(Tensor? a, float? sa, Tensor? b, float? sb) -> Tensor"
    S3 = "(Tensor? q, float? sq, Tensor? k, float? sk, Tensor? v, float? sv) -> Tensor"
    SG = "(Tensor? x, float? sx, Tensor? b, float? sb, str approximate) -> Tensor"
    SB = "(str key, Tensor g, Tensor?[] ins, float?[] nums, Tensor? y) -> Tensor[]"

    def fake_like(*operands):
        shape, dt, dev = _meta_result(*operands)
        return torch.empty(shape, dtype=dt, device=dev)

    # ---- forward operators: the op itself, operands as (tensor, number) pairs
    @_custom_op("cufuse::add_relu", schema=S2)
    def add_relu(a, sa, b, sb):
        return E.add_relu(*_unpair([a, sa, b, sb]))

    @_custom_op("cufuse::mul_tanh", schema=S2)
    def mul_tanh(a, sa, b, sb):
        return E.mul_tanh(*_unpair([a, sa, b, sb]))

    @_custom_op("cufuse::add_mul_exp", schema=S2)
    def add_mul_exp(a, sa, b, sb):
        return E.add_mul_exp(*_unpair([a, sa, b, sb]))

    @_custom_op("cufuse::fma", schema=S3)
    def fma(q, sq, k, sk, v, sv):
        return E.fma(*_unpair([q, sq, k, sk, v, sv]))

    @_custom_op("cufuse::bias_gelu", schema=SG)
    def bias_gelu(x, sx, b, sb, approximate):
        return E.bias_gelu(*_unpair([x, sx, b, sb]), approximate)

    for op, n in ((add_relu, 2), (mul_tanh, 2), (add_mul_exp, 2), (fma, 3)):
        op.register_fake(lambda *flat: fake_like(*_unpair(list(flat))))
    bias_gelu.register_fake(lambda x, sx, b, sb, approximate: fake_like(*_unpair([x, sx, b, sb])))

    # ---- backward operators: one generated kernel each (cufuse/_autograd.py)
    @_custom_op("cufuse::elementwise_backward", schema=SB)
    def backward(key, g, ins, nums, y):
        _, bwd = AG._grads()[key]
        operands = [t if t is not None else s for t, s in zip(ins, nums)]
        grads = bwd(g, operands if operands else None, y)
        return list(grads[:_DISTINCT.get(key, 1)])  # distinct tensors only (an output may not alias another)

    @backward.register_fake
    def _(key, g, ins, nums, y):
        operands = [t if t is not None else s for t, s in zip(ins, nums)]
        shape, dt, dev = _meta_result(g, *operands) if operands else _meta_result(g, y)
        return [torch.empty(shape, dtype=dt, device=dev) for _ in range(_DISTINCT.get(key, 1))]

    def setup(key, saved, nops):
        def setup_context(ctx, inputs, output):
            flat = list(inputs[:2 * nops])
            ctx.key, ctx.saved = key, saved
            ctx.meta = [(tuple(t.shape), t.dtype) if t is not None else None for t in flat[0::2]]
            ctx.nums = flat[1::2]
            # (None entries are allowed; the inputs and the output only where the backward reads them:
            # each saved tensor costs the forward and the backward host time)
            ins = flat[0::2] if saved != "out" else [None] * nops
            ctx.save_for_backward(*ins, output if saved != "in" else None)
        return setup_context

    def grad_fn(ctx, g):
        *ins, y = ctx.saved_tensors
        uses_in = ctx.saved != "out"
        got = _direct(ctx, backward)(ctx.key, g, list(ins) if uses_in else [], list(ctx.nums) if uses_in else [],
                                     y if ctx.saved != "in" else None)
        # per operand: the one gradient shared by all (add_relu ...), or its own; fma's v gets g itself
        if ctx.key == "fma":
            grads = [got[0], got[1], g]
        elif len(got) == 2:
            grads = [got[0], got[1]]
        else:
            grads = [got[0]] * len(ctx.meta)
        out = []
        for gr, meta in zip(grads, ctx.meta):
            if meta is None:
                out += [None, None]
                continue
            shape, dt = meta
            if tuple(gr.shape) != shape:
                gr = gr.sum_to_size(shape)
            out += [gr if gr.dtype == dt else gr.to(dt), None]
        return tuple(out)

    def grad_fn_gelu(ctx, g):
        return (*grad_fn(ctx, g), None)

    for name, op, nops in (("add_relu", add_relu, 2), ("mul_tanh", mul_tanh, 2), ("add_mul_exp", add_mul_exp, 2),
                           ("fma", fma, 3)):
        op.register_autograd(grad_fn, setup_context=setup(name, AG._grads()[name][0], nops))

    def setup_gelu(ctx, inputs, output):
        ctx.key = "bias_gelu" if inputs[4] == "none" else "bias_gelu_tanh"
        setup(ctx.key, "in", 2)(ctx, inputs, output)

    bias_gelu.register_autograd(grad_fn_gelu, setup_context=setup_gelu)
    _OPS.update(add_relu=add_relu, mul_tanh=mul_tanh, add_mul_exp=add_mul_exp, fma=fma, bias_gelu=bias_gelu)
    _register_rows(torch)
    _register_dropout(torch)
    _register_reductions(torch)
    _register_fused(torch)
    _register_cross_entropy(torch)
    _register_linear_cross_entropy(torch)
    _register_rope(torch)
    _register_scatter(torch)
    _register_attention(torch)
    from .ops import quantize as Q
    AG._function_class("fake_quantize", Q._fq_function)  # made now: torch.compile cannot trace a class body


_U64 = (1 << 64) - 1


def gelu_dropout(x, p, seed, approximate):
    """gelu_dropout through its registered operator (torch.compile). The seed
    travels as an int64 tensor: a given one as its two's complement, None as
    one drawn by torch.randint inside the traced graph (a fresh mask every
    call; torch.manual_seed makes it reproducible, cufuse.manual_seed does
    not reach into a compiled graph)."""
    import torch
    register()
    if seed is None:  # (the range and generator of eager's draw, _random.torch_seed: the same mask)
        s = torch.randint(0, _random.TORCH_SEED_HIGH, (), dtype=torch.int64)
    else:
        s = torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64)
    return _OPS["gelu_dropout"](x, p, s, approximate)


def _register_dropout(torch):
    """gelu_dropout and its backward (which draws the mask again from the seed)."""
    from .ops import elementwise as E

    @_custom_op("cufuse::gelu_dropout",
                schema="(Tensor x, float p, Tensor seed, str approximate) -> Tensor")
    def gelu_dropout(x, p, seed, approximate):
        return E.gelu_dropout(x, p, True, int(seed.item()) & _U64, approximate)

    @_custom_op("cufuse::gelu_dropout_backward",
                schema="(Tensor g, Tensor x, float p, Tensor seed, str approximate) -> Tensor")
    def gelu_dropout_backward(g, x, p, seed, approximate):
        return E.gelu_dropout_grad(g, x, p, int(seed.item()) & _U64, approximate)

    # (C order, as the kernels write them: a transposed x's strides would be a fake the eager result breaks)
    gelu_dropout.register_fake(
        lambda x, p, seed, approximate: torch.empty_like(x, memory_format=torch.contiguous_format))
    gelu_dropout_backward.register_fake(
        lambda g, x, p, seed, approximate: torch.empty_like(x, memory_format=torch.contiguous_format))

    def setup(ctx, inputs, output):
        x, p, seed, approximate = inputs
        ctx.p, ctx.approximate = p, approximate
        ctx.save_for_backward(x, seed)  # x and the seed: nothing mask-sized

    def grad(ctx, g):
        x, seed = ctx.saved_tensors
        return _direct(ctx, gelu_dropout_backward)(g, x, ctx.p, seed, ctx.approximate), None, None, None

    gelu_dropout.register_autograd(grad, setup_context=setup)
    _OPS["gelu_dropout"] = gelu_dropout


def _register_reductions(torch):
    """sum_squared (mean False) and mean_abs (True) over given axes, and their backward."""
    from .ops import reduction as RD

    @_custom_op("cufuse::reduction",
                schema="(Tensor x, int[] axes, bool keepdims, ScalarType? dtype, bool mean) -> Tensor")
    def reduction(x, axes, keepdims, dtype, mean):
        return (RD.mean_abs if mean else RD.sum_squared)(x, tuple(axes), keepdims, dtype)

    @_custom_op("cufuse::reduction_backward",
                schema="(Tensor g, Tensor x, int[] axes, bool keepdims, bool mean) -> Tensor")
    def reduction_backward(g, x, axes, keepdims, mean):
        return AG.reduction_grad(g, x, tuple(axes), keepdims, mean)

    @reduction.register_fake
    def _(x, axes, keepdims, dtype, mean):
        shape = [1 if i in axes else n for i, n in enumerate(x.shape)] if keepdims else \
            [n for i, n in enumerate(x.shape) if i not in axes]
        return x.new_empty(shape, dtype=dtype or x.dtype)

    reduction_backward.register_fake(lambda g, x, axes, keepdims, mean: torch.empty_like(x))

    def setup(ctx, inputs, output):
        x, axes, keepdims, _, mean = inputs
        ctx.axes, ctx.keepdims, ctx.mean = list(axes), keepdims, mean
        ctx.save_for_backward(x)

    def grad(ctx, g):
        (x,) = ctx.saved_tensors
        return _direct(ctx, reduction_backward)(g, x, ctx.axes, ctx.keepdims, ctx.mean), None, None, None, None

    reduction.register_autograd(grad, setup_context=setup)
    _OPS["reduction"] = reduction


def _register_rows(torch):
    """layer_norm (and its relu form), rms_norm, softmax / log_softmax."""
    from .ops import norm as N

    @_custom_op("cufuse::layer_norm",
                schema="(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
                       "bool relu) -> Tensor")
    def layer_norm(x, ns, w, b, eps, relu):
        return (N.layer_norm_relu if relu else N.layer_norm)(x, tuple(ns), w, b, eps)

    @_custom_op("cufuse::rms_norm",
                schema="(Tensor x, int[] normalized_shape, Tensor? weight, float eps) -> Tensor")
    def rms_norm(x, ns, w, eps):
        return N.rms_norm(x, tuple(ns), w, eps)

    @_custom_op("cufuse::softmax", schema="(Tensor x, int axis, bool log) -> Tensor")
    def softmax(x, axis, log):
        return (N.log_softmax if log else N.softmax)(x, axis)

    @_custom_op("cufuse::norm_backward",
                schema="(str kind, Tensor g, Tensor x, int n, Tensor? weight, Tensor? bias, float eps) "
                       "-> Tensor[]")
    def norm_backward(kind, g, x, n, w, b, eps):
        dx, dw, db = AG.norm_backward(kind, g, x, n, w, b, eps)
        return [dx, x.new_empty((0,)) if dw is None else dw, x.new_empty((0,)) if db is None else db]

    @_custom_op("cufuse::softmax_backward",
                schema="(Tensor g, Tensor y, int axis, bool log) -> Tensor")
    def softmax_backward(g, y, axis, log):
        return AG.softmax_backward(g, y, axis, log)

    layer_norm.register_fake(lambda x, ns, w, b, eps, relu: torch.empty_like(x, memory_format=torch.contiguous_format))
    rms_norm.register_fake(lambda x, ns, w, eps: torch.empty_like(x, memory_format=torch.contiguous_format))
    softmax.register_fake(lambda x, axis, log: torch.empty_like(x, memory_format=torch.contiguous_format))
    softmax_backward.register_fake(lambda g, y, axis, log: torch.empty_like(y, memory_format=torch.contiguous_format))

    @norm_backward.register_fake
    def _(kind, g, x, n, w, b, eps):
        return [torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty((0,)) if w is None else torch.empty_like(w, memory_format=torch.contiguous_format),
                x.new_empty((0,)) if b is None else torch.empty_like(b, memory_format=torch.contiguous_format)]

    def norm_grads(kind, ctx, g):
        x, w, b = ctx.saved_tensors
        n = 1
        for d in ctx.ns:
            n *= d
        if getattr(ctx, "eager", False):  # as _direct, without the operator's list of three tensors to unpack
            return AG.norm_backward(kind, g, x, n, w, b, ctx.eps)
        dx, dw, db = norm_backward(kind, g, x, n, w, b, ctx.eps)
        return dx, (dw if w is not None else None), (db if b is not None else None)

    def ln_setup(ctx, inputs, output):
        x, ns, w, b, eps, relu = inputs
        ctx.ns, ctx.eps, ctx.relu = list(ns), eps, relu
        ctx.save_for_backward(x, w, b)

    def ln_grad(ctx, g):
        dx, dw, db = norm_grads("layer_relu" if ctx.relu else "layer", ctx, g)
        return dx, None, dw, db, None, None

    def rms_setup(ctx, inputs, output):
        x, ns, w, eps = inputs
        ctx.ns, ctx.eps = list(ns), eps
        ctx.save_for_backward(x, w, None)

    def rms_grad(ctx, g):
        dx, dw, _ = norm_grads("rms", ctx, g)
        return dx, None, dw, None

    def sm_setup(ctx, inputs, output):
        _, axis, log = inputs
        ctx.axis, ctx.log = axis, log
        ctx.save_for_backward(output)  # the output alone: no second copy of x

    def sm_grad(ctx, g):
        (y,) = ctx.saved_tensors
        return _direct(ctx, softmax_backward)(g, y, ctx.axis, ctx.log), None, None

    layer_norm.register_autograd(ln_grad, setup_context=ln_setup)
    rms_norm.register_autograd(rms_grad, setup_context=rms_setup)
    softmax.register_autograd(sm_grad, setup_context=sm_setup)
    _OPS.update(layer_norm=layer_norm, rms_norm=rms_norm, softmax=softmax)


# ------------------------------------------------------------ cufuse.fuse
# A fused function under torch.compile is one operator for all of them,
# cufuse::fused, told which by a key; its arguments travel as a layout string
# ("t" tensor, "f" float, "i" int, "b" bool per argument) and a list per type.
_FUSED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> Fused
_COUNT = itertools.count()
_CODES = {float: "f", int: "i", bool: "b"}


def fused_key(fused):
    key = f"{fused.__name__}#{next(_COUNT)}"
    _FUSED[key] = fused
    return key


def _fused(key):
    f = _FUSED.get(key)
    if f is None:
        raise RuntimeError(f"cufuse.fuse: the fused function {key.split('#')[0]!r} of a compiled graph no longer "
                           "exists (keep a reference to it while the compiled function is in use)")
    return f


def _pack_fused(fused, args):
    layout, tensors, nums = [], [], {"f": [], "i": [], "b": []}
    Tensor = sys.modules["torch"].Tensor
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            layout.append("t")
            tensors.append(a)
            continue
        c = _CODES.get(type(a))
        if c is None:
            raise TypeError(f"cufuse.{fused._name}: under torch.compile, a fused function takes tensors and Python "
                            f"int, float and bool; argument {i + 1} is {type(a).__module__}.{type(a).__name__}")
        layout.append(c)
        nums[c].append(a)
    return "".join(layout), tensors, nums["f"], nums["i"], nums["b"]


def _unpack_fused(layout, tensors, floats, ints, bools):
    its = {"t": iter(tensors), "f": iter(floats), "i": iter(ints), "b": iter(bools)}
    return [next(its[c]) for c in layout]


def fused_call(fused, args, out):
    """A cufuse.fuse function through torch.ops.cufuse.fused (torch.compile)."""
    AG.no_out(fused._name, out)
    register()
    layout, tensors, floats, ints, bools = _pack_fused(fused, args)
    res = _OPS["fused"](fused._op_key, layout, tensors, floats, ints, bools)
    tuple_out = _fused_tuple_out(fused._op_key, layout, tuple(t.dtype for t in tensors),
                                 tuple(t.dim() for t in tensors))
    return tuple(res) if tuple_out else res[0]


def _fused_tuple_out(key, layout, dtypes, ndims):
    """Whether the fused function returns a tuple for these argument types
    (run by torch.compile at trace time, as a constant)."""
    import torch
    ts = [torch.empty((1,) * n, dtype=dt, device="meta") for dt, n in zip(dtypes, ndims)]
    args = _unpack_fused(layout, ts, [1.0] * layout.count("f"), [1] * layout.count("i"), [True] * layout.count("b"))
    return _fused(key)._result_meta(args)[1]


_fused_tuple_out._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _register_fused(torch):
    """cufuse::fused (any fused function, by key) and its backward: ONE
    generated kernel per signature recomputing the forward (Fused._backward)."""

    def detached(tensors):
        return [t.detach() for t in tensors]

    @_custom_op("cufuse::fused",
                schema="(str key, str layout, Tensor[] tensors, float[] floats, int[] ints, "
                       "bool[] bools) -> Tensor[]")
    def fused(key, layout, tensors, floats, ints, bools):
        res = _fused(key)(*_unpack_fused(layout, detached(tensors), floats, ints, bools))
        # contiguous, as the fake results say (the engine may give strided inputs' layout to its results)
        return [r.contiguous() for r in (res if isinstance(res, tuple) else (res,))]

    @fused.register_fake
    def _(key, layout, tensors, floats, ints, bools):
        args = _unpack_fused(layout, detached(tensors), floats, ints, bools)
        metas, _ = _fused(key)._result_meta(args, torch.broadcast_shapes)
        dev = tensors[0].device
        return [torch.empty(shape, dtype=A.numpy_to_torch_dtype(dt), device=dev) for shape, dt in metas]

    @_custom_op("cufuse::fused_backward",
                schema="(str key, str layout, Tensor[] tensors, float[] floats, int[] ints, "
                       "bool[] bools, Tensor[] gouts, int[] need) -> Tensor[]")
    def fused_backward(key, layout, tensors, floats, ints, bools, gouts, need):
        ts = detached(tensors)
        args = _unpack_fused(layout, ts, floats, ints, bools)
        pos = [i for i, c in enumerate(layout) if c == "t"]  # argument position of each tensor
        grads = _fused(key)._backward(args, detached(gouts), [pos[k] for k in need])
        out = []
        for k in need:  # an argument the outputs do not depend on gets zeros
            gr = grads.get(pos[k])
            gr = torch.zeros_like(ts[k]) if gr is None else gr.to(ts[k].dtype)
            out.append(gr.contiguous())  # (as the fake results)
        return out

    fused_backward.register_fake(lambda key, layout, tensors, floats, ints, bools, gouts, need:
                                 [torch.empty_like(tensors[k], memory_format=torch.contiguous_format)
                                  for k in need])

    def setup(ctx, inputs, output):
        key, layout, tensors, floats, ints, bools = inputs
        ctx.args = (key, layout, floats, ints, bools)
        ctx.need = [k for k, t in enumerate(tensors) if t.requires_grad]
        if ctx.need:  # max / min reductions have no gradient: say so while tracing, as eager calls do
            reached = set(_fused(key)._differentiable(_unpack_fused(layout, detached(tensors), floats, ints,
                                                                    bools)))
            # a tensor the outputs do not depend on gets no gradient (None, as eager calls give)
            pos = [i for i, c in enumerate(layout) if c == "t"]
            ctx.need = [k for k in ctx.need if pos[k] in reached]
        ctx.metas = [(o.shape, o.dtype, o.device) for o in output]
        ctx.save_for_backward(*tensors)

    def grad(ctx, gouts):
        key, layout, floats, ints, bools = ctx.args
        tensors = list(ctx.saved_tensors)
        gouts = [g if g is not None else torch.zeros(s, dtype=dt, device=dev) for g, (s, dt, dev) in
                 zip(gouts, ctx.metas)]
        got = iter(fused_backward(key, layout, tensors, floats, ints, bools, gouts, ctx.need) if ctx.need else [])
        grads = [next(got) if k in ctx.need else None for k in range(len(tensors))]
        # the inputs' structure, as torch.library flattens it: None for a list of numbers, [] for an empty list
        return None, None, grads, *[None if v else [] for v in (floats, ints, bools)]

    fused.register_autograd(grad, setup_context=setup)
    _OPS["fused"] = fused


# ------------------------------------------------------------ cross entropy
def _ce_ignore(name, ignore_index):
    """ignore_index under torch.compile: an int in int64's range, as eager mode checks (int() truncated a float)."""
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(ignore_index, (int, np.integer)):
        # (a NumPy int reaches here as an array under Dynamo: a Python int is what fullgraph takes)
        raise TypeError(f"{name}: ignore_index must be an int (under torch.compile(fullgraph=True) a Python int), "
                        f"got {type(ignore_index).__name__}")
    if not -2**63 <= int(ignore_index) < 2**63:
        raise ValueError(f"{name}: ignore_index must be in int64's range, got {ignore_index!r}")


def cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, reduction, dtype):
    """cufuse.cross_entropy through its registered operator (torch.compile):
    checked with torch's attributes only (Dynamo traces this), then the
    operator, whose backward writes a new gradient (no in-place write in a
    compiled graph)."""
    import torch
    name = "cufuse.cross_entropy"
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: under torch.compile, logits and target must be torch tensors")
    if logits.dtype not in A.torch_floats():
        raise TypeError(f"{name}: logits have dtype {logits.dtype}; accepted dtypes are {A.torch_floats()}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must hold int64 (or int32) class indices, got dtype {target.dtype}")
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"{name}: logits must be (rows, classes) and target (rows,); got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{name}: reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
    if dtype is not None and dtype not in A.torch_floats():
        raise TypeError(f"{name}: under torch.compile, dtype must be a torch float dtype, got {dtype!r}")
    _ce_ignore(name, ignore_index)
    register()
    return _OPS["cross_entropy"](logits, target.to(torch.int64), int(ignore_index), float(label_smoothing),
                                 float(z_loss), reduction, dtype)[0]


def _register_cross_entropy(torch):
    from .ops.cross_entropy import backward_rows, forward_rows

    @_custom_op("cufuse::cross_entropy",
                schema="(Tensor logits, Tensor target, int ignore, float eps, float z, str reduction, "
                       "ScalarType? dtype) -> (Tensor, Tensor, Tensor)")
    def ce(logits, target, ignore, eps, z, reduction, dtype):
        return forward_rows(logits, target, ignore, eps, z, reduction, dtype)

    @ce.register_fake
    def _(logits, target, ignore, eps, z, reduction, dtype):
        rows = logits.shape[0]
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        loss = logits.new_empty((rows,) if reduction == "none" else (), dtype=dtype or logits.dtype)
        return loss, logits.new_empty((rows,), dtype=acc), target.new_empty(())

    @_custom_op("cufuse::cross_entropy_backward",
                schema="(Tensor g, Tensor logits, Tensor target, Tensor lse, Tensor count, int ignore, "
                       "float eps, float z, str reduction) -> Tensor")
    def ce_backward(g, logits, target, lse, count, ignore, eps, z, reduction):
        return backward_rows(g, logits, target, lse, count, ignore, eps, z, reduction)

    ce_backward.register_fake(lambda g, logits, target, lse, count, ignore, eps, z, reduction:
                              torch.empty_like(logits, memory_format=torch.contiguous_format))

    def setup(ctx, inputs, output):
        logits, target, ignore, eps, z, reduction, _ = inputs
        ctx.args = (ignore, eps, z, reduction)
        ctx.save_for_backward(logits, target, output[1], output[2])
        ctx.mark_non_differentiable(output[1], output[2])

    def grad(ctx, g, _lse, _count):
        logits, target, lse, count = ctx.saved_tensors
        return ce_backward(g, logits, target, lse, count, *ctx.args), None, None, None, None, None, None

    ce.register_autograd(grad, setup_context=setup)
    _OPS["cross_entropy"] = ce


def linear_cross_entropy(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction, dtype,
                         chunk_rows):
    """cufuse.linear_cross_entropy through its registered operator
    (torch.compile): checked with torch's attributes only (Dynamo traces
    this), then the operator. No logits outlive a chunk, as in eager mode:
    the gradients autograd will want (of the operands that require grad,
    grad mode on, decided when traced) are made by the operator's forward
    where the eager call makes them there too, else by its backward."""
    import torch
    name = "cufuse.linear_cross_entropy"
    if not all(isinstance(a, torch.Tensor) for a in (hidden, weight, target)) or \
            not (bias is None or isinstance(bias, torch.Tensor)):
        raise TypeError(f"{name}: under torch.compile, hidden, weight, bias and target must be torch tensors")
    if hidden.dtype not in A.torch_floats() or weight.dtype != hidden.dtype or \
            (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"{name}: hidden, weight and bias must share a float dtype of {A.torch_floats()}; got "
                        f"{hidden.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must hold int64 (or int32) class indices, got dtype {target.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0 or \
            (bias is not None and tuple(bias.shape) != tuple(weight.shape[:1])) or \
            tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{name}: hidden [..., features], weight [classes, features], bias [classes] and target "
                         f"hidden's leading shape; got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)} and {tuple(target.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{name}: reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
    if dtype is not None and dtype not in A.torch_floats():
        raise TypeError(f"{name}: under torch.compile, dtype must be a torch float dtype, got {dtype!r}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1):
        raise ValueError(f"{name}: chunk_rows must be an int >= 1 or None, got {chunk_rows!r}")
    _ce_ignore(name, ignore_index)
    grad = torch.is_grad_enabled()
    need = [grad and a is not None and a.requires_grad for a in (hidden, weight, bias)]
    register()
    return _OPS["linear_cross_entropy"](hidden, weight, bias, target.to(torch.int64), int(ignore_index),
                                        float(label_smoothing), float(z_loss), reduction, dtype, chunk_rows or 0,
                                        need)[0]


def _register_linear_cross_entropy(torch):
    from .ops.cross_entropy import grads_in_forward, linear_backward_rows, linear_forward_rows

    @_custom_op("cufuse::linear_cross_entropy",
                schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore, "
                       "float eps, float z, str reduction, ScalarType? dtype, SymInt chunk_rows, "
                       "bool[] need) -> Tensor[]")
    def lce(hidden, weight, bias, target, ignore, eps, z, reduction, dtype, chunk_rows, need):
        return linear_forward_rows(hidden, weight, bias, target, ignore, eps, z, reduction, dtype, chunk_rows, need)

    def made(hidden, reduction, need):
        return grads_in_forward(reduction, hidden.dtype == torch.float16, need)

    def grads_like(hidden, weight, bias, need):
        return [torch.empty_like(a, memory_format=torch.contiguous_format) if n else hidden.new_empty((0,))
                for a, n in zip((hidden, weight, bias), need)]

    @lce.register_fake
    def _(hidden, weight, bias, target, ignore, eps, z, reduction, dtype, chunk_rows, need):
        loss = hidden.new_empty(tuple(hidden.shape[:-1]) if reduction == "none" else (), dtype=dtype or hidden.dtype)
        grads = grads_like(hidden, weight, bias, need if made(hidden, reduction, need) else [False] * 3)
        return [loss, target.new_empty(())] + grads

    @_custom_op("cufuse::linear_cross_entropy_backward",
                schema="(Tensor g, Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
                       "Tensor count, int ignore, float eps, float z, str reduction, SymInt chunk_rows, "
                       "bool[] need) -> Tensor[]")
    def lce_backward(g, hidden, weight, bias, target, count, ignore, eps, z, reduction, chunk_rows, need):
        return linear_backward_rows(g, hidden, weight, bias, target, count, ignore, eps, z, reduction, chunk_rows,
                                    need)

    lce_backward.register_fake(lambda g, hidden, weight, bias, target, count, ignore, eps, z, reduction, chunk_rows,
                               need: grads_like(hidden, weight, bias, need))

    def setup(ctx, inputs, output):
        hidden, weight, bias, target, ignore, eps, z, reduction, dtype, chunk_rows, need = inputs
        if any(wanted and not n for wanted, n in zip(ctx.needs_input_grad[:3], need)):
            raise RuntimeError(f"cufuse::linear_cross_entropy: need={list(need)} leaves out an operand that "
                               f"requires grad ({list(ctx.needs_input_grad[:3])}): its gradient would be missing")
        ctx.made, ctx.need = made(hidden, reduction, need), list(need)
        ctx.args = (ignore, eps, z, reduction, chunk_rows, list(need))
        ctx.mark_non_differentiable(*output[1:])
        if ctx.made:  # the gradients for an incoming 1, scaled by the backward (out of place: a graph may be kept)
            ctx.save_for_backward(*output[2:])
        else:
            ctx.save_for_backward(hidden, weight, bias, target, output[1])

    def grad(ctx, gouts):
        g = gouts[0]
        if ctx.made:
            grads = [d * g for d in ctx.saved_tensors]
        else:
            hidden, weight, bias, target, count = ctx.saved_tensors
            grads = lce_backward(g, hidden, weight, bias, target, count, *ctx.args)
        return tuple(d if n else None for d, n in zip(grads, ctx.need)) + (None,) * 8

    lce.register_autograd(grad, setup_context=setup)
    _OPS["linear_cross_entropy"] = lce


# ------------------------------------------------------------ rotary embedding


def rope(xs, cos, sin, interleaved):
    """cufuse.rope's rotation of the tensors xs (q, or q and k) through its
    registered operator (torch.compile); cos and sin already shaped."""
    register()
    return _OPS["rope"](xs, cos, sin, interleaved, False)


def _register_rope(torch):
    from .ops.rope import out_strides, rotate_tensors

    @_custom_op("cufuse::rope",
                schema="(Tensor[] xs, Tensor cos, Tensor sin, bool interleaved, bool bwd) -> Tensor[]")
    def rope_op(xs, cos, sin, interleaved, bwd):
        return rotate_tensors(xs, cos, sin, interleaved, bwd)

    def fake(xs, cos, sin, interleaved, bwd):  # the layouts rotate_tensors gives (ops/rope.py: out_strides)
        sts = [out_strides(tuple(x.shape), tuple(x.stride())) if x.is_cuda else None for x in xs]
        return [torch.empty_like(x, memory_format=torch.contiguous_format) if st is None else
                torch.empty_strided(x.shape, st, dtype=x.dtype, device=x.device) for x, st in zip(xs, sts)]

    rope_op.register_fake(fake)

    def setup(ctx, inputs, output):
        xs, cos, sin, interleaved, bwd = inputs
        ctx.args = (interleaved, bwd)
        ctx.metas = [(x.shape, x.dtype, x.device) for x in xs]
        ctx.save_for_backward(cos, sin)

    def grad(ctx, gouts):
        cos, sin = ctx.saved_tensors
        interleaved, bwd = ctx.args
        gs = [g if g is not None else torch.zeros(s, dtype=dt, device=dev) for g, (s, dt, dev) in
              zip(gouts, ctx.metas)]
        # the rotation is linear in x: its gradient is the transposed rotation (and that one's, the rotation)
        return rope_op(gs, cos, sin, interleaved, not bwd), None, None, None, None

    rope_op.register_autograd(grad, setup_context=setup)
    _OPS["rope"] = rope_op


# -------------------------------------------------------------- attention


def attention(q, k, v, scale, causal):
    """cufuse.attention of 4-D tensors through its registered operator
    (torch.compile): (o, lse)."""
    register()
    return _OPS["attention"](q, k, v, float(scale), bool(causal))


def attention_score(q, k, scale, mask):
    """cufuse.attention_score of 4-D tensors through its registered operator (torch.compile)."""
    register()
    return _OPS["attention_score"](q, k, float(scale), mask)


def _register_attention(torch):
    from .ops.attention import backward_tensors, forward_tensors, score_backward, score_tensors

    @_custom_op("cufuse::attention",
                schema="(Tensor q, Tensor k, Tensor v, float scale, bool causal) -> (Tensor, Tensor)")
    def attention_op(q, k, v, scale, causal):
        return forward_tensors(q, k, v, scale, causal)

    @_custom_op("cufuse::attention_backward",
                schema="(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor go, Tensor? glse, float scale, "
                       "bool causal) -> (Tensor, Tensor, Tensor)")
    def attention_backward(q, k, v, o, lse, go, glse, scale, causal):
        return backward_tensors(q, k, v, o, lse, go, scale, causal, glse)

    attention_op.register_fake(lambda q, k, v, scale, causal: (
        q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float64 if q.dtype == torch.float64
                                          else torch.float32)))
    attention_backward.register_fake(lambda q, k, v, o, lse, go, glse, scale, causal: (
        q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))

    def setup(ctx, inputs, output):
        q, k, v, scale, causal = inputs
        ctx.args = (scale, causal)
        ctx.save_for_backward(q, k, v, output[0], output[1])

    def grad(ctx, go, glse):  # (the lse's gradient too: d lse / d scores = p)
        q, k, v, o, lse = ctx.saved_tensors
        go = torch.zeros_like(o) if go is None else go.contiguous()
        dq, dk, dv = attention_backward(q, k, v, o, lse, go, glse, *ctx.args)
        return dq, dk, dv, None, None

    attention_op.register_autograd(grad, setup_context=setup)
    _OPS["attention"] = attention_op

    @_custom_op("cufuse::attention_score",
                schema="(Tensor q, Tensor k, float scale, Tensor? mask) -> Tensor")
    def attention_score_op(q, k, scale, mask):
        return score_tensors(q, k, scale, mask)

    attention_score_op.register_fake(lambda q, k, scale, mask: q.new_empty((*q.shape[:3], k.shape[2])))

    def score_setup(ctx, inputs, output):
        q, k, scale, mask = inputs
        ctx.scale = scale
        ctx.save_for_backward(q, k, mask)

    def score_grad(ctx, g):
        q, k, mask = ctx.saved_tensors
        return (*score_backward(g, q, k, ctx.scale, mask), None, None)

    attention_score_op.register_autograd(score_grad, setup_context=score_setup)
    _OPS["attention_score"] = attention_score_op


# ------------------------------------------------------------ scatter-add


def scatter_add(values, index, dim_size, activation):
    """cufuse.scatter_add through its registered operator (torch.compile)."""
    register()
    return _OPS["scatter_add"](values, index, int(dim_size), activation or "")


def _register_scatter(torch):
    from .ops.scatter import backward_op, forward_op

    # the index range is checked on the host: not capturable in a CUDA graph (inductor's cudagraphs skip it)
    unsafe = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)

    @_custom_op("cufuse::scatter_add", tags=unsafe,
                schema="(Tensor values, Tensor index, int dim_size, str activation) -> Tensor")
    def scatter_op(values, index, dim_size, activation):
        return forward_op(values, index, dim_size, activation)

    scatter_op.register_fake(lambda values, index, dim_size, activation:
                             values.new_empty((dim_size,) + tuple(values.shape[1:])))

    @_custom_op("cufuse::scatter_add_backward",
                schema="(Tensor g, Tensor values, Tensor index, str activation) -> Tensor")
    def scatter_backward(g, values, index, activation):
        return backward_op(g, values, index, activation)

    scatter_backward.register_fake(lambda g, values, index, activation:
                                   torch.empty_like(values, memory_format=torch.contiguous_format))

    def setup(ctx, inputs, output):
        values, index, _, activation = inputs
        ctx.activation = activation
        ctx.save_for_backward(values, index)

    def grad(ctx, g):
        values, index = ctx.saved_tensors
        return scatter_backward(g, values, index, ctx.activation), None, None, None

    scatter_op.register_autograd(grad, setup_context=setup)
    _OPS["scatter_add"] = scatter_op


# torch.compile runs register() at trace time instead of tracing it (torch.compiler.assume_constant_result,
# spelled as its attribute so that defining it needs no torch): a first call inside a compiled function works
register._dynamo_marked_constant = True  # type: ignore[attr-defined]


def call_row(name, *args):
    """A row op through its registered operator (see ``call``)."""
    register()
    return _dispatch(_OPS[name], *args)
