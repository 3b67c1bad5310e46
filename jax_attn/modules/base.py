"""What every jax_attn variant module shares: ``_Variant`` (the constructor arguments checked
against the variant's description and kept static, the dropout stream and its rate),
``_linear`` (an ``nnx.Linear`` with the module's precision), ``compiled_call`` (how every
``__call__`` is compiled) and ``_merge_heads`` (the heads' outputs through out_proj, where the
result lies on a mesh). Shape legend as in jax_attn.modules: B batch, L sequence length, N
heads, Dh head width, d_* feature widths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from functools import reduce

from golden.specification import variants
from golden.specification.positions import allowed_terms
from golden.specification.temperature import learned_temperature, temperature
from golden.specification.variants import VARIANTS
from jax_attn.sharding import explicit_spec


# Compiles a module's __call__: the module is a pytree (graph=False, the fast path: no shared
# submodules here), ``return_weights`` changes the program's outputs, so it is static.
compiled_call = nnx.jit(graph=False, static_argnames="return_weights")


def _check_rngs(rngs) -> None:
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got "
                        f"{type(rngs).__name__}")


def _linear(d_in, d_out, bias, rngs, precision):
    _check_rngs(rngs)
    return nnx.Linear(d_in, d_out, use_bias=bias, precision=precision, rngs=rngs)


class _Variant(nnx.Module):
    """What every variant shares: its checked configuration and its dropout stream."""

    variant: str
    dropout = 0.0

    def _configure(self, **given) -> None:
        """Check the constructor arguments (golden.specification.variants); kept as a hashable
        tuple, because a module's plain attributes are static under jit."""
        self._config = tuple((n, variants.freeze(v))
                             for n, v in VARIANTS[self.variant].config(given).items())

    @property
    def config(self) -> dict:
        """The constructor arguments (what ``build`` needs besides the parameters)."""
        return {n: variants.thaw(v) for n, v in self._config}

    def _init_dropout(self, dropout, rngs):
        self.dropout = dropout
        self.deterministic = False
        self.seed_dropout(rngs)

    def seed_dropout(self, rngs) -> None:
        """A fresh dropout stream forked from ``rngs`` (none when dropout is 0)."""
        _check_rngs(rngs)
        self.dropout_rngs = rngs["dropout"].fork() if self.dropout > 0 else nnx.data(None)

    def _rate(self) -> float:
        return 0.0 if getattr(self, "deterministic", True) else self.dropout

    def _dropout_key(self, dropout_mask):
        """A fresh key from the dropout stream when dropout is active and no dropout mask is
        given, else None."""
        return self.dropout_rngs() if self._rate() > 0 and dropout_mask is None else None


def _merge_heads(out_proj, o, output=None):
    """out_proj of the heads' outputs o (B, N, L, Dh) side by side, (B, L, N·Dh) -> (B, L, d_out),
    through ``output`` (B, L, N·Dh) -> (B, L, N·Dh) first when given (GroupedQueryAttention's
    output norm and gate). With the heads split over a mesh axis
    (jax_attn.sharding: out_proj row-parallel) the product sums over devices, and explicit mesh
    axes ask where its result lies: as o's batch and length, the features whole on every device
    (the all-reduce Megatron's layout implies)."""
    merged = jnp.swapaxes(o, -2, -3)  # (B, L, N, Dh)
    merged = merged.reshape(merged.shape[:-2] + (-1,))  # (B, L, N·Dh)
    if output is not None:
        merged = output(merged)
    spec = explicit_spec(merged)
    out = None if spec is None else jax.typeof(merged).sharding.update(
        spec=jax.sharding.PartitionSpec(*spec[:-1], None))  # on merged's (abstract) mesh
    return out_proj(merged, out_sharding=out)


def _head_mask(mask, x):
    """The core's mask (B, 1 or N, Lq, Lk) of a module's mask for x (B, Lq, d): (B, Lq, Lk)
    gains the head axis; a mask with one, (B, 1 or N, Lq, Lk) (Hugging Face's 4-D boolean
    masks), is used as it is. None stays None."""
    if mask is None:
        return None
    return mask if mask.ndim == x.ndim + 1 else mask[..., None, :, :]


def _query_temperature(module, q, offset, positions):
    """q (B, N, L, Dh) times the module's query temperature (its ``query_temperature``, a
    hashable tuple of items, golden.specification.temperature; the learned kind's
    ``temperature_scale`` and ``temperature_bias``) at each token's position (``positions``, or
    index + offset), in at least float32, rounded once."""
    compute = jnp.promote_types(q.dtype, jnp.float32)
    if positions is None:
        positions = jnp.arange(q.shape[-2])  # (L,)
        if offset is not None:
            positions = positions + offset[:, None]  # (B, L)
    t = dict(module.query_temperature)
    functions = dict(real=lambda n: n.astype(compute), log1p=jnp.log1p)
    if t.get("kind") == "learned":  # (N, L) or (B, N, L)
        factors = learned_temperature(
            positions, module.temperature_scale.get_value().astype(compute),
            module.temperature_bias.get_value().astype(compute), **functions)
        return (q.astype(compute) * factors[..., None]).astype(q.dtype)
    factors = temperature(positions, t, exp=jnp.exp, **functions)
    factors = factors[..., None] if factors.ndim == 1 else factors[:, None, :, None]
    return (q.astype(compute) * factors).astype(q.dtype)  # (L, 1) or (B, 1, L, 1)


def selection_allowed(mask, shape, offset, q_lengths, kv_lengths, *, causal,
                      window=(None, None), chunk=None):
    """Where each query may attend, bool ``shape`` (B, Lq, Lk), for an indexer's choice: the
    call's mask (its head axis of size 1 dropped), causality, the sliding ``window`` and the
    ``chunk``s at the queries' positions (offset + i), the lengths."""
    if mask is not None and mask.ndim == len(shape) + 1:
        mask = mask[..., 0, :, :]                                # (B, Lq, Lk)
    row = jnp.arange(shape[-2])[:, None]                         # (Lq, 1)
    key = jnp.arange(shape[-1])[None, :]                         # (1, Lk)
    pos = row if offset is None else row + offset[:, None, None]  # (B, Lq, 1)
    q_lengths, kv_lengths = (None if n is None else n[..., None, None]
                             for n in (q_lengths, kv_lengths))
    terms = allowed_terms(row, key, pos, is_causal=causal, window=window, chunk=chunk,
                          q_lengths=q_lengths, kv_lengths=kv_lengths)
    terms += [] if mask is None else [mask]
    return jnp.broadcast_to(reduce(jnp.logical_and, terms, jnp.ones((), bool)), shape)
