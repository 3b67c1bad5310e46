"""Flax's own attention modules and Llama-style checkpoints <-> jax_attn modules, exactly.

The mappings themselves are NumPy (``golden.convert``, shared with torch_attn); this module
reads and builds the Flax objects. Every array handed over is a copy.

* ``flax.nnx.MultiHeadAttention``: ``from_nnx_mha(mha) -> (variant, config, params)`` and
  ``to_nnx_mha(variant, config, params) -> nnx.MultiHeadAttention``.
* ``flax.linen.MultiHeadDotProductAttention``: ``from_linen_mha(variables)`` and
  ``to_linen_mha(variant, config, params) -> (module, variables)``.
* Llama-style state dicts: ``from_llama(state_dict, ...) -> GroupedQueryAttention`` and
  ``to_llama(module) -> {key: (out, in) array}``, with ``rope_permute``/``rope_unpermute``
  between Meta's interleaved and Hugging Face's rotate-half RoPE pairs.

Build our module from (variant, config, params) with ``jax_attn.build``. Flax's modules take
masks with a heads axis, ``(B, H, Lq, Lk)`` or broadcastable (ours ``mask[:, None]``), and are
causal through the call argument ``is_causal``, not a setting; their dropout draws one dropout mask
for the whole batch and all heads (``broadcast_dropout``) from their own stream, so only
evaluation-mode numbers can agree. Numerics: ``nnx.MultiHeadAttention``'s default
``attention_fn`` (no dropout, ``sow_weights=False``) calls ``jax.nn.dot_product_attention``,
whose softmax runs in float32 even under x64: in float64 it agrees with us to about 1e-7, not
1e-13. Called with ``sow_weights=True`` (or with dropout) it computes the softmax in the input's
dtype and agrees to rounding; linen's module always does.

Shape legend: E (= d_in) input width, E_out (= d_out) output width, H query heads, Hkv
key-value heads, Dh head width.
"""

from __future__ import annotations

import flax.linen as linen
import jax
from flax import nnx
from flax.core import unfreeze

from golden.convert import (
    HF_NAMES,
    META_NAMES,
    check_pair_move,
    flax_mha_settings,
    flax_mha_to_neutral,
    llama_config,
    llama_from_hf,
    llama_to_neutral,
    neutral_to_flax_mha,
    neutral_to_llama,
    permute_qk,
    rope_permute,
    rope_unpermute,
)
from jax_attn.functional import DEFAULT_PRECISION
from jax_attn.params import _device, build, export_params

__all__ = ["HF_NAMES", "META_NAMES", "from_linen_mha", "from_llama", "from_nnx_mha",
           "llama_config", "llama_to_neutral", "neutral_to_llama", "permute_qk",
           "rope_permute", "rope_unpermute", "to_linen_mha", "to_llama", "to_nnx_mha"]


# ---- flax.nnx.MultiHeadAttention --------------------------------------------------------------

def from_nnx_mha(mha, *, causal=False):
    """(variant, config, params) of our module computing what ``mha`` computes when called
    with ``is_causal=causal``: ``multi_head_attention`` when it can hold the weights (Hkv = H,
    out_features = qkv_features), else ``grouped_query_attention`` without RoPE. Weights
    (E, H, Dh) -> W (E, H·Dh), (H, Dh, E_out) -> W_out (H·Dh, E_out), biases flattened;
    ``use_bias`` gives qkv_bias = out_bias, ``dropout_rate`` the dropout. ``normalize_qk`` and
    ``in_kv_features != in_features`` have no counterpart: ValueError. ``nnx.grad``'s
    gradients convert the same way: ``golden.convert.flax_mha_to_neutral(nnx.to_pure_dict(g))``.
    """
    if not isinstance(mha, nnx.MultiHeadAttention):
        raise ValueError(f"mha should be a flax.nnx.MultiHeadAttention, got "
                         f"{type(mha).__name__}")
    if mha.normalize_qk:
        raise ValueError("normalize_qk should be False: the layer norms of q and k have no "
                         "counterpart in our variants, got True")
    if mha.in_kv_features != mha.in_features:
        raise ValueError(f"in_kv_features should equal in_features = {mha.in_features} (our "
                         f"self-attention variants take one input), got {mha.in_kv_features}")
    tree = nnx.to_pure_dict(nnx.state(mha, nnx.Param))
    return flax_mha_to_neutral(tree, causal=causal, dropout=float(mha.dropout_rate))


def to_nnx_mha(variant, config, params, *, rngs=None, precision=DEFAULT_PRECISION):
    """An ``nnx.MultiHeadAttention`` holding exactly ``params`` of ``variant``
    (``multi_head_attention``, or ``grouped_query_attention`` without RoPE, soft-capping,
    window or another scale: ValueError), in their dtype (float64 needs ``jax.enable_x64``),
    ``decode=False``. Call it with ``is_causal=config["causal"]``. Flax has one ``use_bias``:
    projections of ours without a bias get zeros (the same function; they come back as zero
    biases). ``rngs`` seeds its dropout stream (default ``nnx.Rngs(0)``); ``precision`` reaches
    its projections (its fast attention path takes none)."""
    settings = flax_mha_settings(variant, config)
    tree = neutral_to_flax_mha(variant, config, params)
    dtype = tree["query"]["kernel"].dtype
    # The structure only (as jax_attn.build): no weights drawn just to be overwritten.
    mha = nnx.eval_shape(lambda: nnx.MultiHeadAttention(
        **settings, param_dtype=dtype, precision=precision, decode=False, rngs=nnx.Rngs(0)))
    for role, arrays in tree.items():
        for name, array in arrays.items():
            getattr(getattr(mha, role), name).set_value(_device(array))
    if settings["dropout_rate"] > 0:
        mha.rngs = (nnx.Rngs(0) if rngs is None else rngs).dropout.fork()
    return mha


# ---- flax.linen.MultiHeadDotProductAttention --------------------------------------------------

def from_linen_mha(variables, *, causal=False, dropout=0.0):
    """(variant, config, params) from a linen ``MultiHeadDotProductAttention``'s ``variables``
    (``{"params": {"query": {"kernel", "bias"}, ...}}``, or the inner dict), as
    ``from_nnx_mha``; ``dropout`` is the module's ``dropout_rate`` (not in the variables)."""
    return flax_mha_to_neutral(unfreeze(variables), causal=causal, dropout=dropout)


def to_linen_mha(variant, config, params, *, precision=DEFAULT_PRECISION):
    """(module, variables): a linen ``MultiHeadDotProductAttention`` computing what our module
    does (``module.apply(variables, x, mask=mask[:, None])``; causal through a mask, e.g.
    ``nn.make_causal_mask``) and its variables ``{"params": ...}``, copies in the parameters'
    dtype. Linen has no key-value head groups: Hkv < H raises ValueError. Zero biases fill in
    for ours that are absent, as in ``to_nnx_mha``."""
    settings = flax_mha_settings(variant, config)
    if settings["num_kv_heads"] != settings["num_heads"]:
        raise ValueError(f"num_kv_heads should equal num_heads = {settings['num_heads']} for "
                         f"linen's MultiHeadDotProductAttention, which has no key-value "
                         f"groups, got {settings['num_kv_heads']}")
    tree = neutral_to_flax_mha(variant, config, params)
    module = linen.MultiHeadDotProductAttention(
        num_heads=settings["num_heads"], qkv_features=settings["qkv_features"],
        out_features=settings["out_features"], use_bias=settings["use_bias"],
        dropout_rate=settings["dropout_rate"], param_dtype=tree["query"]["kernel"].dtype,
        precision=precision)
    return module, {"params": jax.tree.map(_device, tree)}


# ---- Llama-style checkpoints ------------------------------------------------------------------

def from_llama(state_dict, *, num_heads, rope_theta, num_kv_heads=None, head_dim=None,
               prefix="", names=HF_NAMES, interleaved=False, sliding_window=None, rngs=None):
    """A GroupedQueryAttention holding one attention layer of a Llama-style state dict (torch
    tensors or arrays, (out, in)): ``golden.convert.llama_from_hf``, a thin use of ``from_hf`` (see
    there for ``prefix``, ``names`` and ``interleaved``, Meta's RoPE pairs, moved to
    rotate-half): causal, rotate-half RoPE of ``rope_theta``, Hugging Face's
    ``sliding_window`` (Mistral's config)."""
    return build(*llama_from_hf(state_dict, num_heads=num_heads, rope_theta=rope_theta,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, prefix=prefix,
                                names=names, interleaved=interleaved,
                                sliding_window=sliding_window), rngs=rngs)


def to_llama(module, *, prefix="", names=HF_NAMES, interleaved=False) -> dict:
    """A GroupedQueryAttention's weights as a Llama-style state dict ``{prefix + name +
    ".weight": (out, in) NumPy array, ...}``, RoPE pairs rotate-half (``interleaved=True``:
    Meta's interleaved), whichever convention the module uses. The weights only: rope_theta
    and the other settings belong in the model's configuration."""
    if getattr(module, "variant", None) != "grouped_query_attention":
        raise ValueError(f"module should be a jax_attn.GroupedQueryAttention, got "
                         f"{type(module).__name__}")
    check_pair_move(module.config, interleaved)
    return neutral_to_llama(export_params(module), num_heads=module.num_heads, prefix=prefix,
                            names=names, interleaved=interleaved,
                            rope_interleaved=module.config["rope_interleaved"])
