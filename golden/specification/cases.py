"""The declarative list of golden cases. Each case owns its seed: adding one changes no other.

An input spec is a tuple naming how the array is drawn from the case's generator:
    ("normal", shape)                 standard normal, rounded to float32
    ("ints", shape, high)             integers in [-high, high] (exact in any float dtype)
    ("mask", shape, p, dead_rows)     bool, True with probability p; rows listed as index tuples
                                      of the leading axes plus the query index are all False
    ("keep", shape, rate)             dropout mask: True with probability 1 − rate
    ("grid", shape)                   standard normal rounded to a multiple of 1/64 in [-4, 4]:
                                      exact in bfloat16 and float16 too
    ("values", values, dtype)         exactly these values (a number or nested list) in an
                                      integer dtype: offsets and lengths, stored as int32;
                                      draws nothing from the generator

``dtypes`` lists the dtypes the frameworks run the case at. A case that lists float16 or bfloat16
draws grid inputs, and its parameters are rounded to the same grid, so that every dtype starts
from the same exact numbers and only the arithmetic differs.

Shape legend: B=2 batch, H=3 heads, Lq=5 query length, Lk=7 key length, Dk=4, Dv=6; Hkv the
heads of key and value where they differ from H (grouped-query attention). ``sinks``: one logit
per query head, (H,), or () for unbatched (Lq, Dk) inputs.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from golden.specification.validate import DTYPES
from golden.specification.variants import SDPA

B, H, LQ, LK, DK, DV = 2, 3, 5, 7, 4, 6


@dataclass(frozen=True)
class Case:
    name: str
    variant: str
    seed: int
    inputs: dict
    config: dict = field(default_factory=dict)
    dtypes: tuple = ("float32", "float64")
    # parameters given exactly ({name: values}, stored as float32) in place of the drawn ones,
    # drawn all the same so that the generator's stream is unchanged: a decay rate that only
    # makes sense positive (lightning attention's slope)
    fixed: dict = field(default_factory=dict)


def _qkv(lead=(B, H), lq=LQ, lk=LK, dk=DK, dv=DV, kv_lead=None, kind="normal"):
    kv_lead = lead if kv_lead is None else kv_lead
    return {"query": (kind, lead + (lq, dk)), "key": (kind, kv_lead + (lk, dk)),
            "value": (kind, kv_lead + (lk, dv))}


def _ints(values):
    """Offsets or lengths, exactly as written, stored as int32."""
    return ("values", values, "int32")


CASES = [
    Case("sdpa_plain", SDPA, 101, _qkv()),
    Case("sdpa_causal_square", SDPA, 102, _qkv(lk=LQ), {"is_causal": True}),
    Case("sdpa_causal_rect", SDPA, 103, _qkv(), {"is_causal": True}),
    Case("sdpa_causal_tall", SDPA, 104, _qkv(lq=LK, lk=LQ), {"is_causal": True}),
    Case("sdpa_mask", SDPA, 105, {**_qkv(), "mask": ("mask", (B, 1, LQ, LK), 0.7, ())}),
    Case("sdpa_bias", SDPA, 106, {**_qkv(), "bias": ("normal", (H, LQ, LK))}),
    Case("sdpa_mask_bias", SDPA, 107,
         {**_qkv(), "mask": ("mask", (LQ, LK), 0.6, ()), "bias": ("normal", (B, H, LQ, LK))}),
    Case("sdpa_wide_key", SDPA, 108, _qkv(dk=9, dv=3)),
    Case("sdpa_scale", SDPA, 109, _qkv(), {"scale": 0.3}),
    Case("sdpa_masked_row", SDPA, 110,
         {**_qkv(), "mask": ("mask", (B, H, LQ, LK), 0.7, ((1, 2, 3), (0, 0, 0)))}),
    Case("sdpa_masked_row_causal", SDPA, 111,
         {**_qkv(), "mask": ("mask", (B, 1, LQ, LK), 0.8, ((0, 0, 4),))}, {"is_causal": True}),
    Case("sdpa_unbatched_2d", SDPA, 112, _qkv(lead=())),
    Case("sdpa_unbatched_3d", SDPA, 113, _qkv(lead=(H,))),
    Case("sdpa_dropout", SDPA, 114, {**_qkv(), "dropout_mask": ("keep", (B, H, LQ, LK), 0.25)},
         {"dropout_rate": 0.25}),
    Case("sdpa_dropout_causal_bias", SDPA, 115,
         {**_qkv(), "bias": ("normal", (LK,)), "dropout_mask": ("keep", (B, 1, LQ, LK), 0.4)},
         {"dropout_rate": 0.4, "is_causal": True}),
    # Biases and masks with size-1 axes in every position: their gradients sum over the axes
    # they were broadcast along (reference.unbroadcast), B or H or Lq of size 1, and 2-D.
    Case("sdpa_bias_batch1", SDPA, 117,
         {**_qkv(), "mask": ("mask", (1, H, LQ, LK), 0.8, ()), "bias": ("normal", (1, H, LQ, LK))}),
    Case("sdpa_bias_head1", SDPA, 118,
         {**_qkv(), "mask": ("mask", (B, 1, LQ, LK), 0.8, ()), "bias": ("normal", (B, 1, LQ, LK))},
         {"is_causal": True}),
    Case("sdpa_bias_query1", SDPA, 119,  # a key-padding bias and mask, one row for every query
         {**_qkv(), "mask": ("mask", (B, 1, 1, LK), 0.7, ()), "bias": ("normal", (B, H, 1, LK))}),
    Case("sdpa_bias_2d_masked_rows", SDPA, 120,  # (Lq, 1): whole query rows masked out
         {**_qkv(), "mask": ("mask", (LQ, 1), 0.6, ((1, 0),)), "bias": ("normal", (LQ, LK))}),
    # Scores of order 1e3: exp overflows float32 without the max shift. Integer q and k with Dk=4
    # (scale 1/2) keep the scores exact in float32, so the float32 tolerance still applies.
    Case("sdpa_large_logits", SDPA, 116,
         {"query": ("ints", (B, H, LQ, 4), 40), "key": ("ints", (B, H, LK, 4), 40),
          "value": ("normal", (B, H, LK, DV))}),
]

# Module variants. Every dimension a different size within a case: B=2, L=7 (or Lq=6, Lk=7),
# feature widths 3 to 5, heads 1 or 3, head widths 2 or 4. Weights are drawn from the case's
# seed after the inputs (golden.harness.regenerate.draw_params).
CASES += [
    Case("simple_self_attention_batched", "simple_self_attention", 201,
         {"x": ("normal", (2, 7, 3))}),
    Case("simple_self_attention_unbatched_mask", "simple_self_attention", 202,
         {"x": ("normal", (6, 4)), "mask": ("mask", (6, 6), 0.7, ())}),
    Case("self_attention_unbatched", "self_attention", 211,
         {"x": ("normal", (7, 5))}, {"d_in": 5, "d_k": 4, "d_v": 6}),
    Case("self_attention_batched_bias_mask", "self_attention", 212,
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.7, ((1, 3),))},
         {"d_in": 5, "d_k": 4, "d_v": 3, "qkv_bias": True}),
    Case("causal_self_attention_batched", "causal_self_attention", 221,
         {"x": ("normal", (2, 7, 5))}, {"d_in": 5, "d_k": 4, "d_v": 6}),
    Case("causal_self_attention_dropout", "causal_self_attention", 222,
         {"x": ("normal", (2, 7, 5)), "dropout_mask": ("keep", (2, 7, 7), 0.3)},
         {"d_in": 5, "d_k": 3, "dropout": 0.3, "qkv_bias": True}),
    Case("causal_self_attention_unbatched_eval", "causal_self_attention", 223,
         {"x": ("normal", (6, 5)), "mask": ("mask", (6, 6), 0.8, ())},
         {"d_in": 5, "d_k": 4, "dropout": 0.5}),
    Case("cross_attention_kv", "cross_attention", 231,
         {"x_q": ("normal", (2, 6, 5)), "x_kv": ("normal", (2, 7, 3)),
          "mask": ("mask", (2, 6, 7), 0.7, ())},
         {"d_q_in": 5, "d_kv_in": 3, "d_k": 4, "d_v": 8}),
    Case("cross_attention_separate_values", "cross_attention", 232,
         {"x_q": ("normal", (6, 5)), "x_kv": ("normal", (7, 3)), "x_v": ("normal", (7, 3))},
         {"d_q_in": 5, "d_kv_in": 3, "d_k": 4, "qkv_bias": True}),
    Case("multi_head_attention_wrapper_one_head", "multi_head_attention_wrapper", 241,
         {"x": ("normal", (2, 7, 5))}, {"d_in": 5, "d_head": 4, "num_heads": 1}),
    Case("multi_head_attention_wrapper_causal_proj_dropout", "multi_head_attention_wrapper", 242,
         {"x": ("normal", (2, 7, 5)), "dropout_mask": ("keep", (2, 3, 7, 7), 0.2)},
         {"d_in": 5, "d_head": 4, "num_heads": 3, "causal": True, "dropout": 0.2,
          "qkv_bias": True, "out_proj": True}),
    Case("multi_head_attention_wrapper_unbatched_mask", "multi_head_attention_wrapper", 243,
         {"x": ("normal", (6, 5)), "mask": ("mask", (6, 6), 0.7, ())},
         {"d_in": 5, "d_head": 2, "num_heads": 3}),
    Case("multi_head_attention_causal", "multi_head_attention", 251,
         {"x": ("normal", (2, 7, 5))}, {"d_in": 5, "d_out": 12, "num_heads": 3, "causal": True}),
    Case("multi_head_attention_unbatched_qkv_bias_mask", "multi_head_attention", 252,
         {"x": ("normal", (7, 5)), "mask": ("mask", (7, 7), 0.7, ())},
         {"d_in": 5, "d_out": 6, "num_heads": 3, "qkv_bias": True, "out_bias": False}),
    Case("multi_head_attention_one_head", "multi_head_attention", 253,
         {"x": ("normal", (2, 7, 5))}, {"d_in": 5, "d_out": 4, "num_heads": 1}),
    Case("multi_head_attention_dropout", "multi_head_attention", 254,
         {"x": ("normal", (2, 5, 7)), "dropout_mask": ("keep", (2, 3, 5, 5), 0.25)},
         {"d_in": 7, "d_out": 12, "num_heads": 3, "dropout": 0.25}),
]

# Low precision: the same fixtures run at bfloat16 and float16 (softmax accumulates in float32).
LOW = DTYPES  # every dtype
CASES += [
    Case("sdpa_low_precision", SDPA, 301,
         {"query": ("grid", (B, H, LQ, 8)), "key": ("grid", (B, H, LK, 8)),
          "value": ("grid", (B, H, LK, DV))}, dtypes=LOW),
    Case("sdpa_low_precision_causal_mask", SDPA, 302,
         {"query": ("grid", (B, H, LK, DK)), "key": ("grid", (B, H, LK, DK)),
          "value": ("grid", (B, H, LK, DV)), "mask": ("mask", (B, 1, LK, LK), 0.8, ())},
         {"is_causal": True}, dtypes=LOW),
    Case("multi_head_attention_low_precision", "multi_head_attention", 303,
         {"x": ("grid", (2, 7, 5))}, {"d_in": 5, "d_out": 12, "num_heads": 3, "causal": True,
                                      "qkv_bias": True}, dtypes=LOW),
    Case("sdpa_low_precision_bias_dropout_masked_row", SDPA, 305,
         {"query": ("grid", (B, H, LQ, 8)), "key": ("grid", (B, H, LK, 8)),
          "value": ("grid", (B, H, LK, DV)), "bias": ("grid", (B, 1, LQ, LK)),
          "mask": ("mask", (B, H, LQ, LK), 0.8, ((0, 1, 2), (1, 2, 4))),
          "dropout_mask": ("keep", (B, H, LQ, LK), 0.3)}, {"dropout_rate": 0.3}, dtypes=LOW),
    Case("multi_head_attention_low_precision_dropout_masked_row", "multi_head_attention", 306,
         {"x": ("grid", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.8, ((1, 3),)),
          "dropout_mask": ("keep", (2, 3, 7, 7), 0.25)},
         {"d_in": 5, "d_out": 12, "num_heads": 3, "dropout": 0.25, "qkv_bias": True},
         dtypes=LOW),
    # Scores up to about 20 (scale 1): exact in float32 from grid inputs, but not in the low
    # dtypes, so rounding the scores or the softmax to them shows in the weights.
    Case("sdpa_low_precision_large_scores", SDPA, 307,
         {"query": ("grid", (B, H, LQ, 8)), "key": ("grid", (B, H, LK, 8)),
          "value": ("grid", (B, H, LK, DV))}, {"scale": 1.0}, dtypes=LOW),
    Case("cross_attention_low_precision", "cross_attention", 304,
         {"x_q": ("grid", (2, 6, 5)), "x_kv": ("grid", (2, 7, 3))},
         {"d_q_in": 5, "d_kv_in": 3, "d_k": 4, "d_v": 8}, dtypes=LOW),
]

# Grouped-query attention (key and value with Hkv heads), soft-capping, query positions shifted
# by query_offset, sliding windows and sequence lengths (issue 9). local_window_size is a JSON
# list [left, right] (null = unbounded side) or an int; offsets and lengths are int32 inputs.
CASES += [
    Case("sdpa_gqa_causal_offset", SDPA, 131,  # H=6, Hkv=3; query i at i + [4, 2]
         {**_qkv(lead=(B, 6), lk=9, dv=7, kv_lead=(B, 3)), "query_offset": _ints([4, 2])},
         {"is_causal": True}),
    Case("sdpa_mqa_decode_ragged", SDPA, 132,  # one new token per row of a ragged batch
         {**_qkv(lq=1, lk=9, kv_lead=(B, 1)), "query_offset": _ints([8, 5]),
          "key_value_seq_lengths": _ints([9, 6])},
         {"is_causal": True}),
    Case("sdpa_window_softcap_mask", SDPA, 133,
         {**_qkv(), "mask": ("mask", (B, 1, LQ, LK), 0.8, ())},
         {"local_window_size": [2, 1], "softcap": 1.0, "scale": 1.0}),
    Case("sdpa_lengths", SDPA, 134,  # batch 0: query rows 3, 4 dead; batch 1: keys 4-6 dead
         {**_qkv(), "bias": ("normal", (B, 1, LQ, LK)), "query_seq_lengths": _ints([3, 5]),
          "key_value_seq_lengths": _ints([7, 4])}),
    Case("sdpa_window_causal_offset", SDPA, 135,  # keys p − 2 … p, p = i + [4, 1]
         {**_qkv(lk=8), "query_offset": _ints([4, 1])},
         {"local_window_size": 2, "is_causal": True}),
    Case("sdpa_softcap_masked_row", SDPA, 136,
         {**_qkv(), "mask": ("mask", (B, H, LQ, LK), 0.7, ((1, 2, 3), (0, 0, 0)))},
         {"softcap": 1.5, "scale": 1.0}),
    Case("sdpa_gqa_unbatched", SDPA, 137,  # (H, L, D) with H=6, Hkv=2; keys from p − 3 on
         {**_qkv(lead=(6,), dv=3, kv_lead=(2,)), "query_offset": _ints(2)},
         {"local_window_size": [3, None]}),
    Case("sdpa_low_precision_gqa_softcap", SDPA, 308,
         {**_qkv(lead=(B, 6), dk=8, dv=4, kv_lead=(B, 3), kind="grid"),
          "bias": ("grid", (B, 1, LQ, LK))},
         {"softcap": 1.5, "is_causal": True}, dtypes=LOW),
]

# GroupedQueryAttention (issue 10): Hkv key-value heads, rotary embeddings in both conventions,
# the core's soft-cap, window (Hugging Face's sliding_window) and scale reaching it from the
# constructor, right-padded rows
# (query_seq_lengths), dropout, unbatched input, low precision. B=2, L=7, d_in 5 or 8.
GQA = "grouped_query_attention"
CASES += [
    Case("gqa_rope_half", GQA, 261, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "qkv_bias": True, "out_bias": True, "rope_theta": 10000.0}),
    Case("gqa_mqa_rope_interleaved_unbatched", GQA, 262, {"x": ("normal", (7, 5))},
         {"d_in": 5, "num_heads": 3, "num_kv_heads": 1, "head_dim": 4, "rope_theta": 100.0,
          "rope_interleaved": True}),
    Case("gqa_window_softcap_lengths_mask", GQA, 263,  # head_dim = d_in // num_heads = 2
         {"x": ("normal", (2, 7, 8)), "mask": ("mask", (2, 7, 7), 0.8, ()),
          "query_seq_lengths": _ints([7, 4])},
         {"d_in": 8, "num_heads": 4, "num_kv_heads": 2, "sliding_window": 3, "softcap": 2.0,
          "scale": 0.6, "rope_theta": 10000.0, "out_bias": True}),
    Case("gqa_dropout_bidirectional_padding", GQA, 264,  # padding is neither query nor key
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([5, 7]),
          "dropout_mask": ("keep", (2, 6, 7, 7), 0.2)},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 3, "head_dim": 4, "causal": False,
          "dropout": 0.2, "qkv_bias": True, "rope_theta": 500.0, "rope_interleaved": True}),
    Case("gqa_as_mha_no_rope", GQA, 265,  # num_kv_heads = num_heads: multi-head attention
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.7, ((1, 3),))},
         {"d_in": 5, "num_heads": 3, "num_kv_heads": 3, "head_dim": 2, "d_out": 4,
          "qkv_bias": True, "causal": False}),
    Case("gqa_low_precision_rope", GQA, 309, {"x": ("grid", (2, 7, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 8, "d_out": 3,
          "qkv_bias": True, "rope_theta": 10000.0}, dtypes=LOW),
]

# Attention sinks (GPT-OSS: one logit per query head in every row's softmax, taking no value)
# and chunked attention (Llama 4's attention_chunk_size C: key j // C = position // C).
CASES += [
    Case("sdpa_sinks", SDPA, 138, {**_qkv(), "sinks": ("normal", (H,))}),
    Case("sdpa_sinks_masked_row", SDPA, 139,  # rows (1, 2, 3) and (0, 0, 0): the sink takes all
         {**_qkv(lq=6, dv=5), "mask": ("mask", (B, H, 6, LK), 0.7, ((1, 2, 3), (0, 0, 0))),
          "sinks": ("normal", (H,))}),
    Case("sdpa_sinks_gqa_causal_window", SDPA, 140,  # H=6, Hkv=3; keys p − 3 … p, p = i + [4, 2]
         {**_qkv(lead=(B, 6), lk=9, dv=7, kv_lead=(B, 3)), "query_offset": _ints([4, 2]),
          "sinks": ("normal", (6,))},
         {"is_causal": True, "local_window_size": 3}),
    Case("sdpa_chunks", SDPA, 141, _qkv(lk=8), {"attention_chunk_size": 3}),
    Case("sdpa_chunks_offset_lengths", SDPA, 142,  # positions i + [4, 1] in chunks of 4, causal
         {**_qkv(lk=9), "query_offset": _ints([4, 1]), "query_seq_lengths": _ints([5, 3]),
          "key_value_seq_lengths": _ints([9, 6])},
         {"attention_chunk_size": 4, "is_causal": True}),
    Case("sdpa_sinks_chunks_softcap", SDPA, 143,  # unbatched (Lq, Dk): one sink, shape ()
         {**_qkv(lead=(), lq=6, lk=9, dk=5, dv=3), "sinks": ("normal", ()),
          "bias": ("normal", (6, 9))},
         {"attention_chunk_size": 2, "is_causal": True, "softcap": 1.5, "scale": 1.0}),
]

# GroupedQueryAttention's options of 2025–26 decoders (issue 23): the five QK norms, Llama 4's
# query temperature, Qwen3-Next's output gate, Hugging Face's sliding_window. Seeds from 421.
CASES += [
    Case("gqa_qk_rms_qwen3", GQA, 421, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "qk_norm": "rms", "rope_theta": 1000.0}),
    Case("gqa_qk_rms_one_plus_window_gemma3", GQA, 422,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
          "qk_norm": "rms_one_plus", "qk_norm_eps": 1e-3, "sliding_window": 3, "scale": 0.4,
          "rope_theta": 10000.0}),
    Case("gqa_qk_across_heads_olmo2", GQA, 423, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 3, "num_kv_heads": 3, "head_dim": 4, "d_out": 6,
          "qk_norm": "rms_across_heads", "rope_theta": 500.0}),
    Case("gqa_qk_layer_interleaved_cohere", GQA, 424, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 3, "head_dim": 4, "d_out": 3,
          "qk_norm": "layer", "qk_norm_eps": 1e-5, "rope_theta": 100.0,
          "rope_interleaved": True, "qkv_bias": True}),
    Case("gqa_qk_l2_after_rope_llama4", GQA, 425, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 1, "head_dim": 6, "d_out": 3,
          "qk_norm": "l2", "rope_theta": 300.0, "rope_interleaved": True}),
    Case("gqa_temperature_nope_llama4", GQA, 426,
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.8, ())},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3, "d_out": 6,
          "query_temperature": {"beta": 0.7, "floor_scale": 2, "shift": 1}}),
    Case("gqa_output_gate_qwen3_next", GQA, 427,
         {"x": ("normal", (2, 7, 5)), "dropout_mask": ("keep", (2, 6, 7, 7), 0.25)},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "qkv_bias": True, "out_bias": True, "output_gate": True, "qk_norm": "rms_one_plus",
          "rope_theta": 10000.0, "dropout": 0.25}),
    Case("gqa_all_options_unbatched", GQA, 428, {"x": ("normal", (7, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
          "qk_norm": "layer", "output_gate": True, "sliding_window": 4, "softcap": 2.5,
          "query_temperature": {"beta": 0.4, "floor_scale": 3, "shift": 0},
          "rope_theta": 50.0}),
    Case("gqa_sinks_window_gpt_oss", GQA, 429,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([6, 7])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
          "qkv_bias": True, "out_bias": True, "sinks": True, "sliding_window": 3,
          "rope_theta": 150000.0}),
    Case("gqa_chunked_l2_llama4", GQA, 430, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "attention_chunk_size": 3, "qk_norm": "l2", "rope_theta": 500000.0,
          "rope_interleaved": True}),
    Case("gqa_positions_left_pad_and_packed", GQA, 431,  # row 0 left-padded, row 1 two packed
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.85, ()),
          "positions": _ints([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3]])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
          "qk_norm": "rms", "partial_rotary_factor": 0.67,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 100.0, "factor": 4.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                              "original_max_position_embeddings": 4},
          "query_temperature": {"beta": 0.6, "floor_scale": 2, "shift": 1}}),
    Case("gqa_every_option", GQA, 432,  # YaRN × partial × interleaved × norm × sinks × chunks
         {"x": ("normal", (2, 9, 5)), "query_seq_lengths": _ints([9, 6])},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 8, "d_out": 3,
          "qkv_bias": True, "qk_norm": "rms_one_plus", "sinks": True,
          "attention_chunk_size": 4, "sliding_window": 3, "output_gate": True,
          "rope_interleaved": True, "partial_rotary_factor": 0.5,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 300.0, "factor": 2.0,
                              "original_max_position_embeddings": 5},
          "query_temperature": {"beta": 0.2, "floor_scale": 4, "shift": 0}}),
]

# The output stage and a QK norm after RoPE (issue 42): gates per head and softplus gates
# (Step-3.7-Flash, Laguna), the output norm before out_proj (BitNet's over all heads, Muse
# Spark's per head), HunYuan's weighted RMS norm of q and k after RoPE.
CASES += [
    Case("gqa_softplus_head_gate_laguna", GQA, 820,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "output_gate": "softplus_per_head", "qk_norm": "rms", "sliding_window": 3,
          "rope_theta": 500.0}),
    Case("gqa_softplus_gate_unbatched", GQA, 821, {"x": ("normal", (7, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 1, "head_dim": 3, "d_out": 6,
          "qkv_bias": True, "output_gate": "softplus"}),
    Case("gqa_sigmoid_head_gate_step3p7", GQA, 822,
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.85, ())},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
          "qkv_bias": True, "output_gate": "sigmoid_per_head", "qk_norm": "rms", "scale": 0.3,
          "rope_theta": 100.0}),
    Case("gqa_output_norm_bitnet", GQA, 823, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 3, "num_kv_heads": 1, "head_dim": 4, "d_out": 6,
          "output_norm": "rms", "output_norm_eps": 1e-5, "rope_theta": 1000.0}),
    Case("gqa_head_norm_gate_muse_spark", GQA, 824,
         {"x": ("normal", (2, 7, 5)), "dropout_mask": ("keep", (2, 4, 7, 7), 0.25)},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "output_norm": "rms_per_head", "output_gate": True, "dropout": 0.25,
          "rope_theta": 10000.0}),
    Case("gqa_qk_norm_after_rope_hunyuan", GQA, 825,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([6, 7])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
          "qkv_bias": True, "qk_norm": "rms_after_rope", "qk_norm_eps": 1e-5,
          "rope_theta": 300.0}),
    # the query temperature's kinds: Beam's power law on a NoPE layer with its gate's own bias,
    # Inkling's log past n, Mistral Large 4's learned per head (n small: every kind bites)
    Case("gqa_temperature_power_beam", GQA, 826,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 4])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3, "d_out": 6,
          "query_temperature": {"kind": "power", "alpha": 0.7, "length": 3},
          "output_gate": True, "gate_bias": True, "qk_norm": "rms"}),
    Case("gqa_temperature_log_inkling", GQA, 827,
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.85, ()),
          "positions": _ints([[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 1, "head_dim": 4, "d_out": 3,
          "query_temperature": {"kind": "log", "alpha": 0.8, "length": 2},
          "rope_theta": 100.0}),
    # MiMo-V2-Flash's sliding layers: values 5 wide on keys 4 wide, a value scale, sinks
    Case("gqa_value_width_mimo_v2_flash", GQA, 829,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 4, "v_head_dim": 5,
          "d_out": 3, "value_scale": 0.707, "sinks": True, "sliding_window": 3,
          "qkv_bias": True, "rope_theta": 1000.0, "output_gate": "sigmoid_per_head",
          "output_norm": "rms"}),
    # OLMoE: q and k clamped after their norm over all heads (the clamp bites on both sides)
    Case("gqa_clip_after_norm_olmoe", GQA, 830, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 4, "d_out": 6,
          "qk_norm": "rms_across_heads", "clip_qkv": 1.1, "clip_qkv_after_norm": True,
          "rope_theta": 10000.0}),
    Case("gqa_temperature_learned_mistral_large4", GQA, 828, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "query_temperature": {"kind": "learned"}, "sliding_window": 4,
          "rope_theta": 1000.0, "rope_interleaved": True}),
]

# RoPE of 2025–26 models (issue 23): Hugging Face's rope_parameters (llama3 bands, YaRN with
# DeepSeek's mscale ratio and truncate off, LongRoPE past a small original max, linear, dynamic
# NTK), the rotary fraction (partial rotary, rotate-half and GLM's interleaved), and all of
# them at once with GQA and a window. Every size distinct within a case.
CASES += [
    Case("gqa_rope_llama3", GQA, 401, {"x": ("normal", (2, 9, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 8, "d_out": 3,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}}),
    Case("gqa_rope_yarn_mscale", GQA, 402, {"x": ("normal", (3, 7, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "d_out": 6,
          "qkv_bias": True, "rope_theta": 100.0,
          "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32, "truncate": False,
                              "mscale": 1.0, "mscale_all_dim": 0.8}}),
    Case("gqa_rope_longrope_long", GQA, 403, {"x": ("normal", (2, 9, 7))},
         {"d_in": 7, "num_heads": 3, "num_kv_heads": 1, "head_dim": 6, "d_out": 4,
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0, "factor": 4.0,
                              "short_factor": [1.0, 1.25, 2.0], "long_factor": [1.5, 3.0, 5.0],
                              "original_max_position_embeddings": 6}}),
    Case("gqa_rope_linear", GQA, 404, {"x": ("normal", (2, 8, 5))},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 3, "head_dim": 4, "d_out": 7,
          "rope_theta": 1000.0, "rope_parameters": {"rope_type": "linear", "factor": 2.5}}),
    Case("gqa_rope_dynamic", GQA, 405, {"x": ("normal", (3, 8, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 1, "head_dim": 6, "d_out": 2,
          "rope_parameters": {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 3.0,
                              "original_max_position_embeddings": 5}}),
    Case("gqa_partial_rotary_half", GQA, 406, {"x": ("normal", (2, 7, 9))},
         {"d_in": 9, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "d_out": 5,
          "qkv_bias": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    Case("gqa_partial_rotary_interleaved", GQA, 407, {"x": ("normal", (2, 5, 7))},
         {"d_in": 7, "num_heads": 3, "num_kv_heads": 1, "head_dim": 12, "d_out": 4,
          "rope_interleaved": True,
          "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                              "partial_rotary_factor": 0.5}}),
    Case("gqa_yarn_partial_window_lengths", GQA, 408,
         {"x": ("normal", (2, 9, 5)), "query_seq_lengths": _ints([9, 6])},
         {"d_in": 5, "num_heads": 8, "num_kv_heads": 2, "head_dim": 8, "d_out": 3,
          "sliding_window": 4, "out_bias": True, "partial_rotary_factor": 0.75,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 50.0, "factor": 2.0,
                              "original_max_position_embeddings": 12, "beta_fast": 8.0,
                              "beta_slow": 2.0}}),
]

# Positions in more than one dimension (issue 41): multimodal RoPE's positions (3, B, L) with an
# image span whose height and width rows differ from the temporal one (row 1 a 2 × 2 image from
# token 2, row 0 a 3 × 1 one from token 3), in Qwen2-VL's chunked sections, Qwen3-VL's
# interleaved ones with its per-head norms, GLM-4V's chunked sections on interleaved pairs of a
# partial slice; and Gemma 4's proportional RoPE (the whole head paired, a quarter turning).
# As get_rope_index makes them: an image's tokens at its temporal position, each at its own row
# and column; the text after it from the largest position so far + 1, every axis alike.
_MROPE_POSITIONS = _ints([[[0, 1, 2, 3, 3, 3, 6, 7, 8], [0, 1, 2, 2, 2, 2, 4, 5, 6]],
                          [[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 2, 3, 3, 4, 5, 6]],
                          [[0, 1, 2, 3, 3, 3, 6, 7, 8], [0, 1, 2, 3, 2, 3, 4, 5, 6]]])
CASES += [
    Case("gqa_mrope_chunked_qwen2_vl", GQA, 441,
         {"x": ("normal", (2, 9, 5)), "positions": _MROPE_POSITIONS},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 12, "d_out": 3,
          "qkv_bias": True,
          "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                              "mrope_section": [2, 2, 2]}}),
    Case("gqa_mrope_interleaved_qwen3_vl", GQA, 442,
         {"x": ("normal", (2, 9, 7)), "positions": _MROPE_POSITIONS},
         {"d_in": 7, "num_heads": 6, "num_kv_heads": 2, "head_dim": 12, "d_out": 4,
          "qk_norm": "rms",
          "rope_parameters": {"rope_type": "default", "rope_theta": 300.0,
                              "mrope_section": [2, 2, 2], "mrope_interleaved": True}}),
    Case("gqa_mrope_glm4v_partial_interleaved_pairs", GQA, 443,
         {"x": ("normal", (2, 9, 5)), "positions": _MROPE_POSITIONS},
         {"d_in": 5, "num_heads": 3, "num_kv_heads": 1, "head_dim": 12, "d_out": 6,
          "qkv_bias": True, "rope_interleaved": True,
          "rope_parameters": {"rope_type": "default", "rope_theta": 50.0,
                              "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1]}}),
    Case("gqa_rope_proportional", GQA, 444, {"x": ("normal", (2, 9, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "d_out": 3,
          "rope_parameters": {"rope_type": "proportional", "rope_theta": 100.0,
                              "partial_rotary_factor": 0.25, "factor": 2.0}}),
]

# Axial 2-D RoPE of vision towers (issue 41): positions (2, B, L), each patch's row and column;
# row 0 two images packed, 2 × 3 then 2 × 2 patches, under their block-diagonal mask (HF's
# cu_seqlens), row 1 one image of 2 × 5: Qwen-VL's shared frequencies (rotate-half over the
# head), Pixtral's split ones, Gemma 4's blocks (each axis rotate-half in its half of the head,
# with its QK norms, value norm and scale 1), Llama 4's interleaved pairs at (column + 1, row + 1) with its
# class token, last, at (0, 0).
_AXIAL_POSITIONS = _ints([[[0, 0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]],
                          [[0, 1, 2, 0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]])
_TWO_IMAGES = ("values", [[[i < 6] * 6 + [i >= 6] * 4 for i in range(10)], [[True] * 10] * 10],
               "bool")
_LLAMA4_POSITIONS = _ints([[[1, 2, 3, 1, 2, 3, 1, 2, 3, 0]] * 2,
                           [[1, 1, 1, 2, 2, 2, 3, 3, 3, 0]] * 2])
CASES += [
    Case("gqa_axial_qwen_vl_two_images", GQA, 445,
         {"x": ("normal", (2, 10, 5)), "positions": _AXIAL_POSITIONS, "mask": _TWO_IMAGES},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 4, "head_dim": 12, "d_out": 3,
          "qkv_bias": True, "out_bias": True, "causal": False,
          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}),
    Case("gqa_axial_pixtral_split", GQA, 446,
         {"x": ("normal", (2, 10, 6)), "positions": _AXIAL_POSITIONS, "mask": _TWO_IMAGES},
         {"d_in": 6, "num_heads": 2, "num_kv_heads": 2, "head_dim": 12, "d_out": 6,
          "causal": False,
          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0,
                              "axial_frequencies": "split"}}),
    Case("gqa_axial_gemma4_blocks", GQA, 447,
         {"x": ("normal", (2, 10, 5)), "positions": _AXIAL_POSITIONS, "mask": _TWO_IMAGES},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 12, "d_out": 4,
          "causal": False, "qk_norm": "rms", "scale": 1.0, "v_norm": True,
          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0,
                              "axial_pairs": "blocks"}}),
    Case("gqa_axial_llama4_interleaved_class_token", GQA, 448,
         {"x": ("normal", (2, 10, 5)), "positions": _LLAMA4_POSITIONS},
         {"d_in": 5, "num_heads": 2, "num_kv_heads": 2, "head_dim": 8, "d_out": 5,
          "qkv_bias": True, "causal": False, "rope_interleaved": True,
          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}),
]

# DINOv3's axial RoPE (issue 41): its patch centres (2i + 1 − H)/H, (2j + 1 − W)/W as integer
# positions 2i + 1 − H and 2j + 1 − W (negative ones too) with the frequencies scaled by 2π/H
# and 2π/W (axial_scale); the class token and a register first, at (0, 0): an image of 2 × 3
# patches in two rows, with biases (golden.hf.vision.dinov3_positions builds such positions).
_DINOV3_POSITIONS = _ints([[[0, 0, -1, -1, -1, 1, 1, 1]] * 2, [[0, 0, -2, 0, 2, -2, 0, 2]] * 2])
CASES += [
    Case("gqa_axial_dinov3_scale_negative", GQA, 481,
         {"x": ("normal", (2, 8, 6)), "positions": _DINOV3_POSITIONS},
         {"d_in": 6, "num_heads": 2, "num_kv_heads": 2, "head_dim": 12, "d_out": 6,
          "qkv_bias": True, "out_bias": True, "causal": False,
          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0,
                              "axial_scale": [math.pi, 2 * math.pi / 3]}}),
]

# Transformer-XL's relative positions (issue 41, the speech encoders: Parakeet, Canary): bias_u,
# bias_v and W_pos; Parakeet's layout (q/k/v/o biases, bidirectional) on right-padded rows, and
# unbatched with grouped heads, causal, a mask and a scale.
CASES += [
    Case("gqa_transformer_xl_padding", GQA, 451,
         {"x": ("normal", (2, 7, 6)), "query_seq_lengths": _ints([7, 4])},
         {"d_in": 6, "num_heads": 3, "num_kv_heads": 3, "head_dim": 4, "d_out": 5,
          "qkv_bias": True, "out_bias": True, "causal": False,
          "relative_positions": "transformer_xl"}),
    Case("gqa_transformer_xl_unbatched", GQA, 452,
         {"x": ("normal", (6, 8)), "mask": ("mask", (6, 6), 0.8, ())},
         {"d_in": 8, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3, "d_out": 5,
          "scale": 0.4, "relative_positions": "transformer_xl"}),
]

# Shaw's relative positions (issue 41, Granite Speech's Conformer): one relative_key_table
# (2M + 1, Dh) for every head; Granite's layout (blocks of C = 3 frames: attention_chunk_size,
# bidirectional; no q/k/v bias, an output bias; M = 4 > C) on right-padded rows of a length not
# a multiple of C, and unbatched with grouped heads, causal, a mask, a scale and distances past
# M clipped; Granite's pre_norm inside the attention (input_norm: LayerNorm of x, weight and
# bias, before the projections).
CASES += [
    Case("gqa_shaw_blocks_padding", GQA, 461,
         {"x": ("normal", (2, 7, 6)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 6, "num_heads": 3, "num_kv_heads": 3, "head_dim": 4, "d_out": 6,
          "out_bias": True, "causal": False, "attention_chunk_size": 3,
          "relative_positions": "shaw", "relative_max_distance": 4}),
    Case("gqa_shaw_unbatched", GQA, 462,
         {"x": ("normal", (6, 5)), "mask": ("mask", (6, 6), 0.8, ())},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3, "d_out": 4,
          "qkv_bias": True, "scale": 0.4, "relative_positions": "shaw",
          "relative_max_distance": 2}),
    Case("gqa_shaw_granite_input_norm", GQA, 463,
         {"x": ("normal", (2, 5, 6)), "query_seq_lengths": _ints([5, 4])},
         {"d_in": 6, "num_heads": 2, "num_kv_heads": 2, "head_dim": 3, "out_bias": True,
          "causal": False, "attention_chunk_size": 2, "relative_positions": "shaw",
          "relative_max_distance": 3, "input_norm": "layer", "input_norm_eps": 1e-3}),
    # Shaw's term inside a soft cap that bites (every relative term is part of the raw scores)
    Case("gqa_shaw_softcap", GQA, 464,
         {"x": ("normal", (2, 7, 6))},
         {"d_in": 6, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "softcap": 1.0,
          "relative_positions": "shaw", "relative_max_distance": 2}),
]

# The USM Conformer's relative positions (issue 41, Gemma 3n's and Gemma 4's audio encoders):
# per_dim_scale and W_pos over the timing signal, the term inside the soft cap. Right-padded rows
# 11 long, bidirectional with 3 keys back and 2 ahead (Gemma 3n's context left 4, right 2), a
# cap that bites; and unbatched with grouped heads, causal 5 keys, Gemma 4's key scale
# ln(1 + e)/ln 2 and its cap 50.
CASES += [
    Case("gqa_conformer_timing_padding", GQA, 471,
         {"x": ("normal", (2, 11, 6)), "query_seq_lengths": _ints([11, 7])},
         {"d_in": 6, "num_heads": 3, "num_kv_heads": 3, "head_dim": 4, "d_out": 6,
          "causal": False, "sliding_window": [3, 2], "softcap": 2.0,
          "relative_positions": "conformer_timing"}),
    Case("gqa_conformer_timing_unbatched", GQA, 472,
         {"x": ("normal", (9, 8))},
         {"d_in": 8, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3, "d_out": 5,
          "sliding_window": 5, "softcap": 50.0, "relative_positions": "conformer_timing",
          "key_scale": math.log(1 + math.e) / math.log(2)}),
]

# Gemma 4's full-attention layers (issues 41-42): no value projection (k_eq_v: the values are
# the key projection's heads, RMS-normalised without weight, v_norm), QK norms with weight,
# scale 1, proportional RoPE with a quarter of the pairs turning; and a sliding layer's options.
CASES += [
    Case("gqa_gemma4_full_k_eq_v", GQA, 449,
         {"x": ("normal", (2, 9, 5)), "query_seq_lengths": _ints([9, 6])},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "d_out": 5,
          "qk_norm": "rms", "v_norm": True, "k_eq_v": True, "scale": 1.0,
          "rope_parameters": {"rope_type": "proportional", "rope_theta": 100.0,
                              "partial_rotary_factor": 0.25}}),
]

# MultiHeadCrossAttention (issue 24): queries from x, keys and values from a context of another
# length and width; Whisper's encoder_attn (no bias on k_proj), T5's (no biases, scale 1),
# multi-query, padded contexts (context_lengths) and a row with no context at all.
MHCA = "multi_head_cross_attention"
CASES += [
    Case("mhca_whisper_padding_gqa", MHCA, 601,
         {"x": ("normal", (2, 5, 7)), "context": ("normal", (2, 9, 11)),
          "mask": ("mask", (2, 5, 9), 0.8, ()), "context_lengths": _ints([9, 4])},
         {"d_in": 7, "d_context": 11, "num_heads": 6, "num_kv_heads": 3, "head_dim": 4,
          "d_out": 10, "qkv_bias": True, "key_bias": False, "out_bias": True}),
    Case("mhca_t5_scale_one_unbatched", MHCA, 602,
         {"x": ("normal", (6, 5)), "context": ("normal", (8, 3)),
          "mask": ("mask", (6, 8), 0.7, ((2,),))},
         {"d_in": 5, "d_context": 3, "num_heads": 4, "head_dim": 2, "d_out": 7, "scale": 1.0}),
    Case("mhca_mqa_empty_context_row", MHCA, 603,  # row 1 has no context: its weights are zero
         {"x": ("normal", (3, 4, 6)), "context": ("normal", (3, 7, 5)),
          "context_lengths": _ints([7, 0, 2])},
         {"d_in": 6, "d_context": 5, "num_heads": 8, "num_kv_heads": 1, "head_dim": 2,
          "d_out": 9, "qkv_bias": True}),
]

# MultiHeadCrossAttention's QK norm and soft cap (issue 42): Mllama's cross-attention layers (q
# from x and k from the context RMS-normalised per head, weights (Dh,)), T5Gemma's (scale
# query_pre_attn_scalar^−1/2, its scores capped), both at once with padding. Seeds from 840.
CASES += [
    Case("mhca_qk_norm_mllama", MHCA, 840,
         {"x": ("normal", (2, 5, 8)), "context": ("normal", (2, 7, 6)),
          "mask": ("mask", (2, 5, 7), 0.8, ())},
         {"d_in": 8, "d_context": 6, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3,
          "d_out": 9, "qk_norm": "rms", "qk_norm_eps": 1e-5}),
    Case("mhca_softcap_t5gemma", MHCA, 841,
         {"x": ("normal", (3, 4, 6)), "context": ("normal", (3, 9, 5)),
          "context_lengths": _ints([9, 3, 6])},
         {"d_in": 6, "d_context": 5, "num_heads": 3, "num_kv_heads": 1, "head_dim": 4,
          "d_out": 7, "scale": 0.6, "softcap": 0.8}),
    Case("mhca_qk_norm_softcap_unbatched", MHCA, 842,
         {"x": ("normal", (6, 5)), "context": ("normal", (8, 4))},
         {"d_in": 5, "d_context": 4, "num_heads": 2, "head_dim": 5, "d_out": 3,
          "qkv_bias": True, "out_bias": True, "qk_norm": "rms", "softcap": 1.5}),
]

# Chameleon's QK norm (issue 42): a LayerNorm of each head over Dh with its own weight and bias
# (qk_norm="layer_with_bias", q_norm and q_norm_bias (N, Dh), k_norm and k_norm_bias (Nkv, Dh)),
# before RoPE; grouped heads with left padding by positions, and unbatched with a mask and a
# key-value head shared by all. Seeds from 850.
CASES += [
    Case("gqa_qk_layer_with_bias_chameleon", GQA, 850,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 3,
          "qk_norm": "layer_with_bias", "qk_norm_eps": 1e-5, "rope_theta": 100.0}),
    Case("gqa_qk_layer_with_bias_mqa_unbatched", GQA, 851,
         {"x": ("normal", (6, 8)), "mask": ("mask", (6, 6), 0.8, ())},
         {"d_in": 8, "num_heads": 3, "num_kv_heads": 1, "head_dim": 6, "d_out": 5,
          "qkv_bias": True, "out_bias": True, "qk_norm": "layer_with_bias", "scale": 0.3,
          "rope_theta": 1000.0, "rope_interleaved": True}),
]

# Position biases in GroupedQueryAttention (issue 24): ALiBi's slopes of BLOOM (and Falcon's,
# added before the scale), MPT's with its reordering for a head count that is not a power of
# two. Seeds from 501.
CASES += [
    Case("gqa_alibi_bloom", GQA, 501, {"x": ("normal", (3, 7, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 9,
          "qkv_bias": True, "alibi": "bloom"}),
    Case("gqa_alibi_mpt_six_heads_lengths", GQA, 502,
         {"x": ("normal", (2, 8, 5)), "query_seq_lengths": _ints([8, 5])},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 3, "head_dim": 4, "d_out": 7,
          "alibi": "mpt", "sliding_window": 6}),
    Case("gqa_alibi_falcon_bidirectional_unbatched", GQA, 503,
         {"x": ("normal", (6, 7)), "mask": ("mask", (6, 6), 0.8, ())},
         {"d_in": 7, "num_heads": 5, "num_kv_heads": 1, "head_dim": 4, "d_out": 3,
          "causal": False, "out_bias": True, "alibi": "falcon"}),
]

# T5's relative position buckets (a learned table (num_buckets, N) at the bucket of j − i,
# bidirectional unless causal; no 1/√Dh: scale 1), distances past max_distance included.
CASES += [
    Case("gqa_t5_buckets_bidirectional", GQA, 504,
         {"x": ("normal", (2, 9, 5)), "mask": ("mask", (2, 9, 9), 0.85, ())},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 1, "head_dim": 3, "d_out": 6,
          "causal": False, "scale": 1.0, "relative_attention_num_buckets": 8,
          "relative_attention_max_distance": 5}),
    Case("gqa_t5_buckets_causal_lengths", GQA, 505,
         {"x": ("normal", (3, 8, 5)), "query_seq_lengths": _ints([8, 5, 3])},
         {"d_in": 5, "num_heads": 6, "num_kv_heads": 2, "head_dim": 4, "d_out": 7,
          "scale": 1.0, "relative_attention_num_buckets": 10,
          "relative_attention_max_distance": 6}),
]

# Phi-4-multimodal's audio encoder: a learned bias per clipped distance (relative_attention_
# buckets "clipped": j − i clipped to [−M, M − 1], 2M rows; "clipped_symmetric": |j − i| clipped
# to M − 1, M rows), with q/k/v/o biases, bidirectional on right-padded rows; distances far past
# M on both sides, so the clipping is exercised.
CASES += [
    Case("gqa_clipped_buckets_padding", GQA, 455,
         {"x": ("normal", (2, 9, 6)), "query_seq_lengths": _ints([9, 6])},
         {"d_in": 6, "num_heads": 2, "num_kv_heads": 2, "head_dim": 3, "qkv_bias": True,
          "out_bias": True, "causal": False, "relative_attention_num_buckets": 6,
          "relative_attention_max_distance": 3, "relative_attention_buckets": "clipped"}),
    Case("gqa_clipped_buckets_symmetric_unbatched", GQA, 456,
         {"x": ("normal", (8, 5)), "mask": ("mask", (8, 8), 0.8, ())},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 3, "d_out": 4,
          "causal": False, "relative_attention_num_buckets": 3,
          "relative_attention_max_distance": 3, "relative_attention_buckets":
              "clipped_symmetric"}),
]

# MPT's clip_qkv (q, k and v clamped to [−c, c] after their projections; OLMo's too), with its
# ALiBi: about half the projected entries clipped here, so the gradient's zeros are exercised.
CASES += [
    Case("gqa_mpt_clip_qkv", GQA, 506, {"x": ("normal", (2, 6, 5))},
         {"d_in": 5, "num_heads": 4, "num_kv_heads": 4, "head_dim": 3, "d_out": 5,
          "alibi": "mpt", "clip_qkv": 0.6}),
]

# MultiHeadLatentAttention (DeepSeek-V2/V3's MLA): with and without the query's low-rank
# projection (q_lora_rank), DeepSeek's interleaved RoPE pairs and "rotate half", yarn with
# mscale_all_dim (the softmax scale times mscale²), padding (query_seq_lengths) with explicit
# positions (row 1 continuing at position 5), unbatched with a mask.
MLA = "multi_head_latent_attention"
CASES += [
    Case("mla_q_lora_bias", MLA, 701, {"x": ("normal", (2, 7, 9))},
         {"d_in": 9, "num_heads": 3, "kv_lora_rank": 6, "qk_nope_head_dim": 5,
          "qk_rope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": 10, "d_out": 11,
          "attention_bias": True, "rope_theta": 100.0}),
    Case("mla_no_lora_rotate_half_unbatched_mask", MLA, 702,
         {"x": ("normal", (6, 5)), "mask": ("mask", (6, 6), 0.8, ())},
         {"d_in": 5, "num_heads": 4, "kv_lora_rank": 3, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 8, "v_head_dim": 7, "d_out": 9, "rope_interleaved": False,
          "rope_theta": 1000.0}),
    Case("mla_yarn_mscale_all_dim", MLA, 703, {"x": ("normal", (3, 8, 6))},
         {"d_in": 6, "num_heads": 2, "kv_lora_rank": 7, "qk_nope_head_dim": 3,
          "qk_rope_head_dim": 4, "v_head_dim": 5, "q_lora_rank": 10, "d_out": 9,
          "rms_norm_eps": 1e-5,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                              "original_max_position_embeddings": 4, "beta_fast": 8.0,
                              "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.8}}),
    Case("mla_padding_positions", MLA, 704,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 4]),
          "positions": _ints([[0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 0, 0, 0]])},
         {"d_in": 5, "num_heads": 4, "kv_lora_rank": 3, "qk_nope_head_dim": 6,
          "qk_rope_head_dim": 2, "v_head_dim": 1, "attention_bias": True, "rope_theta": 50.0}),
    # Mistral Small 4's query temperature (Llama 4's, shift 0) after RoPE on latent attention;
    # Mistral Large 4's learned one per head (issue 42)
    Case("mla_temperature_mistral4", MLA, 705,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 5, "num_heads": 3, "kv_lora_rank": 6, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 4, "v_head_dim": 3, "q_lora_rank": 4, "rope_theta": 100.0,
          "query_temperature": {"beta": 0.6, "floor_scale": 2, "shift": 0}}),
    # Kimi Linear's latent attention: no rotary embedding (its shared key part unturned)
    Case("mla_nope_kimi_linear", MLA, 707,
         {"x": ("normal", (2, 7, 5)), "mask": ("mask", (2, 7, 7), 0.85, ())},
         {"d_in": 5, "num_heads": 3, "kv_lora_rank": 4, "qk_nope_head_dim": 3,
          "qk_rope_head_dim": 2, "v_head_dim": 4, "q_lora_rank": 6, "rope": False}),
    Case("mla_temperature_learned", MLA, 706, {"x": ("normal", (2, 7, 5))},
         {"d_in": 5, "num_heads": 4, "kv_lora_rank": 3, "qk_nope_head_dim": 3,
          "qk_rope_head_dim": 2, "v_head_dim": 4, "rope_theta": 300.0,
          "rope_interleaved": False, "query_temperature": {"kind": "learned"}}),
    # HY-V4's latent attention: the output gate per feature (σ(x W_gate), W_gate (d_in, N·Dv),
    # from x, not the query's latent) and sinks, padding; Ling 3.0's (bailing_hybrid's MLA
    # layers): one gate per head, no q_lora, a mask (issue 42)
    Case("mla_gate_sinks_hy_v4", MLA, 708,
         {"x": ("normal", (2, 7, 5)), "query_seq_lengths": _ints([7, 4])},
         {"d_in": 5, "num_heads": 3, "kv_lora_rank": 6, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 4, "v_head_dim": 3, "q_lora_rank": 4, "rope_theta": 100.0,
          "rope_interleaved": False, "sinks": True, "output_gate": "sigmoid"}),
    Case("mla_gate_per_head_ling", MLA, 709,
         {"x": ("normal", (2, 6, 7)), "mask": ("mask", (2, 6, 6), 0.8, ())},
         {"d_in": 7, "num_heads": 4, "kv_lora_rank": 5, "qk_nope_head_dim": 3,
          "qk_rope_head_dim": 2, "v_head_dim": 6, "d_out": 9, "rope_theta": 300.0,
          "output_gate": "sigmoid_per_head"}),
    # dots3's: the shared rotary key RMS-normalised (k_pe_norm) before RoPE, a gate per head,
    # padding; AXK2's: the query and its gate per feature read [RMSNorm(c_q) | c_q] (W_q_b and
    # W_gate 2·q_lora_rank wide), a bias on c_q, a mask (issue 44)
    Case("mla_rope_key_norm_dots3", MLA, 710,
         {"x": ("normal", (2, 7, 6)), "query_seq_lengths": _ints([7, 5])},
         {"d_in": 6, "num_heads": 3, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 4, "v_head_dim": 3, "q_lora_rank": 5, "rope_theta": 100.0,
          "rms_norm_eps": 1e-5, "rope_key_norm": True, "output_gate": "sigmoid_per_head"}),
    Case("mla_query_latent_axk2", MLA, 711,
         {"x": ("normal", (2, 6, 5)), "mask": ("mask", (2, 6, 6), 0.8, ())},
         {"d_in": 5, "num_heads": 2, "kv_lora_rank": 3, "qk_nope_head_dim": 3,
          "qk_rope_head_dim": 2, "v_head_dim": 4, "q_lora_rank": 4, "d_out": 7,
          "attention_bias": True, "rope_theta": 300.0, "query_latent": "normed_and_raw",
          "output_gate": "sigmoid"}),
    # dots.3-note's windowed layers: 3 keys, the query's own included, L 8 past them, padding
    Case("mla_window_dots3", MLA, 712,
         {"x": ("normal", (2, 8, 5)), "query_seq_lengths": _ints([8, 6])},
         {"d_in": 5, "num_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 2, "v_head_dim": 3, "q_lora_rank": 3, "rope_theta": 100.0,
          "sliding_window": 3, "rope_key_norm": True, "output_gate": "sigmoid_per_head"}),
]

# The learned indexer (issue 44, golden.specification.indexer): each query attends only the
# index_topk keys its indexer scores highest, L above index_topk so that the choice matters.
# DeepSeek-V3.2's (rotate-half on the first features, the scale on q·k) with padding; GLM-5's
# interleaved indexer RoPE with a mask; HY-V4's (RoPE on the last features, the scale on the
# head weights, its LayerNorm ε, with its gate and sinks); Mistral Large 4's unbatched (no
# q_lora: the indexer reads LayerNorm(x), a learned temperature per indexer head). The seeds
# are those whose draws separate every row's k-th and (k+1)-th scores by far more than
# float32's error (tests/test_indexer_reference.py measures the gaps).
CASES += [
    Case("mla_indexer_deepseek_v32", MLA, 880,
         {"x": ("normal", (2, 24, 6)), "query_seq_lengths": _ints([24, 19])},
         {"d_in": 6, "num_heads": 3, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 4, "v_head_dim": 3, "q_lora_rank": 5, "rope_theta": 100.0,
          "index_topk": 8, "index_heads": 8, "index_head_dim": 6}),
    Case("mla_indexer_glm5_interleaved", MLA, 881,
         {"x": ("normal", (2, 16, 5)), "mask": ("mask", (2, 16, 16), 0.9, ())},
         {"d_in": 5, "num_heads": 2, "kv_lora_rank": 3, "qk_nope_head_dim": 3,
          "qk_rope_head_dim": 2, "v_head_dim": 4, "q_lora_rank": 4, "rope_theta": 300.0,
          "index_topk": 6, "index_heads": 6, "index_head_dim": 4,
          "index_rope": "interleaved"}),
    Case("mla_indexer_hy_v4", MLA, 884,
         {"x": ("normal", (2, 14, 5)), "query_seq_lengths": _ints([14, 11])},
         {"d_in": 5, "num_heads": 3, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 2, "v_head_dim": 3, "q_lora_rank": 4, "rope_theta": 100.0,
          "rope_interleaved": False, "rms_norm_eps": 1e-5, "sinks": True,
          "output_gate": "sigmoid", "index_topk": 5, "index_heads": 6, "index_head_dim": 5,
          "index_rope_dims": "last", "index_scale": "weights", "index_norm_eps": 1e-5}),
    Case("mla_indexer_mistral_large4_unbatched", MLA, 887, {"x": ("normal", (15, 6))},
         {"d_in": 6, "num_heads": 2, "kv_lora_rank": 3, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 2, "v_head_dim": 3, "rope_theta": 300.0,
          "query_temperature": {"kind": "learned"}, "index_topk": 6, "index_heads": 3,
          "index_head_dim": 4, "index_rope": "interleaved", "index_query": "layer_norm",
          "index_temperature": True}),
]

# Block selection (issue 44 part 4, golden.specification.indexer, GroupedQueryAttention's
# index_blocks): each query attends whole blocks of keys, L above the kept keys so that the
# choice matters. MiniMax M3's "max" (per-KV-group max-pooled token scores, local blocks; its
# per-head Gemma QK norm and partial RoPE) with right padding, and unbatched; Qwen4-Exp's
# "mean" (pooled, normed, rotated blocks of the keys each query may see, the tail kept; its
# gated attention, partial RoPE 1/4) with a mask, and unbatched. The seeds are those whose
# draws separate every row's last kept and first dropped block scores by ≥ 1e-3 relative
# (tests/test_indexer_blocks.py measures the gaps).
CASES += [
    Case("gqa_blocks_minimax_m3", GQA, 890,
         {"x": ("normal", (2, 20, 6)), "query_seq_lengths": _ints([20, 17])},
         {"d_in": 6, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "rope_theta": 100.0,
          "partial_rotary_factor": 2 / 3, "qk_norm": "rms_one_plus", "index_blocks": "max",
          "index_heads": 2, "index_head_dim": 5, "index_block_size": 3,
          "index_topk_blocks": 3, "index_local_blocks": 1}),
    Case("gqa_blocks_qwen4_exp", GQA, 891,
         {"x": ("normal", (2, 18, 6)), "mask": ("mask", (2, 18, 18), 0.85, ())},
         {"d_in": 6, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "rope_theta": 100.0,
          "partial_rotary_factor": 0.25, "qk_norm": "rms_one_plus", "output_gate": "sigmoid",
          "index_blocks": "mean", "index_heads": 3, "index_head_dim": 4,
          "index_block_size": 2, "index_topk_blocks": 3}),
    Case("gqa_blocks_minimax_m3_unbatched", GQA, 892, {"x": ("normal", (15, 5))},
         {"d_in": 5, "num_heads": 3, "num_kv_heads": 3, "head_dim": 4, "rope_theta": 300.0,
          "qk_norm": "rms_one_plus", "index_blocks": "max", "index_heads": 3,
          "index_head_dim": 4, "index_block_size": 2, "index_topk_blocks": 3,
          "index_local_blocks": 2}),
    Case("gqa_blocks_qwen4_exp_unbatched", GQA, 893, {"x": ("normal", (16, 5))},
         {"d_in": 5, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "rope_theta": 300.0,
          "partial_rotary_factor": 0.25, "qk_norm": "rms_one_plus", "output_gate": "sigmoid",
          "index_blocks": "mean", "index_heads": 4, "index_head_dim": 4,
          "index_block_size": 3, "index_topk_blocks": 2}),
]

# Key width = value width (issue 26). Every core fixture above has Dv ≠ Dk, which fast kernels
# (cuDNN, FlashAttention, Pallas, splash) and jax.nn.dot_product_attention refuse: these run
# the core's features at Dk = Dv = D, so that JAX's, Flax's and PyTorch's own attention can be
# checked against the suite (golden.runners.recipes). D = 4 unless stated; seeds from 801.
D = DK
CASES += [
    Case("sdpa_dkv_plain", SDPA, 801, _qkv(dv=D)),
    Case("sdpa_dkv_causal_square", SDPA, 802, _qkv(lk=LQ, dv=D), {"is_causal": True}),
    Case("sdpa_dkv_causal_rect", SDPA, 803, _qkv(dv=D), {"is_causal": True}),
    Case("sdpa_dkv_mask_bias", SDPA, 804,  # a (B, 1, Lq, Lk) mask, an (H, Lq, Lk) bias
         {**_qkv(dv=D), "mask": ("mask", (B, 1, LQ, LK), 0.7, ()),
          "bias": ("normal", (H, LQ, LK))}),
    Case("sdpa_dkv_padding_bias_causal", SDPA, 805,  # key padding (B, 1, 1, Lk), bias (B, 1, ...)
         {**_qkv(dv=D), "mask": ("mask", (B, 1, 1, LK), 0.8, ()),
          "bias": ("normal", (B, 1, LQ, LK))}, {"is_causal": True}),
    Case("sdpa_dkv_masked_row", SDPA, 806,  # rows (1, 2, 3) and (0, 0, 0) attend nothing
         {**_qkv(dv=D), "mask": ("mask", (B, H, LQ, LK), 0.7, ((1, 2, 3), (0, 0, 0)))}),
    Case("sdpa_dkv_gqa_causal_scale", SDPA, 807,  # H=6, Hkv=3
         {**_qkv(lead=(B, 6), dv=D, kv_lead=(B, 3))}, {"is_causal": True, "scale": 0.3}),
    Case("sdpa_dkv_window_causal", SDPA, 808,  # keys i − 2 … i
         _qkv(lk=LQ + 3, dv=D), {"local_window_size": 2, "is_causal": True}),
    Case("sdpa_dkv_window_lengths_mqa", SDPA, 809,  # keys i − 1 … i + 2; Hkv=1; padded rows
         {**_qkv(dv=D, kv_lead=(B, 1)), "query_seq_lengths": _ints([3, 5]),
          "key_value_seq_lengths": _ints([7, 4])},
         {"local_window_size": [1, 2]}),
    Case("sdpa_dkv_unbatched_mask_scale", SDPA, 810,  # (H, L, D), an (Lq, Lk) mask
         {**_qkv(lead=(H,), dv=D), "mask": ("mask", (LQ, LK), 0.8, ())}, {"scale": 0.5}),
    Case("sdpa_dkv_wide_head", SDPA, 811,  # D = 16
         {**_qkv(dk=16, dv=16), "bias": ("normal", (LQ, LK))}, {"is_causal": True}),
    Case("sdpa_dkv_low_precision", SDPA, 812,  # D = 8
         {**_qkv(dk=8, dv=8, kind="grid"), "mask": ("mask", (B, 1, LQ, LK), 0.8, ())},
         dtypes=LOW),
    Case("sdpa_dkv_low_precision_gqa_bias_causal", SDPA, 813,  # H=6, Hkv=2, D = 8
         {**_qkv(lead=(B, 6), dk=8, dv=8, kv_lead=(B, 2), kind="grid"),
          "bias": ("grid", (B, 1, LQ, LK))}, {"is_causal": True}, dtypes=LOW),
    Case("sdpa_dkv_softcap", SDPA, 814, _qkv(dv=D), {"softcap": 1.5, "scale": 1.0}),
]

# T5Gemma 2's merged self- and cross-attention (issue 42, merged_context=True): one softmax over
# x's keys (causal, RoPE, Gemma's 1 + w QK norm) and the context's (k_norm, no RoPE); its
# sliding window, a soft cap, right-padded decoder rows and a padded context; and unbatched
# with multi-query heads, the biases, LayerNorm QK norm and a mask over both key groups.
CASES += [
    Case("gqa_merged_context_t5gemma2", GQA, 860,
         {"x": ("normal", (2, 6, 8)), "context": ("normal", (2, 5, 8)),
          "context_mask": ("values", [[True, True, True, True, True],
                                      [True, True, True, False, False]], "bool"),
          "query_seq_lengths": _ints([6, 4])},
         {"d_in": 8, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 5,
          "scale": 0.4, "softcap": 2.0, "sliding_window": 3, "rope_theta": 100.0,
          "qk_norm": "rms_one_plus", "merged_context": True}),
    Case("gqa_merged_context_unbatched_mask", GQA, 861,
         {"x": ("normal", (5, 6)), "context": ("normal", (4, 6)),
          "mask": ("mask", (5, 9), 0.8, ())},
         {"d_in": 6, "num_heads": 3, "num_kv_heads": 1, "head_dim": 4, "qkv_bias": True,
          "out_bias": True, "rope_theta": 100.0, "qk_norm": "layer", "merged_context": True}),
]

# The recurrent token mixers (issue 43, golden.specification.recurrent.MIXERS): no attention
# weights (the fixture holds none; the loss is Σ y ⊙ dO), x (B, L, d_in) or (L, d_in) and a mask
# (B, L) of booleans, True = a real token (here left padding: the first tokens of a row False).
# L = 70 crosses the twins' chunk of 64 (and lightning's block_size 16); Hv = 2·Hk where the
# heads are grouped. Lightning's slope is fixed (positive: a decay e^−slope < 1 per token).
def _left_padded(pads, length):
    """A (B, L) mask, row b's first pads[b] tokens False (``pads`` an int: one (L,) row)."""
    row = lambda n: [False] * n + [True] * (length - n)  # noqa: E731
    return ("values", row(pads) if isinstance(pads, int) else [row(n) for n in pads], "bool")


GDN, KDA, LIGHTNING = "gated_delta_net", "kimi_delta_attention", "lightning_attention"
CASES += [
    Case("gated_delta_net_grouped_chunks", GDN, 870, {"x": ("normal", (2, 70, 6))},
         {"d_in": 6, "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 3, "head_v_dim": 4,
          "d_out": 5, "conv_kernel": 4}),
    Case("gated_delta_net_neg_eigval_left_padding", GDN, 871,
         {"x": ("normal", (2, 9, 5)), "mask": _left_padded([3, 0], 9)},
         {"d_in": 5, "num_k_heads": 1, "num_v_heads": 2, "head_k_dim": 4, "head_v_dim": 3,
          "conv_kernel": 3, "allow_neg_eigval": True}),
    Case("gated_delta_net_unbatched", GDN, 872, {"x": ("normal", (11, 4))},
         {"d_in": 4, "num_k_heads": 2, "num_v_heads": 2, "head_k_dim": 2, "head_v_dim": 3,
          "d_out": 6, "conv_kernel": 2, "norm_eps": 1e-5}),
    Case("kimi_delta_softplus_low_rank_left_padding", KDA, 873,
         {"x": ("normal", (2, 70, 5)), "mask": _left_padded([0, 6], 70)},
         {"d_in": 5, "num_heads": 2, "head_dim": 3, "d_out": 7, "conv_kernel": 4,
          "decay_rank": 2, "gate_rank": 4}),
    Case("kimi_delta_bounded_sigmoid_full_rank", KDA, 874, {"x": ("normal", (2, 9, 6))},
         {"d_in": 6, "num_heads": 3, "head_dim": 4, "conv_kernel": 3,
          "forget_gate": "bounded_sigmoid", "decay_lower_bound": -5.0}),
    Case("lightning_blocks", LIGHTNING, 875, {"x": ("normal", (2, 70, 5))},
         {"d_in": 5, "num_heads": 3, "head_dim": 4, "d_out": 6, "block_size": 16},
         fixed={"slope": [0.5, 0.125, 0.03125]}),
    Case("lightning_left_padding", LIGHTNING, 876,
         {"x": ("normal", (2, 9, 6)), "mask": _left_padded([4, 1], 9)},
         {"d_in": 6, "num_heads": 2, "head_dim": 3, "block_size": 4},
         fixed={"slope": [0.25, 0.0625]}),
    Case("lightning_unbatched", LIGHTNING, 877, {"x": ("normal", (10, 4))},
         {"d_in": 4, "num_heads": 4, "head_dim": 2, "d_out": 3, "block_size": 4,
          "norm_eps": 1e-5}, fixed={"slope": [1.0, 0.5, 0.25, 0.125]}),
]
