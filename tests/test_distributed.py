"""cufuse inside a torch.distributed data-parallel training step: one process
per rank (gloo on CPU tensors, where the ops run their NumPy path; NCCL with
one process per GPU on a machine with 2 GPUs), DistributedDataParallel over a
small model built from cufuse's modules. The gradients every rank ends with
(all-reduced) equal those of one process over the whole batch, and a step
keeps the replicas equal."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2
BATCH, WIDTH = 8, 48


def _model(device):
    import cufuse.nn as cnn
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 96), cnn.LayerNorm(96), cnn.GELU(), torch.nn.Linear(96, 96), cnn.RMSNorm(96),
        cnn.SwiGLU(96, 64), torch.nn.Linear(96, 4)).to(device)


def _data(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * BATCH, WIDTH, generator=g, dtype=torch.float64).float()
    y = torch.randn(WORLD * BATCH, 4, generator=g, dtype=torch.float64).float()
    return x.to(device), y.to(device)


def _loss(model, x, y):
    import cufuse
    out = model(x)
    return cufuse.sum_squared(out - y, axis=None) / out.numel()


def _rank(rank, backend, init, outdir):
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=WORLD)
    try:
        model = _model(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if backend == "nccl" else None)
        x, y = _data(device)
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        # DDP averages over ranks; each rank's loss is the mean over its part
        _loss(ddp, x[part], y[part]).backward()
        grads = [p.grad.detach().cpu().double().numpy() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()
        params = [p.detach().cpu().double().numpy() for p in model.parameters()]
        np.savez(os.path.join(outdir, f"rank{rank}.npz"), *grads, *params)
    finally:
        dist.destroy_process_group()


def _run(backend, device):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        mp.spawn(_rank, args=(backend, init, d), nprocs=WORLD, join=True)
        ranks = [np.load(os.path.join(d, f"rank{r}.npz")) for r in range(WORLD)]
        ranks = [[f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))] for f in ranks]
    model = _model(device)
    x, y = _data(device)
    _loss(model, x, y).backward()
    want = [p.grad.detach().cpu().double().numpy() for p in model.parameters()]
    n = len(want)
    assert all(np.abs(w).max() > 0 for w in want)  # every parameter gets a gradient
    for r, got in enumerate(ranks):
        for k, (a, b) in enumerate(zip(got[:n], want)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=f"rank {r}, parameter {k}")
    for k in range(n, 2 * n):  # after the optimizer step the replicas are equal
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k])


def test_data_parallel_step_cpu_gloo():
    if not dist.is_gloo_available():
        pytest.skip("torch has no gloo backend")
    _run("gloo", "cpu")


@pytest.mark.cuda
def test_data_parallel_step_two_gpus_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not dist.is_nccl_available():
        pytest.skip("torch has no NCCL backend")
    _run("nccl", "cuda:0")
