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
        : scale(cufuse::math::param_of<R>(s)), zp(cufuse::math::param_of<R>(z)),
          inv(R(1) / cufuse::math::param_of<R>(s)) {}
    __device__ __forceinline__ signed char operator()(R x) const {
        return Recip ? cufuse::math::quantize_int8(x, scale, inv, zp) : cufuse::math::quantize_int8(x, scale, zp);
    }
};

// (q - zero_point) * scale in R, then rounded to the output type.
template <typename R> struct Dequantize {
    using compute = R;
    R scale, zp;
    __device__ Dequantize(double s, double z)
        : scale(cufuse::math::param_of<R>(s)), zp(cufuse::math::param_of<R>(z)) {}
    __device__ __forceinline__ R operator()(R q) const { return cufuse::math::dequantize(q, zp, scale); }
};

// Per-channel parameters: element i is in channel (i / inner) % channels;
// scale and zero point are R arrays of `channels` entries on the device.
// Walk says how the V elements of a pack (V consecutive indices from a
// multiple of V) meet the channels. The host picks it per call
// (cufuse/ops/quantize.py: _walk), so that each kernel holds one path:
// - kInChannel: inner % V == 0, so a pack lies in one channel (axis 0 and
//   most others): one scale and zero point per pack;
// - kAcross: inner == 1, channels % V == 0, V % 4 == 0 and both parameter
//   arrays aligned to 4 elements (the last axis): a pack spans V consecutive
//   channels, whose parameters are read in packs of 4;
// - kAny: anything else, the channel stepped per element.
// Wide: indices may reach 2**31 (64-bit division); otherwise the divisions
// are 32-bit multiply-highs. One path per kernel, 32-bit indices, and the
// driver's aligned loop: 15-23 points of copy on axis 0 (bench/NOTES.md,
// "Figures from code comments").
enum ChannelWalk { kInChannel = 0, kAcross = 1, kAny = 2 };

template <typename R, int Walk, bool Wide> struct Channels {
    const R* scale;
    const R* zp;
    long long inner, channels;
    unsigned long long inner_mg, channels_mg;
    __device__ Channels(unsigned long long s, unsigned long long z, long long in, unsigned long long in_mg,
                        long long ch, unsigned long long ch_mg)
        : scale(reinterpret_cast<const R*>(s)), zp(reinterpret_cast<const R*>(z)), inner(in), channels(ch),
          inner_mg(in_mg), channels_mg(ch_mg) {}
    static __device__ __forceinline__ long long div(long long i, long long d, unsigned long long mg) {
        if constexpr (Wide) return cufuse::fast_div(i, d, mg);
        else return cufuse::fast_div_u32(static_cast<unsigned>(i), mg);
    }
    __device__ __forceinline__ long long channel(long long i) const {
        const long long q = Walk == kAcross ? i : div(i, inner, inner_mg);  // kAcross: inner == 1
        return q - div(q, channels, channels_mg) * channels;
    }
    // For the V consecutive elements from i0 (a multiple of V): kInChannel
    // calls shared(scale, zero point) once; the others call each(j, scale,
    // zero point) per element. The stepping walk is right for any pack.
    template <int V, typename FS, typename FE>
    __device__ __forceinline__ void for_pack(long long i0, FS shared, FE each) const {
        if constexpr (Walk == kInChannel) {
            const long long c = channel(i0);
            shared(__ldg(scale + c), __ldg(zp + c));
        } else if constexpr (Walk == kAcross && V % 4 == 0) {
            const long long c = channel(i0);
#pragma unroll
            for (int g = 0; g < V / 4; ++g) {
                const auto s = cufuse::load_pack(reinterpret_cast<const cufuse::Pack<R, 4>*>(scale + c) + g);
                const auto z = cufuse::load_pack(reinterpret_cast<const cufuse::Pack<R, 4>*>(zp + c) + g);
#pragma unroll
                for (int j = 0; j < 4; ++j) each(4 * g + j, s.v[j], z.v[j]);
            }
        } else {
            // kAny (or a kAcross pack of other than a multiple of 4: one element)
            const long long q = div(i0, inner, inner_mg);
            long long c = q - div(q, channels, channels_mg) * channels;
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

// one_loop (elementwise.cuh run_contiguous_one_loop: whole and partial packs
// in one loop) or the aligned loop and a tail, whichever was faster per walk:
// the aligned loop for kInChannel and for dequantize kAcross; one loop for
// quantize kAcross (since then periodic, below) and kAny (bench/NOTES.md,
// "Figures from code comments").
template <typename R, int Walk, bool Wide, int PackBytes> struct QuantizeChBase : Channels<R, Walk, Wide> {
    using compute = R;
    static constexpr bool indexed = true;
    static constexpr bool packed = true;
    static constexpr bool one_loop = Walk != kInChannel;
    static constexpr int pack_bytes = PackBytes;  // codes per pack (cufuse/ops/quantize.py: _quant_pack_bytes)
    using pack_out = signed char;  // pack() writes the codes themselves
    using Channels<R, Walk, Wide>::Channels;
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

template <typename R, int Walk, bool Wide, int PackBytes> struct QuantizeCh : QuantizeChBase<R, Walk, Wide, PackBytes> {
    using QuantizeChBase<R, Walk, Wide, PackBytes>::QuantizeChBase;
};

// The last axis (kAcross) is periodic (elementwise.cuh op_periodic): a pack
// spans V channels, and the packs one grid stride apart, a multiple of
// channels / V packs, span the same V. Each thread loads their scales and
// zero points once and takes the reciprocals once, where the stateless pack()
// loaded 2V parameters per V codes, in loads 4V elements apart across the
// warp: ncu put L1 at 90% and DRAM at 43% for float16 (bench/NOTES.md).
// 50M as (rows, 1024), H200, % of copy, stateless -> periodic (one pack
// loaded ahead, a grid of one wave: cufuse/ops/quantize.py): float16 51.6 ->
// 75.0, float32 87.1 -> 91.7 (bench/NOTES.md);
// float16 packs of 8 codes, not 16 (16: 56.2 against 61.2, before the load
// ahead; more registers). Two kinds of state, so that each gets a loop of
// its own: Recip when every channel of the pack is reciprocal_ok (a
// corrected product with inv), else a division (a test per pack in one
// loop: float16 48.7 against 66.2 for a kernel with no division at all).
// float only: double data divides anyway, and its state (2V doubles) would
// take the kernel from 78 to 124 registers (ptxas sm_90).
template <int V, bool Recip> struct AcrossParams {
    float s[V], z[V], inv[Recip ? V : 1];
};

// V codes by true division, out of line: inlined, this rare path's code took
// the float16 kernel from 48 to 64 registers (ptxas sm_90).
template <int V>
__device__ __noinline__ cufuse::Pack<signed char, V> quantize_dividing(cufuse::Pack<float, V> x, cufuse::Pack<float, V> s,
                                                                       cufuse::Pack<float, V> z) {
    cufuse::Pack<signed char, V> y;
#pragma unroll
    for (int j = 0; j < V; ++j) y.v[j] = cufuse::math::quantize_int8(x.v[j], s.v[j], z.v[j]);
    return y;
}

template <int PackBytes>
struct QuantizeCh<float, kAcross, false, PackBytes> : QuantizeChBase<float, kAcross, false, PackBytes> {
    using R = float;
    static constexpr int V = PackBytes;  // int8 codes per pack
    static_assert(V % 4 == 0, "kAcross reads parameters in packs of 4");
    static constexpr bool periodic = true;
    // float16 input (16-byte packs of 8 codes): 4 packs in flight through
    // shared memory, 75.1 -> 84.8% of copy; float32's 32-byte packs keep
    // one pack ahead in registers (staged: 91.8 -> 89.9). elementwise.cuh:
    // op_async_stages.
    static constexpr int async_stages = 4;
    using QuantizeChBase<R, kAcross, false, PackBytes>::QuantizeChBase;
    using QuantizeChBase<R, kAcross, false, PackBytes>::pack;
    __device__ __forceinline__ long long period() const { return this->channels / V; }
    template <typename F> __device__ __forceinline__ void with_setup(long long i0, F f) const {
        AcrossParams<V, true> st;
        const long long c = this->channel(i0);
        bool recip = true;
#pragma unroll
        for (int g = 0; g < V / 4; ++g) {
            const auto s = cufuse::load_pack(reinterpret_cast<const cufuse::Pack<R, 4>*>(this->scale + c) + g);
            const auto z = cufuse::load_pack(reinterpret_cast<const cufuse::Pack<R, 4>*>(this->zp + c) + g);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                st.s[4 * g + j] = s.v[j];
                st.z[4 * g + j] = z.v[j];
                recip = recip && cufuse::math::reciprocal_ok(s.v[j], z.v[j]);
            }
        }
        if (recip) {
#pragma unroll
            for (int j = 0; j < V; ++j) st.inv[j] = R(1) / st.s[j];
            f(st);
        } else {
            AcrossParams<V, false> sd;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                sd.s[j] = st.s[j];
                sd.z[j] = st.z[j];
            }
            f(sd);
        }
    }
    template <int W, bool Recip>
    __device__ __forceinline__ void pack(const AcrossParams<V, Recip>& st, long long, const R (&x)[W],
                                         signed char (&y)[W]) const {
        static_assert(W == V, "a periodic pack is the functor's own width");
        if constexpr (Recip) {
#pragma unroll
            for (int j = 0; j < V; ++j) y[j] = cufuse::math::quantize_int8(x[j], st.s[j], st.inv[j], st.z[j]);
        } else {
            cufuse::Pack<R, V> xp, sp, zp;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                xp.v[j] = x[j];
                sp.v[j] = st.s[j];
                zp.v[j] = st.z[j];
            }
            const auto yp = quantize_dividing<V>(xp, sp, zp);
#pragma unroll
            for (int j = 0; j < V; ++j) y[j] = yp.v[j];
        }
    }
};

template <typename R, int Walk, bool Wide> struct DequantizeCh : Channels<R, Walk, Wide> {
    using compute = R;
    static constexpr bool indexed = true;
    static constexpr bool packed = true;
    static constexpr bool one_loop = Walk == kAny;  // see QuantizeCh
    using Channels<R, Walk, Wide>::Channels;
    __device__ __forceinline__ R operator()(long long i, R q) const {
        const long long c = this->channel(i);
        return cufuse::math::dequantize(q, this->zp[c], this->scale[c]);
    }
    template <int V> __device__ __forceinline__ void pack(long long i0, const R (&q)[V], R (&y)[V]) const {
        this->template for_pack<V>(
            i0, [&](R s, R z) {
#pragma unroll
                for (int j = 0; j < V; ++j) y[j] = cufuse::math::dequantize(q[j], z, s);
            },
            [&](int j, R s, R z) { y[j] = cufuse::math::dequantize(q[j], z, s); });
    }
};

