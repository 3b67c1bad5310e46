"""Fused q/k/v projections: one matrix for q, k and v, and GPT-2's Conv1D; each family one
``_fused_family`` entry of ``FAMILIES``: its settings function, its layout, the names of its
fused and output projections, and what the checkpoint verifier needs (its stacks of attention
modules in the checkpoint's keys where not a decoder's ``layers.N.self_attn``; GPT-2's own
index).

Phi-3, GPT-NeoX, Falcon, BLOOM, MPT, DBRX and GPT-2 keep q, k and v in one projection; two
layouts cover them all, as rows of the fused (out, D) weight:
  "thirds":  [q (N·Dh); k (Nkv·Dh); v (Nkv·Dh)]                       Phi-3, MPT, DBRX, GPT-2
  "grouped": per key-value group g, [q_{g·G} … q_{g·G+G−1}, k_g, v_g], G = N / Nkv heads each
             (view (Nkv, G + 2, Dh)): Falcon's new_decoder_architecture; multi-query is Nkv = 1
             (view (N + 2, Dh)); BLOOM, GPT-NeoX and Falcon's multi-head are Nkv = N
             (view (N, 3, Dh), per head [q_h, k_h, v_h]).
GPT-2's Conv1D stores its weight (in, out), already ours; nn.Linear (out, in) is transposed.
Dropout (training only) is on the attention weights, as each family drops them; GPT-2's
resid_pdrop and BLOOM's hidden_dropout act on the module's output and are the caller's.

Shape legend: D (= d_in) the model's width, N query heads, Nkv key-value heads, Dh head
width, G = N / Nkv.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import (GQA, Family, Stack, _decoder_settings, _dropout, _heads, _read,
                              _rope)


def _fused_rows(layout, n, nkv, dh) -> tuple:
    """The fused weight's rows holding q, k and v, three index arrays of N·Dh, Nkv·Dh, Nkv·Dh."""
    if layout == "thirds":
        rows = np.arange((n + 2 * nkv) * dh)
        return rows[:n * dh], rows[n * dh:(n + nkv) * dh], rows[(n + nkv) * dh:]
    rows = np.arange((n + 2 * nkv) * dh).reshape(nkv, n // nkv + 2, dh)  # (Nkv, G + 2, Dh)
    return rows[:, :-2].reshape(-1), rows[:, -2].reshape(-1), rows[:, -1].reshape(-1)


def _weight(sd, name, conv1d, mt) -> np.ndarray:
    """A projection's weight as (in, out), a copy."""
    w = _read(sd, f"{name}.weight", mt)
    return np.ascontiguousarray(w if conv1d else w.T)


def _fused_family(mt, settings, layout, fused, out, *, conv1d=False, **family) -> Family:
    """A family whose q, k and v come from one projection ``fused`` in ``layout`` (above) and
    whose output projection is ``out``; ``settings(c, layer_idx)`` -> our configuration
    (sizes included), qkv_bias and out_bias read from which biases the state dict has;
    ``family``: the Family's other fields (``stacks``, ``own_index``, ...)."""

    def our_settings(c, layer_idx, sd):
        ours = settings(c, layer_idx)
        ours.update(qkv_bias=f"{fused}.bias" in sd, out_bias=f"{out}.bias" in sd)
        return ours

    def rows(ours):
        return _fused_rows(layout, ours["num_heads"], ours["num_kv_heads"], ours["head_dim"])

    def to_neutral(sd, ours):
        w = _weight(sd, fused, conv1d, mt)  # (D, rows)
        want = (ours["num_heads"] + 2 * ours["num_kv_heads"]) * ours["head_dim"]
        if w.shape[1] != want:
            raise ValueError(f"model_type {mt!r}: {fused}.weight should have {want} outputs "
                             f"((N + 2·Nkv)·Dh from the config), got shape "
                             f"{tuple(_read(sd, f'{fused}.weight', mt).shape)}")
        params = {"W_out": _weight(sd, out, conv1d, mt)}
        for role, r in zip(("query", "key", "value"), rows(ours)):
            params[f"W_{role}"] = np.ascontiguousarray(w[:, r])
            if f"{fused}.bias" in sd:
                params[f"b_{role}"] = _read(sd, f"{fused}.bias", mt)[r].copy()
        if f"{out}.bias" in sd:
            params["b_out"] = _read(sd, f"{out}.bias", mt)
        return params

    def from_neutral(params, ours):
        r = rows(ours)
        d_in = np.asarray(params["W_query"]).shape[0]
        w = np.empty((d_in, sum(len(i) for i in r)), np.asarray(params["W_query"]).dtype)
        for role, i in zip(("query", "key", "value"), r):
            w[:, i] = params[f"W_{role}"]
        sd = {f"{fused}.weight": w if conv1d else np.ascontiguousarray(w.T),
              f"{out}.weight": np.array(params["W_out"]) if conv1d else np.ascontiguousarray(
                  np.asarray(params["W_out"]).T)}
        if "b_query" in params:
            b = np.empty(w.shape[1], np.asarray(params["b_query"]).dtype)
            for role, i in zip(("query", "key", "value"), r):
                b[i] = params[f"b_{role}"]
            sd[f"{fused}.bias"] = b
        if "b_out" in params:
            sd[f"{out}.bias"] = np.array(params["b_out"])
        return sd

    return Family(GQA, our_settings, to_neutral, from_neutral, **family)


def _phi3(c, layer_idx):
    ours = _decoder_settings(c, layer_idx, mt="phi3")
    rope = ours.get("rope_parameters", {})
    if rope.get("rope_type") == "longrope" and rope.get("factor") is None:
        # HF: max_position_embeddings / original_max_position_embeddings when the dict has none
        rope["factor"] = c["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return ours


def _gpt_neox(c, layer_idx):
    ours = {**_heads(c, c["num_attention_heads"], "gpt_neox"), **_rope(c, None, "gpt_neox")}
    return _dropout(c, ours)


def _falcon_kv_heads(c) -> int:
    """Falcon's key-value heads: num_kv_heads with new_decoder_architecture, 1 with
    multi_query, else one per head."""
    if c.get("new_decoder_architecture"):
        return c["num_kv_heads"]
    return 1 if c.get("multi_query", True) else c["num_attention_heads"]


def _falcon(c, layer_idx):
    ours = _heads(c, c["num_attention_heads"], "falcon", _falcon_kv_heads(c))
    if not c.get("alibi"):  # FalconAttention drops its weights only on the ALiBi path
        return {**ours, **_rope(c, None, "falcon")}
    ours["alibi"] = "falcon"  # (q kᵀ + m_h · j) / √Dh, bfloat16 slopes
    return _dropout(c, ours)


def _bloom(c, layer_idx):
    return _dropout(c, dict(_heads(c, c["n_head"], "bloom"), alibi="bloom"))


def _mpt(c, layer_idx):
    a = dict(c.get("attn_config") or {})
    refuse = {"attn_type": ("multihead_attention", "transformers' MptAttention has no "
                            "multi-query projection"),
              "qk_ln": (False, "transformers' MptAttention leaves out MosaicML's q/k LayerNorm"),
              "prefix_lm": (False, "a bidirectional prefix is not causal attention"),
              "alibi": (True, "transformers' MptModel adds ALiBi whatever the config says"),
              "alibi_bias_max": (8, "transformers' MptModel builds its ALiBi with 8 whatever "
                                 "the config says, MosaicML's code with this value: the "
                                 "checkpoint's meaning is ambiguous")}
    for name, (accepted, why) in refuse.items():
        if a.get(name, accepted) != accepted:
            raise ValueError(f"model_type 'mpt': attn_config['{name}'] = {a[name]!r} is not "
                             f"supported ({why})")
    ours = dict(_heads(c, c["n_heads"], "mpt"), alibi="mpt")
    if a.get("clip_qkv"):
        ours["clip_qkv"] = float(a["clip_qkv"])
    if a.get("softmax_scale") is not None:
        ours["scale"] = float(a["softmax_scale"])
    return _dropout(a, ours, "attn_pdrop")


def _dbrx(c, layer_idx):
    """DBRX: head width D / N, attn_config's kv_n_heads and clip_qkv (the fused projection's
    output clamped to [−c, c] before q, k and v are split, ours before RoPE as HF's), Llama's
    RoPE from the top-level rope_parameters (HF's rotary embedding reads them, not
    attn_config's rope_theta), attn_config's attn_pdrop as dropout."""
    a = dict(c.get("attn_config") or {})
    ours = {**_heads(c, c["n_heads"], "dbrx", a.get("kv_n_heads", 1)), **_rope(c, None, "dbrx")}
    if a.get("clip_qkv") is not None:
        ours["clip_qkv"] = float(a["clip_qkv"])
    return _dropout(a, ours, "attn_pdrop")


def _gpt2(c, layer_idx):
    ours = _heads(c, c["n_head"], "gpt2")
    scale = ours["head_dim"] ** -0.5 if c.get("scale_attn_weights", True) else 1.0
    if c.get("scale_attn_by_inverse_layer_idx"):
        scale /= float(layer_idx + 1)
    ours["scale"] = scale  # GPT2Attention's scaling, the same float
    return _dropout(c, ours, "attn_pdrop")


FAMILIES: dict[str, Family] = {
    "phi3": _fused_family("phi3", _phi3, "thirds", "qkv_proj", "o_proj"),
    "gpt_neox": _fused_family("gpt_neox", _gpt_neox, "grouped", "query_key_value", "dense",
                              stacks=(Stack("layers", "attention"),)),
    "falcon": _fused_family("falcon", _falcon, "grouped", "query_key_value", "dense",
                            stacks=(Stack("h", "self_attention"),)),
    # BLOOM adds the residual inside its attention: ours is the output of its dense
    "bloom": _fused_family("bloom", _bloom, "grouped", "query_key_value", "dense",
                           stacks=(Stack("h", "self_attention", output="dense"),)),
    "mpt": _fused_family("mpt", _mpt, "thirds", "Wqkv", "out_proj",
                         stacks=(Stack("blocks", "attn"),)),
    # DBRX's attention sits in its block's norm_attn_norm
    "dbrx": _fused_family("dbrx", _dbrx, "thirds", "Wqkv", "out_proj",
                          stacks=(Stack("blocks", "norm_attn_norm.attn"),)),
    # GPT2Attention's scaling is divided by layer_idx + 1 (scale_attn_by_inverse_layer_idx): it
    # reads its index in the whole model beyond layer_types (own_index)
    "gpt2": _fused_family("gpt2", _gpt2, "thirds", "c_attn", "c_proj", conv1d=True,
                          stacks=(Stack("h", "attn"),), own_index=True),
}
