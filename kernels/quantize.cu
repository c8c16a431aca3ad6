// cufuse: int8 quantization and dequantization functors for the elementwise
// driver (cufuse/ops/quantize.py), per tensor and per channel.
#include "elementwise.cuh"

// V int8 codes clamp(rint(x / s + z), -128, 127) of one pack in one channel
// (QuantizeCh), with inv = 1 / s: the scale, which only the device holds, is
// tested once per pack (math::reciprocal_ok); inside its range the pack
// multiplies by the reciprocal, outside it divides.
template <typename R, int V>
__device__ __forceinline__ void quantize_pack(const R (&x)[V], R s, R inv, R z, signed char (&y)[V]) {
    if (cufuse::math::reciprocal_ok(s, z)) {
#pragma unroll
        for (int j = 0; j < V; ++j) y[j] = cufuse::math::quantize_int8(x[j], s, inv, z);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) y[j] = cufuse::math::quantize_int8(x[j], s, z);
    }
}

// int8 quantization in R (float for float16/float32 input, double for float64):
// clamp(rint(x / scale + zero_point), -128, 127), NaN -> 0. Recip: the host
// found reciprocal_ok(scale, zero_point) (cufuse/ops/quantize.py), so every element
// multiplies by the reciprocal (math::div_by); else every element divides.
// Two functors, not a test per pack, because the division's code in the same
// kernel took float16 from 40 to 50 registers (ptxas sm_90); the dividing one
// is compiled only when a call needs it (family quantize:div).
template <typename R, bool Recip> struct Quantize {
    using compute = R;
    R scale, zp, inv;
    __device__ Quantize(double s, double z)
        : scale(cast(s)), zp(cast(z)), inv(R(1) / cast(s)) {}
    static __device__ __forceinline__ R cast(double v) {  // a subnormal float scale stays subnormal
        if constexpr (sizeof(R) == 4) return cufuse::math::float_of(v);
        else return static_cast<R>(v);
    }
    __device__ __forceinline__ signed char operator()(R x) const {
        return Recip ? cufuse::math::quantize_int8(x, scale, inv, zp) : cufuse::math::quantize_int8(x, scale, zp);
    }
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
    // For the V consecutive elements from i0 (a multiple of V): the channel
    // is divided out once per pack; then a pack inside one channel (axis 0
    // and most others) reads its scale once and calls shared(scale, zero
    // point); a pack of V consecutive channels (the last axis, aligned) reads
    // them in 16-byte packs, and anything else steps the channel per
    // element, both calling each(j, scale, zero point) per element.
    template <int V, typename FS, typename FE>
    __device__ __forceinline__ void for_pack(long long i0, FS shared, FE each) const {
        const long long q = cufuse::fast_div(i0, inner, inner_mg);
        long long c = q - cufuse::fast_div(q, channels, channels_mg) * channels;
        if (inner % V == 0) {
            shared(__ldg(scale + c), __ldg(zp + c));
        } else if (inner == 1 && channels % V == 0 && V % 4 == 0 && cufuse::is_aligned<R, 4>(scale) &&
                   cufuse::is_aligned<R, 4>(zp)) {
            // 16-byte loads (float) of the pack's V consecutive scales and zero points
#pragma unroll
            for (int g = 0; g < V / 4; ++g) {
                const auto s = cufuse::load_pack(reinterpret_cast<const cufuse::Pack<R, 4>*>(scale + c) + g);
                const auto z = cufuse::load_pack(reinterpret_cast<const cufuse::Pack<R, 4>*>(zp + c) + g);
#pragma unroll
                for (int j = 0; j < 4; ++j) each(4 * g + j, s.v[j], z.v[j]);
            }
        } else {
            long long r = i0 - q * inner;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                each(j, scale[c], zp[c]);
                if (++r == inner) {
                    r = 0;
                    if (++c == channels) c = 0;
                }
            }
        }
    }
};

template <typename R> struct QuantizeCh : Channels<R> {
    using compute = R;
    static constexpr bool indexed = true;
    static constexpr bool packed = true;
    static constexpr bool one_loop = true;  // whole and partial packs in one loop (elementwise.cuh)
    using pack_out = signed char;           // pack() writes the codes themselves
    using Channels<R>::Channels;
    __device__ __forceinline__ signed char operator()(long long i, R x) const {
        const long long c = this->channel(i);
        return cufuse::math::quantize_int8(x, this->scale[c], this->zp[c]);
    }
    template <int V>
    __device__ __forceinline__ void pack(long long i0, const R (&x)[V], signed char (&y)[V]) const {
        this->template for_pack<V>(
            i0, [&](R s, R z) { quantize_pack<R, V>(x, s, R(1) / s, z, y); },
            [&](int j, R s, R z) { y[j] = cufuse::math::quantize_int8(x[j], s, z); });
    }
};

template <typename R> struct DequantizeCh : Channels<R> {
    using compute = R;
    static constexpr bool indexed = true;
    static constexpr bool packed = true;
    static constexpr bool one_loop = true;  // whole and partial packs in one loop (elementwise.cuh)
    using Channels<R>::Channels;
    __device__ __forceinline__ R operator()(long long i, R q) const {
        const long long c = this->channel(i);
        return (q - this->zp[c]) * this->scale[c];
    }
    template <int V> __device__ __forceinline__ void pack(long long i0, const R (&q)[V], R (&y)[V]) const {
        this->template for_pack<V>(
            i0, [&](R s, R z) {
#pragma unroll
                for (int j = 0; j < V; ++j) y[j] = (q[j] - z) * s;
            },
            [&](int j, R s, R z) { y[j] = (q[j] - z) * s; });
    }
};

