"""Gemma 4's and Gemma 3n's text attention: per-layer head widths and KV heads, K = V on the
full layers, the weightless value norm, and cross-layer KV sharing (``kv_source``: the layer
whose cache a reusing layer attends with). golden.hf.decoders' table holds their entries.

Shape legend: Dh head width.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import (GQA, LLAMA_NAMES, Family, _bias_flags, _decoder_settings,
                              _layer_type, _linears_to_neutral, _neutral_to_linears, _read)


def _gemma4_layer(c, layer_idx, mt="gemma4_text"):
    """Gemma 4's layer ``layer_idx``: its per_layer_config's overrides (the full layers' wider
    heads and fewer KV heads), whether its values are its keys' (attention_k_eq_v, full layers
    only), and whether it reuses a storing layer's keys and values (num_kv_shared_layers:
    golden.hf.kv_source names that layer). Gemma 3n's config has neither per_layer_config nor
    attention_k_eq_v: its layers are the same with every head alike."""
    if c.get("use_bidirectional_attention") == "all":
        raise ValueError(f"model_type {mt!r}: use_bidirectional_attention = 'all' is not "
                         f"supported (HF's bidirectional Gemma 4 halves its sliding window, "
                         f"(W // 2) + 1 on each side, which no option of ours says)")
    reuses = kv_source(c, layer_idx) is not None
    overrides = dict((c.get("per_layer_config") or {}).get(str(layer_idx))
                     or (c.get("per_layer_config") or {}).get(layer_idx) or {})
    sliding = _layer_type(c, layer_idx) == "sliding_attention"
    return overrides, bool(c.get("attention_k_eq_v")) and not sliding, reuses


def kv_source(config, layer_idx):
    """The index of the layer whose keys and values layer ``layer_idx`` attends with, for
    Gemma 4's and Gemma 3n's cross-layer KV sharing: the last ``num_kv_shared_layers`` layers
    (no k_proj, v_proj, k_norm, v_norm; our ``kv_shared=True``) reuse those of the last layer
    before them of their own ``layer_types`` entry (HF's kv_sharing_modes "store"); None for a
    layer that computes its own (every layer without num_kv_shared_layers). ``config`` a
    transformers config's ``to_dict()`` (or an object with one)."""
    c = config.to_dict() if hasattr(config, "to_dict") else config
    count, shared = int(c["num_hidden_layers"]), int(c.get("num_kv_shared_layers") or 0)
    if not 0 <= layer_idx < count:
        raise ValueError(f"layer_idx should be in [0, {count}) (num_hidden_layers), got "
                         f"{layer_idx}")
    first = count - shared
    if not shared or layer_idx < first:
        return None
    kind = _layer_type(c, layer_idx)
    stores = [i for i in range(first) if _layer_type(c, i) == kind]
    if not stores:
        raise ValueError(f"num_kv_shared_layers = {shared}: layer {layer_idx} ({kind!r}) has no "
                         f"earlier layer of its type to reuse the keys and values of, got "
                         f"layer_types {c.get('layer_types')}")
    return stores[-1]


def _gemma4_text(mt="gemma4_text") -> Family:
    """Gemma 4's text attention: LLAMA_NAMES' projections (no v_proj on a k_eq_v layer), RMSNorm
    of q and k with weight and of v without, scale 1, RoPE per layer type (proportional on the
    full layers), sliding windows on the sliding layers; a layer of the last
    num_kv_shared_layers has q_proj, q_norm and o_proj only (``kv_shared=True``: called with
    the cache of the layer kv_source names). Gemma 3n's text attention (``mt``
    "gemma3n_text", Gemma3nTextAttention) is the same without per-layer head widths or K = V."""

    def names(ours):
        if ours.get("kv_shared"):
            return {r: n for r, n in LLAMA_NAMES.items() if r in ("query", "out")}
        return ({r: n for r, n in LLAMA_NAMES.items() if r != "value"} if ours.get("k_eq_v")
                else LLAMA_NAMES)

    def settings(c, layer_idx, sd):
        overrides, k_eq_v, reuses = _gemma4_layer(c, layer_idx, mt)
        ours = _decoder_settings(c, layer_idx, mt=mt)
        ours.update({n: int(overrides[k]) for n, k in (("head_dim", "head_dim"),
                                                       ("num_kv_heads", "num_key_value_heads"))
                     if overrides.get(k) is not None})
        ours.update(scale=1.0, qk_norm="rms", qk_norm_eps=float(c["rms_norm_eps"]))
        if reuses:  # the storing layer's v_norm and k_eq_v made its cache
            ours["kv_shared"] = True
        else:
            ours["v_norm"] = True
            if k_eq_v:
                ours["k_eq_v"] = True
        ours.update(_bias_flags(sd, names(ours), mt))
        return ours

    def norms(ours):
        return ("q_norm",) if ours.get("kv_shared") else ("q_norm", "k_norm")

    def to_neutral(sd, ours):
        return {**_linears_to_neutral(sd, names(ours), mt),
                **{n: _read(sd, f"{n}.weight", mt) for n in norms(ours)}}

    def from_neutral(params, ours):
        sd = _neutral_to_linears(params, names(ours))
        sd.update({f"{n}.weight": np.array(params[n]) for n in norms(ours)})
        return sd

    return Family(GQA, settings, to_neutral, from_neutral)
