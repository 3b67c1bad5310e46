"""Gated delta-rule linear attention (issue 43), written plainly: the causal convolution, the
gates and the recurrence one token at a time (the loop over t is the definition; no chunked
algebra here), and the backward by hand in reverse time.

The mixers are described in golden.specification.recurrent (``MIXERS``: Gated DeltaNet, Kimi
Delta Attention, lightning attention, whose recurrence has no delta rule: ``decayed_sum``);
each is a pair in ``MIXERS`` below: forward(config, inputs, params) -> (output, None, saved) and backward(saved,
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


def decayed_sum(q, k, v, a):
    """(o, states): lightning attention's S_t = a S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t, for q, k
    (..., H, L, Dk), v (..., H, L, Dv) and a (H,) the decay per head; states S_0 … S_L."""
    s = real(np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1])))
    decay = a[:, None, None]
    states, outs = [s], []
    for t in range(q.shape[-2]):
        s = s * decay + k[..., t, :, None] * v[..., t, None, :]
        states.append(s)
        outs.append(einsum("...kv,...k->...v", s, q[..., t, :]))
    return np.stack(outs, axis=-2), states


def decayed_sum_backward(q, k, v, a, states, g_o):
    """(dq, dk, dv, da (H,)) of ``decayed_sum``, in reverse time."""
    decay = a[:, None, None]
    g_s = real(np.zeros(states[0].shape))
    g_q, g_k, g_v = ([None] * q.shape[-2] for _ in range(3))
    g_a = None
    for t in reversed(range(q.shape[-2])):
        g_s = g_s + q[..., t, :, None] * g_o[..., t, None, :]
        g_q[t] = einsum("...kv,...v->...k", states[t + 1], g_o[..., t, :])
        g_k[t] = einsum("...kv,...v->...k", g_s, v[..., t, :])
        g_v[t] = einsum("...kv,...k->...v", g_s, k[..., t, :])
        term = (g_s * states[t]).sum(axis=(-2, -1))  # (..., H)
        g_a = term if g_a is None else g_a + term
        g_s = g_s * decay
    g_a = g_a.reshape(-1, g_a.shape[-1]).sum(axis=0)
    return (*(np.stack(x, axis=-2) for x in (g_q, g_k, g_v)), g_a)


def _heads_last(y, heads):
    """(..., L, H) -> (..., H, L)."""
    return np.swapaxes(y.reshape(y.shape[:-1] + (heads,)), -1, -2)


# ---- the mixers: Gated DeltaNet and Kimi Delta Attention -------------------------------------

def _projection(x, p, name):
    """(x W_name, saved) or, low-rank, ((x W_name_a) W_name_b, saved)."""
    if name in p:
        return linear(x, p[name]), None
    inner = linear(x, p[f"{name}_a"])
    return linear(inner, p[f"{name}_b"]), inner


def _projection_backward(x, p, name, inner, g, grads):
    """dL/dx of ``_projection``, its weights' gradients into ``grads``."""
    if name in p:
        return linear_backward(x, p[name], g, grads, (name, None))
    g_inner = linear_backward(inner, p[f"{name}_b"], g, grads, (f"{name}_b", None))
    return linear_backward(x, p[f"{name}_a"], g_inner, grads, (f"{name}_a", None))


def _decay(c, p, x, heads):
    """(a = e^g, saved): per head (..., Hv, L) for Gated DeltaNet, per key channel (..., H, L, D)
    for Kimi Delta Attention (golden.specification.recurrent's formulas)."""
    rate = np.exp(p["A_log"])
    f, inner = _projection(x, p, "W_decay")
    if c.get("forget_gate") is None:  # Gated DeltaNet: one value per head and token
        u = _heads_last(f, heads) + p["dt_bias"][:, None]  # (..., Hv, L)
        soft, slope = softplus(u)
        g = -rate[:, None] * soft
        g_u = -rate[:, None] * slope
    else:  # per key channel: (..., H, L, D)
        u = split_heads(f + p["dt_bias"], heads)
        r = rate[:, None, None]
        if c["forget_gate"] == "softplus":
            soft, slope = softplus(u)
            g, g_u = -r * soft, -r * slope
        else:
            bound = number(c["decay_lower_bound"])
            sig, sig_slope = sigmoid(r * u)
            g, g_u = bound * sig, bound * sig_slope * r
    a = np.exp(g)
    return a, {"g": g, "g_u": g_u, "u": u, "a": a, "inner": inner}


def _decay_backward(c, p, x, saved, g_a, grads, heads):
    """dL/dx of ``_decay`` for dL/da ``g_a``, the gradients of A_log, dt_bias and the decay's
    projection into ``grads``."""
    g_g = g_a * saved["a"]
    g_u = g_g * saved["g_u"]
    lead = tuple(range(g_g.ndim - (2 if c.get("forget_gate") is None else 3)))
    if c.get("forget_gate") is None:
        grads["A_log"] = (g_g * saved["g"]).sum(axis=lead + (-1,))
        grads["dt_bias"] = g_u.sum(axis=lead + (-1,))
        g_f = np.swapaxes(g_u, -1, -2)  # (..., L, Hv)
    else:
        if c["forget_gate"] == "softplus":
            grads["A_log"] = (g_g * saved["g"]).sum(axis=lead + (-2, -1))
        else:  # g = λ σ(e^A u): dg/dA = dg/du · u
            grads["A_log"] = (g_u * saved["u"]).sum(axis=lead + (-2, -1))
        g_f = merge_heads(g_u)  # (..., L, H·D)
        grads["dt_bias"] = g_f.reshape(-1, g_f.shape[-1]).sum(axis=0)
    return _projection_backward(x, p, "W_decay", saved["inner"], g_f, grads)


def _mixer_forward(name):
    def forward(config, inputs, params):
        """A recurrent mixer (golden.specification.recurrent) from S_0 = 0 over x."""
        c = recurrent.get(name).config(config)
        p = {n: real(a) for n, a in params.items()}
        x = real(inputs["x"])
        mask = inputs.get("mask")
        if mask is not None:
            x = x * real(np.asarray(mask, dtype=np.float64))[..., None]
        hk, hv, dk, _ = recurrent.sizes(c)
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
        sig, sig_slope = sigmoid(_heads_last(linear(x, p["W_beta"]), hv))  # (..., Hv, L)
        factor = number(2) if c.get("allow_neg_eigval") else number(1)
        beta = factor * sig
        a, decay_saved = _decay(c, p, x, hv)
        o, states = delta_rule(q, k, v, a, beta)
        z, gate_inner = _projection(x, p, "W_gate")
        z = split_heads(z, hv)
        unit, norm_saved = normalize("rms", o, None, number(c["norm_eps"]))
        act, act_slope = silu(z) if name == "gated_delta_net" else sigmoid(z)
        normed = unit * p["norm_weight"] * act
        merged = merge_heads(normed)
        y = linear(merged, p["W_out"])
        saved.update(acts=acts, q_unit=q_unit, q_r=q_r, k_unit=k_unit, k_r=k_r, scale=scale,
                     q=q, k=k, v=v, beta=beta, sig_slope=sig_slope, factor=factor, a=a,
                     decay=decay_saved, states=states, unit=unit, norm_saved=norm_saved,
                     act=act, act_slope=act_slope, gate_inner=gate_inner, merged=merged)
        return y, None, saved
    return forward


def _mixer_backward(saved, d_y, d_weights=None):
    """Gradients of Σ y ⊙ d_y: "x" and every parameter."""
    s, p, c = saved, saved["p"], saved["c"]
    hk, hv, _, _ = recurrent.sizes(c)
    group = hv // hk
    grads = {}
    g_merged = linear_backward(s["merged"], p["W_out"], real(d_y), grads, ("W_out", None))
    g_normed = split_heads(g_merged, hv)
    weight, unit, act = p["norm_weight"], s["unit"], s["act"]
    grads["norm_weight"] = (g_normed * unit * act).reshape(-1, unit.shape[-1]).sum(axis=0)
    g_o, _ = normalize_backward("rms", s["norm_saved"], g_normed * weight * act)
    g_z = merge_heads(g_normed * unit * weight * s["act_slope"])
    g_x = _projection_backward(s["x"], p, "W_gate", s["gate_inner"], g_z, grads)
    g_q, g_k, g_v, g_a, g_beta, _ = delta_rule_backward(s["q"], s["k"], s["v"], s["a"],
                                                        s["beta"], s["states"], g_o)
    g_x = g_x + _decay_backward(c, p, s["x"], s["decay"], g_a, grads, hv)
    g_logit = g_beta * s["factor"] * s["sig_slope"]
    g_x = g_x + linear_backward(s["x"], p["W_beta"], np.swapaxes(g_logit, -1, -2), grads,
                                ("W_beta", None))

    def fold(t):  # a key head's gradient sums its value heads'
        return t.reshape(t.shape[:-3] + (hk, group) + t.shape[-2:]).sum(axis=-3)
    acts = {"query": merge_heads(l2_normalize_backward(s["q_unit"], s["q_r"],
                                                       fold(g_q) * s["scale"])),
            "key": merge_heads(l2_normalize_backward(s["k_unit"], s["k_r"], fold(g_k))),
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


# ---- lightning attention ------------------------------------------------------------------------

def _lightning(config, inputs, params):
    """LightningAttention (golden.specification.recurrent) from S_0 = 0 over x."""
    c = recurrent.get("lightning_attention").config(config)
    p = {n: real(a) for n, a in params.items()}
    x = real(inputs["x"])
    mask = inputs.get("mask")
    if mask is not None:
        x = x * real(np.asarray(mask, dtype=np.float64))[..., None]
    h = c["num_heads"]
    acts = {role: silu(linear(x, p[f"W_{role}"])) for role in ("query", "key", "value")}
    q, k, v = (split_heads(acts[r][0], h) for r in ("query", "key", "value"))
    a = np.exp(-p["slope"])
    o, states = decayed_sum(q, k, v, a)
    merged = merge_heads(o)
    unit, norm_saved = normalize("rms", merged, None, number(c["norm_eps"]))
    gate, gate_slope = sigmoid(linear(x, p["W_gate"]))
    gated = gate * unit * p["norm_weight"]
    y = linear(gated, p["W_out"])
    return y, None, dict(p=p, x=x, mask=mask, h=h, acts=acts, q=q, k=k, v=v, a=a,
                         states=states, unit=unit, norm_saved=norm_saved, gate=gate,
                         gate_slope=gate_slope, gated=gated)


def _lightning_backward(s, d_y, d_weights=None):
    """Gradients of Σ y ⊙ d_y: "x" and every parameter."""
    p, grads = s["p"], {}
    g_gated = linear_backward(s["gated"], p["W_out"], real(d_y), grads, ("W_out", None))
    weight, unit, gate = p["norm_weight"], s["unit"], s["gate"]
    grads["norm_weight"] = (g_gated * gate * unit).reshape(-1, unit.shape[-1]).sum(axis=0)
    g_x = linear_backward(s["x"], p["W_gate"], g_gated * unit * weight * s["gate_slope"],
                          grads, ("W_gate", None))
    g_merged, _ = normalize_backward("rms", s["norm_saved"], g_gated * gate * weight)
    g_q, g_k, g_v, g_a = decayed_sum_backward(s["q"], s["k"], s["v"], s["a"], s["states"],
                                              split_heads(g_merged, s["h"]))
    grads["slope"] = -g_a * s["a"]
    for role, g in (("query", g_q), ("key", g_k), ("value", g_v)):
        g_pre = merge_heads(g) * s["acts"][role][1]
        g_x = g_x + linear_backward(s["x"], p[f"W_{role}"], g_pre, grads, (f"W_{role}", None))
    if s["mask"] is not None:
        g_x = g_x * real(np.asarray(s["mask"], dtype=np.float64))[..., None]
    grads["x"] = g_x
    return grads


MIXERS = {**{name: (_mixer_forward(name), _mixer_backward)
             for name in ("gated_delta_net", "kimi_delta_attention")},
          "lightning_attention": (_lightning, _lightning_backward)}
