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
// bits: 52.7 -> 63.0; bench/NOTES.md).
template <bool Tanh, typename T, int Bits> struct GeluDropout {
    static constexpr bool indexed = true;
    static constexpr bool packed = true;  // one Philox call serves 4 or 8 consecutive elements
    static constexpr int kLanes = 128 / Bits;  // elements per Philox call
    unsigned long long seed, threshold;
    double scale;
    template <typename C> __device__ __forceinline__ C keep(C x, unsigned w) const {
        const C g = Tanh ? cufuse::math::gelu_tanh(x) : cufuse::math::gelu_erf_to<T>(x);
        return w >= (threshold >> (32 - Bits)) ? g * static_cast<C>(scale) : C(0);  // floor(p * 2**Bits)
    }
    template <typename C> __device__ __forceinline__ C operator()(long long i, C x) const {
        return keep(x, cufuse::philox_lane<Bits>(seed, i));
    }
    template <int V, typename C> __device__ __forceinline__ void pack(long long i0, const C (&x)[V], C (&y)[V]) const {
        if constexpr (V % kLanes == 0) {  // i0 is a multiple of V, so of kLanes: whole Philox blocks
#pragma unroll
            for (int g = 0; g < V / kLanes; ++g) {
                const uint4 r = cufuse::philox_block(seed, static_cast<unsigned long long>(i0) / kLanes + g);
#pragma unroll
                for (int j = 0; j < kLanes; ++j) y[kLanes * g + j] = keep(x[kLanes * g + j], cufuse::lane_of<Bits>(r, j));
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) y[j] = (*this)(i0 + j, x[j]);
        }
    }
};
