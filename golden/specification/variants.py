"""Every attention variant described once, independent of any framework.

A :class:`Variant` says what a variant is: its name and class name, its constructor arguments and
their checks, its parameters' names and shapes in the neutral layout, where the module keeps the
layers holding them, how it is called, and a small sample configuration for tests. Building and
exporting modules, the fixture loader's checks, the fixture runners, the command line and the
tests' parametrisation all read these descriptions; nothing else branches on a variant's name.

Neutral layout: a projection is y = x W + b with W of shape (in, out) and b of shape (out,).
Multi-head projections keep the heads as contiguous blocks of the output axis (head h owns
columns h·Dh … (h+1)·Dh − 1); the wrapper's independent heads are stacked on a leading axis.

Shape legend: B batch, L sequence length (Lq queries, Lk keys), N heads, d_* feature widths.

Why one room of about 700 lines: it is one table (the ten variants, each a ``Variant`` beside the
shape and input functions it names) and the few functions every reader of the table shares;
split, a variant's description would sit in two places. Grouped-query attention's position
terms, which grow with each family of relative positions, are checked and shaped in
golden.specification.position_terms (its ``Arg`` checks and ``position_shapes``), the checks of
one value every variant shares in golden.specification.settings. What a description is
(``Arg``, ``Input``, ``Variant``) is golden.specification.description's; the recurrent token
mixers' descriptions are golden.specification.recurrent's, found here by ``lookup`` and
``described`` beside the attention variants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from golden.specification.description import (REQUIRED, Arg, Input, Variant,  # noqa: F401
                                              check_param_shapes)
from golden.specification.outputs import (check_output_gate, check_output_norm, gate_kind,
                                          output_shapes)
from golden.specification import recurrent
from golden.specification.indexer import (block_shapes, check_index_blocks,
                                          check_index_query, check_index_rope,
                                          check_index_rope_dims, check_index_scale,
                                          check_index_select, check_index_mask,
                                          check_local_blocks, index_shapes)
from golden.specification.position_terms import (
    check_alibi,
    check_alibi_bias_max,
    check_bucket_rule,
    check_input_norm,
    check_relative_positions,
    check_sliding_window,
    input_norm_shapes,
    position_shapes,
)
from golden.specification.settings import epsilon, positive, positive_or_none
from golden.specification.temperature import (TEMPERATURE_FIELDS, check_temperature,
                                              temperature_shapes)
from golden.specification.validate import (
    check_attention_args,
    check_chunk_size,
    check_context_inputs,
    check_cross_inputs,
    check_decoder_inputs,
    check_flags,
    check_latent_inputs,
    check_positive_or_none,
    check_rate,
    check_scale,
    check_self_inputs,
    rope_axis_count,
    rope_settings,
    rotary_dims,
    window,
)



# one validator per kind of argument, shared with the core (golden.specification.validate)
_rate = check_rate
_scale = check_scale


def _flag(name, b) -> None:
    check_flags(**{name: b})


def _window(name, w) -> None:
    window(w)  # raises naming local_window_size


def _rope_parameters(name, p) -> None:
    theta = None if isinstance(p, Mapping) and "rope_theta" in p else 10000.0
    rope_settings(theta, p)  # a dict (or None) of known, valid fields


def _rotary_fraction(name, x) -> None:
    rope_settings(1.0, None, x)  # a number in (0, 1]


def _rope_precision(name, x) -> None:
    rope_settings(None, None, 1.0, x)  # "exact" or "hf"


# ---- parameter shapes -------------------------------------------------------------------------

def _qkv(prefix, d_q_in, d_kv_in, d_k, d_v, qkv_bias):
    """Shapes of the query, key and value projections (weights, then biases)."""
    shapes = {"W_query": prefix + (d_q_in, d_k), "W_key": prefix + (d_kv_in, d_k),
              "W_value": prefix + (d_kv_in, d_v)}
    if qkv_bias:
        shapes.update({"b_query": prefix + (d_k,), "b_key": prefix + (d_k,),
                       "b_value": prefix + (d_v,)})
    return shapes


def _d_v(c) -> int:
    """The value width: d_v, which defaults to d_k."""
    return c["d_k"] if c["d_v"] is None else c["d_v"]


def _one_head_shapes(c):
    return _qkv((), c["d_in"], c["d_in"], c["d_k"], _d_v(c), c["qkv_bias"])


def _cross_shapes(c):
    return _qkv((), c["d_q_in"], c["d_kv_in"], c["d_k"], _d_v(c), c["qkv_bias"])


def _wrapper_shapes(c):
    n, d_head = c["num_heads"], c["d_head"]
    shapes = _qkv((n,), c["d_in"], c["d_in"], d_head, d_head, c["qkv_bias"])
    if c["out_proj"]:
        shapes.update({"W_out": (n * d_head, n * d_head), "b_out": (n * d_head,)})
    return shapes


def _multi_head_shapes(c):
    n, d_out = c["num_heads"], c["d_out"]
    if d_out % n:
        raise ValueError(f"d_out should be divisible by num_heads = {n}, got {d_out}")
    shapes = _qkv((), c["d_in"], c["d_in"], d_out, d_out, c["qkv_bias"])
    shapes["W_out"] = (d_out, d_out)
    if c["out_bias"]:
        shapes["b_out"] = (d_out,)
    return shapes


def head_dim(c) -> int:
    """GroupedQueryAttention's head width Dh: head_dim, which defaults to d_in // num_heads."""
    return c["d_in"] // c["num_heads"] if c["head_dim"] is None else c["head_dim"]


def value_dim(c) -> int:
    """GroupedQueryAttention's value head width Dv: v_head_dim, which defaults to Dh."""
    return head_dim(c) if c.get("v_head_dim") is None else c["v_head_dim"]


# The QK norms in use (golden.reference.qk_norm_stage): kind -> (the weight's shape for
# ``heads`` heads of width Dh, or None for no weight; an example family).
QK_NORMS = {
    "rms": (lambda heads, dh: (dh,), "Qwen3: RMSNorm per head before RoPE, one weight (Dh,)"),
    "rms_one_plus": (lambda heads, dh: (dh,), "Gemma 3, Qwen3-Next: RMSNorm · (1 + w) per head"),
    "rms_across_heads": (lambda heads, dh: (heads * dh,),
                         "OLMo 2: RMSNorm over all heads' features (N·Dh,) before the split"),
    "layer": (lambda heads, dh: (heads, dh),
              "Cohere, StableLM: LayerNorm per head, no bias, weights (N, Dh)"),
    "layer_with_bias": (lambda heads, dh: (heads, dh),
                        "Chameleon: LayerNorm per head, weights and biases (N, Dh) each"),
    "l2": (lambda heads, dh: None, "Llama 4: RMS normalisation without weight, after RoPE"),
    "rms_after_rope": (lambda heads, dh: (dh,),
                       "HunYuan v1: RMSNorm per head after RoPE, one weight (Dh,)"),
}
# The QK norms that run after RoPE (the others before it).
AFTER_ROPE = ("l2", "rms_after_rope")
# The QK norms with a bias besides the weight (q_norm_bias, k_norm_bias: the weight's shapes).
BIASED_QK_NORMS = ("layer_with_bias",)


def _qk_norm(name, kind) -> None:
    if kind is not None and kind not in QK_NORMS:
        raise ValueError(f"{name} should be None or one of {', '.join(map(repr, QK_NORMS))}, "
                         f"got {kind!r}")


# MultiHeadCrossAttention's QK norms: per head over Dh, q from x and k from the context (Mllama's
# cross-attention layers, BLT's).
CROSS_QK_NORMS = ("rms",)


def _cross_qk_norm(name, kind) -> None:
    if kind is not None and kind not in CROSS_QK_NORMS:
        raise ValueError(f"{name} should be None or one of {', '.join(map(repr, CROSS_QK_NORMS))} "
                         f"(MultiHeadCrossAttention: RMSNorm per head, weights (Dh,), as Mllama's "
                         f"cross-attention layers), got {kind!r}")


def _grouped_query_shapes(c):
    h, hkv, dh = c["num_heads"], c["num_kv_heads"], head_dim(c)
    if h % hkv:
        raise ValueError(f"num_kv_heads should divide num_heads = {h}, got {hkv}")
    if dh == 0:
        raise ValueError(f"head_dim should be given when d_in < num_heads (d_in // num_heads "
                         f"= 0), got d_in = {c['d_in']}, num_heads = {h}")
    if c["rope_theta"] is not None and dh % 2:
        raise ValueError(f"head_dim should be even with rotary embeddings (rope_theta), "
                         f"got {dh}")
    rope = rope_settings(c["rope_theta"], c["rope_parameters"], c["partial_rotary_factor"],
                         c["rope_precision"])
    rotary = 0 if rope is None else rotary_dims(dh, rope)
    d_out = c["d_in"] if c["d_out"] is None else c["d_out"]
    if c["clip_qkv_after_norm"] and (c["clip_qkv"] is None or c["qk_norm"] is None
                                     or c["qk_norm"] in AFTER_ROPE):
        raise ValueError(f"clip_qkv_after_norm should be False unless clip_qkv is set and "
                         f"qk_norm is one before RoPE (OLMoE: its q and k clamped after their "
                         f"norm), got True with clip_qkv = {c['clip_qkv']!r}, qk_norm = "
                         f"{c['qk_norm']!r}")
    dv = value_dim(c)
    if c["k_eq_v"] and dv != dh:
        raise ValueError(f"v_head_dim should be None or head_dim = {dh} with k_eq_v (the values "
                         f"are the keys' projection), got {c['v_head_dim']}")
    shapes = {"W_query": (c["d_in"], h * dh), "W_key": (c["d_in"], hkv * dh),
              "W_value": (c["d_in"], hkv * dv), "W_out": (h * dv, d_out)}
    if c["qkv_bias"]:
        shapes.update({"b_query": (h * dh,), "b_key": (hkv * dh,), "b_value": (hkv * dv,)})
    shapes.update(output_shapes(c, h, dv))  # the output gate's and the output norm's: values
    shapes.update(temperature_shapes(c))  # the learned query temperature's
    if c["k_eq_v"]:  # Gemma 4's full layers: no value projection, V is the key's
        shapes.pop("W_value")
        shapes.pop("b_value", None)
    if c["out_bias"]:
        shapes["b_out"] = (d_out,)
    if c["qk_norm"] is not None and QK_NORMS[c["qk_norm"]][0](h, dh) is not None:
        shapes["q_norm"] = QK_NORMS[c["qk_norm"]][0](h, dh)
        shapes["k_norm"] = QK_NORMS[c["qk_norm"]][0](hkv, dh)
    if c["qk_norm"] in BIASED_QK_NORMS:  # Chameleon: each head's norm has a bias
        shapes["q_norm_bias"], shapes["k_norm_bias"] = shapes["q_norm"], shapes["k_norm"]
    shapes.update(block_shapes(c, rotary))  # MiniMax M3's, Qwen4-Exp's block indexer
    if c.get("kv_shared"):  # Gemma 4's, Gemma 3n's reusing layers: the storing layer's k and v
        _check_kv_shared(c)
        for name in ("W_key", "b_key", "W_value", "b_value", "k_norm", "k_norm_bias"):
            shapes.pop(name, None)
    if c.get("merged_context"):  # T5Gemma 2's decoder: the context through W_key and W_value
        _check_merged(c)
    if c["sinks"]:
        shapes["sinks"] = (h,)
    shapes.update(position_shapes(c, h, dh))
    shapes.update(input_norm_shapes(c))
    return shapes


def _check_kv_shared(c) -> None:
    """kv_shared (a layer that attends with another layer's cached keys and values): the
    settings that shape keys and values (k_eq_v, v_norm, value_scale) are the storing layer's,
    so the reusing layer refuses them rather than ignore them."""
    for name, idle in (("k_eq_v", False), ("v_norm", False), ("value_scale", None)):
        if c[name] != idle:
            raise ValueError(f"{name} should be {idle!r} with kv_shared=True (the keys and values "
                             f"are the storing layer's cache, made with its own {name}), got "
                             f"{c[name]!r}")


MERGED_IDLE = (("causal", True), ("sinks", False), ("attention_chunk_size", None),
               ("query_temperature", None), ("output_gate", False), ("alibi", None),
               ("relative_attention_num_buckets", None), ("clip_qkv", None), ("v_norm", False),
               ("k_eq_v", False), ("relative_positions", None), ("input_norm", None),
               ("output_norm", None), ("v_head_dim", None), ("value_scale", None),
               ("kv_shared", False))
MERGED_QK_NORMS = (None, "rms", "rms_one_plus", "layer")


def _check_merged(c) -> None:
    """merged_context (T5Gemma 2's decoder: one softmax over the decoder's own keys and the
    context's, both from W_key and W_value): the options it was built and tested with are RoPE,
    a per-head QK norm before RoPE (k_norm on the context's keys too, which take no RoPE),
    scale, softcap, sliding_window, the biases, head_dim, d_out and dropout; every other one
    is refused rather than given a meaning no family has tested."""
    for name, idle in MERGED_IDLE:
        if c[name] != idle:
            raise ValueError(f"{name} should be {idle!r} with merged_context=True (T5Gemma 2's "
                             f"merged self- and cross-attention has none), got {c[name]!r}")
    if c["sliding_window"] is not None and not isinstance(c["sliding_window"], int):
        raise ValueError(f"sliding_window should be None or an int W with merged_context=True "
                         f"(the decoder's W keys; the context is never windowed), got "
                         f"{c['sliding_window']!r}")
    if c["qk_norm"] not in MERGED_QK_NORMS:
        raise ValueError(f"qk_norm should be one of {MERGED_QK_NORMS} with merged_context=True "
                         f"(a per-head norm before RoPE, which the context's keys share), got "
                         f"{c['qk_norm']!r}")


def cross_sizes(c) -> dict:
    """MultiHeadCrossAttention's sizes: Nkv (default N), Dh (default d_in // N), d_out (default
    d_in) and whether the key projection has a bias (key_bias, default qkv_bias)."""
    h = c["num_heads"]
    hkv = h if c["num_kv_heads"] is None else c["num_kv_heads"]
    dh = c["d_in"] // h if c["head_dim"] is None else c["head_dim"]
    if h % hkv:
        raise ValueError(f"num_kv_heads should divide num_heads = {h}, got {hkv}")
    if dh == 0:
        raise ValueError(f"head_dim should be given when d_in < num_heads (d_in // num_heads "
                         f"= 0), got d_in = {c['d_in']}, num_heads = {h}")
    key_bias = c["qkv_bias"] if c["key_bias"] is None else c["key_bias"]
    return dict(num_kv_heads=hkv, head_dim=dh, d_out=c["d_in"] if c["d_out"] is None
                else c["d_out"], key_bias=key_bias)


def _multi_head_cross_shapes(c):
    s, h = cross_sizes(c), c["num_heads"]
    hkv, dh = s["num_kv_heads"], s["head_dim"]
    shapes = {"W_query": (c["d_in"], h * dh), "W_key": (c["d_context"], hkv * dh),
              "W_value": (c["d_context"], hkv * dh), "W_out": (h * dh, s["d_out"])}
    if c["qkv_bias"]:
        shapes.update({"b_query": (h * dh,), "b_value": (hkv * dh,)})
    if s["key_bias"]:
        shapes["b_key"] = (hkv * dh,)
    if c["out_bias"]:
        shapes["b_out"] = (s["d_out"],)
    if c["qk_norm"] is not None:  # per head: q's from x, k's from the context
        shapes["q_norm"] = shapes["k_norm"] = QK_NORMS[c["qk_norm"]][0](h, dh)
    return shapes


def _value_scale(name, s) -> None:
    """None or a finite number other than 0 (the values times it)."""
    if s is not None:
        check_scale(name, s)
        if s == 0:
            raise ValueError(f"{name} should be None or a finite number other than 0, got {s!r}")


def _flag_or_none(name, b) -> None:
    if b is not None:
        _flag(name, b)


QUERY_LATENTS = ("normed", "normed_and_raw")


def check_query_latent(name, value) -> None:
    """MultiHeadLatentAttention's query input: "normed" RMSNorm(c_q) (DeepSeek's), or
    "normed_and_raw" [RMSNorm(c_q) | c_q] (AXK2's, which its output gate reads too)."""
    if value not in QUERY_LATENTS:
        raise ValueError(f"{name} should be one of {', '.join(map(repr, QUERY_LATENTS))}, got "
                         f"{value!r}")


def latent_rope(c):
    """MultiHeadLatentAttention's RoPE settings (golden.specification.validate.rope_settings): θ
    from
    rope_theta or rope_parameters, 10000 (Hugging Face's default) when neither gives one."""
    theta, given = c["rope_theta"], c["rope_parameters"] or {}
    if theta is None and "rope_theta" not in given:
        theta = 10000.0
    return rope_settings(theta, c["rope_parameters"])


def latent_sizes(c) -> dict:
    """MultiHeadLatentAttention's sizes: qk_head_dim Dk = qk_nope_head_dim + qk_rope_head_dim,
    d_out (default d_in), and the softmax scale's mscale factor (Hugging Face's
    yarn_apply_mscale: mscale(s, mscale_all_dim)² with mscale(s, a) = 0.1·a·ln s + 1 (1 for
    s ≤ 1) when rope_parameters are yarn with mscale_all_dim, else 1) as (factor s, a) or
    None."""
    if c["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim should be even (RoPE turns pairs), got "
                         f"{c['qk_rope_head_dim']}")
    rope = dict(latent_rope(c))
    rotary_dims(c["qk_rope_head_dim"], latent_rope(c))
    mscale = ((rope["factor"], rope["mscale_all_dim"]) if rope["rope_type"] == "yarn"
              and rope.get("mscale_all_dim") else None)
    return dict(qk_head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
                d_out=c["d_in"] if c["d_out"] is None else c["d_out"], mscale=mscale)


def latent_scale(c) -> float:
    """The softmax scale of MultiHeadLatentAttention: ``scale``, or Dk^−1/2 times the yarn
    mscale² (latent_sizes), as Hugging Face's DeepseekV3Attention.scaling."""
    if c["scale"] is not None:
        return float(c["scale"])
    s = latent_sizes(c)
    scale = s["qk_head_dim"] ** -0.5
    if s["mscale"] is not None and s["mscale"][0] > 1:
        m = 0.1 * s["mscale"][1] * math.log(s["mscale"][0]) + 1.0
        scale = scale * m * m
    return scale


def _latent_shapes(c):
    if not c["rope"] and (c["rope_theta"] is not None or c["rope_parameters"] is not None):
        raise ValueError(f"rope_theta and rope_parameters should be None with rope=False (no "
                         f"rotary embedding: Kimi Linear's latent attention), got "
                         f"{c['rope_theta']!r} and {c['rope_parameters']!r}")
    s, n = latent_sizes(c), c["num_heads"]
    nope, rope, dv, r = (c[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                         "kv_lora_rank"))
    shapes = {"W_kv_a": (c["d_in"], r + rope), "kv_a_norm": (r,),
              "W_kv_b": (r, n * (nope + dv)), "W_out": (n * dv, s["d_out"])}
    both = c["query_latent"] == "normed_and_raw"  # AXK2's: W_q_b reads [RMSNorm(c_q) | c_q]
    if both and c["q_lora_rank"] is None:
        raise ValueError("query_latent should be 'normed' without q_lora_rank (there is no "
                         "query latent c_q to read raw), got 'normed_and_raw'")
    if c["q_lora_rank"] is None:
        shapes["W_query"] = (c["d_in"], n * s["qk_head_dim"])
    else:
        shapes.update({"W_q_a": (c["d_in"], c["q_lora_rank"]), "q_a_norm": (c["q_lora_rank"],),
                       "W_q_b": ((2 if both else 1) * c["q_lora_rank"],
                                 n * s["qk_head_dim"])})
    if c["rope_key_norm"]:  # dots3's RMSNorm of the shared rotary key, before RoPE
        shapes["k_pe_norm"] = (rope,)
    if c["attention_bias"]:
        shapes.update({"b_kv_a": (r + rope,), "b_out": (s["d_out"],)})
        if c["q_lora_rank"] is not None:
            shapes["b_q_a"] = (c["q_lora_rank"],)
    shapes.update(temperature_shapes(c))  # the learned query temperature's
    gate = gate_kind(c["output_gate"])  # HY-V4's per feature, Ling 3.0's per head; no bias
    if gate is not None:  # from x, or (AXK2's) from the query's input [RMSNorm(c_q) | c_q]
        shapes["W_gate"] = (2 * c["q_lora_rank"] if both else c["d_in"], n if gate[1] else n * dv)
    if c["sinks"]:  # HY-V4's: one logit per head in every softmax row
        shapes["sinks"] = (n,)
    if c["sliding_window"] is not None and c["index_topk"] is not None:
        raise ValueError(f"sliding_window should be None with index_topk (the indexer chooses "
                         f"among every key the query may see, no family windows it), got "
                         f"{c['sliding_window']!r}")
    shapes.update(index_shapes(c))  # DeepSeek-V3.2's indexer (golden.specification.indexer)
    return shapes


# ---- input checks: (config, arrays, dropout rate in force) -> weights shape ------------------

def _core_inputs(c, i, rate):
    return check_attention_args(i["query"], i["key"], i["value"], i.get("mask"), i.get("bias"),
                                scale=c["scale"], softcap=c["softcap"],
                                local_window_size=c["local_window_size"],
                                query_offset=i.get("query_offset"),
                                query_seq_lengths=i.get("query_seq_lengths"),
                                key_value_seq_lengths=i.get("key_value_seq_lengths"),
                                dropout_rate=c["dropout_rate"], dropout_mask=i.get("dropout_mask"),
                                sinks=i.get("sinks"),
                                attention_chunk_size=c["attention_chunk_size"])


def _self_inputs(c, i, rate):
    return check_self_inputs(i["x"], c.get("d_in"), i.get("mask"), i.get("dropout_mask"),
                             heads=c.get("num_heads"), rate=rate)


def _decoder_inputs(c, i, rate):
    if c.get("index_blocks") is not None:  # one visible set per query, as Hugging Face's mask[:, 0]
        check_index_mask(i.get("mask"), np.shape(i["x"])[:-2], "index_blocks")
    return check_decoder_inputs(i["x"], c["d_in"], i.get("mask"), i.get("dropout_mask"),
                                i.get("query_seq_lengths"), heads=c["num_heads"], rate=rate,
                                positions=i.get("positions"),
                                axes=rope_axis_count(rope_settings(
                                    c["rope_theta"], c["rope_parameters"],
                                    c["partial_rotary_factor"])),
                                temperature=c.get("query_temperature") is not None,
                                merged=bool(c.get("merged_context")), context=i.get("context"),
                                context_mask=i.get("context_mask"))


def _cross_inputs(c, i, rate):
    return check_cross_inputs(i["x_q"], i["x_kv"], i.get("x_v"), c["d_q_in"], c["d_kv_in"],
                              i.get("mask"))


def _context_inputs(c, i, rate):
    s = cross_sizes(c)
    return check_context_inputs(i["x"], i["context"], c["d_in"], c["d_context"], i.get("mask"),
                                i.get("context_lengths"), heads=c["num_heads"],
                                kv_heads=s["num_kv_heads"], head_dim=s["head_dim"])


def _latent_inputs(c, i, rate):
    shape = check_latent_inputs(i["x"], c["d_in"], i.get("mask"), i.get("query_seq_lengths"),
                                heads=c["num_heads"], positions=i.get("positions"))
    if c["index_topk"] is not None:
        check_index_mask(i.get("mask"), shape[:-3])
    return shape


# ---- the variants -----------------------------------------------------------------------------

SDPA = "scaled_dot_product_attention"
QKV_LAYERS = {"query": "W_query", "key": "W_key", "value": "W_value"}

_VARIANTS = [
    Variant(SDPA, None,
            (Arg("is_causal", _flag, False), Arg("scale", _scale, None),
             Arg("softcap", check_positive_or_none, None), Arg("local_window_size", _window, None),
             Arg("attention_chunk_size", check_chunk_size, None),
             Arg("dropout_rate", _rate, 0.0)),
            shapes=lambda c: {}, check_inputs=_core_inputs,
            inputs=(Input("query", None), Input("key", None, "key"),
                    Input("value", None, "key")),
            call_names=("bias",), dropout=True),
    Variant("simple_self_attention", "SimpleSelfAttention", (),
            shapes=lambda c: {}, check_inputs=_self_inputs, inputs=(Input("x", None),)),
    Variant("self_attention", "SelfAttention",
            (Arg("d_in", positive), Arg("d_k", positive), Arg("d_v", positive_or_none, None),
             Arg("qkv_bias", _flag, False)),
            shapes=_one_head_shapes, check_inputs=_self_inputs, layers=QKV_LAYERS,
            sample=dict(d_in=5, d_k=4, d_v=6, qkv_bias=True)),
    Variant("causal_self_attention", "CausalSelfAttention",
            (Arg("d_in", positive), Arg("d_k", positive), Arg("d_v", positive_or_none, None),
             Arg("dropout", _rate, 0.0), Arg("qkv_bias", _flag, False)),
            shapes=_one_head_shapes, check_inputs=_self_inputs, dropout=True, layers=QKV_LAYERS,
            sample=dict(d_in=5, d_k=3, d_v=4, dropout=0.3)),
    Variant("cross_attention", "CrossAttention",
            (Arg("d_q_in", positive), Arg("d_kv_in", positive), Arg("d_k", positive),
             Arg("d_v", positive_or_none, None), Arg("qkv_bias", _flag, False)),
            shapes=_cross_shapes, check_inputs=_cross_inputs,
            inputs=(Input("x_q", "d_q_in"), Input("x_kv", "d_kv_in", "key"),
                    Input("x_v", "d_kv_in", "key", optional=True)),
            layers=QKV_LAYERS, sample=dict(d_q_in=5, d_kv_in=3, d_k=4, d_v=6, qkv_bias=True)),
    Variant("multi_head_attention_wrapper", "MultiHeadAttentionWrapper",
            (Arg("d_in", positive), Arg("d_head", positive), Arg("num_heads", positive),
             Arg("causal", _flag, False), Arg("dropout", _rate, 0.0),
             Arg("qkv_bias", _flag, False), Arg("out_proj", _flag, False)),
            shapes=_wrapper_shapes, check_inputs=_self_inputs, dropout=True,
            layers={"query": "heads.*.W_query", "key": "heads.*.W_key",
                    "value": "heads.*.W_value", "out": "out_proj"},
            sample=dict(d_in=5, d_head=2, num_heads=3, causal=True, dropout=0.1, qkv_bias=True,
                        out_proj=True)),
    Variant("multi_head_attention", "MultiHeadAttention",
            (Arg("d_in", positive), Arg("d_out", positive), Arg("num_heads", positive),
             Arg("causal", _flag, False), Arg("dropout", _rate, 0.0),
             Arg("qkv_bias", _flag, False), Arg("out_bias", _flag, True)),
            shapes=_multi_head_shapes, check_inputs=_self_inputs, dropout=True,
            layers={**QKV_LAYERS, "out": "out_proj"},
            sample=dict(d_in=5, d_out=12, num_heads=3, causal=True, dropout=0.2, qkv_bias=True)),
    Variant("grouped_query_attention", "GroupedQueryAttention",
            (Arg("d_in", positive), Arg("num_heads", positive), Arg("num_kv_heads", positive),
             Arg("head_dim", positive_or_none, None), Arg("d_out", positive_or_none, None),
             Arg("qkv_bias", _flag, False), Arg("out_bias", _flag, False),
             Arg("causal", _flag, True), Arg("scale", _scale, None),
             Arg("softcap", check_positive_or_none, None),
             Arg("sliding_window", check_sliding_window, None),
             Arg("rope_theta", check_positive_or_none, None),
             Arg("rope_interleaved", _flag, False), Arg("dropout", _rate, 0.0),
             Arg("qk_norm", _qk_norm, None), Arg("qk_norm_eps", epsilon, 1e-6),
             Arg("sinks", _flag, False), Arg("attention_chunk_size", positive_or_none, None),
             Arg("query_temperature", check_temperature, None),
             Arg("output_gate", check_output_gate, False),
             Arg("rope_parameters", _rope_parameters, None),
             Arg("partial_rotary_factor", _rotary_fraction, 1.0),
             Arg("rope_precision", _rope_precision, "exact"), Arg("alibi", check_alibi, None),
             Arg("alibi_bias_max", check_alibi_bias_max, 8),
             Arg("relative_attention_num_buckets", positive_or_none, None),
             Arg("relative_attention_max_distance", positive, 128),
             Arg("relative_attention_buckets", check_bucket_rule, "t5"),
             Arg("clip_qkv", check_positive_or_none, None), Arg("v_norm", _flag, False),
             Arg("k_eq_v", _flag, False),
             Arg("relative_positions", check_relative_positions, None),
             Arg("relative_max_distance", positive_or_none, None),
             Arg("input_norm", check_input_norm, None), Arg("input_norm_eps", epsilon, 1e-5),
             Arg("key_scale", check_positive_or_none, None),
             Arg("output_norm", check_output_norm, None), Arg("output_norm_eps", epsilon, 1e-6),
             Arg("gate_bias", _flag_or_none, None), Arg("v_head_dim", positive_or_none, None),
             Arg("value_scale", _value_scale, None),
             Arg("clip_qkv_after_norm", _flag, False), Arg("kv_shared", _flag, False),
             Arg("merged_context", _flag, False),
             # the block indexer (issue 44 part 4): the reference's, not yet the twins'
             Arg("index_blocks", check_index_blocks, None),
             Arg("index_heads", positive_or_none, None),
             Arg("index_head_dim", positive_or_none, None),
             Arg("index_block_size", positive_or_none, None),
             Arg("index_topk_blocks", positive_or_none, None),
             Arg("index_local_blocks", check_local_blocks, 0),
             Arg("index_norm_eps", epsilon, 1e-6)),
            shapes=_grouped_query_shapes, check_inputs=_decoder_inputs, dropout=True,
            layers={**QKV_LAYERS, "out": "out_proj", "gate": "W_gate", "pos": "W_pos",
                    "index_q": "W_index_q", "index_k": "W_index_k"},  # the block indexer's
            vectors=("q_norm", "k_norm", "q_norm_bias", "k_norm_bias", "sinks",
                     "relative_attention_bias", "bias_u",
                     "bias_v", "relative_key_table", "input_norm_weight", "input_norm_bias",
                     "per_dim_scale", "output_norm_weight", "temperature_scale",
                     "temperature_bias", "index_q_norm", "index_k_norm"),
            sample=dict(d_in=5, num_heads=6, num_kv_heads=2, head_dim=4, d_out=3, qkv_bias=True,
                        out_bias=True, rope_theta=100.0, dropout=0.1)),
    Variant("multi_head_cross_attention", "MultiHeadCrossAttention",
            (Arg("d_in", positive), Arg("d_context", positive), Arg("num_heads", positive),
             Arg("num_kv_heads", positive_or_none, None),
             Arg("head_dim", positive_or_none, None), Arg("d_out", positive_or_none, None),
             Arg("qkv_bias", _flag, False), Arg("key_bias", _flag_or_none, None),
             Arg("out_bias", _flag, False), Arg("scale", _scale, None),
             Arg("qk_norm", _cross_qk_norm, None), Arg("qk_norm_eps", epsilon, 1e-6),
             Arg("softcap", check_positive_or_none, None)),
            shapes=_multi_head_cross_shapes, check_inputs=_context_inputs,
            inputs=(Input("x", "d_in"), Input("context", "d_context", "key")),
            layers={**QKV_LAYERS, "out": "out_proj"}, vectors=("q_norm", "k_norm"),
            sample=dict(d_in=5, d_context=3, num_heads=4, num_kv_heads=2, head_dim=6, d_out=7,
                        qkv_bias=True, key_bias=False, out_bias=True, scale=0.3, qk_norm="rms",
                        softcap=2.0)),
    Variant("multi_head_latent_attention", "MultiHeadLatentAttention",
            (Arg("d_in", positive), Arg("num_heads", positive), Arg("kv_lora_rank", positive),
             Arg("qk_nope_head_dim", positive), Arg("qk_rope_head_dim", positive),
             Arg("v_head_dim", positive), Arg("q_lora_rank", positive_or_none, None),
             Arg("d_out", positive_or_none, None), Arg("attention_bias", _flag, False),
             Arg("rms_norm_eps", epsilon, 1e-6),
             Arg("rope_theta", check_positive_or_none, None),
             Arg("rope_parameters", _rope_parameters, None),
             Arg("rope_interleaved", _flag, True), Arg("causal", _flag, True),
             Arg("scale", _scale, None), Arg("query_temperature", check_temperature, None),
             Arg("rope", _flag, True), Arg("sinks", _flag, False),
             Arg("output_gate", check_output_gate, False),
             Arg("rope_key_norm", _flag, False),
             Arg("query_latent", check_query_latent, "normed"),
             Arg("sliding_window", check_sliding_window, None),
             Arg("index_topk", positive_or_none, None),
             Arg("index_heads", positive_or_none, None),
             Arg("index_head_dim", positive_or_none, None),
             Arg("index_rope", check_index_rope, "half"),
             Arg("index_rope_dims", check_index_rope_dims, "first"),
             Arg("index_query", check_index_query, "latent"),
             Arg("index_temperature", _flag, False),
             Arg("index_scale", check_index_scale, "scores"),
             Arg("index_norm_eps", epsilon, 1e-6),
             Arg("index_select", check_index_select, "tokens")),
            shapes=_latent_shapes, check_inputs=_latent_inputs,
            layers={"query": "W_query", "q_a": "W_q_a", "q_b": "W_q_b", "kv_a": "W_kv_a",
                    "kv_b": "W_kv_b", "out": "out_proj", "gate": "W_gate",
                    "index_q": "W_index_q", "index_k": "W_index_k",
                    "index_weights": "W_index_weights"},
            vectors=("q_a_norm", "kv_a_norm", "k_pe_norm", "temperature_scale",
                     "temperature_bias", "sinks",
                     "index_k_norm", "index_k_norm_bias", "index_q_norm", "index_q_norm_bias",
                     "index_temperature_scale", "index_temperature_bias"),
            sample=dict(d_in=5, num_heads=3, kv_lora_rank=7, qk_nope_head_dim=2,
                        qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=9, d_out=8,
                        attention_bias=True, rope_theta=100.0)),
]

VARIANTS = {v.name: v for v in _VARIANTS}
MODULES = [v for v in _VARIANTS if v.is_module]  # the variants that are classes


def get(name) -> Variant:
    """The description of a variant by name; ValueError listing the known ones otherwise."""
    if name not in VARIANTS:
        raise ValueError(f"variant should be one of {', '.join(VARIANTS)}, got {name!r}")
    return VARIANTS[name]


def lookup(name) -> Variant:
    """The description of a fixture's variant: an attention variant (``get``) or a recurrent
    token mixer (golden.specification.recurrent.MIXERS, kept out of VARIANTS: no attention
    weights); ValueError listing both otherwise."""
    if name in recurrent.MIXERS:
        return recurrent.MIXERS[name]
    if name not in VARIANTS:
        raise ValueError(f"variant should be one of {', '.join([*VARIANTS, *recurrent.MIXERS])}"
                         f", got {name!r}")
    return VARIANTS[name]


def module_variant(name) -> Variant:
    """Like ``get``, for a variant that is a module class (what ``build`` makes)."""
    if name not in VARIANTS or not VARIANTS[name].is_module:
        raise ValueError(f"variant should be one of {', '.join(v.name for v in MODULES)}, "
                         f"got {name!r}")
    return VARIANTS[name]


def check_defaults(variant, config, supported, target) -> None:
    """ValueError naming the first argument of ``variant`` outside ``supported`` that ``config``
    sets to other than its default: an option ``target`` (another library's module) lacks."""
    for arg in VARIANTS[variant].args:
        if arg.name not in supported and config.get(arg.name, arg.default) != arg.default:
            raise ValueError(f"{arg.name} should be {arg.default!r} for {target}, which has no "
                             f"such option, got {config.get(arg.name)!r}")


# Configuration values that are dicts (query_temperature), and the lists inside them, as
# hashable values: a JAX module's configuration is static under jit, and jit hashes it.
@dataclass(frozen=True)
class Frozen:
    """A dict (``items``: its (key, frozen value) pairs, sorted) or a list inside one
    (``items``: its frozen values); not a pytree, so JAX and NNX keep it whole and static."""

    kind: str  # "dict" or "list"
    items: tuple


def freeze(value):
    """``value`` hashable: dicts, and the lists inside them, as Frozen."""
    if isinstance(value, dict):
        return Frozen("dict", tuple((k, freeze(v)) for k, v in sorted(value.items())))
    return Frozen("list", tuple(freeze(v) for v in value)) if isinstance(value, list) else value


def thaw(value):
    """The inverse of ``freeze``."""
    if not isinstance(value, Frozen):
        return value
    if value.kind == "dict":
        return {k: thaw(v) for k, v in value.items}
    return [thaw(v) for v in value.items]


# ---- a module's layers, for either framework --------------------------------------------------

def _resolve(module, path):
    """The layers at an attribute path: [layer], [] when it is None, one per head for "*"."""
    found = [module]
    for part in path.split("."):
        found = [x for f in found for x in f] if part == "*" else [getattr(f, part) for f in found]
    return [f for f in found if f is not None]


def described(module) -> Variant:
    """The description of a torch_attn or jax_attn module: its ``variant`` among VARIANTS'
    modules, or among the recurrent mixers (golden.specification.recurrent.MIXERS)."""

    variant = getattr(module, "variant", None)
    if variant in VARIANTS and VARIANTS[variant].is_module:
        return VARIANTS[variant]
    if variant in recurrent.MIXERS:
        return recurrent.MIXERS[variant]
    raise ValueError(f"module should be a torch_attn or jax_attn variant, "
                     f"got {type(module).__name__}")


def projections(module) -> dict:
    """{role: ([layer, ...], stacked)} for a torch_attn or jax_attn module."""
    out = {}
    for role, path in described(module).layers.items():
        layers = _resolve(module, path)
        if layers:
            out[role] = (layers, "*" in path)
    return out


# The value of a vector parameter that changes nothing, where it is not 0: a norm's weight (QK
# norms' 1, or 0 for the "rms_one_plus" norms, which multiply by 1 + w; the input norm's 1).
def vector_starts(variant, config) -> dict:
    """{name: (shape, its start value)} of every vector parameter of the variant (its
    ``vectors``) that the configuration has, each at the value that changes nothing: what a
    twin's module holds when built."""
    shapes = VARIANTS[variant].shapes(config)
    norm = 0.0 if config.get("qk_norm") == "rms_one_plus" else 1.0
    starts = {"q_norm": norm, "k_norm": norm, "input_norm_weight": 1.0,
              "output_norm_weight": 1.0, "temperature_bias": 1.0,  # factor 0·ln(p + 1) + 1
              "index_k_norm": 1.0, "index_q_norm": 1.0, "index_temperature_bias": 1.0,
              "k_pe_norm": 1.0}
    return {n: (shapes[n], starts.get(n, 0.0)) for n in VARIANTS[variant].vectors if n in shapes}


def _vectors(module) -> dict:
    """{name: the module's array} for the variant's ``vectors`` the module holds (not None)."""
    held = ((n, getattr(module, n, None)) for n in described(module).vectors)
    return {n: a for n, a in held if a is not None}


def export_layers(module, weight, bias, vector, *, xp=np) -> dict:
    """Neutral-layout parameters: ``weight(layer)`` gives W as (in, out), ``bias(layer)`` gives
    b or None, ``vector(array)`` a plain parameter (a norm's weight, the sinks) as NumPy;
    per-head arrays of the wrapper are stacked (with ``xp.stack``: ``jax.numpy`` for traced
    arrays)."""
    out = {}
    for role, (layers, stacked) in projections(module).items():
        pick = xp.stack if stacked else (lambda arrays: arrays[0])
        out[f"W_{role}"] = pick([weight(layer) for layer in layers])
        biases = [bias(layer) for layer in layers]
        if biases[0] is not None:
            out[f"b_{role}"] = pick(biases)
    out.update({n: vector(a) for n, a in _vectors(module).items()})
    return out


def load_layers(module, params, set_weight, set_bias, set_vector, *, xp=np) -> None:
    """Check ``params`` against the module's configuration, then hand each layer its slice:
    ``set_weight(layer, W (in, out))`` and ``set_bias(layer, b)``, and each plain parameter
    ``set_vector(module's array, array)``; each taken with ``xp.asarray`` (``jax.numpy`` for
    traced arrays)."""
    found = projections(module)
    described(module).check_params(module.config, params)
    for role, (layers, stacked) in found.items():
        for i, layer in enumerate(layers):
            pick = (lambda a: xp.asarray(a)[i]) if stacked else xp.asarray
            set_weight(layer, pick(params[f"W_{role}"]))
            if f"b_{role}" in params:
                set_bias(layer, pick(params[f"b_{role}"]))
    for name, held in _vectors(module).items():
        set_vector(held, xp.asarray(params[name]))
