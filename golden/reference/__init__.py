"""The float64 NumPy reference: the maths written out plainly, with analytic gradients.

Nothing here imports torch or JAX. Every function is loop-free and works on any number of
leading axes, and the same code runs in NumPy float64 or, inside ``exact_arithmetic()``, in
golden.specification.exact's decimal arithmetic that writes the fixtures (docs/reproducibility.md).
Each variant is a pair in ``VARIANTS``: forward(config, inputs, params) -> (output, weights, saved)
and backward(saved, d_output, d_weights) -> {input or parameter name: gradient}.

The rooms, each importing only those above it:
    arithmetic     the numbers: float64 or exact, ``real``/``number``/``einsum``, and the
                   switches exact_arithmetic, rounded_products, blas_products
    core           scaled dot-product attention forward and backward: the allowed set (masks,
                   causal, windows, chunks, lengths, a given selection key_indices as the mask
                   it stands for), the masked softmax with sinks, GQA's repeated heads, the
                   terms' sizes
    storage        what a fixture stores: values rounded once, gradients zero by structure
    rotary         RoPE: every rope_type's frequencies, angles, the turn of pairs
    position_bias  ALiBi's and T5's score biases, the bucket table's gradient, Transformer-XL's
                   relative positional term, Shaw's relative key term and the USM Conformer's
                   relative position terms, with their gradients
    block          projections, heads split and merged, the Stage contract, the generic block
                   (output gate, clip_qkv) forward and backward
    stages         the decoder's stages on q and k: RoPE, the QK norms, the query temperature
    modules        the module variants: plain core, one-head, multi-head, the wrapper,
                   GroupedQueryAttention (the decoder family)
    cross          CrossAttention and MultiHeadCrossAttention
    indexer        the learned indexer of latent attention (DeepSeek-V3.2's): scores, top-k
                   selection, the chosen keys as a mask
    latent         MultiHeadLatentAttention (MLA), with the indexer's choice

The next two kinds of token mixer get rooms of their own. Gated delta-rule linear attention, a
recurrence carrying a state from token to token, goes in ``delta_rule``: the plain step-by-step
recurrence and its backward. Learned sparse top-k selection, each query attending only the keys
an indexer scores highest, is ``indexer``'s (token top-k; block selection to come).
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import (blas_products, einsum, exact_arithmetic, number,
                                         number_type, real, round_to_bits, rounded_products)
from golden.reference.block import (Stage, block_backward, block_forward, linear,
                                    linear_backward, merge_heads, parameter_term_sizes,
                                    split_heads)
from golden.reference.core import (allowed_positions, masked_softmax, per_batch, repeat_kv,
                                   scaled_dot_product_attention, sdpa_backward, sdpa_forward,
                                   sdpa_term_sizes, sink_logits, sum_groups, unbroadcast)
from golden.reference.cross import (_cross, _cross_backward, _multi_head_cross,
                                    _multi_head_cross_backward)
from golden.reference.indexer import index_keys, index_scores, select_keys, selected_mask
from golden.reference.latent import _latent, _latent_backward, latent_mscale, latent_rope_stage
from golden.reference.modules import (_causal, _grouped_query, _grouped_query_backward,
                                      _multi_head, _multi_head_backward, _sdpa, _self,
                                      _self_backward,
                                      _simple, _simple_backward, _wrapper, _wrapper_backward)
from golden.reference.position_bias import (alibi_term, bucket_sums, conformer_timing_backward,
                                            conformer_timing_term, relative_term, shaw_backward,
                                            shaw_term, sinusoid_term, timing_term,
                                            transformer_xl_backward, transformer_xl_term)
from golden.reference.rotary import rope_angles, rope_cos_sin, rope_frequencies, rotate, turn
from golden.reference.stages import (qk_norm_stage, rope_stage, temperature_factors,
                                     temperature_stage)
from golden.reference.storage import ZERO_GRADS, stored, zero_elements, zero_grads

VARIANTS = {
    "scaled_dot_product_attention": (_sdpa, sdpa_backward),
    "simple_self_attention": (_simple, _simple_backward),
    "self_attention": (_self, _self_backward),
    "causal_self_attention": (_causal, _self_backward),
    "cross_attention": (_cross, _cross_backward),
    "multi_head_attention_wrapper": (_wrapper, _wrapper_backward),
    "multi_head_attention": (_multi_head, _multi_head_backward),
    "grouped_query_attention": (_grouped_query, _grouped_query_backward),
    "multi_head_cross_attention": (_multi_head_cross, _multi_head_cross_backward),
    "multi_head_latent_attention": (_latent, _latent_backward),
}



def pair(name):
    """(forward, backward) of a fixture's variant: an attention variant's (``VARIANTS``) or a
    recurrent mixer's (golden.reference.delta_rule.MIXERS, whose forward returns no weights:
    (output, None, saved), and whose backward takes d_weights None)."""
    from golden.reference import delta_rule  # the mixers' room, below nothing here

    return delta_rule.MIXERS[name] if name in delta_rule.MIXERS else VARIANTS[name]


__all__ = [
    "VARIANTS", "pair", "ZERO_GRADS", "Stage", "alibi_term", "allowed_positions", "blas_products",
    "block_backward", "block_forward", "bucket_sums", "conformer_timing_backward",
    "conformer_timing_term", "einsum", "exact_arithmetic",
    "latent_mscale", "latent_rope_stage", "linear", "linear_backward", "masked_softmax",
    "parameter_term_sizes",
    "merge_heads", "number", "number_type", "per_batch", "qk_norm_stage", "real",
    "relative_term", "repeat_kv", "rope_angles", "rope_cos_sin", "rope_frequencies",
    "rope_stage", "rotate", "round_to_bits", "rounded_products", "scaled_dot_product_attention",
    "sdpa_backward", "sdpa_forward", "sdpa_term_sizes", "shaw_backward", "shaw_term",
    "sink_logits", "sinusoid_term", "split_heads", "stored", "sum_groups", "temperature_factors",
    "temperature_stage", "timing_term",
    "transformer_xl_backward", "transformer_xl_term", "turn", "unbroadcast",
    "zero_elements", "zero_grads",
]


def selected_keys(saved):
    """The keys a learned indexer chose, key_indices (..., Lq, k) int32 (golden.reference.indexer),
    from a forward's ``saved``; None for a variant or configuration without an indexer."""
    chosen = saved.get("key_indices") if isinstance(saved, dict) else None
    return None if chosen is None else np.asarray(chosen).astype(np.int32)
