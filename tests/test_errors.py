"""Every documented error: exception type, a key phrase of the message, and
(on the GPU backends) that nothing was launched before the error."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cufuse
from cufuse.ops.elementwise import OPS as INTERNAL_OPS

from _reference import ARITY, OP_NAMES, OPS, Backend, gpu_count, rand

F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
ACCEPTED = "float16, float32, float64"
op_param = pytest.mark.parametrize("op", OP_NAMES)


def operands(backend, op, shape=(4, 5), dtype=F32):
    return [backend.asarray(rand(shape, dtype, 10 + k)) for k in range(ARITY[op])]


# ---------------------------------------------------------------------- dtypes
BAD_DTYPES = [np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.complex128]


@op_param
@pytest.mark.parametrize("bad", BAD_DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("position", [0, -1], ids=["first", "last"])
def test_non_float_array_dtype(backend, op, bad, position, launches):
    args = operands(backend, op)
    args[position] = backend.asarray(np.ones((4, 5), dtype=bad))
    with pytest.raises(TypeError, match=ACCEPTED):
        OPS[op](*args)
    assert launches == []


def test_bfloat16_without_ml_dtypes_says_so():
    """Without ml_dtypes (bfloat16's NumPy dtype) a bfloat16 tensor is refused
    by every op family with a TypeError naming ml_dtypes (tests/test_bfloat16.py
    has bfloat16 itself)."""
    pytest.importorskip("torch")
    code = textwrap.dedent("""
        import sys
        sys.modules["ml_dtypes"] = None  # as if not installed
        import torch, cufuse
        x = torch.randn(4, 8).to(torch.bfloat16)
        calls = [lambda: cufuse.add_relu(x, x), lambda: cufuse.layer_norm(x, 8), lambda: cufuse.softmax(x),
                 lambda: cufuse.sum_squared(x), lambda: cufuse.quantize_int8(x, 0.1),
                 lambda: cufuse.fuse(lambda a: a * 2)(x), lambda: cufuse.sum_squared(x.float(), dtype=torch.bfloat16)]
        for k, call in enumerate(calls):
            try:
                call()
            except TypeError as e:
                assert "ml_dtypes" in str(e), (k, str(e))
            else:
                raise AssertionError(f"call {k} did not raise")
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@op_param
def test_only_scalars(op):
    with pytest.raises(TypeError, match="at least one operand must be an array"):
        OPS[op](*([1.5] * ARITY[op]))
    with pytest.raises(TypeError, match="at least one operand must be an array"):
        OPS[op](*([np.float32(1.5)] + [2] * (ARITY[op] - 1)))


@pytest.mark.parametrize("scalar, phrase", [(True, "bool scalars are not accepted"),
                                            (np.bool_(False), "bool scalars are not accepted"),
                                            (1 + 2j, "complex scalars are not accepted")],
                         ids=["bool", "np.bool_", "complex"])
def test_bad_scalar_types(backend, scalar, phrase, launches):
    x = backend.asarray(rand((5,), F32, 2))
    with pytest.raises(TypeError, match=phrase):
        cufuse.add_relu(x, scalar)
    assert launches == []


# ------------------------------------------------------------- operand count
@op_param
def test_wrong_operand_count(backend, op):
    x = backend.asarray(rand((5,), F32, 3))
    n = ARITY[op]
    phrase = f"takes {n} (operands|positional arguments)"
    with pytest.raises(TypeError, match=phrase):
        OPS[op](*[x] * (n - 1))
    with pytest.raises(TypeError, match=phrase):
        OPS[op](*[x] * (n + 1))
    with pytest.raises(TypeError, match=phrase):
        OPS[op]()


@op_param
def test_wrong_operand_count_internal(op):
    """The op objects behind the functions check the count themselves."""
    x = rand((5,), F32, 3)
    n = ARITY[op]
    with pytest.raises(TypeError, match=f"takes {n} operands, got {n + 1}"):
        INTERNAL_OPS[op](*[x] * (n + 1))
    with pytest.raises(TypeError, match=f"takes {n} operands, got {n - 1}"):
        INTERNAL_OPS[op](*[x] * (n - 1))


# ------------------------------------------------------------ operand types
@op_param
@pytest.mark.parametrize("bad", [[1.0, 2.0], "abc", None, {"a": 1}, object()],
                         ids=["list", "str", "None", "dict", "object"])
def test_non_array_operand(backend, op, bad, launches):
    x = backend.asarray(rand((2,), F32, 4))
    args = [x] * ARITY[op]
    args[1] = bad
    name = f"{type(bad).__module__}.{type(bad).__name__}"
    with pytest.raises(TypeError, match=re.escape(f"operand 2: got {name}")):
        OPS[op](*args)
    assert launches == []


@op_param
def test_shapes_do_not_broadcast(backend, op, launches):
    args = [backend.asarray(rand((3, 4), F32, 5))] * ARITY[op]
    args[-1] = backend.asarray(rand((5,), F32, 6))
    with pytest.raises(ValueError, match="do not broadcast"):
        OPS[op](*args)
    assert launches == []


# --------------------------------------------------------------- mixed kinds
KIND_NAMES = {"numpy": "numpy.ndarray", "cupy": "cupy.ndarray",
              "torch_cpu": "torch.Tensor (CPU)", "torch_cuda": "torch.Tensor (CUDA)"}
_GPU = pytest.mark.cuda
MIXED = [
    pytest.param("numpy", "torch_cpu", id="numpy-torch_cpu"),
    pytest.param("torch_cpu", "numpy", id="torch_cpu-numpy"),
    pytest.param("numpy", "cupy", id="numpy-cupy", marks=_GPU),
    pytest.param("cupy", "numpy", id="cupy-numpy", marks=_GPU),
    pytest.param("cupy", "torch_cuda", id="cupy-torch_cuda", marks=_GPU),
    pytest.param("torch_cuda", "cupy", id="torch_cuda-cupy", marks=_GPU),
    pytest.param("torch_cpu", "torch_cuda", id="torch_cpu-torch_cuda", marks=_GPU),
    pytest.param("torch_cuda", "numpy", id="torch_cuda-numpy", marks=_GPU),
    pytest.param("cupy", "torch_cpu", id="cupy-torch_cpu", marks=_GPU),
]


@op_param
@pytest.mark.parametrize("first, second", MIXED)
def test_mixed_kinds(op, first, second, launches):
    b1, b2 = Backend(first), Backend(second)
    args = [b1.asarray(rand((6,), F32, 7))] + [2.5] * (ARITY[op] - 2) + [b2.asarray(rand((6,), F32, 8))]
    with pytest.raises(TypeError, match="mixed array kinds") as exc:
        OPS[op](*args)
    msg = str(exc.value)
    assert KIND_NAMES[first] in msg and KIND_NAMES[second] in msg
    assert launches == []


# ------------------------------------------------------------------------ out=
@op_param
def test_out_wrong_shape(backend, op, launches):
    args = operands(backend, op)
    for shape in [(5, 4), (4, 5, 1), (20,), ()]:
        out = backend.full(shape, np.nan, F32)
        with pytest.raises(ValueError, match=re.escape(f"out has shape {shape}")):
            OPS[op](*args, out=out)
        assert np.isnan(backend.to_numpy(out)).all()
    assert launches == []


@op_param
@pytest.mark.parametrize("out_dtype", [F16, F64, np.dtype(np.int32)], ids=lambda d: d.name)
def test_out_wrong_dtype(backend, op, out_dtype, launches):
    args = operands(backend, op)
    out = backend.asarray(np.zeros((4, 5), out_dtype))
    with pytest.raises(TypeError, match="out has dtype"):
        OPS[op](*args, out=out)
    assert launches == []


def test_out_dtype_is_the_promoted_one(backend, launches):
    """float16 + float32 operands need a float32 out; a float16 out is refused."""
    a, b = backend.asarray(rand((8,), F16, 1)), backend.asarray(rand((8,), F32, 2))
    with pytest.raises(TypeError, match="result dtype is float32"):
        cufuse.add_relu(a, b, out=backend.full((8,), 0, F16))
    assert launches == []


OTHER_KIND = {"numpy": "torch_cpu", "torch_cpu": "numpy", "cupy": "numpy", "torch_cuda": "cupy"}


@op_param
def test_out_wrong_kind(backend, op, launches):
    other = Backend(OTHER_KIND[backend.name])
    args = operands(backend, op)
    out = other.full((4, 5), np.nan, F32)
    with pytest.raises(TypeError, match=re.escape(f"but the operands are {KIND_NAMES[backend.name]}")):
        OPS[op](*args, out=out)
    assert np.isnan(other.to_numpy(out)).all()
    assert launches == []


@pytest.mark.parametrize("bad", [[0.0] * 20, 1.0, "out"], ids=["list", "float", "str"])
def test_out_not_an_array(backend, bad, launches):
    args = operands(backend, "add_relu", shape=(20,))
    with pytest.raises(TypeError, match="out must be a"):
        cufuse.add_relu(*args, out=bad)
    assert launches == []


def _broadcast_out(backend, shape):
    """A writable view with a stride of 0, in the backend's kind."""
    base = backend.full((1, shape[1]), np.nan, F32)
    if backend.name == "numpy":
        return np.lib.stride_tricks.as_strided(base, shape=shape, strides=(0, base.strides[1]),
                                               writeable=True)
    if backend.name == "cupy":
        return backend.cp.broadcast_to(base, shape)
    return base.expand(*shape)


@op_param
def test_out_broadcast_view(backend, op, launches):
    args = operands(backend, op)
    out = _broadcast_out(backend, (4, 5))
    with pytest.raises(ValueError, match="broadcast view"):
        OPS[op](*args, out=out)
    assert launches == []


@op_param
def test_out_read_only_numpy(op):
    args = operands(Backend("numpy"), op)
    out = np.zeros((4, 5), F32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        OPS[op](*args, out=out)
    assert not out.any()


def test_out_read_only_numpy_broadcast():
    """np.broadcast_to views are read-only: refused either way (ValueError)."""
    x = rand((4, 5), F32, 1)
    out = np.broadcast_to(np.zeros((1, 5), F32), (4, 5))
    with pytest.raises(ValueError, match="read-only|broadcast view"):
        cufuse.add_relu(x, x, out=out)


# --------------------------------------------------------------- autograd
def _torch_backend(backend):
    if not backend.is_torch:
        pytest.skip("requires_grad exists only in torch")
    return backend.torch


@op_param
@pytest.mark.parametrize("where", ["operand", "out"])
def test_requires_grad(backend, op, where, launches):
    torch = _torch_backend(backend)
    np_in = [rand((64,), F32, 20 + k) for k in range(ARITY[op])]
    args = [backend.asarray(a) for a in np_in]
    out = None
    if where == "operand":
        args[0] = args[0].clone().requires_grad_(True)
    else:
        out = backend.full((64,), np.nan, F32).requires_grad_(True)
    kw = {} if out is None else {"out": out}
    if where == "operand":  # differentiable (tests/test_autograd.py): recorded for backward
        r = OPS[op](*args)
        assert r.requires_grad and r.grad_fn is not None
        with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
            OPS[op](*args, out=backend.full((64,), np.nan, F32))
    else:  # (as torch's out= functions: a RuntimeError; it had said the op "has no autograd yet")
        with pytest.raises(RuntimeError, match="out requires grad"):
            OPS[op](*args, **kw)
    del launches[:]
    with pytest.raises(NotImplementedError, match="quantize_int8 has no autograd yet"):
        cufuse.quantize_int8(backend.asarray(np_in[0]).requires_grad_(True), 0.1)
    assert launches == []
    # Works under torch.no_grad(), with the same values as detached inputs give.
    with torch.no_grad():
        res = OPS[op](*args, **kw)
    expected = OPS[op](*[a.detach() for a in args])
    np.testing.assert_array_equal(backend.to_numpy(res), backend.to_numpy(expected))
    if out is not None:
        assert res is out


# ----------------------------------------------------------------- two GPUs
def _two_gpus():
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.cuda
@op_param
def test_cupy_operands_on_two_gpus(op, launches):
    _two_gpus()
    import cupy as cp
    a0 = cp.asarray(rand((16,), F32, 1))
    with cp.cuda.Device(1):
        a1 = cp.asarray(rand((16,), F32, 2))
        out1 = cp.zeros((16,), F32)
    args = [a0] * (ARITY[op] - 1) + [a1]
    with pytest.raises(ValueError, match="different GPUs"):
        OPS[op](*args)
    with pytest.raises(ValueError, match="out is on GPU 1"):
        OPS[op](*[a0] * ARITY[op], out=out1)
    assert launches == []


@pytest.mark.cuda
@op_param
def test_torch_operands_on_two_gpus(op, launches):
    _two_gpus()
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("torch sees fewer than 2 GPUs")
    a0 = torch.from_numpy(rand((16,), F32, 1)).to("cuda:0")
    a1 = torch.from_numpy(rand((16,), F32, 2)).to("cuda:1")
    with pytest.raises(ValueError, match="different GPUs"):
        OPS[op](*[a0] * (ARITY[op] - 1), a1)
    with pytest.raises(ValueError, match="out is on GPU 1"):
        OPS[op](*[a0] * ARITY[op], out=torch.zeros(16, device="cuda:1"))
    assert launches == []


@pytest.mark.cuda
def test_cupy_operands_on_second_gpu_run_there(launches):
    """Both operands on GPU 1 while GPU 0 is current: the result is on GPU 1 and right."""
    _two_gpus()
    import cupy as cp
    from _reference import assert_close, reference
    a, b = rand((4097,), F32, 1), rand((4097,), F32, 2)
    with cp.cuda.Device(1):
        da, db = cp.asarray(a), cp.asarray(b)
    with cp.cuda.Device(0):
        res = cufuse.add_relu(da, db)
    assert res.data.device_id == 1 and len(launches) == 1
    assert_close(cp.asnumpy(res), reference("add_relu", [a, b], F32), F32)


# ------------------------------------------------------- huge Python ints
def test_int_scalars_beyond_any_float_are_named():
    """A Python int no float can hold gets an error naming the op and operand
    (OverflowError for operands, as NumPy raises; ValueError for parameters
    that must be finite), raised before anything runs."""
    x = rand((4,), F32, 1)
    with pytest.raises(OverflowError, match=r"cufuse.add_relu: operand 2 is an int of 1329 bits"):
        cufuse.add_relu(x, 10**400)
    with pytest.raises(OverflowError, match=r"cufuse.fma: operand 1 is an int"):
        cufuse.fma(-10**400, x, x)
    with pytest.raises(ValueError, match=r"cufuse.quantize_int8: scale must be finite and > 0, got an int"):
        cufuse.quantize_int8(x, 10**400)
    with pytest.raises(ValueError, match=r"cufuse.dequantize_int8: zero_point must be finite, got an int"):
        cufuse.dequantize_int8(np.zeros(4, np.int8), 0.5, zero_point=-10**400)
    with pytest.raises(ValueError, match=r"cufuse.layer_norm: eps must be finite and >= 0"):
        cufuse.layer_norm(x, 4, eps=10**400)
    assert cufuse.add_relu(x, 10**30).dtype == F32  # a big int that a float holds is fine


# -------------------------------------------- quantize parameters, masked arrays
def test_quantize_scalar_scale_with_axis(backend, launches):
    """A scalar scale with axis= is a mistake (one scale per channel was asked
    for); a scalar zero point with axis= is one zero point for every channel."""
    x = backend.asarray(rand((3, 8), F32, 2))
    with pytest.raises(TypeError, match=r"quantize_int8: scale is a scalar .* axis=0 .*shape \(3,\)"):
        cufuse.quantize_int8(x, 0.5, axis=0)
    with pytest.raises(TypeError, match=r"dequantize_int8: scale is a scalar .* axis=1 .*shape \(8,\)"):
        cufuse.dequantize_int8(backend.asarray(np.ones((3, 8), np.int8)), 0.5, axis=1)
    assert launches == []
    q = cufuse.quantize_int8(x, np.full(3, 0.25, np.float32), 2.0, axis=0)   # a scalar zero point
    ref = np.clip(np.rint(rand((3, 8), F32, 2).astype(np.float64) / 0.25 + 2.0), -128, 127)
    np.testing.assert_array_equal(backend.to_numpy(q), ref.astype(np.int8))


@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
def test_quantize_parameters_checked_in_the_compute_type(backend, dtype, launches):
    """A scale that is positive in float64 but 0 (or inf) in float32, where the
    data is computed, is rejected, per tensor as per channel; float64 data takes it."""
    x = backend.asarray(rand((4, 8), dtype, 3))
    with pytest.raises(ValueError, match=r"quantize_int8: scale 1e-46 is 0.0 in float32"):
        cufuse.quantize_int8(x, 1e-46, 5.0)
    with pytest.raises(ValueError, match=r"quantize_int8: every scale must be finite and > 0"):
        cufuse.quantize_int8(x, np.full(4, 1e-46), axis=0)
    with pytest.raises(ValueError, match=r"dequantize_int8: scale 1e\+39 is inf in float32"):
        cufuse.dequantize_int8(backend.asarray(np.zeros(8, np.int8)), 1e39, dtype=dtype)
    with pytest.raises(ValueError, match=r"quantize_int8: zero_point 1e\+39 is inf in float32"):
        cufuse.quantize_int8(x, 0.5, 1e39)
    assert launches == []
    x64 = rand((4, 8), F64, 3)
    q = cufuse.quantize_int8(backend.asarray(x64), 1e-46, 5.0)     # float64: a valid scale
    np.testing.assert_array_equal(backend.to_numpy(q), np.full((4, 8), 127, np.int8) * np.sign(x64).astype(np.int8)
                                  + (np.sign(x64) < 0).astype(np.int8) * -1)


def test_per_channel_parameter_that_requires_grad(backend, launches):
    """A per-channel scale tensor that requires grad: the same clear error as for
    the data; under torch.no_grad() it runs (the CPU path too)."""
    if not backend.is_torch:
        pytest.skip("torch only")
    torch = backend.torch
    x = backend.asarray(rand((3, 8), F32, 4))
    s = backend.asarray(np.full(3, 0.5, np.float32)).requires_grad_(True)
    with pytest.raises(NotImplementedError, match="requires grad"):
        cufuse.quantize_int8(x, s, axis=0)
    assert launches == []
    with torch.no_grad():
        q = cufuse.quantize_int8(x, s, axis=0)
    ref = np.clip(np.rint(rand((3, 8), F32, 4).astype(np.float64) / 0.5), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(backend.to_numpy(q), ref)


def test_strides_of_partial_items_rejected():
    """A view whose byte strides are not whole items (a structured array's
    field) would be stepped through in elements: every entry point raises
    ValueError naming the strides, before anything runs (the check is the
    array classification's, CuPy arrays' too)."""
    import cufuse.image  # noqa: F401
    rec = np.zeros((4, 6), dtype=[("v", "<f4", (3,)), ("flag", "u1")])
    rec["v"] = rand((4, 6, 3), F32, 6)
    x = rec["v"][..., 0]  # float32 with byte strides (78, 13)
    assert x.strides[-1] % 4
    calls = [lambda: cufuse.add_relu(x, 1.0), lambda: cufuse.layer_norm(x, 6), lambda: cufuse.softmax(x),
             lambda: cufuse.sum_squared(x), lambda: cufuse.fuse(lambda a: a * 2)(x),
             lambda: cufuse.image.process(x, None)]
    calls += [lambda: cufuse.quantize_int8(x, 0.1), lambda: cufuse.scatter_add(x, np.zeros(4, np.int64), 2),
              lambda: cufuse.add_relu(rand((4, 6), F32, 7), 1.0, out=x)]
    for call in calls:  # (each names the op: the message came without it)
        with pytest.raises(ValueError, match=r"^cufuse\.\S+: .*not multiples of its 4-byte items"):
            call()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_torch_func_transforms_refused(device):
    """torch.func's vmap and grad: a TypeError that says they are not supported (torch's "Cannot access data
    pointer of Tensor that doesn't have storage" and "must override the setup_context" came through)."""
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 4, device=device)
    t = torch.tensor([0, 1, 2, 3], device=device)
    calls = [lambda: torch.func.vmap(lambda v: cufuse.softmax(v))(x),
             lambda: torch.func.vmap(lambda v: cufuse.add_relu(v, 1.0))(x),
             lambda: torch.func.vmap(cufuse.fuse(lambda a: a * 2))(x),
             lambda: torch.func.vmap(lambda v: cufuse.cross_entropy(v, t))(x[:, None].expand(3, 4, 4)),
             lambda: torch.func.grad(lambda v: cufuse.layer_norm(v, 4).sum())(x),
             lambda: torch.func.grad(lambda v: cufuse.fuse(lambda a: a * 2)(v).sum())(x)]
    for call in calls:
        with pytest.raises(TypeError, match="torch.func transform"):
            call()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_unstrided_torch_tensors_rejected(device):
    """Nested, sparse and meta tensors: a TypeError naming the op and what to pass (torch's own
    errors came through: "NestedTensorImpl doesn't support sizes", a numpy conversion of a meta
    tensor; on the GPU the fast path's strides of a sparse tensor)."""
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 3, 5, 8, device=device)
    nested = torch.nested.nested_tensor([torch.randn(5, 8), torch.randn(3, 8)], layout=torch.jagged, device=device)
    cases = {"nested": (nested, "nested torch tensor"),
             "sparse": (q.to_sparse(), "layout torch.sparse_coo; pass x.to_dense"),
             "meta": (q.to("meta"), "is a meta tensor")}
    tables = torch.ones(5, 8, device=device)
    for name, (t, match) in cases.items():
        calls = [lambda: cufuse.add_relu(t, 1.0), lambda: cufuse.attention(t, q, q), lambda: cufuse.softmax(t),
                 lambda: cufuse.rope(t, None, tables, tables)]
        for call in calls:
            with pytest.raises(TypeError, match=r"^cufuse\.\S+: .*" + match):
                call()


def test_masked_arrays_rejected():
    """numpy.ma arrays: their mask would be ignored, so every entry point says so."""
    m = np.ma.masked_array(rand((2, 4), F32, 5), mask=[[1, 0, 0, 0], [0, 0, 0, 1]])
    calls = [lambda: cufuse.add_relu(m, 1.0), lambda: cufuse.quantize_int8(m, 0.5),
             lambda: cufuse.layer_norm(m, 4), lambda: cufuse.softmax(m), lambda: cufuse.sum_squared(m),
             lambda: cufuse.fuse(lambda a: a * 2)(m), lambda: cufuse.exp(m)]
    for call in calls:
        with pytest.raises(TypeError, match="MaskedArray; its mask would be ignored"):
            call()


def test_refused_inputs_say_why():
    """Each names the op and what to pass instead: a negative-bit torch view (its memory holds the
    values negated), a list as cross_entropy's target (it raised kind_of's bare message), a uint64
    index beyond int64 (its range was reported wrapped negative)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"cufuse\.quantize_int8: .*negative bit set.*resolve_neg"):
        cufuse.quantize_int8(torch._neg_view(torch.ones(2)), 0.5)
    with pytest.raises(TypeError, match=r"cufuse\.cross_entropy: target must be the logits' array kind.*builtins\.list"):
        cufuse.cross_entropy(torch.randn(2, 3), [0, 1])
    with pytest.raises(ValueError, match=r"cufuse\.scatter_add: index holds values up to 9223372036854775808"):
        cufuse.scatter_add(np.ones(2), np.array([2 ** 63, 0], np.uint64), 2)
    # the refusal's reason where the array is out= or a target, and an activation that is no name
    neg = torch._neg_view(torch.zeros(3))
    with pytest.raises(TypeError, match=r"cufuse\.softmax: out must be .*negative bit set.*resolve_neg"):
        cufuse.softmax(torch.randn(3), out=neg)
    with pytest.raises(TypeError, match=r"cufuse\.cross_entropy: target must be .*negative bit set.*resolve_neg"):
        cufuse.cross_entropy(torch.randn(4, 5), torch._neg_view(torch.tensor([-1, -2, -3, -4])))
    with pytest.raises(TypeError, match=r"cufuse\.scatter_add: activation must be None or a str .*\['relu'\]$"):
        cufuse.scatter_add(np.ones((4, 5)), np.array([0, 1, 1, 0]), 2, activation=["relu"])
    with pytest.raises(TypeError, match=r"cufuse\.quantize_int8: scale is refused: .*negative bit set"):
        cufuse.quantize_int8(torch.randn(4, 3), torch._neg_view(torch.ones(3)), axis=1)
    with pytest.raises(OverflowError, match=r"cufuse\.add_relu: operand 2 is an int of 1329 bits"):
        cufuse.add_relu(torch.ones(3, requires_grad=True), 10 ** 400)  # (recorded: the same check)
    # a list as x beside a weight that requires grad: x's own error, not an AttributeError
    with pytest.raises(TypeError, match=r"cufuse\.layer_norm: x must be an array"):
        cufuse.layer_norm([[1.0] * 4], 4, torch.ones(4, requires_grad=True))
