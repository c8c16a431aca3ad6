// cufuse.image: one kernel per pipeline structure (cufuse/image.py writes a
// short source that defines `Spec` and includes this file).
//
// Backwards fusion: each output pixel walks the pipeline backwards: output
// (x, y) -> the letterbox box -> un-flip -> the resize's sample position in
// the crop -> the source pixels it needs. Nothing intermediate is stored.
// blockIdx.z is the item (crop), so N crops of different rectangles and
// source images are one launch.
//
// Spec (generated) supplies:
//   using In, Out;                  storage types of the source and the output
//   kRead, kOut                     source channels read, output channels written
//   kInterp                         0 nearest (floor(d * w / bw)), 1 nearest-exact
//                                   (floor((d + 0.5) * w / bw)), 2 bilinear (half-pixel centers)
//   kYuv                            0 interleaved / planar channels, 1 NV12, 2 I420 (YUV420 planar)
//   static int channel(int k)       the source channel of read channel k
//   static void color(r[kRead], o[kOut])   channel selection / gray / YUV->RGB on the sample
#pragma once

#include "common.cuh"

namespace cufuse {
namespace image {

// The values of a call (kernel argument by value); twin of _PARAMS in cufuse/image.py.
struct Params {
    long long out_stride[3];  // element strides of the output: item, row, column
    long long out_plane[4];   // element offset of each output channel (k * the channel stride, or for
                              // planes given apart, each plane's distance from the first)
    float mean[4];            // per output channel
    float inv_std[4];         // 1 / std, per output channel
    float fill[4];            // letterbox padding, per output channel, before normalize
    float scale;              // x * scale before the mean is taken away
    int out_h, out_w;
    int items;
    float yuv[4];             // YUV->RGB: Rv, Gu, Gv, Bu (R = Y + Rv V, G = Y + Gu U + Gv V, B = Y + Bu U)
    float y_offset, y_gain, c_offset, c_gain;  // Y = (y - y_offset) * y_gain, U/V = (c - c_offset) * c_gain
    float range;              // the largest value of the source dtype (YUV results are clamped to [0, range])
    int pad_;
};
static_assert(sizeof(Params) == 160, "Params: the layout of _PARAMS in cufuse/image.py");

// Per item, int32[kItem]: source image, crop x, y, w, h, box x, y, w, h (inside the output), flags
// (1: flip horizontally, 2: flip vertically; the crop is flipped before it is resized), 2 unused.
constexpr int kItem = 12;
// Per source image, int64[kImage]: byte offset from the base pointer, element strides of a row, a
// column and a channel; for NV12 / I420 also the chroma planes' byte offsets and strides:
// u offset, u row stride, u column stride, v offset, v row stride, v column stride.
constexpr int kImage = 10;

template <typename Out> __device__ __forceinline__ Out store_cast(float v) { return from_compute<Out>(v); }
// Saturating round to nearest even (OpenCV's saturate_cast); NaN gives 0.
template <> __device__ __forceinline__ unsigned char store_cast<unsigned char>(float v) {
    v = fminf(fmaxf(rintf(v), 0.0f), 255.0f);
    return static_cast<unsigned char>(v);
}

// floor(num / den) for 0 <= num < 2**31 and den > 0, and the remainder, through the float reciprocal
// ``inv`` (found once per item and axis) corrected by one step: the float quotient is within one of
// the true one while that is below 2**22 (the host checks crop sides < 2**22). A division by a
// runtime divisor costs some twenty instructions; this, six.
__device__ __forceinline__ int div_floor(int num, int den, float inv, int& rem) {
    int q = static_cast<int>(static_cast<float>(num) * inv);
    int r = num - q * den;
    if (r < 0) {
        --q;
        r += den;
    } else if (r >= den) {
        ++q;
        r -= den;
    }
    rem = r;
    return q;
}

// The divisor of one axis of one item: box (nearest) or 2 box (nearest-exact, bilinear).
template <int kInterp> __device__ __forceinline__ int axis_den(int box) { return kInterp == 0 ? box : 2 * box; }

// The sample position along one axis: indices i0, i1 and the weight of i1. d is the output
// coordinate inside the box (0 <= d < box), n the crop's extent, box the box's extent, den and inv
// its divisor and that's reciprocal. Exact integer index arithmetic, so that the indices are the
// float64 ones: for bilinear, s = (d + 0.5) * n / box - 0.5 = ((2d + 1) n - box) / 2 box, clamped to
// [0, n - 1]; nearest floor(d n / box); nearest-exact floor((2d + 1) n / 2 box). The host checks
// (2 box + 1) n < 2**31.
template <int kInterp>
__device__ __forceinline__ void axis(int d, int n, int box, int den, float inv, bool flip, int& i0, int& i1,
                                     float& t) {
    int r;
    if constexpr (kInterp == 0) {
        i0 = i1 = min(div_floor(d * n, den, inv, r), n - 1);
        t = 0.0f;
    } else if constexpr (kInterp == 1) {
        i0 = i1 = min(div_floor((2 * d + 1) * n, den, inv, r), n - 1);
        t = 0.0f;
    } else {
        const int num = (2 * d + 1) * n - box;
        if (num <= 0) {
            i0 = i1 = 0;
            t = 0.0f;
        } else {
            const int q = div_floor(num, den, inv, r);
            if (q >= n - 1) {
                i0 = i1 = n - 1;
                t = 0.0f;
            } else {
                i0 = q;
                i1 = q + 1;
                t = static_cast<float>(r) * inv;
            }
        }
    }
    if (flip) {
        i0 = n - 1 - i0;
        i1 = n - 1 - i1;
    }
}

template <typename In> __device__ __forceinline__ float ld(const char* p, long long off) {
    return to_compute<float>(reinterpret_cast<const In*>(p)[off]);
}

template <typename In> __device__ __forceinline__ float ldi(const In* p, long long off) {
    return to_compute<float>(p[off]);
}

// YUV -> RGB of one pixel's (y, u, v), the offsets and gains of the range, clamped to the source range.
__device__ __forceinline__ void yuv_to_rgb(const float (&r)[3], float (&rgb)[3], const Params& P) {
    const float y = (r[0] - P.y_offset) * P.y_gain;
    const float u = (r[1] - P.c_offset) * P.c_gain, v = (r[2] - P.c_offset) * P.c_gain;
    rgb[0] = fminf(fmaxf(y + P.yuv[0] * v, 0.0f), P.range);
    rgb[1] = fminf(fmaxf(y + P.yuv[1] * u + P.yuv[2] * v, 0.0f), P.range);
    rgb[2] = fminf(fmaxf(y + P.yuv[3] * u, 0.0f), P.range);
}

// Threads and tiles: a block of 32 x 8 threads writes a tile of 32 x 32 output pixels of one item
// (blockIdx.x: tile column, blockIdx.y: tile row, blockIdx.z: item). A thread owns one column of the
// tile: the column's sample position (the x axis) is found once, then kRows rows. A warp writes 32
// consecutive pixels of a row: coalesced in NCHW.
constexpr int kTileW = 32, kTileH = 32, kBlockRows = 8, kRows = kTileH / kBlockRows;

template <typename S>
__device__ __forceinline__ void run(const char* base, const long long* __restrict__ images,
                                    const int* __restrict__ items, typename S::Out* __restrict__ out,
                                    const Params& P) {
    using In = typename S::In;
    using Out = typename S::Out;
    const int ox = blockIdx.x * kTileW + threadIdx.x;
    if (ox >= P.out_w) return;
    const int item = blockIdx.z;
    // the item's row of the table: three 16-byte loads (rows are 48 bytes, the table 16-byte aligned)
    const int4* it4 = reinterpret_cast<const int4*>(items + item * kItem);
    const int4 i0 = it4[0], i1 = it4[1], i2 = it4[2];
    const int img = i0.x, cx = i0.y, cy = i0.z, cw = i0.w, ch = i1.x;
    const int bx = i1.y, by = i1.z, bw = i1.w, bh = i2.x, flags = i2.y;
    const longlong2* im2 = reinterpret_cast<const longlong2*>(images + static_cast<long long>(img) * kImage);
    const longlong2 m0 = im2[0], m1 = im2[1];
    const char* src = base + m0.x;
    const long long sy = m0.y, sx = m1.x, sc = m1.y;
    Out* o = out + static_cast<long long>(item) * P.out_stride[0] + ox * P.out_stride[2];

    // The x axis, once per column; the y axis's divisor, once.
    const int dx = ox - bx;
    const bool x_in = dx >= 0 && dx < bw;
    int x0 = 0, x1 = 0;
    float tx = 0.0f;
    if (x_in) {
        const int den = axis_den<S::kInterp>(bw);
        axis<S::kInterp>(dx, cw, bw, den, 1.0f / static_cast<float>(den), flags & 1, x0, x1, tx);
    }
    x0 += cx;
    x1 += cx;
    const int y_den = axis_den<S::kInterp>(bh);
    const float y_inv = 1.0f / static_cast<float>(y_den);
    // element offsets of the two columns' samples, per channel read
    long long o0[S::kRead], o1[S::kRead];
#pragma unroll
    for (int k = 0; k < S::kRead; ++k) {
        const long long ck = S::channel(k) * sc;
        o0[k] = x0 * sx + ck;
        o1[k] = x1 * sx + ck;
    }
    const In* s_in = reinterpret_cast<const In*>(src);

#pragma unroll
    for (int j = 0; j < kRows; ++j) {
        const int oy = blockIdx.y * kTileH + threadIdx.y + j * kBlockRows;
        if (oy >= P.out_h) break;
        float v[S::kOut];
        const int dy = oy - by;
        if (!x_in || dy < 0 || dy >= bh) {  // letterbox padding
#pragma unroll
            for (int k = 0; k < S::kOut; ++k) v[k] = P.fill[k];
        } else {
            int y0, y1;
            float ty;
            axis<S::kInterp>(dy, ch, bh, y_den, y_inv, flags & 2, y0, y1, ty);
            y0 += cy;
            y1 += cy;
            float r[S::kRead];
            if constexpr (S::kYuv == 0) {
                const In* p0 = s_in + y0 * sy;
                const In* p1 = s_in + y1 * sy;
#pragma unroll
                for (int k = 0; k < S::kRead; ++k) {  // bilinear (nearest: t = 0, the same pixel twice)
                    const float a = ldi(p0, o0[k]), b = ldi(p0, o1[k]);
                    const float c = ldi(p1, o0[k]), d = ldi(p1, o1[k]);
                    const float top = a + tx * (b - a), bottom = c + tx * (d - c);
                    r[k] = top + ty * (bottom - top);
                }
            } else {
                // NV12 / I420: each of the four source pixels to RGB (clamped to the source range), then
                // interpolated, as converting the frame and then resizing it. Chroma is 4:2:0: the pixel
                // (x, y) takes the chroma sample (x / 2, y / 2) (no chroma interpolation, as OpenCV).
                const longlong2 m2 = im2[2], m3 = im2[3], m4 = im2[4];  // u offset, row, column; v ...
                const int ys[2] = {y0, y1}, xs[2] = {x0, x1};
                float c[2][2][3];
#pragma unroll
                for (int a = 0; a < 2; ++a)
#pragma unroll
                    for (int b = 0; b < 2; ++b) {
                        const float yuv[3] = {
                            ld<In>(src, ys[a] * sy + xs[b] * sx),
                            ld<In>(base + m2.x, (ys[a] >> 1) * m2.y + (xs[b] >> 1) * m3.x),
                            ld<In>(base + m3.y, (ys[a] >> 1) * m4.x + (xs[b] >> 1) * m4.y)};
                        yuv_to_rgb(yuv, c[a][b], P);
                    }
#pragma unroll
                for (int k = 0; k < S::kRead; ++k) {  // read channel k: RGB channel channel(k)
                    const int ck = S::channel(k);
                    const float top = c[0][0][ck] + tx * (c[0][1][ck] - c[0][0][ck]);
                    const float bottom = c[1][0][ck] + tx * (c[1][1][ck] - c[1][0][ck]);
                    r[k] = top + ty * (bottom - top);
                }
            }
            S::color(r, v, P);
        }
        Out* q = o + oy * P.out_stride[1];
#pragma unroll
        for (int k = 0; k < S::kOut; ++k)
            q[P.out_plane[k]] = store_cast<Out>((v[k] * P.scale - P.mean[k]) * P.inv_std[k]);
    }
}

}  // namespace image
}  // namespace cufuse
