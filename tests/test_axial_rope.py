"""Axial 2-D RoPE (rope_type "axial") and the vision towers that use it, against transformers'
own modules: the rotary embeddings of Qwen-VL (frequencies shared by rows and columns, rotate-
half over the head), Pixtral (the 1-D frequencies dealt to rows and columns in turn), Llama 4's
vision model (shared, interleaved pairs) and Gemma 4's (shared, each axis rotate-half within its
own half of the head). The towers' attention layers are tests/test_hf_import_vision.py's.

Levels (the levels of tests/test_mrope.py):
- ``precision="hf"``: HF's own float32 angles, cos and sin: the torch twin equal to HF's bits
  where HF turns in the input's dtype; JAX at float32's level;
- exact mode (float64) against the reference: 1e-12 (the same angles, another order);
- exact mode against HF's float64 rotation: 1e-6, HF's angles being float32.

Shape legend: B batch, H heads, L patches, Dh head width, rd rotated features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from golden.reference import rotary as reference_rotary
from golden.specification.positions import rope_axes, rope_blocks
from golden.specification.validate import rope_settings
from jax_attn.rotary import rotary_embedding as jax_rotary
from tests.helpers import TWINS, fresh_rng
from torch_attn.rotary import rotary_embedding as torch_rotary

transformers = pytest.importorskip("transformers")
from tests.hf_harness import rel  # noqa: E402

F32 = 1e-6
EXACT = 1e-12
THETA = 100.0
AXIAL = {"rope_type": "axial", "rope_theta": THETA}
LAYOUTS = {  # our rope_parameters and pairing for each HF layout
    "qwen": (AXIAL, False),
    "pixtral": ({**AXIAL, "axial_frequencies": "split"}, False),
    "llama4": (AXIAL, True),
    "gemma4": ({**AXIAL, "axial_pairs": "blocks"}, False),
}


def _grid_positions(h, w):
    """(2, h·w): each patch's row and column, row-major."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([rows.reshape(-1), cols.reshape(-1)])


# ---- the rotary embedding against HF's classes ---------------------------------------------------

def _hf_turned(layout, x, positions):
    """HF's own rotary embedding of x (B, H, L, Dh) at positions (2, L) (rows, columns), each
    layout by its family's classes, float32 angles; the turn in x's dtype except where HF
    turns in float32 (Qwen-VL, Llama 4)."""
    dh, length = x.shape[-1], x.shape[-2]
    t = torch.from_numpy(x)
    pos = torch.from_numpy(positions.T.copy())  # HF's (L, 2)
    if layout in ("qwen", "pixtral"):
        from transformers.models.pixtral import modeling_pixtral as mp
        from transformers.models.qwen2_vl import modeling_qwen2_vl as mq
        if layout == "qwen":
            config = transformers.Qwen2VLVisionConfig(embed_dim=2 * dh, num_heads=2,
                                                      rope_parameters=AXIAL)
            cos, sin = mq.Qwen2VLVisionRotaryEmbedding(config)(t, pos)
            q, _ = mq.apply_rotary_pos_emb_vision(t.transpose(1, 2), t.transpose(1, 2), cos, sin)
            return q.transpose(1, 2).numpy()
        config = transformers.PixtralVisionConfig(hidden_size=2 * dh, num_attention_heads=2,
                                                  head_dim=dh, rope_parameters=AXIAL)
        cos, sin = mp.PixtralVisionRotaryEmbedding(config)(t, pos)
        q, _ = mp.apply_rotary_pos_emb(t, t, cos, sin, unsqueeze_dim=0)
        return q.numpy()
    if layout == "gemma4":
        from transformers.models.gemma4 import modeling_gemma4 as mg
        config = transformers.Gemma4VisionConfig(hidden_size=2 * dh, num_attention_heads=2,
                                                 head_dim=dh, rope_parameters=AXIAL)
        cos, sin = mg.Gemma4VisionRotaryEmbedding(config)(t, pos[None])
        q = mg.apply_multidimensional_rope(t.transpose(1, 2), cos, sin, pos[None])
        return q.transpose(1, 2).numpy()
    from transformers.models.llama4 import modeling_llama4 as ml
    side = int(round((length - 1) ** 0.5))  # a square grid and its class token
    config = transformers.Llama4VisionConfig(hidden_size=2 * dh, num_attention_heads=2,
                                             image_size=side, patch_size=1,
                                             rope_parameters={"rope_type": "default",
                                                              "rope_theta": THETA})
    freqs = ml.Llama4VisionRotaryEmbedding._compute_freqs_ci(config)
    q, _ = ml.vision_apply_rotary_emb(t.transpose(1, 2), t.transpose(1, 2), freqs)
    return q.transpose(1, 2).numpy()


def _layout_positions(layout, side=3):
    """(2, L) positions of each layout's test: a 3 × 5 grid; Llama 4's fixed square grid (side ×
    side) as (column + 1, row + 1) and its class token, last, at (0, 0)."""
    if layout != "llama4":
        return _grid_positions(3, 5)
    rows, cols = _grid_positions(side, side)
    return np.concatenate([np.stack([cols + 1, rows + 1]), [[0], [0]]], axis=1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hf_precision_reproduces_hfs_own_rotary(layout):
    rope, interleaved = LAYOUTS[layout]
    positions = _layout_positions(layout)
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 3, positions.shape[1], 16)).astype(np.float32)
    expected = _hf_turned(layout, x, positions)
    ours = torch_rotary(torch.from_numpy(x), theta=None, rope_parameters=rope,
                        positions=torch.from_numpy(positions[:, None, None]), interleaved=interleaved,
                        precision="hf").numpy()
    mine = np.asarray(jax_rotary(jnp.asarray(x), theta=None, rope_parameters=rope,
                                 positions=jnp.asarray(positions[:, None, None]), interleaved=interleaved,
                                 precision="hf"))
    if layout == "llama4":  # HF's complex product (its own multiply) against our two terms
        assert rel(ours, expected) < F32, seed
    else:
        np.testing.assert_array_equal(ours, expected, err_msg=f"seed {seed}")
    assert rel(mine, expected) < F32, seed


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_exact_mode_equals_the_reference_and_hf_at_its_float32_angles(layout):
    rope, interleaved = LAYOUTS[layout]
    positions = _layout_positions(layout)
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 3, positions.shape[1], 16))
    settings = rope_settings(None, rope)
    cos, sin = reference_rotary.rope_cos_sin(settings, 16, positions[:, None, None], multi=True)
    expected = reference_rotary.turn(x, cos, sin, interleaved, rope_blocks(settings))
    mine = torch_rotary(torch.from_numpy(x), theta=None, rope_parameters=rope,
                        positions=torch.from_numpy(positions[:, None, None]),
                        interleaved=interleaved).numpy()
    with TWINS["jax"].float64():
        theirs = np.asarray(jax_rotary(jnp.asarray(x), theta=None, rope_parameters=rope,
                                       positions=jnp.asarray(positions[:, None, None]),
                                       interleaved=interleaved))
    for framework, turned in (("torch", mine), ("jax", theirs)):
        assert turned.dtype == np.float64 and rel(turned, expected) < EXACT, (framework, seed)
    assert rel(expected, _hf_turned(layout, x, positions)) < F32, seed


def test_the_layouts_differ_by_far_more_than_the_bound():
    """Each layout is its own: the same input turned by another layout's settings moves by far
    more than F32 (the tests above would see a wrong layout)."""
    positions = _grid_positions(3, 5)
    x = fresh_rng()[0].standard_normal((1, 2, 15, 16))
    turned = {}
    for name, (rope, interleaved) in LAYOUTS.items():
        turned[name] = torch_rotary(torch.from_numpy(x), theta=None, rope_parameters=rope,
                                    positions=torch.from_numpy(positions[:, None, None]),
                                    interleaved=interleaved).numpy()
    names = sorted(turned)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert rel(turned[a], turned[b]) > 1e3 * F32, (a, b)


def test_sections_frequencies_and_blocks():
    """The three rules written out for rd = 16, two axes: four pairs per axis."""
    from golden.specification.positions import axial_exponents
    shared, split = (dict(rope_settings(None, r)) for r in (AXIAL, LAYOUTS["pixtral"][0]))
    assert rope_axes(shared, 16).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert axial_exponents(shared, 16).tolist() == [0, 2, 4, 6, 0, 2, 4, 6]
    assert axial_exponents(split, 16).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert rope_blocks(rope_settings(None, LAYOUTS["gemma4"][0])) == 2
    assert rope_blocks(shared) == 1


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("change, message", [
    ({"axial_axes": 1}, "axial_axes"),
    ({"axial_frequencies": "mixed"}, "axial_frequencies"),
    ({"axial_pairs": "rows"}, "axial_pairs"),
    ({"mrope_section": [2, 1, 1]}, "mrope_section"),
    ({"axial_axes": 3}, "multiple of"),
    ({"axial_scale": [1.0]}, r"axial_scale'\] should have axial_axes = 2 numbers"),
    ({"axial_scale": [1.0, 0.0]}, r"axial_scale'\] should be None or a list of positive"),
    ({"axial_scale": 2.0}, r"axial_scale'\] should be None or a list of positive"),
])
def test_bad_settings_name_the_field(framework, change, message):
    rotary, array = ((torch_rotary, torch.from_numpy) if framework == "torch" else
                     (jax_rotary, jnp.asarray))
    with pytest.raises(ValueError, match=message):
        rotary(array(np.zeros((1, 2, 4, 16))), theta=None,
               rope_parameters={**AXIAL, **change})


# ---- negative positions (DINOv3's patch centres 2i + 1 − H) ---------------------------------------

@pytest.mark.parametrize("rope, interleaved", [({"rope_type": "default", "rope_theta": 1e4}, False),
                                               ({**AXIAL, "axial_scale": [0.5, 3.0]}, True)])
def test_negative_positions_equal_the_reference(rope, interleaved):
    """Positions below zero, some past ROPE_BLOCK in magnitude (the tables' second block),
    against the reference's angles p · f (float64, 1e-12), both twins (JAX also under jit with
    a static max_position); and the hand-derived inverse: turned by p then by −p, x again."""
    rng, seed = fresh_rng()
    settings = rope_settings(None, rope)
    axes = 2 if rope["rope_type"] == "axial" else None
    length = 7
    positions = rng.integers(-600, 600, size=((axes,) if axes else ()) + (2, length))
    positions[..., 0, 0] = -1
    x = rng.standard_normal((2, 3, length, 16))
    at = positions[:, :, None] if axes else positions[:, None]  # against (B, H, L, Dh)
    cos, sin = reference_rotary.rope_cos_sin(settings, 16, at, multi=bool(axes))
    expected = reference_rotary.turn(x, cos, sin, interleaved, rope_blocks(settings))
    kw = dict(theta=None, rope_parameters=rope, interleaved=interleaved)
    mine = torch_rotary(torch.from_numpy(x), positions=torch.from_numpy(positions), **kw)
    back = torch_rotary(mine, positions=torch.from_numpy(-positions), **kw).numpy()
    with TWINS["jax"].float64():
        theirs = np.asarray(jax_rotary(jnp.asarray(x), positions=jnp.asarray(positions), **kw))
        jitted = np.asarray(jax.jit(lambda p: jax_rotary(jnp.asarray(x), positions=p,
                                                         max_position=600, **kw))(
            jnp.asarray(positions)))
    for name, turned in (("torch", mine.numpy()), ("jax", theirs), ("jax jit", jitted)):
        assert rel(turned, expected) < EXACT, (name, seed)
    assert rel(back, x) < EXACT, seed
    assert rel(expected, x) > 0.1, seed  # they did turn


def test_a_scale_with_hf_precision_is_refused():
    """HF's float32 arithmetic of a scaled axial RoPE (DINOv3's) is not reproduced: "hf" is
    refused by name rather than given another float32 recipe."""
    with pytest.raises(ValueError, match="rope_precision should be 'exact' with "
                                         r"rope_parameters\['axial_scale'\]"):
        torch_rotary(torch.zeros((1, 2, 4, 16)), theta=None, precision="hf",
                     rope_parameters={**AXIAL, "axial_scale": [1.0, 2.0]})
