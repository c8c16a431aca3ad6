// cufuse: cross entropy over the classes of logits x [rows][cols] (row
// stride ld) with integer targets, label smoothing eps and a z-loss z:
//   lse  = log(sum_j exp(x_j))
//   loss = (1 - eps) (lse - x_t) + eps (lse - mean_j x_j) + z lse^2
// (torch.nn.functional.cross_entropy's definition, plus the z-loss); a row
// whose target is ignore_index has loss 0 and gradient 0.
//
// One block per row (grid-stride). The forward reads the row once: each
// thread keeps a running max m and sum s of exp(x - m) over its packs (the
// online softmax), the block merges them; it writes the row's loss and lse.
// The backward reads the row again and writes
//   dx_j = (p_j (1 + 2 z lse) - eps / C - (1 - eps) [j == t]) * scale_r,
// p_j = exp(x_j - lse), into dx, which may be x itself (the gradient in place
// of the logits: no second vocabulary-sized buffer); scale_r is the incoming
// gradient (divided by the count of rows for a mean), scale[r * sstride].
// Both work relative to the row's shift c = x_t (the target's logit where it
// is finite, else 0): the saved per-row value is lse - c = (m - c) + log(s),
// and p_j = exp((x_j - c) - (lse - c)), the mean is c + sum(x_j - c) / C. So
// logits sharing a large offset lose nothing to it: lse itself, rounded with
// the offset inside, is off by half its ulp (5e-4 at 1e4 in float32).
// A target outside [0, cols) other than ignore_index gives NaN for its row
// (checking on the host would need a synchronization).
#include "common.cuh"

namespace cufuse {

constexpr int kCeThreads = 512;

template <typename C> __device__ __forceinline__ C infinity() { return C(__int_as_float(0x7f800000)); }
template <typename C> __device__ __forceinline__ C quiet_nan() { return C(__int_as_float(0x7fffffff)); }

// exp(a - m), 0 where a is -inf (also when m is: nothing to add)
template <typename C> __device__ __forceinline__ C exp_shift(C a, C m) {
    return a == -infinity<C>() ? C(0) : math::exp_fast(a - m);
}

// (m, s): the running max and sum of exp(x - m); merged so that -inf parts add nothing
template <typename C> __device__ __forceinline__ void merge_ms(C& m, C& s, C m2, C s2) {
    const C mm = math::max_nan(m, m2);
    s = exp_shift(m, mm) * s + exp_shift(m2, mm) * s2;
    m = mm;
}

// The block's (m, s) and sum of x, every thread gets them (the same order
// everywhere: the same bits).
template <typename C> __device__ __forceinline__ void block_merge(C& m, C& s, C& sx, C (*red)[3]) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        merge_ms(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
        sx += __shfl_xor_sync(0xffffffffu, sx, o);
    }
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
    __syncthreads();  // red is reused from the previous row
    if ((threadIdx.x & 31) == 0) {
        red[warp][0] = m;
        red[warp][1] = s;
        red[warp][2] = sx;
    }
    __syncthreads();
    m = red[0][0];
    s = red[0][1];
    sx = red[0][2];
    for (int w = 1; w < warps; ++w) {
        merge_ms(m, s, red[w][0], red[w][1]);
        sx += red[w][2];
    }
}

// A compile-time bool as a value (a generic lambda's argument).
template <bool B> struct Flag {
    static constexpr bool value = B;
};

// The row's shift c (the header): x_t where t is a class and x_t is finite, else 0.
template <typename C, typename T> __device__ __forceinline__ C row_shift(const T* row, long long t, long long cols) {
    if (t < 0 || t >= cols) return C(0);
    const C xt = to_compute<C>(row[t]);
    return xt - xt == C(0) ? xt : C(0);  // (inf - inf and NaN - NaN are NaN)
}

// f(k, pack) over this thread's packs of a row of `cols` elements at `row`:
// whole 16-byte packs where the row starts on one (vec), the elements after
// the last whole pack one by one (a row of an odd vocabulary in a buffer
// whose rows are padded to packs); a row that does not start on a pack (vec
// false) goes element by element.
template <typename T, typename F>
__device__ __forceinline__ void each_pack(const T* row, long long cols, bool vec, F f) {
    constexpr int V = 16 / sizeof(T);
    long long done = 0;
    if (vec) {
        const Pack<T, V>* p = reinterpret_cast<const Pack<T, V>*>(row);
        for (long long k = threadIdx.x; k < cols / V; k += blockDim.x) {
            compute_t<T> t[V];
            unpack(load_pack(p + k), t);
            f(k * V, t, V);
        }
        done = cols / V * V;
    }
    for (long long e = done + threadIdx.x; e < cols; e += blockDim.x) {
        compute_t<T> t[V];
        t[0] = to_compute<compute_t<T>>(row[e]);
        f(e, t, 1);
    }
}

}  // namespace cufuse

template <typename T>
__global__ void __launch_bounds__(cufuse::kCeThreads)
cross_entropy_forward(cufuse::compute_t<T>* __restrict__ loss, cufuse::compute_t<T>* __restrict__ lse,
                      const T* __restrict__ x, const long long* __restrict__ target, long long rows, long long cols,
                      long long ld, long long ignore_index, double eps, double z, bool vec) {
    using namespace cufuse;
    using C = compute_t<T>;
    __shared__ C red[kCeThreads / 32][3];
    const bool smooth = eps != 0.0;  // (the sum of the row, for label smoothing)
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * ld;
        const long long t = target[r];
        // every thread needs c for the sum of x - c; without smoothing only the first, after the loop, which
        // then waits for no load of x_t (a forward 6% slower at bfloat16 4096x128256 with it first)
        C c = smooth ? row_shift<C>(row, t, cols) : C(0);
        C m = -infinity<C>(), s = C(0), sx = C(0);  // sx: the sum of x - c
        const auto pass = [&](auto with_sum) {
            each_pack(row, cols, vec, [&](long long, const C* v, int n) {
                C pm = v[0];
                for (int i = 1; i < n; ++i) pm = math::max_nan(pm, v[i]);
                if (pm > m || pm != pm) {  // a new max (or NaN): rescale what was summed
                    s *= exp_shift(m, pm);
                    m = pm;
                }
                for (int i = 0; i < n; ++i) {
                    s += exp_shift(v[i], m);
                    if constexpr (decltype(with_sum)::value) sx += v[i] - c;
                }
            });
        };
        if (smooth) pass(Flag<true>{});
        else pass(Flag<false>{});
        block_merge(m, s, sx, red);
        if (threadIdx.x == 0) {
            if (!smooth) c = row_shift<C>(row, t, cols);
            const C l = (m - c) + math::log(s);  // lse - c; all -inf: -inf; a NaN: NaN
            C out = C(0);
            if (t != ignore_index) {
                const C xt = (t >= 0 && t < cols) ? to_compute<C>(row[t]) - c : quiet_nan<C>();
                const C e = static_cast<C>(eps);
                out = (C(1) - e) * (l - xt);  // (terms of weight 0 left out: 0 * inf would be NaN)
                if (eps != 0.0) out += e * (l - sx / static_cast<C>(cols));
                if (z != 0.0) out += static_cast<C>(z) * (l + c) * (l + c);
            }
            loss[r] = out;
            lse[r] = l;
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(cufuse::kCeThreads)
cross_entropy_backward(T* dx, const T* x, const long long* __restrict__ target,
                       const cufuse::compute_t<T>* __restrict__ lse, const cufuse::compute_t<T>* __restrict__ scale,
                       long long sstride, long long rows, long long cols, long long ldx, long long ldd,
                       long long ignore_index, double eps, double z, bool vec) {
    using namespace cufuse;
    using C = compute_t<T>;
    constexpr int V = 16 / sizeof(T);
    const C e = static_cast<C>(eps), ec = static_cast<C>(eps / static_cast<double>(cols));
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long t = target[r];
        const bool ignored = t == ignore_index;
        const C l = lse[r], c = row_shift<C>(x + r * ldx, t, cols);  // (lse - c, c)
        __syncthreads();  // every thread has read x_t before any writes the row (dx may be x)
        // a target out of range (not ignored): its loss is NaN, and so is every element of its gradient
        const C sc = (t >= 0 && t < cols) ? scale[r * sstride] : quiet_nan<C>();
        const C pz = z != 0.0 ? C(1) + C(2) * static_cast<C>(z) * (l + c) : C(1);
        const C hit = C(1) - e;
        // p_j = 2**((x_j - c) log2(e) - (lse - c) log2(e)): one FMA after the shift, as many operations as
        // exp(x_j - lse) took before the shift
        const C log2e = C(1.4426950408889634), l2 = l * log2e;
        T* drow = dx + r * ldd;
        each_pack(x + r * ldx, cols, vec, [&](long long e0, const C* tv, int n) {
            C o[V];
            for (int i = 0; i < n; ++i)
                o[i] = ignored ? C(0)
                               : (math::exp2_fast(math::fma(tv[i] - c, log2e, -l2)) * pz - ec - (e0 + i == t ? hit : C(0))) * sc;
            if (n == V) {
                Pack<T, V> p;
#pragma unroll
                for (int i = 0; i < V; ++i) p.v[i] = from_compute<T>(o[i]);
                store_pack(reinterpret_cast<Pack<T, V>*>(drow + e0), p);
            } else {
                drow[e0] = from_compute<T>(o[0]);
            }
        });
    }
}
