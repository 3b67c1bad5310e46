"""Speech encoders with Transformer-XL's relative positional attention: NVIDIA's FastConformer
(Hugging Face's ParakeetEncoderAttention), our GroupedQueryAttention with
``relative_positions="transformer_xl"``. One ``FAMILIES`` entry per encoder config:

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

# Speech encoders whose relative positions are not expressed yet, each with why: from_hf names
# the reason.
_CHUNKED = ("its attention is chunked local attention with relative position logits, a "
            "softplus per-dimension query scale and a soft cap (Gemma 3n's audio encoder), "
            "which no option of ours expresses yet")
_SHAW = ("its attention adds Shaw's learned relative position embeddings inside blocks of the "
         "input (Granite Speech's Conformer), which no option of ours expresses yet")
REFUSED = {
    "gemma3n_audio": _CHUNKED, "gemma4_audio": _CHUNKED,
    **{mt: _SHAW for mt in ("granite_speech_encoder", "granite_speech5_encoder",
                            "granite_speech_plus_encoder")},
}
