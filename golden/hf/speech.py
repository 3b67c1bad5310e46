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

from golden.hf.family import (GQA, LLAMA_NAMES, Family, Stack, _bias_flags, _dropout,
                              _linears_to_neutral, _neutral_to_linears, _read, _sizes)
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

# Speech encoders whose relative positions are not expressed yet, each with why (from_hf names
# the reason): none left.
REFUSED: dict[str, str] = {}

# Speech-language checkpoints, tower by tower ({model_type: {sub-config: key prefix}}, as
# golden.hf.vision.COMPOSITES): Granite Speech's text tower (a granite decoder, its
# layers.N.self_attn under any prefix: "language_model.model." as save_pretrained writes it)
# and its encoder (encoder.layers.N.attn); its projector (a Q-Former) is not read, and
# attn-parity hf's notes say so.
COMPOSITES: dict[str, dict[str, str]] = {
    mt: {"text_config": "", "encoder_config": "encoder."}
    for mt in ("granite_speech", "granite_speech_plus")}
