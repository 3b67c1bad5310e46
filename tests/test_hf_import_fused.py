"""golden.convert.from_hf and to_hf (issue 25) for the families with a fused q/k/v projection
(Phi-3, GPT-NeoX, Falcon, BLOOM, MPT, DBRX, GPT-2's Conv1D) and StableLM's per-head LayerNorms, on
tiny float64 models built as in tests/test_hf_import.py (tests/hf_harness.py): each attention
layer's input and output captured from the model's own forward, our twins built from the
converted state dict must give that output; the round trip is exact and unaliased; each
family's distinctive setting moves the output far more than the bound; settings we cannot
express are named. For every case, in both twins: prefill then token-by-token decoding with our
KV cache, and a left-padded batch, equal HF's output; the input gradient through the torch twin
equals HF's attention module's, called again as the model called it.

What "the attention module's output" is: what the module returns, except for BLOOM, whose
BloomAttention adds the residual inside its forward (``dropout_add(dense(...), residual)``):
there it is the output of its ``dense`` projection, before the residual is added, captured
with a hook on ``dense`` (the family's output_of).

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
    assert_each_undone_moves_the_output,
    attention_of,
    captured,
    draw_parameters,
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
        "self_attention"), output_of=lambda model, i: model.h[i].self_attention.dense,
        attention="eager", float32="BloomAttention's softmax (its only path)"),
    "mpt": Family("MptConfig", dict(n_layers=1, hidden_size=D, max_seq_len=16,
                                    attn_config={"clip_qkv": 1.5, "softmax_scale": 0.3}),
                  attention_of=lambda model, i: model.blocks[i].attn, attention="eager",
                  float32="MptAttention's softmax (eager only)"),
    # DBRX: grouped KV heads in its fused Wqkv, clip_qkv below the projections' reach; HF's
    # attention requires attn_config's rope_theta and reads none of it (the rotary embedding
    # takes rope_parameters')
    "dbrx": Family("DbrxConfig", dict(
        n_layers=1, d_model=D, hidden_size=D, n_heads=4,
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.9, "rope_theta": 5e5},
        ffn_config={"ffn_hidden_size": 8, "moe_num_experts": 2, "moe_top_k": 1},
        rope_parameters={"rope_type": "default", "rope_theta": 300.0}),
        attention_of=lambda model, i: model.blocks[i].norm_attn_norm.attn),
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
    "dbrx": [(0, {"clip_qkv": None}), (0, {"rope_parameters": {"rope_theta": 10000.0}})],
}


def build_model(family, rng):
    """tests.hf_harness.build_model without BASE's head_dim (a property of some of these
    configs, and unused by all: Dh = D / N)."""
    base = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")}
    config = getattr(transformers, family.config)(**{**base, **family.kw})
    config._attn_implementation = family.attention
    model = transformers.AutoModel.from_config(config).double().eval()
    draw_parameters(model, rng)
    return config, (model.float() if family in FLOAT32_MODELS.values() else model)


def _setup(name):
    rng, seed = fresh_rng()
    config, model = build_model(CASES[name], rng)
    return rng, seed, config, model


@pytest.mark.parametrize("name", list(CASES))
def test_layers_equal_the_models_own_attention(name, twin):
    family = CASES[name]
    rng, seed, config, model = _setup(name)
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)))
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
    rng, seed, config, model = _setup(name)
    assert_each_undone_moves_the_output(CASES[name], config, model, DISTINCT[name], rng,
                                        (name, seed))


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


def _ours(config, sd, layer_idx=0):
    """from_hf with HF's float32 angles where the layer has RoPE (the twins' bound below)."""
    variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=layer_idx)
    roped = "rope_parameters" in ours or "rope_theta" in ours
    return variant, (dict(ours, rope_precision="hf") if roped else dict(ours)), params, roped


# The input gradient where HF's float32 step is its softmax (BLOOM, MPT) or the whole model
# (GPT-2's reorder_and_upcast_attn): the backward is float32 there too (the cotangent rounded
# to float32, the softmax's gradient P ⊙ (dP − Σ P ⊙ dP) with its cancellation), a few times
# the forward's error: measured up to 1.5e-6 relative in 300 draws each, median 3e-7.
FLOAT32_GRADIENT = 4 * FLOAT32_LEVEL


def _bound(family, twin, roped, *, gradient=False):
    """EXACT where HF has no float32 step (torch's angles are HF's float32 ones; JAX's are
    exact), else FLOAT32_LEVEL (FLOAT32_GRADIENT for a gradient through the step named in the
    family's float32)."""
    if family.float32 is not None:
        return FLOAT32_GRADIENT if gradient else FLOAT32_LEVEL
    return EXACT if twin.name == "torch" or not roped else FLOAT32_LEVEL


PREFILL = 5  # > Phi-3's original_max_position_embeddings = 4: each call of ours, as HF's full
# forward of L = 9 tokens, takes longrope's long factors (the call's largest position + 1 > 4)


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_then_decode_with_our_cache_equals_the_models_forward(name, twin):
    """A prompt of PREFILL tokens, then one token at a time through our module's KV cache
    (with room to spare): every step equals the captured full forward of the HF model, at the
    bound the full forward is held to."""
    family = CASES[name]
    rng, seed, config, model = _setup(name)
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    for i in family.layers:
        x, expected = (a.astype(np.float64) for a in seen[i])
        variant, ours, params, roped = _ours(config, _state_dict64(family, model, i), i)
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            cache = module.init_cache(B, L + 3)
            steps = []
            for start, stop in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, L)]:
                out, cache = module(twin.array(x[:, start:stop]), cache=cache)
                steps.append(twin.numpy(out))
        assert twin.numpy(cache.lengths).tolist() == [L] * B
        error = rel(np.concatenate(steps, axis=1), expected)
        assert error <= _bound(family, twin, roped), (name, i, error, seed)


LEFT_PAD = 3  # row 1 starts with 3 padding tokens
# Cases left out of the left-padding test, each with why (docs/hf.md lists them): none. The
# ALiBi families agree although HF counts the ALiBi distance differently: BLOOM and Falcon
# build it from the attention_mask's cumsum (key j of a padded row at j − 3), MPT from the
# key index minus the key count, ours from j − i; on the keys a real row attends the three
# differ by a constant per query row, which softmax removes (Falcon's multi-query ALiBi, all
# float64, agrees to EXACT).
NOT_LEFT_PADDED: dict[str, str] = {}


@pytest.mark.parametrize("name", list(CASES))
def test_left_padded_batch_equals_the_models_own_attention(name, twin):
    """HF's model given attention_mask (0 on row 1's first 3 tokens) and position_ids counting
    the real tokens (as generate passes them); ours given the padding as mask (keys) and the
    same positions. The real tokens' rows must agree."""
    if name in NOT_LEFT_PADDED:
        pytest.skip(NOT_LEFT_PADDED[name])
    family = CASES[name]
    rng, seed, config, model = _setup(name)
    real = np.ones((B, L), np.int64)
    real[1, :LEFT_PAD] = 0
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)),
                    attention_mask=torch.from_numpy(real),
                    position_ids=torch.from_numpy(positions))
    keys = np.broadcast_to(real.astype(bool)[:, None, :], (B, L, L))  # (B, L, L)
    rows = real.astype(bool)
    for i in family.layers:
        x, expected = (a.astype(np.float64) for a in seen[i])
        variant, ours, params, roped = _ours(config, _state_dict64(family, model, i), i)
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            out = twin.numpy(module(twin.array(x), twin.array(keys.copy()), positions=(
                twin.array(positions.astype(np.int32)) if roped else None)))
        error = rel(out[rows], expected[rows])
        assert error <= _bound(family, twin, roped), (name, i, error, seed)


@pytest.mark.parametrize("name", list(CASES))
def test_input_gradient_through_the_torch_twin_equals_hfs(name):
    """dL/dx of Σ out ⊙ dO: HF's attention module called again as the model called it (its
    masks, ALiBi and position embeddings; BLOOM's residual argument is a constant), against
    our torch module's."""
    family = CASES[name]
    twin = TWINS["torch"]
    rng, seed, config, model = _setup(name)
    calls = {}
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)),
                    calls=calls, use_cache=False)  # no cache object to append to again
    for i in family.layers:
        x, expected = seen[i]
        d_out = rng.standard_normal(expected.shape).astype(expected.dtype)
        hf = attention_of(family, model, i)
        args, kwargs = calls[i]
        xt = torch.from_numpy(x.copy()).requires_grad_()
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=xt)
        else:
            args = (xt,) + tuple(args[1:])
        (hf(*args, **kwargs)[0] * torch.from_numpy(d_out)).sum().backward()
        variant, ours, params, roped = _ours(config, _state_dict64(family, model, i), i)
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            ours_x = torch.from_numpy(x.astype(np.float64)).requires_grad_()
            (module(ours_x) * torch.from_numpy(d_out.astype(np.float64))).sum().backward()
        error = rel(ours_x.grad.numpy(), xt.grad.numpy().astype(np.float64))
        assert error <= _bound(family, twin, roped, gradient=True), (name, i, error, seed)


def _state_dict64(family, model, i):
    """Layer i's attention state dict in float64 (the FLOAT32_MODELS' float32 numbers)."""
    return {n: a.astype(np.float64) for n, a in state_dict(attention_of(family, model, i))
            .items()}


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
