// cufuse: int8 quantization and dequantization functors for the elementwise
// driver (cufuse/ops/quantize.py), per tensor and per channel.
#include "elementwise.cuh"

// int8 quantization in R (float for float16/float32 input, double for float64):
// clamp(rint(x / scale + zero_point), -128, 127), NaN -> 0.
template <typename R> struct Quantize {
    using compute = R;
    R scale, zp;
    __device__ Quantize(double s, double z) : scale(static_cast<R>(s)), zp(static_cast<R>(z)) {}
    __device__ __forceinline__ signed char operator()(R x) const { return cufuse::math::quantize_int8(x, scale, zp); }
};

// (q - zero_point) * scale in R, then rounded to the output type.
template <typename R> struct Dequantize {
    using compute = R;
    R scale, zp;
    __device__ Dequantize(double s, double z) : scale(static_cast<R>(s)), zp(static_cast<R>(z)) {}
    __device__ __forceinline__ R operator()(R q) const { return (q - zp) * scale; }
};

// Per-channel parameters: element i is in channel (i / inner) % channels;
// scale and zero point are R arrays of `channels` entries on the device.
template <typename R> struct Channels {
    const R* scale;
    const R* zp;
    long long inner, channels;
    unsigned long long inner_mg, channels_mg;
    __device__ Channels(unsigned long long s, unsigned long long z, long long in, unsigned long long in_mg,
                        long long ch, unsigned long long ch_mg)
        : scale(reinterpret_cast<const R*>(s)), zp(reinterpret_cast<const R*>(z)), inner(in), channels(ch),
          inner_mg(in_mg), channels_mg(ch_mg) {}
    __device__ __forceinline__ long long channel(long long i) const {
        const long long q = cufuse::fast_div(i, inner, inner_mg);
        return q - cufuse::fast_div(q, channels, channels_mg) * channels;
    }
    // f(j, c) for the V consecutive elements from i0: the channel is divided
    // out once per pack and then stepped (no division per element).
    template <int V, typename F> __device__ __forceinline__ void for_pack(long long i0, F f) const {
        const long long q = cufuse::fast_div(i0, inner, inner_mg);
        long long r = i0 - q * inner;
        long long c = q - cufuse::fast_div(q, channels, channels_mg) * channels;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            f(j, c);
            if (++r == inner) {
                r = 0;
                if (++c == channels) c = 0;
            }
        }
    }
};

template <typename R> struct QuantizeCh : Channels<R> {
    using compute = R;
    static constexpr bool indexed = true;
    static constexpr bool packed = true;
    using Channels<R>::Channels;
    __device__ __forceinline__ signed char operator()(long long i, R x) const {
        const long long c = this->channel(i);
        return cufuse::math::quantize_int8(x, this->scale[c], this->zp[c]);
    }
    template <int V> __device__ __forceinline__ void pack(long long i0, const R (&x)[V], R (&y)[V]) const {
        this->template for_pack<V>(i0, [&](int j, long long c) {
            y[j] = static_cast<R>(cufuse::math::quantize_int8(x[j], this->scale[c], this->zp[c]));
        });
    }
};

template <typename R> struct DequantizeCh : Channels<R> {
    using compute = R;
    static constexpr bool indexed = true;
    static constexpr bool packed = true;
    using Channels<R>::Channels;
    __device__ __forceinline__ R operator()(long long i, R q) const {
        const long long c = this->channel(i);
        return (q - this->zp[c]) * this->scale[c];
    }
    template <int V> __device__ __forceinline__ void pack(long long i0, const R (&q)[V], R (&y)[V]) const {
        this->template for_pack<V>(i0, [&](int j, long long c) { y[j] = (q[j] - this->zp[c]) * this->scale[c]; });
    }
};

