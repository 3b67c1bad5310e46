"""A modern block in plain PyTorch and a faithful Flax NNX port, with bugs to plant in the port,
for ``golden.compare``'s localisation (docs/validating.md, tests/test_compare_localise.py).

Shape legend: B batch, L sequence length, E = 12 model width, H = 4 query heads, Hkv = 2
key-value heads (each shared by H / Hkv = 2 query heads), Dh = 6 head width, F = 10 MLP width.
The block is Qwen3-like:

    q, k, v = x Wq, x Wk, x Wv                      (B, L, H·Dh), (B, L, Hkv·Dh) twice
    q, k = RMSNorm_q(q), RMSNorm_k(k)               per head, over Dh, each owning a weight
    q, k = rope(q), rope(k)                         rotate-half pairing (i, i + Dh/2)
    k, v = repeat(k), repeat(v)                     key-value head j serves query heads 2j, 2j+1
    h = x + softmax(q kᵀ / √Dh, causal) v Wo        (B, L, E)
    y = h + (silu(n Wgate) ⊙ n Wup) Wdown           n = LayerNorm(h), the block's ``ln_2``

Torch runs the paired submodules in the order q_proj, q_norm, k_proj, k_norm, v_proj, o_proj,
ln_2, mlp.gate, mlp.up, mlp.down. ``BUGS`` names what ``FlaxBlock(bug=...)`` plants: in code
between two of them, in a bypassed ``__call__``, or (one) inside a paired submodule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from torch import nn

E, H, HKV, DH, F = 12, 4, 2, 6, 10
EPS_NORM, EPS_LN = 1e-6, 1e-5
HIGHEST = jax.lax.Precision.HIGHEST

BUGS = {
    "rope_interleaved": "RoPE pairs (2i, 2i + 1) (interleaved) instead of (i, i + Dh/2)",
    "kv_tile": "jnp.tile instead of jnp.repeat for the key-value heads",
    "gelu": "gelu instead of silu in the MLP",
    "no_causal_mask": "the causal mask left out",
    "ln_2_by_hand_eps": "ln_2 applied by hand (its __call__ not called) with eps 1e-2",
    "ln_2_by_hand": "ln_2 applied by hand, correctly (its __call__ not called)",
    "input_bfloat16": "the input rounded to bfloat16 first",
    "no_final_residual": "the MLP's residual left out",
    "q_norm_eps": "q_norm built with epsilon 0.1 (a bug inside a paired submodule)",
}


def _angles(length, dtype):
    """cos, sin of shape (L, Dh/2): position p, frequency 10000^(-2i/Dh)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, DH, 2, dtype=dtype) / DH)  # (Dh/2,)
    pos = torch.arange(length, dtype=dtype)[:, None] * inv  # (L, Dh/2)
    return pos.cos(), pos.sin()


class TorchHFRMSNorm(nn.Module):
    """An RMSNorm written as Hugging Face's (Qwen3RMSNorm): computed in float32 whatever the
    module's dtype, then cast back, so a ``.double()`` model holds float32 steps."""

    def __init__(self, n, eps=EPS_NORM):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class TorchMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(E, F), nn.Linear(E, F), nn.Linear(F, E)

    def forward(self, n):  # (B, L, E)
        return self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))


class TorchBlock(nn.Module):
    """The block in plain torch, in the module's dtype throughout; ``hf_norm`` uses
    ``TorchHFRMSNorm`` (float32 inside) for q_norm and k_norm."""

    def __init__(self, hf_norm=False):
        super().__init__()
        self.q_proj = nn.Linear(E, H * DH, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(E, HKV * DH, bias=False) for _ in range(2))
        self.o_proj = nn.Linear(H * DH, E, bias=False)
        norm = TorchHFRMSNorm if hf_norm else (lambda n: nn.RMSNorm(n, eps=EPS_NORM))
        self.q_norm, self.k_norm = norm(DH), norm(DH)
        self.ln_2 = nn.LayerNorm(E, eps=EPS_LN)
        self.mlp = TorchMLP()

    def forward(self, x):  # (B, L, E)
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, length, H, DH)).transpose(1, 2)  # (B, H, L, Dh)
        k = self.k_norm(self.k_proj(x).view(b, length, HKV, DH)).transpose(1, 2)  # (B, Hkv,..)
        v = self.v_proj(x).view(b, length, HKV, DH).transpose(1, 2)  # (B, Hkv, L, Dh)
        cos, sin = _angles(length, x.dtype)
        q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
        k, v = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))  # (B, H, L, Dh)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DH)  # (B, H, L, L)
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        weights = scores.masked_fill(~allowed, -1e30).softmax(-1)
        a = (weights @ v).transpose(1, 2).reshape(b, length, H * DH)  # (B, L, H·Dh)
        h = x + self.o_proj(a)
        return h + self.mlp(self.ln_2(h))


def _rotate_half(t, cos, sin):
    """t (..., L, Dh) rotated by pairs (i, i + Dh/2)."""
    t1, t2 = t[..., : DH // 2], t[..., DH // 2:]
    return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)


class FlaxMLP(nnx.Module):
    def __init__(self, rngs, act):
        self.gate, self.up = (nnx.Linear(E, F, precision=HIGHEST, rngs=rngs) for _ in range(2))
        self.down = nnx.Linear(F, E, precision=HIGHEST, rngs=rngs)
        self.act = act

    def __call__(self, n):  # (B, L, E)
        return self.down(self.act(self.gate(n)) * self.up(n))


class FlaxBlock(nnx.Module):
    """The port of ``TorchBlock``, in (B, L, heads, Dh) layout; ``bug`` (a key of ``BUGS``)
    plants one bug."""

    def __init__(self, rngs, bug=None):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug should be one of {sorted(BUGS)}, got {bug!r}")
        linear = dict(use_bias=False, precision=HIGHEST, rngs=rngs)
        self.q_proj = nnx.Linear(E, H * DH, **linear)
        self.k_proj, self.v_proj = (nnx.Linear(E, HKV * DH, **linear) for _ in range(2))
        self.o_proj = nnx.Linear(H * DH, E, **linear)
        self.q_norm, self.k_norm = (nnx.RMSNorm(DH, epsilon=eps, rngs=rngs) for eps in (
            0.1 if bug == "q_norm_eps" else EPS_NORM, EPS_NORM))
        self.ln_2 = nnx.LayerNorm(E, epsilon=EPS_LN, use_fast_variance=False, rngs=rngs)
        self.mlp = FlaxMLP(rngs, jax.nn.gelu if bug == "gelu" else jax.nn.silu)
        self.bug = bug

    def __call__(self, x):  # (B, L, E)
        if self.bug == "input_bfloat16":
            x = x.astype(jnp.bfloat16).astype(x.dtype)
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, length, H, DH))  # (B, L, H, Dh)
        k = self.k_norm(self.k_proj(x).reshape(b, length, HKV, DH))  # (B, L, Hkv, Dh)
        v = self.v_proj(x).reshape(b, length, HKV, DH)
        rope = _interleaved if self.bug == "rope_interleaved" else _rotate_half_jax
        q, k = rope(q, length), rope(k, length)
        spread = ((lambda t: jnp.tile(t, (1, 1, H // HKV, 1))) if self.bug == "kv_tile"
                  else (lambda t: jnp.repeat(t, H // HKV, axis=2)))
        k, v = spread(k), spread(v)  # (B, L, H, Dh)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / math.sqrt(DH)
        if self.bug != "no_causal_mask":
            allowed = jnp.tril(jnp.ones((length, length), dtype=bool))  # (L, L)
            scores = jnp.where(allowed, scores, -1e30)
        weights = jax.nn.softmax(scores, axis=-1)  # (B, H, L, L)
        a = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST)
        h = x + self.o_proj(a.reshape(b, length, H * DH))
        mlp = self.mlp(self._ln_2(h))
        return mlp if self.bug == "no_final_residual" else h + mlp

    def _ln_2(self, h):
        """ln_2, or its maths written out (its ``__call__`` bypassed) for the ln_2 bugs."""
        if self.bug not in ("ln_2_by_hand", "ln_2_by_hand_eps"):
            return self.ln_2(h)
        eps = 1e-2 if self.bug == "ln_2_by_hand_eps" else EPS_LN
        centred = h - h.mean(-1, keepdims=True)
        n = centred * jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + eps)
        return n * self.ln_2.scale[...] + self.ln_2.bias[...]


def _angles_jax(length):
    inv = 1.0 / 10000.0 ** (jnp.arange(0, DH, 2, dtype=jnp.float32) / DH)  # (Dh/2,)
    pos = jnp.arange(length, dtype=jnp.float32)[:, None] * inv  # (L, Dh/2)
    return jnp.cos(pos)[:, None, :], jnp.sin(pos)[:, None, :]  # (L, 1, Dh/2)


def _rotate_half_jax(t, length):
    """t (B, L, heads, Dh) rotated by pairs (i, i + Dh/2)."""
    cos, sin = _angles_jax(length)
    t1, t2 = t[..., : DH // 2], t[..., DH // 2:]
    return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)


def _interleaved(t, length):
    """The wrong pairing: (2i, 2i + 1), as GPT-J and Meta's LLaMA checkpoints rotate."""
    cos, sin = _angles_jax(length)
    t1, t2 = t[..., 0::2], t[..., 1::2]
    return jnp.stack([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1).reshape(t.shape)


def make_torch() -> TorchBlock:
    return TorchBlock()


def make_torch_hf_norm() -> TorchBlock:
    return TorchBlock(hf_norm=True)


def make_flax(bug=None) -> FlaxBlock:
    return FlaxBlock(nnx.Rngs(0), bug)


def _linear(name) -> dict:
    return {f"{name}.weight": (f"{name}.kernel", "T"), **(
        {f"{name}.bias": f"{name}.bias"} if name.startswith("mlp.") else {})}


MAPPING = {**_linear("q_proj"), **_linear("k_proj"), **_linear("v_proj"), **_linear("o_proj"),
           "q_norm.weight": "q_norm.scale", "k_norm.weight": "k_norm.scale",
           "ln_2.weight": "ln_2.scale", "ln_2.bias": "ln_2.bias",
           **_linear("mlp.gate"), **_linear("mlp.up"), **_linear("mlp.down")}
