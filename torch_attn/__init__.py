"""PyTorch twin of attn-parity: the attention core and the variant modules."""

from torch_attn.functional import scaled_dot_product_attention
from torch_attn.modules import (
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention,
    SimpleSelfAttention,
)
from torch_attn.params import build, export_params, load_params

__all__ = [
    "CausalSelfAttention", "CrossAttention", "MultiHeadAttention", "MultiHeadAttentionWrapper",
    "SelfAttention", "SimpleSelfAttention", "build", "export_params", "load_params",
    "scaled_dot_product_attention",
]
