// cufuse: fused GELU + dropout for the elementwise driver
// (cufuse/ops/elementwise.py: gelu_dropout). The mask is counter-based
// (Philox4x32-10 in common.cuh), so the NumPy fallback draws the same one.
#include "elementwise.cuh"

// dropout(gelu(x)), gelu to the precision of the output type T: element i is kept iff word i % 4 of Philox4x32-10 at
// counter i / 4 under key `seed` is >= threshold (= floor(p * 2**32)); kept
// values are scaled by 1 / (1 - p).
template <bool Tanh, typename T> struct GeluDropout {
    static constexpr bool indexed = true;
    static constexpr bool packed = true;  // one Philox call serves 4 consecutive elements
    unsigned long long seed, threshold;
    double scale;
    template <typename C> __device__ __forceinline__ C keep(C x, unsigned w) const {
        const C g = Tanh ? cufuse::math::gelu_tanh(x) : cufuse::math::gelu_erf_to<T>(x);
        return w >= threshold ? g * static_cast<C>(scale) : C(0);
    }
    template <typename C> __device__ __forceinline__ C operator()(long long i, C x) const {
        return keep(x, cufuse::philox_word(seed, i));
    }
    template <int V, typename C> __device__ __forceinline__ void pack(long long i0, const C (&x)[V], C (&y)[V]) const {
        if constexpr (V % 4 == 0) {  // i0 is a multiple of V, so of 4: whole Philox blocks
#pragma unroll
            for (int g = 0; g < V / 4; ++g) {
                const unsigned long long q = (static_cast<unsigned long long>(i0) >> 2) + g;
                const uint4 r = cufuse::philox4x32_10(
                    make_uint4(static_cast<unsigned>(q), static_cast<unsigned>(q >> 32), 0u, 0u),
                    make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32)));
                y[4 * g + 0] = keep(x[4 * g + 0], r.x);
                y[4 * g + 1] = keep(x[4 * g + 1], r.y);
                y[4 * g + 2] = keep(x[4 * g + 2], r.z);
                y[4 * g + 3] = keep(x[4 * g + 3], r.w);
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) y[j] = (*this)(i0 + j, x[j]);
        }
    }
};
