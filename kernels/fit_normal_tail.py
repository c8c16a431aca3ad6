"""How the coefficients of ``normal_tail<D>`` in kernels/common.cuh were made.

Not part of the package; needs SciPy. Run: ``python3 kernels/fit_normal_tail.py 8 5 4``.

The upper tail of the standard normal, Q(a) = erfc(a / sqrt 2) / 2 for a >= 0,
is written as t * 2**(p(t) - a**2 log2(e) / 2) with t = 1 / (1 + k a).
For each degree D, k is searched on a grid, p is fitted minimax to the log2 of
Q over a in [0, 14] (a linear program on a dense grid), then its coefficients
are rounded to float32 one at a time from the highest degree, the lower ones
refitted after each rounding. Prints k, the fit's relative error of Q and the
coefficients as common.cuh spells them.

p is a polynomial in t itself, not in t - tc for some centre tc (as it
once was): the kernel saves a subtraction per element (float16
gelu_dropout is bound by its arithmetic), and the fits are as good or better.
The kernel's float32 evaluation emulated in NumPy, relative error of Q for
a < 5, centred -> plain: D = 8 2.4e-6 -> 2.4e-6, D = 5 7.5e-6 -> 7.5e-6,
D = 4 5.4e-5 -> 3.5e-5 (the degree-4 gain is a better k, 0.505 -> 0.26,
which the centred search had missed); on an H200, every finite float16
input to float16 bias_gelu (D = 5): 324 -> 237 results one ulp off.
"""
import sys

import numpy as np
from scipy.optimize import linprog
from scipy.special import log_ndtr

A_MAX = 14.0
C32 = float(np.float32(np.log2(np.e) / 2))   # the kernel's a**2 factor, as a float32


def grid(m):
    return np.unique(np.concatenate([np.linspace(0, A_MAX, m), A_MAX * np.sin(np.linspace(0, np.pi / 2, m)) ** 2]))


def minimax(V, y):
    """argmin_c max |V c - y| and its value."""
    n = V.shape[1]
    ones = np.ones((len(y), 1))
    res = linprog(np.r_[np.zeros(n), 1.0], A_ub=np.block([[V, -ones], [-V, -ones]]), b_ub=np.r_[y, -y],
                  bounds=[(None, None)] * n + [(0, None)], method="highs")
    return res.x[:n], res.x[-1]


def fit(d, k, m=1500, rounded=False):
    a = grid(m)
    k = float(np.float32(k))
    t = 1 / (1 + k * a)
    y = log_ndtr(-a) / np.log(2) - np.log2(t) + C32 * a * a   # what p must give
    V = np.vander(t, d + 1, increasing=True)
    c, err = minimax(V, y)
    if rounded:
        fixed = {}
        for j in range(d, -1, -1):
            fixed[j] = float(np.float32(c[j]))
            free = [i for i in range(d + 1) if i not in fixed]
            if free:
                rest, err = minimax(V[:, free], y - sum(fixed[i] * V[:, i] for i in fixed))
                c[free] = rest
        c = np.array([fixed[i] for i in range(d + 1)])
        err = np.abs(V @ c - y).max()
    return c, err


def search(d):
    """k as a float32: a coarse grid, then a fine one around its best."""
    def best_of(ks):
        return min((fit(d, k, 400)[1], k) for k in ks)[1]
    k0 = best_of(np.linspace(0.15, 0.9, 76))
    return float(np.float32(best_of(np.linspace(k0 - 0.01, k0 + 0.01, 21))))


if __name__ == "__main__":
    for d in [int(a) for a in sys.argv[1:]] or [8, 5, 4]:
        k = search(d)
        c, err = fit(d, k, 3000, rounded=True)
        print(f"D = {d}: k = {k!r}f, relative error of Q {err * np.log(2):.2g}")
        print("    " + ", ".join(f"{float(x)!r}f" for x in c))
