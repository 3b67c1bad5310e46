"""golden.convert.from_hf on the models whose cross-attention takes MultiHeadCrossAttention's QK
norm or soft cap (golden/hf/cross.py): Mllama's text model (its self-attention layers and its
cross-attention layers, q and k RMS-normed per head) and T5Gemma (its encoder's and decoder's
Gemma 2 self-attention, its cross-attention with Gemma 2's scale and soft cap) and T5Gemma 2
(its encoder's Gemma 3 self-attention over a padded row, its decoder's merged self- and
cross-attention as GroupedQueryAttention(merged_context=True), decoded with a MergedCache
against HF's EncoderDecoderCache; its SigLIP vision tower as siglip_vision_model). Tiny random
float64 models (sdpa attention for Mllama, eager for T5Gemma); each attention's input (and
context, and Mllama's cross mask) and output captured from the model's own forward. Our twins
built from the converted state dict give the captured output; the input's, the context's and
the QK norm weights' gradients through our torch twin equal those through HF's module called
again; each family's distinctive setting undone moves the output far more than the agreement;
round trips give the same arrays back; a layer of the other kind and Mllama's vision tower
are refused by name.

Bounds: FLOAT32_LEVEL (1e-6 relative) everywhere: HF has a float32 step in each (Mllama's
RMSNorm, both families' RoPE angles with rope_precision="hf", T5Gemma's eager softmax, the only
attention HF runs it with: its sdpa refuses the soft cap; T5Gemma 2's RMSNorm in float32:
measured over 12 seeds at most 1.7e-7, both twins).

Shape legend: B batch, L decoder tokens, Lc the context's tokens, D width, N heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import golden.convert
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")

from tests.hf_harness import FLOAT32_LEVEL, draw_parameters, rel, state_dict  # noqa: E402

B, L, LC = 2, 7, 5
CONTEXT = ("encoder_hidden_states", "cross_attention_states")


@dataclass(frozen=True)
class Tiny:
    """A tiny model of one family: ``make(rng) -> (config, model, inputs)``, the layers to
    check ((kind, layer_idx)), ``attention_of(model, layer)`` and each kind's bound."""

    make: Callable
    layers: tuple
    attention_of: Callable
    bounds: dict
    self_masks: bool = False  # a self-attention's mask captured and given (a padded encoder)


def _mllama(rng):
    config = transformers.MllamaTextConfig(
        hidden_size=24, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=16, vocab_size=64, cross_attention_layers=[1], rms_norm_eps=1e-5,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    model = transformers.MllamaTextModel(config).double().eval()
    draw_parameters(model, rng)
    mask = rng.random((B, 1, L, LC)) < 0.7
    mask[..., 0] = True  # every query sees a context token
    inputs = {"input_ids": rng.integers(0, 64, (B, L)),
              "cross_attention_states": rng.standard_normal((B, LC, 24)),
              "cross_attention_mask": mask}
    return config, model, inputs


def _t5gemma(rng):
    module = dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                  num_hidden_layers=2, intermediate_size=16, vocab_size=64,
                  query_pre_attn_scalar=7, attn_logit_softcapping=2.0, sliding_window=3,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.T5GemmaConfig(encoder=dict(module), decoder=dict(
        module, hidden_size=20, num_key_value_heads=4), vocab_size=64)
    config._attn_implementation = "eager"  # HF's only one with the soft cap
    model = transformers.T5GemmaModel(config).double().eval()
    draw_parameters(model, rng)
    inputs = {"input_ids": rng.integers(3, 64, (B, LC + 4)),
              "decoder_input_ids": rng.integers(3, 64, (B, L))}
    return config, model, inputs


def _t5gemma2(rng):
    """Two layers (sliding, full) of Gemma 3's attention in the encoder and the decoder (the
    decoder's merged), sdpa at float64; row 1's encoder input padded (its last 3 tokens), which
    the decoder's merged attention sees as the context's mask."""
    text = dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                num_hidden_layers=2, intermediate_size=16, vocab_size=64,
                query_pre_attn_scalar=7, sliding_window=4, max_position_embeddings=64,
                layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-3,
                rope_parameters={"sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10.0},
                                 "full_attention": {"rope_type": "default",
                                                    "rope_theta": 1000.0}})
    vision = dict(hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4)
    config = transformers.T5Gemma2Config(encoder=dict(text_config=dict(text),
                                                      vision_config=vision),
                                         decoder=dict(text, vocab_size=64), vocab_size=64)
    config._attn_implementation = "sdpa"
    model = transformers.T5Gemma2Model(config).double().eval()
    draw_parameters(model, rng)
    padding = np.ones((B, LC + 4), np.int64)
    padding[1, -3:] = 0
    inputs = {"input_ids": rng.integers(3, 64, (B, LC + 4)), "attention_mask": padding,
              "decoder_input_ids": rng.integers(3, 64, (B, L))}
    return config, model, inputs


def _t5gemma2_attention(model, layer):
    kind, i = layer
    stack = model.encoder.text_model if kind == "encoder" else model.decoder
    return stack.layers[i].self_attn


def _mllama_attention(model, layer):
    kind, i = layer
    return getattr(model.layers[i], "cross_attn" if kind == "cross" else "self_attn")


def _t5gemma_attention(model, layer):
    kind, i = layer
    stack = model.encoder if kind == "encoder" else model.decoder
    return getattr(stack.layers[i], "cross_attn" if kind == "cross" else "self_attn")


FAMILIES = {
    "mllama_text_model": Tiny(_mllama, (("decoder", 0), ("cross", 1)), _mllama_attention,
                              {"decoder": FLOAT32_LEVEL, "cross": FLOAT32_LEVEL}),
    "t5gemma": Tiny(_t5gemma, (("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1),
                               ("cross", 0), ("cross", 1)), _t5gemma_attention,
                    {"encoder": FLOAT32_LEVEL, "decoder": FLOAT32_LEVEL, "cross": FLOAT32_LEVEL}),
    "t5gemma2": Tiny(_t5gemma2, (("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1)),
                     _t5gemma2_attention, {"encoder": FLOAT32_LEVEL, "decoder": FLOAT32_LEVEL},
                     self_masks=True),
}

# Each family's distinctive settings, each undone on one layer: (layer, our settings changed).
DISTINCT = {
    "mllama_text_model": [(("cross", 1), {"qk_norm": None})],
    "t5gemma": [(("cross", 0), {"softcap": None}), (("cross", 1), {"scale": None}),
                (("encoder", 1), {"causal": True}), (("encoder", 0), {"sliding_window": None}),
                (("decoder", 1), {"softcap": None})],
    # the merged softmax undone: the decoder's own keys alone (the context unseen); the
    # encoder's window and bidirectionality; the decoder's window on its sliding layer
    "t5gemma2": [(("decoder", 0), {"merged_context": False}),
                 (("decoder", 1), {"merged_context": False}),
                 (("encoder", 0), {"sliding_window": None}), (("encoder", 1), {"causal": True}),
                 (("decoder", 0), {"sliding_window": None})],
}


def _capture(tiny, model, inputs):
    """{layer: (x, output, context or None, mask or None, (args, kwargs))} from one forward."""
    seen, calls = {}, {}

    def read(layer):
        def hook(module, args, kwargs):
            calls[layer] = (args, dict(kwargs))
        return hook

    def write(layer):
        def hook(module, args, output):
            a, kw = calls[layer]
            x = kw["hidden_states"] if "hidden_states" in kw else a[0]
            context = next((kw[n] for n in CONTEXT if kw.get(n) is not None), None)
            mask = (kw.get("attention_mask") if context is not None or tiny.self_masks
                    else None)
            if context is None and mask is not None:  # the padding alone: the keys some query
                real = mask if mask.dtype == torch.bool else mask == 0  # sees, for every query
                mask = real.any(-2, keepdim=True).expand(real.shape)  # (the window is ours)
            if kw.get("merged_attention_mask") is not None:  # T5Gemma 2: the context's part
                merged = kw["merged_attention_mask"]
                real = merged if merged.dtype == torch.bool else merged == 0
                mask = real[:, :, :, x.shape[-2]:].any(-2)  # (B, 1, Lc): the keys some query sees
            seen[layer] = (x.detach().numpy().copy(), output[0].detach().numpy().copy(),
                           None if context is None else context.detach().numpy().copy(),
                           None if mask is None else mask.detach().numpy()[:, 0].copy(),
                           calls[layer])
        return hook

    handles = []
    for layer in tiny.layers:
        attention = tiny.attention_of(model, layer)
        handles += [attention.register_forward_pre_hook(read(layer), with_kwargs=True),
                    attention.register_forward_hook(write(layer))]
    try:
        with torch.no_grad():
            model(**{n: torch.from_numpy(a) for n, a in inputs.items()}, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _model(name):
    rng, seed = fresh_rng()
    config, model, inputs = FAMILIES[name].make(rng)
    return config, model, _capture(FAMILIES[name], model, inputs), seed


def _convert(config, model, tiny, layer, **changes):
    kind, i = layer
    variant, ours, params = golden.convert.from_hf(
        config.to_dict(), state_dict(tiny.attention_of(model, layer)), layer_idx=i, kind=kind,
        rope_precision="hf")
    return variant, {**ours, **changes}, params


def _ours(twin, variant, ours, params, x, context, mask):
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        if ours.get("merged_context"):  # T5Gemma 2's decoder: the context and its mask
            return twin.numpy(module(twin.array(x), context=twin.array(context),
                                     context_mask=twin.array(mask)))
        if context is None or variant == "grouped_query_attention":  # merged undone: x alone
            own = None if mask is None or context is not None else twin.array(mask)
            return twin.numpy(module(twin.array(x), own))
        return twin.numpy(module(twin.array(x), twin.array(context),
                                 None if mask is None else twin.array(mask)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layers_equal_the_models_own_attention(name, twin):
    tiny = FAMILIES[name]
    config, model, seen, seed = _model(name)
    for layer in tiny.layers:
        x, expected, context, mask, _ = seen[layer]
        variant, ours, params = _convert(config, model, tiny, layer)
        assert variant == ("multi_head_cross_attention" if layer[0] == "cross"
                           else "grouped_query_attention")
        merged = bool(ours.get("merged_context"))
        assert (context is not None) == (layer[0] == "cross" or merged)  # context captured
        assert merged == (name == "t5gemma2" and layer[0] == "decoder")
        error = rel(_ours(twin, variant, ours, params, x, context, mask), expected)
        assert error <= tiny.bounds[layer[0]], (name, layer, error, seed)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_distinctive_setting_moves_the_output_far_more_than_the_agreement(name):
    tiny = FAMILIES[name]
    config, model, seen, seed = _model(name)
    for layer, change in DISTINCT[name]:
        x, expected, context, mask, _ = seen[layer]
        variant, ours, params = _convert(config, model, tiny, layer, **change)
        if change.get("qk_norm", "rms") is None:
            params = {n: a for n, a in params.items() if n not in ("q_norm", "k_norm")}
        out = _ours(TWINS["torch"], variant, ours, params, x, context, mask)
        assert rel(out, expected) > 1e3 * FLOAT32_LEVEL, (layer, change, seed)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradients_through_the_torch_twin_equal_hfs(name):
    """dL/dx, dL/dcontext and (Mllama) dL/dq_norm, dL/dk_norm of L = Σ out ⊙ dO: HF's module
    called again with the captured arguments against our torch twin."""
    tiny = FAMILIES[name]
    config, model, seen, seed = _model(name)
    rng = np.random.default_rng(seed)
    for layer in tiny.layers:
        x, expected, context, mask, (args, kwargs) = seen[layer]
        d_out = torch.from_numpy(rng.standard_normal(expected.shape))
        attention = tiny.attention_of(model, layer)
        attention.zero_grad()
        hx = torch.from_numpy(x).requires_grad_()
        kw = {**kwargs, "hidden_states": hx} if "hidden_states" in kwargs else dict(kwargs)
        args = args if "hidden_states" in kwargs else (hx, *args[1:])
        hc = None
        if context is not None:
            hc = torch.from_numpy(context).requires_grad_()
            kw.update({n: hc for n in CONTEXT if kw.get(n) is not None})
        (attention(*args, **kw)[0] * d_out).sum().backward()
        variant, ours, params = _convert(config, model, tiny, layer)
        module = TWINS["torch"].build(variant, ours, params).eval()
        ox = torch.from_numpy(x).requires_grad_()
        inputs = [ox] if mask is None or context is not None else [ox, torch.from_numpy(mask)]
        if context is not None:
            oc = torch.from_numpy(context).requires_grad_()
            inputs += [oc, None if mask is None else torch.from_numpy(mask)]
        if ours.get("merged_context"):
            module(ox, context=oc, context_mask=torch.from_numpy(mask)).mul(
                d_out).sum().backward()
        else:
            (module(*inputs) * d_out).sum().backward()
        # HF's float32 steps enter twice (its forward and backward): measured ≤ 2e-7
        bound = 10 * tiny.bounds[layer[0]]
        pairs = [(ox.grad, hx.grad)] + ([(oc.grad, hc.grad)] if context is not None else [])
        if ours.get("qk_norm") in ("rms", "rms_one_plus"):
            pairs += [(module.q_norm.grad, attention.q_norm.weight.grad),
                      (module.k_norm.grad, attention.k_norm.weight.grad)]
        for ours_g, hf_g in pairs:
            assert rel(ours_g.numpy(), hf_g.numpy()) <= bound, (name, layer, seed)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_round_trip_gives_back_the_same_arrays(name):
    tiny = FAMILIES[name]
    config, model, _, _ = _model(name)
    for layer in tiny.layers:
        sd = state_dict(tiny.attention_of(model, layer))
        variant, ours, params = golden.convert.from_hf(config.to_dict(), sd, layer_idx=layer[1],
                                                       kind=layer[0])
        back = golden.convert.to_hf(variant, ours, params)
        assert set(back) == set(sd)
        for n, a in sd.items():
            np.testing.assert_array_equal(back[n], a)


def test_other_kinds_and_models_are_refused_by_name():
    rng, _ = fresh_rng()
    config, model, _ = _mllama(rng)
    sd = state_dict(model.layers[1].cross_attn)
    with pytest.raises(ValueError, match=r"model_type 'mllama_text_model': layer 1 is a "
                                         r"cross-attention layer \(cross_attention_layers = "
                                         r"\[1\]\): kind should be 'cross', got 'decoder'"):
        golden.convert.from_hf(config.to_dict(), sd, layer_idx=1, kind="decoder")
    with pytest.raises(ValueError, match=r"layer 0 is a self-attention layer"):
        golden.convert.from_hf(config.to_dict(), sd, layer_idx=0, kind="cross")
    with pytest.raises(ValueError, match=r"model_type 'mllama_vision_model' is not supported: "
                                         r"Mllama's vision tower"):
        golden.convert.from_hf({"model_type": "mllama_vision_model"}, {})
    with pytest.raises(ValueError, match=r"model_type 'blt_local_decoder' is not supported: "
                                         r"BLT's cross-attention \(BltCrossAttention\) is not"):
        golden.convert.from_hf({"model_type": "blt_local_decoder"}, {}, kind="cross")
    c = config.to_dict()
    c["dropout"] = 0.1
    with pytest.raises(ValueError, match=r"dropout = 0.1 is not supported for the "
                                         r"cross-attention"):
        golden.convert.from_hf(c, sd, layer_idx=1, kind="cross")


@pytest.mark.parametrize("framework", list(TWINS))
def test_t5gemma2_decoding_equals_hfs_cached_decoding(framework):
    """T5Gemma 2's decoder layers decoded with HF's EncoderDecoderCache (a prefill of 3 tokens,
    then one at a time, each layer's input and output captured) against ours with a
    MergedCache (the context given at the prefill only), over a padded encoder row."""
    rng, seed = fresh_rng()
    config, model, inputs = _t5gemma2(rng)
    tiny, twin = FAMILIES["t5gemma2"], TWINS[framework]
    layers = [("decoder", 0), ("decoder", 1)]
    calls = {layer: [] for layer in layers}

    def hook(layer):
        def record(module, args, kwargs, output):
            calls[layer].append((kwargs["hidden_states"].numpy().copy(), output[0].numpy().copy(),
                                 kwargs["encoder_hidden_states"].numpy().copy()))
        return record

    handles = [tiny.attention_of(model, layer).register_forward_hook(hook(layer), with_kwargs=True)
               for layer in layers]
    tokens = {n: torch.from_numpy(inputs[n]) for n in ("input_ids", "attention_mask")}
    decoder_ids, past = torch.from_numpy(inputs["decoder_input_ids"]), None
    try:
        with torch.no_grad():
            for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, L)]:
                past = model(**tokens, decoder_input_ids=decoder_ids[:, start:stop],
                             past_key_values=past, use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
    real = inputs["attention_mask"].astype(bool)
    for layer in layers:
        variant, ours, params = _convert(config, model, tiny, layer)
        with twin.float64():
            module = twin.build(variant, ours, params)
            cache, got = module.init_cache(B, L + 1), []
            for step, (x, _, context) in enumerate(calls[layer]):
                given = (dict(context=twin.array(context), context_mask=twin.array(real))
                         if step == 0 else {})
                out, cache = module(twin.array(x), cache=cache, **given)
                got.append(twin.numpy(out))
        want = np.concatenate([y for _, y, _ in calls[layer]], axis=1)
        error = rel(np.concatenate(got, axis=1), want)
        assert error <= tiny.bounds["decoder"], (layer, error, seed)


def test_t5gemma2_vision_tower_is_siglips():
    """T5Gemma 2's vision tower (encoder.vision_tower) converted as ``siglip_vision_model``
    from its own sub-config (encoder.vision_config): its attention's output on random states."""
    rng, seed = fresh_rng()
    config, model, _ = _t5gemma2(rng)
    vision = config.to_dict()["encoder"]["vision_config"]
    assert vision["model_type"] == "siglip_vision_model"
    attention = model.encoder.vision_tower.encoder.layers[0].self_attn
    x = rng.standard_normal((B, 4, vision["hidden_size"]))
    with torch.no_grad():
        expected = attention(torch.from_numpy(x))[0].numpy()
    variant, ours, params = golden.convert.from_hf(vision, state_dict(attention), layer_idx=0)
    for twin in TWINS.values():
        error = rel(_ours(twin, variant, ours, params, x, None, None), expected)
        assert error <= FLOAT32_LEVEL, (twin.name, error, seed)
