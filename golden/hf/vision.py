"""Vision towers with axial 2-D RoPE: each patch's row and column turn its own sections of the
head's pairs (rope_type "axial", golden.specification.positions). Bidirectional multi-head
attention, scale Dh^−1/2, one ``FAMILIES`` entry per tower:

  Qwen-VL and their kin   ``qkv`` fused in thirds [q; k; v] (or ``q``, ``k``, ``v``), ``proj``;
                          Dh = width / heads whatever head_dim says; "shared" frequencies
                          θ^(−4m/Dh), rotate-half over the whole head; rows (h, w)
  Pixtral                 ``q_proj`` … ``o_proj`` without biases; the 1-D frequencies dealt to
                          rows and columns in turn ("split"); rows (h, w)
  Llama 4's vision model  ``q_proj`` … ``o_proj`` with biases; "shared" frequencies on
                          interleaved pairs (2i, 2i + 1); rows (column + 1, row + 1), and the
                          class token, last, at (0, 0) (its angle 0)
  Gemma 4's vision tower  ``q_proj.linear`` … ``o_proj.linear`` without biases, GQA, RMSNorm of
                          q and k (weight w), of v (no weight), scale 1; "shared" frequencies,
                          each axis rotate-half in its own half of the head ("blocks"); rows
                          its pixel_position_ids (x, y): (column, row)
  DINOv3's ViT            ``q_proj`` … ``o_proj``, biases on q, v and o (its key_bias False:
                          our b_key zeros, which to_hf leaves out and refuses non-zero); "shared"
                          frequencies, rotate-half over the head, each axis's scaled
                          (axial_scale 2π/H, 2π/W); rows ``dinov3_positions``: the class token
                          and registers first at (0, 0), then each patch's centre as the integers
                          (2i + 1 − H, 2j + 1 − W)

DINOv3's angles: HF turns patch (i, j) of an H × W grid by 2π · c · f_m, c = 2(i + 0.5)/H − 1 =
(2i + 1 − H)/H (columns alike), f_m = θ^(−4m/Dh): our integer position 2i + 1 − H (odd or even,
negative in the top half) times f_m · 2π/H. H and W are the image's (HF takes them from
pixel_values' shape), so the scale is the converted config's: from_hf reads them from its
image_size and patch_size; for an image of another size convert a config whose image_size is
that image's. Training's coordinate augmentation (pos_embed_shift, jitter, rescale) is off in
eval, as here. Its prefix tokens (class, ``num_register_tokens`` registers) are not turned: at
(0, 0) every angle is 0, cos 1 and sin 0 exactly.

The call takes the tower's own order: x (B, L, D) with one image per batch row (or images
packed in a row under a block-diagonal ``mask``, Hugging Face's ``cu_seqlens``), positions
(2, B, L) as the model makes them (``get_vision_position_ids`` for Qwen-VL, the patch's row and
column for Pixtral). Qwen2.5-VL's and Qwen3-VL's windowed layers (those not in
``fullatt_block_indexes``) are the same attention over the window order, with the windows'
block-diagonal mask (``cu_window_seqlens``): the caller's mask, not a setting.

HF's float32 steps: the angles (positions times a float32 inv_freq, cos and sin in float32,
as every RoPE of HF's), and Qwen-VL's and Llama 4's rotation itself (q and k cast to float32,
turned, cast back): against a float64 model the level is float32's.

Shape legend: D (= d_in) the tower's width, N heads, Dh head width.
"""

from __future__ import annotations

import math

import numpy as np

from golden.hf.family import (GQA, LLAMA_NAMES, ROLES, ROOT, Family, Stack, _bias_flags, _dropout,
                              _linears_to_neutral, _neutral_to_linears, _read)
from golden.hf.fused import _fused_family
from golden.specification.mapping import _numpy

QWEN_SEPARATE = {"query": "q", "key": "k", "value": "v", "out": "proj"}


def _axial_rope(c, mt, **fields) -> dict:
    """Our axial rope_parameters from the tower's (θ, inside since transformers 5, or at the top
    of an older config.json); a rope_type HF's tower would not build is refused."""
    given = dict(c.get("rope_parameters") or {})
    kind = given.get("rope_type", "axial")
    if kind not in ("axial", "default"):
        raise ValueError(f"model_type {mt!r}: rope_parameters['rope_type'] should be 'axial' "
                         f"(a vision tower's 2-D RoPE), got {kind!r}")
    theta = given.get("rope_theta", c.get("rope_theta"))
    if theta is None:
        raise ValueError(f"model_type {mt!r}: the config has no rope_theta (in rope_parameters "
                         f"or at its top)")
    return {"rope_type": "axial", "rope_theta": float(theta), **fields}


def _sizes(c, mt, width, heads) -> dict:
    d, n = int(c[width]), int(c[heads])
    if d % n:
        raise ValueError(f"model_type {mt!r}: {width} = {d} should be a multiple of {heads} = "
                         f"{n}")
    return dict(d_in=d, num_heads=n, num_kv_heads=n, head_dim=d // n, causal=False)


def _qwen_settings(mt, width):
    """A Qwen-VL-like tower's settings (sizes from ``width`` and num_heads, axial RoPE)."""
    def settings(c, layer_idx):
        ours = _sizes(c, mt, width, "num_heads")
        ours["rope_parameters"] = _axial_rope(c, mt)
        return _dropout(c, ours)
    return settings


def _qwen_fused(mt, model, width="hidden_size") -> Family:
    """Qwen2-VL's VisionAttention and its descendants: ``qkv`` in thirds, ``proj``, at
    ``blocks.N.attn`` of the vision model ``model`` ("module.Class" in transformers.models)."""
    return _fused_family(mt, _qwen_settings(mt, width), "thirds", "qkv", "proj",
                         stacks=(Stack("blocks", "attn", label="vision"),), model_class=model,
                         position_axes=2)


def _separate(mt, names, settings, stacks, **family) -> Family:
    """A tower with one nn.Linear per role, ``names`` the role's module names (``family``: the
    Family's other fields)."""
    def our_settings(c, layer_idx, sd):
        ours = settings(c, layer_idx)
        ours.update(_bias_flags(sd, names, mt))
        return ours
    family = {"position_axes": 2, **family}
    return Family(GQA, our_settings, lambda sd, ours: _linears_to_neutral(sd, names, mt),
                  lambda params, ours: _neutral_to_linears(params, names), stacks=stacks,
                  **family)


def _pixtral(c, layer_idx):
    ours = _sizes(c, "pixtral", "hidden_size", "num_attention_heads")  # HF: D / N, always
    ours["rope_parameters"] = _axial_rope(c, "pixtral", axial_frequencies="split")
    return _dropout(c, ours)


def _llama4_vision(c, layer_idx):
    ours = _sizes(c, "llama4_vision_model", "hidden_size", "num_attention_heads")
    ours["rope_parameters"] = _axial_rope(c, "llama4_vision_model")
    ours["rope_interleaved"] = True  # HF's complex product on (2i, 2i + 1)
    return _dropout(c, ours)


GEMMA4_NAMES = {"query": "q_proj.linear", "key": "k_proj.linear", "value": "v_proj.linear",
                "out": "o_proj.linear"}


def _gemma4_vision(c, layer_idx):
    mt = "gemma4_vision"
    if c.get("use_clipped_linears"):
        raise ValueError(f"model_type {mt!r}: use_clipped_linears = True is not supported (its "
                         f"projections clamp their inputs and outputs to stored bounds, which "
                         f"no option of ours does)")
    n = int(c["num_attention_heads"])
    dh = c.get("head_dim") or c["hidden_size"] // n
    ours = dict(d_in=int(c["hidden_size"]), num_heads=n,
                num_kv_heads=int(c.get("num_key_value_heads") or n), head_dim=int(dh),
                causal=False, scale=1.0, qk_norm="rms",
                qk_norm_eps=float(c.get("rms_norm_eps", 1e-6)), v_norm=True,
                rope_parameters=_axial_rope(c, mt, axial_pairs="blocks"))
    return _dropout(c, ours)


def _gemma4_vision_family() -> Family:
    """Gemma 4's vision attention: GEMMA4_NAMES' projections (no biases: HF's clippable linears
    have none), its q_norm and k_norm weights (Dh,)."""
    mt = "gemma4_vision"

    def settings(c, layer_idx, sd):
        ours = _gemma4_vision(c, layer_idx)
        ours.update(_bias_flags(sd, GEMMA4_NAMES, mt))
        return ours

    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, GEMMA4_NAMES, mt)
        params.update(q_norm=_read(sd, "q_norm.weight", mt), k_norm=_read(sd, "k_norm.weight", mt))
        return params

    def from_neutral(params, ours):
        sd = _neutral_to_linears(params, GEMMA4_NAMES)
        sd["q_norm.weight"], sd["k_norm.weight"] = (np.array(params[n])
                                                    for n in ("q_norm", "k_norm"))
        return sd

    return Family(GQA, settings, to_neutral, from_neutral,
                  stacks=(Stack("encoder.layers", "self_attn", label="vision"),),
                  position_axes=2)


DINOV3 = "dinov3_vit"


def dinov3_positions(h, w, prefix) -> np.ndarray:
    """(2, prefix + h·w) int64: the positions of DINOv3's tokens for an image of h × w patches,
    in the model's order: its ``prefix`` = 1 + num_register_tokens tokens (class token, then
    registers) at (0, 0), then the patches row-major, patch (i, j) at (2i + 1 − h, 2j + 1 − w),
    its centre's coordinates times h and w. Give the module (2, B, L), this broadcast over B,
    with the rope_parameters from_hf makes for h × w (axial_scale 2π/h, 2π/w)."""
    rows, cols = np.meshgrid(2 * np.arange(h) + 1 - h, 2 * np.arange(w) + 1 - w, indexing="ij")
    patches = np.stack([rows.reshape(-1), cols.reshape(-1)])  # (2, h·w)
    return np.concatenate([np.zeros((2, prefix), np.int64), patches], axis=1).astype(np.int64)


def _pair(c, name, mt) -> tuple:
    """A config field given as an int or a pair (height, width), as a pair of ints ≥ 1."""
    value = c.get(name)
    pair = (value, value) if isinstance(value, int) else tuple(value or ())
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                 for v in pair):
        raise ValueError(f"model_type {mt!r}: {name} should be an int ≥ 1 or a pair of them "
                         f"(height, width), got {value!r}")
    return pair


def _dinov3(c, layer_idx, sd):
    """DINOv3's settings: D / N heads, bidirectional, axial RoPE scaled by 2π/H and 2π/W (H × W
    the patches of config's image_size), q and v biases both or neither, no k bias."""
    mt = DINOV3
    (ih, iw), (ph, pw) = _pair(c, "image_size", mt), _pair(c, "patch_size", mt)
    h, w = ih // ph, iw // pw
    if h < 1 or w < 1:
        raise ValueError(f"model_type {mt!r}: image_size {(ih, iw)} should hold at least one "
                         f"patch {(ph, pw)} a side, got {h} × {w} patches")
    ours = _sizes(c, mt, "hidden_size", "num_attention_heads")
    ours["rope_parameters"] = _axial_rope(c, mt, axial_scale=[2 * math.pi / h, 2 * math.pi / w])
    has = {role: f"{LLAMA_NAMES[role]}.bias" in sd for role in ROLES}
    if has["key"]:
        raise ValueError(f"model_type {mt!r}: k_proj should have no bias (key_bias = False), got "
                         f"k_proj.bias")
    if has["query"] != has["value"]:
        raise ValueError(f"model_type {mt!r}: q_proj and v_proj should both have a bias or "
                         f"neither, got q_proj: {has['query']}, v_proj: {has['value']}")
    ours.update(qkv_bias=has["query"], out_bias=has["out"])
    return _dropout(c, ours)


def _dinov3_to_neutral(sd, ours):
    params = _linears_to_neutral(sd, LLAMA_NAMES, DINOV3)
    if ours["qkv_bias"]:  # its k_proj has none: zeros (k + 0 = k exactly)
        params["b_key"] = np.zeros(params["W_key"].shape[1], params["W_key"].dtype)
    return params


def _dinov3_from_neutral(params, ours):
    """The state dict without b_key: refused unless zeros (under RoPE a key bias changes the
    scores, and DINOv3's k_proj has no bias to hold it)."""
    if "b_key" in params and np.any(_numpy(params["b_key"]) != 0):
        raise ValueError(f"model_type {DINOV3!r}: b_key should be zeros (k_proj has no bias; "
                         f"under RoPE a key bias changes the scores), got a non-zero b_key")
    return _neutral_to_linears({n: a for n, a in params.items() if n != "b_key"}, LLAMA_NAMES)


FAMILIES: dict[str, Family] = {
    "qwen2_vl_vision": _qwen_fused(
        "qwen2_vl_vision", "qwen2_vl.Qwen2VisionTransformerPretrainedModel", width="embed_dim"),
    **{mt: _qwen_fused(mt, model) for mt, model in (
        ("qwen2_5_vl_vision", "qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel"),
        ("qwen3_vl_vision", "qwen3_vl.Qwen3VLVisionModel"),
        ("qwen3_vl_moe_vision", "qwen3_vl_moe.Qwen3VLMoeVisionModel"),
        ("qwen3_5_vision", "qwen3_5.Qwen3_5VisionModel"),
        ("qwen3_5_moe_vision", "qwen3_5_moe.Qwen3_5MoeVisionModel"),
        ("qwen3_omni_moe_vision_encoder", "qwen3_omni_moe.Qwen3OmniMoeVisionEncoder"),
        ("glm4v_vision", "glm4v.Glm4vVisionModel"),
        ("glm4v_moe_vision", "glm4v_moe.Glm4vMoeVisionModel"),
        ("ernie4_5_vl_moe_vision",
         "ernie4_5_vl_moe.Ernie4_5_VLMoeVisionTransformerPretrainedModel"))},
    "qwen2_5_omni_vision_encoder": _separate(
        "qwen2_5_omni_vision_encoder", QWEN_SEPARATE,
        _qwen_settings("qwen2_5_omni_vision_encoder", "hidden_size"),
        (Stack("blocks", "attn", label="vision"),),
        model_class="qwen2_5_omni.Qwen2_5OmniVisionEncoder"),
    "pixtral": _separate("pixtral", LLAMA_NAMES, _pixtral,
                         (Stack("transformer.layers", "attention", label="vision"),)),
    "llama4_vision_model": _separate("llama4_vision_model", LLAMA_NAMES, _llama4_vision,
                                     (Stack("model.layers", "self_attn", label="vision"),),
                                     model_class="Llama4VisionModel"),
    "gemma4_vision": _gemma4_vision_family(),
    DINOV3: Family(GQA, _dinov3, _dinov3_to_neutral, _dinov3_from_neutral,
                   {"key_bias": ((False, None), "our q, k and v biases are all or none; DINOv3's "
                                 "k_proj has none, held as zeros")},
                   stacks=(Stack("layer", "attention", label="vision"),), position_axes=2),
}

# Towers we do not convert, with why: from_hf names the reason.
REFUSED: dict[str, str] = {
    "step3p7": "Step 3.7's checkpoint is a composite whose text tower is Step 3.5's: pass its "
               "text_config (model_type 'step3p5', converted); attn-parity hf does not read "
               "step3p7 checkpoints (save_pretrained writes its text layers at model.layers.N "
               "beside its vision model's model.vision_model.layers.N, a kind we do not "
               "convert)"}

# Vision-language checkpoints, tower by tower: {model_type: {sub-config: key prefix}} (the
# text tower's layers.N.self_attn under any prefix: "model." as save_pretrained writes it,
# "model.language_model." in transformers 5's own layout).
COMPOSITES: dict[str, dict[str, str]] = {
    **{mt: {"text_config": "", "vision_config": "visual."}
       for mt in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                  "glm4v", "glm4v_moe")},
    # Gemma 4: its audio tower (audio_config, gemma4_audio) too, where the model has one
    "gemma4": {"text_config": "language_model.", "vision_config": "vision_tower.",
               "audio_config": "audio_tower."},
    # Gemma 3n: its text and audio towers (its vision tower, a timm MobileNet, is not attention
    # we convert: noted)
    "gemma3n": {"text_config": "language_model.", "audio_config": "audio_tower."},
    # LLaVA and its kin (issue 42; their vision_config any AutoConfig): the text tower under
    # "language_model." (save_pretrained's "language_model.model.layers.N", transformers 5's
    # "model.language_model.layers.N"), the vision tower under "vision_tower." (CLIP's and
    # SigLIP's "vision_tower.vision_model.encoder.layers.N" as released checkpoints have it,
    # "vision_tower.encoder.layers.N" as save_pretrained writes it; Pixtral's
    # "vision_tower.transformer.layers.N"). A vision tower of a kind we do not convert (FastVLM's
    # and Perception LM's timm models) is not read, and attn-parity hf's notes say so
    # (golden.verifier.layout.unread_towers). PaliGemma's text tower is refused at its layers:
    # its config makes its Gemma bidirectional (use_bidirectional_attention, which gemma refuses)
    **{mt: {"text_config": "language_model.", "vision_config": "vision_tower."}
       for mt in ("llava", "llava_next", "llava_next_video", "llava_onevision", "vipllava",
                  "mistral3", "aya_vision", "paligemma", "fast_vlm", "perception_lm",
                  "cohere2_vision")},
    "lighton_ocr": {"text_config": "language_model.", "vision_config": "vision_encoder."},
    # DeepSeek-VL's SigLIP tower at "model.vision_model.encoder.layers.N"
    "deepseek_vl": {"text_config": "language_model.", "vision_config": "vision_model."},
    # The text tower alone, its vision tower's config a class of its own that we do not convert
    # (noted): under "language_model.": InternVL, GOT-OCR 2, Janus (and its VQ-VAE), Ovis 2,
    # VideoLLaMA 3, Qianfan-OCR, Kimi K2.5 (a DeepSeek-V3 text tower), EXAONE 4.5; at
    # "model.text_model.layers.N": Idefics 2 / 3 and SmolVLM (Idefics 2's perceiver resampler,
    # "connector.perceiver_resampler.layers.N.self_attn", is not read)
    **{mt: {"text_config": "language_model."}
       for mt in ("internvl", "got_ocr2", "janus", "ovis2", "video_llama_3", "qianfan_ocr",
                  "kimi_k25", "exaone4_5")},
    **{mt: {"text_config": "text_model."} for mt in ("idefics2", "idefics3", "smolvlm")},
    # Issue 44's learned-selection models: Mistral Large 4 (a Pixtral vision tower), MiniMax M3
    # and dots.3-note (vision towers of their own, and dots.3-note's audio tower: noted), Qwen4-
    # Exp (Qwen3.5's layout; its vision tower noted)
    "mistral_large4": {"text_config": ROOT},  # its files: Mistral's layout, layers.N.attention
    "minimax_m3_vl": {"text_config": "language_model."},
    "dots3_note": {"text_config": ROOT},  # its text layers at model.layers.N
    "qwen4_exp": {"text_config": ""},
}
# Why a composite's tower of a converted kind is not read, where the general reason ("its
# attention is not converted") would mislead: {(model_type, sub-config): why}.
UNREAD_TOWERS: dict[tuple[str, str], str] = {
    ("mistral_large4", "vision_config"): "its Pixtral tower is saved in Mistral's own layout "
                                         "(vision_encoder.transformer.layers.N.attention.wq), "
                                         "which is not read",
}
# Towers a composite's config may leave out (null): Gemma 4's audio encoder (only some Gemma 4
# models have one).
OPTIONAL_TOWERS: dict[str, tuple[str, ...]] = {"gemma4": ("audio_config",)}
