"""Multi-head latent attention: DeepSeek-V3 (Kimi K2's checkpoints are this model_type), one
entry of ``FAMILIES``. Keys and values come from a low-rank latent (``kv_a_proj_with_mqa``,
its RMSNorm, ``kv_b_proj``), queries from ``q_proj`` or, with a ``q_lora_rank``, from
``q_a_proj``, its RMSNorm and ``q_b_proj``; our MultiHeadLatentAttention holds the same
arrays, transposed to (in, out). The checkpoint keeps it at ``layers.N.self_attn``, the Family's
default ``stacks``.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import Family, _read, _rope
from golden.specification.mapping import _numpy

MLA = "multi_head_latent_attention"
MLA_NAMES = {"W_query": "q_proj", "W_q_a": "q_a_proj", "W_q_b": "q_b_proj",
             "W_kv_a": "kv_a_proj_with_mqa", "W_kv_b": "kv_b_proj", "W_out": "o_proj"}
MLA_NORMS = {"q_a_norm": "q_a_layernorm.weight", "kv_a_norm": "kv_a_layernorm.weight"}


def _deepseek_settings(c, layer_idx, sd):
    mt = "deepseek_v3"
    n = c["num_attention_heads"]
    if (c.get("num_key_value_heads") or n) != n:
        raise ValueError(f"model_type {mt!r}: num_key_value_heads should equal "
                         f"num_attention_heads = {n} (latent attention expands one latent to "
                         f"every head), got {c['num_key_value_heads']}")
    rope = _rope(c, None, mt)
    ours = dict(d_in=c["hidden_size"], num_heads=n, kv_lora_rank=c["kv_lora_rank"],
                qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                v_head_dim=c["v_head_dim"], q_lora_rank=c.get("q_lora_rank"),
                attention_bias=bool(c.get("attention_bias", False)),
                # DeepseekV3Attention builds its two norms with RMSNorm's default eps, 1e-6,
                # whatever config.rms_norm_eps says: what HF computes is what we convert
                rms_norm_eps=1e-6, rope_interleaved=bool(c.get("rope_interleave", True)),
                **rope)
    return ours


def _deepseek_to_neutral(sd, ours):
    params = {}
    for name, hf_name in MLA_NAMES.items():
        if f"{hf_name}.weight" in sd:
            params[name] = np.ascontiguousarray(_read(sd, f"{hf_name}.weight", "deepseek_v3").T)
            if f"{hf_name}.bias" in sd:
                params["b" + name[1:]] = _numpy(sd[f"{hf_name}.bias"])
    for name, key in MLA_NORMS.items():
        if key in sd:
            params[name] = _numpy(sd[key])
    return params


def _deepseek_from_neutral(params, ours):
    sd = {}
    for name, hf_name in MLA_NAMES.items():
        if name in params:
            sd[f"{hf_name}.weight"] = np.ascontiguousarray(np.asarray(params[name]).T)
            if "b" + name[1:] in params:
                sd[f"{hf_name}.bias"] = np.array(params["b" + name[1:]])
    for name, key in MLA_NORMS.items():
        if name in params:
            sd[key] = np.array(params[name])
    return sd


FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family(MLA, _deepseek_settings, _deepseek_to_neutral, _deepseek_from_neutral),
}
