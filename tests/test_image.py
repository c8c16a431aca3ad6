"""cufuse.image: fused crop / resize / letterbox / flip / color / normalize / cast pipelines.

Every result is checked against ``ref_pipeline`` below, a float64 reference
written independently of cufuse (explicit per-pixel loops over the output,
the sample positions from the textbook formula ``(d + 0.5) * in / out - 0.5``
with floats), then against torch's and torchvision's resize conventions where
they are installed. The generated CUDA source of every structure used here
is compiled with NVRTC (no GPU needed); the GPU backends (cupy, torch_cuda)
run the same tests on a device.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cufuse
import cufuse.image as I
from cufuse import _runtime as R

from _reference import BF16

U8, U16, F16, F32 = (np.dtype(t) for t in (np.uint8, np.uint16, np.float16, np.float32))
IN_DTYPES = [U8, U16, F16, F32] + ([BF16] if BF16 is not None else [])
OUT_DTYPES = [U8, F16, F32] + ([BF16] if BF16 is not None else [])

# Tolerances, stated once. The kernel computes in float32 and the fallback in float64: a float output
# may differ from the float64 reference rounded to its dtype by one rounding of that dtype (OUT_RTOL
# times the value) plus float32's error on the magnitudes that were combined (F32_EPS times the largest
# of |source| * scale + |mean| over std); uint8 by one unit (a value near .5 rounds either way).
OUT_RTOL = {U8: 0.0, F16: 2.0**-10, F32: 2.0**-23, **({BF16: 2.0**-7} if BF16 is not None else {})}
F32_EPS = 4e-6
U8_UNITS = 1


def assert_pipeline_close(got, ref, dtype, mag):
    got64 = np.asarray(got).astype(np.float64)
    dt = np.dtype(dtype)
    if dt == U8:
        exp = np.clip(np.rint(ref), 0, 255)
        diff = np.abs(got64 - exp)
        where = np.unravel_index(diff.argmax(), diff.shape)
        assert diff.max(initial=0) <= U8_UNITS, f"uint8: max diff {diff.max()} units at {where}"
        return
    exp = ref.astype(dt).astype(np.float64)  # the reference rounded to the output dtype
    tol = OUT_RTOL[dt] * np.abs(ref) + F32_EPS * mag + 1e-30
    bad = ~(np.abs(got64 - exp) <= tol)
    assert not bad.any(), (f"{dt}: {bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}: "
                           f"got {got64[bad][0]}, expected {exp[bad][0]} (float64 {ref[bad][0]})")


# ----------------------------------------------------------------- the reference
def ref_sample_axis(d, n_in, n_out, interp):
    """(i0, i1, weight of i1) of output coordinate d: the textbook formulas, in floats."""
    if interp == "nearest":
        i = min(int(math.floor(d * n_in / n_out)), n_in - 1)
        return i, i, 0.0
    if interp == "nearest_exact":
        i = min(int(math.floor((d + 0.5) * n_in / n_out)), n_in - 1)
        return i, i, 0.0
    s = (d + 0.5) * n_in / n_out - 0.5
    s = max(s, 0.0)
    i0 = min(int(math.floor(s)), n_in - 1)
    i1 = min(i0 + 1, n_in - 1)
    return i0, i1, s - i0 if i1 != i0 else 0.0


def ref_resize(img, oh, ow, interp):
    """img float64 (h, w, c) -> (oh, ow, c), one output pixel at a time."""
    h, w, c = img.shape
    out = np.zeros((oh, ow, c))
    for dy in range(oh):
        y0, y1, ty = ref_sample_axis(dy, h, oh, interp)
        for dx in range(ow):
            x0, x1, tx = ref_sample_axis(dx, w, ow, interp)
            for k in range(c):
                top = img[y0, x0, k] * (1 - tx) + img[y0, x1, k] * tx
                bottom = img[y1, x0, k] * (1 - tx) + img[y1, x1, k] * tx
                out[dy, dx, k] = top * (1 - ty) + bottom * ty
    return out


def ref_color(img, color):
    if color is None:
        return img
    if color in ("bgr2rgb", "rgb2bgr"):
        return img[:, :, [2, 1, 0]]
    if color in ("rgba2rgb",):
        return img[:, :, :3]
    if color == "rgb2gray":
        return 0.299 * img[:, :, 0:1] + 0.587 * img[:, :, 1:2] + 0.114 * img[:, :, 2:3]
    if color == "bgr2gray":
        return 0.114 * img[:, :, 0:1] + 0.587 * img[:, :, 1:2] + 0.299 * img[:, :, 2:3]
    if isinstance(color, tuple):
        return img[:, :, list(color)]
    raise AssertionError(color)


def ref_pipeline(images, rects, sources, size, interp="bilinear", letterbox=False, fill=0.0, color=None,
                 hflip=False, vflip=False, mean=0.0, std=1.0, scale=1.0, out_layout="NCHW"):
    """float64 result of a pipeline on HWC float64 images (a list), before the cast."""
    res = []
    n = len(rects)
    hf = np.broadcast_to(np.asarray(hflip), (n,))
    vf = np.broadcast_to(np.asarray(vflip), (n,))
    for i, ((x, y, w, h), s) in enumerate(zip(rects, sources)):
        crop = images[s][y:y + h, x:x + w].astype(np.float64)
        if hf[i]:
            crop = crop[:, ::-1]
        if vf[i]:
            crop = crop[::-1]
        oh, ow = size if size is not None else (h, w)
        if letterbox:
            if ow / w <= oh / h:
                nw, nh = ow, int(math.floor(h * ow / w + 0.5))
            else:
                nw, nh = int(math.floor(w * oh / h + 0.5)), oh
            nw, nh = max(1, min(nw, ow)), max(1, min(nh, oh))
        else:
            nw, nh = ow, oh
        body = ref_color(ref_resize(crop, nh, nw, interp if size is not None else "nearest"), color)
        c = body.shape[2]
        canvas = np.zeros((oh, ow, c))
        canvas[:, :] = np.broadcast_to(np.asarray(fill, dtype=np.float64), (c,))
        top, left = (oh - nh) // 2, (ow - nw) // 2
        canvas[top:top + nh, left:left + nw] = body
        v = (canvas * scale - np.asarray(mean, dtype=np.float64)) / np.asarray(std, dtype=np.float64)
        res.append(v.transpose(2, 0, 1) if out_layout == "NCHW" else v)
    return np.stack(res)


def magnitude(images, scale=1.0, mean=0.0, std=1.0):
    src = max(float(np.abs(np.asarray(im, dtype=np.float64)).max()) for im in images)
    return (src * abs(scale) + float(np.max(np.abs(mean)))) / float(np.min(np.abs(std)))


def make_image(rng, shape, dtype):
    dt = np.dtype(dtype)
    if dt == U8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if dt == U16:
        return rng.integers(0, 65536, shape, dtype=np.uint16)
    return (rng.random(shape) * 2 - 0.5).astype(dt)


def to_hwc(x, layout):
    """A NumPy source image (or batch) as a list of HWC float64 images for the reference."""
    x = np.asarray(x, dtype=np.float64)
    if layout == "HWC":
        return [x]
    if layout == "CHW":
        return [x.transpose(1, 2, 0)]
    if layout == "HW":
        return [x[:, :, None]]
    if layout == "NHWC":
        return list(x)
    if layout == "NCHW":
        return list(x.transpose(0, 2, 3, 1))
    raise AssertionError(layout)


# ----------------------------------------------------------------- counting launches
class _Counting:
    """A kernel that records its launches (through the driver's unpacked path, as any kernel not CuPy's own)."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    @property
    def ptr(self):
        return self.fn.ptr

    def __call__(self, grid, block, args, shared=0, stream=None):
        self.calls.append((grid, block, stream))
        return self.fn(grid, block, args, shared, stream=stream)


@pytest.fixture
def image_launches(monkeypatch):
    """The generated pipeline kernels' launches: (grid, block, stream)."""
    calls: list = []
    real = I._function
    monkeypatch.setattr(I, "_function", lambda plan, *args: _Counting(real(plan, *args), calls))
    return calls


def run(backend, images, rects, layout=None, out=None, **kw):
    """process() on the backend's kind; the result as NumPy."""
    imgs = [backend.asarray(x) for x in images] if isinstance(images, list) else backend.asarray(images)
    res = I.process(imgs, rects, layout=layout, out=out, **kw)
    assert backend.is_kind(res)
    return backend.to_numpy(res)


# ----------------------------------------------------------------- tests
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_dtypes_crop_resize_normalize(backend, in_dtype, out_dtype, image_launches):
    rng = np.random.default_rng(1)
    img = make_image(rng, (23, 29, 3), in_dtype)
    rects = [(0, 0, 29, 23), (3, 5, 11, 7), (28, 22, 1, 1), (0, 10, 29, 13), (17, 0, 12, 1)]
    rng_ = {U8: 255.0, U16: 65535.0}.get(np.dtype(in_dtype), 1.0)
    mean, std, scale = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 1.0 / rng_
    if np.dtype(out_dtype) == U8:  # a range that uint8 holds
        mean, std, scale = (10.0, 20.0, 30.0), (1.0, 1.5, 0.5), 200.0 / rng_
    got = run(backend, img, rects, size=(9, 13), mean=mean, std=std, scale=scale, dtype=out_dtype)
    assert got.dtype == np.dtype(out_dtype) and got.shape == (5, 3, 9, 13)
    ref = ref_pipeline([img.astype(np.float64)], rects, [0] * 5, (9, 13), mean=mean, std=std, scale=scale)
    assert_pipeline_close(got, ref, out_dtype, magnitude([img], scale, mean, std))
    assert len(image_launches) == (1 if backend.gpu else 0)


@pytest.mark.parametrize("layout", ["HWC", "CHW"])
def test_int64_row_strides(backend, monkeypatch, layout, image_launches):
    """The kernel built for row strides of 31 bits and more (Index long long), taken here for small
    ones (the bound lowered): the same results as the reference, interleaved and planar sources."""
    monkeypatch.setattr(I, "_NARROW", 1)
    built, function = [], I._function
    monkeypatch.setattr(I, "_function", lambda plan, *args: (built.append(args), function(plan, *args))[1])
    rng = np.random.default_rng(3)
    x = make_image(rng, (19, 23, 3) if layout == "HWC" else (3, 19, 23), U8)
    rects = [(0, 0, 23, 19), (4, 3, 9, 11), (22, 18, 1, 1)]
    got = run(backend, x, rects, layout=layout, size=(7, 10), hflip=[False, True, True], dtype=np.float32)
    hwc = to_hwc(x, layout)
    ref = ref_pipeline(hwc, rects, [0] * 3, (7, 10), hflip=[False, True, True])
    assert_pipeline_close(got, ref, F32, magnitude(hwc))
    assert built == ([(True,)] if backend.gpu else []) and len(image_launches) == (1 if backend.gpu else 0)


@pytest.mark.parametrize("layout", ["HWC", "CHW", "HW", "NHWC", "NCHW"])
@pytest.mark.parametrize("out_layout", ["NCHW", "NHWC"])
def test_layouts(backend, layout, out_layout):
    rng = np.random.default_rng(2)
    shape = {"HWC": (11, 13, 3), "CHW": (3, 11, 13), "HW": (11, 13), "NHWC": (2, 11, 13, 3),
             "NCHW": (2, 3, 11, 13)}[layout]
    x = make_image(rng, shape, U8)
    hwc = to_hwc(x, layout)
    batch = layout.startswith("N")
    rects = [(1, 2, 7, 5), (0, 0, 13, 11), (12, 10, 1, 1)]
    sources = [1, 0, 1] if batch else [0, 0, 0]
    got = run(backend, x, rects, layout=layout, size=(6, 5), sources=sources if batch else None,
              out_layout=out_layout, dtype=np.float32)
    ref = ref_pipeline(hwc, rects, sources, (6, 5), out_layout=out_layout)
    assert_pipeline_close(got, ref, F32, magnitude(hwc))


@pytest.mark.parametrize("interp", ["bilinear", "nearest", "nearest_exact"])
@pytest.mark.parametrize("sizes", [((1, 1), (1, 1)), ((1, 1), (5, 3)), ((1, 7), (1, 3)), ((1, 7), (4, 19)),
                                   ((7, 1), (3, 2)), ((13, 17), (31, 37)), ((37, 31), (5, 7)), ((8, 8), (4, 4)),
                                   ((8, 8), (16, 16))], ids=str)
def test_sizes_upscale_downscale(backend, interp, sizes):
    (h, w), (oh, ow) = sizes
    rng = np.random.default_rng(3)
    img = make_image(rng, (h, w, 3), F32)
    got = run(backend, img, None, size=(oh, ow), interpolation=interp)
    ref = ref_pipeline([img], [(0, 0, w, h)], [0], (oh, ow), interp=interp)
    assert_pipeline_close(got, ref, F32, magnitude([img]))


def test_many_crops_one_launch(backend, image_launches):
    """200 crops (one of one pixel, several touching each border) of three images of different sizes in
    one launch."""
    rng = np.random.default_rng(4)
    imgs = [make_image(rng, s, U8) for s in [(17, 23, 3), (5, 41, 3), (31, 7, 3)]]
    rects, sources = [], []
    for i in range(200):
        s = int(rng.integers(0, 3))
        h, w = imgs[s].shape[:2]
        cw, ch = int(rng.integers(1, w + 1)), int(rng.integers(1, h + 1))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        if i % 7 == 0:
            x, y = w - cw, h - ch  # right and bottom borders
        if i % 11 == 0:
            x, y = 0, 0
        rects.append((x, y, cw, ch))
        sources.append(s)
    rects[5] = (3, 4, 1, 1)
    got = run(backend, imgs, rects, sources=sources, size=(7, 9), mean=(120, 110, 100), std=(60, 50, 40),
              dtype=np.float32)
    ref = ref_pipeline(imgs, rects, sources, (7, 9), mean=(120, 110, 100), std=(60, 50, 40))
    assert_pipeline_close(got, ref, F32, magnitude(imgs, 1, (120, 110, 100), (60, 50, 40)))
    assert len(image_launches) == (1 if backend.gpu else 0)


@pytest.mark.parametrize("color", [None, "bgr2rgb", "rgb2gray", "bgr2gray", (1,), (2, 0)])
def test_colors(backend, color):
    rng = np.random.default_rng(5)
    img = make_image(rng, (9, 10, 3), U8)
    got = run(backend, img, [(1, 1, 8, 7), (0, 0, 10, 9)], size=(5, 6), color=color, dtype=np.float32)
    ref = ref_pipeline([img], [(1, 1, 8, 7), (0, 0, 10, 9)], [0, 0], (5, 6), color=color)
    assert got.shape == ref.shape
    assert_pipeline_close(got, ref, F32, magnitude([img]))


def test_rgba(backend):
    rng = np.random.default_rng(6)
    img = make_image(rng, (6, 7, 4), F16)
    got = run(backend, img, None, size=(3, 4), color="rgba2rgb", dtype=np.float32)
    assert_pipeline_close(got, ref_pipeline([img], [(0, 0, 7, 6)], [0], (3, 4), color="rgba2rgb"), F32,
                          magnitude([img]))
    got = run(backend, img, None, size=(3, 4), dtype=np.float32)  # all four channels
    assert got.shape == (1, 4, 3, 4)


@pytest.mark.parametrize("interp", ["bilinear", "nearest"])
def test_flips(backend, interp):
    rng = np.random.default_rng(7)
    img = make_image(rng, (12, 15, 3), F32)
    rects = [(1, 2, 9, 7), (1, 2, 9, 7), (0, 0, 15, 12), (3, 3, 5, 5)]
    hflip, vflip = [True, False, True, False], [False, True, True, False]
    got = run(backend, img, rects, size=(5, 8), interpolation=interp, hflip=hflip, vflip=vflip)
    ref = ref_pipeline([img], rects, [0] * 4, (5, 8), interp=interp, hflip=hflip, vflip=vflip)
    assert_pipeline_close(got, ref, F32, magnitude([img]))
    # a flip is of the crop, not of the image it came from
    plain = run(backend, img, rects[:1], size=(5, 8), interpolation=interp)
    assert not np.allclose(got[0], plain[0])


@pytest.mark.parametrize("rect,size", [((0, 0, 20, 10), (16, 16)), ((2, 1, 7, 15), (16, 16)),
                                       ((0, 0, 5, 5), (7, 12)), ((3, 3, 1, 1), (5, 4)), ((0, 0, 20, 3), (9, 9)),
                                       ((0, 0, 21, 17), (16, 16)), ((0, 0, 15, 17), (9, 9))],
                         ids=str)
def test_letterbox(backend, rect, size):
    rng = np.random.default_rng(8)
    img = make_image(rng, (17, 21, 3), U8)
    fill = (114.0, 0.0, 255.0)
    got = run(backend, img, [rect], size=size, letterbox=True, fill=fill, mean=(100, 100, 100), std=(50, 50, 50),
              dtype=np.float16)
    ref = ref_pipeline([img], [rect], [0], size, letterbox=True, fill=fill, mean=(100, 100, 100),
                       std=(50, 50, 50))
    assert_pipeline_close(got, ref, F16, magnitude([img], 1, 100, 50))


def test_uint8_output_saturates(backend):
    img = np.array([[[0, 128, 255]]], np.uint8)
    got = run(backend, img, None, size=(2, 2), mean=(10.0, 0.0, -10.0), std=1.0, scale=2.0, dtype=np.uint8)
    assert got[0, :, 0, 0].tolist() == [0, 255, 255]
    got = run(backend, np.array([[[2.5, 3.5, -0.4]]], np.float32), None, dtype=np.uint8)
    assert got[0, :, 0, 0].tolist() == [2, 4, 0]  # round half to even, as OpenCV's saturate_cast


def test_exact_ties_round_as_the_cpu(backend):
    """A 2x bilinear downscale weighs two pixels by 0.5 exactly, whatever the width: a uint8 output
    halfway between two codes rounds half to even, as the float64 reference does. The kernel's
    weight is r / den; a float reciprocal alone gave 0.5 + 1 ulp for some widths (41, 94, 115, ...)."""
    rng = np.random.default_rng(31)
    for w in range(1, 203):
        a = rng.integers(0, 255, w)
        b = a + 1 + 2 * rng.integers(0, (254 - a) // 2 + 1)  # a + an odd number <= 255: every mean a tie
        row = np.stack([a, b], axis=-1).reshape(1, 2 * w).astype(np.uint8)
        got = run(backend, row, None, size=(1, w), dtype=np.uint8)
        exp = np.rint((a + b) / 2.0)
        assert ((a + b) % 2 == 1).all()
        np.testing.assert_array_equal(got[0, 0, 0], exp, err_msg=f"width {w}")


def test_no_resize(backend):
    rng = np.random.default_rng(9)
    img = make_image(rng, (10, 12, 3), U16)
    got = run(backend, img, [(0, 0, 4, 3), (8, 7, 4, 3)], dtype=np.float32, scale=1 / 65535)
    assert got.shape == (2, 3, 3, 4)
    np.testing.assert_allclose(got[1], img[7:10, 8:12].transpose(2, 0, 1) / 65535, rtol=1e-6)
    with pytest.raises(ValueError, match="one size"):
        run(backend, img, [(0, 0, 4, 3), (0, 0, 5, 3)])


def test_views_and_offsets(backend):
    """Non-contiguous sources (a crop view of a bigger array, every other column, a channel-reversed
    view where the kind allows) and out= a view of a poisoned array."""
    rng = np.random.default_rng(10)
    big = make_image(rng, (30, 40, 3), U8)
    x = backend.asarray(big)
    view = x[3:25, 5:39:2]  # offset and column stride 6 elements
    hwc = big[3:25, 5:39:2].astype(np.float64)
    rects = [(0, 0, 17, 22), (16, 21, 1, 1), (2, 3, 9, 8)]
    poison = np.full((3, 3, 10, 16), np.nan, np.float32)
    host = np.full((3, 3, 10, 20), np.nan, np.float32)
    outer = backend.asarray(host)
    out = outer[:, :, :, 2:18]
    res = I.process(view, rects, size=(10, 16), out=out)
    assert res is out
    got = backend.to_numpy(outer)
    assert np.isnan(got[..., :2]).all() and np.isnan(got[..., 18:]).all()  # outside the view: untouched
    assert_pipeline_close(got[..., 2:18], ref_pipeline([hwc], rects, [0] * 3, (10, 16)), F32, 255.0)
    assert poison.shape == got[..., 2:18].shape
    if backend.negative_strides:
        rev = x[:, ::-1, ::-1]  # mirrored columns, BGR
        got = backend.to_numpy(I.process(rev, [(1, 1, 30, 20)], size=(7, 9)))
        ref = ref_pipeline([big[:, ::-1, ::-1].astype(np.float64)], [(1, 1, 30, 20)], [0], (7, 9))
        assert_pipeline_close(got, ref, F32, 255.0)


@pytest.mark.parametrize("interp", ["bilinear", "nearest"])
def test_odd_offsets_and_downscales(backend, interp):
    """Interleaved uint8 sources at an odd byte offset with rows of 609 bytes (neither the image's
    first byte nor its rows 16-byte aligned), every downscale from 1x to 6x, output widths that
    leave a warp's last lanes idle, a flipped crop, letterbox padding beside sampled columns, and a
    mirrored view (a negative column stride) where the kind has them."""
    rng = np.random.default_rng(36)
    big = make_image(rng, (40, 210, 3), U8)
    x = backend.asarray(big)
    view, ref_img = x[2:39, 1:204], big[2:39, 1:204].astype(np.float64)
    for ow in (203, 101, 81, 67, 34):
        got = backend.to_numpy(I.process(view, None, size=(9, ow), interpolation=interp))
        assert_pipeline_close(got, ref_pipeline([ref_img], [(0, 0, 203, 37)], [0], (9, ow), interp=interp), F32, 255.0)
    rects = [(0, 0, 203, 37), (5, 3, 150, 30)]
    got = backend.to_numpy(I.process(view, rects, size=(7, 90), interpolation=interp, hflip=[True, False]))
    ref = ref_pipeline([ref_img], rects, [0, 0], (7, 90), interp=interp, hflip=[True, False])
    assert_pipeline_close(got, ref, F32, 255.0)
    got = backend.to_numpy(I.process(view, [(0, 0, 203, 18)], size=(20, 75), interpolation=interp, letterbox=True))
    ref = ref_pipeline([ref_img], [(0, 0, 203, 18)], [0], (20, 75), interp=interp, letterbox=True)
    assert_pipeline_close(got, ref, F32, 255.0)
    if backend.negative_strides:
        got = backend.to_numpy(I.process(view[:, ::-1], None, size=(9, 81), interpolation=interp))
        ref = ref_pipeline([ref_img[:, ::-1]], [(0, 0, 203, 37)], [0], (9, 81), interp=interp)
        assert_pipeline_close(got, ref, F32, 255.0)


def test_planar_split(backend):
    """out= one [N, H, W] array per output channel (separate arrays, or views of one), poisoned first."""
    rng = np.random.default_rng(24)
    img = make_image(rng, (12, 14, 3), U8)
    rects = [(0, 0, 14, 12), (2, 3, 5, 4)]
    ref = ref_pipeline([img], rects, [0, 0], (6, 7), color="bgr2rgb", mean=(1, 2, 3), std=(3, 2, 1))
    planes = [backend.full((2, 6, 7), np.nan, np.float32) for _ in range(3)]
    res = I.process(backend.asarray(img), rects, size=(6, 7), color="bgr2rgb", mean=(1, 2, 3), std=(3, 2, 1),
                    out=planes)
    assert res is planes
    got = np.stack([backend.to_numpy(p) for p in planes], axis=1)
    assert_pipeline_close(got, ref, F32, 255.0)
    block = backend.full((3, 2, 6, 9), np.nan, np.float32)
    views = [block[k, :, :, 1:8] for k in range(3)]
    I.process(backend.asarray(img), rects, size=(6, 7), color="bgr2rgb", mean=(1, 2, 3), std=(3, 2, 1), out=views)
    got = backend.to_numpy(block)
    assert np.isnan(got[..., 0]).all() and np.isnan(got[..., 8]).all()
    assert_pipeline_close(got[..., 1:8].transpose(1, 0, 2, 3), ref, F32, 255.0)
    with pytest.raises(ValueError, match="one \\[N, H, W\\] array per output channel: 3, got 2"):
        I.process(backend.asarray(img), rects, size=(6, 7), out=planes[:2])
    with pytest.raises(ValueError, match="overlap"):
        I.process(backend.asarray(img), rects, size=(6, 7), out=[planes[0], planes[1], planes[0]])


def test_out_overlapping_the_source(backend):
    """out= that is the source's own memory: written through a temporary (the same values as without)."""
    rng = np.random.default_rng(11)
    img = make_image(rng, (1, 3, 8, 8), F32)
    x = backend.asarray(img)
    expect = backend.to_numpy(I.process(x, None, layout="NCHW", size=(8, 8), hflip=True))
    res = I.process(x, None, layout="NCHW", size=(8, 8), hflip=True, out=x)
    np.testing.assert_array_equal(backend.to_numpy(res), expect)


def test_pipeline_object_and_values_are_arguments(backend, image_launches):
    """A Pipeline composed once; new rectangles, flips and mean reuse the compiled structure."""
    pipe = (I.Pipeline().resize((6, 7)).color("bgr2rgb").normalize((1, 2, 3), (4, 5, 6), scale=0.5)
            .cast("float16").write("NHWC"))
    rng = np.random.default_rng(12)
    img = make_image(rng, (14, 15, 3), U8)
    x = backend.asarray(img)
    before = set(I._fns)  # (structures other tests compiled in this process)
    for rects in ([(0, 0, 15, 14)], [(1, 2, 3, 4), (5, 5, 10, 9)]):
        got = backend.to_numpy(pipe(x, rects))
        ref = ref_pipeline([img], rects, [0] * len(rects), (6, 7), color="bgr2rgb", mean=(1, 2, 3),
                           std=(4, 5, 6), scale=0.5, out_layout="NHWC")
        assert_pipeline_close(got, ref, F16, magnitude([img], 0.5, (1, 2, 3), (4, 5, 6)))
    got = backend.to_numpy(pipe.normalize(0, 1, 1.0)(x, [(1, 2, 3, 4)], hflip=[True]))
    ref = ref_pipeline([img], [(1, 2, 3, 4)], [0], (6, 7), color="bgr2rgb", hflip=[True], out_layout="NHWC")
    assert_pipeline_close(got, ref, F16, 255.0)
    if backend.gpu:
        assert len(image_launches) == 3
        assert len(set(I._fns) - before) <= 1  # one structure, one kernel (none if another test made it)
        assert any(k[0][:2] == (U8.str, F16.str) for k in I._fns)


def test_repeated_calls(backend, image_launches, monkeypatch):
    """One Pipeline called again with the same signature and new pixels (the fast path on GPU kinds: no
    planning again), into a new output and into out=."""
    pipe = I.Pipeline().resize((9, 5)).normalize(10, 20).cast("float16")
    plans = []
    real = I._plan
    monkeypatch.setattr(I, "_plan", lambda *a: plans.append(1) or real(*a))
    rng = np.random.default_rng(25)
    rects = np.array([[0, 0, 11, 13], [4, 5, 7, 8]])
    out = backend.full((2, 3, 9, 5), np.nan, np.float16)
    for _ in range(3):
        img = make_image(rng, (13, 11, 3), U8)
        x = backend.asarray(img)
        ref = ref_pipeline([img], rects.tolist(), [0, 0], (9, 5), mean=10, std=20)
        assert_pipeline_close(backend.to_numpy(pipe(x, rects)), ref, F16, 13.0)
        assert pipe(x, rects, out=out) is out
        assert_pipeline_close(backend.to_numpy(out), ref, F16, 13.0)
    assert len(plans) == (2 if backend.gpu else 6)
    assert len(image_launches) == (6 if backend.gpu else 0)


def test_compose(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    img = make_image(rng, (20, 24, 3), U8)
    tf = I.Compose([I.CenterCrop((10, 12)), I.Resize((5, 7)), I.ToDtype(torch.float16, scale=True),
                    I.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    got = backend.to_numpy(tf(backend.asarray(img), [(0, 0, 24, 20), (3, 1, 15, 13)]))
    # torchvision's CenterCrop offsets: round((24 - 12) / 2) = 6, round((20 - 10) / 2) = 5; (15 - 12) / 2 -> 2,
    # (13 - 10) / 2 = 1.5 -> 2 (halves to even)
    rects = [(6, 5, 12, 10), (3 + 2, 1 + 2, 12, 10)]
    ref = ref_pipeline([img], rects, [0, 0], (5, 7), scale=1 / 255, mean=(0.485, 0.456, 0.406),
                       std=(0.229, 0.224, 0.225))
    assert_pipeline_close(got, ref, F16, magnitude([img], 1 / 255, 0.485, 0.224))
    with pytest.raises(ValueError, match="order"):
        I.Compose([I.Normalize(0, 1), I.Resize(4)])


def test_compose_flip_and_resize_order(backend):
    """Compose flips before or after a bilinear Resize alike (they commute: the
    same as torch's flip of the resized image); before a nearest Resize it is
    torch's flip-then-resize, and after a nearest Resize or a Letterbox (where
    the kernel's flip-first would differ) it raises."""
    torch = pytest.importorskip("torch")
    x = np.arange(3 * 5, dtype=np.float32).reshape(3, 5, 1) * 7 % 11
    xt = torch.from_numpy(x).permute(2, 0, 1)[None].double()
    up = torch.nn.functional.interpolate(xt, size=(2, 4), mode="bilinear", align_corners=False)
    for tf in (I.Compose([I.Resize((2, 4)), I.HorizontalFlip()]), I.Compose([I.HorizontalFlip(), I.Resize((2, 4))])):
        got = backend.to_numpy(tf(backend.asarray(x)))
        np.testing.assert_allclose(got, up.flip(-1).numpy(), rtol=1e-5, atol=1e-5)
    got = backend.to_numpy(I.Compose([I.HorizontalFlip(), I.Resize((2, 4), "nearest")])(backend.asarray(x)))
    ref = torch.nn.functional.interpolate(xt.flip(-1), size=(2, 4), mode="nearest")
    np.testing.assert_array_equal(got, ref.numpy())
    # two flips undo each other, as torchvision's (on either side of a bilinear Resize too)
    for tf in (I.Compose([I.HorizontalFlip(), I.HorizontalFlip(), I.Resize((2, 4))]),
               I.Compose([I.HorizontalFlip(), I.Resize((2, 4)), I.HorizontalFlip()])):
        np.testing.assert_allclose(backend.to_numpy(tf(backend.asarray(x))), up.numpy(), rtol=1e-5, atol=1e-5)
    for sizing in (I.Resize((2, 4), "nearest"), I.Letterbox((4, 4))):
        for flip in (I.HorizontalFlip(), I.VerticalFlip()):
            with pytest.raises(ValueError, match="put the flip before"):
                I.Compose([sizing, flip])


def test_compose_refuses_what_one_pipeline_cannot_apply():
    """A second step of a kind (each had replaced the one before: two Resizes ran as the second alone,
    two Normalizes as the second) and torchvision's Resize(int) (the shorter edge: a size per crop) raise;
    hflip / vflip take bools (the string "False" had flipped)."""
    for steps in ([I.Resize((15, 20)), I.Resize((10, 10))], [I.Normalize(0, 1), I.Normalize(1, 2)],
                  [I.Letterbox((16, 16)), I.Resize((8, 8))], [I.CenterCrop(10), I.CenterCrop(20)],
                  [I.ConvertColor("bgr2rgb"), I.ConvertColor("rgb2gray")],
                  [I.ToDtype(np.float32), I.ToDtype(np.float16)]):
        with pytest.raises(ValueError, match="Compose takes one"):
            I.Compose(steps)
    with pytest.raises(TypeError, match="shorter edge"):
        I.Compose([I.Resize(20)])
    x = np.arange(6, dtype=np.uint8).reshape(1, 6, 1)
    for bad in ("False", 0.5, [2]):
        with pytest.raises(ValueError, match="hflip must be a bool"):
            I.Pipeline().cast(np.uint8)(x, hflip=bad)
    np.testing.assert_array_equal(I.Pipeline().cast(np.uint8)(x, hflip=1)[0, 0, 0], [5, 4, 3, 2, 1, 0])
    # the GPU fast path's key of the flags takes what _flags takes (it had read [2, 2] and "abc" as true)
    for bad in ([2, 2, 2], "abc", ["False"] * 3, 0.5):
        with pytest.raises(TypeError):
            I._flag_key(bad)
    assert I._flag_key([True, 0, 1]) == (1, 0, 1)


# ----------------------------------------------------------------- YUV
# Published matrices: BT.601 R = Y + 1.402 V, G = Y - 0.344136 U - 0.714136 V, B = Y + 1.772 U;
# BT.709 R = Y + 1.5748 V, G = Y - 0.187324 U - 0.468124 V, B = Y + 1.8556 U (U, V centered on 0).
# Limited range: Y' = (Y - 16) * 255 / 219, U' = (U - 128) * 255 / 224.
PUBLISHED = {"bt601": (1.402, -0.344136, -0.714136, 1.772), "bt709": (1.5748, -0.187324, -0.468124, 1.8556)}


def ref_yuv_to_rgb(y, u, v, matrix, full_range):
    rv, gu, gv, bu = PUBLISHED[matrix]
    if full_range:
        yy, uu, vv = y, u - 128.0, v - 128.0
    else:
        yy, uu, vv = (y - 16.0) * 255 / 219, (u - 128.0) * 255 / 224, (v - 128.0) * 255 / 224
    rgb = np.stack([yy + rv * vv, yy + gu * uu + gv * vv, yy + bu * uu], axis=-1)
    return np.clip(rgb, 0, 255)


def make_yuv(rng, h, w, fmt):
    """(frame array, Y, U, V) of a 4:2:0 frame, U and V at (h/2, w/2)."""
    y = rng.integers(0, 256, (h, w), dtype=np.uint8)
    u = rng.integers(0, 256, (h // 2, w // 2), dtype=np.uint8)
    v = rng.integers(0, 256, (h // 2, w // 2), dtype=np.uint8)
    if fmt == "nv12":
        uv = np.stack([u, v], axis=-1).reshape(h // 2, w)
        frame = np.concatenate([y, uv], axis=0)
    else:
        frame = np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)]).reshape(h * 3 // 2, w)
    return frame, y, u, v


@pytest.mark.parametrize("fmt", ["nv12", "i420"])
@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
@pytest.mark.parametrize("full_range", [False, True])
def test_yuv(backend, fmt, matrix, full_range):
    rng = np.random.default_rng(14)
    h, w = 10, 14
    frame, y, u, v = make_yuv(rng, h, w, fmt)
    up = lambda p: np.repeat(np.repeat(p, 2, axis=0), 2, axis=1)  # noqa: E731 - chroma of each pixel
    rgb = ref_yuv_to_rgb(y.astype(np.float64), up(u).astype(np.float64), up(v).astype(np.float64), matrix,
                         full_range)
    rects = [(0, 0, w, h), (3, 1, 7, 6), (13, 9, 1, 1)]
    got = run(backend, frame, rects, yuv=fmt, matrix=matrix, full_range=full_range, size=(6, 8),
              dtype=np.float32)
    ref = ref_pipeline([rgb], rects, [0] * 3, (6, 8))
    assert_pipeline_close(got, ref, F32, 255.0 * 3)
    # the pixels themselves, without a resize: the published matrix at each pixel
    got = run(backend, frame, None, yuv=fmt, matrix=matrix, full_range=full_range, color="bgr",
              dtype=np.float32)
    assert_pipeline_close(got, rgb[None, :, :, ::-1].transpose(0, 3, 1, 2), F32, 255.0 * 3)


@pytest.mark.parametrize("dtype", [U16, F32])
@pytest.mark.parametrize("full_range", [False, True])
def test_yuv_16_bit_and_float(backend, dtype, full_range):
    """uint16 frames hold the 8-bit levels shifted left by 8 (16-bit video), float frames the 8-bit levels
    over 255 (chroma centered on 128 / 255): limited and full range give the 8-bit result scaled to the
    range (white at its top, neutral chroma neutral)."""
    rng = np.random.default_rng(41)
    frame, y, u, v = make_yuv(rng, 6, 10, "i420")
    wide = frame.astype(np.uint16) * 256 if dtype == U16 else frame.astype(np.float32) / 255
    got8 = run(backend, frame, None, yuv="i420", size=(4, 6), dtype=np.float32, full_range=full_range)
    got = run(backend, wide, None, yuv="i420", size=(4, 6), dtype=np.float32, full_range=full_range)
    factor = 257.0 if dtype == U16 else 1 / 255
    np.testing.assert_allclose(got, got8 * factor, rtol=1e-5, atol=1e-5 * factor * 255)


def test_yuv_letterbox_like_the_benchmark(backend):
    rng = np.random.default_rng(15)
    frame, y, u, v = make_yuv(rng, 18, 32, "nv12")
    up = lambda p: np.repeat(np.repeat(p, 2, axis=0), 2, axis=1)  # noqa: E731
    rgb = ref_yuv_to_rgb(y.astype(np.float64), up(u).astype(np.float64), up(v).astype(np.float64), "bt601", False)
    got = run(backend, frame, None, yuv="nv12", size=(16, 16), letterbox=True, fill=114, scale=1 / 255,
              dtype=np.float16)
    ref = ref_pipeline([rgb], [(0, 0, 32, 18)], [0], (16, 16), letterbox=True, fill=114, scale=1 / 255)
    assert_pipeline_close(got, ref, F16, 3.0)


def test_nv12_pitched_rows(backend):
    """An NV12 frame whose rows are padded (a decoder's pitch): a column slice of a wider array."""
    rng = np.random.default_rng(16)
    frame, y, u, v = make_yuv(rng, 8, 12, "nv12")
    wide = np.zeros((12, 20), np.uint8)
    wide[:, :12] = frame
    x = backend.asarray(wide)[:, :12]
    up = lambda p: np.repeat(np.repeat(p, 2, axis=0), 2, axis=1)  # noqa: E731
    rgb = ref_yuv_to_rgb(y.astype(np.float64), up(u).astype(np.float64), up(v).astype(np.float64), "bt709", True)
    got = backend.to_numpy(I.process(x, None, yuv="nv12", matrix="bt709", full_range=True, size=(5, 7)))
    assert_pipeline_close(got, ref_pipeline([rgb], [(0, 0, 12, 8)], [0], (5, 7)), F32, 255.0 * 3)


def _planes_of(backend, frame, fmt, h, w, pad):
    """The frame's planes as separate arrays of the backend, rows padded by ``pad`` (views of wider
    arrays), the UV plane of NV12 as [H / 2, W] or, every other call, [H / 2, W / 2, 2]."""
    def padded(a):
        wide = np.zeros((a.shape[0], a.shape[1] + pad) + a.shape[2:], a.dtype)
        wide[:, :a.shape[1]] = a
        return backend.asarray(wide)[:, :a.shape[1]]
    y = padded(frame[:h])
    if fmt == "nv12":
        uv = frame[h:]
        return I.Planes(y, padded(uv) if pad % 2 else padded(uv.reshape(h // 2, w // 2, 2)))
    flat = frame.reshape(-1)
    q = (h // 2) * (w // 2)
    return I.Planes(y, padded(flat[h * w:h * w + q].reshape(h // 2, w // 2)),
                    padded(flat[h * w + q:].reshape(h // 2, w // 2)))


@pytest.mark.parametrize("fmt", ["nv12", "i420"])
@pytest.mark.parametrize("pad", [0, 3])
def test_yuv_planes(backend, fmt, pad):
    """Frames given as separate planes (a decoder's surface), alone and as a list with a frame of one
    array: the same pixels as the one-array frame."""
    rng = np.random.default_rng(27)
    frame, y, u, v = make_yuv(rng, 10, 14, fmt)
    frame2, *_ = make_yuv(rng, 6, 8, fmt)
    planes = _planes_of(backend, frame, fmt, 10, 14, pad)
    expect = run(backend, frame, [(1, 1, 9, 7)], yuv=fmt, size=(5, 6))
    got = backend.to_numpy(I.process(planes, [(1, 1, 9, 7)], yuv=fmt, size=(5, 6)))
    np.testing.assert_array_equal(got, expect)
    both = I.process([backend.asarray(frame2), planes], [(0, 0, 8, 6), (1, 1, 9, 7)], sources=[0, 1], yuv=fmt,
                     size=(5, 6))
    np.testing.assert_array_equal(backend.to_numpy(both)[1], expect[0])
    np.testing.assert_array_equal(backend.to_numpy(both)[0], run(backend, frame2, None, yuv=fmt, size=(5, 6))[0])
    with pytest.raises(ValueError, match="must be|is Planes"):
        I.process(I.Planes(planes.planes[0], planes.planes[0]), yuv=fmt, size=3)
    with pytest.raises(TypeError, match="yuv read"):
        I.process(planes, size=3)


# ----------------------------------------------------------------- torch / torchvision conventions
_TORCH_MODES = [("bilinear", "bilinear"), ("nearest", "nearest"), ("nearest-exact", "nearest_exact")]
_TORCH_SIZES = [((5, 7), (4, 6)), ((7, 5), (13, 11)), ((31, 17), (7, 29)), ((1, 9), (2, 4))]
# 1080p -> 224 for bilinear only: torch's nearest index is floor(d * float32(in / out)), which at
# 1920 -> 224, column 119 (exactly 1020) takes 1019; cufuse's is the exact floor(d * in / out).
_TORCH_CASES = [(m, i, s) for m, i in _TORCH_MODES for s in _TORCH_SIZES] + [
    ("bilinear", "bilinear", ((1080, 1920), (224, 224)))]


@pytest.mark.parametrize("mode,interp,sizes", _TORCH_CASES, ids=str)
def test_matches_torch_interpolate(backend, mode, interp, sizes):
    """torch.nn.functional.interpolate(align_corners=False, antialias=False): what torchvision's resize
    does with antialias=False."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    (h, w), (oh, ow) = sizes
    rng = np.random.default_rng(17)
    img = make_image(rng, (3, h, w), F32)
    got = run(backend, img, None, layout="CHW", size=(oh, ow), interpolation=interp)
    kw = {"align_corners": False, "antialias": False} if mode == "bilinear" else {}
    ref = F.interpolate(torch.from_numpy(img)[None], size=(oh, ow), mode=mode, **kw).numpy()
    # torch computes the sample position in float32 (cufuse's index is exact): its weights may be off by
    # two float32 spacings of the coordinate, times the range of the values
    atol = 1e-5 + 2 * float(np.spacing(np.float32(max(h, w)))) * float(img.max() - img.min())
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=atol)


def test_matches_torchvision_resize_uint8(backend):
    """torchvision.transforms.v2.functional.resize(antialias=False) on uint8: within one unit."""
    pytest.importorskip("torch")
    try:
        import torch
        from torchvision.transforms.v2 import functional as TF
    except Exception as e:  # not installed, or a build that does not match torch
        pytest.skip(f"torchvision not usable: {type(e).__name__}: {e}")
    rng = np.random.default_rng(18)
    img = make_image(rng, (3, 61, 83), U8)
    for rect, size in [((0, 0, 83, 61), (32, 40)), ((7, 3, 50, 41), (97, 113))]:
        x, y, w, h = rect
        got = run(backend, img, [rect], layout="CHW", size=size, dtype=np.uint8)
        ref = TF.resize(TF.crop(torch.from_numpy(img), y, x, h, w), list(size), antialias=False).numpy()
        assert np.abs(got[0].astype(int) - ref.astype(int)).max() <= 1


@pytest.mark.parametrize("sizes", [((61, 83), (32, 40)), ((41, 50), (97, 113)), ((1080, 1920), (224, 224)),
                                   ((7, 1), (3, 5))], ids=str)
def test_matches_opencv(backend, sizes):
    """OpenCV's INTER_LINEAR (uint8 in fixed point: within one unit; float32: within float32's error on the
    coordinate), INTER_NEAREST (floor(d * in / out): equal), BGR2GRAY (uint8: within one unit)."""
    cv2 = pytest.importorskip("cv2")
    (h, w), (oh, ow) = sizes
    rng = np.random.default_rng(22)
    img = make_image(rng, (h, w, 3), U8)
    got = run(backend, img, None, size=(oh, ow), dtype=np.uint8, out_layout="NHWC")[0]
    ref = cv2.resize(img, (ow, oh), interpolation=cv2.INTER_LINEAR)
    assert np.abs(got.astype(int) - ref.reshape(oh, ow, 3).astype(int)).max() <= 1
    f = img.astype(np.float32) / 255
    got = run(backend, f, None, size=(oh, ow), out_layout="NHWC")[0]
    ref = cv2.resize(f, (ow, oh), interpolation=cv2.INTER_LINEAR).reshape(oh, ow, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 + 2 * float(np.spacing(np.float32(max(h, w)))))
    if oh <= h and ow <= w and h % oh == 0 and w % ow == 0:  # nearest where the scale is exact in binary too
        got = run(backend, img, None, size=(oh, ow), interpolation="nearest", dtype=np.uint8, out_layout="NHWC")[0]
        np.testing.assert_array_equal(got, cv2.resize(img, (ow, oh), interpolation=cv2.INTER_NEAREST).reshape(
            oh, ow, 3))
    got = run(backend, img, None, color="bgr2gray", dtype=np.uint8)[0, 0]
    assert np.abs(got.astype(int) - cv2.cvtColor(img, cv2.COLOR_BGR2GRAY).astype(int)).max() <= 1


@pytest.mark.parametrize("matrix,full_range", [("bt601", False)])
def test_matches_opencv_nv12(backend, matrix, full_range):
    """OpenCV's COLOR_YUV2RGB_NV12 / _I420 (BT.601, limited range, in fixed point): within two units, for
    levels inside the video range (OpenCV also raises a Y below 16 to 16 before converting; cufuse
    converts every level with the published formula)."""
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(23)
    for fmt, code in (("nv12", cv2.COLOR_YUV2RGB_NV12), ("i420", cv2.COLOR_YUV2RGB_I420)):
        frame, *_ = make_yuv(rng, 12, 18, fmt)
        frame = np.clip(frame, 16, 235)
        got = run(backend, frame, None, yuv=fmt, matrix=matrix, full_range=full_range, dtype=np.uint8,
                  out_layout="NHWC")[0]
        assert np.abs(got.astype(int) - cv2.cvtColor(frame, code).astype(int)).max() <= 2


# ----------------------------------------------------------------- errors, before any launch
@pytest.mark.parametrize("call,exc,match", [
    (lambda x: I.process(x, [(0, 0, 9, 5)], size=4), ValueError, r"rectangle 0 \(x=0, y=0, w=9, h=5\) lies outside"),
    (lambda x: I.process(x, [(-1, 0, 2, 2)], size=4), ValueError, "lies outside"),
    # x + w beyond int64 (it wrapped negative and passed), w beyond it, and a uint64 beyond int64
    (lambda x: I.process(x, np.array([[2 ** 63 - 1, 0, 1, 1]]), size=4), ValueError, "lies outside"),
    (lambda x: I.process(x, np.array([[1, 0, 2 ** 63 - 1, 1]]), size=4), ValueError, "lies outside"),
    (lambda x: I.process(x, np.array([[0, 0, 2 ** 64 - 1, 1]], np.uint64), size=4), ValueError, "beyond any image"),
    (lambda x: I.process(x, [(0, 0, 0, 2)], size=4), ValueError, "is empty"),
    (lambda x: I.process(x, [(0, 0, 2, 2)], size=(0, 3)), ValueError, "output height must be >= 1"),
    (lambda x: I.process(x, [(0, 0, 2.5, 2)], size=3), TypeError, "must be integers"),
    (lambda x: I.process(x, [(0, 0, 2)], size=3), ValueError, r"shape \(N, 4\)"),
    (lambda x: I.process(x, size=3, mean=(1, 2)), ValueError, "mean must be one value or 3"),
    (lambda x: I.process(x, size=3, std=(1, 0, 1)), ValueError, "std must be finite and nonzero"),
    # None (NaN as a float64) was taken: NaN results, 0 after a uint8 cast
    (lambda x: I.process(x, size=3, mean=None), TypeError, "mean must be a number or one number per output"),
    (lambda x: I.process(x, size=3, mean=(None, 1, 2)), TypeError, "mean must be a number"),
    (lambda x: I.process(x, size=3, mean=(0, float("nan"), 0)), ValueError, "mean must be finite"),
    (lambda x: I.process(x, size=3, letterbox=True, fill=None), TypeError, "fill must be a number"),
    (lambda x: I.process(x, size=3, mean=[[1, 2, 3]]), ValueError, r"got shape \(1, 3\)"),
    (lambda x: I.process(np.zeros((3, 8, 8), np.uint8), size=4), ValueError, "or layout='CHW'"),
    (lambda x: I.process(x, size=3, dtype=np.int32), TypeError, "output dtype must be one of uint8"),
    (lambda x: I.process(x, size=3, layout="WHC"), ValueError, "layout must be one of"),
    (lambda x: I.process(x, size=3, layout="NHWC"), ValueError, "needs a 4-D array"),
    (lambda x: I.process(x, size=3, interpolation="cubic"), ValueError, "interpolation must be one of"),
    (lambda x: I.process(x, size=3, color="rgb2hsv"), ValueError, "color must be one of"),
    (lambda x: I.process(x, size=3, color=(0, 3)), ValueError, "indices of the 3 source channels"),
    (lambda x: I.process(x, size=3, color="rgba2rgb"), ValueError, "needs 4-channel"),
    (lambda x: I.process(x, [(0, 0, 2, 2)] * 2, size=3, hflip=[True]), ValueError, "hflip must be a bool or 2"),
    (lambda x: I.process([x, x], [(0, 0, 2, 2)] * 3, size=3), ValueError, "pass sources="),
    (lambda x: I.process([x, x], [(0, 0, 2, 2)], sources=[2], size=3), ValueError, "sources must index"),
    (lambda x: I.process([], size=3), ValueError, "empty list"),
    (lambda x: I.process(x, size=3, yuv="nv21"), ValueError, "yuv must be one of"),
    (lambda x: I.process(x, size=3, yuv="nv12"), ValueError, "2-D array"),
    (lambda x: I.process(x[:, :, 0], size=3, yuv="nv12"), ValueError, "must be even"),
    (lambda x: I.process(x, None, letterbox=True), ValueError, "letterbox needs a size"),
    (lambda x: I.process(x, None, size=(60000, 60000)), ValueError, "at most 2\\*\\*30"),
    (lambda x: I.process(np.zeros((1, 40000), np.uint8), None, size=(1, 30000)), ValueError,
     "32-bit index arithmetic"),
    (lambda x: I.process(np.zeros((1, 2**22), np.uint8), None, size=1), ValueError, "at most 2\\*\\*22 - 1"),
    # string flags ("False" was true: full range, a letterbox)
    (lambda x: I.process(np.full((6, 4), 100, np.uint8), yuv="nv12", full_range="False"), TypeError,
     "full_range must be a bool"),
    (lambda x: I.process(x, size=4, letterbox="False"), TypeError, "letterbox must be a bool"),
    # empty frames (were accepted: empty results, or an IndexError)
    (lambda x: I.process(np.zeros((0, 4), np.uint8), yuv="nv12"), ValueError, "empty nv12 frame"),
    (lambda x: I.process(np.zeros((3, 0), np.uint8), yuv="nv12", size=4), ValueError, "empty nv12 frame"),
    (lambda x: I.process(I.Planes(np.zeros((2, 0), np.uint8), np.zeros((1, 0), np.uint8)), yuv="nv12"),
     ValueError, "nonzero height and width"),
    (lambda x: I.process(x, [(np.inf, 0, 2, 2)], size=3), TypeError, "must be integers"),
    (lambda x: I.process(x, [(0, 0, 2, 2), (0, 0, 2)], size=3), ValueError, r"rects must be \(x, y, w, h\)"),
    (lambda x: I.process(x, size=3, scale=float("nan")), ValueError, "scale must be finite"),
    # more than 4 channels with the layout given: no advice to give that layout
    (lambda x: I.process(np.zeros((1, 6, 4, 4), np.uint8), layout="NCHW"), ValueError,
     r"keep\)$"),
    # a Pipeline built directly is checked as the step methods check (a yuy2 frame was read as nv12)
    (lambda x: I.Pipeline(yuv="yuy2"), ValueError, "yuv must be one of"),
    (lambda x: I.Pipeline(out_layout="HWC"), ValueError, "output layout must be one of"),
    (lambda x: I.Pipeline(size=(0, 3)), ValueError, "output height must be >= 1"),
    (lambda x: I.Pipeline(interpolation="bicubic"), ValueError, "interpolation must be one of"),
    (lambda x: I.Pipeline(yuv="nv12", matrix="bt2020"), ValueError, "matrix must be one of"),
    (lambda x: I.Pipeline(dtype=np.int32), TypeError, "output dtype must be one of"),
])
def test_errors(call, exc, match):
    x = np.zeros((5, 8, 3), np.uint8)
    with pytest.raises(exc, match=match):
        call(x)


def test_list_of_batches_with_their_layout(backend):
    """A list of NHWC batches reads as their images, with layout= given or not (given, it was refused)."""
    a = np.random.default_rng(31).integers(0, 255, (2, 5, 6, 3)).astype(np.uint8)
    b = np.random.default_rng(32).integers(0, 255, (1, 4, 7, 3)).astype(np.uint8)
    want = run(backend, [a[0], a[1], b[0]], None, size=(3, 3))
    for layout in (None, "NHWC"):
        got = run(backend, [a, b], None, size=(3, 3), layout=layout)
        np.testing.assert_array_equal(got, want, err_msg=str(layout))


def test_values_are_copied():
    """A pipeline keeps its mean, std and fill as given when it was built: a NumPy array changed in
    place afterwards changes nothing (a warm GPU pipeline kept the old values, the CPU path read the
    new ones). A scale that is no number is refused with the module's message."""
    img = np.full((5, 7, 3), 100, np.uint8)
    m, f = np.array([10.0, 20.0, 30.0]), np.array([1.0, 2.0, 3.0])
    p = I.Pipeline().letterbox_to((6, 6), fill=f).normalize(m, 2.0)
    first = p(img)
    m[:], f[:] = 0.0, 0.0
    np.testing.assert_array_equal(p(img), first)
    assert first[0, 0, 0, 0] == (1.0 - 10.0) / 2.0  # a fill pixel: fill, normalized
    for bad in ([1, 2], None, "2"):
        with pytest.raises(TypeError, match="scale must be one number"):
            I.Pipeline().normalize(scale=bad)


def test_infinities_without_interpolation(backend):
    """A float source's inf and -inf pixels stay inf through the nearest resizes and no resize at
    all, and a uint8 cast saturates them to 255 and 0, on the GPU and the CPU alike (the CPU path
    took a + 0 (b - a): NaN, then 0)."""
    x = np.array([[[1.0], [np.inf], [-np.inf], [2.0]]], np.float32)  # 1x4, one channel
    for kw, want in (({}, [1, np.inf, -np.inf, 2]),
                     ({"size": (1, 8), "interpolation": "nearest"}, [1, 1, np.inf, np.inf, -np.inf, -np.inf, 2, 2]),
                     ({"size": (1, 2), "interpolation": "nearest_exact"}, [np.inf, 2])):
        got = run(backend, x, None, **kw).ravel()
        np.testing.assert_array_equal(got, np.array(want, np.float32), err_msg=str(kw))
        got8 = run(backend, x, None, dtype=np.uint8, **kw).ravel()
        np.testing.assert_array_equal(got8, np.clip(np.array(want), 0, 255).astype(np.uint8), err_msg=str(kw))


def test_error_kinds_and_dtypes(backend):
    x = backend.asarray(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(TypeError, match="source images must be uint8, uint16, float16, float32"):
        I.process(backend.asarray(np.zeros((4, 4, 3), np.int32)), size=2)
    with pytest.raises(TypeError, match="mixed array kinds"):
        I.process([x, np.zeros((4, 4, 3), np.uint8) if backend.name != "numpy" else _other(backend)], size=2)
    with pytest.raises(TypeError, match="mixed dtypes"):
        I.process([x, backend.asarray(np.zeros((4, 4, 3), np.float32))], size=2)
    with pytest.raises(ValueError, match="different channel counts"):
        I.process([x, backend.asarray(np.zeros((4, 4, 1), np.uint8))], [(0, 0, 2, 2)] * 2, size=2)
    with pytest.raises(TypeError, match="must be an array"):
        I.process("frame.png", size=2)
    with pytest.raises(TypeError, match="out has dtype"):
        I.process(x, size=2, out=backend.asarray(np.zeros((1, 3, 2, 2), np.float16)))
    with pytest.raises(ValueError, match="out has shape"):
        I.process(x, size=2, out=backend.asarray(np.zeros((1, 2, 2, 3), np.float32)))


def _other(backend):
    torch = pytest.importorskip("torch")
    return torch.zeros((4, 4, 3), dtype=torch.uint8)


def test_errors_happen_before_any_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("launched")
    monkeypatch.setattr(I, "_gpu_run", boom)
    monkeypatch.setattr(I, "_np_run", boom)
    with pytest.raises(ValueError, match="lies outside"):
        I.process(np.zeros((5, 8, 3), np.uint8), [(0, 0, 2, 2), (7, 0, 2, 2)], size=3)


def test_reference_can_fail():
    """The comparison catches one unit of difference (uint8), a half-pixel shift and a dropped flip."""
    rng = np.random.default_rng(19)
    img = make_image(rng, (9, 11, 3), U8)
    ref = ref_pipeline([img], [(0, 0, 11, 9)], [0], (5, 6))
    got = I.process(img, None, size=(5, 6), dtype=np.uint8)
    bad = got.astype(np.int32)
    bad[0, 1, 2, 3] += 2
    with pytest.raises(AssertionError):
        assert_pipeline_close(bad, ref, U8, 255)
    shifted = ref_pipeline([img], [(1, 0, 10, 9)], [0], (5, 6))
    with pytest.raises(AssertionError):
        assert_pipeline_close(I.process(img, None, size=(5, 6)), shifted, F32, 255.0)
    flipped = ref_pipeline([img], [(0, 0, 11, 9)], [0], (5, 6), hflip=True)
    with pytest.raises(AssertionError):
        assert_pipeline_close(I.process(img, None, size=(5, 6)), flipped, F32, 255.0)


# ----------------------------------------------------------------- the generated sources compile
def _structures():
    """A plan of each structure the tests above run (dtype pairs, colors, interpolations, yuv)."""
    x = {dt: np.zeros((6, 8, 3), dt) for dt in IN_DTYPES}
    x4 = np.zeros((6, 8, 4), F16)
    plans = []
    for i in IN_DTYPES:
        for o in OUT_DTYPES:
            plans.append(I._plan(I.Pipeline().resize(3).cast(o), x[i], None, None, False, False, None))
    for color in ["bgr2rgb", "rgb2gray", "bgr2gray", (1,), (2, 0)]:
        for interp in I.INTERPOLATIONS:
            plans.append(I._plan(I.Pipeline().resize(3, interp).color(color).cast(F16), x[U8], None, None, False,
                                 False, None))
    plans.append(I._plan(I.Pipeline().resize(3).color("rgba2rgb").cast(F32), x4, None, None, False, False, None))
    plans.append(I._plan(I.Pipeline().resize(3).cast(F32), x4, None, None, False, False, None))
    plans.append(I._plan(I.Pipeline().cast(F32), x[U16], [(0, 0, 2, 2)], None, False, False, None))
    for fmt in I.YUV_FORMATS:
        for color in ["rgb", "bgr", "gray"]:
            for i in [U8, U16, F32]:
                for o in OUT_DTYPES:
                    p = I.Pipeline().read(yuv=fmt).resize(3).color(color).cast(o)
                    plans.append(I._plan(p, np.zeros((12, 8), i), None, None, False, False, None))
    return plans


def test_generated_sources_compile():
    try:
        import cupy
        cupy.cuda.nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"CuPy / NVRTC not usable: {type(e).__name__}: {e}")
    import cupy.cuda.compiler as cc
    from cufuse._build import _compile
    sources = sorted({I._source(p) for p in _structures()})
    assert len(sources) > 30 and all('extern "C" __global__' in s and "image_pipeline(" in s for s in sources)
    options = R.compile_options() + ("-ftz=true",)
    # Every structure's Spec and kernel, to PTX in one translation unit (each
    # source in a namespace of its own): 8 s, against 22 s one by one to cubins
    # (CPU suite time, issue 32); one source in 16, as it is, to cubins for
    # both architectures (kernels/image.cuh has no code that differs between
    # them: the guards it includes from common.cuh are at 8.0).
    parts = ['#include "image.cuh"'] + [
        f"namespace variant{k} {{\n" + s.replace('#include "image.cuh"\n', "").replace('extern "C" ', "") + "\n}"
        for k, s in enumerate(sources)]
    try:  # CuPy's private NVRTC wrapper, as cufuse._build uses it; else every source to a cubin
        prog = cc._NVRTCProgram(R.expand_includes("\n".join(parts)), "image_sources.cu", (), (), method="ptx")
        prog.compile(options + ("-arch=compute_80", "--device-as-default-execution-space"))
        sample = sources[::16]
    except (AttributeError, TypeError):
        sample = sources
    for src in sample:
        for arch in ("80", "90"):
            _compile(R.expand_includes(src), options, arch, None)  # raises CompileException


def test_source_holds_no_values():
    """Rectangles, sizes, mean, std, scale and fill are arguments: the source is the same for any."""
    x = np.zeros((20, 30, 3), np.uint8)
    a = I._plan(I.Pipeline().resize((5, 6)).normalize(1, 2, 3.0).cast(F16), x, [(1, 2, 3, 4)], None, True, False,
                None)
    b = I._plan(I.Pipeline().letterbox_to((50, 7), fill=9).normalize((4, 5, 6), 7, 8.0).cast(F16), x,
                [(0, 0, 30, 20), (5, 5, 5, 5)], None, False, True, None)
    assert I._source(a) == I._source(b)
    assert I._source(a) != I._source(I._plan(I.Pipeline().resize((5, 6)).cast(F32), x, None, None, False, False,
                                             None))


def test_params_layout():
    """_PARAMS is the twin of cufuse::image::Params (the .cuh asserts 160 bytes; the host-compiled kernel
    tests below compare every offset with the C++ compiler's)."""
    assert I._PARAMS.itemsize == 160
    assert I._PARAMS.fields["gain"][1] == 56 and I._PARAMS.fields["yuv"][1] == 116


def test_import_as_submodule():
    import importlib
    mod = importlib.import_module("cufuse.image")
    assert mod.process is I.process
    assert cufuse.image is mod  # noqa: the attribute the import sets on the package


# ----------------------------------------------------------------- GPU only
@pytest.mark.cuda
def test_torch_current_stream(image_launches):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from cufuse import _driver as D
    rng = np.random.default_rng(20)
    img = make_image(rng, (64, 80, 3), U8)
    x = torch.from_numpy(img).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        res = I.process(x, [(0, 0, 80, 64), (5, 5, 30, 20)], size=(32, 32), dtype=np.float16)
        expect = D.stream_for(cufuse._arrays.TORCH_CUDA, 0)
    s.synchronize()
    assert image_launches[-1][2].ptr == expect.ptr == s.cuda_stream
    ref = ref_pipeline([img], [(0, 0, 80, 64), (5, 5, 30, 20)], [0, 0], (32, 32))
    assert_pipeline_close(res.cpu().numpy(), ref, F16, 255.0)


@pytest.mark.cuda
def test_cuda_graph_capture():
    """After one call of a signature, the same call is captured in a CUDA graph (no allocation, no
    upload) and replays on new pixels; a new signature inside a capture raises clearly."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(26)
    img = make_image(rng, (40, 50, 3), U8)
    x = torch.from_numpy(img).cuda()
    rects = np.array([[0, 0, 50, 40], [3, 4, 20, 30]])
    out = torch.empty((2, 3, 16, 16), dtype=torch.float32, device="cuda")
    pipe = I.Pipeline().resize(16).normalize(100, 50)
    pipe(x, rects, out=out)  # the warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pipe(x, rects, out=out)
    img2 = make_image(rng, (40, 50, 3), U8)
    x.copy_(torch.from_numpy(img2))
    g.replay()
    torch.cuda.synchronize()
    ref = ref_pipeline([img2], rects.tolist(), [0, 0], (16, 16), mean=100, std=50)
    assert_pipeline_close(out.cpu().numpy(), ref, F32, 255 / 50 + 2)
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captured"):
        with torch.cuda.graph(g2):
            pipe(x, np.array([[1, 1, 5, 5]]), out=out[:1])


@pytest.mark.cuda
def test_first_call_of_a_process_warms_the_fast_path():
    """The process's very first cufuse call (a pipeline on torch tensors, torch not yet bound by
    any other call) keeps its signature in the form later calls look up, so the next call (here
    captured in a CUDA graph) takes the fast path: one launcher kept, not a second one made by
    the full path. Run in a fresh interpreter, where nothing else has bound torch."""
    import os
    import subprocess
    import sys
    pytest.importorskip("torch")
    code = """if True:
        import numpy as np, torch, cufuse.image as I
        x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)).cuda()
        rects = np.array([[0, 0, 50, 40], [3, 4, 20, 30]])
        out = torch.empty((2, 3, 16, 16), dtype=torch.float32, device="cuda")
        pipe = I.Pipeline().resize(16)
        pipe(x, rects, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            pipe(x, rects, out=out)
        print(len(pipe._fast))
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "1", r.stdout


@pytest.mark.cuda
def test_gpu_matches_numpy_fallback_large():
    """The issue's shapes: 64 crops of a 1080p frame to 224x224, and 4K -> 1080p, against the fallback."""
    import cupy as cp
    rng = np.random.default_rng(21)
    frame = make_image(rng, (1080, 1920, 3), U8)
    xs = rng.integers(0, 1920 - 300, 64)
    ys = rng.integers(0, 1080 - 300, 64)
    ws = rng.integers(100, 300, 64)
    hs = rng.integers(100, 300, 64)
    rects = np.column_stack([xs, ys, ws, hs])
    mean, std = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
    got = cp.asnumpy(I.process(cp.asarray(frame), rects, size=224, mean=mean, std=std, dtype=np.float16))
    ref = I.process(frame, rects, size=224, mean=mean, std=std, dtype=np.float16)
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-3, atol=2e-3)
    big = make_image(rng, (2160, 3840, 3), U8)
    got = cp.asnumpy(I.process(cp.asarray(big), None, size=(1080, 1920), mean=mean, std=std))
    ref = I.process(big, None, size=(1080, 1920), mean=mean, std=std)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------- the kernel, run on the host
# The GPU path (_gpu_run: tables, parameters, strides, the generated source and kernels/image.cuh) run
# on the CPU: the generated source compiled by the host C++ compiler, with a stand-in for common.cuh
# (the CUDA qualifiers empty, the block and thread indices host globals), launched block by block.
# It checks the index arithmetic, the tables and the Params layout on machines without a GPU.
_HOST_SHIM = r"""
#pragma once
#include <cmath>
#include <cstddef>
#include <cstring>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__
inline void __syncthreads() {}
struct Dim3Host { int x, y, z; };
inline Dim3Host blockIdx, blockDim, threadIdx, gridDim;
struct int4 { int x, y, z, w; };
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, sizeof i);
    return i;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
struct longlong2 { long long x, y; };
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
// (hi:lo) >> (shift & 31), the low 32 bits; each result byte n the byte of (y:x) nibble n of s picks
// (bit 3 of a nibble: that byte's sign replicated)
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return static_cast<unsigned>((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) {
        const unsigned sel = (s >> (4 * n)) & 15, b = (v >> (8 * (sel & 7))) & 0xff;
        r |= (sel & 8 ? (b & 0x80 ? 0xffu : 0u) : b) << (8 * n);
    }
    return r;
}
using __half = _Float16;
namespace cufuse {
template <typename C, typename T> inline C to_compute(T v) { return static_cast<C>(v); }
template <typename T, typename C> inline T from_compute(C v) { return static_cast<T>(v); }
}
"""
_HOST_MAIN = r"""
extern "C" void emulate(int gx, int gy, int gz, int bx, int by, const char* base, const long long* images,
                        const int* items, void* out, const cufuse::image::Params* P) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, 1};
    for (int z = 0; z < gz; ++z)
        for (int y = 0; y < gy; ++y)
            for (int x = 0; x < gx; ++x)
            {  // a block: the y axis of its rows (the first warp), then every thread's column (run's two phases)
                blockIdx = {x, y, z};
                int4 rows[cufuse::image::kTileH];
                for (int tx = 0; tx < bx; ++tx) {
                    threadIdx = {tx, 0, 0};
                    cufuse::image::tile_rows<Spec>(items, rows);
                }
                for (int ty = 0; ty < by; ++ty)
                    for (int tx = 0; tx < bx; ++tx) {
                        threadIdx = {tx, ty, 0};
                        cufuse::image::tile_columns<Spec>(base, images, items, static_cast<Spec::Out*>(out), *P, rows);
                    }
            }
}
extern "C" long long params_layout(int k) {
    using cufuse::image::Params;
    const long long offs[] = {offsetof(Params, out_stride), offsetof(Params, out_plane), offsetof(Params, gain),
        offsetof(Params, bias), offsetof(Params, fill), offsetof(Params, out_h), offsetof(Params, out_w),
        offsetof(Params, items), offsetof(Params, yuv), offsetof(Params, y_offset), offsetof(Params, y_gain),
        offsetof(Params, c_offset), offsetof(Params, c_gain), offsetof(Params, range), offsetof(Params, pad_),
        sizeof(Params)};
    return offs[k];
}
"""
_host_libs: dict = {}


def _host_kernel(src, tmp_path):
    import ctypes
    import shutil
    import subprocess
    lib = _host_libs.get(src)
    if lib is None:
        d = tmp_path / f"k{len(_host_libs)}"
        d.mkdir()
        (d / "common.cuh").write_text(_HOST_SHIM)
        shutil.copy(R.kernel_dir() / "image.cuh", d / "image.cuh")
        (d / "k.cpp").write_text(src + _HOST_MAIN)
        subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(d), "-o", str(d / "k.so"),
                        str(d / "k.cpp")], check=True, capture_output=True, text=True)
        lib = _host_libs[src] = ctypes.CDLL(str(d / "k.so"))
        lib.params_layout.restype = ctypes.c_longlong
    return lib


class _HostArray:
    """A NumPy array standing for a device array (``.data.ptr``)."""

    def __init__(self, a):
        self.a = np.ascontiguousarray(a)

        class _Mem:
            ptr = self.a.__array_interface__["data"][0]
        self.data = _Mem()


class _Launches(list):
    """The grids launched; ``wide``: the Index choice of each kernel built (int64 strides or not)."""

    def __init__(self):
        super().__init__()
        self.wide = []


@pytest.fixture
def host_gpu(monkeypatch, tmp_path):
    """I.process on NumPy arrays through _gpu_run, the kernel run on the host."""
    import contextlib
    import ctypes
    import shutil
    import types
    if shutil.which("g++") is None:
        pytest.skip("no host C++ compiler (g++)")
    from cufuse import _arrays as A_
    from cufuse import _driver as D_
    monkeypatch.setattr(A_, "pointer_of", lambda x, kind: x.__array_interface__["data"][0])
    monkeypatch.setattr(D_, "empty", lambda shape, dt, kind, dev: np.empty(shape, dt))
    monkeypatch.setattr(D_, "uploaded", lambda host, kind, dev, what: _HostArray(host))
    monkeypatch.setattr(D_, "stream_for", lambda kind, dev: None)
    monkeypatch.setattr(D_, "Held", lambda dev, *arrs: types.SimpleNamespace(arrs=arrs, on=lambda stream: None))
    monkeypatch.setattr(D_, "get_device", lambda: 0)
    monkeypatch.setattr(D_, "queue", lambda rec, values, stream=None: [
        st.fn(st.grid, st.block, st.get(st.consts + tuple(values))) for st in rec.steps])
    monkeypatch.setattr(R, "_cp", types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda dev: contextlib.nullcontext())))
    launches = _Launches()

    def function(plan, wide=False):
        launches.wide.append(wide)
        lib = _host_kernel(I._source(plan, wide), tmp_path)
        assert [lib.params_layout(k) for k in range(16)] == [I._PARAMS.fields[n][1] for n in I._PARAMS.names] + [
            I._PARAMS.itemsize]

        def launch(grid, block, args, shared=0, stream=None):
            launches.append(grid)
            base, images, items, out, P = args
            Pbuf = np.array(P, dtype=I._PARAMS)
            ptrs = [ctypes.c_void_p(int(v)) for v in (base, images, items, out, Pbuf.__array_interface__["data"][0])]
            lib.emulate(grid[0], grid[1], grid[2], block[0], block[1], *ptrs)
        launch.ptr = 0  # (a kernel's handle, as RecipeBuilder.launch reads it)
        return launch

    monkeypatch.setattr(I, "_function", function)
    monkeypatch.setattr(I.A, "GPU_KINDS", (A_.CUPY, A_.TORCH_CUDA, A_.NUMPY))  # NumPy takes the GPU path
    return launches


HOST_DTYPES = [(U8, F32), (U16, U8), (F32, F16), (F16, F32)]


@pytest.mark.parametrize("wide", [False, True], ids=["int-strides", "int64-strides"])
@pytest.mark.parametrize("in_dtype,out_dtype", HOST_DTYPES, ids=str)
def test_kernel_on_host_crops(host_gpu, monkeypatch, in_dtype, out_dtype, wide):
    """Both Index types of the kernel: int64 row strides taken here for small ones (the bound lowered)."""
    if wide:
        monkeypatch.setattr(I, "_NARROW", 1)
    rng = np.random.default_rng(30)
    imgs = [make_image(rng, (13, 17, 3), in_dtype), make_image(rng, (6, 23, 3), in_dtype)]
    rects = [(0, 0, 17, 13), (16, 12, 1, 1), (3, 2, 9, 7), (0, 0, 23, 6), (20, 1, 3, 5)]
    sources = [0, 0, 0, 1, 1]
    rng_ = {U8: 255.0, U16: 65535.0}.get(in_dtype, 1.0)
    mean, std, scale = (10.0, 20.0, 30.0), (2.0, 1.5, 0.5), 100.0 / rng_
    hflip, vflip = [False, True, True, False, True], [False, False, True, True, False]
    got = I.process(imgs, rects, sources=sources, size=(7, 11), mean=mean, std=std, scale=scale, hflip=hflip,
                    vflip=vflip, dtype=out_dtype)
    assert host_gpu == [(1, 1, 5)] and host_gpu.wide == [wide]
    ref = ref_pipeline(imgs, rects, sources, (7, 11), mean=mean, std=std, scale=scale, hflip=hflip, vflip=vflip)
    assert_pipeline_close(got, ref, out_dtype, magnitude(imgs, scale, mean, std))


@pytest.mark.parametrize("interp", ["bilinear", "nearest", "nearest_exact"])
@pytest.mark.parametrize("color", [None, "bgr2rgb", "rgb2gray"])
def test_kernel_on_host_layouts_colors(host_gpu, interp, color):
    rng = np.random.default_rng(31)
    x = make_image(rng, (2, 3, 9, 14), U8)  # NCHW batch
    rects, sources = [(0, 0, 14, 9), (5, 2, 6, 7), (13, 8, 1, 1)], [1, 0, 1]
    out = np.full((3, 20, 17, 3 if color != "rgb2gray" else 1), np.nan, np.float32)[:, 1:18:2, 2:15]  # NHWC view
    res = I.process(x, rects, layout="NCHW", sources=sources, size=(9, 13), interpolation=interp, color=color,
                    out_layout="NHWC", out=out)
    assert res is out
    ref = ref_pipeline(to_hwc(x, "NCHW"), rects, sources, (9, 13), interp=interp, color=color, out_layout="NHWC")
    assert_pipeline_close(out, ref, F32, 255.0)


@pytest.mark.parametrize("rect,size", [((0, 0, 21, 17), (16, 16)), ((2, 1, 7, 15), (9, 12)), ((3, 3, 1, 1), (5, 4))],
                         ids=str)
def test_kernel_on_host_letterbox(host_gpu, rect, size):
    rng = np.random.default_rng(32)
    img = make_image(rng, (17, 21, 3), U8)
    got = I.process(img, [rect], size=size, letterbox=True, fill=(114, 0, 255), mean=100, std=50,
                    dtype=np.float32)
    ref = ref_pipeline([img], [rect], [0], size, letterbox=True, fill=(114, 0, 255), mean=100, std=50)
    assert_pipeline_close(got, ref, F32, magnitude([img], 1, 100, 50))


@pytest.mark.parametrize("fmt", ["nv12", "i420"])
@pytest.mark.parametrize("color", ["rgb", "bgr", "gray"])
def test_kernel_on_host_yuv(host_gpu, fmt, color):
    rng = np.random.default_rng(33)
    frame, y, u, v = make_yuv(rng, 10, 14, fmt)
    up = lambda p: np.repeat(np.repeat(p, 2, axis=0), 2, axis=1)  # noqa: E731
    rgb = ref_yuv_to_rgb(y.astype(np.float64), up(u).astype(np.float64), up(v).astype(np.float64), "bt709", False)
    rects = [(0, 0, 14, 10), (3, 1, 7, 6), (13, 9, 1, 1)]
    got = I.process(frame, rects, yuv=fmt, matrix="bt709", size=(6, 8), color=color, dtype=np.float32)
    ref = ref_pipeline([rgb], rects, [0] * 3, (6, 8), color={"rgb": None, "bgr": "rgb2bgr", "gray": "rgb2gray"}[color])
    assert_pipeline_close(got, ref, F32, 255.0 * 3)


def test_kernel_on_host_views(host_gpu):
    """Negative strides and an offset view as the source; out overlapping the source (a temporary)."""
    rng = np.random.default_rng(34)
    big = make_image(rng, (30, 40, 3), F32)
    view = big[3:25, 38:5:-2, ::-1]
    got = I.process(view, [(0, 0, 17, 22), (16, 21, 1, 1)], size=(10, 16))
    ref = ref_pipeline([np.asarray(view, np.float64)], [(0, 0, 17, 22), (16, 21, 1, 1)], [0, 0], (10, 16))
    assert_pipeline_close(got, ref, F32, 1.5)
    x = make_image(rng, (1, 3, 8, 8), F32)
    expect = I.process(x, None, layout="NCHW", size=(8, 8), hflip=True)
    assert I.process(x, None, layout="NCHW", size=(8, 8), hflip=True, out=x) is x
    np.testing.assert_array_equal(x, expect)


def test_kernel_on_host_fast_path(host_gpu, monkeypatch):
    """A repeated call signature (same array layout, rectangles and flips; new pixels and output) skips
    planning and reuses the launches; a new rectangle, an out= that overlaps the source, or new
    flips take the full path."""
    rng = np.random.default_rng(35)
    pipe = I.Pipeline().resize((5, 7)).color("bgr2rgb").normalize((1, 2, 3), (4, 5, 6)).cast("float32")
    plans = []
    real = I._plan
    monkeypatch.setattr(I, "_plan", lambda *a: plans.append(1) or real(*a))
    rects = np.array([[1, 2, 9, 7], [0, 0, 12, 10]])
    for k in range(3):
        img = make_image(rng, (10, 12, 3), U8)
        out = np.full((2, 3, 5, 7), np.nan, np.float32)
        assert pipe(img, rects, hflip=[True, False], out=out) is out
        ref = ref_pipeline([img], rects.tolist(), [0, 0], (5, 7), color="bgr2rgb", mean=(1, 2, 3), std=(4, 5, 6),
                           hflip=[True, False])
        assert_pipeline_close(out, ref, F32, magnitude([img], 1, (1, 2, 3), (4, 5, 6)))
        got = pipe(img, rects, hflip=[True, False])  # out=None: another signature
        assert_pipeline_close(got, ref, F32, magnitude([img], 1, (1, 2, 3), (4, 5, 6)))
    assert len(plans) == 2 and len(host_gpu) == 6
    pipe(img, rects, hflip=[False, False])
    pipe(img, np.array([[0, 2, 9, 7], [0, 0, 12, 10]]))
    assert len(plans) == 4
    x = make_image(rng, (1, 3, 8, 8), F32)
    p2 = I.Pipeline().read("NCHW").resize((8, 8)).flip(True)
    for _ in range(2):
        y = x.copy()
        expect = p2(y)
        assert p2(y, out=y) is y  # overlaps: a temporary, then a copy
        np.testing.assert_array_equal(y, expect)


def test_kernel_on_host_tiles(host_gpu):
    """Outputs of several 32 x 32 tiles, partial at the right and bottom edges, NCHW and NHWC."""
    rng = np.random.default_rng(36)
    img = make_image(rng, (50, 81, 3), U8)
    rects = [(0, 0, 81, 50), (7, 3, 40, 33), (80, 49, 1, 1)]
    for layout in ("NCHW", "NHWC"):
        got = I.process(img, rects, size=(45, 70), out_layout=layout, mean=(1, 2, 3), std=2, dtype=np.float16)
        ref = ref_pipeline([img], rects, [0] * 3, (45, 70), out_layout=layout, mean=(1, 2, 3), std=2)
        assert_pipeline_close(got, ref, F16, 255.0)
    assert host_gpu[-1] == (3, 2, 3)


def test_kernel_on_host_planar(host_gpu):
    rng = np.random.default_rng(37)
    img = make_image(rng, (20, 30, 3), F32)
    block = np.full((3, 2, 9, 11), np.nan, np.float32)
    planes = [block[2], block[0], block[1]]  # out of order in memory
    I.process(img, [(0, 0, 30, 20), (3, 4, 10, 7)], size=(9, 11), out=planes)
    ref = ref_pipeline([img], [(0, 0, 30, 20), (3, 4, 10, 7)], [0, 0], (9, 11))
    assert_pipeline_close(np.stack(planes, axis=1), ref, F32, 1.5)
    src = make_image(rng, (3, 8, 8), F32)  # planes that are the source itself: a temporary
    expect = I.process(src.copy(), None, layout="CHW", size=(8, 8), hflip=True)
    I.process(src, None, layout="CHW", size=(8, 8), hflip=True, out=[src[0:1], src[1:2], src[2:3]])
    np.testing.assert_array_equal(src[:, None].transpose(1, 0, 2, 3), expect)


@pytest.mark.parametrize("fmt", ["nv12", "i420"])
def test_kernel_on_host_yuv_planes(host_gpu, fmt):
    rng = np.random.default_rng(38)
    frame, *_ = make_yuv(rng, 10, 14, fmt)

    class NumpyBackend:
        asarray = staticmethod(np.array)
    planes = _planes_of(NumpyBackend, frame, fmt, 10, 14, 3)
    got = I.process(planes, [(1, 1, 9, 7), (0, 0, 14, 10)], yuv=fmt, size=(5, 6))
    expect = I.process(frame, [(1, 1, 9, 7), (0, 0, 14, 10)], yuv=fmt, size=(5, 6))
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("interp", ["bilinear", "nearest", "nearest_exact"])
def test_kernel_on_host_division(host_gpu, interp):
    """Boxes of 41 and 47 pixels: their float reciprocals make the kernel's quotient one short at exact
    multiples (41 * (1 / 41) < 1 in float32), which its one-step correction fixes."""
    rng = np.random.default_rng(39)
    img = make_image(rng, (90, 100, 3), F32)
    # crop sizes (w, h) at which some quotient needs the correction, per interpolation (found by
    # emulating the float32 steps): nearest 47 / 41 (and 94 / 82), nearest-exact 2 / 2, bilinear 3 / 3
    rects = [(0, 0, 100, 90), (5, 7, 94, 82), (1, 1, 47, 41), (3, 4, 2, 2), (9, 9, 3, 3), (60, 1, 33, 27)]
    got = I.process(img, rects, size=(41, 47), interpolation=interp)
    ref = ref_pipeline([img], rects, [0] * 6, (41, 47), interp=interp)
    assert_pipeline_close(got, ref, F32, 1.5)
