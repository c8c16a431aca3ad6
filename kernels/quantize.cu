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
};

template <typename R> struct QuantizeCh : Channels<R> {
    using compute = R;
    static constexpr bool indexed = true;
    using Channels<R>::Channels;
    __device__ __forceinline__ signed char operator()(long long i, R x) const {
        const long long c = this->channel(i);
        return cufuse::math::quantize_int8(x, this->scale[c], this->zp[c]);
    }
};

template <typename R> struct DequantizeCh : Channels<R> {
    using compute = R;
    static constexpr bool indexed = true;
    using Channels<R>::Channels;
    __device__ __forceinline__ R operator()(long long i, R q) const {
        const long long c = this->channel(i);
        return (q - this->zp[c]) * this->scale[c];
    }
};

