// cufuse: rotary position embedding of up to two tensors (q and k) in one
// launch. Each tensor is rows of d elements (rows indexed by up to three
// leading dims a, b, c with element strides; the row's elements contiguous);
// cos and sin are rows of r elements indexed by the same (a, b, c) through
// their own strides (0 on the dims they broadcast over: the heads). For each
// pair p < r/2 at positions (i, j) = (p, p + r/2), or (2p, 2p + 1) when
// interleaved:
//   forward   out_i = x_i c_i - x_j s_i,   out_j = x_j c_j + x_i s_j
//   backward  out_i = x_i c_i + x_j s_j,   out_j = x_j c_j - x_i s_i
// (the backward is the transposed rotation: x is the incoming gradient).
// Elements [r, d) are copied. out's rows have strides of their own (x's
// layout where x is dense, so that the result keeps it, else C order).
//
// A thread handles one unit of a row: N pairs (two packs of x, cos and sin
// in, two packs out) or N copied elements; N = 16 bytes of elements where
// every row start and the rotary halves are 16-byte aligned (vec), else 1.
#include "common.cuh"

namespace cufuse {

constexpr int kRopeThreads = 256;

template <int N, typename T, typename C> __device__ __forceinline__ void load_n(const T* p, C (&o)[N]) {
    if constexpr (N == 1) {
        o[0] = to_compute<C>(p[0]);
    } else {
        unpack(load_pack(reinterpret_cast<const Pack<T, N>*>(p)), o);
    }
}

template <int N, typename T, typename C> __device__ __forceinline__ void store_n(T* p, const C (&v)[N]) {
    if constexpr (N == 1) {
        p[0] = from_compute<T>(v[0]);
    } else {
        Pack<T, N> k;
#pragma unroll
        for (int i = 0; i < N; ++i) k.v[i] = from_compute<T>(v[i]);
        store_pack(reinterpret_cast<Pack<T, N>*>(p), k);
    }
}

// out_i, out_j of one pair from x_i, x_j, c_i, c_j, s_i, s_j
template <typename C> __device__ __forceinline__ void rotate_pair(C xi, C xj, C ci, C cj, C si, C sj, bool bwd,
                                                                  C& oi, C& oj) {
    if (bwd) {
        oi = xi * ci + xj * sj;
        oj = xj * cj - xi * si;
    } else {
        oi = xi * ci - xj * si;
        oj = xj * cj + xi * sj;
    }
}

// Unit u of a row: N pairs, or (u >= pairs / N) N copied elements.
template <int N, typename T>
__device__ __forceinline__ void rope_unit(T* o, const T* x, const T* c, const T* s, int u, int r, bool interleaved,
                                          bool bwd) {
    using C = compute_t<T>;
    const int pair_units = r / 2 / N;
    if (u >= pair_units) {  // the pass-through dims [r, d)
        const int e = r + (u - pair_units) * N;  // (d - r is whole packs where N > 1)
        C v[N];
        load_n<N>(x + e, v);
        store_n<N>(o + e, v);
        return;
    }
    if (interleaved) {  // 2N elements from 2u N: pairs (2p, 2p + 1) inside them
        const int e = 2 * u * N;
        C xa[N], xb[N], ca[N], cb[N], sa[N], sb[N], oa[N], ob[N];
        load_n<N>(x + e, xa);
        load_n<N>(c + e, ca);
        load_n<N>(s + e, sa);
        if constexpr (N == 1) {
            load_n<N>(x + e + 1, xb);
            load_n<N>(c + e + 1, cb);
            load_n<N>(s + e + 1, sb);
            rotate_pair(xa[0], xb[0], ca[0], cb[0], sa[0], sb[0], bwd, oa[0], ob[0]);
        } else {
            load_n<N>(x + e + N, xb);
            load_n<N>(c + e + N, cb);
            load_n<N>(s + e + N, sb);
            // element k of the 2N is a[k] (k < N) or b[k - N]; pair q is (2q, 2q + 1)
#pragma unroll
            for (int q = 0; q < N / 2; ++q) {
                rotate_pair(xa[2 * q], xa[2 * q + 1], ca[2 * q], ca[2 * q + 1], sa[2 * q], sa[2 * q + 1], bwd,
                            oa[2 * q], oa[2 * q + 1]);
                rotate_pair(xb[2 * q], xb[2 * q + 1], cb[2 * q], cb[2 * q + 1], sb[2 * q], sb[2 * q + 1], bwd,
                            ob[2 * q], ob[2 * q + 1]);
            }
        }
        if constexpr (N == 1) {
            store_n<N>(o + e, oa);
            store_n<N>(o + e + 1, ob);
        } else {
            store_n<N>(o + e, oa);
            store_n<N>(o + e + N, ob);
        }
        return;
    }
    const int i = u * N, j = i + r / 2;
    C xi[N], xj[N], ci[N], cj[N], si[N], sj[N], oi[N], oj[N];
    load_n<N>(x + i, xi);
    load_n<N>(x + j, xj);
    load_n<N>(c + i, ci);
    load_n<N>(c + j, cj);
    load_n<N>(s + i, si);
    load_n<N>(s + j, sj);
#pragma unroll
    for (int k = 0; k < N; ++k) rotate_pair(xi[k], xj[k], ci[k], cj[k], si[k], sj[k], bwd, oi[k], oj[k]);
    store_n<N>(o + i, oi);
    store_n<N>(o + j, oj);
}

// Row (a, b, c) of x, of the tables and of out at their own strides (out: x's
// layout, or C order).
template <int N, typename T>
__device__ __forceinline__ void rope_rows_of(T* out, const T* x, const T* cos, const T* sin, unsigned rows,
                                             unsigned nb, unsigned nc, long long xa, long long xb, long long xc,
                                             long long ca, long long cb, long long cc, long long oa, long long ob,
                                             long long oc, int r, int units, bool interleaved, bool bwd) {
    const unsigned step = gridDim.x * blockDim.y;
    for (unsigned row = blockIdx.x * blockDim.y + threadIdx.y; row < rows; row += step) {
        const unsigned c = row % nc, ab = row / nc, b = ab % nb, a = ab / nb;
        const long long xo = a * xa + b * xb + c * xc, co = a * ca + b * cb + c * cc, oo = a * oa + b * ob + c * oc;
        for (int u = threadIdx.x; u < units; u += blockDim.x)
            rope_unit<N>(out + oo, x + xo, cos + co, sin + co, u, r, interleaved, bwd);
    }
}

}  // namespace cufuse

// blockIdx.y picks the tensor: 0 (x0 -> out0) or 1 (x1 -> out1). vec0 / vec1:
// whether that tensor (with cos and sin) takes 16-byte packs.
template <typename T>
__global__ void __launch_bounds__(cufuse::kRopeThreads)
rope(T* out0, const T* x0, unsigned rows0, unsigned nb0, unsigned nc0, long long xa0, long long xb0, long long xc0,
     long long ca0, long long cb0, long long cc0, long long oa0, long long ob0, long long oc0, bool vec0,
     T* out1, const T* x1, unsigned rows1, unsigned nb1, unsigned nc1, long long xa1, long long xb1, long long xc1,
     long long ca1, long long cb1, long long cc1, long long oa1, long long ob1, long long oc1, bool vec1,
     const T* __restrict__ cos, const T* __restrict__ sin, int d, int r, bool interleaved, bool bwd) {
    using namespace cufuse;
    constexpr int V = 16 / sizeof(T);
    const bool second = blockIdx.y == 1;
    T* out = second ? out1 : out0;
    const T* x = second ? x1 : x0;
    const unsigned rows = second ? rows1 : rows0, nb = second ? nb1 : nb0, nc = second ? nc1 : nc0;
    const long long xa = second ? xa1 : xa0, xb = second ? xb1 : xb0, xc = second ? xc1 : xc0;
    const long long ca = second ? ca1 : ca0, cb = second ? cb1 : cb0, cc = second ? cc1 : cc0;
    const long long oa = second ? oa1 : oa0, ob = second ? ob1 : ob0, oc = second ? oc1 : oc0;
    if (second ? vec1 : vec0) {
        const int units = r / 2 / V + (d - r) / V;
        rope_rows_of<V>(out, x, cos, sin, rows, nb, nc, xa, xb, xc, ca, cb, cc, oa, ob, oc, r, units, interleaved,
                        bwd);
    } else {
        const int units = r / 2 + (d - r);
        rope_rows_of<1>(out, x, cos, sin, rows, nb, nc, xa, xb, xc, ca, cb, cc, oa, ob, oc, r, units, interleaved,
                        bwd);
    }
}
