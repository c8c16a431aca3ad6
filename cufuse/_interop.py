"""Zero-copy, stream-ordered conversion between torch and NumPy/CuPy."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _arrays as A


def from_torch(t: Any) -> Any:
    """A torch tensor as a CuPy array (CUDA) or a NumPy array (CPU), sharing memory.

    CUDA tensors go through DLPack with CuPy's current stream as the consumer:
    work torch queued on its current stream is ordered before anything CuPy
    queues afterwards, without a host synchronization. CPU tensors are
    detached and viewed as NumPy arrays (bfloat16 as ``ml_dtypes.bfloat16``).
    """
    if not A.is_torch_tensor(t):
        raise TypeError(f"cufuse.from_torch: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    if t.is_neg():  # (DLPack would drop the bit: the values negated, silently)
        raise TypeError("cufuse.from_torch: the tensor has its negative bit set (a lazy negation, such as "
                        "z.conj().imag), whose memory holds the values negated; pass t.resolve_neg()")
    if t.is_conj():
        raise TypeError("cufuse.from_torch: the tensor has its conjugate bit set (a lazy z.conj()), whose memory "
                        "holds the values unconjugated; pass t.resolve_conj()")
    if t.is_cuda:
        from ._runtime import _cp, CUDA_AVAILABLE
        if _cp is None or not CUDA_AVAILABLE:
            raise RuntimeError("cufuse.from_torch: a CUDA tensor needs CuPy and a usable GPU")
        with _cp.cuda.Device(t.get_device()):
            return _cp.from_dlpack(t.detach())
    if t.device.type != "cpu":
        raise TypeError(f"cufuse.from_torch: tensors on {t.device} are not supported (CPU or CUDA only)")
    if A.BF16 is None and t.dtype == A.torch().bfloat16:
        raise TypeError(f"cufuse.from_torch: a bfloat16 CPU tensor as NumPy: {A.NO_BF16}")
    return A.torch_numpy(t)


def to_torch(a: Any) -> Any:
    """A CuPy array (as a CUDA tensor) or a NumPy array (as a CPU tensor), sharing memory.

    CuPy arrays go through DLPack with torch's current stream as the consumer,
    so work queued on CuPy's current stream is done before torch reads.
    """
    torch = A.torch()
    if torch is None:
        try:
            import torch  # noqa: F811 - explicit conversion asks for torch
        except ImportError:
            raise ImportError("cufuse.to_torch needs PyTorch installed") from None
    if isinstance(a, np.ndarray):
        try:
            A.kind_of(a)  # (a masked array or np.matrix: refused, as by every op)
        except (TypeError, ValueError) as e:
            raise type(e)(f"cufuse.to_torch: {e}") from None
        if any(st < 0 for st, n in zip(a.strides, a.shape) if n > 1):
            raise ValueError("cufuse.to_torch: the array has negative strides (a reversed view), which a torch "
                             "tensor cannot share; pass a.copy()")
        if not a.dtype.isnative:
            raise ValueError(f"cufuse.to_torch: the array's dtype {a.dtype.str} is not in this machine's byte "
                             "order, which a torch tensor cannot share; pass a.astype(a.dtype.newbyteorder('='))")
        if not a.flags.writeable:  # (torch tensors have no read-only flag: a write crashed on a read-only
            # memory map, or changed an immutable bytes object)
            raise ValueError("cufuse.to_torch: the array is read-only (a read-only memory map, np.frombuffer of "
                             "bytes, a broadcast view); a tensor sharing its memory could be written: pass a.copy()")
        return A.torch_from_numpy(a)
    if isinstance(a, A.CupyArray):
        return torch.from_dlpack(a)
    if isinstance(a, torch.Tensor):
        return a
    raise TypeError(f"cufuse.to_torch: expected a numpy.ndarray or cupy.ndarray, got "
                    f"{type(a).__module__}.{type(a).__name__}")
