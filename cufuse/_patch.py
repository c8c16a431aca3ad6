"""``cufuse.patch(model)``: swap cufuse's modules into a Hugging Face
transformers model (or any torch model built from the same pieces), in place.

Recognized, by module type and layout (not by model name):

- RMSNorm layers of the Llama family (``LlamaRMSNorm``, ``MistralRMSNorm``,
  ``Qwen2RMSNorm``, ...: a ``weight`` and a ``variance_epsilon``) ->
  ``cufuse.nn.RMSNorm``;
- ``torch.nn.LayerNorm`` (GPT-2, BERT, ViT) -> ``cufuse.nn.LayerNorm``, and
  ``torch.nn.RMSNorm`` -> ``cufuse.nn.RMSNorm``;
- GELU activations: ``torch.nn.GELU`` and transformers' ``GELUActivation``
  (erf form), ``NewGELUActivation``, ``GELUTanh`` / ``PytorchGELUTanh``,
  ``FastGELUActivation`` (tanh form) -> ``cufuse.nn.GELU``;
- gated MLPs with a SiLU or GELU activation (``LlamaMLP``, ``MistralMLP``,
  ``Qwen2MLP``, Gemma's: ``gate_proj``, ``up_proj``, ``down_proj``,
  ``act_fn``) -> ``cufuse.nn.SwiGLU``, its ``act(gate) * up`` one fused
  kernel;
- Hugging Face's ``apply_rotary_pos_emb`` of the model's modeling module
  (Llama, Mistral, Qwen2: a module function, so every model of that module
  in the process gets it) -> ``cufuse.rope`` (one kernel per tensor each
  way, computed in float32);
- the causal language-model loss (a model whose ``loss_function`` is
  transformers' ``ForCausalLMLoss``: Llama, Mistral, Qwen2, GPT-2, ...) ->
  ``causal_lm_loss``, the same loss through ``cufuse.cross_entropy``: no
  float32 copy of the logits, the gradient written in place of them (after
  ``loss.backward()`` the model output's ``logits`` hold their gradient);
  for Llama, Mistral, Qwen2 and GPT-2 with a plain ``nn.Linear`` head
  (``linear_loss=True``), a training forward with ``labels=`` runs the head
  and that loss as one ``cufuse.linear_cross_entropy`` (no logits made; the
  output's ``logits`` is None, as Liger-Kernel's): the head becomes an
  ``LMHead`` and the class's forward is wrapped (``_fused_forward``).

- with ``attention=True``, the attention of models that use transformers'
  attention interface (Llama, Mistral, Qwen2, GPT-2, BERT, ViT in
  transformers 5) -> ``cufuse.attention`` (``attention_forward``, registered
  as the implementation "cufuse"): calls without a padding mask, dropout or
  extras it lacks, on CUDA float16/bfloat16 at the kernels' head dims (or on
  the CPU); any other call runs transformers' SDPA path as before. Off by
  default: on an H200 torch's flash backend is still faster (docs/ops.md).

The new modules take over the old ones' Parameter objects (and the MLP's
Linear layers), so ``state_dict`` keys and tensors, and an optimizer built
before the patch, are unchanged. Every replacement is planned before any is
made: a model is patched whole or not at all. Modules of other types stay
as they are.
"""
from __future__ import annotations

import copy
import functools
import sys
import threading
import weakref

import torch
from torch import nn

from . import nn as cnn
from .nn import PatchReport
from .ops.attention import HEAD_DIMS, attention as _attention

_GELU_ERF = {"GELUActivation"}
_GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
_SILU = {"SiLU", "SiLUActivation"}


def _gate_activation(act):
    """The SwiGLU activation name of a gated MLP's ``act_fn``, or None."""
    t = type(act).__name__
    if t in _SILU:
        return "silu"
    if type(act) is nn.GELU:
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if t in _GELU_ERF:
        return "gelu"
    if t in _GELU_TANH:
        return "gelu_tanh"
    return None


class RMSNorm(cnn.RMSNorm):
    """The Llama family's RMSNorm through cufuse.rms_norm: the output dtype is
    torch's promotion of the weight's and the input's, as in Hugging Face's
    ``self.weight * hidden_states.to(input_dtype)``, or the input's where the
    replaced norm casts its result back to it (``input_dtype``: Olmo2's,
    Helium's, ...)."""

    input_dtype = False

    def forward(self, x):
        y = super().forward(x)
        dt = x.dtype if self.input_dtype else torch.promote_types(self.weight.dtype, x.dtype)
        return y if y.dtype == dt else y.to(dt)

    # the replaced norm's name for eps: code that reads or sets it reaches the one forward uses
    @property
    def variance_epsilon(self):
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value):
        self.eps = value


def _rms_probe(old):
    """(None, whether its result takes the input's dtype) for an RMSNorm that
    computes as cufuse's (run on two small rows on its device, its hooks
    bypassed), else (why it stays, None)."""
    if old.weight.device.type == "meta":  # (built without memory: init_empty_weights, FSDP) probed on a CPU twin
        try:
            old = copy.deepcopy(old).to_empty(device="cpu")
            with torch.no_grad():
                for p in old.parameters():
                    p.uniform_(0.5, 1.5)
        except Exception as e:  # noqa: BLE001 - a norm that cannot be copied: left alone
            return f"an RMSNorm on the meta device that could not be checked ({type(e).__name__})", None
    w = old.weight
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *w.shape, generator=g).to(w.device, w.dtype)
    # an input dtype that the weight's promotes away from (bfloat16 with float32 gives float32 either way:
    # a norm that casts back could not be told from one that promotes)
    other = torch.float16 if w.dtype == torch.bfloat16 else torch.bfloat16
    try:
        with torch.no_grad():
            want, out = type(old).forward(old, x), type(old).forward(old, x.to(other))
            probe = RMSNorm(tuple(w.shape), eps=float(old.variance_epsilon), device=w.device, dtype=w.dtype)
            probe.weight.copy_(w)
            got = probe(x)
    except Exception as e:  # noqa: BLE001 - a norm that does not take a plain tensor: left alone
        return f"an RMSNorm whose forward fails on a plain tensor ({type(e).__name__})", None
    tol = 1e-5 if w.dtype in (torch.float32, torch.float64) else 2e-2
    if want.shape != got.shape or not torch.allclose(want.float(), got.float(), rtol=tol, atol=tol):
        return "an RMSNorm that computes otherwise than x * rsqrt(mean(x^2) + eps) * weight", None
    return None, out.dtype == other and torch.promote_types(w.dtype, other) != other


def _rms(old, input_dtype=False):
    w = old.weight
    new = RMSNorm(tuple(w.shape), eps=float(old.variance_epsilon), device="meta")
    new.weight = w
    new.input_dtype = input_dtype  # (_rms_probe's finding, made when the norm was planned)
    return new


def _layer_norm(old):
    new = cnn.LayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                        bias=old.bias is not None, device="meta")
    if old.elementwise_affine:
        new.weight = old.weight
        if old.bias is not None:
            new.bias = old.bias
    return new


def _gelu(approximate):
    return lambda old: cnn.GELU(approximate)


def _torch_rms(old):
    new = cnn.RMSNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine, device="meta")
    if old.elementwise_affine:
        new.weight = old.weight
    return new


class SwiGLU(cnn.SwiGLU):
    """A gated MLP by Llama's names through cufuse's fused gate (``cufuse.nn.SwiGLU``). Its ``act_fn``
    stays the replaced module's attribute: an activation set afterwards is the one it computes with
    (one cufuse has; another raises, where a new child module would be ignored)."""

    def __setattr__(self, name, value):
        if name == "act_fn":
            act = _gate_activation(value)
            if act is None:
                raise ValueError(f"cufuse.patch: a patched gated MLP computes SiLU or GELU gates; act_fn "
                                 f"{type(value).__name__} is neither (patch the model before changing it)")
            super().__setattr__("activation", act)
            object.__setattr__(self, "_act_fn", value)  # (kept, not a child module: it computes nothing here)
            return
        super().__setattr__(name, value)

    @property
    def act_fn(self):
        return self._act_fn


def _swiglu(old):
    g = old.gate_proj
    new = SwiGLU(g.in_features, g.out_features, bias=g.bias is not None, device="meta",
                 activation=_gate_activation(old.act_fn))
    new.gate_proj, new.up_proj, new.down_proj = old.gate_proj, old.up_proj, old.down_proj
    new.act_fn = old.act_fn
    return new


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ``ForCausalLMLoss`` (labels shifted by one, a mean over
    the tokens not ignored, or a sum divided by ``num_items_in_batch``)
    through ``cufuse.cross_entropy``: the logits read in their own dtype
    (computed in float32, as the float32 copy transformers makes), a float32
    loss. Inside a fused training forward (``_fused_forward``) ``logits``
    are the head's input and the loss is ``cufuse.linear_cross_entropy``."""
    from .ops.cross_entropy import cross_entropy, linear_cross_entropy
    head = _DEFER.head
    if head is None:
        x = logits.reshape(-1, vocab_size)
        return _shifted(x, labels, num_items_in_batch, ignore_index, shift_labels, lambda t, reduction: cross_entropy(
            x, t, ignore_index=ignore_index, reduction=reduction, dtype=torch.float32))
    # the head stood aside: logits are its input, the hidden states
    if not getattr(logits, "_cufuse_hidden", False):
        raise RuntimeError("cufuse.patch: the model changed its LM head's output before the loss; its head "
                           "and loss cannot be one linear_cross_entropy: patch it with linear_loss=False")
    x = logits.reshape(-1, logits.shape[-1])
    return _shifted(x, labels, num_items_in_batch, ignore_index, shift_labels, lambda t, reduction: linear_cross_entropy(
        x, head.weight, t, bias=head.bias, ignore_index=ignore_index, reduction=reduction, dtype=torch.float32))


def _shifted(x, labels, num_items_in_batch, ignore_index, shift_labels, loss):
    """``ForCausalLMLoss``'s labels and reduction around ``loss(targets, reduction)`` of the rows of ``x``."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    out = loss(shift_labels.reshape(-1).to(x.device), reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(out.device)
        out = out / num_items_in_batch
    return out


# Causal LMs whose forward is ``logits = lm_head(hidden)`` then ``loss_function(logits, labels, ...)``
# with nothing done to the logits in between (the fused head needs exactly that)
_FUSED_HEAD_MODELS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"}
class _Defer(threading.local):
    """.head: the LM head standing aside in this thread's training forward
    (None in every thread from the start: a missing attribute would make a
    compiled model's guard fail once it is set, and compile it again)."""

    def __init__(self):
        self.head = None


_DEFER = _Defer()


class LMHead(nn.Linear):
    """A causal LM's head after ``cufuse.patch``: ``nn.Linear`` (the same
    Parameters and state_dict), except inside the model's own training
    forward with labels, where it hands its input to the loss instead of
    making the logits (``_fused_forward``)."""

    def forward(self, x):
        if _DEFER.head is self:
            x = x.view_as(x)  # a view marked for causal_lm_loss: these are the hidden states, not logits
            x._cufuse_hidden = True
            return x
        return super().forward(x)


def _plan_head(model):
    """Whether the model's loss may skip the logits: a model of a known forward
    (``_FUSED_HEAD_MODELS``) whose head (``get_output_embeddings``) is a plain
    ``nn.Linear`` and that transforms no logits (no soft-capping or scale)."""
    if type(model).__name__ not in _FUSED_HEAD_MODELS:
        return False
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return False
    return type(model.get_output_embeddings()) is nn.Linear


def _fused_forward(fwd):
    """The class's ``forward`` ``fwd``, wrapped (its signature kept: Trainer
    and generate read it): a model that ``cufuse.patch`` marked
    (``_cufuse_linear_loss``), called in training with ``labels=`` and grad
    mode on, runs ``fwd`` with its ``LMHead`` handing the hidden states to
    ``causal_lm_loss`` (no logits; the output's ``logits`` is None, as
    Liger-Kernel's; under torch.compile too, through the registered
    operator). Any other call, any other model of the class, or one under
    autocast, is ``fwd`` itself."""

    @functools.wraps(fwd)
    def forward(self, *args, **kwargs):
        head = self.get_output_embeddings() if self.__dict__.get("_cufuse_linear_loss") else None
        if head is None or type(head) is not LMHead or kwargs.get("labels") is None or not self.training or \
                not torch.is_grad_enabled() or _autocast() or \
                head._forward_hooks or head._forward_pre_hooks or hasattr(head, "_hf_hook") or \
                self.loss_function is not causal_lm_loss or _DEFER.head is not None:
            return fwd(self, *args, **kwargs)
        _DEFER.head = head
        try:
            out = fwd(self, *args, **kwargs)
        finally:
            _DEFER.head = None
        if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...) without the logits
            return out[:1] + out[2:]
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})

    forward._cufuse_fused = True  # type: ignore[attr-defined]
    return forward


def _autocast():
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


def _use_fused_head(model):
    """Mark the model and make its class's forward ``_fused_forward`` (once per class)."""
    cls = type(model)
    if not getattr(cls.forward, "_cufuse_fused", False):
        cls.forward = _fused_forward(cls.forward)
    head = model.get_output_embeddings()
    head.__class__ = LMHead
    model._cufuse_linear_loss = True


def _plan_loss(model):
    """Whether the model is a causal language model (loss type "ForCausalLM",
    or a ``...LMHeadModel`` as GPT-2's) whose loss is transformers'
    ``ForCausalLMLoss`` (then swapped). transformers gives that loss to every
    model as a default, so the type is what tells."""
    fn = getattr(type(model), "loss_function", None)
    if not isinstance(fn, property) or fn.fset is None:
        return False
    if getattr(model, "loss_type", None) != "ForCausalLM" and not type(model).__name__.endswith("LMHeadModel"):
        return False
    try:
        current = model.loss_function
    except Exception:  # noqa: BLE001 - a model whose loss type is unknown: left alone
        return False
    return getattr(current, "__name__", "") == "ForCausalLMLoss"


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Hugging Face's ``apply_rotary_pos_emb`` (``position_ids``: unused there
    too) through ``cufuse.rope``."""
    from .ops.rope import rope
    return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _rotates_as_llama(fn):
    """``fn(q, k, cos, sin)`` gives Llama's half-split rotation, checked on
    small float64 inputs against cufuse.rope (tables of two copies of the
    frequencies, as Llama's rotary embedding makes them, grouped heads). Many
    modeling modules define the same two names with other maths: interleaved
    pairs, a partial rotary dim, other arguments."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, h, 5, 8, generator=g, dtype=torch.float64) for h in (2, 1))
    f = torch.randn(1, 5, 4, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    try:
        got = fn(q, k, cos, sin)
        want = apply_rotary_pos_emb(q, k, cos, sin)
        return len(got) == 2 and all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-10, atol=1e-10)
                                     for a, b in zip(got, want))
    except Exception:  # noqa: BLE001 - other arguments or results: not Llama's
        return False


def _plan_rope(model):
    """(the model's modeling module, None) if it applies rotary embeddings
    with Hugging Face's ``apply_rotary_pos_emb`` and ``rotate_half`` as
    Llama's and it is not yet cufuse's; (None, why) for one that rotates
    otherwise; (None, None) where there is none, or cufuse's is in already."""
    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None or fn is apply_rotary_pos_emb or not callable(getattr(module, "rotate_half", None)):
        return None, None
    if not _rotates_as_llama(fn):
        return None, "its rotation differs from Llama's half-split form (interleaved pairs, a partial rotary " \
                     "dim or other arguments)"
    return module, None


def _plan(name, mod):
    """(how to build the replacement, None) or (None, why it stays) or (None, None): not ours."""
    t = type(mod).__name__
    if type(mod) is nn.LayerNorm:  # (exactly: cufuse.nn's subclasses are not patched again)
        return _layer_norm, None
    if type(mod) is nn.RMSNorm:
        return _torch_rms, None
    if t.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and isinstance(getattr(mod, "weight", None),
                                                                                 nn.Parameter):
        if len(list(mod.children())) or len(list(mod.parameters(recurse=False))) != 1:
            return None, "an RMSNorm with more than a weight"
        why, input_dtype = _rms_probe(mod)
        return (None, why) if why else (functools.partial(_rms, input_dtype=input_dtype), None)
    if type(mod) is nn.GELU:
        return _gelu(mod.approximate), None
    if t in _GELU_ERF and not isinstance(mod, nn.GELU):
        return _gelu("none"), None
    if t in _GELU_TANH:
        return _gelu("tanh"), None
    if all(isinstance(getattr(mod, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")) \
            and hasattr(mod, "act_fn"):
        if _gate_activation(mod.act_fn) is None:
            return None, f"a gated MLP whose activation is {type(mod.act_fn).__name__}, not SiLU or GELU"
        if not _plain_gated_mlp(mod):
            return None, "a gated MLP that computes more than down_proj(act_fn(gate_proj(x)) * up_proj(x))"
        return _swiglu, None
    return None, None


_MLP_PARTS = frozenset(("gate_proj", "up_proj", "down_proj", "act_fn"))


def _plain_gated_mlp(mod):
    """mod holds those four parts and nothing else (no parameter, buffer or
    attribute but Hugging Face's config and sizes; no forward of its own, as
    accelerate's hooks install) and its class's forward reads no other name:
    an MLP with a norm, clamps, multipliers, dropout or activation sparsity
    computes more, and stays."""
    if set(mod._modules) != _MLP_PARTS or mod._parameters or mod._buffers:
        return False
    if any(not k.startswith("_") and k not in ("config", "hidden_size", "intermediate_size", "training")
           for k in vars(mod)):
        return False
    import inspect
    code = getattr(inspect.unwrap(type(mod).forward), "__code__", None)
    return code is not None and set(code.co_names) <= _MLP_PARTS


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention interface through cufuse.attention where it
    applies (no mask tensor, no dropout in training, none of softcap,
    sinks, position bias or attention weights asked for; CUDA float16 /
    bfloat16 at the kernels' head dims, or the CPU), else transformers' SDPA
    function. q, k, v are (batch, heads, seq, dim); k and v may have fewer
    heads. Returns ((batch, seq, heads, dim), None) as the interface wants."""
    extras = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias"))
    fits = (not query.is_cuda) or (query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] in HEAD_DIMS)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # (as transformers' SDPA path: one query token attends to every key)
    causal = bool(causal) and query.shape[2] > 1
    if (attention_mask is not None or (dropout and module.training) or extras or kwargs.get("output_attentions")
            or not fits or value.shape[-1] != query.shape[-1]
            # no mask with more keys than queries (a static cache's prefill, its free slots at the end): SDPA's
            # causal mask aligns to the top left, cufuse's to the bottom right
            or (causal and query.shape[2] != key.shape[2])):
        fn = _fallback_attention(module)
        if attention_mask is None and causal and fn is not _sdpa_attention():
            # the "cufuse" mask interface is SDPA's, which leaves a purely causal mask to is_causal (aligned to
            # the top left): the eager functions take it as a tensor
            sq, sk = query.shape[2], key.shape[2]
            keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
            attention_mask = torch.zeros(sq, sk, dtype=query.dtype, device=query.device).masked_fill(
                ~keep, torch.finfo(query.dtype).min)[None, None]
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                  **kwargs)
    out = _attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_FALLBACK: dict = {}  # id(config) -> (its weak reference, the attention implementation before the patch)


def _sdpa_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def _fallback_attention(module):
    """For the calls cufuse.attention does not take: the model's own eager function where it used eager
    attention before the patch (softcap and the like, which SDPA refuses), else transformers' SDPA."""
    sdpa_attention_forward = _sdpa_attention()
    cfg = getattr(module, "config", None)
    ref, name = _FALLBACK.get(id(cfg), (None, None))
    if ref is None or ref() is not cfg or name != "eager":
        # (others, flash attention's, read the config's implementation name, now "cufuse", and take their
        # own mask format: SDPA takes the masks the "cufuse" mask interface makes)
        return sdpa_attention_forward
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", sdpa_attention_forward)


def _use_cufuse_attention(model):
    """Register attention_forward as transformers' attention implementation "cufuse" and switch the model
    to it; False where the model does not use the attention interface."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        return False
    if not hasattr(model, "set_attn_implementation") or not getattr(model, "config", None):
        return False
    AttentionInterface.register("cufuse", attention_forward)
    AttentionMaskInterface.register("cufuse", sdpa_mask)  # masks as for SDPA: None where purely causal
    before = {id(m.config): (m.config, getattr(m.config, "_attn_implementation", None))
              for m in model.modules() if getattr(m, "config", None) is not None}
    try:
        model.set_attn_implementation("cufuse")
    except (ValueError, NotImplementedError):
        return False
    for k, (cfg, name) in before.items():
        try:
            _FALLBACK[k] = (weakref.ref(cfg), name)
        except TypeError:  # (a config that takes no weak reference: SDPA)
            pass
    return True


# a module's hook tables, carried over to its replacement
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def _patched(model):
    """cufuse.patch went through the model (it marks it: a model built with cufuse.nn modules is not)."""
    return getattr(model, "_cufuse_patched", False) is True


def patch(model, *, attention=False, linear_loss=True):
    """Replace, in place, the modules of ``model`` that cufuse has (see the
    module doc) and return a ``PatchReport``; with ``attention=True`` also
    its attention (transformers models using the attention interface); with
    ``linear_loss`` (default) a causal LM's head and loss are one
    ``cufuse.linear_cross_entropy`` in training with labels (no logits).
    TypeError for anything but a torch.nn.Module; ValueError when it holds
    none of those modules."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"cufuse.patch: expected a torch.nn.Module, got {type(model).__module__}."
                        f"{type(model).__name__}")
    for what, v in (("attention", attention), ("linear_loss", linear_loss)):
        if not isinstance(v, bool):
            raise TypeError(f"cufuse.patch: {what} must be a bool, got {type(v).__name__}")
    if _patched(model):
        raise ValueError("cufuse.patch: the model is patched already (cufuse.patch went through it); nothing "
                         "was changed")
    report = PatchReport()
    steps = []
    done: set = set()  # a swapped MLP's own submodules are its old ones: not planned again
    root = None  # the model's own type where it is a module patch replaces (it has no parent to go into)
    for name, mod in model.named_modules(remove_duplicate=False):  # (a module at two paths: replaced at both)
        if any(name == d or name.startswith(d + ".") for d in done):
            continue
        make, why = _plan(name, mod)
        if make is not None and ("forward" in vars(mod) or hasattr(mod, "_hf_hook")):
            make, why = None, "its forward is wrapped (accelerate's hooks, say), which a new module would drop"
        if why:
            report.skipped.append((name, why))
        if make is None or not name:
            root = root or (type(mod).__name__ if make is not None else None)
            continue
        parent_name, _, attr = name.rpartition(".")
        steps.append((model.get_submodule(parent_name), attr, name, mod, make))
        if make is _swiglu:
            done.add(name)
    loss = _plan_loss(model)
    rope_module, why = _plan_rope(model)
    if why:
        report.skipped.append((f"{type(model).__module__}.apply_rotary_pos_emb", why))
    # cufuse.rope in the modeling module already (an earlier model of it was patched): this model's too
    rope_before = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None) is \
        apply_rotary_pos_emb
    if not steps and not loss and rope_module is None and not rope_before:
        detail = "".join(
            ([f"; the model itself is a {root}, which patch replaces only inside a model: use cufuse.nn's "
              "module, or patch a model that holds it"] if root else [])
            + [f"; {n or 'the model'} stays: {why}" for n, why in report.skipped])
        raise ValueError("cufuse.patch: no module of the model is one cufuse has (RMSNorm, LayerNorm, GELU, "
                         f"gated SiLU or GELU MLP, rotary embedding, causal-LM loss); nothing was changed{detail}")
    made = {}  # id(old) -> its one replacement (installed at each of its paths)
    built = [(parent, attr, name, mod, made[id(mod)] if id(mod) in made else made.setdefault(id(mod), make(mod)))
             for parent, attr, name, mod, make in steps]  # all, then swap
    for parent, attr, name, old, new in built:
        new.train(old.training)
        for h in _HOOKS:  # the old module's hooks, as they are (their handles remove them from the new one)
            if getattr(old, h, None) is not None:
                setattr(new, h, getattr(old, h))
        setattr(parent, attr, new)
        report.replaced.append((name, type(old).__name__, type(new).__name__))
    if rope_module is not None or rope_before:
        if rope_module is not None:
            rope_module.apply_rotary_pos_emb = apply_rotary_pos_emb
        report.replaced.append((f"{type(model).__module__}.apply_rotary_pos_emb", "apply_rotary_pos_emb",
                                "cufuse.rope"))
    if loss:
        model.loss_function = causal_lm_loss
        report.replaced.append(("loss_function", "ForCausalLMLoss", "cufuse.cross_entropy"))
        if linear_loss and _plan_head(model):
            _use_fused_head(model)
            report.replaced.append(("lm_head + loss_function", "Linear + ForCausalLMLoss",
                                    "cufuse.linear_cross_entropy"))
    if attention:
        before = getattr(model.config, "_attn_implementation", None) if hasattr(model, "config") else None
        if _use_cufuse_attention(model):
            report.replaced.append(("attention", str(before), "cufuse.attention"))
        else:
            report.skipped.append(("attention", "the model does not use transformers' attention interface"))
    model._cufuse_patched = True  # (a second patch refuses)
    return report
