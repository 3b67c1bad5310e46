"""JAX twin of attn-parity: the attention core and the Flax NNX variant modules."""

from golden.specification.positions import ContextCache, KVCache, LatentCache
from jax_attn import convert, sharding
from jax_attn.functional import (
    DEFAULT_PRECISION,
    IMPLEMENTATIONS,
    scaled_dot_product_attention,
)
from jax_attn.modules import *  # noqa: F403  (the variant classes, listed in modules.__all__)
from jax_attn.modules import __all__ as _classes
from jax_attn.recurrent import GatedDeltaNet, KimiDeltaAttention, LightningAttention
from jax_attn.params import build, export_cache, export_params, load_cache, load_params
from jax_attn.ring import ring_attention
from jax_attn.rotary import rotary_embedding

# JAX only, no torch twin: the precision default, the mesh specs (batch and heads) and ring
# attention (the sequence over a mesh).
JAX_ONLY = ("DEFAULT_PRECISION", "sharding", "ring_attention")

__all__ = [*_classes, "GatedDeltaNet", "KimiDeltaAttention", "LightningAttention",
           "DEFAULT_PRECISION", "IMPLEMENTATIONS", "sharding", "ring_attention",
           "ContextCache", "KVCache", "LatentCache", "convert", "build", "export_cache",
           "export_params", "load_cache", "load_params", "rotary_embedding",
           "scaled_dot_product_attention"]
