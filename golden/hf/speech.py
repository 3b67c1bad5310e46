"""Speech encoders with Transformer-XL's relative positional attention: NVIDIA's FastConformer
(Hugging Face's ParakeetEncoderAttention), our GroupedQueryAttention with
``relative_positions="transformer_xl"``; and Gemma 3n's and Gemma 4's audio encoders (Google's
USM Conformer) with ``relative_positions="conformer_timing"`` (the section below). One
``FAMILIES`` entry per encoder config:

  parakeet_encoder                the encoder of parakeet_ctc, parakeet_rnnt, parakeet_tdt,
                                  canary and cohere_asr (each takes it as its ``encoder_config``:
                                  from_hf takes that sub-config)
  nemotron_asr_streaming_encoder  the encoder of nemotron_asr_streaming and nemotron3_5_asr:
                                  the same attention (with a KV cache when streaming); its
                                  ``chunked_limited`` mask (chunks of lookahead + 1 frames, the
                                  sliding_window − 1 frames before) is the model's, per call
                                  (``num_lookahead_tokens``): the caller's mask, not a setting
  gemma3n_audio, gemma4_audio     the audio towers of Gemma 3n and Gemma 4 (their audio_config)

The layer: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (biases as attention_bias says),
``relative_k_proj`` (no bias) our W_pos, ``bias_u`` and ``bias_v`` (N, Dh) ours; multi-head
(Nkv = N), Dh = hidden_size / N (head_dim when the config has one), bidirectional, scale
Dh^−1/2, HF's attention_dropout our dropout. Its position embeddings are the encoder's
(ParakeetEncoderRelPositionalEncoding, an input of the attention): our module makes the same
table itself (golden.specification.decoder.sinusoid_table), in float64.

HF's float32 steps: that table (ω, the angles t·ω, sin and cos in float32, cast to the model's
dtype: about 2⁻²⁴ (2 + 3|t|) at distance t), and the eager softmax (float32, as Llama's; sdpa is
the model's dtype). Against a float64 model the level is float32's.

Shape legend: D (= d_in) the encoder's width, N heads, Dh head width.
"""

from __future__ import annotations

import math

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


FAMILIES: dict[str, Family] = {mt: _encoder(mt) for mt in (
    "parakeet_encoder", "nemotron_asr_streaming_encoder")}

# ---- the USM Conformer's attention: Gemma 3n's and Gemma 4's audio encoders -------------------
#
# Our GroupedQueryAttention with relative_positions="conformer_timing": Nkv = N, Dh = hidden_size
# / N, no biases, q̃ = q ⊙ Dh^−1/2 · softplus(per_dim_scale)/ln 2, R = κ q̃·k + q̃·E(p − j), E the
# projected timing signal (golden.specification.decoder.timing_table), S = c·tanh(R/c) with c
# the logit cap, the softmax over the keys p − P … p + F. HF computes it in blocks of
# chunk_size W queries against W + P + F keys; the blocks are an implementation device (every
# key of the window in the block's context, keys past the sequence masked), not a setting.
#
# gemma3n_audio (Gemma3nAudioConformerAttention, the encoder's ``conformer.N.attention``): P =
# max(0, conf_attention_context_left − 1) keys back and F = conf_attention_context_right ahead
# (its create_local_causal_valid_mask and the unfold give exactly p − P ≤ j ≤ p + F: causal with
# sliding_window P + 1 when F = 0, else the pair (P, F)), κ = 1, c = conf_attention_logit_cap;
# its ``mask`` (B, T), True = padded, hides keys: ours is the caller's (query_seq_lengths for
# right padding, or a mask (B, L, L)). The module's state dict: attn.q_proj, attn.k_proj,
# attn.v_proj, post (our out_proj: the module's ``post``, after the heads merge), attn.
# relative_position_embedding.pos_proj (W_pos) and attn.per_dim_scale. Its pre_attn_norm and
# post_norm (RMS norms around the attention, with the gradient clipping and the residual) are
# the Conformer block's, not the attention's: not read, not written back.
#
# gemma4_audio (Gemma4AudioAttention, the encoder's ``layers.N.self_attn``): κ = ln(1 + e)/ln 2
# on the keys; q, k, v, post are Gemma4ClippableLinear (``q_proj.linear`` …): with
# use_clipped_linears their bounds are buffers of the checkpoint, accepted when infinite (as
# HF initialises them), refused when finite; relative_k_proj W_pos, per_dim_scale. Its position
# table (the model's, rows t = C//2 … 0, C = W + P + F) reads row t = p − j only when C//2 = P
# and F = 0 (its default W = 12, context left 13, right 0): other settings are refused. Its
# window is the model's mask, sliding_window_mask_function((left − 1, right)): keys p − (P − 1)
# … p, one fewer than its blocks hold: causal, sliding_window = context_left − 1. It runs in
# float32 (q, k, v .float()) whatever the model's dtype.

# attn-parity hf runs a layer on drawn hidden states alone; Gemma 4's layer also takes the
# model's position table and its blocked 5-D mask, Gemma 3n's its padding mask.
UNVERIFIED_CONFORMER = (
    "attn-parity hf does not check Gemma's audio encoders yet: Gemma 4's attention takes the "
    "model's relative position table and its mask in blocks (B, 1, U, W, C) as inputs, Gemma "
    "3n's sits inside its Conformer block; convert a layer with golden.convert.from_hf and "
    "compare it given those")
GEMMA3N_NAMES = {"query": "attn.q_proj", "key": "attn.k_proj", "value": "attn.v_proj",
                 "out": "post", "pos": "attn.relative_position_embedding.pos_proj"}
GEMMA4_NAMES = {"query": "q_proj.linear", "key": "k_proj.linear", "value": "v_proj.linear",
                "out": "post.linear", "pos": "relative_k_proj"}
GEMMA4_KEY_SCALE = math.log(1 + math.e) / math.log(2)  # HF's Python float, softplus(1)/ln 2
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _conformer_settings(c, n, cap, key_scale=None) -> dict:
    d = c["hidden_size"]
    return dict(d_in=d, num_heads=n, num_kv_heads=n, head_dim=d // n, qkv_bias=False,
                out_bias=False, softcap=float(cap), relative_positions="conformer_timing",
                **({} if key_scale is None else {"key_scale": key_scale}))


def _gemma3n_settings(c, layer_idx, sd) -> dict:
    back = max(0, c["conf_attention_context_left"] - 1)
    ahead = c["conf_attention_context_right"]
    ours = _conformer_settings(c, c["conf_num_attention_heads"], c["conf_attention_logit_cap"])
    if ahead == 0:
        return dict(ours, causal=True, sliding_window=back + 1)
    return dict(ours, causal=False, sliding_window=(back, ahead))


def _gemma4_settings(c, layer_idx, sd) -> dict:
    mt = "gemma4_audio"
    w, left, ahead = (c["attention_chunk_size"], c["attention_context_left"],
                      c["attention_context_right"])
    back = left - 1
    if ahead != 0 or (w + back + ahead) // 2 != back or left < 2:
        raise ValueError(
            f"model_type {mt!r}: attention_context_right should be 0 and attention_chunk_size "
            f"+ attention_context_left − 1 = C with C // 2 = attention_context_left − 1 (its "
            f"position table's rows t = C//2 … 0 then read the query − key distance, as its "
            f"default 12, 13, 0), got attention_chunk_size = {w}, attention_context_left = "
            f"{left}, attention_context_right = {ahead}")
    for name in (f"{GEMMA4_NAMES[r].rsplit('.', 1)[0]}.{b}" for r in ("query", "key", "value",
                                                                        "out")
                 for b in _CLIP_BOUNDS):
        if name in sd and np.isfinite(_numpy(sd[name])).any():
            raise ValueError(f"model_type {mt!r}: {name} should be infinite (a clip bound of "
                             f"Gemma4ClippableLinear, which we do not implement), got "
                             f"{_numpy(sd[name]).tolist()!r}")
    ours = _conformer_settings(c, c["num_attention_heads"], c["attention_logit_cap"],
                               GEMMA4_KEY_SCALE)
    return dict(ours, causal=True, sliding_window=left - 1)


def _conformer_to_neutral(names, scale_key, mt):
    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, names, mt)
        params["per_dim_scale"] = _read(sd, scale_key, mt)
        return params
    return to_neutral


def _conformer_from_neutral(names, scale_key):
    def from_neutral(params, ours) -> dict:
        sd = _neutral_to_linears(params, names)
        sd[scale_key] = _numpy(params["per_dim_scale"])
        return sd
    return from_neutral


FAMILIES["gemma3n_audio"] = Family(
    GQA, _gemma3n_settings,
    _conformer_to_neutral(GEMMA3N_NAMES, "attn.per_dim_scale", "gemma3n_audio"),
    _conformer_from_neutral(GEMMA3N_NAMES, "attn.per_dim_scale"),
    stacks=(Stack("conformer", "attention", label="encoder"),), unverified=UNVERIFIED_CONFORMER)
FAMILIES["gemma4_audio"] = Family(
    GQA, _gemma4_settings, _conformer_to_neutral(GEMMA4_NAMES, "per_dim_scale", "gemma4_audio"),
    _conformer_from_neutral(GEMMA4_NAMES, "per_dim_scale"),
    stacks=(Stack("layers", "self_attn", label="encoder"),), unverified=UNVERIFIED_CONFORMER)

# Speech encoders whose relative positions are not expressed yet, each with why: from_hf names
# the reason.
_SHAW = ("its attention adds Shaw's learned relative position embeddings inside blocks of the "
         "input (Granite Speech's Conformer), which no option of ours expresses yet")
REFUSED = {
    **{mt: _SHAW for mt in ("granite_speech_encoder", "granite_speech5_encoder",
                            "granite_speech_plus_encoder")},
    "phi4_multimodal_audio": ("its attention adds a learned bias per clipped key - query "
                              "distance to the scores of its Conformer blocks, which its "
                              "converter does not read yet"),
}
