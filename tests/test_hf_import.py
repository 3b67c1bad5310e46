"""golden.convert.from_hf and to_hf (issue 25) on tiny Hugging Face models of each family:
random weights (biases and norm weights too), float64, sdpa attention (eager's softmax is
float32 in most families); each attention layer's
input and output are captured from the model's own forward (so its real masks, positions and
layer kinds are used), the layer's state dict converted, and our twins run on the captured
input must give the captured output. A round trip to_hf(from_hf(...)) gives back the very
arrays; unsupported settings are named.

Where the agreement is bounded: HF computes RoPE's angles in float32 (inv_freq and the
position × frequency product), and some families' norms in float32. With
``rope_precision="hf"`` our module reproduces HF's float32 angles and agrees to float64 level
where nothing else is float32; with the default "exact" angles the agreement is float32's
(FLOAT32_LEVEL), each family's float32 steps named in FAMILIES.

Shape legend: B batch, L tokens, D model width, N heads, Nkv key-value heads, Dh head width.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

import golden.convert
import golden.hf
from golden.hf import FAMILIES as SUPPORTED
from tests.helpers import TWINS, fresh_rng, kind, sweep

transformers = pytest.importorskip("transformers")

from tests.hf_harness import (  # noqa: E402
    BASE,
    EXACT,
    FLOAT32_LEVEL,
    TEXT_TOWERS,
    B,
    Family,
    L,
    N,
    assert_each_undone_moves_the_output,
    attention_of,
    build_model,
    captured,
    rel,
    shared_indexer_case,
    state_dict,
)

YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
        "original_max_position_embeddings": 4, "beta_fast": 8.0, "beta_slow": 1.0}
MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
SLIDING_FULL = dict(num_hidden_layers=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"])
# longrope past original_max_position_embeddings (4 < L)
LONGROPE = {"rope_type": "longrope", "rope_theta": 100.0, "original_max_position_embeddings": 4,
            "long_factor": [3.0, 5.0, 7.0]}
PER_TYPE_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                 "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}


def _csm_backbone(config):
    """Sesame CSM's backbone (CsmBackboneModel) taking text tokens (B, L): its own embedding
    sums a frame's codebook tokens (B, L, K); the attention layers are what is tested."""
    model = transformers.CsmBackboneModel(config)
    model.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    return model


# Issue 42's decoders: each attention a supported one's after mapping config fields; every
# window shorter than L, MoE configs as small as HF builds them.
DECODERS_42 = {
    # OLMo hybrid: its softmax layer (layer 1; layer 0 Gated DeltaNet, tests/
    # test_hf_import_linear.py), OLMo 2's norms over all heads
    "olmo_hybrid": Family("OlmoHybridConfig", dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
        linear_value_head_dim=6, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        layers=(1,), float32="OlmoHybridRMSNorm"),
    # MiniMax: its softmax layer (layer 1; layer 0 lightning attention, tests/
    # test_hf_import_linear.py) with the config's sliding window, which HF applies to every
    # softmax layer whatever layer_types says
    "minimax": Family("MiniMaxConfig", dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], block_size=4,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=4), layers=(1,)),
    # the small options: HunYuan's norm after RoPE (θ by a fixed NTK alpha), BitNet's norm before
    # o_proj (N·Dh = D), OLMoE's clamp after the norm (0.5: it bites), MiMo-V2-Flash's values
    # 4 wide on keys 6 wide, scaled, its sliding layers' doubled KV heads and sinks
    "hunyuan_v1_dense": Family("HunYuanDenseV1Config", dict(
        num_hidden_layers=1, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                         "rope_theta": 100.0}),
        float32="HunYuanDenseV1RMSNorm"),
    "hunyuan_v1_moe": Family("HunYuanMoEV1Config", dict(num_hidden_layers=1, num_experts=2),
                             float32="HunYuanMoEV1RMSNorm"),
    "bitnet": Family("BitNetConfig", dict(num_hidden_layers=1, head_dim=4, attention_bias=True),
                     float32="BitNetRMSNorm"),
    "olmoe": Family("OlmoeConfig", dict(num_hidden_layers=1, head_dim=4, clip_qkv=0.5,
                                        num_experts=2, num_experts_per_tok=1),
                    float32="OlmoeRMSNorm"),
    "mimo_v2_flash": Family("MiMoV2FlashConfig", dict(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, v_head_dim=4, attention_value_scale=0.707, attention_bias=True,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0,
                                            "partial_rotary_factor": 0.334},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0,
                                               "partial_rotary_factor": 0.334}}),
        layers=(0, 1), attention="eager", float32="eager softmax"),
    "qwen2_moe": Family("Qwen2MoeConfig", dict(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        shared_expert_intermediate_size=8, **MOE), layers=(0, 1)),
    "qwen3_moe": Family("Qwen3MoeConfig", dict(num_hidden_layers=1, use_sliding_window=True,
                                               sliding_window=4, attention_bias=True, **MOE),
                        float32="Qwen3MoeRMSNorm"),
    "phimoe": Family("PhimoeConfig", dict(
        num_hidden_layers=1, sliding_window=5, attention_bias=True, num_local_experts=2,
        num_experts_per_tok=2, rope_parameters=dict(
            LONGROPE, short_factor=[1.0, 1.5, 2.0], short_mscale=1.3, long_mscale=1.3))),
    "internlm3": Family("InternLM3Config", dict(num_hidden_layers=1, attention_bias=True,
                                                mlp_bias=True)),
    "iquestcoder": Family("IQuestCoderConfig", dict(num_hidden_layers=1,
                                                    rope_parameters=YARN)),
    "arcee": Family("ArceeConfig", dict(num_hidden_layers=1, attention_bias=True,
                                        rope_parameters=YARN)),
    "jais2": Family("Jais2Config", dict(num_hidden_layers=1, attention_bias=True)),
    "solar_open": Family("SolarOpenConfig", dict(
        num_hidden_layers=1, attention_bias=True, n_routed_experts=2, n_shared_experts=1,
        num_experts_per_tok=1, moe_intermediate_size=8)),
    "csm": Family("CsmConfig", dict(num_hidden_layers=1), model=_csm_backbone),
    "dots1": Family("Dots1Config", dict(**SLIDING_FULL, n_routed_experts=2, n_shared_experts=1,
                                        num_experts_per_tok=1, moe_intermediate_size=8),
                    layers=(0, 1), float32="Dots1RMSNorm"),
    "flex_olmo": Family("FlexOlmoConfig", dict(num_hidden_layers=1, attention_bias=True,
                                               pad_token_id=0, num_experts=2,
                                               num_experts_per_tok=1),
                        float32="FlexOlmoRMSNorm"),
    "exaone_moe": Family("ExaoneMoeConfig", dict(**SLIDING_FULL, **MOE,
                                                 mlp_layer_types=["dense", "sparse"]),
                         layers=(0, 1), float32="ExaoneMoeRMSNorm"),
    "kolibri1": Family("Kolibri1Config", dict(**SLIDING_FULL, **MOE,
                                              shared_expert_intermediate_size=8),
                       layers=(0, 1), float32="Kolibri1RMSNorm"),
    "hyperclovax": Family("HyperCLOVAXConfig", dict(num_hidden_layers=1, attention_multiplier=0.3,
                                                    attention_bias=True)),
    "granitemoeshared": Family("GraniteMoeSharedConfig", dict(
        num_hidden_layers=1, attention_multiplier=0.3, num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=8)),
    "gemma": Family("GemmaConfig", dict(num_hidden_layers=1, head_dim=8, attention_bias=True)),
    "vaultgemma": Family("VaultGemmaConfig", dict(**SLIDING_FULL, query_pre_attn_scalar=10,
                                                  attn_logit_softcapping=3.0),
                         layers=(0, 1), float32="eager softmax", attention="eager"),
    "ministral": Family("MinistralConfig", dict(**SLIDING_FULL), layers=(0, 1)),
    # Ministral 3: the temperature's floor ⌊p / 4⌋ reaches 2 within L
    "ministral3": Family("Ministral3Config", dict(
        num_hidden_layers=1, sliding_window=5, rope_parameters=dict(
            YARN, llama_4_scaling_beta=0.4, max_position_embeddings=64)),
        float32="the temperature"),
    "cwm": Family("CwmConfig", dict(num_hidden_layers=2, sliding_window=4,
                                    layer_types=["full_attention", "sliding_attention"]),
                  layers=(0, 1)),
    "seed_oss": Family("SeedOssConfig", dict(num_hidden_layers=1, attention_bias=True,
                                             attention_out_bias=False)),
    "mellum": Family("MellumConfig", dict(**SLIDING_FULL, **MOE, rope_parameters=PER_TYPE_ROPE),
                     layers=(0, 1), float32="MellumRMSNorm"),
    "apertus": Family("ApertusConfig", dict(num_hidden_layers=1, attention_bias=True),
                      float32="ApertusRMSNorm"),
    # Helium's o_proj is (D, D): N·Dh = D
    "helium": Family("HeliumConfig", dict(num_hidden_layers=1, head_dim=4, attention_bias=True)),
    "nemotron": Family("NemotronConfig", dict(
        num_hidden_layers=1, head_dim=8, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.5})),
    "olmo3": Family("Olmo3Config", dict(**SLIDING_FULL, rope_parameters=PER_TYPE_ROPE),
                    layers=(0, 1), float32="Olmo3RMSNorm"),
    **{mt: Family(config, dict(num_hidden_layers=1, head_dim=8, attention_bias=True, pad_token_id=0,
                               rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                "partial_rotary_factor": 0.5}))
       for mt, config in (("glm", "GlmConfig"), ("glm4", "Glm4Config"))},
    # Cohere 2: interleaved RoPE on the sliding layer, NoPE on the full one (head width D / N)
    "cohere2": Family("Cohere2Config", dict(**SLIDING_FULL, attention_bias=True),
                      layers=(0, 1), float32="apply_rotary_pos_emb (q and k turned in float32)"),
    # Cohere 2 MoE: a dense prefix layer, full but turned (prefix_dense_sliding_window_pattern
    # 1), a sliding layer and a NoPE full one
    "cohere2_moe": Family("Cohere2MoeConfig", dict(
        num_hidden_layers=3, sliding_window=4, num_experts=2, num_experts_per_tok=1,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"]), layers=(0, 1, 2),
        float32="apply_rotary_pos_emb (q and k turned in float32)"),
    "ernie4_5": Family("Ernie4_5Config", dict(num_hidden_layers=1, use_bias=True),
                       float32="apply_rotary_pos_emb (q and k turned in float32)"),
    "ernie4_5_moe": Family("Ernie4_5_MoeConfig", dict(
        num_hidden_layers=1, moe_num_experts=2, moe_k=1, moe_intermediate_size=8,
        moe_layer_start_index=0), float32="apply_rotary_pos_emb (q and k turned in float32)"),
    # GLM-4.5: partial rotary 0.5 by the config's default, rotate-half pairs, per-head norms
    "glm4_moe": Family("Glm4MoeConfig", dict(
        num_hidden_layers=1, head_dim=8, attention_bias=True, use_qk_norm=True,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        first_k_dense_replace=0), float32="Glm4MoeRMSNorm"),
    # MiniMax-M2: norms across heads, the legacy rotary_dim (4 of Dh 8 features turned)
    "minimax_m2": Family("MiniMaxM2Config", dict(
        num_hidden_layers=1, head_dim=8, rotary_dim=4, num_local_experts=2,
        num_experts_per_tok=1), float32="MiniMaxM2RMSNorm"),
    # Molmo 2's text tower: norms across heads ("olmo"), yarn on layer 0 only
    "molmo2_text": Family("Molmo2TextConfig", dict(
        num_hidden_layers=2, attention_bias=True, qk_norm_type="olmo", rope_scaling_layers=[0],
        rope_parameters=YARN), layers=(0, 1), float32="Molmo2RMSNorm", model="Molmo2TextModel"),
    "granitemoe": Family("GraniteMoeConfig", dict(
        num_hidden_layers=1, attention_multiplier=0.3, attention_bias=True, num_local_experts=2,
        num_experts_per_tok=1)),
    # Granite SWA: sinks, a sliding layer of its own θ and a NoPE full layer (θ 0); HF's
    # model has eager attention only (its softmax and sink scale float32)
    **{mt: Family(config, dict(
        num_hidden_layers=2, sliding_window=4, attention_multiplier=0.3, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[100.0, 0],
        **moe), layers=(0, 1), float32="eager softmax and sink scale", attention="eager")
       for mt, config, moe in (("granite_swa", "GraniteSWAConfig", {}),
                               ("granitemoe_swa", "GraniteMoeSWAConfig",
                                dict(num_local_experts=2, num_experts_per_tok=1)))},
    # Flint: sinks, RoPE on the sliding layer only; HF's model has eager attention only (its
    # scores and softmax float32)
    "flint": Family("FlintConfig", dict(**SLIDING_FULL, **MOE, attention_bias=True,
                                        mlp_only_layers=[0]), layers=(0, 1),
                    float32="FlintRMSNorm, eager scores and softmax", attention="eager"),
    "exaone4": Family("Exaone4Config", dict(**SLIDING_FULL), layers=(0, 1),
                      float32="Exaone4RMSNorm"),
    # NanoChat: RoPE turning the other way, a weightless norm after it
    "nanochat": Family("NanoChatConfig", dict(num_hidden_layers=1, attention_bias=True),
                       float32="NanoChatRMSNorm"),
    # OpenAI's privacy filter: bidirectional, each token's keys within 2 on both sides, sinks;
    # HF's model has eager attention only (its softmax float32)
    "openai_privacy_filter": Family("OpenAIPrivacyFilterConfig", dict(
        num_hidden_layers=1, sliding_window=2, num_local_experts=2, num_experts_per_tok=1,
        pad_token_id=0, eos_token_id=1, rope_parameters=dict(YARN, truncate=False)),
        float32="eager softmax", attention="eager", model="OpenAIPrivacyFilterModel"),
}
# Issue 42's σ-gated decoders: σ(x W_g) from a separate gate_proj, our output gate.
GATED_42 = {
    # AFMoE: a sliding layer with RoPE, a NoPE full one, per-head QK norms; biases on q, k, v
    # and o, none on gate_proj (b_gate zeros)
    "afmoe": Family("AfmoeConfig", dict(
        num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention",
                                                            "full_attention"],
        attention_bias=True, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        num_shared_experts=1, num_dense_layers=1), layers=(0, 1), float32="AfmoeRMSNorm"),
    # HRM-Text: one layer a stack, run in HF's cycles (its last call captured), biases on every
    # projection, gate_proj's included
    "hrm_text": Family("HrmTextConfig", dict(num_hidden_layers=1, attention_bias=True),
        attention_of=lambda model, i: model.L_module.layers[i].self_attn),
    # Muse Glimmer's text tower: a sliding layer, a NoPE full one (layer_rope_theta 0), its
    # weightless QK norm and query factor
    "muse_glimmer_text": Family("MuseGlimmerTextConfig", dict(
        num_hidden_layers=2, sliding_window=4, attention_bias=True, qk_scale_factor=2.5,
        layer_rope_theta=[100.0, 0], rope_parameters={"rope_type": "default",
                                                      "rope_theta": 100.0}),
        layers=(0, 1), float32="MuseGlimmerRMSNorm", model="MuseGlimmerTextModel"),
}
# Issue 42's decoders of this session's options: the output gates per head and by softplus,
# the norm of each head's output, the power-law temperature and a gate bias per head.
OPTIONS_42 = {
    # Laguna: 6 query heads on its sliding layer, 4 on its full one (partial rotary 0.5, θ of
    # its own), a softplus gate per feature from g_proj (no bias beside q/k/v/o biases)
    "laguna": Family("LagunaConfig", dict(
        num_hidden_layers=2, head_dim=8, sliding_window=4, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"], num_attention_heads_per_layer=[6, 4],
        gating="per-element", **MOE, shared_expert_intermediate_size=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000.0,
                                            "partial_rotary_factor": 0.5}}),
        layers=(0, 1), float32="LagunaRMSNorm, the gate's softplus"),
    # Step 3.5/3.7's text model: its sliding layer 6 heads, its full one 4 (partial rotary
    # 0.5), (1 + w) norms, query_pre_attn_scalar, a σ per head from g_proj
    "step3p5": Family("Step3p7TextConfig", dict(
        num_hidden_layers=2, head_dim=8, sliding_window=4, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"], num_sliding_attention_heads=6,
        query_pre_attn_scalar=10, rope_theta=[100.0, 1000.0], partial_rotary_factors=[1.0, 0.5],
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        share_expert_dim=8), layers=(0, 1), float32="Step3p7RMSNorm",
        model="Step3p7TextModel"),
    # Muse Spark's text tower: Muse Glimmer's (a sliding layer, a NoPE full one), its output
    # normed per head before the gate
    "muse_spark_text": Family("MuseSparkTextConfig", dict(
        num_hidden_layers=2, sliding_window=4, attention_bias=True, qk_scale_factor=2.5,
        layer_rope_theta=[100.0, 0], rope_parameters={"rope_type": "default",
                                                      "rope_theta": 100.0},
        mlp_layer_types=["dense", "dense"]), layers=(0, 1), float32="MuseSparkRMSNorm",
        model="MuseSparkTextModel"),
    # Beam: a RoPE sliding layer, a NoPE full one with the power temperature (HF's in
    # float32), gate_proj with a bias per head
    "beam": Family("BeamConfig", dict(
        num_hidden_layers=2, sliding_window=4, attention_bias=True, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, n_group=1, topk_group=1,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": None}),
        layers=(0, 1), float32="BeamRMSNorm, the temperature"),
    # LFM3: a short-convolution layer (not converted), a sliding layer, a full one with
    # proportional RoPE on half of each head; a σ per head from g_proj
    "lfm3": Family("Lfm3Config", dict(
        num_hidden_layers=3, head_dim=8, sliding_window=4, attention_bias=True,
        layer_types=["conv", "sliding_attention", "full_attention"], conv_L_cache=3,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1000.0,
                                            "partial_rotary_factor": 0.5}}),
        layers=(1, 2), float32="Lfm3RMSNorm"),
}
# Issue 42's latent attentions (golden/hf/latent.py): DeepSeek-V3's sizes (every one distinct
# but Dr = head_dim), HF's float32 RMSNorm of the latent.
MLA_SIZES = dict(num_key_value_heads=N, head_dim=4, q_lora_rank=8, kv_lora_rank=6,
                 qk_nope_head_dim=3, qk_rope_head_dim=4, v_head_dim=5)
LATENT_42 = {
    # Kimi Linear: its softmax layer (layer 1; layer 0 Kimi Delta Attention, tests/
    # test_hf_import_linear.py), latent attention without RoPE, no q LoRA
    "kimi_linear": Family("KimiLinearConfig", dict(
        num_hidden_layers=2, **dict(MLA_SIZES, q_lora_rank=None, head_dim=None),
        layer_types=["linear_attention", "full_attention"], linear_num_heads=2,
        linear_head_dim=4, num_experts=2, num_experts_per_token=1, moe_intermediate_size=8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), layers=(1,),
        float32="KimiLinearRMSNorm"),
    # DeepSeek-V2: its complex RoPE (interleaved pairs, in float32) with yarn's mscale
    # (Dn 10: HF's view_as_complex needs q's rotary slice at an even offset in float32)
    "deepseek_v2": Family("DeepseekV2Config", dict(
        num_hidden_layers=1, **dict(MLA_SIZES, qk_nope_head_dim=10), attention_bias=True, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, first_k_dense_replace=1,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.7)),
        float32="DeepseekV2RMSNorm, its complex RoPE"),
    # MiniCPM3: rotate-half pairs, no q LoRA, v_head_dim D / N by HF's config
    "minicpm3": Family("MiniCPM3Config", dict(
        num_hidden_layers=1, **dict(MLA_SIZES, q_lora_rank=None, v_head_dim=None),
        attention_bias=True), float32="MiniCPM3RMSNorm"),
    "glm4_moe_lite": Family("Glm4MoeLiteConfig", dict(
        num_hidden_layers=1, **{k: v for k, v in MLA_SIZES.items() if k != "head_dim"},
        rope_interleave=False, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=8), float32="Glm4MoeLiteRMSNorm"),
    "youtu": Family("YoutuConfig", dict(num_hidden_layers=1, **MLA_SIZES, attention_bias=True),
                    float32="YoutuRMSNorm"),
    # Mistral Small 4: its query temperature past F = 4 positions (β 0.5), yarn's mscale (Dn 4:
    # HF's rotary fraction Dr / (Dn + Dr) times Dn + Dr must give Dr back in floating point)
    "mistral4": Family("Mistral4Config", dict(
        num_hidden_layers=1, **{k: v for k, v in MLA_SIZES.items() if k != "head_dim"
                                and k != "qk_nope_head_dim"}, qk_nope_head_dim=4, head_dim=8,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        first_k_dense_replace=1, rope_parameters=dict(
            YARN, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5)),
        float32="Mistral4RMSNorm"),
    "axk1": Family("AXK1Config", dict(
        num_hidden_layers=1, **MLA_SIZES, rope_interleave=False, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, n_group=1, topk_group=1),
        float32="AXK1RMSNorm"),
    # LongCat-Flash: two attentions per layer (self_attn.0 and .1), its q and latent scalings
    "longcat_flash": Family("LongcatFlashConfig", dict(
        num_layers=1, **MLA_SIZES, attention_bias=True, n_routed_experts=2, moe_topk=2,  # top 1: HF squeezes too much
        zero_expert_num=1, expert_ffn_hidden_size=8, ffn_hidden_size=32,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.7)), layers=(0, 1),
        attention_of=lambda model, i: model.layers[i // 2].self_attn[i % 2],
        float32="LongcatFlashRMSNorm"),
}


def _module_at(path):
    """(model, layer) -> the attention module at ``model.layers[layer].<path>``."""
    def attention_of(model, i):
        return model.layers[i].get_submodule(path)
    return attention_of


# Mamba (and RG-LRU) settings as small as HF builds them: outside attention, but each hybrid
# model runs its recurrences on CPU through transformers' torch path.
MAMBA2 = dict(mamba_n_heads=2, mamba_d_head=16, mamba_d_state=4, mamba_d_conv=2,
              mamba_chunk_size=4)
# Issue 42's hybrid models (golden/hf/hybrids.py): their softmax attention layers, each of
# its config's own kind; the layers between are Mamba (or RG-LRU), run by HF's model, refused by
# from_hf (test_hybrids_other_layers_are_refused_by_kind).
HYBRIDS_42 = {
    # Falcon-H1: keys multiplied by key_multiplier; the in/out multipliers are the decoder
    # layer's, around the module
    "falcon_h1": Family("FalconH1Config", dict(
        num_hidden_layers=1, attention_bias=True, key_multiplier=0.3, attention_in_multiplier=1.3,
        attention_out_multiplier=0.9, mamba_d_ssm=16, mamba_n_groups=1,
        **{k: v for k, v in MAMBA2.items() if k != "mamba_d_head"}, mamba_d_head=8)),
    # Jamba: NoPE; layer 1 attention (attn_layer_period 2, offset 1)
    "jamba": Family("JambaConfig", dict(
        num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=2,
        num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=1,
        mamba_dt_rank=2), layers=(1,)),
    # Bamba: partial rotary 0.5 (HF's config's own), attention at attn_layer_indices
    "bamba": Family("BambaConfig", dict(num_hidden_layers=2, attn_layer_indices=[1], head_dim=8,
                                        attention_bias=True, **MAMBA2), layers=(1,)),
    # Granite 4: Granite's scale, RoPE by position_embedding_type
    "granitemoehybrid": Family("GraniteMoeHybridConfig", dict(
        num_hidden_layers=2, layer_types=["mamba", "attention"], attention_multiplier=0.3,
        position_embedding_type="rope", attention_bias=True, num_local_experts=2,
        num_experts_per_tok=1, **MAMBA2), layers=(1,)),
    # Nemotron-H: NoPE, each layer's mixer (Mamba-2, then attention)
    "nemotron_h": Family("NemotronHConfig", dict(
        layers_block_type=["linear_attention", "full_attention"], mamba_num_heads=2,
        mamba_head_dim=8, ssm_state_size=4, conv_kernel=2, chunk_size=4, n_groups=1),
        layers=(1,), attention_of=_module_at("mixer")),
    # Zamba: the shared block's input (B, L, 2D), output (B, L, D), scale (Dh / 2)^-1/2, NoPE;
    # hybrid layers 2 and 3 (HF's two Mamba layers first)
    "zamba": Family("ZambaConfig", dict(
        num_hidden_layers=4, attn_layer_period=1, attn_layer_offset=0, n_mamba_heads=1,
        mamba_d_state=4, mamba_d_conv=2, mamba_expand=1), layers=(2, 3),
        attention_of=_module_at("shared_transf.self_attn")),
    # Zamba 2: one shared block called by hybrid layers 1 and 2, each call site's adapters
    # (rank 3) folded; RoPE (use_mem_rope) over the whole head Dh = 2D / N, Nkv = N (the
    # adapters' width is 2D)
    "zamba2": Family("Zamba2Config", dict(
        num_hidden_layers=3, num_key_value_heads=N, head_dim=8,
        layers_block_type=["mamba", "hybrid", "hybrid"], n_mamba_heads=2, mamba_d_state=4,
        mamba_d_conv=2, mamba_expand=1, chunk_size=4, use_shared_attention_adapter=True,
        adapter_rank=3, num_mem_blocks=1, use_mem_rope=True), layers=(1, 2),
        attention_of=_module_at("shared_transformer.self_attn")),
    # RecurrentGemma: local attention (window 4 < L), RoPE on half of each head (Dh 8), one KV
    # head (multi-query)
    "recurrent_gemma": Family("RecurrentGemmaConfig", dict(
        num_hidden_layers=2, block_types=["recurrent", "attention"], attention_window_size=4,
        head_dim=8, num_key_value_heads=1, attention_bias=True, lru_width=16, conv1d_width=2),
        layers=(1,), attention_of=_module_at("temporal_block"), model="RecurrentGemmaModel"),
    # Ling 3.0: layer 0 Kimi Delta Attention (gated linear, issue 43: refused by kind), layer 1
    # latent attention (no q LoRA, interleaved pairs) with a σ gate per head (issue 42); HF's
    # RMSNorm of the latent in float32
    "bailing_hybrid": Family("BailingHybridConfig", dict(
        num_hidden_layers=2, layer_group_size=2, **{k: v for k, v in MLA_SIZES.items()
                                                    if k not in ("head_dim", "q_lora_rank")},
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, first_k_dense_replace=2,
        n_group=1, topk_group=1, short_conv_kernel_size=2, pad_token_id=0, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}), layers=(1,),
        float32="BailingHybridRMSNorm"),
}

# Issue 42's text encoders with RoPE (golden/hf/encoders.py ROPE_ENCODERS), swept with the
# decoders: bidirectional (not decoded) but for ModernBERT's decoder; every window shorter than
# L, local and global θ apart; BASE's num_key_value_heads and head_dim left in the configs that
# do not read them (HF's GTE, Nomic and Jina attention read head_dim, not the KV heads;
# ModernBERT neither).
LOCAL_GLOBAL = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _attn(model, i):
    return model.layers[i].attn


ENCODERS_42 = {
    # ModernBERT: fused Wqkv, D / N heads (4), layer 0 sliding |i − j| ≤ 2 (local_attention 4)
    "modernbert": Family("ModernBertConfig", dict(
        num_hidden_layers=2, head_dim=None, layer_types=["sliding_attention", "full_attention"],
        local_attention=4, rope_parameters=LOCAL_GLOBAL, attention_bias=True, cls_token_id=1,
        sep_token_id=2, **TOKENS), layers=(0, 1), attention_of=_attn,
        float32="apply_rotary_pos_emb (q and k turned in float32)"),
    # ModernBERT's decoder: causal, layer 1 sliding with 3 keys (local_attention 6)
    "modernbert-decoder": Family("ModernBertDecoderConfig", dict(
        num_hidden_layers=2, head_dim=None, layer_types=["full_attention", "sliding_attention"],
        local_attention=6, rope_parameters=LOCAL_GLOBAL, attention_bias=True, cls_token_id=1,
        sep_token_id=2, **TOKENS), layers=(0, 1), attention_of=_attn,
        float32="apply_rotary_pos_emb (q and k turned in float32)"),
    "eurobert": Family("EuroBertConfig", dict(num_hidden_layers=1, attention_bias=True,
                                              **TOKENS)),
    # UltraBERT: layer 0 sliding |i − j| ≤ 2, its own θ
    "ultrabert": Family("UltrabertConfig", dict(
        num_hidden_layers=2, sliding_window=2, layer_types=["sliding_attention",
                                                            "full_attention"],
        rope_parameters=LOCAL_GLOBAL, attention_bias=True, **TOKENS), layers=(0, 1)),
    # GTE with dynamic NTK past its 4 positions (HF's θ grows with the call's length)
    "gte": Family("GteConfig", dict(num_hidden_layers=1, max_position_embeddings=4, **TOKENS,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                     "rope_theta": 100.0})),
    "nomic_bert": Family("NomicBertConfig", dict(num_hidden_layers=1, **TOKENS)),
    "jina_embeddings_v3": Family("JinaEmbeddingsV3Config", dict(num_hidden_layers=1,
                                                                **TOKENS)),
}

# Issue 44's latent attentions with a learned token indexer: index_topk 4 of L = 9 keys, so the
# selection matters on the later rows. HF's indexer computes its scores in float32 even in a
# float64 model (q.float(), k.float(), weights_proj(...).float()), besides its RMSNorms. 16
# indexer heads: a key's score is exactly 0 when every head's ReLU is (2⁻ᴴ of the pairs), and
# exact ties are broken by torch.topk in HF's, by the lowest index in ours; with 2 heads a tie
# at the k-th place moved the output of 2 of 6 tiny models (0.14 to 0.49), with 16 none.
NO_INDEXER = {n: None for n in ("index_topk", "index_heads", "index_head_dim", "index_rope",
                                "index_rope_dims", "index_query", "index_scale",
                                "index_norm_eps")}
INDEXER_44 = dict(index_topk=4, index_n_heads=16, index_head_dim=6)
# The block indexers (grouped-query attention): MiniMax M3's "max" (one indexer head per KV
# group, blocks of 2, 2 kept of them, 1 local) and Qwen4-Exp's "mean" (16 indexer heads, as
# above: a block scores exactly 0 when every head's ReLU is, and HF's torch.topk breaks such
# ties otherwise than our lowest index); 4 keys kept (and Qwen4-Exp's tail) of L = 9.
NO_BLOCKS = {n: None for n in ("index_blocks", "index_heads", "index_head_dim",
                               "index_block_size", "index_topk_blocks")} | {
    "index_local_blocks": 0}
BLOCKS_44 = {
    # MiniMax M3: Gemma-style QK norms per head, 4 of Dh 6 features turned
    "minimax_m3_vl_text": Family("MiniMaxM3VLTextConfig", dict(
        num_hidden_layers=1, layer_types=["minimax_m3_sparse"], index_n_heads=2,
        index_head_dim=6, index_block_size=2, index_topk_blocks=2, index_local_blocks=1,
        num_local_experts=2, num_experts_per_tok=1, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 2 / 3}),
        float32="MiniMaxM3VLRMSNorm, the indexer's scores"),
    # Qwen4-Exp: its indexed layer (1) after a Gated DeltaNet layer (0,
    # tests/test_hf_import_linear.py); Qwen3.5's gated attention, 2 of Dh 8 features turned
    "qwen4_exp_text": Family("Qwen4ExpTextConfig", dict(
        num_hidden_layers=2, head_dim=8, layer_types=["linear_attention", "indexed_attention"],
        indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=4, indexer_budget=4,
        indexer_compress_ratio=2, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=8, shared_expert_intermediate_size=8, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4, **TOKENS,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.25}), layers=(1,),
        float32="Qwen4ExpTextRMSNorm, the indexer's block means and scores"),
}
INDEXED_44 = {
    "deepseek_v32": Family("DeepseekV32Config", dict(
        num_hidden_layers=1, **MLA_SIZES, **INDEXER_44,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        first_k_dense_replace=1), float32="DeepseekV32RMSNorm, the indexer's scores"),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", dict(
        num_hidden_layers=1, **{k: v for k, v in MLA_SIZES.items() if k != "head_dim"},
        **INDEXER_44, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, first_k_dense_replace=1),
        float32="GlmMoeDsaRMSNorm, the indexer's scores"),
    # HY-V4: rotate-half MLA RoPE, sinks (drawn), a σ gate per feature (eager attention: HF
    # has no SDPA path with sinks); the indexer turns its last features, scales the weights
    "hy_v4": Family("HYV4Config", dict(
        num_hidden_layers=1, **MLA_SIZES, **INDEXER_44, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, **TOKENS), attention="eager",
        float32="HYV4RMSNorm, eager softmax, the indexer's scores and its key's LayerNorm"),
    # A.X-K2: the query and its gate per feature from [RMSNorm(c_q) | c_q] (q_gate_proj)
    "axk2": Family("AXK2Config", dict(
        num_hidden_layers=1, **{k: v for k, v in MLA_SIZES.items() if k != "head_dim"},
        **INDEXER_44, num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        **TOKENS), float32="AXK2RMSNorm, the gate's σ, the indexer's scores"),
    # dots.3-note: an indexed layer, a full one (no indexer) and a windowed one (sizes of its
    # own, per_layer_config, its RoPE θ its type's); the rotary key normalised, a gate per head,
    # the latents' scales folded
    "dots3_note_text": Family("Dots3NoteTextConfig", dict(
        num_hidden_layers=3,
        layer_types=["indexed_attention", "full_attention", "sliding_attention"],
        **dict(MLA_SIZES, head_dim=6), **INDEXER_44, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, **TOKENS, sliding_window=3,
        swa_q_lora_rank=5, swa_kv_lora_rank=7, swa_head_dim=5, swa_qk_nope_head_dim=3,
        swa_v_head_dim=2, swa_num_attention_heads=N, swa_num_key_value_heads=N),
        layers=(0, 1, 2), float32="Dots3NoteRMSNorm, the indexer's scores"),
}

FAMILIES = {
    "llama": Family("LlamaConfig", dict(num_hidden_layers=1, attention_bias=True,
                                        rope_parameters={
                                            "rope_type": "llama3", "rope_theta": 500.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 4})),
    "mistral": Family("MistralConfig", dict(num_hidden_layers=1, sliding_window=4)),
    "mixtral": Family("MixtralConfig", dict(num_hidden_layers=1, sliding_window=5,
                                            num_local_experts=2, num_experts_per_tok=1)),
    "qwen2": Family("Qwen2Config", dict(num_hidden_layers=2, use_sliding_window=True,
                                        sliding_window=4, max_window_layers=1,
                                        rope_parameters=YARN), layers=(0, 1)),
    "qwen3": Family("Qwen3Config", dict(num_hidden_layers=1, attention_bias=True),
                    float32="Qwen3RMSNorm"),
    "starcoder2": Family("Starcoder2Config", dict(num_hidden_layers=1, sliding_window=5,
                                                  use_bias=True)),
    "granite": Family("GraniteConfig", dict(num_hidden_layers=1, attention_multiplier=0.3,
                                            attention_bias=True)),
    "smollm3": Family("SmolLM3Config", dict(num_hidden_layers=2, no_rope_layers=[1, 0],
                                            pad_token_id=0),
                      layers=(0, 1)),
    "olmo": Family("OlmoConfig", dict(num_hidden_layers=1, clip_qkv=0.8)),
    "olmo2": Family("Olmo2Config", dict(num_hidden_layers=1, attention_bias=True),
                    float32="Olmo2RMSNorm"),
    "gemma2": Family("Gemma2Config", dict(num_hidden_layers=2, sliding_window=4,
                                          query_pre_attn_scalar=10,
                                          attn_logit_softcapping=3.0), layers=(0, 1),
                     float32="eager softmax", attention="eager"),
    "gemma3_text": Family("Gemma3TextConfig", dict(
        num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=10,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000.0,
                                            "factor": 2.0}}),
        layers=(0, 1), float32="Gemma3RMSNorm"),
    # Gemma 4: a sliding layer (v_proj, Dh 6) and a full one (K = V, wider heads Dh 8, one KV
    # head, proportional RoPE turning a quarter of its pairs)
    "gemma4_text": Family("Gemma4TextConfig", dict(
        num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention",
                                                            "full_attention"],
        attention_k_eq_v=True, global_head_dim=8, num_global_key_value_heads=1,
        hidden_size_per_layer_input=4, vocab_size_per_layer_input=64,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1000.0,
                                            "partial_rotary_factor": 0.25}}),
        layers=(0, 1), float32="Gemma4RMSNorm"),
    # Gemma 3n's text attention: Gemma 4's without per-layer widths or K = V (its AltUp and
    # Laurel around the attention are not read); a sliding and a full layer, their own θ
    "gemma3n_text": Family("Gemma3nTextConfig", dict(
        num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention",
                                                            "full_attention"],
        num_kv_shared_layers=0, hidden_size_per_layer_input=4, vocab_size_per_layer_input=64,
        laurel_rank=4, altup_num_inputs=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
        layers=(0, 1), float32="Gemma3nRMSNorm"),
    "cohere": Family("CohereConfig", dict(num_hidden_layers=1, use_qk_norm=True),
                     float32="CohereLayerNorm and apply_rotary_pos_emb"),
    # Chameleon (issue 42's new QK norm, so outside the sweep: every run): q and k LayerNorm-ed
    # per head with a weight and a bias each (N, Dh), head width D / N (its rotary embedding
    # reads a head_dim where the config has one, its attention never: BASE's dropped); its
    # VQ-VAE image tokenizer as small as HF builds it (not attention: not converted)
    "chameleon": Family("ChameleonConfig", dict(
        num_hidden_layers=1, head_dim=None, attention_bias=True, vq_config=dict(
            embed_dim=4, num_embeddings=8, latent_channels=4, base_channels=32,
            channel_multiplier=[1], num_res_blocks=1, resolution=8, attn_resolutions=[]),
        vocabulary_map={"<image>": 3})),
    "gpt_oss": Family("GptOssConfig", dict(
        num_hidden_layers=2, sliding_window=4, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
        num_experts_per_tok=1, rope_parameters=dict(YARN, truncate=False)), layers=(0, 1),
        attention="eager"),  # its eager softmax runs in the logits' dtype
    "llama4_text": Family("Llama4TextConfig", dict(
        num_hidden_layers=2, attention_bias=True, no_rope_layers=[1, 0], use_qk_norm=True,
        attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"],
        attn_temperature_tuning=True, floor_scale=3, attn_scale=0.4, num_local_experts=2,
        intermediate_size_mlp=32), layers=(0, 1), float32="L2Norm, the temperature"),
    "deepseek_v3": Family("DeepseekV3Config", dict(
        num_hidden_layers=1, num_key_value_heads=N, head_dim=4, q_lora_rank=8, kv_lora_rank=6,
        qk_nope_head_dim=3, qk_rope_head_dim=4, v_head_dim=5, attention_bias=True,
        n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, rope_interleave=True,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.7)),
        float32="DeepseekV3RMSNorm"),
    "qwen3_next": Family("Qwen3NextConfig", dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        attention_bias=True, num_experts=2, num_experts_per_tok=1, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.67}), layers=(1,),
        float32="Qwen3NextRMSNorm"),
    # The text towers of Qwen2-VL and Qwen3-VL, text only here (every axis the token's index,
    # the 1-D RoPE: tests/test_mrope.py gives them images' positions).
    **TEXT_TOWERS,
    **DECODERS_42,
    **GATED_42,
    **OPTIONS_42,
    **LATENT_42,
    **HYBRIDS_42,
    **ENCODERS_42,
    **INDEXED_44,
    **BLOCKS_44,
}

# The family's distinctive settings, each undone on one layer: (layer, our settings changed).
DISTINCT = {
    "hunyuan_v1_dense": [(0, {"qk_norm": "rms"}),
                         (0, {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}})],
    "hunyuan_v1_moe": [(0, {"qk_norm": "rms"})],
    "bitnet": [(0, {"output_norm": None, "output_norm_eps": 1e-6})],
    "olmoe": [(0, {"clip_qkv_after_norm": False})],
    "mimo_v2_flash": [(0, {"value_scale": None}), (0, {"sinks": False}),
                      (0, {"sliding_window": None})],
    "llama": [(0, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})],
    "mistral": [(0, {"sliding_window": None})],
    "mixtral": [(0, {"sliding_window": None})],
    "qwen2": [(1, {"sliding_window": None}), (0, {"rope_parameters": {"rope_theta": 500.0}})],
    "qwen3": [(0, {"qk_norm": None})],
    "starcoder2": [(0, {"sliding_window": None})],
    "granite": [(0, {"scale": None})],
    "smollm3": [(1, {"rope_parameters": {"rope_theta": 100.0}})],
    "olmo": [(0, {"clip_qkv": None})],
    "olmo2": [(0, {"qk_norm": None})],
    "gemma2": [(0, {"softcap": None}), (0, {"scale": None}), (0, {"sliding_window": None})],
    "gemma3_text": [(0, {"qk_norm": None}), (1, {"rope_parameters": {"rope_theta": 1000.0}})],
    "gemma4_text": [(0, {"v_norm": False}), (1, {"scale": None}),
                    (1, {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})],
    "gemma3n_text": [(0, {"v_norm": False}), (1, {"scale": None}),
                     (1, {"rope_parameters": {"rope_theta": 100.0}})],
    "cohere": [(0, {"rope_interleaved": False}), (0, {"qk_norm": None})],
    "gpt_oss": [(0, {"sinks": False}), (1, {"rope_parameters": {"rope_theta": 500.0}})],
    "llama4_text": [(0, {"attention_chunk_size": None}), (0, {"qk_norm": None}),
                    (1, {"query_temperature": None})],
    "qwen3_next": [(1, {"output_gate": False}), (1, {"partial_rotary_factor": 1.0})],
    # Text only, MRoPE is the 1-D RoPE: its layouts are tests/test_mrope.py's.
    "qwen2_vl_text": [(0, {"rope_parameters": {"rope_theta": 500.0}})],
    "qwen3_vl_text": [(0, {"qk_norm": None})],
    "qwen2_5_vl_text": [(0, {"rope_parameters": {"rope_theta": 500.0}})],
    "qwen3_vl_moe_text": [(0, {"qk_norm": None})],
    "glm4v_text": [(0, {"rope_interleaved": False})],
    "qwen3_5_text": [(1, {"output_gate": False}), (1, {"qk_norm": None})],
    "qwen3_5_moe_text": [(1, {"output_gate": False})],
    "qwen2_5_omni_text": [(1, {"sliding_window": None}),
                          (0, {"rope_parameters": {"rope_theta": 500.0}})],
    "qwen3_omni_moe_text": [(0, {"qk_norm": None}), (0, {"sliding_window": 4})],
    "glm4v_moe_text": [(0, {"rope_interleaved": True})],  # GLM-4V's pairing, not its own
    "paddleocr_vl_text": [(0, {"out_bias": False}),
                          (0, {"rope_parameters": {"rope_theta": 500.0}})],
    "ernie4_5_vl_moe_text": [(0, {"rope_interleaved": False})],
    "deepseek_v3": [(0, {"rope_interleaved": False}),
                    (0, {"rope_parameters": {"rope_theta": 500.0}})],
    # Issue 42's σ-gated decoders
    "afmoe": [(0, {"output_gate": False}), (0, {"sliding_window": None}), (0, {"qk_norm": None}),
              (1, {"rope_parameters": {"rope_theta": 10000.0}})],
    "hrm_text": [(0, {"output_gate": False})],
    "muse_glimmer_text": [(0, {"output_gate": False}), (0, {"scale": None}),
                          (0, {"sliding_window": None}), (0, {"qk_norm": None}),
                          (1, {"rope_parameters": {"rope_theta": 100.0}})],
    # Issue 42's decoders of this session's options
    "laguna": [(0, {"output_gate": "sigmoid"}), (0, {"output_gate": False, "gate_bias": None}),
               (1, {"partial_rotary_factor": 1.0}), (0, {"sliding_window": None}),
               (0, {"qk_norm": None})],
    "step3p5": [(0, {"output_gate": "softplus_per_head"}),
                (0, {"output_gate": False, "gate_bias": None}), (1, {"scale": None}),
                (0, {"qk_norm": "rms"}), (0, {"sliding_window": None})],
    "muse_spark_text": [(0, {"output_norm": None, "output_norm_eps": 1e-6}),
                        (0, {"output_gate": False}), (0, {"scale": None})],
    "beam": [(0, {"gate_bias": False}), (0, {"output_gate": False, "gate_bias": None}),
             (0, {"sliding_window": None}), (0, {"qk_norm": None})],
    "lfm3": [(1, {"output_gate": False, "gate_bias": None}), (1, {"sliding_window": None}),
             (1, {"qk_norm": None}),
             (2, {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})],
    # Issue 42's latent attentions
    **{mt: [(0, {"rope_interleaved": False}), (0, {"rope_parameters": {"rope_theta": 500.0}})]
       for mt in ("deepseek_v2", "youtu")},
    **{mt: [(0, {"rope_interleaved": True})] for mt in ("minicpm3", "glm4_moe_lite", "axk1")},
    "mistral4": [(0, {"query_temperature": None})],
    # Issue 44: the selection dropped, the indexer's RoPE pairs the other way
    "deepseek_v32": [(0, NO_INDEXER), (0, {"index_rope": "interleaved"})],
    "glm_moe_dsa": [(0, NO_INDEXER), (0, {"index_rope": "half"})],
    "hy_v4": [(0, {"index_rope_dims": "first"}), (0, {"rope_interleaved": True}),
              (0, {"sinks": False})],
    "axk2": [(0, NO_INDEXER), (0, {"output_gate": False})],
    "dots3_note_text": [(0, NO_INDEXER), (1, {"rope_key_norm": False}),
                        (1, {"output_gate": False}), (2, {"sliding_window": None})],
    "minimax_m3_vl_text": [(0, NO_BLOCKS), (0, {"index_local_blocks": 0})],
    "qwen4_exp_text": [(1, NO_BLOCKS), (1, {"output_gate": False})],
    # LongCat-Flash: HF's scaling without s_q; its second attention's pairs
    "longcat_flash": [(0, {"scale": None}), (1, {"rope_interleaved": False})],
    # Ling 3.0's MLA layers: the gate per head; their pairs
    "bailing_hybrid": [(1, {"output_gate": False}), (1, {"rope_interleaved": False})],
    # Issue 42's decoders
    # Chameleon: its norm's biases dropped ("layer", Cohere's), or the norm removed
    "chameleon": [(0, {"qk_norm": "layer"}), (0, {"qk_norm": None})],
    "qwen2_moe": [(0, {"sliding_window": None}), (0, {"qkv_bias": False})],
    "qwen3_moe": [(0, {"sliding_window": None}), (0, {"qk_norm": None})],
    # PhiMoE: HF's short factors at every length (the config's long ones would turn pairs
    # past original_max_position_embeddings otherwise), its mscale, its window
    "phimoe": [(0, {"rope_parameters": dict(LONGROPE, short_factor=[1.0, 1.5, 2.0],
                                            attention_factor=1.3)}),
               (0, {"rope_parameters": dict(LONGROPE, short_factor=[1.0, 1.5, 2.0],
                                            long_factor=[1.0, 1.5, 2.0], attention_factor=1.0)}),
               (0, {"sliding_window": None})],
    "internlm3": [(0, {"qkv_bias": False}), (0, {"rope_parameters": {"rope_theta": 500.0}})],
    "iquestcoder": [(0, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})],
    "arcee": [(0, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})],
    "jais2": [(0, {"qkv_bias": False})],
    "solar_open": [(0, {"qkv_bias": False})],
    "csm": [(0, {"rope_parameters": {"rope_theta": 100.0}})],
    "dots1": [(0, {"sliding_window": None}), (0, {"qk_norm": None})],
    "flex_olmo": [(0, {"qk_norm": None})],
    **{mt: [(1, {"rope_parameters": {"rope_theta": 10000.0}}), (0, {"sliding_window": None}),
            (0, {"qk_norm": None})] for mt in ("exaone_moe", "kolibri1", "exaone4")},
    "hyperclovax": [(0, {"scale": None})],
    "granitemoeshared": [(0, {"scale": None})],
    "gemma": [(0, {"rope_parameters": {"rope_theta": 500.0}})],
    "vaultgemma": [(0, {"softcap": None}), (0, {"scale": None}), (0, {"sliding_window": None})],
    "ministral": [(0, {"sliding_window": None})],
    "ministral3": [(0, {"query_temperature": None}), (0, {"sliding_window": None})],
    "cwm": [(1, {"sliding_window": None})],
    "seed_oss": [(0, {"qkv_bias": False})],
    **{mt: [(0, {"sliding_window": None}), (0, {"qk_norm": None}),
            (1, {"rope_parameters": {"rope_theta": 100.0}})] for mt in ("mellum", "olmo3")},
    "apertus": [(0, {"qk_norm": None})],
    "helium": [(0, {"rope_interleaved": False})],
    "nemotron": [(0, {"partial_rotary_factor": 1.0})],
    **{mt: [(0, {"rope_interleaved": False}), (0, {"partial_rotary_factor": 1.0})]
       for mt in ("glm", "glm4")},
    "cohere2": [(0, {"rope_interleaved": False}), (0, {"sliding_window": None}),
                (1, {"rope_parameters": {"rope_theta": 100.0}})],
    "cohere2_moe": [(0, {"rope_parameters": None, "rope_interleaved": None}),
                    (1, {"sliding_window": None}),
                    (2, {"rope_parameters": {"rope_theta": 100.0}})],
    "ernie4_5": [(0, {"rope_interleaved": False}), (0, {"qkv_bias": False})],
    "ernie4_5_moe": [(0, {"rope_interleaved": False})],
    "glm4_moe": [(0, {"partial_rotary_factor": 1.0}), (0, {"qk_norm": None}),
                 (0, {"rope_interleaved": True})],
    "minimax_m2": [(0, {"partial_rotary_factor": 1.0}), (0, {"qk_norm": None})],
    "molmo2_text": [(0, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
                    (1, {"rope_parameters": YARN}), (0, {"qk_norm": None})],
    "granitemoe": [(0, {"scale": None})],
    **{mt: [(0, {"sinks": False}), (0, {"scale": None}), (0, {"sliding_window": None}),
            (0, {"rope_parameters": {"rope_theta": 10000.0}}),
            (1, {"rope_parameters": {"rope_theta": 100.0}})]
       for mt in ("granite_swa", "granitemoe_swa")},
    "nanochat": [(0, {"qk_norm": None})],
    # bidirectional undone: causal, the window's left half kept (W + 1 keys, the query's own)
    "openai_privacy_filter": [(0, {"causal": True, "sliding_window": 3}),
                              (0, {"sliding_window": None}),
                              (0, {"sinks": False}), (0, {"rope_interleaved": False})],
    # ModernBERT: its window undone, the global θ on the local layer, causal; its decoder's too
    "modernbert": [(0, {"sliding_window": None}), (1, {"causal": True}),
                   (0, {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})],
    "modernbert-decoder": [(1, {"sliding_window": None}), (0, {"causal": False}),
                           (1, {"rope_parameters": {"rope_type": "default",
                                                    "rope_theta": 1000.0}})],
    "ultrabert": [(0, {"sliding_window": None}), (1, {"causal": True}),
                  (0, {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})],
    **{mt: [(0, {"causal": True})] for mt in ("eurobert", "nomic_bert", "jina_embeddings_v3")},
    "gte": [(0, {"causal": True}),
            (0, {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}})],
    "flint": [(0, {"sinks": False}), (0, {"qk_norm": None}), (0, {"sliding_window": None}),
              (1, {"rope_parameters": {"rope_theta": 10000.0}})],
    # Issue 42's hybrids
    "minimax": [(1, {"sliding_window": None})],
    "olmo_hybrid": [(1, {"qk_norm": None})],
    "kimi_linear": [(1, {"rope": True, "rope_theta": 100.0})],
    "falcon_h1": [(0, {"scale": None})],  # key_multiplier undone
    **{mt: [(1, {"rope_parameters": {"rope_theta": 100.0}})] for mt in ("jamba", "nemotron_h")},
    "bamba": [(1, {"partial_rotary_factor": 1.0})],
    "granitemoehybrid": [(1, {"scale": None}), (1, {"rope_parameters": None})],
    "zamba": [(2, {"scale": None}), (3, {"rope_parameters": {"rope_theta": 100.0}})],
    "zamba2": [(1, {"scale": None}), (2, {"rope_parameters": None})],
    "recurrent_gemma": [(1, {"sliding_window": None}), (1, {"partial_rotary_factor": 1.0})],
}


# Config fields HF's attention never reads (the experts' and the MLP's sizes): not behaviours
# of the attention, so not a reason to run a family's checks in the quick suite.
OUTSIDE_ATTENTION = {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "num_local_experts", "n_routed_experts",
                     "n_shared_experts", "shared_intermediate_size", "mlp_layer_types",
                     "mlp_bias", "intermediate_size_mlp", "moe_num_experts", "moe_k",
                     "first_k_dense_replace", "pad_token_id", "mlp_only_layers", "eos_token_id",
                     "moe_layer_start_index", "moe_topk", "zero_expert_num",
                     "expert_ffn_hidden_size", "ffn_hidden_size", "n_group", "topk_group",
                     "num_shared_experts", "num_dense_layers", "attention_in_multiplier",
                     "attention_out_multiplier", "lru_width", "conv1d_width", "n_groups",
                     "ssm_state_size", "conv_kernel", "chunk_size", "mamba_num_heads",
                     "mamba_head_dim", "n_mamba_heads", *MAMBA2, "mamba_d_ssm", "mamba_n_groups",
                     "mamba_expand", "mamba_dt_rank", "share_expert_dim",
                     "conv_L_cache", "bos_token_id", "cls_token_id", "sep_token_id",
                     "short_conv_kernel_size"}


# A hybrid's fields that say which layers are attention: each family's reading of them is
# checked against HF's own config (its layer_types) for every hybrid in the quick suite
# (test_hybrids_layer_kinds_are_hfs), so not a reason to run a model.
LAYER_KINDS = {"attn_layer_period", "attn_layer_offset", "attn_layer_indices",
               "layers_block_type", "block_types", "layer_types", "layer_group_size"}


def _fields(family) -> set:
    """The behaviours a family's tiny config sets: each field HF's attention reads, with its
    kind of value (tests/helpers.py ``kind``); a hybrid's without its LAYER_KINDS."""
    skip = OUTSIDE_ATTENTION | (LAYER_KINDS if family in HYBRIDS_42.values() else set())
    return {("field", k, kind(v)) for k, v in family.kw.items() if k not in skip}


# Issue 42's decoders mostly repeat the settings of the families before them and of each
# other: their forward and setting-undone checks run in the quick suite for a covering few
# (each config field they set that HF's attention reads, with its kind, and each setting undone,
# at least once; tests/helpers.py ``sweep``), for all of them in the whole matrix (issue 39:
# the quick suite's time). The round trip (no model run) checks every family in both.
SWEPT = {**DECODERS_42, **GATED_42, **OPTIONS_42, **LATENT_42, **HYBRIDS_42, **ENCODERS_42}
PER_FAMILY = [pytest.param(n, id=n) for n in FAMILIES if n not in SWEPT] + sweep(
    [pytest.param(n, id=n) for n in SWEPT],
    [_fields(SWEPT[n]) | {("undone", k) for _, change in DISTINCT[n] for k in change}
     for n in SWEPT])


def test_every_supported_family_is_tested():
    """Every model_type golden.hf converts has its tiny model in a tests/test_hf_import*.py."""
    tested = set()
    for path in sorted(Path(__file__).parent.glob("test_hf_import*.py")):
        if path.stem != "test_hf_import_linear":  # the linear layers' families: LINEAR's
            tested |= set(importlib.import_module(f"tests.{path.stem}").FAMILIES)
    assert tested == set(SUPPORTED)
    linear = importlib.import_module("tests.test_hf_import_linear").FAMILIES
    assert set(linear) == set(golden.hf.LINEAR)


@pytest.mark.parametrize("name", PER_FAMILY)
def test_layers_equal_the_models_own_attention(name, twin):
    family = FAMILIES[name]
    rng, seed = fresh_rng()
    config, model = build_model(FAMILIES[name], rng)
    ids = rng.integers(0, BASE["vocab_size"], (B, L))
    seen = captured(family, model, family.layers, ids)
    for i in family.layers:
        sd = state_dict(attention_of(FAMILIES[name], model, i))
        x, expected = seen[i]
        for precision in ("exact",) if name in EXACT_ANGLES_ONLY else ("exact", "hf"):
            variant, ours, params = golden.convert.from_hf(config.to_dict(), sd, layer_idx=i,
                                                           rope_precision=precision)
            with twin.float64():
                module = twin.build(variant, ours, params)
                module.eval()
                out = twin.numpy(module(twin.array(x)))
            error = rel(out, expected)
            exact = precision == "hf" and family.float32 is None and (
                twin.name == "torch" or "rope_parameters" not in ours)
            bound = EXACT if exact else FLOAT32_LEVEL
            assert error <= bound, (name, i, precision, error, seed)


# Arrays a family's conversion multiplies by a constant (a scaling of HF's forward folded into
# ours), which to_hf divides by it again: w·s / s is w to within one rounding, 1 ulp (measured
# on 10⁵ draws at LongCat-Flash's s_kv = √(16 / 6): 13% of the elements off by one ulp, none by
# more). {model_type: its state-dict keys}.
ROUNDED_BACK = {"longcat_flash": ("kv_a_layernorm.weight",),
                "dots3_note_text": ("q_a_layernorm.weight", "kv_a_layernorm.weight")}
# The block indexers' Gemma-style norm weights w, ours the multipliers 1 + w (golden.hf.blocks):
# to_hf's (1 + w) − 1 is w to within the rounding of 1 + w, at most one ulp of 2 (2⁻⁵¹), an
# absolute bound (w near 0 loses its low bits relative to itself). {model_type: keys}.
OFFSET_BACK = {"minimax_m3_vl_text": ("indexer.q_norm.weight", "indexer.k_norm.weight"),
               "qwen4_exp_text": ("indexer.q_layernorm.weight", "indexer.k_layernorm.weight")}
# Families whose to_hf cannot give back the module's very arrays, each with why (tested apart).
NOT_ROUND_TRIPPED = {"zamba2": "each call site's adapters are folded into its projections "
                               "(test_zamba2_adapters_fold_per_call_site_and_moves_far_without)"}


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in NOT_ROUND_TRIPPED])
def test_round_trip_gives_back_the_same_arrays(name):
    rng, _ = fresh_rng()
    config, model = build_model(FAMILIES[name], rng)
    for i in FAMILIES[name].layers:
        sd = state_dict(attention_of(FAMILIES[name], model, i))
        result = golden.convert.from_hf(config, sd, layer_idx=i)
        back = golden.convert.to_hf(*result)
        assert set(back) == set(sd), name
        for key, a in sd.items():
            if key in ROUNDED_BACK.get(name, ()):
                np.testing.assert_allclose(back[key], a, rtol=2.0 ** -52, atol=0,
                                           err_msg=f"{name} {key}")
            elif key in OFFSET_BACK.get(name, ()):
                np.testing.assert_allclose(back[key], a, rtol=0, atol=2.0 ** -51,
                                           err_msg=f"{name} {key}")
            else:
                np.testing.assert_array_equal(back[key], a, err_msg=f"{name} {key}")
            assert not np.shares_memory(back[key], a)


def test_unsupported_family_and_settings_are_named():
    with pytest.raises(ValueError, match=r"model_type 'qwen2_vl' is not supported; supported: "):
        golden.convert.from_hf({"model_type": "qwen2_vl"}, {})
    config = dict(transformers.Qwen2Config(**BASE, num_hidden_layers=1).to_dict(),
                  rope_parameters={"rope_type": "mrope", "rope_theta": 10.0,
                                   "mrope_section": [1, 1, 1]})
    with pytest.raises(ValueError, match=r"model_type 'qwen2': rope_parameters\['rope_type'\] "
                                         r"= 'mrope' is not supported"):
        golden.convert.from_hf(config, {})
    rng, _ = fresh_rng()
    # mrope_section under a 1-D family's default type: HF's Qwen2 ignores it, and so do we.
    config, model = build_model(FAMILIES["qwen2"], rng)
    config = dict(config.to_dict(), rope_parameters={
        **config.to_dict()["rope_parameters"], "mrope_section": [1, 1, 1]})
    kwargs = golden.convert.from_hf(config, state_dict(attention_of(FAMILIES["qwen2"], model,
                                                                   0)))[1]
    assert "mrope_section" not in kwargs.get("rope_parameters", {})
    config, model = build_model(FAMILIES["qwen3_next"], rng)
    # its linear_attention layer 0 converts as Gated DeltaNet (tests/test_hf_import_linear.py):
    # given the attention's arrays instead, the linear layer's are named missing
    with pytest.raises(ValueError, match=r"model_type 'qwen3_next': the state dict has no "
                                         r"'in_proj_qkvz.weight'"):
        golden.convert.from_hf(config, state_dict(attention_of(FAMILIES["qwen3_next"], model,
                                                               1)), layer_idx=0)
    sd = state_dict(attention_of(FAMILIES["qwen3_next"], model, 1))
    del sd["k_proj.weight"]
    with pytest.raises(ValueError, match=r"model_type 'qwen3_next': the state dict has no "
                                         r"'k_proj.weight'"):
        golden.convert.from_hf(config, sd, layer_idx=1)


# Each hybrid's layers that are not softmax attention: (layer, the kind named).
HYBRID_OTHERS = {"jamba": (0, "linear_attention"), "bamba": (0, "linear_attention"),
                 "granitemoehybrid": (0, "linear_attention"),
                 "nemotron_h": (0, "linear_attention"), "zamba": (1, "linear_attention"),
                 "zamba2": (0, "linear_attention"), "recurrent_gemma": (0, "recurrent")}
# (Ling 3.0's linear_attention layers convert as Kimi Delta Attention: tests/
# test_hf_import_linear.py)


@pytest.mark.parametrize("name", list(HYBRIDS_42))
def test_hybrids_layer_kinds_are_hfs(name):
    """Which layers are softmax attention, as golden.hf.hybrids reads each family's own
    fields, equals HF's config's own layer_types (its kinds of layer), and the tiny model's
    tested layers are those."""
    from golden.hf.hybrids import ATTENTION, layer_kinds

    family = FAMILIES[name]
    config = getattr(transformers, family.config)(**{**BASE, **family.kw})
    ours = [i for i, k in enumerate(layer_kinds(config.to_dict())) if k in ATTENTION]
    hfs = [i for i, k in enumerate(config.layer_types)
           if k in ("full_attention", "sliding_attention", "hybrid")]
    assert ours == hfs == list(family.layers), (ours, hfs, config.layer_types)


@pytest.mark.parametrize("name", list(HYBRID_OTHERS))
def test_hybrids_other_layers_are_refused_by_kind(name):
    """A hybrid's Mamba (or RG-LRU) layer is refused by name and kind, before any array is
    read, as Qwen3-Next's linear_attention layers are; so is Nemotron-H's MLP layer and a
    layer past the config's count."""
    family = FAMILIES[name]
    config = getattr(transformers, family.config)(**{**BASE, **family.kw}).to_dict()
    layer, kind = HYBRID_OTHERS[name]
    with pytest.raises(ValueError, match=rf"model_type '{name}': layer {layer} is a '{kind}' "
                                         rf"layer \((Mamba|RG-LRU|Kimi Delta Attention)[^)]*not "
                                         rf"softmax attention\)"):
        golden.convert.from_hf(config, {}, layer_idx=layer)
    with pytest.raises(ValueError, match=r"layer_idx should be in \[0, "):
        golden.convert.from_hf(config, {}, layer_idx=7)
    if name == "nemotron_h":  # a legacy config.json's pattern: the MLP layer named
        legacy = {k: v for k, v in config.items() if k != "layers_block_type"}
        with pytest.raises(ValueError, match=r"layer 1 is a 'mlp' layer \(an MLP, no "
                                             r"attention\)"):
            golden.convert.from_hf(dict(legacy, hybrid_override_pattern="M-*"), {}, layer_idx=1)


def test_zamba2_adapters_fold_per_call_site_and_moves_far_without():
    """Zamba 2's shared block serves hybrid layers 1 and 2 with their own adapters: each
    layer's conversion equals HF's output at that layer (test_layers_equal_...); the same
    block converted with the other layer's adapters, or none, is far from it; to_hf gives
    back the folded projections, which convert again (adapters off) to the same arrays."""
    family = FAMILIES["zamba2"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    sd = state_dict(attention_of(family, model, 1))  # the one block: both call sites' adapters
    plain = dict(config.to_dict(), use_shared_attention_adapter=False)
    twin = TWINS["torch"]
    for layer, other in ((1, 2), (2, 1)):
        x, expected = seen[layer]
        swapped = dict(config.to_dict(), layers_block_type=["mamba", "hybrid", "hybrid"])
        for c, at in ((config.to_dict(), layer), (plain, layer)):
            variant, ours, params = golden.convert.from_hf(c, sd, layer_idx=at)
            with twin.float64():
                module = twin.build(variant, ours, params)
                out = twin.numpy(module(twin.array(x)))
            error = rel(out, expected)
            if c is plain:
                assert error > 1e3 * FLOAT32_LEVEL, (layer, error, seed)
            else:
                assert error <= FLOAT32_LEVEL, (layer, error, seed)
        variant, ours, params = golden.convert.from_hf(swapped, sd, layer_idx=other)
        with twin.float64():
            out = twin.numpy(twin.build(variant, ours, params)(twin.array(x)))
        assert rel(out, expected) > 1e3 * FLOAT32_LEVEL, (layer, other, seed)
        folded = golden.convert.from_hf(config, sd, layer_idx=layer)
        back = golden.convert.to_hf(*folded)
        assert set(back) == {f"{p}_proj.weight" for p in "qkvo"}
        again = golden.convert.from_hf(plain, back, layer_idx=layer)[2]
        for n, a in folded[2].items():
            np.testing.assert_array_equal(again[n], a)


def test_issue_42_settings_we_do_not_express_are_named():
    """Gemma's use_bidirectional_attention (HF's Gemma is then bidirectional without a padding
    mask and causal with one), Ministral 3 without its temperature's fields, PhiMoE's
    mscales switching with the length: each refused by name, before any array is read."""
    def config(name, **kw):
        family = FAMILIES[name]
        return getattr(transformers, family.config)(**{**BASE, **family.kw, **kw}).to_dict()

    with pytest.raises(ValueError, match=r"model_type 'gemma': use_bidirectional_attention = "
                                         r"True is not supported \(HF's Gemma then attends"):
        golden.convert.from_hf(config("gemma", use_bidirectional_attention=True), {})
    rope = {k: v for k, v in FAMILIES["ministral3"].kw["rope_parameters"].items()
            if k != "llama_4_scaling_beta"}
    with pytest.raises(ValueError, match=r"model_type 'ministral3': rope_parameters should give "
                                         r"llama_4_scaling_beta"):
        golden.convert.from_hf(dict(config("ministral3"), rope_parameters=rope), {})
    rope = dict(FAMILIES["phimoe"].kw["rope_parameters"], long_mscale=2.0)
    with pytest.raises(ValueError, match=r"model_type 'phimoe': rope_parameters with rope_type "
                                         r"'longrope', short_mscale 1.3 and long_mscale 2.0 is "
                                         r"not supported"):
        golden.convert.from_hf(dict(config("phimoe"), rope_parameters=rope), {})


@pytest.mark.parametrize("name", PER_FAMILY)
def test_each_distinctive_setting_moves_the_output_far_more_than_the_agreement(name):
    """Undoing one of the family's settings (a window, a norm, the sinks, the RoPE scaling...)
    changes the layer's output by more than 10³ times the bound we hold HF's output to, so the
    agreement above is not blind to it."""
    rng, seed = fresh_rng()
    config, model = build_model(FAMILIES[name], rng)
    assert_each_undone_moves_the_output(FAMILIES[name], config, model, DISTINCT[name], rng,
                                        (name, seed))


# Latent attention has exact angles only (its comparison with HF is at float32 level anyway:
# HF's RMSNorm of the latent is float32).
EXACT_ANGLES_ONLY = {"deepseek_v3", *LATENT_42, *INDEXED_44, "bailing_hybrid"}


def _angles(name):
    return "exact" if name in EXACT_ANGLES_ONLY else "hf"


def _bound(family, twin, ours, precision):
    exact = precision == "hf" and family.float32 is None and (
        twin.name == "torch" or "rope_parameters" not in ours)
    return EXACT if exact else FLOAT32_LEVEL


# Hybrid fields whose whole effect is made by the conversion (our scale, RoPE on or off, the
# adapters folded into the projections): the forward test above checks each in the quick
# suite; decoding, padding and the gradient then take paths other families' take there.
CONVERSION_ONLY = {"key_multiplier", "position_embedding_type", "use_shared_attention_adapter",
                   "adapter_rank", "num_mem_blocks"}
FAMILY_SWEEP = sweep([pytest.param(n, id=n) for n in FAMILIES],
                     [{f for f in _fields(family) if f[1] not in CONVERSION_ONLY}
                      for family in FAMILIES.values()])


# Decoding through our cache (and below, left padding and the input gradient), for a covering
# few of the families in the quick suite (each config field they set, with its kind of value,
# at least once; tests/helpers.py ``sweep``), for every family in the whole matrix; each
# family's conversion is checked by the test above in both.
# Families that do not decode, each with why: left out of the decoding test.
NOT_DECODED = {"openai_privacy_filter": "bidirectional (a token classifier): nothing to decode",
               **{mt: "a bidirectional encoder: nothing to decode" for mt in ENCODERS_42
                  if mt != "modernbert-decoder"}}


@pytest.mark.parametrize("name", [p for p in FAMILY_SWEEP if p.id not in NOT_DECODED])
def test_prefill_and_decode_with_our_cache_equal_the_full_forward(name, twin):
    # The first 4 tokens in one call, then one at a time, through the module's KV cache:
    # each token's output equals HF's full forward's (its own masks and positions).
    family = FAMILIES[name]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    for i in family.layers:
        x, expected = seen[i]
        variant, ours, params = golden.convert.from_hf(
            config, state_dict(attention_of(family, model, i)), layer_idx=i,
            rope_precision=_angles(name))
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            cache = module.init_cache(B, L)
            outs = []
            for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, L)]:
                out, cache = module(twin.array(x[:, start:stop]), cache=cache)
                outs.append(twin.numpy(out))
        error = rel(np.concatenate(outs, axis=1), expected)
        assert error <= _bound(family, twin, ours, "hf"), (name, i, error, seed)


LEFT_PAD = 3  # row 1 starts with 3 padding tokens
# Layers left out of the left-padding test, each with why (docs/hf.md lists them):
NOT_LEFT_PADDED = {
    # MiniMax M3's indexer scores every causal key whatever the mask (its padding keys too:
    # tests/test_indexer_blocks.py), ours the keys the mask lets a query see: the same under
    # right padding, not under left padding.
    "minimax_m3_vl_text": {0},
    # HF's eager Gemma 2 gives NaN on the padding's query rows (every key masked, scores
    # soft-capped), and the next layer's every row reads them (NaN · 0 = NaN): layer 0 only.
    "gemma2": {1},
    "vaultgemma": {1},  # Gemma 2's attention: the same NaN
    # Granite SWA's eager attention gives NaN on the padding's rows (every key masked: its
    # softmax of -inf), and the next layer's every row reads them: layer 0 only.
    **{mt: {1} for mt in ("granite_swa", "granitemoe_swa")},
    # Llama 4's chunks start after the padding in HF (masking_utils shifts them by each row's
    # padding); ours count in token order: not the same function with left padding.
    "llama4_text": {0},
}


# Families whose HF query temperature reads position_ids (not the token index)
TEMPERATURE_AT_POSITIONS = {"beam"}


@pytest.mark.parametrize("name", FAMILY_SWEEP)
def test_left_padded_batch_equals_the_models_own_attention(name, twin):
    # HF's model given attention_mask (0 on row 1's first 3 tokens) and position_ids counting
    # the real tokens (as generate passes them); ours given the padding as mask (keys) and the
    # same positions. The real tokens' rows must agree.
    family = FAMILIES[name]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    ids = rng.integers(0, BASE["vocab_size"], (B, L))
    real = np.ones((B, L), np.int64)
    real[1, :LEFT_PAD] = 0
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    seen = captured(family, model, family.layers, ids,
                    attention_mask=torch.from_numpy(real),
                    position_ids=torch.from_numpy(positions))
    keys = np.broadcast_to(real.astype(bool)[:, None, :], (B, L, L))  # (B, L, L)
    for i in sorted(set(family.layers) - NOT_LEFT_PADDED.get(name, set())):
        x, expected = seen[i]
        variant, ours, params = golden.convert.from_hf(
            config, state_dict(attention_of(family, model, i)), layer_idx=i,
            rope_precision=_angles(name))
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            # positions are RoPE's; a NoPE layer's query temperature reads the token index in
            # Llama 4 (cache_position), which is ours without positions, position_ids in Beam
            rope = "rope_parameters" in ours or "rope_theta" in ours or (
                name in TEMPERATURE_AT_POSITIONS and "query_temperature" in ours)
            out = twin.numpy(module(twin.array(x), twin.array(keys.copy()), positions=(
                twin.array(positions.astype(np.int32)) if rope else None)))
        rows = real.astype(bool)
        error = rel(out[rows], expected[rows])
        assert error <= _bound(family, twin, ours, "hf"), (name, i, error, seed)


@pytest.mark.parametrize("name", FAMILY_SWEEP)
def test_input_gradient_through_the_torch_twin_equals_hfs(name):
    # dL/dx of Σ out ⊙ dO: HF's attention module called again as the model called it (its
    # masks and position embeddings), against our torch module's.
    family = FAMILIES[name]
    twin = TWINS["torch"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    calls = {}
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)),
                    calls=calls, use_cache=False)  # no cache object to append to again
    for i in family.layers:
        x, expected = seen[i]
        d_out = rng.standard_normal(expected.shape)
        hf = attention_of(family, model, i)
        args, kwargs = calls[i]
        xt = torch.from_numpy(x.copy()).requires_grad_()
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=xt)
        else:
            args = (xt,) + tuple(args[1:])
        (hf(*args, **kwargs)[0] * torch.from_numpy(d_out)).sum().backward()
        variant, ours, params = golden.convert.from_hf(
            config, state_dict(hf), layer_idx=i, rope_precision=_angles(name))
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            ours_x = torch.from_numpy(x.copy()).requires_grad_()
            (module(ours_x) * torch.from_numpy(d_out)).sum().backward()
        error = rel(ours_x.grad.numpy(), xt.grad.numpy())
        assert error <= _bound(family, twin, ours, "hf"), (name, i, error, seed)


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # llama3 and yarn
def test_a_config_json_of_before_transformers_5_converts_alike(name):
    """Published config.json files of before transformers 5 keep θ at the top and the scaling
    in ``rope_scaling`` (its kind under "type" or "rope_type"): read as transformers 5 reads
    them, the same RoPE settings as the 5.x form, not the scaling dropped."""
    from golden.specification.validate import rope_settings

    family = FAMILIES[name]
    rng, _ = fresh_rng()
    config, model = build_model(family, rng)
    new = config.to_dict()
    rope = dict(new["rope_parameters"])
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=rope.pop("rope_theta"), rope_scaling=dict(rope, type=rope.pop(
        "rope_type")))
    sd = state_dict(attention_of(family, model, family.layers[0]))
    settings = [rope_settings(None, golden.convert.from_hf(c, sd, layer_idx=family.layers[0])[1]
                              ["rope_parameters"]) for c in (old, new)]
    assert settings[0] == settings[1] and dict(settings[0])["rope_type"] != "default", name


def test_minimax_m2_legacy_rotary_dim_converts_as_hfs_config_reads_it():
    """A MiniMax-M2 config.json of before transformers 5 (θ at the top, the partial rotary as
    ``rotary_dim`` features, no rope_parameters) gives the RoPE of transformers 5's form."""
    family = FAMILIES["minimax_m2"]
    rng, _ = fresh_rng()
    config, model = build_model(family, rng)
    new = config.to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = new["rope_parameters"]["rope_theta"]
    sd = state_dict(attention_of(family, model, 0))
    rope = [golden.convert.from_hf(c, sd)[1]["rope_parameters"] for c in (old, new)]
    assert rope[0]["partial_rotary_factor"] == rope[1]["partial_rotary_factor"] == 0.5
    assert rope[0]["rope_theta"] == rope[1]["rope_theta"]


def test_exaone4_5s_text_tower_converts_as_exaone4():
    """EXAONE 4.5's composite config: HF reads its text_config (model_type exaone4_5_text in
    a config.json) as exaone4, so from_hf converts its text tower as EXAONE 4's; the composite
    itself is refused by name."""
    family = FAMILIES["exaone4"]
    rng, _ = fresh_rng()
    config, model = build_model(family, rng)
    text = dict(config.to_dict(), model_type="exaone4_5_text")
    composite = transformers.Exaone4_5_Config(text_config=text).to_dict()
    sd = state_dict(attention_of(family, model, 1))
    assert (golden.convert.from_hf(composite["text_config"], sd, layer_idx=1)[1]
            == golden.convert.from_hf(config, sd, layer_idx=1)[1])
    with pytest.raises(ValueError, match=r"model_type 'exaone4_5' is not supported"):
        golden.convert.from_hf(composite, sd)


def test_longcat_flash_folded_latent_scale_undone_moves_the_output():
    """LongCat-Flash's s_kv = √(D / r), folded into kv_a_norm's weight by from_hf (its s_q is
    our scale, undone in DISTINCT): without it the output moves far beyond the bound."""
    family = FAMILIES["longcat_flash"]
    twin = TWINS["torch"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    x, expected = captured(family, model, (0,), rng.integers(0, BASE["vocab_size"], (B, L)))[0]
    variant, ours, params = golden.convert.from_hf(config, state_dict(attention_of(family,
                                                                                   model, 0)))
    s_kv = (config.hidden_size / config.kv_lora_rank) ** 0.5
    for kv_a_norm, far in ((params["kv_a_norm"], False), (params["kv_a_norm"] / s_kv, True)):
        with twin.float64():
            module = twin.build(variant, ours, dict(params, kv_a_norm=kv_a_norm))
            out = twin.numpy(module(twin.array(x)))
        assert (rel(out, expected) > 1e3 * FLOAT32_LEVEL) == far, (far, seed)


def test_issue_42_encoders_configs_of_before_transformers_5_and_bad_windows():
    """ModernBERT's config.json of before transformers 5 (global_rope_theta, local_rope_theta,
    no rope_parameters) converts as HF's config class reads it (each layer type its θ), a GTE
    one without any θ with HF's default (160000, never NoPE); a ModernBERT local_attention that
    is not an int ≥ 2 and an UltraBERT config without rope_parameters are refused by name."""
    rng, _ = fresh_rng()
    config, model = build_model(FAMILIES["modernbert"], rng)
    old = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    old.update(global_rope_theta=1000.0, local_rope_theta=100.0)
    hf_reads = transformers.ModernBertConfig(**old).to_dict()
    for i in (0, 1):
        sd = state_dict(attention_of(FAMILIES["modernbert"], model, i))
        ours = golden.convert.from_hf(old, sd, layer_idx=i)[1]
        assert ours == golden.convert.from_hf(hf_reads, sd, layer_idx=i)[1]
        assert ours == golden.convert.from_hf(config, sd, layer_idx=i)[1]
        assert ours["rope_parameters"]["rope_theta"] == (100.0, 1000.0)[i]
    with pytest.raises(ValueError, match=r"model_type 'modernbert': local_attention should be "
                                         r"an int ≥ 2 \(the sliding layers' total window\), "
                                         r"got None"):
        golden.convert.from_hf(dict(config.to_dict(), local_attention=None), sd, layer_idx=0)
    config, model = build_model(FAMILIES["gte"], rng)
    sd = state_dict(attention_of(FAMILIES["gte"], model, 0))
    bare = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    assert golden.convert.from_hf(bare, sd)[1]["rope_theta"] == 160_000.0
    assert transformers.GteConfig(**bare).rope_parameters["rope_theta"] == 160_000.0
    config, model = build_model(FAMILIES["ultrabert"], rng)
    bare = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    with pytest.raises(ValueError, match=r"model_type 'ultrabert': the config has no "
                                         r"rope_parameters"):
        golden.convert.from_hf(bare, state_dict(attention_of(FAMILIES["ultrabert"], model, 0)))


# ---- Gemma 4's cross-layer KV sharing ---------------------------------------------------------

# gemma4_text's tiny model on 4 layers, the last 2 reusing (num_kv_shared_layers = 2), layer
# types mixed (HF's last layer is a full one): layer 2 (sliding) reuses layer 0's keys and
# values, layer 3 (full) layer 1's.
GEMMA4_SHARED = Family("Gemma4TextConfig", dict(
    FAMILIES["gemma4_text"].kw, num_hidden_layers=4, num_kv_shared_layers=2,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    layers=(0, 1, 2, 3), float32="Gemma4RMSNorm")
# Gemma 3n's the same way (its kv_sharing_modes the same rule)
GEMMA3N_SHARED = Family("Gemma3nTextConfig", dict(
    FAMILIES["gemma3n_text"].kw, num_hidden_layers=4, num_kv_shared_layers=2,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    layers=(0, 1, 2, 3), float32="Gemma3nRMSNorm")
SHARED = {"gemma4_text": GEMMA4_SHARED, "gemma3n_text": GEMMA3N_SHARED}


@pytest.mark.parametrize("mt", SHARED)
def test_kv_source_is_hugging_faces_kv_sharing_modes(mt):
    rng, _ = fresh_rng()
    config, _ = build_model(SHARED[mt], rng)
    modes, types = config.kv_sharing_modes, config.layer_types
    sources = [golden.hf.kv_source(config.to_dict(), i) for i in range(4)]
    assert sources == [None, None, 0, 1]
    for i, j in enumerate(sources):
        assert (j is not None) == (modes[i] == "reuse")
        if j is not None:
            assert modes[j] == "store" and types[j] == types[i]
    plain, _ = build_model(FAMILIES[mt], rng)  # no sharing: every layer its own
    assert [golden.hf.kv_source(plain, i) for i in range(2)] == [None, None]
    with pytest.raises(ValueError, match=r"layer_idx should be in \[0, 4\)"):
        golden.hf.kv_source(config.to_dict(), 4)


@pytest.mark.parametrize("mt", SHARED)
def test_reusing_layers_equal_the_models_own_attention(twin, mt):
    # Each reusing layer R, converted (kv_shared=True: q_proj, q_norm, o_proj only), called on
    # its own captured input with the cache its storing layer S made from S's captured input,
    # equals HF's reusing layer's output in the model's own forward, at HF's float32 floor (its
    # RoPE angles and Gemma4RMSNorm / Gemma3nRMSNorm), as the family's other rows.
    rng, seed = fresh_rng()
    family = SHARED[mt]
    config, model = build_model(family, rng)
    seen = captured(family, model, (0, 1, 2, 3),
                    rng.integers(0, BASE["vocab_size"], (B, L)))
    for i in (2, 3):
        j = golden.hf.kv_source(config, i)
        store_result, reuse_result = (
            golden.convert.from_hf(config.to_dict(), state_dict(attention_of(
                family, model, k)), layer_idx=k) for k in (j, i))
        assert reuse_result[1]["kv_shared"] and "v_norm" not in reuse_result[1]
        assert sorted(reuse_result[2]) == ["W_out", "W_query", "q_norm"]
        assert golden.convert.to_hf(*reuse_result).keys() == state_dict(
            attention_of(family, model, i)).keys()
        with twin.float64():
            store, reuse = (twin.build(*r) for r in (store_result, reuse_result))
            _, cache = store(twin.array(seen[j][0]), cache=store.init_cache(B, L))
            out, _ = reuse(twin.array(seen[i][0]), cache=cache)
        error = rel(twin.numpy(out), seen[i][1])
        assert error <= FLOAT32_LEVEL, (i, error, seed)
        # the storing layer's own input matters: its cache made from R's input instead (the
        # design's "both read the same x", not HF's) moves the output far
        with twin.float64():
            _, wrong = store(twin.array(seen[i][0]), cache=store.init_cache(B, L))
            far, _ = reuse(twin.array(seen[i][0]), cache=wrong)
        assert rel(twin.numpy(far), seen[i][1]) > 1e3 * FLOAT32_LEVEL, (i, seed)


def test_beam_temperature_at_far_positions_and_undone_moves_the_output():
    """Beam's NoPE full layer scales q by (1 + (p + 1)/2048)^0.1, which is 1.0004 at most
    within the tiny model's L tokens (too near 1 for the undone test above): at positions
    5000 … 5000 + L − 1 (HF's position_ids, ours the same positions) it is 1.13, and the layer
    agrees at the float32 level (HF's factor and q scaled in float32); without the temperature
    it moves far beyond it."""
    family = FAMILIES["beam"]
    twin = TWINS["torch"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    positions = np.broadcast_to(5000 + np.arange(L), (B, L)).copy()
    x, expected = captured(family, model, (1,), rng.integers(0, BASE["vocab_size"], (B, L)),
                           position_ids=torch.from_numpy(positions))[1]
    variant, ours, params = golden.convert.from_hf(config, state_dict(attention_of(family,
                                                                                   model, 1)),
                                                   layer_idx=1)
    assert ours["query_temperature"]["kind"] == "power" and "rope_parameters" not in ours
    for temperature, far in ((ours["query_temperature"], False), (None, True)):
        settings = {k: v for k, v in dict(ours, query_temperature=temperature).items()
                    if v is not None}
        with twin.float64():
            module = twin.build(variant, settings, params)
            module.eval()
            out = twin.numpy(module(twin.array(x), positions=twin.array(positions.astype(
                np.int32))))
        error = rel(out, expected)
        assert (error > 1e3 * FLOAT32_LEVEL if far else error <= FLOAT32_LEVEL), (far, error,
                                                                                  seed)


def test_laguna_gate_per_head_equals_hfs():
    """Laguna's gating True (its default, "per-head"): one softplus gate per head from g_proj
    (D -> N), our output_gate "softplus_per_head", on both layers of the tiny model (its
    table entry has gating "per-element")."""
    family = FAMILIES["laguna"]
    family = Family(family.config, dict(family.kw, gating=True), layers=family.layers,
                    float32=family.float32)
    twin = TWINS["torch"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    seen = captured(family, model, family.layers, rng.integers(0, BASE["vocab_size"], (B, L)))
    for i in family.layers:
        x, expected = seen[i]
        sd = state_dict(attention_of(family, model, i))
        variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=i)
        assert ours["output_gate"] == "softplus_per_head"
        assert params["W_gate"].shape == (BASE["hidden_size"], ours["num_heads"])
        with twin.float64():
            out = twin.numpy(twin.build(variant, ours, params)(twin.array(x)))
        assert rel(out, expected) <= FLOAT32_LEVEL, (i, rel(out, expected), seed)


def test_options_42_settings_we_do_not_express_are_named():
    """Beam's gate bias is one value per head: to_hf refuses a b_gate that differs within a
    head; Step 3.5's attention takes one σ per head only, and causal attention: a config
    asking for a per-feature gate or bidirectional attention is refused by name."""
    family = FAMILIES["beam"]
    rng, _ = fresh_rng()
    config, model = build_model(family, rng)
    variant, ours, params = golden.convert.from_hf(config, state_dict(attention_of(family,
                                                                                   model, 0)))
    b = params["b_gate"].copy()
    b[1] += 1.0  # head 0's second feature
    with pytest.raises(ValueError, match=r"model_type 'beam': b_gate should be constant within "
                                         r"each head"):
        golden.convert.to_hf(variant, ours, dict(params, b_gate=b))
    step = getattr(transformers, FAMILIES["step3p5"].config)(
        **{**BASE, **FAMILIES["step3p5"].kw}).to_dict()
    with pytest.raises(ValueError, match=r"model_type 'step3p5': gating = 'per-element' is not "
                                         r"supported"):
        golden.convert.from_hf(dict(step, gating="per-element"), {})
    with pytest.raises(ValueError, match=r"model_type 'step3p5': use_bidirectional_attention = "
                                         r"True is not supported"):
        golden.convert.from_hf(dict(step, use_bidirectional_attention=True), {})
    lfm3 = getattr(transformers, FAMILIES["lfm3"].config)(**{**BASE, **FAMILIES["lfm3"].kw})
    with pytest.raises(ValueError, match=r"model_type 'lfm3': layer 0 is a 'conv' layer \(a "
                                         r"gated short convolution, not softmax attention\); "
                                         r"only its attention layers convert \(1, 2\)"):
        golden.convert.from_hf(lfm3, {}, layer_idx=0)


def test_step3p7_is_refused_by_name_and_its_text_config_converts():
    with pytest.raises(ValueError, match=r"model_type 'step3p7' is not supported: .*pass its "
                                         r"text_config \(model_type 'step3p5'"):
        golden.convert.from_hf({"model_type": "step3p7"}, {})


def test_chameleon_norm_weight_and_bias_gradients_equal_hfs():
    # dL/d(q_norm, q_norm_bias, k_norm, k_norm_bias) of Σ out ⊙ dO: HF's ChameleonLayerNorm's
    # weight and bias gradients (N, Dh) and (Nkv, Dh), its attention called as the model called
    # it, against our torch module's, float64 (RoPE's angles as HF's: EXACT).
    family, twin = FAMILIES["chameleon"], TWINS["torch"]
    rng, seed = fresh_rng()
    config, model = build_model(family, rng)
    calls = {}
    seen = captured(family, model, (0,), rng.integers(0, BASE["vocab_size"], (B, L)),
                    calls=calls, use_cache=False)
    x, expected = seen[0]
    d_out = torch.from_numpy(rng.standard_normal(expected.shape))
    hf = attention_of(family, model, 0)
    args, kwargs = calls[0]
    hf.zero_grad()
    (hf(*args, **kwargs)[0] * d_out).sum().backward()
    variant, ours, params = golden.convert.from_hf(config, state_dict(hf), layer_idx=0,
                                                   rope_precision="hf")
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        (module(torch.from_numpy(x)) * d_out).sum().backward()
    theirs = {"q_norm": hf.q_norm.weight, "q_norm_bias": hf.q_norm.bias,
              "k_norm": hf.k_norm.weight, "k_norm_bias": hf.k_norm.bias}
    for name, p in theirs.items():
        g, mine = p.grad.numpy(), getattr(module, name).grad.numpy()
        assert mine.shape == g.shape and rel(mine, g) <= EXACT, (name, rel(mine, g), seed)


def test_deepseek_v4_is_refused_by_name_with_what_it_adds():
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v4' is not supported: DeepSeek "
                                         r"V4's compressed sparse attention \(its CSA/HCA"):
        golden.convert.from_hf({"model_type": "deepseek_v4"}, {})


@pytest.mark.parametrize("mt", sorted(set(golden.hf.latent.REFUSED) - {"deepseek_v4"}))
def test_issue_44_composites_say_to_pass_their_text_config(mt):
    # from_hf converts one tower: a composite's config is refused with the tower to pass
    # (attn-parity hf reads the composite's checkpoint: tests/test_hf_composites.py)
    text = mt + "_text"
    with pytest.raises(ValueError, match=rf"model_type {mt!r} is not supported: it is a "
                                         rf"composite model: .*pass its text_config "
                                         rf"\(model_type {text!r}\)"):
        golden.convert.from_hf({"model_type": mt}, {})


@pytest.mark.parametrize("mt", ["glm_moe_dsa", "hy_v4"])
def test_shared_indexer_layers_take_the_previous_layers_choice(mt, twin):
    # indexer_types ["full", "shared"]: layer 1 has no indexer and attends the keys layer 0's
    # chose (HF passes them as prev_topk_indices). Converted as index_select "given", given
    # the choice HF's layer 1 received, both twins equal HF's layer 1 at HF's float32 floor;
    # every key allowed instead moves the output far.
    rng, seed = fresh_rng()
    variant, ours, params, x, expected, chosen = shared_indexer_case(FAMILIES[mt], rng)
    with twin.float64():
        module = twin.build(variant, ours, params)
        out = twin.numpy(module(twin.array(x), key_indices=twin.array(chosen)))
        every = {n: v for n, v in ours.items() if n not in ("index_topk", "index_select")}
        dense = twin.numpy(twin.build(variant, every, params)(twin.array(x)))
    assert rel(out, expected) <= FLOAT32_LEVEL, seed
    assert rel(dense, expected) > 1e3 * FLOAT32_LEVEL, seed
