"""The linear-attention layers of hybrid models (issue 43): Hugging Face's gated delta-rule
modules as our recurrent mixers (golden.specification.recurrent).

``FAMILIES`` maps a model_type to the Family of its ``layer_types`` "linear_attention" layers;
``golden.convert.from_hf`` takes it for those layers (``is_linear``) and the model_type's entry in
the attention tables for the others. Each reads the linear-attention module's own state dict
(``model.layers.N.linear_attn``) as Hugging Face names it:

  qwen3_next                Qwen3NextGatedDeltaNet: in_proj_qkvz and in_proj_ba fused by key-head
                            group (per group [q | k | v of its Hv/Hk value heads | z], [b | a])
  qwen3_5_text,             Qwen3_5GatedDeltaNet: in_proj_qkv ([q | k | v]), in_proj_z,
  qwen3_5_moe_text          in_proj_b, in_proj_a apart
  olmo_hybrid               OlmoHybridGatedDeltaNet: q/k/v/g/a/b_proj apart, o_proj, o_norm
                            (ε 1e-5, FLA's), β = 2σ with linear_allow_neg_eigval
and, as kimi_delta_attention (the decay per key channel, a σ output gate):
  kimi_linear               KimiLinearDeltaAttention: q/k/v/b_proj, the forget gate's low-rank
                            forget_gate.f_a_proj / f_b_proj, dt_bias, A_log (1, 1, H, 1),
                            softplus; the output gate's low-rank g_a_proj / g_b_proj; o_norm
  glm5_next_text            Glm5NextTextLinearAttention: Kimi's, A_log (H,), and with
                            linear_lower_bound λ the bounded sigmoid λ σ(e^A (f + dt_bias))
  bailing_hybrid            BailingHybridDeltaAttention (Ling 3.0): full-rank forget_gate.f_proj
                            and g_proj; kda_safe_gate's bounded sigmoid at kda_lower_bound
and, as lightning_attention:
  minimax                   MiniMaxLightningAttention: qkv_proj per head [q | k | v], SiLU,
                            output_gate, norm (over all heads, ε 1e-6), out_proj; its buffers
                            slope_rate (H, 1, 1) read as ``slope``, and query_decay, key_decay and
                            diagonal_decay (block_size's tables of e^{−slope·n}) checked against
                            it and written back from it

All: one depthwise conv1d over [q | k | v] (channels in that order, no bias), SiLU, the
decay's A_log and dt_bias, the gated RMSNorm's weight, out_proj / o_proj. HF computes the
delta rule (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) and the gated norm
in float32 even in a float64 model: its float64 module agrees with ours at float32's level.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import Family, Stack, _layer_type, _read
from golden.specification import recurrent

LINEAR = "linear_attention"


def is_linear(c, layer_idx) -> bool:
    """Whether the config's layer ``layer_idx`` is a linear-attention layer (layer_types)."""
    return _layer_type(c, layer_idx) == LINEAR


def _check_layer(mt, c, layer_idx, sd) -> None:
    """A linear-attention layer whose convolution we express: SiLU, no bias."""
    if not is_linear(c, layer_idx):
        raise ValueError(f"model_type {mt!r}: layer {layer_idx} is a "
                         f"{_layer_type(c, layer_idx)!r} layer, not linear attention")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model_type {mt!r}: hidden_act = {act!r} is not supported (the "
                         f"convolution's activation is SiLU in every family we convert; "
                         f"HF applies hidden_act there)")
    if "conv1d.bias" in sd:
        raise ValueError(f"model_type {mt!r}: conv1d.bias is not supported (no family has "
                         f"one)")


def _settings(mt, norm_eps=None):
    def settings(c, layer_idx, sd):
        _check_layer(mt, c, layer_idx, sd)
        gate = c.get("output_gate_type") or c.get("hidden_act", "silu")  # Qwen4-Exp's option
        if gate != "silu":
            raise ValueError(f"model_type {mt!r}: output_gate_type = {gate!r} is not supported "
                             f"(the gated norm's activation: SiLU in every family we convert)")
        return dict(d_in=int(c["hidden_size"]), num_k_heads=int(c["linear_num_key_heads"]),
                    num_v_heads=int(c["linear_num_value_heads"]),
                    head_k_dim=int(c["linear_key_head_dim"]),
                    head_v_dim=int(c["linear_value_head_dim"]),
                    conv_kernel=int(c["linear_conv_kernel_dim"]),
                    norm_eps=float(c["rms_norm_eps"] if norm_eps is None else norm_eps),
                    allow_neg_eigval=bool(c.get("linear_allow_neg_eigval", False)))
    return settings


def _widths(ours):
    hk, hv, dk, dv = recurrent.sizes(ours)
    return hk * dk, hv * dv


def _t(a):
    return np.ascontiguousarray(np.asarray(a).T)


def _common_in(sd, ours, mt, norm, out, decay=""):
    """The arrays every family names alike: the convolution split into its q, k, v channels,
    A_log and dt_bias (under the prefix ``decay``, flattened), the gated norm's weight, the
    output projection."""
    kd = _widths(ours)[0]
    conv = _read(sd, "conv1d.weight", mt)  # (C, 1, K)
    conv = conv.reshape(conv.shape[0], conv.shape[-1])
    return {"conv_query": conv[:kd].copy(), "conv_key": conv[kd:2 * kd].copy(),
            "conv_value": conv[2 * kd:].copy(),
            "A_log": _read(sd, f"{decay}A_log", mt).reshape(-1).copy(),
            "dt_bias": _read(sd, f"{decay}dt_bias", mt).reshape(-1).copy(),
            "norm_weight": _read(sd, f"{norm}.weight", mt).copy(),
            "W_out": _t(_read(sd, f"{out}.weight", mt))}


def _common_out(p, norm, out, decay="", a_log_shape=None):
    conv = np.concatenate([np.asarray(p[n]) for n in ("conv_query", "conv_key", "conv_value")])
    a_log = np.array(p["A_log"])
    return {"conv1d.weight": np.ascontiguousarray(conv[:, None, :]),
            f"{decay}A_log": a_log if a_log_shape is None else a_log.reshape(a_log_shape),
            f"{decay}dt_bias": np.array(p["dt_bias"]),
            f"{norm}.weight": np.array(p["norm_weight"]), f"{out}.weight": _t(p["W_out"])}


# ---- Qwen3-Next: in_proj_qkvz and in_proj_ba fused by key-head group -------------------------

def _qwen3_next_in(sd, ours, mt="qwen3_next"):
    hk, hv, dk, dv = (ours[n] for n in ("num_k_heads", "num_v_heads", "head_k_dim",
                                         "head_v_dim"))
    r = hv // hk
    qkvz = _t(_read(sd, "in_proj_qkvz.weight", mt))  # (d, Hk·(2Dk + 2r·Dv))
    d = qkvz.shape[0]
    qkvz = qkvz.reshape(d, hk, 2 * dk + 2 * r * dv)
    ba = _t(_read(sd, "in_proj_ba.weight", mt)).reshape(d, hk, 2 * r)
    cut = np.cumsum([dk, dk, r * dv])
    q, k, v, z = np.split(qkvz, cut, axis=-1)
    b, a = np.split(ba, [r], axis=-1)
    flat = (lambda t: np.ascontiguousarray(t.reshape(d, -1)))
    return {"W_query": flat(q), "W_key": flat(k), "W_value": flat(v), "W_gate": flat(z),
            "W_beta": flat(b), "W_decay": flat(a),
            **_common_in(sd, ours, mt, "norm", "out_proj")}


def _qwen3_next_out(p, ours):
    hk, hv = ours["num_k_heads"], ours["num_v_heads"]
    d = np.asarray(p["W_query"]).shape[0]
    grouped = (lambda n: np.asarray(p[n]).reshape(d, hk, -1))
    qkvz = np.concatenate([grouped(n) for n in ("W_query", "W_key", "W_value", "W_gate")],
                          axis=-1).reshape(d, -1)
    ba = np.concatenate([grouped("W_beta"), grouped("W_decay")], axis=-1).reshape(d, -1)
    return {"in_proj_qkvz.weight": _t(qkvz), "in_proj_ba.weight": _t(ba),
            **_common_out(p, "norm", "out_proj")}


# ---- Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a -----------------------------------

def _qwen3_5_in(mt):
    def to_neutral(sd, ours):
        kd, _ = _widths(ours)
        qkv = _t(_read(sd, "in_proj_qkv.weight", mt))
        return {"W_query": qkv[:, :kd].copy(), "W_key": qkv[:, kd:2 * kd].copy(),
                "W_value": qkv[:, 2 * kd:].copy(), "W_gate": _t(_read(sd, "in_proj_z.weight", mt)),
                "W_beta": _t(_read(sd, "in_proj_b.weight", mt)),
                "W_decay": _t(_read(sd, "in_proj_a.weight", mt)),
                **_common_in(sd, ours, mt, "norm", "out_proj")}
    return to_neutral


def _qwen3_5_out(p, ours):
    qkv = np.concatenate([np.asarray(p[n]) for n in ("W_query", "W_key", "W_value")], axis=1)
    return {"in_proj_qkv.weight": _t(qkv), "in_proj_z.weight": _t(p["W_gate"]),
            "in_proj_b.weight": _t(p["W_beta"]), "in_proj_a.weight": _t(p["W_decay"]),
            **_common_out(p, "norm", "out_proj")}


# ---- OLMo hybrid: every projection apart --------------------------------------------------------

_OLMO = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "gate": "g_proj",
         "beta": "b_proj", "decay": "a_proj"}


def _olmo_in(sd, ours, mt="olmo_hybrid"):
    return {**{f"W_{role}": _t(_read(sd, f"{name}.weight", mt)) for role, name in _OLMO.items()},
            **_common_in(sd, ours, mt, "o_norm", "o_proj")}


def _olmo_out(p, ours):
    return {**{f"{name}.weight": _t(p[f"W_{role}"]) for role, name in _OLMO.items()},
            **_common_out(p, "o_norm", "o_proj")}


# ---- Kimi Delta Attention: Kimi Linear, GLM-5.3-Flash, Ling 3.0 ---------------------------------

_KDA = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "beta": "b_proj"}


def _kda_settings(mt, bound):
    """``bound(c)``: the bounded sigmoid's λ, or None for the softplus forget gate. The low-rank
    projections' rank is linear_head_dim (their checkpoints' f_a_proj and g_a_proj)."""
    def settings(c, layer_idx, sd):
        _check_layer(mt, c, layer_idx, sd)
        lower = bound(c)
        rank = int(c["linear_head_dim"])
        return dict(d_in=int(c["hidden_size"]), num_heads=int(c["linear_num_heads"]),
                    head_dim=rank, conv_kernel=int(c["linear_conv_kernel_dim"]),
                    norm_eps=float(c["rms_norm_eps"]),
                    decay_rank=rank if "forget_gate.f_a_proj.weight" in sd else None,
                    gate_rank=rank if "g_a_proj.weight" in sd else None,
                    forget_gate="softplus" if lower is None else "bounded_sigmoid",
                    decay_lower_bound=None if lower is None else float(lower))
    return settings


def _kda_names(ours):
    names = dict(_KDA)
    names.update({"decay_a": "forget_gate.f_a_proj", "decay_b": "forget_gate.f_b_proj"}
                 if ours["decay_rank"] is not None else {"decay": "forget_gate.f_proj"})
    names.update({"gate_a": "g_a_proj", "gate_b": "g_b_proj"}
                 if ours["gate_rank"] is not None else {"gate": "g_proj"})
    return names


def _kda_in(mt):
    def to_neutral(sd, ours):
        return {**{f"W_{role}": _t(_read(sd, f"{name}.weight", mt))
                   for role, name in _kda_names(ours).items()},
                **_common_in(sd, ours, mt, "o_norm", "o_proj", decay="forget_gate.")}
    return to_neutral


def _kda_out(a_log_shape):
    """``a_log_shape(H)``: A_log's shape on file (Kimi Linear's (1, 1, H, 1))."""
    def from_neutral(p, ours):
        return {**{f"{name}.weight": _t(p[f"W_{role}"])
                   for role, name in _kda_names(ours).items()},
                **_common_out(p, "o_norm", "o_proj", decay="forget_gate.",
                              a_log_shape=a_log_shape(ours["num_heads"]))}
    return from_neutral


# ---- lightning attention: MiniMax ---------------------------------------------------------------

def _lightning_settings(c, layer_idx, sd):
    mt = "minimax"
    _check_layer(mt, c, layer_idx, {})
    n = int(c["num_attention_heads"])
    return dict(d_in=int(c["hidden_size"]), num_heads=n,
                head_dim=int(c.get("head_dim") or c["hidden_size"] // n), norm_eps=1e-6,
                block_size=int(c.get("block_size", 256)))


def lightning_buffers(slope, block_size) -> dict:
    """MiniMaxLightningAttention's decay buffers from its slopes (H,), as its
    ``decay_factors`` forms them, in float64: query_decay e^{−s n}, key_decay e^{−s (b − n)}
    (n = 1 … b, b = block_size) and diagonal_decay e^{−s (i − j)} for i ≥ j (0 above)."""
    s = np.asarray(slope, dtype=np.float64)[:, None, None]  # (H, 1, 1)
    n = np.arange(1, block_size + 1, dtype=np.float64)
    diagonal = s[None] * (n[:, None] - n[None, :])[None, None]
    return {"slope_rate": s, "query_decay": np.exp(-s * n[:, None]),
            "key_decay": np.exp(-s * (block_size - n[:, None])),
            "diagonal_decay": np.where(diagonal >= 0, np.exp(-np.abs(diagonal)), 0.0)}


def _lightning_in(sd, ours, mt="minimax"):
    h, d = ours["num_heads"], ours["head_dim"]
    qkv = _t(_read(sd, "qkv_proj.weight", mt))
    width = qkv.shape[0]
    q, k, v = np.split(qkv.reshape(width, h, 3 * d), 3, axis=-1)
    slope = _read(sd, "slope_rate", mt).reshape(-1).copy()
    if slope.shape != (h,):
        raise ValueError(f"model_type {mt!r}: slope_rate should hold one slope per head, shape "
                         f"({h}, 1, 1), got {_read(sd, 'slope_rate', mt).shape}")
    block = ours["block_size"]
    if "query_decay" in sd:  # the tables HF computes with, checked against the slopes
        want = lightning_buffers(slope, block)
        for name in ("query_decay", "key_decay", "diagonal_decay"):
            got = _read(sd, name, mt).astype(np.float64)
            if got.shape != want[name].shape or not np.allclose(got, want[name], rtol=1e-6,
                                                                atol=1e-30):
                raise ValueError(f"model_type {mt!r}: {name} does not match slope_rate (the "
                                 f"module computes with it: e^(-slope·n) for block_size "
                                 f"{block}), got shape {got.shape}")
    flat = (lambda t: np.ascontiguousarray(t.reshape(width, -1)))
    return {"W_query": flat(q), "W_key": flat(k), "W_value": flat(v),
            "W_gate": _t(_read(sd, "output_gate.weight", mt)),
            "W_out": _t(_read(sd, "out_proj.weight", mt)),
            "norm_weight": _read(sd, "norm.weight", mt).copy(), "slope": slope}


def _lightning_out():
    def from_neutral(p, ours):
        block_size = ours["block_size"]
        h = ours["num_heads"]
        d = np.asarray(p["W_query"]).shape[0]
        grouped = (lambda n: np.asarray(p[n]).reshape(d, h, -1))
        qkv = np.concatenate([grouped(n) for n in ("W_query", "W_key", "W_value")],
                             axis=-1).reshape(d, -1)
        return {"qkv_proj.weight": _t(qkv), "output_gate.weight": _t(p["W_gate"]),
                "out_proj.weight": _t(p["W_out"]), "norm.weight": np.array(p["norm_weight"]),
                **lightning_buffers(p["slope"], block_size)}
    return from_neutral


GDN, KDA = "gated_delta_net", "kimi_delta_attention"
_FLAT = (lambda h: (h,))
# Where the checkpoint verifier (attn-parity hf) finds each family's linear-attention modules:
# "model.layers.N.linear_attn" (the Gated DeltaNet families), or "model.layers.N.self_attn"
# beside the softmax layers' (Kimi Linear, GLM-5.3, Ling 3.0, MiniMax name both so).
# Their checkpoints keep the convolution's q, k and v channels apart (FLA's layout, which
# transformers' conversion_mapping joins on loading) where noted, and Kimi's forget gate's
# arrays beside the attention's (renamed into its forget_gate on loading).
LINEAR_ATTN = (Stack("layers", "linear_attn", linear=True),)
SELF_ATTN = (Stack("layers", "self_attn", linear=True),)
_CONV = (("conv1d.weight", ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")),)
OLMO_ATTN = (Stack("layers", "linear_attn", linear=True, joined=_CONV),)
KIMI_ATTN = (Stack("layers", "self_attn", linear=True, joined=_CONV, renames=tuple(
    (name, f"forget_gate.{name}") for name in ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log"))),)
# Ling 3.0's files keep its own names, which transformers renames on loading (its
# conversion_mapping's "bailing_hybrid"): layers.N.attention (the module's self_attn), dense
# (o_proj), the forget gate's f_proj, dt_bias and A_log at the module's top, q/k/v_conv1d apart
LING_ATTN = (Stack("layers", "attention", linear=True, in_model=("layers", "self_attn"),
                   joined=_CONV, renames=(("dense.", "o_proj."), *(
                       (name, f"forget_gate.{name}") for name in ("f_proj.", "dt_bias",
                                                                   "A_log")))),)
FAMILIES: dict[str, Family] = {
    "qwen3_next": Family(GDN, _settings("qwen3_next"), _qwen3_next_in, _qwen3_next_out,
                         stacks=LINEAR_ATTN),
    "qwen3_5_text": Family(GDN, _settings("qwen3_5_text"), _qwen3_5_in("qwen3_5_text"),
                           _qwen3_5_out, stacks=LINEAR_ATTN),
    "qwen3_5_moe_text": Family(GDN, _settings("qwen3_5_moe_text"),
                               _qwen3_5_in("qwen3_5_moe_text"), _qwen3_5_out,
                               stacks=LINEAR_ATTN),
    # Qwen4-Exp's linear layers: Qwen3.5's (its gated norm's activation output_gate_type,
    # SiLU by default, read above)
    "qwen4_exp_text": Family(GDN, _settings("qwen4_exp_text"), _qwen3_5_in("qwen4_exp_text"),
                             _qwen3_5_out, stacks=LINEAR_ATTN),
    "olmo_hybrid": Family(GDN, _settings("olmo_hybrid", norm_eps=1e-5), _olmo_in, _olmo_out,
                          stacks=OLMO_ATTN),
    "kimi_linear": Family(KDA, _kda_settings("kimi_linear", lambda c: None),
                          _kda_in("kimi_linear"), _kda_out(lambda h: (1, 1, h, 1)),
                          stacks=KIMI_ATTN),
    "glm5_next_text": Family(KDA, _kda_settings("glm5_next_text",
                                                lambda c: c.get("linear_lower_bound")),
                             _kda_in("glm5_next_text"), _kda_out(_FLAT), stacks=KIMI_ATTN),
    "bailing_hybrid": Family(KDA, _kda_settings(
        "bailing_hybrid", lambda c: c["kda_lower_bound"] if c.get("kda_safe_gate") else None),
        _kda_in("bailing_hybrid"), _kda_out(_FLAT), stacks=LING_ATTN),
    "minimax": Family("lightning_attention", _lightning_settings, _lightning_in,
                      _lightning_out(), stacks=SELF_ATTN),
}
