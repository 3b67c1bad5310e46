"""golden.convert.from_hf and to_hf (issue 25, step 2) on tiny Hugging Face encoders,
encoder-decoders and vision towers: BERT, RoBERTa, ViT, CLIP's and SigLIP's text and vision
models, Whisper, BART and T5. As in tests/test_hf_import.py: random float64 weights (biases
too), sdpa attention, each attention's input and output captured from the model's own forward,
and our torch and JAX twins built from the converted state dict must give the captured output;
round trips give back the very arrays; each family's distinctive setting moves the output far
more than the agreement; the input's gradient (and the context's) through our torch twin
equals the one through HF's module called again; unsupported settings are named.

What is compared. BERT and RoBERTa: the input of ``layer.attention`` and the output of its
``output.dense`` (the residual LayerNorm after it is not attention). ViT, CLIP, SigLIP: the
attention module's own output. Whisper, BART and T5: each of the three attentions (``kind``
"encoder", "decoder", "cross"), the cross-attention with the encoder's output it was called
with as our context. None of these families has a float32 step in float64 (no RoPE; sdpa's
softmax is in the input's dtype; T5's buckets are integers, ours equal), so the bound is EXACT
everywhere.

Shape legend: B batch, L tokens (decoder tokens for the encoder-decoders), Lc the encoder's
tokens, D model width, N heads, Dh head width.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import golden.convert
from tests.helpers import TWINS, fresh_rng, matrix

transformers = pytest.importorskip("transformers")

from tests.hf_harness import (  # noqa: E402
    BASE,
    EXACT,
    FLOAT32_LEVEL,
    B,
    Family,
    L,
    attention_of,
    build_model,
    captured,
    rel,
    state_dict,
)

LC, IMAGE, PATCH = 7, 12, 4  # encoder tokens; images 12 × 12 in 4 × 4 patches: 9 tokens (+ CLS)
T5_TABLE = "relative_attention_bias.weight"
LAYER_NORM = "output.LayerNorm."  # BERT's residual LayerNorm: not read, not written


def _ids(low=0):
    return lambda config, rng: {"input_ids": rng.integers(low, BASE["vocab_size"], (B, L))}


def _pixels(config, rng):
    return {"pixel_values": rng.standard_normal((B, 3, IMAGE, IMAGE))}


def _patches(config, rng):
    """SigLIP 2's vision input: the image's patches flattened (B, N, C·P²), all real (its
    pixel_attention_mask ones), on a 3 × 3 grid."""
    n, p = 9, config.patch_size
    return {"pixel_values": rng.standard_normal((B, n, 3 * p * p)),
            "pixel_attention_mask": np.ones((B, n), np.int64),
            "spatial_shapes": np.array([[3, 3]] * B)}


def _aimv2_attention(model, i):
    return model.encoder.layers[i].attention


def _seq2seq(config, rng):
    return {"input_ids": rng.integers(4, BASE["vocab_size"], (B, LC)),
            "decoder_input_ids": rng.integers(4, BASE["vocab_size"], (B, L))}


def _whisper_inputs(config, rng):
    return {"input_features": rng.standard_normal((B, config.num_mel_bins, 2 * LC)),
            "decoder_input_ids": rng.integers(4, BASE["vocab_size"], (B, L))}


def _bert_attention(model, i):
    return model.encoder.layer[i].attention


def _tower(model, i):
    return model.encoder.layers[i].self_attn


def _stacks(model, layer):
    """Whisper's and BART's (kind, i): the encoder's self_attn, the decoder's, its
    encoder_attn."""
    kind, i = layer
    stack = model.encoder if kind == "encoder" else model.decoder
    return getattr(stack.layers[i], "encoder_attn" if kind == "cross" else "self_attn")


def _t5_stacks(model, layer):
    kind, i = layer
    block = (model.encoder if kind == "encoder" else model.decoder).block[i]
    return block.layer[1].EncDecAttention if kind == "cross" else block.layer[0].SelfAttention


TOWER = dict(hidden_size=15, num_attention_heads=3, num_hidden_layers=2)  # Dh = 5
VISION = dict(TOWER, image_size=IMAGE, patch_size=PATCH, num_channels=3)
SEQ2SEQ = dict(hidden_size=30, num_attention_heads=5, decoder_attention_heads=3,  # Dh 6 and 10
               encoder_layers=2, decoder_layers=2, encoder_ffn_dim=8, decoder_ffn_dim=8,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
CROSS_AND_SELF = (("encoder", 0), ("encoder", 1), ("decoder", 1), ("cross", 0), ("cross", 1))
def _layer(model, i):
    """DINOv2's and RADIO's layer i attention (encoder.layer.N.attention)."""
    return model.encoder.layer[i].attention


# Issue 42's towers: CLIP's (MetaCLIP 2) and ViT's attention (DINOv2, with registers, RADIO);
# Dh = 6 from BASE's head_dim where HF reads it (N·Dh ≠ D), o_proj's bias always.
ENCODERS_42 = {
    "metaclip_2_text_model": Family("MetaClip2TextConfig", TOWER, layers=(0, 1),
                                    attention_of=_tower, inputs=_ids(),
                                    model="MetaClip2TextModel"),
    "metaclip_2_vision_model": Family("MetaClip2VisionConfig", VISION, layers=(0, 1),
                                      attention_of=_tower, inputs=_pixels,
                                      model="MetaClip2VisionModel"),
    "dinov2": Family("Dinov2Config", dict(VISION, qkv_bias=False), layers=(0, 1),
                     attention_of=_layer, inputs=_pixels),
    "dinov2_with_registers": Family("Dinov2WithRegistersConfig", dict(
        VISION, num_register_tokens=2), layers=(0, 1), attention_of=_layer, inputs=_pixels),
    "radio": Family("RadioConfig", dict(VISION, max_img_size=IMAGE, num_cls_tokens=2,
                                        num_registers=1), layers=(0, 1), attention_of=_layer,
                    inputs=_pixels),
}

FAMILIES = {
    "bert": Family("BertConfig", dict(TOWER, attention_probs_dropout_prob=0.1), layers=(0, 1),
                   attention_of=_bert_attention, inputs=_ids(),
                   output_of=lambda model, i: model.encoder.layer[i].attention.output.dense),
    "roberta": Family("RobertaConfig", dict(TOWER, is_decoder=True), layers=(0, 1),
                      attention_of=_bert_attention, inputs=_ids(low=2),  # 1 is its padding
                      output_of=lambda model, i: model.encoder.layer[i].attention.output.dense),
    "vit": Family("ViTConfig", dict(VISION, qkv_bias=True), layers=(0, 1),  # Dh = 6: N·Dh ≠ D
                  attention_of=lambda model, i: model.layers[i].attention,
                  inputs=_pixels),
    "clip_text_model": Family("CLIPTextConfig", TOWER, layers=(0, 1),
                              attention_of=_tower, inputs=_ids()),
    "clip_vision_model": Family("CLIPVisionConfig", VISION, layers=(0, 1),
                                attention_of=_tower, inputs=_pixels),
    "siglip_text_model": Family("SiglipTextConfig", TOWER, layers=(0, 1), attention_of=_tower,
                                inputs=_ids(), model="SiglipTextModel"),
    "siglip_vision_model": Family("SiglipVisionConfig", VISION, layers=(0, 1),
                                  attention_of=_tower, inputs=_pixels),
    "siglip2_text_model": Family("Siglip2TextConfig", TOWER, layers=(0, 1), attention_of=_tower,
                                 inputs=_ids(), model="Siglip2TextModel"),
    "siglip2_vision_model": Family("Siglip2VisionConfig", dict(TOWER, patch_size=PATCH,
                                                               num_patches=16),
                                   layers=(0, 1), attention_of=_tower, inputs=_patches),
    "aimv2_text_model": Family("Aimv2TextConfig", dict(TOWER, qkv_bias=True), layers=(0, 1),
                               attention_of=_aimv2_attention, inputs=_ids(),
                               model="Aimv2TextModel"),
    "aimv2_vision_model": Family("Aimv2VisionConfig", VISION, layers=(0, 1),
                                 attention_of=_aimv2_attention, inputs=_pixels),
    **ENCODERS_42,
    "whisper": Family("WhisperConfig", dict(SEQ2SEQ, num_key_value_heads=5, num_mel_bins=4,
                                            max_source_positions=LC, max_target_positions=16),
                      layers=CROSS_AND_SELF, attention_of=_stacks, inputs=_whisper_inputs),
    "bart": Family("BartConfig", SEQ2SEQ, layers=CROSS_AND_SELF, attention_of=_stacks,
                   inputs=_seq2seq),
    "t5": Family("T5Config", dict(hidden_size=16, num_attention_heads=3, head_dim=5,  # N·Dh ≠ D
                                  num_layers=2, d_ff=8, relative_attention_num_buckets=8,
                                  relative_attention_max_distance=12, dropout_rate=0.0),
                 layers=(("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1),
                         ("cross", 1)), attention_of=_t5_stacks, inputs=_seq2seq),
}

# The family's distinctive settings, each undone on one layer: (layer, our settings changed).
DISTINCT = {
    "bert": [(0, {"causal": True})],
    "roberta": [(1, {"causal": False})],  # is_decoder: causal
    "vit": [(0, {"causal": True})],
    "clip_text_model": [(0, {"causal": False})],
    "clip_vision_model": [(1, {"causal": True})],
    "siglip_text_model": [(0, {"causal": True})],
    "siglip_vision_model": [(1, {"causal": True})],
    "siglip2_text_model": [(0, {"causal": True})],
    "siglip2_vision_model": [(1, {"causal": True})],
    "aimv2_text_model": [(0, {"causal": True}), (1, {"qkv_bias": False, "out_bias": False})],
    "aimv2_vision_model": [(1, {"causal": True})],
    "metaclip_2_text_model": [(0, {"causal": False})],
    **{mt: [(1, {"causal": True})] for mt in ("metaclip_2_vision_model", "dinov2",
                                              "dinov2_with_registers", "radio")},
    "whisper": [(("encoder", 0), {"causal": True}), (("decoder", 1), {"causal": False}),
                (("cross", 0), {"qkv_bias": False, "key_bias": None, "out_bias": False})],
    "bart": [(("encoder", 1), {"causal": True}), (("decoder", 1), {"causal": False}),
             (("cross", 1), {"qkv_bias": False, "out_bias": False})],
    "t5": [(("encoder", 1), {"relative_attention_num_buckets": None,
                             "relative_attention_max_distance": None}),
           (("encoder", 0), {"scale": None}), (("decoder", 0), {"causal": False}),
           (("cross", 1), {"scale": None})],
}


# Issue 42's towers repeat CLIP's and ViT's attention: their model runs in the quick suite for
# DINOv2 (q, k and v without biases, o_proj with one), for all of them in the whole matrix
# (issue 39: the quick suite's time); the round trip checks every family in both.
QUICK_42 = {"dinov2"}
PER_FAMILY = [pytest.param(n, id=n, marks=[matrix] if n in ENCODERS_42 and n not in QUICK_42
                           else []) for n in FAMILIES]


def _kind(layer):
    """(kind, layer_idx) of a layer of FAMILIES: (kind, i) for the encoder-decoders, i alone
    for the others (kind None)."""
    return layer if isinstance(layer, tuple) else (None, layer)


def _layer_state(family, model, layer):
    """The layer's attention state dict as from_hf takes it: T5's layers past 0 with layer 0's
    shared table (of the same stack) added."""
    sd = state_dict(attention_of(family, model, layer))
    kind, i = _kind(layer)
    if family.config == "T5Config" and kind != "cross" and T5_TABLE not in sd:
        sd[T5_TABLE] = state_dict(attention_of(family, model, (kind, 0)))[T5_TABLE]
    return sd


def _run(twin, variant, ours, params, seen):
    """Our module built from (variant, ours, params) on the captured input (and context)."""
    x, _, *context = seen
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        return twin.numpy(module(twin.array(x), *(twin.array(c) for c in context)))


def _model(name, rng):
    config, model = build_model(FAMILIES[name], rng)
    seen = captured(FAMILIES[name], model, FAMILIES[name].layers,
                    FAMILIES[name].inputs(config, rng))
    return config, model, seen


@pytest.mark.parametrize("name", PER_FAMILY)
def test_layers_equal_the_models_own_attention(name, twin):
    family = FAMILIES[name]
    rng, seed = fresh_rng()
    config, model, seen = _model(name, rng)
    for layer in family.layers:
        kind, i = _kind(layer)
        variant, ours, params = golden.convert.from_hf(
            config.to_dict(), _layer_state(family, model, layer), layer_idx=i, kind=kind)
        assert variant == ("multi_head_cross_attention" if kind == "cross"
                           else "grouped_query_attention")
        assert len(seen[layer]) == (3 if kind == "cross" else 2)  # the context was captured
        error = rel(_run(twin, variant, ours, params, seen[layer]), seen[layer][1])
        assert error <= EXACT, (name, layer, error, seed)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_round_trip_gives_back_the_same_arrays(name):
    family = FAMILIES[name]
    rng, _ = fresh_rng()
    config, model = build_model(family, rng)
    for layer in family.layers:
        kind, i = _kind(layer)
        sd = _layer_state(family, model, layer)
        result = golden.convert.from_hf(config, sd, layer_idx=i, kind=kind)
        back = golden.convert.to_hf(*result)
        assert set(back) == {k for k in sd if not k.startswith(LAYER_NORM)}, (name, layer)
        for key, a in back.items():
            np.testing.assert_array_equal(a, sd[key], err_msg=f"{name} {layer} {key}")
            assert not np.shares_memory(a, sd[key])
        plain = golden.convert.to_hf(result[0], dict(result[1]), result[2], model_type=name)
        assert set(plain) == set(back), (name, layer)  # the kind from the variant


@pytest.mark.parametrize("name", PER_FAMILY)
def test_each_distinctive_setting_moves_the_output_far_more_than_the_agreement(name):
    """Undoing one of the family's settings (bidirectional or causal, T5's bias table and
    scale, the biases of the cross-attention...) changes the layer's output by more than
    10³ times the loosest bound of these tests, so the agreement above is not blind to it."""
    from golden.specification import variants
    family, twin = FAMILIES[name], TWINS["torch"]
    rng, seed = fresh_rng()
    config, model, seen = _model(name, rng)
    for layer, change in DISTINCT[name]:
        kind, i = _kind(layer)
        variant, ours, params = golden.convert.from_hf(
            config, _layer_state(family, model, layer), layer_idx=i, kind=kind)
        changed = {n: v for n, v in {**ours, **change}.items() if v is not None}
        assert changed != dict(ours), (name, change)
        shapes = variants.VARIANTS[variant].shapes(variants.VARIANTS[variant].config(changed))
        params = {n: a for n, a in params.items() if n in shapes}
        out = _run(twin, variant, changed, params, seen[layer])
        assert rel(out, seen[layer][1]) > 1e3 * FLOAT32_LEVEL, (name, layer, change, seed)


def _tiny(name, **kw):
    """A tiny model's config dict and one layer's state dict."""
    rng, _ = fresh_rng()
    family = FAMILIES[name]
    config, model = build_model(family, rng)
    layer = family.layers[0]
    return dict(config.to_dict(), **kw), _layer_state(family, model, layer)


def test_unsupported_settings_and_kinds_are_named():
    config, sd = _tiny("bert", position_embedding_type="relative_key")
    with pytest.raises(ValueError, match=r"model_type 'bert': position_embedding_type = "
                                         r"'relative_key' is not supported"):
        golden.convert.from_hf(config, sd)
    with pytest.raises(ValueError, match=r"model_type 'bert': kind should be None \(one kind of "
                                         r"attention converts\), got 'cross'"):
        golden.convert.from_hf(config, sd, kind="cross")
    config, sd = _tiny("whisper")
    with pytest.raises(ValueError, match=r"model_type 'whisper' has several attentions per "
                                         r"layer: kind should be 'encoder' or 'decoder' or "
                                         r"'cross', got None"):
        golden.convert.from_hf(config, sd)
    with pytest.raises(ValueError, match=r"model_type 'whisper': k_proj should have no bias"):
        golden.convert.from_hf(config, dict(sd, **{"k_proj.bias": sd["q_proj.bias"]}),
                               kind="encoder")
    config, sd = _tiny("t5", dropout_rate=0.1)
    golden.convert.from_hf(config, sd, kind="encoder")  # GroupedQueryAttention's dropout
    with pytest.raises(ValueError, match=r"model_type 't5': dropout_rate = 0.1 is not supported "
                                         r"for the cross-attention \(MultiHeadCrossAttention "
                                         r"has no dropout"):
        golden.convert.from_hf(config, {k: a for k, a in sd.items() if k != T5_TABLE},
                               kind="cross")
    config, sd = _tiny("t5")
    with pytest.raises(ValueError, match=r"model_type 't5': the state dict has no "
                                         r"'relative_attention_bias.weight': T5 computes the "
                                         r"position bias in layer 0 of each stack and shares "
                                         r"it; for layer 1 put layer 0's table"):
        golden.convert.from_hf(config, {k: a for k, a in sd.items() if k != T5_TABLE},
                               layer_idx=1, kind="encoder")
    with pytest.raises(ValueError, match=r"model_type 'clip' is not supported; supported: "):
        golden.convert.from_hf({"model_type": "clip"}, {})


PREFILL = 4  # decoder tokens given at once before decoding the rest one at a time


@pytest.mark.parametrize("name", ["whisper", "bart", "t5"])
def test_decoding_with_our_caches_equals_the_models_attention(name, twin):
    """The decoder's last layer, converted, decodes as HF's forward computed it: its causal
    self-attention with our KV cache (a prefill of PREFILL tokens, then one token at a time; T5's
    buckets at the cache's positions) and its cross-attention with a ContextCache of the
    encoder's output (made once, one query token at a time), every step's rows against the
    captured output, EXACT."""
    family = FAMILIES[name]
    rng, seed = fresh_rng()
    config, model, seen = _model(name, rng)
    for kind in ("decoder", "cross"):
        layer = (kind, 1)
        variant, ours, params = golden.convert.from_hf(
            config, _layer_state(family, model, layer), layer_idx=1, kind=kind)
        x, expected, *context = seen[layer]
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            if kind == "decoder":
                y, cache = module(twin.array(x[:, :PREFILL]), cache=module.init_cache(B, L))
                steps = [twin.numpy(y)]
                for i in range(PREFILL, L):
                    y, cache = module(twin.array(x[:, i:i + 1]), cache=cache)
                    steps.append(twin.numpy(y))
            else:
                cache = module.context_cache(twin.array(context[0]))
                steps = [twin.numpy(module(twin.array(x[:, i:i + 1]), cache=cache))
                         for i in range(L)]
        error = rel(np.concatenate(steps, axis=1), expected)
        assert error <= EXACT, (name, kind, error, seed)


def _output_of(family, model, layer):
    """The module whose output is the layer's attention output (BERT's output.dense)."""
    return attention_of(family, model, layer) if family.output_of is None else (
        family.output_of(model, layer))


def _hf_again(family, model, layer, call, x, context):
    """HF's attention module of the layer called again as the model called it (its masks,
    T5's position bias), on x (and a cross-attention's context as its key_value_states): the
    output_of module's output, which keeps its graph."""
    args, kwargs = call
    kwargs = dict(kwargs, **({"key_value_states": context} if context is not None else {}))
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = x
    else:
        args = (x,) + tuple(args[1:])
    seen = {}

    def read(module, args, output):
        seen["out"] = output if isinstance(output, torch.Tensor) else output[0]

    handle = _output_of(family, model, layer).register_forward_hook(read)
    try:
        attention_of(family, model, layer)(*args, **kwargs)
    finally:
        handle.remove()
    return seen["out"]


@pytest.mark.parametrize("name", PER_FAMILY)
def test_input_gradient_through_the_torch_twin_equals_hfs(name):
    """dL/dx of L = Σ out ⊙ dO (and dL/dcontext for a cross-attention), HF's module called
    again as the model called it against our torch module's: EXACT (no float32 step in HF)."""
    family, twin = FAMILIES[name], TWINS["torch"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    calls = {}
    # no cache object to append to again (the decoders': RoBERTa's is_decoder, the seq2seq)
    kw = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    seen = captured(family, model, family.layers, family.inputs(config, rng), calls=calls, **kw)
    for layer in family.layers:
        kind, i = _kind(layer)
        # fresh inputs of the captured shapes (the captured context can be nearly the same
        # row at every position, a softmax then nearly flat and x's gradient all cancellation)
        drawn = [rng.standard_normal(a.shape) for a in (seen[layer][0], *seen[layer][2:])]
        d_out = torch.from_numpy(rng.standard_normal(seen[layer][1].shape))
        theirs = [torch.from_numpy(a).requires_grad_() for a in drawn]
        out = _hf_again(family, model, layer, calls[layer], theirs[0], (theirs[1:] or [None])[0])
        (out * d_out).sum().backward()
        variant, ours, params = golden.convert.from_hf(
            config, _layer_state(family, model, layer), layer_idx=i, kind=kind)
        mine = [torch.from_numpy(a.copy()).requires_grad_() for a in drawn]
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            y = module(*mine)
            (y * d_out).sum().backward()
        assert len(mine) == (2 if kind == "cross" else 1)
        assert rel(y.detach().numpy(), out.detach().numpy()) <= EXACT, (name, layer, seed)
        for what, a, b in zip(("x", "context"), mine, theirs):
            error = rel(a.grad.numpy(), b.grad.numpy())
            assert error <= EXACT, (name, layer, what, error, seed)
