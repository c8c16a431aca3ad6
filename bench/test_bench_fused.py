"""Benchmarks of cufuse's fused GELU and int8 quantization ops.

* test_bias_gelu: bias_gelu(x, bias), approximate "none" and "tanh"
* test_quantize: quantize_int8 per tensor and per channel (axis 0, last axis)
* test_dequantize: dequantize_int8 per tensor and per channel, float32 and float16 out
* test_gelu_dropout: gelu_dropout(x, p=0.1)

x is a (N // 1024, 1024) C-contiguous array (N = 50M or 1M nominal: 49,999,872
or 999,424 elements; or "L2": N from the device's L2 size at run time, so that
x, the output and the small operands fill at most half of it), float32 or
float16. cufuse (out=) against the CuPy ufunc chain, cupy.fuse of that chain,
torch eager and torch.compile, each peer skipped on its own when it is
unavailable (or, for cupy.fuse, when this CuPy cannot trace or compile the
chain: the summary says why), and at 1M NumPy on the CPU ("numpy (CPU)").
gelu_dropout has no cupy.fuse peer (cupy.fuse has no random numbers; the mask
is cufuse's own Philox stream) and no CuPy chain. Same method as
test_bench_elementwise.py (see bench/README.md); the issue's targets
go to the summary as met/MISSED and never fail a test.

Run from the repository root:  PYTHONPATH=$PWD python3 -m pytest bench/test_bench_fused.py --benchmark-only -q
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import cufuse

import _common
from _common import as_cupy, cp, F, L2, max_errors, measure, need_torch, size_id, slow_if_large, torch, torch_stream  # noqa: F401
from _common import first_call as _first_call

pytestmark = _common.pytestmark

COLS = 1024
SIZES = (50_000_000, 1_000_000, L2)   # nominal; the arrays hold (N // COLS) * COLS elements
DTYPES = ("float32", "float16")
IMPLS = ("cufuse", "cupy-chain", "cupy.fuse", "torch-eager", "torch.compile")
# The CPU peer (NumPy on host copies) up to this size, as test_bench_elementwise.py:
# the 1M case only (not "L2", whose size is known only at run time; not 50M).
NUMPY_MAX = 1_000_000
TOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 2e-2)}  # (rtol, atol) vs float64 NumPy
DT_SHORT = {"float32": "f32", "float16": "f16"}

# Quantization parameters, exactly representable in float16 (so every
# implementation, whatever its parameter dtype, uses the same values) and not
# powers of two (the division is a real one).
Q_SCALE, Q_ZP = 3 / 128, -3.0
P_DROP, SEED = 0.1, 20261121

# The targets at 50M (judged in the summary, never enforced).
TARGET_PCT = {"bias_gelu": 90.0, "quantize_int8[tensor]": 88.0, "dequantize_int8[tensor]": 88.0,
              "per_channel": 85.0, "gelu_dropout": 85.0}
TARGET_F16_PCT = 80.0
TARGET_VS_COMPILE, TARGET_VS_EAGER = 1.05, 1.5


def cases(variants, impls=IMPLS, dtypes=DTYPES):
    """50M first, so that torch.compile's first (static) compile is the 50M one
    (dynamic=False below anyway); inputs are regenerated only when (n, dtype) changes."""
    return [pytest.param(n, dt, v, impl, id=f"{v}-{dt}-{size_id(n)}-{impl}", marks=slow_if_large(n))
            for n in SIZES for dt in dtypes for v in variants
            for impl in impls + (("numpy",) if n != L2 and n <= NUMPY_MAX else ())]


def resolve(gpu, n, in_bytes, out_bytes):
    """The element count of a size: n, or for "L2" this device's: x (``in_bytes``
    per element), the output and the small operands (a bias row, or a float32
    scale and zero point per channel: at most 8 bytes per row and 8 per column)
    in half of the L2 (GpuBench.l2_elements), whole rows of COLS."""
    if n != L2:
        return n
    return gpu.l2_elements(in_bytes + out_bytes + 8 / COLS, multiple=COLS, fixed_bytes=8 * COLS)


# ----------------------------------------------------------------- inputs
def data(gpu, n, dtype):
    """x: (n // COLS, COLS) view of the session's random normal input; bias: (COLS,)."""
    a, b, _ = gpu.inputs(n, dtype)
    rows = n // COLS
    return a[:rows * COLS].reshape(rows, COLS), b[:COLS]


_Q: dict = {}


def int8_data(gpu, n):
    """int8 codes, (n // COLS, COLS): rint(40 x) clipped, x the float32 input (all 256 codes occur)."""
    if _Q.get("n") != n:
        _Q.clear()
        x, _ = data(gpu, n, "float32")
        _Q["q"] = cp.clip(cp.rint(x * 40), -128, 127).astype(cp.int8)
        _Q["n"] = n
        gpu.sync()
    return _Q["q"]


def channel_params(nch, dtype):
    """Per-channel scale and zero point (CuPy, ``dtype``) and their float64 host copies:
    scale = (16 + c % 16) / 512 (exact in float16), zero point = c % 7 - 3."""
    c = np.arange(nch)
    s64 = (16 + c % 16) / 512.0
    z64 = (c % 7 - 3).astype(np.float64)
    return cp.asarray(s64, dtype=dtype), cp.asarray(z64, dtype=dtype), s64, z64


def torch_dtype(dtype):
    return {"float32": torch.float32, "float16": torch.float16}[dtype]


def sample_index(n):
    """About 65K strided flat indices plus the last 1024."""
    step = max(1, n // 65536)
    return cp.unique(cp.concatenate([cp.arange(0, n, step), cp.arange(max(0, n - 1024), n)]))


# ------------------------------------------------------ float64 references
_erfc = np.frompyfunc(math.erfc, 1, 1)


def gelu64(v, approximate):
    """float64 GELU (PyTorch's definitions), independent of cufuse's code."""
    v = np.asarray(v, dtype=np.float64)
    if approximate == "tanh":
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
    return 0.5 * v * np.asarray(_erfc(-v / math.sqrt(2.0)), dtype=np.float64)


def check_close(what, got, ref, dtype):
    """Asserts; returns {max_abs_err, max_rel_err} for the report."""
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol,
                               err_msg=f"{what}: result differs from the float64 reference")
    return dict(zip(("max_abs_err", "max_rel_err"), max_errors(got, ref, atol / rtol)))


# ------------------------------------------------------ torch peers
# One module-level function per variant: distinct code objects, so that
# torch.compile's per-code-object recompile limit is never reached (a function
# over the limit would silently run eagerly).
def t_bias_gelu_none(x, b):
    return F.gelu(x + b, approximate="none")


def t_bias_gelu_tanh(x, b):
    return F.gelu(x + b, approximate="tanh")


def t_quant_tensor(x):
    return torch.clamp(torch.round(x / Q_SCALE + Q_ZP), -128, 127).to(torch.int8)


def t_quant_axis0(x, s, z):
    return torch.clamp(torch.round(x / s[:, None] + z[:, None]), -128, 127).to(torch.int8)


def t_quant_axis1(x, s, z):
    return torch.clamp(torch.round(x / s + z), -128, 127).to(torch.int8)


def t_dequant_tensor_f32(q):
    return (q.to(torch.float32) - Q_ZP) * Q_SCALE


def t_dequant_tensor_f16(q):
    return (q.to(torch.float16) - Q_ZP) * Q_SCALE


def t_dequant_axis0(q, s, z):   # s, z in the output dtype
    return (q.to(s.dtype) - z[:, None]) * s[:, None]


def t_dequant_axis1(q, s, z):
    return (q.to(s.dtype) - z) * s


def t_gelu_dropout(x):
    return F.dropout(F.gelu(x), p=P_DROP, training=True)


_COMPILED: dict = {}


def compiled(fn):
    """torch.compile(fn, dynamic=False): a static kernel for each shape, the
    strongest form of the peer (not timed: compiled by the correctness call)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


# ------------------------------------------------------ CuPy chains
_SPECIAL: dict = {}


def cupy_erf():
    if "erf" not in _SPECIAL:
        try:
            from cupyx.scipy.special import erf
        except Exception as e:
            erf = e
        _SPECIAL["erf"] = erf
    return _SPECIAL["erf"]


def cp_bias_gelu(x, b, approximate):
    v = x + b
    if approximate == "tanh":
        g = 0.5 * v * (1 + cp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    else:
        g = 0.5 * v * (1 + cupy_erf()(v * 0.7071067811865476))
    return g if g.dtype == x.dtype else g.astype(x.dtype)  # erf of float16 comes back float64 (CuPy 14: e->d)


def cp_quant(x, s, z):
    return cp.clip(cp.rint(x / s + z), -128, 127).astype(cp.int8)


def cp_dequant(q, s, z, dtype):
    return (q.astype(dtype) - z) * s


# ------------------------------------------------------ cupy.fuse peers
# The CuPy chains above (ufuncs and astype only) traced by cupy.fuse into one
# kernel each, so that nothing is written twice: the same ufuncs in the same
# dtypes (float16 arithmetic in float16; erf of float16 in float64, cast back).
# A chain's Python argument (approximate, the output dtype) is bound with
# functools.partial, one fused function per value; scale and zero point stay
# arguments (Python floats per tensor, (rows, 1) or (cols,) arrays per channel).
_FUSED: dict = {}


def fused_chain(gpu, chain, arg=None):
    """cupy.fuse of the CuPy chain of ``chain`` ("bias_gelu", "quantize",
    "dequantize"), its Python argument bound to ``arg``; cached per (chain, arg)."""
    if not hasattr(cp, "fuse"):
        gpu.skip("cupy.fuse", "this CuPy has no cupy.fuse")
    key = (chain, arg)
    if key not in _FUSED:
        if chain == "bias_gelu":
            fn = functools.partial(cp_bias_gelu, approximate=arg)
        elif chain == "dequantize":
            fn = functools.partial(cp_dequant, dtype=arg)
        else:
            fn = cp_quant
        # kernel_name: the generated kernel's name (a partial has no __name__)
        name = f"bench_{chain}" + ("" if arg is None else f"_{arg}")
        _FUSED[key] = cp.fuse(kernel_name=name)(fn)
    return _FUSED[key]


# ------------------------------------------------------ NumPy peers (CPU)
# The CuPy chains' expressions in NumPy, in the same dtype. GELU needs erf,
# which NumPy lacks: bias_gelu and gelu_dropout call cufuse's own NumPy
# fallback (cufuse ops take NumPy arrays): gelu(x + b) with SciPy's erf, or
# math.erf per element without SciPy; float16 computed in float32; dropout's
# mask from the same Philox bits as on the GPU.
def np_quant(x, s, z):
    return np.clip(np.rint(x / s + z), -128, 127).astype(np.int8)


def np_dequant(q, s, z, dtype):
    return (q.astype(dtype) - z) * s


def numpy_erf():
    """Which erf the NumPy GELU ran (an extra_info field of its rows)."""
    try:   # cufuse.ops.elementwise._erf's choice
        from scipy.special import erf
    except ImportError:
        return "math.erf per element (no SciPy)"
    return f"scipy.special.{erf.__name__}"


# ------------------------------------------------------ the measurement


def add_target(gpu, op, dtype, n, family, float_dtype):
    """Register the issue's targets for (op, dtype, n): at 50M, float32: the
    family's % of copy, >= 1.05x torch.compile and >= 1.5x torch eager; float16
    (inputs, or dequantize's output): >= 80% of copy (ratios shown, no target)."""
    if n != 50_000_000 or any((t["op"], t["dtype"], t["n"]) == (op, dtype, n) for t in gpu.targets):
        return
    if float_dtype == "float32":
        gpu.targets.append({"op": op, "dtype": dtype, "n": n, "min_pct": TARGET_PCT[family],
                            "min_vs_compile": TARGET_VS_COMPILE, "min_vs_eager": TARGET_VS_EAGER})
    else:
        gpu.targets.append({"op": op, "dtype": dtype, "n": n, "min_pct": TARGET_F16_PCT,
                            "min_vs_compile": None, "min_vs_eager": None})


def first_call(gpu, impl, call, op):
    """_common.first_call for ``op``, the result as a CuPy array."""
    return as_cupy(_first_call(gpu, impl, call, op))


# ----------------------------------------------------------------- bias_gelu
@pytest.mark.parametrize("n,dtype,approximate,impl", cases(("none", "tanh")))
def test_bias_gelu(benchmark, gpu, n, dtype, approximate, impl):
    op = f"bias_gelu[{approximate}]"
    size = size_id(n)
    benchmark.group = f"{op} {size} {dtype}"
    need_torch(gpu, impl)
    isz = np.dtype(dtype).itemsize
    n = resolve(gpu, n, isz, isz)
    gpu.copy_bandwidth()
    x, b = data(gpu, n, dtype)
    stream = cp.cuda.get_current_stream()
    extra = {"size_id": size}
    if impl == "cufuse":
        out = cp.empty_like(x)
        call = lambda: cufuse.bias_gelu(x, b, approximate, out=out)  # noqa: E731
    elif impl == "numpy":   # cufuse's NumPy fallback on host copies (see "NumPy peers")
        xh, bh = x.get(), b.get()
        call = lambda: cufuse.bias_gelu(xh, bh, approximate)  # noqa: E731
        if approximate == "none":
            extra["numpy_erf"] = numpy_erf()
    elif impl in ("cupy-chain", "cupy.fuse"):
        if approximate == "none" and isinstance(cupy_erf(), Exception):
            gpu.skip(f"{impl} (erf)", f"cupyx.scipy.special.erf unavailable: {cupy_erf()}")
        if impl == "cupy-chain":
            call = lambda: cp_bias_gelu(x, b, approximate)  # noqa: E731
        else:
            f = fused_chain(gpu, "bias_gelu", approximate)
            call = lambda: f(x, b)  # noqa: E731
    else:
        tx, tb = torch.from_dlpack(x), torch.from_dlpack(b)
        assert tx.dtype == torch_dtype(dtype)
        f = t_bias_gelu_none if approximate == "none" else t_bias_gelu_tanh
        f = f if impl == "torch-eager" else compiled(f)
        call = lambda: f(tx, tb)  # noqa: E731
        stream = torch_stream(gpu)

    res = first_call(gpu, impl, call, op)
    assert res.shape == x.shape and res.dtype == x.dtype, (res.shape, res.dtype)
    idx = sample_index(x.size)
    xs = x.ravel()[idx].get().astype(np.float64)
    bs = b.get().astype(np.float64)[(idx % COLS).get()]
    errs = check_close(f"{op} {dtype} {impl}", res.ravel()[idx].get(), gelu64(xs + bs, approximate), dtype)
    del res

    nbytes = 2 * x.nbytes  # x read + out written (the 1024-element bias is not counted)
    measure(gpu, benchmark, op=op, dtype=dtype, n=n, impl=impl, call=call, stream=stream,
            nbytes=nbytes, out_dtype=dtype, extra={"elements": x.size, "shape": list(x.shape), **extra, **errs})
    if impl == "cufuse":
        add_target(gpu, op, dtype, n, "bias_gelu", dtype)


# ----------------------------------------------------------------- quantize
QMODES = ("tensor", "axis0", "axis-1")


def peer_sz(mode, peer, host=False):
    """The peers' (scale, zero point), shaped to broadcast against x ((rows, 1)
    on axis 0); ``host``: their NumPy copies, for the CPU peer."""
    if mode == "tensor":
        return Q_SCALE, Q_ZP
    s, z = (v.get() for v in peer) if host else peer
    return (s, z) if mode == "axis-1" else (s[:, None], z[:, None])


def quant_params(x, mode, dtype):
    """(cufuse kwargs, peer (scale, zero point) args, float64 (scale, zp) per flat index fn)."""
    if mode == "tensor":
        return {}, None, lambda idx: (Q_SCALE, Q_ZP)
    axis = 0 if mode == "axis0" else 1
    nch = x.shape[axis]
    s32, z32, s64, z64 = channel_params(nch, np.float32)   # cufuse computes in float32
    sp, zp = (s32, z32) if dtype == "float32" else channel_params(nch, dtype)[:2]  # peers: x's dtype

    def ref(idx):
        c = idx // COLS if axis == 0 else idx % COLS
        return s64[c], z64[c]

    return {"scale": s32, "zero_point": z32, "axis": axis}, (sp, zp), ref


@pytest.mark.parametrize("n,dtype,mode,impl", cases(QMODES))
def test_quantize(benchmark, gpu, n, dtype, mode, impl):
    op = f"quantize_int8[{mode}]"
    size = size_id(n)
    benchmark.group = f"{op} {size} {dtype}"
    need_torch(gpu, impl)
    n = resolve(gpu, n, np.dtype(dtype).itemsize, 1)
    gpu.copy_bandwidth()
    x, _ = data(gpu, n, dtype)
    kw, peer, ref_params = quant_params(x, mode, dtype)
    stream = cp.cuda.get_current_stream()
    if impl == "cufuse":
        out = cp.empty(x.shape, cp.int8)
        if mode == "tensor":
            call = lambda: cufuse.quantize_int8(x, Q_SCALE, Q_ZP, out=out)  # noqa: E731
        else:
            call = lambda: cufuse.quantize_int8(x, kw["scale"], kw["zero_point"], axis=kw["axis"], out=out)  # noqa: E731
    elif impl in ("cupy-chain", "cupy.fuse"):
        s, z = peer_sz(mode, peer)
        f = cp_quant if impl == "cupy-chain" else fused_chain(gpu, "quantize")
        call = lambda: f(x, s, z)  # noqa: E731
    elif impl == "numpy":   # the same chain on host copies, parameters in x's dtype
        xh, (s, z) = x.get(), peer_sz(mode, peer, host=True)
        call = lambda: np_quant(xh, s, z)  # noqa: E731
    else:
        tx = torch.from_dlpack(x)
        if mode == "tensor":
            f, args = t_quant_tensor, (tx,)
        else:
            f = t_quant_axis0 if mode == "axis0" else t_quant_axis1
            args = (tx, torch.from_dlpack(peer[0]), torch.from_dlpack(peer[1]))
        f = f if impl == "torch-eager" else compiled(f)
        call = lambda: f(*args)  # noqa: E731
        stream = torch_stream(gpu)

    res = first_call(gpu, impl, call, op)
    assert res.shape == x.shape and res.dtype == np.int8, (res.shape, res.dtype)
    idx = sample_index(x.size)
    idx_h = idx.get()
    xs = x.ravel()[idx].get()
    s64, z64 = ref_params(idx_h)
    ref = np.clip(np.rint(xs.astype(np.float64) / s64 + z64), -128, 127)
    got = res.ravel()[idx].get().astype(np.float64)
    what = f"{op} {dtype} {impl}"
    assert np.max(np.abs(got - ref)) <= 1, f"{what}: off by more than one code"
    # cufuse: float32 arithmetic with a true division, documented bit for bit
    # against NumPy in float32; others: near-ties may round the other way
    # (float16 peers round x / scale to half first: its spacing is 1/8 above 128).
    miss = float(np.mean(got != ref))
    assert miss <= (1e-3 if dtype == "float32" or impl == "cufuse" else 0.1), \
        f"{what}: {miss:.2%} of codes differ from the float64 reference"
    if impl == "cufuse":
        f32 = np.float32
        ref32 = np.clip(np.rint(xs.astype(f32) / np.asarray(s64, f32) + np.asarray(z64, f32)), -128, 127)
        np.testing.assert_array_equal(got, ref32.astype(np.float64), err_msg=f"{what}: not NumPy's float32 result")
    del res

    nbytes = x.nbytes + x.size  # x read + int8 out written (per-channel parameters not counted)
    measure(gpu, benchmark, op=op, dtype=dtype, n=n, impl=impl, call=call, stream=stream,
            nbytes=nbytes, out_dtype="int8", extra={"elements": x.size, "shape": list(x.shape), "size_id": size,
                                                    "max_abs_err": float(np.max(np.abs(got - ref))),  # in codes
                                                    "codes_off": miss})
    if impl == "cufuse":
        add_target(gpu, op, dtype, n, op if mode == "tensor" else "per_channel", dtype)


# ----------------------------------------------------------------- dequantize
@pytest.mark.parametrize("n,dtype,mode,impl", cases(QMODES))
def test_dequantize(benchmark, gpu, n, dtype, mode, impl):
    """``dtype`` is the output dtype; the input is int8."""
    op = f"dequantize_int8[{mode}]"
    label = f"i8->{DT_SHORT[dtype]}"
    size = size_id(n)
    benchmark.group = f"{op} {size} {label}"
    need_torch(gpu, impl)
    n = resolve(gpu, n, 1, np.dtype(dtype).itemsize)
    gpu.copy_bandwidth()
    q = int8_data(gpu, n)
    kw, peer, ref_params = quant_params(q, mode, dtype)
    stream = cp.cuda.get_current_stream()
    if impl == "cufuse":
        out = cp.empty(q.shape, dtype)
        if mode == "tensor":
            call = lambda: cufuse.dequantize_int8(q, Q_SCALE, Q_ZP, dtype=dtype, out=out)  # noqa: E731
        else:
            call = lambda: cufuse.dequantize_int8(q, kw["scale"], kw["zero_point"], axis=kw["axis"],  # noqa: E731
                                                  dtype=dtype, out=out)
    elif impl == "cupy-chain":
        s, z = peer_sz(mode, peer)
        call = lambda: cp_dequant(q, s, z, dtype)  # noqa: E731
    elif impl == "cupy.fuse":   # the output dtype bound: one fused function per dtype
        s, z = peer_sz(mode, peer)
        f = fused_chain(gpu, "dequantize", dtype)
        call = lambda: f(q, s, z)  # noqa: E731
    elif impl == "numpy":   # the same chain on host copies, parameters in the output dtype
        qh, (s, z) = q.get(), peer_sz(mode, peer, host=True)
        call = lambda: np_dequant(qh, s, z, dtype)  # noqa: E731
    else:
        tq = torch.from_dlpack(q)
        if mode == "tensor":
            f, args = (t_dequant_tensor_f32 if dtype == "float32" else t_dequant_tensor_f16), (tq,)
        else:
            f = t_dequant_axis0 if mode == "axis0" else t_dequant_axis1
            args = (tq, torch.from_dlpack(peer[0]), torch.from_dlpack(peer[1]))
        f = f if impl == "torch-eager" else compiled(f)
        call = lambda: f(*args)  # noqa: E731
        stream = torch_stream(gpu)

    res = first_call(gpu, impl, call, op)
    assert res.shape == q.shape and res.dtype == np.dtype(dtype), (res.shape, res.dtype)
    idx = sample_index(q.size)
    s64, z64 = ref_params(idx.get())
    ref = (q.ravel()[idx].get().astype(np.float64) - z64) * s64
    errs = check_close(f"{op} {label} {impl}", res.ravel()[idx].get(), ref, dtype)
    del res

    nbytes = q.size + q.size * np.dtype(dtype).itemsize  # int8 read + out written
    measure(gpu, benchmark, op=op, dtype=label, n=n, impl=impl, call=call, stream=stream,
            nbytes=nbytes, out_dtype=dtype, extra={"elements": q.size, "shape": list(q.shape), "size_id": size,
                                                   **errs})
    if impl == "cufuse":
        add_target(gpu, op, label, n, op if mode == "tensor" else "per_channel", dtype)


# ----------------------------------------------------------------- gelu_dropout
@pytest.mark.parametrize("n,dtype,variant,impl", cases(("p0.1",), impls=("cufuse", "torch-eager", "torch.compile")))
def test_gelu_dropout(benchmark, gpu, n, dtype, variant, impl):
    """No cupy.fuse peer: cupy.fuse has no random numbers (the mask is
    cufuse's own Philox stream, the same bits as its NumPy fallback; torch
    draws its own). No CuPy chain either."""
    op = "gelu_dropout"
    size = size_id(n)
    benchmark.group = f"{op} {size} {dtype}"
    need_torch(gpu, impl)
    isz = np.dtype(dtype).itemsize
    n = resolve(gpu, n, isz, isz)
    gpu.copy_bandwidth()
    x, _ = data(gpu, n, dtype)
    stream = cp.cuda.get_current_stream()
    extra = {"size_id": size}
    if impl == "cufuse":
        out = cp.empty_like(x)
        call = lambda: cufuse.gelu_dropout(x, p=P_DROP, seed=SEED, out=out)  # noqa: E731
    elif impl == "numpy":   # cufuse's NumPy fallback on a host copy: the GPU's mask (same seed)
        xh = x.get()
        call = lambda: cufuse.gelu_dropout(xh, p=P_DROP, seed=SEED)  # noqa: E731
        extra["numpy_erf"] = numpy_erf()
    else:
        tx = torch.from_dlpack(x)
        f = t_gelu_dropout if impl == "torch-eager" else compiled(t_gelu_dropout)
        call = lambda: f(tx)  # noqa: E731
        stream = torch_stream(gpu)

    res = first_call(gpu, impl, call, op)
    assert res.shape == x.shape and res.dtype == x.dtype, (res.shape, res.dtype)
    what = f"{op} {dtype} {impl}"
    # Kept fraction over the whole array, within 5 sigma of 1 - p (a gelu
    # that underflows to 0 counts as dropped: ~1e-7 of N(0, 1) samples in float16).
    kept = int(cp.count_nonzero(res)) / res.size
    sigma = math.sqrt(P_DROP * (1 - P_DROP) / res.size)
    assert abs(kept - (1 - P_DROP)) <= 5 * sigma, f"{what}: kept {kept:.6f}, expected {1 - P_DROP} +- {5 * sigma:.6f}"
    # Kept values = gelu(x) / (1 - p), on the sampled indices.
    idx = sample_index(x.size)
    got = res.ravel()[idx].get()
    ref = gelu64(x.ravel()[idx].get(), "none") / (1 - P_DROP)
    k = got != 0
    assert k.mean() > 0.85, f"{what}: only {k.mean():.3f} of the sampled values kept"
    errs = check_close(what + " (kept values)", got[k], ref[k], dtype)
    del res

    nbytes = 2 * x.nbytes  # x read + out written
    measure(gpu, benchmark, op=op, dtype=dtype, n=n, impl=impl, call=call, stream=stream,
            nbytes=nbytes, out_dtype=dtype, extra={"elements": x.size, "shape": list(x.shape), "p": P_DROP,
                                                   "kept_fraction": kept, **extra, **errs})
    if impl == "cufuse":
        add_target(gpu, op, dtype, n, "gelu_dropout", dtype)
