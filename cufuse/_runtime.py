"""The one place that compiles, caches and launches kernels.

Kernel sources live in ``kernels/<family>.cu``. Each family is compiled once
per device, lazily, as one ``cupy.RawModule`` whose ``name_expressions``
instantiate every registered template (for ``__half``, ``float`` and
``double``). Local ``#include "x.cuh"`` lines are inlined before compiling,
so CuPy's on-disk cache key covers every header the kernel depends on and a
changed header never serves a stale binary.

Ops register their name expressions here (``register``) and fetch launchable
functions with ``get_function``; ``launch`` sizes the grid from the SM count
and queues the kernel on CuPy's current stream (or the stream it is given).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from . import _arrays as A

try:  # cupy is an optional extra
    import cupy as _cp
except Exception:  # pragma: no cover - depends on the machine
    _cp = None

BLOCK = 256            # threads per block for every elementwise launch
# Grid cap, in blocks per SM. A grid that covers every 16-byte pack in one
# pass beat grid-stride loops at 50M elements (bench/NOTES.md, "Figures from
# code comments"); 512/SM keeps one pass up to ~69M float32 elements (138M
# float16) and bounds the grid beyond that.
WAVES = 512

# Canonical C++ spelling of each storage dtype, as NVRTC writes it back.
# FLOAT_CTYPES are the dtypes every float op is instantiated for.
FLOAT_CTYPES = {
    np.dtype(np.float16): "__half",
    **({A.BF16: "__nv_bfloat16"} if A.BF16 is not None else {}),
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}
CTYPES = {**FLOAT_CTYPES, np.dtype(np.int8): "signed char"}


def _cuda_available() -> bool:
    if _cp is None or os.environ.get("CUFUSE_DISABLE_CUDA", "") not in ("", "0"):
        return False
    try:
        return _cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


CUDA_AVAILABLE = _cuda_available()


# --------------------------------------------------------------------- sources
def kernel_dir() -> Path:
    """Folder holding the .cu/.cuh sources: inside the installed package
    (wheels ship them as ``cufuse/kernels``) or the repository's ``kernels/``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / "common.cuh").is_file():
            return cand
    raise FileNotFoundError(
        f"cufuse kernel sources not found (looked in {here / 'kernels'} and {here.parent / 'kernels'}); "
        "reinstall cufuse")


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def load_source(family: str) -> str:
    """Source of ``kernels/<family>.cu`` with local includes inlined (each once)."""
    return expand_includes(f'#include "{family.split(":")[0]}.cu"\n')


def expand_includes(text: str) -> str:
    """``text`` with its local ``#include "x.cuh"`` lines (from kernels/) inlined, each once."""
    root = kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(lambda m: expand(m.group(1)), (root / name).read_text().replace("#pragma once", ""))

    return _INCLUDE.sub(lambda m: expand(m.group(1)), text)


def cuda_include_dirs() -> list[str]:
    """Folders holding cuda_fp16.h: the pip NVIDIA runtime headers or the toolkit."""
    dirs = []
    try:
        from cuda import pathfinder  # shipped with cupy 14 / cuda-python
        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            dirs.append(os.path.join(root, "include"))
    if not dirs and os.path.isfile("/usr/local/cuda/include/cuda_fp16.h"):
        dirs.append("/usr/local/cuda/include")
    return list(dict.fromkeys(dirs))


def compile_options() -> tuple[str, ...]:
    return ("--std=c++17",) + tuple(f"-I{d}" for d in cuda_include_dirs())


# -------------------------------------------------------------------- registry
# family -> {name expression: (label, dtype name)}; filled by the op modules.
_REGISTRY: dict[str, dict[str, tuple[str, str]]] = {}
_MIN_ARCH: dict[str, int] = {}
_SPECIFIC: set[str] = set()  # expressions using their architecture's own features (sm_90a's wgmma)


def name_expression(kernel: str, *template_args: str) -> str:
    """``kernel<a, b, c>``: the spelling NVRTC writes back, which CuPy's disk
    cache needs to serve a second process."""
    return f"{kernel}<{', '.join(template_args)}>"


def register(family: str, expression: str, label: str, dtype: str, min_arch: int = 0,
             specific: bool = False) -> str:
    """Add ``expression`` to ``family``: ``kernels/<file>.cu`` where family
    is ``file`` or ``file:part``. Each family is one module, compiled on first
    use, so parts split a large file into what a first call needs.
    ``min_arch`` (e.g. 90): the lowest compute capability it compiles for.
    ``specific``: it uses that architecture's own features (``sm_90a``), so it
    compiles and runs on exactly ``min_arch``; a family holds only such
    expressions or none."""
    if specific and not min_arch:
        raise ValueError(f"register {expression!r}: specific needs its min_arch")
    with _lock:
        _REGISTRY.setdefault(family, {})[expression] = (label, dtype)
        if min_arch:
            _MIN_ARCH[expression] = min_arch
        if specific:
            _SPECIFIC.add(expression)
        # A module already built for this family lacks the new expression.
        for key in [k for k in _modules if k[0] == family]:
            del _modules[key]
    return expression


def registry() -> dict[str, dict[str, tuple[str, str]]]:
    return {f: dict(e) for f, e in _REGISTRY.items()}


def min_arch(expression: str) -> int:
    """Lowest compute capability (e.g. 90) ``expression`` compiles for; 0: any."""
    return _MIN_ARCH.get(expression, 0)


def builds_for(expression: str, arch: int) -> bool:
    """``expression`` compiles for compute capability ``arch`` (e.g. 90)."""
    low = _MIN_ARCH.get(expression, 0)
    return arch >= low and (expression not in _SPECIFIC or arch == low)


def arch_options(expressions, arch: int) -> tuple[str, ...]:
    """NVRTC options that select the architecture-specific target (``-arch=sm_90a``) for a module holding
    ``expressions`` built for ``arch``; () for portable code. CuPy appends its own ``-arch=sm_90`` after
    these: NVRTC then builds for sm_90a (checked: wgmma compiles only so)."""
    return (f"-arch=sm_{arch}a",) if any(e in _SPECIFIC for e in expressions or ()) else ()


# -------------------------------------------------------------------- modules
_lock = threading.RLock()
_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, int], object] = {}
_sm_counts: dict[int, int] = {}
_ccs: dict[int, int] = {}


def _require_cuda():
    if not CUDA_AVAILABLE:
        raise RuntimeError("cufuse: no usable CUDA GPU (cupy missing, no driver, or no device)")


def _module(family: str, device: int):
    key = (family, device)
    mod = _modules.get(key)
    if mod is None:
        exprs = sorted(_REGISTRY.get(family, {}))
        if not exprs:
            raise KeyError(f"no kernels registered for family {family!r}")
        options = compile_options() + arch_options(exprs, compute_capability(device))
        mod = _cp.RawModule(code=load_source(family), options=options, name_expressions=exprs)
        _modules[key] = mod
    return mod


def get_function(family: str, expression: str, device: int):
    """The compiled ``cupy.cuda.Function`` for ``expression`` on ``device``."""
    key = (expression, device)
    fn = _functions.get(key)
    if fn is None:
        _require_cuda()
        with _lock:
            fn = _functions.get(key)
            if fn is None:
                with _cp.cuda.Device(device):
                    fn = _module(family, device).get_function(expression).kernel
                _functions[key] = fn
    return fn


# ------------------------------------------------------- generated sources
_log = logging.getLogger("cufuse")
_generated: dict[tuple[str, int], object] = {}


def generated_cache_dir() -> str:
    """Where compiled generated kernels (cufuse.fuse) are kept across processes:
    $CUFUSE_CACHE_DIR, else ~/.cache/cufuse (read at each compile)."""
    return os.environ.get("CUFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cufuse")


# A cache entry: this header, the SHA-256 of the cubin and its length, then the
# cubin. A truncated or damaged entry (a crash mid-write on a file system
# without atomic rename, a disk error) fails the check and is compiled again.
_CACHE_MAGIC = b"cufuse generated cubin 1\n"
_CACHE_HEAD = len(_CACHE_MAGIC) + 32 + 8
_unwritable: set = set()  # cache folders that could not be written (warned once each)


def read_cached(path: str) -> bytes | None:
    """The cubin stored at ``path``; None when there is none, or when the entry
    is damaged (wrong header, length or hash: logged, to be compiled again)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        _log.warning("cufuse: cannot read the cache entry %s (%s); compiling again", path, e)
        return None
    if len(data) >= _CACHE_HEAD and data.startswith(_CACHE_MAGIC):
        digest = data[len(_CACHE_MAGIC):len(_CACHE_MAGIC) + 32]
        n = int.from_bytes(data[len(_CACHE_MAGIC) + 32:_CACHE_HEAD], "little")
        body = data[_CACHE_HEAD:]
        if len(body) == n and hashlib.sha256(body).digest() == digest:
            return body
    _log.warning("cufuse: damaged cache entry %s (%d bytes); compiling again and rewriting it", path, len(data))
    return None


def write_cached(path: str, binary: bytes) -> bool:
    """Store ``binary`` at ``path`` atomically (a temporary file of a unique
    random name in the same folder, then a rename). False, with one warning
    per folder, when the folder cannot be written: the caller keeps the
    module in memory for this process."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_CACHE_MAGIC + hashlib.sha256(binary).digest() + len(binary).to_bytes(8, "little") + binary)
            os.replace(tmp, path)  # atomic: a concurrent process sees all of it or nothing
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True
    except OSError as e:
        if folder not in _unwritable:
            _unwritable.add(folder)
            warnings.warn(f"cufuse: cannot write the generated-kernel cache folder {folder} ({e}); compiled "
                          "kernels are kept in memory for this process only (set CUFUSE_CACHE_DIR to a "
                          "writable folder)", RuntimeWarning, stacklevel=4)
        return False


def generated_module(source: str, device: int, what: str = "generated kernel"):
    """(module, how) for generated CUDA ``source`` on ``device``; how is
    "memory", "disk" or "compiled". A compile writes the cubin to
    ``generated_cache_dir()`` (``write_cached``), keyed by the source with its
    headers inlined, the options, the architecture and the NVRTC and CuPy
    versions, so a new process loads it instead of compiling (CuPy's own disk
    cache is not used: a hit there cannot be told from a compile). An entry
    is checked when loaded (``read_cached``). ``module.get_function(name)``
    gives the launchable function."""
    key = (source, device)
    mod = _generated.get(key)
    if mod is not None:
        return mod, "memory"
    _require_cuda()
    with _lock:
        mod = _generated.get(key)
        if mod is not None:
            return mod, "memory"
        t0 = time.perf_counter()
        full = expand_includes(source)
        arch = compute_capability(device)
        options = compile_options() + ("-ftz=true",)  # as CuPy compiles the kernels/ families
        digest = hashlib.sha256("\0".join(
            [full, repr(options), str(arch), nvrtc_version(), _cp.__version__,
             _CACHE_MAGIC.decode()]).encode()).hexdigest()[:32]
        path = os.path.join(generated_cache_dir(), f"{digest}.cubin")
        how = "disk"
        with _cp.cuda.Device(device):
            binary = read_cached(path)
            if binary is None:
                from cupy.cuda import compiler
                binary, _ = compiler.compile_using_nvrtc(full, options=options, arch=str(arch), cache_in_memory=True)
                write_cached(path, binary)
                how = "compiled"
            from cupy.cuda import function
            mod = function.Module()
            mod.load(binary)
        _generated[key] = mod
        _log.info("cufuse: %s %s in %.1f ms (%s)", what, "compiled" if how == "compiled" else "loaded from disk",
                  (time.perf_counter() - t0) * 1e3, path)
        return mod, how


_optin: dict[int, int] = {}


def shared_optin(device: int) -> int:
    """Most dynamic shared memory one block may opt in to on ``device`` (bytes:
    227 KiB on an H100, 99 KiB on sm_86/89 cards)."""
    n = _optin.get(device)
    if n is None:
        n = _optin[device] = int(_cp.cuda.runtime.getDeviceProperties(device)["sharedMemPerBlockOptin"])
    return n


def compute_capability(device: int) -> int:
    """e.g. 90 for an H100/H200."""
    cc = _ccs.get(device)
    if cc is None:
        props = _cp.cuda.runtime.getDeviceProperties(device)
        cc = _ccs[device] = props["major"] * 10 + props["minor"]
    return cc


def sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        n = _cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
        _sm_counts[device] = n
    return n


_resident: dict[tuple[int, int, int, int], int] = {}


def resident_blocks(fn, device: int, block: int = BLOCK, shared_mem: int = 0) -> int:
    """Blocks of ``fn`` (``block`` threads, ``shared_mem`` dynamic shared
    bytes) that ``device`` runs at once: its SMs times the blocks per SM that
    CUDA's occupancy calculator allows for the kernel's registers and shared
    memory (at least one per SM; cached per kernel and launch shape)."""
    key = (fn.ptr, device, block, shared_mem)
    n = _resident.get(key)
    if n is None:
        from cupy_backends.cuda.api import driver
        with _cp.cuda.Device(device):
            allow_shared(fn, shared_mem)
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, block, shared_mem)
        n = _resident[key] = sm_count(device) * max(per_sm, 1)
    return n


def resident_threads(fn, device: int) -> int:
    """Threads of ``fn``, in blocks of BLOCK, that ``device`` runs at once."""
    return resident_blocks(fn, device) * BLOCK


_SHARED_DEFAULT = 48 * 1024  # dynamic shared bytes a kernel may use without opting in
_shared_allowed: dict[int, int] = {}


def allow_shared(fn, shared_mem: int) -> None:
    """Opt ``fn`` in to ``shared_mem`` dynamic shared bytes where that and its
    static shared memory pass the default 48 KiB (once per kernel and size):
    a launch of exactly 48 KiB of dynamic shared memory by a kernel with any
    static shared memory of its own fails without it."""
    if shared_mem > _shared_allowed.get(fn.ptr, 0):
        from cupy_backends.cuda.api import driver
        static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
        if shared_mem + static > _SHARED_DEFAULT:
            driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
        _shared_allowed[fn.ptr] = shared_mem


def grid_cap(device: int) -> int:
    """Most blocks a grid-stride launch gets on ``device``."""
    return sm_count(device) * WAVES


def grid_for(work: int, device: int) -> int:
    """Blocks for a grid-stride loop over ``work`` items: enough to cover it,
    capped at ``grid_cap``."""
    blocks = (work + BLOCK - 1) // BLOCK
    cap = grid_cap(device)
    return blocks if blocks < cap else cap


def launch(fn, work: int, device: int, args: tuple, stream=None) -> None:
    """Launch ``fn`` over ``work`` grid-stride items on ``stream`` (None: CuPy's current)."""
    blocks = grid_for(work, device) or 1
    if stream is None:
        fn((blocks,), (BLOCK,), args)
    else:
        fn((blocks,), (BLOCK,), args, 0, stream)


def launch_grid(fn, grid: tuple, block: tuple, args: tuple, stream=None, shared_mem: int = 0) -> None:
    """Launch ``fn`` with an explicit grid and block (row kernels size their
    own) and ``shared_mem`` dynamic shared bytes."""
    allow_shared(fn, shared_mem)
    if stream is None:
        fn(grid, block, args, shared_mem)
    else:
        fn(grid, block, args, shared_mem, stream)


# ------------------------------------------------------------------- streams
_external_streams: dict[tuple[int, int], object] = {}


class _RawStream:
    """A raw stream handle speaking the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr: int, device: int):
    """A cached CuPy stream object for a raw stream handle (torch's), to launch on."""
    key = (ptr, device)
    s = _external_streams.get(key)
    if s is None:
        with _cp.cuda.Device(device):
            if hasattr(_cp.cuda.Stream, "from_external"):  # CuPy >= 14
                s = _cp.cuda.Stream.from_external(_RawStream(ptr))
            else:  # pragma: no cover - older CuPy
                s = _cp.cuda.ExternalStream(ptr, device)
        _external_streams[key] = s
    return s


def cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def nvrtc_version() -> str:
    if _cp is None:
        return "unavailable (cupy not installed)"
    try:
        major, minor = _cp.cuda.nvrtc.getVersion()
        return f"{major}.{minor}"
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"unavailable ({type(e).__name__})"
