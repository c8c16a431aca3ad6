"""cufuse.patch on Hugging Face transformers models built from small random
configs: what it replaces, state_dict unchanged (the same Parameter
objects), outputs and gradients equal to the unpatched model's (float64 on
the CPU; float32 on the GPU with tests/test_autograd.py's TOL), and clear
errors. Skipped without transformers (not a test dependency)."""
from __future__ import annotations

import copy
import inspect
import io
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

import cufuse  # noqa: E402

from test_autograd import TOL  # noqa: E402
from _reference import example_rows  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
_LLAMA_KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
_ENC_KW = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


_LOSS = "ForCausalLMLoss -> cufuse.cross_entropy"
_HEAD = "Linear + ForCausalLMLoss -> cufuse.linear_cross_entropy"
_ROPE = "apply_rotary_pos_emb -> cufuse.rope"
_ROPE_MODULES = [T.models.llama.modeling_llama, T.models.mistral.modeling_mistral, T.models.qwen2.modeling_qwen2]


@pytest.fixture(autouse=True)
def _original_rotary():
    """cufuse.patch replaces a modeling module's apply_rotary_pos_emb (a
    module function): each test starts from, and leaves, transformers' own."""
    saved = [m.apply_rotary_pos_emb for m in _ROPE_MODULES]
    yield saved
    for m, fn in zip(_ROPE_MODULES, saved):
        m.apply_rotary_pos_emb = fn


def _text(batch=2, n=9):
    return {"input_ids": torch.randint(0, 100, (batch, n), generator=torch.Generator().manual_seed(1))}


# family -> (model factory, inputs factory, expected replacements)
MODELS = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_LLAMA_KW)), _text,
              {"LlamaMLP -> SwiGLU": 2, "LlamaRMSNorm -> RMSNorm": 5, _ROPE: 1, _LOSS: 1, _HEAD: 1}),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**_LLAMA_KW)), _text,
                {"MistralMLP -> SwiGLU": 2, "MistralRMSNorm -> RMSNorm": 5, _ROPE: 1, _LOSS: 1, _HEAD: 1}),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_LLAMA_KW)), _text,
              {"Qwen2MLP -> SwiGLU": 2, "Qwen2RMSNorm -> RMSNorm": 5, _ROPE: 1, _LOSS: 1, _HEAD: 1}),
    "llama_geglu": (lambda: T.LlamaForCausalLM(T.LlamaConfig(hidden_act="gelu_pytorch_tanh", **_LLAMA_KW)), _text,
                    {"LlamaMLP -> SwiGLU": 2, "LlamaRMSNorm -> RMSNorm": 5, _ROPE: 1, _LOSS: 1, _HEAD: 1}),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32,
                                                    bos_token_id=0, eos_token_id=0)), _text,
             {"LayerNorm -> LayerNorm": 5, "NewGELUActivation -> GELU": 2, _LOSS: 1, _HEAD: 1}),
    "bert": (lambda: T.BertModel(T.BertConfig(vocab_size=100, **_ENC_KW)), _text,
             {"LayerNorm -> LayerNorm": 5, "GELUActivation -> GELU": 2}),
    "vit": (lambda: T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, **_ENC_KW)),
            lambda: {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))},
            {"LayerNorm -> LayerNorm": 5, "GELUActivation -> GELU": 2}),
}


def _main(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(MODELS))
def test_patch_matches_the_model(family, device):
    make, inputs, expected = MODELS[family]
    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = make().to(device=device, dtype=dtype).train()
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = cufuse.patch(model)
    assert report.counts() == expected, str(report)
    assert report.skipped == []
    # state_dict: the same keys, tensors and Parameter objects
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert all(p is params[k] for k, p in model.named_parameters())
    model.eval()
    ref.eval()
    x = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs().items()}
    y, y_ref = _main(model(**x)), _main(ref(**x))
    # HF's RMSNorm computes in float32 even for float64 models: the Llama family differs by that
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float64 else (TOL[dtype][0] * 10, TOL[dtype][1] * 10)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    y.float().square().mean().backward()
    y_ref.float().square().mean().backward()
    for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, k
            continue
        s = max(1.0, float(q.grad.abs().max()))
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol * 10, atol=atol * 10 * s, msg=f"{family}: {k}")


def test_patch_errors_and_what_it_leaves():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cufuse.patch({"not": "a model"})
    with pytest.raises(ValueError, match="nothing was changed"):
        cufuse.patch(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    with pytest.raises(ValueError, match="the model itself is a LayerNorm, which patch replaces only inside"):
        cufuse.patch(torch.nn.LayerNorm(6))
    with pytest.raises(ValueError, match=r"nothing was changed; 0 stays: an RMSNorm that computes otherwise"):
        cufuse.patch(torch.nn.Sequential(_OffsetRMSNorm(8)))
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_act="relu", **_LLAMA_KW))
    report = cufuse.patch(model)  # the norms and the rest; the ReLU-gated MLPs stay (with why)
    assert report.counts() == {"LlamaRMSNorm -> RMSNorm": 5, _ROPE: 1, _LOSS: 1, _HEAD: 1}
    assert [n for n, _ in report.skipped] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "not SiLU or GELU" in report.skipped[0][1] and "left alone" in str(report)
    with pytest.raises(ValueError, match="nothing was changed"):  # patched already: nothing left to do
        cufuse.patch(model)
    # a second model of the module: its rotary embedding runs through cufuse.rope too, and says so
    twin = T.LlamaForCausalLM(T.LlamaConfig(hidden_act="relu", **_LLAMA_KW))
    assert cufuse.patch(twin).counts() == report.counts()


class _InterleavedRope(torch.nn.Module):
    """A model whose modeling module defines apply_rotary_pos_emb and
    rotate_half with GPT-J's interleaved pairs (as Cohere's, GLM's and
    others do), and an RMSNorm that casts back to its input's dtype (as
    Olmo2's, Helium's)."""

    def __init__(self):
        super().__init__()
        self.norm = _CastBackRMSNorm(8)

    def forward(self, q, k, cos, sin):
        return self.norm(sys.modules[__name__].apply_rotary_pos_emb(q, k, cos, sin)[0])


class _CastBackRMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class _ClampedMLP(torch.nn.Module):
    """A gated MLP by Llama's names whose forward clamps (as DeepseekV4's)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(16, 8, bias=False), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=0.1) * self.up_proj(x))


class _MergerMLP(_ClampedMLP):
    """Llama's names and forward plus a part of its own (as GLM-4V's patch merger's norm)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(self.proj(x))) * self.up_proj(x))


def test_patch_checks_what_it_replaces(_original_rotary):
    """What only looks like Llama's stays: a modeling module's
    apply_rotary_pos_emb that rotates otherwise (interleaved pairs: the
    process's other models keep theirs too), gated MLPs that compute more;
    an RMSNorm that casts back to its input's dtype keeps doing so; hooks go
    with the module; a second patch says the model is patched already."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    f = torch.randn(1, 5, 4, generator=g).repeat_interleave(2, -1)
    model = _InterleavedRope()
    want = model(q, k, f.cos(), f.sin())
    report = cufuse.patch(model)
    assert sys.modules[__name__].apply_rotary_pos_emb is apply_rotary_pos_emb
    assert any(n.endswith("apply_rotary_pos_emb") and "differs from Llama" in why for n, why in report.skipped)
    torch.testing.assert_close(model(q, k, f.cos(), f.sin()), want, rtol=1e-5, atol=1e-5)
    assert report.counts() == {"_CastBackRMSNorm -> RMSNorm": 1}, str(report)
    assert model.norm(q.bfloat16()).dtype == torch.bfloat16  # (a float32 weight: torch would promote)
    for mlp in (_ClampedMLP(), _MergerMLP()):
        seq = torch.nn.Sequential(mlp, torch.nn.LayerNorm(8))
        x = torch.randn(3, 8, generator=g)
        want, keys = seq(x), set(seq.state_dict())
        calls = []
        handle = seq[1].register_forward_hook(lambda mod, i, o: calls.append(type(mod).__name__))
        report = cufuse.patch(seq)
        assert report.counts() == {"LayerNorm -> LayerNorm": 1}, str(report)
        assert "computes more" in report.skipped[0][1]
        assert seq[0] is mlp and set(seq.state_dict()) == keys
        torch.testing.assert_close(seq(x), want, rtol=1e-5, atol=1e-5)
        assert calls == ["LayerNorm"]  # the hook came along, and its handle still removes it
        handle.remove()
        seq(x)
        assert calls == ["LayerNorm"]
        with pytest.raises(ValueError, match="patched already"):
            cufuse.patch(seq)


class _OffsetRMSNorm(_CastBackRMSNorm):
    """Gemma's form, (1 + weight) * xhat: not Llama's, so it stays."""

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight) * h).to(x.dtype)


def test_patch_checks_norms_built_on_the_meta_device():
    """A model built without memory (init_empty_weights, FSDP) is checked as one built on the CPU
    (on a CPU twin of each norm): Gemma's (1 + weight) norm stays, a cast-back norm keeps casting;
    the patched norm's variance_epsilon is the eps it computes with."""
    with torch.device("meta"):
        off = torch.nn.Sequential(_OffsetRMSNorm(8), torch.nn.GELU())
        cast = torch.nn.Sequential(_CastBackRMSNorm(8), torch.nn.GELU())
    report = cufuse.patch(off)
    assert type(off[0]) is _OffsetRMSNorm and "computes otherwise" in report.skipped[0][1], str(report)
    cufuse.patch(cast)
    assert type(cast[0]).__name__ == "RMSNorm" and cast[0].input_dtype
    cast.to_empty(device="cpu")
    with torch.no_grad():
        cast[0].weight.copy_(torch.linspace(0.5, 1.5, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    assert cast(x.bfloat16()).dtype == torch.bfloat16
    ref = _CastBackRMSNorm(8)
    for eps in (1e-6, 10.0):
        ref.variance_epsilon = cast[0].variance_epsilon = eps
        assert cast[0].eps == eps
        torch.testing.assert_close(cast[0](x), ref(x), rtol=1e-5, atol=1e-6)


def test_patched_mlp_takes_a_new_act_fn():
    """A gated MLP's act_fn set after the patch is the one the fused gate computes (it was a new child
    module that nothing called); one cufuse has no gate for raises."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**_LLAMA_KW)).eval()
    ref = T.LlamaForCausalLM(T.LlamaConfig(**_LLAMA_KW)).eval()
    ref.load_state_dict(model.state_dict())
    cufuse.patch(model)
    mlp, rmlp = model.model.layers[0].mlp, ref.model.layers[0].mlp
    assert type(mlp.act_fn) is type(rmlp.act_fn)
    x = torch.randn(2, 5, mlp.hidden_size, generator=torch.Generator().manual_seed(1))
    for act in (torch.nn.GELU(), torch.nn.GELU("tanh"), torch.nn.SiLU()):
        mlp.act_fn, rmlp.act_fn = act, act
        assert mlp.act_fn is act
        torch.testing.assert_close(mlp(x), rmlp(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="computes SiLU or GELU gates; act_fn ReLU"):
        mlp.act_fn = torch.nn.ReLU()
    assert set(model.state_dict()) == set(ref.state_dict())


def test_transformer_integration_example():
    """examples/transformer_integration.py at its tiny sizes: eager and
    cufuse start from the same weights and batches, so their losses agree."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "transformer_integration.py"), "--steps", "2",
                        "--small"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["llama"], ["gpt2"])]
    assert [row[:2] for row in rows] == [["llama", "eager"], ["llama", "cufuse"], ["gpt2", "eager"], ["gpt2", "cufuse"]]
    for eager, ours in (rows[0:2], rows[2:4]):
        assert abs(float(eager[2]) - float(ours[2])) < 1e-3 and abs(float(eager[3]) - float(ours[3])) < 1e-3, rows


def test_vit_example():
    """examples/vit.py at its tiny sizes: eager and cufuse give the same
    logits (to float32 rounding) and the same training losses."""
    rows, stdout = example_rows("vit.py", "--steps", "2", "--small")
    eager, ours = rows["eager"], rows["cufuse"]
    assert abs(float(eager[3]) - float(ours[3])) < 1e-3 and abs(float(eager[4]) - float(ours[4])) < 1e-3, rows
    assert float(ours[6]) < 1e-3, rows
    assert "LayerNorm -> LayerNorm" in stdout


def _same_gradients(loss, ref_loss, model, ref, tol, family):
    """Back-propagates both losses; every parameter's gradient agrees; both models' gradients cleared."""
    loss.backward()
    ref_loss.backward()
    for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=f"{family}: {k}")
    model.zero_grad()
    ref.zero_grad()


def _patched_pair(family, device, train):
    """(a patched causal LM of ``family``, its unpatched twin, input ids,
    labels with one ignored, rtol): float64 on the CPU, float32 on the GPU;
    in eval mode, or in training mode with dropout off (gradients flow in both)."""
    make, inputs, _ = MODELS[family]
    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = make().to(device=device, dtype=dtype).train(train)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = copy.deepcopy(model)
    cufuse.patch(model)
    ids = inputs()["input_ids"].to(device)
    labels = ids.clone()
    labels[0, 3] = -100
    return model, ref, ids, labels, 1e-6 if dtype == torch.float64 else 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patched_causal_lm_loss(family, device):
    """The causal-LM loss through cufuse.cross_entropy: the same loss and
    gradients as transformers' own, with and without num_items_in_batch."""
    model, ref, ids, labels, rtol = _patched_pair(family, device, train=False)
    for extra in ({}, {"num_items_in_batch": torch.tensor(11, device=device)}):
        a, b = model(input_ids=ids, labels=labels, **extra), ref(input_ids=ids, labels=labels, **extra)
        assert a.loss.dtype == b.loss.dtype
        torch.testing.assert_close(a.loss, b.loss, rtol=rtol, atol=rtol)
        _same_gradients(a.loss, b.loss, model, ref, rtol * 10, family)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patched_training_loss_skips_the_logits(family, device):
    """In training with labels the patched causal LM's head and loss are one
    linear_cross_entropy: the same loss and gradients as transformers' own
    (with and without num_items_in_batch, return_dict=False too), no logits
    in the output; a deepcopy keeps the patch on its own weights; eval mode,
    no labels and linear_loss=False give the logits as before."""
    model, ref, ids, labels, rtol = _patched_pair(family, device, train=True)
    make, dtype = MODELS[family][0], next(model.parameters()).dtype
    for extra in ({}, {"num_items_in_batch": torch.tensor(11, device=device)}, {"return_dict": False}):
        a, b = model(input_ids=ids, labels=labels, **extra), ref(input_ids=ids, labels=labels, **extra)
        if extra.get("return_dict") is False:
            assert len(a) == len(b) - 1  # (loss, logits, cache) without the logits
            la, lb = a[0], b[0]
        else:
            assert a.logits is None and "logits" not in a
            assert b.logits is not None  # the class's forward is wrapped: an unpatched model is untouched
            la, lb = a.loss, b.loss
        torch.testing.assert_close(la, lb, rtol=rtol, atol=rtol)
        _same_gradients(la, lb, model, ref, rtol * 10, family)
    # the forward's signature is the model's (Trainer and generate read it); a pickled model keeps the patch
    assert list(inspect.signature(model.forward).parameters)[:1] == ["input_ids"]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out = loaded(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=labels).loss, rtol=rtol, atol=rtol)
    with torch.autocast(device, dtype=torch.bfloat16):  # autocast: the model's own path (logits made)
        assert model(input_ids=ids, labels=labels).logits is not None
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss,
                               rtol=rtol, atol=rtol)
    assert not torch.allclose(twin(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)
    assert model(input_ids=ids).logits.shape == (*ids.shape, 100)
    model.eval()
    assert model(input_ids=ids, labels=labels).logits.shape == (*ids.shape, 100)
    keep = make().to(device=device, dtype=dtype).train()
    assert _HEAD not in cufuse.patch(keep, linear_loss=False).counts()
    assert keep(input_ids=ids, labels=labels).logits.shape == (*ids.shape, 100)
    with pytest.raises(TypeError, match="linear_loss must be a bool"):
        cufuse.patch(make(), linear_loss=1)


def test_fused_head_is_per_thread_and_per_model():
    """While one thread is inside a fused training forward, another thread's
    call on the same model gets its logits; Gemma (not a model the fused
    head knows) keeps its head and loss apart."""
    import threading
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**_LLAMA_KW)).train()
    cufuse.patch(model)
    ids = _text(2, 8)["input_ids"]
    inside, go = threading.Event(), threading.Event()

    def hold(mod, inp, out):  # the training thread waits inside its forward, after the final norm
        if threading.current_thread().name == "train":
            inside.set()
            go.wait(30)
    model.model.norm.register_forward_hook(hold)
    res = {}
    t = threading.Thread(target=lambda: res.update(train=model(input_ids=ids, labels=ids)), name="train")
    t.start()
    assert inside.wait(30)
    with torch.no_grad():
        other = model(input_ids=ids)
    go.set()
    t.join(30)
    assert other.logits.shape == (2, 8, 100)
    assert res["train"].logits is None and torch.isfinite(res["train"].loss)
    gemma = T.GemmaForCausalLM(T.GemmaConfig(**_LLAMA_KW, head_dim=16))
    module = T.models.gemma.modeling_gemma
    saved = module.apply_rotary_pos_emb  # (a patch replaces the modeling module's function)
    try:
        assert _HEAD not in cufuse.patch(gemma).counts()
    finally:
        module.apply_rotary_pos_emb = saved


@pytest.mark.parametrize("device", DEVICES)
def test_patched_rotary_matches_transformers(device, _original_rotary):
    """The patched apply_rotary_pos_emb against transformers' own, values and
    gradients (the model tests cannot tell: both models share the module)."""
    original = _original_rotary[0]
    model = T.LlamaForCausalLM(T.LlamaConfig(**_LLAMA_KW))
    cufuse.patch(model)
    patched = T.models.llama.modeling_llama.apply_rotary_pos_emb
    assert patched is not original
    g = torch.Generator().manual_seed(3)
    q0, k0 = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    ang = torch.rand(2, 7, 8, generator=g) * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    ins = [[v.double().to(device).requires_grad_(True) for v in (q0, k0)] for _ in range(2)]
    cs = [v.double().to(device) for v in (cos, sin)]
    outs = [fn(*i, *cs) for fn, i in zip((patched, original), ins)]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for o in outs:
        (o[0].square().sum() + o[1].sum()).backward()
    for a, b in zip(*ins):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_patched_llama_compiles_whole(device):
    """A patched Llama (norms, gated MLPs, rotary embedding, the fused head
    and loss: every one a registered operator) compiles with fullgraph=True,
    forward and backward equal to the eager patched model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    # eager attention: torch 2.11's compiled CPU flash-attention backward fails on float64
    # ("expected scalar type Double but found Float") with or without cufuse; attention is not patched
    cfg = T.LlamaConfig(**_LLAMA_KW, attn_implementation="eager")
    model = T.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    cufuse.patch(model)
    twin = copy.deepcopy(model)
    ids = _text()["input_ids"].to(device)
    out = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids)
    assert out.logits is None  # the fused head and loss, compiled: no logits made
    a = out.loss
    b = twin(input_ids=ids, labels=ids).loss
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)
    a.backward()
    b.backward()
    for (k, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol * 10, atol=rtol * 10, msg=k)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patched_training_step_under_a_cuda_graph(family):
    """A patched model's whole training step (forward with the fused head and
    loss, backward, a capturable AdamW step) captured in one CUDA graph, as
    torch's docs capture a whole network: each replay trains as an uncaptured
    step of a twin does (same losses, same weights after three steps), and
    the replays' losses move (the step is not replaying stale work)."""
    model, _, ids, labels, rtol = _patched_pair(family, "cuda", train=True)
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True) for m in (model, twin)]

    def step(m, opt):
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls (kernels built, tables uploaded) before capture
        for _ in range(3):
            step(model, opts[0])
            step(twin, opts[1])
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # gradients are None: backward makes them in the graph's memory
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opts[0].step()
    got, want = [], []
    for _ in range(3):
        g.replay()
        got.append(loss.item())
        want.append(step(twin, opts[1]).item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=rtol)
    assert len(set(got)) == 3, got
    for (k, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p, q, rtol=rtol * 10, atol=rtol * 10, msg=k)


def test_compiled_patched_model_compiles_once():
    """The fused head's hand-over (a thread-local) and cufuse's compile
    check are traced without a guard that the next call fails: the compiled
    patched Llama is compiled once, for later steps and in another thread."""
    import threading

    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**_LLAMA_KW, attn_implementation="eager"))
    cufuse.patch(model)
    compiled = torch.compile(model, fullgraph=True)
    ids = _text()["input_ids"]
    results = []

    def step():
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append(out.logits is None)
    for _ in range(3):
        step()
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert results == [True] * 4
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


ATTN_MODELS = ["llama", "qwen2", "gpt2", "bert", "vit"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ATTN_MODELS)
def test_patch_attention(family, device):
    """patch(model, attention=True): the model's attention runs cufuse.attention
    (counted), with outputs and gradients equal to the unpatched model's; a
    padding mask takes transformers' SDPA path and still agrees."""
    from cufuse import _patch as P
    make, inputs, _ = MODELS[family]
    torch.manual_seed(0)
    # the GPU kernels are float16/bfloat16: float64 on the CPU, bfloat16 on the GPU
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    model = make().to(device=device, dtype=dtype).eval()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    report = cufuse.patch(model, attention=True)
    assert ("attention", "sdpa", "cufuse.attention") in report.replaced, str(report)
    calls = []
    real = P.attention_forward

    def counting(module, query, *args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return real(module, query, *args, **kwargs)

    from transformers import AttentionInterface
    AttentionInterface.register("cufuse", counting)
    try:
        x = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs().items()}
        y, y_ref = _main(model(**x)), _main(ref(**x))
        assert len(calls) == 2  # two layers
        tol = 1e-6 if dtype == torch.float64 else 3e-2
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
        y.float().square().mean().backward()
        y_ref.float().square().mean().backward()
        for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if q.grad is not None:
                s = max(1.0, float(q.grad.float().abs().max()))
                torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=tol * 10, atol=tol * 10 * s, msg=k)
        if "input_ids" in x:  # a padded batch: the mask goes to SDPA
            mask = torch.ones_like(x["input_ids"])
            mask[0, :3] = 0
            with torch.no_grad():
                a = _main(model(**x, attention_mask=mask))
                b = _main(ref(**x, attention_mask=mask))
            torch.testing.assert_close(a[1].float(), b[1].float(), rtol=tol, atol=tol)
    finally:
        AttentionInterface.register("cufuse", real)


def test_patch_attention_static_cache_and_fallback():
    """A static cache's prefill (12 queries, 32 cache slots, no mask: SDPA's causal mask is top-left, cufuse's
    bottom-right) gives the unpatched logits (they differed by 0.8); calls cufuse does not take go to the
    model's own implementation before the patch: Gemma2's softcap under eager (SDPA refuses softcap, so
    every forward raised)."""
    from transformers import StaticCache
    cfg = T.LlamaConfig(**_LLAMA_KW)
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(cfg).eval()
    model = copy.deepcopy(ref)
    cufuse.patch(model, attention=True)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = ref(ids, past_key_values=StaticCache(config=cfg, max_cache_len=32)).logits
        b = model(ids, past_key_values=StaticCache(config=cfg, max_cache_len=32)).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    gcfg = T.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=100, attn_implementation="eager")
    torch.manual_seed(0)
    gref = T.Gemma2ForCausalLM(gcfg).eval()
    gm = copy.deepcopy(gref)
    report = cufuse.patch(gm, attention=True)
    assert ("attention", "eager", "cufuse.attention") in report.replaced, str(report)
    with torch.no_grad():
        torch.testing.assert_close(gm(ids).logits, gref(ids).logits, rtol=1e-4, atol=1e-4)


def test_patch_bfloat16_cast_back_norm_and_shared_modules():
    """An RMSNorm that casts back to its input's dtype, patched with bfloat16 weights, keeps doing so (the
    probe's float32 input promoted either way: it was taken for one that promotes). A module at two paths is
    replaced at both (it was at the first only, and the model then counted as patched). A model built with
    cufuse.nn modules can be patched (it counted as patched already)."""
    norm = _CastBackRMSNorm(8).bfloat16()
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), norm)
    cufuse.patch(seq)
    seq.float()
    assert seq[1](torch.randn(2, 8).bfloat16()).dtype == torch.bfloat16
    act = torch.nn.GELU()
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), act, torch.nn.Linear(4, 4), act)
    report = cufuse.patch(m)
    assert isinstance(m[1], cufuse.nn.GELU) and m[3] is m[1], str(report)
    own = torch.nn.Sequential(cufuse.nn.GELU(), torch.nn.LayerNorm(4))
    assert cufuse.patch(own).counts() == {"LayerNorm -> LayerNorm": 1}
    with pytest.raises(ValueError, match="patched already"):
        cufuse.patch(own)


def test_patch_attention_errors():
    model = MODELS["llama"][0]()
    with pytest.raises(TypeError, match="attention must be a bool"):
        cufuse.patch(model, attention="yes")
