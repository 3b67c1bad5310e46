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
    "phi4_multimodal_audio": ("its attention adds a learned bias per clipped key - query "
                              "distance to the scores of its Conformer blocks, which its "
                              "converter does not read yet"),
}
