// cufuse: backward of layer_norm (+relu) and rms_norm over rows of `cols`
// contiguous elements, in one pass over memory: read x and g once, write dx
// once. A block (of blockDim.x threads) holds one row at a time in
// registers, NP packs of V elements per thread, in the storage type; the
// blocks loop over rows blockIdx.x, blockIdx.x + gridDim.x, ...
//
// Per row (compute type C: float for float16/bfloat16/float32, double for
// float64), n = cols, the statistics recomputed from the held row as the
// forward computes them (two passes, never E[x^2] - E[x]^2):
//   mean = sum(x) / n (layer_norm; 0 for rms_norm),
//   rstd = 1 / sqrt(sum((x - mean)^2) / n + eps)  (rms_norm: sum(x^2) / n),
//   xhat = (x - mean) rstd, gm = g (layer_norm_relu: g unless xhat w + b <= 0, as
//        torch's relu backward: a NaN output passes its gradient),
//   gw = gm w, s1 = sum(gw) / n, s2 = sum(gw xhat) / n,
//   dx = rstd (gw - s1 - xhat s2) + gadd    (rms_norm: without s1; gadd, when
//        given, is the gradient of the residual sum h that add_rms_norm /
//        add_layer_norm also return: x there is h, and dx its gradient).
// Block reductions are the latency of a row: without the relu mask,
// sum((x - mean)^2), sum(gw (x - mean)) (= s2 n / rstd) and sum(gw) are one
// reduction after the mean's, so layer_norm takes two a row and rms_norm one;
// layer_norm_relu's mask needs xhat first and takes three.
// The weight and bias gradients are column sums over the rows of gm xhat and
// gm: each thread adds its columns of every row its block holds, in C, in its
// own slots of the block's shared memory, and writes its block's partial sums,
// pw[blockIdx.x][col] and pb[...], which column_sums adds over the blocks (the
// second stage). Nothing is added atomically: the result does not depend on
// timing. A block keeps its next `stages` rows in flight (host-chosen,
// 0-4): each thread copies its packs of them (x, g and gadd) into its own
// slots of shared memory (cp.async, sm_80+), so that those loads neither
// wait for the current row's reductions nor take registers (the current
// row's packs are held in registers). With stages = 0 (older GPUs, or rows
// whose slots do not fit) a block loads each row when it starts it.
//
// Rows must be whole 16-byte packs at 16-byte aligned addresses (the host
// checks: cufuse/ops/norm.py, _bwd_setup); other rows take the generated-kernel path.
#include "common.cuh"

namespace cufuse {

constexpr int kNormBwdMaxThreads = 512;
// Blocks of 512 threads per SM that norm_backward's registers allow (ptxas caps them for it): two in 64
// registers with one pack per thread, and with two of 32-bit or 64-bit elements; 16-bit elements at two
// packs per thread spill a lot there (bfloat16 4096x8192: 129 -> 212 us on an H200) and keep one block.
template <int NP, typename T> constexpr int kNormBwdMinBlocks = NP == 1 || sizeof(T) >= 4 ? 2 : 1;

// Values per warp of a block reduction's shared scratch (red[warps][kRedValues]).
constexpr int kRedValues = 3;

// A block reduction's shared scratch: two buffers of K values per warp, used
// in turn, so that a reduction needs one barrier (between its writes and its
// reads): the next call writes the other buffer, and the call after that
// writes this one only after every thread passed the next call's barrier,
// which it reaches after its reads of this one.
template <typename C> struct RedScratch {
    C (*buf)[kNormBwdMaxThreads / 32][kRedValues];
    int turn;
    __device__ __forceinline__ C (*next())[kRedValues] {
        C (*r)[kRedValues] = buf[turn];
        turn ^= 1;
        return r;
    }
};

// Sums of the K values v over the block; every thread gets them (every
// thread of the block calls it, as often). Each warp's sum goes to the
// scratch; after the one barrier every warp adds the warps' partials by a
// butterfly over its lanes: the same bits in every thread and run, log2(warps)
// dependent steps (three for 8 warps; with the two-barrier tree and a
// broadcast, five). H200, bfloat16 16384x4096: layer_norm 164 -> 162 us,
// rms+add 140 -> 137; float32 rms+add 271 -> 258 (bench/NOTES.md).
template <int K, typename C> __device__ __forceinline__ void block_sum(C (&v)[K], RedScratch<C>& scratch) {
    static_assert(K <= kRedValues, "red holds kRedValues values per warp");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    C (*red)[kRedValues] = scratch.next();
    if (lane == 0)
#pragma unroll
        for (int k = 0; k < K; ++k) red[warp][k] = v[k];
    __syncthreads();
    // each group of `warps` lanes (a power of two: the host's block sizes) holds every warp's partial,
    // and a butterfly adds them: every lane ends with the same bits (each step adds a pair both ways)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = red[lane & (warps - 1)][k];
#pragma unroll
    for (int o = kNormBwdMaxThreads / 64; o > 0; o >>= 1)
        if (o < warps)
#pragma unroll
            for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
}

// One value's block_sum.
template <typename C> __device__ __forceinline__ C block_sum1(C a, RedScratch<C>& red) {
    C v[1] = {a};
    block_sum(v, red);
    return v[0];
}

// The mean of the values a block holds of a row (NP packs per thread, has[j]:
// pack j lies in the row; 1 / n = inv_n): one block reduction.
template <typename T, int NP, typename C>
__device__ __forceinline__ C row_mean(const Pack<T, 16 / sizeof(T)> (&xp)[NP], const bool (&has)[NP], C inv_n,
                                      RedScratch<C>& red) {
    constexpr int V = 16 / sizeof(T);
    C s = C(0);
#pragma unroll
    for (int j = 0; j < NP; ++j)
        if (has[j]) {
            C t[V];
            unpack(xp[j], t);
#pragma unroll
            for (int v = 0; v < V; ++v) s += t[v];
        }
    return block_sum1(s, red) * inv_n;
}

// The mean (0 without Center: rms_norm) and rstd of a row that a block holds
// as NP packs per thread, from the held values in two passes:
// mean = sum(x) / n, rstd = 1 / sqrt(sum((x - mean)^2) / n + eps).
template <bool Center, typename T, int NP, typename C>
__device__ __forceinline__ void row_stats(const Pack<T, 16 / sizeof(T)> (&xp)[NP], const bool (&has)[NP], C inv_n,
                                          double eps, RedScratch<C>& red, C& mean, C& rstd) {
    constexpr int V = 16 / sizeof(T);
    mean = Center ? row_mean(xp, has, inv_n, red) : C(0);
    C s = C(0);
#pragma unroll
    for (int j = 0; j < NP; ++j)
        if (has[j]) {
            C t[V];
            unpack(xp[j], t);
#pragma unroll
            for (int v = 0; v < V; ++v) {
                const C d = t[v] - mean;
                s += d * d;
            }
        }
    rstd = C(1) / math::sqrt(block_sum1(s, red) * inv_n + static_cast<C>(eps));
}

// This thread's packs (threadIdx.x + j blockDim.x, where has[j]) of row r of
// two arrays of rows of `cols` elements.
template <typename T, int NP>
__device__ __forceinline__ void load_rows(const T* a, const T* b, long long r, int cols, const bool (&has)[NP],
                                          Pack<T, 16 / sizeof(T)> (&pa)[NP], Pack<T, 16 / sizeof(T)> (&pb)[NP]) {
    using P = Pack<T, 16 / sizeof(T)>;
    const P* ar = reinterpret_cast<const P*>(a + r * cols);
    const P* br = reinterpret_cast<const P*>(b + r * cols);
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        const int k = threadIdx.x + j * blockDim.x;
        if (has[j]) {
            pa[j] = load_pack(ar + k);
            pb[j] = load_pack(br + k);
        }
    }
}

// wait_async<n> for a run-time n in [0, 3] (a uniform branch: wait_group takes an immediate).
__device__ __forceinline__ void wait_async_upto(int n) {
    if (n >= 3) wait_async<3>();
    else if (n == 2) wait_async<2>();
    else if (n == 1) wait_async<1>();
    else wait_async<0>();
}

// 16 bytes of C values: one 128-bit shared-memory access
template <typename C> struct alignas(16) Quad {
    C v[16 / sizeof(C)];
};

// column_sums's block: 32 columns x 16 parts at a time
constexpr int kColumnSumsX = 32;
constexpr int kColumnSumsY = 16;

}  // namespace cufuse

// (global namespace: short name expressions)
template <typename T, int NP, bool Center, bool Relu>
__global__ void __launch_bounds__(cufuse::kNormBwdMaxThreads, cufuse::kNormBwdMinBlocks<NP, T>)
norm_backward(T* __restrict__ dx, cufuse::compute_t<T>* __restrict__ pw, cufuse::compute_t<T>* __restrict__ pb,
              const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
              const T* __restrict__ b, const T* __restrict__ gadd, long long rows, int cols, double eps,
              int stages) {
    using namespace cufuse;
    using C = compute_t<T>;
    constexpr int V = 16 / sizeof(T);
    using P = Pack<T, V>;
    __shared__ C red_buf[2][kNormBwdMaxThreads / 32][kRedValues];
    RedScratch<C> red{red_buf, 0};
    const int npack = cols / V;
    const C inv_n = C(1) / static_cast<C>(cols);
    bool has[NP];
    // Dynamic shared memory (_bwd_shared in cufuse/ops/norm.py): the column sums of gm xhat (aw) and gm (ab) of
    // the block's rows, then w and b as packs. Held in registers they allowed one block of 512 threads per
    // SM: one row in flight. The sums go in 16-byte quads (one 128-bit access each: the shared-memory
    // instructions are a quarter of one per element), quad q of pack j of thread t at (j QP + q) blockDim.x + t,
    // pack j of w at j blockDim.x + t: each thread's own (no barrier), conflict-free.
    using Q = Quad<C>;
    constexpr int QV = 16 / sizeof(C), QP = V / QV;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Q* aw = reinterpret_cast<Q*>(smem_raw);
    Q* ab = aw + NP * QP * blockDim.x;
    P* wk = reinterpret_cast<P*>(ab + NP * QP * blockDim.x);
    P* bk = wk + NP * blockDim.x;
    // then the stages' slots: slot s of array a (x, g, gadd) holds pack j of thread t at
    // ((s NA + a) NP + j) blockDim.x + t, each thread's own (it alone copies and reads them: no barrier)
    P* ring = bk + NP * blockDim.x;
    const int na = gadd ? 3 : 2;
    const auto at = [&](int s, int a, int j) { return ring + ((s * na + a) * NP + j) * blockDim.x + threadIdx.x; };
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        const int k = threadIdx.x + j * blockDim.x;
        has[j] = k < npack;
        if (has[j] && w) wk[k] = load_pack(reinterpret_cast<const P*>(w) + k);
        if (has[j] && b) bk[k] = load_pack(reinterpret_cast<const P*>(b) + k);
#pragma unroll
        for (int q = 0; q < QP; ++q) aw[(j * QP + q) * blockDim.x + threadIdx.x] = ab[(j * QP + q) * blockDim.x + threadIdx.x] = Q{};
    }
    const auto wb = [&](int j, C (&wv)[V], C (&bv)[V]) {
        const int k = threadIdx.x + j * blockDim.x;
        if (w) unpack(wk[k], wv);
        if (b) unpack(bk[k], bv);
#pragma unroll
        for (int v = 0; v < V; ++v) {
            if (!w) wv[v] = C(1);
            if (!b) bv[v] = C(0);
        }
    };
    // One commit group per row, empty past the last: the wait for the oldest is always wait_async<stages - 1>.
    const auto issue = [&](long long r, int s) {
        if (r < rows) {
#pragma unroll
            for (int j = 0; j < NP; ++j)
                if (has[j]) {
                    const long long k = r * (cols / V) + threadIdx.x + j * blockDim.x;
                    copy_async_16(at(s, 0, j), reinterpret_cast<const P*>(x) + k);
                    copy_async_16(at(s, 1, j), reinterpret_cast<const P*>(g) + k);
                    if (gadd) copy_async_16(at(s, 2, j), reinterpret_cast<const P*>(gadd) + k);
                }
        }
        commit_async();
    };
    if (!kAsyncCopy) stages = 0;  // (built for a GPU without cp.async: the copies would be no-ops)
    for (int d = 0; d < stages; ++d) issue(blockIdx.x + static_cast<long long>(d) * gridDim.x, d);
    int slot = 0;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        P xp[NP], gp[NP], ap[NP];
        if (stages > 0) {
            wait_async_upto(stages - 1);  // this thread's copies of row r have landed
#pragma unroll
            for (int j = 0; j < NP; ++j)
                if (has[j]) {
                    xp[j] = *at(slot, 0, j);
                    gp[j] = *at(slot, 1, j);
                    if (gadd) ap[j] = *at(slot, 2, j);
                }
            issue(r + static_cast<long long>(stages) * gridDim.x, slot);
            slot = slot + 1 == stages ? 0 : slot + 1;
        } else {
            load_rows(x, g, r, cols, has, xp, gp);
            const P* ar = reinterpret_cast<const P*>(gadd + r * cols);
#pragma unroll
            for (int j = 0; j < NP; ++j)
                if (gadd && has[j]) ap[j] = load_pack(ar + threadIdx.x + j * blockDim.x);
        }
        C mean = C(0), rstd, s1 = C(0), s2;  // s1 = sum(gm w), s2 = sum(gm w xhat), then / n
        if constexpr (Relu) {
            // the mask needs xhat: the statistics (two reductions), then s1 and s2 (a third)
            row_stats<Center>(xp, has, inv_n, eps, red, mean, rstd);
            C acc[2] = {C(0), C(0)};
#pragma unroll
            for (int j = 0; j < NP; ++j)
                if (has[j]) {
                    C t[V], gg[V], wv[V], bv[V];
                    unpack(xp[j], t);
                    unpack(gp[j], gg);
                    wb(j, wv, bv);
#pragma unroll
                    for (int v = 0; v < V; ++v) {
                        const C xh = (t[v] - mean) * rstd;
                        const C gw = !(xh * wv[v] + bv[v] <= C(0)) ? gg[v] * wv[v] : C(0);  // (NaN passes)
                        acc[0] += gw;
                        acc[1] += gw * xh;
                    }
                }
            block_sum(acc, red);
            s1 = acc[0];
            s2 = acc[1];
        } else {
            // the mean (layer_norm), then sum((x - mean)^2), sum(g w (x - mean)) (= s2 n / rstd) and s1 in
            // one reduction: two reductions a row for layer_norm, one for rms_norm
            mean = Center ? row_mean(xp, has, inv_n, red) : C(0);
            C acc[Center ? 3 : 2] = {};
#pragma unroll
            for (int j = 0; j < NP; ++j)
                if (has[j]) {
                    C t[V], gg[V], wv[V], bv[V];
                    unpack(xp[j], t);
                    unpack(gp[j], gg);
                    wb(j, wv, bv);
#pragma unroll
                    for (int v = 0; v < V; ++v) {
                        const C d = t[v] - mean, gw = gg[v] * wv[v];
                        acc[0] += d * d;
                        acc[1] += gw * d;
                        if constexpr (Center) acc[2] += gw;
                    }
                }
            block_sum(acc, red);
            rstd = C(1) / math::sqrt(acc[0] * inv_n + static_cast<C>(eps));
            s2 = rstd * acc[1];
            if constexpr (Center) s1 = acc[2];
        }
        s1 *= inv_n;
        s2 *= inv_n;
        P* dr = reinterpret_cast<P*>(dx + r * cols);
#pragma unroll
        for (int j = 0; j < NP; ++j)
            if (has[j]) {
                C t[V], gg[V], ga[V], wv[V], bv[V];
                unpack(xp[j], t);
                unpack(gp[j], gg);
                wb(j, wv, bv);
                if (gadd) {
                    unpack(ap[j], ga);
                } else {
#pragma unroll
                    for (int v = 0; v < V; ++v) ga[v] = C(0);
                }
                P o;
#pragma unroll
                for (int q = 0; q < QP; ++q) {  // a quad of the sums at a time
                    const int i = (j * QP + q) * blockDim.x + threadIdx.x;
                    Q sw = pw ? aw[i] : Q{}, sb = pb ? ab[i] : Q{};
#pragma unroll
                    for (int u = 0; u < QV; ++u) {
                        const int v = q * QV + u;
                        const C xh = (t[v] - mean) * rstd;
                        const C gm = (!Relu || !(xh * wv[v] + bv[v] <= C(0))) ? gg[v] : C(0);
                        o.v[v] = from_compute<T>(rstd * (gm * wv[v] - s1 - xh * s2) + ga[v]);
                        sw.v[u] += gm * xh;
                        sb.v[u] += gm;
                    }
                    if (pw) aw[i] = sw;
                    if (pb) ab[i] = sb;
                }
                store_pack(dr + threadIdx.x + j * blockDim.x, o);
            }
    }
    wait_async<0>();  // the empty groups past the last row
    if (pw == nullptr && pb == nullptr) return;
#pragma unroll
    for (int j = 0; j < NP; ++j)
        if (has[j]) {
            const long long c0 = static_cast<long long>(blockIdx.x) * cols +
                                 static_cast<long long>(threadIdx.x + j * blockDim.x) * V;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                const int i = (j * QP + v / QV) * blockDim.x + threadIdx.x;
                if (pw) pw[c0 + v] = aw[i].v[v % QV];
                if (pb) pb[c0 + v] = ab[i].v[v % QV];
            }
        }
}

// The second stage of the weight and bias gradients: dw[c] is the sum over
// the parts (norm_backward's blocks) of pw[part][c], rounded once to T; db
// likewise from pb (either may be null). A block takes 32 columns (a warp's
// lanes: coalesced rows); its threadIdx.y takes parts y, y + 16, ... and the
// 16 sums are then added in shared memory as a fixed tree: the same order in
// every run, nothing atomic.
template <typename T>
__global__ void __launch_bounds__(cufuse::kColumnSumsX * cufuse::kColumnSumsY)
column_sums(T* __restrict__ dw, T* __restrict__ db, const cufuse::compute_t<T>* __restrict__ pw,
            const cufuse::compute_t<T>* __restrict__ pb, int parts, int cols) {
    using namespace cufuse;
    using C = compute_t<T>;
    __shared__ C sw[kColumnSumsY][kColumnSumsX], sb[kColumnSumsY][kColumnSumsX];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * kColumnSumsX + tx;
    C aw = C(0), ab = C(0);
    if (c < cols) {
        for (int p = ty; p < parts; p += kColumnSumsY) {
            const long long i = static_cast<long long>(p) * cols + c;
            if (pw) aw += pw[i];
            if (pb) ab += pb[i];
        }
    }
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
#pragma unroll
    for (int s = kColumnSumsY / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (ty < s) {
            sw[ty][tx] += sw[ty + s][tx];
            sb[ty][tx] += sb[ty + s][tx];
        }
    }
    if (ty == 0 && c < cols) {
        if (dw) dw[c] = from_compute<T>(sw[0][tx]);
        if (db) db[c] = from_compute<T>(sb[0][tx]);
    }
}

// dx of softmax (y (g - sum(g y))) and log_softmax (g - exp(y) sum(g)) from
// the saved output y, rows as above: y and g read once, dx written once.
template <typename T, int NP, bool Log>
__global__ void __launch_bounds__(cufuse::kNormBwdMaxThreads)
softmax_backward(T* __restrict__ dx, const T* __restrict__ g, const T* __restrict__ y, long long rows, int cols) {
    using namespace cufuse;
    using C = compute_t<T>;
    constexpr int V = 16 / sizeof(T);
    using P = Pack<T, V>;
    // With one or two packs a thread, the next row's packs are loaded before this row's reduction (as
    // norm_backward's); more would take registers that keep blocks off the SM.
    constexpr bool kAhead = NP <= 2;
    __shared__ C red_buf[2][kNormBwdMaxThreads / 32][kRedValues];
    RedScratch<C> red{red_buf, 0};
    const int npack = cols / V;
    bool has[NP];
#pragma unroll
    for (int j = 0; j < NP; ++j) has[j] = threadIdx.x + j * blockDim.x < npack;
    P yp[NP], gp[NP];
    if (kAhead && blockIdx.x < rows) load_rows(y, g, blockIdx.x, cols, has, yp, gp);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        P yn[NP], gn[NP];
        if (!kAhead) load_rows(y, g, r, cols, has, yp, gp);
        else if (r + gridDim.x < rows) load_rows(y, g, r + gridDim.x, cols, has, yn, gn);
        C s = C(0);
#pragma unroll
        for (int j = 0; j < NP; ++j)
            if (has[j]) {
                C t[V], gg[V];
                unpack(yp[j], t);
                unpack(gp[j], gg);
#pragma unroll
                for (int v = 0; v < V; ++v) s += Log ? gg[v] : gg[v] * t[v];
            }
        s = block_sum1(s, red);
        P* dr = reinterpret_cast<P*>(dx + r * cols);
#pragma unroll
        for (int j = 0; j < NP; ++j)
            if (has[j]) {
                C t[V], gg[V];
                unpack(yp[j], t);
                unpack(gp[j], gg);
                P o;
#pragma unroll
                for (int v = 0; v < V; ++v)
                    o.v[v] = from_compute<T>(Log ? gg[v] - cufuse::math::exp(t[v]) * s : t[v] * (gg[v] - s));
                store_pack(dr + threadIdx.x + j * blockDim.x, o);
            }
        if constexpr (kAhead)
#pragma unroll
            for (int j = 0; j < NP; ++j) {
                yp[j] = yn[j];
                gp[j] = gn[j];
            }
    }
}

// add_rms_norm / add_layer_norm forward in one pass: h = x + res (rounded to
// T, as the framework's add), y = the norm of h; reads x and res once,
// writes h and y once. Rows as the backward's (whole packs, aligned, NP packs
// per thread); the statistics are row_stats's, the same the backward
// recomputes.
template <typename T, int NP, bool Center>
__global__ void __launch_bounds__(cufuse::kNormBwdMaxThreads)
add_norm_forward(T* __restrict__ y, T* __restrict__ h, const T* __restrict__ x, const T* __restrict__ res,
                 const T* __restrict__ w, const T* __restrict__ b, long long rows, int cols, double eps) {
    using namespace cufuse;
    using C = compute_t<T>;
    constexpr int V = 16 / sizeof(T);
    using P = Pack<T, V>;
    __shared__ C red_buf[2][kNormBwdMaxThreads / 32][kRedValues];
    RedScratch<C> red{red_buf, 0};
    const int npack = cols / V;
    const C inv_n = C(1) / static_cast<C>(cols);
    bool has[NP];
#pragma unroll
    for (int j = 0; j < NP; ++j) has[j] = threadIdx.x + j * blockDim.x < npack;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const P* xr = reinterpret_cast<const P*>(x + r * cols);
        const P* rr = reinterpret_cast<const P*>(res + r * cols);
        P* hr = reinterpret_cast<P*>(h + r * cols);
        P hp[NP];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
            const int k = threadIdx.x + j * blockDim.x;
            if (has[j]) {
                C a[V], c[V];
                unpack(load_pack(xr + k), a);
                unpack(load_pack(rr + k), c);
#pragma unroll
                for (int v = 0; v < V; ++v) hp[j].v[v] = from_compute<T>(a[v] + c[v]);
                store_pack(hr + k, hp[j]);
            }
        }
        C mean, rstd;
        row_stats<Center>(hp, has, inv_n, eps, red, mean, rstd);
        P* yr = reinterpret_cast<P*>(y + r * cols);
#pragma unroll
        for (int j = 0; j < NP; ++j) {
            const int k = threadIdx.x + j * blockDim.x;
            if (has[j]) {
                C t[V], wv[V], bv[V];
                unpack(hp[j], t);
                if (w) {
                    unpack(load_pack(reinterpret_cast<const P*>(w) + k), wv);
                } else {
#pragma unroll
                    for (int v = 0; v < V; ++v) wv[v] = C(1);
                }
                if (b) {
                    unpack(load_pack(reinterpret_cast<const P*>(b) + k), bv);
                } else {
#pragma unroll
                    for (int v = 0; v < V; ++v) bv[v] = C(0);
                }
                P o;
#pragma unroll
                for (int v = 0; v < V; ++v) o.v[v] = from_compute<T>((t[v] - mean) * rstd * wv[v] + bv[v]);
                store_pack(yr + k, o);
            }
        }
    }
}
