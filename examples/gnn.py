"""A message-passing graph network on a random graph: a few training steps,
torch eager against cufuse, printed side by side.

    python examples/gnn.py                     # GPU if there is one, else CPU (tiny sizes)
    python examples/gnn.py --dtype bfloat16 --steps 10

Each layer computes, for every edge (s -> d), a message from the two end
nodes' features (a gather by torch indexing and an edge MLP, a matmul), and
each node sums the activated messages of its incoming edges:

    m_e   = W_e [x_s, x_d] + b_e
    agg_d = sum over edges e into d of silu(m_e)          (cufuse.scatter_add: one kernel)
    x'    = rms_norm(x + W_n [x, agg])  with x' also the new residual
                                                           (cufuse.add_rms_norm: one kernel)

In eager torch the aggregation is silu then index_add (two kernels and one
edge-sized intermediate), the update an add and a norm. Both models start
from the same weights and see the same graph, so their losses agree to the
precision of the dtype. Needs torch only.
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import cufuse
import cufuse.nn
from _timing import timed  # examples/_timing.py, beside this script


class Layer(nn.Module):
    def __init__(self, dim, fused):
        super().__init__()
        self.edge = nn.Linear(2 * dim, dim)
        self.node = nn.Linear(2 * dim, dim)
        self.norm = (cufuse.nn.RMSNorm if fused else nn.RMSNorm)(dim, eps=1e-6)
        self.fused = fused

    def forward(self, x, src, dst):
        m = self.edge(torch.cat([x[src], x[dst]], -1))
        if self.fused:
            agg = cufuse.scatter_add(m, dst, x.shape[0], activation="silu")
            y, _ = self.norm.add_and_norm(self.node(torch.cat([x, agg], -1)), x)
            return y
        agg = torch.zeros_like(x).index_add(0, dst, nn.functional.silu(m))
        return self.norm(x + self.node(torch.cat([x, agg], -1)))


class Net(nn.Module):
    def __init__(self, dim, layers, classes, fused):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, fused) for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, x, src, dst):
        for layer in self.layers:
            x = layer(x, src, dst)
        return self.head(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--small", action="store_true", help="the CPU's tiny sizes on the GPU too")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and cufuse.CUDA_AVAILABLE else "cpu"
    small = device == "cpu" or a.small
    dtype = getattr(torch, a.dtype)
    nodes, edges, dim, layers, classes = (200, 1000, 32, 2, 5) if small else (100_000, 2_000_000, 128, 3, 16)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, nodes, (edges,), generator=g).to(device)
    dst = torch.randint(0, nodes, (edges,), generator=g).to(device)
    feats = torch.randn(nodes, dim, generator=g).to(device=device, dtype=dtype)
    labels = torch.randint(0, classes, (nodes,), generator=g).to(device)
    torch.manual_seed(1)
    eager = Net(dim, layers, classes, fused=False).to(device=device, dtype=dtype)
    ours = Net(dim, layers, classes, fused=True).to(device=device, dtype=dtype)
    ours.load_state_dict(copy.deepcopy(eager.state_dict()))
    print(f"device {device}, dtype {a.dtype}, {nodes} nodes, {edges} edges, {layers} layers x {dim}, "
          f"{a.steps} steps")
    print(f"{'run':7} {'ms/step':>9} {'edges/s':>12} {'first loss':>11} {'last loss':>10} {'peak MiB':>9}")
    for label, model in (("eager", eager), ("cufuse", ours)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses = []

        def step():
            loss = nn.functional.cross_entropy(model(feats, src, dst).float(), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, t = timed(step, a.steps, device)
        peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else float("nan")
        print(f"{label:7} {t * 1e3:9.2f} {edges / t:12.0f} {losses[0].item():11.4f} {losses[-1].item():10.4f} "
              f"{peak:9.0f}")


if __name__ == "__main__":
    main()
