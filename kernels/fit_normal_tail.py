"""How the coefficients of ``normal_tail<D>`` in kernels/common.cuh were made.

Not part of the package; needs SciPy. Run: ``python3 kernels/fit_normal_tail.py 8 5 4``.

The upper tail of the standard normal, Q(a) = erfc(a / sqrt 2) / 2 for a >= 0,
is written as t * 2**(p(t - tc) - a**2 log2(e) / 2) with t = 1 / (1 + k a).
For each degree D, k and tc are searched on a grid, p is fitted minimax to the
log2 of Q over a in [0, 14] (a linear program on a dense grid), then its
coefficients are rounded to float32 one at a time from the highest degree, the
lower ones refitted after each rounding. Prints k, tc, the fit's relative error
of Q and the coefficients as common.cuh spells them.
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


def fit(d, k, tc, m=1500, rounded=False):
    a = grid(m)
    k, tc = float(np.float32(k)), float(np.float32(tc))
    t = 1 / (1 + k * a)
    y = log_ndtr(-a) / np.log(2) - np.log2(t) + C32 * a * a   # what p must give
    V = np.vander(t - tc, d + 1, increasing=True)
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
    """(k, tc) as float32: k on a grid with tc mid-way in t's range, then both refined."""
    best = None
    for k in np.linspace(0.2, 0.8, 25):
        tc = (1 + 1 / (1 + k * A_MAX)) / 2
        err = fit(d, k, tc, 400)[1]
        if best is None or err < best[0]:
            best = (err, k, tc)
    k0 = best[1]
    for k in np.linspace(k0 - 0.025, k0 + 0.025, 11):
        for tc in np.linspace(1 / (1 + k * A_MAX), 1.0, 9):
            err = fit(d, k, tc, 400)[1]
            if err < best[0]:
                best = (err, k, tc)
    return float(np.float32(best[1])), float(np.float32(best[2]))


if __name__ == "__main__":
    for d in [int(a) for a in sys.argv[1:]] or [8, 5, 4]:
        k, tc = search(d)
        c, err = fit(d, k, tc, 3000, rounded=True)
        print(f"D = {d}: k = {k!r}f, tc = {tc!r}f, relative error of Q {err * np.log(2):.2g}")
        print("    " + ", ".join(f"{float(x)!r}f" for x in c))
