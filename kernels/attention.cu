// cufuse: flash attention on tensor cores (sm_80 path: mma.sync m16n8k16,
// ldmatrix, cp.async), float16 and bfloat16 with float32 accumulation.
//
// Layout: q [batch][heads][seq_q][D], k and v [batch][kv_heads][seq_k][D],
// each through element strides (batch, head, row; the last dim contiguous,
// rows 16-byte aligned); q head h reads kv head h / group (grouped-query
// attention). lse and delta are float32 [batch][heads][seq_q], contiguous.
// Causal: query row i sees keys j <= i + seq_k - seq_q (aligned to the
// bottom right, as FlashAttention: with seq_q == seq_k the usual lower
// triangle; a row that sees no key gives 0 and lse -inf).
//
// Forward (one block per 16 * MT * WARPS query rows of one head; a warp owns
// MT tiles of 16 rows): K and V tiles are double-buffered through shared
// memory with cp.async, S = Q K^T and the online softmax stay in registers
// (scores in log2 units), P is rounded to T and fed to P V as A fragments.
// Nothing seq x seq touches global memory.
//
// Backward, deterministic (no atomics), FlashAttention-2's recomputation
// split in two kernels: attention_backward_kv (a block per 16 * WARPS keys
// of one kv head: loops over the query tiles of the heads of its group,
// accumulates dK and dV in registers) and attention_backward_q (a block per
// query rows: loops over the key tiles, accumulates dQ). Both recompute P
// from the saved lse; delta = rowsum(dO * O) comes first (attention_delta).
//
// attention_score: the scaled scores themselves, q k^T * scale (+ a mask),
// written as T: one pass, the scale and mask applied before the one write.
#include "common.cuh"
#include "attention_tiles.cuh"

namespace cufuse {
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;
}  // namespace cufuse

// ----------------------------------------------------------------- forward
// A block of WARPS warps, each owning MT row tiles of 16 query rows (so each
// K and V fragment read from shared memory feeds MT products), over key
// tiles of BN. Q stays in registers where MT * D <= 128, else it is read
// from shared memory.
template <typename T, int D, int WARPS, int MT, int BN>
__global__ void __launch_bounds__(WARPS * 32)
    attention_forward(T* __restrict__ o, float* __restrict__ lse, const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, long long sqb, long long sqh, long long sqs, long long skb,
                      long long skh, long long sks, long long svb, long long svh, long long svs, long long sob,
                      long long soh, long long sos, int bh_count, int heads, int group, int seq_q, int seq_k,
                      int tiles, float scale_log2, bool causal) {
    using namespace cufuse;
    using namespace cufuse::attn;
    constexpr int THREADS = WARPS * 32, BM = 16 * MT * WARPS, LDS = D + 8;
    constexpr bool QREG = MT * D <= 128;
    extern __shared__ __align__(16) unsigned char smem[];
    T* sq = reinterpret_cast<T*>(smem);
    T* sk = sq + BM * LDS;
    T* sv = sk + 2 * BN * LDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const ForwardTile<T> t = forward_tile<BM, BN>(o, lse, q, k, v, sqb, sqh, skb, skh, svb, svh, sob, soh, bh_count,
                                                  heads, group, seq_q, seq_k, tiles, causal);
    const int m0 = t.m0, shift = t.shift, n_tiles = t.n_tiles, wr = warp * 16 * MT;

    load_rows<BM, D, THREADS>(sq, t.q, sqs, m0, seq_q, tid);
    if (n_tiles > 0) {
        load_rows<BN, D, THREADS>(sk, t.k, sks, 0, seq_k, tid);
        load_rows<BN, D, THREADS>(sv, t.v, svs, 0, seq_k, tid);
    }
    cp_async_commit();

    float acc[MT][D / 8][4];
    float mx[MT][2], sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        zero(acc[mt]);
        mx[mt][0] = mx[mt][1] = ninf();
        sum[mt][0] = sum[mt][1] = 0.0f;
    }
    unsigned qf[QREG ? MT : 1][QREG ? D / 16 : 1][4];
    const int ra = m0 + wr + (lane >> 2);  // the thread's rows: ra + 16 mt + 8 r
    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();
        __syncthreads();  // tile j landed; every warp is done with tile j - 1's buffers
        if constexpr (QREG) {
            if (j == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) load_a_rows<D, LDS>(qf[mt], sq, wr + 16 * mt, lane);
            }
        }
        if (j + 1 < n_tiles) {
            const int nb = ((j + 1) & 1) * BN * LDS;
            load_rows<BN, D, THREADS>(sk + nb, t.k, sks, (j + 1) * BN, seq_k, tid);
            load_rows<BN, D, THREADS>(sv + nb, t.v, svs, (j + 1) * BN, seq_k, tid);
        }
        cp_async_commit();
        const T* ck = sk + (j & 1) * BN * LDS;
        const T* cv = sv + (j & 1) * BN * LDS;

        float s[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(s[mt]);
        if constexpr (QREG) {
            warp_mma<MT, D, BN, false, LDS>(s, qf, ck, lane);
        } else {
            warp_mma_sa<MT, D, BN, false, LDS, LDS>(s, sq, wr, ck, lane);
        }
        const int n0 = j * BN;
        if (n0 + BN > seq_k || (causal && n0 + BN - 1 > m0 + wr + shift)) {  // a tile on an edge: mask
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mask_scores<BN>(s[mt], n0, ra + 16 * mt, seq_k, causal, shift, lane);
        }
        // online softmax in log2 units; the output rescaled only when a row max grew
        float base[MT][2];
        bool grew = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) grew |= new_max<BN>(base[mt], s[mt], mx[mt], scale_log2);
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) rescale<D>(acc[mt], sum[mt], mx[mt], base[mt]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) exponentiate<BN>(s[mt], mx[mt], sum[mt], base[mt], scale_log2);
        unsigned pf[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) c_to_a<BN, T>(pf[mt], s[mt]);
        warp_mma<MT, BN, D, true, LDS>(acc, pf, cv, lane);
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) finish_rows<D, T>(t.o, sos, t.lse, acc[mt], sum[mt], mx[mt], m0 + wr + 16 * mt, seq_q, lane);
}

// ------------------------------------------------------------------ delta
// delta[row] = sum_d dO[row][d] * O[row][d] (float), a warp per row.
template <typename T>
__global__ void attention_delta(float* __restrict__ delta, const T* __restrict__ o, const T* __restrict__ dout,
                                long long sob, long long soh, long long sos, long long sdb, long long sdh,
                                long long sds, int heads, int seq_q, int d, long long rows) {
    using namespace cufuse;
    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    for (long long r = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;
         r += warps) {
        const long long bh = r / seq_q, i = r % seq_q, b = bh / heads, h = bh % heads;
        const T* po = o + b * sob + h * soh + i * sos;
        const T* pd = dout + b * sdb + h * sdh + i * sds;
        float acc = 0.0f;
        for (int c = lane; c < d; c += 32) acc += to_compute<float>(po[c]) * to_compute<float>(pd[c]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) delta[r] = acc;
    }
}

// ------------------------------------------------------------ dK and dV
// A block per 16 * MT * WARPS keys of one kv head; a warp owns MT tiles of
// 16 keys. For each query head of the group and each query tile (BQ rows,
// double-buffered): S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q; dK scaled once at
// the end.
template <typename T, int D, int WARPS, int MT, int BQ>
__global__ void __launch_bounds__(WARPS * 32)
    attention_backward_kv(T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const T* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, long long sqb, long long sqh, long long sqs,
                          long long skb, long long skh, long long sks, long long svb, long long svh,
                          long long svs, long long sdb, long long sdh, long long sds, long long skgb,
                          long long skgh, long long skgs, long long svgb, long long svgh, long long svgs,
                          int bh_count, int kv_heads, int group, int seq_q, int seq_k, int tiles,
                          float scale_log2, float scale, bool causal) {
    using namespace cufuse;
    using namespace cufuse::attn;
    constexpr int THREADS = WARPS * 32, BN = 16 * MT * WARPS, LDS = D + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T* sk = reinterpret_cast<T*>(smem);
    T* sv = sk + BN * LDS;
    T* sq = sv + BN * LDS;
    T* sdo = sq + 2 * BQ * LDS;
    float* slse = reinterpret_cast<float*>(sdo + 2 * BQ * LDS);
    float* sdel = slse + 2 * BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int bh = blockIdx.x % bh_count, tile = tiles - 1 - blockIdx.x / bh_count;
    const int b = bh / kv_heads, hk = bh % kv_heads;
    const int n0 = tile * BN, kw = warp * 16 * MT;
    const int heads = kv_heads * group;
    k += b * skb + hk * skh;
    v += b * svb + hk * svh;
    dk += b * skgb + hk * skgh;
    dv += b * svgb + hk * svgh;
    const int shift = seq_k - seq_q;
    // causal: query rows i >= n0 - shift see some key of this block
    const int q_begin = causal ? min(seq_q, max(0, n0 - shift)) / BQ * BQ : 0;
    const int per_head = (seq_q - q_begin + BQ - 1) / BQ;
    const int iters = group * per_head;

    auto issue = [&](int it, int buf) {  // query tile it (head, rows) into buffer buf
        const int hq = hk * group + it / per_head, q0 = q_begin + (it % per_head) * BQ;
        load_rows<BQ, D, THREADS>(sq + buf * BQ * LDS, q + b * sqb + hq * sqh, sqs, q0, seq_q, tid);
        load_rows<BQ, D, THREADS>(sdo + buf * BQ * LDS, dout + b * sdb + hq * sdh, sds, q0, seq_q, tid);
        const long long lo = (static_cast<long long>(b) * heads + hq) * seq_q;
        for (int i = tid; i < BQ; i += THREADS) {
            const bool in = q0 + i < seq_q;
            slse[buf * BQ + i] = in ? lse[lo + q0 + i] * kLog2e : ninf();
            sdel[buf * BQ + i] = in ? delta[lo + q0 + i] : 0.0f;
        }
    };

    load_rows<BN, D, THREADS>(sk, k, sks, n0, seq_k, tid);
    load_rows<BN, D, THREADS>(sv, v, svs, n0, seq_k, tid);
    if (iters > 0) issue(0, 0);
    cp_async_commit();

    float gk[MT][D / 8][4], gv[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        zero(gk[mt]);
        zero(gv[mt]);
    }
    const int ka = n0 + kw + (lane >> 2);  // the thread's keys: ka + 16 mt + 8 r
    for (int it = 0; it < iters; ++it) {
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < iters) issue(it + 1, (it + 1) & 1);
        cp_async_commit();
        const int buf = it & 1, q0 = q_begin + (it % per_head) * BQ;
        const T* cq = sq + buf * BQ * LDS;
        const T* cdo = sdo + buf * BQ * LDS;
        const float* cl = slse + buf * BQ;
        const float* cd = sdel + buf * BQ;

        float p[MT][BQ / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(p[mt]);
        warp_mma_sa<MT, D, BQ, false, LDS, LDS>(p, sk, kw, cq, lane);  // S^T
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = nt * 8 + (lane & 3) * 2 + (e & 1), key = ka + 16 * mt + (e >> 1) * 8;
                    const float l = cl[qi];
                    const bool ok = l != ninf() && key < seq_k && (!causal || key <= q0 + qi + shift);
                    p[mt][nt][e] = ok ? ex2(fmaf(p[mt][nt][e], scale_log2, -l)) : 0.0f;
                }
            }
        }
        unsigned af[MT][BQ / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) c_to_a<BQ, T>(af[mt], p[mt]);
        warp_mma<MT, BQ, D, true, LDS>(gv, af, cdo, lane);  // dV += P^T dO
        float dp[MT][BQ / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(dp[mt]);
        warp_mma_sa<MT, D, BQ, false, LDS, LDS>(dp, sv, kw, cdo, lane);  // dP^T = V dO^T
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    dp[mt][nt][e] = p[mt][nt][e] * (dp[mt][nt][e] - cd[nt * 8 + (lane & 3) * 2 + (e & 1)]);
                }
            }
            c_to_a<BQ, T>(af[mt], dp[mt]);
        }
        warp_mma<MT, BQ, D, true, LDS>(gk, af, cq, lane);  // dK += dS^T Q
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        store_c<D, T>(dk, skgs, gk[mt], n0 + kw + 16 * mt, seq_k, scale, scale, lane);
        store_c<D, T>(dv, svgs, gv[mt], n0 + kw + 16 * mt, seq_k, 1.0f, 1.0f, lane);
    }
}

// ------------------------------------------------------------------- dQ
// A block per 16 * MT * WARPS query rows of one head; a warp owns MT tiles
// of 16 rows. For each key tile (BN keys, double-buffered): S = Q K^T,
// P = exp2(S - lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K; dQ
// scaled once at the end.
template <typename T, int D, int WARPS, int MT, int BN>
__global__ void __launch_bounds__(WARPS * 32)
    attention_backward_q(T* __restrict__ dq, const T* __restrict__ q, const T* __restrict__ k,
                         const T* __restrict__ v, const T* __restrict__ dout, const float* __restrict__ lse,
                         const float* __restrict__ delta, long long sqb, long long sqh, long long sqs,
                         long long skb, long long skh, long long sks, long long svb, long long svh,
                         long long svs, long long sdb, long long sdh, long long sds, long long sgb, long long sgh,
                         long long sgs, int bh_count, int heads, int group, int seq_q, int seq_k, int tiles,
                         float scale_log2, float scale, bool causal) {
    using namespace cufuse;
    using namespace cufuse::attn;
    constexpr int THREADS = WARPS * 32, BM = 16 * MT * WARPS, LDS = D + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T* sq = reinterpret_cast<T*>(smem);
    T* sdo = sq + BM * LDS;
    T* sk = sdo + BM * LDS;
    T* sv = sk + 2 * BN * LDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int bh = blockIdx.x % bh_count, tile = tiles - 1 - blockIdx.x / bh_count;
    const int b = bh / heads, h = bh % heads, hk = h / group;
    const int m0 = tile * BM, wr = warp * 16 * MT;
    q += b * sqb + h * sqh;
    dout += b * sdb + h * sdh;
    dq += b * sgb + h * sgh;
    k += b * skb + hk * skh;
    v += b * svb + hk * svh;
    const int shift = seq_k - seq_q;
    const int n_end = causal ? max(0, min(seq_k, m0 + BM + shift)) : seq_k;
    const int n_tiles = (n_end + BN - 1) / BN;

    load_rows<BM, D, THREADS>(sq, q, sqs, m0, seq_q, tid);
    load_rows<BM, D, THREADS>(sdo, dout, sds, m0, seq_q, tid);
    if (n_tiles > 0) {
        load_rows<BN, D, THREADS>(sk, k, sks, 0, seq_k, tid);
        load_rows<BN, D, THREADS>(sv, v, svs, 0, seq_k, tid);
    }
    cp_async_commit();
    const int ra = m0 + wr + (lane >> 2);  // the thread's rows: ra + 16 mt + 8 r
    float l2[MT][2], del[MT][2];
    const long long lo = static_cast<long long>(bh) * seq_q;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = ra + 16 * mt + r * 8;
            l2[mt][r] = row < seq_q ? lse[lo + row] * kLog2e : ninf();
            del[mt][r] = row < seq_q ? delta[lo + row] : 0.0f;
        }
    }
    float gq[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) zero(gq[mt]);
    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < n_tiles) {
            const int nb = ((j + 1) & 1) * BN * LDS;
            load_rows<BN, D, THREADS>(sk + nb, k, sks, (j + 1) * BN, seq_k, tid);
            load_rows<BN, D, THREADS>(sv + nb, v, svs, (j + 1) * BN, seq_k, tid);
        }
        cp_async_commit();
        const T* ck = sk + (j & 1) * BN * LDS;
        const T* cv = sv + (j & 1) * BN * LDS;
        const int n0 = j * BN;
        float p[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(p[mt]);
        warp_mma_sa<MT, D, BN, false, LDS, LDS>(p, sq, wr, ck, lane);  // S
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = n0 + nt * 8 + (lane & 3) * 2 + (e & 1), r = e >> 1, row = ra + 16 * mt + r * 8;
                    const bool ok = l2[mt][r] != ninf() && col < seq_k && (!causal || col <= row + shift);
                    p[mt][nt][e] = ok ? ex2(fmaf(p[mt][nt][e], scale_log2, -l2[mt][r])) : 0.0f;
                }
            }
        }
        float dp[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(dp[mt]);
        warp_mma_sa<MT, D, BN, false, LDS, LDS>(dp, sdo, wr, cv, lane);  // dP = dO V^T
        unsigned af[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[mt][nt][e] = p[mt][nt][e] * (dp[mt][nt][e] - del[mt][e >> 1]);
            }
            c_to_a<BN, T>(af[mt], dp[mt]);
        }
        warp_mma<MT, BN, D, true, LDS>(gq, af, ck, lane);  // dQ += dS K
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) store_c<D, T>(dq, sgs, gq[mt], m0 + wr + 16 * mt, seq_q, scale, scale, lane);
}

// ---------------------------------------------------------------- scores
// out[b][h][i][j] = scale * q[b][h][i] . k[b][h / group][j], plus mask[b][h][i][j]
// (MASK 1: additive, T) or -inf where mask[b][h][i][j] is 0 (MASK 2: bytes),
// the mask read through broadcast strides. A block per 16 * MT * 4 query
// rows of one head keeps its Q tile in shared memory and streams the key
// tiles (BN keys, double-buffered); each warp stages its scores through
// shared memory so that the one write is 16-byte stores of whole rows
// (where out's rows are 16-byte aligned: vec), else one element at a time.
template <typename T, int D, int MASK, int MT, int BN>
__global__ void __launch_bounds__(128)
    attention_score(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                    const void* __restrict__ mask, long long sqb, long long sqh, long long sqs, long long skb,
                    long long skh, long long sks, long long sob, long long soh, long long sos, long long smb,
                    long long smh, long long smi, long long smj, int bh_count, int heads, int group, int seq_q,
                    int seq_k, int tiles, float scale, bool vec) {
    using namespace cufuse;
    using namespace cufuse::attn;
    constexpr int WARPS = 4, THREADS = 128, BM = 16 * MT * WARPS, LDS = D + 8, LDO = BN + 8, WR = 16 * MT;
    extern __shared__ __align__(16) unsigned char smem[];
    T* sq = reinterpret_cast<T*>(smem);
    T* sk = sq + BM * LDS;
    T* so = sk + 2 * BN * LDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int bh = blockIdx.x % bh_count, m0 = (tiles - 1 - blockIdx.x / bh_count) * BM;
    const int b = bh / heads, h = bh % heads, hk = h / group;
    k += b * skb + hk * skh;
    out += b * sob + h * soh;
    T* wo = so + warp * WR * LDO;  // the warp's staging rows
    const int wr = warp * WR;
    const int n_tiles = (seq_k + BN - 1) / BN;
    load_rows<BM, D, THREADS>(sq, q + b * sqb + h * sqh, sqs, m0, seq_q, tid);
    load_rows<BN, D, THREADS>(sk, k, sks, 0, seq_k, tid);
    cp_async_commit();
    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < n_tiles) load_rows<BN, D, THREADS>(sk + ((j + 1) & 1) * BN * LDS, k, sks, (j + 1) * BN, seq_k, tid);
        cp_async_commit();
        float acc[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(acc[mt]);
        warp_mma_sa<MT, D, BN, false, LDS, LDS>(acc, sq, wr, sk + (j & 1) * BN * LDS, lane);
        const int n0 = j * BN;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int lr = mt * 16 + (lane >> 2) + r * 8, row = m0 + wr + lr;
                const long long mrow = b * smb + h * smh + static_cast<long long>(min(row, seq_q - 1)) * smi;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) {
                    const int lc = nt * 8 + (lane & 3) * 2;
                    float v[2] = {acc[mt][nt][2 * r] * scale, acc[mt][nt][2 * r + 1] * scale};
                    if constexpr (MASK != 0) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = min(n0 + lc + e, seq_k - 1);  // (tails: read in bounds, not stored)
                            const long long m = mrow + col * smj;
                            if constexpr (MASK == 1) v[e] += to_compute<float>(static_cast<const T*>(mask)[m]);
                            if constexpr (MASK == 2) {
                                if (!static_cast<const unsigned char*>(mask)[m]) v[e] = ninf();
                            }
                        }
                    }
                    *reinterpret_cast<unsigned*>(wo + lr * LDO + lc) = mma_kind<T>::pack(v[0], v[1]);
                }
            }
        }
        __syncwarp();
        // the warp's WR rows x BN columns out, row by row
        if (vec) {
            constexpr int CH = BN / 8;  // 16-byte chunks per row
#pragma unroll
            for (int it = 0; it < WR * CH / 32; ++it) {
                const int i = lane + it * 32, lr = i / CH, c = (i % CH) * 8, row = m0 + wr + lr;
                if (row < seq_q && n0 + c < seq_k) {
                    *reinterpret_cast<int4*>(out + row * sos + n0 + c) = *reinterpret_cast<const int4*>(wo + lr * LDO + c);
                }
            }
        } else {
            for (int i = lane; i < WR * BN; i += 32) {
                const int lr = i / BN, c = i % BN, row = m0 + wr + lr;
                if (row < seq_q && n0 + c < seq_k) out[row * sos + n0 + c] = wo[lr * LDO + c];
            }
        }
        __syncwarp();
    }
}
