"""PyTorch twin of attn-parity: the attention core and the variant modules."""

from torch_attn.functional import scaled_dot_product_attention
from torch_attn.modules import *  # noqa: F403  (the variant classes, listed in modules.__all__)
from torch_attn.modules import __all__ as _classes
from torch_attn.params import build, export_params, load_params

__all__ = [*_classes, "build", "export_params", "load_params", "scaled_dot_product_attention"]
