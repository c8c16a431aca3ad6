// cufuse: scatter-add of rows with an activation fused in, and its backward
// (a gather), for message passing over a graph's edges:
//   forward   acc[index[e], c] += act(values[e, c])    (values [rows][cols], row stride ldv)
//   backward  dvalues[e, c] = act'(values[e, c]) * gout[index[e], c]
// acc is in the compute type (float for 16-bit data; the host converts it
// once). The sums are atomic adds: the order in which the rows that share an
// index add into it depends on timing, as in torch's index_add_, so the last
// bits of such a sum may differ between runs. Indices are checked on the host.
//
// Blocks of 32 x 8 threads: threadIdx.x along the columns (coalesced),
// threadIdx.y over rows, the blocks looping over rows.
#include "common.cuh"

namespace cufuse {

enum ScatterAct { kActNone = 0, kActRelu = 1, kActSilu = 2, kActGelu = 3, kActGeluTanh = 4 };

template <int A, typename C> __device__ __forceinline__ C activation(C x) {
    if constexpr (A == kActRelu) return math::relu(x);
    else if constexpr (A == kActSilu) return math::silu(x);
    else if constexpr (A == kActGelu) return math::gelu_erf(x);
    else if constexpr (A == kActGeluTanh) return math::gelu_tanh(x);
    else return x;
}

// The gradient through act at x of the output gradient g. relu selects (an inf or NaN g where
// x <= 0 gives 0, as torch's, not 0 * inf; a NaN x passes g, as torch's relu backward); the
// others multiply g by d act / dx.
template <int A, typename C> __device__ __forceinline__ C activation_backward(C x, C g) {
    if constexpr (A == kActRelu) {
        return x <= C(0) ? C(0) : g;
    } else if constexpr (A == kActSilu) {
        const C s = math::sigmoid(x);
        return s * (C(1) + x * (C(1) - s)) * g;
    } else if constexpr (A == kActGelu) {  // Phi(x) + x phi(x)
        const C r2 = C(0.70710678118654752440), rpi2 = C(0.39894228040143267794);
        return (C(0.5) * (C(1) + math::erf(x * r2)) + x * rpi2 * math::exp(C(-0.5) * x * x)) * g;
    } else if constexpr (A == kActGeluTanh) {  // 0.5 (1 + t) + 0.5 x (1 - t^2) k0 (1 + 3 k1 x^2)
        const C k0 = C(0.79788456080286535588), k1 = C(0.044715);
        const C t = math::tanh(k0 * (x + k1 * x * x * x));
        return (C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * k0 * (C(1) + C(3) * k1 * x * x)) * g;
    } else {
        return g;
    }
}

}  // namespace cufuse

template <typename T, int A>
__global__ void __launch_bounds__(256)
scatter_add_forward(cufuse::compute_t<T>* __restrict__ acc, const T* __restrict__ values,
                    const long long* __restrict__ index, long long rows, long long cols, long long ldv) {
    using namespace cufuse;
    using C = compute_t<T>;
    for (long long r = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows;
         r += static_cast<long long>(gridDim.x) * blockDim.y) {
        C* dst = acc + index[r] * cols;
        const T* src = values + r * ldv;
        for (long long c = threadIdx.x; c < cols; c += blockDim.x)
            atomicAdd(dst + c, activation<A>(to_compute<C>(src[c])));
    }
}

template <typename T, int A>
__global__ void __launch_bounds__(256)
scatter_add_backward(T* __restrict__ dv, const T* __restrict__ values, const T* __restrict__ gout,
                     const long long* __restrict__ index, long long rows, long long cols, long long ldv,
                     long long ldg) {
    using namespace cufuse;
    using C = compute_t<T>;
    for (long long r = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows;
         r += static_cast<long long>(gridDim.x) * blockDim.y) {
        const T* g = gout + index[r] * ldg;
        const T* src = values + r * ldv;
        T* out = dv + r * cols;
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
            const C gv = to_compute<C>(g[c]);
            const C x = to_compute<C>(src[c]);
            out[c] = from_compute<T>(activation_backward<A>(x, gv));
        }
    }
}
