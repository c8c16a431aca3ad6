"""Seeds for cufuse's random ops, and Philox4x32-10 in NumPy.

The GPU kernels (kernels/common.cuh: philox4x32_10, philox_lane) and the
NumPy fallback compute the same lanes for the same (seed, element index), so
a mask drawn on the GPU equals the fallback's, bit for bit.
"""
from __future__ import annotations

import os
import threading

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LO = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)

_lock = threading.Lock()
_state = [int.from_bytes(os.urandom(8), "little")]
_manual = [False]  # whether manual_seed set the state (else it is entropy)


def manual_seed(seed: int) -> None:
    """Make the seeds that cufuse's random ops draw (``seed=None``) on NumPy and CuPy arrays
    reproducible (torch tensors draw from torch's generator: ``torch.manual_seed``)."""
    _state[0] = check_seed(seed, "cufuse.manual_seed")
    _manual[0] = True


def _reseed_after_fork():
    """A forked process (a DataLoader worker, say) draws seeds of its own unless manual_seed set the
    parent's state (then it repeats the parent's sequence, as torch's generator does after a fork)."""
    if not _manual[0]:
        _state[0] = int.from_bytes(os.urandom(8), "little")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed_after_fork)


# torch_seed's range, which the compiled gelu_dropout draws from too (the same seed, the same mask)
TORCH_SEED_HIGH = 2 ** 63 - 1


def torch_seed() -> int:
    """A seed drawn from torch's default generator, as torch's own dropout draws: torch.manual_seed
    repeats it, and torch.utils.checkpoint's recompute (which restores that generator) draws it again."""
    import torch
    return int(torch.randint(0, TORCH_SEED_HIGH, ()))


def next_seed() -> int:
    """The next seed of cufuse's generator (a 64-bit key; each call advances it)."""
    with _lock:
        s = _state[0]
        _state[0] = (s + 1) & 0xFFFFFFFFFFFFFFFF
    return s


def check_seed(seed, who: str) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{who}: seed must be an int in [0, 2**64), got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"{who}: seed must be in [0, 2**64), got {seed}")
    return seed


def philox4x32_10(counter, key):
    """Philox4x32-10 on arrays of counters: ``counter`` is 4 uint32 arrays,
    ``key`` 2 uint32 values; returns 4 uint32 arrays (Random123's rounds)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = int(key[0]), int(key[1])
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        p0, p1 = _M0 * c0, _M1 * c2
        hi0, lo0 = p0 >> _S32, p0 & _LO
        hi1, lo1 = p1 >> _S32, p1 & _LO
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def philox_lanes(seed: int, n: int, bits: int = 32) -> np.ndarray:
    """Lane i % L of Philox4x32-10 at counter i // L, key ``seed``, for i < n,
    as uint32: ``bits`` 32, L = 4 (the four words); ``bits`` 16, L = 8 (the
    low half of each word, then its high half)."""
    if bits not in (16, 32):
        raise ValueError(f"philox_lanes: bits must be 16 or 32, got {bits}")
    per = 128 // bits
    q = np.arange((n + per - 1) // per, dtype=np.uint64)
    words = np.stack(philox4x32_10((q & _LO, q >> _S32, np.zeros_like(q), np.zeros_like(q)),
                                   (seed & 0xFFFFFFFF, seed >> 32)), axis=1)
    if bits == 16:
        words = np.stack((words & np.uint32(0xFFFF), words >> np.uint32(16)), axis=2)
    return words.reshape(-1)[:n]
