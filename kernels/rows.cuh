// cufuse: row machinery shared by the reductions, the normalizations and softmax.
//
// A row is `cols` contiguous elements; rows are `ld` elements apart. A row
// is walked in 16-byte packs on its *aligned window*: pack k covers the
// elements k*V - head .. k*V - head + V - 1, where `head` is how far the
// row's first element lies past a 16-byte boundary. Every row length (1000,
// 4097, ...) and every offset view is therefore read with full-width loads,
// and only the elements outside [0, cols) of the first and last pack are
// masked. Those loads never fault: a 16-byte aligned segment holding one
// byte of an allocation lies inside the allocation's own (at least 256-byte
// aligned and sized) memory, and never straddles a page; the extra bytes are
// read, never used, never written.
//
// A row belongs to a *group* of `tpr` threads (a power of two, 32..1024) of
// one block, or, on sm_90, to a cluster of CS blocks that each hold one slice
// of it. Group reductions go warp shuffle -> shared memory -> (cluster)
// distributed shared memory, combining partial values in a fixed order, so a
// result never depends on scheduling.
//
// Why not CUB's WarpReduce / BlockReduce: including <cub/warp/warp_reduce.cuh>
// and <cub/block/block_reduce.cuh> added 1.05 s to every NVRTC compile of a
// module (NVRTC 12.9, sm_90: 1.08-1.30 s with CUB vs 0.03-0.11 s without, for
// the same two-kernel module), and neither covers what is needed here: a group
// size chosen at run time (rows of different lengths share one kernel) and
// the cluster level. The shuffle tree below is five lines.
#pragma once

#include "common.cuh"

namespace cufuse {

constexpr int kMaxWarps = 32;  // per block
constexpr int kSlots = 2;      // reductions per kernel, each with its own shared slots (no reuse, no extra barrier)

template <bool B, typename X, typename Y> struct select_type { using type = X; };
template <typename X, typename Y> struct select_type<false, X, Y> { using type = Y; };

template <typename T> struct PackOf {
    static constexpr int V = 16 / sizeof(T);
    using type = Pack<T, V>;
};

// ---- combining functions -----------------------------------------------------
struct SumOp {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return a + b; }
    template <typename C> static __device__ __forceinline__ C identity() { return C(0); }
};
struct MaxOp {
    // NaN wins, as in torch.max: a row holding NaN gives NaN.
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const {
        return (a != a || a > b) ? a : b;
    }
    template <typename C> static __device__ __forceinline__ C identity() { return C(-__int_as_float(0x7f800000)); }
};

// ---- clusters (sm_90): distributed shared memory through PTX ------------------
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

template <typename C> __device__ __forceinline__ C load_cluster(const C* smem, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    if constexpr (sizeof(C) == 8) {
        double v;
        asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(remote) : "memory");
        return v;
    } else {
        float v;
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
        return v;
    }
#else
    __trap();
    return C(0);
#endif
}

// ---- the row group ----------------------------------------------------------
// Threads of a block are split into groups of `tpr`; with CS > 1 there is one
// group per block and CS consecutive blocks (a cluster) share a row.
template <int CS> struct Group {
    int tpr, lane, group, groups;
    unsigned rank;  // this block's place in its cluster (0 without clusters)

    __device__ __forceinline__ explicit Group(int tpr_) : tpr(tpr_) {
        lane = threadIdx.x & (tpr - 1);
        group = threadIdx.x / tpr;
        groups = blockDim.x / tpr;
        rank = CS > 1 ? blockIdx.x % CS : 0;
    }
    // Index of the group's item (row, or row split) in the launch.
    __device__ __forceinline__ long long item() const {
        return static_cast<long long>(blockIdx.x / CS) * groups + group;
    }

    // Every thread of the group (every thread of the cluster with CS > 1)
    // gets the combination of all the group's `v`. `slot` < kSlots must
    // differ between the reductions of one kernel. All threads of the block
    // must call it (threads without data pass the identity).
    template <typename C, typename F> __device__ __forceinline__ C reduce(C v, F f, int slot) const {
        __shared__ C warp_part[kSlots][kMaxWarps];
        __shared__ C block_part[kSlots];
        const int width = tpr < 32 ? tpr : 32;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            if (o < width) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (tpr > 32) {
            const int warp = threadIdx.x >> 5;
            if ((threadIdx.x & 31) == 0) warp_part[slot][warp] = v;
            __syncthreads();
            const int first = group * (tpr >> 5);
            v = warp_part[slot][first];
            for (int w = 1; w < (tpr >> 5); ++w) v = f(v, warp_part[slot][first + w]);
        }
        if constexpr (CS > 1) {
            if (threadIdx.x == 0) block_part[slot] = v;
            cluster_sync();
            v = load_cluster(&block_part[slot], 0);
#pragma unroll
            for (unsigned r = 1; r < CS; ++r) v = f(v, load_cluster(&block_part[slot], r));
        }
        return v;
    }
};

// Where a row's aligned window starts: `head` elements before the row.
template <typename T> __device__ __forceinline__ int row_head(const T* row) {
    return static_cast<int>((reinterpret_cast<unsigned long long>(row) & 15) / sizeof(T));
}

}  // namespace cufuse
