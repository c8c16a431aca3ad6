// cufuse: tile helpers of the attention kernels (sm_80 and newer): cp.async
// copies of row tiles into shared memory, ldmatrix fragments and the
// m16n8k16 tensor-core product of 16-bit operands with float accumulators,
// composed into warp-level products of a 16-row A by a shared-memory B.
//
// Shared tiles are row-major with a row pitch of LDS = cols + 8 elements:
// the 16 extra bytes shift each row by four banks, so the eight 16-byte rows
// one ldmatrix reads (and the eight one cp.async round writes) fall in
// different banks whatever the head dim (a multiple of 8).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 of 16-bit data; g = lane / 4,
// t = lane % 4): A regs a0..a3 hold (row g, cols 2t..2t+1), (g + 8, 2t..),
// (g, 2t + 8..), (g + 8, 2t + 8..); B regs b0, b1 hold (k 2t..2t+1, col g),
// (k 2t + 8.., g); C floats c0..c3 hold (g, 2t), (g, 2t + 1), (g + 8, 2t),
// (g + 8, 2t + 1). So the C tiles of two neighbouring 8-column blocks are,
// once rounded, the A fragment of the 16 columns they cover (P in P V).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cufuse {
namespace attn {

__device__ __forceinline__ float ninf() { return __int_as_float(0xff800000); }

// 2^x by the special-function unit (ex2.approx.ftz: 2 ulp, 2^-inf = 0), one
// instruction where exp2f adds range handling the scores never need.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled where !valid (then
// nothing is read from src).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [row0, row0 + ROWS) of a global [rows][COLS] view (row stride ld
// elements, rows >= limit zero-filled) into a shared [ROWS][COLS + 8] tile,
// by THREADS threads. COLS % 8 == 0; the view's rows are 16-byte aligned.
template <int ROWS, int COLS, int THREADS, typename T>
__device__ __forceinline__ void load_rows(T* s, const T* g, long long ld, int row0, int limit, int tid) {
    constexpr int CHUNKS = COLS / 8, LDS = COLS + 8, TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {  // (a fixed trip count: fully unrolled)
        const int i = tid + it * THREADS;
        if (TOTAL % THREADS != 0 && i >= TOTAL) break;
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool valid = row0 + r < limit;
        cp_async16(s + r * LDS + c, valid ? g + (row0 + r) * ld + c : g, valid);
    }
}

// The same into a tile in the 128-byte swizzled layout wgmma reads
// (wgmma.cuh): COLS / 64 column blocks of [ROWS][64], chunk c of row r at
// chunk c ^ (r % 8). A thread copies one chunk column c of the rows r0,
// r0 + STEP, ... (consecutive threads: consecutive chunks of a row); STEP is
// a multiple of 8, so its swizzled position is the same in each: one source
// pointer and one shared offset per thread, advanced by constants.
template <int ROWS, int COLS, int THREADS, typename T>
__device__ __forceinline__ void load_swizzled(T* s, const T* g, long long ld, int row0, int limit, int tid) {
    constexpr int CHUNKS = COLS / 8, STEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && STEP % 8 == 0, "whole swizzle rows per pass");
    const int r0 = tid / CHUNKS, c = tid % CHUNKS;
    unsigned char* dst = reinterpret_cast<unsigned char*>(s) + (c >> 3) * (ROWS * 128) + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
    const T* src = g + (row0 + r0) * ld + c * 8;
    const int left = limit - row0 - r0;  // rows r0 + STEP * it < left are in the view
#pragma unroll
    for (int it = 0; it < (ROWS + STEP - 1) / STEP; ++it) {
        if (ROWS % STEP != 0 && r0 + STEP * it >= ROWS) break;
        const bool valid = STEP * it < left;
        cp_async16(dst + it * STEP * 128, valid ? src : g, valid);
        src += STEP * ld;
    }
}

// The four 8x8 16-bit matrices whose rows lanes 8i..8i+7 address (a shared
// address: the callers add compile-time offsets to one per-lane base, so no
// pointer per fragment stays live in registers).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <typename T> struct mma_kind;
template <> struct mma_kind<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&h);
    }
};
template <> struct mma_kind<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&h);
    }
};

// Per-lane byte offsets of the ldmatrix rows: an A fragment (rows r..r + 15,
// cols c..c + 15 of a row-major tile), B stored [n][k] (two 8-column blocks
// of n, one k step) and B stored [k][n] (transposed on load). For the block
// at (row, col) add (row * LDS + col) * sizeof(T).
template <int LDS, typename T> __device__ __forceinline__ unsigned lane_a(int lane) {
    return ((lane & 15) * LDS + (lane >> 4) * 8) * sizeof(T);
}
template <int LDS, typename T> __device__ __forceinline__ unsigned lane_b_nk(int lane) {
    return (((lane >> 4) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8) * sizeof(T);
}
template <int LDS, typename T> __device__ __forceinline__ unsigned lane_b_kn(int lane) {
    return ((((lane >> 3) & 1) * 8 + (lane & 7)) * LDS + (lane >> 4) * 8) * sizeof(T);
}

// A fragment of the 16x16 block at (row0, col0) of a row-major shared tile.
template <int LDS, typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const T* s, int row0, int col0, int lane) {
    ldmatrix_x4(a, smem_addr(s) + lane_a<LDS, T>(lane) + (row0 * LDS + col0) * sizeof(T));
}

// The A fragments of a 16 x K row block of a shared tile (K % 16 == 0).
template <int K, int LDS, typename T>
__device__ __forceinline__ void load_a_rows(unsigned (&a)[K / 16][4], const T* s, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) load_a<LDS>(a[kk], s, row0, kk * 16, lane);
}

// B fragments of the k step k0 for the columns n0..n0 + 15 of a shared B
// stored [n][k] (KN = false: K in Q K^T) or [k][n] (KN = true: V in P V),
// from the lane's base address (lane_b_nk / lane_b_kn added). r[0], r[1]:
// b0, b1 of columns n0..n0 + 7; r[2], r[3]: of n0 + 8..n0 + 15.
template <bool KN, int LDS, typename T>
__device__ __forceinline__ void load_b(unsigned (&b)[4], unsigned base, int k0, int n0) {
    if constexpr (KN) {
        ldmatrix_x4_trans(b, base + (k0 * LDS + n0) * sizeof(T));
    } else {
        ldmatrix_x4(b, base + (n0 * LDS + k0) * sizeof(T));
    }
}
template <bool KN, int LDS, typename T> __device__ __forceinline__ unsigned lane_b(const T* sb, int lane) {
    return smem_addr(sb) + (KN ? lane_b_kn<LDS, T>(lane) : lane_b_nk<LDS, T>(lane));
}

// acc[MT][16][N] += A[MT][16][K] B[K][N] for MT row tiles of 16: A as
// fragments, B a shared tile stored [n][k] (KN = false) or [k][n] (KN =
// true); each B fragment is loaded once for the MT row tiles. N, K % 16 == 0.
template <int MT, int K, int N, bool KN, int LDS, typename T>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][N / 8][4], const unsigned (&a)[MT][K / 16][4],
                                         const T* sb, int lane) {
    const unsigned base = lane_b<KN, LDS>(sb, lane);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            load_b<KN, LDS, T>(b, base, kk * 16, np * 16);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_kind<T>::run(acc[mt][2 * np], a[mt][kk], b[0], b[1]);
                mma_kind<T>::run(acc[mt][2 * np + 1], a[mt][kk], b[2], b[3]);
            }
        }
    }
}

// The same with A read from a shared tile (row tile mt at rows row0 + 16 mt)
// one k step at a time.
template <int MT, int K, int N, bool KN, int LDSA, int LDS, typename T>
__device__ __forceinline__ void warp_mma_sa(float (&acc)[MT][N / 8][4], const T* sa, int row0, const T* sb,
                                            int lane) {
    const unsigned base = lane_b<KN, LDS>(sb, lane);
    const unsigned abase = smem_addr(sa) + lane_a<LDSA, T>(lane) + row0 * LDSA * sizeof(T);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], abase + (16 * mt * LDSA + kk * 16) * sizeof(T));
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            load_b<KN, LDS, T>(b, base, kk * 16, np * 16);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_kind<T>::run(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_kind<T>::run(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Float C tiles [16][N] rounded to T as the A fragments of a [16][N] operand.
template <int N, typename T>
__device__ __forceinline__ void c_to_a(unsigned (&a)[N / 16][4], const float (&c)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        a[kk][0] = mma_kind<T>::pack(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = mma_kind<T>::pack(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = mma_kind<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = mma_kind<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

template <int N> __device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
}

// Max and sum over the four lanes that hold one row of a C tile.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Stores rows (row g and g + 8 of a 16-row C tile [16][N], each scaled by
// its own factor) as T into global rows [row0 + ..] (row stride ld), rows
// >= limit skipped. Two elements per store (4-byte aligned rows).
template <int N, typename T>
__device__ __forceinline__ void store_c(T* g, long long ld, const float (&c)[N / 8][4], int row0, int limit,
                                        float fa, float fb, int lane) {
    const int ra = row0 + (lane >> 2), rb = ra + 8, col = (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
        if (ra < limit) {
            *reinterpret_cast<unsigned*>(g + ra * ld + nt * 8 + col) = mma_kind<T>::pack(c[nt][0] * fa, c[nt][1] * fa);
        }
        if (rb < limit) {
            *reinterpret_cast<unsigned*>(g + rb * ld + nt * 8 + col) = mma_kind<T>::pack(c[nt][2] * fb, c[nt][3] * fb);
        }
    }
}

// ------------------------------------------------- the online softmax
// One 16-row tile of a warp: scores s[BN / 8][4] and output accumulator
// acc[D / 8][4] in the C layout above (the thread's rows g and g + 8: index
// r = 0, 1), its running row max mx (log2 units) and sum. Shared by the
// mma.sync and the wgmma forward (kernels/wgmma.cuh: the same layout).

// Scores of keys >= seq_k, or (causal) above the diagonal, to -inf; the
// tile's keys start at n0, the thread's first row is `row`.
template <int BN>
__device__ __forceinline__ void mask_scores(float (&s)[BN / 8][4], int n0, int row, int seq_k, bool causal,
                                            int shift, int lane) {
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = n0 + nt * 8 + (lane & 3) * 2 + (e & 1), r = row + (e >> 1) * 8;
            if (col >= seq_k || (causal && col > r + shift)) s[nt][e] = ninf();
        }
    }
}

// The new row max (base, log2 units) of each row over the tile's raw scores
// (scale_log2 > 0: the host sends other scales to the dense path); true
// where one grew.
template <int BN>
__device__ __forceinline__ bool new_max(float (&base)[2], const float (&s)[BN / 8][4], const float (&mx)[2],
                                        float scale_log2) {
    bool grew = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float m = ninf();
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) m = fmaxf(m, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        m = quad_max(m);
        m = m == ninf() ? ninf() : m * scale_log2;
        grew |= m > mx[r];
        base[r] = fmaxf(m, mx[r]);
    }
    return grew;
}

// The factors from the old row max to the new (a row with nothing seen yet:
// mx = -inf, alpha = 0, and its acc and sum are 0 anyway), sum rescaled by
// them; acc is rescaled by scale_rows (the wgmma forward: once its product
// into acc is done).
__device__ __forceinline__ void rescale_sum(float (&alpha)[2], float (&sum)[2], const float (&mx)[2],
                                            const float (&base)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        alpha[r] = ex2(mx[r] - (base[r] == ninf() ? 0.0f : base[r]));
        sum[r] *= alpha[r];
    }
}

// acc's two rows scaled by their factors.
template <int D> __device__ __forceinline__ void scale_rows(float (&acc)[D / 8][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        acc[dt][0] *= alpha[0];
        acc[dt][1] *= alpha[0];
        acc[dt][2] *= alpha[1];
        acc[dt][3] *= alpha[1];
    }
}

// acc and sum rescaled from the old max to the new.
template <int D>
__device__ __forceinline__ void rescale(float (&acc)[D / 8][4], float (&sum)[2], const float (&mx)[2],
                                        const float (&base)[2]) {
    float alpha[2];
    rescale_sum(alpha, sum, mx, base);
    scale_rows<D>(acc, alpha);
}

// A forward block's row tile. Blocks run heads fastest, and each head's
// heaviest tile (the last, under a causal mask) first. The pointers are
// moved to the block's batch and head (k and v: the kv head its query head
// reads); m0 is its first row, n_tiles the key tiles of BN its rows see.
template <typename T> struct ForwardTile {
    T* __restrict__ o;
    float* __restrict__ lse;
    const T* __restrict__ q;
    const T* __restrict__ k;
    const T* __restrict__ v;
    int m0, shift, n_tiles;
};
template <int BM, int BN, typename T>
__device__ __forceinline__ ForwardTile<T> forward_tile(T* o, float* lse, const T* q, const T* k, const T* v,
                                                       long long sqb, long long sqh, long long skb, long long skh,
                                                       long long svb, long long svh, long long sob, long long soh,
                                                       int bh_count, int heads, int group, int seq_q, int seq_k,
                                                       int tiles, bool causal) {
    const int bh = blockIdx.x % bh_count, tile = tiles - 1 - blockIdx.x / bh_count;
    const int b = bh / heads, h = bh % heads, hk = h / group;
    ForwardTile<T> t;
    t.o = o + b * sob + h * soh;
    t.lse = lse + static_cast<long long>(bh) * seq_q;
    t.q = q + b * sqb + h * sqh;
    t.k = k + b * skb + hk * skh;
    t.v = v + b * svb + hk * svh;
    t.m0 = tile * BM;
    t.shift = seq_k - seq_q;
    const int n_end = causal ? max(0, min(seq_k, t.m0 + BM + t.shift)) : seq_k;
    t.n_tiles = (n_end + BN - 1) / BN;
    return t;
}

// Scores to probabilities 2^(s * scale_log2 - base) (one FFMA and one ex2
// each), their row sums added to sum; mx becomes base.
template <int BN>
__device__ __forceinline__ void exponentiate(float (&s)[BN / 8][4], float (&mx)[2], float (&sum)[2],
                                             const float (&base)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = base[r];
        const float nb = base[r] == ninf() ? 0.0f : -base[r];
        float l = 0.0f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            s[nt][2 * r] = ex2(fmaf(s[nt][2 * r], scale_log2, nb));
            s[nt][2 * r + 1] = ex2(fmaf(s[nt][2 * r + 1], scale_log2, nb));
            l += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        sum[r] += l;
    }
}

// The tile's output rows (row0 + g, + 8; rows >= seq_q skipped) divided by
// their sums, and their log-sum-exp (natural log; -inf for a row that saw
// no key, whose output is 0).
template <int D, typename T>
__device__ __forceinline__ void finish_rows(T* o, long long sos, float* lse, const float (&acc)[D / 8][4],
                                            float (&sum)[2], const float (&mx)[2], int row0, int seq_q,
                                            int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[r] = quad_sum(sum[r]);
    store_c<D, T>(o, sos, acc, row0, seq_q, sum[0] > 0.0f ? 1.0f / sum[0] : 0.0f,
                  sum[1] > 0.0f ? 1.0f / sum[1] : 0.0f, lane);
    if ((lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + (lane >> 2) + r * 8;
            if (row < seq_q) lse[row] = sum[r] > 0.0f ? (mx[r] + log2f(sum[r])) * 0.6931471805599453f : ninf();
        }
    }
}

}  // namespace attn
}  // namespace cufuse
