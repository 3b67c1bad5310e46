"""Long sequences, causal, float32: our cores' O(L)-memory implementations (JAX's blockwise,
torch's row_chunks) and the explicit ones against torch's fused kernel, forward and
forward+backward (``run_long``), with XLA's temporary memory; the long-sequence targets, speed
at 16k and memory at 16k and 64k (``long_targets``)."""

from __future__ import annotations

import sys
from functools import partial

import jax
import torch

import jax_attn
import torch_attn
from golden.bench.attention import framework, make_inputs, random_qkv
from golden.bench.cells import _f
from golden.bench.grid import Grid, Shape
from golden.bench.timing import measure_long, xla_memory

__all__ = ["LONG_IMPLS", "LONG_TARGETS", "LONG_MEMORY_TARGETS", "long_call", "run_long",
           "long_targets"]


LONG_IMPLS = {  # impl: the core, f(q, k, v, *, is_causal), on (B, H, L, D)
    "torch_peer": torch.nn.functional.scaled_dot_product_attention,
    "torch_row_chunks": partial(torch_attn.scaled_dot_product_attention,
                                implementation="row_chunks"),
    "jax_blockwise": partial(jax_attn.scaled_dot_product_attention, implementation="blockwise"),
    "torch_explicit": partial(torch_attn.scaled_dot_product_attention,
                              implementation="explicit"),
    "jax_explicit": partial(jax_attn.scaled_dot_product_attention, implementation="explicit"),
}
LONG_TARGETS = (  # L, pass, numerator impl, denominator impl, target: time(num) / time(den)
    (16384, "fwd", "torch_peer", "jax_blockwise", 0.9),
    (16384, "fwd+bwd", "torch_peer", "jax_blockwise", 0.6),
)
LONG_MEMORY_TARGETS = ((16384, 1024.0), (65536, 4096.0))  # L, MiB at most, fwd+bwd


def long_call(impl: str, backward: bool):
    """f(q, k, v) for a long row: causal; JAX's backward jitted; torch's forward under no_grad."""
    f = partial(LONG_IMPLS[impl], is_causal=True)
    if framework(impl) == "jax":
        if backward:
            return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))
        return f  # the core is jitted inside
    if backward:
        return lambda q, k, v: torch.autograd.grad(f(q, k, v).sum(), (q, k, v))

    def forward(q, k, v):
        with torch.no_grad():
            return f(q, k, v)
    return forward


def run_long(grid: Grid, rng) -> list[dict]:
    """Every long row: each length, forward and forward+backward, each implementation (the
    explicit ones up to their longest L); peer_ratio = torch_peer's time / this row's (> 1:
    faster)."""
    (b, h, d), lengths, explicit_max = grid.long
    rows = []
    for length in lengths:
        host = random_qkv(Shape(b, h, length, length, d), rng)
        steady = 2 if length <= 16384 else 1
        for backward in (False, True):
            block = []
            for impl in LONG_IMPLS:
                if impl.endswith("explicit") and length > explicit_max:
                    continue
                args = make_inputs(Shape(b, h, length, length, d), "float32", impl, backward, host)
                fn = long_call(impl, backward)
                m = measure_long(fn, args, steady)
                block.append({"L": length, "shape": f"B={b},H={h},L={length},D={d}",
                              "pass": "fwd+bwd" if backward else "fwd", "impl": impl,
                              "framework": framework(impl), **m,
                              "xla_temp_mb": _xla_temp_mb(fn, args, impl, backward)})
                print(f"  long L={length} {block[-1]['pass']:7} {impl:15} "
                      f"{m['median_ms']:10.1f} ms, XLA temp "
                      f"{_f(block[-1]['xla_temp_mb'], '{:.0f}')} MiB", file=sys.stderr, flush=True)
            peer = next(r["median_ms"] for r in block if r["impl"] == "torch_peer")
            for r in block:
                r["peer_ratio"] = peer / r["median_ms"]
            rows += block
    return rows


def _xla_temp_mb(fn, args, impl, backward):
    """XLA's temporary memory of a JAX long row's program, MiB (None for torch: in-process RSS
    growth reads ~0 once earlier rows have grown the heap, so torch's memory is measured by the
    tests' saved-tensor count and by separate processes, see docs/core.md, "Long sequences")."""
    if framework(impl) != "jax":
        return None
    jitted = fn if backward else jax.jit(partial(LONG_IMPLS[impl], is_causal=True))
    memory = xla_memory(jitted, args)
    return None if memory is None else memory["temp_size_in_bytes"] / 2**20


def long_targets(rows: list[dict]) -> list[dict]:
    """The issue's long-sequence targets: speed ratios at 16k, peak memory at 16k and 64k."""
    at = {(r["L"], r["pass"], r["impl"]): r for r in rows}
    out = []
    for length, phase, num, den, target in LONG_TARGETS:
        if (length, phase, num) in at and (length, phase, den) in at:
            a, b = at[length, phase, num], at[length, phase, den]
            ratio = a["median_ms"] / b["median_ms"]
            others = [x["other_cpu_pct"] for x in (a, b) if x["other_cpu_pct"] is not None]
            out.append({"name": f"{den} {phase} vs {num} ({num} time / {den} time)",
                        "shape": a["shape"], "ratio": ratio, "target": target,
                        "met": ratio >= target, "other_cpu_pct": max(others, default=None)})
    for length, mib in LONG_MEMORY_TARGETS:
        r = at.get((length, "fwd+bwd", "jax_blockwise"))
        if r is not None and r["xla_temp_mb"] is not None:
            out.append({"name": "jax_blockwise fwd+bwd XLA temporary memory, MiB",
                        "shape": r["shape"], "ratio": r["xla_temp_mb"], "target": mib,
                        "at_most": True, "met": r["xla_temp_mb"] <= mib, "other_cpu_pct": None})
    return out
