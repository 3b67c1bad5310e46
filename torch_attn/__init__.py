"""PyTorch twin of attn-parity: the attention core and the variant modules."""

from golden.specification.positions import ContextCache, KVCache, LatentCache
from torch_attn import convert
from torch_attn.functional import IMPLEMENTATIONS, scaled_dot_product_attention
from torch_attn.modules import *  # noqa: F403  (the variant classes, listed in modules.__all__)
from torch_attn.modules import __all__ as _classes
from torch_attn.params import build, export_cache, export_params, load_cache, load_params
from torch_attn.recurrent import GatedDeltaNet, KimiDeltaAttention, LightningAttention
from torch_attn.rotary import rotary_embedding

__all__ = [*_classes, "GatedDeltaNet", "KimiDeltaAttention", "LightningAttention", "ContextCache",
           "IMPLEMENTATIONS", "KVCache", "LatentCache", "convert", "build", "export_cache",
           "export_params", "load_cache", "load_params", "rotary_embedding",
           "scaled_dot_product_attention"]
