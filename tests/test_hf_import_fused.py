"""golden.convert.from_hf and to_hf (issue 25) for the families with a fused q/k/v projection
(Phi-3, GPT-NeoX, Falcon, BLOOM, MPT, GPT-2's Conv1D) and StableLM's per-head LayerNorms, on
tiny float64 models built as in tests/test_hf_import.py (tests/hf_harness.py): each attention
layer's input and output captured from the model's own forward, our twins built from the
converted state dict must give that output; the round trip is exact and unaliased; each
family's distinctive setting moves the output far more than the bound; settings we cannot
express are named.

What "the attention module's output" is: what the module returns, except for BLOOM, whose
BloomAttention adds the residual inside its forward (``dropout_add(dense(...), residual)``):
there it is the output of its ``dense`` projection, before the residual is added, captured
with a hook on ``dense``.

Sizes: these families' head width is D / N whatever ``head_dim`` says, so the tiny models
have D = 24, N = 4, Dh = 6 (L = 9, B = 2: every size distinct but Dh and the harness's DH).

Where the agreement is bounded (beyond RoPE's float32 angles, which rope_precision="hf"
reproduces in torch): BLOOM and MPT have only an eager attention, with the softmax in float32;
GPT-2's reorder_and_upcast_attn takes the logits and softmax in float32. Falcon's ALiBi in
sdpa is float64 throughout (its bfloat16 slopes are ours exactly): EXACT in both twins.

Shape legend: B batch, L tokens, D model width, N heads, Nkv key-value heads, Dh head width.
"""

from __future__ import annotations

import numpy as np
import pytest

import golden.convert
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests.hf_harness import (  # noqa: E402
    BASE,
    EXACT,
    FLOAT32_LEVEL,
    B,
    Family,
    L,
    attention_of,
    rel,
    state_dict,
)

D = 24  # N = 4 heads of Dh = 6
LONGROPE = {"rope_type": "longrope", "rope_theta": 300.0, "partial_rotary_factor": 0.67,
            "short_factor": [1.0, 1.5], "long_factor": [2.0, 5.0]}  # rd = int(6 · 0.67) = 4


def _h(attr):
    return lambda model, i: getattr(model.h[i], attr)


FAMILIES = {
    "phi3": Family("Phi3Config", dict(num_hidden_layers=1, hidden_size=D, sliding_window=4,
                                      num_key_value_heads=2,
                                      pad_token_id=0, original_max_position_embeddings=4,
                                      rope_parameters=LONGROPE)),  # L = 9 > 4: long_factor
    "stablelm": Family("StableLmConfig", dict(num_hidden_layers=1, hidden_size=D,
                                              num_key_value_heads=2, qk_layernorm=True,
                                              use_qkv_bias=True, layer_norm_eps=1e-3,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 200.0,
                                                               "partial_rotary_factor": 0.67})),
    "gpt_neox": Family("GPTNeoXConfig", dict(num_hidden_layers=1, hidden_size=D,
                                             attention_bias=True,
                                             rope_parameters={"rope_type": "default",
                                                              "rope_theta": 200.0,
                                                              "partial_rotary_factor": 0.67}),
                       attention_of=lambda model, i: model.layers[i].attention),
    "falcon": Family("FalconConfig", dict(num_hidden_layers=1, hidden_size=D, bias=True,
                                          new_decoder_architecture=True, num_kv_heads=2,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 200.0}),
                     attention_of=_h("self_attention")),
    "bloom": Family("BloomConfig", dict(n_layer=1, hidden_size=D), attention_of=_h(
        "self_attention"), attention="eager", float32="BloomAttention's softmax (its only path)"),
    "mpt": Family("MptConfig", dict(n_layers=1, hidden_size=D, max_seq_len=16,
                                    attn_config={"clip_qkv": 1.5, "softmax_scale": 0.3}),
                  attention_of=lambda model, i: model.blocks[i].attn, attention="eager",
                  float32="MptAttention's softmax (eager only)"),
    "gpt2": Family("GPT2Config", dict(n_layer=2, hidden_size=D,
                                      scale_attn_by_inverse_layer_idx=True),
                   layers=(0, 1), attention_of=_h("attn")),
}
# More settings of the same model types: Falcon's other two layouts, GPT-2's float32 path.
MORE = {
    "falcon_multi_query_alibi": Family("FalconConfig", dict(
        num_hidden_layers=1, hidden_size=D, bias=True, multi_query=True, alibi=True,
        new_decoder_architecture=False), attention_of=_h("self_attention")),
    "falcon_multi_head": Family("FalconConfig", dict(
        num_hidden_layers=1, hidden_size=D, bias=False, multi_query=False,
        new_decoder_architecture=False, num_kv_heads=4), attention_of=_h("self_attention")),
    "gpt2_reorder_and_upcast": Family("GPT2Config", dict(n_layer=1, hidden_size=D,
                                                         reorder_and_upcast_attn=True),
                                      attention_of=_h("attn"), attention="eager",
                                      float32="the whole model (see FLOAT32_MODELS)"),
}
# Models run in float32, their weights and inputs (float32 numbers) given to ours in float64:
# GPT-2's reorder_and_upcast_attn adds the float64 mask to its float32 logits and then raises
# "Error with upcasting" in a float64 model; it is the same attention, with float32 logits.
FLOAT32_MODELS = {"gpt2_reorder_and_upcast": MORE["gpt2_reorder_and_upcast"]}
CASES = {**FAMILIES, **MORE}
# Where the output is not what the module returns: the submodule whose output it is.
OUTPUT_OF = {"bloom": lambda attention: attention.dense}

# The family's distinctive settings, each undone on one layer: (layer, our settings changed).
DISTINCT = {
    "phi3": [(0, {"sliding_window": None}),
             (0, {"rope_parameters": {"rope_type": "default", "rope_theta": 300.0}})],
    "stablelm": [(0, {"qk_norm": None}), (0, {"partial_rotary_factor": 1.0})],
    "gpt_neox": [(0, {"partial_rotary_factor": 1.0})],
    "falcon": [(0, {"rope_parameters": {"rope_theta": 10000.0}})],
    "falcon_multi_query_alibi": [(0, {"alibi": "bloom"})],
    "bloom": [(0, {"alibi": None})],
    "mpt": [(0, {"clip_qkv": None}), (0, {"alibi": None}), (0, {"scale": None})],
    "gpt2": [(1, {"scale": None})],
}


def build_model(family, rng):
    """tests.hf_harness.build_model without BASE's head_dim (a property of some of these
    configs, and unused by all: Dh = D / N)."""
    base = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")}
    config = getattr(transformers, family.config)(**{**base, **family.kw})
    config._attn_implementation = family.attention
    model = transformers.AutoModel.from_config(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
    return config, (model.float() if family in FLOAT32_MODELS.values() else model)


def captured(name, model, layers, ids):
    """Each layer's attention input (B, L, D) and output (OUTPUT_OF's where it names one),
    from one forward of the model on token ids ``ids``."""
    family, seen, handles = CASES[name], {}, []

    def record(i, part):
        def hook(module, args, kwargs, output):
            if part == "input":
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                seen.setdefault(i, {})["x"] = x.detach().numpy().copy()
            else:
                y = output if isinstance(output, torch.Tensor) else output[0]
                seen.setdefault(i, {})["y"] = y.detach().numpy().copy()
        return hook

    for i in layers:
        attention = attention_of(family, model, i)
        out = OUTPUT_OF[name](attention) if name in OUTPUT_OF else attention
        handles.append(attention.register_forward_hook(record(i, "input"), with_kwargs=True))
        handles.append(out.register_forward_hook(record(i, "output"), with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids))
    finally:
        for h in handles:
            h.remove()
    return {i: (s["x"], s["y"]) for i, s in seen.items()}


def _setup(name):
    rng, seed = fresh_rng()
    config, model = build_model(CASES[name], rng)
    return rng, seed, config, model


@pytest.mark.parametrize("name", list(CASES))
def test_layers_equal_the_models_own_attention(name, twin):
    family = CASES[name]
    rng, seed, config, model = _setup(name)
    seen = captured(name, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    for i in family.layers:
        sd = {n: a.astype(np.float64) for n, a in state_dict(attention_of(family, model, i))
              .items()}
        x, expected = seen[i][0].astype(np.float64), seen[i][1]
        for precision in ("exact", "hf"):
            variant, ours, params = golden.convert.from_hf(config.to_dict(), sd, layer_idx=i)
            roped = "rope_parameters" in ours or "rope_theta" in ours
            ours = dict(ours, rope_precision=precision) if roped else dict(ours)
            with twin.float64():
                module = twin.build(variant, ours, params)
                module.eval()
                out = twin.numpy(module(twin.array(x)))
            error = rel(out, expected)
            exact = precision == "hf" and family.float32 is None and (
                twin.name == "torch" or not roped)
            bound = EXACT if exact else FLOAT32_LEVEL
            assert error <= bound, (name, i, precision, error, seed)


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_gives_back_the_same_arrays(name):
    _, _, config, model = _setup(name)
    for i in CASES[name].layers:
        sd = state_dict(attention_of(CASES[name], model, i))
        result = golden.convert.from_hf(config, sd, layer_idx=i)
        back = golden.convert.to_hf(*result)
        assert set(back) == set(sd), name
        for key, a in sd.items():
            np.testing.assert_array_equal(back[key], a, err_msg=f"{name} {key}")
            assert back[key].dtype == a.dtype and not np.shares_memory(back[key], a)


@pytest.mark.parametrize("name", list(DISTINCT))
def test_each_distinctive_setting_moves_the_output_far_more_than_the_agreement(name):
    """Undoing one of the family's settings changes the layer's output by more than 10³ times
    the bound we hold HF's output to, so the agreement above is not blind to it."""
    from golden import variants
    twin = TWINS["torch"]
    rng, seed, config, model = _setup(name)
    layers = {layer for layer, _ in DISTINCT[name]}
    seen = captured(name, model, layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    for layer, change in DISTINCT[name]:
        sd = state_dict(attention_of(CASES[name], model, layer))
        x, expected = seen[layer]
        variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=layer)
        changed = {n: v for n, v in {**ours, **change}.items() if v is not None}
        rope = ours.get("rope_parameters", {})
        if "rope_parameters" in change and "partial_rotary_factor" in rope:
            changed["rope_parameters"] = dict(change["rope_parameters"],
                                              partial_rotary_factor=rope["partial_rotary_factor"])
        if "partial_rotary_factor" in change:
            changed["rope_parameters"] = {k: v for k, v in rope.items()
                                          if k != "partial_rotary_factor"}
        assert changed != dict(ours), (name, change)
        shapes = variants.VARIANTS[variant].shapes(variants.VARIANTS[variant].config(changed))
        with twin.float64():
            module = twin.build(variant, changed, {n: a for n, a in params.items()
                                                   if n in shapes})
            module.eval()
            out = twin.numpy(module(twin.array(x)))
        assert rel(out, expected) > 1e3 * FLOAT32_LEVEL, (name, layer, change, seed)


def _mpt_config(**attn):
    return transformers.MptConfig(d_model=D, n_heads=4, n_layers=1,
                                  attn_config=attn).to_dict()


@pytest.mark.parametrize("attn, message", [
    ({"qk_ln": True}, r"model_type 'mpt': attn_config\['qk_ln'\] = True is not supported"),
    ({"attn_type": "multiquery_attention"}, r"attn_config\['attn_type'\] = "
                                            r"'multiquery_attention' is not supported"),
    ({"prefix_lm": True}, r"attn_config\['prefix_lm'\] = True is not supported"),
    ({"alibi": False}, r"attn_config\['alibi'\] = False is not supported"),
    ({"alibi_bias_max": 6}, r"model_type 'mpt': attn_config\['alibi_bias_max'\] = 6 is not "
                            r"supported \(transformers' MptModel builds its ALiBi with 8"),
])
def test_settings_we_cannot_express_are_named(attn, message):
    with pytest.raises(ValueError, match=message):
        golden.convert.from_hf(_mpt_config(**attn), {})


def test_a_fused_weight_of_the_wrong_width_is_named():
    rng, _, config, model = _setup("falcon")
    sd = state_dict(attention_of(FAMILIES["falcon"], model, 0))
    sd["query_key_value.weight"] = sd["query_key_value.weight"][:-6]  # one head short
    with pytest.raises(ValueError, match=r"model_type 'falcon': query_key_value.weight should "
                                         r"have 48 outputs \(\(N \+ 2·Nkv\)·Dh from the "
                                         r"config\), got shape \(42, 24\)"):
        golden.convert.from_hf(config, sd)
    sd = state_dict(attention_of(FAMILIES["falcon"], model, 0))
    del sd["dense.weight"]
    with pytest.raises(ValueError, match=r"model_type 'falcon': the state dict has no "
                                         r"'dense.weight'"):
        golden.convert.from_hf(config, sd)


def test_stablelm_norms_are_stacked_per_head():
    _, _, config, model = _setup("stablelm")
    attention = model.layers[0].self_attn
    _, ours, params = golden.convert.from_hf(config, state_dict(attention))
    assert ours["qk_norm"] == "layer" and params["q_norm"].shape == (4, 6)
    assert params["k_norm"].shape == (config.num_key_value_heads, 6)
    np.testing.assert_array_equal(params["q_norm"][2],
                                  attention.q_layernorm.norms[2].weight.detach().numpy())


@pytest.mark.parametrize("name", ["gpt_neox", "falcon_multi_query_alibi"])
def test_prefill_then_decode_with_our_cache_equals_the_models_forward(name, twin):
    """A prompt of 4 tokens, then one token at a time through our module's KV cache (with
    room to spare): every step equals the captured full forward of the HF model, at the bound
    the full forward is held to (partial RoPE; Falcon's multi-query ALiBi, exact in both)."""
    family = CASES[name]
    rng, seed, config, model = _setup(name)
    x, expected = captured(name, model, (0,), rng.integers(0, BASE["vocab_size"], (B, L)))[0]
    variant, ours, params = golden.convert.from_hf(config, state_dict(
        attention_of(family, model, 0)))
    roped = "rope_parameters" in ours
    ours = dict(ours, rope_precision="hf") if roped else dict(ours)
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        cache = module.init_cache(B, L + 3)
        steps = []
        for start, stop in [(0, 4)] + [(i, i + 1) for i in range(4, L)]:
            out, cache = module(twin.array(x[:, start:stop]), cache=cache)
            steps.append(twin.numpy(out))
    assert twin.numpy(cache.lengths).tolist() == [L] * B
    bound = EXACT if twin.name == "torch" or not roped else FLOAT32_LEVEL
    assert rel(np.concatenate(steps, axis=1), expected) <= bound, (name, seed)


@pytest.mark.parametrize("flags", [dict(scale_attn_by_inverse_layer_idx=True),
                                   dict(scale_attn_weights=False),
                                   dict(scale_attn_weights=False,
                                        scale_attn_by_inverse_layer_idx=True)])
def test_gpt2_scale_is_the_very_float_gpt2_attention_uses(flags):
    """scale_attn_weights and scale_attn_by_inverse_layer_idx are one number, our scale."""
    from transformers.models.gpt2 import modeling_gpt2
    config = transformers.GPT2Config(n_embd=D, n_head=4, n_layer=4, **flags)
    for i in range(4):
        module = modeling_gpt2.GPT2Attention(config, layer_idx=i)
        _, ours, _ = golden.convert.from_hf(config, state_dict(module), layer_idx=i)
        assert ours["scale"] == module.scaling, (flags, i)


def test_falcon_key_value_heads_that_do_not_divide_the_heads_are_named():
    config = dict(transformers.FalconConfig(hidden_size=D, num_attention_heads=4,
                                            new_decoder_architecture=True).to_dict(),
                  num_kv_heads=3)
    with pytest.raises(ValueError, match=r"model_type 'falcon': num_kv_heads should divide "
                                         r"num_heads = 4, got 3"):
        golden.convert.from_hf(config, {"query_key_value.weight": np.zeros((60, D))})
