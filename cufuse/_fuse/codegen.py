"""A traced graph becomes one functor for the N-ary driver (kernels/elementwise.cuh).

The source depends only on the graph's structure and the input dtypes, never
on scalar values (those are kernel arguments), so equal structures share one
compiled module, in memory and on disk.
"""
from __future__ import annotations

import numpy as np

from . import graph as G

STORAGE = {"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "int32": "int",
           "int64": "long long", "uint64": "unsigned long long", "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
           "float64": "double"}
BLOCK = 256  # threads per block: the driver's __launch_bounds__


def storage(dt):
    return STORAGE[np.dtype(dt).name]


def compute(dt):
    return storage(G.compute_dtype(np.dtype(dt)))


_CALL = {  # ops written as a call on compute-typed operands ({T}: the node's storage type)
    "exp": "cufuse::math::exp", "exp2": "cufuse::math::exp2", "log": "cufuse::math::log",
    "log1p": "cufuse::math::log1p", "expm1": "cufuse::math::expm1", "sqrt": "cufuse::math::sqrt",
    "rsqrt": "cufuse::math::rsqrt", "sin": "cufuse::math::sin", "cos": "cufuse::math::cos",
    "tanh": "cufuse::math::tanh", "sigmoid": "cufuse::math::sigmoid", "erf": "cufuse::math::erf",
    "gelu": "cufuse::math::gelu_erf_to<{T}>",  # erf form, to the precision of its result (common.cuh)
    "gelu_tanh": "cufuse::math::gelu_tanh", "silu": "cufuse::math::silu",
    "softplus": "cufuse::math::softplus", "abs": "cufuse::math::abs", "relu": "cufuse::math::relu",
    "round": "cufuse::math::rint", "floor": "cufuse::math::floor", "ceil": "cufuse::math::ceil",
    "floordiv": "cufuse::math::floordiv", "mod": "cufuse::math::pymod", "pow": "cufuse::math::power",
    "minimum": "cufuse::math::minimum", "maximum": "cufuse::math::maximum",
    "clip_lo": "cufuse::math::maximum", "clip_hi": "cufuse::math::minimum",  # (graph.clip)
    # quantization's arithmetic (functions.QUANT_OPS): as NumPy's, subnormal operands and results kept
    "qdiv": "cufuse::math::divide", "qsub": "cufuse::math::sub_keep", "qmul": "cufuse::math::mul_keep",
}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "and": "&", "or": "|", "xor": "^",
          "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def _expr(g, i, node, names):
    a = [names[j] for j in node.args]
    c = compute(node.dtype)
    op = node.op
    if op == "input":
        return f"cufuse::to_compute<{c}>(a{node.attr}.v[j])"
    if op == "param":
        return f"static_cast<{c}>(s{node.attr})"
    if op == "cast":
        return f"cufuse::cast_to<{storage(node.attr)}>({a[0]})"
    if op in _INFIX:
        e = f"({a[0]} {_INFIX[op]} {a[1]})"
        return e if op in ("lt", "le", "gt", "ge", "eq", "ne") else f"static_cast<{c}>{e}"
    if op == "neg":
        return f"static_cast<{c}>(-{a[0]})"
    if op == "invert":
        return f"(!{a[0]})" if node.dtype == np.bool_ else f"static_cast<{c}>(~{a[0]})"
    if op == "where":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    if op in _CALL:
        return f"{_CALL[op].replace('{T}', storage(node.dtype))}({', '.join(a)})"
    raise AssertionError(f"no code for {op}")  # graph.py only makes the ops above


def _body(g, live, indent):
    """Lines computing every live node as ``v<i>`` (inside the per-element loop)."""
    names, lines = {}, []
    for i, node in enumerate(g.nodes):
        if i not in live:
            continue
        names[i] = f"v{i}"
        lines.append(f"{indent}const {compute(node.dtype)} v{i} = {_expr(g, i, node, names)};")
    return lines, names


def _live(g):
    live, stack = set(), [o[0] for o in g.outputs]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(g.nodes[n].args)
    return live


def pack_width(g, in_dtypes):
    """Elements per pack: one 16-byte store of the widest output (elementwise),
    or one 16-byte load of the widest input (reductions)."""
    if g.reduction:
        return 16 // max(np.dtype(d).itemsize for d in in_dtypes)
    return 16 // max(np.dtype(o[3]).itemsize for o in g.outputs)


_SHFL = {"float": "float", "double": "double", "long long": "long long", "unsigned long long": "unsigned long long"}


def _limits(kind, c):
    """Identity of max (kind "max") or min for compute type c."""
    if c in ("float", "double"):
        inf = "__int_as_float(0x7f800000)" if c == "float" else "__longlong_as_double(0x7ff0000000000000LL)"
        return f"-{inf}" if kind == "max" else inf
    if c == "bool":
        return "false" if kind == "max" else "true"
    lim = {"signed char": (-128, 127), "unsigned char": (0, 255), "short": (-32768, 32767),
           "int": (-2**31, 2**31 - 1), "long long": (-2**63, 2**63 - 1), "unsigned long long": (0, 2**64 - 1)}[c]
    v = lim[0] if kind == "max" else lim[1]
    if c == "long long" and v == -2**63:
        return "(-9223372036854775807LL - 1)"
    suffix = "ULL" if c == "unsigned long long" else ("LL" if c == "long long" else "")
    return f"static_cast<{c}>({v}{suffix})"


ENTRIES = ("fused_contig", "fused_strided", "fused_tiled", "fused_segments")  # elementwise; a reduction has fused_rows


def source(g, in_dtypes, entry=None):
    """CUDA source of the kernels for graph ``g`` with array inputs of ``in_dtypes``:
    every entry point, or only ``entry`` (each is compiled on its first use,
    so that a first call pays for one kernel, not four)."""
    nout, nin = len(g.outputs), len(in_dtypes)
    n = nout + nin
    V = pack_width(g, in_dtypes)
    out_st = [storage(o[3]) for o in g.outputs]
    in_st = [storage(d) for d in in_dtypes]
    live = _live(g)
    members = "".join(f"    {ck} s{k};\n" for k, (_, ck) in enumerate(g.params))
    loads = "".join(
        f"        const cufuse::Pack<{in_st[k]}, W> a{k} = cufuse::load_w<{in_st[k]}, W>(p[{nout + k}], "
        f"off[{nout + k}], bc[{nout + k}]);\n"
        for k in range(nin) if any(g.nodes[i].op == "input" and g.nodes[i].attr == k for i in live))
    body, names = _body(g, live, "            ")
    ops = [f"static_cast<const {t}*>(p[{k}])" for k, t in enumerate(out_st)]
    ops += [f"static_cast<const {t}*>(p[{nout + k}])" for k, t in enumerate(in_st)]
    types = out_st + in_st
    aligned = " &&\n               ".join(f"cufuse::is_aligned<{t}, V>({o})" for t, o in zip(types, ops))
    lines = [
        "// Generated by cufuse.fuse: one functor for the N-ary driver in elementwise.cuh.",
        '#include "elementwise.cuh"',
        "",
        "struct Fused {",
        f"    static constexpr int N = {n};",
        f"    static constexpr int V = {V};",
        members.rstrip("\n"),
        "    __device__ __forceinline__ bool aligned(void* const* p) const {",
        f"        return {aligned};",
        "    }",
    ]
    if not g.reduction:
        stores_decl = "".join(f"        cufuse::Pack<{t}, W> r{k};\n" for k, t in enumerate(out_st))
        stores = "".join(f"            r{k}.v[j] = cufuse::from_compute<{t}>({names[g.outputs[k][0]]});\n"
                         for k, t in enumerate(out_st))
        writes = "".join(f"        cufuse::store_w<{t}, W>(p[{k}], off[{k}], r{k});\n" for k, t in enumerate(out_st))
        lines += [
            "    template <int W>",
            "    __device__ __forceinline__ void apply(void* const* p, const long long (&off)[N], "
            "const bool (&bc)[N]) const {",
            loads + stores_decl.rstrip("\n"),
            "#pragma unroll",
            "        for (int j = 0; j < W; ++j) {",
            *body,
            stores.rstrip("\n"),
            "        }",
            writes.rstrip("\n"),
            "    }",
            "};",
        ]
    else:
        acc_t = [compute(o[3]) for o in g.outputs]
        fold, init, combs, shfl, fin = [], [], [], [], []
        for k, (node, kind, _, odt) in enumerate(g.outputs):
            c = acc_t[k]
            if kind in ("sum", "mean"):
                fold.append(f"acc.r{k} = static_cast<{c}>(acc.r{k} + {names[node]});")
                combs.append(f"a.r{k} = static_cast<{c}>(a.r{k} + b.r{k});")
                init.append(f"a.r{k} = static_cast<{c}>(0);")
            else:
                fn = "cufuse::math::maximum" if kind == "max" else "cufuse::math::minimum"
                fold.append(f"acc.r{k} = {fn}(acc.r{k}, {names[node]});")
                combs.append(f"a.r{k} = {fn}(a.r{k}, b.r{k});")
                init.append(f"a.r{k} = {_limits(kind, c)};")
            shfl.append(f"r.r{k} = static_cast<{c}>(__shfl_xor_sync(0xffffffffu, "
                        f"static_cast<{_SHFL.get(c, 'int')}>(a.r{k}), m));")
            val = f"acc.r{k}" if kind != "mean" else f"static_cast<{c}>(acc.r{k} / static_cast<{c}>(cols))"
            fin.append(f"static_cast<{out_st[k]}*>(p[{k}])[off[{k}]] = cufuse::from_compute<{out_st[k]}>({val});")
        fold = ["            " + x for x in fold]
        init, combs, shfl, fin = (["        " + x for x in xs] for xs in (init, combs, shfl, fin))
        lines += [
            "    struct Acc {",
            *[f"        {c} r{k};" for k, c in enumerate(acc_t)],
            "    };",
            "    __device__ __forceinline__ Acc init() const {",
            "        Acc a;",
            *init,
            "        return a;",
            "    }",
            "    __device__ __forceinline__ void combine(Acc& a, const Acc& b) const {",
            *combs,
            "    }",
            "    __device__ __forceinline__ Acc shfl(const Acc& a, int m) const {",
            "        Acc r;",
            *shfl,
            "        return r;",
            "    }",
            "    template <int W>",
            "    __device__ __forceinline__ void accumulate(Acc& acc, void* const* p, const long long (&off)[N], "
            "const bool (&bc)[N]) const {",
            loads.rstrip("\n"),
            "#pragma unroll",
            "        for (int j = 0; j < W; ++j) {",
            *body,
            *fold,
            "        }",
            "    }",
            "    __device__ __forceinline__ void finish(void* const* p, const long long (&off)[N], const Acc& acc, "
            "long long cols) const {",
            *fin,
            "    }",
            "};",
        ]
    ptrs = ", ".join([f"void* o{k}" for k in range(nout)] + [f"const void* i{k}" for k in range(nin)])
    plist = ", ".join([f"o{k}" for k in range(nout)] + [f"const_cast<void*>(i{k})" for k in range(nin)])
    sparams = "".join(f", {ck} s{k}" for k, (_, ck) in enumerate(g.params))
    sargs = ", ".join(f"s{k}" for k in range(len(g.params)))
    head = f'extern "C" __global__ void __launch_bounds__({BLOCK})'
    lines.append("")
    if not g.reduction:
        kernels = {
            "fused_contig": [
                f"{head} fused_contig({ptrs}, long long n{sparams}) {{",
                f"    void* p[{n}] = {{{plist}}};",
                f"    cufuse::run_fused(Fused{{{sargs}}}, p, n);",
                "}"],
            "fused_strided": [
                f"{head} fused_strided({ptrs}, long long n, cufuse::LayoutT<{n}> L{sparams}) {{",
                f"    void* p[{n}] = {{{plist}}};",
                f"    cufuse::run_fused_strided(Fused{{{sargs}}}, p, n, L);",
                "}"],
            "fused_tiled": [
                f"{head} fused_tiled({ptrs}, long long n, cufuse::LayoutT<{n}> L{sparams}) {{",
                f"    void* p[{n}] = {{{plist}}};",
                f"    cufuse::run_fused_tiled(Fused{{{sargs}}}, p, n, {nout}, L);",
                "}"],
            "fused_segments": [
                f"{head} fused_segments(const long long* table, int nseg, int upt{sparams}) {{",
                f"    cufuse::run_fused_segments(Fused{{{sargs}}}, table, nseg, upt);",
                "}"],
        }
        for name in ([entry] if entry else ENTRIES):
            lines += kernels[name]
    else:
        lines += [
            f"{head} fused_rows({ptrs}, long long rows, int tpr, cufuse::LayoutT<{n}> L{sparams}) {{",
            f"    void* p[{n}] = {{{plist}}};",
            f"    cufuse::run_fused_rows(Fused{{{sargs}}}, p, rows, tpr, L);",
            "}",
        ]
    return "\n".join(x for x in lines if x != "") + "\n"
