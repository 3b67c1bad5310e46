"""DINOv3's vision transformer (``dinov3_vit``, golden.hf.vision) converted by
``golden.convert.from_hf``, against transformers' own modules at float64: its rotary embedding
(HF's DINOv3ViTRopePositionEmbedding and apply_rotary_pos_emb) and its attention layers in a
whole model, on a non-square image (H ≠ W) with a class token and registers, both twins given
golden.hf.vision.dinov3_positions; the input gradient; each setting undone (the RoPE, its
scale, its negative half) far from HF's; the round trip to_hf(from_hf(...)); attn-parity hf
on a DINOv3 checkpoint, and its HF row failing a conversion without the scale.

Level: FLOAT32_LEVEL (1e-6 relative): HF forms the patch centres in float32 and its inv_freq
in float32 (a float64 model keeps those float32 values), so its angles are float32's; the
turn and the attention are float64. Our angles against the reference's (1e-12) are
tests/test_axial_rope.py's.

Shape legend: B batch, H × W the image's patches, P prefix tokens (class token and registers),
L = P + H·W tokens, D width, Dh head width.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import golden.convert
from golden.hf.vision import dinov3_positions
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")
from transformers.models.dinov3_vit import modeling_dinov3_vit as hf_dinov3  # noqa: E402
from tests.hf_harness import FLOAT32_LEVEL, called_with, rel, state_dict  # noqa: E402

PATCH = 2
ROWS, COLS = 3, 5    # the image's patches, H ≠ W
REGISTERS = 2        # P = 1 + REGISTERS


def _config(**kw):
    """A tiny DINOv3: width 32, 2 heads of 16 (4 frequencies per axis), two layers, an image of
    ROWS × COLS patches."""
    settings = dict(hidden_size=32, num_attention_heads=2, intermediate_size=32,
                    num_hidden_layers=2, patch_size=PATCH, image_size=[ROWS * PATCH, COLS * PATCH],
                    num_register_tokens=REGISTERS, rope_theta=100.0)
    config = transformers.DINOv3ViTConfig(**{**settings, **kw})
    config._attn_implementation = "sdpa"
    return config


def _random_model(config, rng):
    """The model in float64 with weights N(0, 0.25²): scores of a few units. (At 0.5 the
    softmax is sharp enough that HF's float32 angles alone moved one layer in 120 to 1.3e-6,
    past the level; at 0.25 the worst of 120 was 4.8e-8, and each setting undone still moves
    the output by more than 2e-2.)"""
    model = transformers.DINOv3ViTModel(config).double().eval()  # eval: no coordinate jitter
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.25))
    return model


def _layer_calls(model, pixels):
    """Each attention layer's input x (B, L, D), output (B, L, D) and call (args, kwargs),
    from one forward of the model on ``pixels`` (B, 3, H·PATCH, W·PATCH)."""
    seen = {}

    def hooks(i, attention):
        def before(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen[i] = {"x": x.detach().numpy().copy(), "call": (args, dict(kwargs))}

        def after(module, args, output):
            seen[i]["y"] = output[0].detach().numpy().copy()
        return (attention.register_forward_pre_hook(before, with_kwargs=True),
                attention.register_forward_hook(after))
    handles = [h for i, layer in enumerate(model.model.layer) for h in hooks(i, layer.attention)]
    try:
        with torch.no_grad():
            model(torch.from_numpy(pixels))
    finally:
        for h in handles:
            h.remove()
    return seen


def _model_and_calls(rng, rows=ROWS, cols=COLS):
    config = _config(image_size=[rows * PATCH, cols * PATCH])
    model = _random_model(config, rng)
    pixels = rng.standard_normal((2, 3, rows * PATCH, cols * PATCH))
    return config, model, _layer_calls(model, pixels)


def _positions(batch, rows=ROWS, cols=COLS):
    """(2, B, L): dinov3_positions broadcast over the batch."""
    return np.broadcast_to(dinov3_positions(rows, cols, 1 + REGISTERS)[:, None],
                           (2, batch, 1 + REGISTERS + rows * cols)).copy()


def _ours(twin, config, sd, x, positions, change=None):
    """Our module of the layer's conversion (with ``change`` applied to its settings) on x."""
    t = TWINS[twin]
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    if change is not None:
        ours = change(dict(ours))
    with t.float64():
        module = t.build(variant, ours, params)
        at = {} if positions is None else {"positions": t.array(positions)}
        return t.numpy(module(t.array(x), None, **at))


# ---- the positions and the rotary embedding --------------------------------------------------------

def test_dinov3_positions_by_hand():
    """2 × 3 patches after a class token and one register: (0, 0) twice, then rows −1, 1 and
    columns −2, 0, 2 (the centres −1/2, 1/2 and −2/3, 0, 2/3 times H = 2 and W = 3); the
    fixture gqa_axial_dinov3_scale_negative's positions are these."""
    from golden.specification.cases import CASES
    expected = [[0, 0, -1, -1, -1, 1, 1, 1], [0, 0, -2, 0, 2, -2, 0, 2]]
    assert dinov3_positions(2, 3, 2).tolist() == expected
    assert dinov3_positions(2, 3, 2).dtype == np.int64
    case = next(c for c in CASES if c.name == "gqa_axial_dinov3_scale_negative")
    assert np.array(case.inputs["positions"][1])[:, 0].tolist() == expected


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("rows, cols", [(3, 5), (4, 4), (6, 1)])
def test_the_rotary_embedding_equals_hfs(rows, cols, twin):
    """HF's DINOv3 RoPE of q (B, N, P + H·W, Dh) (the prefix tokens unturned), against our
    rotary embedding with from_hf's rope_parameters at dinov3_positions: HF's float32 level."""
    from jax_attn.rotary import rotary_embedding as jax_rotary
    from torch_attn.rotary import rotary_embedding as torch_rotary
    rng, seed = fresh_rng()
    config = _config(image_size=[rows * PATCH, cols * PATCH])
    rope = hf_dinov3.DINOv3ViTRopePositionEmbedding(config).double().eval()
    cos, sin = rope(torch.zeros((1, 3, rows * PATCH, cols * PATCH), dtype=torch.float64))
    length = 1 + REGISTERS + rows * cols
    x = rng.standard_normal((2, 3, length, 16))
    expected, _ = hf_dinov3.apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos,
                                                 sin)
    _, ours, _ = golden.convert.from_hf(config.to_dict(), state_dict(
        hf_dinov3.DINOv3ViTAttention(config)))
    positions = dinov3_positions(rows, cols, 1 + REGISTERS)[:, None, None]  # (2, 1, 1, L)
    rotary, array = ((torch_rotary, torch.from_numpy) if twin == "torch" else
                     (jax_rotary, np.asarray))
    with TWINS[twin].float64():
        turned = np.asarray(rotary(array(x), theta=None, rope_parameters=ours["rope_parameters"],
                                   positions=array(positions)))
    assert rel(turned, expected.numpy()) < FLOAT32_LEVEL, (rows, cols, seed)
    np.testing.assert_array_equal(turned[..., :1 + REGISTERS, :], x[..., :1 + REGISTERS, :])


# ---- the attention layers in the model -------------------------------------------------------------

@pytest.mark.parametrize("twin", sorted(TWINS))
def test_layers_equal_hfs(twin):
    """Both layers of a two-image batch, each token's output (class token, registers, patches)
    at HF's float32 level; without the RoPE, without its scale, or with the positions' sign
    dropped (|p|: only the bottom-right quarter right), far from it."""
    rng, seed = fresh_rng()
    config, model, seen = _model_and_calls(rng)
    for i, s in seen.items():
        sd = state_dict(model.model.layer[i].attention)
        positions = _positions(s["x"].shape[0])
        out = _ours(twin, config, sd, s["x"], positions)
        assert rel(out, s["y"]) < FLOAT32_LEVEL, (i, seed)
        if twin != "torch":
            continue
        undone = {
            "no RoPE": (None, lambda o: {n: v for n, v in o.items()
                                              if n != "rope_parameters"}),
            "no scale": (positions, lambda o: dict(o, rope_parameters={
                n: v for n, v in o["rope_parameters"].items() if n != "axial_scale"})),
            "|positions|": (np.abs(positions), None),
        }
        for name, (at, change) in undone.items():
            far = _ours(twin, config, sd, s["x"], at, change)
            assert rel(far, s["y"]) > 1e3 * FLOAT32_LEVEL, (name, i, seed)


def test_input_gradient_equals_hfs():
    """dL/dx of Σ out ⊙ dO for layer 0: HF's attention called again as its model called it,
    against the torch twin's (the JAX twin's gradients against the torch twin's are
    tests/test_modules.py's)."""
    rng, seed = fresh_rng()
    config, model, seen = _model_and_calls(rng)
    s = seen[0]
    x = torch.from_numpy(s["x"].copy()).requires_grad_()
    args, kwargs = called_with(s["call"], x)
    d_out = rng.standard_normal(s["y"].shape)
    (model.model.layer[0].attention(*args, **kwargs)[0] * torch.from_numpy(d_out)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(),
                                                   state_dict(model.model.layer[0].attention))
    twin = TWINS["torch"]
    with twin.float64():
        module = twin.build(variant, ours, params)
        ours_x = torch.from_numpy(s["x"].copy()).requires_grad_()
        y = module(ours_x, positions=torch.from_numpy(_positions(s["x"].shape[0])))
        (y * torch.from_numpy(d_out)).sum().backward()
    assert rel(ours_x.grad.numpy(), x.grad.numpy()) < FLOAT32_LEVEL, seed


# ---- the conversion ---------------------------------------------------------------------------------

def test_conversion_settings_and_round_trip():
    """from_hf: D / N heads, bidirectional, q, v, o biases with b_key zeros, axial_scale 2π/H and
    2π/W of config's image_size; to_hf gives back HF's very arrays (no k_proj.bias)."""
    rng = fresh_rng()[0]
    config = _config()
    sd = state_dict(_random_model(config, rng).model.layer[1].attention)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd, layer_idx=1)
    assert variant == "grouped_query_attention"
    assert (ours["num_heads"], ours["head_dim"], ours["causal"]) == (2, 16, False)
    assert (ours["qkv_bias"], ours["out_bias"]) == (True, True)
    assert ours["rope_parameters"] == {"rope_type": "axial", "rope_theta": 100.0,
                                       "axial_scale": [2 * math.pi / ROWS, 2 * math.pi / COLS]}
    np.testing.assert_array_equal(params["b_key"], np.zeros(32))
    back = golden.convert.to_hf(variant, ours, params)
    assert sorted(back) == sorted(sd)
    for name, array in sd.items():
        np.testing.assert_array_equal(back[name], array, err_msg=name)


def test_conversion_refusals_name_the_setting():
    rng = fresh_rng()[0]
    config = _config()
    sd = state_dict(_random_model(config, rng).model.layer[0].attention)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    with pytest.raises(ValueError, match="'dinov3_vit': b_key should be zeros"):
        golden.convert.to_hf(variant, ours, dict(params, b_key=np.ones(32)))
    with pytest.raises(ValueError, match=r"'dinov3_vit': key_bias = True is not supported"):
        golden.convert.from_hf(dict(config.to_dict(), key_bias=True), sd)
    with pytest.raises(ValueError, match="k_proj should have no bias"):
        golden.convert.from_hf(config.to_dict(), dict(sd, **{"k_proj.bias": np.zeros(32)}))
    with pytest.raises(ValueError, match="q_proj and v_proj should both have a bias or neither"):
        golden.convert.from_hf(config.to_dict(), {n: a for n, a in sd.items()
                                                  if n != "v_proj.bias"})
    with pytest.raises(ValueError, match="image_size should be an int ≥ 1 or a pair"):
        golden.convert.from_hf(dict(config.to_dict(), image_size=[6]), sd)
    with pytest.raises(ValueError, match="rope_precision should be 'exact' with "):
        golden.convert.from_hf(config.to_dict(), sd, rope_precision="hf")


def test_without_q_and_v_biases():
    """query_bias = value_bias = False: no biases in, none out; proj_bias as its state dict."""
    rng, seed = fresh_rng()
    config = _config(query_bias=False, value_bias=False, proj_bias=False)
    model = _random_model(config, rng)
    seen = _layer_calls(model, rng.standard_normal((1, 3, ROWS * PATCH, COLS * PATCH)))
    sd = state_dict(model.model.layer[0].attention)
    _, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    assert (ours["qkv_bias"], ours["out_bias"]) == (False, False)
    assert not any(n.startswith("b_") for n in params)
    out = _ours("torch", config, sd, seen[0]["x"], _positions(1))
    assert rel(out, seen[0]["y"]) < FLOAT32_LEVEL, seed


def _checkpoint(directory):
    """A tiny DINOv3 (the sizes above, two layers, an image of ROWS × COLS patches), written by
    save_pretrained in float32."""
    config = _config()
    _random_model(config, np.random.default_rng(0)).float().save_pretrained(directory)
    return directory


def _run(directory):
    from golden.verifier import check as hf_check
    return hf_check.run(directory, frameworks=["torch", "jax"], log=lambda row: None)


def test_a_dinov3_checkpoint_is_checked(tmp_path):
    """attn-parity hf on a DINOv3 checkpoint: one image of the config's image_size (3 × 5
    patches, its class token and registers), every row of both layers passing, HF's among
    them."""
    report = _run(_checkpoint(tmp_path))
    assert {r["fixture"] for r in report["rows"]} == {
        "vision layer 0 (attention)", "vision layer 1 (attention)"}
    bad = [(r["fixture"], r["implementation"], r["dtype"], r["reason"]) for r in report["rows"]
           if r["status"] not in ("pass", "not supported")]
    assert not bad, bad
    assert sum(r["implementation"] == "hf" and r["status"] == "pass"
               for r in report["rows"]) == 2
    assert all(any("one image of 3 × 5 patches" in n for n in r["exercised"])
               for r in report["rows"])


def test_a_conversion_without_the_scale_fails_on_hfs_row(tmp_path, monkeypatch):
    """axial_scale dropped from the conversion: the twins agree with the reference (both use
    the converted settings), HF's own module does not, in both layers."""
    from golden import hf
    family = hf.FAMILIES["dinov3_vit"]

    def unscaled(c, layer_idx, sd):
        ours = family.settings(c, layer_idx, sd)
        rope = {n: v for n, v in ours["rope_parameters"].items() if n != "axial_scale"}
        return dict(ours, rope_parameters=rope)

    monkeypatch.setitem(hf.FAMILIES, "dinov3_vit", dataclasses.replace(family, settings=unscaled))
    report = _run(_checkpoint(tmp_path))
    failed = {(r["fixture"], r["implementation"]) for r in report["rows"]
              if r["status"] == "fail"}
    assert failed == {("vision layer 0 (attention)", "hf"), ("vision layer 1 (attention)", "hf")}


# The model_types tested here (tests/test_hf_import.py's census and docs/hf.md's table read it).
FAMILIES = {"dinov3_vit": _model_and_calls}
