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

}  // namespace attn
}  // namespace cufuse
