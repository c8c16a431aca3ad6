// cufuse: fused GELU + dropout for the elementwise driver
// (cufuse/ops/elementwise.py: gelu_dropout). The mask is counter-based
// (Philox4x32-10 in common.cuh), so the NumPy fallback draws the same one.
#include "elementwise.cuh"

// dropout(gelu(x)), gelu to the precision of the output type T: element i
// is kept iff its Bits-bit lane of Philox4x32-10 (common.cuh:
// philox_lane<Bits>, key `seed`) is >= floor(p * 2**Bits) (`threshold` is
// floor(p * 2**32)); kept values are scaled by 1 / (1 - p). The host takes
// Bits = 16 (8 elements per Philox call) for float16 outputs with p in
// [1/32, 31/32], where p's resolution of 2**-16 stays within half an ulp of
// float16 in the keep rate; 32 (4 per call) otherwise. float16 is bound by
// the generator's arithmetic, not by memory (H200, 50M, % of copy, 32 -> 16
// bits: 52.7 -> 63.0; bench/NOTES.md). The seed's round keys are built once
// per thread (common.cuh: PhiloxKeys) and lanes compared in 32 bits. The erf
// form takes 1 / (1 - p) in its tail's exponent (common.cuh: gelu_normal,
// `lift` from the host) rather than a multiply, float16 the degree-4 tail, a
// high 16-bit lane is compared without a shift, the scale and its log2 come
// from the host (not a log2f per thread), and the tail's polynomial is in t
// rather than t - tc (common.cuh: normal_tail): each step fewer instructions
// and more of copy (bench/NOTES.md, "Figures from code comments").
template <bool Tanh, typename T, int Bits> struct GeluDropout {
    static constexpr bool indexed = true;
    static constexpr bool packed = true;  // one Philox call serves 4 or 8 consecutive elements
    static constexpr int kLanes = 128 / Bits;  // elements per Philox call
    unsigned lane_threshold;  // floor(p * 2**Bits): a 32-bit compare per element, not a 64-bit one
    double scale;             // 1 / (1 - p), for double results
    float scale_f, lift;      // float(scale) and its log2 (host: cufuse/ops/elementwise.py), for float compute:
                              // the erf form folds the scale into its tail (common.cuh: gelu_normal)
    cufuse::PhiloxKeys keys;  // the seed's schedule, built once per thread
    __device__ __forceinline__ GeluDropout(unsigned long long seed_, unsigned long long threshold, double scale_,
                                           float scale_f_, float lift_)
        : lane_threshold(static_cast<unsigned>(threshold >> (32 - Bits))), scale(scale_), scale_f(scale_f_),
          lift(lift_), keys(seed_) {}
    __device__ __forceinline__ float scale_as(float) const { return scale_f; }
    __device__ __forceinline__ double scale_as(double) const { return scale; }
    template <typename C> __device__ __forceinline__ C keep(C x, bool kept) const {
        using namespace cufuse::math;
        const C s = scale_as(C(0));
        const C g = Tanh ? gelu_tanh(x) * s : gelu_erf_scaled_to<T>(x, s, lift);
        return kept ? g : C(0);
    }
    template <typename C> __device__ __forceinline__ C operator()(long long i, C x) const {
        return keep(x, cufuse::philox_lane<Bits>(keys, i) >= lane_threshold);
    }
    template <int V, typename C> __device__ __forceinline__ void pack(long long i0, const C (&x)[V], C (&y)[V]) const {
        if constexpr (V % kLanes == 0) {  // i0 is a multiple of V, so of kLanes: whole Philox blocks
#pragma unroll
            for (int g = 0; g < V / kLanes; ++g) {
                const uint4 r = cufuse::philox_block(keys, static_cast<unsigned long long>(i0) / kLanes + g);
#pragma unroll
                for (int j = 0; j < kLanes; ++j)
                    y[kLanes * g + j] = keep(x[kLanes * g + j], cufuse::lane_at_least<Bits>(r, j, lane_threshold));
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) y[j] = (*this)(i0 + j, x[j]);
        }
    }
};

// The gradient of gelu_dropout with respect to x from the incoming gradient g
// and x itself: the mask is drawn again from the same Philox lanes (nothing
// mask-sized is saved by the forward), g gelu'(x) / (1 - p) where kept, 0
// elsewhere. gelu'(v) = Phi(v) + v phi(v) (erf form) or the derivative of
// the tanh form, in the compute type. One Philox call per element (not per
// 4 or 8: pack() takes one input).
template <bool Tanh, typename T, int Bits> struct GeluDropoutGrad {
    static constexpr bool indexed = true;
    unsigned lane_threshold;
    double scale;
    float scale_f;
    cufuse::PhiloxKeys keys;
    __device__ __forceinline__ GeluDropoutGrad(unsigned long long seed_, unsigned long long threshold, double scale_,
                                               float scale_f_, float)
        : lane_threshold(static_cast<unsigned>(threshold >> (32 - Bits))), scale(scale_), scale_f(scale_f_),
          keys(seed_) {}
    __device__ __forceinline__ float scale_as(float) const { return scale_f; }
    __device__ __forceinline__ double scale_as(double) const { return scale; }
    template <typename C> __device__ __forceinline__ C operator()(long long i, C g, C v) const {
        namespace m = cufuse::math;
        if (cufuse::philox_lane<Bits>(keys, i) < lane_threshold) return C(0);
        C d;
        if constexpr (Tanh) {
            const C c = C(0.7978845608028654), k = C(0.044715);
            const C t = m::tanh(c * (v + k * v * v * v));
            d = C(0.5) * (C(1) + t) + C(0.5) * v * (C(1) - t * t) * c * (C(1) + C(3) * k * v * v);
        } else {
            d = C(0.5) * m::erfc(-v * C(0.7071067811865476)) + v * m::exp(C(-0.5) * v * v) * C(0.3989422804014327);
        }
        return g * d * scale_as(C(0));
    }
};
