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
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * ld;
        C m = -infinity<C>(), s = C(0), sx = C(0);
        each_pack(row, cols, vec, [&](long long, const C* t, int n) {
            C pm = t[0];
            for (int i = 1; i < n; ++i) pm = math::max_nan(pm, t[i]);
            if (pm > m || pm != pm) {  // a new max (or NaN): rescale what was summed
                s *= exp_shift(m, pm);
                m = pm;
            }
            for (int i = 0; i < n; ++i) {
                s += exp_shift(t[i], m);
                sx += t[i];
            }
        });
        block_merge(m, s, sx, red);
        if (threadIdx.x == 0) {
            const long long t = target[r];
            const C l = m + math::log(s);  // all -inf: -inf; a NaN: NaN
            C out = C(0);
            if (t != ignore_index) {
                const C xt = (t >= 0 && t < cols) ? to_compute<C>(row[t]) : quiet_nan<C>();
                const C e = static_cast<C>(eps);
                out = (C(1) - e) * (l - xt);  // (terms of weight 0 left out: 0 * inf would be NaN)
                if (eps != 0.0) out += e * (l - sx / static_cast<C>(cols));
                if (z != 0.0) out += static_cast<C>(z) * l * l;
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
        const C l = lse[r];
        // a target out of range (not ignored): its loss is NaN, and so is every element of its gradient
        const C sc = (t >= 0 && t < cols) ? scale[r * sstride] : quiet_nan<C>();
        const C pz = z != 0.0 ? C(1) + C(2) * static_cast<C>(z) * l : C(1);
        const C hit = C(1) - e;
        T* drow = dx + r * ldd;
        each_pack(x + r * ldx, cols, vec, [&](long long e0, const C* tv, int n) {
            C o[V];
            for (int i = 0; i < n; ++i)
                o[i] = ignored ? C(0) : (math::exp_fast(tv[i] - l) * pz - ec - (e0 + i == t ? hit : C(0))) * sc;
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
