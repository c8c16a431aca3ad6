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
// one block, or to several blocks that each hold one slice (a *part*) of it:
// on sm_90 a cluster of CS blocks (Group<CS>), on any GPU blocks that meet
// through global memory (SplitGroup). Group reductions go warp shuffle ->
// shared memory; the parts' statistics are then merged once per row through
// distributed shared memory or global memory. Every combination is in a fixed
// order, so a result never depends on scheduling.
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
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return math::max_nan(a, b); }
    template <typename C> static __device__ __forceinline__ C identity() { return C(-__int_as_float(0x7f800000)); }
};

// ---- clusters (sm_90): distributed shared memory through PTX ------------------
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// A cluster barrier without the release, for a block's last one (Group::
// finish): the blocks' reads of one another's shared memory are done
// (their values used) before they arrive, and nothing else needs ordering.
// The release made each block wait for its global stores to complete
// before it could leave (MEMBAR.ALL.GPU in the SASS); relaxed, layer_norm
// and rms_norm gain 2-4 points (bench/NOTES.md, "Figures from code comments").
__device__ __forceinline__ void cluster_sync_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// An S built word by word: word(i) gives its i-th 32-bit word (S is a
// struct of whole words: the statistics below, moved between threads).
template <typename S, typename F> __device__ __forceinline__ S from_words(F word) {
    static_assert(sizeof(S) % 4 == 0, "words only");
    unsigned w[sizeof(S) / 4];
#pragma unroll
    for (int i = 0; i < int(sizeof(S) / 4); ++i) w[i] = word(i);
    S out;
    memcpy(&out, w, sizeof(S));
    return out;
}

// A value of another block of the cluster: `smem` is this block's copy of
// the variable, `rank` the block to read it from.
template <typename S> __device__ __forceinline__ S load_cluster(const S* smem, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return from_words<S>([&](int i) {
        unsigned r;
        asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(r) : "r"(remote + 4 * i) : "memory");
        return r;
    });
#else
    __trap();
    return *smem;
#endif
}

// ---- statistics merged across the parts of a row ---------------------------
// A part's statistic S (a struct of the compute type) provides identity()
// and merge(a, b), merge(earlier part, later part). It need not be
// commutative bit for bit (contracted multiply-adds are not): every merge
// below takes its operands in one fixed order.
template <typename S> __device__ __forceinline__ S shfl_down(const S& v, int o) {
    unsigned w[sizeof(S) / 4];
    memcpy(w, &v, sizeof(S));
    return from_words<S>([&](int i) { return __shfl_down_sync(0xffffffffu, w[i], o); });
}

// `v` of the thread where `mine` holds, for every thread of the block (all
// must call it; once per kernel: the shared slot is not reused).
template <typename S> __device__ __forceinline__ S block_broadcast(const S& v, bool mine) {
    __shared__ S slot;
    if (mine) slot = v;
    __syncthreads();
    return slot;
}

template <typename S> __device__ __forceinline__ S load_cg(const S* p) {  // through L2, never L1
    return from_words<S>([&](int i) { return __ldcg(reinterpret_cast<const unsigned*>(p) + i); });
}

// ---- the row group ----------------------------------------------------------
// Warp shuffle, then (tpr > 32) shared memory: every thread of a group of
// `tpr` threads (the `group`-th of its block) gets the combination of all the
// group's `v`. `slot` < kSlots must differ between the reductions of one
// kernel. All threads of the block must call it (threads without data pass
// the identity).
template <typename C, typename F> __device__ __forceinline__ C group_reduce(C v, F f, int slot, int tpr, int group) {
    __shared__ C warp_part[kSlots][kMaxWarps];
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
    return v;
}

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
    static constexpr bool kOnePart = CS == 1;  // a group holds its whole row
    static constexpr bool kStaged = false;     // rows are read from global memory
    static constexpr bool kCluster = CS > 1;   // a block holds one part of a cluster's row
    static constexpr bool kMayQuit = false;    // blocks never give up (SplitGroup)
    __device__ __forceinline__ int parts() const { return CS; }
    // Index of the group's item (row, or row split) in the launch.
    __device__ __forceinline__ long long item() const {
        return static_cast<long long>(blockIdx.x / CS) * groups + group;
    }

    // Every thread of the group gets the combination of all the group's `v`
    // (see group_reduce): the part of the row this block holds.
    template <typename C, typename F> __device__ __forceinline__ C reduce(C v, F f, int slot) const {
        return group_reduce(v, f, slot, tpr, group);
    }
    // The parts' statistics merged (every thread gets the same bits): a
    // cluster's blocks in rank order; one part: `v` itself. At most one
    // combine per kernel. One thread per block merges and shares the result
    // through shared memory (see SplitGroup::combine for why).
    template <typename S> __device__ __forceinline__ S combine(const S& v) const {
        if constexpr (CS == 1) {
            return v;
        } else {
            __shared__ S block_part;
            if (threadIdx.x == 0) block_part = v;
            cluster_sync();
            S acc = S::identity();
            if (threadIdx.x == 0) {
                acc = load_cluster(&block_part, 0);
#pragma unroll
                for (unsigned r = 1; r < CS; ++r) acc = S::merge(acc, load_cluster(&block_part, r));
            }
            return block_broadcast(acc, threadIdx.x == 0);
        }
    }
    // Before the block leaves: no block of a cluster may leave while another
    // reads its shared memory.
    __device__ __forceinline__ void finish() const {
        if constexpr (CS > 1) cluster_sync_relaxed();
    }
};

// ---- rows split over blocks through global memory (any architecture) ----------
// `parts` blocks share a row, one slice each, as a cluster's blocks do; the
// merge of their statistics goes through a workspace in global memory that
// is zeroed before the launch, all but the slots (cufuse/ops/norm.py):
//   work[0]                    ticket counter
//   work[1]                    set once any block gave up waiting (see below)
//   work[3]                    norm_rows_rescue's blocks that have ended
//   work[4 .. 4 + rows)        per row: the parts that have published
//   then [rows][parts] bytes   per part: 1 where its block gave up (16-byte aligned)
//   then [rows][parts]         kPartBytes per part's statistic (16-byte aligned)
// Each block writes its statistic, counts it in (release), waits until all
// parts of its row have (acquire) and merges them in a fixed order (lanes,
// then the shuffle tree), so that every block of a row gets the same bits.
// A block takes its (row, part) from the ticket counter in the order blocks
// start, not from blockIdx: the parts it waits for are held by running
// blocks or taken by the next blocks to start. The wait is bounded, because
// nothing guarantees those blocks can start (other kernels may hold the
// multiprocessors, as under MPS, green contexts or beside a persistent
// kernel): a block that has waited `patience` ns, or sees that another block
// gave up, marks its part and leaves without storing it (patience 0: every
// block does, so that tests take the rescue for every part); every block still
// publishes first, so after the launch every row's statistics are complete,
// and norm_rows_rescue (the next launch on the stream) stores the marked
// parts from them, merged in the same order. Progress needs one free block
// slot. The host keeps the workspace per stream; norm_rows_rescue zeroes it
// again for the next launch.
constexpr int kPartBytes = 32;

// The low 32 bits of the global nanosecond timer: differences of up to 4 s,
// across a wrap too, in one register.
__device__ __forceinline__ unsigned global_ns() {
    unsigned t;
    asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t));
    return t;
}
__device__ __forceinline__ bool gave_up(const unsigned* work) {
    return *reinterpret_cast<const volatile unsigned*>(work + 1) != 0;
}

// The bounded wait of the split and pipe blocks: until ready(), polled after
// a short sleep and refresh() (which reloads what ready() reads), at most
// `patience` ns, or until expired(t0) says another block gave up or the time
// since t0 is past the patience; expired is asked every 16th round only, so
// that a round is one load, as without it. Returns true when the block gives
// up (patience 0: at once).
template <typename Ready, typename Refresh, typename Expired>
__device__ __forceinline__ bool wait_bounded(unsigned patience, Ready ready, Refresh refresh, Expired expired) {
    if (patience == 0) return true;
    if (ready()) return false;
    const unsigned t0 = global_ns();
    for (unsigned round = 1;; ++round) {
        if ((round & 15) == 0 && expired(t0)) return true;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(32);
#endif
        refresh();
        if (ready()) return false;
    }
}

// SplitGroup's workspace: the part marks and the statistics' slots.
struct SplitWork {
    unsigned* work;
    unsigned char* marks;  // [rows][parts]
    char* slots;           // [rows][parts][kPartBytes]
    __device__ __forceinline__ SplitWork(unsigned* work_, long long rows, int parts) : work(work_) {
        marks = reinterpret_cast<unsigned char*>(work + 4 + ((rows + 3) & ~3LL));
        slots = reinterpret_cast<char*>(marks) + ((rows * parts + 15) & ~15LL);
    }
    // The parts' statistics of a row merged by warp 0 into lane 0: lanes in
    // order, then a shuffle tree (lower lane, higher lane), so that every
    // block of the row, and norm_rows_rescue, gets the same bits. Loaded
    // through L2 (ld.global.cg): another row's part may share a line that
    // this SM's L1 holds from before it was written.
    template <typename S> __device__ __forceinline__ S merged(long long row, int nparts) const {
        const char* base = slots + row * nparts * kPartBytes;
        S acc = S::identity();
        for (int i = threadIdx.x; i < nparts; i += 32)
            acc = S::merge(acc, load_cg(reinterpret_cast<const S*>(base + i * kPartBytes)));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc = S::merge(acc, shfl_down(acc, o));
        return acc;
    }
};

struct SplitGroup {
    int tpr, lane, group, groups, nparts;
    unsigned rank;
    long long row, rows;
    unsigned* work;
    unsigned patience;  // ns a block waits for its row's other parts (< 2**32)
    mutable bool quit = false;    // this block gave up (block-uniform after combine)

    __device__ __forceinline__ SplitGroup(unsigned* work_, long long rows_, int parts_, unsigned patience_)
        : tpr(blockDim.x), lane(threadIdx.x), group(0), groups(1), nparts(parts_), rows(rows_), work(work_),
          patience(patience_) {
        __shared__ unsigned ticket;
        if (threadIdx.x == 0) ticket = atomicAdd(work, 1u);
        __syncthreads();
        row = ticket / static_cast<unsigned>(nparts);
        rank = ticket % static_cast<unsigned>(nparts);
    }
    static constexpr bool kOnePart = false;
    static constexpr bool kStaged = false;
    static constexpr bool kCluster = false;
    static constexpr bool kMayQuit = true;
    __device__ __forceinline__ int parts() const { return nparts; }
    __device__ __forceinline__ long long item() const { return row; }

    template <typename C, typename F> __device__ __forceinline__ C reduce(C v, F f, int slot) const {
        return group_reduce(v, f, slot, tpr, 0);
    }

    // The row's statistic (see SplitWork::merged), or, where this block
    // gave up waiting (`quit`), nothing: the block then stores nothing.
    template <typename S> __device__ __forceinline__ S combine(const S& v) const {
        static_assert(sizeof(S) <= kPartBytes, "a part's statistic exceeds its workspace slot");
        const SplitWork sw(work, rows, nparts);
        unsigned* count = work + 4 + row;
        __shared__ bool left;
        if (threadIdx.x == 0) {
            *reinterpret_cast<S*>(sw.slots + (row * nparts + rank) * kPartBytes) = v;
            __threadfence();  // the statistic before the count
            atomicAdd(count, 1u);
            const bool gone = wait_bounded(
                patience, [&] { return load_acquire(count) >= static_cast<unsigned>(nparts); }, [] {},
                [&](unsigned t0) { return gave_up(work) || global_ns() - t0 > patience; });
            if (gone) {
                sw.marks[row * nparts + rank] = 1;
                atomicExch(work + 1, 1u);
            }
            left = gone;
        }
        __syncthreads();
        quit = left;
        // Warp 0 merges (every warp merging, as before, put layer_norm's
        // merges, two divisions each, into the instructions of every thread,
        // which holds only 32 values: H200, layer_norm 256 x 262144, % of
        // copy, float32 53.5 -> 61.2, float16 56.1 -> 60.1).
        S acc = S::identity();
        if (threadIdx.x < 32 && !quit) acc = sw.merged<S>(row, nparts);
        return block_broadcast(acc, threadIdx.x == 0);
    }
    __device__ __forceinline__ void finish() const {}

  private:
    static __device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
        unsigned v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
        v = *reinterpret_cast<const volatile unsigned*>(p);
        __threadfence();
#endif
        return v;
    }
};

// ---- persistent blocks over many rows (norm_rows_pipe, any architecture) ---------
// A launch of `groups` x `parts` blocks, each holding one part (slice of
// columns) of the rows g, g + groups, ... of its group g. Parts publish a
// statistic S (a struct of float words) per row as tagged 64-bit words
// (value | 1 << 32) in a workspace zeroed before the launch:
//   work[0]                    ticket counter
//   work[1]                    set once any block gave up waiting
//   work[3]                    norm_rows_rescue's blocks that have ended
//   then [rows][parts][kPipeWords] tagged words (8-byte aligned)
//   then [groups][parts] u32   per block: 0, or 1 + the index (in its group's
//                              rows) of the first row it did not store
// A 64-bit aligned word is read or written whole (single-copy atomic), so a
// reader sees each word either unwritten (tag 0) or complete: no fence, no
// counter, and the words can be read ahead (`fetch`) and checked later
// (`collect`), so that the exchange's round trips through L2 overlap the
// next row's work instead of stalling the block. One lane of warp 0 per
// part: at most 32 parts. Tickets as in SplitGroup, and the wait bounded as
// there: a block that gave up (`quit`) stores no more rows but still
// publishes the statistics of all of its rows, and norm_rows_rescue stores
// the rows it left.
constexpr int kPipeWords = 3;

// The merge of part `lane`'s statistic (words `got`, lane < nparts) over
// warp 0 into lane 0, as PipeGroup::collect and norm_rows_rescue do it.
template <typename S> __device__ __forceinline__ S pipe_merge(const unsigned long long (&got)[kPipeWords], int nparts) {
    S acc = S::identity();
    if (threadIdx.x < static_cast<unsigned>(nparts))
        acc = from_words<S>([&](int i) { return static_cast<unsigned>(got[i]); });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = S::merge(acc, shfl_down(acc, o));
    return acc;
}

template <int TPB> struct PipeGroup {
    static constexpr bool kOnePart = false;
    static constexpr bool kStaged = true;  // rows come from shared memory (`staged`)
    static constexpr bool kCluster = false;
    static constexpr int tpr = TPB, group = 0, groups = 1;  // one group of TPB threads: the block
    int lane, nparts;
    unsigned rank;        // the part this block holds
    long long first;      // this block's group: rows first, first + stride, ...
    unsigned long long* words;
    const void* staged;   // the packs of the current row, in shared memory (RowView)
    unsigned long long got[kPipeWords];  // warp 0: lane l's read of part l's words
    bool quit;            // block-uniform: this block gave up waiting (stores no more rows)
    // (The workspace's address and the patience are not kept: kernel
    // parameters, read where needed, hold no registers across the row loop.)

    __device__ __forceinline__ PipeGroup(unsigned* work, int parts_)
        : lane(threadIdx.x), nparts(parts_), staged(nullptr), quit(false) {
        __shared__ unsigned ticket;
        if (threadIdx.x == 0) ticket = atomicAdd(work, 1u);
        __syncthreads();
        first = ticket / static_cast<unsigned>(nparts);
        rank = ticket % static_cast<unsigned>(nparts);
        words = reinterpret_cast<unsigned long long*>(work + 4);
    }
    __device__ __forceinline__ int parts() const { return nparts; }

    template <typename C, typename F> __device__ __forceinline__ C reduce(C v, F f, int slot) const {
        return group_reduce(v, f, slot, tpr, 0);
    }

    // Thread 0: this part's statistic of `row`.
    template <typename S> __device__ __forceinline__ void publish(long long row, const S& v) const {
        static_assert(sizeof(S) <= 4 * kPipeWords, "a statistic of at most kPipeWords 32-bit words");
        unsigned w[sizeof(S) / 4];
        memcpy(w, &v, sizeof(S));
        if (threadIdx.x == 0) {
            unsigned long long* slot = words + (row * nparts + rank) * kPipeWords;
#pragma unroll
            for (int i = 0; i < int(sizeof(S) / 4); ++i) store_relaxed(slot + i, (1ull << 32) | w[i]);
        }
    }
    // Warp 0: read part `lane`'s words of `row` (they may not be written yet).
    template <typename S> __device__ __forceinline__ void fetch(long long row) {
        if (threadIdx.x < static_cast<unsigned>(nparts)) {
            const unsigned long long* slot = words + (row * nparts + threadIdx.x) * kPipeWords;
#pragma unroll
            for (int i = 0; i < int(sizeof(S) / 4); ++i) got[i] = load_relaxed(slot + i);
        }
    }
    // Every thread: the parts' statistics of `row` (the `seq`-th of this
    // block's rows) merged (lane l holds part l; a shuffle tree into lane 0,
    // so that every block of the row gets the same bits), after `fetch(row)`
    // by warp 0; waits for parts not yet written, at most `patience` ns
    // (then, or once another block gave up, `quit`, and the result is not
    // to be stored). All threads must call it; `out` is a shared slot of the
    // block; `work` and `rows` as the launch's.
    template <typename S>
    __device__ __forceinline__ S collect(long long row, int seq, S& out, unsigned* work, long long rows,
                                         unsigned patience) {
        __shared__ bool left;
        if (quit) {  // the barrier still: group_reduce's slots are written again at the next row
            __syncthreads();
            return out;
        }
        if (threadIdx.x < 32) {
            auto ready = [&]() {
                bool ok = true;
                if (threadIdx.x < static_cast<unsigned>(nparts))
#pragma unroll
                    for (int i = 0; i < int(sizeof(S) / 4); ++i) ok = ok && (got[i] >> 32) != 0;
                return ok;
            };
            const bool gone = wait_bounded(
                patience, [&] { return __all_sync(0xffffffffu, ready()); }, [&] { fetch<S>(row); },
                [&](unsigned t0) {  // by lane 0, for the warp
                    return __shfl_sync(0xffffffffu,
                                       threadIdx.x == 0 && (gave_up(work) || global_ns() - t0 > patience), 0) != 0;
                });
            if (gone) {
                if (threadIdx.x == 0) {
                    unsigned* stops = reinterpret_cast<unsigned*>(words + rows * nparts * kPipeWords);
                    stops[first * nparts + rank] = static_cast<unsigned>(seq) + 1;
                    atomicExch(work + 1, 1u);
                }
            } else {
                const S acc = pipe_merge<S>(got, nparts);
                if (threadIdx.x == 0) out = acc;
            }
            if (threadIdx.x == 0) left = gone;
        }
        __syncthreads();
        // (read here, after the barrier, by every thread: the next write of
        // `left` comes after the next row's reduce, whose barrier follows it)
        quit = left;
        return out;
    }

  private:
    static __device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* p) {
        unsigned long long v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
#else
        v = *reinterpret_cast<const volatile unsigned long long*>(p);
#endif
        return v;
    }
    static __device__ __forceinline__ void store_relaxed(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
        *reinterpret_cast<volatile unsigned long long*>(p) = v;
#endif
    }
};

// Where a row's aligned window starts: `head` elements before the row.
template <typename T> __device__ __forceinline__ int row_head(const T* row) {
    return static_cast<int>((reinterpret_cast<unsigned long long>(row) & 15) / sizeof(T));
}

}  // namespace cufuse
