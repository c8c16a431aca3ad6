// cufuse: sum_squared and mean_abs (a map, then a sum).
//
// The host views the reduction as x[outer][R][inner] (C-contiguous):
//   * inner == 1 (a row reduction, e.g. the last axis): reduce_rows_block, a
//     block per (row, split), for rows of at least 512 packs; reduce_rows, a
//     group of `tpr` threads per (row, split), for shorter ones. Either reads
//     the row in 16-byte packs on its aligned window (rows.cuh), so any length
//     and offset runs at full width;
//   * inner > 1 (a column reduction, e.g. the first axis): reduce_cols (for
//     float16 reduce_cols_deep, more rows in flight), a block of 64 packs of
//     columns by 4 row phases down the rows of a chunk
//     (cufuse/ops/reduction.py: _COL_BLOCK).
// When there are too few rows (or columns) to fill the GPU, each is split in
// `splits` chunks whose partial sums (in the accumulation type) are added up
// in a fixed order, so that results are the same from run to run: by a
// second launch of the same kernels for rows, by the last block of each
// column tile for columns. `scale` multiplies the final sum (1, or 1/count for a mean).
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

// The last partial sum of a row launch also zeroes the rest of its 16-byte pack (the temporary is
// rounded up to 16 bytes: RecipeBuilder.temp), which the second pass reads whole (row_part's tail).
template <typename A> __device__ __forceinline__ void zero_pack_tail(A* partial, long long i) {
    for (long long j = i + 1; j % (16 / sizeof(A)); ++j) partial[j] = A(0);
}

// This thread's part of the sum of map(x) over chunk `split` of `splits` of
// a row of `cols` elements at xr: the thread is `lane` of `tpr` (a power of
// two) reading the chunk's whole packs in passes of U packs (the loads of a
// pass issued together, each predicated: each pass is one memory round
// trip). The row's aligned window: packs [first, last) hold row
// elements only and are added with no test; a pack the row only partly
// covers (pack 0 when head > 0, pack `last` when the row ends inside it) is
// added element by element, by lane 0 (head, first split) and lane 1 (tail,
// last split), loaded before the passes so that their round trips overlap.
// `per` < 2**31 and per * splits >= any row's whole packs (the host's bound).
template <int U, typename Map, typename Tin, typename A, bool Whole = false>
__device__ __forceinline__ A row_part(const Tin* xr, long long cols, long long per, int split, int splits, int lane,
                                      int tpr, bool active) {
    constexpr int V = PackOf<Tin>::V;
    using P = typename PackOf<Tin>::type;
    const int head = Whole ? 0 : row_head(xr);
    const P* xp = reinterpret_cast<const P*>(xr - head);
    const long long first = head ? 1 : 0;
    const long long last = (head + cols) / V;
    const long long whole = last > first ? last - first : 0;
    const long long lo = first + per * split;
    const long long end = lo + per < first + whole ? lo + per : first + whole;
    const Map map;
    long long ek = -1;
    if (active && lane == 0 && head && split == 0) ek = 0;
    if (!Whole && active && lane == 1 && last * V - head < cols && (last > 0 || !head) && split == splits - 1)
        ek = last;
    P e;
    if (ek >= 0) e = load_hinted<Hint::stream>(xp + ek);
    A acc[U];  // one chain of additions per pack in flight
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = A(0);
    auto add = [&](A& a, const P& p) {
        compute_t<Tin> t[V];
        unpack(p, t);
#pragma unroll
        for (int i = 0; i < V; ++i) a += map(static_cast<A>(t[i]));
    };
    // This lane's packs: lo + lane + j * tpr for j < n, in passes of U
    // loads, each predicated (u < n): every lane of a warp runs the same
    // passes, where a loop of whole passes and a separate tail split a warp
    // whose lanes have n and n - 1 packs into both paths: 5-6 points of copy
    // (bench/NOTES.md, "Figures from code comments").
    const int span = active && end > lo ? static_cast<int>(end - lo) - lane : 0;
    int n = span > 0 ? ((span - 1) >> (__ffs(tpr) - 1)) + 1 : 0;
    const P* xl = xp + lo + lane;
#pragma unroll 1
    for (; n > 0; n -= U, xl += U * tpr) {
        P p[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (u < n) p[u] = load_hinted<Hint::stream>(xl + u * tpr);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (u < n) add(acc[u], p[u]);
    }
    if (ek >= 0) {
        const long long e0 = ek * V - head;
        compute_t<Tin> t[V];
        unpack(e, t);
#pragma unroll
        for (int i = 0; i < V; ++i)
            if (e0 + i >= 0 && e0 + i < cols) acc[0] += map(static_cast<A>(t[i]));
    }
#pragma unroll
    for (int u = 1; u < U; ++u) acc[0] += acc[u];
    return acc[0];
}

}  // namespace cufuse

// Row reduction, rows of any length: group g of block (bx, split) handles row
// bx * groups + g, chunk `split` (blockIdx.y) of `per` whole packs of its
// row; writes out[row] (one split) or partial[row * splits + split].
template <typename Map, typename Tin, typename A, typename Tout>
__global__ void __launch_bounds__(512) reduce_rows(Tout* out, A* partial, const Tin* x, long long rows, long long cols,
                                                   long long ldx, int tpr, long long per, double scale) {
    using namespace cufuse;
    const Group<1> g(tpr);
    const long long item = g.item();
    const bool active = item < rows;
    const long long row = active ? item : 0;
    const int split = blockIdx.y, splits = gridDim.y;
    const A part = row_part<2, Map, Tin, A>(x + row * ldx, cols, per, split, splits, g.lane, tpr, active);
    const A sum = g.reduce(part, SumOp{}, 0);
    if (active && g.lane == 0) {
        finish(out, splits > 1 ? partial : static_cast<A*>(nullptr), splits > 1 ? row * splits + split : row, sum, scale);
        if (splits > 1 && row == rows - 1 && split == splits - 1) zero_pack_tail(partial, row * splits + split);
    }
}

// Long rows: one block per (row, split) = (blockIdx.x, blockIdx.y), its
// blockDim.x (a power of two, 32 to kRowBlock) threads reading the chunk in
// passes of kRowBlockU packs: as reduce_rows with tpr = blockDim.x but none
// of its per-group arithmetic, and the block's sum gathered by warp 0 alone.
// Many short blocks, as torch.compile's reduction does, rather than one wave
// of long-lived groups (ncu, 6250 x 8000 float16: reduce_rows with groups of
// 32 threads ran in one wave, 41-50% occupancy, DRAM 70%).
// Whole (host-checked: cufuse/ops/reduction.py _reduce_rows): every row
// starts on a 16-byte boundary and is a whole number of packs, so there is
// no head or tail pack to find. A block lives for one or two round trips,
// so the instructions before its first load count (102 -> 58 of them, 32
// -> 22 registers); it takes 4 packs per pass (kRowBlockWholeU), still 8
// blocks of 256 per SM (bench/NOTES.md, "Figures from code comments").
constexpr int kRowBlock = 512;
constexpr int kRowBlockU = 2;       // packs in flight per thread
constexpr int kRowBlockWholeU = 4;  // the same, Whole
template <typename Map, typename Tin, typename A, typename Tout, bool Whole = false>
__global__ void __launch_bounds__(kRowBlock) reduce_rows_block(Tout* out, A* partial, const Tin* x, long long cols,
                                                               long long ldx, long long per, double scale) {
    using namespace cufuse;
    const long long row = blockIdx.x;
    const int split = blockIdx.y, splits = gridDim.y;
    constexpr int U = Whole ? kRowBlockWholeU : kRowBlockU;
    A v = row_part<U, Map, Tin, A, Whole>(x + row * ldx, cols, per, split, splits, threadIdx.x, blockDim.x, true);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (blockDim.x > 32) {
        __shared__ A warp_sum[kRowBlock / 32];
        if ((threadIdx.x & 31) == 0) warp_sum[threadIdx.x >> 5] = v;
        __syncthreads();
        if (threadIdx.x >= 32) return;
        v = threadIdx.x < (blockDim.x >> 5) ? warp_sum[threadIdx.x] : A(0);
#pragma unroll
        for (int o = kRowBlock / 64; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    if (threadIdx.x == 0) {
        finish(out, splits > 1 ? partial : static_cast<A*>(nullptr), splits > 1 ? row * splits + split : row, v, scale);
        if (splits > 1 && row == gridDim.x - 1 && split == splits - 1) zero_pack_tail(partial, row * splits + split);
    }
}

// Column reduction over x[outer][R][inner]: a block of 256 threads, (BX, BY)
// from the host (cufuse/ops/reduction.py: _COL_BLOCK); threadIdx.x picks a
// pack of `vec` columns (vec is the pack width when inner and the base are
// pack aligned, else 1), threadIdx.y a phase of the rows of chunk
// blockIdx.y. Writes out[o * inner + c] (one chunk) or
// partial[(chunk * outer + o) * inner + c]; with `tickets`, the last block of
// each tile then adds the tile's partial sums up into out (one launch). Each
// thread keeps U rows' packs in flight (reduce_cols: 4, reduce_cols_deep: 12).
template <int V, int U, typename Map, typename Tin, typename A, typename Tout>
__device__ __forceinline__ void reduce_cols_body(Tout* out, A* partial, const Tin* x, long long outer, long long R,
                                                 long long inner, long long chunk, double scale,
                                                 unsigned* tickets) {
    using namespace cufuse;
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
        auto add = [&](const P& p) {
            compute_t<Tin> t[V];
            unpack(p, t);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += map(static_cast<A>(t[i]));
        };
        // Rows r_lo + threadIdx.y + j * by for j < n, U loads per pass (each
        // predicated, as in reduce_rows), each pass's loads issued before the
        // previous pass's additions, so that a thread always has
        // loads in flight (40 -> 64 registers, still the 4 blocks per SM the
        // grid is sized for): a few points for float16, float32 within noise
        // (bench/NOTES.md, "Figures from code comments").
        const long long span = r_hi - r_lo - threadIdx.y;
        int n = span > 0 ? static_cast<int>((span - 1) / by) + 1 : 0;  // chunk < 2**31 rows
        const Tin* xl = base + (r_lo + threadIdx.y) * inner;
        const long long stride = by * inner;
        const auto load = [&](P (&p)[U], int m) {
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < m) p[u] = load_hinted<Hint::stream>(reinterpret_cast<const P*>(xl + u * stride));
        };
        P p[U];
        load(p, n);
#pragma unroll 1
        while (n > 0) {
            const int m = n - U;  // rows after this pass
            xl += U * stride;
            P q[U];
            load(q, m);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < n) add(p[u]);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < m) p[u] = q[u];
            n = m;
        }
    }
    // Row phase 0 adds the other phases' sums (shared memory), in order.
    auto gather = [&]() {
        if (by == 1) return;
#pragma unroll
        for (int i = 0; i < V; ++i) part[(threadIdx.y * bx + threadIdx.x) * V + i] = acc[i];
        __syncthreads();
        if (threadIdx.y == 0) {
#pragma unroll
            for (int i = 0; i < V; ++i)
                for (int y = 1; y < by; ++y) acc[i] += part[(y * bx + threadIdx.x) * V + i];
        }
    };
    gather();
    const bool lead = threadIdx.y == 0 && c0 < inner;
    if (gridDim.y == 1) {
        if (lead) {
#pragma unroll
            for (int i = 0; i < V; ++i) finish(out, static_cast<A*>(nullptr), o * inner + c0 + i, acc[i], scale);
        }
        return;
    }
    if (lead) {
#pragma unroll
        for (int i = 0; i < V; ++i) partial[(blockIdx.y * outer + o) * inner + c0 + i] = acc[i];
    }
    if (!tickets) return;
    // One launch: the last of the tile's gridDim.y blocks to finish (a ticket
    // per tile, taken after its partial sums are visible: __threadfence) adds
    // them up, chunk k by row phase k % by, then the phases in order, so the
    // result does not depend on which block is last; it sets the ticket back
    // to 0 for the next launch on the stream (cufuse/ops/reduction.py:
    // _tickets).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        last = atomicAdd(tickets + blockIdx.x, 1u) == gridDim.y - 1;
        if (last) tickets[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return;
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = A(0);
    if (c0 < inner) {
        for (int k = threadIdx.y; k < gridDim.y; k += by) {
            const A* pk = partial + (k * outer + o) * inner + c0;
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += __ldcg(pk + i);
        }
    }
    gather();
    if (lead) {
#pragma unroll
        for (int i = 0; i < V; ++i) finish(out, static_cast<A*>(nullptr), o * inner + c0 + i, acc[i], scale);
    }
}

template <typename Map, typename Tin, typename A, typename Tout>
__global__ void __launch_bounds__(256) reduce_cols(Tout* out, A* partial, const Tin* x, long long outer, long long R,
                                                   long long inner, long long chunk, int vec, double scale,
                                                   unsigned* tickets) {
    if (vec) reduce_cols_body<cufuse::PackOf<Tin>::V, 4, Map>(out, partial, x, outer, R, inner, chunk, scale, tickets);
    else reduce_cols_body<1, 4, Map>(out, partial, x, outer, R, inner, chunk, scale, tickets);
}

// float16 columns: 12 rows in flight per thread (126-128 registers), in one
// block per SM where reduce_cols has four of 4 rows (cufuse/ops/reduction.py:
// _COL_DEEP): 3-4 points of copy for float16; float32 lost with it, and two
// blocks per SM gained nothing over one (bench/NOTES.md, "Figures from code
// comments").
template <typename Map, typename Tin, typename A, typename Tout>
__global__ void __launch_bounds__(256) reduce_cols_deep(Tout* out, A* partial, const Tin* x, long long outer,
                                                        long long R, long long inner, long long chunk, int vec,
                                                        double scale, unsigned* tickets) {
    if (vec) reduce_cols_body<cufuse::PackOf<Tin>::V, 12, Map>(out, partial, x, outer, R, inner, chunk, scale, tickets);
    else reduce_cols_body<1, 12, Map>(out, partial, x, outer, R, inner, chunk, scale, tickets);
}
