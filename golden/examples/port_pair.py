"""A small PyTorch block and its faithful Flax NNX port, for ``golden.compare``: the worked
example of docs/validating.md and the pair tests/test_compare.py runs.

Shape legend: B batch, L sequence length, E = 8 model width, H = 2 heads, Dh = 4 head width,
F = 6 MLP width. The block is causal self-attention (with an optional key mask) followed by an
MLP, without norms:

    q, k, v = x Wq + bq, x Wk + bk, x Wv + bv        (B, L, E), split into H heads of Dh
    a = softmax(q kᵀ / √Dh, causal) v                 (B, L, E) after merging the heads
    h = a Wo + bo                                     (B, L, E)
    y = tanh(h Wfc + bfc) Wout + bout + h             the MLP (E -> F -> E) with a residual

The projections q, k, v and o are square (8 × 8): a missing transpose keeps their shapes. The
MLP's are not (8 × 6, 6 × 8).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from torch import nn

E, H, F = 8, 2, 6
DH = E // H
HIGHEST = jax.lax.Precision.HIGHEST


class TorchMLP(nn.Module):
    """E -> F -> E with tanh."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(E, F), nn.Linear(F, E)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


class TorchBlock(nn.Module):
    """Causal self-attention then the MLP, written plainly in the module's dtype."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E) for _ in range(4))
        self.mlp = TorchMLP()

    def forward(self, x, mask=None):  # x: (B, L, E); mask: (B, L) keys that may be attended
        b, length, _ = x.shape
        q, k, v = (p(x).view(b, length, H, DH).transpose(1, 2)  # (B, H, L, Dh)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(DH)  # (B, H, L, L)
        allowed = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L)
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]  # (B, 1, L, L)
        weights = scores.masked_fill(~allowed, -1e30).softmax(-1)
        a = (weights @ v).transpose(1, 2).reshape(b, length, E)  # (B, L, E)
        h = self.o_proj(a)
        return self.mlp(h) + h


class FlaxMLP(nnx.Module):
    """E -> F -> E with tanh."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(E, F, precision=HIGHEST, rngs=rngs)
        self.out = nnx.Linear(F, E, precision=HIGHEST, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.fc(x)))


class FlaxBlock(nnx.Module):
    """The port of ``TorchBlock``; ``transpose_key`` builds a deliberately wrong port that
    multiplies by the key kernel's transpose."""

    def __init__(self, rngs, transpose_key=False):
        self.query, self.key, self.value, self.out = (
            nnx.Linear(E, E, precision=HIGHEST, rngs=rngs) for _ in range(4))
        self.mlp = FlaxMLP(rngs)
        self.transpose_key = transpose_key

    def __call__(self, x, mask=None):  # x: (B, L, E); mask: (B, L) keys that may be attended
        b, length, _ = x.shape
        if self.transpose_key:
            k = jnp.matmul(x, self.key.kernel[...].T, precision=HIGHEST) + self.key.bias[...]
        else:
            k = self.key(x)
        q, k, v = (t.reshape(b, length, H, DH) for t in (self.query(x), k, self.value(x)))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / math.sqrt(DH)
        allowed = jnp.tril(jnp.ones((length, length), dtype=bool))  # (L, L)
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]  # (B, 1, L, L)
        weights = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)  # (B, H, L, L)
        a = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST).reshape(b, length, E)
        h = self.out(a)
        return self.mlp(h) + h


def make_torch() -> TorchBlock:
    return TorchBlock()


def make_flax() -> FlaxBlock:
    return FlaxBlock(nnx.Rngs(0))


def make_flax_wrong_key() -> FlaxBlock:
    """A port with a bug: the key projection uses its kernel transposed."""
    return FlaxBlock(nnx.Rngs(0), transpose_key=True)


def _linear(torch_name, flax_name) -> dict:
    return {f"{torch_name}.weight": (f"{flax_name}.kernel", "T"),
            f"{torch_name}.bias": f"{flax_name}.bias"}


MAPPING = {**_linear("q_proj", "query"), **_linear("k_proj", "key"),
           **_linear("v_proj", "value"), **_linear("o_proj", "out"),
           **_linear("mlp.fc", "mlp.fc"), **_linear("mlp.out", "mlp.out")}

# The same correspondence through the neutral layout (y = x W + b, W (in, out)): torch's
# nn.Linear keeps Wᵀ, Flax's nnx.Linear keeps W.
NEUTRAL_NAMES = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value",
                 "o_proj": "W_out", "mlp.fc": "W_fc", "mlp.out": "W_mlp_out"}


def _neutral(layout) -> dict:
    """{neutral name: (path, rule)} for torch ("torch") or Flax ("flax")."""
    table = {}
    for torch_name, w in NEUTRAL_NAMES.items():
        flax_name = MAPPING[f"{torch_name}.bias"].rpartition(".")[0]
        name = torch_name if layout == "torch" else flax_name
        table[w] = (f"{name}.weight", "T") if layout == "torch" else (f"{name}.kernel", "")
        table["b" + w[1:]] = (f"{name}.bias", "")
    return table


TORCH_NEUTRAL = _neutral("torch")
FLAX_NEUTRAL = _neutral("flax")
