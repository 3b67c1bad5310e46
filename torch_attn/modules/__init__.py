"""PyTorch attention variants. Each computes attention through
``torch_attn.scaled_dot_product_attention``; they differ only in how they make q, k, v and what
they do with the result.

Shape legend: B batch, L sequence length (Lq queries, Lk keys), N heads, Dh head width,
d_* feature widths. Inputs are (B, L, d) or (L, d). Masks are bool, True = may attend, and
broadcast to (B, Lq, Lk); multi-head modules apply them to every head.
Parameters are ``nn.Linear`` layers named W_query, W_key, W_value (and out_proj).

The rooms, the same in both twins (a class lies in the same room of ``torch_attn.modules`` and
``jax_attn.modules``), each importing only those above it:
    base           what every variant shares: ``_config`` (its checked configuration) and
                   ``_dropout_rate``
    notebook       the source notebooks' variants: SimpleSelfAttention, SelfAttention,
                   CausalSelfAttention, CrossAttention (one head), MultiHeadAttentionWrapper,
                   MultiHeadAttention
    grouped_query  GroupedQueryAttention, the decoder family, with its KV cache and RoPE
    cross          MultiHeadCrossAttention, encoder-decoder attention with its context cache
    latent         MultiHeadLatentAttention (MLA), its latent cache appended as
                   GroupedQueryAttention's KV cache is

A new variant's class goes in the room of its idea, or a room of its own, and is listed here.
"""

from torch_attn.modules.cross import MultiHeadCrossAttention
from torch_attn.modules.grouped_query import GroupedQueryAttention
from torch_attn.modules.latent import MultiHeadLatentAttention
from torch_attn.modules.notebook import (
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention,
    SimpleSelfAttention,
)

__all__ = ["CausalSelfAttention", "CrossAttention", "GroupedQueryAttention", "MultiHeadAttention",
           "MultiHeadAttentionWrapper", "MultiHeadCrossAttention",
           "MultiHeadLatentAttention", "SelfAttention", "SimpleSelfAttention"]

# Each class keeps the public path it had before the rooms, torch_attn.modules.X, whichever room
# defines it: error messages (a module of the other framework given to build or export_params),
# reprs and pickles name it so.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
