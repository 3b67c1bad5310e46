"""The module variants over the block (golden.reference.block): the plain core, the one-head
self-attentions, multi-head attention and its per-head wrapper, and GroupedQueryAttention,
the decoder family that composes the stages (golden.reference.stages) and position biases
(golden.reference.position_bias).

Each variant is forward(config, inputs, params) -> (output, weights, saved) and
backward(saved, d_output, d_weights) -> {input or parameter name: gradient}, registered in
golden.reference.VARIANTS. Dropout is active exactly when the inputs hold a dropout mask (the
module is in training mode). Shape legend as in golden.reference.block: B batch, N heads (Nkv
key-value heads), L sequence length, Dh head width, d_* feature widths.
"""

from __future__ import annotations

import numpy as np

from golden.specification import variants
from golden.specification.decoder import sliding_window
from golden.specification.outputs import gate_kind
from golden.reference.arithmetic import number, real
from golden.reference.block import block_backward, block_forward
from golden.reference.core import allowed_positions, sdpa_backward, sdpa_forward
from golden.reference.indexer import block_keys, selected_mask
from golden.specification.indexer import BLOCK_DEFAULTS
from golden.reference.norms import normalize, normalize_backward
from golden.reference.merged import merged_backward, merged_forward
from golden.reference.position_bias import alibi_term, relative_term
from golden.reference.rotary import rope_cos_sin
from golden.specification.positions import rope_blocks
from golden.reference.stages import (clamp_stage, learned_temperature_stage, qk_norm_stage,
                                      rope_stage,
                                      temperature_factors,
                                      temperature_stage)
from golden.specification.validate import rope_settings


def _sdpa(config, inputs, params):
    return sdpa_forward(**inputs, **config)


def _simple(config, inputs, params):
    x = inputs["x"]  # softmax(X Xᵀ) X: no weights, no scaling
    out, weights, attn = sdpa_forward(x, x, x, inputs.get("mask"), scale=1.0)
    return out, weights, attn


def _simple_backward(attn, d_out, d_weights):
    g = sdpa_backward(attn, d_out, d_weights)
    return {"x": g["query"] + g["key"] + g["value"]}


def one_head(config, inputs, params, x_q, x_k, x_v, is_causal):
    """A single head: the block with N = 1, the head axis removed from the weights."""
    keep = inputs.get("dropout_mask")
    y, weights, saved = block_forward(
        x_q, x_k, x_v, params, num_heads=1, is_causal=is_causal, mask=inputs.get("mask"),
        dropout_rate=config.get("dropout", 0.0) if keep is not None else 0.0,
        dropout_mask=None if keep is None else keep[..., None, :, :])
    return y, weights[..., 0, :, :], saved


def _self(config, inputs, params):
    x = inputs["x"]
    return one_head(config, inputs, params, x, x, x, is_causal=False)


def _causal(config, inputs, params):
    x = inputs["x"]
    return one_head(config, inputs, params, x, x, x, is_causal=True)


def _self_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights[..., None, :, :])
    g["x"] = g.pop("x_query") + g.pop("x_key") + g.pop("x_value")
    return g


def _multi_head(config, inputs, params):
    x = inputs["x"]
    train = "dropout_mask" in inputs
    return block_forward(x, x, x, params, num_heads=config["num_heads"],
                         is_causal=config.get("causal", False), mask=inputs.get("mask"),
                         dropout_rate=config.get("dropout", 0.0) if train else 0.0,
                         dropout_mask=inputs.get("dropout_mask"))


def _multi_head_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights)
    g["x"] = g.pop("x_query") + g.pop("x_key") + g.pop("x_value")
    return g


def _stacked_to_fused(name, a):
    """Wrapper layout -> block layout: W (N, in, Dh) -> (in, N·Dh); b (N, Dh) -> (N·Dh,)."""
    if name.startswith("W_") and name != "W_out":
        return np.swapaxes(a, 0, 1).reshape(a.shape[1], -1)
    return a.reshape(-1) if name.startswith("b_") and name != "b_out" else a


def _fused_to_stacked(name, g, num_heads):
    """The inverse of _stacked_to_fused, for gradients."""
    if name.startswith("W_") and name != "W_out":
        return np.swapaxes(g.reshape(g.shape[0], num_heads, -1), 0, 1)
    return g.reshape(num_heads, -1) if name.startswith("b_") and name != "b_out" else g


def _wrapper(config, inputs, params):
    fused = {n: _stacked_to_fused(n, real(a)) for n, a in params.items()}
    return _multi_head(config, inputs, fused)


def _wrapper_backward(saved, d_y, d_weights):
    g = _multi_head_backward(saved, d_y, d_weights)
    return {n: _fused_to_stacked(n, a, saved["heads"]["query"]) for n, a in g.items()}


def _grouped_query(config, inputs, params):
    """GroupedQueryAttention: Hkv key-value heads; a QK norm, RoPE and the query temperature at
    the tokens' positions (0 … L − 1, or the inputs' ``positions``) on q and k
    (golden.specification.variants.QK_NORMS says which norm runs before RoPE and which after); sinks
    and the output gate when the parameters hold them; ALiBi's or T5's bias (alibi_term,
    relative_term, the table's gradient by bucket_sums), or Transformer-XL's relative positions
    (W_pos, bias_u, bias_v: transformer_xl_term, in block_forward), the USM Conformer's (W_pos,
    per_dim_scale, key_scale: conformer_timing_term, in block_forward) or Shaw's
    (relative_key_table: shaw_term, in block_forward); the input norm (input_norm: LayerNorm
    of x before every projection, _input_norm); the padding past
    query_seq_lengths neither querying nor attended; with merged_context (T5Gemma 2's
    decoder) golden.reference.merged: one softmax over x's keys and the context's."""
    c, x = variants.get("grouped_query_attention").config(config), inputs["x"]  # defaults in
    num_heads, kind = c["num_heads"], c["qk_norm"]
    dh = c.get("head_dim") or c["d_in"] // num_heads
    norm = None if kind is None else qk_norm_stage(
        kind, *(None if params.get(n) is None else real(params[n])
                for n in ("q_norm", "k_norm")), number(c["qk_norm_eps"]),
        *(None if params.get(n) is None else real(params[n])
          for n in ("q_norm_bias", "k_norm_bias")))  # Chameleon's biases, or None
    stages = [norm] if norm is not None and kind not in variants.AFTER_ROPE else []
    if c["clip_qkv_after_norm"]:  # OLMoE: q and k clamped after their norm, v at projection
        stages.append(clamp_stage(c["clip_qkv"]))
    settings = rope_settings(c["rope_theta"], c["rope_parameters"], c["partial_rotary_factor"],
                             c["rope_precision"])
    positions = inputs.get("positions")  # (B, L) or (L,): each token's, default its index;
    positions = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
    multi = positions.ndim == x.ndim  # (A, B, L) or (A, L): a multimodal or axial RoPE's axes
    if multi and c.get("query_temperature") is not None:
        raise ValueError("a query temperature with multimodal positions: which axis scales it?")
    heads_axis = (slice(None), None) if positions.ndim - multi == 2 else ()  # (B, L) -> (B, 1, L)
    if settings is not None:
        cos, sin = rope_cos_sin(settings, dh, positions, multi)  # (..., L, rd/2)
        stages.append(rope_stage(cos[heads_axis], sin[heads_axis], c["rope_interleaved"],
                                 rope_blocks(settings)))
    if kind in variants.AFTER_ROPE:  # Llama 4's, HunYuan's: after RoPE
        stages.append(norm)
    t = c.get("query_temperature")
    if t is not None and t.get("kind") == "learned":  # per head, from its parameters
        stages.append(learned_temperature_stage(positions, real(params["temperature_scale"]),
                                                real(params["temperature_bias"])))
    elif t is not None:
        factors = temperature_factors(positions, t)
        stages.append(temperature_stage(factors[heads_axis][..., None]))  # (L, 1), (B, 1, L, 1)
    if c["merged_context"]:  # T5Gemma 2's decoder: golden.reference.merged
        return merged_forward(c, inputs, params, stages, None if norm is None else (
            kind, number(c["qk_norm_eps"])))
    lengths = inputs.get("query_seq_lengths")
    train = "dropout_mask" in inputs
    core = {} if c.get("attention_chunk_size") is None else {
        "attention_chunk_size": c["attention_chunk_size"]}
    if c["alibi"] is not None:
        core["bias"] = alibi_term(c, x.shape[-2], dh)
    buckets = None
    if c["relative_attention_num_buckets"] is not None:
        core["bias"], buckets = relative_term(c, x.shape[-2], params["relative_attention_bias"])
    causal = c.get("causal", True)
    x, normed = _input_norm(c, x, params)  # Granite Speech's pre_norm, before the projections
    mask, key_indices = _block_mask(c, x, inputs, positions, settings, dh, multi, params)
    y, weights, saved = block_forward(
        x, x, x, params, num_heads=num_heads, kv_heads=c["num_kv_heads"], stages=stages,
        mask=mask, is_causal=causal, scale=c.get("scale"), softcap=c.get("softcap"),
        local_window_size=sliding_window(c.get("sliding_window"), causal),
        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        dropout_rate=c.get("dropout", 0.0) if train else 0.0,
        dropout_mask=inputs.get("dropout_mask"), clip=c["clip_qkv"],
        v_norm=number(c["qk_norm_eps"]) if c.get("v_norm") else None,
        key_scale=c.get("key_scale"), gate=gate_kind(c["output_gate"]),
        value_scale=c.get("value_scale"),
        clip_roles=("value",) if c["clip_qkv_after_norm"] else ("query", "key", "value"),
        output_norm=None if c["output_norm"] is None else (c["output_norm"],
                                                           number(c["output_norm_eps"])),
        **core)
    saved["key_indices"] = key_indices  # the block indexer's choice, or None
    saved["buckets"] = buckets  # T5's, for the table's gradient (block_backward)
    saved["input_norm"] = normed
    return y, weights, saved


def _block_mask(c, x, inputs, positions, settings, dh, multi, params):
    """(the attention's mask, key_indices or None): with index_blocks (MiniMax M3's, Qwen4-Exp's
    block indexer, golden.reference.indexer.block_keys) the caller's mask AND the chosen keys,
    chosen among the keys each query may see (mask, causal, window, lengths); without, the
    caller's mask. No gradient reaches the indexer."""
    mask = inputs.get("mask")
    if c.get("index_blocks") is None:
        return mask, None
    c = {**dict(BLOCK_DEFAULTS), **c}  # the options not given at their defaults
    if multi:
        raise ValueError("positions should be (L,) or (B, L) with index_blocks (the indexer "
                         "turns by one position per token), got multimodal positions of shape "
                         f"{positions.shape}")
    lead, length = x.shape[:-2], x.shape[-2]
    flat = None if mask is None else np.asarray(mask)
    if flat is not None and flat.ndim == len(lead) + 3:  # (..., 1, Lq, Lk): one for all heads
        flat = flat[..., 0, :, :]
    lengths = inputs.get("query_seq_lengths")
    causal = c.get("causal", True)
    allowed = allowed_positions(lead + (length, length), flat, causal,
                                local_window_size=sliding_window(c.get("sliding_window"), causal),
                                attention_chunk_size=c.get("attention_chunk_size"),
                                query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    key_indices = block_keys(c, real(x), positions, lambda at: rope_cos_sin(settings, dh, at),
                             {n: real(params[n]) for n in ("W_index_q", "W_index_k",
                                                           "index_q_norm", "index_k_norm")},
                             allowed)
    chosen = selected_mask(key_indices, length)        # (..., [H,] Lq, Lk)
    if c["index_blocks"] == "mean":
        chosen = chosen[..., None, :, :]               # (..., 1, Lq, Lk)
    if mask is None:
        return chosen, key_indices
    mask = np.asarray(mask)
    return (mask if mask.ndim == len(lead) + 3 else mask[..., None, :, :]) & chosen, key_indices


def _input_norm(c, x, params):
    """(x normed, saved) for the projections: LayerNorm over d_in with input_norm_weight and
    input_norm_bias, ε = input_norm_eps (Granite Speech's pre_norm); (x, None) without."""
    if c.get("input_norm") is None:
        return x, None
    y, saved = normalize("layer", real(x), real(params["input_norm_weight"]),
                         number(c["input_norm_eps"]))
    return y + real(params["input_norm_bias"]), saved


def _grouped_query_backward(saved, d_y, d_weights):
    """_multi_head_backward, then through the input norm when there is one: its weight's and
    bias's gradients summed over the leading axes."""
    if saved.get("merged_context"):
        return merged_backward(saved, d_y, d_weights)
    g = _multi_head_backward(saved, d_y, d_weights)
    if saved.get("input_norm") is not None:
        lead = tuple(range(g["x"].ndim - 1))
        g["input_norm_bias"] = g["x"].sum(axis=lead)
        g["x"], g_w = normalize_backward("layer", saved["input_norm"], g["x"])
        g["input_norm_weight"] = g_w.sum(axis=lead)
    return g
