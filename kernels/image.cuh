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
//   kUnit                           every source's channel stride is 1 (interleaved pixels): a read
//                                   channel is a constant offset from its pixel
//   using Index                     int where the row strides of the sources and the output, in bytes,
//                                   fit in 31 bits (the host checks), else long long: a row's address is
//                                   then one multiply-add (IMAD.WIDE) of a 32-bit index and stride
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
    float gain[4];            // normalize, per output channel: x * gain + bias, gain = scale / std,
    float bias[4];            // bias = -mean / std (found in float64 on the host: one rounding each)
    float fill[4];            // letterbox padding, per output channel, before normalize
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
                // r / den rounded to nearest: r * inv corrected by its exact residual (one
                // step), so that t is the CPU's, 0.5 exactly at a 2x downscale whatever den
                const float t0 = static_cast<float>(r) * inv;
                t = fmaf(fmaf(-t0, static_cast<float>(den), static_cast<float>(r)), inv, t0);
            }
        }
    }
    if (flip) {
        i0 = n - 1 - i0;
        i1 = n - 1 - i1;
    }
}

// p advanced by ``off`` bytes, as a char pointer's add: an address made through an integer loses its
// global space, and the loads and stores through it become generic (LD / ST, not LDG / STG).
template <typename T> __device__ __forceinline__ T* byte_add(T* p, long long off) {
    return reinterpret_cast<T*>(const_cast<char*>(reinterpret_cast<const char*>(p)) + off);
}
// p advanced by i strides of ``bytes``: for an int stride one multiply-add of two 32-bit values into a
// 64-bit address (IMAD.WIDE; NVVM otherwise widens both and multiplies in 64 bits, four instructions).
template <typename T> __device__ __forceinline__ T* at(T* p, int i, long long bytes) {
    return byte_add(p, static_cast<long long>(i) * bytes);
}
template <typename T> __device__ __forceinline__ T* at(T* p, int i, int bytes) {
#ifdef __CUDA_ARCH__
    long long off;
    asm("mul.wide.s32 %0, %1, %2;" : "=l"(off) : "r"(i), "r"(bytes));
    return byte_add(p, off);
#else
    return at(p, i, static_cast<long long>(bytes));
#endif
}

// YUV -> RGB of one pixel's (y, u, v), the offsets and gains of the range, clamped to the source range.
__device__ __forceinline__ void yuv_to_rgb(const float (&r)[3], float (&rgb)[3], const Params& P) {
    const float y = (r[0] - P.y_offset) * P.y_gain;
    const float u = (r[1] - P.c_offset) * P.c_gain, v = (r[2] - P.c_offset) * P.c_gain;
    rgb[0] = fminf(fmaxf(y + P.yuv[0] * v, 0.0f), P.range);
    rgb[1] = fminf(fmaxf(y + P.yuv[1] * u + P.yuv[2] * v, 0.0f), P.range);
    rgb[2] = fminf(fmaxf(y + P.yuv[3] * u, 0.0f), P.range);
}

// Taps: a thread's column of one source image, sampled at a row pair (y0, y1, weight ty of y1): the
// value of each read channel, interpolated (bilinear; nearest: one tap, x1 == x0, y1 == y0).

// Interleaved or planar channels, any dtype: pointers at the tap columns, found once; a row is then one
// multiply-add per pointer and a load per value. kUnit (channel stride 1, interleaved pixels): a pointer
// per tap, the channels at constant offsets from it; else a pointer per tap and read channel.
template <typename S, bool kUnit> struct ChannelTaps {
    using In = typename S::In;
    static constexpr bool kTwo = S::kInterp == 2;
    static constexpr int kPtrs = kUnit ? 1 : S::kRead;
    const In* p0[kPtrs];
    const In* p1[kPtrs];
    typename S::Index sy;  // bytes
    float tx;

    // im2: the image's row of the images table (byte offset, strides of a row, a column, a channel)
    __device__ __forceinline__ ChannelTaps(const char* base, const longlong2* im2, int x0, int x1, float tx_)
        : tx(tx_) {
        const longlong2 m0 = im2[0], m1 = im2[1];
        const In* s = reinterpret_cast<const In*>(base + m0.x);
        const long long sx = m1.x, sc = m1.y;
        sy = static_cast<typename S::Index>(m0.y * static_cast<long long>(sizeof(In)));
#pragma unroll
        for (int k = 0; k < kPtrs; ++k) {
            const long long ck = kUnit ? 0 : S::channel(k) * sc;
            p0[k] = s + x0 * sx + ck;
            p1[k] = s + x1 * sx + ck;
        }
    }
    __device__ __forceinline__ void sample(int y0, int y1, float ty, float (&r)[S::kRead], const Params&) const {
        In a[S::kRead], b[S::kRead], c[S::kRead], d[S::kRead];
        const In *r00[kPtrs], *r01[kPtrs], *r10[kPtrs], *r11[kPtrs];
#pragma unroll
        for (int k = 0; k < kPtrs; ++k) {
            r00[k] = at(p0[k], y0, sy);
            if constexpr (kTwo) {
                r01[k] = at(p1[k], y0, sy);
                r10[k] = at(p0[k], y1, sy);
                r11[k] = at(p1[k], y1, sy);
            }
        }
#pragma unroll
        for (int k = 0; k < S::kRead; ++k) {  // every load first
            const int i = kUnit ? 0 : k, off = kUnit ? S::channel(k) : 0;
            a[k] = r00[i][off];
            if constexpr (kTwo) {
                b[k] = r01[i][off];
                c[k] = r10[i][off];
                d[k] = r11[i][off];
            }
        }
#pragma unroll
        for (int k = 0; k < S::kRead; ++k) {
            const float va = to_compute<float>(a[k]);
            if constexpr (kTwo) {
                const float vb = to_compute<float>(b[k]), vc = to_compute<float>(c[k]), vd = to_compute<float>(d[k]);
                const float top = va + tx * (vb - va), bottom = vc + tx * (vd - vc);
                r[k] = top + ty * (bottom - top);
            } else {
                r[k] = va;
            }
        }
    }
};

// NV12 / I420: each of the four source pixels to RGB (clamped to the source range), then interpolated,
// as converting the frame and then resizing it. Chroma is 4:2:0: the pixel (x, y) takes the chroma
// sample (x / 2, y / 2) (no chroma interpolation, as OpenCV).
template <typename S> struct YuvTaps {
    using In = typename S::In;
    const char* src;
    const char* base;
    long long sy, sx;
    longlong2 m2, m3, m4;  // the image's u offset, row, column; v ...
    int xs[2];
    float tx;

    __device__ __forceinline__ YuvTaps(const char* base_, const longlong2* im2, int x0, int x1, float tx_)
        : src(base_ + im2[0].x), base(base_), sy(im2[0].y), sx(im2[1].x), m2(im2[2]), m3(im2[3]), m4(im2[4]),
          xs{x0, x1}, tx(tx_) {}
    __device__ __forceinline__ void sample(int y0, int y1, float ty, float (&r)[S::kRead], const Params& P) const {
        const int ys[2] = {y0, y1};
        float c[2][2][3];
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const float yuv[3] = {
                    to_compute<float>(reinterpret_cast<const In*>(src)[ys[a] * sy + xs[b] * sx]),
                    to_compute<float>(reinterpret_cast<const In*>(base + m2.x)[(ys[a] >> 1) * m2.y + (xs[b] >> 1) * m3.x]),
                    to_compute<float>(reinterpret_cast<const In*>(base + m3.y)[(ys[a] >> 1) * m4.x + (xs[b] >> 1) * m4.y])};
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
};

// Threads and tiles: a block of 32 x 8 threads writes a tile of 32 x 32 output pixels of one item
// (blockIdx.x: tile column, blockIdx.y: tile row, blockIdx.z: item). A thread owns one column of the
// tile: the column's sample position (the x axis) is found once, then kRows rows. A warp writes 32
// consecutive pixels of a row: coalesced in NCHW. The rows' sample positions (the y axis) are found
// once per block, by its first warp, into shared memory.
constexpr int kTileW = 32, kTileH = 32, kBlockRows = 8, kRows = kTileH / kBlockRows;
static_assert(kTileH == 32, "the first warp finds the y axis of the tile's rows, a row per lane");

// One item's row of the item table: three 16-byte loads (rows are 48 bytes, the table 16-byte aligned).
struct Item {
    int img, cx, cy, cw, ch, bx, by, bw, bh, flags;
    __device__ __forceinline__ explicit Item(const int* items) {
        const int4* it4 = reinterpret_cast<const int4*>(items + blockIdx.z * kItem);
        const int4 i0 = it4[0], i1 = it4[1], i2 = it4[2];
        img = i0.x, cx = i0.y, cy = i0.z, cw = i0.w, ch = i1.x;
        bx = i1.y, by = i1.z, bw = i1.w, bh = i2.x, flags = i2.y;
    }
};

// The y axis of the tile's rows, by the block's first warp (a row per lane): per row the source rows
// y0, y1, the weight of y1 (float bits) and whether the row is inside the box (1) or padding (0).
template <typename S> __device__ __forceinline__ void tile_rows(const int* items, int4* rows) {
    const Item it(items);
    const int dy = blockIdx.y * kTileH + threadIdx.x - it.by;
    int4 e = make_int4(0, 0, 0, 0);
    if (dy >= 0 && dy < it.bh) {
        const int den = axis_den<S::kInterp>(it.bh);
        float ty;
        axis<S::kInterp>(dy, it.ch, it.bh, den, 1.0f / static_cast<float>(den), it.flags & 2, e.x, e.y, ty);
        e = make_int4(e.x + it.cy, e.y + it.cy, __float_as_int(ty), 1);
    }
    rows[threadIdx.x] = e;
}

// A thread's kRows rows of the tile, each sampled through ``taps``, converted, normalized and stored in
// every output plane (q: the planes' pointers at the thread's column; rs: the output's row stride, bytes).
template <typename S, typename Taps>
__device__ __forceinline__ void tile_loop(const Taps& taps, bool x_in, typename S::Out* const (&q)[S::kOut],
                                          typename S::Index rs, const Params& P, const int4* rows) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
        const int r = threadIdx.y + j * kBlockRows;
        const int oy = blockIdx.y * kTileH + r;
        if (oy >= P.out_h) break;
        const int4 e = rows[r];
        float v[S::kOut];
        if (x_in && e.w) {
            float smp[S::kRead];
            taps.sample(e.x, e.y, __int_as_float(e.z), smp, P);
            S::color(smp, v, P);
        } else {  // letterbox padding
#pragma unroll
            for (int k = 0; k < S::kOut; ++k) v[k] = P.fill[k];
        }
#pragma unroll
        for (int k = 0; k < S::kOut; ++k)
            *at(q[k], oy, rs) = store_cast<typename S::Out>(fmaf(v[k], P.gain[k], P.bias[k]));
    }
}

// A thread's column of the tile: its x axis once, then its rows.
template <typename S>
__device__ __forceinline__ void tile_columns(const char* base, const long long* __restrict__ images,
                                             const int* __restrict__ items, typename S::Out* __restrict__ out,
                                             const Params& P, const int4* rows) {
    using Out = typename S::Out;
    const int ox = blockIdx.x * kTileW + threadIdx.x;
    if (ox >= P.out_w) return;
    const Item it(items);
    const int dx = ox - it.bx;
    const bool x_in = dx >= 0 && dx < it.bw;
    int x0 = 0, x1 = 0;
    float tx = 0.0f;
    if (x_in) {
        const int den = axis_den<S::kInterp>(it.bw);
        axis<S::kInterp>(dx, it.cw, it.bw, den, 1.0f / static_cast<float>(den), it.flags & 1, x0, x1, tx);
    }
    x0 += it.cx;
    x1 += it.cx;
    // each output plane's pointer at this column; a row is then one multiply-add
    Out* q[S::kOut];
    Out* o = out + static_cast<long long>(blockIdx.z) * P.out_stride[0] + ox * P.out_stride[2];
#pragma unroll
    for (int k = 0; k < S::kOut; ++k) q[k] = o + P.out_plane[k];
    const auto rs = static_cast<typename S::Index>(P.out_stride[1] * static_cast<long long>(sizeof(Out)));
    const longlong2* im2 = reinterpret_cast<const longlong2*>(images + static_cast<long long>(it.img) * kImage);
    if constexpr (S::kYuv != 0)
        tile_loop<S>(YuvTaps<S>(base, im2, x0, x1, tx), x_in, q, rs, P, rows);
    else
        tile_loop<S>(ChannelTaps<S, S::kUnit>(base, im2, x0, x1, tx), x_in, q, rs, P, rows);
}

template <typename S>
__device__ __forceinline__ void run(const char* base, const long long* __restrict__ images,
                                    const int* __restrict__ items, typename S::Out* __restrict__ out,
                                    const Params& P) {
    __shared__ int4 rows[kTileH];
    if (threadIdx.y == 0) tile_rows<S>(items, rows);
    __syncthreads();
    tile_columns<S>(base, images, items, out, P, rows);
}

}  // namespace image
}  // namespace cufuse
