"""Attention sinks (GPT-OSS), chunked attention (Llama 4) and ALiBi (BLOOM), causal, float32:
our cores against torch's fused kernel given each feature as its users give it (``run_modern``,
``modern_markdown``; ``python -m golden.bench --only modern``)."""

from __future__ import annotations

import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_attn
import torch_attn
from golden.bench.attention import framework, make_inputs, random_qkv
from golden.bench.cells import _f
from golden.bench.grid import Grid, Shape
from golden.bench.timing import measure

__all__ = ["alibi_bias_table", "MODERN_IMPLS", "ALIBI_IMPLS", "MODERN_FEATURES", "modern_call",
           "run_modern", "modern_markdown"]


def _torch_peer_sinks(q, k, v, sinks):
    """torch's fused kernel given what sinks mean: one more key of zeros whose additive bias is
    the head's sink logit and whose value is 0 (K and V copied with it, a float (Lq, Lk + 1)
    mask formed: why torch_attn's "fused" refuses sinks)."""
    lq, lk = q.shape[-2], k.shape[-2]
    zeros = lambda x: x.new_zeros(x.shape[:-2] + (1, x.shape[-1]))  # noqa: E731
    k, v = torch.cat([k, zeros(k)], dim=-2), torch.cat([v, zeros(v)], dim=-2)
    causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    mask = torch.zeros(q.shape[-3:-1] + (lk + 1,), dtype=q.dtype, device=q.device)
    mask[..., :lk] = mask[..., :lk].masked_fill(~causal, -math.inf)
    mask[..., lk] = sinks[:, None]  # (H, Lq, Lk + 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _torch_peer_chunks(q, k, v, chunk):
    """torch's fused kernel with the chunked causal mask as a boolean (Lq, Lk)."""
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)
    mask = (j <= i) & (j // chunk == i // chunk)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def alibi_bias_table(heads, length):
    """BLOOM's slopes times every distance key − query of a length-L call, (H, 2L + 1) float32:
    the JAX core's distance_bias, O(L)."""
    from golden.specification.decoder import alibi_slopes
    return (alibi_slopes(heads, "bloom")[:, None]
            * np.arange(-length, length + 1)).astype(np.float32)


def _alibi_materialised(q, k):
    """ALiBi's (H, Lq, Lk) float bias m_h · (j − i) formed in the call, as torch users (and
    HF's BLOOM) do; the causal entries −inf for torch_peer's float mask."""
    from golden.specification.decoder import alibi_slopes
    slopes = torch.from_numpy(alibi_slopes(q.shape[-3], "bloom")).to(q.dtype)
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)
    bias = slopes[:, None, None] * (j - i).to(q.dtype)  # (H, Lq, Lk)
    return bias.masked_fill(j > i, -math.inf)


def _ours_alibi(core, implementation):
    """Our core with the ALiBi bias: JAX's as its distance_bias table (O(L)); torch's (no
    blockwise path) as the (H, Lq, Lk) bias formed in the call."""
    if core is jax_attn.scaled_dot_product_attention:
        def f(q, k, v, sinks=None):
            table = jnp.asarray(alibi_bias_table(q.shape[-3], q.shape[-2] + k.shape[-2]))
            return core(q, k, v, is_causal=True, distance_bias=table,
                        implementation=implementation)
        return f
    return lambda q, k, v, sinks=None: core(q, k, v, None, _alibi_materialised(q, k),
                                            is_causal=True, implementation=implementation)


def _torch_peer_alibi(q, k, v):
    """torch's fused kernel given ALiBi's bias with the causal −inf as its float mask."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                            attn_mask=_alibi_materialised(q, k))


def _ours(core, implementation):
    """Our core with an implementation, sinks or chunks passed through."""
    def f(q, k, v, sinks=None, chunk=None):
        extra = {} if sinks is None else {"sinks": sinks}
        return core(q, k, v, is_causal=True, attention_chunk_size=chunk,
                    implementation=implementation, **extra)
    return f


MODERN_IMPLS = {  # impl: f(q, k, v, sinks=..., chunk=...) on (B, H, L, D), causal
    "jax_blockwise": _ours(jax_attn.scaled_dot_product_attention, "blockwise"),
    "jax_explicit": _ours(jax_attn.scaled_dot_product_attention, "explicit"),
    "torch_peer": None,  # torch's fused kernel, given the feature as _torch_peer_* does
    "torch_explicit": _ours(torch_attn.scaled_dot_product_attention, "explicit"),
}


ALIBI_IMPLS = {
    "jax_blockwise": _ours_alibi(jax_attn.scaled_dot_product_attention, "blockwise"),
    "jax_explicit": _ours_alibi(jax_attn.scaled_dot_product_attention, "explicit"),
    "torch_explicit": _ours_alibi(torch_attn.scaled_dot_product_attention, "explicit"),
}
MODERN_FEATURES = ("sinks", "chunks", "alibi")


def modern_call(impl: str, feature: str, chunk: int, backward: bool):
    """f(q, k, v, sinks) for a sinks or chunks row (the sinks an input, differentiated too);
    JAX's backward jitted, torch's forward under no_grad."""
    if impl == "torch_peer":
        f = (_torch_peer_sinks if feature == "sinks" else
             (lambda q, k, v, sinks: _torch_peer_alibi(q, k, v)) if feature == "alibi" else
             lambda q, k, v, sinks: _torch_peer_chunks(q, k, v, chunk))
    elif feature == "alibi":
        f = ALIBI_IMPLS[impl]
    elif feature == "sinks":
        f = MODERN_IMPLS[impl]
    else:
        f = partial(lambda g, q, k, v, sinks: g(q, k, v, chunk=chunk), MODERN_IMPLS[impl])
    args = (0, 1, 2, 3) if feature == "sinks" else (0, 1, 2)
    if framework(impl) == "jax":
        if backward:
            return jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=args))
        return jax.jit(f)
    if backward:
        return lambda *a: torch.autograd.grad(f(*a).sum(), [a[n] for n in args])

    def forward(*a):
        with torch.no_grad():
            return f(*a)
    return forward


def run_modern(grid: Grid, rng) -> list[dict]:
    """Sinks rows, chunked rows and ALiBi rows (causal, float32), forward and forward+backward,
    each implementation; peer_ratio = torch_peer's time / this row's (> 1: faster)."""
    b, h, length, d, chunk = grid.modern
    shape = Shape(b, h, length, length, d)
    host = random_qkv(shape, rng) + [rng.standard_normal(h, dtype=np.float32)]
    rows = []
    for feature in MODERN_FEATURES:
        for backward in (False, True):
            block = []
            for impl in MODERN_IMPLS:
                args = make_inputs(shape, "float32", impl, backward, host[:3])
                sinks = host[3]
                args.append(jnp.asarray(sinks) if framework(impl) == "jax" else
                            torch.from_numpy(sinks).requires_grad_(backward))
                fn = modern_call(impl, feature, chunk, backward)
                m = measure(fn, args, grid.repeats)
                block.append({"feature": feature, "shape": shape.name + (
                    f",C={chunk}" if feature == "chunks" else ""),
                    "pass": "fwd+bwd" if backward else "fwd", "impl": impl,
                    "framework": framework(impl), **m})
                print(f"  {feature} {block[-1]['pass']:7} {impl:15} {m['median_ms']:10.1f} ms",
                      file=sys.stderr, flush=True)
            peer = next(r["median_ms"] for r in block if r["impl"] == "torch_peer")
            for r in block:
                r["peer_ratio"] = peer / r["median_ms"]
            rows += block
    return rows


def modern_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "", "## Attention sinks, chunked attention and ALiBi (causal, float32)", "",
        "- sinks: one logit per head (GPT-OSS), differentiated in fwd+bwd; torch_peer is "
        "`F.scaled_dot_product_attention` given an extra key of zeros whose float mask entry is "
        "the sink (value 0), K and V copied with it. chunks: attention_chunk_size C (Llama 4), "
        "torch_peer given the chunked causal mask as a boolean (Lq, Lk). jax_blockwise: "
        "default blocks (1024, 1024), key blocks outside a query block's chunk skipped. "
        "*_explicit: `implementation=\"explicit\"`. alibi: BLOOM's slopes m_h · (j − i), JAX's "
        "as the core's distance_bias table (H, 2L + 1) gathered per block, torch's (torch_peer "
        "and torch_explicit) as the (H, Lq, Lk) float bias formed in the call (causal entries "
        "−inf in torch_peer's).",
        "- ÷ peer: torch_peer's time ÷ this row's (> 1: faster than torch's fused kernel).", "",
        "| feature | shape | pass | impl | median ms | n | ÷ peer | others % |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    return lines + [f"| {r['feature']} | {r['shape']} | {r['pass']} | {r['impl']} "
                    f"| {r['median_ms']:.1f} | {r['repeats']} | {r['peer_ratio']:.2f} "
                    f"| {_f(r['other_cpu_pct'], '{:.0f}')} |" for r in rows]
