"""Gated delta-rule linear attention (issue 43), written plainly: the causal convolution, the
gates and the recurrence one token at a time (the loop over t is the definition; no chunked
algebra here), and the backward by hand in reverse time.

The mixers are described in golden.specification.recurrent (``MIXERS``); each is a pair in
``MIXERS`` below: forward(config, inputs, params) -> (output, None, saved) and backward(saved,
d_output, None) -> {input or parameter name: gradient}, as golden.reference.VARIANTS' pairs.

Shape legend: leading axes (...) (the batch, or none), L tokens, H heads (Hv value heads; Hk key
heads, each serving Hv/Hk value heads), Dk and Dv the key and value widths, C channels, K the
convolution's width. Per head the state S is (Dk, Dv):
    S′_t = a_t ⊙ S_{t−1}     a_t = e^{g_t}: one number per head (Gated DeltaNet) or one per key
                             channel, (Dk,) broadcast over Dv (Kimi Delta Attention)
    u_t = S′_tᵀ k_t          what the decayed state recalls for k_t            (Dv,)
    δ_t = β_t (v_t − u_t)    the delta rule's correction
    S_t = S′_t + k_t ⊗ δ_t
    o_t = S_tᵀ q_t                                                             (Dv,)
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import einsum, number, real
from golden.reference.block import linear, linear_backward, merge_heads, split_heads
from golden.reference.norms import normalize, normalize_backward
from golden.reference.position_bias import softplus
from golden.specification import recurrent


# ---- the pieces -------------------------------------------------------------------------------

def sigmoid(z):
    """(σ(z), dσ/dz = e^−z σ², no cancellation)."""
    e = np.exp(-z)
    s = number(1) / (number(1) + e)
    return s, e * s * s


def silu(z):
    """(z σ(z), its slope σ(z) + z e^−z σ(z)²)."""
    s, ds = sigmoid(z)
    return z * s, s + z * ds


def causal_conv(u, w, state=None):
    """(y, saved): y_t[c] = Σ_{i<K} w[c, i] u_{t−K+1+i}[c] for u (..., L, C), w (C, K), the inputs
    before the first token ``state`` (..., K − 1, C) (None: zeros)."""
    k, length = w.shape[-1], u.shape[-2]
    if state is None:
        state = real(np.zeros(u.shape[:-2] + (k - 1, u.shape[-1])))
    padded = np.concatenate([state, u], axis=-2)  # (..., K − 1 + L, C)
    y = sum(padded[..., i:i + length, :] * w[:, i] for i in range(k))
    return y, padded


def causal_conv_backward(padded, w, g):
    """(dL/du (..., L, C), dL/dw (C, K)) of ``causal_conv``."""
    k, length = w.shape[-1], g.shape[-2]
    g_padded = real(np.zeros(padded.shape))
    g_w = []
    for i in range(k):
        g_padded[..., i:i + length, :] = g_padded[..., i:i + length, :] + g * w[:, i]
        g_w.append((g * padded[..., i:i + length, :]).reshape(-1, g.shape[-1]).sum(axis=0))
    return g_padded[..., k - 1:, :], np.stack(g_w, axis=-1)


def l2_normalize(a, eps):
    """(â, r) with â = a r, r = (Σ a² + ε)^−1/2 over the last axis (Hugging Face's l2norm, FLA's
    eps inside the root)."""
    r = number(1) / np.sqrt((a * a).sum(axis=-1, keepdims=True) + eps)
    return a * r, r


def l2_normalize_backward(unit, r, g):
    """dL/da of ``l2_normalize``: r (g − â (â·g))."""
    return r * (g - unit * (unit * g).sum(axis=-1, keepdims=True))


def delta_rule(q, k, v, a, beta, state=None):
    """(o (..., H, L, Dv), states): the recurrence above for q, k (..., H, L, Dk), v (..., H, L,
    Dv), the decay factors a = e^g (..., H, L) or per key channel (..., H, L, Dk), beta (..., H,
    L), from ``state`` (..., H, Dk, Dv) (None: zeros). ``states`` holds S_0 … S_L."""
    s = real(np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]))) if state is None else state
    states, outs = [s], []
    for t in range(q.shape[-2]):
        decay = a[..., t, None, None] if a.ndim == q.ndim - 1 else a[..., t, :, None]
        decayed = s * decay
        recalled = einsum("...kv,...k->...v", decayed, k[..., t, :])
        delta = beta[..., t, None] * (v[..., t, :] - recalled)
        s = decayed + k[..., t, :, None] * delta[..., None, :]
        states.append(s)
        outs.append(einsum("...kv,...k->...v", s, q[..., t, :]))
    return np.stack(outs, axis=-2), states


def delta_rule_backward(q, k, v, a, beta, states, g_o):
    """(dq, dk, dv, da, dbeta, dS_0) of ``delta_rule`` for dL/do ``g_o``, in reverse time."""
    per_channel = a.ndim == q.ndim
    g_s = real(np.zeros(states[0].shape))
    g_q, g_k, g_v, g_a, g_beta = ([None] * q.shape[-2] for _ in range(5))
    for t in reversed(range(q.shape[-2])):
        decay = a[..., t, :, None] if per_channel else a[..., t, None, None]
        previous, s = states[t], states[t + 1]
        decayed = previous * decay
        kt, qt, dt = k[..., t, :], q[..., t, :], g_o[..., t, :]
        recalled = einsum("...kv,...k->...v", decayed, kt)
        residual = v[..., t, :] - recalled
        delta = beta[..., t, None] * residual
        g_s = g_s + qt[..., :, None] * dt[..., None, :]  # o_t = S_tᵀ q_t
        g_q[t] = einsum("...kv,...v->...k", s, dt)
        g_delta = einsum("...kv,...k->...v", g_s, kt)  # S_t = S′_t + k_t ⊗ δ_t
        g_kt = einsum("...kv,...v->...k", g_s, delta)
        g_beta[t] = (g_delta * residual).sum(axis=-1)
        g_v[t] = beta[..., t, None] * g_delta
        g_recalled = -g_v[t]
        g_decayed = g_s + kt[..., :, None] * g_recalled[..., None, :]  # u_t = S′_tᵀ k_t
        g_k[t] = g_kt + einsum("...kv,...v->...k", decayed, g_recalled)
        product = g_decayed * previous
        g_a[t] = product.sum(axis=-1) if per_channel else product.sum(axis=(-2, -1))
        g_s = g_decayed * decay
    return (*(np.stack(x, axis=-2) for x in (g_q, g_k, g_v)),
            np.stack(g_a, axis=-2) if per_channel else np.stack(g_a, axis=-1),
            np.stack(g_beta, axis=-1), g_s)


def gated_rms_norm(o, z, weight, eps):
    """(RMSNorm(o) · weight ⊙ SiLU(z), saved) over the last axis (Qwen3-Next's
    RMSNormGated: the norm, then the gate)."""
    unit, saved = normalize("rms", o, None, eps)
    act, slope = silu(z)
    return unit * weight * act, (unit, saved, act, slope, weight)


def gated_rms_norm_backward(saved, g):
    """(dL/do, dL/dz, dL/dweight)."""
    unit, norm_saved, act, slope, weight = saved
    g_unit = g * weight * act
    g_o, _ = normalize_backward("rms", norm_saved, g_unit)
    g_w = (g * unit * act).reshape(-1, unit.shape[-1]).sum(axis=0)
    return g_o, g * unit * weight * slope, g_w


def _heads_last(y, heads):
    """(..., L, H) -> (..., H, L)."""
    return np.swapaxes(y.reshape(y.shape[:-1] + (heads,)), -1, -2)


# ---- Gated DeltaNet -----------------------------------------------------------------------------

def _gated_delta_net(config, inputs, params):
    """GatedDeltaNet (golden.specification.recurrent): the recurrence from S_0 = 0 over x."""
    c = recurrent.get("gated_delta_net").config(config)
    p = {n: real(a) for n, a in params.items()}
    x = real(inputs["x"])
    mask = inputs.get("mask")
    if mask is not None:
        x = x * real(np.asarray(mask, dtype=np.float64))[..., None]
    hk, hv, dk = c["num_k_heads"], c["num_v_heads"], c["head_k_dim"]
    saved = {"p": p, "x": x, "mask": mask, "c": c}
    acts = {}
    for role in ("query", "key", "value"):
        pre, padded = causal_conv(linear(x, p[f"W_{role}"]), p[f"conv_{role}"])
        acts[role] = silu(pre)
        saved[f"conv_{role}"] = padded
    q_unit, q_r = l2_normalize(split_heads(acts["query"][0], hk), number(c["l2norm_eps"]))
    k_unit, k_r = l2_normalize(split_heads(acts["key"][0], hk), number(c["l2norm_eps"]))
    scale = number(1) / np.sqrt(number(dk))
    group = hv // hk
    q = np.repeat(q_unit * scale, group, axis=-3)  # value head h reads key head h // group
    k = np.repeat(k_unit, group, axis=-3)
    v = split_heads(acts["value"][0], hv)
    beta_logit = _heads_last(linear(x, p["W_beta"]), hv)  # (..., Hv, L)
    sig, sig_slope = sigmoid(beta_logit)
    factor = number(2) if c["allow_neg_eigval"] else number(1)
    beta = factor * sig
    soft, soft_slope = softplus(_heads_last(linear(x, p["W_decay"]), hv)
                                + p["dt_bias"][:, None])
    rate = np.exp(p["A_log"])[:, None]  # (Hv, 1)
    g = -rate * soft
    a = np.exp(g)
    o, states = delta_rule(q, k, v, a, beta)
    z = split_heads(linear(x, p["W_gate"]), hv)
    normed, norm_saved = gated_rms_norm(o, z, p["norm_weight"], number(c["norm_eps"]))
    merged = merge_heads(normed)
    y = linear(merged, p["W_out"])
    saved.update(acts=acts, q_unit=q_unit, q_r=q_r, k_unit=k_unit, k_r=k_r, scale=scale,
                 q=q, k=k, v=v, beta=beta, sig_slope=sig_slope, factor=factor, soft=soft,
                 soft_slope=soft_slope, rate=rate, g=g, a=a, states=states,
                 norm_saved=norm_saved, merged=merged)
    return y, None, saved


def _gated_delta_net_backward(saved, d_y, d_weights=None):
    """Gradients of Σ y ⊙ d_y: "x" and every parameter."""
    s, p, c = saved, saved["p"], saved["c"]
    hk, hv = c["num_k_heads"], c["num_v_heads"]
    group = hv // hk
    grads = {}
    g_merged = linear_backward(s["merged"], p["W_out"], real(d_y), grads, ("W_out", None))
    g_normed = split_heads(g_merged, hv)
    g_o, g_z, grads["norm_weight"] = gated_rms_norm_backward(s["norm_saved"], g_normed)
    g_x = linear_backward(s["x"], p["W_gate"], merge_heads(g_z), grads, ("W_gate", None))
    g_q, g_k, g_v, g_a, g_beta, _ = delta_rule_backward(s["q"], s["k"], s["v"], s["a"],
                                                        s["beta"], s["states"], g_o)
    # the decay: a = e^g, g = −e^{A_log} softplus(x W_decay + dt_bias)
    g_g = g_a * s["a"]  # (..., Hv, L)
    lead = tuple(range(g_g.ndim - 2))
    grads["A_log"] = (g_g * s["g"]).sum(axis=lead + (-1,))
    g_pre = -g_g * s["rate"] * s["soft_slope"]
    grads["dt_bias"] = g_pre.sum(axis=lead + (-1,))
    g_x = g_x + linear_backward(s["x"], p["W_decay"], np.swapaxes(g_pre, -1, -2), grads,
                                ("W_decay", None))
    g_logit = g_beta * s["factor"] * s["sig_slope"]
    g_x = g_x + linear_backward(s["x"], p["W_beta"], np.swapaxes(g_logit, -1, -2), grads,
                                ("W_beta", None))
    # the heads: a key head's gradient sums its value heads'
    def fold(t):
        return t.reshape(t.shape[:-3] + (hk, group) + t.shape[-2:]).sum(axis=-3)
    g_q_unit = fold(g_q) * s["scale"]
    g_k_unit = fold(g_k)
    acts = {"query": merge_heads(l2_normalize_backward(s["q_unit"], s["q_r"], g_q_unit)),
            "key": merge_heads(l2_normalize_backward(s["k_unit"], s["k_r"], g_k_unit)),
            "value": merge_heads(g_v)}
    for role, g_act in acts.items():
        g_pre = g_act * s["acts"][role][1]
        g_u, grads[f"conv_{role}"] = causal_conv_backward(s[f"conv_{role}"],
                                                          p[f"conv_{role}"], g_pre)
        g_x = g_x + linear_backward(s["x"], p[f"W_{role}"], g_u, grads, (f"W_{role}", None))
    if s["mask"] is not None:
        g_x = g_x * real(np.asarray(s["mask"], dtype=np.float64))[..., None]
    grads["x"] = g_x
    return grads


MIXERS = {"gated_delta_net": (_gated_delta_net, _gated_delta_net_backward)}
