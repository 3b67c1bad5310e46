"""The harness of tests/test_hf_import*.py: a tiny Hugging Face model of a family (float64,
random weights), its attention layers' inputs and outputs captured from the model's own
forward, and their state dicts as NumPy.

Shape legend: B batch, L tokens, D model width, N heads, Nkv key-value heads, Dh head width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers

B, L, D, N, NKV, DH = 2, 9, 16, 4, 2, 6
EXACT = 1e-12        # float64 against float64
FLOAT32_LEVEL = 1e-6  # relative: a float32 step inside HF (its RoPE angles, norms)


@dataclass(frozen=True)
class Family:
    """A tiny configuration of one family (``config`` the class, ``kw`` beyond the sizes),
    the layers to check (one of each kind), and HF's float32 steps besides RoPE's angles
    (None: none, so rope_precision="hf" agrees to EXACT)."""

    config: str
    kw: dict = field(default_factory=dict)
    layers: tuple = (0,)
    float32: str | None = None
    attention: str = "sdpa"  # eager's softmax is float32 in most families
    attention_of: Callable | None = None  # (model, layer) -> the attention module; default
    # model.layers[layer].self_attn
    output_of: Callable | None = None  # (model, layer) -> the module whose output is the
    # attention's, when not attention_of's (BERT: output.dense, before its residual LayerNorm)
    inputs: Callable | None = None  # (config, rng) -> the model's inputs (NumPy arrays) when
    # not input_ids alone (pixel_values, input_features, decoder_input_ids)
    model: str | Callable | None = None  # the transformers class (or config -> model), where
    # AutoModel does not take the config


BASE = dict(hidden_size=D, num_attention_heads=N, num_key_value_heads=NKV, head_dim=DH,
            intermediate_size=32, vocab_size=64, max_position_embeddings=64)


# The text towers of the vision-language models (multimodal RoPE): the rows
# of tests/test_hf_import.py (text only) and tests/test_mrope.py (an image's positions). Qwen2-VL's
# attention takes its head width as D / N whatever the config's head_dim says.
TEXT_TOWERS = {
    "qwen2_vl_text": Family("Qwen2VLTextConfig", dict(
        num_hidden_layers=1, hidden_size=N * DH,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [1, 1, 1]})),
    "qwen3_vl_text": Family("Qwen3VLTextConfig", dict(
        num_hidden_layers=1, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [1, 1, 1], "mrope_interleaved": True}),
        float32="Qwen3VLTextRMSNorm"),
    "qwen2_5_vl_text": Family("Qwen2_5_VLTextConfig", dict(
        num_hidden_layers=1, hidden_size=N * DH,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0,
                         "mrope_section": [2, 0, 1]})),
    "qwen3_vl_moe_text": Family("Qwen3VLMoeTextConfig", dict(
        num_hidden_layers=1, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [1, 1, 1], "mrope_interleaved": True}),
        float32="Qwen3VLMoeTextRMSNorm"),
    # GLM-4V: half of each head (D / N = 12) rotated, its pairs interleaved.
    "glm4v_text": Family("Glm4vTextConfig", dict(
        num_hidden_layers=1, hidden_size=N * 12, head_dim=12,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1]})),
    # Qwen3.5's full-attention layer (layer 1; layer 0 is Gated DeltaNet): Qwen3-Next's
    # attention, interleaved MRoPE on its rotary slice (4 of 6 features: pairs t, h).
    **{mt: Family(config, dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
        linear_value_head_dim=4, **moe,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.67, "mrope_section": [1, 1, 0]}),
        layers=(1,), float32=norm)
       for mt, config, norm, moe in [
           ("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5RMSNorm", {}),
           ("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeRMSNorm",
            dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                 shared_expert_intermediate_size=8))]},
    # The towers below each have a section whose layouts differ (chunked, Qwen3-VL's
    # interleaving, ERNIE's), so that an image's positions tell them apart.
    # Qwen2.5-Omni's thinker: Qwen2-VL's chunked MRoPE (its config's mrope_interleaved ignored,
    # as HF does) with the config's head width (6, not D / N); layer 1 sliding.
    "qwen2_5_omni_text": Family("Qwen2_5OmniTextConfig", dict(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [1, 2, 0], "mrope_interleaved": True}),
        layers=(0, 1), model="Qwen2_5OmniThinkerTextModel"),
    # Qwen3-Omni-MoE's thinker: Qwen3-VL's attention, interleaved whatever the config says;
    # its sliding_window is not read by HF's attention.
    "qwen3_omni_moe_text": Family("Qwen3OmniMoeTextConfig", dict(
        num_hidden_layers=1, head_dim=8, attention_bias=True, sliding_window=4, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [2, 1, 1]}),
        float32="Qwen3OmniMoeThinkerTextRMSNorm", model="Qwen3OmniMoeThinkerTextModel"),
    # GLM-4.5V: half of each head (20) rotated by default, rotate-half pairs, chunked.
    "glm4v_moe_text": Family("Glm4vMoeTextConfig", dict(
        num_hidden_layers=1, head_dim=20, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [2, 2, 1]})),
    # PaddleOCR-VL: biases on q, k, v and o, Qwen2-VL's chunked MRoPE.
    "paddleocr_vl_text": Family("PaddleOCRTextConfig", dict(
        num_hidden_layers=1, head_dim=8, use_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [2, 1, 1]}), model="PaddleOCRTextModel"),
    # ERNIE 4.5 VL: (s_h, s_w, s_t) = (2, 2, 1), pairs h w h w t, interleaved features; HF
    # turns q and k in float32.
    "ernie4_5_vl_moe_text": Family("Ernie4_5_VLMoeTextConfig", dict(
        num_hidden_layers=1, head_dim=10, use_bias=True, moe_num_experts=2, moe_k=1,
        moe_intermediate_size=[8, 8],
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "mrope_section": [2, 2, 1]}),
        float32="apply_rotary_pos_emb (q and k turned in float32)",
        model="Ernie4_5_VLMoeTextModel"),
}


def build_model(family, rng):
    """The tiny base model, float64, sdpa attention (or the family's), every parameter drawn
    N(0, 0.5²) (norm weights, biases and sinks included)."""
    config = getattr(transformers, family.config)(**{**BASE, **family.kw})
    config._attn_implementation = family.attention
    config._experts_implementation = "eager"  # the grouped kernels take no float64
    make = (transformers.AutoModel.from_config if family.model is None else
            family.model if callable(family.model) else getattr(transformers, family.model))
    model = make(config).double().eval()
    draw_parameters(model, rng)
    return config, model


def draw_parameters(model, rng):
    """Every parameter of the torch ``model`` drawn N(0, 0.5²) in place (norm weights, biases
    and sinks included)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))


def assert_gives_back(sd, back):
    """to_hf's state dict ``back`` holds exactly ``sd``'s keys, each array equal and a copy."""
    assert set(back) == set(sd)
    for name, a in sd.items():
        np.testing.assert_array_equal(back[name], a)
        assert not np.shares_memory(back[name], a)


def called_with(call, x):
    """(args, kwargs) of HF's attention as its model called it (``call``), x in place of its
    input (``hidden_states``, by keyword or first)."""
    args, kwargs = call
    if "hidden_states" in kwargs:
        return args, dict(kwargs, hidden_states=x)
    return (x,) + tuple(args[1:]), kwargs


def attention_of(family, model, i):
    """Layer i's attention module (the family's attention_of, else model.layers[i].self_attn)."""
    if family.attention_of is not None:
        return family.attention_of(model, i)
    return model.layers[i].self_attn


def captured(family, model, layers, ids, *, calls=None, **kw):
    """Each layer's attention input (B, L, D) and output, from one forward of the model on
    token ids ``ids`` (or on ``ids`` a dict of the model's inputs, NumPy arrays; ``kw`` to the
    model: attention_mask, position_ids, ...); a cross-attention's entry adds its context
    (B, Lc, D), the key_value_states it was called with. The output is the output_of module's
    when the family names one. ``calls``, a dict, also receives each layer's (args, kwargs) of
    the call, to call it again."""
    seen, inputs = {}, {}

    def read(i):
        def record(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            context = kwargs.get("key_value_states")
            inputs[i] = (x,) if context is None else (x, context)
            if calls is not None:
                calls[i] = (args, dict(kwargs))
        return record

    def write(i):
        def record(module, args, output):
            y = output if isinstance(output, torch.Tensor) else output[0]
            x, *context = (a.detach().numpy().copy() for a in inputs[i])
            seen[i] = (x, y.detach().numpy().copy(), *context)
        return record

    handles = []
    for i in layers:
        attention = attention_of(family, model, i)
        handles.append(attention.register_forward_pre_hook(read(i), with_kwargs=True))
        out = attention if family.output_of is None else family.output_of(model, i)
        handles.append(out.register_forward_hook(write(i)))
    if not isinstance(ids, dict):
        ids = {"input_ids": ids}
    try:
        with torch.no_grad():
            model(**{n: torch.from_numpy(a) for n, a in ids.items()}, **kw)
    finally:
        for h in handles:
            h.remove()
    return seen


def state_dict(module):
    return {n: t.detach().numpy().copy() for n, t in module.state_dict().items()}


def rel(actual, expected):
    return float(np.abs(actual - expected).max() / np.abs(expected).max())




def undone(variant, ours, params, change):
    """Our configuration with ``change`` applied (None removes a setting; a new RoPE keeps the
    old rotary fraction; a rotary fraction in ``change`` replaces the one inside
    rope_parameters), and the parameters it still has a place for: what a family's distinctive
    setting undone computes."""
    from golden.specification import variants

    changed = {n: v for n, v in {**ours, **change}.items() if v is not None}
    rope = ours.get("rope_parameters", {})
    if "rope_parameters" in change and "partial_rotary_factor" in rope:
        changed["rope_parameters"] = dict(change["rope_parameters"],
                                          partial_rotary_factor=rope["partial_rotary_factor"])
    if "partial_rotary_factor" in change:
        changed["rope_parameters"] = {k: v for k, v in rope.items()
                                      if k != "partial_rotary_factor"}
    assert changed != dict(ours), change
    shapes = variants.VARIANTS[variant].shapes(variants.VARIANTS[variant].config(changed))
    return changed, {n: a for n, a in params.items() if n in shapes}


def assert_each_undone_moves_the_output(family, config, model, changes, rng, seed):
    """For each (layer, change) of ``changes``: the layer converted by from_hf, the change
    undone (``undone``), and the torch twin's float64 output on the layer's captured input
    must differ from HF's captured output by more than 10³ × FLOAT32_LEVEL relative: the
    family's distinctive setting is one the agreement tests would see."""
    import golden.convert
    from tests.helpers import TWINS

    twin = TWINS["torch"]
    layers = {layer for layer, _ in changes}
    seen = captured(family, model, layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    for layer, change in changes:
        x, expected = seen[layer]
        variant, ours, params = golden.convert.from_hf(
            config, state_dict(attention_of(family, model, layer)), layer_idx=layer)
        changed, kept = undone(variant, ours, params, change)
        with twin.float64():
            module = twin.build(variant, changed, kept)
            module.eval()
            out = twin.numpy(module(twin.array(x)))
        assert rel(out, expected) > 1e3 * FLOAT32_LEVEL, (layer, change, seed)


def shared_indexer_case(family, rng, beside=lambda model: {}):
    """(variant, ours, params, x, expected, chosen) of layer 1 of ``family``'s tiny model with
    indexer_types ["full", "shared"] (GLM-5's, HY-V4's, Mistral Large 4's): layer 1 has no
    indexer and attends the keys layer 0 chose, which HF passes it as prev_topk_indices
    (``chosen``, int32); converted by from_hf from its state dict plus ``beside(model)`` (the
    model's arrays beside the layers: Mistral Large 4's RoPE scales), checked to be
    index_select "given" with no indexer arrays; x and expected its captured input and
    output."""
    import golden.convert

    family = Family(family.config, dict(family.kw, num_hidden_layers=2,
                                        indexer_types=["full", "shared"]),
                    attention=family.attention)
    config, model = build_model(family, rng)
    calls = {}
    x, expected = captured(family, model, (1,), rng.integers(0, BASE["vocab_size"], (B, L)),
                           calls=calls)[1]
    chosen = calls[1][1]["prev_topk_indices"].numpy().astype(np.int32)
    sd = {**state_dict(attention_of(family, model, 1)), **beside(model)}
    variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=1)
    assert ours["index_select"] == "given" and not any("index" in n for n in params)
    return variant, ours, params, x, expected, chosen


# ---- Hugging Face's DeepSeek-V3.2 attention with its learned indexer (issue 44) --------------

INDEXER_CONFIG = dict(d_in=6, num_heads=3, kv_lora_rank=4, qk_nope_head_dim=2,
                      qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=7, rope_theta=100.0,
                      index_heads=4, index_head_dim=6)
INDEXER_HF_NAMES = {  # ours: HF's, weights (out, in) there, (in, out) here
    "W_q_a": "q_a_proj.weight", "W_q_b": "q_b_proj.weight",
    "W_kv_a": "kv_a_proj_with_mqa.weight", "W_kv_b": "kv_b_proj.weight",
    "W_out": "o_proj.weight", "W_index_q": "indexer.wq_b.weight",
    "W_index_k": "indexer.wk.weight", "W_index_weights": "indexer.weights_proj.weight"}
INDEXER_HF_VECTORS = {"q_a_norm": "q_a_layernorm.weight", "kv_a_norm": "kv_a_layernorm.weight",
                      "index_k_norm": "indexer.k_norm.weight",
                      "index_k_norm_bias": "indexer.k_norm.bias"}


def indexer_hf_case(seed, topk=5):
    """(layer, config, params): Hugging Face's DeepseekV32Attention (float64, eval; every
    weight drawn N(0, 1/in) after torch.manual_seed(seed); its RMSNorms' float32 step replaced
    by the same formula in float64), and the same layer as ours, MultiHeadLatentAttention's
    arguments (INDEXER_CONFIG, index_topk = ``topk``) and its parameters in the neutral layout
    (NumPy float64, moved from the layer's state dict by hand: no from_hf for deepseek_v32
    yet). The layer is called as layer(x, (cos, sin), mask (B, 1, L, L) bool), cos and sin
    (B, L, qk_rope_head_dim) in HF's rotate-half layout (indexer_hf_rope)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    c = INDEXER_CONFIG
    config = hf.DeepseekV32Config(
        hidden_size=c["d_in"], num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_heads"], q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], index_topk=topk,
        index_head_dim=c["index_head_dim"], index_n_heads=c["index_heads"], num_hidden_layers=1,
        vocab_size=16, intermediate_size=8, moe_intermediate_size=4, n_routed_experts=2,
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layer = hf.DeepseekV32Attention(config, 0).double().eval()
    with torch.no_grad():
        for t in layer.parameters():
            t.copy_(torch.randn_like(t) / math.sqrt(t.shape[-1] if t.ndim == 2 else 1))
    for norm in (layer.q_a_layernorm, layer.kv_a_layernorm):  # HF's RMSNorm is float32 inside:
        norm.forward = lambda h, n=norm: n.weight * h * torch.rsqrt(  # the same sum in float64
            h.pow(2).mean(-1, keepdim=True) + n.variance_epsilon)
    sd = state_dict(layer)
    params = {n: sd[h].T.copy() for n, h in INDEXER_HF_NAMES.items()}
    params.update({n: sd[h].copy() for n, h in INDEXER_HF_VECTORS.items()})
    return layer, {**c, "index_topk": topk}, params


def indexer_hf_rope(config, length, batch):
    """HF's position_embeddings (cos, sin), each (B, L, r) float64, made from ours
    (golden.reference.rotary.rope_cos_sin, exact) at positions 0 … L − 1, in its rotate-half
    layout [c | c]."""
    from golden.reference.rotary import rope_cos_sin
    from golden.specification import variants

    c = variants.get("multi_head_latent_attention").config(config)
    cos, sin = rope_cos_sin(variants.latent_rope(c), c["qk_rope_head_dim"], np.arange(length))
    return tuple(torch.tensor(np.concatenate([a, a], -1)[None].repeat(batch, 0))
                 for a in (cos, sin))
