// cufuse: row normalizations and softmax: layer_norm (+relu), rms_norm,
// softmax, log_softmax, over the last `cols` elements of each row.
//
// Each op is written once against a RowView: `reduce` of a function of
// every element of the part of the row a block holds, `combine` of the
// parts' statistics, and `store` of a function of every element. The view
// either holds the row in registers (NP packs per thread, loaded once; the
// model is QuACK's norms: read once, write once, staged reductions), one
// block's group, a cluster's blocks or split blocks sharing a row, or, for
// rows longer than all those hold, streams the row from memory again in
// every pass (correct at any length, slower). Statistics come from the held
// values in two passes (mean, then the sum of squared deviations), merged
// across parts by Chan's update, never from E[x^2] - E[x]^2.
#include "rows.cuh"

namespace cufuse {

// Whole (host-checked: cufuse/ops/norm.py): every row starts on a 16-byte
// boundary and is a whole number of packs, and y, w and b are aligned too, so
// that no pack is partial and no alignment is tested per pack.
// The weight and bias packs of the columns a block holds, kept in registers
// across rows (norm_rows_pipe: a block holds the same part of every row).
template <typename T, int NP> struct HeldColumns {
    typename PackOf<T>::type w[NP], b[NP];
};

template <typename T, int NP, typename G, bool Resident, bool Whole> struct RowView {
    using C = compute_t<T>;
    static constexpr int V = PackOf<T>::V;
    using P = typename PackOf<T>::type;
    // Held values are kept in the storage type (float16 takes half the
    // registers) and converted at each use; float/double ones may be
    // replaced by a pass (softmax keeps exp(x - max) for the store).
    static constexpr bool kMutable = Resident && !is_half<T>::value && !G::kStaged;
    static constexpr bool kOnePart = G::kOnePart;  // one block's group holds the whole row
    static constexpr bool kWhole = Whole;
    // Indices within the row: 32-bit for a row held in registers (at most
    // 512 x 16 packs per block, 8 blocks), 64-bit when it streams (any
    // length). 64-bit ones held the float16 layer_norm kernel at 63 registers.
    using I = typename select_type<Resident, int, long long>::type;

    const G& g;
    const T* x;           // the row
    I cols;
    int head;             // elements of the window before the row
    I lo, hi;             // this block's packs of the window: [lo, hi)
    P held[Resident && !G::kStaged ? NP : 1];
    // G::kStaged (norm_rows_pipe): the packs stay in shared memory (`stage`:
    // pack k at k - lo), read again at each pass, which keeps 16 registers
    // free for w and b: those come from `columns_held` (a copy: a pointer to
    // the kernel's registers put them in local memory).
    const P* stage = nullptr;
    struct NoColumns {};
    typename select_type<G::kStaged, HeldColumns<T, NP>, NoColumns>::type columns_held;

    __device__ __forceinline__ RowView(const G& g_, const T* x_, long long cols_, bool active)
        : g(g_), x(x_), cols(static_cast<I>(cols_)) {
        head = Whole ? 0 : row_head(x);
        const I npack = (head + cols + V - 1) / V;
        const I per = (npack + g.parts() - 1) / g.parts();
        lo = per * g.rank;
        hi = lo + per < npack ? lo + per : npack;
        if (!active) hi = lo;  // groups past the last row: no loads, no stores
        if constexpr (G::kStaged) {
            stage = static_cast<const P*>(g.staged);
        } else if constexpr (Resident) {
#pragma unroll
            for (int j = 0; j < NP; ++j) {
                const I k = lo + g.lane + static_cast<I>(j) * g.tpr;
                if (k < hi) held[j] = pack(k);
            }
            // A part of a row of whole packs (cluster and split kernels):
            // every load issued before the first use of any. The compiler
            // may otherwise sink a pack's load to its use in the first pass,
            // a round trip per pack (float16 softmax in the cluster kernel of
            // 256 threads: 8 of them, 77 -> 66% of copy; bench/NOTES.md).
            // Elsewhere not needed, and it cost registers
            // (float16 softmax norm_rows np 4: 32 -> 40).
            if constexpr (Whole && !G::kOnePart) {
#pragma unroll
                for (int j = 0; j < NP; ++j) opaque(held[j]);
            }
        }
    }

    // p as the result of an empty asm: computed (loaded) here, and not
    // recomputed or moved past this point by the compiler.
    static __device__ __forceinline__ void opaque(P& p) {
        unsigned u[sizeof(P) / 4];
        memcpy(u, &p, sizeof(P));
#pragma unroll
        for (int i = 0; i < int(sizeof(P) / 4); ++i) asm volatile("" : "+r"(u[i]));
        memcpy(&p, u, sizeof(P));
    }

    __device__ __forceinline__ P pack(I k) const { return *(reinterpret_cast<const P*>(x - head) + k); }
    // The j-th of this thread's packs (pack k) of a resident row.
    __device__ __forceinline__ P resident(int j, I k) const {
        if constexpr (G::kStaged)
            return stage[k - lo];
        else
            return held[j];
    }

    // f(value, element index) for each element of this thread's packs in the
    // row; with kMutable, f may update the held value (C&).
    template <typename F> __device__ __forceinline__ void each(F f) {
        if constexpr (Resident) {
            auto at = [&](int j, I k) {
                C t[V];
                unpack(resident(j, k), t);
                visit(k, t, f);
                if constexpr (kMutable) {
#pragma unroll
                    for (int i = 0; i < V; ++i) held[j].v[i] = t[i];
                }
            };
            auto tested = [&]() {
#pragma unroll
                for (int j = 0; j < NP; ++j) {
                    const I k = lo + g.lane + static_cast<I>(j) * g.tpr;
                    if (k < hi) at(j, k);
                }
            };
            // A cluster's or the pipe kernel's part of a row of whole packs
            // where every thread holds NP packs: the passes without a test
            // per pack (a branch around each, 4 instructions a pack and
            // pass). H200, same runs, two rounds, % of copy: float16
            // 1024x65536 (a cluster of 4) layer_norm 74.9-75.0 -> 76.7-76.8,
            // rms_norm 83.6-83.9 -> 84.4-84.8, softmax 78.6-79.1 -> 79.6-80.1;
            // float32 layer_norm (pipe; its 16 bytes of spills gone)
            // 256x262144 74.7-74.9 -> 78.0-79.6, 1024x65536 79.7-80.8 ->
            // 80.5-82.5. The store keeps its tests: without them too, float16
            // layer_norm spilled (bench/NOTES.md).
            if constexpr (Whole && (G::kCluster || G::kStaged)) {
                if (hi - lo == static_cast<I>(NP) * g.tpr) {
#pragma unroll
                    for (int j = 0; j < NP; ++j) at(j, lo + g.lane + static_cast<I>(j) * g.tpr);
                } else {
                    tested();
                }
            } else {
                tested();
            }
        } else {
            for (I k = lo + g.lane; k < hi; k += g.tpr) {
                C t[V];
                unpack(pack(k), t);
                visit(k, t, f);
            }
        }
    }

    template <typename F> __device__ __forceinline__ void visit(I k, C (&t)[V], F& f) const {
        const I e0 = k * V - head;
        if (Whole || (e0 >= 0 && e0 + V <= cols)) {
#pragma unroll
            for (int i = 0; i < V; ++i) f(t[i], e0 + i);
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i)
                if (e0 + i >= 0 && e0 + i < cols) f(t[i], e0 + i);
        }
    }

    // The reduction of f(value, element index) over this block's part of the
    // row (all of it for one group per row).
    template <typename R, typename F> __device__ __forceinline__ C reduce(F f, R r, int slot) {
        C acc = R::template identity<C>();
        each([&](C& t, I e) { acc = r(acc, f(t, e)); });
        return g.reduce(acc, r, slot);
    }
    // Elements of the row in this block's part.
    __device__ __forceinline__ C count() const {
        if (g.parts() == 1) return static_cast<C>(cols);
        auto clip = [&](I k) { const I e = k * V - head; return e < 0 ? I(0) : (e > cols ? cols : e); };
        return static_cast<C>(clip(hi) - clip(lo));
    }
    // The parts' statistics merged (Group::combine, SplitGroup::combine).
    template <typename S> __device__ __forceinline__ S combine(const S& v) const { return g.combine(v); }

    // Whether a per-column array (w, b) is tested for null at each pack
    // (kTested), known to be given (kGiven) or known to be null (kAbsent):
    // see store.
    enum Known { kTested, kGiven, kAbsent };

    // V values of a per-column array `a` (weight, bias) for the pack at e0:
    // one 16-byte load when the pack is whole and aligned in `a`, else per
    // element; `dflt` everywhere when a is null.
    template <Known K = kTested> __device__ __forceinline__ void columns(const T* a, I e0, C (&o)[V], C dflt) const {
        if (K == kAbsent || (K == kTested && !a)) {
#pragma unroll
            for (int i = 0; i < V; ++i) o[i] = dflt;
        } else if (Whole || (e0 >= 0 && e0 + V <= cols && (reinterpret_cast<unsigned long long>(a + e0) & 15) == 0)) {
            const P* p = reinterpret_cast<const P*>(a + e0);
            const P v = *p;  // one 16-byte load (unpack(*p, o) read it as V scalar loads)
            unpack(v, o);
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) o[i] = (e0 + i >= 0 && e0 + i < cols) ? to_compute<C>(a[e0 + i]) : dflt;
        }
    }

    // A held pack of w or b (`a` says whether there is one). The empty asm
    // keeps the conversion inside the row loop: converted once before it,
    // float16 packs would take twice the registers for the whole kernel.
    template <Known K = kTested>
    static __device__ __forceinline__ void held_column(const T* a, P p, C (&o)[V], C dflt) {
        if (K == kAbsent || (K == kTested && !a)) {
#pragma unroll
            for (int i = 0; i < V; ++i) o[i] = dflt;
        } else {
            opaque(p);
            unpack(p, o);
        }
    }

    // y[e] = f(value, w[e], b[e]) for every element (w, b may be null: 1 and
    // 0); full packs are stored whole when the output row has the input
    // row's alignment. w and b are plain loads: the read-only path
    // (ld.global.nc), once a gain, now costs layer_norm 1-2 points and cost
    // rms_norm more (bench/NOTES.md, "Figures from code comments").
    template <typename F> __device__ __forceinline__ void store(T* y, F f, const T* w, const T* b) {
        // Rows of whole packs: w and b tested once here rather than at every
        // pack (a test, a predicated load and V default moves per pack and
        // array). Other rows keep the tests: there, a copy of the loop per
        // case took registers (float16 norm_rows np 8: 77 -> 85); so does
        // norm_rows_pipe, whose float32 layer_norm it made slower (80.8 ->
        // 79.1% of copy at 1024x65536).
        if constexpr (Whole && !G::kStaged) {
            if (w && b) store_as<kGiven, kGiven>(y, f, w, b);
            else if (w) store_as<kGiven, kAbsent>(y, f, w, b);
            else store_as<kTested, kTested>(y, f, w, b);
        } else {
            store_as<kTested, kTested>(y, f, w, b);
        }
    }
    template <Known KW, Known KB, typename F>
    __device__ __forceinline__ void store_as(T* y, F f, const T* w, const T* b) {
        const int yhead = Whole ? 0 : row_head(y);
        auto one = [&](int j, I k, C (&t)[V]) {
            const I e0 = k * V - head;
            C wv[V], bv[V];
            if constexpr (G::kStaged) {
                held_column<KW>(w, columns_held.w[j], wv, C(1));
                held_column<KB>(b, columns_held.b[j], bv, C(0));
            } else {
                columns<KW>(w, e0, wv, C(1));
                columns<KB>(b, e0, bv, C(0));
            }
            if (Whole || (yhead == head && e0 >= 0 && e0 + V <= cols)) {
                P p;
#pragma unroll
                for (int i = 0; i < V; ++i) p.v[i] = from_compute<T>(f(t[i], wv[i], bv[i]));
                *(reinterpret_cast<P*>(y - head) + k) = p;
            } else {
#pragma unroll
                for (int i = 0; i < V; ++i)
                    if (e0 + i >= 0 && e0 + i < cols) y[e0 + i] = from_compute<T>(f(t[i], wv[i], bv[i]));
            }
        };
        if constexpr (Resident) {
#pragma unroll
            for (int j = 0; j < NP; ++j) {
                const I k = lo + g.lane + static_cast<I>(j) * g.tpr;
                if (k < hi) {
                    C t[V];
                    unpack(resident(j, k), t);
                    one(j, k, t);
                }
            }
        } else {
            for (I k = lo + g.lane; k < hi; k += g.tpr) {
                C t[V];
                unpack(pack(k), t);
                one(0, k, t);
            }
        }
    }
};

}  // namespace cufuse

// ---- the ops (global namespace: short name expressions) ------------------------
// Each is two steps on a RowView: `part(view)` reduces the part of the row
// the view holds into a statistic S (a struct of the compute type), and
// `finish(view, S, y, w, b, eps)` stores the row from the parts' merged S;
// `w`/`b` may be null (no affine part). A row may be split into parts
// (clusters, split and pipe kernels): one merge of S per row, so that a
// split row costs one exchange between blocks.
namespace cufuse {

// Products and sums rounded one by one, never contracted into an FMA: a
// merge computed as fma(a.n, a.mean, b.n * b.mean) differs from its mirror
// image in the last bit, and the threads of a row must agree bit for bit.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename C> struct Total {  // rms_norm: a sum
    C s;
    static __device__ __forceinline__ Total identity() { return {C(0)}; }
    static __device__ __forceinline__ Total merge(const Total& a, const Total& b) { return {a.s + b.s}; }
};

// layer_norm: count, mean and sum of squared deviations from the mean of a
// part, merged as Chan, Golub and LeVeque's pairwise update: no
// E[x^2] - E[x]^2 anywhere. One division a merge (1 / n, then products):
// H200, float16 256x262144 layer_norm (the split kernel, whose warp 0
// merges the parts in a shuffle tree) 64.8-65.1 -> 65.4-65.7% of copy, two
// same-run rounds; 1024x65536 (a cluster of 4) unchanged.
template <typename C> struct Moments {
    C n, mean, m2;
    static __device__ __forceinline__ Moments identity() { return {C(0), C(0), C(0)}; }
    static __device__ __forceinline__ Moments merge(const Moments& a, const Moments& b) {
        if (a.n == C(0)) return b;
        if (b.n == C(0)) return a;
        const C n = a.n + b.n;
        const C r = C(1) / n;
        const C d = b.mean - a.mean;  // squared below: the sign does not matter
        return {n, mul_rn(add_rn(mul_rn(a.n, a.mean), mul_rn(b.n, b.mean)), r),
                add_rn(add_rn(a.m2, b.m2), mul_rn(mul_rn(d, d), mul_rn(mul_rn(a.n, b.n), r)))};
    }
};

// softmax: a part's max m and sum of exp(x - m); a part of -inf only has
// m = -inf and s = 0 and adds nothing.
template <typename C> struct MaxSum {
    C m, s;
    static __device__ __forceinline__ MaxSum identity() { return {MaxOp::identity<C>(), C(0)}; }
    static __device__ __forceinline__ C scaled(const MaxSum& a, C m) {
        return a.m == MaxOp::identity<C>() ? C(0) : mul_rn(a.s, math::exp_fast(a.m - m));
    }
    static __device__ __forceinline__ MaxSum merge(const MaxSum& a, const MaxSum& b) {
        const C m = MaxOp{}(a.m, b.m);
        return {m, add_rn(scaled(a, m), scaled(b, m))};
    }
};

}  // namespace cufuse

template <bool Relu> struct LayerNorm {
    template <typename View> __device__ __forceinline__ static auto part(View& r) {
        using C = typename View::C;
        // The part's mean, then its squared deviations from it (two passes
        // over the held values); the parts are merged by Chan's update.
        const C n = r.count();
        const C s = r.reduce([](C t, long long) { return t; }, cufuse::SumOp{}, 0);
        const C mp = n > C(0) ? s / n : C(0);
        const C q = r.reduce([&](C t, long long) { const C d = t - mp; return d * d; }, cufuse::SumOp{}, 1);
        return cufuse::Moments<C>{n, mp, q};
    }
    template <typename View, typename S, typename T>
    __device__ __forceinline__ static void finish(View& r, const S& m, T* y, const T* w, const T* b, double eps) {
        using C = typename View::C;
        const C mean = m.mean;
        const C rstd = C(1) / cufuse::math::sqrt(m.m2 / m.n + static_cast<C>(eps));
        // float16 rows of whole packs: t * rstd - mean * rstd (one FMA, one
        // instruction less per element), whose extra rounding (|mean| rstd
        // 2^-24) float16 outputs do not see; float32 ones would, at x = 1000
        // + randn. (In the kernels for other rows it cost registers: 77 -> 85.)
        constexpr bool kFused = cufuse::is_half<T>::value && View::kWhole;
        const C mr = mean * rstd;
        r.store(y, [&](C t, C wv, C bv) {
            const C o = (kFused ? fma(t, rstd, -mr) : (t - mean) * rstd) * wv + bv;
            return Relu ? cufuse::math::relu(o) : o;
        }, w, b);
    }
};

struct RmsNorm {
    template <typename View> __device__ __forceinline__ static auto part(View& r) {
        using C = typename View::C;
        return cufuse::Total<C>{r.reduce([](C t, long long) { return t * t; }, cufuse::SumOp{}, 0)};
    }
    template <typename View, typename S, typename T>
    __device__ __forceinline__ static void finish(View& r, const S& ss, T* y, const T* w, const T*, double eps) {
        using C = typename View::C;
        const C rstd = C(1) / cufuse::math::sqrt(ss.s / static_cast<C>(r.cols) + static_cast<C>(eps));
        r.store(y, [&](C t, C wv, C) { return t * rstd * wv; }, w, static_cast<const T*>(nullptr));
    }
};

template <bool Log> struct Softmax {
    // A view with mutable held values keeps exp(t - base) for the store
    // (softmax only), when it holds the whole row (base is then the row's
    // max). A part of a split row recomputes exp(t - m) at the store
    // instead of scaling its kept exp(t - base) by exp(base - m): that
    // product can differ from exp(t - m) in the last bit, so that equal
    // inputs in two parts gave outputs an ulp apart.
    template <typename View> static constexpr bool keep = View::kMutable && !Log && View::kOnePart;

    template <typename View> __device__ __forceinline__ static auto part(View& r) {
        using C = typename View::C;
        const C mp = r.reduce([](C t, long long) { return t; }, cufuse::MaxOp{}, 0);
        // A part of -inf only: exp(x - 0) = 0, not exp(-inf + inf) = NaN.
        const C base = mp == cufuse::MaxOp::identity<C>() ? C(0) : mp;
        const C sp = r.reduce([&](C& t, long long) {
            const C p = cufuse::math::exp_fast(t - base);
            if (keep<View>) t = p;
            return p;
        }, cufuse::SumOp{}, 1);
        return cufuse::MaxSum<C>{mp, sp};
    }
    // `a`: the row's max and sum of exp(x - max); all -inf: max -inf, sum 0,
    // and every output NaN (as torch).
    template <typename View, typename S, typename T>
    __device__ __forceinline__ static void finish(View& r, const S& a, T* y, const T*, const T*, double) {
        using C = typename View::C;
        const C m = a.m;
        if constexpr (Log) {
            const C ls = cufuse::math::log(a.s);
            r.store(y, [&](C t, C, C) { return (t - m) - ls; }, static_cast<const T*>(nullptr),
                    static_cast<const T*>(nullptr));
        } else {
            const C inv = C(1) / a.s;  // kept values are exp(t - m): one part, base == m (or all -inf: NaN)
            r.store(y, [&](C t, C, C) { return (keep<View> ? t : cufuse::math::exp_fast(t - m)) * inv; },
                    static_cast<const T*>(nullptr), static_cast<const T*>(nullptr));
        }
    }
};

namespace cufuse {

template <typename Op, typename T, int NP, bool Resident, bool Whole, typename G>
__device__ __forceinline__ void norm_rows_body(const G& g, T* y, const T* x, const T* w, const T* b, long long rows,
                                               long long cols, long long ldy, long long ldx, double eps) {
    const long long row = g.item();
    const bool active = row < rows;
    const long long r = active ? row : 0;
    T* const yr = y + r * ldy;
    RowView<T, NP, G, Resident, Whole> view(g, x + r * ldx, cols, active);
    const auto stat = view.combine(Op::part(view));
    bool store = true;
    if constexpr (G::kMayQuit) store = !g.quit;  // else norm_rows_rescue stores this part (rows.cuh SplitGroup)
    if (store) Op::finish(view, stat, yr, w, b, eps);
    g.finish();
}

}  // namespace cufuse

// ---- kernel entry points --------------------------------------------------------
// norm_rows: a group of `tpr` threads per row, the row in registers (NP packs
// per thread). norm_rows_cluster: CS blocks of one cluster per row (sm_90).
// norm_rows_split: `parts` blocks per row that combine their reductions
// through the workspace `work` (rows.cuh: SplitGroup), the row in registers.
// norm_rows_stream: one block per row, any length, re-reading the row.
// norm_rows_pipe: persistent blocks, each holding one part of many rows
// (below).
template <typename Op, typename T, int NP, bool Whole>
__global__ void __launch_bounds__(512) norm_rows(T* y, const T* x, const T* w, const T* b, long long rows,
                                                 long long cols, long long ldy, long long ldx, int tpr, double eps) {
    cufuse::norm_rows_body<Op, T, NP, true, Whole>(cufuse::Group<1>(tpr), y, x, w, b, rows, cols, ldy, ldx, eps);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Blocks of norm_rows_cluster: kClusterThreads threads (the host launches
// that many: cufuse/ops/norm.py plan). For rows of whole packs the kernel
// takes the group size as a constant, so that the group's reductions unroll
// and a thread's packs sit at immediate offsets from one address, and its
// float16 / float32 forms are bounded to 64 registers, 4 blocks per SM
// (a staged variant, unbounded, took 76: 3 blocks), with the w and b
// tests out of the store loop (RowView::store) and the loads kept ahead
// (RowView): fewer instructions and 2-8 points of copy (bench/NOTES.md,
// "Figures from code comments"). Other rows keep the host's group size and
// the bounds they had (not measured).
constexpr int kClusterThreads = 256;
template <typename T, bool Whole> constexpr bool cluster_bounded() { return Whole && sizeof(T) <= 4; }
template <typename Op, typename T, int NP, int CS, bool Whole>
__global__ void __cluster_dims__(CS, 1, 1)
    __launch_bounds__(cluster_bounded<T, Whole>() ? kClusterThreads : 512, cluster_bounded<T, Whole>() ? 4 : 0)
    norm_rows_cluster(T* y, const T* x, const T* w, const T* b, long long rows, long long cols, long long ldy,
                      long long ldx, int tpr, double eps) {
    cufuse::norm_rows_body<Op, T, NP, true, Whole>(cufuse::Group<CS>(Whole ? kClusterThreads : tpr), y, x, w, b, rows,
                                                   cols, ldy, ldx, eps);
}
#endif

template <typename Op, typename T, int NP, bool Whole>
__global__ void __launch_bounds__(512) norm_rows_split(T* y, const T* x, const T* w, const T* b, long long rows,
                                                       long long cols, long long ldy, long long ldx, int parts,
                                                       double eps, unsigned* work, unsigned patience) {
    cufuse::norm_rows_body<Op, T, NP, true, Whole>(cufuse::SplitGroup(work, rows, parts, patience), y, x, w, b, rows,
                                                   cols, ldy, ldx, eps);
}

template <typename Op, typename T>
__global__ void __launch_bounds__(512) norm_rows_stream(T* y, const T* x, const T* w, const T* b, long long rows,
                                                        long long cols, long long ldy, long long ldx, int tpr,
                                                        double eps) {
    cufuse::norm_rows_body<Op, T, 1, false, false>(cufuse::Group<1>(tpr), y, x, w, b, rows, cols, ldy, ldx, eps);
}

// Long rows of whole, aligned packs (host-checked, as RowView's Whole), float
// compute (float16, float32): `groups` x `parts` persistent blocks of
// kPipeThreads; a block holds part `rank` of the rows first, first + groups,
// ... (rows.cuh: PipeGroup), so that its NP packs of w and b per thread are
// loaded once and kept in registers. Each row's packs stream into a ring of D
// slots of shared memory with cp.async, D - 2 rows ahead; the block reduces
// row i and publishes its statistic, then merges row i - 1's (published a
// row earlier, by every part) and stores row i - 1 from its slot, so that the
// exchange between blocks overlaps a row's work instead of stalling it.
// Faster than split rows for float32 layer_norm; waiting for the exchange in
// place, loading w and b at each row, or holding the row in registers (spills
// at the 64-register cap) were slower (bench/NOTES.md, "Figures from code
// comments").
constexpr int kPipeThreads = 512;

template <typename Op, typename T, int NP, int D>
__global__ void __launch_bounds__(kPipeThreads, 2)
    norm_rows_pipe(T* y, const T* x, const T* w, const T* b, long long rows, long long cols, long long ldy,
                   long long ldx, int parts, int groups, double eps, unsigned* work, unsigned patience) {
    using namespace cufuse;
    using View = RowView<T, NP, PipeGroup<kPipeThreads>, true, true>;
    using P = typename View::P;
    using S = decltype(Op::part(*static_cast<View*>(nullptr)));
    static_assert(D >= 3, "a slot being reduced, one being stored, one in flight at least");
    extern __shared__ __align__(16) unsigned char pipe_smem[];
    P* ring = reinterpret_cast<P*>(pipe_smem);  // [D][NP * kPipeThreads]: pack k of a row at k - lo
    __shared__ S merged;

    PipeGroup<kPipeThreads> g(work, parts);
    const long long first = g.first;
    const int nr = first < rows ? static_cast<int>((rows - 1 - first) / groups + 1) : 0;
    auto row_of = [&](int i) { return first + static_cast<long long>(i) * groups; };
    // This block's packs of a row: [lo, hi), as RowView computes them.
    const int npack = static_cast<int>(cols / View::V);
    const int per = (npack + parts - 1) / parts;
    const int lo = per * static_cast<int>(g.rank), hi = lo + per < npack ? lo + per : npack;

    HeldColumns<T, NP> held;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        const int k = lo + static_cast<int>(threadIdx.x) + j * kPipeThreads;
        if (k < hi) {
            if (w) held.w[j] = load_hinted<Hint::readonly>(reinterpret_cast<const P*>(w) + k);
            if (b) held.b[j] = load_hinted<Hint::readonly>(reinterpret_cast<const P*>(b) + k);
        }
    }
    // Row i's packs into slot i % D (one commit group per row, empty past the last).
    auto issue = [&](int i) {
        if (i < nr) {
            const P* src = reinterpret_cast<const P*>(x + row_of(i) * ldx);
            P* dst = ring + (i % D) * (NP * kPipeThreads);
#pragma unroll
            for (int j = 0; j < NP; ++j) {
                const int k = lo + static_cast<int>(threadIdx.x) + j * kPipeThreads;
                if (k < hi) copy_async_16(dst + (k - lo), src + k);
            }
        }
        commit_async();
    };
    auto view = [&](int i) {
        g.staged = ring + (i % D) * (NP * kPipeThreads);
        return View(g, x + row_of(i) * ldx, cols, true);
    };
#pragma unroll
    for (int i = 0; i < D; ++i) issue(i);
    // Before row i >= 1 is read, D + i - 1 commit groups were issued (D, then
    // one per stored row), row i's the (i + 1)-th: at most D - 2 in flight.
    for (int i = 0; i <= nr; ++i) {
        if (i >= 1 && threadIdx.x < 32) g.template fetch<S>(row_of(i - 1));
        if (i < nr) {
            wait_async<D - 2>();
            View v = view(i);
            g.publish(row_of(i), Op::part(v));
            // group_reduce's shared slots are written again at the next row:
            // every thread must have read them (from row 1 on, collect's
            // barrier does that)
            if (i == 0) __syncthreads();
        } else if (i >= 1) {
            // The last collect (no row published before it): every thread
            // must have read `merged` and the flag the collect before wrote
            // (elsewhere the reduce's barrier does that; racecheck)
            __syncthreads();
        }
        if (i >= 1) {
            // (once the block gave up it goes on publishing, and stores nothing)
            const S s = g.collect(row_of(i - 1), i - 1, merged, work, rows, patience);
            if (!g.quit) {
                View v = view(i - 1);  // every thread reads only the slots it copied: no barrier
                v.columns_held = held;
                Op::finish(v, s, y + row_of(i - 1) * ldy, w, b, eps);
            }
            issue(i - 1 + D);
        }
    }
    wait_async<0>();
}

// The launch after every norm_rows_split (Pipe false) or norm_rows_pipe (Pipe
// true) launch on the same stream, with the same arguments: where any block
// gave up waiting for the other parts of its row (rows.cuh SplitGroup,
// PipeGroup), stores the parts left (a part's x is read only by its block
// and here: intact in place too), from the statistics that every part
// published, merged in the same order as the blocks merge them. Then the
// first `zero_bytes` of the workspace are zeroed for the next launch on the
// stream (the host keeps one per stream, zeroed once): as a rule at once by
// every block, else by the last block to end (work[3] counts them).
struct RescueGroup {
    static constexpr bool kOnePart = false;
    static constexpr bool kStaged = false;
    static constexpr bool kCluster = false;
    int tpr, lane, nparts;
    unsigned rank;
    __device__ __forceinline__ int parts() const { return nparts; }
    template <typename C, typename F> __device__ __forceinline__ C reduce(C v, F f, int slot) const {
        return cufuse::group_reduce(v, f, slot, tpr, 0);  // (not called: the types of Op::part)
    }
};

template <typename Op, typename T, bool Whole, bool Pipe>
__global__ void __launch_bounds__(256)
    norm_rows_rescue(T* y, const T* x, const T* w, const T* b, long long rows, long long cols, long long ldy,
                     long long ldx, int parts, int groups, double eps, unsigned* work, long long zero_bytes) {
    using namespace cufuse;
    auto zero = [&](long long first, long long step) {
        uint4* p = reinterpret_cast<uint4*>(work);
        for (long long i = first; i < zero_bytes / 16; i += step) p[i] = make_uint4(0u, 0u, 0u, 0u);
    };
    __shared__ bool any_left;  // (read once per block: the last block below zeroes the flag too)
    if (threadIdx.x == 0) any_left = gave_up(work);
    __syncthreads();
    if (!any_left) {
        zero(static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x,
             static_cast<long long>(gridDim.x) * blockDim.x);
        return;
    }
    using View = RowView<T, 1, RescueGroup, false, Whole>;
    using S = decltype(Op::part(*static_cast<View*>(nullptr)));
    __shared__ S merged;
    __shared__ bool last;
    RescueGroup g{static_cast<int>(blockDim.x), static_cast<int>(threadIdx.x), parts, 0u};
    const SplitWork sw(work, rows, parts);
    const unsigned long long* words = reinterpret_cast<const unsigned long long*>(work + 4);
    const unsigned* stops = reinterpret_cast<const unsigned*>(words + rows * parts * kPipeWords);
    for (long long item = blockIdx.x; item < rows * parts; item += gridDim.x) {
        const long long row = item / parts;
        g.rank = static_cast<unsigned>(item % parts);
        bool left;
        if constexpr (Pipe) {
            const unsigned stop = stops[(row % groups) * parts + g.rank];
            left = stop != 0 && row / groups >= stop - 1;
        } else {
            left = sw.marks[item] != 0;
        }
        if (!left) continue;  // the same for every thread of the block
        if (threadIdx.x < 32) {
            S acc;
            if constexpr (Pipe) {
                unsigned long long got[kPipeWords] = {};
                if (threadIdx.x < static_cast<unsigned>(parts))
#pragma unroll
                    for (int i = 0; i < int(sizeof(S) / 4); ++i)
                        got[i] = words[(row * parts + threadIdx.x) * kPipeWords + i];
                acc = pipe_merge<S>(got, parts);
            } else {
                acc = sw.merged<S>(row, parts);
            }
            if (threadIdx.x == 0) merged = acc;
        }
        __syncthreads();
        View v(g, x + row * ldx, cols, true);
        Op::finish(v, merged, y + row * ldy, w, b, eps);
        __syncthreads();  // `merged` is written again at the next item
    }
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(work + 3, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        zero(threadIdx.x, blockDim.x);
    }
}
