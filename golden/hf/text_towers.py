"""The text towers of vision-language models whose RoPE is multimodal (MRoPE: positions (3, B,
L), each pair of features turned by one axis): Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and MoE),
GLM-4V (and MoE), Qwen2.5-Omni's and Qwen3-Omni's thinkers, PaddleOCR-VL, ERNIE 4.5 VL. Each is a
settings function for golden.hf.decoders' ``_llama_like`` entries: the layout of its sections,
the rope types and windows HF's model takes.
"""

from __future__ import annotations

from golden.hf.family import _layer_type, _no_window, _qwen3, _whole_head


def _mrope(section, interleaved, temporal_last=False):
    """Multimodal RoPE of a vision-language model's text tower: ``mrope_section`` from the
    config's rope_parameters, or the family's default when it has none (HF's rotary embedding
    falls back to it: Qwen2-VL [16, 24, 24], Qwen3-VL [24, 20, 20]); the layout is the family's
    whatever the config says (HF's Qwen3-VL always interleaves, Qwen2-VL never). With
    ``temporal_last`` (ERNIE 4.5 VL) the config lists its section in the order of its pairs,
    (s_h, s_w, s_t): kept as ours, (s_t, s_h, s_w)."""

    def extra(c, layer_idx, ours):
        # A config.json of before transformers 5 keeps θ at the top and the section in
        # rope_scaling ({"type": "mrope", "mrope_section": ...}).
        given = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if "rope_parameters" not in ours:
            ours["rope_parameters"] = {"rope_theta": ours.pop("rope_theta")}
        rope = ours["rope_parameters"]
        rope["mrope_section"] = list(given.get("mrope_section", section))
        if interleaved:
            rope["mrope_interleaved"] = True
        if temporal_last:
            rope["mrope_section"] = rope["mrope_section"][2:] + rope["mrope_section"][:2]
            rope["mrope_temporal_last"] = True
    return extra


def _qwen2_vl_text(c, layer_idx, ours):
    ours["head_dim"] = c["hidden_size"] // c["num_attention_heads"]  # HF's attention's, always
    _mrope([16, 24, 24], False)(c, layer_idx, ours)


def _glm4v_text(c, layer_idx, ours):
    ours["head_dim"] = c["hidden_size"] // c["num_attention_heads"]  # HF's attention's, always
    ours["rope_interleaved"] = True  # GLM's pairs (2i, 2i + 1), on its rotary slice
    _mrope([8, 12, 12], False)(c, layer_idx, ours)


def _qwen3_vl_text(c, layer_idx, ours):
    _qwen3(c, layer_idx, ours)
    _mrope([24, 20, 20], True)(c, layer_idx, ours)


def _qwen2_5_omni_text(c, layer_idx, ours):
    """Qwen2.5-Omni's thinker: Qwen2-VL's chunked MRoPE, but the config's head_dim (D / N
    without one), and HF's Qwen2 rule for its sliding layers: with use_sliding_window, those
    of layer_types, or (a config.json listing none) the layers from max_window_layers on."""
    mt = "qwen2_5_omni_text"
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    kind = _layer_type(c, layer_idx)
    if kind is None:
        kind = ("sliding_attention" if layer_idx >= c.get("max_window_layers", 28)
                else "full_attention")
    _no_window(ours)
    if kind == "sliding_attention" and window is not None:
        ours["sliding_window"] = int(window)
    _mrope([16, 24, 24], False)(c, layer_idx, ours)
    _whole_head(mt, ours)


def _qwen3_omni_moe_text(c, layer_idx, ours):
    """Qwen3-Omni-MoE's thinker: Qwen3-VL's attention (per-head QK RMSNorm, interleaved MRoPE
    [24, 20, 20] by default); its config's sliding_window is not read by its attention."""
    _qwen3(c, layer_idx, ours)
    _no_window(ours)
    _mrope([24, 20, 20], True)(c, layer_idx, ours)
    _whole_head("qwen3_omni_moe_text", ours)


def _glm4v_moe_text(c, layer_idx, ours):
    """GLM-4.5V's text tower: GLM-4V's chunked MRoPE ([8, 12, 12]) on half of each head by
    default (HF's config sets partial_rotary_factor 0.5 when neither rope_parameters nor the
    config gives one), but rotate-half pairs, unlike GLM-4V's, and the config's head_dim."""
    _no_window(ours)
    _mrope([8, 12, 12], False)(c, layer_idx, ours)
    rope = ours["rope_parameters"]
    if "partial_rotary_factor" not in rope:
        top = c.get("partial_rotary_factor")
        rope["partial_rotary_factor"] = 0.5 if top is None else top


def _paddleocr_vl_text(c, layer_idx, ours):
    """PaddleOCR-VL's ERNIE-4.5-0.3B text tower: q/k/v/o biases (use_bias), Qwen2-VL's chunked
    MRoPE [16, 24, 24]; head_dim 128 when the config has none (HF's class default; D / N
    when it is null); no window and an attention dropout of 0 whatever the config says."""
    mt = "paddleocr_vl_text"
    dh = c.get("head_dim", 128)
    ours["head_dim"] = c["hidden_size"] // c["num_attention_heads"] if dh is None else dh
    _no_window(ours, fixed_dropout=True)
    _mrope([16, 24, 24], False)(c, layer_idx, ours)
    _whole_head(mt, ours)


def _ernie4_5_vl_text(c, layer_idx, ours):
    """ERNIE 4.5 VL's text tower: interleaved pairs (2i, 2i + 1), MRoPE with the height and
    width pairs alternating first and the temporal ones last (mrope_section (s_h, s_w, s_t) in
    HF's config, [22, 22, 20] by default, s_h = s_w), the default rope_type only (HF's rotary
    embedding raises on another); no window and an attention dropout of 0 whatever the config
    says."""
    mt = "ernie4_5_vl_moe_text"
    _no_window(ours, fixed_dropout=True)
    ours["rope_interleaved"] = True
    _mrope([22, 22, 20], True, temporal_last=True)(c, layer_idx, ours)
    rope = ours["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"model_type {mt!r}: rope_parameters['rope_type'] = "
                         f"{rope['rope_type']!r} is not supported (HF's ERNIE 4.5 VL takes "
                         f"'default' only)")
    _whole_head(mt, ours)
    section = rope["mrope_section"]
    if len(section) == 3 and section[1] != section[2]:
        raise ValueError(f"model_type {mt!r}: rope_parameters['mrope_section'] = "
                         f"{section[1:] + section[:1]} is not supported (HF's ERNIE 4.5 VL "
                         f"alternates height and width pairs: their sections should be equal)")
