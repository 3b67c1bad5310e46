"""Encoders, encoder-decoders and vision towers: BERT, RoBERTa, ViT, CLIP's and SigLIP's
text and vision models (and MetaCLIP 2's, AIMv2's), DINOv2 and RADIO (``_self_family``
entries of ``FAMILIES``), and Whisper, BART and T5 (``Kinds`` entries: the encoder's and the
decoder's ``_self_family``, the cross-attention's ``_cross_family``); the text encoders with
RoPE (``ROPE_ENCODERS``: ModernBERT and its decoder, EuroBERT, UltraBERT, GTE, Nomic BERT,
Jina embeddings v3), whose bidirectional windows are pairs (HF's |i − j| ≤ r).

Which arrays and which output. BERT and RoBERTa: the state dict of ``layer.attention``
(``self.query``, ``self.key``, ``self.value``, ``output.dense``); its ``output.LayerNorm.*``
belong to the residual block after the attention (LayerNorm(dense(a) + x)) and are not read
(to_hf does not give them): our module's output is ``output.dense``'s. ViT (5.x: ``q_proj`` ...
``o_proj`` on ``layer.attention``), CLIP and SigLIP (``self_attn``: ``q_proj`` ... ``out_proj``)
compute exactly the attention. Whisper, BART and T5 have three attentions: ``kind="encoder"``
(the encoder's self-attention, bidirectional), ``"decoder"`` (the decoder's, causal) and
``"cross"`` (the decoder's ``encoder_attn`` / ``EncDecAttention``, our
MultiHeadCrossAttention); ``layer_idx`` counts the layers of that stack. Composite configs
(``clip``, ``siglip``) are not read: pass their ``text_config`` or ``vision_config``
(``clip_text_model``, ``clip_vision_model``, ``siglip_text_model``, ``siglip_vision_model``).

Whisper's self-attention has no key bias (k_proj bias=False), our GroupedQueryAttention q, k
and v biases all or none: ``b_key`` is zeros, which changes nothing (k + 0 = k exactly; and
any b_key adds q·b_key, the same for every key of a query row, which softmax removes), so
to_hf leaves it out whatever it holds. Its cross-attention is key_bias=False as it is.

T5 computes its relative position bias in layer 0 of each stack (``relative_attention_bias``,
(K, N)) and passes it to the later layers, whose state dicts have no table: for layer_idx > 0
put layer 0's ``relative_attention_bias.weight`` (of the same stack) into the state dict;
each of our modules holds its own copy, and to_hf gives it back under that name. T5's
cross-attention has no table (a ``relative_attention_bias.weight`` some checkpoints store for
it is unused by transformers and not read here).

Dropout on the attention weights (attention_probs_dropout_prob, attention_dropout,
dropout_rate) becomes GroupedQueryAttention's ``dropout`` (training only); our
MultiHeadCrossAttention has none, so a cross-attention with a non-zero rate is refused
(set it to 0.0: in inference HF's dropout is off too).

For the checkpoint verifier each entry also says where its attention modules sit in a
checkpoint's keys (``stacks``: BERT's ``encoder.layer.N.attention``, an encoder-decoder's three
stacks, ...), and every family here has ``hf_float64``: HF's attention has no float32 step (no
RoPE, ALiBi or float32 norm), so the verifier's HF rows run at float64 too. ``COMPOSITES``: the
composite model_types (``clip``, ``siglip``), their towers' sub-configs and key prefixes.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import (GQA, LLAMA_NAMES, ROLES, Family, Kinds, Stack, _bias_flags,
                              _dropout, _heads, _layer_type, _linears_to_neutral,
                              _neutral_to_linears, _read, _rope, _sizes)
from golden.hf.fused import _fused_family

MHCA = "multi_head_cross_attention"
KINDS = ("encoder", "decoder", "cross")
BERT_NAMES = {"query": "self.query", "key": "self.key", "value": "self.value",
              "out": "output.dense"}
OUT_PROJ_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "out_proj"}
T5_NAMES = {"query": "q", "key": "k", "value": "v", "out": "o"}
T5_TABLE = "relative_attention_bias.weight"


def _self_family(mt, names, *, width, heads, causal=False, dropout=None, head_dim=None,
                 zero_key_bias=False, relative=False, unsupported=None, **family) -> Family:
    """A bidirectional (or causal) self-attention with separate q, k, v, out linears: sizes
    from the config fields ``width`` and ``heads`` (Dh = width // N unless ``head_dim(c)``),
    biases from the state dict; ``causal`` a bool or ``causal(c)``; ``dropout`` the config
    field of the weights' dropout; ``zero_key_bias``: k has no bias where q and v have one
    (Whisper); ``relative``: T5's scale 1 and bucketed bias table; ``family``: the Family's
    other fields (``stacks``, ``hf_float64``, ...)."""

    def settings(c, layer_idx, sd):
        n, d = int(c[heads]), int(c[width])
        ours = dict(d_in=d, num_heads=n, num_kv_heads=n,
                    head_dim=int(head_dim(c)) if head_dim is not None else d // n,
                    causal=bool(causal(c) if callable(causal) else causal))
        if zero_key_bias:
            if f"{names['key']}.bias" in sd:
                raise ValueError(f"model_type {mt!r}: {names['key']} should have no bias, got "
                                 f"{names['key']}.bias")
            ours.update(qkv_bias=f"{names['query']}.bias" in sd,
                        out_bias=f"{names['out']}.bias" in sd)
        else:
            ours.update(_bias_flags(sd, names, mt))
        if dropout is not None and c.get(dropout):
            ours["dropout"] = float(c[dropout])
        if relative:
            ours.update(scale=1.0,
                        relative_attention_num_buckets=int(c["relative_attention_num_buckets"]),
                        relative_attention_max_distance=int(c["relative_attention_max_distance"]))
            if T5_TABLE not in sd:
                raise ValueError(f"model_type {mt!r}: the state dict has no {T5_TABLE!r}: T5 "
                                 f"computes the position bias in layer 0 of each stack and "
                                 f"shares it; for layer {layer_idx} put layer 0's table (of the "
                                 f"same stack) into the state dict under that name")
        return ours

    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, names, mt)
        if zero_key_bias and ours["qkv_bias"]:
            params["b_key"] = np.zeros(params["W_key"].shape[1], params["W_key"].dtype)
        if relative:
            params["relative_attention_bias"] = _read(sd, T5_TABLE, mt)
        return params

    def from_neutral(params, ours):
        keep = {n: a for n, a in params.items()
                if not (zero_key_bias and n == "b_key") and n != "relative_attention_bias"}
        sd = _neutral_to_linears(keep, names)
        if "relative_attention_bias" in params:
            sd[T5_TABLE] = np.array(params["relative_attention_bias"])
        return sd

    return Family(GQA, settings, to_neutral, from_neutral, dict(unsupported or {}), **family)


def _cross_family(mt, names, *, width, heads, head_dim=None, scale=None, dropout) -> Family:
    """The decoder's attention over the encoder's output: MultiHeadCrossAttention, d_context =
    d_in = ``width``; q and v have biases or not alike, k may differ (key_bias)."""

    def settings(c, layer_idx, sd):
        if c.get(dropout):
            raise ValueError(f"model_type {mt!r}: {dropout} = {c[dropout]!r} is not supported "
                             f"for the cross-attention (MultiHeadCrossAttention has no dropout; "
                             f"set it to 0.0, as in inference, where HF's is off too)")
        has = {role: f"{names[role]}.bias" in sd for role in ROLES}
        if has["query"] != has["value"]:
            raise ValueError(f"model_type {mt!r}: q and v should both have a bias or neither, "
                             f"got {names['query']}: {has['query']}, {names['value']}: "
                             f"{has['value']}")
        n, d = int(c[heads]), int(c[width])
        ours = dict(d_in=d, d_context=d, num_heads=n,
                    head_dim=int(head_dim(c)) if head_dim is not None else d // n,
                    qkv_bias=has["query"], out_bias=has["out"])
        if has["key"] != has["query"]:
            ours["key_bias"] = has["key"]
        if scale is not None:
            ours["scale"] = scale
        return ours

    return Family(MHCA, settings, lambda sd, ours: _linears_to_neutral(sd, names, mt),
                  lambda params, ours: _neutral_to_linears(params, names))


def _seq2seq(stack, module, cross) -> tuple:
    """Whisper's and BART's (encoder and decoder "layers"), T5's ("block") three stacks: the
    encoder's and the decoder's self-attention ``module``, the decoder's ``cross``-attention;
    T5's self-attention layers after the first are converted with their stack's layer 0
    table."""
    shared = T5_TABLE if stack == "block" else None
    return (Stack(f"encoder.{stack}", module, "encoder", shared=shared, label="encoder"),
            Stack(f"decoder.{stack}", module, "decoder", shared=shared, label="decoder"),
            Stack(f"decoder.{stack}", cross, "cross", label="decoder"))


def _encoder_decoder(mt, names, *, zero_key_bias=False) -> Kinds:
    """Whisper and BART: encoder_attention_heads and decoder_attention_heads over d_model."""
    common = dict(width="d_model", dropout="attention_dropout", zero_key_bias=zero_key_bias)
    return Kinds(encoder=_self_family(mt, names, heads="encoder_attention_heads", **common),
                 decoder=_self_family(mt, names, heads="decoder_attention_heads", causal=True,
                                      **common),
                 cross=_cross_family(mt, names, width="d_model", heads="decoder_attention_heads",
                                     dropout="attention_dropout"),
                 stacks=_seq2seq("layers", "self_attn", "encoder_attn"), hf_float64=True)


def _t5() -> Kinds:
    common = dict(width="d_model", heads="num_heads", head_dim=lambda c: c["d_kv"])
    return Kinds(encoder=_self_family("t5", T5_NAMES, dropout="dropout_rate", relative=True,
                                      **common),
                 decoder=_self_family("t5", T5_NAMES, dropout="dropout_rate", relative=True,
                                      causal=True, **common),
                 cross=_cross_family("t5", T5_NAMES, scale=1.0, dropout="dropout_rate",
                                     **common),
                 stacks=_seq2seq("block", "layer.0.SelfAttention", "layer.1.EncDecAttention"),
                 hf_float64=True)


def _bert(mt) -> Family:
    return _self_family(mt, BERT_NAMES, width="hidden_size", heads="num_attention_heads",
                        causal=lambda c: c.get("is_decoder", False),
                        dropout="attention_probs_dropout_prob", unsupported={
                            "position_embedding_type": ((None, "absolute"), "relative_key and "
                                                        "relative_key_query scores are not "
                                                        "expressed")},
                        # BERT's LayerNorm(dense(a) + x) after it is not attention: ours is
                        # dense's output
                        stacks=(Stack("encoder.layer", "attention", output="output.dense"),),
                        hf_float64=True)


def _head_dim(c) -> int:
    """HF's getattr(config, "head_dim", D / N) of ViT's descendants."""
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _vit() -> Family:
    return _self_family("vit", LLAMA_NAMES, width="hidden_size", heads="num_attention_heads",
                        dropout="attention_probs_dropout_prob",
                        head_dim=_head_dim,
                        # ViT's modules (5.x) are q_proj ... o_proj on layers.N.attention;
                        # save_pretrained writes (as every published checkpoint has) the 4.x
                        # names of the same arrays
                        stacks=(Stack("encoder.layer", "attention",
                                      in_model=("layers", "attention"),
                                      renames=(("attention.query.", "q_proj."),
                                               ("attention.key.", "k_proj."),
                                               ("attention.value.", "v_proj."),
                                               ("output.dense.", "o_proj."))),),
                        hf_float64=True)


def _tower(mt, causal, label, **family) -> Family:
    """CLIP's and SigLIP's text and vision transformers: CLIPAttention, SiglipAttention, at
    ``encoder.layers.N.self_attn``; ``label`` ("text", "vision") begins the rows' names."""
    return _self_family(mt, OUT_PROJ_NAMES, width="hidden_size", heads="num_attention_heads",
                        causal=causal, dropout="attention_dropout",
                        stacks=(Stack("encoder.layers", "self_attn", label=label),),
                        hf_float64=True, **family)


# ---- encoders with RoPE (issue 42) --------------------------------------------------------------

MODERNBERT_THETA = {"full_attention": ("global_rope_theta", 160_000.0),
                    "sliding_attention": ("local_rope_theta", 10_000.0)}


def _with_rope_parameters(c, mt, theta) -> dict:
    """The config with rope_parameters as transformers 5's config class fills them in where a
    config.json of before it has none: ``theta`` HF's default θ (a float), or for ModernBERT
    {layer type: (the old field, its default)}; a θ left out is HF's default, never NoPE."""
    if c.get("rope_parameters") is not None:
        return c
    if isinstance(theta, dict):
        if c.get("rope_scaling") is not None:
            raise ValueError(f"model_type {mt!r}: rope_scaling = {c['rope_scaling']!r} without "
                             f"rope_parameters is not supported (give rope_parameters, as "
                             f"transformers 5 saves them)")
        return dict(c, rope_parameters={kind: {"rope_type": "default",
                                               "rope_theta": float(c.get(old, value))}
                                        for kind, (old, value) in theta.items()})
    if theta is None:
        raise ValueError(f"model_type {mt!r}: the config has no rope_parameters (transformers "
                         f"5 saves them)")
    return dict(c, rope_theta=float(c.get("rope_theta", theta)))


def _rope_encoder(mt, *, theta, window=None, causal=False, dropout="attention_dropout",
                  head_dim_from_config=True, grouped=True):
    """The settings of a text encoder with rotary positions: sizes (Dh the config's head_dim,
    else D / N; D / N whatever it says where not ``head_dim_from_config``), the RoPE of the
    layer's type (a per-type rope_parameters dict resolved: ModernBERT's and UltraBERT's
    local and global θ), bidirectional unless ``causal``; ``window(c)`` the sliding window of
    the config's "sliding_attention" layers (an int: causal, W keys up to the query's own; a
    pair: HF's bidirectional |i − j| ≤ r, keys p − r … p + r); ``grouped``: HF's attention
    reads num_key_value_heads (else one KV head per head, whatever a config says);
    ``dropout`` the config field of the weights' dropout; ``theta``: HF's default θ where a
    config.json of before transformers 5 has no rope_parameters (``_with_rope_parameters``)."""

    def settings(c, layer_idx):
        c = _with_rope_parameters(c, mt, theta)
        layer_type = _layer_type(c, layer_idx)
        sizes = _sizes(c) if head_dim_from_config else _heads(c, c["num_attention_heads"], mt)
        if not grouped:
            sizes["num_kv_heads"] = sizes["num_heads"]
        ours = {**sizes, **_rope(c, layer_type, mt), "causal": causal}
        if window is not None and layer_type == "sliding_attention":
            ours["sliding_window"] = window(c)
        return _dropout(c, ours, dropout)
    return settings


def _half_of_local_attention(c, mt) -> int:
    """ModernBERT's window radius: local_attention (its total width W) // 2, as HF's
    config.sliding_window."""
    w = c.get("local_attention")
    if not isinstance(w, int) or isinstance(w, bool) or w < 2:
        raise ValueError(f"model_type {mt!r}: local_attention should be an int ≥ 2 (the "
                         f"sliding layers' total window), got {w!r}")
    return w // 2


def _separate_rope(mt, names, settings, stacks=None, **family) -> Family:
    """A RoPE encoder with one nn.Linear per role (``names``): ``settings(c, layer_idx)`` and
    the bias flags of the state dict."""

    def our_settings(c, layer_idx, sd):
        ours = settings(c, layer_idx)
        ours.update(_bias_flags(sd, names, mt))
        return ours

    if stacks is not None:
        family["stacks"] = stacks
    return Family(GQA, our_settings, lambda sd, ours: _linears_to_neutral(sd, names, mt),
                  lambda params, ours: _neutral_to_linears(params, names), **family)


def _fused_on_file(what, mt) -> str:
    """Why ``attn-parity hf`` does not check the family's checkpoints yet (Family.unverified):
    they keep q, k and v fused, ``what`` the file's names, which transformers splits into
    q_proj, k_proj, v_proj and renames when loading (its conversion_mapping)."""
    return (f"attn-parity hf does not check {mt} checkpoints yet: they keep q, k and v fused "
            f"({what}; transformers splits and renames them when loading), a layout it does "
            f"not read")


MODERNBERT_DECODER_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "Wo"}
ROPE_ENCODERS: dict[str, Family] = {
    # ModernBERT: Wqkv in thirds [q; k; v], Wo; D / N heads; bidirectional, its sliding layers
    # |i − j| ≤ local_attention // 2 (HF's create_bidirectional_sliding_window_mask on
    # config.sliding_window = local_attention // 2), their own θ (local_rope_theta). Its out_drop
    # (dropout of Wo's output, training only) is the caller's, as BLOOM's hidden_dropout
    "modernbert": _fused_family(
        "modernbert", _rope_encoder(
            "modernbert", theta=MODERNBERT_THETA, head_dim_from_config=False,
            window=lambda c: (_half_of_local_attention(c, "modernbert"),) * 2),
        "thirds", "Wqkv", "Wo",
        stacks=(Stack("layers", "attn"),)),
    # ModernBERT's decoder: causal, q_proj, k_proj, v_proj and Wo; its sliding layers see
    # local_attention // 2 keys (HF's causal sliding window of config.sliding_window keys)
    "modernbert-decoder": _separate_rope(
        "modernbert-decoder", MODERNBERT_DECODER_NAMES, _rope_encoder(
            "modernbert-decoder", theta=MODERNBERT_THETA, causal=True,
            head_dim_from_config=False,
            window=lambda c: _half_of_local_attention(c, "modernbert-decoder")),
        (Stack("layers", "attn"),)),
    # EuroBERT: Llama's attention, bidirectional
    "eurobert": _separate_rope("eurobert", LLAMA_NAMES,
                               _rope_encoder("eurobert", theta=10_000.0)),
    # UltraBERT: EuroBERT's with sliding layers |i − j| ≤ sliding_window (a radius) and a θ per
    # layer type
    "ultrabert": _separate_rope("ultrabert", LLAMA_NAMES, _rope_encoder(
        "ultrabert", theta=None, window=lambda c: (int(c["sliding_window"]),) * 2)),
    # GTE (the new implementation), Nomic BERT, Jina embeddings v3 (XLM-R with RoPE):
    # q_proj ... o_proj (biases: GTE and Jina; none: Nomic), bidirectional, one KV head per
    # head. Jina's task LoRA adapters are not in transformers' model (a checkpoint's are not
    # loaded): its attention is the base weights'; a task's adapter, W + s·B·A, folds exactly
    # into q, k, v, o before conversion, and is not read here
    **{mt: _separate_rope(mt, LLAMA_NAMES, _rope_encoder(
        mt, theta=theta, grouped=False, dropout="attention_probs_dropout_prob"),
        unverified=_fused_on_file(what, mt))
       for mt, theta, what in (("gte", 160_000.0, "qkv_proj and o_proj"),
                               ("nomic_bert", 1000.0, "attn.Wqkv and attn.out_proj"),
                               ("jina_embeddings_v3", 20_000.0,
                                "mixer.Wqkv and mixer.out_proj"))},
}


def _dinov2(mt, renames=(), **family) -> Family:
    """DINOv2's (and RADIO's) ViT attention at encoder.layer.N.attention: q_proj ... o_proj,
    q, k and v biases with qkv_bias, o_proj's always; ``renames``: the checkpoints' 4.x
    names of the same arrays; ``family``: the Family's other fields."""
    return _self_family(mt, LLAMA_NAMES, width="hidden_size", heads="num_attention_heads",
                        dropout="attention_probs_dropout_prob", head_dim=_head_dim,
                        stacks=(Stack("encoder.layer", "attention", renames=renames),),
                        hf_float64=True, **family)


DINOV2_RENAMES = (("attention.query.", "q_proj."), ("attention.key.", "k_proj."),
                  ("attention.value.", "v_proj."), ("output.dense.", "o_proj."))


FAMILIES: dict[str, Family | Kinds] = {
    "bert": _bert("bert"),
    "roberta": _bert("roberta"),
    "vit": _vit(),
    "clip_text_model": _tower("clip_text_model", causal=True, label="text"),
    "clip_vision_model": _tower("clip_vision_model", causal=False, label="vision"),
    # AutoModel does not take a SiglipTextConfig
    "siglip_text_model": _tower("siglip_text_model", causal=False, label="text",
                                model_class="SiglipTextModel"),
    "siglip_vision_model": _tower("siglip_vision_model", causal=False, label="vision"),
    # SigLIP 2 (its vision tower's variable resolution is the patch embedding's and the mask's)
    "siglip2_text_model": _tower("siglip2_text_model", causal=False, label="text",
                                 model_class="Siglip2TextModel"),
    "siglip2_vision_model": _tower("siglip2_vision_model", causal=False, label="vision"),
    # AIMv2: the attention at encoder.layers.N.attention, out_proj's bias as qkv_bias. Its text
    # attention is not causal itself: Aimv2TextModel makes a causal mask only when it is given
    # an attention_mask, and passes none otherwise; that mask is the caller's here
    **{mt: _self_family(mt, OUT_PROJ_NAMES, width="hidden_size", heads="num_attention_heads",
                        causal=causal, dropout="attention_dropout", hf_float64=True,
                        stacks=(Stack("encoder.layers", "attention", label=label),), **kw)
       for mt, causal, label, kw in (
           ("aimv2_vision_model", False, "vision", {}),
           ("aimv2_text_model", False, "text", {"model_class": "Aimv2TextModel"}))},
    # MetaCLIP 2: CLIP's towers (AutoModel takes neither tower's config)
    **{mt: _tower(mt, causal=causal, label=label, model_class=model)
       for mt, causal, label, model in (
           ("metaclip_2_text_model", True, "text", "MetaClip2TextModel"),
           ("metaclip_2_vision_model", False, "vision", "MetaClip2VisionModel"))},
    # DINOv2 (with registers: the same attention, the registers are tokens) and RADIO
    **{mt: _dinov2(mt, DINOV2_RENAMES) for mt in ("dinov2", "dinov2_with_registers")},
    "radio": _dinov2("radio", unverified=_fused_on_file("blocks.N.attn.qkv and attn.proj",
                                                        "radio")),
    **ROPE_ENCODERS,
    "whisper": _encoder_decoder("whisper", OUT_PROJ_NAMES, zero_key_bias=True),
    "bart": _encoder_decoder("bart", OUT_PROJ_NAMES),
    "t5": _t5(),
}

# Composite models (not converted themselves: from_hf takes a tower's own config): their
# towers' sub-configs and the towers' key prefixes, {model_type: {sub-config: key prefix}}.
COMPOSITES: dict[str, dict[str, str]] = {
    mt: {"text_config": "text_model.", "vision_config": "vision_model."}
    for mt in ("clip", "siglip", "siglip2", "aimv2", "metaclip_2")}
