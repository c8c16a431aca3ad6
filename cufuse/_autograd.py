"""Autograd for the elementwise ops on torch tensors.

A call whose torch operands require grad (with grad mode on) runs through a
``torch.autograd.Function``: the forward is the op itself; the backward is
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

_GRADS: dict = {}   # op key -> (what to save, the fused backward)
_FUNCTION: list = []  # [the torch.autograd.Function], made on first use


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

    relu_b = Fused(lambda g, y: F.where(y > 0, g, 0.0), name="add_relu_backward")
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


def _function():
    if _FUNCTION:
        return _FUNCTION[0]
    torch = A.torch()

    class ElementwiseGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, op, *args):
            saved, _ = _grads()[op.grad]
            y = op.call(args, None)
            ctx.op = op
            ctx.scalars = [None if A.is_torch_tensor(a) else a for a in args]
            ctx.meta = [(tuple(a.shape), a.dtype) if A.is_torch_tensor(a) else None for a in args]
            tensors = [a for a in args if A.is_torch_tensor(a)]
            if saved == "out":
                ctx.save_for_backward(y)
            elif saved == "in":
                ctx.save_for_backward(*tensors)
            else:
                ctx.save_for_backward(*tensors, y)
            return y

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            saved, bwd = _grads()[ctx.op.grad]
            st = list(ctx.saved_tensors)
            ins = y = None
            if saved == "out":
                y = st[0]
            else:
                it = iter(st)
                ins = [next(it) if s is None else s for s in ctx.scalars]
                y = st[-1] if saved == "both" else None
            grads = bwd(g, ins, y)
            out = [None]
            for gr, meta, need in zip(grads, ctx.meta, ctx.needs_input_grad[1:]):
                if meta is None or not need:
                    out.append(None)
                    continue
                shape, dt = meta
                if tuple(gr.shape) != shape:
                    gr = gr.sum_to_size(shape)
                out.append(gr.to(dt) if gr.dtype != dt else gr)
            return tuple(out)

    _FUNCTION.append(ElementwiseGrad)
    return ElementwiseGrad


def apply(op, args, out):
    """``op(*args)`` recorded for autograd (``out=`` cannot be, as in torch)."""
    if out is not None:
        raise RuntimeError(f"cufuse.{op.name}: out= does not support automatic differentiation (as torch's out= "
                           "arguments); call it without out=, or under torch.no_grad()")
    return _function().apply(op, *args)
