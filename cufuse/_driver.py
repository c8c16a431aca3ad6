"""The one host-side launch path: every op family launches through here.

- **torch binding** (``torch_api``): torch's names the hot path uses, bound
  once when the first tensor is seen (cufuse never imports torch itself).
- **streams** (``stream_for``): torch tensors run on torch's current stream,
  CuPy arrays on CuPy's current stream.
- **allocation and copies** (``empty``, ``dense``, ``copy_into``, ...):
  torch results come from torch's caching allocator, CuPy's from CuPy's pool.
- **aliasing** (``overlaps``, ``needs_temporary``): one rule for every op.
- **layouts** (``layout``, ``strided_layout``): the collapsed shapes and
  strides the elementwise kernels walk.
- **recipes and the fast path**: a family describes its launches as a
  ``Recipe`` (kernels, grids and arguments, with ``Slot`` placeholders for
  the pointers and scalar values of a call) built from the call's signature
  alone; ``execute`` runs a recipe on a call's arrays. A ``FastPath`` keeps
  the recipes of the signatures seen before (keyed by ``signature``), so a
  repeated call reads its arguments' attributes, finds its recipe and
  launches, with no validation or planning.
"""
from __future__ import annotations

import contextlib
import itertools

import operator
import struct
import threading
import weakref
from typing import NamedTuple

import numpy as np

from . import _arrays as A
from . import _runtime as R

_cp = R._cp
get_device = _cp.cuda.runtime.getDevice if _cp is not None else None
try:  # the driver's launch: what cupy.cuda.Function calls after packing its arguments
    from cupy.cuda.function import Function as _Function
    from cupy_backends.cuda.api.driver import launchKernel as _launch_kernel
except Exception:  # pragma: no cover - no CuPy
    _Function = _launch_kernel = None


# ----------------------------------------------------------------- torch
class TorchAPI:
    """The torch names of the hot path (``Tensor`` is None until bound)."""
    __slots__ = ("Tensor", "empty", "empty_like", "empty_strided", "raw_stream", "float_dtypes", "np_dtypes",
                 "devices", "grad_enabled", "bump_versions")

    def __init__(self):
        self.Tensor = None
        self.empty = self.empty_like = self.empty_strided = None
        self.raw_stream = self.grad_enabled = self.bump_versions = None
        self.float_dtypes = {}  # torch float dtype -> NumPy dtype
        self.np_dtypes = {}     # NumPy dtype -> torch dtype
        self.devices = {}       # ordinal -> torch.device("cuda", ordinal)


TORCH = TorchAPI()


def torch_api() -> TorchAPI:
    """``TORCH``, bound to the imported torch module on first use."""
    if TORCH.Tensor is None:
        t = A.torch()
        if t is not None:
            TORCH.float_dtypes = {t.float16: A.F16, t.float32: A.F32, t.float64: A.F64}
            if A.BF16 is not None:
                TORCH.float_dtypes[t.bfloat16] = A.BF16
            TORCH.np_dtypes = {v: k for k, v in TORCH.float_dtypes.items()} | {np.dtype(np.int8): t.int8,
                                                                               np.dtype(np.uint8): t.uint8}
            TORCH.empty, TORCH.empty_like, TORCH.grad_enabled = t.empty, t.empty_like, t.is_grad_enabled
            TORCH.empty_strided = t.empty_strided
            TORCH.raw_stream = getattr(t._C, "_cuda_getCurrentRawStream", None) or (
                lambda dev: t.cuda.current_stream(dev).cuda_stream)
            TORCH.bump_versions = _version_bumper(t)
            TORCH.Tensor = t.Tensor
            from . import _torch_ops
            _torch_ops.register()  # torch.ops.cufuse, before anything traces a call
    return TORCH


def _version_bumper(t):
    """A function that bumps the version counters of a sequence of torch tensors and skips inference
    tensors (they keep none): torch's C function itself where it takes a sequence and skips them (a
    fifth of the public wrapper's cost: about 0.2 against 1 µs), else the public wrapper."""
    inc = getattr(t._C, "_increment_version", None)
    if inc is not None:
        try:
            with t.inference_mode():
                probe = t.empty(0)
            inc((probe,))
            return inc
        except Exception:  # an older form (one tensor, or inference tensors refused)
            pass
    public = t.autograd.graph.increment_version
    return lambda outs: public([o for o in outs if not o.is_inference()])


def torch_device(dev):
    d = TORCH.devices.get(dev)
    if d is None:
        d = TORCH.devices[dev] = A.torch().device("cuda", dev)
    return d


# ----------------------------------------------------------------- streams
_torch_streams: dict = {}  # (raw torch stream, device) -> CuPy stream object


def torch_stream(dev):
    """A CuPy stream object for torch's current stream on ``dev`` (cached per stream)."""
    return _stream_object(A.TORCH_CUDA, dev, TORCH.raw_stream(dev))


def stream_for(kind, dev):
    """The stream a call on arrays of ``kind`` launches on: torch's current
    stream for torch tensors, None (CuPy's current stream) for CuPy arrays."""
    if kind == A.TORCH_CUDA:
        torch_api()
        return torch_stream(dev)
    return None


# ----------------------------------------------------- allocation and copies
def empty(shape, dtype, kind, dev):
    """A new GPU array of ``kind``: torch's caching allocator or CuPy's pool."""
    if kind == A.TORCH_CUDA:
        return A.torch().empty(shape, dtype=A.numpy_to_torch_dtype(dtype), device=torch_device(dev))
    return _cp.ndarray(shape, dtype)


def empty_dense(shape, dtype, kind, dev, strides):
    """``empty`` with the element ``strides`` of a dense layout (a permutation of C order's)."""
    if kind == A.TORCH_CUDA:
        return A.torch().empty_strided(shape, strides, dtype=A.numpy_to_torch_dtype(dtype), device=torch_device(dev))
    dtype = np.dtype(dtype)
    return _cp.ndarray(shape, dtype, _cp.cuda.alloc(A.count(tuple(shape)) * dtype.itemsize),
                       tuple(s * dtype.itemsize for s in strides))


def empty_padded(shape, dtype, kind, dev):
    """``empty``, in a buffer that goes on to the end of its last 16-byte
    pack, those bytes zeroed: the row kernels read a row's last pack whole
    (lanes past the end masked), and compute-sanitizer's initcheck reports
    bytes that nobody wrote. For the temporaries that cufuse hands to them."""
    n = A.count(tuple(shape))
    pad = -(-n * dtype.itemsize // 16) * 16 // dtype.itemsize - n
    with _cp.cuda.Device(dev):
        buf = empty((n + pad,), dtype, kind, dev)
        if pad:
            buf[n:] = 0
    return buf[:n].reshape(shape)


def empty_like(x, kind):
    """A new C-contiguous array of x's shape, dtype and kind (NumPy kinds too)."""
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        return A.torch().empty_like(x, memory_format=A.torch().contiguous_format)
    return (np if kind == A.NUMPY else _cp).empty(tuple(x.shape), A.dtype_of(x, kind))


def dense(x, shape, kind):
    """``x`` broadcast to ``shape`` as a C-contiguous copy."""
    if kind == A.TORCH_CUDA:
        return x.expand(shape).contiguous()
    return _cp.ascontiguousarray(_cp.broadcast_to(x, shape))


def contiguous(x, kind):
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        return x.contiguous()
    return np.ascontiguousarray(x) if kind == A.NUMPY else _cp.ascontiguousarray(x)


def on_device(kind, dev):
    """A context in which CuPy allocates on ``dev`` (GPU kinds), else
    nothing; for torch tensors CuPy's current stream is also torch's current
    stream there, so that CuPy work inside (copies, the dense math of
    attention) is ordered with the caller's torch work, as every launch is."""
    if kind == A.TORCH_CUDA:
        return _OnTorchStream(dev)
    return _cp.cuda.Device(dev) if kind in A.GPU_KINDS else contextlib.nullcontext()


class _OnTorchStream:
    """GPU ``dev`` and torch's current stream on it, as CuPy's current ones."""
    __slots__ = ("device", "stream")

    def __init__(self, dev):
        self.device = _cp.cuda.Device(dev)
        self.stream = stream_for(A.TORCH_CUDA, dev)

    def __enter__(self):
        self.device.__enter__()
        try:
            self.stream.__enter__()
        except BaseException:
            self.device.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.stream.__exit__(*exc)
        finally:
            self.device.__exit__(*exc)


def fresh_copy(x, kind):
    """A new C-contiguous copy of x (``contiguous`` returns x itself when it
    already is: a misaligned contiguous view stays misaligned)."""
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        return x.clone(memory_format=A.torch().contiguous_format)
    return x.copy(order="C")


def copy_into(out, src, kind):
    """out[...] = src, queued on the caller's stream."""
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        out.copy_(src)
    else:
        out[...] = src


def astype(x, dtype, kind):
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        return x.to(A.numpy_to_torch_dtype(dtype))
    return x.astype(dtype)


def moveaxis(x, kind, src, dst):
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        return x.movedim(src, dst)
    return (np if kind == A.NUMPY else _cp).moveaxis(x, src, dst)


def current_stream(kind, dev):
    """The CuPy stream object a call on ``kind`` runs on (torch's current stream
    for torch tensors, CuPy's current stream otherwise)."""
    return stream_for(kind, dev) or _cp.cuda.get_current_stream(dev)


def capturing(kind, dev):
    """True while the stream a call on ``kind`` runs on is being captured into a CUDA graph."""
    return current_stream(kind, dev).is_capturing()


# Host data (launch tables, per-channel parameters given as NumPy arrays) on
# the GPU, kept by content: (device, dtype, shape, bytes) -> _Upload. Each is
# copied on a stream of its own and waited for (microseconds: that stream
# holds nothing else), so it is ready for every stream at once and a call
# inside a CUDA graph capture, which cannot copy from host memory or query an
# event, can use a copy made before (the graph then keeps it for good).
#
# Eviction (issue 37). A copy's memory comes from the upload stream's part of
# CuPy's pool: freed, it goes to the next upload on that stream with no
# ordering behind the kernels callers queued on THEIR streams to read it, and
# once a caller's launch is queued the cache's reference is usually the last.
# So an evicted copy waits in _RETIRING with an event recorded at eviction on
# each stream it was returned for, and is dropped (back to the pool) only once
# those events are done: checked on later copies, never waited for. A full
# cache evicts its least recently used eighth (by ``_Upload.used``, a count of
# calls), so an entry a call just got, whose launch may not be queued yet, is
# not evicted under it (unless 7/8 of the cache were used by other threads in
# the microseconds between that call and its launch); a hit on a stream
# already noted takes no lock. Objects that keep a copy and launch it later
# (a foreach plan, an image launcher) hold it in a ``Held``, which retires it
# the same way when they are dropped.
_UPLOADS: dict = {}
_UPLOADS_MAX = 128
_UPLOAD_USERS_MAX = 8  # streams noted per entry past which those not used lately give way to events
_UPLOAD_STALE = 1024   # calls of uploaded after which a stream noted on an entry counts as not used lately
_upload_streams: dict = {}  # device -> the CuPy stream uploads are copied on
_uploads_lock = threading.Lock()  # taken for misses, evictions and a stream new to an entry
_RETIRING: list = []  # (array, events) of evicted copies, in eviction order
_ticks = itertools.count(1)  # calls of uploaded (next() of a count is atomic under the GIL)


class _Upload:
    """A copy in _UPLOADS: ``users`` {handle: (stream, tick of its last call)}
    it was returned for, ``events`` recorded on users since forgotten
    (``_prune_users``), ``used`` the tick of its last call, ``evicted`` (see
    ``_evict``)."""
    __slots__ = ("arr", "users", "events", "used", "evicted")

    def __init__(self, arr, tick):
        self.arr, self.users, self.events, self.used, self.evicted = arr, {}, [], tick, False


def uploaded(host, kind, dev, what, stream=None):
    """NumPy array ``host`` on GPU ``dev`` (a CuPy array; hold it while it is
    used), its copy complete. ``stream``: the CuPy stream the caller launches
    on (``stream_for``'s result; None: ``current_stream(kind, dev)``, where the
    driver's launches for ``kind`` go); once evicted, the copy goes back to the
    pool only after the work queued by then on such streams is done. Inside a
    capture with no earlier copy of the same content: RuntimeError naming
    ``what``, before anything is queued."""
    key = (dev, host.dtype.str, host.shape, host.tobytes())
    s = current_stream(kind, dev) if stream is None else stream
    captured = s.is_capturing()
    tick = next(_ticks)
    e = _UPLOADS.get(key)
    if e is not None:
        e.used = tick  # then read e.evicted (see _evict)
        if captured:
            _CAPTURED_TEMPS.append(e.arr)  # the graph keeps its address: never freed
            return e.arr
        if e.evicted or s.ptr not in e.users:
            with _uploads_lock:
                e = _use(key, e, s, tick)
        else:
            e.users[s.ptr] = (s, tick)  # (a known key: no resize, safe beside a locked reader)
        return e.arr
    if captured:
        raise RuntimeError(f"cufuse: {what} must be copied to the GPU, which cannot happen while a CUDA "
                           "graph is being captured; make the same call once before capturing (a warm-up, "
                           "on any stream), or pass device arrays")
    with _cp.cuda.Device(dev):  # outside the lock: the wait would hold up other threads
        u = _upload_streams.get(dev)
        if u is None:
            u = _upload_streams[dev] = _cp.cuda.Stream(non_blocking=True)
        with u:
            arr = _cp.asarray(host)
        u.synchronize()
    with _uploads_lock:
        e = _UPLOADS.get(key)
        if e is None:  # (else another thread copied it meanwhile: ours, read by nothing, is dropped)
            while _RETIRING and all(ev.done for ev in _RETIRING[0][1]):
                del _RETIRING[0]  # (in order: one still running holds up later ones, a little longer)
            if len(_UPLOADS) >= _UPLOADS_MAX:
                _evict()
            e = _UPLOADS[key] = _Upload(arr, tick)
        return _use(key, e, s, tick).arr


class Held:
    """Copies made by ``uploaded`` that an object keeps and launches later (a
    foreach plan, an image launcher): ``on(stream)`` notes each stream (None:
    CuPy's current) a launch reading them goes on; a launch captured into a
    CUDA graph keeps them for good. Once the Held is dropped
    the copies wait in _RETIRING for the work queued by then on those
    streams, as an evicted cache entry does: the cache's own reference may be
    gone by then, and the upload stream's next copy would take the memory
    while a kernel queued on another stream still reads it."""
    __slots__ = ("arrs", "streams", "events", "kept", "dev", "__weakref__")

    def __init__(self, dev, *arrs):
        self.arrs, self.streams, self.events, self.kept, self.dev = arrs, {}, [], False, dev
        weakref.finalize(self, _retire_held, arrs, self.streams, self.events, dev)

    def on(self, stream):
        s = stream if stream is not None else _cp.cuda.get_current_stream()
        if s.ptr not in self.streams:
            if len(self.streams) >= _UPLOAD_USERS_MAX:  # (a stream per call, say): events for those noted
                evs = _events(list(self.streams.values()), self.dev)
                if evs is None:
                    self._keep()
                else:
                    self.events[:] = [ev for ev in self.events if not ev.done] + evs
                self.streams.clear()
            self.streams[s.ptr] = s
        if not self.kept and s.is_capturing():  # a CUDA graph keeps the addresses: never freed
            self._keep()

    def _keep(self):
        _CAPTURED_TEMPS.extend(self.arrs)
        self.kept = True


def _retire_held(arrs, streams, events, dev):
    try:
        evs = _events(list(streams.values()), dev)
    except Exception:  # no event could be recorded (a capture beside, the interpreter exiting): kept for good
        evs = None
    if evs is None:
        _CAPTURED_TEMPS.extend(arrs)
    else:
        _RETIRING.append((arrs, events + evs))  # (one append: atomic beside the locked readers)


def _use(key, e, s, tick):
    """(Under the lock.) Note ``s`` among the streams entry ``e`` of ``key`` is
    returned for; if another thread evicted it since it was looked up, the
    entry cached now for ``key`` instead, or ``e`` cached again. The entry."""
    if e.evicted:
        cur = _UPLOADS.get(key)
        if cur is None:  # cached again; its uses so far wait in _RETIRING
            e.users, e.events, e.evicted = {}, [], False
            cur = _UPLOADS[key] = e
        e = cur
    if s.ptr not in e.users and len(e.users) >= _UPLOAD_USERS_MAX:
        _prune_users(e, key[0], tick)  # before noting s: its caller's launch is not queued yet
    e.users[s.ptr] = (s, tick)
    return e


def _evict():
    """(Under the lock.) Evict the least recently used eighth of the entries
    into _RETIRING (``_retire``). A hit in another thread sets ``used``, then
    reads ``evicted``; this takes ``used`` when it chooses, sets ``evicted``,
    then reads ``used`` again: a hit after the choice is seen here (the entry
    stays) or sees ``evicted`` (``_use`` caches it again)."""
    chosen = sorted((e.used, k) for k, e in _UPLOADS.items())[:max(1, _UPLOADS_MAX // 8)]
    for used, k in chosen:
        e = _UPLOADS.pop(k)
        e.evicted = True
        if e.used != used:  # hit meanwhile: keep it
            e.evicted = False
            _UPLOADS[k] = e
        else:
            _retire(e, k[0])


def _events(streams, dev):
    """An event recorded now on each stream (of device ``dev``), or None when
    one is being captured (its earlier work cannot be waited for by event)."""
    out = []
    for st in streams:
        if st.is_capturing():
            return None
        d = getattr(st, "device_id", -1)  # -1: not known (the null stream, some external ones)
        with _cp.cuda.Device(dev if d < 0 else d):  # an event is recorded on a stream of its device
            ev = _cp.cuda.Event(block=False, disable_timing=True)
            try:
                ev.record(st)
            except _cp.cuda.runtime.CUDARuntimeError:  # a stream of another device after all
                return None
        out.append(ev)
    return out


def _retire(e, dev):
    """Evicted ``e`` waits in _RETIRING for the work queued so far on its
    streams; kept for good where no event can say so (a stream being
    captured, or of another device: rare)."""
    evs = _events([st for st, _ in list(e.users.values())], dev)
    if evs is None:
        _CAPTURED_TEMPS.append(e.arr)
    else:
        _RETIRING.append((e.arr, e.events + evs))


def _prune_users(e, dev, tick):
    """Swap the streams of ``e`` not noted in the last _UPLOAD_STALE calls
    (a CuPy stream made per call, say) for events recorded on them now, and
    drop its events done. A stream noted lately stays: a launch on it may
    still be on its way from another thread."""
    gone = [p for p, (_, t) in list(e.users.items()) if tick - t > _UPLOAD_STALE]
    evs = _events([e.users.pop(p)[0] for p in gone], dev)
    if evs is None:
        _CAPTURED_TEMPS.append(e.arr)  # kept for good (rare)
        evs = []
    e.events = [ev for ev in e.events if not ev.done] + evs


_stream_buffers: dict = {}  # (device, stream handle) -> zeroed CuPy uint8 array


def stream_buffer(dev, stream, nbytes):
    """Address of a zeroed buffer of at least ``nbytes`` for launches on
    ``stream`` (None: CuPy's current) of ``dev``, which leave it zeroed (a
    recipe's last launch may zero it again). Made, or grown, zeroed on that
    stream; ``execute`` calls it and queues the recipe under _SBUF_LOCK, so
    that no other thread's launch on the buffer comes in between (a call
    being captured gets a buffer of its own)."""
    s = stream or _cp.cuda.get_current_stream()
    key = (dev, s.ptr)
    b = _stream_buffers.get(key)
    if b is None or b.size < nbytes:
        with _cp.cuda.Device(dev), s:
            b = _stream_buffers[key] = _cp.zeros(max(nbytes, 4096), np.uint8)
    return b.data.ptr


# ------------------------------------------------------------------ aliasing
def span(x, kind, shape=None, strides=None):
    """[lo, hi) bytes that view ``x`` touches (``shape``/``strides``: as broadcast)."""
    item = A.dtype_of(x, kind).itemsize
    return A.extent(A.pointer_of(x, kind), tuple(x.shape) if shape is None else shape,
                    A.strides_of(x, kind) if strides is None else strides, item)


def overlaps(a, b, kind):
    """True when two GPU arrays share any byte."""
    lo1, hi1 = span(a, kind)
    lo2, hi2 = span(b, kind)
    return lo1 < hi2 and lo2 < hi1


def needs_temporary(out, odt, ins, in_dtypes, kind, shape):
    """True when ``out`` (dtype ``odt``, the result ``shape``) shares memory with
    an input (``None`` entries are scalars) in any way other than
    element-for-element identity, which is safe in an elementwise kernel."""
    ost = A.strides_of(out, kind)
    optr = A.pointer_of(out, kind)
    lo, hi = A.extent(optr, shape, ost, odt.itemsize)
    for x, dt in zip(ins, in_dtypes):
        if x is None:
            continue
        xst = A.broadcast_strides(tuple(x.shape), A.strides_of(x, kind), shape)
        xptr = A.pointer_of(x, kind)
        xlo, xhi = A.extent(xptr, shape, xst, dt.itemsize)
        if xlo < hi and lo < xhi and not (xptr == optr and list(xst) == list(ost) and dt == odt):
            return True
    return False


# ------------------------------------------------------------------- layouts
STRIDED_NDIM = 8     # kernels/elementwise.cuh: kMaxDims
_LAYOUTS: dict = {}  # operand count -> numpy twin of LayoutT<n>


def layout_dtype(nops):
    """numpy twin of kernels/elementwise.cuh LayoutT<nops> (the hand-written
    kernels: nops = 4, kMaxOperands; a generated kernel: its operand count)."""
    dt = _LAYOUTS.get(nops)
    if dt is None:
        nd = STRIDED_NDIM
        dt = _LAYOUTS[nops] = np.dtype({"names": ["shape", "stride", "magic", "ndim", "vec"],
                                        "formats": [(np.int64, (nd,)), (np.int64, (nops, nd)), (np.uint64, (nd,)),
                                                    np.int32, np.int32]}, align=True)
    return dt


def layout(nops, cshape, cstrides, vec):
    """A LayoutT<nops> record: collapsed shape and per-operand strides (dim 0
    innermost; rows of None stay zero), traversal ``vec``."""
    L = np.zeros((), dtype=layout_dtype(nops))
    nd = len(cshape)
    L["ndim"] = nd
    L["shape"][:nd] = cshape
    L["magic"][:nd] = [A.fast_div_magic(d) for d in cshape]
    for k, st in enumerate(cstrides):
        if st is not None:
            L["stride"][k, :nd] = st
    L["vec"] = vec
    return L


def strided_layout(nops, cshape, parts, vec, n, nout=1):
    """(LayoutT<nops> record, threads) for the strided kernels. ``parts``: per
    operand (pointer, collapsed strides, itemsize), the ``nout`` outputs
    first; None for a scalar input's slot. Only the pointers' alignment is
    read. The traversal (kernels/elementwise.cuh, LayoutT): tiles (2) when
    the outputs are C-contiguous and every input an array that repeats a
    contiguous block, else packs along dim 0 (1) when they fit, else one
    element per thread (0)."""
    tiles = _tiles(cshape, parts, vec, n, nout)
    if tiles is not None:
        L = layout(nops, cshape, [], 2)
        for k, row in enumerate(tiles):
            L["stride"][k, :5] = row
        return L[()], n // vec
    strides = [None if p is None else p[1] for p in parts]
    if any(p[1][0] == 0 for p in parts[:nout]) or not _packs_fit(cshape, parts, vec):
        return layout(nops, cshape, strides, 0)[()], n
    return layout(nops, cshape, strides, 1)[()], n // vec


def _tiles(cshape, parts, vec, n, nout):
    """Per operand [pack, div, mod, magic(div), magic(mod)] for tile mode, or
    None. Operand k's element for logical index i is (i / div) % mod: the
    outputs are C-contiguous (div 1, mod n) and each input's strides are 0 on
    the dims inside and outside one run of dims over which it is contiguous.
    A pack of ``vec`` elements then reads ``vec`` consecutive elements (div
    1, and the block a multiple of ``vec`` long, aligned) or one (div a
    multiple of ``vec``)."""
    if n % vec or n >= 2**31:  # the kernels index tiles in 32 bits
        return None
    if any(p is None for p in parts):
        return None  # the tiled kernels take arrays only (no scalar decoding in them)
    rows = []
    for k, (ptr, st, itemsize) in enumerate(parts):
        a = 0
        while a < len(cshape) and st[a] == 0:
            a += 1
        b, expect = a, 1
        while b < len(cshape) and st[b] == expect:
            expect *= cshape[b]
            b += 1
        if any(st[d] for d in range(b, len(cshape))):
            return None
        div, mod = A.count(cshape[:a]), expect  # mod: the block's length (n // div: no wrap)
        if k < nout and (a or b < len(cshape)):
            return None
        if div == 1 and a < len(cshape):
            if mod % vec or ptr % min(vec * itemsize, 16):
                return None
            pack = 1
        elif div % vec == 0 or a == len(cshape):
            pack = 0
        else:
            return None
        rows.append([pack, div, mod, A.fast_div_magic(div), A.fast_div_magic(mod)])
    return rows


def _packs_fit(cshape, parts, vec):
    """Can the strided kernel walk dim 0 in packs of ``vec``? Its size must be
    a multiple of ``vec``; the output and each input must be contiguous (or,
    for inputs, broadcast) along it, with every pack start aligned as the
    kernel's Pack type is (its size, at most 16 bytes)."""
    if cshape[0] % vec:
        return 0
    for k, part in enumerate(parts):
        if part is None:
            continue  # a scalar
        ptr, st, itemsize = part
        if st[0] == 0 and k > 0:
            continue  # one value broadcast over each pack
        align = min(vec * itemsize, 16)
        if st[0] != 1 or ptr % align or any((s * itemsize) % align for s in st[1:]):
            return 0
    return 1


# ----------------------------------------------------------- signatures
# Scalars whose type (not value) is part of a call's signature; bools too, which
# cufuse.fuse takes and the ops reject in their general path.
SCALAR_TYPES = frozenset([int, float, bool, np.bool_, np.float16, np.float32, np.float64, np.int8, np.int16,
                          np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])


def signature(items):
    """(key, pointers) of a call's arguments, or None when one of them is not
    a CuPy array, a CUDA tensor, None or a scalar (NumPy and CPU tensors take
    the general path, and so does anything to be rejected).

    Per array: its type, dtype, shape, strides, the low 4 bits of its address
    (what alignment decisions read) and its device; per other item its type.
    A tensor with its negative bit set gives None (the general path refuses it).
    ``pointers`` lists the arrays' addresses. A tensor that requires grad
    with grad mode on gives None: the call is recorded for autograd (the
    general path), so a kept recipe never skips that."""
    Cupy, Tensor = A.CupyArray, TORCH.Tensor
    key, ptrs = [], []
    try:
        for a in items:
            t = type(a)
            if t is Cupy:
                d = a.data
                p = d.ptr
                key.append((a.dtype, a.shape, a.strides, p & 15, d.device_id))
                ptrs.append(p)
            elif t is Tensor:
                d = a.get_device()  # -1 off the GPU
                if d < 0:
                    return None
                if a.requires_grad and TORCH.grad_enabled() or a.is_neg():  # (a lazy negation: refused there)
                    return None
                p = a.data_ptr()
                key.append((a.dtype, a.shape, a.stride(), p & 15, d))
                ptrs.append(p)
            elif t in SCALAR_TYPES or a is None:
                key.append(t)  # a scalar's type fixes its dtype; its value is read at each call
            elif Tensor is None and A.is_torch_tensor(a):
                torch_api()
                return signature(items)
            elif Tensor is not None and isinstance(a, Tensor):  # a subclass (nn.Parameter): as a tensor
                d = a.get_device()
                if d < 0 or a.requires_grad and TORCH.grad_enabled() or a.is_neg():
                    return None
                p = a.data_ptr()
                key.append((t, a.dtype, a.shape, a.stride(), p & 15, d))
                ptrs.append(p)
            else:
                return None  # NumPy arrays, CuPy subclasses, anything to be rejected: the general path
    except RuntimeError:  # a CUDA tensor without strided memory (sparse, nested): the general path refuses it
        return None
    return tuple(key), ptrs


# ---------------------------------------------------------------- recipes
class Slot:
    """A kernel argument filled in at each call: output k, input k, temporary
    k, or per-call value k (a scalar: eps, a seed, a scalar operand's bits)."""
    __slots__ = ("what", "k")

    def __init__(self, what, k):
        self.what, self.k = what, k

    def __repr__(self):
        return f"Slot({self.what!r}, {self.k})"


def out_(k):
    return Slot("out", k)


def in_(k):
    return Slot("in", k)


def val(k):
    return Slot("val", k)


class Launch(NamedTuple):
    fn: object
    grid: tuple
    block: tuple
    shared: int
    get: object    # operator.itemgetter picking the arguments from (*constants, *slot values)
    consts: tuple
    packed: list   # [Packed, None before the first launch, or False: always through fn]


# struct formats of kernel arguments as CuPy passes them: Python bool, int and
# float as bool, int64 (uint64 from 2**63) and double; NumPy scalars as their dtype
_FORMATS = {np.dtype(t): f for t, f in ((np.bool_, "?"), (np.int8, "b"), (np.uint8, "B"), (np.int16, "h"),
                                         (np.uint16, "H"), (np.int32, "i"), (np.uint32, "I"), (np.int64, "q"),
                                         (np.uint64, "Q"), (np.float16, "e"), (np.float32, "f"),
                                         (np.float64, "d"))}


class Packed:
    """A launch's arguments packed as the driver takes them: one buffer
    holding every argument 16-byte aligned, and the array of their addresses
    (cuLaunchKernel's kernelParams). Each call packs its values into the
    buffer and launches under the lock (the driver copies the arguments
    before cuLaunchKernel returns)."""
    __slots__ = ("struct", "buf", "params", "params_ptr", "consts", "dims", "fptr", "lock")

    def __init__(self, st, args):
        fmt, offsets, off = ["<"], [], 0
        for a in args:
            t = type(a)
            if t is bool:
                f = "?"
            elif t is int:
                f = "Q" if a >= 2**63 else "q"
            elif t is float:
                f = "d"
            elif isinstance(a, np.generic):
                f = _FORMATS.get(a.dtype) or f"{a.dtype.itemsize}s"  # records (Layout) as their bytes
            else:
                raise TypeError(f"no packing for a {t.__name__} kernel argument")
            start = -(-off // 16) * 16
            if start > off:
                fmt.append(f"{start - off}x")
            fmt.append(f)
            offsets.append(start)
            off = start + struct.calcsize("<" + f)
        self.struct = struct.Struct("".join(fmt))
        self.buf = np.zeros(max(off, 16), np.uint8)
        base = self.buf.ctypes.data
        self.params = np.array([base + o for o in offsets], np.uint64)
        self.params_ptr = self.params.ctypes.data
        # constants as packed (records as bytes, once)
        self.consts = tuple(c.tobytes() if isinstance(c, np.void) else c for c in st.consts)
        g, b = (tuple(st.grid) + (1, 1))[:3], (tuple(st.block) + (1, 1))[:3]
        self.dims = (*[max(1, int(v)) for v in g + b], int(st.shared))
        self.fptr = st.fn.ptr
        self.lock = threading.Lock()


class Memset(NamedTuple):
    slot: int      # index of the pointer among the slot values
    nbytes: int


class Output(NamedTuple):
    shape: tuple
    dtype: object  # NumPy dtype (CuPy) or torch dtype (torch)
    strides: tuple | None = None  # element strides of a dense layout (a permutation of C order); None: C order


class Recipe(NamedTuple):
    """Everything a call of one signature launches, with its pointers and
    per-call values as slots: (outputs, inputs, temporaries, values)."""
    kind: str
    device: int
    outs: tuple       # Output per result (allocated when the call has no out=)
    temps: tuple      # bytes of each temporary (uint8, allocated per call, all in one allocation)
    steps: tuple      # Launch and Memset, in order
    nout: int
    nin: int
    out_spans: tuple  # per output: (lo, hi) byte offsets from its pointer
    in_spans: tuple   # per input: the same
    same_ok: tuple    # per output: inputs that may be the very same view (elementwise in place)
    sbufs: tuple = ()  # bytes of each per-stream buffer (RecipeBuilder.stream_buffer)
    extra: object = None  # what else the family keeps with the recipe (cufuse.fuse: the traced signature)
    like: bool = False    # output 0 may be empty_like(the call's first argument) (build's like)
    temp_offsets: tuple = ()  # per temporary: its byte offset in the call's one allocation of them
    temp_bytes: int = 0       # that allocation's size
    flat: list | None = None  # [its flat launcher (``_flat``), None before one is made, or False: none]


class RecipeBuilder:
    """Collects a recipe's steps; ``temp`` adds a temporary and returns its slot."""

    def __init__(self, kind, device, nout, nin):
        self.kind, self.device, self.nout, self.nin = kind, device, nout, nin
        self.temps, self.sbufs, self.steps = [], [], []

    def stream_buffer(self, nbytes):
        """A buffer of at least ``nbytes`` kept per (device, stream), zeroed
        once; the recipes that use it (column tickets, the split and pipe
        rows' workspace) leave it zeroed, so launches on one stream, which
        run in order, share it."""
        s = Slot("sbuf", len(self.sbufs))
        self.sbufs.append(int(nbytes))
        return s

    def temp(self, nbytes, zeroed=0):
        """A per-call temporary of ``nbytes``, its first ``zeroed`` bytes set to 0 on the call's stream.
        Allocated rounded up to 16 bytes, as row kernels read whole 16-byte packs: a memset of all
        ``nbytes`` covers the tail too, else the kernel that writes the temporary must (initcheck)."""
        s = Slot("tmp", len(self.temps))
        n = -(-int(nbytes) // 16) * 16
        self.temps.append(n)
        if zeroed:
            self.steps.append(("memset", s, n if zeroed >= nbytes else int(zeroed)))
        return s

    def launch(self, fn, grid, block, args, shared=0):
        R.allow_shared(fn, shared)
        self.steps.append(("launch", fn, tuple(grid), tuple(block), int(shared), tuple(args)))

    def build(self, outs, out_spans, in_spans, same_ok=None, extra=None, like=None):
        """The recipe of outputs ``outs`` (``output``); ``out_spans`` and
        ``in_spans`` (``view_span``, one per output and input) and ``same_ok``
        (per output, the inputs it may be the very same view of; default none)
        are what ``apart`` checks a given out= with. ``like``: the call's first
        argument, whose twin (empty_like) output 0 may be where it has that
        output's shape and dtype and is C-contiguous."""
        same_ok = ((),) * len(outs) if same_ok is None else same_ok
        if not len(out_spans) == len(same_ok) == len(outs) or len(in_spans) != self.nin:
            raise ValueError(f"recipe: {len(outs)} outputs with {len(out_spans)} spans and {len(same_ok)} "
                             f"same-view sets; {self.nin} inputs with {len(in_spans)} spans")
        t = self.nout + self.nin
        base = {"out": 0, "in": self.nout, "tmp": t, "sbuf": t + len(self.temps),
                "val": t + len(self.temps) + len(self.sbufs)}
        steps = []
        for st in self.steps:
            if st[0] == "memset":
                steps.append(Memset(base["tmp"] + st[1].k, st[2]))
                continue
            _, fn, grid, block, shared, args = st
            # the arguments are picked from (*constants, *slot values)
            consts = tuple(a for a in args if type(a) is not Slot)
            idx, c = [], 0
            for a in args:
                if type(a) is Slot:
                    idx.append(len(consts) + base[a.what] + a.k)
                else:
                    idx.append(c)
                    c += 1
            get = operator.itemgetter(*idx) if len(idx) > 1 else (lambda v, i=idx[0]: (v[i],))
            steps.append(Launch(fn, grid, block, shared, get, consts, [None]))
        like_ok = False
        if like is not None and outs and self.kind == A.TORCH_CUDA and A.is_torch_tensor(like):
            o = outs[0]
            like_ok = (tuple(like.shape) == o.shape and like.dtype == o.dtype and o.strides is None
                       and A.is_c_contiguous(o.shape, A.strides_of(like, self.kind)))
        offsets, end = [], 0
        for n in self.temps:  # each at a multiple of 128 bytes: one allocation per call, not one per temporary
            offsets.append(end)
            end += -(-n // 128) * 128
        return Recipe(self.kind, self.device, tuple(outs), tuple(self.temps), tuple(steps), self.nout, self.nin,
                      tuple(out_spans), tuple(in_spans), tuple(same_ok), tuple(self.sbufs), extra, like_ok,
                      tuple(offsets), end, [None])


def output(shape, dtype, kind, strides=None):
    """The Output of a recipe for a result of ``shape`` and NumPy ``dtype``,
    C-contiguous or with ``strides`` (elements) of a dense layout."""
    return Output(tuple(shape), A.numpy_to_torch_dtype(dtype) if kind == A.TORCH_CUDA else np.dtype(dtype),
                  None if strides is None else tuple(strides))


def view_span(shape, strides, itemsize):
    """(lo, hi) byte offsets from a view's pointer of what it touches (strides in elements)."""
    return A.extent(0, tuple(shape), tuple(strides), itemsize)


def _torch_outs(T, specs, dev):
    """New torch tensors for the Outputs ``specs`` on GPU ``dev`` (C order, or their strides)."""
    return [torch_empty(T, o.shape, o.dtype, dev) if o.strides is None else
            T.empty_strided(o.shape, o.strides, dtype=o.dtype, device=T.devices.get(dev) or torch_device(dev))
            for o in specs]


_TEMPLATES: dict = {}  # (shape, torch dtype, device) -> torch_empty's template, or False: none
_TEMPLATES_MAX = 4096
_BASES: dict = {}  # torch device -> the 16 bytes every template of that device views


def torch_empty(T, shape, dtype, dev):
    """A new C-order torch tensor of ``shape`` and torch ``dtype`` on GPU
    ``dev``: ``empty_like`` of a template (``_template``, kept per shape,
    dtype and device), which costs about half of ``torch.empty(shape,
    dtype=, device=)``: no keywords to parse."""
    k = (shape, dtype, dev)
    t = _TEMPLATES.get(k)
    if t is None:
        t = _template(T, shape, dtype, T.devices.get(dev) or torch_device(dev))
        if t is not None:
            if len(_TEMPLATES) >= _TEMPLATES_MAX:
                _TEMPLATES.clear()
            _TEMPLATES[k] = t
    if t is None or t is False:
        return T.empty(shape, dtype=dtype, device=T.devices.get(dev) or torch_device(dev))
    return T.empty_like(t)


def _template(T, shape, dtype, tdev):
    """The template of ``torch_empty``: the first element of ``tdev``'s base
    viewed as ``dtype`` and ``shape``, with stride 0 on every dim longer than
    1 (so it overlaps itself and ``empty_like`` lays its result out in C
    order) and torch.empty's stride on the others. Its layout is checked
    once on the meta device against ``torch.empty``'s (False where they
    would differ). It holds no memory of torch's allocator (``_base``), whose
    pools torch.compile's CUDA graphs check for tensors they do not know.
    None where no base can be made now or a tensor mode is active (not
    kept: asked again at a later call)."""
    base = _base(T, tdev)
    if base is None:
        return None
    try:
        ref = T.empty(shape, dtype=dtype, device="meta")
        if ref.numel() == 0:  # (empty_like of an empty view keeps its strides on some devices, not on meta)
            return False
        strides = tuple(0 if n > 1 else s for n, s in zip(ref.shape, ref.stride()))
        y = T.empty_like(T.empty((1,), dtype=dtype, device="meta").as_strided(shape, strides))
        if not (y.shape == ref.shape and y.stride() == ref.stride() and y.dtype == dtype and y.is_contiguous()):
            return False
        t = base.view(dtype)[:1].as_strided(shape, strides)
    except Exception:  # (a shape torch rejects, or a dtype wider than the base: torch.empty at the call)
        return False
    return t if type(t) is T.Tensor else None


def _base(T, tdev):
    """16 bytes on ``tdev`` as a torch uint8 tensor, made once: on a GPU,
    CuPy's memory (outside torch's allocator and its CUDA graph pools), made
    when torch's stream there is not capturing a graph; None until then."""
    b = _BASES.get(tdev)
    if b is None:
        if tdev.type != "cuda":
            b = T.empty((16,), dtype=T.np_dtypes[_U8], device=tdev)
        else:
            if _torch_capturing(tdev):
                return None
            with _cp.cuda.Device(tdev.index):
                b = A.torch().from_dlpack(_cp.empty(16, np.uint8))
        b = _BASES[tdev] = b
    return b


def _torch_capturing(tdev):
    """Whether torch's current stream on the GPU ``tdev`` is capturing a CUDA graph."""
    torch = A.torch()
    with torch.cuda.device(tdev):
        return torch.cuda.is_current_stream_capturing()


def execute(rec, outs, in_ptrs, values=(), like=None):
    """Run ``rec``: ``outs`` the output arrays (None: allocate them),
    ``in_ptrs`` the inputs' addresses, ``values`` the per-call values,
    ``like`` the call's first argument (a torch result is allocated as
    ``empty_like`` of it where the recipe says it may: half the host time of
    ``torch.empty``). Returns the outputs (a list). Through the recipe's
    flat launcher once it has one (``_flat``)."""
    fl = rec.flat
    f = fl[0] if fl else False  # (a Recipe made other than by RecipeBuilder.build has no slot for one)
    res = None
    if f:
        res = f(outs, in_ptrs, values, like)
    elif f is None:
        fl[0] = _flat(rec)
    if res is None:
        res = _execute(rec, outs, in_ptrs, values, like)
    if outs is not None and rec.kind == A.TORCH_CUDA:
        written(outs)
    return res


def written(outs):
    """``outs``, torch tensors written through their memory (``out=``): their version
    counters bumped, as torch's own out= ops do, so that autograd refuses a
    backward that saved one (it would read the new values: a wrong gradient,
    silently). In any grad mode, as torch's: a graph recorded before a
    no_grad write still reads the tensor; inference tensors keep no version."""
    T = TORCH if TORCH.Tensor is not None else torch_api()
    T.bump_versions(outs)


def _execute(rec, outs, in_ptrs, values, like):
    """``execute`` for every recipe, step by step."""
    kind, dev = rec.kind, rec.device
    if dev != get_device():
        with _cp.cuda.Device(dev):
            return _execute(rec, outs, in_ptrs, values, like)
    if kind == A.TORCH_CUDA:
        T = TORCH if TORCH.Tensor is not None else torch_api()
        if outs is None:
            if rec.like and like is not None:
                outs = [T.empty_like(like)]
                if len(rec.outs) > 1:
                    outs += _torch_outs(T, rec.outs[1:], dev)
            else:
                outs = _torch_outs(T, rec.outs, dev)
        optrs = [o.data_ptr() for o in outs] if len(outs) > 1 else (outs[0].data_ptr(),)
        sptr = T.raw_stream(dev)  # torch's current stream
        temps = tptrs = ()
        if rec.temps:
            temps = torch_empty(T, (rec.temp_bytes,), T.np_dtypes[_U8], dev)
            t0 = temps.data_ptr()
            tptrs = [t0 + o for o in rec.temp_offsets]
    else:
        if outs is None:
            new = _cp.ndarray
            outs = [new(o.shape, o.dtype) if o.strides is None else empty_dense(o.shape, o.dtype, kind, dev, o.strides)
                    for o in rec.outs]
        optrs = [o.data.ptr for o in outs] if len(outs) > 1 else (outs[0].data.ptr,)
        sptr = _cp.cuda.get_current_stream().ptr
        temps = tptrs = ()
        if rec.temps:
            temps = _cp.empty((rec.temp_bytes,), np.uint8)
            t0 = temps.data.ptr
            tptrs = [t0 + o for o in rec.temp_offsets]
            if _cp.cuda.get_current_stream().is_capturing():
                # a CUDA graph being captured keeps these addresses: the memory
                # must not return to the pool, where another array would take it
                _CAPTURED_TEMPS.append(temps)
    if rec.sbufs:
        sobj = _stream_object(kind, dev, sptr)
        if (sobj or _cp.cuda.get_current_stream()).is_capturing():
            # A graph gets buffers of its own, zeroed by a memset it captures (a
            # graph may replay on any stream, beside eager calls on this one)
            bufs = [empty((max(n, 16),), _U8, kind, dev) for n in rec.sbufs]
            _CAPTURED_TEMPS.extend(bufs)
            bptrs = [A.pointer_of(b, kind) for b in bufs]
            for p, n in zip(bptrs, rec.sbufs):
                _cp.cuda.runtime.memsetAsync(p, 0, n, sptr)
            tptrs = [*tptrs, *bptrs]
        else:
            # The stream's buffer looked up (or grown) and every launch that
            # uses it queued (the last one leaves it zeroed) with no other
            # thread's launch on the buffer in between; a recipe not queued
            # whole leaves it to be made again, zeroed
            with _SBUF_LOCK:
                try:
                    _queue(rec, (*optrs, *in_ptrs, *tptrs, *[stream_buffer(dev, sobj, n) for n in rec.sbufs],
                                 *values), kind, dev, sptr)
                except BaseException:
                    _stream_buffers.pop((dev, sptr), None)
                    raise
            del temps
            return outs
    _queue(rec, (*optrs, *in_ptrs, *tptrs, *values), kind, dev, sptr)
    del temps  # queued: the allocators order the memory's reuse after the launches
    return outs


_SBUF_LOCK = threading.Lock()


def queue(rec, values, stream=None):
    """Queue the launches of ``rec``, a recipe with no outputs, inputs or
    temporaries (``RecipeBuilder(kind, dev, 0, 0)``: every pointer a
    constant or a value), with the call's ``values`` on ``stream`` (a CuPy
    stream object; None: CuPy's current), on the current device: the packed
    launches of ``execute`` for launchers that keep their own per-signature
    state (image pipelines)."""
    sptr = (stream if stream is not None else _cp.cuda.get_current_stream()).ptr
    _queue(rec, values, rec.kind, rec.device, sptr)


def _queue(rec, vals, kind, dev, sptr):
    """Queue ``rec``'s steps on the stream ``sptr`` with the call's ``vals``."""
    for st in rec.steps:
        if type(st) is not Launch:
            _cp.cuda.runtime.memsetAsync(vals[st.slot], 0, st.nbytes, sptr)
            continue
        p = st.packed[0]
        if p:
            try:
                with p.lock:
                    p.struct.pack_into(p.buf, 0, *st.get(p.consts + vals))
                    _launch_kernel(p.fptr, *p.dims, sptr, p.params_ptr, 0)
                continue
            except Exception:  # a value that does not pack, or no context on this thread: as below
                pass
        args = _launch_fn(st, vals, kind, dev, sptr)
        if p is None:
            try:
                st.packed[0] = Packed(st, args) if type(st.fn) is _Function else False
            except TypeError:
                st.packed[0] = False


def _launch_fn(st, vals, kind, dev, sptr):
    """Launch ``st`` through its CuPy function (which makes the device's
    context current and converts each argument); returns the arguments."""
    args = st.get(st.consts + vals)
    st.fn(st.grid, st.block, args, st.shared, _stream_object(kind, dev, sptr))
    return args


def _flat(rec):
    """A launcher doing ``execute``'s work for ``rec`` with everything that
    does not change between calls bound once: for a recipe of one packed
    launch and no temporaries or stream buffers (most ops' forward), the
    per-call work is the outputs' allocation, the stream and the launch.
    None while the launch is not packed yet (its first run packs it),
    False for recipes that need ``_execute``'s general steps. The launcher
    returns None off the recipe's device (the caller runs ``_execute``); it
    holds no reference to the recipe, which holds it (no cycle to collect)."""
    steps = rec.steps
    if len(steps) != 1 or type(steps[0]) is not Launch or rec.temps or rec.sbufs:
        return False
    st = steps[0]
    p = st.packed[0]
    if not p:
        return p
    kind, dev, specs = rec.kind, rec.device, rec.outs
    one = len(specs) == 1
    pack, buf, lock, get, consts = p.struct.pack_into, p.buf, p.lock, st.get, p.consts
    gx, gy, gz, bx, by, bz, shared = p.dims
    fptr, params, launch, current = p.fptr, p.params_ptr, _launch_kernel, get_device

    def queue(vals, sptr):
        try:
            with lock:
                pack(buf, 0, *get(consts + vals))
                launch(fptr, gx, gy, gz, bx, by, bz, shared, sptr, params, 0)
        except Exception:  # a value that does not pack, or no context on this thread
            _launch_fn(st, vals, kind, dev, sptr)

    if kind == A.TORCH_CUDA:
        T = torch_api()
        raw, empty_like, like_ok = T.raw_stream, T.empty_like, rec.like

        def run(outs, in_ptrs, values, like):
            if current() != dev:
                return None
            if outs is None:
                if like_ok and like is not None:
                    outs = [empty_like(like)] if one else [empty_like(like), *_torch_outs(T, specs[1:], dev)]
                else:
                    outs = _torch_outs(T, specs, dev)
            if one:
                queue((outs[0].data_ptr(), *in_ptrs, *values), raw(dev))
            else:
                queue((*[o.data_ptr() for o in outs], *in_ptrs, *values), raw(dev))
            return outs
    else:
        new, stream = _cp.ndarray, _cp.cuda.get_current_stream

        def run(outs, in_ptrs, values, like):
            if current() != dev:
                return None
            if outs is None:
                outs = [new(o.shape, o.dtype) if o.strides is None else empty_dense(o.shape, o.dtype, kind, dev, o.strides)
                        for o in specs]
            if one:
                queue((outs[0].data.ptr, *in_ptrs, *values), stream().ptr)
            else:
                queue((*[o.data.ptr for o in outs], *in_ptrs, *values), stream().ptr)
            return outs
    return run


_U8 = np.dtype(np.uint8)
_CAPTURED_TEMPS: list = []  # CuPy temporaries of launches captured into CUDA graphs (kept for good)


def keep_captured(*arrays):
    """Keep arrays whose addresses a CUDA graph being captured holds, for good."""
    _CAPTURED_TEMPS.extend(arrays)


def run_general(rec, targets, outs, in_ptrs, values=(), like=None, fast=None, key=None):
    """The general path's launch: ``execute`` into ``targets`` (None: new
    arrays), each result copied into the caller's ``outs`` entry where that
    is not where it was computed (a temporary), and the recipe kept in
    ``fast`` under ``key`` unless key is None (the call needed copies).
    Returns the results (a list)."""
    res = execute(rec, targets, in_ptrs, values, like)
    if outs is not None:
        for k, (r, o) in enumerate(zip(res, outs)):
            if o is not None and r is not o:
                copy_into(o, r, rec.kind)
                res[k] = o
    if key is not None:
        fast.put(key, rec)
    return res


def _stream_object(kind, dev, sptr):
    """The stream argument of a launch on the handle ``sptr``: for torch a
    CuPy stream object (cached per handle), for CuPy None (its current)."""
    if kind == A.TORCH_CUDA:
        s = _torch_streams.get((sptr, dev))
        if s is None:
            s = _torch_streams[(sptr, dev)] = R.external_stream(sptr, dev)
        return s
    return None


def apart(rec, optrs, in_ptrs):
    """Each given output shares no byte with any input, or is the very same
    view of it where the recipe allows (an elementwise op in place), and no
    byte with another output."""
    spans = rec.in_spans
    done = []
    for (lo, hi), ok, p in zip(rec.out_spans, rec.same_ok, optrs):
        lo += p
        hi += p
        j = 0
        for q in in_ptrs:
            ilo, ihi = spans[j]
            if q + ilo < hi and lo < q + ihi and not (q == p and j in ok):
                return False
            j += 1
        for plo, phi in done:
            if plo < hi and lo < phi:
                return False
        done.append((lo, hi))
    return True


# -------------------------------------------------------------- fast path
_FAST_PATHS: weakref.WeakSet = weakref.WeakSet()


class FastPath:
    """The recipes of one op by call signature; ``hits`` and ``misses`` count
    calls that found theirs or took the general path."""
    MAX = 256

    def __init__(self, name):
        self.name = name
        self.recipes: dict = {}
        self.hits = 0
        self.misses = 0
        _FAST_PATHS.add(self)

    def put(self, key, rec):
        if key is None or rec is None:
            return
        if len(self.recipes) >= self.MAX:
            self.recipes.clear()
        self.recipes[key] = rec

    def lookup(self, key, ptrs, nin, out):
        """The recipe of this signature, if there is one and a given ``out`` is
        apart from the inputs (else None: the general path). ``ptrs``: the
        inputs' addresses, then the outputs' (``nin`` inputs)."""
        rec = self.recipes.get(key)
        if rec is None or (out is not None and not apart(rec, ptrs[nin:], ptrs[:nin])):
            self.misses += 1
            return None
        self.hits += 1
        return rec

    def run(self, key, ptrs, nin, out, values=(), like=None):
        """The call's outputs if its signature has a recipe (``lookup``), else
        None; ``out``: None or a tuple of output arrays; ``like``: the call's
        first argument (``execute``)."""
        rec = self.lookup(key, ptrs, nin, out)
        if rec is None:
            return None
        return execute(rec, out, ptrs[:nin] if len(ptrs) > nin else ptrs, values, like)


def fast_paths():
    return list(_FAST_PATHS)


def clear_fast_paths():
    """Forget every recipe (tests that wrap the kernels start from here)."""
    for fp in _FAST_PATHS:
        fp.recipes.clear()
