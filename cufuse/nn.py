"""``torch.nn.Module`` drop-ins running cufuse's kernels (needs torch).

Each module takes the constructor arguments of the module it replaces and
keeps its parameters under the same names, so ``state_dict`` saving and
loading are unchanged; ``forward`` calls the fused op (differentiable:
see docs/pytorch.md). Parameters in another dtype than the input (float32
master weights under bfloat16 activations) are cast to the input's dtype in
the forward, a differentiable cast.

- ``LayerNorm``, ``RMSNorm``: ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``;
  ``add_and_norm(x, residual)`` gives ``(norm(x + residual), x + residual)``
  in one pass (a block's residual connection and this norm).
- ``GELU``: ``torch.nn.GELU``.
- ``GELUDropout``: ``torch.nn.Sequential(GELU(approximate), Dropout(p))`` in
  one kernel, whose backward keeps no mask (eval mode: GELU alone).
- ``SwiGLU``: the gated MLP of Llama-family models (Hugging Face's
  ``LlamaMLP``: ``gate_proj``, ``up_proj``, ``down_proj``), with
  ``silu(gate) * up`` as one fused kernel forward and one backward;
  ``GeGLU``: the same with a GELU gate (Gemma's MLP); ``gated(x)``: the
  gate from one fused ``gate_up`` projection's output.
- ``CrossEntropyLoss``: ``torch.nn.CrossEntropyLoss`` (class indices, no
  class weights) through ``cufuse.cross_entropy``, plus a z-loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import torch
from torch import nn

from . import _autograd as AG
from . import _torch_ops as TO
from . import ops as _ops
from ._fuse import functions as _F
from ._fuse.api import fuse as _fuse
from .ops.elementwise import check_dropout_p

__all__ = ["LayerNorm", "RMSNorm", "GELU", "GELUDropout", "SwiGLU", "GeGLU", "swiglu", "geglu", "geglu_tanh",
           "gated", "CrossEntropyLoss", "PatchReport"]


def _as(p, x):
    return p if p is None or p.dtype == x.dtype else p.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same arguments and parameters) through ``cufuse.layer_norm``."""

    def forward(self, x):
        return _ops.layer_norm(x, tuple(self.normalized_shape), _as(self.weight, x), _as(self.bias, x), self.eps)

    def add_and_norm(self, x, residual):
        """``(self(x + residual), x + residual)`` in one pass (``cufuse.add_layer_norm``)."""
        return _ops.add_layer_norm(x, residual, tuple(self.normalized_shape), _as(self.weight, x),
                                   _as(self.bias, x), self.eps)


def _rms_eps(eps, x):
    """``eps``, or torch's default for None: the machine epsilon of the type torch computes in,
    float32 for 16-bit inputs (their own epsilon, 1e-3 for float16 and 8e-3 for bfloat16, would
    shrink small activations' outputs by a third)."""
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same arguments and parameters) through
    ``cufuse.rms_norm``; ``eps=None`` is torch's default (float32's machine
    epsilon for 16-bit and float32 inputs, float64's for float64)."""

    def forward(self, x):
        return _ops.rms_norm(x, tuple(self.normalized_shape), _as(self.weight, x), _rms_eps(self.eps, x))

    def add_and_norm(self, x, residual):
        """``(self(x + residual), x + residual)`` in one pass (``cufuse.add_rms_norm``): a
        block's residual connection and this norm; the second result is the next residual."""
        return _ops.add_rms_norm(x, residual, tuple(self.normalized_shape), _as(self.weight, x),
                                 _rms_eps(self.eps, x))


class GELU(nn.GELU):
    """``torch.nn.GELU`` through ``cufuse.bias_gelu`` (with a zero bias)."""

    def forward(self, x):
        return _ops.bias_gelu(x, 0.0, self.approximate)


class GELUDropout(nn.Module):
    """dropout(gelu(x)) in one kernel (``cufuse.gelu_dropout``): the mask is
    drawn again in backward rather than saved. Its seed comes from torch's
    (CPU) generator, as ``cufuse.gelu_dropout``'s on torch tensors does, so the
    masks follow ``torch.manual_seed`` and ``torch.utils.checkpoint``'s
    recompute draws the forward's mask. In eval mode: GELU alone."""

    def __init__(self, p: float = 0.1, approximate: str = "none"):
        super().__init__()
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)) or \
                not 0.0 <= p < 1.0:
            raise ValueError(f"cufuse.nn.GELUDropout: p must be a number in [0, 1), got {p!r}")
        check_dropout_p("cufuse.nn.GELUDropout", p)  # (and not closer to 1 than the mask resolves)
        self.p, self.approximate = p, approximate

    def forward(self, x):
        return _ops.gelu_dropout(x, self.p, self.training, approximate=self.approximate)

    def extra_repr(self):
        return f"p={self.p}, approximate={self.approximate!r}"


@_fuse
def swiglu(gate, up):
    """silu(gate) * up, fused; differentiable (one backward kernel)."""
    return gate * _F.sigmoid(gate) * up


@_fuse
def geglu(gate, up):
    """gelu(gate) * up (the erf GELU), fused; differentiable (one backward kernel)."""
    return _F.gelu(gate) * up


@_fuse
def geglu_tanh(gate, up):
    """gelu(gate, approximate="tanh") * up, fused; differentiable."""
    return _F.gelu(gate, "tanh") * up


_GATES = {"silu": swiglu, "gelu": geglu, "gelu_tanh": geglu_tanh}


def gated(x, activation: str = "silu"):
    """act(gate) * up from one fused projection's output ``x`` (its last dim:
    gate, then up, as ``gate_up_proj`` layers give): one fused kernel over
    the two halves (strided views, no copy), differentiable."""
    fn = _GATES.get(activation)
    if fn is None:
        raise ValueError(f"cufuse.nn.gated: activation must be one of {tuple(_GATES)}, got {activation!r}")
    n = x.shape[-1]
    if n % 2:
        raise ValueError(f"cufuse.nn.gated: the last dim holds gate and up, so it must be even; got {n}")
    return fn(x[..., : n // 2], x[..., n // 2:])


class SwiGLU(nn.Module):
    """The gated MLP of Llama-family models: down_proj(act(gate_proj(x)) *
    up_proj(x)), with parameter names of Hugging Face's ``LlamaMLP``;
    ``activation`` "silu" (SwiGLU), "gelu" or "gelu_tanh" (GeGLU, as
    Gemma's), the gate one fused kernel forward and one backward.

    ``inplace_backward`` (default True): on CUDA the gate's backward writes
    the gradients of gate_proj's and up_proj's outputs into those outputs'
    own memory (two intermediate-sized buffers fewer at the backward's peak),
    as Liger-Kernel's SwiGLU does, except under ``retain_graph``. Those
    outputs are made and used here only. A forward hook on gate_proj or
    up_proj sees them: one that keeps them finds them holding their
    gradients after the backward, and a backward through something it made
    of them raises torch's in-place error. Where saved-tensor hooks are
    active (non-reentrant checkpointing, ``saved_tensors_hooks``), which
    turn that error's check off, a forward hook on either (or a global one)
    keeps the gradients apart."""

    inplace_backward = True  # (modules pickled before the option had none)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None,
                 activation: str = "silu", inplace_backward: bool = True):
        super().__init__()
        if activation not in _GATES:
            raise ValueError(f"cufuse.nn.{type(self).__name__}: activation must be one of {tuple(_GATES)}, "
                             f"got {activation!r}")
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size, self.activation = hidden_size, intermediate_size, activation
        if not isinstance(inplace_backward, (bool, np.bool_)):  # ("False" would be true)
            raise TypeError(f"cufuse.nn.{type(self).__name__}: inplace_backward must be a bool, got "
                            f"{type(inplace_backward).__name__}")
        self.inplace_backward = bool(inplace_backward)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x):
        fn, gate, up = _GATES[self.activation], self.gate_proj(x), self.up_proj(x)
        if self._into() and AG.wants_grad((gate, up)):
            return self.down_proj(fn._recorded((gate, up), into_inputs=True))
        return self.down_proj(fn(gate, up))

    def _into(self) -> bool:
        """The gate's backward may write into gate_proj's and up_proj's outputs: asked for, not
        under torch.compile, and not where a forward hook could have kept them while saved-tensor
        hooks turn off torch's check of saved tensors changed in place."""
        if not self.inplace_backward or TO.compiling():
            return False
        seen = nn.modules.module._global_forward_hooks or self.gate_proj._forward_hooks or self.up_proj._forward_hooks
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        return not seen or (top is not None and top(True) is None)

    def extra_repr(self):
        return f"activation={self.activation!r}" + ("" if self.inplace_backward else ", inplace_backward=False")


class GeGLU(SwiGLU):
    """``SwiGLU`` with a GELU gate (``activation`` "gelu" or "gelu_tanh")."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None,
                 activation: str = "gelu", inplace_backward: bool = True):
        super().__init__(hidden_size, intermediate_size, bias, device, dtype, activation, inplace_backward)


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss`` over (rows, classes) logits and (rows,)
    class indices through ``cufuse.cross_entropy`` (one kernel forward, one
    backward, the gradient in place of non-leaf logits), with a ``z_loss``
    term; class ``weight`` and probability targets are not supported. The
    arguments are torch's, in torch's order (``size_average`` and ``reduce``,
    deprecated there, are refused), then the keyword-only ``z_loss`` and
    ``inplace_backward``."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, z_loss: float = 0.0, inplace_backward: bool = True):
        super().__init__()
        if weight is not None:
            raise NotImplementedError("cufuse.nn.CrossEntropyLoss: class weights are not supported; use "
                                      "torch.nn.CrossEntropyLoss for them")
        if size_average is not None or reduce is not None:
            raise NotImplementedError("cufuse.nn.CrossEntropyLoss: size_average and reduce (deprecated in torch) are "
                                      f"not supported, got size_average={size_average!r}, reduce={reduce!r}; pass "
                                      "reduction='mean', 'sum' or 'none'")
        if not isinstance(inplace_backward, (bool, np.bool_)):  # ("False" would be true)
            raise TypeError(f"cufuse.nn.CrossEntropyLoss: inplace_backward must be a bool, got "
                            f"{type(inplace_backward).__name__}")
        self.register_buffer("weight", None)  # (torch's module has one: code that reads it finds None)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.inplace_backward = z_loss, bool(inplace_backward)

    def forward(self, logits, target):
        return _ops.cross_entropy(logits, target, ignore_index=self.ignore_index,
                                  label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                  reduction=self.reduction, inplace_backward=self.inplace_backward)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}")


@dataclass
class PatchReport:
    """What ``cufuse.patch`` replaced: (module name, old type, new type) per
    replacement, and the recognized modules it left alone, with why."""
    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def counts(self):
        """{"old type -> new type": how many}."""
        out: dict = {}
        for _, old, new in self.replaced:
            out[f"{old} -> {new}"] = out.get(f"{old} -> {new}", 0) + 1
        return out

    def __str__(self):
        lines = [f"cufuse.patch: {len(self.replaced)} modules replaced"]
        lines += [f"  {n} x {k}" for k, n in self.counts().items()]
        lines += [f"  left alone: {name} ({why})" for name, why in self.skipped]
        return "\n".join(lines)
