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
    constexpr int CHUNKS = COLS / 8, LDS = COLS + 8;
#pragma unroll
    for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool valid = row0 + r < limit;
        cp_async16(s + r * LDS + c, valid ? g + (row0 + r) * ld + c : g, valid);
    }
}

// The four 8x8 16-bit matrices whose rows lanes 8i..8i+7 address.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
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

// A fragment of the 16x16 block at (row0, col0) of a row-major shared tile.
template <int LDS, typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const T* s, int row0, int col0, int lane) {
    ldmatrix_x4(a, s + (row0 + (lane & 15)) * LDS + col0 + (lane >> 4) * 8);
}

// The A fragments of a 16 x K row block of a shared tile (K % 16 == 0).
template <int K, int LDS, typename T>
__device__ __forceinline__ void load_a_rows(unsigned (&a)[K / 16][4], const T* s, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) load_a<LDS>(a[kk], s, row0, kk * 16, lane);
}

// B fragments of two 8-column blocks (n0..n0 + 15) for the k step k0..k0 + 15:
//   b_nk: B stored transposed, as rows [n][k] (K in Q K^T)
//   b_kn: B stored as rows [k][n] (V in P V)
// r[0], r[1]: b0, b1 of columns n0..n0 + 7; r[2], r[3]: of n0 + 8..n0 + 15.
template <int LDS, typename T>
__device__ __forceinline__ void load_b_nk(unsigned (&r)[4], const T* s, int n0, int k0, int lane) {
    ldmatrix_x4(r, s + (n0 + (lane >> 4) * 8 + (lane & 7)) * LDS + k0 + ((lane >> 3) & 1) * 8);
}
template <int LDS, typename T>
__device__ __forceinline__ void load_b_kn(unsigned (&r)[4], const T* s, int k0, int n0, int lane) {
    ldmatrix_x4_trans(r, s + (k0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LDS + n0 + (lane >> 4) * 8);
}

// acc[16][N] += A[16][K] B[K][N]: A as fragments, B a shared tile stored
// [n][k] (KN = false) or [k][n] (KN = true). N % 16 == 0, K % 16 == 0.
template <int K, int N, bool KN, int LDS, typename T>
__device__ __forceinline__ void warp_mma(float (&acc)[N / 8][4], const unsigned (&a)[K / 16][4], const T* sb,
                                         int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            if constexpr (KN) {
                load_b_kn<LDS>(b, sb, kk * 16, np * 16, lane);
            } else {
                load_b_nk<LDS>(b, sb, np * 16, kk * 16, lane);
            }
            mma_kind<T>::run(acc[2 * np], a[kk], b[0], b[1]);
            mma_kind<T>::run(acc[2 * np + 1], a[kk], b[2], b[3]);
        }
    }
}

// The same with A read from a shared tile (rows row0..row0 + 15) one k step at a time.
template <int K, int N, bool KN, int LDSA, int LDS, typename T>
__device__ __forceinline__ void warp_mma_sa(float (&acc)[N / 8][4], const T* sa, int row0, const T* sb, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned a[4];
        load_a<LDSA>(a, sa, row0, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            if constexpr (KN) {
                load_b_kn<LDS>(b, sb, kk * 16, np * 16, lane);
            } else {
                load_b_nk<LDS>(b, sb, np * 16, kk * 16, lane);
            }
            mma_kind<T>::run(acc[2 * np], a, b[0], b[1]);
            mma_kind<T>::run(acc[2 * np + 1], a, b[2], b[3]);
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
