"""JAX twin of attn-parity: the attention core and (from issue 3) the Flax NNX variant modules."""

from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention

__all__ = ["DEFAULT_PRECISION", "scaled_dot_product_attention"]
