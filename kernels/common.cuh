// cufuse: shared device helpers.
//
// Type conversion between storage types (__half, float, double) and the type
// arithmetic is done in (float for __half, the type itself otherwise), and
// math overloads so that functors can be written once for every dtype.
#pragma once

#include <cuda_fp16.h>

namespace cufuse {

// Arithmetic type for a storage type: float16 is computed in float32.
template <typename T> struct compute_type { using type = T; };
template <> struct compute_type<__half> { using type = float; };
template <typename T> using compute_t = typename compute_type<T>::type;

// Storage -> compute and compute -> storage conversions (round to nearest even).
template <typename C, typename T> __device__ __forceinline__ C to_compute(T v) { return static_cast<C>(v); }
template <> __device__ __forceinline__ float to_compute<float, __half>(__half v) { return __half2float(v); }

template <typename T, typename C> __device__ __forceinline__ T from_compute(C v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_compute<__half, float>(float v) { return __float2half_rn(v); }

// A host scalar arrives as a double. It is first rounded to the storage type
// (as NumPy does when a Python scalar meets an array), then widened.
template <typename T> __device__ __forceinline__ compute_t<T> scalar_to_compute(double s) {
    return to_compute<compute_t<T>>(from_compute<T>(static_cast<compute_t<T>>(s)));
}
template <> __device__ __forceinline__ float scalar_to_compute<__half>(double s) {
    return __half2float(__double2half(s));
}

// Math overloads: one spelling for float and double.
namespace math {
__device__ __forceinline__ float exp(float x) { return ::expf(x); }
__device__ __forceinline__ double exp(double x) { return ::exp(x); }
__device__ __forceinline__ float tanh(float x) { return ::tanhf(x); }
__device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
__device__ __forceinline__ double fma(double a, double b, double c) { return ::fma(a, b, c); }
// relu that propagates NaN (x > 0 is false for NaN, so test the other way).
template <typename C> __device__ __forceinline__ C relu(C x) { return x < C(0) ? C(0) : x; }
}  // namespace math

// 16-byte-aligned pack of N storage elements, loaded and stored as one access.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

// Pack loads and stores: one 16-byte (or narrower) access each. Streaming
// cache hints (__ldcs/__stcs) were measured on an H200 and gained nothing.
template <typename T, int N> __device__ __forceinline__ Pack<T, N> load_pack(const Pack<T, N>* p) { return *p; }
template <typename T, int N> __device__ __forceinline__ void store_pack(Pack<T, N>* p, const Pack<T, N>& v) { *p = v; }

template <typename T, int N> __device__ __forceinline__ bool is_aligned(const T* p) {
    return (reinterpret_cast<unsigned long long>(p) % (sizeof(T) * N)) == 0;
}

}  // namespace cufuse
