"""Models whose cross-attention takes issue 42's extras of MultiHeadCrossAttention: Mllama's text
model (``mllama_text_model``: Llama's self-attention layers and, at its config's
``cross_attention_layers``, cross-attention layers with a per-head RMS QK norm) and T5Gemma
(``t5gemma``: an encoder-decoder of Gemma 2's attention, its cross-attention with Gemma 2's
scale and soft cap). Each is a ``Kinds`` entry of ``FAMILIES`` as Whisper's and BART's are:
``kind="decoder"`` (a self-attention layer, causal) and ``"cross"`` (the cross-attention,
our MultiHeadCrossAttention), T5Gemma's ``"encoder"`` too (bidirectional).

Mllama (MllamaTextCrossAttention, ``layers.N.cross_attn``): q = RMSNorm(split(x W_q)) ·
q_norm, k = RMSNorm(split(c W_k)) · k_norm per head over Dh (HF's q_norm and k_norm after the
head split; ε = rms_norm_eps), Dh = D / N whatever the config says, the context c of width D
(the vision tower's output after the model's projector), scale Dh^−1/2, no biases; the gate
tanh(cross_attn_attn_gate) that scales its output is the residual block's, not the attention's.
HF's RMSNorm runs in float32 (its agreement in float64 is float32's). Its self-attention
layers (``layers.N.self_attn``) are Llama's with Dh = D / N. A layer of the other kind is
refused by index. The vision tower (``mllama_vision_model``) is refused by name (REFUSED).

T5Gemma (T5GemmaSelfAttention, T5GemmaCrossAttention; the config's ``encoder`` and
``decoder`` sub-configs): each attention's scale query_pre_attn_scalar^−1/2 and its soft cap
attn_logit_softcapping; the encoder's sliding layers bidirectional |i − j| ≤ W (HF's
create_bidirectional_sliding_window_mask), the decoder's causal W keys; the cross-attention
full, over the encoder's output (d_context = the encoder's hidden_size), without RoPE.
T5Gemma 2 (``t5gemma2``: T5Gemma2SelfAttention in the encoder, T5Gemma2MergedAttention in
the decoder; the config's ``encoder.text_config`` and ``decoder``): Gemma 3's attention (scale
query_pre_attn_scalar^−1/2, q_norm and k_norm per head with 1 + w, RoPE per layer type); its
encoder bidirectional, a sliding layer's keys i − ((W + 1)//2 − 1) … i + W//2 (HF's
sliding_window_mask_function(W, is_causal=False)); its decoder our GroupedQueryAttention with
``merged_context=True``: one softmax over the decoder's own keys (causal, W keys on a sliding
layer) and the encoder's (the same k_proj, k_norm and v_proj on the encoder's output, no RoPE),
called with ``context=`` the encoder's output and ``context_mask=`` its attention mask. HF
passes no soft cap to either attention (attn_logit_softcapping is read and not used): none is
converted. Its vision tower (SigLIP, ``encoder.vision_config``) is the ``siglip_vision_model``
family's (golden/hf/vision.py), converted from its own config. BLT
(``blt`` and its local encoder and decoder) is refused by name: its cross-attention's
q_norm and k_norm are RMSNorms of x and of the context over D before the projections (not per
head), and it adds x to its output.

The checkpoint verifier (``attn-parity hf``) does not check these families' checkpoints yet
(``unverified``: it runs one attention per call, not a cross-attention's context).
"""

from __future__ import annotations

import numpy as np

from golden.hf.decoders import _gemma, _qk_norm_entries
from golden.hf.family import (GQA, LLAMA_NAMES, Family, Kinds, Stack, _bias_flags,
                              _decoder_settings, _dropout, _heads, _linears_to_neutral,
                              _neutral_to_linears, _rope)

MHCA = "multi_head_cross_attention"
NORMS = ("q_norm.weight", "k_norm.weight")


def _normed_linears(mt):
    """(to_neutral, from_neutral) of LLAMA_NAMES' projections with per-head q_norm and k_norm
    (NORMS' keys): Mllama's cross layers and T5Gemma 2's attention name them alike."""

    def to_neutral(sd, ours):
        return {**_linears_to_neutral(sd, LLAMA_NAMES, mt), **_qk_norm_entries(sd, mt, *NORMS)}

    def from_neutral(params, ours):
        sd = _neutral_to_linears({n: a for n, a in params.items() if n not in ("q_norm", "k_norm")},
                                 LLAMA_NAMES)
        sd[NORMS[0]], sd[NORMS[1]] = np.array(params["q_norm"]), np.array(params["k_norm"])
        return sd

    return to_neutral, from_neutral


def _no_dropout(c, mt, name):
    if c.get(name):
        raise ValueError(f"model_type {mt!r}: {name} = {c[name]!r} is not supported for the "
                         f"cross-attention (MultiHeadCrossAttention has no dropout; set it to "
                         f"0.0, as in inference, where HF's is off too)")


# ---- Mllama's text model -------------------------------------------------------------------------

def _mllama_kind(c, layer_idx, kind):
    """Refuse a layer of the other kind: the cross-attention layers are cross_attention_layers."""
    crossing = [int(i) for i in c.get("cross_attention_layers") or ()]
    if (layer_idx in crossing) != (kind == "cross"):
        want = "cross" if layer_idx in crossing else "decoder"
        raise ValueError(f"model_type 'mllama_text_model': layer {layer_idx} is a "
                         f"{'cross' if want == 'cross' else 'self'}-attention layer "
                         f"(cross_attention_layers = {crossing}): kind should be {want!r}, got "
                         f"{kind!r}")


def _mllama_sizes(c) -> dict:
    """Dh = D / N (HF's, whatever else the config says), Nkv num_key_value_heads."""
    n = int(c["num_attention_heads"])
    return _heads(c, n, "mllama_text_model", int(c.get("num_key_value_heads") or n))


def _mllama_self() -> Family:
    mt = "mllama_text_model"

    def settings(c, layer_idx, sd):
        _mllama_kind(c, layer_idx, "decoder")
        ours = {**_mllama_sizes(c), **_rope(c, None, mt), **_bias_flags(sd, LLAMA_NAMES, mt)}
        return _dropout(c, ours, "dropout")

    return Family(GQA, settings, lambda sd, ours: _linears_to_neutral(sd, LLAMA_NAMES, mt),
                  lambda params, ours: _neutral_to_linears(params, LLAMA_NAMES))


def _mllama_cross() -> Family:
    mt = "mllama_text_model"

    def settings(c, layer_idx, sd):
        _mllama_kind(c, layer_idx, "cross")
        _no_dropout(c, mt, "dropout")
        sizes = _mllama_sizes(c)
        return dict(d_in=sizes["d_in"], d_context=sizes["d_in"], num_heads=sizes["num_heads"],
                    num_kv_heads=sizes["num_kv_heads"], head_dim=sizes["head_dim"],
                    **_bias_flags(sd, LLAMA_NAMES, mt), qk_norm="rms",
                    qk_norm_eps=float(c["rms_norm_eps"]))

    to_neutral, from_neutral = _normed_linears(mt)

    return Family(MHCA, settings, to_neutral, from_neutral)


# ---- T5Gemma 2 -----------------------------------------------------------------------------------

def _t5gemma2(kind) -> Family:
    """T5Gemma 2's ``kind``: "encoder" (T5Gemma2SelfAttention, bidirectional) or "decoder"
    (T5Gemma2MergedAttention, merged_context)."""
    mt = "t5gemma2"

    def settings(c, layer_idx, sd):
        sub = c["encoder"]["text_config"] if kind == "encoder" else c["decoder"]
        ours = _decoder_settings(sub, layer_idx, mt=mt)
        ours.update(_bias_flags(sd, LLAMA_NAMES, mt), scale=float(
            sub["query_pre_attn_scalar"]) ** -0.5, qk_norm="rms_one_plus",
            qk_norm_eps=float(sub["rms_norm_eps"]))
        if kind == "decoder":
            ours["merged_context"] = True
            return ours
        ours["causal"] = False
        if "sliding_window" in ours:  # HF's bidirectional window of W: (W + 1)//2 − 1, W//2
            w = ours["sliding_window"]
            ours["sliding_window"] = ((w + 1) // 2 - 1, w // 2)
        return ours

    to_neutral, from_neutral = _normed_linears(mt)

    return Family(GQA, settings, to_neutral, from_neutral)


# ---- T5Gemma -------------------------------------------------------------------------------------

def _t5gemma_self(stack) -> Family:
    """The ``stack``'s ("encoder", "decoder") self-attention: Gemma 2's, bidirectional in the
    encoder."""
    mt = "t5gemma"

    def settings(c, layer_idx, sd):
        sub = c[stack]
        ours = _decoder_settings(sub, layer_idx, mt=mt)
        ours.update(_bias_flags(sd, LLAMA_NAMES, mt))
        _gemma(sub, layer_idx, ours)
        if stack == "encoder":
            ours["causal"] = False
            if "sliding_window" in ours:  # HF's bidirectional window: |i − j| ≤ W
                ours["sliding_window"] = (ours["sliding_window"],) * 2
        return ours

    return Family(GQA, settings, lambda sd, ours: _linears_to_neutral(sd, LLAMA_NAMES, mt),
                  lambda params, ours: _neutral_to_linears(params, LLAMA_NAMES))


def _t5gemma_cross() -> Family:
    mt = "t5gemma"

    def settings(c, layer_idx, sd):
        sub = c["decoder"]
        _no_dropout(sub, mt, "attention_dropout")
        sizes = {**_decoder_settings(sub, layer_idx, mt=mt)}
        ours = dict(d_in=sizes["d_in"], d_context=int(c["encoder"]["hidden_size"]),
                    num_heads=sizes["num_heads"], num_kv_heads=sizes["num_kv_heads"],
                    head_dim=sizes["head_dim"], **_bias_flags(sd, LLAMA_NAMES, mt))
        _gemma(sub, layer_idx, ours)  # scale and softcap
        return ours

    return Family(MHCA, settings, lambda sd, ours: _linears_to_neutral(sd, LLAMA_NAMES, mt),
                  lambda params, ours: _neutral_to_linears(params, LLAMA_NAMES))


def _unverified(mt) -> str:
    return (f"attn-parity hf does not check {mt} checkpoints yet: its cross-attention needs the "
            f"context it attends (tested against HF's modules in tests/test_hf_import_cross.py)")


def _kinds(unverified, **kinds) -> Kinds:
    entry = Kinds(**kinds)
    entry.unverified = unverified
    return entry


FAMILIES = {
    "mllama_text_model": _kinds(
        _unverified("mllama"), decoder=_mllama_self(), cross=_mllama_cross(),
        stacks=(Stack("layers", "self_attn", "decoder", label="decoder"),
                Stack("layers", "cross_attn", "cross", label="cross"))),
    "t5gemma": _kinds(
        _unverified("t5gemma"), encoder=_t5gemma_self("encoder"),
        decoder=_t5gemma_self("decoder"), cross=_t5gemma_cross(),
        stacks=(Stack("encoder.layers", "self_attn", "encoder", label="encoder"),
                Stack("decoder.layers", "self_attn", "decoder", label="decoder"),
                Stack("decoder.layers", "cross_attn", "cross", label="decoder"))),
    "t5gemma2": _kinds(
        _unverified("t5gemma2"), encoder=_t5gemma2("encoder"), decoder=_t5gemma2("decoder"),
        stacks=(Stack("text_model.layers", "self_attn", "encoder", label="encoder"),
                Stack("decoder.layers", "self_attn", "decoder", label="decoder"))),
}

_BLT = ("BLT's cross-attention (BltCrossAttention) is not MultiHeadCrossAttention's: its q_norm "
        "and k_norm are RMSNorms over the whole width D of x and of the context before the "
        "projections (not per head after them), and it adds its input x to its output (a "
        "residual inside the module); neither is an option of ours")
REFUSED = {
    **{mt: _BLT for mt in ("blt", "blt_local_encoder", "blt_local_decoder")},
    "mllama_vision_model": "Mllama's vision tower is not converted (its attention is plain "
                           "multi-head attention, but its gated layers, tiles and aspect-ratio "
                           "masks are not tested here); its text model is mllama_text_model",
}
