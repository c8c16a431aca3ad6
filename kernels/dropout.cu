// cufuse: fused GELU + dropout for the elementwise driver
// (cufuse/ops/elementwise.py: gelu_dropout). The mask is counter-based
// (Philox4x32-10 in common.cuh), so the NumPy fallback draws the same one.
#include "elementwise.cuh"

// dropout(gelu(x)): element i is kept iff word i % 4 of Philox4x32-10 at
// counter i / 4 under key `seed` is >= threshold (= floor(p * 2**32)); kept
// values are scaled by 1 / (1 - p).
template <bool Tanh> struct GeluDropout {
    static constexpr bool indexed = true;
    unsigned long long seed, threshold;
    double scale;
    template <typename C> __device__ __forceinline__ C operator()(long long i, C x) const {
        const C g = Tanh ? cufuse::math::gelu_tanh(x) : cufuse::math::gelu_erf(x);
        return cufuse::philox_word(seed, i) >= threshold ? g * static_cast<C>(scale) : C(0);
    }
};
