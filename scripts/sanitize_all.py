"""Every kernel family on small, odd-sized torch tensors, forward and backward,
for compute-sanitizer (issue 37: "compute-sanitizer clean on every kernel
family"):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_all.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_all.py [family ...]

Families: elementwise, dropout, quantize, reduction, norm, add_norm,
cross_entropy, rope, scatter, fuse, attention, image (default: all). Sizes are
odd around the 16-byte packs, with a misaligned view per family, so that the
tails and the unaligned paths run too. ``--device cpu`` runs the same calls on
the CPU (a check of this script, not of the kernels). Prints one line per
family; the sanitizer reports errors itself."""
from __future__ import annotations

import argparse

import numpy as np
import torch

import cufuse


def _inside(shape, dt, dev, g, at):
    """Random values at element ``at`` of a larger buffer of random values:
    the row kernels read each row on its 16-byte aligned window
    (kernels/rows.cuh), whose lanes past the row's end are masked and never
    used; at the end of an allocation that is memory no one wrote, which
    initcheck reports."""
    n = int(np.prod(shape))
    return torch.randn(n + 64, generator=g).to(dev, dt)[at:at + n].view(shape).detach()


def _t(shape, dt, dev, g, grad=False):
    x = _inside(shape, dt, dev, g, 32)
    return x.requires_grad_(True) if grad else x


def _misaligned(shape, dt, dev, g):
    return _inside(shape, dt, dev, g, 33)


def elementwise(dt, dev, g):
    x, y, z = (_t((37, 129), dt, dev, g, True) for _ in range(3))
    b = _t((129,), dt, dev, g, True)
    outs = [cufuse.add_relu(x, y), cufuse.mul_tanh(x, y), cufuse.add_mul_exp(x * 0.1, y * 0.1), cufuse.fma(x, y, z),
            cufuse.bias_gelu(x, b), cufuse.bias_gelu(x, b, "tanh")]
    sum(o.float().sum() for o in outs).backward()
    cufuse.add_relu(_misaligned((37, 129), dt, dev, g), y.detach())
    # the strided and tiled paths: a column-strided view, a transposed one beside a broadcast row
    xs, zs = _t((33, 65), dt, dev, g), _t((33, 33), dt, dev, g)
    cufuse.fma(xs[:, ::2], 0.5, zs)
    cufuse.mul_tanh(_t((64, 64), dt, dev, g).T, _t((64,), dt, dev, g))
    cufuse.add_mul_exp(_t((4097,), dt, dev, g) * 0.1, _t((4097,), dt, dev, g) * 0.1)


def dropout(dt, dev, g):
    x = _t((33, 257), dt, dev, g, True)
    cufuse.gelu_dropout(x, 0.2, seed=3).float().sum().backward()


def quantize(dt, dev, g):
    x = _t((31, 67), dt, dev, g)
    q = cufuse.quantize_int8(x, 0.05)
    cufuse.dequantize_int8(q, 0.05, dtype=dt)
    s = torch.rand(67, generator=g).to(dev, torch.float32) * 0.1 + 0.01
    cufuse.quantize_int8(x, s, axis=1)
    cufuse.quantize_int8(x, torch.rand(31, generator=g).to(dev, torch.float32) * 0.1 + 0.01, axis=0)
    xg = x.clone().requires_grad_(True)
    cufuse.fake_quantize_int8(xg, 0.05).float().sum().backward()


def reduction(dt, dev, g):
    x = _t((45, 1031), dt, dev, g, True)
    (cufuse.sum_squared(x, axis=-1).float().sum() + cufuse.mean_abs(x, axis=0).float().sum()).backward()
    cufuse.sum_squared(_misaligned((45, 1031), dt, dev, g), axis=(0, 1))
    cufuse.mean_abs(_t((1000, 64), dt, dev, g), axis=0)  # columns of a tall array (tickets)
    cufuse.sum_squared(_t((33, 1001), dt, dev, g), axis=None)
    cufuse.sum_squared(_t((4, 300001), dt, dev, g))  # long rows


def norm(dt, dev, g):
    for cols in (127, 4099):
        x = _t((19, cols), dt, dev, g, True)
        w, b = _t((cols,), dt, dev, g, True), _t((cols,), dt, dev, g, True)
        outs = [cufuse.layer_norm(x, cols, w, b), cufuse.layer_norm_relu(x, cols, w, b), cufuse.rms_norm(x, cols, w),
                cufuse.softmax(x), cufuse.log_softmax(x)]
        sum(o.float().sum() for o in outs).backward()
    cufuse.layer_norm_relu(_t((512, 8192), dt, dev, g), 8192)
    cufuse.softmax(_t((300, 40), dt, dev, g), axis=0)
    cufuse.softmax(_t((2, 300001), dt, dev, g))  # rows split over blocks
    cufuse.rms_norm(_t((2, 1 << 20), dt, dev, g), 1 << 20)  # beyond them: the kernel that re-reads rows
    if dev != "cuda":
        return
    from cufuse import _driver
    from cufuse.ops import norm as N
    patience = N.PATIENCE_NS
    for N.PATIENCE_NS in (patience, 0):  # then every part stored by the rescue launch
        _driver.clear_fast_paths()
        cufuse.layer_norm(_t((8, 500001), torch.float32, dev, g), 500001)  # the split rows
        cufuse.layer_norm(_t((9, 20000), torch.float32, dev, g), 20000, _t((20000,), torch.float32, dev, g))  # pipe
    N.PATIENCE_NS = patience
    _driver.clear_fast_paths()


def add_norm(dt, dev, g):
    x, r = _t((21, 1029), dt, dev, g, True), _t((21, 1029), dt, dev, g, True)
    w, b = _t((1029,), dt, dev, g, True), _t((1029,), dt, dev, g, True)
    y, h = cufuse.add_rms_norm(x, r, 1029, w)
    y2, h2 = cufuse.add_layer_norm(x, r, 1029, w, b)
    (y.float().sum() + h.float().sum() + y2.float().sum() + h2.float().sum()).backward()


def cross_entropy(dt, dev, g):
    logits = _t((37, 32003), dt, dev, g, True)
    target = torch.randint(0, 32003, (37,), generator=g).to(dev)
    target[3] = -100
    cufuse.cross_entropy(logits * 1, target, label_smoothing=0.1, z_loss=1e-4).backward()


def rope(dt, dev, g):
    q, k = _t((2, 4, 33, 64), dt, dev, g, True), _t((2, 2, 33, 64), dt, dev, g, True)
    ang = torch.rand(2, 33, 16, generator=g).to(dev) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)  # partial: 32 of 64
    a, b = cufuse.rope(q, k, cos, sin)
    (a.float().sum() + b.float().sum()).backward()
    cufuse.rope(q.detach().transpose(1, 2), None, cos, sin, unsqueeze_dim=2, interleaved=True)


def scatter(dt, dev, g):
    v = _t((301, 65), dt, dev, g, True)
    idx = torch.randint(0, 17, (301,), generator=g).to(dev)
    cufuse.scatter_add(v, idx, 17, activation="silu").float().sum().backward()


def fuse(dt, dev, g):
    @cufuse.fuse
    def f(a, b):
        return cufuse.tanh(a) * b + cufuse.exp(-a * a)

    x, y = _t((29, 131), dt, dev, g, True), _t((131,), dt, dev, g, True)
    f(x, y).float().sum().backward()
    xs, ys = x.detach(), y.detach()
    cufuse.fuse(lambda a, b: ((a - b) ** 2).sum(axis=-1))(xs, ys.expand(29, 131))  # a fused row reduction
    f.foreach([xs, xs[:5].contiguous(), xs[1:]], [ys.expand(29, 131).contiguous(), ys.expand(5, 131).contiguous(),
                                                  ys.expand(28, 131).contiguous()])


def attention(dt, dev, g):
    if dt == torch.float32 and dev == "cuda":
        return  # (the dense path: no kernel of its own)
    q, k, v = _t((2, 4, 77, 64), dt, dev, g, True), _t((2, 2, 77, 64), dt, dev, g, True), \
        _t((2, 2, 77, 64), dt, dev, g, True)
    cufuse.attention(q, k, v, causal=True).float().sum().backward()
    cufuse.attention_score(q.detach(), k.detach(), mask=torch.rand(77, 77, generator=g).to(dev) < 0.5)


def image(dt, dev, g):
    import cufuse.image as I
    frame = torch.randint(0, 256, (67, 131, 3), generator=g, dtype=torch.uint8).to(dev)
    rects = np.array([[0, 0, 131, 67], [3, 5, 1, 1], [10, 7, 50, 31], [120, 60, 11, 7]])  # the last at the corner
    norm = I.Pipeline().resize((17, 23)).color("bgr2rgb").normalize((0.4, 0.5, 0.6), (0.2, 0.25, 0.3), scale=1 / 255)
    norm.cast(dt).write("NCHW")(frame, rects, hflip=[False, True, False, True], vflip=[True, False, False, True])
    odd = torch.randint(0, 256, (67 * 131 * 3 + 1,), generator=g, dtype=torch.uint8).to(dev)[1:].view(67, 131, 3)
    norm.cast(dt).write("NHWC")(odd, rects)  # a misaligned source, an interleaved output
    planar = frame.permute(2, 0, 1).contiguous().to(dt)  # CHW: a pointer per channel
    I.Pipeline().read("CHW").resize((40, 33), "nearest").normalize(0.5, 0.25)(planar, rects)
    I.Pipeline().read("CHW").letterbox_to((29, 41), fill=(1, 2, 3))(planar, rects)
    nv12 = torch.randint(16, 236, (66, 130), generator=g, dtype=torch.uint8).to(dev)  # 44 rows of Y, 22 of UV
    I.Pipeline().read(yuv="nv12").letterbox_to(31, fill=114).normalize(scale=1 / 255).cast(dt)(nv12)


FAMILIES = {f.__name__: f for f in (elementwise, dropout, quantize, reduction, norm, add_norm, cross_entropy, rope,
                                    scatter, fuse, attention, image)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for name in args.families:
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            FAMILIES[name](dt, args.device, g)
        if args.device == "cuda":
            torch.cuda.synchronize()
        print(name, "ok", flush=True)


if __name__ == "__main__":
    main()
