"""cufuse.scatter_add: out[index[e]] += act(values[e]) against a float64
reference written here (a loop over the rows, the activations from their
definitions), every dtype, array kind and activation; collisions (many rows
into one), empty targets, 0 rows, one row, more feature dims, views, int32
indices; gradients by gradcheck and against torch's index_add autograd;
torch.compile; errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cufuse
from _reference import BF16, DTYPES, compiled_matches_eager, example_rows, rand

DTYPES_ALL = DTYPES + ([BF16] if BF16 is not None else [])
ACTS = [None, "relu", "silu", "gelu", "gelu_tanh"]
# sums of a few O(1) terms, accumulated in float32 (float64 for float64) and rounded once; atol for sums that cancel
TOLS = {np.dtype(np.float16): (2e-3, 2e-3), np.dtype(np.float32): (2e-5, 2e-5), np.dtype(np.float64): (1e-12, 1e-12)}
if BF16 is not None:
    TOLS[BF16] = (1e-2, 1e-2)

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _act(v, a):
    """The activation of float64 values, from its definition."""
    if a == "relu":
        return np.maximum(v, 0.0)
    if a == "silu":
        return v / (1 + np.exp(-v))
    if a == "gelu":
        return 0.5 * v * (1 + _erf(v / math.sqrt(2)))
    if a == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    return v


def _reference(values, index, dim_size, a):
    v = _act(values.astype(np.float64), a)
    out = np.zeros((dim_size,) + values.shape[1:])
    for e, d in enumerate(index):
        out[d] += v[e]
    return out


CASES = {  # name: (values shape, dim_size, how)
    "collisions": ((100, 16), 10, "plain"),
    "empty_targets": ((5, 8), 12, "plain"),
    "one_row": ((1, 1), 1, "plain"),
    "odd": ((7, 3), 4, "plain"),
    "features_3d": ((9, 2, 5), 3, "plain"),
    "transposed": ((6, 10), 5, "transposed"),
    "int32_index": ((20, 7), 6, "int32"),
    "no_rows": ((0, 4), 3, "plain"),
}


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(backend, case, act, dtype):
    shape, dim_size, how = CASES[case]
    values = rand(shape, dtype, 1)
    index = np.random.default_rng(2).integers(0, dim_size, shape[0])
    if how == "transposed":
        v = backend.asarray(np.ascontiguousarray(values.T)).T
    else:
        v = backend.asarray(values)
    idx = backend.asarray(index.astype(np.int32 if how == "int32" else np.int64))
    got = backend.to_numpy(cufuse.scatter_add(v, idx, dim_size, activation=act))
    assert got.dtype == dtype and got.shape == (dim_size,) + shape[1:]
    want = _reference(values, index, dim_size, act).astype(dtype).astype(np.float64)
    rtol, atol = TOLS[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    if case == "empty_targets":  # nodes no row reaches are exactly 0
        untouched = np.setdiff1d(np.arange(dim_size), index)
        assert untouched.size and not got[untouched].any()


def test_strided_and_broadcast_index(backend):
    """An index that is a column of an (edges, 2) array (stride 2), reversed
    (negative stride where the kind has it) or one entry broadcast (stride 0):
    the kernel reads one int64 per row, so such views are copied first."""
    values = rand((12, 5), np.float32, 3)
    edges = np.random.default_rng(4).integers(0, 6, (12, 2))
    edges[:, 0] += 100  # the other column out of range: reading it would write out of bounds
    cases = [(backend.asarray(edges)[:, 1], edges[:, 1])]
    if backend.is_torch:
        cases.append((backend.asarray(np.zeros(1, np.int64)).expand(12), np.zeros(12, np.int64)))
    else:
        cases.append((backend.asarray(edges[:, 1])[::-1], edges[::-1, 1]))
    for idx, want_idx in cases:
        got = backend.to_numpy(cufuse.scatter_add(backend.asarray(values), idx, 6, activation="relu"))
        np.testing.assert_allclose(got, _reference(values, want_idx, 6, "relu"), rtol=2e-5, atol=2e-5)


def test_index_of_any_integer_type(backend):
    """Indices of every integer type gather as int64 ones do, torch's uint16 /
    uint32 / uint64 too (they raised AttributeError)."""
    values = rand((12, 5), np.float32, 5)
    idx = np.random.default_rng(6).integers(0, 6, 12)
    want = _reference(values, idx, 6, "relu")
    dts = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.uint64]
    for dt in dts:
        i = backend.asarray(idx.astype(dt)) if not backend.is_torch or dt in (np.int8, np.uint8, np.int16, np.int32) \
            else backend.asarray(idx.astype(np.int64)).to(getattr(backend.torch, np.dtype(dt).name, None) or
                                                           backend.torch.int64)
        got = backend.to_numpy(cufuse.scatter_add(backend.asarray(values), i, 6, activation="relu"))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=str(dt))


def test_errors():
    v = np.ones((4, 3), np.float32)
    i = np.array([0, 1, 2, 1])
    with pytest.raises(ValueError, match=r"index holds values in \[0, 2\]; they must lie in \[0, 2\)"):
        cufuse.scatter_add(v, i, 2)
    with pytest.raises(ValueError, match=r"\[-1, 2\]"):
        cufuse.scatter_add(v, np.array([0, -1, 2, 1]), 3)
    with pytest.raises(TypeError, match="index must hold integers"):
        cufuse.scatter_add(v, i.astype(np.float32), 3)
    with pytest.raises(ValueError, match="one entry per row"):
        cufuse.scatter_add(v, i[:3], 3)
    with pytest.raises(ValueError, match="activation must be one of"):
        cufuse.scatter_add(v, i, 3, activation="tanh")
    with pytest.raises(ValueError, match="dim_size"):
        cufuse.scatter_add(v, i, -1)
    for bad in (True, 6.0, np.array(6)):  # (type errors: a bool, a float, an array)
        with pytest.raises(TypeError, match="dim_size must be an int"):
            cufuse.scatter_add(v, i, bad)
    with pytest.raises(TypeError, match="activation must be None or a str"):
        cufuse.scatter_add(v, i, 3, activation=["relu"])
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.scatter_add(v.astype(np.int32), i, 3)
    with pytest.raises(ValueError, match="0-d"):
        cufuse.scatter_add(np.ones((), np.float32), np.array([0]), 3)


# ---------------------------------------------------------------- autograd
torch = pytest.importorskip("torch")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
_TORCH_ACT = {None: lambda v: v, "relu": torch.relu, "silu": torch.nn.functional.silu,
              "gelu": torch.nn.functional.gelu,
              "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}


def test_kinds_must_match():
    with pytest.raises(TypeError, match="index is torch.Tensor.*but values is a numpy"):
        cufuse.scatter_add(np.ones((2, 3), np.float32), torch.tensor([0, 1]), 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_gradients(device, act):
    """gradcheck in float64, then float32 (and bfloat16 on the GPU) against
    torch's index_add of torch's activation, with a gradient that arrives
    as a transposed view."""
    g = torch.Generator().manual_seed(7)
    rows, nodes, feats = 30, 6, 5
    index = torch.randint(0, nodes, (rows,), generator=g).to(device)
    v = torch.randn(rows, feats, generator=g, dtype=torch.float64).to(device)
    assert torch.autograd.gradcheck(lambda a: cufuse.scatter_add(a, index, nodes, activation=act),
                                    (v.clone().requires_grad_(True),))
    for dt in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        a, b = (v.to(dt).requires_grad_(True) for _ in range(2))
        out = cufuse.scatter_add(a, index, nodes, activation=act)
        ref = torch.zeros(nodes, feats, dtype=torch.float32, device=device).index_add(
            0, index, _TORCH_ACT[act](b.float())).to(dt)
        tol = 1e-5 if dt == torch.float32 else 2e-2
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        gout = torch.randn(feats, nodes, generator=g).to(device=device, dtype=dt).t()
        (da,) = torch.autograd.grad(out, a, gout)
        (db,) = torch.autograd.grad(ref, b, gout)
        torch.testing.assert_close(da, db, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_relu_gradient_at_nan(device):
    """A NaN message passes its gradient through the relu, as torch.relu's
    threshold_backward does (g unless the output is <= 0); it was dropped. An inf or NaN
    gradient where the message is <= 0 gives 0 (not 0 * inf)."""
    index = torch.tensor([0, 1, 1, 2], device=device)
    v = torch.tensor([[float("nan"), 1.0], [-1.0, 0.0], [2.0, float("nan")], [0.5, -0.5]], device=device)
    a, b = v.clone().requires_grad_(True), v.clone().requires_grad_(True)
    gout = torch.tensor([[1.0, 2.0], [float("inf"), 4.0], [5.0, float("nan")]], device=device)  # 0, not 0 * inf
    (da,) = torch.autograd.grad(cufuse.scatter_add(a, index, 3, activation="relu"), a, gout)
    (db,) = torch.autograd.grad(torch.zeros(3, 2, device=device).index_add(0, index, torch.relu(b)), b, gout)
    torch.testing.assert_close(da, db, rtol=0, atol=0)


def test_compile_checks_arguments():
    v, i = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    torch._dynamo.reset()
    for kw, match in (({"dim_size": 2.9}, "dim_size"), ({"dim_size": 3, "activation": ""}, "activation")):
        with pytest.raises(Exception, match=match):
            torch.compile(lambda v: cufuse.scatter_add(v, i, **kw), fullgraph=True)(v)


@pytest.mark.parametrize("device", DEVICES)
def test_under_compile(device):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(8)
    index = torch.randint(0, 4, (12,), generator=g).to(device)
    v = torch.randn(12, 3, generator=g).to(device)

    def f(v):
        return cufuse.scatter_add(v, index, 4, activation="silu").square().sum()
    compiled_matches_eager(f, [v.requires_grad_(True)], 1e-5, 1e-5)
    # the registered operator: schema (no output aliases an input), fake kernel, autograd
    torch.library.opcheck(torch.ops.cufuse.scatter_add, (v, index, 4, "silu"))


def test_gnn_example():
    """examples/gnn.py at its tiny sizes: eager and cufuse start from the same
    weights and graph, so their first and last losses agree."""
    rows, _ = example_rows("gnn.py", "--steps", "2", "--small")
    eager, ours = rows["eager"], rows["cufuse"]
    assert abs(float(eager[3]) - float(ours[3])) < 1e-4 and abs(float(eager[4]) - float(ours[4])) < 1e-4, rows
