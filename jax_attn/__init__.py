"""JAX twin of attn-parity: the attention core and the Flax NNX variant modules."""

from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.modules import *  # noqa: F403  (the variant classes, listed in modules.__all__)
from jax_attn.modules import __all__ as _classes
from jax_attn.params import build, export_params, load_params

__all__ = [*_classes, "DEFAULT_PRECISION", "build", "export_params", "load_params",
           "scaled_dot_product_attention"]
