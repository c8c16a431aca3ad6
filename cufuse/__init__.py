"""cufuse: fused CUDA kernels for CuPy and PyTorch arrays, with NumPy fallbacks.

    >>> import cufuse
    >>> y = cufuse.add_mul_exp(x, z)        # exp((x + z) * 2) in one pass
"""
from ._runtime import CUDA_AVAILABLE
from ._interop import from_torch, to_torch
from ._random import manual_seed
from ._fuse import Fused, TraceError, fuse
from ._fuse.functions import (abs, ceil, clip, cos, erf, exp, exp2, expm1, floor, gelu, log, log1p, maximum, minimum,
                              relu, round, rsqrt, sigmoid, silu, sin, softplus, sqrt, tanh, where)
from .ops import (add_layer_norm, attention, attention_score, add_mul_exp, add_relu, add_rms_norm, bias_gelu, cross_entropy, dequantize_int8,
                  fake_quantize_int8, fma, gelu_dropout, layer_norm, layer_norm_relu, linear_cross_entropy, log_softmax,
                  mean_abs, mul_tanh,
                  quantize_int8, rms_norm, rope, scatter_add, softmax, sum_squared)

__version__ = "0.1.0"

import sys as _sys
from typing import Any as _Any


def patch(model: _Any, *, attention: bool = False, linear_loss: bool = True) -> _Any:
    """Swap cufuse's modules (cufuse.nn) into a torch model in place, e.g. a
    Hugging Face Llama, GPT-2, BERT or ViT; returns what it replaced
    (cufuse.nn.PatchReport). ``attention=True``: its attention too, through
    cufuse.attention. ``linear_loss`` (default): a causal LM's head and loss
    in training with labels are one cufuse.linear_cross_entropy (no logits
    are made; the output's ``logits`` is None). See cufuse/_patch.py and
    docs/pytorch.md."""
    from ._patch import patch as _patch
    return _patch(model, attention=attention, linear_loss=linear_loss)


if "torch" in _sys.modules:  # torch.ops.cufuse now (else at the first call on a tensor)
    from . import _torch_ops as _to
    _to.register()

__all__ = ["CUDA_AVAILABLE", "__version__", "from_torch", "to_torch", "patch",
           "add_relu", "mul_tanh", "add_mul_exp", "fma", "bias_gelu", "gelu_dropout",
           "quantize_int8", "dequantize_int8", "fake_quantize_int8", "manual_seed", "sum_squared", "mean_abs",
           "layer_norm", "layer_norm_relu", "rms_norm", "add_rms_norm", "add_layer_norm", "softmax", "log_softmax",
           "cross_entropy", "linear_cross_entropy", "rope", "scatter_add", "attention", "attention_score",
           "fuse", "Fused", "TraceError", "where", "abs", "exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt",
           "sin", "cos", "tanh", "sigmoid", "erf", "relu", "gelu", "silu", "softplus", "clip", "minimum", "maximum",
           "round", "floor", "ceil"]


def __getattr__(name):  # cufuse.bench on first use (python -m cufuse.bench runs it as __main__)
    if name in ("bench", "image"):  # cufuse.image: the image pipelines, imported on first use
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cufuse' has no attribute {name!r}")
