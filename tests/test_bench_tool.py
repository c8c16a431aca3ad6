"""cufuse.bench: the compare() utility and the report CLI (python -m cufuse.bench)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cufuse
from cufuse import bench


def _xy(n=4099, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


def test_compare_numpy_rows_speedups_errors():
    x, y = _xy()
    t = bench.compare({"ref": lambda a, b: np.exp((a + b) * 2), "same": lambda a, b: np.exp((a + b) * 2),
                       "wrong": lambda a, b: np.exp((a + b) * 2) * 1.5}, x, y, nbytes=3 * x.nbytes, repeats=5)
    assert [r["name"] for r in t.rows] == ["ref", "same", "wrong"]
    assert t["ref"]["speedup"] == pytest.approx(1.0)
    for r in t.rows:
        assert r["q1_us"] <= r["median_us"] <= r["q3_us"] and r["median_us"] > 0
        assert r["GBps"] == pytest.approx(3 * x.nbytes / (r["median_us"] * 1e-6) / 1e9)
        assert r["speedup"] == pytest.approx(r["median_us"] / t["ref"]["median_us"])  # > 1: ref is faster
    assert t["same"]["max_abs_err"] == 0.0 and t["same"]["max_rel_err"] == 0.0
    assert t["wrong"]["max_rel_err"] == pytest.approx(0.5, rel=1e-6)
    text = str(t)
    assert "wrong" in text and "GB/s" in text and "CPU" in text
    md = t.to_markdown()
    assert md.splitlines()[0].startswith("| impl |") and len(md.splitlines()) == 5


def test_compare_list_of_functions_and_cufuse_fallback():
    x, y = _xy(1000, 1)

    def chain(a, b):
        return np.maximum(a + b, 0)

    t = bench.compare([cufuse.add_relu, chain], x, y, repeats=3, warmup=1)
    assert [r["name"] for r in t.rows] == ["add_relu", "chain"]
    assert t["chain"]["max_abs_err"] == 0.0
    assert t["add_relu"]["GBps"] is None  # no nbytes given


def test_compare_errors():
    x, y = _xy(10)
    with pytest.raises(ValueError, match="no implementations"):
        bench.compare({}, x)
    with pytest.raises(TypeError, match="not callable"):
        bench.compare({"a": 3}, x)
    with pytest.raises(ValueError, match="repeats"):
        bench.compare({"a": np.negative}, x, repeats=0)


def test_compare_result_shape_mismatch_is_an_error_figure():
    x, _ = _xy(10)
    t = bench.compare({"a": lambda v: v * 2, "b": lambda v: v[:5] * 2}, x, repeats=2, warmup=0)
    assert t["b"]["max_abs_err"] == float("inf")


def test_compare_plot(tmp_path):
    pytest.importorskip("matplotlib")
    x, y = _xy(100)
    t = bench.compare({"a": np.add, "b": lambda a, b: a + b}, x, y, repeats=3, warmup=0)
    p = tmp_path / "c.png"
    t.plot(p)
    assert p.stat().st_size > 1000


SUMMARY = {
    "info": {"gpu": "Test GPU", "cupy": "14.2.0"},
    "copy": {"GBps": 4000.0},
    "bandwidth": [
        {"op": "add_mul_exp", "dtype": "float32", "n": 50_000_000, "impl": "cufuse", "gpu_us": 150.0,
         "host_us": 160.0, "GBps": 4000.0, "pct_of_copy": 100.0},
        {"op": "add_mul_exp", "dtype": "float32", "n": 50_000_000, "impl": "torch-eager", "gpu_us": 330.0,
         "host_us": 340.0, "GBps": 1818.0, "pct_of_copy": 45.5},
    ],
    "latency": [{"n": 100_000, "dtype": "float32", "us": {"bare RawKernel": 4.0, "add_mul_exp (cupy)": 6.0}}],
    "skipped": {"cupy.fuse": "why not"},
}


def test_cli_from_saved_summary(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SUMMARY))
    p = subprocess.run([sys.executable, "-m", "cufuse.bench", "--from", str(f)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "== add_mul_exp" in out and "3 kernels and 7 passes" in out and "cufuse 1 kernel and 3" in out
    assert "2.20x" in out  # torch eager µs / cufuse µs
    assert "100.0%" in out and "skipped peer cupy.fuse: why not" in out and "1.50x" in out


def _row(op, n, impl, gpu_us, dtype="float32", **kw):
    return {"op": op, "dtype": dtype, "n": n, "impl": impl, "gpu_us": gpu_us, "gpu_q1_us": gpu_us * 0.9,
            "gpu_q3_us": gpu_us * 1.1, "host_us": gpu_us, "GBps": 1.0, "pct_of_copy": 1.0, "regime": "L2", **kw}


def test_report_numpy_rows_and_device_sized_l2_rows():
    """NumPy CPU rows of norm ops and reductions, and "L2" rows whose n comes from
    the device's L2 (not a round number), group and sort by n like the others."""
    l2_n = 3_271_680   # bias_gelu float32 on a 50 MiB L2
    data = {"copy": {"GBps": 4000.0}, "bandwidth": [
        _row("layer_norm[4096x768]", 4096 * 768, "cufuse", 10.0),
        _row("layer_norm[4096x768]", 4096 * 768, "numpy (CPU)", 6000.0, timer="host"),
        _row("layer_norm[16384x1024]", 16384 * 1024, "cufuse", 30.0, regime="DRAM"),
        _row("sum_squared[axis0]", 818 * 8000, "cufuse", 8.0, size_id="L2"),
        _row("sum_squared[axis0]", 818 * 8000, "numpy (CPU)", 2700.0, size_id="L2", timer="host"),
        _row("sum_squared[axis0]", 50_000_000, "cufuse", 70.0, regime="DRAM"),
        _row("bias_gelu[none]", 50_000_000, "cufuse", 130.0, regime="DRAM"),
        _row("bias_gelu[none]", l2_n, "cufuse", 12.0, size_id="L2"),
        _row("bias_gelu[none]", l2_n, "torch-eager", 24.0, size_id="L2"),
        _row("bias_gelu[none]", 1_000_000, "numpy (CPU)", 9000.0, timer="host"),
        _row("bias_gelu[none]", 1_000_000, "cufuse", 6.0),
    ]}
    lines = bench.report(data)
    text = "\n".join(lines)
    assert "== layer_norm" in text and "== sum_squared[axis0]" in text and "== bias_gelu[none]" in text
    assert "600.00x" in text      # layer_norm numpy (CPU) µs / cufuse µs, same shape
    assert "337.50x" in text      # sum_squared "L2" numpy / cufuse, same n
    assert "1500.00x" in text and "2.00x" in text
    gelu = lines[lines.index("== bias_gelu[none]"):]
    sizes = [ln.split()[1] for ln in gelu[4:] if ln.startswith("float32")]
    assert sizes == ["1M", "1M", str(l2_n), str(l2_n), "50M"], sizes   # sorted by n, the device's n as is
    red = lines[lines.index("== sum_squared[axis0]"):]
    assert [ln.split()[1] for ln in red[4:7]] == ["6544K", "6544K", "50M"]


def test_report_log_softmax_and_cupy_fuse_rows():
    """log_softmax is its own group with its own memory-traffic line (not
    softmax's), and cupy.fuse rows (fused ops, reductions) sit beside the other
    peers with their speedup."""
    data = {"copy": {"GBps": 4000.0}, "bandwidth": [
        _row("softmax[4096x768]", 4096 * 768, "cufuse", 10.0),
        _row("log_softmax[4096x768]", 4096 * 768, "cufuse", 10.0),
        _row("log_softmax[4096x768]", 4096 * 768, "cupy-chain", 45.0),
        _row("log_softmax[4096x768]", 4096 * 768, "torch-eager", 12.5),
        _row("sum_squared[axis-1]", 50_000_000, "cufuse", 70.0, regime="DRAM"),
        _row("sum_squared[axis-1]", 50_000_000, "cupy.fuse", 105.0, regime="DRAM"),
        _row("quantize_int8[axis0]", 50_000_000, "cufuse", 100.0, regime="DRAM"),
        _row("quantize_int8[axis0]", 50_000_000, "cupy.fuse", 130.0, regime="DRAM"),
    ]}
    lines = bench.report(data)
    sm, lsm = lines.index("== softmax"), lines.index("== log_softmax")
    assert "divide" in lines[sm + 1] and "subtract" not in lines[sm + 1]
    assert lines[lsm + 1].startswith("memory traffic: CuPy max, x - m, exp, sum, log")
    assert "5 kernels and 8 passes over memory; cufuse 1 kernel and 2" in lines[lsm + 1]

    def rows(header):   # (impl, cufuse speedup) of a group's table
        i = lines.index(header) + 4
        j = lines.index("", i)
        return [(ln.split()[3], ln.split()[9]) for ln in lines[i:j]]

    assert rows("== log_softmax") == [("cufuse", "1.00x"), ("cupy-chain", "4.50x"), ("torch-eager", "1.25x")]
    assert rows("== sum_squared[axis-1]") == [("cufuse", "1.00x"), ("cupy.fuse", "1.50x")]
    assert rows("== quantize_int8[axis0]") == [("cufuse", "1.00x"), ("cupy.fuse", "1.30x")]


def test_cli_from_bad_file(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("[1, 2]")
    p = subprocess.run([sys.executable, "-m", "cufuse.bench", "--from", str(f)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "not a cufuse suite summary" in p.stderr


def test_cli_suite_without_gpu_says_so():
    """Without a GPU the suite is not started: the CLI says at once what it needs and what works."""
    env = dict(os.environ, CUFUSE_DISABLE_CUDA="1")
    p = subprocess.run([sys.executable, "-m", "cufuse.bench"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0
    assert "needs a CUDA GPU" in p.stderr and "--quick" in p.stderr and "--from" in p.stderr
    assert "suite" not in p.stdout and "running:" not in p.stderr


def test_cli_quick_without_gpu():
    env = dict(os.environ, CUFUSE_DISABLE_CUDA="1")
    p = subprocess.run([sys.executable, "-m", "cufuse.bench", "--quick"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("numpy chain") >= 4 and "== add_mul_exp" in p.stdout


@pytest.mark.cuda
def test_compare_gpu_cupy_and_torch():
    import cupy as cp
    x, y = (cp.asarray(v) for v in _xy(1 << 20, 3))
    impls = {"cufuse": cufuse.add_mul_exp, "cupy": lambda a, b: cp.exp((a + b) * 2)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        tx, ty = torch.from_dlpack(x), torch.from_dlpack(y)
        impls["torch"] = lambda a, b: torch.exp((tx + ty) * 2)
    t = bench.compare(impls, x, y, nbytes=3 * x.nbytes, repeats=10)
    assert "CUDA events" in t.method
    for r in t.rows:
        assert r["median_us"] > 0 and r["GBps"] > 0
        assert r["max_rel_err"] < 1e-5


# ------------------------------------------------------------ profile_model
def test_profile_model_rows_and_totals():
    torch = pytest.importorskip("torch")
    from cufuse.bench import profile_model

    class Twice(torch.nn.Module):  # one Linear called twice, and a GELU: calls are counted per module
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.act = torch.nn.GELU()

        def forward(self, x):
            return self.act(self.lin(self.lin(x)))
    model = torch.nn.Sequential(Twice(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 8)
    p = profile_model(model, x, steps=2)
    rows = {r["name"]: r for r in p.rows}
    assert set(rows) == {"", "0", "0.lin", "0.act", "1"}
    assert rows["0.lin"]["calls"] == 2 and rows["0.act"]["calls"] == 1 and rows[""]["type"] == "Sequential"
    assert rows["0"]["forward_ms"] <= rows[""]["forward_ms"] + 1e-9  # a child within its parent
    assert p.totals["backward_ms"] is None and p.totals["step_ms"] >= p.totals["forward_ms"]
    assert p.totals["peak_mib"] != p.totals["peak_mib"]  # NaN: not measured off the GPU
    assert "0.lin" in str(p) and "Linear" in str(p)
    t = profile_model(model, (x,), train=True, steps=1)
    assert t.totals["backward_ms"] is not None and t.totals["backward_ms"] > 0
    assert all(q.grad is None for q in model.parameters())  # the step leaves no gradients behind


def test_profile_model_hugging_face_training_step():
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from cufuse.bench import profile_model
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    ids = torch.randint(0, 50, (2, 6))
    p = profile_model(model, {"input_ids": ids, "labels": ids}, train=True, steps=1)
    names = [r["name"] for r in p.rows]
    assert "model.layers.0.mlp" in names and "model.norm" in names
    assert p.totals["backward_ms"] > 0


def test_profile_model_errors():
    torch = pytest.importorskip("torch")
    from cufuse.bench import profile_model
    with pytest.raises(TypeError, match="torch.nn.Module"):
        profile_model(lambda x: x, torch.ones(2))
    with pytest.raises(ValueError, match="steps"):
        profile_model(torch.nn.Linear(2, 2), torch.ones(2), steps=0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        profile_model(torch.nn.Linear(2, 2), torch.ones(2), warmup=-1)
    with pytest.raises(TypeError, match="warmup must be an int"):
        profile_model(torch.nn.Linear(2, 2), torch.ones(2), warmup=1.5)


@pytest.mark.parametrize("reentrant", [True, False])
def test_profile_model_checkpointed_dict_and_no_grad(reentrant):
    """Activation checkpointing's recompute is not a forward call (reentrant: counted twice; not
    reentrant: a crash); a dict output's "loss" is the loss, one without says to pass loss_fn; a
    training step under torch.no_grad() still steps."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint
    from cufuse.bench import profile_model

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(self.b, self.a(x).sin(), use_reentrant=reentrant)

    class Logits(torch.nn.Module):
        def __init__(self, with_loss):
            super().__init__()
            self.lin, self.with_loss = torch.nn.Linear(4, 4), with_loss

        def forward(self, x):
            y = self.lin(x)
            return {"loss": y.square().sum(), "logits": y} if self.with_loss else {"logits": y}

    prof = profile_model(M(), torch.randn(2, 4, requires_grad=True), train=True)
    assert {r["name"]: r["calls"] for r in prof.rows} == {"": 1, "a": 1, "b": 1}
    with torch.no_grad():
        assert profile_model(Logits(True), torch.randn(2, 4), train=True).rows[0]["calls"] == 1
    with pytest.raises(TypeError, match="without a 'loss'; pass loss_fn="):
        profile_model(Logits(False), torch.randn(2, 4), train=True)


def test_compare_errors_of_other_outputs():
    """Another number of outputs is an infinite error (zip dropped the extra one: 0); complex results
    compare their imaginary parts (dropped: 0); bfloat16 tensors and dicts of results compare."""
    x = np.linspace(-1, 1, 8)
    assert bench._errors((x, x), (x,))[0] == float("inf")
    assert bench._errors(x * 1j, x * -1j)[0] == 2.0
    assert bench._errors({"a": x, "b": x}, {"b": x, "a": x + 1})[0] == 1.0
    torch = pytest.importorskip("torch")
    assert bench._errors(torch.ones(3, dtype=torch.bfloat16), torch.ones(3)) == (0.0, 0.0)


@pytest.mark.cuda
def test_profile_model_peak_memory_on_the_gpu():
    """A module that allocates 64 MiB during its forward reports at least that
    as its peak, and so do its parent and the step; a sibling that allocates
    nothing reports about nothing."""
    torch = pytest.importorskip("torch")
    from cufuse.bench import profile_model

    class Big(torch.nn.Module):
        def forward(self, x):
            tmp = torch.empty(16 * 2 ** 20, device=x.device)  # 64 MiB, freed at the return
            return x + tmp[:1]

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Identity(), Big()), torch.nn.Identity()).cuda()
    p = profile_model(model, torch.ones(4, device="cuda"), steps=2)
    rows = {r["name"]: r for r in p.rows}
    assert rows["0.1"]["peak_mib"] >= 64 and rows["0"]["peak_mib"] >= 64 and p.totals["peak_mib"] >= 64
    assert rows["0.0"]["peak_mib"] < 1 and rows["1"]["peak_mib"] < 1
    assert p.device.startswith("NVIDIA") and rows["0.1"]["forward_ms"] > 0


def test_model_probe_variants_leave_transformers_as_they_found_it(monkeypatch):
    """bench/model_probe.py's run: a variant whose patch swaps the modeling module's classes and rope
    function (as Liger-Kernel's does) keeps its own rope for its steps, and models built after the run
    are transformers' own (a second dtype's base model was once made of Liger's modules)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import model_probe as MP
    finally:
        sys.path.pop(0)
    import transformers.models.llama.modeling_llama as L
    norm, rope = L.LlamaRMSNorm, L.apply_rotary_pos_emb
    monkeypatch.setattr(L, "LlamaRMSNorm", norm)  # put back after the test whatever run leaves
    monkeypatch.setattr(L, "apply_rotary_pos_emb", rope)
    seen = []

    class Swapped(norm):
        pass

    def swapped_rope(*a, **k):
        seen.append(1)
        return rope(*a, **k)

    def patching():
        m = T.LlamaForCausalLM(MP.config(True))
        L.LlamaRMSNorm, L.apply_rotary_pos_emb = Swapped, swapped_rope
        return m

    monkeypatch.setattr(MP, "variants", lambda base: {"eager": lambda: base, "patching": patching})
    torch.manual_seed(0)
    base = T.LlamaForCausalLM(MP.config(True))
    ids = torch.randint(0, 512, (1, 8))
    res = MP.run(base, ids, reps=1, rounds=1, log=print)
    assert set(res) == {"eager", "patching"} and seen  # the patching variant ran with its own rope
    assert all(r["issue_ms"] > 0 for r in res.values())  # (the host's time to queue a step)
    assert L.LlamaRMSNorm is norm and L.apply_rotary_pos_emb is rope
    assert type(T.LlamaForCausalLM(MP.config(True)).model.norm) is norm
