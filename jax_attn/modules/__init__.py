"""Flax NNX attention variants, twins of ``torch_attn.modules``. Each computes attention through
``jax_attn.scaled_dot_product_attention``; they differ only in how they make q, k, v and what
they do with the result.

Shape legend: B batch, L sequence length (Lq queries, Lk keys), N heads, Dh head width,
d_* feature widths. Inputs are (B, L, d) or (L, d). Masks are bool, True = may attend, and
broadcast to (B, Lq, Lk); multi-head modules apply them to every head.
Parameters are ``nnx.Linear`` layers named W_query, W_key, W_value (and out_proj); their kernels
are already in the neutral (in, out) layout. Dropout is active unless ``deterministic`` is True
(``module.eval()``); it draws from the ``dropout`` stream of the ``rngs`` given at construction.
The constructors take the PyTorch twin's arguments plus ``rngs`` and ``precision`` (keyword-only;
``precision`` reaches every dot, projections included).

Execution: every ``__call__`` is plain code from the projections to the core, compiled with
``nnx.jit(graph=False)``: an eager call runs one compiled program (the module's arrays traced,
its settings static), and whatever the call changes in the module (the dropout stream's counter)
is written back. Inside a caller's ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` or optax step the
inner ``jit`` is inlined and NNX carries the same updates through.

The rooms are torch_attn.modules's, each holding the same classes, so that a class lies in the
same place in either twin (its docstring lists them); ``base`` here is the ``_Variant`` class
(the checked configuration kept static, the dropout stream), ``_linear``, ``compiled_call`` and
``_merge_heads``.
"""

from jax_attn.modules.cross import MultiHeadCrossAttention
from jax_attn.modules.grouped_query import GroupedQueryAttention
from jax_attn.modules.latent import MultiHeadLatentAttention
from jax_attn.modules.notebook import (
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

# The public path of each class, jax_attn.modules.X, as torch_attn.modules gives its own.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
