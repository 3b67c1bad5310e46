"""Decoders of the Llama shape: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (nn.Linear), each
family one ``_llama_like`` entry of ``FAMILIES`` with what it adds to the shared decoder
settings (golden.hf.family's ``_decoder_settings``): a small settings function (Gemma's scale
and softcap, the QK norms of Qwen3, OLMo 2, Gemma 3, Cohere, StableLM, Chameleon, Llama 4's
chunks and NoPE layers, ...), the state-dict keys of its q/k norms, and the arrays it moves
besides the four projections (GPT-OSS's sinks, Qwen3-Next's output gate, StableLM's per-head
norms, Chameleon's norm biases). Each
keeps its attention at ``layers.N.self_attn`` in a checkpoint's keys, the Family's default
``stacks``. ``REFUSED``: text towers of the same shape we do not convert, each with why
(from_hf names it). The multimodal text towers' settings (MRoPE) are golden.hf.text_towers',
Gemma 4's and Gemma 3n's golden.hf.gemma's; their entries are in this table.

Shape legend: D (= d_in) the model's width, N query heads, Dh head width.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from golden.hf.family import (GQA, LLAMA_NAMES, Family, Stack, _bias_flags, _decoder_settings,
                              _heads, _layer_type, _linears_to_neutral, _neutral_to_linears,
                              _no_window, _qwen3, _read, _whole_head, llama4_scaling)
from golden.hf.gemma import _gemma4_text
from golden.hf.text_towers import (_ernie4_5_vl_text, _glm4v_moe_text, _glm4v_text, _mrope,
                                   _paddleocr_vl_text, _qwen2_5_omni_text, _qwen2_vl_text,
                                   _qwen3_omni_moe_text, _qwen3_vl_text)


def _qk_norm_entries(sd, mt, q="q_norm.weight", k="k_norm.weight") -> dict:
    return {"q_norm": _read(sd, q, mt), "k_norm": _read(sd, k, mt)}


def _llama_like(mt, extra=None, norms=None, to_extra=None, from_extra=None, **family) -> Family:
    """A family with LLAMA_NAMES' projections; ``extra(c, layer_idx, ours)`` adds its settings;
    ``norms`` the q/k norm state-dict keys (copied as q_norm, k_norm); ``to_extra`` and
    ``from_extra`` move more arrays (sinks, a gate)."""

    def settings(c, layer_idx, sd):
        ours = _decoder_settings(c, layer_idx, mt=mt)
        ours.update(_bias_flags(sd, LLAMA_NAMES, mt))
        if extra is not None:
            extra(c, layer_idx, ours)
        return ours

    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, LLAMA_NAMES, mt)
        if norms is not None and ours.get("qk_norm") not in (None, "l2"):
            params.update(_qk_norm_entries(sd, mt, *norms))
        if to_extra is not None:
            params = to_extra(sd, ours, params)
        return params

    def from_neutral(params, ours):
        sd = _neutral_to_linears(params, LLAMA_NAMES)
        if norms is not None and "q_norm" in params:
            sd[norms[0]], sd[norms[1]] = np.array(params["q_norm"]), np.array(params["k_norm"])
        if from_extra is not None:
            sd = from_extra(params, ours, sd)
        return sd

    return Family(GQA, settings, to_neutral, from_neutral, **family)


def _gemma(c, layer_idx, ours):
    ours["scale"] = float(c["query_pre_attn_scalar"]) ** -0.5
    if c.get("attn_logit_softcapping") is not None:
        ours["softcap"] = float(c["attn_logit_softcapping"])


def _gemma3(c, layer_idx, ours):
    _gemma(c, layer_idx, ours)
    ours.update(qk_norm="rms_one_plus", qk_norm_eps=float(c["rms_norm_eps"]))


def _olmo2(c, layer_idx, ours):
    ours.update(qk_norm="rms_across_heads", qk_norm_eps=float(c["rms_norm_eps"]))


def _olmo(c, layer_idx, ours):
    if c.get("clip_qkv") is not None:
        ours["clip_qkv"] = float(c["clip_qkv"])


def _cohere(c, layer_idx, ours):
    ours["rope_interleaved"] = True
    if c.get("use_qk_norm"):
        ours.update(qk_norm="layer", qk_norm_eps=float(c["layer_norm_eps"]))


def _granite(c, layer_idx, ours):
    ours["scale"] = float(c["attention_multiplier"])


def _nope(c, layer_idx, ours):
    """SmolLM3 and Llama 4: no_rope_layers[layer] == 0 is a NoPE layer."""
    flags = c.get("no_rope_layers")
    if flags is not None and not flags[layer_idx]:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)
        return True
    return False


def _smollm3(c, layer_idx, ours):
    _nope(c, layer_idx, ours)


def _llama4(c, layer_idx, ours):
    ours["rope_interleaved"] = True  # complex pairs (2i, 2i + 1)
    if _layer_type(c, layer_idx) == "chunked_attention":
        ours["attention_chunk_size"] = int(c["attention_chunk_size"])
    if _nope(c, layer_idx, ours):
        ours.pop("rope_interleaved")
        if c.get("attn_temperature_tuning"):
            ours["query_temperature"] = {"beta": float(c["attn_scale"]),
                                         "floor_scale": int(c["floor_scale"]), "shift": 1}
    elif c.get("use_qk_norm"):
        ours.update(qk_norm="l2", qk_norm_eps=float(c["rms_norm_eps"]))


def _gpt_oss(c, layer_idx, ours):
    ours["sinks"] = True


def _moved(name, key, mt, when=None) -> tuple:
    """(to_extra, from_extra) moving one array: our parameter ``name`` from and to the state
    dict's ``key`` (model_type ``mt`` in the messages); ``when(ours)`` says which layers have
    it (default all)."""
    def to_extra(sd, ours, params):
        if when is None or when(ours):
            params[name] = _read(sd, key, mt)
        return params

    def from_extra(params, ours, sd):
        if name in params:
            sd[key] = np.array(params[name])
        return sd
    return to_extra, from_extra


# GPT-OSS's sinks (and those of the families that copy them), by name
_sinks_in, _sinks_out = _moved("sinks", "sinks", "gpt_oss")


def _minimax(c, layer_idx, ours):
    """MiniMax's softmax layers (its full_attention ones; the lightning layers are
    golden.hf.linear's): Mixtral's attention, its sliding_window on every one of them (HF's
    MiniMaxAttention passes the config's, whatever layer_types says)."""
    if c.get("sliding_window") is not None:
        ours["sliding_window"] = int(c["sliding_window"])


def _gated_full_attention(mt):
    """Qwen3-Next's attention (its full_attention layers: (1 + w) QK norms, the output gate in
    q_proj); its linear_attention layers refused by name."""

    def extra(c, layer_idx, ours):
        if _layer_type(c, layer_idx) != "full_attention":
            raise ValueError(f"model_type {mt!r}: layer {layer_idx} is a "
                             f"{_layer_type(c, layer_idx)!r} layer (Gated DeltaNet, not softmax "
                             f"attention); only its full_attention layers convert")
        ours.update(qk_norm="rms_one_plus", qk_norm_eps=float(c["rms_norm_eps"]),
                    output_gate=True)
    return extra


_qwen3_next = _gated_full_attention("qwen3_next")


def _qwen3_5(mt):
    """Qwen3.5's full_attention layers: Qwen3-Next's attention with Qwen3-VL's interleaved
    MRoPE ([11, 11, 10] by default) on its rotary slice."""
    gated = _gated_full_attention(mt)

    def extra(c, layer_idx, ours):
        gated(c, layer_idx, ours)
        _mrope([11, 11, 10], True)(c, layer_idx, ours)
    return extra


def _gate_split(sd, ours, params):
    """q_proj's output is per head [query (Dh) | gate (Dh)]: split into W_query and W_gate."""
    n, dh = ours["num_heads"], ours["head_dim"]
    w = params["W_query"]  # (d_in, N·2·Dh)
    w = w.reshape(w.shape[0], n, 2, dh)
    params["W_query"], params["W_gate"] = (np.ascontiguousarray(
        w[:, :, i].reshape(w.shape[0], n * dh)) for i in (0, 1))
    if "b_query" in params:
        b = params["b_query"].reshape(n, 2, dh)
        params["b_query"], params["b_gate"] = (b[:, i].reshape(n * dh).copy() for i in (0, 1))
    return params


def _gate_join(params, ours, sd):
    n, dh = ours["num_heads"], ours["head_dim"]
    q, g = (np.asarray(params[n_]).T.reshape(n, 1, dh, -1) for n_ in ("W_query", "W_gate"))
    sd["q_proj.weight"] = np.concatenate([q, g], axis=1).reshape(n * 2 * dh, -1)
    if "b_query" in params:
        qb, gb = (np.asarray(params[n_]).reshape(n, 1, dh) for n_ in ("b_query", "b_gate"))
        sd["q_proj.bias"] = np.concatenate([qb, gb], axis=1).reshape(-1)
    return sd


def _stablelm(c, layer_idx, ours):
    ours.update(_heads(c, c["num_attention_heads"], "stablelm",
                       c.get("num_key_value_heads") or c["num_attention_heads"]))
    if c.get("qk_layernorm"):
        ours.update(qk_norm="layer", qk_norm_eps=float(c["layer_norm_eps"]))


def _chameleon(c, layer_idx, ours):
    """Chameleon's text attention: head width D / N whatever the config says, q and k
    LayerNorm-ed per head with a weight and a bias each (HF's ChameleonLayerNorm, its ε 1e-5
    fixed in its forward, not a config field), before RoPE."""
    ours.update(_heads(c, c["num_attention_heads"], "chameleon",
                       c.get("num_key_value_heads") or c["num_attention_heads"]))
    ours.update(qk_norm="layer_with_bias", qk_norm_eps=1e-5)


def _norm_biases_in(sd, ours, params):
    """Chameleon's q_norm.bias (N, Dh) and k_norm.bias (Nkv, Dh) as q_norm_bias, k_norm_bias."""
    params.update(q_norm_bias=_read(sd, "q_norm.bias", "chameleon"),
                  k_norm_bias=_read(sd, "k_norm.bias", "chameleon"))
    return params


def _norm_biases_out(params, ours, sd):
    sd["q_norm.bias"], sd["k_norm.bias"] = (np.array(params[n])
                                            for n in ("q_norm_bias", "k_norm_bias"))
    return sd


def _per_head_norms_in(sd, ours, params):
    """StableLM's q_layernorm.norms.{h}.weight (Dh,) for each head, stacked to (N, Dh)."""
    if ours.get("qk_norm") == "layer":
        for ours_name, hf_name, heads in (("q_norm", "q_layernorm", ours["num_heads"]),
                                          ("k_norm", "k_layernorm", ours["num_kv_heads"])):
            params[ours_name] = np.stack([_read(sd, f"{hf_name}.norms.{h}.weight", "stablelm")
                                          for h in range(heads)])
    return params


def _per_head_norms_out(params, ours, sd):
    for ours_name, hf_name in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        if ours_name in params:
            for h, w in enumerate(np.asarray(params[ours_name])):
                sd[f"{hf_name}.norms.{h}.weight"] = np.array(w)
    return sd


def _plain_no_window(c, layer_idx, ours):
    """Llama's attention where HF's model makes a causal mask whatever the config's
    sliding_window says (none of these reads it)."""
    _no_window(ours)


def _qwen3_no_window(c, layer_idx, ours):
    _qwen3(c, layer_idx, ours)
    _no_window(ours)


def _olmo2_no_window(c, layer_idx, ours):
    _olmo2(c, layer_idx, ours)
    _no_window(ours)


def _granite_no_window(c, layer_idx, ours):
    _granite(c, layer_idx, ours)
    _no_window(ours)


def _rope_on_sliding_layers(c, layer_idx, ours):
    """EXAONE 4's attention (EXAONE-MoE, Kolibri): per-head RMSNorm of q and k; with a
    sliding_window, RoPE on the sliding layers only (the full layers NoPE), without one,
    RoPE on every layer."""
    _qwen3(c, layer_idx, ours)
    if c.get("sliding_window") is not None and _layer_type(c, layer_idx) != "sliding_attention":
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)


def _ministral3(c, layer_idx, ours):
    """Ministral 3: Llama 4's query temperature 1 + β·ln(1 + ⌊p / F⌋) on every layer, without
    Llama 4's shift (β rope_parameters' llama_4_scaling_beta, F its
    original_max_position_embeddings, p the token's position); the two fields HF's rotary
    embedding does not read (and its legacy "type") dropped from our RoPE."""
    mt = "ministral3"
    given = c.get("rope_parameters") or {}
    rope = ours.get("rope_parameters", {})
    for name in ("type", "max_position_embeddings", "llama_4_scaling_beta"):
        rope.pop(name, None)
    ours["query_temperature"] = llama4_scaling(given, mt)


def _phimoe(c, layer_idx, ours):
    """PhiMoE: Llama's attention; its rotary embedding (HF 5.x) computes the frequencies with
    no sequence length, so always longrope's short_factor, and multiplies cos and sin by
    short_mscale up to original_max_position_embeddings, long_mscale past it: ours the
    short factors at every length and the one mscale as attention_factor (unequal ones
    refused)."""
    rope = ours.get("rope_parameters", {})
    short, long = rope.pop("short_mscale", None), rope.pop("long_mscale", None)
    if rope.get("rope_type", "default") == "default":
        return
    if rope["rope_type"] != "longrope" or short is None or short != long:
        raise ValueError(f"model_type 'phimoe': rope_parameters with rope_type "
                         f"{rope['rope_type']!r}, short_mscale {short!r} and long_mscale "
                         f"{long!r} is not supported (we take 'default', or 'longrope' with "
                         f"equal mscales: HF switches them with the sequence length)")
    rope.update(long_factor=list(rope["short_factor"]), attention_factor=float(short))


def _partial_interleaved(c, layer_idx, ours):
    """GLM and GLM-4: the first partial_rotary_factor of each head turned (0.5 by HF's
    config), on interleaved pairs (2i, 2i + 1); HF's attention has no window."""
    _no_window(ours)
    ours["rope_interleaved"] = True


def _interleaved_no_window(c, layer_idx, ours):
    """Helium: interleaved pairs (2i, 2i + 1) over the whole head; no window."""
    _no_window(ours)
    ours["rope_interleaved"] = True


def _cohere2(c, layer_idx, ours):
    """Cohere 2 (and Cohere 2 MoE): Cohere's interleaved RoPE on the sliding layers only, the
    full layers NoPE (no layer turned at all without a sliding_window: HF's attention turns q
    and k only where it has a window), except Cohere 2 MoE's dense prefix layers with
    prefix_dense_sliding_window_pattern 1, which HF turns (its ``force_rope``); no QK norm."""
    mlp = c.get("mlp_layer_types")
    forced = (mlp is not None and mlp[layer_idx] == "dense"
              and c.get("prefix_dense_sliding_window_pattern", 1) == 1)
    if "sliding_window" in ours or forced:
        ours["rope_interleaved"] = True
    else:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)


def _ernie4_5(mt):
    """ERNIE 4.5 (and its MoE): interleaved pairs (2i, 2i + 1) over the whole head (HF's
    attention has no slice for a partial_rotary_factor), no window, an attention dropout of 0
    whatever the config says."""

    def extra(c, layer_idx, ours):
        _no_window(ours, fixed_dropout=True)
        ours["rope_interleaved"] = True
        _whole_head(mt, ours)
    return extra


def _glm4_moe(c, layer_idx, ours):
    """GLM-4.5 (glm4_moe): Llama's rotate-half pairs on the first partial_rotary_factor of each
    head (0.5 by HF's config), per-head RMSNorm of q and k with use_qk_norm, q/k/v bias with
    attention_bias (o_proj none); HF's attention has no window."""
    _no_window(ours)
    if c.get("use_qk_norm"):
        _qwen3(c, layer_idx, ours)


def _minimax_m2(c, layer_idx, ours):
    """MiniMax-M2: OLMo 2's RMSNorm of the whole q and k (across heads), no window; a
    config.json of before transformers 5 gives its partial rotary as ``rotary_dim`` (features
    turned per head), read as HF's config reads it, partial_rotary_factor rotary_dim / Dh."""
    _olmo2_no_window(c, layer_idx, ours)
    if c.get("rotary_dim") is not None:
        if "rope_parameters" not in ours:
            ours["rope_parameters"] = {"rope_theta": ours.pop("rope_theta")}
        ours["rope_parameters"].setdefault("partial_rotary_factor",
                                           c["rotary_dim"] / ours["head_dim"])


def _molmo2_text(c, layer_idx, ours):
    """Molmo 2's text tower: OLMo 2's attention, its q and k RMSNorm per head (qk_norm_type
    "qwen3", HF's default) or across heads ("olmo"), q/k/v bias with attention_bias (o_proj
    none); rope_parameters' scaling only on the rope_scaling_layers (all when the config lists
    none), the others HF's default RoPE of the same θ; the whole head turned; no window."""
    _no_window(ours)
    (_olmo2 if c.get("qk_norm_type", "qwen3") == "olmo" else _qwen3)(c, layer_idx, ours)
    _whole_head("molmo2_text", ours)
    scaled = c.get("rope_scaling_layers")
    if scaled is not None and layer_idx not in scaled:
        ours["rope_parameters"] = {"rope_type": "default",
                                   "rope_theta": ours["rope_parameters"]["rope_theta"]}


def _granite_swa(c, layer_idx, ours):
    """Granite SWA (and Granite MoE SWA): Granite's scale (attention_multiplier), a sink per
    head (HF scales the output by σ(lse − s_h), which is GPT-OSS's extra logit s_h in the
    softmax's denominator), the window of layer_types' sliding layers, and RoPE of θ
    layer_rope_theta[layer] with rope_parameters' other fields (θ 0: a NoPE layer)."""
    _granite(c, layer_idx, ours)
    ours["sinks"] = True
    thetas = c.get("layer_rope_theta")
    if thetas is None:
        return
    if not thetas[layer_idx]:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)
    elif "rope_parameters" in ours:
        ours["rope_parameters"] = dict(ours["rope_parameters"],
                                       rope_theta=float(thetas[layer_idx]))
    else:
        ours["rope_theta"] = float(thetas[layer_idx])


def _flint(c, layer_idx, ours):
    """Flint: Qwen3's per-head RMSNorm of q and k, a sink per head (GPT-OSS's extra logit),
    and RoPE on the sliding layers only, the full layers NoPE (no layer turned without a
    sliding_window: HF turns q and k only where its layer has a window)."""
    _qwen3(c, layer_idx, ours)
    ours["sinks"] = True
    if "sliding_window" not in ours:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)


def _nanochat(c, layer_idx, ours):
    """NanoChat: Qwen3's projections, a weightless RMS norm of q and k per head ("l2") after
    RoPE (the norm is blind to RoPE's rotation, so before it is the same), no window; its
    RoPE turns the other way (``_halves_swapped``)."""
    _no_window(ours)
    ours.update(qk_norm="l2", qk_norm_eps=float(c["rms_norm_eps"]))
    _whole_head("nanochat", ours)


def _swap_halves(a, dh, axis):
    """``a`` with the two halves of each head's Dh features swapped along ``axis`` (N·Dh long),
    a copy; its own inverse."""
    a = np.moveaxis(np.asarray(a), axis, 0)
    n = a.shape[0] // dh
    out = a.reshape(n, 2, dh // 2, *a.shape[1:])[:, ::-1].reshape(a.shape)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def _halves_swapped_in(sd, ours, params):
    return _halves_swapped(params, ours)


def _halves_swapped_out(params, ours, sd):
    return _halves_swapped(params, ours, sd)


def _halves_swapped(params, ours, sd=None):
    """NanoChat's rotate_half is (x2, −x1), Llama's negated: its RoPE turns each pair (x1, x2)
    of a head's halves by −θ, which is Llama's +θ on the pair swapped, (x2, x1). Scores are
    unchanged when q and k both have their halves swapped, and the weightless norm is blind to
    the order: ours are HF's q_proj and k_proj with each head's halves swapped (both ways)."""
    dh = ours["head_dim"]
    if sd is not None:  # to_hf: the state dict's (out, in) weights and biases
        for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
            if name in sd:
                sd[name] = _swap_halves(sd[name], dh, 0)
        return sd
    for role in ("query", "key"):
        params[f"W_{role}"] = _swap_halves(params[f"W_{role}"], dh, 1)  # (D, N·Dh)
        if f"b_{role}" in params:
            params[f"b_{role}"] = _swap_halves(params[f"b_{role}"], dh, 0)
    return params


def _privacy_filter(c, layer_idx, ours):
    """OpenAI's privacy filter (a token classifier): GPT-OSS's attention (a sink per head,
    yarn, q/k/v/o biases) made bidirectional, every layer within HF's bidirectional window
    |i − j| ≤ W (keys p − W … p + W), on interleaved pairs (2i, 2i + 1); HF scales q and k by
    Dh^(-1/4) each, our scale Dh^(-1/2) the two together."""
    ours.update(causal=False, sinks=True, rope_interleaved=True)
    window = c.get("sliding_window")
    if window is not None:
        ours["sliding_window"] = (int(window), int(window))


def _afmoe(c, layer_idx, ours):
    """AFMoE: Qwen3's per-head RMSNorm of q and k, RoPE on the sliding layers only (the full
    layers NoPE, whatever sliding_window says), the output gated per feature by σ(x W_g) from
    ``gate_proj`` (``_gate_proj``)."""
    _qwen3(c, layer_idx, ours)
    ours["output_gate"] = True
    if _layer_type(c, layer_idx) != "sliding_attention":
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)


def _hrm_text(c, layer_idx, ours):
    """HRM-Text: Llama's attention with as many KV heads as heads, the output gated per feature
    by σ(x W_g + b_g) from ``gate_proj`` (its bias with attention_bias, as q's, k's and v's);
    no window. Its prefix-LM (bidirectional instruction tokens, from the model's
    token_type_ids) is a mask of the caller's, not of the module: without token_type_ids HF's
    mask is causal, which is what converts."""
    _no_window(ours)
    ours.update(num_kv_heads=ours["num_heads"], output_gate=True)


def _muse_glimmer_text(c, layer_idx, ours):
    """Muse Glimmer's text tower: a weightless RMS norm of q and k per head ("l2"; HF's before
    RoPE, the same after), q then times qk_scale_factor (ours: the scale Dh^(−1/2) times it),
    sliding layers by layer_types, RoPE where layer_rope_theta[layer] is not 0 (HF's model
    turns those layers with rope_parameters' θ, whatever the entry's value; 0 a NoPE layer),
    the output gated per feature by σ(x W_g) from ``gate_proj``."""
    ours.update(qk_norm="l2", qk_norm_eps=float(c["rms_norm_eps"]), output_gate=True,
                scale=ours["head_dim"] ** -0.5 * float(c.get("qk_scale_factor", 3.87)))
    thetas = c.get("layer_rope_theta")
    if thetas is not None and not thetas[layer_idx]:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)


def _gate_proj(mt, bias=False, name="gate_proj"):
    """(to_extra, from_extra) of a ``gate_proj`` (nn.Linear D -> N·Dh, or D -> N for a gate per
    head; ``name`` its state-dict name) beside q, k, v, o: W_gate its weight transposed, b_gate
    its bias (``bias``: HRM-Text's, with attention_bias); where q, k and v have biases and
    gate_proj none (AFMoE, Muse Glimmer), b_gate zeros, σ(x W_g + 0), which to_hf leaves out
    (and refuses non-zero); none where the settings say gate_bias=False (Laguna's g_proj).
    A layer whose settings have no output gate (LFM3 without use_attention_gate) has none."""

    def to_extra(sd, ours, params):
        if not ours.get("output_gate"):
            return params
        params["W_gate"] = np.ascontiguousarray(_read(sd, f"{name}.weight", mt).T)
        if bias and f"{name}.bias" in sd:
            params["b_gate"] = _read(sd, f"{name}.bias", mt)
        elif ours.get("qkv_bias") and ours.get("gate_bias") is not False:
            params["b_gate"] = np.zeros(params["W_gate"].shape[1], params["W_gate"].dtype)
        return params

    def from_extra(params, ours, sd):
        if "W_gate" not in params:
            return sd
        sd[f"{name}.weight"] = np.ascontiguousarray(np.asarray(params["W_gate"]).T)
        if "b_gate" in params:
            b = np.asarray(params["b_gate"])
            if bias:
                sd[f"{name}.bias"] = np.array(b)
            elif np.any(b != 0):
                raise ValueError(f"model_type {mt!r}: b_gate should be zeros (its gate_proj has "
                                 f"no bias), got a non-zero vector")
        return sd
    return dict(to_extra=to_extra, from_extra=from_extra)


def _layer_heads(c, layer_idx, ours, mt):
    """A layer's own query head count: Laguna's num_attention_heads_per_layer[layer], or the
    overrides of a per_layer_config entry (Step 3.5/3.7's sliding layers: num_attention_heads,
    and num_key_value_heads, head_dim where given; any other overridden field refused)."""
    heads = c.get("num_attention_heads_per_layer")
    if heads is not None:
        ours["num_heads"] = int(heads[layer_idx])
    table = c.get("per_layer_config") or {}
    overrides = dict(table.get(str(layer_idx)) or table.get(layer_idx) or {})
    names = {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
             "head_dim": "head_dim"}
    other = sorted(set(overrides) - set(names))
    if other:
        raise ValueError(f"model_type {mt!r}: per_layer_config[{layer_idx}] overrides "
                         f"{', '.join(other)}, which is not supported (we read "
                         f"{', '.join(names)})")
    ours.update({ours_name: int(overrides[k]) for k, ours_name in names.items()
                 if overrides.get(k) is not None})


def _laguna(c, layer_idx, ours):
    """Laguna (AFMoE's attention, RoPE on every layer): its own query head count per layer
    (num_attention_heads_per_layer), per-head RMSNorm of q and k, RoPE per layer type (partial
    on the full layers by its config's default), sliding layers by layer_types, the output
    gated by softplus(x W_g) from ``g_proj`` (no bias), one value per head (gating True or
    "per-head": W_g (D, N)) or per feature (anything else, as HF: W_g (D, N·Dh)); HF takes the
    softplus in float32."""
    mt = "laguna"
    _layer_heads(c, layer_idx, ours, mt)
    _qwen3(c, layer_idx, ours)
    gating = c.get("gating", True)
    per_head = gating is True or gating == "per-head"
    ours.update(output_gate="softplus_per_head" if per_head else "softplus", gate_bias=False)


def _step3p5(c, layer_idx, ours):
    """Step 3.5/3.7-Flash's text model (model_type step3p5, the text_config of step3p7):
    Laguna's attention with (1 + w) RMSNorms of q and k per head, the scale
    query_pre_attn_scalar^(−1/2), the sliding layers' own head count (per_layer_config), and
    one σ gate per head from ``g_proj`` (D -> N, no bias)."""
    mt = "step3p5"
    _layer_heads(c, layer_idx, ours, mt)
    ours.update(qk_norm="rms_one_plus", qk_norm_eps=float(c["rms_norm_eps"]),
                scale=float(c["query_pre_attn_scalar"]) ** -0.5,
                output_gate="sigmoid_per_head", gate_bias=False)


def _muse_spark_text(c, layer_idx, ours):
    """Muse Spark's text tower: Muse Glimmer's attention with ``o_norm``, a weightless RMS norm
    of each head's output over its Dh (ε rms_norm_eps, in float32), before the σ gate."""
    _muse_glimmer_text(c, layer_idx, ours)
    ours.update(output_norm="rms_per_head", output_norm_eps=float(c["rms_norm_eps"]))


def _beam(c, layer_idx, ours):
    """Beam: per-head RMSNorm of q and k; RoPE per layer type where rope_parameters has an
    entry for it, a layer type whose entry is None (its full layers by default) NoPE with
    HF's query temperature (1 + (p + 1)/2048)^0.1 at position p (compute_attention_scaling,
    fixed); sliding layers by layer_types; the output gated per feature by σ(x W_g + b_h)
    with ``gate_proj`` (no bias) and one bias b_h per head, ``gate_bias`` (N,): our b_gate
    (N·Dh) with each head's value on its Dh features (``_head_gate_bias``)."""
    _qwen3(c, layer_idx, ours)
    ours.update(output_gate="sigmoid", gate_bias=True)
    rope = c.get("rope_parameters") or {}
    kind = _layer_type(c, layer_idx)
    if kind in rope and rope[kind] is None:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)
        ours["query_temperature"] = {"kind": "power", "alpha": 0.1, "length": 2048}


def _lfm3(c, layer_idx, ours):
    """LFM3's attention layers (layer_types' full_attention and sliding_attention; its "conv"
    layers, gated short convolutions, refused by kind): Qwen3's per-head RMSNorm of q and k
    (ε norm_eps), RoPE per layer type (its full layers' proportional RoPE on half of each head
    by its config's default), sliding layers, and with use_attention_gate one σ per head from
    ``g_proj`` (D -> N, no bias)."""
    mt = "lfm3"
    kind = _layer_type(c, layer_idx)
    if kind not in ("full_attention", "sliding_attention"):
        attention = [i for i, k in enumerate(c["layer_types"]) if k.endswith("_attention")]
        raise ValueError(f"model_type {mt!r}: layer {layer_idx} is a {kind!r} layer (a gated "
                         f"short convolution, not softmax attention); only its attention "
                         f"layers convert ({', '.join(map(str, attention)) or 'none'})")
    ours.update(qk_norm="rms", qk_norm_eps=float(c.get("norm_eps", c.get("rms_norm_eps"))))
    if c.get("use_attention_gate", True):
        ours.update(output_gate="sigmoid_per_head", gate_bias=False)


def _head_gate_bias():
    """(to_extra, from_extra) of Beam's gate: ``gate_proj`` (D -> N·Dh, no bias) and its
    ``gate_bias`` (N,) added to each head's Dh gate values: b_gate (N·Dh) the (N,) vector
    repeated Dh times per head; to_hf gives the (N,) vector back and refuses a b_gate that is
    not constant within each head."""
    mt = "beam"
    plain = _gate_proj(mt)

    def to_extra(sd, ours, params):
        params = plain["to_extra"](sd, ours, params)
        per_head = _read(sd, "gate_bias", mt)  # (N,)
        params["b_gate"] = np.repeat(per_head, ours["head_dim"])  # (N·Dh,)
        return params

    def from_extra(params, ours, sd):
        sd = plain["from_extra"]({k: v for k, v in params.items() if k != "b_gate"}, ours, sd)
        b = np.asarray(params["b_gate"]).reshape(ours["num_heads"], ours["head_dim"])
        if np.any(b != b[:, :1]):
            raise ValueError(f"model_type {mt!r}: b_gate should be constant within each head "
                             f"(its gate_bias is one value per head, (N,) = "
                             f"({ours['num_heads']},)), got values that differ within a head")
        sd["gate_bias"] = np.array(b[:, 0])
        return sd
    return dict(to_extra=to_extra, from_extra=from_extra)


# Towers we do not convert, with why: from_hf names the reason.
REFUSED = {
    "hunyuan_vl_text": "HunYuan-VL's XD-RoPE gives the two features of a rotated pair the "
                       "positions of different axes (its sections split the duplicated "
                       "frequency vector over 3 or 4 axes), not one axis per pair (its QK norm "
                       "after RoPE is qk_norm='rms_after_rope', as HunYuan v1's)",
}


QK_NORMS = ("q_norm.weight", "k_norm.weight")


def _text_tower(mt, extra, **family) -> Family:
    """A vision-language model's text tower: a ``_llama_like`` entry whose HF model takes
    positions of 3 axes (multimodal RoPE)."""
    return _llama_like(mt, extra, position_axes=3, **family)


# Step 3.5/3.7's config fields its attention reads as class attributes (to_dict leaves them
# out: None), refused where a config.json sets them otherwise.
_STEP_UNSUPPORTED = {
    "gating": ((None, True, "per-head"), "HF's Step3p7 attention multiplies each head's output "
                                         "by one σ; a gate per feature does not fit its shapes"),
    "use_bidirectional_attention": ((None, False), "HF's Step3p7 then attends both ways, "
                                                   "and within a window both ways on its "
                                                   "sliding layers: not converted")}

# ---- issue 42's small options ---------------------------------------------------------------

def _hunyuan(c, layer_idx, ours):
    """HunYuan v1 (dense and MoE): RMSNorm of each head's q and k (query_layernorm,
    key_layernorm) after RoPE."""
    ours.update(qk_norm="rms_after_rope", qk_norm_eps=float(c["rms_norm_eps"]))


def _ntk_alpha(family) -> Family:
    """``family`` with HunYuan's fixed NTK alpha read as what it is: rope_type "dynamic" with an
    ``alpha`` is plain RoPE at θ · α^(Dh/(Dh − 2)) (HF's compute_ntk_alpha_rope_parameters,
    whatever the length)."""
    def settings(c, layer_idx, sd):
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type") == "dynamic" and rope.get("alpha"):
            dh = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            theta = float(rope["rope_theta"]) * float(rope["alpha"]) ** (dh / (dh - 2))
            c = {**c, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
        return family.settings(c, layer_idx, sd)
    return replace(family, settings=settings)


def _bitnet(c, layer_idx, ours):
    """BitNet: attn_sub_norm, RMSNorm over the heads' N·Dh output features, before o_proj."""
    width = ours["num_heads"] * ours["head_dim"]
    if width != c["hidden_size"]:
        raise ValueError(f"model_type 'bitnet': num_attention_heads · head_dim = {width} should "
                         f"be hidden_size = {c['hidden_size']} (attn_sub_norm is "
                         f"hidden_size wide)")
    ours.update(output_norm="rms", output_norm_eps=float(c["rms_norm_eps"]))


# BitNet's attn_sub_norm; MiMo-V2-Flash's sinks, on its sliding layers only
_sub_norm_in, _sub_norm_out = _moved("output_norm_weight", "attn_sub_norm.weight", "bitnet")
_layer_sinks_in, _layer_sinks_out = _moved("sinks", "sinks", "mimo_v2_flash",
                                           when=lambda ours: ours.get("sinks"))


def _olmoe(c, layer_idx, ours):
    """OLMoE: OLMo 2's norm over all heads' q and k, then clip_qkv on q and k (v at its
    projection)."""
    _olmo2(c, layer_idx, ours)
    if c.get("clip_qkv") is not None:
        ours.update(clip_qkv=float(c["clip_qkv"]), clip_qkv_after_norm=True)


def _mimo_v2_flash(c, layer_idx, ours):
    """MiMo-V2-Flash: values v_head_dim wide, times attention_value_scale; its sliding layers
    twice the KV heads and sinks; o_proj without bias."""
    ours.update(v_head_dim=int(c["v_head_dim"]))
    if c.get("attention_value_scale") is not None:
        ours["value_scale"] = float(c["attention_value_scale"])
    if _layer_type(c, layer_idx) == "sliding_attention":
        ours.update(num_kv_heads=2 * ours["num_kv_heads"], sinks=True)


FAMILIES: dict[str, Family] = {
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "mixtral": _llama_like("mixtral"),
    "minimax": _llama_like("minimax", _minimax),
    "qwen2": _llama_like("qwen2"),
    "starcoder2": _llama_like("starcoder2"),
    "granite": _llama_like("granite", _granite),
    "smollm3": _llama_like("smollm3", _smollm3),
    "olmo": _llama_like("olmo", _olmo),
    "qwen3": _llama_like("qwen3", _qwen3, norms=("q_norm.weight", "k_norm.weight")),
    "olmo2": _llama_like("olmo2", _olmo2, norms=("q_norm.weight", "k_norm.weight")),
    "gemma2": _llama_like("gemma2", _gemma),
    "gemma3_text": _llama_like("gemma3_text", _gemma3, norms=("q_norm.weight",
                                                                "k_norm.weight")),
    "gemma4_text": _gemma4_text(),
    "gemma3n_text": _gemma4_text("gemma3n_text"),
    "cohere": _llama_like("cohere", _cohere, norms=("q_norm.weight", "k_norm.weight")),
    "gpt_oss": _llama_like("gpt_oss", _gpt_oss, to_extra=_sinks_in, from_extra=_sinks_out),
    "llama4_text": _llama_like("llama4_text", _llama4),
    "qwen3_next": _llama_like("qwen3_next", _qwen3_next,
                              norms=("q_norm.weight", "k_norm.weight"),
                              to_extra=_gate_split, from_extra=_gate_join),
    "stablelm": _llama_like("stablelm", _stablelm, to_extra=_per_head_norms_in,
                            from_extra=_per_head_norms_out),
    # Chameleon's text decoder (its VQ-VAE image tokenizer, under vqmodel., is no attention of
    # ours: its keys are not in the stack, not read)
    "chameleon": _llama_like("chameleon", _chameleon, norms=("q_norm.weight", "k_norm.weight"),
                             to_extra=_norm_biases_in, from_extra=_norm_biases_out),
    # The text towers of vision-language models: their HF models take (3, B, L) position_ids
    # (``_text_tower``: the verifier draws an image's span)
    "qwen2_vl_text": _text_tower("qwen2_vl_text", _qwen2_vl_text),
    "qwen2_5_vl_text": _text_tower("qwen2_5_vl_text", _qwen2_vl_text),  # Qwen2-VL's attention
    "qwen3_vl_text": _text_tower("qwen3_vl_text", _qwen3_vl_text, norms=QK_NORMS),
    "qwen3_vl_moe_text": _text_tower("qwen3_vl_moe_text", _qwen3_vl_text,  # Qwen3-VL's
                                     norms=QK_NORMS),
    "glm4v_text": _text_tower("glm4v_text", _glm4v_text),
    "qwen2_5_omni_text": _text_tower("qwen2_5_omni_text", _qwen2_5_omni_text,
                                     model_class="Qwen2_5OmniThinkerTextModel"),
    "qwen3_omni_moe_text": _text_tower("qwen3_omni_moe_text", _qwen3_omni_moe_text,
                                       norms=QK_NORMS, model_class="Qwen3OmniMoeThinkerTextModel"),
    "glm4v_moe_text": _text_tower("glm4v_moe_text", _glm4v_moe_text),
    "paddleocr_vl_text": _text_tower("paddleocr_vl_text", _paddleocr_vl_text,
                                     model_class="PaddleOCRTextModel"),
    "ernie4_5_vl_moe_text": _text_tower("ernie4_5_vl_moe_text", _ernie4_5_vl_text,
                                        model_class="Ernie4_5_VLMoeTextModel"),
    **{mt: _text_tower(mt, _qwen3_5(mt), norms=QK_NORMS, to_extra=_gate_split,
                       from_extra=_gate_join)
       for mt in ("qwen3_5_text", "qwen3_5_moe_text")},
    # Issue 42's small options: HunYuan's QK norm after RoPE (and its NTK-alpha θ), BitNet's
    # norm before o_proj, OLMoE's clamp after the norm, MiMo-V2-Flash's value width and scale
    **{mt: _ntk_alpha(_llama_like(mt, _hunyuan, norms=("query_layernorm.weight",
                                                        "key_layernorm.weight")))
       for mt in ("hunyuan_v1_dense", "hunyuan_v1_moe")},
    "bitnet": _llama_like("bitnet", _bitnet, to_extra=_sub_norm_in, from_extra=_sub_norm_out),
    "olmoe": _llama_like("olmoe", _olmoe, norms=("q_norm.weight", "k_norm.weight")),
    # MiMo-V2-Flash's checkpoints name its sinks attention_sink_bias (HF renames them when
    # loading)
    "mimo_v2_flash": _llama_like("mimo_v2_flash", _mimo_v2_flash, to_extra=_layer_sinks_in,
                                 from_extra=_layer_sinks_out, stacks=(Stack(
                                     "layers", "self_attn",
                                     renames=(("attention_sink_bias", "sinks"),)),)),
    # Issue 42's decoders whose attention is a supported one's, after mapping config fields.
    # Llama's attention; HF's model makes a window where the config says (all layers, or the
    # sliding ones of layer_types), a causal mask in the others (window dropped).
    **{mt: _llama_like(mt) for mt in ("qwen2_moe", "ministral", "cwm")},
    **{mt: _llama_like(mt, _plain_no_window)
       for mt in ("internlm3", "iquestcoder", "arcee", "jais2", "solar_open", "seed_oss",
                  "nemotron")},  # nemotron: partial rotary (rotate-half within the slice)
    # Sesame CSM's backbone (its depth decoder, under depth_decoder.model.layers, has a config
    # of its own, csm_depth_decoder_model: not read)
    "csm": _llama_like("csm", _plain_no_window,
                       stacks=(Stack("layers", "self_attn", within="backbone_model."),),
                       unverified="attn-parity hf does not check CSM checkpoints yet: its "
                                  "one-layer model would be CsmForConditionalGeneration, "
                                  "with the Mimi codec and the depth decoder, and no test "
                                  "has run it"),
    "phimoe": _llama_like("phimoe", _phimoe),
    "ministral3": _llama_like("ministral3", _ministral3),
    "gemma": _llama_like("gemma", _plain_no_window, unsupported={
        "use_bidirectional_attention": ((None, False), "HF's Gemma then attends both ways "
                                        "only where no padding mask is made (sdpa's is_causal "
                                        "off), causally where one is: not one function")}),
    "vaultgemma": _llama_like("vaultgemma", _gemma),
    **{mt: _llama_like(mt, _granite_no_window)
       for mt in ("hyperclovax", "granitemoeshared", "granitemoe")},
    # Qwen3's per-head RMSNorm of q and k (Mellum: RoPE per layer type)
    **{mt: _llama_like(mt, _qwen3, norms=QK_NORMS) for mt in ("qwen3_moe", "dots1", "mellum")},
    "apertus": _llama_like("apertus", _qwen3_no_window, norms=QK_NORMS),
    # EXAONE 4 (also EXAONE 4.5's text tower: HF's config reads its text_config as exaone4)
    **{mt: _llama_like(mt, _rope_on_sliding_layers, norms=QK_NORMS)
       for mt in ("exaone_moe", "kolibri1", "exaone4")},
    # OLMo 2's RMSNorm of the whole q and k (OLMo 3: sliding layers, RoPE per layer type)
    "flex_olmo": _llama_like("flex_olmo", _olmo2_no_window, norms=QK_NORMS),
    "olmo3": _llama_like("olmo3", _olmo2, norms=QK_NORMS),
    # OLMo hybrid's softmax layers (its linear layers: golden.hf.linear): OLMo 3's attention
    # (its config always gives a rope_theta, so HF's NoPE mode is never reached)
    "olmo_hybrid": _llama_like("olmo_hybrid", _olmo2, norms=QK_NORMS),
    "helium": _llama_like("helium", _interleaved_no_window),
    **{mt: _llama_like(mt, _partial_interleaved) for mt in ("glm", "glm4")},
    **{mt: _llama_like(mt, _cohere2) for mt in ("cohere2", "cohere2_moe")},
    **{mt: _llama_like(mt, _ernie4_5(mt)) for mt in ("ernie4_5", "ernie4_5_moe")},
    "glm4_moe": _llama_like("glm4_moe", _glm4_moe, norms=QK_NORMS),
    "minimax_m2": _llama_like("minimax_m2", _minimax_m2, norms=QK_NORMS),
    # Molmo 2's text tower (the composite molmo2's text_config; 1-D RoPE)
    "molmo2_text": _llama_like("molmo2_text", _molmo2_text, norms=QK_NORMS,
                               unverified="attn-parity hf does not check Molmo 2 checkpoints "
                                          "yet: they keep q, k and v fused in att_proj and "
                                          "o_proj as attn_out (HF splits and renames them "
                                          "when loading), a layout it does not read"),
    **{mt: _llama_like(mt, _granite_swa, to_extra=_sinks_in, from_extra=_sinks_out)
       for mt in ("granite_swa", "granitemoe_swa")},
    # Flint's checkpoints name its sinks softmax_offset (HF renames them when loading)
    "flint": _llama_like("flint", _flint, norms=QK_NORMS, to_extra=_sinks_in,
                         from_extra=_sinks_out, stacks=(Stack(
                             "layers", "self_attn", renames=(("softmax_offset", "sinks"),)),)),
    "nanochat": _llama_like("nanochat", _nanochat, to_extra=_halves_swapped_in,
                            from_extra=_halves_swapped_out),
    "openai_privacy_filter": _llama_like("openai_privacy_filter", _privacy_filter,
                                         to_extra=_sinks_in, from_extra=_sinks_out),
    # σ(x W_g) output gates from a separate gate_proj (Qwen3-Next's output_gate, its own array)
    "afmoe": _llama_like("afmoe", _afmoe, norms=QK_NORMS, **_gate_proj("afmoe")),
    # HRM-Text: two stacks, L_module's and H_module's layers, each run several cycles a forward
    "hrm_text": _llama_like("hrm_text", _hrm_text, **_gate_proj("hrm_text", bias=True),
                            stacks=(Stack("layers", "self_attn", within="L_module."),
                                    Stack("layers", "self_attn", within="H_module.")),
                            unverified="attn-parity hf does not check HRM-Text checkpoints yet: "
                                       "its config's num_hidden_layers counts the attention "
                                       "calls of the recurrent cycles (num_layers_per_stack · "
                                       "H_cycles · (L_cycles + 1)), not the stacks' layers"),
    # Muse Glimmer's text tower (the text_config of muse_glimmer)
    "muse_glimmer_text": _llama_like("muse_glimmer_text", _muse_glimmer_text,
                                     **_gate_proj("muse_glimmer_text")),
    # Issue 42's gates, output norms and temperatures: Laguna's softplus gate and per-layer
    # heads, Step 3.5/3.7's σ per head, Muse Spark's norm per head, Beam's power temperature
    # and gate bias per head
    "laguna": _llama_like("laguna", _laguna, norms=QK_NORMS, **_gate_proj("laguna", name="g_proj")),
    "step3p5": _llama_like("step3p5", _step3p5, norms=QK_NORMS,
                           **_gate_proj("step3p5", name="g_proj"), model_class="Step3p7TextModel",
                           unsupported=_STEP_UNSUPPORTED),
    "muse_spark_text": _llama_like("muse_spark_text", _muse_spark_text,
                                   **_gate_proj("muse_spark_text")),
    "beam": _llama_like("beam", _beam, norms=QK_NORMS, **_head_gate_bias()),
    # LFM3's checkpoints name its g_proj gate_proj (HF renames it when loading)
    "lfm3": _llama_like("lfm3", _lfm3, norms=QK_NORMS, **_gate_proj("lfm3", name="g_proj"),
                        stacks=(Stack("layers", "self_attn",
                                      renames=(("gate_proj", "g_proj"),)),)),
}
