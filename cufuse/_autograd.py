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

_GRADS: dict = {}   # op key -> (what to save, the fused backward)


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
