"""Image pipelines in one kernel: read -> crop -> resize / letterbox -> flip ->
color -> normalize -> cast -> write (kernels/image.cuh).

A ``Pipeline`` is composed in Python; its STRUCTURE (source and output
dtypes, the channels read and the color conversion, the interpolation, the
YUV format) is one generated kernel, compiled once and cached in memory and
on disk (``_runtime.generated_module``). Its VALUES (crop rectangles, source
images, sizes, boxes, flips, mean, std, scale, fill) are kernel arguments: a
new rectangle never recompiles. Backwards fusion: each output pixel finds the
source pixels it needs through the resize and the crop, so nothing
intermediate is stored; N crops (of one image or of several, of different
sizes) are one [N, C, H, W] (or [N, H, W, C]) output written by one launch.

On NumPy arrays and torch CPU tensors the same calls run a NumPy
implementation (float64 math, then the same cast).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from . import _arrays as A
from . import _driver as D
from . import _runtime as R
from ._arrays import Array

__all__ = ["Pipeline", "process", "Planes", "Compose", "Resize", "Letterbox", "CenterCrop", "Normalize", "ToDtype",
           "ConvertColor", "HorizontalFlip", "VerticalFlip", "LAYOUTS", "INTERPOLATIONS", "COLORS"]

_NAME = "image"
U8, U16 = np.dtype(np.uint8), np.dtype(np.uint16)
IN_DTYPES = (U8, U16, A.F16, A.F32) + (() if A.BF16 is None else (A.BF16,))
OUT_DTYPES = (U8, A.F16, A.F32) + (() if A.BF16 is None else (A.BF16,))
_CTYPES: dict[np.dtype, str] = {U8: "unsigned char", U16: "unsigned short", A.F16: "__half", A.F32: "float"}
_RANGE: dict[np.dtype, float] = {U8: 255.0, U16: 65535.0, A.F16: 1.0, A.F32: 1.0}
if A.BF16 is not None:
    _CTYPES[A.BF16], _RANGE[A.BF16] = "__nv_bfloat16", 1.0

# Source layouts: the letters name the axes (N: image of a batch, H: rows, W: columns, C: channels).
LAYOUTS = ("HWC", "CHW", "HW", "NHWC", "NCHW", "NHW")
OUT_LAYOUTS = ("NCHW", "NHWC")
# 0: nearest as OpenCV INTER_NEAREST and torch "nearest" (source index floor(d * in / out));
# 1: nearest-exact (torch "nearest-exact": floor((d + 0.5) * in / out)); 2: bilinear with half-pixel
# centers (OpenCV INTER_LINEAR, torch / torchvision antialias=False).
INTERPOLATIONS = {"nearest": 0, "nearest_exact": 1, "bilinear": 2}
_GRAY_RGB = (0.299, 0.587, 0.114)  # BT.601 luma, as OpenCV's RGB2GRAY
# Named color conversions: (source channels read, output): a tuple of read channel positions per output
# channel, or "gray" (weights over the three read channels).
COLORS: dict[str, tuple] = {
    "rgb2bgr": ((2, 1, 0), None), "bgr2rgb": ((2, 1, 0), None),
    "rgba2rgb": ((0, 1, 2), None), "bgra2bgr": ((0, 1, 2), None),
    "rgba2bgr": ((2, 1, 0), None), "bgra2rgb": ((2, 1, 0), None),
    "rgb2gray": ((0, 1, 2), "gray"), "bgr2gray": ((2, 1, 0), "gray"),
}
# YUV formats (a planar 4:2:0 video frame) and their matrices: R = Y + Rv V, G = Y + Gu U + Gv V, B = Y + Bu U.
YUV_FORMATS = ("nv12", "i420")
_YUV_MATRIX = {
    "bt601": (1.402, -0.344136286, -0.714136286, 1.772),
    "bt709": (1.5748, -0.187324273, -0.468124273, 1.8556),
}
_YUV_OUT = {"rgb": (0, 1, 2), "bgr": (2, 1, 0), "gray": "gray"}
_MAX_ITEMS_PER_LAUNCH = 65535  # gridDim.z
_TILE_W, _TILE_H, _BLOCK = 32, 32, (32, 8)  # kernels/image.cuh: a block of 32 x 8 threads writes 32 x 32 pixels
_ITEM, _IMAGE = 12, 10         # kernels/image.cuh kItem, kImage

# Twin of cufuse::image::Params (kernels/image.cuh), passed by value.
_PARAMS = np.dtype({"names": ["out_stride", "out_plane", "gain", "bias", "fill", "out_h", "out_w",
                              "items", "yuv", "y_offset", "y_gain", "c_offset", "c_gain", "range", "pad_"],
                    "formats": [(np.int64, (3,)), (np.int64, (4,)), (np.float32, (4,)), (np.float32, (4,)),
                                (np.float32, (4,)), np.int32, np.int32, np.int32, (np.float32, (4,)),
                                np.float32, np.float32, np.float32, np.float32, np.float32, np.int32]}, align=True)
_NARROW = 2**31  # row strides in bytes below this: the kernel's Index is int (kernels/image.cuh)


def _err(msg: str) -> str:
    return f"cufuse.image: {msg}"


# ------------------------------------------------------------------ arguments
def _in_dtype(x, kind):
    dt = A.dtype_of(x, kind)
    if kind in (A.TORCH_CPU, A.TORCH_CUDA) and not isinstance(dt, np.dtype):
        t = A.torch()
        dt = U16 if dt == t.uint16 else dt
    if dt not in IN_DTYPES:
        raise TypeError(_err(f"source images must be {A.dtype_names(IN_DTYPES)}; got {A.describe(x, kind)}"))
    return np.dtype(dt)


def _out_dtype(dtype) -> np.dtype:
    t = A.torch()
    d = None
    if t is not None and isinstance(dtype, t.dtype):
        d = A.torch_to_numpy_dtype(dtype)
    else:
        try:
            d = np.dtype(dtype)
        except TypeError:
            d = None
    if d is None or d not in OUT_DTYPES:
        hint = f" ({A.NO_BF16})" if A.BF16 is None and "bfloat16" in str(dtype) else ""
        raise TypeError(_err(f"the output dtype must be one of {A.dtype_names(OUT_DTYPES)}, got {dtype!r}{hint}"))
    return d


def _int(what, v, lo=None):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(_err(f"{what} must be an int, got {v!r}"))
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(_err(f"{what} must be >= {lo}, got {v}"))
    return v


def _bool(what, v):
    """v, which must be a bool (a string such as "False" would be true)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(_err(f"{what} must be a bool, got {v!r}"))
    return bool(v)


def _size(size):
    """(H, W) from an int (square) or a pair."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, (bool, np.bool_)):
        size = (size, size)
    if not isinstance(size, (tuple, list)) or len(size) != 2:
        raise TypeError(_err(f"size must be (height, width) or an int, got {size!r}"))
    return _int("the output height", size[0], 1), _int("the output width", size[1], 1)


@dataclass
class _Image:
    """One source image: the array it lives in, its extent and element strides, the byte offset of
    its first pixel from that array's data pointer; planes (YUV): (offset, row stride, column
    stride) of U and V, in bytes / elements, from the same pointer."""
    array: Any
    h: int
    w: int
    c: int
    sy: int
    sx: int
    sc: int
    offset: int
    planes: tuple = ()
    index: int | None = None  # its position in a batch array
    parts: tuple = ()         # a frame given as Planes: its (Y, U, V) arrays (U and V may be views of one)


class Planes:
    """A 4:2:0 video frame given as separate planes, for a yuv read: ``Planes(y, uv)`` for NV12 (y
    [H, W]; uv [H / 2, W] interleaved, or [H / 2, W / 2, 2]) or ``Planes(y, u, v)`` for I420 (u and v
    [H / 2, W / 2]); any strides, any distance between the planes (a decoder's padded surface). A list
    of them is a batch of frames."""

    def __init__(self, *planes: Array):
        if len(planes) not in (2, 3):
            raise TypeError(_err(f"Planes takes (y, uv) for nv12 or (y, u, v) for i420, got {len(planes)} arrays"))
        self.planes = planes

    def __repr__(self) -> str:
        return "Planes(" + ", ".join(str(tuple(p.shape)) for p in self.planes) + ")"


def _as_images(images: Any, layout: str | None, yuv: str | None) -> tuple[str, np.dtype, Any, list[_Image]]:
    """(kind, dtype, device, [_Image]) of a source array or a list of them."""
    if isinstance(images, (list, tuple)):
        if not images:
            raise ValueError(_err("got an empty list of source images"))
        arrays = list(images)  # (batches in it count as their images, as without layout=)
    else:
        arrays = [images]
    if any(isinstance(x, Planes) for x in arrays):
        if yuv is None:
            raise TypeError(_err("Planes are read by a yuv read: Pipeline().read(yuv='nv12' or 'i420')"))
        frames = arrays
        arrays = [p for f in frames for p in (f.planes if isinstance(f, Planes) else (f,))]
    else:
        frames = None
    kinds = [A.array_kind(_NAME, x, "each source image" if len(arrays) > 1 else "the source image") for x in arrays]
    kind, first = kinds[0], arrays[0]
    dt = _in_dtype(first, kind)
    dev = A.device_of(first, kind)
    for i, (x, k) in enumerate(zip(arrays[1:], kinds[1:]), 1):
        if k != kind:
            raise TypeError(_err(f"mixed array kinds: source image 0 is {A.describe(first, kind)}, source "
                                 f"image {i} is {A.describe(x, k)}"))
        if _in_dtype(x, k) != dt:
            raise TypeError(_err(f"mixed dtypes: source image 0 is {A.describe(first, kind)}, source image {i} "
                                 f"is {A.describe(x, k)}; every source image must have one dtype"))
        if A.device_of(x, k) != dev:
            raise ValueError(_err(f"source images on different GPUs: image 0 on GPU {dev}, image {i} on GPU "
                                  f"{A.device_of(x, k)}"))
        if kind in (A.TORCH_CPU, A.TORCH_CUDA):
            A.check_grad(x, _NAME)
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        A.check_grad(first, _NAME)
    item = dt.itemsize
    out: list[_Image] = []
    if frames is not None:
        return kind, dt, dev, [_planes_image(f, kind, yuv, item) if isinstance(f, Planes) else
                               _yuv_image(f, tuple(f.shape), A.strides_of(f, kind), yuv, item) for f in frames]
    for x in arrays:
        shape, st = tuple(x.shape), A.strides_of(x, kind)
        if yuv is not None:
            out.append(_yuv_image(x, shape, st, yuv, item))
            continue
        lay = layout or {2: "HW", 3: "HWC", 4: "NHWC"}.get(len(shape))
        if lay not in LAYOUTS:
            raise ValueError(_err(f"layout must be one of {LAYOUTS}, got {layout!r}" if layout is not None else
                                  f"a source image of shape {shape} has no default layout; pass layout= "
                                  f"(one of {LAYOUTS})"))
        if len(shape) != len(lay):
            raise ValueError(_err(f"layout {lay!r} needs a {len(lay)}-D array; got {A.describe(x, kind)}"))
        ax = {a: i for i, a in enumerate(lay)}
        h, w = shape[ax["H"]], shape[ax["W"]]
        c = shape[ax["C"]] if "C" in ax else 1
        sy, sx = st[ax["H"]], st[ax["W"]]
        sc = st[ax["C"]] if "C" in ax else 0
        if h == 0 or w == 0 or c == 0:
            raise ValueError(_err(f"empty source image: {A.describe(x, kind)} (layout {lay})"))
        if "N" in ax:
            if shape[0] == 0:
                raise ValueError(_err(f"the batch of source images is empty: {A.describe(x, kind)}"))
            out += [_Image(x, h, w, c, sy, sx, sc, i * st[0] * item, (), i) for i in range(shape[0])]
        else:
            out.append(_Image(x, h, w, c, sy, sx, sc, 0))
    cs = {im.c for im in out}
    if len(cs) > 1:
        raise ValueError(_err(f"the source images have different channel counts {sorted(cs)}; they must agree"))
    return kind, dt, dev, out


def _yuv_image(x, shape, st, yuv, item):
    """A 4:2:0 frame: one 2-D array of (H * 3 / 2) rows of W (NV12: the Y plane, then interleaved UV
    rows, any row pitch; I420: the Y plane, then the U and V planes, packed contiguously)."""
    if len(shape) != 2:
        raise ValueError(_err(f"a {yuv} frame is a 2-D array of (height * 3 / 2, width); got shape {shape}"))
    rows, w = shape
    if rows == 0 or w == 0:
        raise ValueError(_err(f"empty {yuv} frame: shape {shape}"))
    if rows % 3 or (rows // 3 * 2) % 2 or w % 2:
        raise ValueError(_err(f"a {yuv} frame of shape {shape}: the frame's height and width must be even and "
                              "the array's height 3 / 2 of the frame's"))
    h = rows // 3 * 2
    sy, sx = st
    if yuv == "nv12":
        uv = h * sy * item
        planes = (uv, sy, 2 * sx, uv + sx * item, sy, 2 * sx)
    else:
        if sx != 1 or sy != w:
            raise ValueError(_err(f"an i420 frame given as one array must be contiguous (its U and V planes "
                                  f"are packed); got strides {st}"))
        u = h * w * item
        v = u + (h // 2) * (w // 2) * item
        planes = (u, w // 2, 1, v, w // 2, 1)
    return _Image(x, h, w, 3, sy, sx, 0, 0, planes)


def _planes_image(f: Planes, kind, yuv, item):
    """A frame of separate planes: offsets of U and V from Y's pointer (GPU kinds), their strides."""
    y = f.planes[0]
    if len(tuple(y.shape)) != 2:
        raise ValueError(_err(f"the Y plane must be 2-D (height, width), got shape {tuple(y.shape)}"))
    h, w = tuple(y.shape)
    if h % 2 or w % 2 or h == 0 or w == 0:
        raise ValueError(_err(f"a 4:2:0 frame needs an even, nonzero height and width; the Y plane is {h}x{w}"))
    sy, sx = A.strides_of(y, kind)
    gpu = kind in A.GPU_KINDS
    py = A.pointer_of(y, kind) if gpu else 0
    if yuv == "nv12":
        if len(f.planes) != 2:
            raise ValueError(_err(f"an nv12 frame is Planes(y, uv), got {len(f.planes)} planes"))
        uv = f.planes[1]
        shape, st = tuple(uv.shape), A.strides_of(uv, kind)
        if shape == (h // 2, w):
            (usy, ucx), vstep = st, st[1]
            ucx *= 2
        elif shape == (h // 2, w // 2, 2):
            usy, ucx, vstep = st
        else:
            raise ValueError(_err(f"the uv plane of an nv12 frame of {h}x{w} must be ({h // 2}, {w}) or "
                                  f"({h // 2}, {w // 2}, 2); got {shape}"))
        pu = A.pointer_of(uv, kind) - py if gpu else 0
        planes = (pu, usy, ucx, pu + vstep * item, usy, ucx)
        npy = A.torch_numpy if kind == A.TORCH_CPU else (lambda a: a)
        parts: tuple = ()
        if not gpu:
            u = npy(uv).reshape(h // 2, w // 2, 2) if shape == (h // 2, w) else npy(uv)
            parts = (npy(y), u[..., 0], u[..., 1])
    else:
        if len(f.planes) != 3:
            raise ValueError(_err(f"an i420 frame is Planes(y, u, v), got {len(f.planes)} planes"))
        for name, q in zip("uv", f.planes[1:]):
            if tuple(q.shape) != (h // 2, w // 2):
                raise ValueError(_err(f"the {name} plane of an i420 frame of {h}x{w} must be ({h // 2}, "
                                      f"{w // 2}); got {tuple(q.shape)}"))
        (usy, usx), (vsy, vsx) = A.strides_of(f.planes[1], kind), A.strides_of(f.planes[2], kind)
        pu = A.pointer_of(f.planes[1], kind) - py if gpu else 0
        pv = A.pointer_of(f.planes[2], kind) - py if gpu else 0
        planes = (pu, usy, usx, pv, vsy, vsx)
        npy = A.torch_numpy if kind == A.TORCH_CPU else (lambda a: a)
        parts = () if gpu else tuple(npy(q) for q in f.planes)
    if gpu and any(o % item for o in (planes[0], planes[3])):
        raise ValueError(_err("the planes of a frame must lie a whole number of elements apart"))
    return _Image(y, h, w, 3, sy, sx, 0, 0, planes, None, parts if parts else tuple(f.planes))


def _items(imgs, rects, sources):
    """int64 [N, 5]: source image, x, y, w, h; checked against the images."""
    m = len(imgs)
    if rects is None:
        src = np.arange(m) if sources is None else _sources_arr(sources, None, m)
        hw = np.array([[im.w, im.h] for im in imgs], dtype=np.int64)[src]
        return np.column_stack([src, np.zeros_like(src), np.zeros_like(src), hw[:, 0], hw[:, 1]]).astype(np.int64)
    if isinstance(rects, A.CupyArray) or (A.is_torch_tensor(rects) and rects.is_cuda):
        raise TypeError(_err("rects must be host data (a list, a NumPy array or a torch CPU tensor): the "
                             "rectangles are checked before the launch"))
    try:
        r = np.asarray(rects)
    except ValueError:  # (ragged)
        raise ValueError(_err(f"rects must be (x, y, w, h) or a sequence of them, got {rects!r}")) from None
    if r.dtype.kind not in "iu":
        if r.dtype.kind == "f" and r.size and np.all(np.abs(r) < 2.0**62) and np.all(r == np.round(r)):
            r = r.astype(np.int64)
        elif r.size:
            raise TypeError(_err(f"rects must be integers (x, y, w, h), got dtype {r.dtype}"))
    if r.dtype == np.uint64 and r.size and int(r.max()) > np.iinfo(np.int64).max:
        i = np.unravel_index(int(np.argmax(r)), r.shape)
        raise ValueError(_err(f"rects hold {int(r[i])}, beyond any image"))
    r = r.astype(np.int64)
    if r.ndim == 1 and r.shape[0] == 4:
        r = r[None]
    if r.ndim != 2 or r.shape[1] != 4:
        raise ValueError(_err(f"rects must be (x, y, w, h) or a sequence of them, shape (N, 4); got shape "
                              f"{r.shape}"))
    n = r.shape[0]
    if n == 0:
        raise ValueError(_err("no crop rectangles were given (rects has 0 rows)"))
    if sources is None:
        if m == 1:
            src = np.zeros(n, np.int64)
        elif m == n:
            src = np.arange(n)
        else:
            raise ValueError(_err(f"{n} rectangles and {m} source images: pass sources= (the source image of "
                                  "each rectangle)"))
    else:
        src = _sources_arr(sources, n, m)
    hs = np.array([im.h for im in imgs], dtype=np.int64)[src]
    ws = np.array([im.w for im in imgs], dtype=np.int64)[src]
    x, y, w, h = r.T
    bad = (w < 1) | (h < 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(_err(f"rectangle {i} (x={x[i]}, y={y[i]}, w={w[i]}, h={h[i]}) is empty: w and h must "
                              "be >= 1"))
    bad = (x < 0) | (y < 0) | (x > ws - w) | (y > hs - h)  # (x + w could overflow int64)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(_err(f"rectangle {i} (x={x[i]}, y={y[i]}, w={w[i]}, h={h[i]}) lies outside source "
                              f"image {src[i]} ({ws[i]} wide, {hs[i]} high): it needs 0 <= x, 0 <= y, "
                              f"x + w <= {ws[i]}, y + h <= {hs[i]}"))
    return np.column_stack([src, r]).astype(np.int64)


def _sources_arr(sources, n, m):
    s = np.asarray(sources)
    if s.ndim == 0:
        s = np.full(n if n is not None else 1, s)
    if s.dtype.kind not in "iu" or s.ndim != 1 or (n is not None and s.shape[0] != n):
        raise ValueError(_err(f"sources must be {n if n is not None else 'N'} integer image indices, got "
                              f"{np.asarray(sources).dtype} of shape {np.asarray(sources).shape}"))
    s = s.astype(np.int64)
    if s.size and (s.min() < 0 or s.max() >= m):
        raise ValueError(_err(f"sources must index the {m} source images (0 to {m - 1}); got {s.min()} to "
                              f"{s.max()}"))
    return s


def _flags(what, v, n):
    """Per-item flags from a bool or n bools (integers 0 and 1 too; the string "False" or 0.5 are refused,
    not read as true)."""
    f = np.asarray(v)
    if f.dtype.kind not in "bui" or (f.dtype.kind != "b" and np.any((f != 0) & (f != 1))):
        raise ValueError(_err(f"{what} must be a bool or {n} bools (one per item), got {v!r}"))
    if f.ndim == 0:
        f = np.full(n, bool(f))
    if f.shape != (n,):
        raise ValueError(_err(f"{what} must be a bool or {n} bools (one per item), got {v!r}"))
    return f.astype(bool)


def _boxes(items, oh, ow, letterbox):
    """int64 [N, 4] box (x, y, w, h) in the output that each crop is resized into: the whole output,
    or (letterbox) the largest box of the crop's aspect, rounded to the nearest pixel, centered (the
    odd pixel of padding on the right / bottom)."""
    n = items.shape[0]
    if not letterbox:
        return np.tile(np.array([0, 0, ow, oh], np.int64), (n, 1))
    w, h = items[:, 3], items[:, 4]
    wide = ow * h <= oh * w  # the width binds
    bw = np.where(wide, ow, (2 * w * oh + h) // (2 * h))
    bh = np.where(wide, (2 * h * ow + w) // (2 * w), oh)
    bw, bh = np.clip(bw, 1, ow), np.clip(bh, 1, oh)
    return np.column_stack([(ow - bw) // 2, (oh - bh) // 2, bw, bh]).astype(np.int64)


def _values(what, v):
    """A per-channel argument as the pipeline keeps it: a float, or a tuple of floats (a copy: a NumPy
    array changed in place later changes no pipeline, whose calls may have cached the values)."""
    if type(v) is float:
        return v
    vals = v if isinstance(v, (list, tuple)) else [v]
    if any(x is None or isinstance(x, (str, bytes)) for x in vals):
        raise TypeError(_err(f"{what} must be a number or one number per output channel, got {v!r}"))
    try:
        a = np.array(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(_err(f"{what} must be a number or one number per output channel, got "
                             f"{type(v).__module__}.{type(v).__name__}")) from None
    if a.ndim == 0:
        return float(a)
    if a.ndim > 1:
        raise ValueError(_err(f"{what} must be one value or one per output channel, got shape {a.shape} "
                              f"({a.tolist()})"))
    return tuple(a.tolist())


def _per_channel(what, v, n):
    a = np.asarray(_values(what, v), dtype=np.float64)
    if a.ndim == 0:
        a = np.full(n, float(a))
    if a.shape != (n,):
        raise ValueError(_err(f"{what} must be one value or {n} (one per output channel), got shape "
                              f"{a.shape} ({a.tolist()})"))
    return a


# ------------------------------------------------------------------ the pipeline
@dataclass(frozen=True)
class Pipeline:
    """An image pipeline: read -> crop -> resize or letterbox -> flip -> color -> normalize -> cast ->
    write, run as one kernel on CuPy arrays and torch CUDA tensors (NumPy on CPU kinds). Compose it by
    chaining (each call returns a new Pipeline), then call it on images:

        pipe = (cufuse.image.Pipeline()
                .resize((224, 224))
                .color("bgr2rgb")
                .normalize(mean=(123.7, 116.3, 103.5), std=(58.4, 57.1, 57.4))
                .cast("float16")
                .write("NCHW"))
        batch = pipe(frame, rects=[(x, y, w, h), ...])   # [N, 3, 224, 224] float16, one launch

    Steps apply in the order above whatever the order of the calls (crop rectangles are given to the call).
    """
    layout: str | None = None
    size: tuple | None = None
    interpolation: str = "bilinear"
    letterbox: bool = False
    fill: Any = 0.0
    colors: Any = None
    yuv: str | None = None
    matrix: str = "bt601"
    full_range: bool = False
    mean: Any = 0.0
    std: Any = 1.0
    scale: float = 1.0
    dtype: Any = np.float32
    out_layout: str = "NCHW"
    hflip: Any = False
    vflip: Any = False

    # call signature -> _Launcher (the fast path); each Pipeline (every replace() too) has its own
    _fast: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        # every field checked (and normalized) here: a Pipeline(...) built directly, and each step's
        # replace(), as the step methods' arguments (hflip / vflip and colors are checked per call)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(_err(f"layout must be one of {LAYOUTS}, got {self.layout!r}"))
        if self.yuv is not None and self.yuv not in YUV_FORMATS:
            raise ValueError(_err(f"yuv must be one of {YUV_FORMATS} or None, got {self.yuv!r}"))
        if self.matrix not in _YUV_MATRIX:
            raise ValueError(_err(f"matrix must be one of {tuple(_YUV_MATRIX)}, got {self.matrix!r}"))
        if self.yuv is not None and self.layout is not None:
            raise ValueError(_err("a yuv frame has its own layout; leave layout None"))
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(_err(f"interpolation must be one of {tuple(INTERPOLATIONS)}, got "
                                  f"{self.interpolation!r}"))
        if self.out_layout not in OUT_LAYOUTS:
            raise ValueError(_err(f"the output layout must be one of {OUT_LAYOUTS}, got {self.out_layout!r}"))
        sc = self.scale
        if isinstance(sc, (bool, np.bool_)) or not isinstance(sc, (int, float, np.integer, np.floating)):
            raise TypeError(_err(f"scale must be one number (the factor before mean and std), got {sc!r}"))
        if not math.isfinite(sc):
            raise ValueError(_err(f"scale must be finite, got {sc!r}"))
        fixed = {"full_range": _bool("full_range", self.full_range), "letterbox": _bool("letterbox", self.letterbox),
                 "size": None if self.size is None else _size(self.size), "dtype": _out_dtype(self.dtype),
                 "fill": _values("fill", self.fill), "mean": _values("mean", self.mean),
                 "std": _values("std", self.std), "scale": float(sc)}
        for k, v in fixed.items():
            object.__setattr__(self, k, v)  # (frozen)

    # ---- composing
    def read(self, layout: str | None = None, *, yuv: str | None = None, matrix: str = "bt601",
             full_range: bool = False) -> Pipeline:
        """Source layout (one of LAYOUTS; None: HW, HWC or NHWC by the array's dimensions); or a
        4:2:0 video frame, ``yuv`` "nv12" or "i420", converted to RGB with ``matrix`` "bt601" or
        "bt709", ``full_range`` or limited (Y 16-235, U/V 16-240, for 8 bits; scaled for 16)."""
        return replace(self, layout=layout, yuv=yuv, matrix=matrix, full_range=full_range)

    def resize(self, size: Any, interpolation: str = "bilinear") -> Pipeline:
        """Resize each crop to ``size`` (H, W) (an int: square). ``interpolation``: "bilinear"
        (half-pixel centers, as OpenCV INTER_LINEAR and torchvision antialias=False), "nearest" (OpenCV
        INTER_NEAREST, torch "nearest") or "nearest_exact" (torch "nearest-exact")."""
        return replace(self, size=_size(size), interpolation=interpolation, letterbox=False)

    def letterbox_to(self, size: Any, fill: Any = 0.0, interpolation: str = "bilinear") -> Pipeline:
        """Resize each crop, keeping its aspect ratio, into the largest box that fits ``size``,
        centered; the rest is ``fill`` (one value or one per output channel, in source units: it
        goes through normalize and cast)."""
        p = self.resize(size, interpolation)
        return replace(p, letterbox=True, fill=fill)

    def flip(self, horizontal: Any = False, vertical: Any = False) -> Pipeline:
        """Flip each crop (before it is resized): a bool, or one per item (may also be given per call)."""
        return replace(self, hflip=horizontal, vflip=vertical)

    def color(self, conversion: Any) -> Pipeline:
        """A name of COLORS ("bgr2rgb", "rgb2gray", ...), a tuple of source channels (a selection or
        permutation, e.g. (2, 1, 0)), or for a yuv read "rgb", "bgr" or "gray"."""
        return replace(self, colors=conversion)

    def normalize(self, mean: Any = 0.0, std: Any = 1.0, scale: float = 1.0) -> Pipeline:
        """(x * scale - mean) / std per output channel (mean, std: one value or one per channel; their
        values are copied here)."""
        return replace(self, mean=mean, std=std, scale=scale)

    def cast(self, dtype: Any) -> Pipeline:
        """Output dtype: float32, float16, bfloat16 or uint8 (saturating, rounded to nearest even)."""
        return replace(self, dtype=dtype)

    def write(self, layout: str = "NCHW") -> Pipeline:
        return replace(self, out_layout=layout)

    # ---- running
    def __call__(self, images: Any, rects: Any = None, *, sources: Any = None, hflip: Any = None,
                 vflip: Any = None, out: Array | None = None) -> Array:
        """Run on ``images`` (an array, or a list of arrays of one kind, dtype and channel count,
        sizes free). ``rects``: (x, y, w, h) per output item (None: each whole image); ``sources``:
        the source image of each rectangle (default: image 0 when there is one, else one rectangle
        per image). Returns [N, C, H, W] (or [N, H, W, C]) of the images' kind, or writes ``out``."""
        return _run(self, images, rects, sources, self.hflip if hflip is None else hflip,
                    self.vflip if vflip is None else vflip, out)


def process(images: Any, rects: Any = None, *, size: Any = None, interpolation: str = "bilinear",
            letterbox: bool = False, fill: Any = 0.0, layout: str | None = None, color: Any = None,
            yuv: str | None = None, matrix: str = "bt601", full_range: bool = False, hflip: Any = False,
            vflip: Any = False, mean: Any = 0.0, std: Any = 1.0, scale: float = 1.0, dtype: Any = np.float32,
            out_layout: str = "NCHW", sources: Any = None, out: Array | None = None) -> Array:
    """One call of a ``Pipeline``: crop ``rects`` from ``images``, resize (or letterbox) to ``size``
    (None: no resize, every crop of one size), flip, ``color``, (x * scale - mean) / std, cast to
    ``dtype``, write ``out_layout``. See ``Pipeline`` for each step."""
    if _bool("letterbox", letterbox) and size is None:
        raise ValueError(_err("letterbox needs a size"))
    p = Pipeline(layout=layout, size=size, interpolation=interpolation, letterbox=letterbox, fill=fill, colors=color,
                 yuv=yuv, matrix=matrix, full_range=full_range, mean=mean, std=std, scale=scale, dtype=dtype,
                 out_layout=out_layout)  # (one construction: each step method's replace() checks every field)
    return p(images, rects, sources=sources, hflip=hflip, vflip=vflip, out=out)


# ------------------------------------------------------------------ planning
@dataclass
class _Plan:
    kind: str
    in_dtype: np.dtype
    out_dtype: np.dtype
    device: Any
    images: list
    items: np.ndarray     # int64 [N, 10] (kItem)
    reads: tuple          # source channels read
    gray: tuple | None    # weights over the read channels, or None: output k = read k
    cout: int
    interp: int
    yuv: str | None
    oh: int
    ow: int
    mean: np.ndarray
    std: np.ndarray
    fill: np.ndarray
    scale: float
    yuv_params: tuple     # (Rv, Gu, Gv, Bu, y_offset, y_gain, c_offset, c_gain, range)


def _color_spec(colors, c, yuv, layout=None):
    """(reads, gray weights or None) for a color argument and c source channels (``layout``: the
    one given, None for the default by dimensions)."""
    if yuv is not None:
        if colors is None:
            colors = "rgb"
        if colors not in _YUV_OUT:
            raise ValueError(_err(f"after a yuv read the color must be one of {tuple(_YUV_OUT)}, got {colors!r}"))
        spec = _YUV_OUT[colors]
        return ((0, 1, 2), _GRAY_RGB) if spec == "gray" else (spec, None)
    if colors is None:
        if c > 4:
            raise ValueError(_err(f"the source images have {c} channels; at most 4 are written: pass color= (a "
                                  "tuple of the channels to keep)" + ("" if layout is not None else
                                  ", or layout='CHW' (or 'NCHW') if the channels come first (HWC is the "
                                  "default for 3-D arrays)")))
        return tuple(range(c)), None
    if isinstance(colors, str):
        if colors not in COLORS:
            raise ValueError(_err(f"color must be one of {tuple(COLORS)} or a tuple of channels, got {colors!r}"))
        reads, how = COLORS[colors]
        need = 4 if colors.startswith(("rgba", "bgra")) else 3
        if c != need:
            raise ValueError(_err(f"color {colors!r} needs {need}-channel source images; they have {c}"))
        if how == "gray":
            return (0, 1, 2), (_GRAY_RGB if colors == "rgb2gray" else _GRAY_RGB[::-1])
        return reads, None
    if isinstance(colors, (tuple, list)) and colors and all(
            isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)) for k in colors):
        reads = tuple(int(k) for k in colors)
        if len(reads) > 4 or min(reads) < 0 or max(reads) >= c:
            raise ValueError(_err(f"color channels {reads}: 1 to 4 indices of the {c} source channels"))
        return reads, None
    raise TypeError(_err(f"color must be a name ({', '.join(COLORS)}) or a tuple of channel indices, "
                         f"got {colors!r}"))


def _yuv_params(p: Pipeline, dt):
    """(Rv, Gu, Gv, Bu, y offset, y gain, chroma offset, chroma gain, range) for a source dtype. The
    8-bit levels (black 16, white 235, chroma 16-240 centered on 128; full range: 0-255) scale by 256
    for uint16 (16-bit video: 8-bit levels shifted left by 8) and by 1 / 255 for floats. The result is
    in the source's range, 8-bit white at its top: 0-255, 0-65535 or 0-1 (the 8-bit result times 257
    for uint16, over 255 for floats)."""
    rng = _RANGE[dt]
    unit = {U8: 1.0, U16: 256.0}.get(dt, 1.0 / 255.0)
    if p.full_range:
        g = rng / (255.0 * unit)  # 8-bit white to the range's top, as limited range's 235
        yo, yg, co, cg = 0.0, g, 128.0 * unit, g
    else:
        yo, yg, co, cg = 16.0 * unit, rng / (219.0 * unit), 128.0 * unit, rng / (224.0 * unit)
    return (*_YUV_MATRIX[p.matrix], yo, yg, co, cg, rng)


def _plan(p: Pipeline, images, rects, sources, hflip, vflip, out) -> _Plan:
    kind, dt, dev, imgs = _as_images(images, p.layout, p.yuv)
    odt = _out_dtype(p.dtype)
    reads, gray = _color_spec(p.colors, imgs[0].c, p.yuv, p.layout)
    cout = 1 if gray is not None else len(reads)
    its = _items(imgs, rects, sources)
    n = its.shape[0]
    if p.size is None:
        if p.letterbox:
            raise ValueError(_err("letterbox needs a size"))
        sizes = {(int(h), int(w)) for w, h in its[:, 3:5]}
        if len(sizes) != 1:
            raise ValueError(_err(f"without a resize every crop must have one size; got {sorted(sizes)[:4]} "
                                  "(h, w)...: add .resize(size)"))
        oh, ow = sizes.pop()
        interp = 0
    else:
        oh, ow = p.size
        interp = INTERPOLATIONS[p.interpolation]
    if oh * ow > 2**30 or oh > 65535 * _TILE_H:  # int32 pixel indices; gridDim.y
        raise ValueError(_err(f"an output of {oh}x{ow} pixels per item: at most 2**30, and a height of at most "
                              f"{65535 * _TILE_H}"))
    if int(its[:, 3:5].max()) >= 2**22:  # the kernel's float-reciprocal division (kernels/image.cuh div_floor)
        raise ValueError(_err(f"a crop of {int(its[:, 3:5].max())} pixels a side: at most 2**22 - 1"))
    boxes = _boxes(its, oh, ow, p.letterbox)
    # The kernel's bilinear index arithmetic is int32: (2 box + 1) crop < 2**31.
    big = max(int(((2 * boxes[:, 2] + 1) * its[:, 3]).max()), int(((2 * boxes[:, 3] + 1) * its[:, 4]).max()))
    if big >= 2**31:
        raise ValueError(_err("a crop and output size too large for the kernel's 32-bit index arithmetic: "
                              f"(2 * output size + 1) * crop size = {big} >= 2**31"))
    flags = _flags("hflip", hflip, n).astype(np.int64) | (_flags("vflip", vflip, n).astype(np.int64) << 1)
    items = np.column_stack([its, boxes, flags, np.zeros((n, _ITEM - 10), np.int64)]).astype(np.int64)
    mean = _per_channel("mean", p.mean, cout)
    if not np.all(np.isfinite(mean)):
        raise ValueError(_err(f"mean must be finite, got {list(mean)}"))
    std = _per_channel("std", p.std, cout)
    if np.any(std == 0) or not np.all(np.isfinite(std)):
        raise ValueError(_err(f"std must be finite and nonzero, got {list(std)}"))
    fill = _per_channel("fill", p.fill, cout)
    scale = float(p.scale)
    yp = _yuv_params(p, dt) if p.yuv is not None else (0.0,) * 9
    if isinstance(out, (list, tuple)):
        _check_planes(out, kind, odt, (n, oh, ow), dev, cout)
    elif out is not None:
        A.check_out(_NAME, out, kind, odt, _out_shape(n, cout, oh, ow, p.out_layout), dev)
    return _Plan(kind, dt, odt, dev, imgs, items, reads, gray, cout, interp, p.yuv, oh, ow, mean, std, fill,
                 scale, yp)


def _check_planes(out, kind, odt, shape, dev, cout):
    """out= given as one [N, H, W] array per output channel (a planar split)."""
    if len(out) != cout:
        raise ValueError(_err(f"out= as planes needs one [N, H, W] array per output channel: {cout}, got "
                              f"{len(out)}"))
    for o in out:
        A.check_out(_NAME, o, kind, odt, shape, dev)
    if kind in A.GPU_KINDS:
        st = A.strides_of(out[0], kind)
        p0 = A.pointer_of(out[0], kind)
        for k, o in enumerate(out[1:], 1):
            if A.strides_of(o, kind) != st:
                raise ValueError(_err(f"out planes 0 and {k} have different strides ({st} and "
                                      f"{A.strides_of(o, kind)}); the planes must share one layout"))
            if (A.pointer_of(o, kind) - p0) % odt.itemsize:
                raise ValueError(_err(f"out plane {k} is not a whole number of elements away from plane 0"))
    for i in range(len(out)):
        for j in range(i):
            if kind in A.GPU_KINDS:
                shared = D.overlaps(out[i], out[j], kind)
            else:
                npy = A.torch_numpy if kind == A.TORCH_CPU else np.asarray
                shared = np.shares_memory(npy(out[i]), npy(out[j]))
            if shared:
                raise ValueError(_err(f"out planes {j} and {i} overlap"))


def _out_shape(n, c, h, w, layout):
    return (n, c, h, w) if layout == "NCHW" else (n, h, w, c)


# ------------------------------------------------------------------ NumPy
def _np_view(im: _Image, kind, yuv):
    """(H, W, C) NumPy view of a source image; for yuv: its (Y, U, V) planes."""
    if im.parts:  # a frame of separate planes
        y, u, v = (A.torch_numpy(q) if kind == A.TORCH_CPU and A.is_torch_tensor(q) else q for q in im.parts)
        return y, u, v
    x = A.torch_numpy(im.array) if kind == A.TORCH_CPU else im.array
    if im.index is not None:
        x = x[im.index]
    if im.planes:
        h, w = im.h, im.w
        if yuv == "i420":  # contiguous, U and V packed after Y
            flat = x.reshape(-1)
            q = (h // 2) * (w // 2)
            return (x[:h], flat[h * w:h * w + q].reshape(h // 2, w // 2),
                    flat[h * w + q:h * w + 2 * q].reshape(h // 2, w // 2))
        return x[:h], x[h:, 0::2], x[h:, 1::2]  # nv12: interleaved UV rows after Y
    item = x.dtype.itemsize
    return np.lib.stride_tricks.as_strided(x, shape=(im.h, im.w, im.c),
                                           strides=(im.sy * item, im.sx * item, im.sc * item), writeable=False)


def _np_axis(n_out, n, box, interp, flip):
    """(i0, i1, t) over the box's extent: the kernel's axis() in float64."""
    d = np.arange(box, dtype=np.int64)
    if interp == 0:
        i0 = np.minimum(d * n // box, n - 1)
        i1, t = i0, np.zeros(box)
    elif interp == 1:
        i0 = np.minimum((2 * d + 1) * n // (2 * box), n - 1)
        i1, t = i0, np.zeros(box)
    else:
        num, den = (2 * d + 1) * n - box, 2 * box
        q = np.floor_divide(num, den)
        lo, hi = num <= 0, q >= n - 1
        i0 = np.where(lo, 0, np.where(hi, n - 1, q))
        i1 = np.where(lo | hi, i0, q + 1)
        t = np.where(lo | hi, 0.0, (num - q * den) / den)
    if flip:
        i0, i1 = n - 1 - i0, n - 1 - i1
    return i0, i1, t


def _np_yuv_rgb(y, u, v, yp):
    rv, gu, gv, bu, yo, yg, co, cg, rng = yp
    yy = (y - yo) * yg
    uu, vv = (u - co) * cg, (v - co) * cg
    return np.clip(np.stack([yy + rv * vv, yy + gu * uu + gv * vv, yy + bu * uu], axis=-1), 0.0, rng)


def _np_run(plan: _Plan) -> np.ndarray:
    """float64 [N, C, H, W] before the cast."""
    n = plan.items.shape[0]
    res = np.empty((n, plan.cout, plan.oh, plan.ow), np.float64)
    views: dict = {}
    for i in range(n):
        img, cx, cy, cw, ch, bx, by, bw, bh, fl = (int(v) for v in plan.items[i, :10])
        x0, x1, tx = _np_axis(plan.ow, cw, bw, plan.interp, fl & 1)
        y0, y1, ty = _np_axis(plan.oh, ch, bh, plan.interp, fl & 2)
        if img not in views:
            views[img] = _np_view(plan.images[img], plan.kind, plan.yuv)
        view = views[img]
        if plan.yuv is not None:
            yv, uv, vv = view
            ys, xs = np.arange(cy, cy + ch), np.arange(cx, cx + cw)
            crop = _np_yuv_rgb(yv[cy:cy + ch, cx:cx + cw].astype(np.float64),
                               uv[ys[:, None] // 2, xs[None, :] // 2].astype(np.float64),
                               vv[ys[:, None] // 2, xs[None, :] // 2].astype(np.float64), plan.yuv_params)
            crop = crop[:, :, list(plan.reads)]
        else:
            crop = view[cy:cy + ch, cx:cx + cw][:, :, list(plan.reads)].astype(np.float64)
        if plan.interp == INTERPOLATIONS["bilinear"]:
            a, b = crop[y0][:, x0], crop[y0][:, x1]
            c, d = crop[y1][:, x0], crop[y1][:, x1]
            txb, tyb = tx[None, :, None], ty[:, None, None]
            top, bottom = a + txb * (b - a), c + txb * (d - c)
            r = top + tyb * (bottom - top)  # (bh, bw, reads)
        else:  # one source pixel, as the kernel takes it (an inf stays inf: no inf - inf)
            r = crop[y0][:, x0]
        if plan.gray is not None:
            r = (r * np.asarray(plan.gray)).sum(axis=-1, keepdims=True)
        full = np.empty((plan.oh, plan.ow, plan.cout))
        full[...] = plan.fill
        full[by:by + bh, bx:bx + bw] = r
        res[i] = np.moveaxis(full, -1, 0)
    with np.errstate(all="ignore"):
        return (res * plan.scale - plan.mean[None, :, None, None]) / plan.std[None, :, None, None]


def cast(v: np.ndarray, dtype: Any) -> np.ndarray:
    """The pipeline's cast of float64 values: uint8 saturating, rounded to nearest even (NaN: 0);
    the floats rounded to nearest."""
    dt = np.dtype(dtype)
    if dt == U8:
        return np.clip(np.rint(np.nan_to_num(v, nan=0.0, posinf=255.0, neginf=0.0)), 0, 255).astype(U8)
    return v.astype(dt)


# ------------------------------------------------------------------ GPU
_fns: dict = {}


def _source(plan: _Plan, wide: bool = False) -> str:
    """The generated CUDA source of a plan's structure (nothing of its values); ``wide``: a row stride
    of a source or of the output, in bytes, needs more than 31 bits (the kernel's Index)."""
    ch = " : ".join(f"k == {k} ? {c}" for k, c in enumerate(plan.reads[:-1]))
    ch = f"{ch} : {plan.reads[-1]}" if ch else str(plan.reads[-1])
    if plan.gray is not None:
        body = "o[0] = " + " + ".join(f"{w!r}f * r[{k}]" for k, w in enumerate(plan.gray)) + ";"
    else:
        body = " ".join(f"o[{k}] = r[{k}];" for k in range(plan.cout))
    yuv = {None: 0, "nv12": 1, "i420": 2}[plan.yuv]
    return "\n".join([
        "// Generated by cufuse.image: one pipeline structure (kernels/image.cuh).",
        '#include "image.cuh"',
        "struct Spec {",
        f"    using In = {_CTYPES[plan.in_dtype]};",
        f"    using Out = {_CTYPES[plan.out_dtype]};",
        f"    static constexpr int kRead = {len(plan.reads)}, kOut = {plan.cout}, kInterp = {plan.interp}, "
        f"kYuv = {yuv}, kUnit = {int(_unit(plan))};",
        f"    using Index = {'long long' if wide else 'int'};",
        f"    __device__ __forceinline__ static int channel(int k) {{ return {ch}; }}",
        "    __device__ __forceinline__ static void color(const float (&r)[kRead], float (&o)[kOut], "
        "const cufuse::image::Params&) {",
        f"        {body}",
        "    }",
        "};",
        # planar sources: 5 blocks per SM lets ptxas keep more loads in flight (4K CHW uint8 -> 1080p 26.6
        # -> 20.2 us on an H200); interleaved ones are as fast either way (bench/NOTES.md)
        f'extern "C" __global__ void __launch_bounds__(256{"" if _unit(plan) else ", 5"}) image_pipeline('
        "const char* base, const long long* images, const int* items, void* out, cufuse::image::Params P) {",
        "    cufuse::image::run<Spec>(base, images, items, static_cast<Spec::Out*>(out), P);",
        "}",
        ""])


def _unit(plan: _Plan) -> bool:
    """Every source has interleaved channels (channel stride 1): the kernel reads them at constant offsets."""
    return plan.yuv is None and all(im.sc == 1 for im in plan.images)


def _structure(plan: _Plan) -> tuple:
    return (plan.in_dtype.str, plan.out_dtype.str, plan.reads, plan.gray, plan.interp, plan.yuv, _unit(plan))


def _function(plan: _Plan, wide: bool = False):
    key = (_structure(plan), wide, plan.device)
    fn = _fns.get(key)
    if fn is None:
        mod, _ = R.generated_module(_source(plan, wide), plan.device, what=f"cufuse.image pipeline {key[0]}")
        with R._cp.cuda.Device(plan.device):
            fn = _fns[key] = mod.get_function("image_pipeline")
    return fn


def _images_table(plan: _Plan):
    """(base pointer, int64 [M, kImage]: byte offset of each image from the base, its strides)."""
    ptrs = [A.pointer_of(im.array, plan.kind) + im.offset for im in plan.images]
    base = min(ptrs)
    t = np.zeros((len(plan.images), _IMAGE), np.int64)
    for k, (im, p) in enumerate(zip(plan.images, ptrs)):
        t[k, :4] = (p - base, im.sy, im.sx, im.sc)
        if im.planes:
            uo, usy, usx, vo, vsy, vsx = im.planes
            t[k, 4:] = (p - base + uo, usy, usx, p - base + vo, vsy, vsx)
    return base, t


def _params(plan: _Plan, out_strides, planes, n):
    P = np.zeros((), _PARAMS)
    P["out_stride"] = out_strides
    P["out_plane"][:plan.cout] = planes
    P["gain"][:plan.cout] = plan.scale / plan.std  # x * gain + bias: (x * scale - mean) / std, in float64
    P["bias"][:plan.cout] = -plan.mean / plan.std
    P["fill"][:plan.cout] = plan.fill
    P["out_h"], P["out_w"], P["items"] = plan.oh, plan.ow, n
    rv, gu, gv, bu, yo, yg, co, cg, rng = plan.yuv_params
    P["yuv"] = (rv, gu, gv, bu)
    P["y_offset"], P["y_gain"], P["c_offset"], P["c_gain"], P["range"] = yo, yg, co, cg, rng
    return P


class _Launcher:
    """The launches of one call signature: everything but the source and output pointers, which
    change from call to call (a Pipeline keeps these for the signatures it has seen: a repeated
    call builds no table and validates nothing again)."""
    __slots__ = ("fn", "rec", "offsets", "base_rel", "held", "shape", "out_dtype", "kind", "dev", "in_span",
                 "out_span")

    def __init__(self, plan: _Plan, res, out_layout):
        kind, dev = plan.kind, plan.device
        n = plan.items.shape[0]
        isz = plan.out_dtype.itemsize
        if isinstance(res, (list, tuple)):  # planes apart: [N, H, W] each, one set of strides
            st = A.strides_of(res[0], kind)
            p0 = A.pointer_of(res[0], kind)
            ost = (st[0], st[1], st[2])
            planes = [(A.pointer_of(r, kind) - p0) // isz for r in res]
            res = res[0]
        else:
            st = A.strides_of(res, kind)
            ost, sc = ((st[0], st[2], st[3]), st[1]) if out_layout == "NCHW" else ((st[0], st[1], st[2]), st[3])
            planes = [k * sc for k in range(plan.cout)]
        row_bytes = [abs(im.sy) * plan.in_dtype.itemsize for im in plan.images] + [abs(ost[1]) * isz]
        self.fn = _function(plan, max(row_bytes) >= _NARROW)
        first = A.pointer_of(plan.images[0].array, kind)
        base, table = _images_table(plan)
        self.base_rel = base - first  # the kernel's base pointer, from the first image's array's
        images = D.uploaded(table, kind, dev, "cufuse.image's table of source images")
        items = D.uploaded(plan.items.astype(np.int32), kind, dev, "cufuse.image's crop rectangles")
        self.held = D.Held(dev, images, items)  # the tables live as long as this launcher, and its launches
        grid_xy = (-(-plan.ow // _TILE_W), -(-plan.oh // _TILE_H))
        # one launch per chunk of items; per call: value 0 the base pointer, 1 + k chunk k's output
        b = D.RecipeBuilder(kind, dev, 0, 0)
        self.offsets = []
        for k, s in enumerate(range(0, n, _MAX_ITEMS_PER_LAUNCH)):
            m = min(_MAX_ITEMS_PER_LAUNCH, n - s)
            b.launch(self.fn, (*grid_xy, m), _BLOCK, (D.val(0), int(images.data.ptr),
                                                      int(items.data.ptr) + s * _ITEM * 4, D.val(1 + k),
                                                      _params(plan, ost, planes, m)[()]))
            self.offsets.append(s * ost[0] * isz)
        self.rec = b.build([], [], [])
        self.shape, self.out_dtype, self.kind, self.dev = tuple(res.shape), plan.out_dtype, kind, dev
        # bytes each side of the pointer that the sources and the output touch (an overlap check without
        # walking the arrays again)
        self.in_span = D.span(plan.images[0].array, kind) if len(plan.images) and len(
            {id(im.array) for im in plan.images}) == 1 else None
        self.in_span = None if self.in_span is None else (self.in_span[0] - first, self.in_span[1] - first)
        osp = D.span(res, kind)
        optr = A.pointer_of(res, kind)
        self.out_span = (osp[0] - optr, osp[1] - optr)

    def launch(self, first_ptr: int, out_ptr: int, stream) -> None:
        values = (first_ptr + self.base_rel, *[out_ptr + off for off in self.offsets])  # pointers as Python ints
        current = D.get_device
        if current is not None and self.dev == current():
            self.held.on(stream)
            D.queue(self.rec, values, stream)
        else:
            with R._cp.cuda.Device(self.dev):
                self.held.on(stream)
                D.queue(self.rec, values, stream)

    def overlaps(self, first_ptr: int, out_ptr: int) -> bool:
        if self.in_span is None:
            return True  # (not used for several source arrays: no fast path there)
        return (out_ptr + self.out_span[0] < first_ptr + self.in_span[1]
                and first_ptr + self.in_span[0] < out_ptr + self.out_span[1])


def _gpu_run(plan: _Plan, out, out_layout, keep=None):
    """Launch ``plan`` (into ``out`` or a new array); ``keep``: a dict that takes the launcher for
    the call signature's fast path."""
    kind, dev = plan.kind, plan.device
    n = plan.items.shape[0]
    planar = isinstance(out, (list, tuple))
    if planar:
        out_layout, keep = "NCHW", None
    shape = _out_shape(n, plan.cout, plan.oh, plan.ow, out_layout)
    target = out
    outs = list(out) if planar else [] if out is None else [out]
    if any(D.overlaps(o, a, kind) for o in outs for im in plan.images for a in (im.parts or (im.array,))):
        target = None  # written to a temporary, then copied: the kernel reads the sources while it writes
        keep = None
    res = target if target is not None else D.empty(shape, plan.out_dtype, kind, dev)
    launcher = _Launcher(plan, res, out_layout)
    first = res[0] if isinstance(res, (list, tuple)) else res
    launcher.launch(A.pointer_of(plan.images[0].array, kind), A.pointer_of(first, kind), D.stream_for(kind, dev))
    if keep is not None:
        keep["launcher"] = launcher
    if out is not None and target is None:
        if planar:
            for k, o in enumerate(out):
                D.copy_into(o, res[:, k], kind)
        else:
            D.copy_into(out, res, kind)
    return out if out is not None else res


# ------------------------------------------------------------------ the fast path
_FAST_MAX = 64  # signatures a Pipeline keeps


def _flag_key(v):
    """The fast path's key of a flag argument; TypeError (the full path then checks it and raises)
    for anything but bools and integers 0 and 1, as _flags takes."""
    if v is None:
        return v
    if isinstance(v, (bool, np.bool_, int, np.integer)):
        if not isinstance(v, (bool, np.bool_)) and v not in (0, 1):
            raise TypeError(v)
        return int(v)
    if isinstance(v, np.ndarray):
        return (v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (str, bytes)):
        raise TypeError(v)
    return tuple(_flag_key(b) for b in v)


def _array_key(x):
    """(dtype, shape, strides, device) of a GPU array; None for other arrays and for tensors
    that require grad (the full path checks those)."""
    t = D.TORCH.Tensor
    if t is None and A.torch() is not None:  # torch not yet bound: bind it, so that the key of a first
        t = D.torch_api().Tensor             # call is the form later calls make (else it never matches)
    if t is not None and isinstance(x, t):
        if not x.is_cuda or x.requires_grad:
            return None
        return (x.dtype, tuple(x.shape), x.stride(), x.get_device())
    if A._cp is not None and isinstance(x, A._cp.ndarray):
        return (x.dtype.str, x.shape, x.strides, x.data.device_id)
    try:
        kind = A.kind_of(x)
    except (TypeError, ValueError):  # (the general path says what is wrong)
        return None
    if kind not in A.GPU_KINDS:
        return None
    return (A.dtype_of(x, kind), tuple(x.shape), A.strides_of(x, kind), A.device_of(x, kind))


def _fast_key(images, rects, sources, hflip, vflip, out):
    """The call signature of a single GPU source array (kind, dtype, shape, strides, device), the
    values of the rectangles, sources and flips, and the output's signature; None where the call
    takes the full path (CPU kinds, several source arrays, tensors that require grad)."""
    if isinstance(images, (list, tuple)):
        return None
    ik = _array_key(images)
    if ik is None:
        return None
    ok = None
    if out is not None:
        ok = _array_key(out)
        if ok is None:
            return None
    if rects is None:
        rk = None
    elif isinstance(rects, np.ndarray):
        rk = (rects.dtype.str, rects.shape, rects.tobytes())
    else:
        try:
            r = np.asarray(rects)
        except Exception:
            return None
        if r.dtype.kind not in "iu":
            return None
        rk = (r.dtype.str, r.shape, r.tobytes())
    try:
        flags = (_flag_key(sources), _flag_key(hflip), _flag_key(vflip))
    except TypeError:
        return None
    return (type(images), ik, rk, flags, type(out), ok)


def _fast_call(e: _Launcher, images, out):
    kind = e.kind
    first = A.pointer_of(images, kind)
    if out is None:
        res = D.empty(e.shape, e.out_dtype, kind, e.dev)
    else:
        res = out
        if e.overlaps(first, A.pointer_of(out, kind)):
            return None
    e.launch(first, A.pointer_of(res, kind), D.stream_for(kind, e.dev))
    return res


def _written(out, kind):
    """A torch CUDA out= that a launch wrote: its version bumped, as every op's (_driver.written)."""
    if out is not None and kind == A.TORCH_CUDA:
        D.written(tuple(out) if isinstance(out, (list, tuple)) else (out,))


def _run(p: Pipeline, images, rects, sources, hflip, vflip, out):
    key = _fast_key(images, rects, sources, hflip, vflip, out)
    if key is not None:
        e = p._fast.get(key)
        if e is not None:
            res = _fast_call(e, images, out)
            if res is not None:
                _written(out, e.kind)
                return res
    plan = _plan(p, images, rects, sources, hflip, vflip, out)
    if plan.kind in A.GPU_KINDS:
        keep: dict | None = {} if key is not None else None
        res = _gpu_run(plan, out, p.out_layout, keep)
        _written(out, plan.kind)
        if keep:
            if len(p._fast) >= _FAST_MAX:
                p._fast.clear()
            p._fast[key] = keep["launcher"]
        return res
    res = cast(_np_run(plan), plan.out_dtype)
    if isinstance(out, (list, tuple)):  # planes apart
        for k, o in enumerate(out):
            if plan.kind == A.TORCH_CPU:
                o.copy_(A.torch_from_numpy(np.ascontiguousarray(res[:, k])))
            else:
                o[...] = res[:, k]
        return out
    if p.out_layout == "NHWC":
        res = np.ascontiguousarray(np.moveaxis(res, 1, -1))
    if plan.kind == A.TORCH_CPU:
        t = A.torch_from_numpy(res)
        if out is not None:
            out.copy_(t)
            return out
        return t
    if out is not None:
        out[...] = res
        return out
    return res


# ------------------------------------------------------------------ Compose front end
class _Step:
    def apply(self, p: Pipeline) -> Pipeline:  # pragma: no cover - every step overrides it
        raise NotImplementedError


@dataclass(frozen=True)
class Resize(_Step):
    """torchvision.transforms.v2.Resize with a (H, W) size and antialias=False."""
    size: Any
    interpolation: str = "bilinear"

    def apply(self, p: Pipeline) -> Pipeline:
        return p.resize(self.size, self.interpolation)


@dataclass(frozen=True)
class Letterbox(_Step):
    size: Any
    fill: Any = 0.0
    interpolation: str = "bilinear"

    def apply(self, p: Pipeline) -> Pipeline:
        return p.letterbox_to(self.size, self.fill, self.interpolation)


@dataclass(frozen=True)
class CenterCrop(_Step):
    """A centered crop of ``size`` (H, W) of each item's crop (before any resize)."""
    size: Any

    def apply(self, p: Pipeline) -> Pipeline:  # applied to the rectangles in Compose.__call__
        return p


@dataclass(frozen=True)
class Normalize(_Step):
    mean: Any
    std: Any

    def apply(self, p: Pipeline) -> Pipeline:
        return p.normalize(self.mean, self.std, p.scale)


@dataclass(frozen=True)
class ToDtype(_Step):
    """torchvision.transforms.v2.ToDtype: ``scale`` divides by the source range (255 for uint8) as
    torchvision does, and must come before Normalize (as in torchvision)."""
    dtype: Any
    scale: bool = False


@dataclass(frozen=True)
class ConvertColor(_Step):
    conversion: Any

    def apply(self, p: Pipeline) -> Pipeline:
        return p.color(self.conversion)


@dataclass(frozen=True)
class HorizontalFlip(_Step):
    def apply(self, p: Pipeline) -> Pipeline:  # (a second flip undoes the first, as in torchvision)
        return p.flip(not p.hflip, p.vflip)


@dataclass(frozen=True)
class VerticalFlip(_Step):
    def apply(self, p: Pipeline) -> Pipeline:
        return p.flip(p.hflip, not p.vflip)


class Compose:
    """A torchvision.transforms.v2.Compose-style front end: ``Compose([CenterCrop(...), Resize(...),
    ToDtype(torch.float16, scale=True), Normalize(mean, std)])(images, rects)`` runs as one Pipeline
    (one kernel). The transforms must follow the Pipeline's order (crop, resize and flips, color,
    ToDtype, Normalize); ToDtype with scale=True before Normalize multiplies by 1 / range first. The
    kernel flips the crop before resizing it: the same as flipping the resized image for a bilinear
    Resize, not for nearest sampling (at ties) nor for a Letterbox (its odd padding pixel), so a flip
    after those raises (put it before them)."""

    _ORDER = {CenterCrop: 0, Resize: 1, Letterbox: 1, HorizontalFlip: 1, VerticalFlip: 1, ConvertColor: 3,
              ToDtype: 4, Normalize: 5}

    def __init__(self, transforms: Sequence[Any], layout: str | None = None):
        self.transforms = list(transforms)
        last, seen = -1, None
        for t in self.transforms:
            rank = self._ORDER.get(type(t))
            if rank is None:
                raise TypeError(_err(f"Compose takes {', '.join(c.__name__ for c in self._ORDER)}; got {t!r}"))
            if rank < last:
                raise ValueError(_err(f"{type(t).__name__} after a later step: the order is crop, resize and "
                                      "flips, color, ToDtype, Normalize"))
            last = rank
            # one step of each kind but flips (two flips undo each other): the Pipeline holds one crop, one
            # size, one color conversion, one cast and one normalization, and a second would have replaced
            # the first (torchvision applies both)
            if not isinstance(t, (HorizontalFlip, VerticalFlip)):
                kind = "Resize or Letterbox" if isinstance(t, (Resize, Letterbox)) else type(t).__name__
                if seen is not None and kind in seen:
                    raise ValueError(_err(f"Compose takes one {kind}; got a second ({t!r}): a fused pipeline "
                                          "applies each kind of step once"))
                seen = (seen or set()) | {kind}
            if isinstance(t, Resize) and isinstance(t.size, (int, np.integer)):
                raise TypeError(_err(f"Resize({t.size!r}) in Compose: pass the output size as (height, width). "
                                     "torchvision's Resize(int) matches the shorter edge, keeping each crop's "
                                     "aspect ratio, so crops of different shapes would not fit one batch"))
        sizing = None  # the Resize or Letterbox met so far
        for t in self.transforms:
            if isinstance(t, (Resize, Letterbox)):
                sizing = t
            elif isinstance(t, (HorizontalFlip, VerticalFlip)) and sizing is not None and (
                    isinstance(sizing, Letterbox) or sizing.interpolation != "bilinear"):
                how = "its padding's odd pixel" if isinstance(sizing, Letterbox) else \
                    f"{sizing.interpolation} sampling at ties"
                raise ValueError(_err(f"{type(t).__name__} after {type(sizing).__name__}"
                                      f"(interpolation={sizing.interpolation!r}): the kernel flips the crop before "
                                      f"resizing it, which differs from flipping the result ({how}); put the flip "
                                      f"before the {type(sizing).__name__}"))
        self.layout = layout
        self._crop = None
        self._todtype = None
        p = Pipeline(layout=layout)
        for t in self.transforms:
            if isinstance(t, CenterCrop):
                self._crop = _size(t.size)
            elif isinstance(t, ToDtype):
                self._todtype = t
                p = p.cast(t.dtype)
            else:
                p = t.apply(p)
        self._pipeline = p
        self._pipelines: dict = {}  # source dtype -> the Pipeline (ToDtype's scale depends on it)

    def _pipeline_for(self, images) -> Pipeline:
        t = self._todtype
        if t is None or not t.scale:
            return self._pipeline
        if isinstance(images, (list, tuple)) and not images:
            raise ValueError(_err("got an empty list of source images"))
        first = images[0] if isinstance(images, (list, tuple)) else images
        if isinstance(first, Planes):
            first = first.planes[0]
        dt = _in_dtype(first, A.array_kind(_NAME, first, "the source image"))
        p = self._pipelines.get(dt)
        if p is None:
            # torchvision's scale=True: from the source's range to the output's (floats: 0 to 1)
            scale = _RANGE[_out_dtype(t.dtype)] / _RANGE[dt]
            p = self._pipelines[dt] = replace(self._pipeline, scale=self._pipeline.scale * scale)
        return p

    def __call__(self, images: Any, rects: Any = None, *, sources: Any = None, out: Array | None = None) -> Array:
        p = self._pipeline_for(images)
        if self._crop is not None:
            kind, dt, _, imgs = _as_images(images, p.layout, p.yuv)
            its = _items(imgs, rects, sources)
            ch, cw = self._crop
            if np.any(its[:, 3] < cw) or np.any(its[:, 4] < ch):
                raise ValueError(_err(f"CenterCrop({self._crop}) is larger than a rectangle; padding is not "
                                      "supported"))
            # torchvision's offsets: int(round((w - cw) / 2.0)), halves to even
            x = its[:, 1] + np.round((its[:, 3] - cw) / 2.0).astype(np.int64)
            y = its[:, 2] + np.round((its[:, 4] - ch) / 2.0).astype(np.int64)
            rects = np.column_stack([x, y, np.full_like(x, cw), np.full_like(y, ch)])
            sources = its[:, 0]
        return p(images, rects, sources=sources, out=out)
