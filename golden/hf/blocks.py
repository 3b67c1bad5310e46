"""Grouped-query attention with a learned block indexer (issue 44; golden.specification.indexer's
"Block selection"): MiniMax M3's text attention ("max": per-KV-group max-pooled key blocks, local
blocks kept) and Qwen4-Exp's ("mean": pooled, normalised, rotated key blocks, the tail kept).
Both put the indexer on ordinary GQA softmax attention (transformers 5.23.0:
MiniMaxM3VLAttention(MiniMaxM2Attention), Qwen4ExpTextAttention(Qwen3_5Attention)).

HF's indexer norms are Gemma-style (x·rsqrt(mean x² + ε)·(1 + w)); our block indexer's norm
weights are the multipliers themselves: index_q_norm = 1 + w on import, w = index_q_norm − 1 on
export (1 + w rounded once, so to_hf gives back w to within 2⁻⁵¹ absolute, not bit for bit:
tests/test_hf_import.py's OFFSET_BACK).
"""

from __future__ import annotations

import numpy as np

from golden.hf.decoders import QK_NORMS, _gate_join, _gate_split, _llama_like
from golden.hf.family import Stack, _layer_type, _no_window, _read

# The block indexers' arrays: ours, Hugging Face's (at the attention's ``indexer.``).
MINIMAX_INDEXER = {"W_index_q": "indexer.q_proj.weight", "W_index_k": "indexer.k_proj.weight",
                   "index_q_norm": "indexer.q_norm.weight", "index_k_norm": "indexer.k_norm.weight"}
QWEN4_INDEXER = {"index_q_norm": "indexer.q_layernorm.weight",
                 "index_k_norm": "indexer.k_layernorm.weight"}
QWEN4_QK = "indexer.index_qk_proj.weight"  # [q (H_I·D_I) | k (D_I)] rows


def _multiplier(sd, key, mt):
    """HF's Gemma-style norm weight w as our multiplier 1 + w."""
    return 1.0 + _read(sd, key, mt)


def _minimax_m3(c, layer_idx, ours):
    """MiniMax M3's text attention (MiniMaxM3VLAttention): MiniMax-M2's projections with
    Gemma-style (1 + w) RMSNorm of q and k per head (ε rms_norm_eps), partial rotate-half RoPE
    from rope_parameters (HF's rotary embedding reads its partial_rotary_factor, not the config's
    rotary_dim), no window; its "minimax_m3_sparse" layers with the block indexer "max":
    index_n_heads (= num_key_value_heads), index_head_dim, index_block_size,
    index_topk_blocks, index_local_blocks, the indexer's norms' ε rms_norm_eps."""
    _no_window(ours)
    eps = float(c["rms_norm_eps"])
    ours.update(qk_norm="rms_one_plus", qk_norm_eps=eps)
    if _layer_type(c, layer_idx) == "minimax_m3_sparse":
        ours.update(index_blocks="max", index_heads=int(c["index_n_heads"]),
                    index_head_dim=int(c["index_head_dim"]),
                    index_block_size=int(c["index_block_size"]),
                    index_topk_blocks=int(c["index_topk_blocks"]),
                    index_local_blocks=int(c["index_local_blocks"]), index_norm_eps=eps)


def _minimax_in(sd, ours, params):
    if ours.get("index_blocks") is None:
        return params
    mt = "minimax_m3_vl_text"
    for name in ("W_index_q", "W_index_k"):
        params[name] = np.ascontiguousarray(_read(sd, MINIMAX_INDEXER[name], mt).T)
    for name in ("index_q_norm", "index_k_norm"):
        params[name] = _multiplier(sd, MINIMAX_INDEXER[name], mt)
    return params


def _minimax_out(params, ours, sd):
    if "W_index_q" not in params:
        return sd
    for name in ("W_index_q", "W_index_k"):
        sd[MINIMAX_INDEXER[name]] = np.ascontiguousarray(np.asarray(params[name]).T)
    for name in ("index_q_norm", "index_k_norm"):
        sd[MINIMAX_INDEXER[name]] = np.asarray(params[name]) - 1.0
    return sd


def _qwen4_exp(c, layer_idx, ours):
    """Qwen4-Exp's "indexed_attention" layers (Qwen4ExpTextAttention): Qwen3.5's attention
    ((1 + w) QK norms, the σ output gate in q_proj, partial rotate-half RoPE) with the block
    indexer "mean" (Qwen4ExpTextQSAIndexer): indexer_n_heads, indexer_head_dim, blocks of
    indexer_compress_ratio keys, indexer_budget / indexer_compress_ratio of them kept, the
    tail kept, its norms' ε rms_norm_eps. HF's text model turns by MRoPE, whose three axes are
    equal on text: ours turns by one position per token, the same angles (the block indexer
    takes no multimodal positions). Its "linear_attention" layers are golden.hf.linear's."""
    mt = "qwen4_exp_text"
    kind = _layer_type(c, layer_idx)
    if kind != "indexed_attention":
        raise ValueError(f"model_type {mt!r}: layer {layer_idx} is a {kind!r} layer (Gated "
                         f"DeltaNet: golden.hf.linear converts it); this entry converts its "
                         f"indexed_attention layers")
    kv_heads = c.get("indexer_kv_heads")
    if kv_heads != 1:
        raise ValueError(f"model_type {mt!r}: indexer_kv_heads should be 1 (one indexer key "
                         f"shared by its heads, as HF requires), got {kv_heads!r}")
    ratio, budget = int(c["indexer_compress_ratio"]), int(c["indexer_budget"])
    if budget % ratio:
        raise ValueError(f"model_type {mt!r}: indexer_budget should be a multiple of "
                         f"indexer_compress_ratio = {ratio}, got {budget}")
    eps = float(c["rms_norm_eps"])
    rope = ours.get("rope_parameters")
    if rope is not None:  # MRoPE's section: one position per token here (above)
        for name in ("mrope_section", "mrope_interleaved"):
            rope.pop(name, None)
    ours.update(qk_norm="rms_one_plus", qk_norm_eps=eps, output_gate=True, index_blocks="mean",
                index_heads=int(c["indexer_n_heads"]), index_head_dim=int(c["indexer_head_dim"]),
                index_block_size=ratio, index_topk_blocks=budget // ratio, index_norm_eps=eps)


def _qwen4_in(sd, ours, params):
    mt = "qwen4_exp_text"
    params = _gate_split(sd, ours, params)
    qk = _read(sd, QWEN4_QK, mt)
    split = ours["index_heads"] * ours["index_head_dim"]
    params["W_index_q"] = np.ascontiguousarray(qk[:split].T)
    params["W_index_k"] = np.ascontiguousarray(qk[split:].T)
    for name, key in QWEN4_INDEXER.items():
        params[name] = _multiplier(sd, key, mt)
    return params


def _qwen4_out(params, ours, sd):
    sd = _gate_join(params, ours, sd)
    sd[QWEN4_QK] = np.ascontiguousarray(np.concatenate(
        [np.asarray(params["W_index_q"]), np.asarray(params["W_index_k"])], axis=1).T)
    for name, key in QWEN4_INDEXER.items():
        sd[key] = np.asarray(params[name]) - 1.0
    return sd


# (the file's, the module's) names of MiniMax M3's indexer in its composite's checkpoints
# (transformers renames them on loading minimax_m3_vl)
MINIMAX_FILE = tuple((f"index_{n}.", f"indexer.{n}.") for n in ("q_proj", "k_proj", "q_norm",
                                                                  "k_norm"))

FAMILIES = {
    "minimax_m3_vl_text": _llama_like("minimax_m3_vl_text", _minimax_m3, norms=QK_NORMS,
                                      to_extra=_minimax_in, from_extra=_minimax_out,
                                      stacks=(Stack("layers", "self_attn", renames=MINIMAX_FILE),)),
    "qwen4_exp_text": _llama_like("qwen4_exp_text", _qwen4_exp, norms=QK_NORMS,
                                  to_extra=_qwen4_in, from_extra=_qwen4_out),
}
