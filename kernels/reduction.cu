// cufuse: sum_squared and mean_abs (a map, then a sum).
//
// The host views the reduction as x[outer][R][inner] (C-contiguous):
//   * inner == 1 (a row reduction, e.g. the last axis): reduce_rows, a group
//     of `tpr` threads per (row, split), the row read in 16-byte packs on its
//     aligned window (rows.cuh), so any length and offset runs at full width;
//   * inner > 1 (a column reduction, e.g. the first axis): reduce_cols, a
//     block of 64 packs of columns by 4 row phases down the rows of a chunk
//     (cufuse/ops/reduction.py: _COL_BLOCK).
// When there are too few rows (or columns) to fill the GPU, each is split in
// `splits` chunks whose partial sums (in the accumulation type) a second
// launch of the same kernels adds up in a fixed order: results are the same
// from run to run. `scale` multiplies the final sum (1, or 1/count for a mean).
#include "rows.cuh"

struct Square {
    template <typename C> __device__ __forceinline__ C operator()(C v) const { return v * v; }
};
struct Abs {
    template <typename C> __device__ __forceinline__ C operator()(C v) const { return cufuse::math::abs(v); }
};
struct Identity {
    template <typename C> __device__ __forceinline__ C operator()(C v) const { return v; }
};

namespace cufuse {

template <typename Tout, typename A> __device__ __forceinline__ void finish(Tout* out, A* partial, long long i, A acc,
                                                                           double scale) {
    if (partial) partial[i] = acc;
    else out[i] = from_compute<Tout>(static_cast<compute_t<Tout>>(acc * static_cast<A>(scale)));
}

}  // namespace cufuse

// Row reduction: group g handles row g / splits, chunk g % splits of its
// aligned window; writes out[row] (splits == 1) or partial[g].
template <typename Map, typename Tin, typename A, typename Tout>
__global__ void __launch_bounds__(512) reduce_rows(Tout* out, A* partial, const Tin* x, long long rows, long long cols,
                                                   long long ldx, int tpr, int splits, double scale) {
    using namespace cufuse;
    constexpr int V = PackOf<Tin>::V;
    using P = typename PackOf<Tin>::type;
    // Packs in flight per thread. sum_squared(axis=-1) of 6250 x 8000 on an H200
    // (read bytes over the copy's rate, one run): U = 2 83.5% f32 / 73.9% f16
    // (6 blocks of 256 per SM), U = 4 81.3 / 68.8% (5 and 4 blocks), U = 8
    // 75.7 / 65.7%; capping registers with __launch_bounds__ spilled and lost.
    constexpr int U = 2;
    const Group<1> g(tpr);
    const long long item = g.item();
    const bool active = item < rows * splits;
    const long long row = active ? item / splits : 0;
    const int split = active ? static_cast<int>(item % splits) : 0;
    const Tin* xr = x + row * ldx;
    const int head = row_head(xr);
    const P* xp = reinterpret_cast<const P*>(xr - head);
    const long long npack = (head + cols + V - 1) / V;
    const long long per = (npack + splits - 1) / splits;
    const long long lo = per * split;
    const long long hi = !active ? lo : (lo + per < npack ? lo + per : npack);
    const Map map;
    A acc[U];  // one chain of additions per pack in flight
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = A(0);
    auto add = [&](A& a, long long k, const P& p) {
        const long long e0 = k * V - head;
        compute_t<Tin> t[V];
        unpack(p, t);
        if (e0 >= 0 && e0 + V <= cols) {
#pragma unroll
            for (int i = 0; i < V; ++i) a += map(static_cast<A>(t[i]));
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i)
                if (e0 + i >= 0 && e0 + i < cols) a += map(static_cast<A>(t[i]));
        }
    };
    long long k = lo + g.lane;
    for (; k + (U - 1) * static_cast<long long>(tpr) < hi; k += U * static_cast<long long>(tpr)) {
        P p[U];
#pragma unroll
        for (int u = 0; u < U; ++u) p[u] = xp[k + u * static_cast<long long>(tpr)];
#pragma unroll
        for (int u = 0; u < U; ++u) add(acc[u], k + u * static_cast<long long>(tpr), p[u]);
    }
    for (; k < hi; k += tpr) add(acc[0], k, xp[k]);
#pragma unroll
    for (int u = 1; u < U; ++u) acc[0] += acc[u];
    const A sum = g.reduce(acc[0], SumOp{}, 0);
    if (active && g.lane == 0) finish(out, splits > 1 ? partial : static_cast<A*>(nullptr), splits > 1 ? item : row,
                                      sum, scale);
}

// Column reduction over x[outer][R][inner]: a block of 256 threads, (BX, BY)
// from the host (cufuse/ops/reduction.py: _COL_BLOCK); threadIdx.x picks a
// pack of `vec` columns (vec is the pack width when inner and the base are
// pack aligned, else 1), threadIdx.y a phase of the rows of chunk
// blockIdx.y. Writes out[o * inner + c] (one chunk) or
// partial[(chunk * outer + o) * inner + c].
template <int V, typename Map, typename Tin, typename A, typename Tout>
__device__ __forceinline__ void reduce_cols_body(Tout* out, A* partial, const Tin* x, long long outer, long long R,
                                                 long long inner, long long chunk, double scale) {
    using namespace cufuse;
    constexpr int U = 4;
    __shared__ A part[256 * V];
    const int bx = blockDim.x, by = blockDim.y;
    const long long tiles = (inner + bx * V - 1) / (bx * V);
    const long long o = blockIdx.x / tiles;
    const long long c0 = (blockIdx.x % tiles) * bx * V + threadIdx.x * V;
    const long long r_lo = blockIdx.y * chunk;
    const long long r_hi = r_lo + chunk < R ? r_lo + chunk : R;
    const Map map;
    A acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = A(0);
    if (c0 < inner) {
        const Tin* base = x + (o * R) * inner + c0;
        using P = Pack<Tin, V>;
        long long r = r_lo + threadIdx.y;
        for (; r + by * (U - 1) < r_hi; r += by * U) {
            P p[U];
#pragma unroll
            for (int u = 0; u < U; ++u) p[u] = *reinterpret_cast<const P*>(base + (r + by * u) * inner);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                compute_t<Tin> t[V];
                unpack(p[u], t);
#pragma unroll
                for (int i = 0; i < V; ++i) acc[i] += map(static_cast<A>(t[i]));
            }
        }
        for (; r < r_hi; r += by) {
            compute_t<Tin> t[V];
            unpack(*reinterpret_cast<const P*>(base + r * inner), t);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += map(static_cast<A>(t[i]));
        }
    }
    if (by > 1) {
#pragma unroll
        for (int i = 0; i < V; ++i) part[(threadIdx.y * bx + threadIdx.x) * V + i] = acc[i];
        __syncthreads();
        if (threadIdx.y != 0) return;
#pragma unroll
        for (int i = 0; i < V; ++i)
            for (int y = 1; y < by; ++y) acc[i] += part[(y * bx + threadIdx.x) * V + i];
    }
    if (c0 < inner) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const long long c = c0 + i;
            if (gridDim.y > 1) partial[(blockIdx.y * outer + o) * inner + c] = acc[i];
            else finish(out, static_cast<A*>(nullptr), o * inner + c, acc[i], scale);
        }
    }
}

template <typename Map, typename Tin, typename A, typename Tout>
__global__ void __launch_bounds__(256) reduce_cols(Tout* out, A* partial, const Tin* x, long long outer, long long R,
                                                   long long inner, long long chunk, int vec, double scale) {
    if (vec) reduce_cols_body<cufuse::PackOf<Tin>::V, Map>(out, partial, x, outer, R, inner, chunk, scale);
    else reduce_cols_body<1, Map>(out, partial, x, outer, R, inner, chunk, scale);
}
