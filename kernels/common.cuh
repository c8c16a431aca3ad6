// cufuse: shared device helpers.
//
// Type conversion between storage types (__half, __nv_bfloat16, float,
// double) and the type arithmetic is done in (float for the 16-bit floats,
// the type itself otherwise), and math overloads so that functors can be
// written once for every dtype.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cufuse {

// Arithmetic type for a storage type: float16 and bfloat16 are computed in float32.
template <typename T> struct compute_type { using type = T; };
template <> struct compute_type<__half> { using type = float; };
template <> struct compute_type<__nv_bfloat16> { using type = float; };
template <typename T> using compute_t = typename compute_type<T>::type;

// is_half: a 16-bit float storage type (float16 or bfloat16), computed in
// float32 and rounded once on store; the choices made for it (registers held
// in the storage type, polynomial degrees bounded by its precision) hold for
// both. Where the two differ (conversions), same_type<T, __half> tells.
template <typename T> struct is_half { static constexpr bool value = false; };
template <> struct is_half<__half> { static constexpr bool value = true; };
template <> struct is_half<__nv_bfloat16> { static constexpr bool value = true; };
template <typename T> struct is_float { static constexpr bool value = false; };
template <> struct is_float<float> { static constexpr bool value = true; };
template <> struct is_float<double> { static constexpr bool value = true; };
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// Storage -> compute and compute -> storage conversions (round to nearest even).
template <typename C, typename T> __device__ __forceinline__ C to_compute(T v) { return static_cast<C>(v); }
template <> __device__ __forceinline__ float to_compute<float, __half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_compute<float, __nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T, typename C> __device__ __forceinline__ T from_compute(C v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_compute<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_compute<__nv_bfloat16, float>(float v) {
    return __float2bfloat16_rn(v);
}

// A host scalar arrives as a double. It is first rounded to the storage type
// (as NumPy does when a Python scalar meets an array), then widened; the
// 16-bit floats round from the double once (no double rounding through float).
template <typename T> __device__ __forceinline__ compute_t<T> scalar_to_compute(double s) {
    return to_compute<compute_t<T>>(from_compute<T>(static_cast<compute_t<T>>(s)));
}
template <> __device__ __forceinline__ float scalar_to_compute<__half>(double s) {
    return __half2float(__double2half(s));
}
template <> __device__ __forceinline__ float scalar_to_compute<__nv_bfloat16>(double s) {
    return __bfloat162float(__double2bfloat16(s));
}

// Math overloads: one spelling for float and double.
namespace math {
__device__ __forceinline__ float exp(float x) { return ::expf(x); }
__device__ __forceinline__ double exp(double x) { return ::exp(x); }
// exp through the hardware exp2 (2 ulp, subnormal results flushed to 0); exact exp for double.
__device__ __forceinline__ float exp_fast(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
    return r;
}
__device__ __forceinline__ double exp_fast(double x) { return ::exp(x); }
__device__ __forceinline__ float tanh(float x) { return ::tanhf(x); }
__device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
__device__ __forceinline__ double fma(double a, double b, double c) { return ::fma(a, b, c); }
__device__ __forceinline__ float erf(float x) { return ::erff(x); }
__device__ __forceinline__ double erf(double x) { return ::erf(x); }
__device__ __forceinline__ float erfc(float x) { return ::erfcf(x); }
__device__ __forceinline__ double erfc(double x) { return ::erfc(x); }
__device__ __forceinline__ float log(float x) { return ::logf(x); }
__device__ __forceinline__ double log(double x) { return ::log(x); }
__device__ __forceinline__ float sqrt(float x) { return ::sqrtf(x); }
__device__ __forceinline__ double sqrt(double x) { return ::sqrt(x); }
__device__ __forceinline__ float abs(float x) { return ::fabsf(x); }
__device__ __forceinline__ double abs(double x) { return ::fabs(x); }
__device__ __forceinline__ float rint(float x) { return ::rintf(x); }  // half to even
__device__ __forceinline__ double rint(double x) { return ::rint(x); }
// max(a, b) where NaN wins (either operand), as torch.max and relu keep NaN.
// float on sm_80+: PTX max.NaN, one instruction (FMNMX.NAN) where the tests
// are two or three (FSETP + FSEL): float16 layer_norm_relu and softmax gain
// 2-8 points of copy (bench/NOTES.md, "Figures from code comments"). Equal
// values either way; a zero result may have either sign.
template <typename C> __device__ __forceinline__ C max_nan(C a, C b) { return (a != a || a > b) ? a : b; }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <> __device__ __forceinline__ float max_nan<float>(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#endif
template <typename C> __device__ __forceinline__ C relu(C x) { return max_nan(x, C(0)); }

// GELU with PyTorch's two definitions. gelu(v) = v Phi(v), Phi the normal
// CDF; written with erfc, Phi(v) = erfc(-v / sqrt 2) / 2, so that the left
// tail keeps its relative accuracy (1 + erf(v / sqrt 2) cancels for v < -3).
template <typename C> __device__ __forceinline__ C gelu_erf(C v) {
    return C(0.5) * v * erfc(v * C(-0.70710678118654752440));
}
template <typename C> __device__ __forceinline__ C gelu_tanh(C v) {
    return C(0.5) * v * (C(1) + tanh(C(0.79788456080286535588) * (v + C(0.044715) * v * v * v)));
}
// float (also float16's compute type): the same function written as
// 0.5 v (1 + tanh(u)) = v / (1 + exp(-2u)), with exp through ex2.approx and a
// fast division: a few ulps, and no cancellation in 1 + tanh(u) for negative
// v. About half the instructions of tanhf; measured on an H200 (50M float16,
// bias_gelu with a row bias): bench/NOTES.md. +-inf and NaN as before
// (inf, NaN = -inf * 0, NaN); below v = -10 it is -0 (the exact value is
// under 1e-37 in magnitude).
__device__ __forceinline__ float gelu_tanh(float v) {
    const float u = 0.79788456080286535588f * (v + 0.044715f * v * v * v);
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u * -2.8853900817779268f));  // exp(-2u)
    return __fdividef(v, 1.0f + e);
}

// c0 + u (c1 + u (c2 + ...)) with FMAs.
__device__ __forceinline__ float horner(float, float c0) { return c0; }
template <typename... R> __device__ __forceinline__ float horner(float u, float c0, float c1, R... rest) {
    return fmaf(horner(u, c1, rest...), u, c0);
}

// The upper tail of the standard normal, Q(a) = P(Z > a) = erfc(a / sqrt 2) / 2
// for a >= 0 (Q(+inf) = 0, Q(NaN) = NaN), as t 2**(p(t) - a**2 log2(e) / 2)
// with t = 1 / (1 + k a): the exp(-a**2 / 2) factor exact in form, the rest
// (a slowly varying function of t in (0, 1]) a polynomial of degree D fitted
// minimax to the log2 of Q over a in [0, 14], with float32 coefficients
// (kernels/fit_normal_tail.py makes them). Fit error, relative, of Q:
// D = 8 9.7e-8, D = 5 6.6e-6, D = 4 3.4e-5. rcp.approx and ex2.approx add
// about 3e-7, and the float rounding of a**2 log2(e) / 2 and of the ex2
// argument up to about 6e-8 a**2 (emulated in float32: 1.8e-6 near a = 6,
// 7e-6 near a = 12.5); results below 2**-126 (a > 12.95) are flushed to 0.
// Branch-free: D + 6 instructions, two of them MUFU (rcp, ex2), where erff
// takes two branches of ~10 each. p is in powers of t, not of t - tc: one
// subtraction less per element, and as accurate (fit_normal_tail.py). `lift`:
// the result is Q(a) 2**lift, the factor folded into the polynomial's constant
// term (gelu_dropout's 1 / (1 - p) at no cost per element: lift is the same
// for every element, so c0 + lift is computed once).
template <int D> __device__ __forceinline__ float normal_tail(float a, float lift = 0.0f) {
    static_assert(D == 8 || D == 5 || D == 4, "normal_tail: degree 8, 5 or 4");
    float t, p, r;
    if constexpr (D == 8) {
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(0.27399998903274536f, a, 1.0f)));
        p = horner(t, -3.1939258575439453f + lift, 1.45146906375885f, 0.5347195267677307f, 0.6574506759643555f,
                   -1.1557174921035767f, 2.2767016887664795f, -2.8398118019104004f, 1.6095422506332397f,
                   -0.34042808413505554f);
    } else if constexpr (D == 5) {
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(0.3490000069141388f, a, 1.0f)));
        p = horner(t, -2.8464243412017822f + lift, 1.4747564792633057f, 0.3440316319465637f, 0.7497895956039429f,
                   -1.0550647974014282f, 0.33291783928871155f);
    } else {
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(0.25999999046325684f, a, 1.0f)));
        p = horner(t, -3.2766237258911133f + lift, 1.531057357788086f, 0.2348162829875946f, 1.0630462169647217f,
                   -0.5523365139961243f);
    }
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(-0.7213475204444817f * a, a, p)));
    return t * r;
}

// s v Phi(v) in float, with Phi = Q(-v) for v < 0 and 1 - Q(v) otherwise and
// Q from normal_tail<D>: no cancellation in the left tail. s = 2**lift (1 for
// GELU itself): v (s - s Q) and v s Q, where s Q comes from normal_tail, so
// that a scale costs no multiply. +-inf and NaN as the erf form gives them
// (inf, NaN = -inf * 0, NaN).
template <int D> __device__ __forceinline__ float gelu_normal(float v, float s = 1.0f, float lift = 0.0f) {
    const float q = normal_tail<D>(fabsf(v), lift);
    return v * (v < 0.0f ? q : s - q);
}

// float (also float16's compute type): measured against float64 on an H200,
// at most 1.4e-6 relative for |v| < 5 (23 ulps, in the left tail near v = -5;
// 6e-7 near 0), about 7e-6 near v = -12.5 (see normal_tail), where erff's
// form is off by up to 6% of the value for v < -3 (1 + erf cancels); for
// -13.2 < v < -12.95 the result is -0 where the exact one is a normal float
// under 1e-37 in magnitude. bias_gelu with a row bias, 50M float32: 91% ->
// 98% of copy (bench/NOTES.md).
__device__ __forceinline__ float gelu_erf(float v) { return gelu_normal<8>(v); }

// gelu_erf for a result stored as T. float16 keeps 11 bits, so its GELU takes
// the degree-5 tail (7e-6 relative): over all 63488 finite float16 inputs, 237
// results are one ulp from the correctly rounded value (erff's form: 373),
// and 50M float16 bias_gelu goes from 79% to 83% of copy.
// bfloat16 (8 bits) takes the same tails, far inside its half ulp (2e-3).
template <typename T, typename C> __device__ __forceinline__ C gelu_erf_to(C v) {
    if constexpr (is_half<T>::value) return gelu_normal<5>(v);
    else return gelu_erf(v);
}
// s gelu(v) for a result stored as T, lift = log2(s): the scale folded into
// the tail (float compute: see gelu_normal); double multiplies. float16 takes
// the degree-4 tail here, one FMA less per element where arithmetic bounds
// the op (gelu_dropout): 3.4e-5 relative, a seventh of float16's half ulp, so
// every finite float16 input is still within one ulp of the correctly rounded
// value (at p = 0.1, 846 of the 56868 kept ones are one ulp off, H200;
// tests/test_dropout.py checks them all). bias_gelu, bound by memory, keeps
// degree 5 (as fast there: 91.3% of copy either way, 50M float16).
template <typename T, typename C> __device__ __forceinline__ C gelu_erf_scaled_to(C v, C s, float lift) {
    if constexpr (same_type<C, float>::value) return gelu_normal<is_half<T>::value ? 4 : 8>(v, s, lift);
    else return gelu_erf_to<T>(v) * s;
}

// x / s for quantize_int8, with inv = 1 / s, rounded to nearest as a true
// division is (NumPy's): for double the division itself; for float
// Markstein's correction of the reciprocal product, q = x * inv,
// q += (x - q * s) * inv with FMAs, which is the correctly rounded quotient
// (a bare reciprocal multiply moves ties) in fewer instructions than div.rn's
// checked sequence, once inv is shared by many elements (a per-tensor scale,
// or a pack in one channel). Callers take it only for 2**-60 <= s <= 2**60
// and |zp| <= 2**20 (reciprocal_ok; other scales divide): there inv is a
// normal number, and where the correction matters (|x| >= 2**-100) the
// residual x - q * s is not flushed; a smaller |x| gives |x / s| < 2**-40,
// whose code is rint(zp) whichever way q rounds. q is clamped to +-2**30
// before the correction, with no branch: x = +-inf would make inf - inf =
// NaN, and with |zp| <= 2**20 any |q| >= 2**30 gives the code -128 or 127
// anyway (the clamped quotient is not the division's there, the code is); a
// NaN x stays NaN (the FMA with x). Checked on an H200 over all 2**32
// float32 x, for scales across the range and at its ends and 4 zero points:
// the same int8 codes as div.rn everywhere. float16
// quantize per tensor: 63% -> 77% of copy in one run with a branchy form of
// this (bench/NOTES.md).
template <typename R> __device__ __forceinline__ bool reciprocal_ok(R, R) { return false; }
__device__ __forceinline__ bool reciprocal_ok(float s, float zp) {
    return s >= 0x1p-60f && s <= 0x1p60f && fabsf(zp) <= 0x1p20f;
}
template <typename R> __device__ __forceinline__ R div_by(R x, R s, R) { return x / s; }
__device__ __forceinline__ float div_by(float x, float s, float inv) {
    const float q = fminf(fmaxf(x * inv, -0x1p30f), 0x1p30f);
    return fmaf(fmaf(-q, s, x), inv, q);
}

// clamp(rint(v), -128, 127); NaN -> 0.
template <typename R> __device__ __forceinline__ signed char round_int8(R v) {
    if (v != v) return 0;
    v = rint(v);
    v = v < R(-128) ? R(-128) : (v > R(127) ? R(127) : v);
    return static_cast<signed char>(v);
}
// float without FRND and F2I (conversion-unit instructions): clamp first (rint
// is monotonic and the bounds are integers, so the result is the same), then
// add 1.5 * 2**23. That FADD rounds to an integer, half to even, and the low
// byte of the sum's bits is the integer in two's complement.
template <> __device__ __forceinline__ signed char round_int8<float>(float v) {
    const float c = fminf(fmaxf(v, -128.0f), 127.0f);
    const int b = __float_as_int(__fadd_rn(c, 12582912.0f));
    return v == v ? static_cast<signed char>(b) : static_cast<signed char>(0);
}
// static_cast<float>(d), rounded to nearest, without the -ftz conversion's
// flush of a subnormal result to zero (the bits are built from d * 2**149):
// a subnormal scale passed as a double reaches divide() unflushed.
__device__ __forceinline__ float float_of(double d) {
    if (!(fabs(d) < 0x1p-126)) return static_cast<float>(d);
    const unsigned m = static_cast<unsigned>(rint(fabs(d) * 0x1p149));  // <= 2**23: the least normal
    return __uint_as_float(m | (d < 0 ? 0x80000000u : 0u));
}
// x / s as NumPy divides: the kernels' float arithmetic flushes subnormal
// operands to zero (-ftz), which changes the quotient when |s| < 2**-60 (a
// subnormal x over a tiny s, or a subnormal s). There both are scaled by
// 2**64 first, from their bits when subnormal: the same quotient, exactly.
__device__ __forceinline__ float times_2_64(float v) {  // exact for |v| < 2**63
    const unsigned b = __float_as_uint(v);
    if ((b & 0x7f800000u) == 0) {  // zero or subnormal: m * 2**-149 * 2**64
        const float m = static_cast<float>(b & 0x007fffffu) * 0x1p-85f;
        return (b >> 31) ? -m : m;
    }
    return v * 0x1p64f;
}
template <typename R> __device__ __forceinline__ R divide(R x, R s) { return x / s; }
__device__ __forceinline__ float divide(float x, float s) {
    if (fabsf(s) < 0x1p-60f && fabsf(x) < 0x1p63f) return times_2_64(x) / times_2_64(s);
    return x / s;
}
// clamp(rint(x / scale + zp), -128, 127) with a true division; NaN -> 0. The
// second form takes inv = 1 / scale, computed once for many elements, and
// needs reciprocal_ok(scale, zp) (see div_by).
template <typename R> __device__ __forceinline__ signed char quantize_int8(R x, R scale, R zp) {
    return round_int8(divide(x, scale) + zp);
}
template <typename R> __device__ __forceinline__ signed char quantize_int8(R x, R scale, R inv, R zp) {
    return round_int8(div_by(x, scale, inv) + zp);
}
// (q - zp) * s as NumPy computes it: the PTX subtract and multiply without the
// .ftz that the kernels' -ftz adds, which flushed a subnormal zero point, scale
// or result to zero (float32 ALUs take subnormals at full speed since sm_20).
template <typename R> __device__ __forceinline__ R sub_keep(R a, R b) { return a - b; }
__device__ __forceinline__ float sub_keep(float a, float b) {
    float d;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
template <typename R> __device__ __forceinline__ R mul_keep(R a, R b) { return a * b; }
__device__ __forceinline__ float mul_keep(float a, float b) {
    float y;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
}
template <typename R> __device__ __forceinline__ R dequantize(R q, R zp, R s) { return mul_keep(sub_keep(q, zp), s); }
// A scalar parameter passed as a double, in R: float_of for float (a subnormal
// float scale or zero point stays subnormal), a plain conversion otherwise.
template <typename R> __device__ __forceinline__ R param_of(double v) {
    if constexpr (sizeof(R) == 4) return float_of(v);
    else return static_cast<R>(v);
}
// ---- more math, for generated (cufuse.fuse) code -----------------------------
__device__ __forceinline__ float exp2(float x) { return ::exp2f(x); }
__device__ __forceinline__ double exp2(double x) { return ::exp2(x); }
__device__ __forceinline__ float log1p(float x) { return ::log1pf(x); }
__device__ __forceinline__ double log1p(double x) { return ::log1p(x); }
__device__ __forceinline__ float expm1(float x) { return ::expm1f(x); }
__device__ __forceinline__ double expm1(double x) { return ::expm1(x); }
__device__ __forceinline__ float sin(float x) { return ::sinf(x); }
__device__ __forceinline__ double sin(double x) { return ::sin(x); }
__device__ __forceinline__ float cos(float x) { return ::cosf(x); }
__device__ __forceinline__ double cos(double x) { return ::cos(x); }
__device__ __forceinline__ float floor(float x) { return ::floorf(x); }
__device__ __forceinline__ double floor(double x) { return ::floor(x); }
__device__ __forceinline__ float ceil(float x) { return ::ceilf(x); }
__device__ __forceinline__ double ceil(double x) { return ::ceil(x); }
__device__ __forceinline__ float fmod(float a, float b) { return ::fmodf(a, b); }
__device__ __forceinline__ double fmod(double a, double b) { return ::fmod(a, b); }
__device__ __forceinline__ float copysign(float a, float b) { return ::copysignf(a, b); }
__device__ __forceinline__ double copysign(double a, double b) { return ::copysign(a, b); }
__device__ __forceinline__ float pow(float a, float b) { return ::powf(a, b); }
__device__ __forceinline__ double pow(double a, double b) { return ::pow(a, b); }
template <typename I> __device__ __forceinline__ I abs(I x) { return x < I(0) ? I(-x) : x; }  // integers
template <typename C> __device__ __forceinline__ C rsqrt(C x) { return C(1) / sqrt(x); }
template <typename C> __device__ __forceinline__ C sigmoid(C x) { return C(1) / (C(1) + exp(-x)); }
template <typename C> __device__ __forceinline__ C silu(C x) { return x / (C(1) + exp(-x)); }
// log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|))
template <typename C> __device__ __forceinline__ C softplus(C x) {
    return (x > C(0) ? x : C(0)) + log1p(exp(-abs(x)));
}
// NaN-propagating minimum / maximum (NumPy's), for floats and integers.
template <typename C> __device__ __forceinline__ C minimum(C a, C b) {
    return (a != a) ? a : ((b != b) ? b : (b < a ? b : a));
}
template <typename C> __device__ __forceinline__ C maximum(C a, C b) {
    return (a != a) ? a : ((b != b) ? b : (b > a ? b : a));
}
// Python's // and % (NumPy's floor_divide / remainder): the remainder takes
// the divisor's sign; integer division by zero gives 0 (NumPy warns and gives 0).
template <typename C> __device__ __forceinline__ C floordiv(C a, C b) {
    if constexpr (is_float<C>::value) {
        // NumPy's npy_divmod: exact for representable quotients.
        if (b == C(0)) return a / b;
        C mod = fmod(a, b);
        C div = (a - mod) / b;
        if (mod != C(0) && ((b < C(0)) != (mod < C(0)))) div -= C(1);
        if (div != C(0)) {
            C fl = floor(div);
            if (div - fl > C(0.5)) fl += C(1);
            return fl;
        }
        return copysign(C(0), a / b);
    } else {
        if (b == C(0)) return C(0);
        if constexpr (C(-1) < C(0)) {
            // the lowest value over -1 overflows (undefined in C++): NumPy's wrapped -a, by unsigned arithmetic
            if (b == C(-1)) return static_cast<C>(0ull - static_cast<unsigned long long>(a));
        }
        C q = a / b;
        if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
        return q;
    }
}
template <typename C> __device__ __forceinline__ C pymod(C a, C b) {
    if constexpr (is_float<C>::value) {
        if (b == C(0)) return fmod(a, b);  // NaN, as NumPy
        C mod = fmod(a, b);
        if (mod != C(0)) {
            if ((b < C(0)) != (mod < C(0))) mod += b;
        } else {
            mod = copysign(C(0), b);
        }
        return mod;
    } else {
        if (b == C(0)) return C(0);
        if constexpr (C(-1) < C(0)) {
            if (b == C(-1)) return C(0);  // (the lowest value % -1 overflows in C++; NumPy gives 0)
        }
        C r = a % b;
        if (r != 0 && ((r < 0) != (b < 0))) r += b;
        return r;
    }
}
// a ** b: pow for floats; for integers repeated squaring, and for a negative
// exponent 1 / a**|b| truncated toward zero, as torch gives it: 1 for a base of
// 1, +-1 for -1 (the exponent's parity), 0 for every other base, 0 included.
template <typename C> __device__ __forceinline__ C power(C a, C b) {
    if constexpr (is_float<C>::value) {
        return pow(a, b);
    } else {
        if (b < 0) return a == C(1) ? C(1) : a == C(-1) ? ((b & 1) ? C(-1) : C(1)) : C(0);
        C r = 1;
        while (b) {
            if (b & 1) r = C(r * a);
            a = C(a * a);
            b >>= 1;
        }
        return r;
    }
}
}  // namespace math

// Conversion to the storage type T, returned in T's compute type (float16,
// bfloat16: rounded to it, then widened): NumPy's astype, rounded once.
template <typename T, typename S> __device__ __forceinline__ compute_t<T> cast_to(S x) {
    if constexpr (same_type<T, __half>::value) {
        if constexpr (same_type<S, double>::value) return __half2float(__double2half(x));
        else return __half2float(__float2half_rn(static_cast<float>(x)));
    } else if constexpr (same_type<T, __nv_bfloat16>::value) {
        if constexpr (same_type<S, double>::value) return __bfloat162float(__double2bfloat16(x));
        else return __bfloat162float(__float2bfloat16_rn(static_cast<float>(x)));
    } else if constexpr (same_type<T, bool>::value) {
        return x != S(0);
    } else if constexpr ((same_type<S, float>::value || same_type<S, double>::value) &&
                         !same_type<T, float>::value && !same_type<T, double>::value) {
        // A float to an integer: truncated toward zero; NaN and values beyond the
        // range of int32 (int64 for 8-byte targets) give that type's minimum, and
        // narrower targets take the low bits, as NumPy and torch do on x86-64
        // (the GPU's own conversion saturates). Defined once: docs/fuse.md;
        // the NumPy path: numpy_eval.float_to_int.
        const double d = static_cast<double>(x);
        if constexpr (sizeof(T) == 8) {
            return (d >= -9223372036854775808.0 && d < 9223372036854775808.0)
                ? static_cast<T>(static_cast<long long>(d)) : static_cast<T>(-9223372036854775807LL - 1);
        } else {
            return static_cast<T>((d >= -2147483648.0 && d < 2147483648.0)
                ? static_cast<int>(d) : (-2147483647 - 1));
        }
    } else {
        return static_cast<T>(x);
    }
}
namespace math {
}  // namespace math

// n / d for a divisor fixed per launch: a multiply-high with a magic number
// computed on the host (cufuse/_arrays.py: fast_div_magic) when n and d are below 2**31,
// a plain 64-bit division beyond. `mg` packs the magic (low 32 bits) and the
// shift (high 32 bits).
__device__ __forceinline__ unsigned fast_div_u32(unsigned n, unsigned long long mg) {  // n, d < 2**31
    return (__umulhi(n, static_cast<unsigned>(mg)) + n) >> static_cast<unsigned>(mg >> 32);
}
__device__ __forceinline__ long long fast_div(long long n, long long d, unsigned long long mg) {
    if (n < (1LL << 31) && d < (1LL << 31)) return fast_div_u32(static_cast<unsigned>(n), mg);
    return n / d;
}

// Philox4x32-10 (Salmon et al., Random123): a counter-based generator; the
// same (counter, key) gives the same four words everywhere (the NumPy
// fallback implements it too). PhiloxKeys is a key's schedule (the key of
// each of the 10 rounds), built once per thread: the empty asm makes each
// round key an opaque value, which ptxas then keeps in a uniform register
// for the whole kernel; as plain sums of the seed it recomputed them inside
// every call (20 integer additions per block of 4 words; float16
// gelu_dropout's loop: 249 -> 213 SASS instructions per 8 elements, 40 -> 32
// registers, nvcc 13.0 sm_90).
struct PhiloxKeys {
    uint2 k[10];
    __device__ __forceinline__ explicit PhiloxKeys(unsigned long long seed) {
        constexpr unsigned W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
        for (int r = 0; r < 10; ++r) {
            k[r] = make_uint2(static_cast<unsigned>(seed) + r * W0, static_cast<unsigned>(seed >> 32) + r * W1);
            asm volatile("" : "+r"(k[r].x), "+r"(k[r].y));
        }
    }
};
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, const PhiloxKeys& ks) {
    constexpr unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const unsigned hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ ks.k[r].x, lo1, hi0 ^ c.w ^ ks.k[r].y, lo0);
    }
    return c;
}

// Philox4x32-10 at the 64-bit counter q (words 2, 3 zero) under a 64-bit key.
__device__ __forceinline__ uint4 philox_block(const PhiloxKeys& ks, unsigned long long q) {
    return philox4x32_10(make_uint4(static_cast<unsigned>(q), static_cast<unsigned>(q >> 32), 0u, 0u), ks);
}
// Word w of a Philox block.
__device__ __forceinline__ unsigned word_of(const uint4& r, int w) {
    return w == 0 ? r.x : (w == 1 ? r.y : (w == 2 ? r.z : r.w));
}
// Lane j of a block of `Bits`-bit lanes: Bits 32, word j; Bits 16, the low
// (j even) or high (j odd) half of word j / 2.
template <int Bits> __device__ __forceinline__ unsigned lane_of(const uint4& r, int j) {
    const unsigned word = word_of(r, Bits == 32 ? j : j >> 1);
    return Bits == 32 ? word : (word >> (16 * (j & 1))) & 0xFFFFu;
}
// Whether lane j of a block is >= thr (thr < 2**Bits). A high 16-bit lane is
// compared in place, word >= thr << 16, without the shift that lane_of takes.
// (Hopper's DPX compare, VIMNMX.U16x2 through __vibmax_u16x2, gives both
// halves' predicates in one instruction, but ptxas 13.0 keeps two dead PRMTs
// beside it: 186 -> 187 instructions per 8 float16 elements.)
template <int Bits> __device__ __forceinline__ bool lane_at_least(const uint4& r, int j, unsigned thr) {
    if constexpr (Bits == 16) {
        if (j & 1) return word_of(r, j >> 1) >= (thr << 16);
    }
    return lane_of<Bits>(r, j) >= thr;
}
// Element i's lane: lane i % L of the block at counter i / L, L = 128 / Bits
// (the NumPy fallback: cufuse/_random.py philox_lanes).
template <int Bits> __device__ __forceinline__ unsigned philox_lane(const PhiloxKeys& ks, long long i) {
    constexpr int L = 128 / Bits;
    return lane_of<Bits>(philox_block(ks, static_cast<unsigned long long>(i) / L), static_cast<int>(i % L));
}

// A pack of N storage elements, moved in 16-byte (or narrower) accesses; it
// is aligned to its size, at most 16 bytes, which is all those accesses need.
template <typename T, int N> struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
    T v[N];
};

// Pack loads and stores. Packs of 1-byte elements go through 32-bit words
// built with shifts, so the compiler never splits them into byte accesses.
// (Streaming cache hints, __ldcs/__stcs, were measured on an H200 and gained nothing
// here; the reductions' read-once loads do use them: load_hinted below.)
template <typename T, int N> __device__ __forceinline__ Pack<T, N> load_pack(const Pack<T, N>* p) {
    if constexpr (sizeof(T) == 1 && N % 4 == 0) {
        const unsigned* w = reinterpret_cast<const unsigned*>(p);
        unsigned u[N / 4];
        if constexpr (N == 16) {
            const uint4 r = *reinterpret_cast<const uint4*>(p);
            u[0] = r.x; u[1] = r.y; u[2] = r.z; u[3] = r.w;
        } else {
#pragma unroll
            for (int g = 0; g < N / 4; ++g) u[g] = w[g];
        }
        Pack<T, N> v;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const unsigned char b = static_cast<unsigned char>(u[j / 4] >> (8 * (j % 4)));
            v.v[j] = *reinterpret_cast<const T*>(&b);
        }
        return v;
    } else {
        return *p;
    }
}
template <typename T, int N> __device__ __forceinline__ void store_pack(Pack<T, N>* p, const Pack<T, N>& v) {
    if constexpr (sizeof(T) == 1 && N % 4 == 0) {
        unsigned u[N / 4];
#pragma unroll
        for (int g = 0; g < N / 4; ++g) {
            u[g] = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                u[g] |= static_cast<unsigned>(*reinterpret_cast<const unsigned char*>(&v.v[4 * g + j])) << (8 * j);
        }
        if constexpr (N == 16) {
            *reinterpret_cast<uint4*>(p) = make_uint4(u[0], u[1], u[2], u[3]);
        } else {
#pragma unroll
            for (int g = 0; g < N / 4; ++g) reinterpret_cast<unsigned*>(p)[g] = u[g];
        }
    } else {
        *p = v;
    }
}

// Loads with a cache hint, for 16-byte packs (other sizes load plainly):
// - stream (ld.global.cs), for data read once (the reductions' x): evicted
//   from the caches first; what else the L2 holds (dirty lines of earlier
//   kernels, likely what the gain comes from) stays: faster reductions, no
//   gain for the row kernels' x (bench/NOTES.md, "Figures from code comments").
// - readonly (ld.global.nc), for data no thread writes during the kernel
//   (norm weights and biases): the compiler may issue them ahead of the
//   kernel's stores (see norm.cu RowView::store for the measurements).
enum class Hint { stream, readonly };
template <Hint H, typename P> __device__ __forceinline__ P load_hinted(const P* p) {
    if constexpr (sizeof(P) == 16) {
        const uint4* q = reinterpret_cast<const uint4*>(p);
        const uint4 v = H == Hint::stream ? __ldcs(q) : __ldg(q);
        P r;
        memcpy(&r, &v, 16);
        return r;
    } else {
        return *p;
    }
}

// Asynchronous 16-byte copies from global to shared memory (cp.async.cg,
// sm_80+; kAsyncCopy is false on older GPUs, whose callers keep their
// register loads and never call these). commit_async closes a group of
// copies; wait_async<N> waits until at most N groups are still in flight,
// after which the thread sees the data of the others in shared memory.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kAsyncCopy = true;
__device__ __forceinline__ void copy_async_16(void* smem, const void* gmem) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_async() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
constexpr bool kAsyncCopy = false;
__device__ __forceinline__ void copy_async_16(void*, const void*) {}
__device__ __forceinline__ void commit_async() {}
template <int N> __device__ __forceinline__ void wait_async() {}
#endif

// A pack converted to the compute type; 16-bit float pairs convert two at a time.
template <typename C, typename T, int N> __device__ __forceinline__ void unpack(const Pack<T, N>& p, C (&out)[N]) {
    if constexpr (same_type<T, __half>::value && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&p.v[i]));
            out[i] = f.x;
            out[i + 1] = f.y;
        }
    } else if constexpr (same_type<T, __nv_bfloat16>::value && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p.v[i]));
            out[i] = f.x;
            out[i + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_compute<C>(p.v[i]);
    }
}

template <typename T, int N> __device__ __forceinline__ bool is_aligned(const T* p) {
    return (reinterpret_cast<unsigned long long>(p) % alignof(Pack<T, N>)) == 0;
}

}  // namespace cufuse
