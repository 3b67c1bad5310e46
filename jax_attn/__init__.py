"""JAX twin of attn-parity: the attention core and the Flax NNX variant modules."""

from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.modules import (
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention,
    SimpleSelfAttention,
)
from jax_attn.params import build, export_params, load_params

__all__ = [
    "DEFAULT_PRECISION", "CausalSelfAttention", "CrossAttention", "MultiHeadAttention",
    "MultiHeadAttentionWrapper", "SelfAttention", "SimpleSelfAttention", "build", "export_params",
    "load_params", "scaled_dot_product_attention",
]
