// cufuse: fused elementwise ops, as functors for the driver in elementwise.cuh.
//
// Each functor receives values in the compute type C (float for __half,
// otherwise the storage type) and returns one value of that type. The Python
// side (cufuse/ops/elementwise.py) names the functor, its arity and its
// parameter types; the runtime instantiates ewN<Functor, T, T> for __half,
// float and double through name expressions.
#include "elementwise.cuh"

// relu(a + b)
struct AddRelu {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const {
        return cufuse::math::relu(a + b);
    }
};

// tanh(a * b)
struct MulTanh {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const {
        return cufuse::math::tanh(a * b);
    }
};

// exp((x + y) * 2)
struct AddMulExp {
    template <typename C> __device__ __forceinline__ C operator()(C x, C y) const {
        return cufuse::math::exp((x + y) * C(2));
    }
};

// q * k + v
struct Fma {
    template <typename C> __device__ __forceinline__ C operator()(C q, C k, C v) const {
        return cufuse::math::fma(q, k, v);
    }
};

// gelu(x + bias), PyTorch's erf definition (to the precision of the output
// type T) / its tanh approximation
template <typename T> struct BiasGeluErf {
    template <typename C> __device__ __forceinline__ C operator()(C x, C b) const {
        return cufuse::math::gelu_erf_to<T>(x + b);
    }
};
struct BiasGeluTanh {
    template <typename C> __device__ __forceinline__ C operator()(C x, C b) const {
        return cufuse::math::gelu_tanh(x + b);
    }
};

