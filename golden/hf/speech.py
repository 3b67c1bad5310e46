"""Speech encoders with relative positional attention: NVIDIA's FastConformer (Hugging Face's
ParakeetEncoderAttention), our GroupedQueryAttention with
``relative_positions="transformer_xl"``; IBM's Granite Speech Conformer, ours with
``relative_positions="shaw"`` in blocks; and Gemma 3n's and Gemma 4's audio encoders (Google's
USM Conformer) with ``relative_positions="conformer_timing"`` (each in its section below). One
``FAMILIES`` entry per encoder config:

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
  gemma3n_audio, gemma4_audio     the audio towers of Gemma 3n and Gemma 4 (their audio_config)
  qwen2_audio_encoder,            the audio towers of Qwen2-Audio, Voxtral and Audio Flamingo 3
  voxtral_encoder,                (their audio_config): Whisper's encoder attention
  audioflamingo3_encoder
  lasr_encoder, glmasr_encoder    LASR's (lasr_ctc's encoder_config) and GLM-ASR's audio
                                  encoders: bidirectional attention with RoPE
  moonshine, dia                  encoder-decoders (``Kinds``): encoder, decoder and cross
  kyutai_speech_to_text           Kyutai's speech-to-text decoder (Moshi's attention)
(the last eight: the section "issue 42" at the end); ``REFUSED``: Fun-ASR-Nano's encoder.

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

import math

import numpy as np

from golden.hf.encoders import MHCA, OUT_PROJ_NAMES, _self_family
from golden.hf.family import (GQA, LLAMA_NAMES, Family, Kinds, Stack, _bias_flags, _dropout,
                              _linears_to_neutral, _neutral_to_linears, _read, _rope, _sizes)
from golden.specification.mapping import _numpy

NAMES = {**LLAMA_NAMES, "pos": "relative_k_proj"}
VECTORS = ("bias_u", "bias_v")


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
                  stacks=(Stack("layers", "self_attn", label="encoder"),))


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
                 stacks=(Stack("encoders", "self_attn", label="encoder",
                               beside=(PHI4_TABLE,)),), hf_float64=True,
                 model_class="Phi4MultimodalAudioModel"),
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
# our query_seq_lengths or mask (padded frames' outputs are not HF's to compare). No float32
# step in HF's attention (its table, LayerNorm and sdpa in the model's dtype): the verifier's
# HF rows run at float64 too.
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
                  stacks=(Stack("layers", "attn", label="encoder"),), hf_float64=True,
                  model_class=model)
       for mt, model in (("granite_speech_encoder", "granite_speech.GraniteSpeechCTCEncoder"),
                         ("granite_speech_plus_encoder",
                          "granite_speech_plus.GraniteSpeechPlusCTCEncoder"))},
    "granite_speech5_encoder": Family(
        GQA, _granite5_settings, _granite5_to_neutral, _granite5_from_neutral,
        stacks=(Stack("layers", "self_attn", label="encoder"),), hf_float64=True),
})

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
# float32 (q, k, v .float()) whatever the model's dtype: attn-parity hf's HF row of it is at
# float32 only, judged by the tolerance table's float32 bound as our float32 twins are (no
# wider bound): the one-layer model is float32, and the fixture's x and the checkpoint's
# weights are float32-exact, so HF's float32 steps are float32's own roundings, as in our
# float32 twin (seen at most 2.0e-7 elementwise relative on tests/test_hf_speech_command.py's
# checkpoints, 3 seeds; the table's relative norm bound 1e-6). tests/test_hf_import_speech.py's
# GEMMA4_FLOAT32 (4e-6) is another comparison: float64 inputs and weights, which HF's .float()
# rounds.

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
        if isinstance(getattr(sd.get(name), "dtype", None), str):  # a header's entry (attn-
            continue  # parity hf's preflight): the values are checked when the layer converts
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
    stacks=(Stack("conformer", "attention", label="encoder", output="post", input="attn"),))
FAMILIES["gemma4_audio"] = Family(
    GQA, _gemma4_settings, _conformer_to_neutral(GEMMA4_NAMES, "per_dim_scale", "gemma4_audio"),
    _conformer_from_neutral(GEMMA4_NAMES, "per_dim_scale"),
    stacks=(Stack("layers", "self_attn", label="encoder"),))

# Speech encoders we do not convert, each with why (from_hf names the reason).
REFUSED: dict[str, str] = {
    "fun_asr_nano_encoder": "Fun-ASR-Nano's SAN-M attention adds an FSMN memory block to its "
                            "output (a depthwise convolution over neighbouring frames of the "
                            "padding-masked values, fsmn_kernel_size wide), which no option of "
                            "ours computes; and its first layer's projections take the stacked "
                            "features' width (num_mel_bins · num_stacked_frames) but give "
                            "hidden_size back, an output of another width than the input",
}

# Speech-language checkpoints, tower by tower ({model_type: {sub-config: key prefix}}, as
# golden.hf.vision.COMPOSITES): Granite Speech's text tower (a granite decoder, its
# layers.N.self_attn under any prefix: "language_model.model." as save_pretrained writes it)
# and its encoder (encoder.layers.N.attn); its projector (a Q-Former) is not read, and
# attn-parity hf's notes say so.
COMPOSITES: dict[str, dict[str, str]] = {
    **{mt: {"text_config": "", "encoder_config": "encoder."}
       for mt in ("granite_speech", "granite_speech_plus")},
    # Issue 42's audio-language models: the text tower under "language_model." (a Llama or
    # Mistral for Voxtral and GLM-ASR, a Qwen2 for Qwen2-Audio and Audio Flamingo 3, a Qwen3 for
    # Fun-ASR-Nano), the audio tower under "audio_tower." (Fun-ASR-Nano's refused: REFUSED, so
    # noted, not read; its adaptor layers not read either); their projectors are not attention
    **{mt: {"text_config": "language_model.", "audio_config": "audio_tower."}
       for mt in ("voxtral", "qwen2_audio", "audioflamingo3", "glmasr", "fun_asr_nano")},
}


# ---- issue 42: speech and audio models whose attention is a supported one's ----------------
#
# Whisper-like audio towers (qwen2_audio_encoder: Qwen2-Audio's; voxtral_encoder: Voxtral's;
# audioflamingo3_encoder: Audio Flamingo 3's): Whisper's encoder self-attention (q_proj, k_proj
# without bias, v_proj, out_proj; multi-head, Dh = D / N, bidirectional; HF's queries multiplied
# by Dh^−1/2 before the product, ours the product scaled: one rounding apart, float64's), at
# ``layers.N.self_attn``; their padding mask the caller's. No float32 step (sinusoids added
# before the layers, sdpa): the verifier's HF rows at float64.
#
# Rotary speech encoders: lasr_encoder (LASR / MedASR's Conformer, LasrEncoderAttention:
# Llama's attention made bidirectional, RoPE over the whole head, biases as attention_bias) and
# glmasr_encoder (GLM-ASR's, GlmAsrAttention: q_proj, v_proj and o_proj with biases, k_proj
# without (b_key zeros: k + 0 = k exactly, to_hf leaves it out and refuses a non-zero one, as
# DINOv3's), rotate-half RoPE on the first partial_rotary_factor (0.5) of each head,
# bidirectional, no padding mask in its encoder). HF's float32 step: RoPE's angles.
#
# Encoder-decoders (``Kinds``): moonshine (MoonshineAttention, GLM's: interleaved pairs (2i,
# 2i + 1) on the first partial_rotary_factor (0.9) of each head, q/k/v biases as
# attention_bias, o_proj none; the encoder bidirectional, the decoder causal, the decoder's
# ``encoder_attn`` a cross-attention without RoPE; its pad_head_dim_to_multiple_of pads q, k and
# v with zeros, which changes nothing, the scale being the unpadded Dh's); dia (Dia's text
# encoder and audio decoder: DiaSelfAttention, Llama's projections without biases, RoPE over the
# whole head, scale 1, GQA; DiaCrossAttention: GQA over the encoder's cross_hidden_size, scale
# 1, no RoPE; the config's encoder_config and decoder_config give the sizes).
#
# kyutai_speech_to_text (Kyutai's STT decoder: MoshiAttention without flexible linears, its
# q_proj.linear … o_proj.linear, no biases, Llama's RoPE, causal; HF's model makes a causal
# mask whatever sliding_window says).

MOSHI_NAMES = {r: f"{n}.linear" for r, n in LLAMA_NAMES.items()}


def _whisper_like(mt, width="hidden_size", heads="num_attention_heads") -> Family:
    """A Whisper-like audio tower's self-attention: golden.hf.encoders' Whisper encoder's
    (``width``, ``heads`` the config fields to_dict() names)."""
    return _self_family(mt, OUT_PROJ_NAMES, width=width, heads=heads,
                        dropout="attention_dropout", zero_key_bias=True,
                        stacks=(Stack("layers", "self_attn", label="encoder"),),
                        hf_float64=True)


def _no_key_bias(mt, names):
    """to_neutral and from_neutral of an attention whose k has no bias where q and v have one
    (under RoPE a key bias changes the scores: b_key zeros, a non-zero one refused by to_hf)."""

    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, names, mt)
        if ours["qkv_bias"]:
            params["b_key"] = np.zeros(params["W_key"].shape[1], params["W_key"].dtype)
        return params

    def from_neutral(params, ours):
        if "b_key" in params and np.any(_numpy(params["b_key"]) != 0):
            raise ValueError(f"model_type {mt!r}: b_key should be zeros (k_proj has no bias; "
                             f"under RoPE a key bias changes the scores), got a non-zero b_key")
        return _neutral_to_linears({n: a for n, a in params.items() if n != "b_key"}, names)
    return to_neutral, from_neutral


def _rotary_encoder(mt, *, key_bias=True, names=LLAMA_NAMES) -> Family:
    """LASR's and GLM-ASR's encoders: Llama's projections, bidirectional, RoPE (GLM-ASR's on
    its rotary slice, rotate-half), GQA as num_key_value_heads says."""

    def settings(c, layer_idx, sd):
        ours = {**_sizes(c), **_rope(c, None, mt), "causal": False}
        if key_bias:
            ours.update(_bias_flags(sd, names, mt))
        else:
            if f"{names['key']}.bias" in sd:
                raise ValueError(f"model_type {mt!r}: {names['key']} should have no bias, got "
                                 f"{names['key']}.bias")
            has = {r: f"{names[r]}.bias" in sd for r in ("query", "value")}
            if has["query"] != has["value"]:
                raise ValueError(f"model_type {mt!r}: q_proj and v_proj should both have a bias "
                                 f"or neither, got q_proj: {has['query']}, v_proj: "
                                 f"{has['value']}")
            ours.update(qkv_bias=has["query"], out_bias=f"{names['out']}.bias" in sd)
        return _dropout(c, ours)

    if key_bias:
        to_neutral = lambda sd, ours: _linears_to_neutral(sd, names, mt)  # noqa: E731
        from_neutral = lambda params, ours: _neutral_to_linears(params, names)  # noqa: E731
    else:
        to_neutral, from_neutral = _no_key_bias(mt, names)
    return Family(GQA, settings, to_neutral, from_neutral,
                  stacks=(Stack("layers", "self_attn", label="encoder"),))


def _moonshine_heads(c) -> int:
    """Moonshine's one head count: HF's MoonshineAttention views q, k and v with the config's
    num_key_value_heads, which each layer built overwrites (the decoder's last): it computes
    multi-head attention only when its four head counts are equal."""
    mt = "moonshine"
    fields = ("encoder_num_attention_heads", "encoder_num_key_value_heads",
              "decoder_num_attention_heads", "decoder_num_key_value_heads")
    counts = {f: c.get(f) for f in fields}
    counts = {f: (v if v is not None else counts[f.replace("key_value", "attention")])
              for f, v in counts.items()}
    if len(set(counts.values())) != 1:
        got = ", ".join(f"{f} = {v}" for f, v in counts.items())
        raise ValueError(f"model_type {mt!r}: {', '.join(fields)} should be equal (HF's "
                         f"MoonshineAttention views q, k and v with the num_key_value_heads "
                         f"the last layer built leaves in its config: other counts fail or mix "
                         f"the stacks' sizes), got {got}")
    return int(counts[fields[0]])


def _moonshine(kind):

    def settings(c, layer_idx, sd):
        n, d = _moonshine_heads(c), int(c["hidden_size"])
        ours = dict(d_in=d, num_heads=n, head_dim=d // n, **_bias_flags(sd, LLAMA_NAMES,
                                                                       "moonshine"))
        if kind == "cross":
            return dict(ours, d_context=d, num_kv_heads=n)
        ours.update(num_kv_heads=n, causal=kind == "decoder", rope_interleaved=True,
                    **_rope(c, None, "moonshine"))
        return _dropout(c, ours)

    return Family(MHCA if kind == "cross" else GQA, settings,
                  lambda sd, ours: _linears_to_neutral(sd, LLAMA_NAMES, "moonshine"),
                  lambda params, ours: _neutral_to_linears(params, LLAMA_NAMES))


def _dia(kind):
    """Dia's three attentions, their sizes from the config's encoder_config (the encoder's) or
    decoder_config (the decoder's self- and cross-attention)."""
    mt = "dia"

    def settings(c, layer_idx, sd):
        sub = c.get("encoder_config" if kind == "encoder" else "decoder_config")
        if not isinstance(sub, dict):
            raise ValueError(f"model_type {mt!r}: the config should have its encoder_config and "
                             f"decoder_config (dicts: Dia's sizes), got {sub!r}")
        if kind == "cross":
            n, kv = int(sub["cross_num_attention_heads"]), int(sub["cross_num_key_value_heads"])
            return dict(d_in=int(sub["hidden_size"]), d_context=int(sub["cross_hidden_size"]),
                        num_heads=n, num_kv_heads=kv, head_dim=int(sub["cross_head_dim"]),
                        scale=1.0, **_bias_flags(sd, LLAMA_NAMES, mt))
        ours = {**_sizes(sub), **_rope(sub, None, mt), "causal": kind == "decoder",
                "scale": 1.0, **_bias_flags(sd, LLAMA_NAMES, mt)}
        return ours

    return Family(MHCA if kind == "cross" else GQA, settings,
                  lambda sd, ours: _linears_to_neutral(sd, LLAMA_NAMES, mt),
                  lambda params, ours: _neutral_to_linears(params, LLAMA_NAMES))


def _kyutai(c, layer_idx, sd):
    mt = "kyutai_speech_to_text"
    ours = {**_sizes(c), **_rope(c, None, mt), **_bias_flags(sd, MOSHI_NAMES, mt)}
    return _dropout(c, ours)  # causal (our default); HF's model makes no window


def _seq2seq_stacks(module, cross):
    return (Stack("encoder.layers", module, "encoder", label="encoder"),
            Stack("decoder.layers", module, "decoder", label="decoder"),
            Stack("decoder.layers", cross, "cross", label="decoder"))


_MOONSHINE = Kinds(encoder=_moonshine("encoder"), decoder=_moonshine("decoder"),
                   cross=_moonshine("cross"), stacks=_seq2seq_stacks("self_attn", "encoder_attn"))
_MOONSHINE.unverified = ("attn-parity hf does not check Moonshine checkpoints yet: its "
                         "one-layer model takes raw audio (input_values) and its layer counts "
                         "are encoder_num_hidden_layers and decoder_num_hidden_layers, which "
                         "the verifier does not read")
_DIA = Kinds(encoder=_dia("encoder"), decoder=_dia("decoder"), cross=_dia("cross"),
             stacks=_seq2seq_stacks("self_attention", "cross_attention"))
_DIA.unverified = ("attn-parity hf does not check Dia checkpoints yet: its sizes and layer "
                   "counts are in encoder_config and decoder_config, which the verifier's "
                   "one-layer model does not read")

FAMILIES.update({
    "qwen2_audio_encoder": _whisper_like("qwen2_audio_encoder", "d_model",
                                         "encoder_attention_heads"),
    **{mt: _whisper_like(mt) for mt in ("voxtral_encoder", "audioflamingo3_encoder")},
    "lasr_encoder": _rotary_encoder("lasr_encoder"),
    "glmasr_encoder": _rotary_encoder("glmasr_encoder", key_bias=False),
    "moonshine": _MOONSHINE,
    "dia": _DIA,
    "kyutai_speech_to_text": Family(
        GQA, _kyutai, lambda sd, ours: _linears_to_neutral(sd, MOSHI_NAMES,
                                                           "kyutai_speech_to_text"),
        lambda params, ours: _neutral_to_linears(params, MOSHI_NAMES),
        unverified="attn-parity hf does not check Kyutai STT checkpoints yet: they hold the "
                   "Mimi codec's transformer (codec_model.…layers.N.self_attn) beside the "
                   "decoder's, which its one-layer model does not tell apart"),
})
