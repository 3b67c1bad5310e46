"""PyTorch twin of attn-parity: the attention core and (from issue 3) the variant modules."""

from torch_attn.functional import scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention"]
