"""Reverse-mode differentiation of a traced graph: the backward of a fused
function as ONE fused function (so one generated kernel per signature).

``backward_function(graph, wrt)`` returns a Python function of
``(g_0, ..., g_{k-1}, n, *args)``: the incoming gradient of each output
(reduced outputs' with the reduced axis kept, so that it broadcasts), the
length of the reduced last axis (for ``mean``), and the forward call's own
arguments. Traced by ``cufuse.fuse``, it copies the forward's nodes into its
own graph (the forward is recomputed in registers: nothing but the inputs is
saved) and then accumulates adjoints from the outputs back to the inputs,
returning the gradient of each argument position in ``wrt``, in that
argument's dtype and the broadcast shape of the call (the caller sums it
down to the argument's shape).

Operations without a derivative (comparisons, bitwise and integer
operations) pass no gradient, and rounding a zero gradient, as in torch (an
argument reached only through a comparison gets None, one through floor
zeros); ``max`` / ``min``
reductions are not differentiable here (``NotImplementedError``).
"""
from __future__ import annotations

import math

from . import functions as F
from . import graph as G

_NO_GRAD = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor", "invert", "floordiv"}
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _reached(graph, start):
    """The nodes that node ``start`` depends on through differentiable operations, itself included."""
    reached = {start}
    for i in range(start, -1, -1):
        if i not in reached:
            continue
        nd = graph.nodes[i]
        if nd.op in _NO_GRAD or not G.is_float(nd.dtype):
            continue
        args = nd.args[1:] if nd.op == "where" else nd.args  # not through the condition
        if nd.op == "cast":
            args = [a for a in args if G.is_float(graph.nodes[a].dtype)]
        reached.update(args)
    return reached


def differentiable_inputs(graph):
    """Argument positions of the float array inputs that some output depends
    on through differentiable operations. A max / min reduction of values
    that depend on none (a comparison's, constants') has no gradient to give;
    one of values that do raises NotImplementedError."""
    reached: set = set()
    for node, red, _, _ in graph.outputs:
        r = _reached(graph, node)
        if red in ("max", "min"):
            if _float_inputs(graph, r):
                raise NotImplementedError("cufuse.fuse: the gradient of a max / min reduction is not supported yet")
            continue
        reached |= r
    return _float_inputs(graph, reached)


def _float_inputs(graph, reached):
    return sorted(graph.inputs[nd.attr][0] for i, nd in enumerate(graph.nodes)
                  if nd.op == "input" and i in reached and G.is_float(nd.dtype))


def backward_function(graph, wrt):
    """The backward of ``graph`` for the argument positions ``wrt`` (see the module doc)."""
    nout = len(graph.outputs)

    def backward(*a):
        gs, n, args = a[:nout], a[nout], a[nout + 1:]
        g = G.tracing()
        vals = {}  # forward node id -> Traced in this graph
        for i, nd in enumerate(graph.nodes):
            if nd.op == "input":
                vals[i] = args[graph.inputs[nd.attr][0]]
            elif nd.op == "param":
                src, _ = graph.params[nd.attr]
                if src[0] == "host":  # the backward's arguments: the forward's after the gradients and n
                    src = ("host", src[1].shifted(nout + 1))
                vals[i] = args[src[1]] if src[0] == "arg" else G.param(g, src, nd.dtype, weak=False)
            else:
                ins = [vals[j] for j in nd.args]
                ndim = max((v.ndim for v in ins), default=0)
                vals[i] = G.Traced(g, g.add(nd.op, [v.node for v in ins], nd.dtype, nd.attr), nd.dtype, ndim=ndim)
        adj = {}

        def add(j, c):
            c = G.cast(c, graph.nodes[j].dtype) if c.dtype != graph.nodes[j].dtype else c
            adj[j] = c if j not in adj else adj[j] + c

        for (node, red, _, _), go in zip(graph.outputs, gs):
            if red not in ("max", "min"):  # (those depend on no input: differentiable_inputs)
                add(node, go / n if red == "mean" else go)
        for i in range(len(graph.nodes) - 1, -1, -1):
            gi = adj.get(i)
            nd = graph.nodes[i]
            if gi is None or nd.op in ("input", "param") or nd.op in _NO_GRAD:
                continue
            for j, c in _rule(nd, [vals[k] for k in nd.args], vals[i], gi):
                k = nd.args[j]
                if G.is_float(graph.nodes[k].dtype):
                    add(k, c)
        grads = []
        for pos in wrt:
            k = next(i for i, nd in enumerate(graph.nodes) if nd.op == "input" and graph.inputs[nd.attr][0] == pos)
            grads.append(adj[k])
        return tuple(grads) if len(grads) > 1 else grads[0]

    return backward


def _rule(nd, x, y, g):
    """(argument index, contribution) pairs of node ``nd`` with inputs ``x``,
    output ``y`` and adjoint ``g`` (Traced values)."""
    op = nd.op
    if op == "cast":
        return [(0, g)]
    if op == "add":
        return [(0, g), (1, g)]
    if op == "sub":
        return [(0, g), (1, -g)]
    if op == "mul":
        return [(0, g * x[1]), (1, g * x[0])]
    if op == "truediv":
        return [(0, g / x[1]), (1, -g * y / x[1])]
    if op == "mod":  # a - (a // b) b, the quotient the forward took (floor(a / b) rounds a / b first: 1 % 0.1)
        return [(0, g), (1, -g * (x[0] // x[1]))]
    if op == "pow":  # torch's masks: no base gradient where b == 0, no exponent gradient where a == 0 <= b
        a, b = x
        return [(0, F.where(b == 0, 0.0, g * b * a ** (b - 1))),
                (1, F.where((a == 0) & (b >= 0), 0.0, g * y * F.log(a)))]
    if op in ("minimum", "maximum"):  # torch's: half to each side at ties, and all to both at a NaN
        lose0 = x[0] > x[1] if op == "minimum" else x[0] < x[1]  # the first operand is not the result
        lose1 = x[0] < x[1] if op == "minimum" else x[0] > x[1]
        tie = x[0] == x[1]
        return [(0, F.where(tie, 0.5 * g, F.where(lose0, 0.0, g))),
                (1, F.where(tie, 0.5 * g, F.where(lose1, 0.0, g)))]
    if op == "clip_lo":  # maximum(x, lo) in clip: torch.clamp's x >= lo to x, x < lo to lo
        return [(0, F.where(x[0] >= x[1], g, 0.0)), (1, F.where(x[0] < x[1], g, 0.0))]
    if op == "clip_hi":  # minimum(m, hi) in clip: m <= hi to m, m > hi to hi
        return [(0, F.where(x[0] <= x[1], g, 0.0)), (1, F.where(x[0] > x[1], g, 0.0))]
    if op == "where":
        return [(1, F.where(x[0], g, 0.0)), (2, F.where(x[0], 0.0, g))]
    if op in ("round", "floor", "ceil"):  # torch's zeros (0 * g would be NaN where g is not finite)
        return [(0, F.where(g != g, 0.0, 0.0))]
    v = x[0]
    if op == "neg":
        return [(0, -g)]
    if op == "abs":
        return [(0, F.where(v > 0, g, F.where(v < 0, -g, 0.0)))]
    if op == "relu":  # torch's threshold_backward: g unless v <= 0 (a NaN passes it)
        return [(0, F.where(v <= 0, 0.0, g))]
    d = {
        "exp": lambda: y,
        "exp2": lambda: y * math.log(2.0),
        "log": lambda: 1.0 / v,
        "log1p": lambda: 1.0 / (v + 1.0),
        "expm1": lambda: y + 1.0,
        "sqrt": lambda: 0.5 / y,
        "rsqrt": lambda: -0.5 * y * y * y,
        "sin": lambda: F.cos(v),
        "cos": lambda: -F.sin(v),
        "tanh": lambda: 1.0 - y * y,
        "sigmoid": lambda: y * (1.0 - y),
        "erf": lambda: (2.0 / math.sqrt(math.pi)) * F.exp(-v * v),
        "gelu": lambda: 0.5 * (1.0 + F.erf(v * 0.7071067811865476)) + v * F.exp(-0.5 * v * v) * _INV_SQRT_2PI,
        "gelu_tanh": lambda: _dgelu_tanh(v),
        "silu": lambda: _dsilu(v),
        "softplus": lambda: F.sigmoid(v),
    }.get(op)
    if d is None:
        raise NotImplementedError(f"cufuse.fuse: no gradient for the operation {op!r}")
    return [(0, g * d())]


def _dgelu_tanh(v):
    t = F.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v * v * v))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v)


def _dsilu(v):
    s = F.sigmoid(v)
    return s * (1.0 + v * (1.0 - s))
