// cufuse: flash attention forward on Hopper (sm_90a: wgmma), float16 and
// bfloat16 with float32 accumulation. Same arguments, layout and results as
// attention_forward in attention.cu (the sm_80 path), whose causal rule,
// online softmax and row stores it shares (attention_tiles.cuh).
//
// A block is WGS warpgroups, each owning 64 query rows of one head. Q, and K
// and V tiles of BN keys, are copied by cp.async into shared memory in the
// 128-byte swizzled layout wgmma reads (wgmma.cuh), K and V double buffered.
// Per key tile j a warpgroup issues S_j = Q K_j^T (D / 16 wgmma, both
// operands in shared memory) and then O += P_{j-1} V_{j-1} (BN / 16 wgmma, P
// in registers), so that the softmax of S_j runs while the tensor cores
// still add the previous tile (FlashAttention-3's intra-warpgroup overlap);
// the output is rescaled once that product is done. V_j's copy is issued a
// tile after K_j's, when the buffer it overwrites is free.
#include "common.cuh"
#include "attention_tiles.cuh"
#include "wgmma.cuh"

namespace cufuse {
namespace attn90 {

// S = Q K^T of one key tile (the warpgroup's 64 rows; not waited for).
template <typename T, int D, int BM, int BN>
__device__ __forceinline__ void issue_qk(float (&s)[BN / 8][4], unsigned qa, unsigned ka) {
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wg::mma<BN, T>::template ss<0>(s, wg::desc_k(qa, BM, kk), wg::desc_k(ka, BN, kk), kk);
    wg::commit();
}

// O += P V of one key tile (P as A fragments; not waited for).
template <typename T, int D, int BN>
__device__ __forceinline__ void issue_pv(float (&acc)[D / 8][4], const unsigned (&pf)[BN / 16][4], unsigned va) {
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wg::mma<D, T>::template rs<1>(acc, pf[kk], wg::desc_mn(va, BN, kk), 1);
    wg::commit();
}

}  // namespace attn90
}  // namespace cufuse

template <typename T, int D, int BN, int WGS>
__global__ void __launch_bounds__(WGS * 128, 1)
    attention_forward_sm90(T* __restrict__ o, float* __restrict__ lse, const T* __restrict__ q,
                           const T* __restrict__ k, const T* __restrict__ v, long long sqb, long long sqh,
                           long long sqs, long long skb, long long skh, long long sks, long long svb,
                           long long svh, long long svs, long long sob, long long soh, long long sos, int bh_count,
                           int heads, int group, int seq_q, int seq_k, int tiles, float scale_log2, bool causal) {
    using namespace cufuse;
    using namespace cufuse::attn;
    using namespace cufuse::attn90;
    static_assert(D % 64 == 0 && BN % 64 == 0, "whole 128-byte swizzle blocks");
    constexpr int THREADS = WGS * 128, BM = 64 * WGS;
    extern __shared__ __align__(1024) unsigned char smem[];
    if (smem_addr(smem) & 1023) __trap();  // the swizzle's address bits: 1024-byte aligned tiles
    T* sq = reinterpret_cast<T*>(smem);
    T* sk = sq + BM * D;
    T* sv = sk + 2 * BN * D;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const ForwardTile<T> t = forward_tile<BM, BN>(o, lse, q, k, v, sqb, sqh, skb, skh, svb, svh, sob, soh, bh_count,
                                                  heads, group, seq_q, seq_k, tiles, causal);
    const int m0 = t.m0, shift = t.shift, n_tiles = t.n_tiles, wr = warp * 16;

    float acc[D / 8][4];
    float mx[2] = {ninf(), ninf()}, sum[2] = {0.0f, 0.0f};
    zero(acc);
    const unsigned qa = smem_addr(sq) + (warp >> 2) * 64 * 128;  // the warpgroup's 64 rows
    const int ra = m0 + wr + (lane >> 2);                         // the thread's rows: ra, ra + 8
    load_swizzled<BM, D, THREADS>(sq, t.q, sqs, m0, seq_q, tid);
    if (n_tiles > 0) load_swizzled<BN, D, THREADS>(sk, t.k, sks, 0, seq_k, tid);
    cp_async_commit();

    unsigned pf[BN / 16][4];  // P of the previous tile
    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();
        wg::fence_proxy();
        __syncthreads();  // K_j and V_{j-1} landed; every warpgroup is done with K_{j-1} and V_{j-2}
        if (j + 1 < n_tiles) load_swizzled<BN, D, THREADS>(sk + ((j + 1) & 1) * BN * D, t.k, sks, (j + 1) * BN, seq_k, tid);
        load_swizzled<BN, D, THREADS>(sv + (j & 1) * BN * D, t.v, svs, j * BN, seq_k, tid);
        cp_async_commit();

        float s[BN / 8][4];
        issue_qk<T, D, BM, BN>(s, qa, smem_addr(sk + (j & 1) * BN * D));
        if (j > 0) {
            issue_pv<T, D, BN>(acc, pf, smem_addr(sv + ((j - 1) & 1) * BN * D));
            wg::wait<1>();
        } else {
            wg::wait<0>();
        }
        wg::touch(s);

        const int n0 = j * BN;
        if (n0 + BN > seq_k || (causal && n0 + BN - 1 > m0 + wr + shift)) {  // a tile on an edge: mask
            mask_scores<BN>(s, n0, ra, seq_k, causal, shift, lane);
        }
        float base[2], alpha[2];
        const bool grew = __any_sync(0xffffffffu, new_max<BN>(base, s, mx, scale_log2));
        rescale_sum(alpha, sum, mx, base);
        exponentiate<BN>(s, mx, sum, base, scale_log2);
        wg::wait<0>();  // P_{j-1} V_{j-1} added
        wg::touch(acc);
        if (grew) scale_rows<D>(acc, alpha);
        c_to_a<BN, T>(pf, s);
    }
    if (n_tiles > 0) {
        cp_async_wait<0>();
        wg::fence_proxy();
        __syncthreads();  // V of the last tile landed
        issue_pv<T, D, BN>(acc, pf, smem_addr(sv + ((n_tiles - 1) & 1) * BN * D));
        wg::wait<0>();
        wg::touch(acc);
    }
    finish_rows<D, T>(t.o, sos, t.lse, acc, sum, mx, m0 + wr, seq_q, lane);
}
