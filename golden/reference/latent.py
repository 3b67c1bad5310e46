"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values made from a
low-rank latent, one rotary key head shared by every head, and yarn's mscale on the
softmax scale; the block (golden.reference.block) runs from the query input and the latent.

Shape legend: N heads, L sequence length, r kv_lora_rank (the latent's width), nope the
features of each head's q and k that are not turned (qk_nope_head_dim), rope the turned ones
(qk_rope_head_dim), Dv the value width; q and k are (..., N, L, nope + rope).
"""

from __future__ import annotations

import numpy as np

from golden.specification import variants
from golden.specification.decoder import sliding_window
from golden.specification.outputs import gate_kind
from golden.reference.arithmetic import number, real
from golden.reference.block import Stage, block_backward, block_forward, linear, linear_backward
from golden.reference.core import allowed_positions, unbroadcast
from golden.reference.indexer import index_keys, selected_mask
from golden.specification.indexer import check_key_indices, require_given
from golden.reference.rotary import rope_cos_sin, turn
from golden.reference.norms import normalize, normalize_backward
from golden.reference.stages import (learned_temperature_stage, temperature_factors,
                                      temperature_stage)


def latent_rope_stage(k_pe, cos, sin, interleaved, nope) -> Stage:
    """Multi-head latent attention's RoPE, as a Stage on q (..., N, L, nope + rope) and the
    keys' nope part k (..., N, L, nope): q's last rope features turned, and the one rotary key
    head k_pe (..., 1, L, rope), turned, appended to every head's key. Its backward returns
    the gradient of k_pe (summed over the heads it was broadcast to) as "k_pe"."""
    def forward(q, k):
        q_rot = turn(q[..., nope:], cos, sin, interleaved)
        k_rot = np.broadcast_to(turn(k_pe, cos, sin, interleaved),
                                k.shape[:-1] + (k_pe.shape[-1],))
        return (np.concatenate([q[..., :nope], q_rot], axis=-1),
                np.concatenate([k, k_rot], axis=-1), None)

    def backward(saved, g_q, g_k):
        g_q = np.concatenate([g_q[..., :nope], turn(g_q[..., nope:], cos, -sin, interleaved)],
                             axis=-1)
        g_pe = turn(g_k[..., nope:].sum(axis=-3, keepdims=True), cos, -sin, interleaved)
        return g_q, g_k[..., :nope], {"k_pe": g_pe}

    return Stage(forward, backward)


def _split_kv_b(w, heads, nope):
    """W_kv_b (r, N·(nope + Dv)), per head [k_nope | v], -> (W_k (r, N·nope), W_v (r, N·Dv))."""
    w = w.reshape(w.shape[0], heads, -1)  # (r, N, nope + Dv)
    return (w[..., :nope].reshape(w.shape[0], -1), w[..., nope:].reshape(w.shape[0], -1))


def _join_kv_b(g_k, g_v, heads):
    """The inverse of _split_kv_b, for gradients."""
    r = g_k.shape[0]
    return np.concatenate([g_k.reshape(r, heads, -1), g_v.reshape(r, heads, -1)],
                          axis=-1).reshape(r, -1)


def latent_mscale(c):
    """Yarn's mscale(s, mscale_all_dim)², mscale(s, a) = 0.1·a·ln s + 1, by which multi-head
    latent attention multiplies its softmax scale Dk^−1/2 (Hugging Face's yarn_apply_mscale),
    in the reference's arithmetic; None when it does not apply (``scale`` given, no yarn with
    mscale_all_dim, or a factor s ≤ 1)."""
    s = variants.latent_sizes(c)
    if c["scale"] is not None or s["mscale"] is None or s["mscale"][0] <= 1:
        return None
    m = number(0.1) * number(s["mscale"][1]) * np.log(number(s["mscale"][0])) + number(1)
    return m * m


def _latent(config, inputs, params):
    """MultiHeadLatentAttention (DeepSeek-V2/V3's MLA): q from x (or through the low-rank
    W_q_a, RMSNorm q_a_norm, W_q_b), per head [q_nope | q_pe]; x W_kv_a + b_kv_a = [c | k_pe],
    the latent c RMS-normalised (kv_a_norm), W_kv_b making each head's [k_nope | v] from it;
    q_pe and the one key head k_pe turned (RoPE at the tokens' positions), k_pe shared by every
    head; causal attention of [q_nope | q_pe] on [k_nope | k_pe] at the scale Dk^−1/2 ·
    latent_mscale (or ``scale``), with ``sinks`` (HY-V4) a learned logit per head in every
    softmax row; ``output_gate`` (HY-V4's "sigmoid", Ling 3.0's "sigmoid_per_head") the heads'
    output times act(x W_gate), from x (not the query's latent), before W_out; ``rope_key_norm``
    (dots.3-note) k_pe RMS-normalised (k_pe_norm) before RoPE; ``query_latent``
    "normed_and_raw" (A.X-K2) the query and the gate from [RMSNorm(c_q) | c_q], the indexer's
    query from RMSNorm(c_q); ``sliding_window`` W (dots.3-note's windowed layers) W keys, the
    query's own included. The block (block_forward) runs from the query input and the
    latent: its W_key and W_value are W_kv_b's key and value columns, its stage the RoPE
    (latent_rope_stage)."""
    c, x = variants.get("multi_head_latent_attention").config(config), real(inputs["x"])
    p = {n: real(a) for n, a in params.items()}
    heads, nope, r = c["num_heads"], c["qk_nope_head_dim"], c["kv_lora_rank"]
    eps = number(c["rms_norm_eps"])
    q_norm, both = None, c["query_latent"] == "normed_and_raw"
    if "W_q_a" in p:
        c_q = linear(x, p["W_q_a"], p.get("b_q_a"))
        q_resid, q_norm = normalize("rms", c_q, p["q_a_norm"], eps)
        x_q = np.concatenate([q_resid, c_q], axis=-1) if both else q_resid  # AXK2's: both
    else:
        x_q = q_resid = x
    kv_a = linear(x, p["W_kv_a"], p.get("b_kv_a"))     # (..., L, r + rope)
    latent, kv_norm = normalize("rms", kv_a[..., :r], p["kv_a_norm"], eps)
    positions = inputs.get("positions")
    positions = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
    heads_axis = (slice(None), None) if positions.ndim == 2 else ()  # (B, L) -> (B, 1, L)
    cos, sin = rope_cos_sin(variants.latent_rope(c), c["qk_rope_head_dim"], positions)
    if not c["rope"]:  # Kimi Linear: no rotation, cos 1 and sin 0 (x·1 − y·0 is x exactly)
        cos, sin = np.ones_like(cos), np.zeros_like(sin)
    k_pe, pe_norm = kv_a[..., None, :, r:], None         # (..., 1, L, rope)
    if "k_pe_norm" in p:  # dots3's: RMS-normalised before RoPE
        k_pe, pe_norm = normalize("rms", k_pe, p["k_pe_norm"], eps)
    stage = latent_rope_stage(k_pe, cos[heads_axis], sin[heads_axis], c["rope_interleaved"],
                              nope)
    stages = [stage]
    mscale = latent_mscale(c)  # the scale Dk^−1/2 · m², as q · m² at the core's default scale
    if mscale is not None:
        stages.append(temperature_stage(mscale))
    t = c["query_temperature"]  # Mistral Small 4's (Llama 4's, shift 0), after RoPE
    if t is not None and t.get("kind") == "learned":
        stages.append(learned_temperature_stage(positions, p["temperature_scale"],
                                                p["temperature_bias"]))
    elif t is not None:
        stages.append(temperature_stage(temperature_factors(positions, t)[heads_axis][..., None]))
    mask, key_indices = _indexed_mask(c, x, q_resid, positions, cos, sin, p, inputs)
    w_k, w_v = _split_kv_b(p["W_kv_b"], heads, nope)
    block = {"W_query": p.get("W_q_b", p.get("W_query")), "W_key": w_k, "W_value": w_v,
             "W_out": p["W_out"], **{n: p[n] for n in ("b_out", "W_gate", "sinks") if n in p}}
    lengths = inputs.get("query_seq_lengths")
    y, weights, saved = block_forward(x_q, latent, latent, block, num_heads=heads,
                                      stages=stages, mask=mask,
                                      gate=gate_kind(c["output_gate"]),
                                      gate_input=x_q if both else x,
                                      is_causal=c["causal"], scale=c["scale"],
                                      local_window_size=sliding_window(c["sliding_window"],
                                                                       c["causal"]),
                                      query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    return y, weights, dict(block=saved, x=x, p=p, q_norm=q_norm, kv_norm=kv_norm, r=r,
                            heads=heads, key_indices=key_indices, pe_norm=pe_norm, both=both)


def _indexed_mask(c, x, q_resid, positions, cos, sin, p, inputs):
    """(the attention's mask, key_indices or None): with index_topk, the caller's mask AND the
    keys the indexer chose (golden.reference.indexer), or chose for it (``key_indices`` among
    the inputs: the given-selection mode, no indexer run), the choice among the keys each query
    may see (mask, causal, lengths); without, the caller's mask."""
    mask, given = inputs.get("mask"), inputs.get("key_indices")
    if c["index_topk"] is None:
        if given is not None:
            raise ValueError("key_indices should be None without index_topk (no indexer), got "
                             "an array")
        return mask, None
    lead, length = x.shape[:-2], x.shape[-2]
    flat = None if mask is None else np.asarray(mask)
    if flat is not None and flat.ndim == len(lead) + 3:  # (..., 1, Lq, Lk): one for all heads
        flat = flat[..., 0, :, :]
    lengths = inputs.get("query_seq_lengths")
    allowed = allowed_positions(lead + (length, length), flat, c["causal"],
                                query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    require_given(c, given)
    if given is None:
        key_indices = index_keys(c, x, q_resid, positions, cos, sin, p, allowed)
    else:
        check_key_indices(given, lead, length, length, min(c["index_topk"], length))
        key_indices = np.asarray(given).astype(np.int64)
    chosen = selected_mask(key_indices, length)                  # (..., Lq, Lk)
    if mask is None:
        return chosen, key_indices
    mask = np.asarray(mask)
    return mask & (chosen[..., None, :, :] if mask.ndim == len(lead) + 3 else chosen), key_indices


def _latent_backward(saved, d_y, d_weights):
    p, x, heads = saved["p"], saved["x"], saved["heads"]
    g = block_backward(saved["block"], d_y, d_weights)
    grads = {"W_out": g["W_out"], "W_kv_b": _join_kv_b(g["W_key"], g["W_value"], heads)}
    grads.update({n: g[n] for n in ("temperature_scale", "temperature_bias", "sinks", "W_gate")
                  if n in g})
    if "b_out" in g:
        grads["b_out"] = g["b_out"]
    g_c, g_w = normalize_backward("rms", saved["kv_norm"], g["x_key"] + g["x_value"])
    grads["kv_a_norm"] = unbroadcast(g_w, p["kv_a_norm"].shape)
    g_pe = g["k_pe"]                                     # (..., 1, L, rope)
    if saved["pe_norm"] is not None:
        g_pe, g_w = normalize_backward("rms", saved["pe_norm"], g_pe)
        grads["k_pe_norm"] = unbroadcast(g_w, p["k_pe_norm"].shape)
    g_kv_a = np.concatenate([g_c, g_pe[..., 0, :, :]], axis=-1)  # (..., L, r + rope)
    g_x = linear_backward(x, p["W_kv_a"], g_kv_a, grads,
                          ("W_kv_a", "b_kv_a" if "b_kv_a" in p else None))
    if saved["q_norm"] is None:
        grads["W_query"] = g["W_query"]
        return dict(grads, x=g_x + g["x_query"] + g.get("x_gate", 0))
    grads["W_q_b"] = g["W_query"]
    g_q, g_raw = g["x_query"], 0
    if saved["both"]:  # [RMSNorm(c_q) | c_q], the gate's input too
        g_q = g_q + g.get("x_gate", 0)
        rank = p["q_a_norm"].shape[0]
        g_q, g_raw = g_q[..., :rank], g_q[..., rank:]
    else:
        g_x = g_x + g.get("x_gate", 0)
    g_a, g_w = normalize_backward("rms", saved["q_norm"], g_q)
    g_a = g_a + g_raw
    grads["q_a_norm"] = unbroadcast(g_w, p["q_a_norm"].shape)
    g_x = g_x + linear_backward(x, p["W_q_a"], g_a, grads,
                                ("W_q_a", "b_q_a" if "b_q_a" in p else None))
    return dict(grads, x=g_x)
