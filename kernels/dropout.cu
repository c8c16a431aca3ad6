// cufuse: fused GELU + dropout for the elementwise driver
// (cufuse/ops/elementwise.py: gelu_dropout). The mask is counter-based
// (Philox4x32-10 in common.cuh), so the NumPy fallback draws the same one.
#include "elementwise.cuh"

// dropout(gelu(x)), gelu to the precision of the output type T: element i
// is kept iff its lane of Philox4x32-10 (common.cuh: philox_lane<Bits>, key
// `seed`) is >= floor(p * 2**Bits) (`threshold` is floor(p * 2**32)); kept values are scaled by
// 1 / (1 - p). Bits is 16 for float16 outputs (8 elements per Philox call),
// 32 otherwise (4 per call): float16 is bound by the generator's
// arithmetic, not by memory (H200, 50M, % of copy: see bench/NOTES.md).
template <bool Tanh, typename T> struct GeluDropout {
    static constexpr bool indexed = true;
    static constexpr bool packed = true;  // one Philox call serves 4 or 8 consecutive elements
    static constexpr int kBits = cufuse::is_half<T>::value ? 16 : 32;
    static constexpr int kLanes = 128 / kBits;  // elements per Philox call
    unsigned long long seed, threshold;
    double scale;
    template <typename C> __device__ __forceinline__ C keep(C x, unsigned w) const {
        const C g = Tanh ? cufuse::math::gelu_tanh(x) : cufuse::math::gelu_erf_to<T>(x);
        return w >= (threshold >> (32 - kBits)) ? g * static_cast<C>(scale) : C(0);  // floor(p * 2**kBits)
    }
    template <typename C> __device__ __forceinline__ C operator()(long long i, C x) const {
        return keep(x, cufuse::philox_lane<kBits>(seed, i));
    }
    template <int V, typename C> __device__ __forceinline__ void pack(long long i0, const C (&x)[V], C (&y)[V]) const {
        if constexpr (V % kLanes == 0) {  // i0 is a multiple of V, so of kLanes: whole Philox blocks
#pragma unroll
            for (int g = 0; g < V / kLanes; ++g) {
                const uint4 r = cufuse::philox_block(seed, static_cast<unsigned long long>(i0) / kLanes + g);
#pragma unroll
                for (int j = 0; j < kLanes; ++j) y[kLanes * g + j] = keep(x[kLanes * g + j], cufuse::lane_of<kBits>(r, j));
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) y[j] = (*this)(i0 + j, x[j]);
        }
    }
};
