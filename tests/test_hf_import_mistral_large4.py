"""Mistral Large 4's text attention (golden.hf.latent, model_type ``mistral_large4_text``)
against transformers' own MistralLarge4TextAttention at float64: latent attention without a q
LoRA, a learned query temperature, the lightning indexer reading LayerNorm(x) with a learned
temperature of its own, and RoPE whose frequencies the model scales by learned e^α (its
rotary embedding's ``alpha`` buffer, beside the layers: from_hf reads it from the layer's state
dict as ``rotary_emb.alpha``). Forward through both twins, prefill then decode through our
cache, the round trip, α and the indexer each moving the output when undone, its NoPE, shared
and KV-sharing layers refused by name.

HF's float32 steps (the FLOAT32_LEVEL bound): its RoPE's frequencies, angles, cos and sin
(inv_freq·e^α in float32), ln(p + 1) of both temperatures, MistralLarge4RMSNorm's upcast, the
indexer's scores (q.float(), k.float()). 16 indexer heads, as tests/test_hf_import.py's
INDEXER_44 (no exact ties at the k-th place); index_topk 4 of L = 9.
"""

from __future__ import annotations

import numpy as np
import pytest

import golden.convert
from golden.hf.latent import ROPE_ALPHA
from tests.hf_harness import (B, BASE, FLOAT32_LEVEL, L, Family, attention_of, build_model,
                              captured, rel, shared_indexer_case, state_dict)
from tests.helpers import fresh_rng

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The model_type tested here (docs/hf.md's table reads it).
FAMILIES = {"mistral_large4_text": Family("MistralLarge4TextConfig", dict(
    num_hidden_layers=1, num_key_value_heads=4, kv_lora_rank=6, qk_nope_head_dim=3,
    qk_rope_head_dim=4, v_head_dim=5, index_topk=4, index_n_heads=16, index_head_dim=6,
    n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
    float32="MistralLarge4RMSNorm, RoPE's e^α, ln(p + 1), the indexer's scores")}
FAMILY = FAMILIES["mistral_large4_text"]


def _model(rng):
    """The tiny model (float64, parameters drawn) with α drawn N(0, 0.3²): learned scales."""
    config, model = build_model(FAMILY, rng)
    with torch.no_grad():
        alpha = model.rotary_emb.alpha
        alpha.copy_(torch.from_numpy(0.3 * rng.standard_normal(tuple(alpha.shape))))
    return config, model


def _sd(model):
    """Layer 0's attention state dict with the model's α put in (from_hf's input)."""
    sd = state_dict(attention_of(FAMILY, model, 0))
    sd[ROPE_ALPHA] = model.rotary_emb.alpha.detach().numpy().copy()
    return sd


def _run(twin, variant, ours, params, x, steps=None):
    """The twin's float64 output on x (B, L, D): one call, or ``steps`` (start, stop) calls
    through the module's cache."""
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        if steps is None:
            return twin.numpy(module(twin.array(x)))
        cache, outs = module.init_cache(x.shape[0], x.shape[1]), []
        for start, stop in steps:
            out, cache = module(twin.array(x[:, start:stop]), cache=cache)
            outs.append(twin.numpy(out))
        return np.concatenate(outs, axis=1)


def _case(rng):
    config, model = _model(rng)
    x, expected = captured(FAMILY, model, (0,), rng.integers(0, BASE["vocab_size"], (B, L)))[0]
    return config, model, x, expected


def test_layer_equals_hfs_attention(twin):
    rng, seed = fresh_rng()
    config, model, x, expected = _case(rng)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), _sd(model))
    assert len(ours["rope_parameters"]["frequency_log_scale"]) == 2  # α read
    assert rel(_run(twin, variant, ours, params, x), expected) <= FLOAT32_LEVEL, seed


def test_input_gradient_through_the_twins_equals_hfs(twin):
    # dL/dx of Σ out ⊙ dO: HF's attention called again as the model called it (its masks,
    # position embeddings and ids), against our module's (the indexer's choice held, no
    # gradient through it in either).
    rng, seed = fresh_rng()
    config, model = _model(rng)
    calls = {}
    seen = captured(FAMILY, model, (0,), rng.integers(0, BASE["vocab_size"], (B, L)),
                    calls=calls, use_cache=False)
    x, expected = seen[0]
    d_out = rng.standard_normal(expected.shape)
    hf = attention_of(FAMILY, model, 0)
    args, kwargs = calls[0]
    xt = torch.from_numpy(x.copy()).requires_grad_()
    kwargs = dict(kwargs, hidden_states=xt) if "hidden_states" in kwargs else kwargs
    args = args if "hidden_states" in kwargs else (xt,) + tuple(args[1:])
    (hf(*args, **kwargs)[0] * torch.from_numpy(d_out)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(), _sd(model))
    grad = _input_grad(twin, variant, ours, params, x, d_out)
    assert rel(grad, xt.grad.numpy()) <= FLOAT32_LEVEL, seed


def _input_grad(twin, variant, ours, params, x, d_out):
    """dL/dx of Σ module(x) ⊙ d_out at float64: torch's autograd, JAX's vjp."""
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        if twin.name == "torch":
            xt = torch.from_numpy(x.copy()).requires_grad_()
            (module(xt) * torch.from_numpy(d_out)).sum().backward()
            return xt.grad.numpy()
        import jax
        _, pull = jax.vjp(lambda a: module(a), twin.array(x))
        return twin.numpy(pull(twin.array(d_out))[0])


def test_prefill_then_decode_through_our_cache_equals_hfs_forward(twin):
    rng, seed = fresh_rng()
    config, model, x, expected = _case(rng)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), _sd(model))
    steps = [(0, 4)] + [(t, t + 1) for t in range(4, L)]
    assert rel(_run(twin, variant, ours, params, x, steps), expected) <= FLOAT32_LEVEL, seed


@pytest.mark.parametrize("change", [
    pytest.param("alpha", id="alpha-dropped"),
    pytest.param({n: None for n in ("index_topk", "index_heads", "index_head_dim", "index_rope",
                                    "index_rope_dims", "index_query", "index_temperature",
                                    "index_scale", "index_norm_eps")}, id="no-indexer"),
    pytest.param({"query_temperature": None}, id="no-temperature")])
def test_each_setting_undone_moves_the_output_far(change, twin):
    rng, seed = fresh_rng()
    config, model, x, expected = _case(rng)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), _sd(model))
    if change == "alpha":
        ours = dict(ours, rope_parameters={k: v for k, v in ours["rope_parameters"].items()
                                           if k != "frequency_log_scale"})
    else:
        ours = {n: v for n, v in {**ours, **change}.items() if v is not None}
        from golden.specification import variants
        shapes = variants.get(variant).param_shapes(ours)
        params = {n: a for n, a in params.items() if n in shapes}
    assert rel(_run(twin, variant, ours, params, x), expected) > 1e3 * FLOAT32_LEVEL, seed


def test_round_trip_gives_back_the_same_arrays():
    rng, _ = fresh_rng()
    _, model = _model(rng)
    sd = _sd(model)
    config = model.config.to_dict()
    back = golden.convert.to_hf(*golden.convert.from_hf(config, sd))
    assert set(back) == set(sd)
    for key, a in sd.items():
        np.testing.assert_array_equal(back[key], a, err_msg=key)
        assert not np.shares_memory(back[key], a)
    sd[ROPE_ALPHA] = np.zeros_like(sd[ROPE_ALPHA])  # α 0: no scale in our settings, 0 back
    variant, ours, params = golden.convert.from_hf(config, sd)
    assert "frequency_log_scale" not in ours.get("rope_parameters", {})
    np.testing.assert_array_equal(golden.convert.to_hf(variant, ours, params)[ROPE_ALPHA], 0.0)


@pytest.mark.parametrize("change, match", [
    (dict(no_rope_layers=[0]), r"layer 0 is a NoPE layer"),
    (dict(indexer_types=["partial"]), r"indexer_types\[0\] should be 'full' or 'shared', "
                                      r"got 'partial'"),
    (dict(num_hidden_layers=2, kv_source_layers=[0, 0], no_rope_layers=[1, 1],
          indexer_types=["full", "full"]), r"layer 1 attends layer 0's latent cache")])
def test_refused_layers_are_named(change, match):
    rng, _ = fresh_rng()
    _, model = _model(rng)
    config = {**model.config.to_dict(), **change}
    layer = config["num_hidden_layers"] - 1
    with pytest.raises(ValueError, match=r"model_type 'mistral_large4_text': " + match):
        golden.convert.from_hf(config, _sd(model), layer_idx=layer)


def test_without_alpha_it_says_where_to_find_it():
    rng, _ = fresh_rng()
    _, model = _model(rng)
    sd = state_dict(attention_of(FAMILY, model, 0))
    with pytest.raises(ValueError, match=r"the state dict has no 'rotary_emb.alpha'"):
        golden.convert.from_hf(model.config.to_dict(), sd)


@pytest.mark.parametrize("layers", [1, 2], ids=["rope", "rope-then-nope"])
def test_attn_parity_hf_checks_a_saved_text_model(tmp_path, layers):
    # A save_pretrained MistralLarge4TextModel (float32, weights N(0, 1/fan_in), α drawn): the
    # checkpoint's model.rotary_emb.alpha is read beside the layer; every row passes. With a
    # NoPE layer after it (no_rope_layers [1, 0]) that layer is named in the notes, not
    # checked, and the RoPE layer still is.
    from golden.cli import main
    rng = np.random.default_rng(0)
    kw = dict(FAMILY.kw, num_hidden_layers=layers, no_rope_layers=[1, 0][:layers])
    config = transformers.MistralLarge4TextConfig(**{**BASE, **kw})
    model = transformers.MistralLarge4TextModel(config)
    with torch.no_grad():
        for p in model.parameters():
            scale = 1 / np.sqrt(p.shape[-1]) if p.dim() == 2 else 0.5
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)
                                     * scale))
        model.rotary_emb.alpha.copy_(torch.from_numpy(
            0.3 * rng.standard_normal(tuple(model.rotary_emb.alpha.shape)).astype(np.float32)))
    model.save_pretrained(tmp_path / "ckpt")
    report = tmp_path / "report.json"
    assert main(["hf", str(tmp_path / "ckpt"), "--json", str(report)]) == 0
    import json
    rows = json.loads(report.read_text())["rows"]
    assert {r["implementation"] for r in rows} == {"torch", "jax", "hf"}
    # every row passes but HF's float64 one, which HF's float32 RoPE makes a float32 row
    others = [r for r in rows if r["status"] != "pass"]
    assert [(r["implementation"], r["dtype"], r["status"]) for r in others] == [
        ("hf", "float64", "not supported")], others
    notes = json.loads(report.read_text())["checkpoint"]["notes"]
    assert {r["fixture"] for r in rows} == {"layer 0 (indexed_attention)"}
    assert any(n.startswith("layer 1 (indexed_attention): not checked: model_type "
                            "'mistral_large4_text': layer 1 is a NoPE layer")
               for n in notes) == (layers == 2), notes


def test_a_shared_indexer_layer_takes_the_previous_layers_choice(twin):
    # indexer_types ["full", "shared"]: layer 1 reuses layer 0's choice (HF's
    # prev_topk_indices); converted as index_select "given" (no indexer arrays read, its
    # temperature kept), given that choice, both twins equal HF's layer 1 at its float32 floor.
    rng, seed = fresh_rng()
    variant, ours, params, x, expected, chosen = shared_indexer_case(FAMILY, rng, lambda model: {
        ROPE_ALPHA: model.rotary_emb.alpha.detach().numpy().copy()})
    with twin.float64():
        out = twin.numpy(twin.build(variant, ours, params)(twin.array(x),
                                                           key_indices=twin.array(chosen)))
    assert rel(out, expected) <= FLOAT32_LEVEL, seed
