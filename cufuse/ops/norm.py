"""Row normalizations and softmax: layer_norm, layer_norm_relu, rms_norm,
softmax, log_softmax (kernels/norm.cu on kernels/rows.cuh).

Each row (the trailing ``normalized_shape`` dims, or the softmax axis) is
held in registers: read once, reduced, written once. A row up to 4096
16-byte packs belongs to a group of threads of one block (warp shuffle,
shared memory); a longer one to several blocks, each holding a part, that
merge their statistics once per row: on sm_90 a thread-block cluster's
distributed shared memory (up to 8 blocks of 2048 packs for float16, 4 for
others), beyond that (or
without clusters) a workspace in global memory (a row's blocks wait for one
another: at most a quarter of the SMs per row, see plan). Rows longer than
that fall back to a kernel that re-reads the row.
float16 is computed in float32, float32 in float32, float64 in float64.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import NamedTuple

import numpy as np

from .. import _arrays as A
from .._arrays import Array
from .. import _autograd as AG
from .. import _dask as DK
from .. import _torch_ops as TO
from .. import _driver as D
from .. import _runtime as R
from .._fuse.api import Fused
from . import _rows

FAMILY = "norm"
_NPS = (1, 2, 4, 8)           # packs (16 bytes) per thread of norm_rows instantiations
_CLUSTER_BLOCK_PACKS = 256 * 8  # packs a block of norm_rows_cluster holds (256 threads x 8)
# blocks per row of norm_rows_cluster (sm_90, 8 packs per thread); 8 is the
# portable maximum. No 2: rows of up to _ONE_GROUP_PACKS take one group, and
# two 256 x 8 blocks hold no more, so plan() never picked it.
_CLUSTERS = (4, 8)
_SPLIT_NP = 8                 # packs per thread of norm_rows_split
_SPLIT_TPR = ((256, 32), (512, None))  # (threads per block, most parts) of norm_rows_split, in order of preference
_SPLIT_LAUNCHES = 4           # split launches in flight at once (any streams) that cannot deadlock
_PART_BYTES = 32              # workspace bytes per part of a split row (kernels/rows.cuh: kPartBytes)
_STREAM_TPR = 512
# norm_rows_pipe (float16/float32 rows of whole packs): packs per thread,
# shared-memory slots per block (rows in flight + 2), threads per block
# (kernels/norm.cu kPipeThreads), most parts per row (rows.cuh: one lane of
# warp 0 per part), and the workspace bytes per part (rows.cuh: kPipeWords
# words of 8 bytes)
_PIPE_NP, _PIPE_SLOTS, _PIPE_TPB, _PIPE_MOST_PARTS, _PIPE_PART_BYTES = 4, 3, 512, 32, 24
_ONE_GROUP_PACKS = 4096      # rows of up to this many 16-byte packs: one thread group (no cluster)
_RESCUE_TPB = 256            # threads per block of norm_rows_rescue (kernels/norm.cu: its launch bounds)
# How long (ns) a block of norm_rows_split / norm_rows_pipe waits for the other
# parts of its row before it gives up and leaves its part to norm_rows_rescue
# (kernels/rows.cuh SplitGroup).
# Waits last a block's lifetime (microseconds) unless other kernels hold the
# GPU; tests set 0 (every block gives up) to take the rescue path.
PATIENCE_NS = 1_000_000  # (below 2**32: kernels/rows.cuh global_ns)


def _cbool(v):
    return "true" if v else "false"


class _RowOp:
    """One op of kernels/norm.cu (functor ``functor``) for every float dtype."""

    def __init__(self, name, functor, narrow=False, pipe=()):
        self.name = name
        self.functor = functor
        self.pipe = dict(pipe)  # dtype -> the fewest packs of a row that takes norm_rows_pipe (see plan)
        # layer_norm: float16 rows of misaligned packs keep 4 packs per thread
        # (see plan), and float32/float64 rows of >= 8 packs per thread the
        # kernel for any row (see launch)
        self.narrow = narrow
        self.exprs = {}
        self.fast = D.FastPath(name)
        for dt, ct in R.FLOAT_CTYPES.items():
            # each register-resident plan twice: for any row, and ("whole") for
            # rows of whole, aligned packs (see launch)
            for whole, tag in ((False, ()), (True, ("whole",))):
                for np_ in _NPS:
                    self._register(dt, ("np", np_) + tag,
                                   R.name_expression("norm_rows", functor, ct, str(np_), _cbool(whole)))
                for cs in _CLUSTERS:
                    self._register(dt, ("cluster", 8, cs) + tag,
                                   R.name_expression("norm_rows_cluster", functor, ct, "8", str(cs),
                                                     _cbool(whole)), 90)
                # kernels whose blocks wait for one another, each with the
                # launch after it that stores the parts of blocks that gave up
                self._register(dt, ("split", _SPLIT_NP) + tag,
                               R.name_expression("norm_rows_split", functor, ct, str(_SPLIT_NP), _cbool(whole)),
                               rescue=R.name_expression("norm_rows_rescue", functor, ct, _cbool(whole), "false"))
            self._register(dt, ("stream",), R.name_expression("norm_rows_stream", functor, ct))
            if dt in self.pipe:
                self._register(dt, ("pipe", _PIPE_NP, _PIPE_SLOTS),
                               R.name_expression("norm_rows_pipe", functor, ct, str(_PIPE_NP), str(_PIPE_SLOTS)), 80,
                               rescue=R.name_expression("norm_rows_rescue", functor, ct, "true", "true"))

    def _register(self, dt, key, expr, min_arch=0, rescue=None):
        family = f"{FAMILY}:{self.name}:{dt.name}:{'-'.join(map(str, key))}"
        R.register(family, expr, self.name, dt.name, min_arch)
        self.exprs[(dt, key)] = (family, expr)
        if rescue:  # in its kernel's module: built with it
            R.register(family, rescue, self.name, dt.name, min_arch)
            self.exprs[(dt, key, "rescue")] = (family, rescue)

    def plan(self, dt, cols, aligned, dev, whole=False):
        """(kernel key, threads per row, blocks per row) for rows of ``cols``.
        From sweeps on an H200 (bench/NOTES.md): rows up to 4096 packs take
        one group with 4 packs per thread (8 from 1024 packs, except float16
        layer_norm below 2048 packs, unless ``whole``: see launch); longer
        rows a cluster of up to 8 (float16; else 4) 256-thread blocks with 8
        packs each (sm_90); longer ones (or without clusters) blocks of 8 packs per thread that
        merge their statistics through global memory (norm_rows_split), up
        to a quarter of the SMs per row; beyond that, the streaming kernel.
        Before the clusters, rows of whole packs from self.pipe's length on
        take persistent blocks (norm_rows_pipe, sm_80+), up to 32 parts."""
        v = 16 // dt.itemsize
        npack = -(-cols // v) + (0 if aligned else 1)  # a misaligned row's window holds one more pack
        if npack <= _ONE_GROUP_PACKS:
            # 8 packs a thread from 1024 packs; float16 layer_norm keeps 4 below 2048 unless whole
            # (registers; bench/NOTES.md, "Figures from code comments")
            per_thread = 8 if npack >= 1024 and (dt.itemsize >= 4 or whole or not self.narrow) else 4
            tpr = min(max(_rows.pow2_at_least(-(-npack // per_thread)), 32), 512)
            return ("np", _rows.pow2_at_least(-(-npack // tpr))), tpr, 1
        # Rows of whole packs of at least self.pipe[dt] packs: persistent blocks
        # that keep w and b in registers and overlap the exchange between a
        # row's parts with the next row (kernels/norm.cu norm_rows_pipe;
        # cp.async: sm_80+), for the ops and dtypes where they beat clusters and
        # split rows (_PIPE_FROM; bench/NOTES.md, "Figures from code comments").
        least = self.pipe.get(dt)
        if whole and least is not None and npack >= least and R.compute_capability(dev) >= 80:
            parts = -(-npack // (_PIPE_TPB * _PIPE_NP))
            if parts <= min(_PIPE_MOST_PARTS, max(1, R.sm_count(dev) // _SPLIT_LAUNCHES)):
                return ("pipe", _PIPE_NP, _PIPE_SLOTS), _PIPE_TPB, parts
        # A cluster of 8 only for float16: float32 rows that long are faster
        # split (bench/NOTES.md, "Figures from code comments"). There is no
        # cluster of 2 (see _CLUSTERS).
        if R.compute_capability(dev) >= 90:
            for cs in _CLUSTERS:
                if -(-npack // cs) <= _CLUSTER_BLOCK_PACKS and (cs < 8 or dt.itemsize == 2):
                    # 256 threads: kernels/norm.cu kClusterThreads, which the kernel for
                    # rows of whole packs takes as a constant
                    return ("cluster", 8, cs), 256, cs
        # Split rows: faster than a cluster of 8 or the streaming kernel on
        # rows this long (bench/NOTES.md, "Figures from code comments").
        # A split row's blocks wait for one another (kernels/rows.cuh
        # SplitGroup): parts are kept at most SMs / 4, so that four split
        # launches in flight at once (any streams) hold at most all SMs minus
        # four even at one resident block per SM, and never deadlock. (The
        # kernel's indices within a row are 32-bit: far beyond that bound.)
        most_parts = max(1, R.sm_count(dev) // _SPLIT_LAUNCHES)
        for tpr, most in _SPLIT_TPR:
            parts = -(-npack // (tpr * _SPLIT_NP))
            if parts <= min(most or parts, most_parts):
                return ("split", _SPLIT_NP), tpr, parts
        return ("stream",), _STREAM_TPR, 1

    def recipe(self, kind, dev, dt, rows, cols, ldy, ldx, py, px, pw, pb, plan=None):
        """The launch over [rows][cols] of x (row stride ``ldx``) into y
        (``ldy``); ``py``..``pb``: the addresses of y, x, weight and bias (0 for
        a new y, None for no weight or bias), of which only the alignment is
        read. Inputs: x, then weight and bias where given; value 0: eps."""
        isz = dt.itemsize
        has_w, has_b = pw is not None, pb is not None
        pw, pb = pw or 0, pb or 0
        aligned = px % 16 == 0 and (ldx * isz) % 16 == 0
        whole = aligned and (cols * isz) % 16 == 0 and py % 16 == 0 and (ldy * isz) % 16 == 0 \
            and pw % 16 == 0 and pb % 16 == 0
        key, tpr, cs = plan or self.plan(dt, cols, aligned, dev, whole)
        # Rows of whole 16-byte packs, x, y, weight and bias aligned: the
        # kernel built without per-pack bounds and alignment tests (RowView's
        # Whole; fewer registers), except float32/float64 layer_norm at >= 8
        # packs per thread, where ptxas then issues two of the 8 loads late
        # (bench/NOTES.md, "Figures from code comments").
        if whole and key[0] not in ("stream", "pipe") and (not self.narrow or isz == 2 or key[1] < 8):
            key = key + ("whole",)
        fn = R.get_function(*self.exprs[(dt, key)], dev)
        b = D.RecipeBuilder(kind, dev, 1, 1 + has_w + has_b)
        eps = D.val(0)
        args = (D.out_(0), D.in_(0), D.in_(1) if has_w else 0, D.in_(1 + has_w) if has_b else 0,
                rows, cols, ldy, ldx, np.int32(tpr), eps)
        if key[0] in ("pipe", "split"):
            # The workspace of kernels/rows.cuh (PipeGroup, SplitGroup): the
            # stream's buffer, zeroed once, and again after each use by
            # norm_rows_rescue (which first stores the parts of blocks that
            # gave up waiting: none, as a rule); it costs what a memset per call did
            if key[0] == "pipe":
                # groups x parts persistent blocks, as many as run at once;
                # zeroed: all (ticket, flag, counter, tagged words, a word per block)
                smem = _PIPE_SLOTS * _PIPE_NP * _PIPE_TPB * 16
                groups = max(1, min(rows, R.resident_blocks(fn, dev, tpr, smem) // cs))
                zeroed = -(-(16 + rows * cs * _PIPE_PART_BYTES + 4 * groups * cs) // 16) * 16
                work = b.stream_buffer(zeroed)
                b.launch(fn, (groups * cs,), (tpr,),
                         args[:8] + (np.int32(cs), np.int32(groups), eps, work, np.uint32(PATIENCE_NS)), smem)
            else:
                # one block of tpr threads per (row, part): header, counts,
                # marks, the statistics' slots (which need no zeroing, but
                # other kernels on the stream share the buffer)
                groups = 0
                zeroed = 16 + 4 * (-(-rows // 4) * 4) + (-(-(rows * cs) // 16) * 16) + rows * cs * _PART_BYTES
                work = b.stream_buffer(zeroed)
                b.launch(fn, (rows * cs,), (tpr,), args[:8] + (np.int32(cs), eps, work, np.uint32(PATIENCE_NS)))
            rescue = R.get_function(*self.exprs[(dt, key, "rescue")], dev)
            b.launch(rescue, (max(1, min(rows * cs, R.sm_count(dev))),), (_RESCUE_TPB,),
                     args[:8] + (np.int32(cs), np.int32(groups), eps, work, np.int64(zeroed)))
            return b
        block = max(tpr, 128) if cs == 1 else tpr
        b.launch(fn, (-(-rows // (block // tpr)) * cs,), (block,), args)
        return b



# Rows that take norm_rows_pipe, per op and dtype: the fewest 16-byte packs
# (see plan for the measurements). float32 layer_norm: every row longer than
# one group; rms_norm: longer than a cluster of 4 (32768 float32 / 65536
# float16 columns; float32 rows of a cluster of 4 read the same either way);
# softmax: longer than a cluster of 8 (131072 float16 columns) or than 65536
# float32 columns; float16 layer_norm: never. bfloat16 rows as float16 ones
# (the same bytes per element; not swept separately).
_PIPE_FROM = {"layer_norm": {A.F32: _ONE_GROUP_PACKS + 1},
              "rms_norm": {**dict.fromkeys(A.HALVES, 4 * _CLUSTER_BLOCK_PACKS + 1), A.F32: 4 * _CLUSTER_BLOCK_PACKS + 1},
              "softmax": {**dict.fromkeys(A.HALVES, 8 * _CLUSTER_BLOCK_PACKS + 1), A.F32: 65536 // 4 + 1}}
_PIPE_FROM["layer_norm_relu"], _PIPE_FROM["log_softmax"] = _PIPE_FROM["layer_norm"], _PIPE_FROM["softmax"]
_OPS = {name: _RowOp(name, functor, narrow, _PIPE_FROM[name]) for name, functor, narrow in (
    ("layer_norm", "LayerNorm<false>", True), ("layer_norm_relu", "LayerNorm<true>", True),
    ("rms_norm", "RmsNorm", False), ("softmax", "Softmax<false>", False),
    ("log_softmax", "Softmax<true>", False))}


# ------------------------------------------------------------------ backward
# kernels/norm_backward.cu: dx of layer_norm / layer_norm_relu / rms_norm in
# one pass (x and g read once, dx written once) and per-block partial column
# sums for dweight / dbias, for rows of whole 16-byte packs that a block of
# at most 512 threads holds in NP <= 2 packs per thread (8192 16-bit, 4096
# float32, 2048 float64 columns); softmax / log_softmax from their output in
# one pass, NP <= 8 (32768 16-bit columns). Other rows take the generated
# kernels of cufuse/_autograd.py.
_BWD_FAMILY = "norm_backward"
_BWD_THREADS = 512
# kind -> (kernel, its flag template arguments, packs per thread instantiated)
# (The residual-add norms' forward, add_norm_forward, holds rows the same way and lives there too.)
_BWD_KINDS = {"layer": ("norm_backward", ("true", "false"), (1, 2)),
              "layer_relu": ("norm_backward", ("true", "true"), (1, 2)),
              "rms": ("norm_backward", ("false", "false"), (1, 2)),
              "softmax": ("softmax_backward", ("false",), (1, 2, 4, 8)),
              "log_softmax": ("softmax_backward", ("true",), (1, 2, 4, 8)),
              "add_layer": ("add_norm_forward", ("true",), (1, 2)),
              "add_rms": ("add_norm_forward", ("false",), (1, 2))}
_BWD_EXPRS = {(dt, kind, np_): R.register(f"{_BWD_FAMILY}:{dt.name}", R.name_expression(kernel, ct, str(np_), *flags),
                                          f"{kind} forward" if kind.startswith("add") else f"{kind} backward",
                                          dt.name)
              for dt, ct in R.FLOAT_CTYPES.items() for kind, (kernel, flags, nps) in _BWD_KINDS.items()
              for np_ in nps}


# column_sums (the second stage of dw and db) per dtype, and its block (kernels/norm_backward.cu)
_SUM_EXPRS = {dt: R.register(f"{_BWD_FAMILY}:{dt.name}", R.name_expression("column_sums", ct), "norm backward column sums",
                             dt.name) for dt, ct in R.FLOAT_CTYPES.items()}
_SUM_X, _SUM_Y = 32, 16

_BWD_PLANS: dict = {}  # (dtype (torch or NumPy), kind, n, device, add) -> _bwd_plan's tuple, or None


# Rows norm_backward keeps in flight through shared memory on sm_80+ (cp.async; kernels/norm_backward.cu
# takes 0-4; fewer where their slots would not fit the device's shared memory). One: on an H200 two to four
# gave the same times, and their slots keep blocks off the SM where the residual's gradient travels too
# (bfloat16 16384x4096 with it: 140 us at one, 173 at three; bench/NOTES.md).
_BWD_STAGES = 1


def _bwd_shared(kind, dt, np_, threads, add, stages):
    """Dynamic shared bytes of the one-pass kernel ``kind``: norm_backward holds the weight and bias
    column sums (compute type), w and b (packs), and the packs of ``stages`` rows in flight (x, g and,
    with ``add``, the residual's gradient) there (kernels/norm_backward.cu); the others none."""
    if _BWD_KINDS[kind][0] != "norm_backward":
        return 0
    acc = 8 if dt == np.float64 else 4
    return np_ * threads * (2 * (16 // dt.itemsize) * acc + 2 * 16 + stages * (3 if add else 2) * 16)


# The norm backward over 16-bit rows of 64 packs or more: two packs a thread in half the threads, not one
# (with the rows in flight through shared memory; H200, bfloat16 rms_norm 32768x2048 156 -> 118 us, 16384x1024
# 52 -> 41, the residual-add backward 16384x4096 198 -> 140; bench/NOTES.md).
_BWD_TWO_PACKS = ("layer", "layer_relu", "rms")


def _bwd_plan(kind, dtype, n, dev, add=False):
    """(kernel, threads, most blocks, dynamic shared bytes, rows in flight) of the one-pass
    kernel ``kind`` for rows of ``n`` elements of ``dtype`` (a torch or NumPy
    dtype), ``add``: with a second row-wise input (the residual's gradient),
    or None where they are not whole packs or too long for it. Most
    blocks: those the device runs at once (each with its current row and
    ``stages`` more in flight)."""
    key = (dtype, kind, n, dev, add)
    plan = _BWD_PLANS.get(key, False)
    if plan is False:
        dt = dtype if isinstance(dtype, np.dtype) else A.torch_to_numpy_dtype(dtype)
        plan = None
        if dt in R.FLOAT_CTYPES and n % (16 // dt.itemsize) == 0:
            npack = n // (16 // dt.itemsize)
            np_ = next((k for k in _BWD_KINDS[kind][2] if npack <= _BWD_THREADS * k), None)
            if kind in _BWD_TWO_PACKS and dt.itemsize == 2 and 64 <= npack <= 2 * _BWD_THREADS:
                np_ = 2
            if np_ is not None:
                threads = min(_BWD_THREADS, max(32, 1 << (-(-npack // np_) - 1).bit_length()))
                fn = R.get_function(f"{_BWD_FAMILY}:{dt.name}", _BWD_EXPRS[(dt, kind, np_)], dev)
                staged = _BWD_KINDS[kind][0] == "norm_backward" and R.compute_capability(dev) >= 80
                stages = _BWD_STAGES if staged else 0
                while stages and _bwd_shared(kind, dt, np_, threads, add, stages) > R.shared_optin(dev):
                    stages -= 1
                shared = _bwd_shared(kind, dt, np_, threads, add, stages)
                if shared <= R.shared_optin(dev):  # else (GPUs of less shared memory) the generated kernels
                    plan = (fn, threads, R.resident_blocks(fn, dev, threads, shared), shared, stages)
        _BWD_PLANS[key] = plan
    return plan


class _BwdSetup(NamedTuple):
    fn: object      # the one-pass kernel
    shared: int     # its dynamic shared bytes
    stages: int     # rows in flight through shared memory (norm_backward)
    threads: int
    grid: int       # blocks: the rows, at most those the device runs at once
    rows: int
    arrays: tuple   # (x, *rowwise, *per_column), C-contiguous (copies where they were not)


def _bwd_setup(kind, x, rowwise, n, per_column=(), akind=A.TORCH_CUDA):
    """The ``_BwdSetup`` of the one-pass kernel ``kind`` over rows of ``n``
    elements of x (arrays of ``akind``), the ``rowwise`` arrays (None:
    absent) shaped as x and the ``per_column`` ones (weight, bias) of n
    elements; None where kernels/norm_backward.cu does not take them (dtypes
    that differ, a partial pack, rows too long, misaligned data)."""
    dt = A.dtype_of(x, akind)
    if any(a is not None and (A.dtype_of(a, akind) != dt or A.count(tuple(a.shape)) != n) for a in per_column) or \
            any(a is not None and A.dtype_of(a, akind) != dt for a in rowwise):
        return None
    dev = A.device_of(x, akind)
    plan = _bwd_plan(kind, x.dtype, n, dev, any(a is not None for a in rowwise[1:]))
    if plan is None:
        return None
    fn, threads, most, shared, stages = plan
    ts = tuple(None if a is None else D.contiguous(a, akind) for a in (x, *rowwise, *per_column))
    if any(a is not None and A.pointer_of(a, akind) % 16 for a in ts):
        return None
    rows = A.count(tuple(x.shape)) // n if n else 0
    return _BwdSetup(fn, shared, stages, threads, max(1, min(rows, most)), rows, ts)


# Recipes of the backward kernels by call signature (dx and, for the norms,
# the column sums' second stage): a repeated backward is one lookup and the launches.
_BWD_FAST = D.FastPath("norm_backward")


def _bwd_run(key, arrays, eps, build):
    """The results of the backward recipe of ``key`` (the signature of the
    ``arrays`` given and what else selects the kernel) with ``eps``, from
    the fast path, else from ``build()``: (recipe, its inputs, whether
    nothing was copied), None where the kernel does not take the rows."""
    s = D.signature(arrays)
    if s is not None:
        key = (s[0], key)
        res = _BWD_FAST.run(key, s[1], len(s[1]), None, (eps,), arrays[0])
        if res is not None:
            return res
    got = build()
    if got is None:
        return None
    rec, ins, kept = got
    return D.run_general(rec, None, None, [a.data_ptr() for a in ins], (eps,), arrays[0], _BWD_FAST,
                         key if kept and s is not None else None)


def _bwd_inputs(setup, given):
    """(the arrays of ``setup`` that are present, the input slot of each of
    its arrays (0 where absent), whether none is a copy of the ``given`` one)."""
    ins, slots = [], []
    for a in setup.arrays:
        slots.append(0 if a is None else D.in_(len(ins)))
        if a is not None:
            ins.append(a)
    return ins, slots, all(a is o for a, o in zip(setup.arrays, given))


def backward_rows(kind, g, x, n, w, b, eps, gadd=None):
    """(dx, dw or None, db or None) of the norm ``kind`` ("layer",
    "layer_relu", "rms") over the last ``n`` elements of CUDA tensors, plus
    ``gadd`` (x's shape; None: nothing) in dx, from kernels/norm_backward.cu
    on torch's current stream: the one-pass kernel, then column_sums over
    its blocks' partial sums for dw and db; None where the rows do not fit
    it (the caller then takes the generated kernels)."""
    eps = float(eps)

    def build():
        setup = _bwd_setup(kind, x, (g, gadd), n, (w, b))
        if setup is None:
            return None
        wc, bc = setup.arrays[3:]
        ins, (sx, sg, sa, sw, sb), kept = _bwd_inputs(setup, (x, g, gadd, w, b))
        dev, dt = x.get_device(), A.torch_to_numpy_dtype(x.dtype)
        acc = 8 if dt == np.float64 else 4
        bld = D.RecipeBuilder(A.TORCH_CUDA, dev, 1 + (wc is not None) + (bc is not None), len(ins))
        shape = tuple(x.shape)
        outs, spans = [D.output(shape, dt, A.TORCH_CUDA)], [D.view_span(shape, A.c_strides(shape), dt.itemsize)]
        grads = []  # (output slot, partial sums' temporary) of dw and db; (0, 0) where absent
        for a in (wc, bc):
            if a is None:
                grads.append((0, 0))
                continue
            outs.append(D.output(tuple(a.shape), dt, A.TORCH_CUDA))
            spans.append(D.view_span(tuple(a.shape), A.c_strides(tuple(a.shape)), dt.itemsize))
            part = setup.grid * n * acc  # zeroed where no row adds to it
            grads.append((D.out_(len(outs) - 1), bld.temp(part, zeroed=0 if setup.rows else part)))
        (dw, pw), (db, pb) = grads
        if setup.rows:
            bld.launch(setup.fn, (setup.grid,), (setup.threads,),
                       (D.out_(0), pw, pb, sg, sx, sw, sb, sa, np.int64(setup.rows), np.int32(n), D.val(0),
                        np.int32(setup.stages)),
                       setup.shared)
        if n and (wc is not None or bc is not None):
            sums = R.get_function(f"{_BWD_FAMILY}:{dt.name}", _SUM_EXPRS[dt], dev)
            bld.launch(sums, (-(-n // _SUM_X),), (_SUM_X, _SUM_Y), (dw, db, pw, pb, np.int32(setup.grid), np.int32(n)))
        rec = bld.build(outs, spans, [D.view_span(tuple(a.shape), A.c_strides(tuple(a.shape)), dt.itemsize)
                                      for a in ins], like=x)
        return rec, ins, kept

    res = _bwd_run((kind, n), (x, g, gadd, w, b), eps, build)
    if res is None:
        return None
    it = iter(res[1:])
    return res[0], (next(it) if w is not None else None), (next(it) if b is not None else None)


def softmax_backward_rows(g, y, log):
    """dx of softmax (``log`` False) or log_softmax over the last axis of
    CUDA tensors from the output ``y``, by kernels/norm_backward.cu; None where
    the rows do not fit it."""
    if y.dim() == 0:
        return None
    kind = "log_softmax" if log else "softmax"

    def build():
        n = y.shape[-1]
        setup = _bwd_setup(kind, y, (g,), n)
        if setup is None:
            return None
        ins, (sy, sg), kept = _bwd_inputs(setup, (y, g))
        dev, dt, shape = y.get_device(), A.torch_to_numpy_dtype(y.dtype), tuple(y.shape)
        bld = D.RecipeBuilder(A.TORCH_CUDA, dev, 1, 2)
        if setup.rows:
            bld.launch(setup.fn, (setup.grid,), (setup.threads,),
                       (D.out_(0), sg, sy, np.int64(setup.rows), np.int32(n)), setup.shared)
        span = D.view_span(shape, A.c_strides(shape), dt.itemsize)
        return bld.build([D.output(shape, dt, A.TORCH_CUDA)], [span], [span, span], like=y), ins, kept

    res = _bwd_run(kind, (y, g), 0.0, build)
    return None if res is None else res[0]


# --------------------------------------------------------------- validation
def _normalized_shape(name, x, normalized_shape):
    ns = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else normalized_shape
    if isinstance(ns, (bool, np.bool_)) or not isinstance(ns, (tuple, list)) or \
            not all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) for n in ns):
        raise TypeError(f"cufuse.{name}: normalized_shape must be an int or a tuple of ints, got {normalized_shape!r}")
    ns = tuple(int(n) for n in ns)
    shape = tuple(x.shape)
    if not ns or len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
        raise ValueError(f"cufuse.{name}: normalized_shape {ns} must be the trailing dims of x, whose shape is {shape}")
    return ns


def _eps(name, eps):
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (Real, np.integer, np.floating)):
        raise TypeError(f"cufuse.{name}: eps must be a real number, got {type(eps).__name__}")
    try:
        e = float(eps)
    except OverflowError:  # an int beyond any float
        e = math.inf
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"cufuse.{name}: eps must be finite and >= 0, got {eps!r}")
    return e


def _affine(name, what, a, ns, kind, dt, dev):
    if a is None:
        return None
    k = A.array_kind(name, a, f"{what} (when given)")
    if k != kind:
        raise TypeError(f"cufuse.{name}: {what} is {A.describe(a, k)} but x is a {kind}; pass the same array kind")
    if A.dtype_of(a, k) != dt:
        raise TypeError(f"cufuse.{name}: {what} has dtype {A.dtype_of(a, k)}; it must have x's dtype ({dt})")
    if tuple(a.shape) != ns:
        raise ValueError(f"cufuse.{name}: {what} has shape {tuple(a.shape)}; normalized_shape is {ns}")
    if kind in A.GPU_KINDS and A.device_of(a, k) != dev:
        raise ValueError(f"cufuse.{name}: {what} is on GPU {A.device_of(a, k)} but x is on GPU {dev}")
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        A.check_grad(a, name)
    return a


# ---------------------------------------------------------- NumPy fallbacks
def _np_layer_norm(x, ns, w, b, eps, relu):
    axes = tuple(range(x.ndim - len(ns), x.ndim))
    # Shifted by each row's first element: a constant row gives exactly 0 (its
    # mean rounded in float32 is not its value, and / sqrt(eps) magnified the
    # difference to 2e-5, found by the fuzz suite), and large offsets do not cancel.
    # (In place on the one new array: fresh temporaries cost page faults, not arithmetic.)
    first = x[(Ellipsis,) + (slice(0, 1),) * len(ns)]
    d = x - first
    d -= d.mean(axis=axes, keepdims=True)
    var = np.square(d).mean(axis=axes, keepdims=True)
    d /= np.sqrt(var + x.dtype.type(eps))
    if w is not None:
        d *= w
    if b is not None:
        d += b
    if relu:
        np.copyto(d, x.dtype.type(0), where=d < 0)  # (NaN and -0.0 stay, as the kernels give)
    return d


def _np_rms_norm(x, ns, w, eps):
    axes = tuple(range(x.ndim - len(ns), x.ndim))
    y = x / np.sqrt(np.square(x).mean(axis=axes, keepdims=True) + x.dtype.type(eps))
    if w is not None:
        y *= w
    return y


def _np_softmax(x, log):
    d = x - x.max(axis=-1, keepdims=True)
    if log:
        d -= np.log(np.exp(d).sum(axis=-1, keepdims=True))
        return d
    np.exp(d, out=d)
    d /= d.sum(axis=-1, keepdims=True)
    return d


# --------------------------------------------------------------- the calls
def _fast(op, x, w, b, eps, out, shape_key):
    """The fast path of a row op: the recipe of this call's signature (x,
    weight, bias, out, and ``shape_key``: the normalized shape or the axis),
    launched with this call's eps; None when there is none (or eps is not a
    finite float >= 0, which the general path checks)."""
    s = D.signature((x, w, b, out))
    if s is None or type(eps) is not float or not 0.0 <= eps < _INF:
        return None, None
    key, ptrs = (s[0], shape_key), s[1]
    res = op.fast.run(key, ptrs, len(ptrs) - (out is not None), None if out is None else (out,), (eps,), x)
    return (None if res is None else res[0]), key


_INF = float("inf")


def _run(op, x, kind, dt, dev, lead, w, b, eps, out, np_impl, key):
    """Validate ``out``, then launch ``op`` over x viewed as [rows][cols]
    (rows: the first ``lead`` dims), keeping the recipe under ``key``, or run
    ``np_impl`` on NumPy values."""
    shape = tuple(x.shape)
    if out is not None:
        A.check_out(op.name, out, kind, dt, shape, dev)
    if 0 in shape:
        return out if out is not None else D.empty_like(x, kind)
    if kind not in A.GPU_KINDS:
        cdt = A.compute_dtype(dt)
        # (no copies where the dtype is already the compute dtype: the NumPy paths never write their inputs)
        vals = [None if a is None else _rows.to_numpy(a, kind).astype(cdt, copy=False) for a in (x, w, b)]
        with np.errstate(all="ignore"):
            res = np.asarray(np_impl(*vals), dtype=cdt).astype(dt, copy=False)
        return _rows.from_numpy(res, kind, out)
    rows = A.count(shape[:lead])
    cols = A.count(shape[lead:])
    keep = key is not None
    with R._cp.cuda.Device(dev):
        ldx = _rows.row_stride(x, kind, lead)
        if ldx is None:
            x, ldx, keep = D.contiguous(x, kind), cols, False
        ws = []
        for a in (w, b):
            if a is not None and not A.is_c_contiguous(tuple(a.shape), A.strides_of(a, kind)):
                a, keep = D.contiguous(a, kind), False
            ws.append(a)
        w, b = ws
        ins = [a for a in (x, w, b) if a is not None]
        target, ldy = out, cols
        if out is not None:
            ldy = _rows.row_stride(out, kind, lead)
            # out may be x itself (same rows), else it must share no byte with x, weight or bias
            if ldy is None or any(D.overlaps(out, a, kind) for a in (w, b) if a is not None) or (
                    D.overlaps(out, x, kind) and not (A.pointer_of(out, kind) == A.pointer_of(x, kind)
                                                       and ldy == ldx)):
                target, ldy, keep = None, cols, False
        ptrs = [A.pointer_of(a, kind) for a in ins]
        bld = op.recipe(kind, dev, dt, rows, cols, ldy, ldx, 0 if target is None else A.pointer_of(target, kind),
                        ptrs[0], ptrs[1] if w is not None else None, ptrs[-1] if b is not None else None)
        isz = dt.itemsize
        rec = bld.build([D.output(shape, dt, kind)],
                        [D.view_span(shape, A.strides_of(target, kind), isz) if target is not None else (0, 0)],
                        [D.view_span(tuple(a.shape), A.strides_of(a, kind), isz) for a in ins],
                        [(0,)] if target is not None and ldy == ldx else [()], like=x)
        return D.run_general(rec, None if target is None else [target], None if out is None else [out], ptrs,
                             (eps,), x, op.fast, key if keep else None)[0]


def _shape_key(ns):
    """normalized_shape as a fast-path key: an int or a tuple of ints (None: the general path)."""
    if type(ns) is int or (type(ns) is tuple and all(type(n) is int for n in ns)):
        return ns
    return None


def _recorded_norm(name, x, normalized_shape, weight, bias, eps, out):
    ns, e = list(_normalized_shape(name, x, normalized_shape)), _eps(name, eps)  # (checked as the other paths do)
    if name == "rms_norm":
        return _recorded(name, out, "rms_norm", x, ns, weight, e)
    return _recorded(name, out, "layer_norm", x, ns, weight, bias, e, name == "layer_norm_relu")


def _recorded(name, out, op, *args):
    """The call through torch.ops.cufuse (autograd, torch.compile); out= cannot be recorded."""
    AG.no_out(name, out)
    return TO.call_row(op, *args)


def layer_norm(x: Array, normalized_shape: int | tuple[int, ...], weight: Array | None = None,
               bias: Array | None = None, eps: float = 1e-5, *, out: Array | None = None) -> Array:
    """Layer normalization over the trailing ``normalized_shape`` dims, with
    PyTorch's semantics: (x - mean) / sqrt(var + eps) * weight + bias, the
    biased variance, ``weight``/``bias`` optional (shape ``normalized_shape``,
    x's kind and dtype). The mean and variance come from the row held in
    registers, in two passes (never E[x^2] - E[x]^2). Returns x's shape,
    dtype and kind; ``out=`` receives it."""
    return _norm("layer_norm", x, normalized_shape, weight, bias, eps, out)


def layer_norm_relu(x: Array, normalized_shape: int | tuple[int, ...], weight: Array | None = None,
                    bias: Array | None = None, eps: float = 1e-5, *, out: Array | None = None) -> Array:
    """relu(layer_norm(x, ...)), fused: one read of x, one write. Arguments as in ``layer_norm``."""
    return _norm("layer_norm_relu", x, normalized_shape, weight, bias, eps, out)


# The NumPy path of each norm, given the normalized shape and eps (made once, not per call)
_NUMPY_OF = {
    "layer_norm": lambda ns, e: lambda xv, wv, bv: _np_layer_norm(xv, ns, wv, bv, e, False),
    "layer_norm_relu": lambda ns, e: lambda xv, wv, bv: _np_layer_norm(xv, ns, wv, bv, e, True),
    "rms_norm": lambda ns, e: lambda xv, wv, bv: _np_rms_norm(xv, ns, wv, e),
}


def rms_norm(x: Array, normalized_shape: int | tuple[int, ...], weight: Array | None = None, eps: float = 1e-6,
             *, out: Array | None = None) -> Array:
    """RMS normalization over the trailing ``normalized_shape`` dims, with
    PyTorch's semantics: x / sqrt(mean(x^2) + eps) * weight (``weight``
    optional). Returns x's shape, dtype and kind; ``out=`` receives it."""
    return _norm("rms_norm", x, normalized_shape, weight, None, eps, out)


# ------------------------------------------------------ residual add + norm
_ADD = Fused(lambda a, b: a + b, name="residual_add")  # h where the one-pass kernel does not take the rows
# op -> (the norm, its one-pass forward kernel, its backward kind)
_ADD_NORMS = {"add_rms_norm": ("rms_norm", "add_rms", "rms"), "add_layer_norm": ("layer_norm", "add_layer", "layer")}


def add_rms_norm(x: Array, residual: Array, normalized_shape: int | tuple[int, ...], weight: Array | None = None,
                 eps: float = 1e-6) -> tuple[Array, Array]:
    """``(rms_norm(h, normalized_shape, weight, eps), h)`` with ``h = x +
    residual`` rounded to x's dtype (as the framework's add): a transformer
    block's residual connection and the next norm in one pass on the GPU
    (x and residual read once, h and the output written once). ``h`` is the
    next block's residual. Differentiable for torch tensors (the backward:
    one pass, dh = the norm's dx + the gradient of h, given to x and
    residual)."""
    return _add_norm("add_rms_norm", x, residual, normalized_shape, weight, None, eps)


def add_layer_norm(x: Array, residual: Array, normalized_shape: int | tuple[int, ...], weight: Array | None = None,
                   bias: Array | None = None, eps: float = 1e-5) -> tuple[Array, Array]:
    """``(layer_norm(h, normalized_shape, weight, bias, eps), h)`` with ``h =
    x + residual``; as ``add_rms_norm``."""
    return _add_norm("add_layer_norm", x, residual, normalized_shape, weight, bias, eps)


def _add_norm(name, x, residual, normalized_shape, weight, bias, eps):
    if TO.compiling():  # the add traced by torch (inductor fuses it), the norm its registered operator
        import torch
        if not isinstance(x, torch.Tensor) or not isinstance(residual, torch.Tensor):
            raise TypeError(f"cufuse.{name}: under torch.compile, x and residual must be torch tensors")
        if residual.dtype != x.dtype or residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"cufuse.{name}: residual ({residual.dtype}, {tuple(residual.shape)}, {residual.device}) "
                             f"must have x's dtype, shape and device ({x.dtype}, {tuple(x.shape)}, {x.device})")
        h = x + residual
        return _recorded_norm(_ADD_NORMS[name][0], h, normalized_shape, weight, bias, eps, None), h
    res, key = _add_norm_fast(name, x, residual, normalized_shape, weight, bias, eps)
    if res is not None:
        return res
    if DK.is_dask(x) or DK.is_dask(residual):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported")
    kind = A.array_kind(name, x, "x")
    if kind in (A.TORCH_CPU, A.TORCH_CUDA) and AG.wants_grad((x, residual, weight, bias)):
        ns = _normalized_shape(name, x, normalized_shape)
        return AG.apply(name, _add_norm_function, x, residual, weight, bias, name, ns, _eps(name, eps))
    return _add_norm_values(name, x, residual, normalized_shape, weight, bias, eps, key)


_ADD_FAST = D.FastPath("add_norm")


def _add_norm_fast(name, x, residual, normalized_shape, weight, bias, eps):
    """((y, h) from the fast path, or None; the key of the call's signature,
    under which _add_norm_values keeps its launch, or None where the call has
    none: a tensor that requires grad in grad mode, an eps or shape the path does not take)."""
    sk = _shape_key(normalized_shape)
    if sk is None or type(eps) is not float or not 0.0 <= eps < _INF:
        return None, None
    s = D.signature((x, residual, weight, bias))
    if s is None:
        return None, None
    key = (name, s[0], sk)
    res = _ADD_FAST.run(key, s[1], len(s[1]), None, (eps,))
    return (None if res is None else (res[0], res[1])), key


def _add_norm_values(name, x, residual, normalized_shape, weight, bias, eps, key=None):
    """(y, h) of a residual-add norm, no autograd: checked, then the one-pass
    kernel where the rows fit it (its launch kept as the recipe of ``key``
    where it needed no copies), else h by a fused add and the norm's own path."""
    norm, fwd_kind, _ = _ADD_NORMS[name]
    kind, dt, dev = _rows.data_arg(name, x)
    rk = A.array_kind(name, residual, "residual")
    if rk != kind:
        raise TypeError(f"cufuse.{name}: residual is {A.describe(residual, rk)} but x is a {kind}; pass the same "
                        "array kind")
    if A.dtype_of(residual, rk) != dt:
        raise TypeError(f"cufuse.{name}: residual has dtype {A.dtype_of(residual, rk)}; it must have x's dtype ({dt})")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"cufuse.{name}: residual has shape {tuple(residual.shape)} and x {tuple(x.shape)}; they "
                         "must be equal")
    if kind in A.GPU_KINDS and A.device_of(residual, rk) != dev:
        raise ValueError(f"cufuse.{name}: residual is on GPU {A.device_of(residual, rk)} but x is on GPU {dev}")
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        A.check_grad(residual, name)
    ns = _normalized_shape(name, x, normalized_shape)
    w = _affine(name, "weight", weight, ns, kind, dt, dev)
    b = _affine(name, "bias", bias, ns, kind, dt, dev)
    e = _eps(name, eps)
    n = A.count(ns)
    if kind in A.GPU_KINDS:
        with D.on_device(kind, dev):
            res = _add_norm_kernel(fwd_kind, kind, dt, dev, x, residual, n, w, b, e, key)
        if res is not None:
            return res
    h = D.empty_padded(tuple(x.shape), dt, kind, dev) if kind in A.GPU_KINDS else None
    h = _ADD(x, residual, out=h)
    return _norm(norm, h, ns, w, b, e, None), h


def _add_norm_kernel(fwd_kind, kind, dt, dev, x, residual, n, w, b, e, key):
    """(y, h) from the one-pass kernel (its launch a recipe kept under ``key``
    where nothing was copied), or None where the rows do not fit it."""
    setup = _bwd_setup(fwd_kind, x, (residual,), n, (w, b), kind)
    if setup is None:
        return None
    ins, (sx, sr, sw, sb), kept = _bwd_inputs(setup, (x, residual, w, b))
    bld = D.RecipeBuilder(kind, dev, 2, len(ins))
    if setup.rows:
        bld.launch(setup.fn, (setup.grid,), (setup.threads,),
                   (D.out_(0), D.out_(1), sx, sr, sw, sb, np.int64(setup.rows), np.int32(n), D.val(0)))
    shape, isz = tuple(x.shape), dt.itemsize
    span = D.view_span(shape, A.c_strides(shape), isz)
    rec = bld.build([D.output(shape, dt, kind)] * 2, [span, span],
                    [D.view_span(tuple(a.shape), A.strides_of(a, kind), isz) for a in ins])
    y, h = D.run_general(rec, None, None, [A.pointer_of(a, kind) for a in ins], (e,), None, _ADD_FAST,
                         key if kept else None)
    return y, h


def _add_norm_function(torch):
    class AddNormFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, w, b, name, ns, eps):
            # grad mode is off here: the fast path and the recipe kept by signature as in a no-grad call
            res, key = _add_norm_fast(name, x, residual, ns, w, b, eps)
            y, h = res if res is not None else _add_norm_values(name, x, residual, ns, w, b, eps, key)
            ctx.kind, ctx.n, ctx.eps = _ADD_NORMS[name][2], A.count(ns), eps
            ctx.save_for_backward(h, w, b)
            return y, h

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, gy, gh):
            h, w, b = ctx.saved_tensors
            dh, dw, db = AG.norm_backward(ctx.kind, gy, h, ctx.n, w, b, ctx.eps, gadd=gh)
            return dh, dh, dw, db, None, None, None

    return AddNormFn


def _norm(name, x, normalized_shape, weight, bias, eps, out):
    """The norms' one entry: the fast path, Dask arrays, then validation and
    the launch (or the NumPy path, _NUMPY_OF)."""
    if TO.compiling():  # torch.compile: the registered operator
        return _recorded_norm(name, x, normalized_shape, weight, bias, eps, out)
    op = _OPS[name]
    sk = _shape_key(normalized_shape)
    key = None
    if sk is not None:
        res, key = _fast(op, x, weight, bias, eps, out, sk)
        if res is not None:
            return res
    if A.is_torch_tensor(x) and AG.wants_grad((x, weight, bias)):  # recorded (no fast-path signature)
        return _recorded_norm(name, x, normalized_shape, weight, bias, eps, out)
    if DK.is_dask(x):
        w, b = (DK._concrete(name, what, v) for what, v in (("weight", weight), ("bias", bias)))
        # checked before the graph is built (each chunk checks again, and its errors name the chunk)
        ns = _normalized_shape(name, x, normalized_shape)
        _eps(name, eps)
        return DK.rows(name, lambda blk: _norm(name, blk, normalized_shape, w, b, eps, None), x,
                       range(-len(ns), 0), x.dtype, out)
    kind, dt, dev = _rows.data_arg(name, x)
    ns = _normalized_shape(name, x, normalized_shape)
    w = _affine(name, "weight", weight, ns, kind, dt, dev)
    b = _affine(name, "bias", bias, ns, kind, dt, dev)
    e = _eps(name, eps)
    return _run(op, x, kind, dt, dev, len(x.shape) - len(ns), w, b, e, out, _NUMPY_OF[name](ns, e), key)


def softmax(x: Array, axis: int = -1, *, out: Array | None = None) -> Array:
    """exp(x - max) / sum(exp(x - max)) along ``axis``: stable for any
    magnitude; a row of all -inf gives NaN, as in PyTorch. Returns x's shape,
    dtype and kind; ``out=`` receives it."""
    return _softmax("softmax", x, axis, out)


def log_softmax(x: Array, axis: int = -1, *, out: Array | None = None) -> Array:
    """(x - max) - log(sum(exp(x - max))) along ``axis``; as ``softmax``."""
    return _softmax("log_softmax", x, axis, out)


def _softmax_axis(name, axis, ndim):
    """``axis`` checked (an int in range; a 0-d x is a row of length 1)."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"cufuse.{name}: axis must be an int, got {type(axis).__name__}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"cufuse.{name}: axis {axis} is out of range for x with {ndim} dimensions")
    return int(axis)


def _softmax(name, x, axis, out):
    if TO.compiling():
        return _recorded(name, out, "softmax", x, _softmax_axis(name, axis, x.dim()), name == "log_softmax")
    op = _OPS[name]
    key = None
    if type(axis) is int:
        res, key = _fast(op, x, None, None, 0.0, out, axis)
        if res is not None:
            return res
    if AG.wants_grad((x,)):  # recorded (no fast-path signature: _driver.signature)
        return _recorded(name, out, "softmax", x, _softmax_axis(name, axis, x.dim()), name == "log_softmax")
    if DK.is_dask(x):
        _softmax_axis(name, axis, x.ndim)  # (the chunks' errors would name a chunk's shape)
        return DK.rows(name, lambda blk: _softmax(name, blk, axis, None), x, [axis] if x.ndim else [], x.dtype, out)
    kind, dt, dev = _rows.data_arg(name, x)
    ndim = len(x.shape)
    _softmax_axis(name, axis, ndim)
    log = name == "log_softmax"
    if ndim == 0:  # one element: a row of length 1
        if out is not None:
            A.check_out(name, out, kind, dt, (), dev)
        res = _softmax(name, x.reshape(1), 0, None)
        res = res.reshape(())
        if out is None:
            return res
        D.copy_into(out, res, kind)
        return out
    axis = int(axis) % ndim
    if axis == ndim - 1:
        return _run(op, x, kind, dt, dev, ndim - 1, None, None, 0.0, out, lambda xv, wv, bv: _np_softmax(xv, log),
                    key)
    # Another axis: move it last, compute (contiguous rows), move it back.
    if out is not None:
        A.check_out(name, out, kind, dt, tuple(x.shape), dev)
    res = _run(op, D.moveaxis(x, kind, axis, -1), kind, dt, dev, ndim - 1, None, None, 0.0, None,
               lambda xv, wv, bv: _np_softmax(xv, log), None)
    back = D.moveaxis(res, kind, -1, axis)
    if out is None:
        return D.contiguous(back, kind)
    D.copy_into(out, back, kind)
    return out
