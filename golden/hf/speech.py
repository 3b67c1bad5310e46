"""Speech encoders with relative positional attention: NVIDIA's FastConformer (Hugging Face's
ParakeetEncoderAttention), our GroupedQueryAttention with
``relative_positions="transformer_xl"``, and IBM's Granite Speech Conformer, ours with
``relative_positions="shaw"`` in blocks (below, at its entries). One ``FAMILIES`` entry per
encoder config:

  parakeet_encoder                the encoder of parakeet_ctc, parakeet_rnnt, parakeet_tdt,
                                  canary and cohere_asr (each takes it as its ``encoder_config``:
                                  from_hf takes that sub-config)
  nemotron_asr_streaming_encoder  the encoder of nemotron_asr_streaming and nemotron3_5_asr:
                                  the same attention (with a KV cache when streaming); its
                                  ``chunked_limited`` mask (chunks of lookahead + 1 frames, the
                                  sliding_window − 1 frames before) is the model's, per call
                                  (``num_lookahead_tokens``): the caller's mask, not a setting
  phi4_multimodal_audio           Phi-4-multimodal's audio encoder (audio_config of
                                  phi4_multimodal): not Transformer-XL's, see below
  granite_speech_encoder,         the encoders of granite_speech and granite_speech_plus (their
  granite_speech_plus_encoder     ``encoder_config``): Shaw's relative key table in blocks of
                                  context_size frames, pre_norm inside the module
  granite_speech5_encoder         Granite Speech 5's: the same term, separate q/k/v, the norm
                                  outside the module

The layer: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (biases as attention_bias says),
``relative_k_proj`` (no bias) our W_pos, ``bias_u`` and ``bias_v`` (N, Dh) ours; multi-head
(Nkv = N), Dh = hidden_size / N (head_dim when the config has one), bidirectional, scale
Dh^−1/2, HF's attention_dropout our dropout. Its position embeddings are the encoder's
(ParakeetEncoderRelPositionalEncoding, an input of the attention): our module makes the same
table itself (golden.specification.decoder.sinusoid_table), in float64.

HF's float32 steps: that table (ω, the angles t·ω, sin and cos in float32, cast to the model's
dtype: about 2⁻²⁴ (2 + 3|t|) at distance t), and the eager softmax (float32, as Llama's; sdpa is
the model's dtype). Against a float64 model the level is float32's.

Phi-4-multimodal's audio attention (Phi4MultimodalAudioAttention, layers ``encoders.N.self_attn``):
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, all with biases, multi-head, Dh = hidden_size / N,
scale Dh^−1/2, bidirectional, dropout_rate our dropout; plus a learned bias per clipped key −
query distance, the encoder's (``relative_attention_bias_layer.bias_values.weight``, (2M, N), or
(M, N) when bias_symmetric; M = bias_max_distance), one table for every layer: our
``relative_attention_num_buckets`` table with ``relative_attention_buckets`` "clipped" (or
"clipped_symmetric"). from_hf takes a layer's state dict with the encoder's table put in under
that name (as T5's layers after the first). HF's encoder passes its layers ``hs_mask + bias``
with ``hs_mask`` boolean, so a position its streaming or padding mask blocks gets +0 and an
allowed one +1 rather than −∞: no row of the full (unchunked, chunk_size −1) mask is changed by
that (softmax ignores a constant), but a padded or chunked one is not blocked by HF's model; our
module blocks what the caller's mask blocks. Its eager softmax is float32; nothing else is.

Shape legend: D (= d_in) the encoder's width, N heads, Dh head width.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import (GQA, LLAMA_NAMES, Family, Stack, _bias_flags, _dropout,
                              _linears_to_neutral, _neutral_to_linears, _read, _sizes)
from golden.specification.mapping import _numpy

NAMES = {**LLAMA_NAMES, "pos": "relative_k_proj"}
VECTORS = ("bias_u", "bias_v")
# attn-parity hf runs a layer on drawn hidden states alone; these layers also take the
# encoder's table of relative position embeddings.
UNVERIFIED = ("attn-parity hf does not check speech encoders yet: their attention also takes "
              "the encoder's relative position embeddings (position_embeddings, a sinusoidal "
              "table of 2L − 1 distances); convert a layer with golden.convert.from_hf and "
              "compare it given those")


def _settings(mt):
    def settings(c, layer_idx, sd):
        ours = _sizes(c)
        if ours["num_kv_heads"] != ours["num_heads"]:
            raise ValueError(f"model_type {mt!r}: num_key_value_heads should be "
                             f"num_attention_heads = {ours['num_heads']} (HF's encoder sets "
                             f"it so), got {ours['num_kv_heads']}")
        ours.update(_bias_flags(sd, LLAMA_NAMES, mt), causal=False,
                    relative_positions="transformer_xl")
        return _dropout(c, ours)
    return settings


def _to_neutral(mt):
    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, NAMES, mt)
        params.update({n: _read(sd, n, mt) for n in VECTORS})
        return params
    return to_neutral


def _from_neutral(params, ours) -> dict:
    sd = _neutral_to_linears(params, NAMES)
    sd.update({n: _numpy(params[n]) for n in VECTORS})
    return sd


def _encoder(mt) -> Family:
    return Family(GQA, _settings(mt), _to_neutral(mt), _from_neutral,
                  stacks=(Stack("layers", "self_attn", label="encoder"),),
                  unverified=UNVERIFIED)


PHI4_TABLE = "relative_attention_bias_layer.bias_values.weight"
PHI4 = "phi4_multimodal_audio"


def _phi4_settings(c, layer_idx, sd):
    n, d = int(c["num_attention_heads"]), int(c["hidden_size"])
    far, symmetric = int(c["bias_max_distance"]), bool(c.get("bias_symmetric"))
    if PHI4_TABLE not in sd:
        raise ValueError(f"model_type {PHI4!r}: the state dict has no {PHI4_TABLE!r}: the encoder "
                         f"holds one table of position biases for all its layers; put it into "
                         f"layer {layer_idx}'s state dict under that name")
    ours = dict(d_in=d, num_heads=n, num_kv_heads=n, head_dim=int(c.get("head_dim") or d // n),
                causal=False,
                relative_attention_num_buckets=far if symmetric else 2 * far,
                relative_attention_max_distance=far,
                relative_attention_buckets="clipped_symmetric" if symmetric else "clipped",
                **_bias_flags(sd, LLAMA_NAMES, PHI4))
    return _dropout(c, ours, "dropout_rate")


def _phi4_to_neutral(sd, ours):
    params = _linears_to_neutral(sd, LLAMA_NAMES, PHI4)
    params["relative_attention_bias"] = _read(sd, PHI4_TABLE, PHI4)
    return params


def _phi4_from_neutral(params, ours):
    sd = _neutral_to_linears({n: a for n, a in params.items()
                              if n != "relative_attention_bias"}, LLAMA_NAMES)
    sd[PHI4_TABLE] = _numpy(params["relative_attention_bias"])
    return sd


FAMILIES: dict[str, Family] = {
    **{mt: _encoder(mt) for mt in ("parakeet_encoder", "nemotron_asr_streaming_encoder")},
    PHI4: Family(GQA, _phi4_settings, _phi4_to_neutral, _phi4_from_neutral,
                 stacks=(Stack("encoders", "self_attn", label="encoder"),),
                 unverified=("attn-parity hf does not check Phi-4-multimodal's audio encoder "
                             "yet: its layers take the encoder's table of position biases "
                             f"({PHI4_TABLE}); convert a layer with golden.convert.from_hf, "
                             "that table put into its state dict")),
}


# ---- Granite Speech: Shaw's relative positions in blocks -----------------------------------
# IBM's Granite Speech Conformer (GraniteSpeechConformerAttention, granite_speech_plus's the
# same; granite_speech5's GraniteSpeech5EncoderAttention): the frames cut into blocks of
# context_size C (the last one right-padded, its padded keys masked), attention within a block,
# bidirectional; one learned table rel_pos_emb (2·max_pos_emb + 1, Dh) shared by the heads,
# read at M + clamp(i − j, −C, C) (M = max_pos_emb ≥ C: inside a block |i − j| < C, so our
# clip at M reads the same rows). Ours: attention_chunk_size C, causal=False,
# relative_positions="shaw", relative_max_distance M, the table our relative_key_table.
# granite_speech(_plus)_encoder: pre_norm (LayerNorm, ε 1e-5) inside the module our input_norm;
# to_q (no bias); to_kv (no bias) K the first half of its rows, V the second; to_out (bias);
# its dropout is on the module's output (the caller's). granite_speech5_encoder: the norm
# outside the module (the layer's norm_self_att, the caller's); q_proj, k_proj, v_proj (no
# bias), o_proj (bias); its attention_dropout ours; the encoder's padding mask (B, L) of keys
# our query_seq_lengths or mask (padded frames' outputs are not HF's to compare).
SHAW_UNVERIFIED = ("attn-parity hf does not check speech encoders yet: Granite Speech's "
                   "attention also takes the encoder's table of clamped distances "
                   "(attention_dists); convert a layer with golden.convert.from_hf and compare "
                   "it given those")
GRANITE_NAMES = {"query": "to_q", "out": "to_out"}
GRANITE5_NAMES = LLAMA_NAMES


def _granite_shaw(c, mt, width, heads, dh, max_distance) -> dict:
    """The block and Shaw settings both Granite attentions share."""
    if not 0 < c["context_size"] <= c[max_distance]:
        raise ValueError(f"model_type {mt!r}: context_size should be in (0, {max_distance} = "
                         f"{c[max_distance]}] (HF's check), got {c['context_size']}")
    return dict(d_in=c[width], num_heads=c[heads], num_kv_heads=c[heads],
                head_dim=c.get(dh) or c[width] // c[heads], causal=False,
                attention_chunk_size=int(c["context_size"]), relative_positions="shaw",
                relative_max_distance=int(c[max_distance]))


def _granite_settings(mt):
    def settings(c, layer_idx, sd):
        ours = _granite_shaw(c, mt, "hidden_dim", "num_heads", "dim_head", "max_pos_emb")
        return dict(ours, out_bias="to_out.bias" in sd, input_norm="layer", input_norm_eps=1e-5)
    return settings


def _granite_to_neutral(mt):
    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, GRANITE_NAMES, mt)
        kv = _read(sd, "to_kv.weight", mt)  # (2·N·Dh, D): K's rows, then V's
        half = ours["num_heads"] * ours["head_dim"]
        if kv.shape[0] != 2 * half:
            raise ValueError(f"model_type {mt!r}: to_kv.weight should have {2 * half} rows "
                             f"(2·N·Dh from the config), got shape {tuple(kv.shape)}")
        params.update(W_key=np.ascontiguousarray(kv[:half].T),
                      W_value=np.ascontiguousarray(kv[half:].T),
                      relative_key_table=_read(sd, "rel_pos_emb.weight", mt),
                      input_norm_weight=_read(sd, "pre_norm.weight", mt),
                      input_norm_bias=_read(sd, "pre_norm.bias", mt))
        return params
    return to_neutral


def _granite_from_neutral(params, ours) -> dict:
    sd = _neutral_to_linears(params, GRANITE_NAMES)
    sd["to_kv.weight"] = np.ascontiguousarray(np.concatenate(
        [np.asarray(params["W_key"]), np.asarray(params["W_value"])], axis=1).T)
    sd.update({"rel_pos_emb.weight": _numpy(params["relative_key_table"]),
               "pre_norm.weight": _numpy(params["input_norm_weight"]),
               "pre_norm.bias": _numpy(params["input_norm_bias"])})
    return sd


def _granite5_settings(c, layer_idx, sd):
    mt = "granite_speech5_encoder"
    ours = _granite_shaw(c, mt, "hidden_size", "num_attention_heads", "head_dim",
                         "max_position_embeddings")
    kv = c.get("num_key_value_heads") or ours["num_heads"]
    if kv != ours["num_heads"]:
        raise ValueError(f"model_type {mt!r}: num_key_value_heads should be num_attention_heads "
                         f"= {ours['num_heads']} (HF's k_proj and v_proj have N heads), got {kv}")
    ours.update(_bias_flags(sd, GRANITE5_NAMES, mt))
    return _dropout(c, ours)


def _granite5_to_neutral(sd, ours):
    params = _linears_to_neutral(sd, GRANITE5_NAMES, "granite_speech5_encoder")
    params["relative_key_table"] = _read(sd, "rel_pos_emb.weight", "granite_speech5_encoder")
    return params


def _granite5_from_neutral(params, ours) -> dict:
    sd = _neutral_to_linears(params, GRANITE5_NAMES)
    sd["rel_pos_emb.weight"] = _numpy(params["relative_key_table"])
    return sd


FAMILIES.update({
    **{mt: Family(GQA, _granite_settings(mt), _granite_to_neutral(mt), _granite_from_neutral,
                  stacks=(Stack("layers", "attn", label="encoder"),),
                  unverified=SHAW_UNVERIFIED)
       for mt in ("granite_speech_encoder", "granite_speech_plus_encoder")},
    "granite_speech5_encoder": Family(
        GQA, _granite5_settings, _granite5_to_neutral, _granite5_from_neutral,
        stacks=(Stack("layers", "self_attn", label="encoder"),), unverified=SHAW_UNVERIFIED),
})

# Speech encoders whose relative positions are not expressed yet, each with why: from_hf names
# the reason.
_CHUNKED = ("its attention is chunked local attention with relative position logits, a "
            "softplus per-dimension query scale and a soft cap (Gemma 3n's audio encoder), "
            "which no option of ours expresses yet")
REFUSED = {
    "gemma3n_audio": _CHUNKED, "gemma4_audio": _CHUNKED,
}
