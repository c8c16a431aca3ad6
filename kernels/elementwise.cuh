// cufuse: the one generic elementwise driver.
//
// An op is a functor with `template <typename C> C operator()(C...) const`
// taking and returning values in the compute type (float for __half). The
// driver owns everything else:
//
//   * contiguous path: grid-stride over 16-byte packs when every pointer is
//     aligned to 16 bytes; the tail (n % pack), or everything when a pointer
//     is misaligned, element by element (packed ops: in partial packs); see
//     run_contiguous; 64-bit indices throughout;
//   * strided path: any layout (transposed, step-sliced, broadcast with
//     stride 0, negative strides), dims collapsed on the host;
//   * scalar operands travel in the pointer slot (see the calling convention
//     below), so an all-array call passes exactly (out, inputs..., n).
//
// Calling convention of every entry point: (out, in_0 .. in_{N-1}, nm
// [, Layout], p...). `nm` holds the element count in its low kScalarShift
// bits; bit kScalarShift + k set means input k is a scalar, and its slot
// holds the bit pattern of a double instead of a pointer (the value is
// rounded to the storage type first, as NumPy rounds a Python scalar). Op
// parameters, if any, follow as `P... p` and construct the functor: Op{p...}.
// Entry points ew1/ew2/ew3 (and *_strided) differ only in the input count.
#pragma once

#include "common.cuh"

namespace cufuse {

constexpr int kScalarShift = 56;  // nm: count in bits 0..55, scalar flags above
constexpr int kMaxDims = 8;      // after collapsing; more falls back to a copy
constexpr int kMaxOperands = 4;  // the output plus up to three inputs

// Strides in elements, dim 0 innermost; operand 0 is the output. `magic`
// holds fast_div's multiplier for each dim's size. `vec`, set by the host
// (cufuse/ops/elementwise.py: strided_layout), picks the traversal:
//   0  one element per thread, any layout;
//   1  packs along dim 0 (its size a multiple of the pack width, the output
//      and every input contiguous or broadcast along it, packs aligned);
//   2  tiles: the output is C-contiguous and every input is a contiguous
//      block repeated over the others, so that its element for logical index
//      i is (i / div) % mod (a row bias: div 1, mod = row length; a
//      per-channel scale on axis 0: div = row size, mod = channels). Then
//      stride[k] holds, instead of strides, {pack, div, mod, magic(div),
//      magic(mod)}, pack 1 when the operand's pack is V consecutive elements
//      and 0 when it is one value repeated (as a stride of 0 along dim 0 says
//      in mode 1). No per-dim arithmetic and, in kernels of their own, at
//      most 32 registers: bias_gelu with a row bias went from 65% to 91% of
//      copy (float32, 50M, H200; bench/NOTES.md).
// N operands: the hand-written kernels use kMaxOperands; a generated
// (cufuse.fuse) kernel uses its own operand count.
template <int N> struct LayoutT {
    long long shape[kMaxDims];
    long long stride[N][kMaxDims];
    unsigned long long magic[kMaxDims];
    int ndim;
    int vec;
};
using Layout = LayoutT<kMaxOperands>;

// ---- functor traits ---------------------------------------------------------
// A functor may declare
//   using compute = T;                    the arithmetic type (default: compute_t<Tin>)
//   static constexpr bool indexed = true; operator() takes the element's logical
//                                         C-order index first: op(i, x...)
template <typename...> using void_t = void;
template <typename Op, typename Tin, typename = void> struct op_compute { using type = compute_t<Tin>; };
template <typename Op, typename Tin> struct op_compute<Op, Tin, void_t<typename Op::compute>> {
    using type = typename Op::compute;
};
template <typename Op, typename = void> struct op_indexed { static constexpr bool value = false; };
template <typename Op> struct op_indexed<Op, void_t<decltype(Op::indexed)>> { static constexpr bool value = Op::indexed; };

// A functor may also declare `static constexpr bool packed = true;` and
//   template <int V, typename C> void pack(long long i0, const C (&x)[V], C (&y)[V]) const
// to compute a whole pack of V consecutive elements at once (one input only),
// e.g. to share one random draw among several elements.
template <typename Op, typename = void> struct op_packed { static constexpr bool value = false; };
template <typename Op> struct op_packed<Op, void_t<decltype(Op::packed)>> { static constexpr bool value = Op::packed; };
// A packed op may also declare `using pack_out = T;`: pack() then writes T
// (int8 codes) instead of C values that the driver would convert again.
template <typename Op, typename C, typename = void> struct op_pack_out { using type = C; };
template <typename Op, typename C> struct op_pack_out<Op, C, void_t<typename Op::pack_out>> {
    using type = typename Op::pack_out;
};
// A packed op may also say `one_loop = true`: its contiguous kernel then runs
// whole and partial packs in one loop through one instance of pack()
// (run_contiguous_one_loop) instead of the aligned loop and a tail.
template <typename Op, typename = void> struct op_one_loop { static constexpr bool value = false; };
template <typename Op> struct op_one_loop<Op, void_t<decltype(Op::one_loop)>> {
    static constexpr bool value = op_packed<Op>::value && Op::one_loop;
};
// A one_loop op may also say `periodic = true`, and declare
//   long long period() const;          packs after which the packs' setup repeats
//   template <typename F> void with_setup(long long i0, F f) const;
//       calls f(st) once with the state st that pack() needs for the pack at
//       i0; st's type may depend on what setup found, so that each kind of
//       state gets a loop of its own, with no branch per pack
//   template <int V, typename C, typename Y> void pack(const S& st, long long i0, const C (&x)[V], Y (&y)[V]) const
// Its contiguous kernel then strides the grid by a multiple of period() packs,
// so that a thread sets up once for all its packs (per-channel quantize on the
// last axis: the channels' scales, zero points and reciprocals stay in
// registers). The strided and tiled kernels call the plain pack().
template <typename Op, typename = void> struct op_periodic { static constexpr bool value = false; };
template <typename Op> struct op_periodic<Op, void_t<decltype(Op::periodic)>> {
    static constexpr bool value = op_one_loop<Op>::value && Op::periodic;
};
// A periodic op of one input may say `async_stages = D`: where its input
// packs are 16 bytes, the contiguous kernel's whole-pack loop then copies
// each thread's next D packs into shared memory (cp.async, sm_80+; older
// GPUs keep the registers) instead of holding one next pack in registers:
// more loads in flight at the same registers (run_contiguous_one_loop;
// common.cuh: copy_async_16).
template <typename Op, typename = void> struct op_async_stages { static constexpr int value = 0; };
template <typename Op> struct op_async_stages<Op, void_t<decltype(Op::async_stages)>> {
    static constexpr int value = op_periodic<Op>::value && kAsyncCopy ? Op::async_stages : 0;
};
constexpr int kEwBlock = 256;  // threads per elementwise block (cufuse/_runtime.py: BLOCK)

// Each thread's D slots of shared memory for the packs in flight
// (op_async_stages): one array per (pack type, D) and block.
template <typename P, int D> __device__ __forceinline__ P (&stage_ring())[D][kEwBlock] {
    __shared__ P ring[D][kEwBlock];
    return ring;
}

template <typename Op, int NIN, typename C>
__device__ __forceinline__ auto apply_op(const Op& op, long long i, const C (&x)[NIN]) {
    if constexpr (op_indexed<Op>::value) {
        if constexpr (NIN == 1) return op(i, x[0]);
        else if constexpr (NIN == 2) return op(i, x[0], x[1]);
        else return op(i, x[0], x[1], x[2]);
    } else {
        if constexpr (NIN == 1) return op(x[0]);
        else if constexpr (NIN == 2) return op(x[0], x[1]);
        else return op(x[0], x[1], x[2]);
    }
}

// Splits nm into the count and the per-input scalar flags and values.
template <int NIN, typename C, typename Tin>
__device__ __forceinline__ long long decode_operands(const Tin* const (&in)[NIN], long long nm, bool (&is_s)[NIN],
                                                     C (&sc)[NIN]) {
#pragma unroll
    for (int k = 0; k < NIN; ++k) {
        // A call has at least one array (cufuse/_arrays.py checks), so the one
        // input of a unary op never is a scalar: known at compile time, so no
        // scalar state is live in its kernels.
        is_s[k] = NIN > 1 && ((nm >> (kScalarShift + k)) & 1);
        sc[k] = is_s[k] ? C(scalar_to_compute<Tin>(__longlong_as_double(reinterpret_cast<long long>(in[k])))) : C(0);
    }
    return nm & ((1LL << kScalarShift) - 1);
}

// Elements per pack: one 16-byte store per thread, so that every store
// instruction is coalesced across the warp; a wider input side is read in
// several 16-byte loads (L1 absorbs their stride). Measured on an H200 at
// 50M elements: quantize f32->int8 went from 59% of copy (4-byte int8
// stores) to 89%; dequantize int8->f32 with 16 elements per thread (four
// 16-byte stores per thread, 64 bytes apart) fell from 78% to 38%. A
// functor may say `static constexpr int pack_bytes = B;` for stores of B
// bytes instead (the host's ElementwiseOp(pack_bytes=) must agree).
template <typename Op, typename = void> struct op_pack_bytes { static constexpr int value = 16; };
template <typename Op> struct op_pack_bytes<Op, void_t<decltype(Op::pack_bytes)>> {
    static constexpr int value = Op::pack_bytes;
};
template <typename Op, typename Tout, typename Tin> struct PackWidth {
    static constexpr int value = op_pack_bytes<Op>::value / static_cast<int>(sizeof(Tout));
};

// One pack of V outputs from V elements of each input (already loaded).
// `st`: a periodic op's state for this pack (op_periodic), passed to pack().
template <typename Op, int NIN, int V, typename C, typename Tout, typename Tin, typename... S>
__device__ __forceinline__ Pack<Tout, V> compute_pack(const Op& op, long long i0, const Pack<Tin, V> (&x)[NIN],
                                                      const bool (&is_s)[NIN], const C (&sc)[NIN], const S&... st) {
    Pack<Tout, V> y;
    if constexpr (op_packed<Op>::value && NIN == 1) {
        C a[V];
        typename op_pack_out<Op, C>::type r[V];
#pragma unroll
        for (int j = 0; j < V; ++j) a[j] = is_s[0] ? sc[0] : to_compute<C>(x[0].v[j]);
        op.template pack<V>(st..., i0, a, r);
#pragma unroll
        for (int j = 0; j < V; ++j) y.v[j] = from_compute<Tout>(r[j]);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            C v[NIN];
#pragma unroll
            for (int k = 0; k < NIN; ++k) v[k] = is_s[k] ? sc[k] : to_compute<C>(x[k].v[j]);
            y.v[j] = from_compute<Tout>(apply_op<Op, NIN, C>(op, i0 + j, v));
        }
    }
    return y;
}

// Part of a pack: elements j < m of V from p (the others repeat p[0], so
// that the op sees ordinary values), and the matching partial store.
template <typename T, int V> __device__ __forceinline__ Pack<T, V> load_part(const T* p, long long m) {
    Pack<T, V> x;
#pragma unroll
    for (int j = 0; j < V; ++j) x.v[j] = p[j < m ? j : 0];
    return x;
}
template <typename T, int V> __device__ __forceinline__ void store_part(T* p, const Pack<T, V>& y, long long m) {
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (j < m) p[j] = y.v[j];
}

// The contiguous driver of a packed op with `one_loop`: whole and partial
// packs in one loop, one instance of pack(). Per-channel quantize/dequantize
// (50M, H200, one run each way): dequantize float32 axis 0 / last axis
// 58.6 / 73.9% of copy here, 52.7 / 63.4% in run_contiguous with an
// element-by-element tail, 53 / 60% with a partial-pack tail; gelu_dropout
// is the other way round (82.5% here, 89.3% in run_contiguous).
template <typename Op, int NIN, typename Tout, typename Tin>
__device__ __forceinline__ void run_contiguous_one_loop(const Op& op, Tout* out, const Tin* const (&in)[NIN],
                                                      long long nm) {
    using C = typename op_compute<Op, Tin>::type;
    constexpr int V = PackWidth<Op, Tout, Tin>::value;
    C sc[NIN];
    bool is_s[NIN];
    const long long n = decode_operands<NIN, C>(in, nm, is_s, sc);
    bool aligned = is_aligned<Tout, V>(out);
#pragma unroll
    for (int k = 0; k < NIN; ++k) aligned = aligned && (is_s[k] || is_aligned<Tin, V>(in[k]));
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    const auto body = [&](long long p, const auto&... st) {
        const long long i0 = p * V;
        const bool whole = aligned && i0 + V <= n;
        Pack<Tin, V> x[NIN];
#pragma unroll
        for (int k = 0; k < NIN; ++k) {
            if (is_s[k]) continue;
            if (whole) x[k] = load_pack(reinterpret_cast<const Pack<Tin, V>*>(in[k]) + p);
            else x[k] = load_part<Tin, V>(in[k] + i0, n - i0);
        }
        const Pack<Tout, V> y = compute_pack<Op, NIN, V, C, Tout>(op, i0, x, is_s, sc, st...);
        if (whole) store_pack(reinterpret_cast<Pack<Tout, V>*>(out) + p, y);
        else store_part(out + i0, y, n - i0);
    };
    if constexpr (op_periodic<Op>::value) {
        // A grid stride that is a multiple of the period keeps each thread on
        // packs of one setup; a grid smaller than one period sets up per pack.
        const long long period = op.period();
        if (nthreads >= period) {
            const long long stride = nthreads - nthreads % period;
            if (tid >= stride) return;
            op.with_setup(tid * V, [&](const auto& st) {
                if (!aligned || n % V) {
                    for (long long p = tid; p * V < n; p += stride) body(p, st);
                    return;
                }
                const long long npack = n / V;
                constexpr int D = sizeof(Pack<Tin, V>) == 16 && NIN == 1 ? op_async_stages<Op>::value : 0;
                if constexpr (D > 0) {
                    // Whole packs only, each thread's next D packs in flight
                    // as asynchronous copies into its slots of shared memory
                    // (one commit group per pack, empty past the end: the
                    // wait for the oldest is always wait_group D - 1).
                    // Faster than one pack ahead in registers (below) for
                    // the per-channel quantize (bench/NOTES.md, "Figures
                    // from code comments").
                    using PI = Pack<Tin, V>;
                    PI (&ring)[D][kEwBlock] = stage_ring<PI, D>();
                    const PI* src = reinterpret_cast<const PI*>(in[0]);
                    const auto issue = [&](long long p, int slot) {
                        if (p < npack) copy_async_16(&ring[slot][threadIdx.x], src + p);
                        commit_async();
                    };
#pragma unroll
                    for (int d = 0; d < D; ++d) issue(tid + d * stride, d);
                    int slot = 0;
                    for (long long p = tid; p < npack; p += stride) {
                        wait_async<D - 1>();  // this thread's copy of pack p has landed
                        PI x[1] = {ring[slot][threadIdx.x]};
                        issue(p + D * stride, slot);
                        store_pack(reinterpret_cast<Pack<Tout, V>*>(out) + p,
                                   compute_pack<Op, NIN, V, C, Tout>(op, p * V, x, is_s, sc, st));
                        slot = slot + 1 == D ? 0 : slot + 1;
                    }
                    return;
                }
                // Whole packs only, the next pack's loads issued before this
                // pack's arithmetic and store. Per-channel quantize float16 on
                // the last axis, 50M, H200, % of copy: 61.1 -> 72.5 with one
                // pack ahead; two or three ahead 64.9 / 63.5 (54 -> 60
                // registers; bench/NOTES.md).
                const auto load = [&](long long p, Pack<Tin, V> (&x)[NIN]) {
                    if (p >= npack) return;
#pragma unroll
                    for (int k = 0; k < NIN; ++k)
                        if (!is_s[k]) x[k] = load_pack(reinterpret_cast<const Pack<Tin, V>*>(in[k]) + p);
                };
                Pack<Tin, V> x[NIN], next[NIN];
                load(tid, x);
                for (long long p = tid; p < npack; p += stride) {
                    load(p + stride, next);
                    store_pack(reinterpret_cast<Pack<Tout, V>*>(out) + p,
                               compute_pack<Op, NIN, V, C, Tout>(op, p * V, x, is_s, sc, st));
#pragma unroll
                    for (int k = 0; k < NIN; ++k) x[k] = next[k];
                }
            });
        } else {
            for (long long p = tid; p * V < n; p += nthreads) op.with_setup(p * V, [&](const auto& st) { body(p, st); });
        }
    } else {
        for (long long p = tid; p * V < n; p += nthreads) body(p);
    }
}

// The contiguous driver: whole 16-byte packs while every pointer is aligned,
// then the tail (n % V), or everything when a pointer is misaligned. A
// `packed` op (one whose pack() shares work among the pack's elements, e.g.
// one Philox call per 4 or 8 dropout elements) has an expensive per-element
// operator(), so its tail goes through pack() too, in partial packs with
// element loads and stores (one instance of the op per kernel: gelu_dropout
// float32 44 -> 28 registers, ptxas sm_90); other ops take the tail element
// by element (routing theirs through pack() slowed float16 add_mul_exp from
// 74 to 86 us). Packed ops with `one_loop` take run_contiguous_one_loop.
template <typename Op, int NIN, typename Tout, typename Tin>
__device__ __forceinline__ void run_contiguous(const Op& op, Tout* out, const Tin* const (&in)[NIN], long long nm) {
    if constexpr (op_one_loop<Op>::value) {
        run_contiguous_one_loop<Op, NIN>(op, out, in, nm);
        return;
    }
    using C = typename op_compute<Op, Tin>::type;
    constexpr int V = PackWidth<Op, Tout, Tin>::value;
    C sc[NIN];
    bool is_s[NIN];
    const long long n = decode_operands<NIN, C>(in, nm, is_s, sc);
    bool aligned = is_aligned<Tout, V>(out);
#pragma unroll
    for (int k = 0; k < NIN; ++k) aligned = aligned && (is_s[k] || is_aligned<Tin, V>(in[k]));
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long done = 0;
    if (aligned) {
        // One 16-byte pack per input per thread per iteration. The host sizes
        // the grid to cover every pack in one pass up to a large cap (see
        // _runtime.WAVES): on an H200 that beat fewer threads each looping
        // over several packs, unrolled or not, by 2-5 points of copy bandwidth.
        Pack<Tout, V>* dst = reinterpret_cast<Pack<Tout, V>*>(out);
        const long long npack = n / V;
        // An indexed op (gelu_dropout: its index is the Philox counter) takes
        // 32-bit pack indices where p + nthreads cannot wrap (all but arrays
        // of 2**32 packs): the counter's high word is then zero and an
        // address one IMAD.WIDE. H200, 50M, same runs: float16 gelu_dropout
        // 79.1-79.5 -> 83.1-83.5% of copy, float32 unchanged. Other ops keep
        // the one 64-bit loop: a second one cost float32 bias_gelu (one pack
        // per thread, where the setup before the loop counts) 1.8 points.
        const auto packs = [&](auto p0) {
            using I = decltype(p0);
            for (I p = static_cast<I>(tid); p < static_cast<I>(npack); p += static_cast<I>(nthreads)) {
                Pack<Tin, V> x[NIN];
#pragma unroll
                for (int k = 0; k < NIN; ++k)
                    if (!is_s[k]) x[k] = load_pack(reinterpret_cast<const Pack<Tin, V>*>(in[k]) + p);
                const Pack<Tout, V> y =
                    compute_pack<Op, NIN, V, C, Tout>(op, static_cast<long long>(p) * V, x, is_s, sc);
                store_pack(dst + p, y);
            }
        };
        if constexpr (op_indexed<Op>::value) {
            if (npack + nthreads <= 0xFFFFFFFFll) packs(0u);
            else packs(0ll);
        } else {
            packs(0ll);
        }
        done = npack * V;
    }
    if constexpr (op_packed<Op>::value) {
        // partial packs from a multiple of V (pack() may rely on it)
        for (long long i0 = done + tid * V; i0 < n; i0 += nthreads * V) {
            Pack<Tin, V> x[NIN];
#pragma unroll
            for (int k = 0; k < NIN; ++k)
                if (!is_s[k]) x[k] = load_part<Tin, V>(in[k] + i0, n - i0);
            store_part(out + i0, compute_pack<Op, NIN, V, C, Tout>(op, i0, x, is_s, sc), n - i0);
        }
    } else {
        for (long long i = done + tid; i < n; i += nthreads) {
            C v[NIN];
#pragma unroll
            for (int k = 0; k < NIN; ++k) v[k] = is_s[k] ? sc[k] : to_compute<C>(in[k][i]);
            out[i] = from_compute<Tout>(apply_op<Op, NIN, C>(op, i, v));
        }
    }
}

// Element offsets of logical index i for the output (off[0]) and each input.
template <int NIN, int M>
__device__ __forceinline__ void strided_offsets(const LayoutT<M>& L, long long i, long long (&off)[NIN + 1]) {
#pragma unroll
    for (int k = 0; k <= NIN; ++k) off[k] = 0;
    long long rem = i;
#pragma unroll
    for (int d = 0; d < kMaxDims; ++d) {
        if (d >= L.ndim) break;
        // The outermost dim needs no division: what is left of i is its index.
        const long long q = d + 1 < L.ndim ? fast_div(rem, L.shape[d], L.magic[d]) : 0;
        const long long c = rem - q * L.shape[d];
        rem = q;
#pragma unroll
        for (int k = 0; k <= NIN; ++k) off[k] += c * L.stride[k][d];
    }
}

// Offset of operand k's element for logical index i in tile mode (L.vec == 2):
// (i / div) % mod in 32 bits with the magic numbers, no branch (the host
// takes tiles below 2**31 elements only; div 1 and mod n stand for "none").
template <int M> __device__ __forceinline__ long long tile_offset(const LayoutT<M>& L, int k, long long i) {
    const unsigned u = static_cast<unsigned>(i);
    const unsigned long long md = static_cast<unsigned long long>(L.stride[k][3]);
    const unsigned long long mm = static_cast<unsigned long long>(L.stride[k][4]);
    const unsigned q = fast_div_u32(u, md);
    const unsigned r = fast_div_u32(q, mm);
    return static_cast<long long>(q - r * static_cast<unsigned>(L.stride[k][2]));
}

// The pack traversal of the strided kernels (L.vec == 1): body(i0, off) for
// every pack of V elements, i0 its logical (C-order) index, off its element
// offset per operand; a grid-stride loop with one pack per thread per step.
// (A traversal that kept a column pack per thread and walked the rows, with no
// index division per pack, was measured on an H200 and gained nothing for
// bias_gelu with a row bias: bench/NOTES.md.)
template <int NOP, int V, int M, typename Body>
__device__ __forceinline__ void for_packs(const LayoutT<M>& L, long long n, Body body) {
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long off[NOP];
    for (long long q = tid; q < n / V; q += nthreads) {
        strided_offsets<NOP - 1>(L, q * V, off);
        body(q * V, off);
    }
}

// The tile traversal (L.vec == 2, its own kernels so that no other path sets
// their register count): the outputs are C-contiguous, so a pack's output
// offset is its logical index i0; inputs k >= first at tile_offset.
// body(i0, off) for every pack; off[k] = i0 for k < first.
template <int NOP, int V, int M, typename Body>
__device__ __forceinline__ void for_tiles(const LayoutT<M>& L, long long n, int first, Body body) {
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long off[NOP];
    for (long long q = tid; q < n / V; q += nthreads) {
        const long long i0 = q * V;
#pragma unroll
        for (int k = 0; k < NOP; ++k) off[k] = k < first ? i0 : tile_offset(L, k, i0);
        body(i0, off);
    }
}

// Pack of input k: V consecutive elements at in + off, or one value
// repeated (`bcast`: a stride of 0 along dim 0, or a tile constant over the pack).
template <typename T, int V> __device__ __forceinline__ Pack<T, V> load_or_bcast(const T* p, bool bcast) {
    if (bcast) {
        Pack<T, V> x;
        const T b = *p;
#pragma unroll
        for (int j = 0; j < V; ++j) x.v[j] = b;
        return x;
    }
    return load_pack(reinterpret_cast<const Pack<T, V>*>(p));
}

template <typename Op, int NIN, typename Tout, typename Tin>
__device__ __forceinline__ void run_strided(const Op& op, Tout* out, const Tin* const (&in)[NIN], long long nm,
                                            const Layout& L) {
    using C = typename op_compute<Op, Tin>::type;
    constexpr int V = PackWidth<Op, Tout, Tin>::value;
    C sc[NIN];
    bool is_s[NIN];
    const long long n = decode_operands<NIN, C>(in, nm, is_s, sc);
    if (L.vec) {
        // Dim 0 in packs (for_packs); an input with stride 0 along dim 0 is
        // one value broadcast over the pack.
        for_packs<NIN + 1, V>(L, n, [&](long long i0, const long long (&off)[NIN + 1]) {
            Pack<Tin, V> x[NIN];
#pragma unroll
            for (int k = 0; k < NIN; ++k)
                if (!is_s[k]) x[k] = load_or_bcast<Tin, V>(in[k] + off[k + 1], L.stride[k + 1][0] == 0);
            store_pack(reinterpret_cast<Pack<Tout, V>*>(out + off[0]),
                       compute_pack<Op, NIN, V, C, Tout>(op, i0, x, is_s, sc));
        });
        return;
    }
    // Any layout: one element per thread, computed as a pack of one (a
    // V-wide pack here would instantiate the op a second time).
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = tid; i < n; i += nthreads) {
        long long off[NIN + 1];
        strided_offsets<NIN>(L, i, off);
        Pack<Tin, 1> x[NIN];
#pragma unroll
        for (int k = 0; k < NIN; ++k)
            if (!is_s[k]) x[k].v[0] = in[k][off[k + 1]];
        out[off[0]] = compute_pack<Op, NIN, 1, C, Tout>(op, i, x, is_s, sc).v[0];
    }
}

template <typename Op, int NIN, typename Tout, typename Tin>
__device__ __forceinline__ void run_tiled(const Op& op, Tout* out, const Tin* const (&in)[NIN], long long nm,
                                          const Layout& L) {
    using C = typename op_compute<Op, Tin>::type;
    constexpr int V = PackWidth<Op, Tout, Tin>::value;
    // Arrays only: the host sends calls with a scalar operand to the strided
    // kernel, so that no scalar decoding is live here (40 -> 32 registers for
    // bias_gelu, which is what lets 8 blocks of 256 threads fit on an SM).
    C sc[NIN];
    bool is_s[NIN];
#pragma unroll
    for (int k = 0; k < NIN; ++k) {
        is_s[k] = false;
        sc[k] = C(0);
    }
    const long long n = nm;
    for_tiles<NIN + 1, V>(L, n, 1, [&](long long i0, const long long (&off)[NIN + 1]) {
        Pack<Tin, V> x[NIN];
#pragma unroll
        for (int k = 0; k < NIN; ++k) x[k] = load_or_bcast<Tin, V>(in[k] + off[k + 1], L.stride[k + 1][0] == 0);
        store_pack(reinterpret_cast<Pack<Tout, V>*>(out + i0), compute_pack<Op, NIN, V, C, Tout>(op, i0, x, is_s, sc));
    });
}

// ---- the N-ary driver: generated functors (cufuse.fuse) ---------------------
// cufuse/_fuse/codegen.py writes, per traced signature, a functor F with
//   static constexpr int N;   array operands, outputs first, then inputs
//   static constexpr int V;   elements per pack (one 16-byte store of the widest output)
//   bool aligned(void* const* p) const;     every operand at its pack alignment
//   template <int W> void apply(void* const* p, const long long (&off)[N], const bool (&bc)[N]) const;
//       computes W consecutive elements: operand k's start at element off[k]
//       of p[k], one value repeated over the W when bc[k]
// and its scalars as members (kernel arguments). Operands may differ in type,
// so F does the typed loads and stores (load_w/store_w); the traversal, the
// same as run_contiguous/run_strided above, lives here.
template <typename T, int W> __device__ __forceinline__ Pack<T, W> load_w(const void* base, long long off, bool bc) {
    return load_or_bcast<T, W>(static_cast<const T*>(base) + off, W == 1 || bc);
}
template <typename T, int W> __device__ __forceinline__ void store_w(void* base, long long off, const Pack<T, W>& y) {
    T* p = static_cast<T*>(base) + off;
    if constexpr (W == 1) *p = y.v[0];
    else store_pack(reinterpret_cast<Pack<T, W>*>(p), y);
}

template <typename F> __device__ __forceinline__ void run_fused(const F& f, void* const* p, long long n) {
    constexpr int N = F::N, V = F::V;
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long off[N];
    bool bc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) bc[k] = false;
    long long done = 0;
    if (f.aligned(p)) {
        const long long npack = n / V;
        for (long long q = tid; q < npack; q += nthreads) {
#pragma unroll
            for (int k = 0; k < N; ++k) off[k] = q * V;
            f.template apply<V>(p, off, bc);
        }
        done = npack * V;
    }
    for (long long i = done + tid; i < n; i += nthreads) {
#pragma unroll
        for (int k = 0; k < N; ++k) off[k] = i;
        f.template apply<1>(p, off, bc);
    }
}

template <typename F>
__device__ __forceinline__ void run_fused_strided(const F& f, void* const* p, long long n, const LayoutT<F::N>& L) {
    constexpr int N = F::N, V = F::V;
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long nthreads = static_cast<long long>(gridDim.x) * blockDim.x;
    long long off[N];
    bool bc[N];
    if (L.vec) {  // dim 0 in packs, as in run_strided
#pragma unroll
        for (int k = 0; k < N; ++k) bc[k] = L.stride[k][0] == 0;
        for_packs<N, V>(L, n, [&](long long, const long long (&o)[N]) { f.template apply<V>(p, o, bc); });
        return;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) bc[k] = false;
    for (long long i = tid; i < n; i += nthreads) {
        strided_offsets<N - 1>(L, i, off);
        f.template apply<1>(p, off, bc);
    }
}

// Tile mode for generated kernels (L.vec == 2): outputs C-contiguous, each
// input at its tile offset (for_tiles); its own entry point, fused_tiled.
template <typename F>
__device__ __forceinline__ void run_fused_tiled(const F& f, void* const* p, long long n, int nout,
                                                const LayoutT<F::N>& L) {
    constexpr int N = F::N, V = F::V;
    bool bc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) bc[k] = L.stride[k][0] == 0;
    for_tiles<N, V>(L, n, nout, [&](long long, const long long (&o)[N]) { f.template apply<V>(p, o, bc); });
}

// Horizontal fusion: many independent contiguous operand sets in one launch.
// `table` holds one row per set: N pointers, the element count, the first
// block. A block takes `upt` * blockDim.x packs of one set (a thread `upt`
// packs, blockDim.x apart), so that the binary search for its set (dependent
// loads) is paid once per several packs; the host picks `upt`
// (cufuse/_fuse/api.py: SEGMENT_PACKS, with the measurements). Sets are sorted
// by first block, and every set's pointers are pack-aligned (host-checked).
template <typename F>
__device__ __forceinline__ void run_fused_segments(const F& f, const long long* __restrict__ table, int nseg,
                                                   int upt) {
    constexpr int N = F::N, V = F::V, R = N + 2;
    const long long b = blockIdx.x;
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[mid * R + N + 1] <= b) lo = mid;
        else hi = mid - 1;
    }
    const long long* row = table + static_cast<long long>(lo) * R;
    void* p[N];
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = reinterpret_cast<void*>(row[k]);
    const long long n = row[N];
    const long long q0 = (b - row[N + 1]) * blockDim.x * upt + threadIdx.x;
    long long off[N];
    bool bc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) bc[k] = false;
    for (int u = 0; u < upt; ++u) {
        const long long q = q0 + static_cast<long long>(u) * blockDim.x;
        if ((q + 1) * V <= n) {
#pragma unroll
            for (int k = 0; k < N; ++k) off[k] = q * V;
            f.template apply<V>(p, off, bc);
        } else {
            for (long long i = q * V; i < n; ++i) {
#pragma unroll
                for (int k = 0; k < N; ++k) off[k] = i;
                f.template apply<1>(p, off, bc);
            }
        }
    }
}

// A trailing reduction over the last axis. F also has
//   struct Acc;  Acc init() const;  void combine(Acc&, const Acc&) const;
//   Acc shfl(const Acc&, int lane_mask) const;          __shfl_xor_sync of each member
//   template <int W> void accumulate(Acc&, void* const* p, const long long (&off)[N], const bool (&bc)[N]) const;
//   void finish(void* const* p, const long long (&off)[N], const Acc&, long long cols) const;
// L's dim 0 is the reduced axis (outputs have stride 0 there), dims 1.. the
// rows. `tpr` threads (a power of two <= blockDim.x = 256) reduce one row:
// warp shuffle, then shared memory across the row's warps.
template <typename F>
__device__ __forceinline__ void run_fused_rows(const F& f, void* const* p, long long rows, int tpr,
                                               const LayoutT<F::N>& L) {
    constexpr int N = F::N, V = F::V;
    using Acc = typename F::Acc;
    __shared__ Acc part[32];
    const long long cols = L.shape[0];
    const int lane = threadIdx.x & (tpr - 1);
    const int rpb = blockDim.x / tpr;
    const int width = tpr < 32 ? tpr : 32;
    bool bc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) bc[k] = L.stride[k][0] == 0;
    for (long long r0 = static_cast<long long>(blockIdx.x) * rpb; r0 < rows; r0 += static_cast<long long>(gridDim.x) * rpb) {
        const long long r = r0 + threadIdx.x / tpr;
        const bool active = r < rows;
        long long off[N];
#pragma unroll
        for (int k = 0; k < N; ++k) off[k] = 0;
        long long rem = active ? r : 0;
        for (int d = 1; d < L.ndim; ++d) {
            const long long qd = fast_div(rem, L.shape[d], L.magic[d]);
            const long long c = rem - qd * L.shape[d];
            rem = qd;
#pragma unroll
            for (int k = 0; k < N; ++k) off[k] += c * L.stride[k][d];
        }
        Acc acc = f.init();
        if (active) {
            long long co[N];
            if (L.vec) {
                for (long long c = static_cast<long long>(lane) * V; c < cols; c += static_cast<long long>(tpr) * V) {
#pragma unroll
                    for (int k = 0; k < N; ++k) co[k] = off[k] + c * L.stride[k][0];
                    f.template accumulate<V>(acc, p, co, bc);
                }
            } else {
                for (long long c = lane; c < cols; c += tpr) {
#pragma unroll
                    for (int k = 0; k < N; ++k) co[k] = off[k] + c * L.stride[k][0];
                    f.template accumulate<1>(acc, p, co, bc);
                }
            }
        }
        for (int m = width >> 1; m > 0; m >>= 1) f.combine(acc, f.shfl(acc, m));
        if (tpr > 32) {
            const int warp = threadIdx.x >> 5;
            if ((threadIdx.x & 31) == 0) part[warp] = acc;
            __syncthreads();
            if (lane == 0) {
                for (int w = 1; w < tpr / 32; ++w) f.combine(acc, part[warp + w]);
            }
            __syncthreads();
        }
        if (lane == 0 && active) f.finish(p, off, acc, cols);
    }
}

}  // namespace cufuse

// ---- kernel entry points (global namespace: short name expressions) --------
#define CUFUSE_EW_BOUNDS __launch_bounds__(cufuse::kEwBlock)

template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew1(Tout* out, const Tin* a, long long nm, P... p) {
    const Tin* in[1] = {a};
    cufuse::run_contiguous<Op, 1>(Op{p...}, out, in, nm);
}
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew2(Tout* out, const Tin* a, const Tin* b, long long nm, P... p) {
    const Tin* in[2] = {a, b};
    cufuse::run_contiguous<Op, 2>(Op{p...}, out, in, nm);
}
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew3(Tout* out, const Tin* a, const Tin* b, const Tin* c, long long nm, P... p) {
    const Tin* in[3] = {a, b, c};
    cufuse::run_contiguous<Op, 3>(Op{p...}, out, in, nm);
}

template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew1_strided(Tout* out, const Tin* a, long long nm, cufuse::Layout L, P... p) {
    const Tin* in[1] = {a};
    cufuse::run_strided<Op, 1>(Op{p...}, out, in, nm, L);
}
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew2_strided(Tout* out, const Tin* a, const Tin* b, long long nm, cufuse::Layout L,
                                             P... p) {
    const Tin* in[2] = {a, b};
    cufuse::run_strided<Op, 2>(Op{p...}, out, in, nm, L);
}
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew3_strided(Tout* out, const Tin* a, const Tin* b, const Tin* c, long long nm,
                                             cufuse::Layout L, P... p) {
    const Tin* in[3] = {a, b, c};
    cufuse::run_strided<Op, 3>(Op{p...}, out, in, nm, L);
}

// Tile mode (Layout vec 2), separate so that its register count is its own.
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew1_tiled(Tout* out, const Tin* a, long long nm, cufuse::Layout L, P... p) {
    const Tin* in[1] = {a};
    cufuse::run_tiled<Op, 1>(Op{p...}, out, in, nm, L);
}
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew2_tiled(Tout* out, const Tin* a, const Tin* b, long long nm, cufuse::Layout L,
                                           P... p) {
    const Tin* in[2] = {a, b};
    cufuse::run_tiled<Op, 2>(Op{p...}, out, in, nm, L);
}
template <typename Op, typename Tout, typename Tin, typename... P>
__global__ void CUFUSE_EW_BOUNDS ew3_tiled(Tout* out, const Tin* a, const Tin* b, const Tin* c, long long nm,
                                           cufuse::Layout L, P... p) {
    const Tin* in[3] = {a, b, c};
    cufuse::run_tiled<Op, 3>(Op{p...}, out, in, nm, L);
}
