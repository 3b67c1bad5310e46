"""Exact conversion between ``torch.nn.MultiheadAttention`` and our modules, and between the two
frameworks' mask conventions.

Shape legend: B batch, H heads, Lq query length (torch's L), Lk key length (torch's S), E
``embed_dim`` (the query input, attention and output width), Dh = E / H the head width, and
``kdim``, ``vdim`` the key and value input widths (E unless given).

Weights: ``nn.MultiheadAttention`` keeps W_q, W_k, W_v as (out, in) blocks of one packed
``in_proj_weight`` (3E, E), or as ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim) and
``v_proj_weight`` (E, vdim) when kdim or vdim differs from E; ``in_proj_bias`` (3E,) packs the
three biases, and ``out_proj`` is an ``nn.Linear(E, E)``. The neutral layout is (in, out), head h
owning columns h·Dh … (h+1)·Dh − 1, which is torch's order of rows, so conversion is a split and
a transpose, nothing else, and it is exact both ways.

Masks. **POLARITY IS OPPOSITE.** In ``nn.MultiheadAttention`` a boolean ``attn_mask`` or
``key_padding_mask`` entry True means **BLOCKED** (may not attend; padding); in ours a boolean
``mask`` entry True means **MAY ATTEND**. A float ``attn_mask`` is additive (−inf blocks), which
is our ``bias`` plus a mask False where it is −inf. ``mask_from_torch`` and ``mask_to_torch``
translate; never pass one framework's boolean mask to the other as it is.

Inputs: our modules take (B, L, E) batch first. A ``batch_first=False`` torch module takes
(L, B, E); converting it changes nothing in the weights, but its inputs and outputs must be
transposed, ``x.transpose(0, 1)``, on the way to and from ours. Masks do not depend on
``batch_first``.

Fully masked query rows (every key blocked): ours give zeros in the weights and the attention
output (so the module's output row is the output bias). On torch 2.13, ``nn.MultiheadAttention``
gives NaN in that row's output and weights when ``need_weights=True`` (its explicit softmax), and
ours' answer when ``need_weights=False`` (PyTorch's fused kernel returns zeros there).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from golden.specification import variants
from golden.convert import (
    HF_NAMES,
    META_NAMES,
    MHA_SETTINGS,
    check_pair_move,
    llama_config,
    llama_from_hf,
    llama_to_neutral,
    neutral_to_llama,
    permute_qk,
    rope_permute,
    rope_unpermute,
)
from torch_attn.params import _numpy, build, export_params

__all__ = ["HF_NAMES", "META_NAMES", "from_llama", "from_torch_mha", "llama_config",
           "llama_to_neutral", "load_torch_mha", "mask_from_torch", "mask_to_torch",
           "mha_grads", "mha_params", "neutral_to_llama", "permute_qk", "rope_permute",
           "rope_unpermute", "to_llama", "to_torch_mha"]

_VARIANTS = ("multi_head_attention", "grouped_query_attention")
_QKV = ("query", "key", "value")


# ---- weights: torch -> neutral ----------------------------------------------------------------

def _check_representable(mha) -> None:
    """ValueError for an ``nn.MultiheadAttention`` option the neutral layout cannot hold."""
    if not isinstance(mha, nn.MultiheadAttention):
        raise ValueError(f"mha should be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if mha.bias_k is not None:
        raise ValueError("add_bias_kv should be False: our attention has no learned key and value "
                         "rows appended to the sequence (bias_k, bias_v), got add_bias_kv=True")
    if mha.add_zero_attn:
        raise ValueError("add_zero_attn should be False: our attention has no zero key and value "
                         "appended to the sequence, got add_zero_attn=True")


def _neutral(mha, get_array) -> dict:
    """Neutral-layout NumPy copies of W (in, out) and b (out,) from ``get_array(parameter)``."""
    if mha._qkv_same_embed_dim:
        weights = get_array(mha.in_proj_weight, "in_proj_weight").chunk(3)  # 3 × (E, E) (out, in)
    else:
        weights = [get_array(getattr(mha, f"{r[0]}_proj_weight"), f"{r[0]}_proj_weight")
                   for r in _QKV]                                  # (E, E), (E, kdim), (E, vdim)
    out = {f"W_{r}": _numpy(w).T for r, w in zip(_QKV, weights)}
    if mha.in_proj_bias is not None:
        biases = get_array(mha.in_proj_bias, "in_proj_bias").chunk(3)  # 3 × (E,)
        out.update({f"b_{r}": _numpy(b) for r, b in zip(_QKV, biases)})
    out["W_out"] = _numpy(get_array(mha.out_proj.weight, "out_proj.weight")).T
    if mha.out_proj.bias is not None:
        out["b_out"] = _numpy(get_array(mha.out_proj.bias, "out_proj.bias"))
    return out


def _grad(param, name):
    if param.grad is None:
        raise ValueError(f"{name}.grad should be a tensor after a backward pass, got None")
    return param.grad


def mha_params(mha) -> dict:
    """The weights of an ``nn.MultiheadAttention`` in the neutral layout, as NumPy copies:
    W_query (E, E), W_key (kdim, E), W_value (vdim, E), W_out (E, E), and b_query, b_key,
    b_value, b_out (E,) when it has biases. Any kdim and vdim, packed or separate storage: use
    these with ``torch_attn.scaled_dot_product_attention`` for your own cross-attention (project,
    split E into H blocks of Dh, attend, merge, project out). ValueError for add_bias_kv and
    add_zero_attn, which the layout cannot hold."""
    _check_representable(mha)
    return _neutral(mha, lambda p, name: p)


def mha_grads(mha) -> dict:
    """The ``.grad`` of an ``nn.MultiheadAttention``'s parameters after a backward pass, in the
    neutral layout of ``mha_params`` (the same split and transpose)."""
    _check_representable(mha)
    return _neutral(mha, _grad)


def from_torch_mha(mha, *, causal=False, variant="multi_head_attention"):
    """``(variant, config, params)`` for ``torch_attn.build`` / ``jax_attn.build`` computing what
    ``mha`` computes on self-attention ``mha(x, x, x)``; params are NumPy copies.

    ``variant`` "multi_head_attention" (``MultiHeadAttention(d_in=E, d_out=E, num_heads=H)``) or
    "grouped_query_attention" (``num_kv_heads=H``, ``head_dim=E/H``, no rotary embeddings).
    ``qkv_bias`` and ``out_bias`` follow torch's ``bias`` (its in_proj_bias and out_proj.bias);
    ``dropout`` is ``mha.dropout``. ``causal``: torch keeps no causal flag (it takes a causal
    ``attn_mask`` at each call); say here whether ours should be causal. Our modules take
    (B, L, E): transpose the inputs of a ``batch_first=False`` module. ValueError for
    add_bias_kv, add_zero_attn and kdim or vdim ≠ E (our multi-head variants are self-attention:
    use ``mha_params`` with the core for cross-attention).
    """
    _check_representable(mha)
    if variant not in _VARIANTS:
        raise ValueError(f"variant should be one of {', '.join(_VARIANTS)}, got {variant!r}")
    e, h = mha.embed_dim, mha.num_heads
    if not mha._qkv_same_embed_dim:
        raise ValueError(f"kdim and vdim should equal embed_dim = {e} to convert to our "
                         f"self-attention variants (our variants have no multi-head cross "
                         f"attention; use mha_params with the core), got kdim = {mha.kdim}, "
                         f"vdim = {mha.vdim}")
    biases = dict(qkv_bias=mha.in_proj_bias is not None, out_bias=mha.out_proj.bias is not None)
    shape = (dict(d_in=e, d_out=e, num_heads=h) if variant == "multi_head_attention" else
             dict(d_in=e, num_heads=h, num_kv_heads=h, head_dim=e // h, d_out=e))
    given = dict(shape, causal=causal, dropout=float(mha.dropout), **biases)
    return variant, variants.get(variant).config(given), mha_params(mha)


# ---- weights: neutral -> torch ----------------------------------------------------------------

def _expected_shapes(mha) -> dict:
    """{neutral name: shape} that ``mha`` holds."""
    e = mha.embed_dim
    shapes = {"W_query": (e, e), "W_key": (mha.kdim, e), "W_value": (mha.vdim, e),
              "W_out": (e, e)}
    if mha.in_proj_bias is not None:
        shapes.update({f"b_{r}": (e,) for r in _QKV})
    if mha.out_proj.bias is not None:
        shapes["b_out"] = (e,)
    return shapes


def _check_params(mha, params) -> None:
    want = _expected_shapes(mha)
    variants.check_param_shapes(want, params, f"this nn.MultiheadAttention (bias="
                                f"{mha.in_proj_bias is not None})")


def load_torch_mha(mha, params) -> None:
    """Copy neutral-layout ``params`` (NumPy arrays or tensors; the names and shapes of
    ``mha_params``) into an ``nn.MultiheadAttention``, after checking them; exact: the same
    arrays come back from ``mha_params``."""
    _check_representable(mha)
    _check_params(mha, params)

    def put(target, neutral, transpose):  # neutral W (in, out) -> torch (out, in)
        t = torch.as_tensor(neutral)
        with torch.no_grad():
            target.copy_(t.T if transpose else t)

    if mha._qkv_same_embed_dim:
        put(mha.in_proj_weight, torch.cat([torch.as_tensor(params[f"W_{r}"]).T for r in _QKV]),
            False)                                                 # (3E, E)
    else:
        for r in _QKV:
            put(getattr(mha, f"{r[0]}_proj_weight"), params[f"W_{r}"], True)
    if mha.in_proj_bias is not None:
        put(mha.in_proj_bias, torch.cat([torch.as_tensor(params[f"b_{r}"]) for r in _QKV]), False)
    put(mha.out_proj.weight, params["W_out"], True)
    if mha.out_proj.bias is not None:
        put(mha.out_proj.bias, params["b_out"], False)


def _fit_config(variant, config, num_heads) -> int:
    """The heads H of an equivalent nn.MultiheadAttention; ValueError naming what does not fit."""
    h = config["num_heads"]
    if num_heads is not None and num_heads != h:
        raise ValueError(f"num_heads should be the module's {h} or None, got {num_heads}")
    d_out = config["d_out"] if config["d_out"] is not None else config["d_in"]
    width = d_out if variant == "multi_head_attention" else h * variants.head_dim(config)
    if config["d_in"] != d_out or width != d_out:
        raise ValueError(f"d_in, the heads' width N·Dh and d_out should all equal (torch's "
                         f"embed_dim is all three), got d_in = {config['d_in']}, N·Dh = {width}, "
                         f"d_out = {d_out}")
    if variant == "grouped_query_attention":
        if config["num_kv_heads"] != h:
            raise ValueError(f"num_kv_heads should be num_heads = {h} for "
                             f"torch.nn.MultiheadAttention, got {config['num_kv_heads']}")
        variants.check_defaults(variant, config, MHA_SETTINGS,
                                "torch.nn.MultiheadAttention")
        if config["scale"] not in (None, 1.0 / math.sqrt(width // h)):
            raise ValueError(f"scale should be None (1/√Dh) for torch.nn.MultiheadAttention, "
                             f"got {config['scale']}")
    return h


def _source(source, num_heads):
    """(params, heads, dropout, training, device) of a module of ours or a params dict."""
    variant = getattr(source, "variant", None)
    if isinstance(source, nn.Module) and variant in _VARIANTS:
        h = _fit_config(variant, source.config, num_heads)
        return (export_params(source), h, source.config["dropout"], source.training,
                source.W_query.weight.device)
    if isinstance(source, dict):
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads should be a positive int with a params dict, "
                             f"got {num_heads!r}")
        return source, num_heads, 0.0, True, None
    raise ValueError(f"source should be a MultiHeadAttention, a GroupedQueryAttention or a dict "
                     f"of neutral-layout params, got {type(source).__name__}")


def to_torch_mha(source, *, num_heads=None, batch_first=True) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` computing what ``source`` computes; exact (``mha_params``
    of it gives back the same arrays).

    ``source``: our ``MultiHeadAttention`` (d_in = d_out) or ``GroupedQueryAttention``
    (num_kv_heads = num_heads, N·Dh = d_in = d_out, no rope_theta, softcap or window), whose
    dropout and train/eval mode are kept; or a neutral params dict as ``mha_params`` gives
    (num_heads then required; kdim and vdim from W_key and W_value). Torch has one ``bias``
    flag: when the source has any bias, the ones it lacks (our default MultiHeadAttention has
    b_out only) are set to zeros, which computes the same. **Torch keeps no causal flag**: a
    causal source needs a causal ``attn_mask`` at each call (``mask_to_torch``). The dtype is
    W_query's (a bfloat16 or float16 module of ours gives float32, as ``export_params`` does);
    ``batch_first`` is the new module's (False: inputs (L, B, E)).
    """
    params, h, dropout, training, device = _source(source, num_heads)
    if "W_query" not in params:
        raise ValueError("parameter W_query is missing: expected shape (E, E)")
    e = np.shape(params["W_query"])[-1]
    kdim, vdim = (np.shape(params[f"W_{r}"])[0] if f"W_{r}" in params else e
                  for r in ("key", "value"))
    bias = any(name.startswith("b_") for name in params)
    dtype = torch.as_tensor(params["W_query"]).dtype
    mha = nn.MultiheadAttention(e, h, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
                                batch_first=batch_first, device=device, dtype=dtype)
    if bias:  # torch's one bias flag: the biases the source lacks are zeros
        params = {**{f"b_{r}": torch.zeros(e, dtype=dtype) for r in (*_QKV, "out")}, **params}
    load_torch_mha(mha, params)
    return mha.train(training)


# ---- masks ------------------------------------------------------------------------------------

def _tensor(name, a):
    if a is None or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    raise ValueError(f"{name} should be a tensor, a NumPy array or None, got {type(a).__name__}")


def _as_input(a, numpy_in):
    """Give back NumPy when the masks came as NumPy."""
    return a.cpu().numpy() if numpy_in and a is not None else a


def _broadcasts(shape, full) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, full)) == tuple(full)
    except RuntimeError:
        return False


def _split_float(name, m):
    """A torch mask -> (allowed, additive or None): bool True = blocked; float additive, −inf
    blocks (NaN or +inf raise)."""
    if m.dtype == torch.bool:
        return ~m, None
    if not m.is_floating_point():
        raise ValueError(f"{name} dtype should be bool or a float type, got {m.dtype}")
    if bool((m.isnan() | (m == math.inf)).any()):
        raise ValueError(f"{name} should hold finite numbers or -inf (blocked), got NaN or +inf")
    allowed = m != -math.inf
    return allowed, m.masked_fill(~allowed, 0.0)


def mask_from_torch(attn_mask=None, key_padding_mask=None, *, batch_size, num_heads, lq, lk,
                    dtype=None, per_head=True):
    """``nn.MultiheadAttention``'s masks -> our ``(mask, bias)``.

    **POLARITY: torch's boolean masks are True = BLOCKED; ours is True = MAY ATTEND.** This
    inverts them. Torch's ``attn_mask`` is (Lq, Lk) or (B·H, Lq, Lk) (row b·H + h), boolean
    (True = blocked) or float (added to the scores; −inf blocks); ``key_padding_mask`` is
    (B, Lk), boolean (True = padding, blocked) or float (added). Returns ``mask``: bool, **True
    = may attend**, False where torch blocks; ``bias``: the float terms (0 where blocked) in
    ``dtype`` (default the float mask's), or None when no mask is float. Both are None when no
    mask is given. Shapes: broadcastable to (B, H, Lq, Lk), 4-D, with axis 1 where torch's masks
    do not vary ((1, 1, Lq, Lk) from an (Lq, Lk) attn_mask, (B, 1, 1, Lk) from a padding mask),
    for ``torch_attn.scaled_dot_product_attention``. ``per_head=False``: (B or 1, Lq, Lk) for
    our modules' ``mask`` (one mask for every head); a per-head (B·H, Lq, Lk) attn_mask then
    raises. Tensors in, tensors out; NumPy in, NumPy out.
    """
    numpy_in = any(isinstance(a, np.ndarray) for a in (attn_mask, key_padding_mask))
    am, kpm = _tensor("attn_mask", attn_mask), _tensor("key_padding_mask", key_padding_mask)
    b, h = batch_size, num_heads
    allowed = bias = None
    if am is not None:
        if tuple(am.shape) == (lq, lk):
            am = am[None, None]                                   # (1, 1, Lq, Lk)
        elif tuple(am.shape) == (b * h, lq, lk) and per_head:
            am = am.unflatten(0, (b, h))                          # (B, H, Lq, Lk)
        else:
            want = f"(Lq, Lk) = {(lq, lk)}" + (
                f" or (B·H, Lq, Lk) = {(b * h, lq, lk)}" if per_head else
                " with per_head=False (our modules take one mask for every head)")
            raise ValueError(f"attn_mask shape should be {want}, got {tuple(am.shape)}")
        allowed, bias = _split_float("attn_mask", am)
    if kpm is not None:
        if tuple(kpm.shape) != (b, lk):
            raise ValueError(f"key_padding_mask shape should be (B, Lk) = {(b, lk)}, "
                             f"got {tuple(kpm.shape)}")
        keep, add = _split_float("key_padding_mask", kpm[:, None, None, :])  # (B, 1, 1, Lk)
        allowed = keep if allowed is None else allowed & keep
        bias = add if bias is None else (bias if add is None else bias + add)
        bias = None if bias is None else torch.where(allowed, bias, 0.0)
    if bias is not None and dtype is not None:
        bias = bias.to(dtype)
    if not per_head:
        allowed, bias = (None if a is None else a[:, 0] for a in (allowed, bias))
    return _as_input(allowed, numpy_in), _as_input(bias, numpy_in)


def mask_to_torch(mask=None, bias=None, *, batch_size, num_heads, lq, lk, per_head=True):
    """Our ``(mask, bias)`` -> ``nn.MultiheadAttention``'s ``(attn_mask, key_padding_mask)``.

    **POLARITY: our mask is True = MAY ATTEND; torch's boolean masks are True = BLOCKED.** This
    inverts it. ``mask`` (bool) and ``bias`` (float) as the core takes them: (Lq, Lk) or
    (B, H, Lq, Lk), axes of 1 broadcast; ``per_head=False``: as our modules take them, (Lq, Lk)
    or (B, Lq, Lk), one for every head. Returns:
    - for a mask of shape (B, 1, 1, Lk) (``per_head=False``: (B, 1, Lk)) and no bias, which
      blocks keys only: attn_mask None and ``key_padding_mask`` (B, Lk), bool, True = padding;
    - otherwise ``attn_mask``, (Lq, Lk) when the arrays have no batch or head axis above 1,
      else (B·H, Lq, Lk) (row b·H + h), and key_padding_mask None. Without a bias it is
      bool, True = blocked; with one it is float additive: the bias where allowed, −inf where
      blocked.
    Tensors in, tensors out; NumPy in, NumPy out. A row blocked everywhere gives NaN in
    ``nn.MultiheadAttention`` with ``need_weights=True`` (zeros in ours).
    """
    numpy_in = any(isinstance(a, np.ndarray) for a in (mask, bias))
    m, f = _tensor("mask", mask), _tensor("bias", bias)
    ranks, form = (((2, 4), "(Lq, Lk) or (B, H, Lq, Lk)") if per_head else
                   ((2, 3), "(Lq, Lk) or (B, Lq, Lk) with per_head=False"))
    for name, a in (("mask", m), ("bias", f)):
        if a is not None and a.dim() not in ranks:
            raise ValueError(f"{name} shape should be {form}, got {tuple(a.shape)}")
    if m is not None and m.dtype != torch.bool:
        raise ValueError(f"mask dtype should be bool (True = may attend), got {m.dtype}")
    if m is None and f is None:
        return None, None
    if not per_head:
        m, f = (a if a is None or a.dim() == 2 else a[:, None] for a in (m, f))  # (B, 1, Lq, Lk)
    flat = all(a is None or math.prod(a.shape[:-2]) == 1 for a in (m, f))  # no B, H axes
    m, f = (a if a is None or not flat else a.reshape(a.shape[-2:]) for a in (m, f))
    b, h = batch_size, num_heads
    if f is None and tuple(m.shape) == (b, 1, 1, lk):
        return None, _as_input(~m[:, 0, 0, :], numpy_in)           # (B, Lk)
    full = (lq, lk) if flat else (b, h, lq, lk)
    for name, a in (("mask", m), ("bias", f)):
        if a is not None and not _broadcasts(a.shape, full):
            axes = "(Lq, Lk)" if flat else "(B, H, Lq, Lk)"
            raise ValueError(f"{name} should broadcast to {axes} = {full}, got {tuple(a.shape)}")
    m, f = (None if a is None else a.broadcast_to(full) for a in (m, f))
    out = ~m if f is None else (f if m is None else f.masked_fill(~m, -math.inf))
    out = out if flat else out.reshape(b * h, lq, lk)               # (B·H, Lq, Lk)
    return _as_input(out.contiguous(), numpy_in), None


# ---- Llama-style checkpoints (the mapping is golden.convert's, shared with jax_attn) ---------

def from_llama(state_dict, *, num_heads, rope_theta, num_kv_heads=None, head_dim=None,
               prefix="", names=HF_NAMES, interleaved=False, sliding_window=None):
    """A GroupedQueryAttention holding one attention layer of a Llama-style state dict (tensors
    or arrays, (out, in)): ``golden.convert.llama_to_neutral`` (see there for ``prefix``,
    ``names`` and ``interleaved``, Meta's RoPE pairs, moved to rotate-half), then ``build``
    with ``llama_config``: causal, rotate-half RoPE of ``rope_theta``, Hugging Face's
    ``sliding_window`` (Mistral's config)."""
    return build(*llama_from_hf(state_dict, num_heads=num_heads, rope_theta=rope_theta,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, prefix=prefix,
                                names=names, interleaved=interleaved,
                                sliding_window=sliding_window))


def to_llama(module, *, prefix="", names=HF_NAMES, interleaved=False) -> dict:
    """A GroupedQueryAttention's weights as a Llama-style state dict ``{prefix + name +
    ".weight": (out, in) NumPy array, ...}``, RoPE pairs rotate-half (``interleaved=True``:
    Meta's interleaved), whichever convention the module uses. The weights only: rope_theta
    and the other settings belong in the model's configuration."""
    if getattr(module, "variant", None) != "grouped_query_attention":
        raise ValueError(f"module should be a torch_attn.GroupedQueryAttention, got "
                         f"{type(module).__name__}")
    check_pair_move(module.config, interleaved)
    return neutral_to_llama(export_params(module), num_heads=module.num_heads, prefix=prefix,
                            names=names, interleaved=interleaved,
                            rope_interleaved=module.config["rope_interleaved"])
