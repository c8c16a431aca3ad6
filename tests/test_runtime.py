"""Runtime and tooling: the build / demo / info CLI, kernel sources and the
registry, the CuPy disk cache across processes, and the layout helpers
(``_arrays.collapse`` / ``broadcast_strides`` / ``extent``) that decide which
kernel sees which strides."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cufuse
from cufuse import _arrays as A
from cufuse import _runtime as R

ROOT = Path(cufuse.__file__).resolve().parent.parent


def subprocess_env(**extra):
    """os.environ plus the repository root first on PYTHONPATH (the same cufuse)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def run_py(args, timeout=600, **extra_env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**extra_env), cwd=str(ROOT))


# ------------------------------------------------------------------ package
def test_version_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cufuse.__version__ == meta["project"]["version"]


def test_cuda_available_is_a_bool_and_consistent():
    assert isinstance(cufuse.CUDA_AVAILABLE, bool)
    assert cufuse.CUDA_AVAILABLE == R.CUDA_AVAILABLE
    if R._cp is None:
        assert cufuse.CUDA_AVAILABLE is False


def test_disable_cuda_env_uses_the_fallback():
    code = ("import numpy as np, cufuse; r = cufuse.add_relu(np.ones(3, np.float32), -2.0); "
            "print(cufuse.CUDA_AVAILABLE, type(r).__module__)")
    p = run_py(["-c", code], timeout=120, CUFUSE_DISABLE_CUDA="1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "numpy"]


# ---------------------------------------------------------- sources, registry
def test_kernel_dir_holds_the_sources():
    d = R.kernel_dir()
    for name in ("common.cuh", "elementwise.cuh", "elementwise.cu"):
        assert (d / name).is_file()


def test_load_source_inlines_local_includes_once():
    src = R.load_source("elementwise")
    assert not re.search(r'^\s*#\s*include\s+"', src, re.M), "a local include was left in"
    assert "#pragma once" not in src
    assert "#include <cuda_fp16.h>" in src                   # system headers stay
    for functor in ("struct AddRelu", "struct MulTanh", "struct AddMulExp", "struct Fma"):
        assert src.count(functor) == 1
    assert src.count("struct LayoutT {") == 1                  # elementwise.cuh inlined once
    assert src.count("struct compute_type {") == 1            # common.cuh inlined once


_EXPR = re.compile(r"(ew[123](?:_strided|_tiled)?|norm_rows(?:_cluster|_split|_stream|_pipe|_rescue)?|reduce_(?:rows_block|rows|cols_deep|cols))"
                   r"<(\w+)(?:<[\w ,]+>)?, ([\w ]+)(?:, [\w ]+)*>")
_CTYPE_NAMES = {"__half": "float16", "__nv_bfloat16": "bfloat16", "float": "float32", "double": "float64",
                "signed char": "int8"}
FLOATS = {d.name for d in A.FLOAT_DTYPES}  # bfloat16 among them where ml_dtypes is installed
# kernels without a functor: the backward of the row ops (kernels/norm_backward.cu), storage type first
_BWD_EXPR = re.compile(r"(norm_backward|softmax_backward|add_norm_forward)<([\w ]+), (\d+)(?:, (?:true|false))+>"
                       r"|(cross_entropy_forward|cross_entropy_backward|rope|column_sums)<([\w ]+)>"
                       r"|(scatter_add_forward|scatter_add_backward)<([\w ]+), \d>"
                       r"|(attention_forward|attention_forward_sm90|attention_backward_kv|attention_backward_q|attention_delta|attention_score)"
                       r"<([\w ]+)(?:, \d+)*>")


# Constants held both by the host and by the kernels: (module, attribute,
# kernel file, C++ name). A change on one side only would misplace data
# (the split rows' workspace) or misread arguments, with no compile error.
MIRRORED = [("cufuse.ops.norm", "_PART_BYTES", "rows.cuh", "kPartBytes"),
            ("cufuse.ops.elementwise", "_SCALAR_SHIFT", "elementwise.cuh", "kScalarShift"),
            ("cufuse._driver", "STRIDED_NDIM", "elementwise.cuh", "kMaxDims"),
            ("cufuse.ops.elementwise", "_MAX_OPERANDS", "elementwise.cuh", "kMaxOperands"),
            ("cufuse.ops.reduction", "_ROW_BLOCK", "reduction.cu", "kRowBlock")]


@pytest.mark.parametrize("module, attr, file, name", MIRRORED, ids=lambda v: v if isinstance(v, str) else "")
def test_host_and_kernel_constants_agree(module, attr, file, name):
    import importlib
    text = (R.kernel_dir() / file).read_text()
    found = re.findall(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
    assert len(found) == 1, f"{file}: {name} defined {len(found)} times"
    assert getattr(importlib.import_module(module), attr) == int(found[0]), (module, attr, file, name)


def test_registry_has_every_op_and_dtype():
    """Every registered name expression names a kernel and a functor that its
    family's source defines, with a ctype matching its dtype label; every op
    exists for every float dtype."""
    reg = R.registry()
    assert {"elementwise", "quantize", "dropout"} <= set(reg)
    names = _CTYPE_NAMES
    labels = {}
    for family, entries in reg.items():
        src = R.load_source(family)
        for expr, (label, dtype) in entries.items():
            m = _BWD_EXPR.fullmatch(expr)
            if m:  # kernels templated on the dtype (and flags): no functor
                kernel, ctype = next((m.group(i), m.group(i + 1)) for i in (1, 4, 6, 8) if m.group(i))
                assert re.search(rf"__global__ void [^;{{]*?\b{kernel}\(", src), expr
                assert names[ctype] == dtype, expr
                labels.setdefault(label, set()).add(dtype)
                continue
            m = _EXPR.fullmatch(expr)
            assert m, expr
            kernel, functor = m.group(1), m.group(2)
            assert re.search(rf"__global__ void [^;{{]*?\b{kernel}\(", src), expr
            assert f"struct {functor}" in src, expr
            if kernel.startswith("ew"):
                out_ctype, in_ctype = re.fullmatch(r"\w+<\w+(?:<[\w ,]+>)?, ([\w ]+), ([\w ]+).*>", expr).groups()
                expected = names[in_ctype] if in_ctype == out_ctype else f"{names[in_ctype]}->{names[out_ctype]}"
                assert dtype == expected, expr
            labels.setdefault(label, set()).add(dtype)
    for name in ("add_relu", "mul_tanh", "add_mul_exp", "fma", "bias_gelu", "gelu_dropout", "gelu_dropout_backward"):
        for label in (name, f"{name} (strided)", f"{name} (tiled)"):
            assert labels.get(label) == FLOATS, label
    for kind in ("layer", "layer_relu", "rms", "softmax", "log_softmax"):
        assert labels[f"{kind} backward"] == FLOATS, kind
    assert labels["quantize_int8"] == {f"{f}->int8" for f in FLOATS}
    assert labels["dequantize_int8"] == {f"int8->{f}" for f in FLOATS}
    for name in ("layer_norm", "layer_norm_relu", "rms_norm", "softmax", "log_softmax"):
        assert labels[name] == FLOATS, name
    for name in ("sum_squared", "mean_abs"):
        assert FLOATS <= labels[name], name
    halves = {d.name for d in A.HALVES}
    for kern in ("forward", "backward_kv", "backward_q"):  # tensor-core attention: the 16-bit dtypes
        assert labels[f"{kern} d64"] == labels[f"{kern} d128"] == halves, kern


def test_family_parts_share_one_source():
    """``file:part`` families compile kernels/<file>.cu; each part is its own module."""
    assert R.load_source("norm:softmax:float32:np-4") == R.load_source("norm")
    assert "struct LayerNorm" in R.load_source("norm") and "struct Square" in R.load_source("reduction")
    cluster = [e for fam in R.registry().values() for e in fam if e.startswith("norm_rows_cluster")]
    assert cluster and all(R.min_arch(e) == 90 for e in cluster)


def test_architecture_specific_kernels():
    """The wgmma forward builds for sm_90a only: not for sm_80, nor for sm_100 (another architecture's own
    features); a portable sm_90 kernel builds for every newer one."""
    sm90 = [e for f, fam in R.registry().items() if f.startswith("attention_sm90") for e in fam]
    cluster = [e for fam in R.registry().values() for e in fam if e.startswith("norm_rows_cluster")]
    assert sm90 and cluster
    assert all(R.builds_for(e, 90) and not R.builds_for(e, 80) and not R.builds_for(e, 100) for e in sm90)
    assert all(R.builds_for(e, 90) and R.builds_for(e, 100) and not R.builds_for(e, 80) for e in cluster)
    assert R.arch_options(sm90, 90) == ("-arch=sm_90a",) and R.arch_options(cluster, 90) == ()
    with pytest.raises(ValueError, match="specific needs its min_arch"):
        R.register("attention_sm90:test", "nothing<1>", "x", "float16", specific=True)


# --------------------------------------------------------------------- CLIs
def _need_nvrtc():
    try:
        import cupy
        cupy.cuda.nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"CuPy / NVRTC not usable: {type(e).__name__}: {e}")


# Every family is compiled by CI itself (.ci/run: python -m cufuse build --arch
# sm_80,sm_90, which exits non-zero on any failure); here the CLI's output is
# checked on the families of one kind, which compile in seconds, not minutes.
@pytest.mark.parametrize("archs,family", [("sm_90", "cross_entropy"), ("sm_80,sm_90", "reduction:final"),
                                          ("sm_80,sm_90", "attention_sm90:64_float16")])
def test_build_cli_compiles_every_kernel(archs, family):
    _need_nvrtc()
    p = run_py(["-m", "cufuse", "build", "--arch", archs, "--family", family, "-v"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "FAIL" not in p.stdout
    expressions = [e for f, fam in R.registry().items() if f.startswith(family) for e in fam]
    assert expressions
    ok = [line for line in p.stdout.splitlines() if line.startswith("ok ")]
    arch_list = archs.split(",")
    wanted = [(a, e) for a in arch_list for e in expressions if R.builds_for(e, int(a.removeprefix("sm_")))]
    assert len(ok) == len(wanted)
    for arch, e in wanted:
        hits = [line for line in ok if f" {arch} " in line and line.endswith(" " + e)]
        assert len(hits) == 1, (arch, e)


def test_build_cli_prints_a_summary_without_v():
    """Without -v: a line per family and architecture and a summary, no line per kernel."""
    _need_nvrtc()
    p = run_py(["-m", "cufuse", "build", "--arch", "sm_90", "--family", "cross_entropy"])
    assert p.returncode == 0, p.stdout + p.stderr
    fams = sorted(f for f in R.registry() if f.startswith("cross_entropy"))
    n = sum(len(R.registry()[f]) for f in fams)
    lines = p.stdout.splitlines()
    assert not [line for line in lines if line.startswith("ok ")]
    assert len([line for line in lines if " sm_90 cross_entropy" in line and "kernels, " in line]) == len(fams)
    assert f"all kernels compiled: {n} kernel builds of {len(fams)} families for sm_90" in lines[-1]


def test_build_cli_unknown_family():
    p = run_py(["-m", "cufuse", "build", "--arch", "sm_90", "--family", "no_such_family"], timeout=120)
    assert p.returncode == 2
    assert "no kernel family starts with 'no_such_family'" in p.stdout


def test_build_cli_bad_arch_name():
    p = run_py(["-m", "cufuse", "build", "--arch", "sm_xx"], timeout=120)
    assert p.returncode != 0
    assert "bad architecture" in p.stderr


def test_build_cli_arch_nvrtc_rejects():
    _need_nvrtc()
    p = run_py(["-m", "cufuse", "build", "--arch", "sm_1"])
    assert p.returncode != 0
    assert "FAIL" in p.stdout


def test_demo_cli():
    p = run_py(["-m", "cufuse"])
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "exp((x + y) * 2)" in out
    rows = re.findall(r"^\s*([\d,]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+[\d.]+\s+\(max rel err ([^)]+)\)\s*$", out, re.M)
    assert [int(n.replace(",", "")) for n, _ in rows] == [100_000, 1_000_000, 20_000_000]
    for _, err in rows:
        assert float(err) < 1e-5
    assert ("NumPy fallback" in out) == (not cufuse.CUDA_AVAILABLE)


def test_info_cli():
    p = run_py(["-m", "cufuse", "info"], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"cufuse {cufuse.__version__}" in p.stdout
    assert f"kernel sources: {R.kernel_dir()}" in p.stdout
    assert ("NumPy fallback" in p.stdout) == (not cufuse.CUDA_AVAILABLE)
    assert f"generated kernel cache: {R.generated_cache_dir()}" in p.stdout   # cufuse's own, not only CuPy's
    assert "GPU architectures: compute capability 8.0 or newer" in p.stdout


# --------------------------------------------------------------- disk cache
_CACHE_SCRIPT = r"""
import numpy as np
import cupy as cp
import cupy.cuda.compiler as cc

assert hasattr(cc, "_compile_using_nvrtc_no_warning"), "CuPy internals changed: update the test"
calls = []
_real = cc._compile_using_nvrtc_no_warning

def _counting(*args, **kwargs):
    calls.append(args[0][:40])
    return _real(*args, **kwargs)

cc._compile_using_nvrtc_no_warning = _counting

import cufuse
rng = np.random.default_rng(0)
for name, arity in (("add_relu", 2), ("mul_tanh", 2), ("add_mul_exp", 2), ("fma", 3)):
    op = getattr(cufuse, name)
    for dt in (np.float16, np.float32, np.float64):
        xs = [cp.asarray((rng.standard_normal(64) * 0.5).astype(dt)) for _ in range(arity)]
        a = op(*xs)                       # contiguous kernel
        b = op(*[x[::2] for x in xs])     # strided kernel
        assert a.dtype == dt and b.shape == (32,)
cp.cuda.Device().synchronize()
print("CUFUSE_FILE", cufuse.__file__)
print("COMPILES", len(calls))
"""


@pytest.mark.cuda
def test_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "cupy_cache"
    cache.mkdir()
    env = {"CUPY_CACHE_DIR": str(cache)}

    def run():
        p = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], capture_output=True, text=True,
                           timeout=600, cwd=str(tmp_path),
                           env={k: v for k, v in subprocess_env(**env).items() if k != "CUPY_CACHE_IN_MEMORY"})
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"CUFUSE_FILE {cufuse.__file__}" in p.stdout
        return int(re.search(r"^COMPILES (\d+)$", p.stdout, re.M).group(1))

    first = run()
    assert first >= 1                    # the counter does see compiles
    assert any(cache.iterdir())
    assert run() == 0                    # everything came from the disk cache


# ------------------------------------------------------------------ layouts
def _elem_strides(a):
    return [s // a.itemsize for s in a.strides]


def _layouts():
    base = np.zeros((4, 6, 10), np.float32)
    return {
        "contiguous": base,
        "transposed": base.transpose(2, 0, 1),
        "sliced": base[:, 1:5, ::3],
        "negative": base[::-1, :, ::-2],
    }


BROADCASTS = [((5,), (4, 5)), ((1, 5), (4, 5)), ((4, 1), (4, 5)), ((), (3, 4)),
              ((2, 1, 3), (4, 2, 5, 3)), ((4, 5), (4, 5)), ((1,), (1,)), ((1, 1), (7, 1))]


@pytest.mark.parametrize("shape, out_shape", BROADCASTS, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "negative"])
def test_broadcast_strides_match_numpy(shape, out_shape, layout):
    size = int(np.prod(shape)) if shape else 1
    big = np.zeros(size * 4, np.float32)
    x = {"contiguous": big[:size], "sliced": big[::4], "negative": big[::-4]}[layout].reshape(shape)
    got = A.broadcast_strides(x.shape, _elem_strides(x), out_shape)
    want = _elem_strides(np.broadcast_to(x, out_shape))
    assert len(got) == len(out_shape)
    # the stride of a dim of size 1 is never used (NumPy may report 0 or anything)
    assert [g for g, n in zip(got, out_shape) if n != 1] == [w for w, n in zip(want, out_shape) if n != 1]


def _offsets(shape, strides):
    """Element offsets of a (shape, strides) layout, visited in C order."""
    if not shape:
        return np.zeros(1, np.int64)
    idx = np.indices(shape).reshape(len(shape), -1)
    return (np.asarray(strides, np.int64)[:, None] * idx).sum(axis=0)


def _check_collapse(shape, strides_list):
    cshape, cstrides = A.collapse(shape, strides_list)
    assert len(cstrides) == len(strides_list)
    assert all(len(st) == len(cshape) for st in cstrides)
    assert int(np.prod(cshape)) == int(np.prod(shape))
    for st, cst in zip(strides_list, cstrides):  # collapsed dims are innermost first
        np.testing.assert_array_equal(_offsets(shape, st), _offsets(cshape[::-1], cst[::-1]))
    return cshape, cstrides


@pytest.mark.parametrize("layout", list(_layouts()))
@pytest.mark.parametrize("second", [None, "row", "column", "middle", "scalar"])
def test_collapse_preserves_offsets(layout, second):
    """Every operand visits the same elements in the same order after collapsing."""
    x = _layouts()[layout]
    shape = x.shape
    out = np.empty(shape, np.float32)
    strides = [_elem_strides(out), _elem_strides(x)]
    if second is not None:
        yshape = {"row": shape[-1:], "column": shape[:-1] + (1,), "middle": (shape[0], 1, shape[2]),
                  "scalar": ()}[second]
        y = np.zeros(yshape, np.float32)
        strides.append(A.broadcast_strides(y.shape, _elem_strides(y), shape))
    _check_collapse(shape, strides)


# (shape, element strides per operand, number of dims after collapsing)
COLLAPSE_DIMS = [
    ((2, 3, 4), [[12, 4, 1], [12, 4, 1]], 1),          # all C-contiguous
    ((1, 4, 1, 5), [[20, 5, 5, 1], [20, 5, 5, 1]], 1),  # size-1 dims dropped
    ((4, 5), [[5, 1], [1, 4]], 2),                     # transposed input
    ((4, 5), [[5, 1], [0, 1]], 2),                     # row broadcast
    ((4, 5), [[5, 1], [1, 0]], 2),                     # column broadcast
    ((4, 5), [[5, 1], [0, 0]], 1),                     # broadcast scalar-like operand
    ((4, 5), [[5, 1], [20, 2]], 2),                    # x[:, ::2] of (4, 20): rows apart
    ((2, 5), [[5, 1], [5, 1]], 1),                     # x[:2] of (4, 5): still contiguous
    ((7,), [[1], [3]], 1),                             # step slice
    ((7,), [[1], [-1]], 1),                            # reversed
    ((1, 1), [[1, 1], [1, 1]], 1),                     # all size 1
    ((3, 4, 5), [[20, 5, 1], [4, 1, 12]], 2),          # innermost dim apart, outer two mergeable
]


@pytest.mark.parametrize("shape, strides, ndim", COLLAPSE_DIMS, ids=[str(c[:2]) for c in COLLAPSE_DIMS])
def test_collapse_merges_what_it_can(shape, strides, ndim):
    cshape, cstrides = _check_collapse(shape, strides)
    assert len(cshape) == ndim
    if shape == (1, 1):
        assert cshape == [1] and cstrides == [[0], [0]]


def test_collapse_contiguous_is_one_dim_of_stride_one():
    """What the op uses to pick the contiguous kernel."""
    shape = (3, 4, 5)
    c = [20, 5, 1]
    assert A.collapse(shape, [c, c, c]) == ([60], [[1], [1], [1]])


@pytest.mark.parametrize("view", ["contiguous", "transposed", "sliced", "negative", "broadcast"])
def test_extent_matches_numpy_byte_bounds(view):
    byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds
    base = np.zeros((5, 8), np.float64)
    x = {"contiguous": base, "transposed": base.T, "sliced": base[1:4, 2:7:2],
         "negative": base[::-1, ::-3], "broadcast": np.broadcast_to(base[2:3], (6, 8))}[view]
    got = A.extent(x.ctypes.data, x.shape, _elem_strides(x), x.itemsize)
    assert got == byte_bounds(x)


def test_packs_per_thread_of_every_signature():
    """Every ElementwiseOp gives a packs-per-thread count (its grid divisor)
    for each signature it instantiates: a positive int. Checked here because
    the launch path that asks for it runs on a GPU only."""
    from cufuse.ops import elementwise as E
    from cufuse.ops import quantize as Q
    ops = [*E.OPS.values(), Q._quant, Q._quant_div, Q._dequant, *Q._quant_ch.values(), *Q._dequant_ch.values()]
    for op in ops:
        for in_dt, out_dt in op.signatures:
            p = op._ppt(in_dt, out_dt)
            assert isinstance(p, int) and p >= 1, (op.name, in_dt, out_dt, p)
            assert isinstance(op._one_wave[(in_dt, out_dt)], bool), (op.name, in_dt, out_dt)
    # one_wave: per-channel quantize on the last axis of 16-bit float and float32 data only (a periodic functor)
    waves = {(w, i.name) for (w, wide), op in Q._quant_ch.items() for (i, o), ow in op._one_wave.items() if ow}
    assert waves == {(Q.ACROSS, f) for f in FLOATS - {"float64"}}, waves
    assert not any(ow for op in ops if op not in Q._quant_ch.values() for ow in op._one_wave.values())


@pytest.mark.cuda
@pytest.mark.parametrize("dynamic", [1024, 48 * 1024, 64 * 1024])
def test_launch_grid_dynamic_shared_memory(dynamic):
    """launch_grid opts a kernel in to dynamic shared memory beyond the 48 KiB
    default counting its static shared memory: exactly 48 KiB dynamic plus
    a static array failed to launch (CUDA_ERROR_INVALID_VALUE) before."""
    import cupy as cp
    src = r"""
    extern "C" __global__ void fill(float* out, int n) {
        __shared__ float fixed[64];
        extern __shared__ float dyn[];
        fixed[threadIdx.x % 64] = 1.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) dyn[i] = static_cast<float>(i);
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dyn[n - 1 - i] + fixed[i % 64];
    }"""
    fn = cp.RawModule(code=src).get_function("fill").kernel  # the cupy.cuda.Function, as _runtime launches
    n = dynamic // 4
    out = cp.full(n, cp.nan, dtype=cp.float32)
    R.launch_grid(fn, (1,), (256,), (out, np.int32(n)), None, dynamic)
    np.testing.assert_array_equal(cp.asnumpy(out), np.arange(n, dtype=np.float32)[::-1] + 1)


# ------------------------------------------------- the generated-kernel cache
class _Warnings(logging.Handler):
    """The messages of the warnings logged to a logger while attached (the
    suite runs without pytest's logging plugin, whose handler on every
    non-propagating logger cost ~10% of the CPU suite once torch is imported)."""

    def __init__(self, name):
        super().__init__(logging.WARNING)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def test_cache_entry_round_trip_and_damage(tmp_path):
    """write_cached / read_cached: a stored cubin comes back; a truncated entry,
    a flipped byte, an old plain cubin and an empty file are refused (logged),
    so the caller compiles again and rewrites the entry."""
    path = str(tmp_path / "deadbeef.cubin")
    blob = bytes(range(256)) * 40
    assert R.read_cached(path) is None                         # nothing there yet
    assert R.write_cached(path, blob)
    assert R.read_cached(path) == blob
    assert os.listdir(tmp_path) == ["deadbeef.cubin"]          # no temporary file left
    whole = Path(path).read_bytes()
    for name, damaged in [("truncated", whole[:len(whole) // 2]), ("flipped", whole[:-1] + bytes([whole[-1] ^ 1])),
                          ("plain cubin", blob), ("empty", b"")]:
        Path(path).write_bytes(damaged)
        with _Warnings("cufuse") as logged:
            assert R.read_cached(path) is None, name
        assert any("damaged cache entry" in m for m in logged.messages), (name, logged.messages)
    assert R.write_cached(path, blob) and R.read_cached(path) == blob   # rewritten


def test_cache_temporary_names_are_unique(tmp_path, monkeypatch):
    """Two writers (two containers may share a pid) never share a temporary file."""
    names = []
    real = R.tempfile.mkstemp

    def spy(*a, **k):
        fd, name = real(*a, **k)
        names.append(name)
        return fd, name

    monkeypatch.setattr(R.tempfile, "mkstemp", spy)
    for _ in range(2):
        assert R.write_cached(str(tmp_path / "a.cubin"), b"x" * 10)
    assert len(set(names)) == 2 and all(n.endswith(".tmp") and "a.cubin." in n for n in names)
    assert os.listdir(tmp_path) == ["a.cubin"]


def _unwritable_folder(tmp_path):
    """A cache folder no one can create, root included: a path under a plain file."""
    (tmp_path / "file").write_bytes(b"not a folder")
    return tmp_path / "file" / "cache"


def test_cache_unwritable_folder_warns_once(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_unwritable", set())
    folder = _unwritable_folder(tmp_path)
    with pytest.warns(RuntimeWarning, match="cannot write the generated-kernel cache folder .* in memory"):
        assert not R.write_cached(str(folder / "a.cubin"), b"x")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not R.write_cached(str(folder / "b.cubin"), b"x")   # once per folder


def _fresh_fused(tag):
    """A new fused function x * 2 + tag.5 (literals are kernel arguments: the
    same source for every tag; the tests empty the in-memory module cache)."""
    return cufuse.fuse(lambda x: x * 2.0 + (tag + 0.5))


@pytest.mark.cuda
def test_damaged_disk_entry_is_compiled_again(tmp_path, monkeypatch):
    """A truncated .cubin in CUFUSE_CACHE_DIR (a crash before write-back) is
    detected on load, compiled again and rewritten; the result is right."""
    import cupy as cp
    monkeypatch.setenv("CUFUSE_CACHE_DIR", str(tmp_path))
    x = cp.asarray(np.linspace(-3, 3, 1001, dtype=np.float32))
    monkeypatch.setattr(R, "_generated", {})                  # as a new process
    tag = 41
    f = _fresh_fused(tag)
    f(x)
    assert f.stats["compiles"] == 1
    (entry,) = tmp_path.glob("*.cubin")
    entry.write_bytes(entry.read_bytes()[:100])               # truncated
    monkeypatch.setattr(R, "_generated", {})                  # as a new process
    g = _fresh_fused(tag)
    np.testing.assert_allclose(cp.asnumpy(g(x)), cp.asnumpy(x).astype(np.float64) * 2 + tag + 0.5, rtol=1e-6)
    assert g.stats["compiles"] == 1 and g.stats["disk_loads"] == 0
    assert R.read_cached(str(entry)) is not None              # rewritten whole
    monkeypatch.setattr(R, "_generated", {})
    h = _fresh_fused(tag)
    h(x)
    assert h.stats["disk_loads"] == 1 and h.stats["compiles"] == 0


@pytest.mark.cuda
def test_unwritable_cache_folder_runs_from_memory(tmp_path, monkeypatch):
    """CUFUSE_CACHE_DIR that cannot be written: one warning, and the kernel runs
    from memory (before, every new fused signature failed)."""
    import cupy as cp
    monkeypatch.setenv("CUFUSE_CACHE_DIR", str(_unwritable_folder(tmp_path)))
    monkeypatch.setattr(R, "_unwritable", set())
    monkeypatch.setattr(R, "_generated", {})                  # as a new process
    x = cp.asarray(np.linspace(-3, 3, 101, dtype=np.float32))
    with pytest.warns(RuntimeWarning, match="kept in memory"):
        got = _fresh_fused(7)(x)
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(x).astype(np.float64) * 2 + 7.5, rtol=1e-6)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # another kernel: no second warning
        again = cufuse.fuse(lambda v: v * v - 1.0)(x)
    np.testing.assert_allclose(cp.asnumpy(again), cp.asnumpy(x).astype(np.float64) ** 2 - 1, rtol=1e-6)
