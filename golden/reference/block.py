"""The block every module variant runs: project, split heads, stages, attend, merge heads,
gate, project out; and its backward.

Shape legend: B batch, N heads (Nkv of key and value), Lq query length, Lk key length (L
either), D head width (Dv of the value), d_* feature widths.
    Q = x_q W_q + b_q, K = x_k W_k + b_k, V = x_v W_v + b_v      (..., L, N·D), K and V
                                                                  (..., L, Nkv·D) with GQA
    Q, K = stages(split(Q), split(K))                             RoPE, QK norm, temperature
    O = attention(split(Q), split(K), split(V))                   (..., N, Lq, Dv)
    y = merge(O) W_out + b_out   (or merge(O) when there is no output projection)
A Stage is the contract of the steps between the projections and the core
(golden.reference.stages holds them); the output gate, clip_qkv (MPT, OLMo), the gradient of
T5's bias table and the relative positions' terms (after the stages: Transformer-XL's query
q + u, the Conformer's q̃, to the core, the position term as the core's position_term, inside
its cap) ride in the block itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, NamedTuple

import numpy as np

from golden.reference.arithmetic import einsum, number, real
from golden.reference.core import sdpa_backward, sdpa_forward
from golden.reference.norms import normalize, normalize_backward
from golden.reference.position_bias import (bucket_sums, conformer_timing_backward,
                                            conformer_timing_term, shaw_backward, shaw_term,
                                            softplus, transformer_xl_backward,
                                            transformer_xl_term)


def linear(x, w, b=None):
    """x W + b with W of shape (in, out)."""
    y = einsum("...i,io->...o", x, w)
    return y if b is None else y + b


_TERM_SIZES = contextvars.ContextVar("term_sizes", default=None)


@contextlib.contextmanager
def parameter_term_sizes():
    """Inside, every ``linear_backward`` also records, in the dict this yields, the size of the
    terms each element of its weight's and bias's gradients sums: |x|ᵀ|g| and Σ|g| over the
    positions (golden.specification.tolerances.compare_terms's M). A projection's gradient may
    cancel far below its terms (the key bias's, Σ over keys of dL/dk, is zero without RoPE and
    small with it), and then carries their rounding, not its own. For references computed in
    memory (``attn-parity hf``'s rows); nothing stored."""
    sizes = {}
    token = _TERM_SIZES.set(sizes)
    try:
        yield sizes
    finally:
        _TERM_SIZES.reset(token)


def linear_backward(x, w, g_y, grads, names):
    """Accumulate dL/dW and dL/db into ``grads``; return dL/dx."""
    w_name, b_name = names
    x2, g2 = x.reshape(-1, x.shape[-1]), g_y.reshape(-1, g_y.shape[-1])  # (positions, width)
    grads[w_name] = einsum("ni,no->io", x2, g2)  # Σ over positions of xᵀ g
    if b_name is not None:
        grads[b_name] = g2.sum(axis=0)
    sizes = _TERM_SIZES.get()
    if sizes is not None:
        sizes[w_name] = einsum("ni,no->io", np.abs(x2), np.abs(g2))
        if b_name is not None:
            sizes[b_name] = np.abs(g2).sum(axis=0)
    return einsum("...o,io->...i", g_y, w)


def split_heads(y, num_heads):
    """(..., L, N·D) -> (..., N, L, D): head n owns the n-th contiguous block of features."""
    y = y.reshape(y.shape[:-1] + (num_heads, y.shape[-1] // num_heads))  # (..., L, N, D)
    return np.swapaxes(y, -2, -3)


def merge_heads(y):
    """(..., N, L, D) -> (..., L, N·D)."""
    y = np.swapaxes(y, -2, -3)  # (..., L, N, D)
    return y.reshape(y.shape[:-2] + (-1,))


class Stage(NamedTuple):
    """A differentiable step on the split heads q (..., N, L, Dh) and k (..., Nkv, L, Dh)
    between the projections and the core (RoPE, a QK norm, the query temperature):
    ``forward(q, k) -> (q, k, saved)`` and ``backward(saved, g_q, g_k) -> (g_q, g_k, {parameter:
    gradient})``."""

    forward: Callable
    backward: Callable


def block_forward(x_q, x_k, x_v, p, *, num_heads, kv_heads=None, stages=(), mask=None,
                  clip=None, v_norm=None, key_scale=None, gate=None, output_norm=None,
                  value_scale=None, clip_roles=("query", "key", "value"), gate_input=None,
                  **core):
    """The generic block; p holds W_query, W_key, W_value, optional b_*, W_out, b_out, and for
    GroupedQueryAttention's options W_gate/b_gate (the output gate), sinks, and W_pos, bias_u
    and bias_v (Transformer-XL's relative positions: golden.reference.transformer_xl_term,
    after the stages), W_pos and per_dim_scale (the USM Conformer's,
    golden.reference.conformer_timing_term, after the stages: the core's query q̃ and its
    scale ``key_scale`` κ, default 1) or relative_key_table (Shaw's: golden.reference.shaw_term,
    after the stages), each relative term inside the core's cap. Key and value
    have ``kv_heads`` heads (default num_heads); ``stages`` (Stage) run in order on q and k;
    ``clip`` c (MPT's and OLMo's clip_qkv) clamps each projection of ``clip_roles`` to [−c, c]
    before the stages (OLMoE's q and k: a clamp_stage after their norm);
    ``v_norm`` ε (Gemma 4): each value head v / √(mean(v²) + ε), no weight, after the clip;
    without W_value (k_eq_v, Gemma 4's full layers) the values are the key projection's heads,
    before the stages; ``value_scale`` s (MiMo-V2-Flash): the values times s after the clip,
    before the value norm; ``output_norm`` (kind, ε) (golden.specification.outputs): the heads'
    output RMS-normalised per head ("rms_per_head", no weight) or over all heads' features
    ("rms", times p["output_norm_weight"]) before the gate; ``gate`` (activation, per_head) of
    golden.specification.outputs.gate_kind: the output times act(x_q W_gate + b_gate), one value
    per feature or per head (broadcast over its Dv), default ("sigmoid", False) when p has
    W_gate; ``gate_input`` the gate's input in place of x_q (multi-head latent attention's x,
    whose x_q is the query's low-rank latent), its gradient then returned as "x_gate";
    ``core`` goes to sdpa_forward (is_causal, scale, dropout, lengths, ...)."""
    x_q, x_k, x_v = (real(a) for a in (x_q, x_k, x_v))
    p = {n: real(a) for n, a in p.items()}
    heads = {"query": num_heads, "key": kv_heads or num_heads, "value": kv_heads or num_heads}
    value_from = (x_v, "value") if "W_value" in p else (x_k, "key")  # Gemma 4's K = V
    q, k, v = (split_heads(linear(x, p[f"W_{n}"], p.get(f"b_{n}")), heads[n])
               for x, n in ((x_q, "query"), (x_k, "key"), value_from))
    inside = None
    if clip is not None:  # the derivative is 1 inside [−c, c] (ends included, as torch's), else 0
        (q, k, v), inside = clamp((q, k, v), clip, clip_roles)
    if value_scale is not None:
        v = v * number(value_scale)
    v_normed = None
    if v_norm is not None:
        v, v_normed = normalize("l2", v, None, v_norm)
    staged = []
    for stage in stages:
        q, k, s = stage.forward(q, k)
        staged.append(s)
    relative = None
    if "W_pos" in p:  # the core takes q + u (q̃), and the position term inside its cap
        scale = core.get("scale")
        scale = number(1) / np.sqrt(number(q.shape[-1])) if scale is None else number(scale)
        if "per_dim_scale" in p:  # the USM Conformer's: the core's scale is the key scale κ
            q, core["position_term"], conformer = conformer_timing_term(q, p, scale)
            core["scale"] = 1.0 if key_scale is None else key_scale  # sdpa_forward's number
            relative = ("conformer_timing", conformer)
        else:
            q, core["position_term"], relative = transformer_xl_term(q, p, scale)
            relative = ("transformer_xl", relative)
    shaw = None
    if "relative_key_table" in p:  # Shaw's: the position term scale · q_i·E[M + clip(i − j)]
        scale = core.get("scale")
        scale = number(1) / np.sqrt(number(q.shape[-1])) if scale is None else number(scale)
        core["position_term"], shaw = shaw_term(q, p["relative_key_table"], scale)
    head_mask = None if mask is None else np.asarray(mask)  # (..., [1 or N,] Lq, Lk)
    if head_mask is not None and head_mask.ndim < np.ndim(x_q) + 1:
        head_mask = head_mask[..., None, :, :]  # (..., 1, Lq, Lk)
    if "sinks" in p:
        core["sinks"] = p["sinks"]
    out, weights, attn = sdpa_forward(q, k, v, head_mask, **core)
    out, normed = _output_norm(out, p, output_norm)
    merged = merge_heads(out)  # (..., Lq, N·Dv)
    if output_norm is not None and output_norm[0] == "rms":  # over all heads' features
        merged, normed = normalize("rms", merged, p["output_norm_weight"], output_norm[1])
    gated = None
    if "W_gate" in p:  # merged ⊙ act(x_q W_gate + b_gate)
        x_g = x_q if gate_input is None else real(gate_input)
        merged, gated = _gate(merged, linear(x_g, p["W_gate"], p.get("b_gate")),
                              gate or ("sigmoid", False), num_heads)
    y = linear(merged, p["W_out"], p.get("b_out")) if "W_out" in p else merged
    saved = dict(x=(x_q, x_k, x_v), p=p, heads=heads, stages=stages, staged=staged,
                 merged=merged, gate=gated, attn=attn, inside=inside, v_normed=v_normed,
                 relative=relative, shaw=shaw, output_norm=(output_norm, normed),
                 value_scale=value_scale,
                 gate_input=None if gate_input is None else real(gate_input))
    return y, weights, saved


def clamp(arrays, clip, roles=("query", "key", "value")):
    """(arrays clamped to [−c, c] where their role is in ``roles``, the masks where each is
    inside: its derivative 1 there (ends included, as torch's), 0 outside)."""
    c = number(clip)
    inside = [((a >= -c) & (a <= c)).astype(bool) if role in roles else np.ones(a.shape, bool)
              for a, role in zip(arrays, ("query", "key", "value"))]
    return [np.where(i, a, np.where(a > c, c, -c)) for i, a in zip(inside, arrays)], inside


def _output_norm(out, p, output_norm):
    """(out, saved) with out (..., N, Lq, Dv) RMS-normalised per head when ``output_norm`` is
    ("rms_per_head", ε); as it is (saved None) otherwise."""
    if output_norm is None or output_norm[0] != "rms_per_head":
        return out, None
    return normalize("rms", out, None, output_norm[1])


def _gate(merged, z, kind, num_heads):
    """(merged ⊙ a, saved) with a = act(z), z (..., Lq, N·Dv) or (..., Lq, N) per head (each
    value broadcast over its head's Dv): σ(z) = 1 / (1 + e^−z), dσ/dz = e^−z σ² (no
    cancellation), or softplus(z) = ln(1 + e^z), its slope σ(z)."""
    activation, per_head = kind
    if activation == "sigmoid":
        e = np.exp(-z)
        a = number(1) / (number(1) + e)
        slope = e * a * a
    else:
        a, slope = softplus(z)
    wide = (lambda t: np.repeat(t, merged.shape[-1] // num_heads, axis=-1)) if per_head else (
        lambda t: t)  # (..., Lq, N) -> (..., Lq, N·Dv): head n's value on its Dv features
    return merged * wide(a), (merged, wide(a), slope, per_head, num_heads)


def _gate_backward(saved, g):
    """(dL/dz, dL/d(ungated merged)) of ``_gate``: per head, dL/da summed over the head's Dv."""
    ungated, a, slope, per_head, num_heads = saved
    g_a = g * ungated  # (..., Lq, N·Dv)
    if per_head:
        g_a = g_a.reshape(g_a.shape[:-1] + (num_heads, -1)).sum(axis=-1)  # (..., Lq, N)
    return g_a * slope, g * a


def block_backward(saved, d_y, d_weights):
    """Gradients of Σ y⊙dy + Σ A⊙dA: keys x_query, x_key, x_value and every parameter name."""
    p, grads = saved["p"], {}
    g_merged, d_weights = real(d_y), real(d_weights)
    if "W_out" in p:
        g_merged = linear_backward(saved["merged"], p["W_out"], g_merged, grads,
                                   ("W_out", "b_out" if "b_out" in p else None))
    g_gate = None
    if saved["gate"] is not None:
        g_gate, g_merged = _gate_backward(saved["gate"], g_merged)
    kind, normed = saved.get("output_norm") or (None, None)
    if kind is not None and kind[0] == "rms":  # over all heads' features, with its weight
        g_merged, g_w = normalize_backward("rms", normed, g_merged)
        grads["output_norm_weight"] = g_w.reshape(-1, g_w.shape[-1]).sum(axis=0)
    g_out = split_heads(g_merged, saved["heads"]["query"])
    if kind is not None and kind[0] == "rms_per_head":
        g_out = normalize_backward("rms", normed, g_out)[0]
    g = sdpa_backward(saved["attn"], g_out, d_weights)
    if "sinks" in p:
        grads["sinks"] = g["sinks"]
    if saved.get("v_normed") is not None:  # the value norm's transpose (no weight)
        g["value"] = normalize_backward("l2", saved["v_normed"], g["value"])[0]
    if saved.get("value_scale") is not None:
        g["value"] = g["value"] * number(saved["value_scale"])
    if saved.get("buckets") is not None:  # T5: the bias's gradient summed into its buckets
        grads["relative_attention_bias"] = bucket_sums(g["bias"], saved["buckets"],
                                                       p["relative_attention_bias"].shape)
    if saved.get("relative") is not None:  # the relative positions' term, after the stages
        kind, relative = saved["relative"]
        if kind == "conformer_timing":
            g["query"], g_params = conformer_timing_backward(relative, g["query"],
                                                             g["position_term"])
        else:
            g["query"], g_params = transformer_xl_backward(relative, p, g["query"],
                                                           g["position_term"])
        grads.update(g_params)
    if saved.get("shaw") is not None:  # Shaw's term, after the stages, inside the cap
        g_q, grads["relative_key_table"] = shaw_backward(saved["shaw"], p["relative_key_table"],
                                                         g["position_term"])
        g["query"] = g["query"] + g_q
    for stage, s in zip(reversed(saved["stages"]), reversed(saved["staged"])):
        g["query"], g["key"], g_params = stage.backward(s, g["query"], g["key"])
        grads.update(g_params)
    for i, n in enumerate(("query", "key", "value") if saved.get("inside") else ()):
        g[n] = np.where(saved["inside"][i], g[n], number(0))
    roles = ("query", "key", "value")
    if "W_value" not in p:  # the values are the key projection's: its gradient the sum of both
        g["key"] = g["key"] + g.pop("value")
        grads["x_value"] = np.zeros_like(saved["x"][2])
        roles = ("query", "key")
    for x, n in zip(saved["x"], roles):
        grads[f"x_{n}"] = linear_backward(x, p[f"W_{n}"], merge_heads(g[n]), grads,
                                          (f"W_{n}", f"b_{n}" if f"b_{n}" in p else None))
    if g_gate is not None:
        x_g = saved.get("gate_input")
        g_x = linear_backward(saved["x"][0] if x_g is None else x_g, p["W_gate"], g_gate, grads,
                              ("W_gate", "b_gate" if "b_gate" in p else None))
        if x_g is None:
            grads["x_query"] = grads["x_query"] + g_x
        else:
            grads["x_gate"] = g_x
    return grads
