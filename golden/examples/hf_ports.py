"""Flax NNX ports of two Hugging Face modules, written as a user would write them, for
``golden.compare`` on the HF modules as they are (docs/validating.md "A Hugging Face block, as
it is", tests/test_compare_hf.py): transformers' ``GPT2Block`` (eager attention) and
``Qwen3Attention`` (grouped-query attention, q_norm/k_norm, RoPE), each with a tiny config.
Needs transformers besides torch and Flax.

Shape legend: B batch, L tokens, D model width (GPT2_D for GPT-2), N heads, Nkv key-value
heads, Dh head width, F the MLP width. Masks are HF's additive 4-D masks (B or 1, 1, L, L):
0 where a query may attend, a large negative number elsewhere. Each port takes a ``bug`` naming
a planted mistake (None: the faithful port), which the tests expect ``compare`` to catch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

HIGHEST = jax.lax.Precision.HIGHEST
D, N, NKV, DH = 16, 4, 2, 6  # Qwen3's head width is not D / N
GPT2_D = 24  # GPT-2's width: N = 4 heads of D / N = 6, F = 4D = 96


def causal_mask(length: int) -> np.ndarray:
    """(1, 1, L, L) float32: HF's eager causal mask, 0 on and below the diagonal and the
    float32 minimum above it (what ``GPT2Model`` and ``Qwen3Model`` build with
    ``create_causal_mask`` for a batch without padding)."""
    allowed = np.tril(np.ones((length, length), dtype=bool))
    return np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[None, None]


# ---------------------------------------------------------------- GPT-2


def gpt2_config():
    return transformers.GPT2Config(n_embd=GPT2_D, n_head=N, n_layer=1, n_positions=32,
                                   vocab_size=64, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="eager")


def make_gpt2_block():
    """transformers' GPT2Block, as it is (a tensor out; causal only through the mask)."""
    return GPT2Block(gpt2_config(), layer_idx=0)


class LayerNorm(nnx.Module):
    """y = (x − mean) / √(var + eps) · scale + bias, the statistics in float32.
    ``one_pass``: the variance as E[x²] − E[x]² in the input's dtype, a low-precision bug
    (it cancels when the mean is large against the spread)."""

    def __init__(self, d, eps=1e-5, one_pass=False):
        self.scale, self.bias = nnx.Param(jnp.ones(d)), nnx.Param(jnp.zeros(d))
        self.eps, self.one_pass = eps, one_pass

    def __call__(self, x):  # x (..., D)
        if self.one_pass:
            mean = x.mean(-1, keepdims=True)
            var = (x * x).mean(-1, keepdims=True) - mean * mean  # in x's dtype
            y = ((x - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        else:
            x32 = x.astype(jnp.float32)
            mean = x32.mean(-1, keepdims=True)
            var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
            y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return y * self.scale[...] + self.bias[...]


class GPT2Attention(nnx.Module):
    """Causal self-attention through the mask given: c_attn makes q, k, v (D -> 3D)."""

    def __init__(self, d, heads, rngs, bug=None):
        self.c_attn = nnx.Linear(d, 3 * d, precision=HIGHEST, rngs=rngs)
        self.c_proj = nnx.Linear(d, d, precision=HIGHEST, rngs=rngs)
        self.heads, self.bug = heads, bug

    def __call__(self, x, attention_mask=None):  # x (B, L, D); mask (B or 1, 1, L, L)
        b, length, d = x.shape
        q, k, v = (t.reshape(b, length, self.heads, d // self.heads)  # (B, L, N, Dh)
                   for t in jnp.split(self.c_attn(x), 3, axis=-1))
        if self.bug == "key_value_swapped":
            k, v = v, k
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * (d // self.heads)**-0.5
        if attention_mask is not None and self.bug != "mask_ignored":
            scores = scores + attention_mask
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        a = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST)  # (B, L, N, Dh)
        return self.c_proj(a.reshape(b, length, d))


class GPT2MLP(nnx.Module):
    def __init__(self, d, f, rngs):
        self.c_fc = nnx.Linear(d, f, precision=HIGHEST, rngs=rngs)
        self.c_proj = nnx.Linear(f, d, precision=HIGHEST, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))  # gelu_new


class FlaxGPT2Block(nnx.Module):
    """Pre-norm block: x + attn(ln_1 x), then + mlp(ln_2 ·). ``bug``: "mask_ignored",
    "key_value_swapped" or "one_pass_variance" (ln_1 and ln_2)."""

    def __init__(self, rngs, bug=None):
        self.ln_1 = LayerNorm(GPT2_D, one_pass=bug == "one_pass_variance")
        self.attn = GPT2Attention(GPT2_D, N, rngs, bug)
        self.ln_2 = LayerNorm(GPT2_D, one_pass=bug == "one_pass_variance")
        self.mlp = GPT2MLP(GPT2_D, 4 * GPT2_D, rngs)

    def __call__(self, hidden_states, attention_mask=None):
        h = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask)
        return h + self.mlp(self.ln_2(h))


def make_flax_gpt2_block(bug=None):
    return FlaxGPT2Block(nnx.Rngs(0), bug=bug)


# HF's Conv1D keeps its weight as (in, out), as nnx.Linear's kernel: no transpose.
GPT2_MAPPING = {"ln_1.weight": "ln_1.scale", "ln_1.bias": "ln_1.bias",
                "ln_2.weight": "ln_2.scale", "ln_2.bias": "ln_2.bias",
                **{f"{m}.{p}": f"{m}.{'kernel' if p == 'weight' else 'bias'}"
                   for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                   for p in ("weight", "bias")}}


# ---------------------------------------------------------------- Qwen3


def qwen3_config():
    return transformers.Qwen3Config(hidden_size=D, num_attention_heads=N, num_key_value_heads=NKV,
                                    head_dim=DH, intermediate_size=32, vocab_size=64,
                                    max_position_embeddings=64, attn_implementation="eager")


def make_qwen3_attention():
    """transformers' Qwen3Attention, as it is: (hidden_states, position_embeddings,
    attention_mask) in, (output, weights) out."""
    return Qwen3Attention(qwen3_config(), layer_idx=0)


def qwen3_position_embeddings(length: int):
    """(cos, sin), each (1, L, Dh) float32 NumPy, from HF's Qwen3RotaryEmbedding at positions
    0 .. L − 1: what Qwen3Model hands every layer for a batch without a cache."""
    import torch

    rotary = Qwen3RotaryEmbedding(qwen3_config())
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
    return cos.numpy().copy(), sin.numpy().copy()


class RMSNorm(nnx.Module):
    """x / √(mean x² + eps) · weight, in float32, cast back before the weight (as HF)."""

    def __init__(self, d, eps=1e-6):
        self.scale, self.eps = nnx.Param(jnp.ones(d)), eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps)
        return self.scale[...] * x32.astype(x.dtype)


def _rotate_half(x):  # (..., Dh): (x1, x2) -> (−x2, x1), the halves
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _rotate_pairs(x):  # the planted bug: GPT-J's interleaved pairs (x0, x1) -> (−x1, x0)
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


class FlaxQwen3Attention(nnx.Module):
    """Grouped-query attention with RMSNorm on each head's q and k, then RoPE. ``bug``:
    "rope_interleaved" (pairs rotated instead of halves) or "norm_after_rope"."""

    def __init__(self, rngs, bug=None):
        self.q_proj = nnx.Linear(D, N * DH, use_bias=False, precision=HIGHEST, rngs=rngs)
        self.k_proj = nnx.Linear(D, NKV * DH, use_bias=False, precision=HIGHEST, rngs=rngs)
        self.v_proj = nnx.Linear(D, NKV * DH, use_bias=False, precision=HIGHEST, rngs=rngs)
        self.o_proj = nnx.Linear(N * DH, D, use_bias=False, precision=HIGHEST, rngs=rngs)
        self.q_norm, self.k_norm = RMSNorm(DH), RMSNorm(DH)
        self.bug = bug

    def __call__(self, hidden_states, position_embeddings, attention_mask=None):
        b, length, _ = hidden_states.shape  # (B, L, D)
        q = self.q_proj(hidden_states).reshape(b, length, N, DH)  # (B, L, N, Dh)
        k = self.k_proj(hidden_states).reshape(b, length, NKV, DH)  # (B, L, Nkv, Dh)
        v = self.v_proj(hidden_states).reshape(b, length, NKV, DH)
        if self.bug != "norm_after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t[:, :, None, :] for t in position_embeddings)  # (B, L, 1, Dh)
        rotate = _rotate_pairs if self.bug == "rope_interleaved" else _rotate_half
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        if self.bug == "norm_after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        k, v = (jnp.repeat(t, N // NKV, axis=2) for t in (k, v))  # (B, L, N, Dh), as repeat_kv
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * DH**-0.5
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        a = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST)  # (B, L, N, Dh)
        return self.o_proj(a.reshape(b, length, N * DH)), weights


def make_flax_qwen3_attention(bug=None):
    return FlaxQwen3Attention(nnx.Rngs(0), bug=bug)


QWEN3_MAPPING = {**{f"{p}.weight": (f"{p}.kernel", "T")  # nn.Linear keeps (out, in)
                    for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                 "q_norm.weight": "q_norm.scale", "k_norm.weight": "k_norm.scale"}


# For the command line (``attn-parity compare --keywords golden.examples.hf_ports:GPT2_KEYWORDS``): the
# causal mask GPT2Model hands its blocks, for inputs of 7 tokens.
GPT2_KEYWORDS = {"attention_mask": causal_mask(7)}


def make_flax_gpt2_block_mask_ignored():
    """The port with its planted bug "mask_ignored", named for the command line."""
    return make_flax_gpt2_block("mask_ignored")
