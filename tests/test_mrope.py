"""Multimodal RoPE (MRoPE) in the rotary embedding of both twins and the reference, against
transformers' own text rotary embeddings: Qwen2-VL's chunked sections (rotate-half), Qwen3-VL's
interleaved sections (and Qwen3-Omni's code for them), GLM-4V's chunked sections on interleaved
pairs of a partial slice (GLM-4.5V's on rotate-half pairs), ERNIE 4.5 VL's height and width pairs
alternating with the temporal ones last (``mrope_temporal_last``) on interleaved pairs.
Positions (3, B, L) as Hugging Face's ``get_rope_index`` makes them: an image span whose height
and width rows differ from the temporal one; with every axis equal, the 1-D RoPE. Then the
attention layers of the text towers (tests/hf_harness.py's TEXT_TOWERS, converted by
``golden.convert.from_hf``) given an image's positions: forward, prefill and decode with (3, B, n)
positions per call, and the input gradient, against HF's model given the same position ids; and
what each tower's HF code decides beyond its config.

What is compared, and at which level (the levels of tests/test_rope_scaling.py):
- ``precision="hf"``: HF's own float32 angles, cos and sin, recomposed per axis: the torch twin
  equal to HF's bits (the same operations on the same machine), JAX at float32's level (1e-6);
  where HF turns a float64 q in float32 (ERNIE 4.5 VL), float32's level for torch too;
- exact mode (float64) against the reference: 1e-12 (the same angles, another order);
- exact mode against HF's float64 model, whose angles are float32: 1e-6 of |x| at positions
  below 16 (HF's angle p · f in float32 errs by about p · 2⁻²⁴ radians);
- equal axes against the 1-D RoPE: bit for bit (the mixing selects each pair's axis).

Shape legend: B batch, H heads, L tokens, Dh head width, rd rotated features.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import golden.convert
import golden.hf
from golden.reference import rotary as reference_rotary
from golden.specification.positions import rope_axes
from golden.specification.validate import MROPE_FIELDS, rope_settings
from jax_attn.rotary import rotary_embedding as jax_rotary
from tests.helpers import TWINS, fresh_rng
from torch_attn.rotary import rotary_embedding as torch_rotary

transformers = pytest.importorskip("transformers")
from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe  # noqa: E402
from transformers.models.glm4v import modeling_glm4v  # noqa: E402
from transformers.models.glm4v_moe import modeling_glm4v_moe  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: E402
from tests import port_numpy  # noqa: E402
from tests.hf_harness import (  # noqa: E402
    BASE,
    TEXT_TOWERS,
    FLOAT32_LEVEL,
    Family,
    attention_of,
    build_model,
    captured,
    rel,
    state_dict,
)
from tests.hf_harness import EXACT as LAYER_EXACT  # noqa: E402
from tests.hf_harness import B as HB  # noqa: E402
from tests.hf_harness import L as HL  # noqa: E402

B, H, L, DH, THETA = 2, 3, 11, 16, 100.0
F32 = 1e-6
EXACT = 1e-12
NO_MROPE = dict.fromkeys(MROPE_FIELDS)  # the 1-D RoPE's settings: every MRoPE field removed

# name: (HF's text config class, its rotary embedding, its apply_rotary_pos_emb, our
# interleaved pairing, rope_parameters without θ)
FAMILIES = {
    "qwen2_vl": (transformers.Qwen2VLTextConfig, modeling_qwen2_vl.Qwen2VLRotaryEmbedding,
                 modeling_qwen2_vl.apply_rotary_pos_emb, False,
                 {"rope_type": "default", "mrope_section": [2, 3, 3]}),
    "qwen3_vl": (transformers.Qwen3VLTextConfig, modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding,
                 modeling_qwen3_vl.apply_rotary_pos_emb, False,
                 {"rope_type": "default", "mrope_section": [4, 2, 2],
                  "mrope_interleaved": True}),
    "glm4v": (transformers.Glm4vTextConfig, modeling_glm4v.Glm4vTextRotaryEmbedding,
              modeling_glm4v.apply_rotary_pos_emb, True,
              {"rope_type": "default", "mrope_section": [1, 2, 1],
               "partial_rotary_factor": 0.5}),
    # Qwen3-VL's layout in code of its own; HF interleaves whatever the config says.
    "qwen3_omni_moe": (transformers.Qwen3OmniMoeTextConfig,
                       modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextRotaryEmbedding,
                       modeling_qwen3_omni_moe.apply_rotary_pos_emb, False,
                       {"rope_type": "default", "mrope_section": [4, 2, 2],
                        "mrope_interleaved": True}),
    # GLM-4.5V: GLM-4V's chunked sections on the rotary half, rotate-half pairs.
    "glm4v_moe": (transformers.Glm4vMoeTextConfig, modeling_glm4v_moe.Glm4vMoeTextRotaryEmbedding,
                  modeling_glm4v_moe.apply_rotary_pos_emb, False,
                  {"rope_type": "default", "mrope_section": [1, 2, 1],
                   "partial_rotary_factor": 0.5}),
    # ERNIE 4.5 VL: height and width pairs alternating, then the temporal ones; HF's config
    # lists the section as (s_h, s_w, s_t) (HF_PARAMETERS).
    "ernie4_5_vl_moe": (transformers.Ernie4_5_VLMoeTextConfig,
                        modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeTextRotaryEmbedding,
                        modeling_ernie4_5_vl_moe.apply_rotary_pos_emb, True,
                        {"rope_type": "default", "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True, "mrope_temporal_last": True}),
}
# HF's rope_parameters where they differ from ours (a field None: not given to HF).
HF_PARAMETERS = {"ernie4_5_vl_moe": {"mrope_section": [3, 3, 2], "mrope_interleaved": None,
                                     "mrope_temporal_last": None}}
# HF's apply_rotary_pos_emb turns q and k in float32 whatever their dtype (and its cos and sin
# stay float32): a float64 q is rounded to float32 there.
ROTATES_IN_FLOAT32 = {"ernie4_5_vl_moe"}


def image_positions(batch=B, length=L, start=3, shift=1):
    """(3, B, L) int64: text 0 … start − 1, a 2 × 2 image at temporal position ``start`` (height
    start, start, start + 1, start + 1; width start, start + 1, start, start + 1), then text from
    start + 2 (HF's get_rope_index: after an image, the largest position + 1); row 1
    ``shift`` positions on (left padding)."""
    positions = np.broadcast_to(np.arange(length), (3, batch, length)).copy()
    image = slice(start, start + 4)
    positions[:, :, image] = start
    positions[1, :, image] += [0, 0, 1, 1]
    positions[2, :, image] += [0, 1, 0, 1]
    positions[:, :, start + 4:] -= 2
    positions[:, 1] += shift
    return positions


def _hf(name, q):
    """HF's rotary embedding of q (B, H, L, Dh) at image_positions(), in q's dtype."""
    config_class, embedding, apply, _, parameters = FAMILIES[name]
    parameters = _changed(parameters, HF_PARAMETERS.get(name, {}))
    config = config_class(hidden_size=H * DH, num_attention_heads=H, num_key_value_heads=H,
                          head_dim=DH, max_position_embeddings=64,
                          rope_parameters={**parameters, "rope_theta": THETA})
    cos, sin = embedding(config)(q, torch.from_numpy(image_positions()))
    return apply(q, q, cos, sin)[0]


def _ours(framework, name, q, positions=None, precision="exact", **change):
    """Our rotary embedding of q (NumPy float64/float32) in ``framework``, as float64 NumPy."""
    *_, interleaved, parameters = FAMILIES[name]
    parameters = _changed(parameters, change)
    positions = image_positions() if positions is None else positions
    kw = dict(theta=THETA, interleaved=interleaved, rope_parameters=parameters,
              precision=precision)
    if framework == "torch":
        out = torch_rotary(torch.from_numpy(q), positions=torch.from_numpy(positions), **kw)
        return out.double().numpy()
    with jax.enable_x64(q.dtype == np.float64):
        return np.asarray(jax_rotary(jnp.asarray(q), positions=jnp.asarray(positions), **kw),
                          np.float64)


def _reference(name, q, positions=None, **change):
    """The reference's rotary embedding of q at positions (3, B, L), float64."""
    *_, interleaved, parameters = FAMILIES[name]
    settings = rope_settings(THETA, _changed(parameters, change))
    positions = image_positions() if positions is None else positions
    cos, sin = reference_rotary.rope_cos_sin(settings, DH, positions[..., None, :],
                                             multi=positions.ndim == 3)  # ([3,] B, 1, L)
    return reference_rotary.turn(q.astype(np.float64), cos, sin, interleaved)


def _changed(parameters, change):
    """rope_parameters with ``change`` applied, a field changed to None removed."""
    return {k: v for k, v in {**parameters, **change}.items() if v is not None}


def _q(dtype):
    rng, seed = fresh_rng()
    return rng.standard_normal((B, H, L, DH)).astype(dtype), seed


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_precision_reproduces_hfs_own_recomposition(name, dtype):
    """The torch twin's "hf" angles are HF's bits; where HF turns a float64 q in float32
    (ROTATES_IN_FLOAT32) the rest of our turn is float64, so float32's level there."""
    q, seed = _q(dtype)
    expected = _hf(name, torch.from_numpy(q)).double().numpy()
    if name in ROTATES_IN_FLOAT32 and dtype == "float64":
        np.testing.assert_allclose(_ours("torch", name, q, precision="hf"), expected, rtol=0,
                                   atol=F32 * np.abs(q).max(), err_msg=f"torch, seed {seed}")
    else:
        np.testing.assert_array_equal(_ours("torch", name, q, precision="hf"), expected,
                                      err_msg=f"torch, seed {seed}")
    np.testing.assert_allclose(_ours("jax", name, q, precision="hf"), expected, rtol=0,
                               atol=F32 * np.abs(q).max(), err_msg=f"jax, seed {seed}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_exact_mode_equals_the_reference_and_hf_at_its_float32_angles(name):
    q, seed = _q("float64")
    reference = _reference(name, q)
    for framework in ("torch", "jax"):
        np.testing.assert_allclose(_ours(framework, name, q), reference, rtol=0, atol=EXACT,
                                   err_msg=f"{framework}, seed {seed}")
    hf = _hf(name, torch.from_numpy(q)).numpy()
    np.testing.assert_allclose(reference, hf, rtol=0, atol=F32 * np.abs(q).max(),
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_equal_axes_are_the_one_dimensional_rope(name):
    """Every axis at the token's position (text only) equals the 1-D RoPE bit for bit, and so
    do positions of one axis (B, L) with the MRoPE settings."""
    q, seed = _q("float64")
    text = np.broadcast_to(np.arange(L) + np.arange(B)[:, None], (B, L)).copy()  # (B, L)
    equal = np.broadcast_to(text, (3, B, L)).copy()
    for framework in ("torch", "jax"):
        one_d = _ours(framework, name, q, positions=text, **NO_MROPE)
        np.testing.assert_array_equal(_ours(framework, name, q, positions=equal), one_d,
                                      err_msg=f"{framework}, seed {seed}")
        np.testing.assert_array_equal(_ours(framework, name, q, positions=text), one_d,
                                      err_msg=f"{framework}, seed {seed}")
    np.testing.assert_array_equal(_reference(name, q, positions=equal),
                                  _reference(name, q, positions=text, **NO_MROPE))


def test_each_layout_is_its_own():
    """The axis maps as Hugging Face lays them out (hand-derived from its recomposition), and
    swapping the layout moves the output by far more than the bound."""
    chunked = dict(rope_settings(THETA, {"mrope_section": [2, 3, 3]}))
    assert rope_axes(chunked, 16).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    interleaved = rope_settings(THETA, {"mrope_section": [4, 2, 2], "mrope_interleaved": True})
    assert rope_axes(interleaved, 16).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    ernie = rope_settings(THETA, {"mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                  "mrope_temporal_last": True})
    assert rope_axes(ernie, 16).tolist() == [1, 2, 1, 2, 1, 2, 0, 0]
    last = rope_settings(THETA, {"mrope_section": [2, 3, 3], "mrope_temporal_last": True})
    assert rope_axes(last, 16).tolist() == [1, 1, 1, 2, 2, 2, 0, 0]
    assert rope_axes(rope_settings(THETA), 16) is None
    q, seed = _q("float64")
    for name, change in [("qwen3_vl", {"mrope_interleaved": False}),
                         ("ernie4_5_vl_moe", {"mrope_temporal_last": False}),
                         ("ernie4_5_vl_moe", {"mrope_interleaved": False})]:
        moved = np.abs(_ours("torch", name, q) - _ours("torch", name, q, **change)).max()
        assert moved > 1e3 * F32 * np.abs(q).max(), (name, change, seed)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("temporal_last", [False, True])
def test_the_numpy_ports_own_axis_rule_equals_the_reference(name, temporal_last):
    """tests/port_numpy.py writes each layout's axis rule again, independently of rope_axes:
    its turn at an image's positions equals the reference's (each layout, the temporal pairs
    first and last; the chunked one with temporal_last has no HF family, only this)."""
    q, seed = _q("float64")
    *_, interleaved, parameters = FAMILIES[name]
    parameters = dict(parameters, mrope_temporal_last=temporal_last)
    if parameters.get("mrope_interleaved") and temporal_last:
        parameters["mrope_section"] = [2, 3, 3]  # alternating pairs: equal h and w
    settings = rope_settings(THETA, parameters)
    positions = image_positions()[..., None, :]  # (3, B, 1, L)
    ours = port_numpy.rope(q, settings, interleaved, positions, multi=True)
    np.testing.assert_allclose(ours, _reference(name, q, **parameters), rtol=0, atol=EXACT,
                               err_msg=f"seed {seed}")


def test_jax_under_jit_with_traced_positions():
    q, seed = _q("float32")
    *_, interleaved, parameters = FAMILIES["qwen2_vl"]
    run = jax.jit(lambda x, p: jax_rotary(x, theta=THETA, positions=p, max_position=16,
                                          rope_parameters=parameters))
    # One compiled program may contract products into fused multiply-adds where the eager
    # operations round each: float32's level, not bit equality.
    np.testing.assert_allclose(np.asarray(run(jnp.asarray(q), jnp.asarray(image_positions()))),
                               _ours("jax", "qwen2_vl", q), rtol=0, atol=F32 * np.abs(q).max(),
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("change, positions, message", [
    ({"mrope_section": [2, 3]}, None, r"mrope_section'\] should be 3 non-negative ints"),
    ({"mrope_section": [2, 3, -1]}, None, r"mrope_section'\] should be 3 non-negative ints"),
    ({"mrope_section": [2, 3, 4]}, None, r"should sum to the rotated pairs rd / 2 = 8, got "
                                         r"\[2, 3, 4\] \(sum 9\)"),
    ({"mrope_interleaved": "yes"}, None, r"mrope_interleaved'\] should be True or False"),
    ({"mrope_section": None, "mrope_interleaved": True}, None,
     r"mrope_interleaved'\] needs mrope_section"),
    ({"mrope_temporal_last": 1}, None, r"mrope_temporal_last'\] should be True or False"),
    ({"mrope_section": None, "mrope_temporal_last": True}, None,
     r"mrope_temporal_last'\] needs mrope_section"),
    ({"mrope_section": [2, 4, 2], "mrope_interleaved": True, "mrope_temporal_last": True}, None,
     r"should have equal height and width sections .*got \[2, 4, 2\]"),
    ({}, np.zeros((4, B, L), np.int64),
     r"positions should be integers shaped .*one row per position axis"),
    ({}, np.zeros((3, L), np.int64)[None].repeat(3, 0)[:, :, None],
     r"positions should be integers shaped"),
])
def test_bad_settings_and_positions_name_the_field(framework, change, positions, message):
    q, _ = _q("float64")
    parameters = _changed(FAMILIES["qwen2_vl"][-1], change)
    positions = image_positions() if positions is None else positions
    with pytest.raises(ValueError, match=message):
        if framework == "torch":
            torch_rotary(torch.from_numpy(q), theta=THETA, positions=torch.from_numpy(positions),
                         rope_parameters=parameters)
        else:
            jax_rotary(jnp.asarray(q), theta=THETA, positions=jnp.asarray(positions),
                       rope_parameters=parameters)


def test_ambiguous_positions_are_refused():
    """(3, L) against x (3, H, L, Dh): three rows' positions, or one row's three axes?"""
    x = torch.zeros(3, H, L, DH)
    with pytest.raises(ValueError, match=r"ambiguous: give \(3, B, L\)"):
        torch_rotary(x, theta=THETA, positions=torch.zeros(3, L, dtype=torch.int64),
                     rope_parameters=FAMILIES["qwen2_vl"][-1])


# ---- the text towers' attention layers, with an image's positions -------------------------------

TOWERS = TEXT_TOWERS


def tower_positions():
    """(3, B, L) for the towers' L tokens: image_positions with the image at 2, row 1 two on."""
    return image_positions(HB, HL, start=2, shift=2)


def _tower(name, rng, **kw):
    """HF's tiny text tower, its attention layer's (the family's first layer's) captured input
    and output with tower_positions(), the call, our configuration of it (rope_precision "hf"),
    and the layer's index."""
    family = TOWERS[name]
    layer = family.layers[0]
    config, model = build_model(family, rng)
    calls = {}
    seen = captured(family, model, (layer,), rng.integers(0, BASE["vocab_size"], (HB, HL)),
                    position_ids=torch.from_numpy(tower_positions()), calls=calls, **kw)
    converted = golden.convert.from_hf(config, state_dict(attention_of(family, model, layer)),
                                       layer_idx=layer, rope_precision="hf")
    return family, model, seen[layer], calls[layer], converted, layer


def _bound(family, twin):
    """HF's own float32 steps are RoPE's (reproduced by "hf" in torch) and, in Qwen3-VL, its
    RMSNorm of q and k: EXACT for torch without a float32 norm, else float32's level."""
    return LAYER_EXACT if family.float32 is None and twin.name == "torch" else FLOAT32_LEVEL


@pytest.mark.parametrize("name", list(TOWERS))
def test_text_tower_layer_with_an_images_positions_equals_hfs(name, twin):
    rng, seed = fresh_rng()
    family, _, (x, expected), _, (variant, ours, params), _ = _tower(name, rng)
    positions = tower_positions()
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        out = twin.numpy(module(twin.array(x), positions=twin.array(positions)))
        text_only = twin.numpy(module(twin.array(x)))
    error = rel(out, expected)
    assert error <= _bound(family, twin), (name, error, seed)
    assert rel(text_only, expected) > 1e3 * FLOAT32_LEVEL, (name, seed)  # the image moves it


@pytest.mark.parametrize("name", list(TOWERS))
def test_text_tower_prefill_and_decode_with_3d_positions(name, twin):
    """The first 4 tokens in one call, then one at a time, each call given its tokens'
    (3, B, n) positions: every output equals HF's full forward's."""
    rng, seed = fresh_rng()
    family, _, (x, expected), _, (variant, ours, params), _ = _tower(name, rng)
    positions = tower_positions()
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        cache = module.init_cache(HB, HL)
        outs = []
        for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, HL)]:
            out, cache = module(twin.array(x[:, start:stop]), cache=cache,
                                positions=twin.array(positions[:, :, start:stop].copy()))
            outs.append(twin.numpy(out))
    error = rel(np.concatenate(outs, axis=1), expected)
    assert error <= _bound(family, twin), (name, error, seed)


@pytest.mark.parametrize("name", list(TOWERS))
def test_text_tower_input_gradient_equals_hfs(name):
    """dL/dx of Σ out ⊙ dO: HF's attention called again as the model called it (its position
    embeddings of the image's positions), against the torch twin's."""
    rng, seed = fresh_rng()
    family, model, (x, expected), (args, kwargs), (variant, ours, params), layer = _tower(
        name, rng, use_cache=False)
    d_out = rng.standard_normal(expected.shape)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    kwargs = dict(kwargs, hidden_states=xt) if "hidden_states" in kwargs else kwargs
    args = args if "hidden_states" in kwargs else (xt,) + tuple(args[1:])
    hf = attention_of(family, model, layer)
    (hf(*args, **kwargs)[0] * torch.from_numpy(d_out)).sum().backward()
    twin = TWINS["torch"]
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        ours_x = torch.from_numpy(x.copy()).requires_grad_()
        (module(ours_x, positions=torch.from_numpy(tower_positions()))
         * torch.from_numpy(d_out)).sum().backward()
    error = rel(ours_x.grad.numpy(), xt.grad.numpy())
    assert error <= _bound(family, twin), (name, error, seed)


def test_module_positions_are_checked():
    """A module without MRoPE takes (B, L) only; with it, (3, B, L) too, but not beside a query
    temperature; the reference refuses the same."""
    rng, _ = fresh_rng()
    *_, (variant, ours, params), _ = _tower("qwen2_vl_text", rng)
    twin = TWINS["torch"]
    x = torch.zeros(HB, HL, ours["d_in"], dtype=torch.float64)
    with twin.float64():
        module = twin.build(variant, ours, params)
        with pytest.raises(ValueError, match=r"positions shape should be \(B, L\) = \(2, 9\) "
                                             r"or \(3, B, L\) = \(3, 2, 9\) \(one row per "
                                             r"position axis\), got \(4, 2, 9\)"):
            module(x, positions=torch.zeros(4, HB, HL, dtype=torch.int64))
        plain = twin.build(variant, {k: v for k, v in ours.items() if k != "rope_parameters"},
                           params)
        with pytest.raises(ValueError, match=r"positions shape should be \(B, L\) = \(2, 9\), "
                                             r"got \(3, 2, 9\)"):
            plain(x, positions=torch.from_numpy(tower_positions()))
        warm = twin.build(variant, dict(ours, query_temperature={
            "beta": 0.1, "floor_scale": 4, "shift": 1}), params)
        with pytest.raises(ValueError, match=r"with query_temperature: no family says which "
                                             r"axis"):
            warm(x, positions=torch.from_numpy(tower_positions()))


@pytest.mark.parametrize("name", ["qwen2_vl_text", "qwen3_vl_text"])
def test_a_config_json_of_before_transformers_5_converts_alike(name):
    """Qwen2-VL's published config.json: θ at the top, the section in rope_scaling ({"type":
    "mrope", ...}), no rope_parameters: the same RoPE settings as transformers 5's form."""
    rng, _ = fresh_rng()
    family = TOWERS[name]
    config, model = build_model(family, rng)
    new = config.to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=new["rope_parameters"]["rope_theta"],
               rope_scaling={"type": "mrope",
                             "mrope_section": new["rope_parameters"]["mrope_section"]})
    sd = state_dict(attention_of(family, model, family.layers[0]))
    settings = [rope_settings(None, golden.convert.from_hf(c, sd)[1]["rope_parameters"])
                for c in (old, new)]
    assert settings[0] == settings[1] and dict(settings[0])["mrope_section"] == (1, 1, 1)


# ---- what the towers' HF code decides beyond their configs -------------------------------------

def _expected_settings(name, config, layer):
    """Our configuration of a tower's layer (golden.hf.expected_state: the arrays not read)."""
    family = TOWERS[name]
    rng, _ = fresh_rng()
    _, model = build_model(family, rng)
    sd = state_dict(attention_of(family, model, family.layers[0]))
    return golden.hf.expected_state(config, sd, layer_idx=layer)[1]


@pytest.mark.parametrize("name, strip", [
    ("qwen2_5_omni_text", lambda c: c.pop("layer_types")),  # from max_window_layers
    ("glm4v_moe_text", lambda c: c["rope_parameters"].pop("partial_rotary_factor")),  # 0.5
    # 128; its section then the default, [16, 24, 24], to fit 64 pairs
    ("paddleocr_vl_text", lambda c: (c.pop("head_dim"), c["rope_parameters"].pop("mrope_section"))),
])
def test_a_config_json_without_what_hfs_class_fills_in_converts_as_hf_reads_it(name, strip):
    """A config.json may leave out what the config class fills in (to_dict() always has it):
    converted from such a file, every layer is what HF's own class makes of the same file."""
    rng, _ = fresh_rng()
    config, _ = build_model(TOWERS[name], rng)
    short = copy.deepcopy(config.to_dict())
    strip(short)
    hf_read = type(config).from_dict(copy.deepcopy(short)).to_dict()
    for layer in range(config.num_hidden_layers):
        assert (_expected_settings(name, short, layer)
                == _expected_settings(name, hf_read, layer)), (name, layer)


@pytest.mark.parametrize("name, change, message", [
    ("ernie4_5_vl_moe_text", {"rope_type": "linear", "factor": 2.0},
     r"'ernie4_5_vl_moe_text': rope_parameters\['rope_type'\] = 'linear' is not supported "
     r"\(HF's ERNIE 4.5 VL takes 'default' only\)"),
    ("ernie4_5_vl_moe_text", {"mrope_section": [2, 1, 2]},
     r"rope_parameters\['mrope_section'\] = \[2, 1, 2\] is not supported \(HF's ERNIE 4.5 VL "
     r"alternates height and width pairs"),
    *((name, {"partial_rotary_factor": 0.5}, r"rope_parameters\['partial_rotary_factor'\] = "
      r"0.5 is not supported \(HF's attention of this family turns the whole head")
      for name in ("qwen2_5_omni_text", "qwen3_omni_moe_text", "paddleocr_vl_text",
                   "ernie4_5_vl_moe_text")),
])
def test_settings_a_towers_hf_code_does_not_take_are_refused_by_name(name, change, message):
    rng, _ = fresh_rng()
    config, _ = build_model(TOWERS[name], rng)
    c = config.to_dict()
    c["rope_parameters"] = dict(c["rope_parameters"], **change)
    with pytest.raises(ValueError, match=message):
        _expected_settings(name, c, 0)


def test_hunyuan_vl_is_refused_with_why():
    """HunYuan-VL's text tower: its XD-RoPE (each half of a pair on its own axis) is not ours
    to express; named, not converted."""
    with pytest.raises(ValueError, match=r"model_type 'hunyuan_vl_text' is not supported: "
                                         r"HunYuan-VL's XD-RoPE gives the two features of a "
                                         r"rotated pair the positions of different axes"):
        golden.convert.from_hf({"model_type": "hunyuan_vl_text"}, {})


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_module_positions_past_the_calls_tokens_equal_the_reference(twin):
    """A video's temporal positions pass the call's length: the module's tables reach the
    largest position (read on the host), and under jax.jit with traced positions the call's
    max_position does; the output equals the reference's. Before, torch raised an IndexError
    and JAX gave NaN."""
    from golden import reference
    rng, seed = fresh_rng()
    config = dict(d_in=8, num_heads=2, num_kv_heads=1, head_dim=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                   "mrope_section": [2, 1, 1]})
    x = rng.standard_normal((2, 5, 8))
    positions = np.array([[[0, 1, 300, 300, 302], [0, 1, 2, 3, 4]]] * 2
                         + [[[0, 1, 600, 601, 700], [0, 1, 2, 3, 4]]])  # (3, B, L)
    t = TWINS[twin]
    import torch_attn
    source = torch_attn.GroupedQueryAttention(**config).double()
    params = torch_attn.export_params(source)
    forward, _ = reference.VARIANTS["grouped_query_attention"]
    expected, _, _ = forward(dict(source.config), {"x": x, "positions": positions}, params)
    with t.float64():
        module = t.build("grouped_query_attention", source.config, params)
        out = t.numpy(module(t.array(x), positions=t.array(positions)))
        assert rel(out, expected) < EXACT, seed
        if twin == "jax":
            traced = jax.jit(lambda a, p: module(a, positions=p, max_position=701))
            out = t.numpy(traced(t.array(x), t.array(positions)))
            assert rel(out, expected) < EXACT, seed
    with pytest.raises(ValueError, match="max_position"):
        module(t.array(x), positions=t.array(positions), max_position=0)
