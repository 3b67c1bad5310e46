"""Cross-attention: queries from one sequence, keys and values from another, never causal.
The one-head CrossAttention (x_q, x_kv, optionally a separate x_v) and MultiHeadCrossAttention
(queries from x, keys and values from the context, its tokens past context_lengths not
attended).

Shape legend as in golden.reference.block: N query heads over Nkv key-value heads, Lq the query
and Lk the context length.
"""

from __future__ import annotations

from golden.specification import variants
from golden.reference.arithmetic import number, real
from golden.reference.block import block_backward, block_forward
from golden.reference.modules import one_head
from golden.reference.stages import qk_norm_stage


def _cross(config, inputs, params):
    x_v = inputs.get("x_v", inputs["x_kv"])
    y, weights, saved = one_head(config, inputs, params, inputs["x_q"], inputs["x_kv"], x_v,
                                 is_causal=False)
    saved["separate_values"] = "x_v" in inputs
    return y, weights, saved


def _cross_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights[..., None, :, :])
    g["x_q"], g["x_kv"] = g.pop("x_query"), g.pop("x_key")
    if saved["separate_values"]:
        g["x_v"] = g.pop("x_value")
    else:
        g["x_kv"] = g["x_kv"] + g.pop("x_value")
    return g


def _multi_head_cross(config, inputs, params):
    """MultiHeadCrossAttention: queries from x, keys and values from the context (its tokens
    past context_lengths not attended), N query heads over Nkv key-value heads, no causality;
    ``qk_norm`` "rms" (Mllama's cross-attention layers): q (from x) and k (from the context)
    RMS-normalised per head over Dh, times q_norm and k_norm (Dh,), after the head split (a
    qk_norm_stage: its backward gives their gradients); ``softcap`` c (T5Gemma): the scores
    c·tanh(s/c) in the core."""
    c = variants.get("multi_head_cross_attention").config(config)  # defaults in
    s = variants.cross_sizes(c)
    context = inputs["context"]
    stages = () if c["qk_norm"] is None else (qk_norm_stage(
        c["qk_norm"], real(params["q_norm"]), real(params["k_norm"]), number(c["qk_norm_eps"])),)
    return block_forward(inputs["x"], context, context, params, num_heads=c["num_heads"],
                         kv_heads=s["num_kv_heads"], stages=stages, mask=inputs.get("mask"),
                         scale=c["scale"], softcap=c["softcap"],
                         key_value_seq_lengths=inputs.get("context_lengths"))


def _multi_head_cross_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights)
    g["x"], g["context"] = g.pop("x_query"), g.pop("x_key") + g.pop("x_value")
    return g
