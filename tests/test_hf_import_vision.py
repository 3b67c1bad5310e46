"""The vision towers' attention layers with axial 2-D RoPE (golden.hf.vision), converted by
``golden.convert.from_hf`` and given the patches' rows and columns as positions (2, B, L),
against transformers' own modules at float64: the Qwen-VL towers and their kin (GLM-4V, ERNIE-
4.5-VL, the Omni encoders) on two images of different grids packed in one sequence (HF's
``cu_seqlens``: our block-diagonal mask; Qwen2.5-VL's windowed layer in its window order),
Pixtral on two images of different sizes (its block mask), Llama 4's vision model on two
images of a fixed grid with their class tokens; the input gradient; and each tower without its
own setting (its 2-D RoPE, Pixtral's frequencies, Llama 4's pairs) far from HF's.

Level: FLOAT32_LEVEL (1e-6 relative), HF's angles being float32, and Qwen-VL's and Llama 4's
rotation itself float32 (q and k cast down, turned, cast back). The rotary embeddings alone are
tests/test_axial_rope.py's.

Shape legend: B batch, L patches, D width.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import golden.convert
from golden.hf.vision import COMPOSITES as COMPOSITES_VL
from tests.helpers import TWINS, WHOLE, fresh_rng
from tests.test_axial_rope import AXIAL, THETA, _grid_positions, _layout_positions

transformers = pytest.importorskip("transformers")
from transformers import vision_utils  # noqa: E402
from tests.hf_harness import (FLOAT32_LEVEL, called_with, draw_parameters, rel,  # noqa: E402
                              state_dict)

PATCH, MERGE = 2, 2
GRIDS = np.array([[1, 4, 6], [1, 2, 4]])  # two images (t, h, w), of 24 and 8 patches


def _qwen_tower(config, model, width="hidden_size", **kw):
    return dict(config=config, model=model, width=width, kw=kw)


def _hf_class(name):
    """A transformers class by name, from the top or from the module of its model type."""
    if hasattr(transformers, name):
        return getattr(transformers, name)
    for module in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                   "qwen2_5_omni", "qwen3_omni_moe", "glm4v", "glm4v_moe", "ernie4_5_vl_moe"):
        found = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(name)


# model_type -> the vision config class, the model class, its tiny settings (width 32, 2 heads
# of 16: 4 frequencies per axis)
QWEN_TOWERS = {
    "qwen2_vl_vision": _qwen_tower("Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel",
                                   width="embed_dim", hidden_size=32, mlp_ratio=2),
    "qwen2_5_vl_vision": _qwen_tower("Qwen2_5_VLVisionConfig",
                                     "Qwen2_5_VisionTransformerPretrainedModel",
                                     intermediate_size=32, out_hidden_size=32, window_size=8,
                                     fullatt_block_indexes=[1], depth=2),
    **{mt: _qwen_tower(config, model, intermediate_size=32, out_hidden_size=32,
                       num_position_embeddings=16, deepstack_visual_indexes=[])
       for mt, config, model in [
           ("qwen3_vl_vision", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
           ("qwen3_vl_moe_vision", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
           ("qwen3_5_vision", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
           ("qwen3_5_moe_vision", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
           ("qwen3_omni_moe_vision_encoder", "Qwen3OmniMoeVisionEncoderConfig",
            "Qwen3OmniMoeVisionEncoder")]},
    "qwen2_5_omni_vision_encoder": _qwen_tower(
        "Qwen2_5OmniVisionEncoderConfig", "Qwen2_5OmniVisionEncoder", intermediate_size=32,
        out_hidden_size=32, window_size=8, fullatt_block_indexes=[1], depth=2),
    # GLM-4V: no bias on proj, qkv's as attention_bias says
    **{mt: _qwen_tower(config, model, intermediate_size=32, out_hidden_size=32,
                       attention_bias=True, image_size=8)
       for mt, config, model in [
           ("glm4v_vision", "Glm4vVisionConfig", "Glm4vVisionModel"),
           ("glm4v_moe_vision", "Glm4vMoeVisionConfig", "Glm4vMoeVisionModel")]},
    "ernie4_5_vl_moe_vision": _qwen_tower(
        "Ernie4_5_VLMoeVisionConfig", "Ernie4_5_VLMoeVisionTransformerPretrainedModel",
        intermediate_size=32),
}


def _random_model(model, rng):
    model = model.double().eval()
    draw_parameters(model, rng)
    return model


def _tower_model(mt, rng):
    spec = QWEN_TOWERS[mt]
    kw = dict(dict(depth=1, num_heads=2, in_channels=3, patch_size=PATCH,
                   spatial_merge_size=MERGE, temporal_patch_size=1,
                   rope_parameters=dict(AXIAL)), **spec["kw"])
    kw[spec["width"]] = 32
    config = _hf_class(spec["config"])(**kw)
    config._attn_implementation = "sdpa"
    return config, _random_model(_hf_class(spec["model"])(config), rng)


def _layer_calls(attentions, run):
    """Each attention's input x, mask (HF's additive one), cu_seqlens and output as NumPy, and
    its call (args, kwargs) to call it again, from one forward (``run()``)."""
    seen, calls = {}, {}

    def hooks(i, attention):
        def before(module, args, kwargs):
            calls[i] = (args, dict(kwargs))
            seen[i] = {"x": kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                       "mask": kwargs.get("attention_mask"), "cu": kwargs.get("cu_seqlens")}

        def after(module, args, output):
            seen[i]["y"] = output if isinstance(output, torch.Tensor) else output[0]
        return (attention.register_forward_pre_hook(before, with_kwargs=True),
                attention.register_forward_hook(after))
    handles = [h for i, a in enumerate(attentions) for h in hooks(i, a)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return {i: {**{n: None if t is None else t.detach().numpy().copy() for n, t in s.items()},
                "call": calls[i]} for i, s in seen.items()}


def _tower_positions(model, grids):
    """(2, L): the rows and columns in the order the attention sees the patches (HF's
    get_vision_position_ids; Qwen2.5-VL's window order where the model permutes)."""
    g = torch.from_numpy(grids)
    positions = vision_utils.get_vision_position_ids(g, MERGE)  # (L, 2)
    if hasattr(model, "permute_input_for_window_attn"):
        window_index, _ = vision_utils.get_vision_window_index(
            g, spatial_merge_size=MERGE, window_size=model.window_size, patch_size=PATCH)
        positions = model.permute_input_for_window_attn(positions, window_index,
                                                        seq_len=positions.shape[0])
    return positions.numpy().T.copy()


def _block_mask(cu):
    """(1, L, L) bool: True within each span of cu_seqlens."""
    segment = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    return (segment[:, None] == segment[None, :])[None]


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("mt", sorted(QWEN_TOWERS))
def test_tower_layer_with_two_images_equals_hfs(mt, twin):
    rng, seed = fresh_rng()
    config, model = _tower_model(mt, rng)
    n = int((GRIDS[:, 0] * GRIDS[:, 1] * GRIDS[:, 2]).sum())
    patches = rng.standard_normal((n, 3 * PATCH * PATCH))
    seen = _layer_calls([block.attn for block in model.blocks], lambda: model(
        torch.from_numpy(patches), grid_thw=torch.from_numpy(GRIDS)))
    positions = _tower_positions(model, GRIDS)[:, None]  # (2, 1, L)
    t = TWINS[twin]
    for i, s in seen.items():
        variant, ours, params = golden.convert.from_hf(config.to_dict(),
                                                       state_dict(model.blocks[i].attn),
                                                       layer_idx=i)
        with t.float64():
            module = t.build(variant, ours, params)
            out = t.numpy(module(t.array(s["x"][None]), t.array(_block_mask(s["cu"])),
                                 positions=t.array(positions)))[0]
        assert rel(out, s["y"]) < FLOAT32_LEVEL, (mt, i, seed)
        if i == 0 and mt == "qwen2_5_vl_vision":  # a windowed layer: its windows are smaller
            assert len(s["cu"]) > len(GRIDS) + 1
        if twin == "torch":  # without its 2-D RoPE the layer is far from HF's
            plain = {n: v for n, v in ours.items() if n != "rope_parameters"}
            with t.float64():
                far = t.numpy(t.build(variant, plain, params)(
                    t.array(s["x"][None]), t.array(_block_mask(s["cu"]))))[0]
            assert rel(far, s["y"]) > 1e3 * FLOAT32_LEVEL, (mt, i, seed)


def _pixtral(rng):
    """Pixtral's vision model on two images of 4 × 6 and 2 × 4 patches packed in one sequence
    (HF's block-diagonal mask); positions each patch's (row, column)."""
    config = transformers.PixtralVisionConfig(
        hidden_size=32, num_attention_heads=2, head_dim=16, intermediate_size=32,
        num_hidden_layers=1, patch_size=PATCH, image_size=16, rope_parameters=dict(AXIAL))
    config._attn_implementation = "sdpa"
    model = _random_model(transformers.PixtralVisionModel(config), rng)
    sizes = [(4, 6), (2, 4)]
    pixels = rng.standard_normal((2, 3, 8, 12))
    seen = _layer_calls([layer.attention for layer in model.transformer.layers], lambda: model(
        torch.from_numpy(pixels), image_sizes=[(h * PATCH, w * PATCH) for h, w in sizes]))
    positions = np.concatenate([_grid_positions(h, w) for h, w in sizes], axis=1)
    return config, [layer.attention for layer in model.transformer.layers], seen, positions


def _llama4(rng):
    """Llama 4's vision model on two images of 4 × 4 patches and their class tokens (last):
    positions (column + 1, row + 1), the class token (0, 0); no mask."""
    config = transformers.Llama4VisionConfig(
        hidden_size=32, num_attention_heads=2, intermediate_size=128, num_hidden_layers=1,
        image_size=4 * PATCH, patch_size=PATCH, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32, pixel_shuffle_ratio=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": THETA})
    config._attn_implementation = "sdpa"
    model = _random_model(transformers.Llama4VisionModel(config), rng)
    pixels = rng.standard_normal((2, 3, 4 * PATCH, 4 * PATCH))
    attentions = [layer.self_attn for layer in model.model.layers]
    seen = _layer_calls(attentions, lambda: model(torch.from_numpy(pixels)))
    return config, attentions, seen, _layout_positions("llama4", side=4)


def _gemma4(rng):
    """Gemma 4's vision tower (GQA: 2 heads, 1 key-value head) on two images, 4 × 4 and 2 × 4
    patches, the second padded to 16 with HF's (−1, −1): positions its pixel_position_ids (x,
    y), the padding's 0 here (their rows are padding in both; only real rows are compared)."""
    config = transformers.Gemma4VisionConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=32, num_hidden_layers=1, patch_size=PATCH, pooling_kernel_size=1,
        position_embedding_size=8, rope_parameters=dict(AXIAL))
    config._attn_implementation = "sdpa"
    model = _random_model(transformers.Gemma4VisionModel(config), rng)
    xy = [np.stack([cols, rows], -1) for rows, cols in (_grid_positions(4, 4),
                                                        _grid_positions(2, 4))]
    ids = np.full((2, 16, 2), -1)
    for b, p in enumerate(xy):
        ids[b, :len(p)] = p
    pixels = rng.standard_normal((2, 16, 3 * PATCH * PATCH))
    attentions = [layer.self_attn for layer in model.encoder.layers]
    seen = _layer_calls(attentions, lambda: model(torch.from_numpy(pixels),
                                                  pixel_position_ids=torch.from_numpy(ids)))
    valid = (ids >= 0).all(-1)  # (B, L)
    for s in seen.values():
        s["mask"] = np.where(valid[:, None, None, :], 0.0, -np.inf)  # HF's, as additive
        s["valid"] = valid
    return config, attentions, seen, np.where(valid, np.moveaxis(ids, -1, 0), 0)  # (2, B, L)


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("mt, make", [("pixtral", _pixtral), ("llama4_vision_model", _llama4),
                                      ("gemma4_vision", _gemma4)])
def test_pixtral_and_llama4_layers_equal_hfs(mt, make, twin):
    rng, seed = fresh_rng()
    config, attentions, seen, positions = make(rng)
    t = TWINS[twin]
    for i, s in seen.items():
        x = s["x"]
        mask = None if s["mask"] is None else t.array(s["mask"][:, 0] == 0)  # HF's 0 / −inf
        variant, ours, params = golden.convert.from_hf(config.to_dict(),
                                                       state_dict(attentions[i]), layer_idx=i)
        assert ours["rope_parameters"]["rope_type"] == "axial"
        batch_positions = (positions if positions.ndim == 3 else np.broadcast_to(
            positions[:, None], (2,) + x.shape[:2])).copy()
        rows = s.get("valid", np.ones(x.shape[:2], bool))  # the real patches' rows
        with t.float64():
            module = t.build(variant, ours, params)
            out = t.numpy(module(t.array(x), mask, positions=t.array(batch_positions)))
        assert rel(out[rows], s["y"][rows]) < FLOAT32_LEVEL, (mt, i, seed)
        if twin == "torch":  # its own layout undone (Pixtral's split, Llama 4's pairs): far
            undone = dict(ours)
            if mt == "pixtral":
                undone["rope_parameters"] = dict(ours["rope_parameters"],
                                                 axial_frequencies="shared")
            elif mt == "gemma4_vision":  # its pairs in blocks, and its value norm
                undone["rope_parameters"] = dict(ours["rope_parameters"], axial_pairs="half")
            else:
                undone["rope_interleaved"] = False
            with t.float64():
                far = t.numpy(t.build(variant, undone, params)(
                    t.array(x), mask, positions=t.array(batch_positions)))
            assert rel(far[rows], s["y"][rows]) > 1e3 * FLOAT32_LEVEL, (mt, i, seed)
            if mt == "gemma4_vision":
                with t.float64():
                    far = t.numpy(t.build(variant, dict(ours, v_norm=False), params)(
                        t.array(x), mask, positions=t.array(batch_positions)))
                assert rel(far[rows], s["y"][rows]) > 1e3 * FLOAT32_LEVEL, (mt, "v", seed)


def _qwen2_5_windowed(rng):
    """Qwen2.5-VL's tower, its windowed layer 0 (the window order and the windows' mask)."""
    config, model = _tower_model("qwen2_5_vl_vision", rng)
    n = int((GRIDS[:, 0] * GRIDS[:, 1] * GRIDS[:, 2]).sum())
    patches = rng.standard_normal((n, 3 * PATCH * PATCH))
    attentions = [block.attn for block in model.blocks]
    seen = _layer_calls(attentions, lambda: model(torch.from_numpy(patches),
                                                  grid_thw=torch.from_numpy(GRIDS)))
    for s in seen.values():
        s["mask"] = np.where(_block_mask(s["cu"]), 0.0, -np.inf)[:, None]  # HF's additive form
    return config, attentions, seen, _tower_positions(model, GRIDS)


@pytest.mark.parametrize("mt, make", [("qwen2_5_vl_vision", _qwen2_5_windowed),
                                      ("pixtral", _pixtral), ("llama4_vision_model", _llama4),
                                      ("gemma4_vision", _gemma4)])
def test_tower_input_gradient_equals_hfs(mt, make):
    """dL/dx of Σ out ⊙ dO for layer 0: HF's attention called again as its model called it,
    against the torch twin's (the JAX twin's gradients against the torch twin's are
    tests/test_modules.py's)."""
    rng, seed = fresh_rng()
    config, attentions, seen, positions = make(rng)
    s = seen[0]
    x = torch.from_numpy(s["x"].copy()).requires_grad_()
    args, kwargs = called_with(s["call"], x)
    d_out = rng.standard_normal(s["y"].shape)
    if "valid" in s:  # padding rows: their outputs are padding (their positions differ)
        d_out = d_out * s["valid"][..., None]
    out = attentions[0](*args, **kwargs)
    ((out if isinstance(out, torch.Tensor) else out[0]) * torch.from_numpy(d_out)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(), state_dict(attentions[0]))
    twin = TWINS["torch"]
    lead = s["x"].shape[:-1]
    batched = len(lead) == 2
    mask = s["mask"][:, 0] == 0 if s["mask"] is not None else None
    if not batched:  # a Qwen tower's (L, D): ours (1, L, D)
        mask = mask if mask is None else mask[:1]
    batch_positions = (positions if positions.ndim == 3 else np.broadcast_to(
        positions[:, None], (2, lead[0] if batched else 1, lead[-1]))).copy()
    with twin.float64():
        module = twin.build(variant, ours, params)
        ours_x = torch.from_numpy(s["x"].copy() if batched else s["x"][None].copy())
        ours_x.requires_grad_()
        y = module(ours_x, None if mask is None else torch.from_numpy(mask),
                   positions=torch.from_numpy(batch_positions))
        (y.reshape(d_out.shape) * torch.from_numpy(d_out)).sum().backward()
    grad = ours_x.grad.numpy().reshape(x.shape)
    assert rel(grad, x.grad.numpy()) < FLOAT32_LEVEL, (mt, seed)


# The model_types tested here (tests/test_hf_import.py's census and docs/hf.md's table read it).
FAMILIES = {**QWEN_TOWERS, "pixtral": _pixtral, "llama4_vision_model": _llama4,
            "gemma4_vision": _gemma4}


def _assert_every_row_passes(report):
    """Every row of an attn-parity hf report passes or is not supported, the others named."""
    bad = [(r["fixture"], r["implementation"], r["dtype"], r["reason"])
           for r in report["rows"] if r["status"] not in ("pass", "not supported")]
    assert not bad, bad


def _tower_checkpoint(mt, directory):
    """A tiny checkpoint of Pixtral's, Llama 4's or Gemma 4's vision tower alone (the sizes of
    the layer tests above, two layers), written by save_pretrained."""
    rng = np.random.default_rng(0)
    if mt == "pixtral":
        config = transformers.PixtralVisionConfig(
            hidden_size=32, num_attention_heads=2, head_dim=16, intermediate_size=32,
            num_hidden_layers=2, patch_size=PATCH, image_size=16, rope_parameters=dict(AXIAL))
        model = transformers.PixtralVisionModel(config)
    elif mt == "llama4_vision_model":
        config = transformers.Llama4VisionConfig(
            hidden_size=32, num_attention_heads=2, intermediate_size=128, num_hidden_layers=2,
            image_size=4 * PATCH, patch_size=PATCH, vision_output_dim=32,
            projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": THETA})
        model = transformers.Llama4VisionModel(config)
    else:
        config = transformers.Gemma4VisionConfig(
            hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=32, num_hidden_layers=2, patch_size=PATCH,
            pooling_kernel_size=1, position_embedding_size=8, rope_parameters=dict(AXIAL))
        model = transformers.Gemma4VisionModel(config)
    _random_model(model, rng).float().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("mt", ["pixtral", "llama4_vision_model", "gemma4_vision"])
def test_a_vision_towers_checkpoint_is_checked(mt, tmp_path):
    """attn-parity hf on a tower's own checkpoint: one image drawn as its model takes it
    (Pixtral's image_sizes, Llama 4's fixed grid and class token, Gemma 4's
    pixel_position_ids), every layer's rows passing, HF's among them."""
    from golden.verifier import check as hf_check
    report = hf_check.run(_tower_checkpoint(mt, tmp_path), frameworks=["torch"],
                          log=lambda row: None)
    assert {r["fixture"] for r in report["rows"]} == {
        "vision layer 0 (attention)", "vision layer 1 (attention)"}
    _assert_every_row_passes(report)
    assert sum(r["implementation"] == "hf" and r["status"] == "pass"
               for r in report["rows"]) == 2


# ---- vision-language checkpoints through attn-parity hf, tower by tower --------------------------

def _vl_config(mt):
    """A tiny vision-language config of ``mt`` (golden.hf.COMPOSITES): its text tower's tiny
    settings (tests/hf_harness.TEXT_TOWERS, two layers) and its vision tower's (QWEN_TOWERS,
    two blocks)."""
    from tests.hf_harness import BASE, TEXT_TOWERS
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL",
              "qwen3_vl_moe": "Qwen3VLMoe", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe",
              "glm4v": "Glm4v", "glm4v_moe": "Glm4vMoe"}[mt]
    text = {**BASE, **TEXT_TOWERS[f"{mt}_text"].kw} if f"{mt}_text" in TEXT_TOWERS else None
    if text is None:  # a text tower without a tiny config in the harness: Qwen2-VL's
        text = {**BASE, **TEXT_TOWERS["qwen2_vl_text"].kw}
    text = dict(text, num_hidden_layers=max(2, text.get("num_hidden_layers", 2)))
    if isinstance(text.get("layer_types"), list) and len(text["layer_types"]) < 2:
        text["layer_types"] = text["layer_types"] * 2
    spec = QWEN_TOWERS[f"{mt}_vision"]
    vision = dict(dict(depth=2, num_heads=2, in_channels=3, patch_size=PATCH,
                       spatial_merge_size=MERGE, temporal_patch_size=1,
                       rope_parameters=dict(AXIAL)), **spec["kw"])
    vision[spec["width"]] = 32
    vision["depth"] = 2
    config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision)
    return config, getattr(transformers, f"{prefix}ForConditionalGeneration")


# every vision-language composite attn-parity hf reads (Gemma 4's: its own test below)
# with an axial-RoPE vision tower (the LLaVA family's and the other composites of issue 42:
# tests/test_hf_composites.py)
VL = tuple(mt for mt in COMPOSITES_VL if f"{mt}_vision" in QWEN_TOWERS)


# Quick: one composite (Qwen2.5-VL, windowed tower); Qwen3-VL's tower layers are checked in the
# quick suite by test_tower_layer_with_two_images_equals_hfs, its whole checkpoint here in the
# whole matrix (23 s to 31 s each here, 2 shared cores).
@pytest.mark.parametrize("mt", VL if WHOLE else ("qwen2_5_vl",))
def test_a_vision_language_checkpoint_is_checked_tower_by_tower(mt, tmp_path):
    """A composite checkpoint made with save_pretrained: attn-parity hf checks every attention
    layer of both towers (the text tower given an image's (3, B, L) positions, the vision
    tower one image of its grid), every row passing."""
    from golden.verifier import check as hf_check
    config, make = _vl_config(mt)
    model = make(config)
    model.save_pretrained(tmp_path)
    report = hf_check.run(tmp_path, frameworks=["torch", "jax"], log=lambda row: None)
    names = {r["fixture"] for r in report["rows"]}
    assert {n for n in names if n.startswith("vision layer")} == {
        "vision layer 0 (attention)", "vision layer 1 (attention)"}, names
    assert len(names) >= 3, names  # and the text tower's attention layers
    _assert_every_row_passes(report)
    assert any("hf" == r["implementation"] and r["status"] == "pass" and
               r["fixture"].startswith("vision") for r in report["rows"])


def test_a_wrong_vision_conversion_fails_on_hfs_row(tmp_path, monkeypatch):
    """Pixtral's frequencies in a Qwen2.5-VL tower's conversion: the twins agree with the
    reference (both use the converted settings), HF's own module does not."""
    from golden import hf
    from golden.verifier import check as hf_check
    config, make = _vl_config("qwen2_5_vl")
    make(config).save_pretrained(tmp_path)
    family = hf.FAMILIES["qwen2_5_vl_vision"]

    def split(c, layer_idx, sd):
        ours = family.settings(c, layer_idx, sd)
        return dict(ours, rope_parameters=dict(ours["rope_parameters"],
                                               axial_frequencies="split"))

    monkeypatch.setitem(hf.FAMILIES, "qwen2_5_vl_vision", family.__class__(
        family.variant, split, family.to_neutral, family.from_neutral, stacks=family.stacks,
        model_class=family.model_class, position_axes=2))
    report = hf_check.run(tmp_path, frameworks=["torch"], log=lambda row: None)
    failed = {(r["fixture"], r["implementation"]) for r in report["rows"]
              if r["status"] == "fail"}
    assert failed == {("vision layer 0 (attention)", "hf"), ("vision layer 1 (attention)", "hf")}


@pytest.mark.parametrize("rows, cols, m, w", [(6, 6, 2, 2), (4, 8, 2, 2), (10, 6, 2, 4),
                                               (3, 6, 1, 2), (6, 4, 2, 1), (16, 16, 2, 4)])
def test_the_verifiers_window_order_is_hfs(rows, cols, m, w):
    """golden.verifier.towers.window_order against transformers' get_vision_window_index (one
    image): the same patch order, and the same windows (its cu_window_seqlens), grids that
    divide into whole windows (an empty padded window row) and grids that do not."""
    from golden.verifier.towers import window_order
    order, windows = window_order(rows, cols, m, w)
    index, cu = vision_utils.get_vision_window_index(
        torch.tensor([[1, rows, cols]]), spatial_merge_size=m, window_size=w * m * PATCH,
        patch_size=PATCH)
    expected = (index.numpy()[:, None] * m * m + np.arange(m * m)).reshape(-1)
    np.testing.assert_array_equal(order, expected)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(windows))])  # empty windows: repeats
    np.testing.assert_array_equal(np.unique(bounds), cu.numpy())


def test_qwen2_5_vls_windows_are_exercised_by_attn_parity_hf(tmp_path, monkeypatch):
    """The Qwen2.5-VL tower's windowed layer (layer 0; layer 1 is in fullatt_block_indexes) is
    checked on an image that spans several windows, under their block mask: the report says
    so, every row passes, and the same image with the windows' mask dropped (one window) fails
    HF's row of that layer alone."""
    from golden.verifier import check as hf_check
    from golden.verifier import towers
    config, make = _vl_config("qwen2_5_vl")
    make(config).save_pretrained(tmp_path)
    report = hf_check.run(tmp_path, frameworks=["torch"], log=lambda row: None)
    _assert_every_row_passes(report)
    windowed = {r["fixture"] for r in report["rows"]
                if any(n.startswith("Qwen2.5-VL's windows: exercised (the image spans 4 windows")
                       for n in r["exercised"])}
    assert windowed == {"vision layer 0 (attention)"}
    order = towers.window_order
    monkeypatch.setattr(towers, "window_order",
                        lambda *a: (order(*a)[0], np.zeros_like(order(*a)[1])))
    report = hf_check.run(tmp_path, frameworks=["torch"], log=lambda row: None)
    failed = {(r["fixture"], r["implementation"]) for r in report["rows"]
              if r["status"] == "fail"}
    assert failed == {("vision layer 0 (attention)", "hf")}


def test_a_composite_without_its_towers_config_is_refused_by_name(tmp_path):
    import json

    from golden.verifier.checkpoint import CheckpointError
    from golden.verifier.layout import read_config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(CheckpointError, match="'qwen2_5_vl' is a composite model: its "
                                              "text_config should be a dict"):
        read_config(tmp_path)


def test_a_gemma4_shaped_checkpoint_is_checked_tower_by_tower(tmp_path):
    """Gemma 4 (text tower: a sliding layer and a full one with K = V, wider heads, proportional
    RoPE; vision tower: axial blocks, QK and V norms; audio tower: the USM Conformer's local
    window, golden.verifier.speech), made with save_pretrained: attn-parity hf checks all five
    layers, every row passing, the audio layer's window noted as exercised; the same model
    without an audio tower (audio_config null) checks the other four."""
    from golden.verifier import check as hf_check
    from tests.test_hf_import import FAMILIES as DECODERS
    from tests.hf_harness import BASE
    text = {**BASE, **DECODERS["gemma4_text"].kw}
    vision = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  intermediate_size=32, num_hidden_layers=2, patch_size=PATCH,
                  pooling_kernel_size=1, position_embedding_size=8, rope_parameters=dict(AXIAL))
    audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 subsampling_conv_channels=(4, 4), output_proj_dims=16,
                 attention_chunk_size=4, attention_context_left=5)
    towers = {"layer 0 (sliding_attention)", "layer 1 (full_attention)",
              "vision layer 0 (attention)", "vision layer 1 (attention)"}
    without = transformers.Gemma4Config(text_config=text, vision_config=vision)
    transformers.Gemma4ForConditionalGeneration(without).save_pretrained(tmp_path / "without")
    report = hf_check.run(tmp_path / "without", frameworks=["torch"], log=lambda row: None)
    assert {r["fixture"] for r in report["rows"]} == towers
    _assert_every_row_passes(report)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision,
                                       audio_config=audio)
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(tmp_path)
    report = hf_check.run(tmp_path, frameworks=["torch", "jax"], log=lambda row: None)
    assert not [n for n in report["checkpoint"]["notes"] if n.startswith("audio_config")]
    assert {r["fixture"] for r in report["rows"]} == towers | {"encoder layer 0 (attention)"}
    assert any(n.startswith("local attention in blocks of 4 (4 frames back, 0 ahead of a "
                            "block): exercised")
               for n in report["checkpoint"]["exercised"])
    _assert_every_row_passes(report)
    assert sum(r["implementation"] == "hf" and r["status"] == "pass"
               for r in report["rows"]) == 5
