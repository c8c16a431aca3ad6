"""Autograd for the elementwise ops on torch tensors: the backward formulas.

A call whose torch operands require grad (with grad mode on) runs through
its registered operator (cufuse/_torch_ops.py), whose autograd formula is
here: the forward is the op itself; the backward is
ONE generated kernel per op and signature (a ``cufuse.fuse`` function of the
incoming gradient and what the forward saved: its output, or its inputs
where the derivative needs them), then, for an operand that was broadcast,
a sum down to its shape (torch's ``sum_to_size``). Python-scalar operands
get no gradient. Calls without grad take the ops' direct path, as before.

Saved for backward, per op: add_relu and add_mul_exp their output only;
mul_tanh the inputs and the output; fma the inputs; bias_gelu the inputs.
"""
from __future__ import annotations

import math

from . import _arrays as A
from . import _torch_ops as TO

_GRADS: dict = {}   # op key -> (what to save, the fused backward)


def no_out(name, out):
    """A recorded call (autograd, torch.compile tracing) cannot take ``out=``,
    as torch's out= arguments cannot: RuntimeError before anything runs."""
    if out is not None:
        raise RuntimeError(f"cufuse.{name}: out= does not support automatic differentiation or torch.compile "
                           "tracing (as torch's out= arguments); call it without out=, or under torch.no_grad()")


_CLASSES: dict = {}
_APPLY: dict = {}   # key -> that class's apply as torch's C implementation
_functorch_active = None  # torch._C._are_functorch_transforms_active, once torch is imported


def _function_class(key, make):
    """The torch.autograd.Function subclass ``make(torch)`` builds, made once."""
    cls = _CLASSES.get(key)
    if cls is None:
        cls = _CLASSES[key] = make(A.torch())
    return cls


def apply(key, make, *args):
    """``_function_class(key, make).apply(*args)`` through torch's C apply,
    bound once. Function.apply's Python part checks for torch.func
    transforms (asked here too: under one, its route is taken) and for a
    setup_context (the classes here have none), ~1.5 µs a call; under
    torch.compile the Python apply is what Dynamo traces. Tensors of a
    torch.func transform that has ended (dead wrappers) are not unwrapped as
    that part does: they have no storage, so reading their address raises."""
    if TO.compiling():
        return _function_class(key, make).apply(*args)
    f = _APPLY.get(key)
    if f is None:
        f = _bind_apply(key, make)
    if _functorch_active():  # (the Functions have no setup_context, which torch.func's route needs)
        raise TypeError("cufuse: torch.func transforms (vmap, grad, jacrev, ...) are not supported; call "
                        "cufuse's ops on plain tensors (torch.autograd for gradients)")
    return f(*args)


def _bind_apply(key, make):
    global _functorch_active
    torch = A.torch()
    cls = _function_class(key, make)
    if cls.setup_context is not torch.autograd.Function.setup_context:
        raise TypeError(f"{cls.__name__} defines setup_context: its apply binds default arguments in Python")
    _functorch_active = torch._C._are_functorch_transforms_active
    f = _APPLY[key] = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
    return f


def once_differentiable(fn):
    """A Function's backward that is not itself differentiable. With grad mode
    off (a plain backward) ``fn`` runs as it is (no_grad is the mode already).
    With it on (``create_graph=True``) every gradient it returns is marked so
    that differentiating it raises. torch's ``once_differentiable`` marks them
    only when an incoming gradient requires grad, so the gradient of a loss
    such as ``o.sum()`` came back as a constant and a penalty on it (a
    double backward) silently added nothing. The mark (a node that raises)
    also takes the saved tensors and incoming gradients that require grad as
    inputs: it is then on the path from the gradients to the op's inputs, so
    ``torch.autograd.grad(penalty, params)`` and hessians raise too (a mark
    on fresh leaves alone was not on that path: they silently left this op's
    terms out). Where nothing links it so (an op that saved no such tensor,
    and incoming gradients that do not require grad) the mark is on the
    fresh leaves alone, as before: ``.backward()`` of a penalty raises. The
    saved tensors are unpacked once (``fn`` gets them through a view of
    ``ctx``): a non-reentrant checkpoint refuses a second unpack, and an
    in-place backward (cross_entropy) bumps their version."""
    import functools

    import torch
    grad_enabled, delayed = torch.is_grad_enabled, torch._C._functions.DelayedError

    class Unpacked:
        """``ctx`` with its saved tensors unpacked once."""

        def __init__(self, c, saved):
            object.__setattr__(self, "_c", c)
            object.__setattr__(self, "saved_tensors", saved)

        def __getattr__(self, k):
            return getattr(object.__getattribute__(self, "_c"), k)

        def __setattr__(self, k, v):
            setattr(object.__getattribute__(self, "_c"), k, v)

    def fake_requires_grad(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach()
            v.requires_grad = True
        return v

    @functools.wraps(fn)
    def backward(ctx, *grads):
        if not grad_enabled():
            return fn(ctx, *grads)
        saved = ctx.saved_tensors
        links = [t for t in (*saved, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
        with torch.no_grad():
            outs = fn(Unpacked(ctx, saved), *grads)
        outs_ = outs if isinstance(outs, tuple) else (outs,)
        err = delayed(b"cufuse: trying to differentiate twice: a cufuse op's backward is not differentiable "
                      b"(its create_graph=True gradients cannot be differentiated again)", len(outs_) + len(links))
        res = err(*[fake_requires_grad(v) for v in outs_], *links)
        res = res if isinstance(res, tuple) else (res,)
        return tuple(res[:len(outs_)]) if isinstance(outs, tuple) else res[0]
    return backward


def wants_grad(args) -> bool:
    """A torch operand requires grad and grad mode is on."""
    t = None
    for a in args:
        if A.is_torch_tensor(a) and a.requires_grad:
            t = t or A.torch()
            if t.is_grad_enabled():
                return True
    return False


def _grads():
    if _GRADS:
        return _GRADS
    from ._fuse import functions as F
    from ._fuse.api import Fused

    s2pi = 1.0 / math.sqrt(2.0 * math.pi)
    c = math.sqrt(2.0 / math.pi)

    def dgelu_erf(v):
        return 0.5 * (1.0 + F.erf(v * 0.7071067811865476)) + v * F.exp(-0.5 * v * v) * s2pi

    def dgelu_tanh(v):
        t = F.tanh(c * (v + 0.044715 * v * v * v))
        return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * v * v)

    relu_b = Fused(lambda g, y: F.where(y <= 0, 0.0, g), name="add_relu_backward")  # (NaN passes g, as torch)
    exp_b = Fused(lambda g, y: g * y * 2.0, name="add_mul_exp_backward")
    tanh_b = Fused(lambda g, a, b, y: ((1.0 - y * y) * g * b, (1.0 - y * y) * g * a), name="mul_tanh_backward")
    fma_b = Fused(lambda g, q, k: (g * k, g * q), name="fma_backward")
    gelu_b = Fused(lambda g, x, b: g * dgelu_erf(x + b), name="bias_gelu_backward")
    gelu_t = Fused(lambda g, x, b: g * dgelu_tanh(x + b), name="bias_gelu_tanh_backward")
    # op -> (what the forward saves: "out", "in" or "both"; (g, inputs, output) -> a gradient per
    # operand, of the broadcast shape; each is ONE generated kernel per signature)
    _GRADS.update({
        "add_relu": ("out", lambda g, ins, y: [relu_b(g, y)] * 2),
        "add_mul_exp": ("out", lambda g, ins, y: [exp_b(g, y)] * 2),
        "mul_tanh": ("both", lambda g, ins, y: list(tanh_b(g, *ins, y))),
        "fma": ("in", lambda g, ins, y: [*fma_b(g, ins[0], ins[1]), g]),
        "bias_gelu": ("in", lambda g, ins, y: [gelu_b(g, *ins)] * 2),
        "bias_gelu_tanh": ("in", lambda g, ins, y: [gelu_t(g, *ins)] * 2),
    })
    return _GRADS


# ------------------------------------------------------------ gelu_dropout
def dropout_apply(fwd, bwd, x, params, np_params):
    """gelu_dropout recorded for autograd: the forward saves x only (and the
    seed and p, as numbers); the backward is ONE kernel that draws the mask
    again from the same Philox lanes (kernels/dropout.cu GeluDropoutGrad)."""
    return apply("gelu_dropout", _dropout_class, x, fwd, bwd, params, np_params)


def _dropout_class(torch):
    class GeluDropoutFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd, bwd, params, np_params):
            ctx.save_for_backward(x)
            ctx.bwd, ctx.params, ctx.np_params = bwd, params, np_params
            return fwd.call((x.detach(),), None, params=params, np_params=np_params)

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            dx = ctx.bwd.call((g, x.detach()), None, params=ctx.params, np_params=ctx.np_params)
            return dx, None, None, None, None

    return GeluDropoutFn


# ------------------------------------------------------- cufuse.fuse
_TENSOR = object()  # where an argument was a tensor (saved for backward)


def fused_apply(fused, args, into_inputs=False):
    """A ``cufuse.fuse`` call recorded for autograd: the forward is the fused
    function itself on detached tensors; the backward ONE generated kernel
    per signature that recomputes the forward and writes the gradient of
    every argument that needs one (Fused._backward). Saved: the arguments.
    ``into_inputs``: the backward writes each gradient into its argument's
    own memory where that is a CUDA intermediate of the graph (not a leaf nor
    a view of one), contiguous, of the gradient's shape and dtype, as
    cross_entropy's in-place backward: the arguments then hold their
    gradients. Being no leaf does not make a tensor private (autocast's
    cached casts, DataParallel's replicated parameters are intermediates
    too): only for callers that made the arguments and hand them to nothing
    else (cufuse.nn.SwiGLU)."""
    return apply("fuse", _fused_class, fused, into_inputs, *args)


def _keep_graph(torch) -> bool:
    """The running backward keeps the graph (retain_graph, create_graph); True where torch cannot say."""
    return getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)()


def _intermediate(t) -> bool:
    """A CUDA tensor that autograd made: neither a leaf nor a view of one (its memory is no user's data)."""
    root = t._base if t._is_view() else t
    return t.is_cuda and not root.is_leaf


def _fused_class(torch):
    class FusedFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fused, into_inputs, *args):
            fused._differentiable_once(args)  # NotImplementedError before anything runs
            tensors = [a for a in args if A.is_torch_tensor(a)]
            ctx.fused = fused
            ctx.args = [_TENSOR if A.is_torch_tensor(a) else a for a in args]
            ctx.into = into_inputs and all(_intermediate(t) for t in tensors if t.requires_grad)
            ctx.save_for_backward(*tensors)
            return fused(*[a.detach() if A.is_torch_tensor(a) else a for a in args])

        @staticmethod
        @once_differentiable
        def backward(ctx, *gouts):
            saved = ctx.saved_tensors
            it = iter(saved)
            args = [next(it).detach() if a is _TENSOR else a for a in ctx.args]
            need = [i for i, r in enumerate(ctx.needs_input_grad[2:]) if r and ctx.args[i] is _TENSOR]
            # not where the graph is kept for another backward (retain_graph): that one reads the arguments
            into = ctx.into and not _keep_graph(torch)
            grads = ctx.fused._backward(args, gouts, need, into)
            if into:  # arguments that now hold their gradients: a backward that saved them raises
                for t, i in zip(saved, [i for i, a in enumerate(ctx.args) if a is _TENSOR]):
                    if grads.get(i) is args[i]:
                        torch.autograd.graph.increment_version(t)
            return (None, None, *[grads.get(i) for i in range(len(args))])

    return FusedFn


# ------------------------------------------------------------ reductions
def reduction_grad(g, x, axes, keepdims, mean):
    """dx of sum_squared (``mean`` False) or mean_abs over ``axes`` from the
    incoming gradient g: one generated kernel, in x's dtype."""
    R = _row_fns()
    if not keepdims:
        g = g.reshape([1 if i in axes else n for i, n in enumerate(x.shape)])
    if mean:
        dx = R["abs_grad"](g, x, float(math.prod(x.shape[i] for i in axes)))
    else:
        dx = R["sq_grad"](g, x)
    return dx.to(x.dtype)


# ------------------------------------------------------------- row ops
# Backward of the norms and softmax on rows of the last ``n`` elements, from
# generated kernels: row statistics by fused trailing reductions, the input
# gradient by one fused elementwise kernel (float16 computed in float32);
# weight and bias gradients are column sums (torch). Nothing is saved by the
# forward but its inputs (the statistics are recomputed) or, for softmax, its
# output.
_ROW: dict = {}


def _row_fns():
    if _ROW:
        return _ROW
    from ._fuse import functions as F
    from ._fuse.api import Fused
    _ROW.update(
        mean=Fused(lambda x: x.mean(axis=-1, keepdims=True), name="row_mean"),
        var=Fused(lambda x, mu: ((x - mu) * (x - mu)).mean(axis=-1, keepdims=True), name="row_var"),
        ms=Fused(lambda x: (x * x).mean(axis=-1, keepdims=True), name="row_mean_square"),
        xhat=Fused(lambda x, mu, rstd: (x - mu) * rstd, name="row_xhat"),
        # relu passes the gradient unless its output is <= 0 (a NaN output passes it, as torch's)
        gmask=Fused(lambda g, w, xh, b, relu: F.where((relu == 0) | ~(xh * w + b <= 0), g, 0.0), name="row_gmask"),
        stats=Fused(lambda gxh, xh: ((gxh).mean(axis=-1, keepdims=True), (gxh * xh).mean(axis=-1, keepdims=True)),
                    name="row_grad_stats"),
        dx=Fused(lambda gxh, xh, s1, s2, rstd, center: rstd * (gxh - center * s1 - xh * s2), name="row_dx"),
        sq_grad=Fused(lambda g, x: 2.0 * x * g, name="sum_squared_backward"),
        abs_grad=Fused(lambda g, x, n: F.where(x > 0, g, F.where(x < 0, -g, 0.0)) / n, name="mean_abs_backward"),
        sm_sum=Fused(lambda g, y: (g * y).sum(axis=-1, keepdims=True), name="softmax_grad_sum"),
        sm_dx=Fused(lambda g, y, s: y * (g - s), name="softmax_dx"),
        lsm_sum=Fused(lambda g: g.sum(axis=-1, keepdims=True), name="log_softmax_grad_sum"),
        lsm_dx=Fused(lambda g, y, s: g - F.exp(y) * s, name="log_softmax_dx"),
    )
    return _ROW


_NORM_OPS: list = []  # cufuse.ops.norm, imported at the first backward (it imports this module)


def _norm_ops():
    if not _NORM_OPS:
        from .ops import norm
        _NORM_OPS.append(norm)
    return _NORM_OPS[0]


def norm_backward(kind, g, x, n, w, b, eps, gadd=None):
    """(dx, dw or None, db or None) of layer_norm (kind "layer", "layer_relu")
    or rms_norm ("rms") over the last ``n`` elements of each row; ``gadd``
    (x's shape, or None) is added to dx (the residual-add norms: x is the
    sum they return too, gadd its gradient)."""
    if x.numel() == 0:  # no element (rows of none, or none of them): zero gradients of the inputs' shapes
        import torch
        dx = torch.zeros_like(x) if gadd is None else gadd.clone()
        return dx, None if w is None else torch.zeros_like(w), None if b is None else torch.zeros_like(b)
    if x.is_cuda:  # one pass (kernels/norm_backward.cu) where the rows fit it
        res = _norm_ops().backward_rows(kind, g, x, n, w, b, eps, gadd)
        if res is not None:
            return res
    import torch
    if gadd is not None:
        dx, dw, db = norm_backward(kind, g, x, n, w, b, eps)
        return dx + gadd, dw, db
    R = _row_fns()
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x2 = x.reshape(-1, n).to(acc)
    g2 = g.reshape(-1, n).to(acc)
    w2 = w.reshape(n).to(acc) if w is not None else 1.0
    b2 = b.reshape(n).to(acc) if b is not None else 0.0
    if kind == "rms":
        rstd = torch.rsqrt(R["ms"](x2) + eps)
        xh = x2 * rstd
    else:
        x2 = x2 - x2[:, :1]  # (each row shifted by its first element, as the NumPy forward: an offset common to
        # the row, 1000 + randn, costs the statistics nothing, and the relu mask agrees with the forward's)
        mu = R["mean"](x2)
        rstd = torch.rsqrt(R["var"](x2, mu) + eps)  # (rows, 1): a small torch op
        xh = R["xhat"](x2, mu, rstd)
    gm = R["gmask"](g2, w2, xh, b2, 1 if kind == "layer_relu" else 0) if kind == "layer_relu" else g2
    gxh = gm * w2 if w is not None else gm
    s1, s2 = R["stats"](gxh, xh)
    dx = R["dx"](gxh, xh, s1, s2, rstd, 0.0 if kind == "rms" else 1.0).to(x.dtype).reshape(x.shape)
    dw = db = None
    if w is not None or b is not None:
        if w is not None:
            dw = (gm * xh).sum(0).to(w.dtype).reshape(w.shape)
        if b is not None:
            db = gm.sum(0).to(b.dtype).reshape(b.shape)
    return dx, dw, db


def softmax_backward(g, y, axis, log):
    """dx of softmax / log_softmax along ``axis`` from the output ``y``."""
    if y.is_cuda and y.dim() and axis % y.dim() == y.dim() - 1:  # one pass (kernels/norm_backward.cu)
        dx = _norm_ops().softmax_backward_rows(g, y, log)
        if dx is not None:
            return dx
    import torch
    if y.dim() == 0:  # a row of one element: softmax is 1 and log_softmax 0 whatever x is
        return torch.zeros_like(y)
    R = _row_fns()
    acc = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
    gm, ym = g.movedim(axis, -1).to(acc), y.movedim(axis, -1).to(acc)
    if log:
        dx = R["lsm_dx"](gm, ym, R["lsm_sum"](gm))
    else:
        dx = R["sm_dx"](gm, ym, R["sm_sum"](gm, ym))
    return dx.to(y.dtype).movedim(-1, axis).contiguous()
