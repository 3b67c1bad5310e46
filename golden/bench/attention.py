"""The attention grid: the twins' cores (``*_core``) against each framework's own attention
(``*_peer``) and a plain matmul-softmax-matmul (``*_naive``) on (B, H, L, D), forward and
forward+backward, causal and not (``run_block``, one block of rows; ``add_ratios``); each
framework's matmul ceiling (``ceiling``); the three target ratios (``targets``); and
grouped-query attention (``run_gqa``: H query heads read Hkv key and value heads)."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_attn
import torch_attn
from golden.bench.grid import Grid, Shape
from golden.bench.timing import MIN_REPEATS, STEADY_S, _call, measure, xla_memory

__all__ = ["IMPLS", "OURS", "ATTENTION", "framework", "build", "make_inputs", "random_qkv",
           "CEILING_CALL_S", "ceiling", "run_block", "add_ratios", "predicted_backward_s",
           "TARGETS", "targets", "GQA_IMPLS", "run_gqa"]


IMPLS = ("jax_core", "jax_peer", "jax_naive", "torch_core", "torch_peer", "torch_naive")
OURS = ("jax_core", "torch_core")


# --- implementations: f(q, k, v, *, is_causal), all (B, H, L, D) except jax_peer ----------------

def _jax_peer(q, k, v, *, is_causal):
    """jax.nn.dot_product_attention; takes (B, L, H, D), transposed outside the timed region."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)


def _jax_naive(q, k, v, *, is_causal):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], dtype=bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def _torch_naive(q, k, v, *, is_causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


ATTENTION = {
    "jax_core": jax_attn.scaled_dot_product_attention,  # jitted inside
    "jax_peer": _jax_peer,
    "jax_naive": _jax_naive,
    "torch_core": torch_attn.scaled_dot_product_attention,
    "torch_peer": torch.nn.functional.scaled_dot_product_attention,
    "torch_naive": _torch_naive,
}


def framework(impl: str) -> str:
    return impl.split("_")[0]


def build(impl: str, causal: bool, backward: bool):
    """The callable to time, f(q, k, v), and the jitted function behind it (JAX) or None."""
    f = partial(ATTENTION[impl], is_causal=causal)
    if framework(impl) == "jax":
        if backward:
            grad = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))
            return grad, grad
        jitted = jax.jit(f)
        return (f if impl == "jax_core" else jitted), jitted
    if backward:
        return (lambda q, k, v: torch.autograd.grad(f(q, k, v).sum(), (q, k, v))), None

    def forward(q, k, v):
        with torch.no_grad():
            return f(q, k, v)
    return forward, None


def make_inputs(shape: Shape, dtype: str, impl: str, backward: bool, host: list[np.ndarray]):
    """q, k, v for impl from the float32 NumPy arrays ``host`` (created outside any timing)."""
    if impl == "jax_peer":
        host = [a.transpose(0, 2, 1, 3) for a in host]  # (B, L, H, D)
    if framework(impl) == "jax":
        return [jax.block_until_ready(jnp.asarray(a, dtype=dtype)) for a in host]
    torch_dtype = getattr(torch, dtype)
    return [torch.from_numpy(a).to(torch_dtype).requires_grad_(backward) for a in host]


def random_qkv(shape: Shape, rng: np.random.Generator) -> list[np.ndarray]:
    B, H, D = shape.B, shape.H, shape.D
    return [rng.standard_normal((B, H, L, D), dtype=np.float32)
            for L in (shape.Lq, shape.Lk, shape.Lk)]


# The longest a ceiling's product may be predicted to take: 64 times the time of a product a
# quarter the size, which for a small product is mostly a call's overhead (16 ms for torch
# at n = 64 to 512 with the other core busy), hence seconds, not one.
CEILING_CALL_S = 4.0


def ceiling(fw: str, n: int, dtype: str, repeats: int, rng) -> dict:
    """GFLOP/s of an (n, n) @ (n, n) product: the framework's practical ceiling on this CPU.
    Where one product at n is predicted to take more than CEILING_CALL_S (from a product of a
    quarter the size), n is halved until it is not: torch's bfloat16 product ran at 0.3-0.8
    GFLOP/s on a CPU without AVX512_BF16, up to a minute a call at n = 2048 (there n = 1024,
    2.6 s a call; the row says the n used)."""
    while n > 64 and _matmul_s(fw, n // 4, dtype, rng) * 64 > CEILING_CALL_S:
        n //= 2
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    fn, args = _matmul(fw, a, b, dtype)
    with torch.no_grad():
        m = measure(fn, args, repeats)
    return {"framework": fw, "dtype": dtype, "n": n, **m,
            "gflop_s": 2 * n**3 / (m["median_ms"] * 1e-3) / 1e9}


def _matmul(fw, a, b, dtype):
    """(the framework's product, its two arguments) for NumPy float32 a, b at ``dtype``."""
    if fw == "jax":
        return jax.jit(jnp.matmul), [jax.block_until_ready(jnp.asarray(x, dtype=dtype))
                                     for x in (a, b)]
    return torch.matmul, [torch.from_numpy(x).to(getattr(torch, dtype)) for x in (a, b)]


def _matmul_s(fw, n, dtype, rng) -> float:
    """Seconds of one steady (n, n) @ (n, n) product (after a first call)."""
    fn, args = _matmul(fw, *(rng.standard_normal((n, n), dtype=np.float32) for _ in range(2)),
                       dtype)
    with torch.no_grad():
        _call(fn, args)
        return _call(fn, args)


def run_block(shape, dtype, causal, backward, host, grid, ceilings,
              steady_s: float = STEADY_S) -> list[dict]:
    """Every implementation on one (shape, dtype, causal, pass), each measured with about
    ``steady_s`` of steady calls (at least MIN_REPEATS, at most grid.repeats)."""
    rows = []
    for impl in IMPLS:
        fn, jitted = build(impl, causal, backward)
        args = make_inputs(shape, dtype, impl, backward, host)
        m = measure(fn, args, grid.repeats, steady_s)
        flops = shape.flops(causal, backward)
        gflop_s = flops / (m["median_ms"] * 1e-3) / 1e9
        row = {"shape": shape.name, **asdict(shape), "dtype": dtype, "causal": causal,
               "pass": "fwd+bwd" if backward else "fwd", "impl": impl,
               "framework": framework(impl), "gflop": flops / 1e9, "gflop_s": gflop_s,
               "pct_ceiling": 100 * gflop_s / ceilings[framework(impl), dtype]["gflop_s"], **m,
               "xla_memory": xla_memory(jitted, args) if jitted is not None else None}
        if framework(impl) == "torch":
            row["compile_ms"] = None  # no compilation; first_call_ms keeps the warm-up cost
        rows.append(row)
        print(f"  {shape.name} {dtype} causal={causal} {row['pass']:7} {impl:11} "
              f"{m['median_ms']:9.2f} ms ×{m['repeats']}", file=sys.stderr, flush=True)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """row[f"{ours}_speedup"] = time(row) / time(ours) in the same block; > 1: ours is faster."""
    blocks = {}
    for r in rows:
        blocks.setdefault((r["shape"], r["dtype"], r["causal"], r["pass"]), {})[r["impl"]] = r
    for block in blocks.values():
        for r in block.values():
            for ours in OURS:
                r[f"{ours}_speedup"] = r["median_ms"] / block[ours]["median_ms"]


def predicted_backward_s(rows: list[dict], shape: Shape) -> float:
    """Forward+backward cost of a shape from its float32 forward medians: 3.5× each, for the
    first call and MIN_REPEATS steady calls, plus one call of margin."""
    fwd = [r["median_ms"] * 1e-3 for r in rows
           if r["shape"] == shape.name and r["pass"] == "fwd" and r["dtype"] == "float32"]
    return sum(fwd) * 3.5 * (MIN_REPEATS + 2)


TARGETS = (  # name, numerator impl, denominator impl, target: time(numerator) / time(denominator)
    ("jax_core vs jax_peer (jax_peer time / jax_core time)", "jax_peer", "jax_core", 1.5),
    ("jax_core vs torch_peer (torch_peer time / jax_core time)", "torch_peer", "jax_core", 0.5),
    ("torch_core vs torch_peer (torch_peer time / torch_core time)", "torch_peer", "torch_core",
     1 / 1.2),
)


def targets(rows: list[dict], shape: Shape) -> list[dict]:
    """The three target ratios at ``shape``, float32 forward non-causal."""
    at = {r["impl"]: r for r in rows if r["shape"] == shape.name
          and r["dtype"] == "float32" and r["pass"] == "fwd" and not r["causal"]}
    out = []
    for name, num, den, target in TARGETS:
        measured = num in at and den in at
        ratio = at[num]["median_ms"] / at[den]["median_ms"] if measured else None
        others = [at[i]["other_cpu_pct"] for i in (num, den) if i in at]
        out.append({"name": name, "shape": shape.name, "ratio": ratio, "target": target,
                    "met": None if ratio is None else ratio >= target,
                    "other_cpu_pct": max((o for o in others if o is not None), default=None)})
    return out


# --- grouped-query attention: H query heads read Hkv key/value heads ---------------------------

GQA_IMPLS = {  # impl: f(q, k, v, *, is_causal) on (B, H|Hkv, L, D), jax_peer on (B, L, H|Hkv, D)
    "jax_core": jax_attn.scaled_dot_product_attention,
    "jax_peer": _jax_peer,
    "torch_core": torch_attn.scaled_dot_product_attention,
    "torch_peer": partial(torch.nn.functional.scaled_dot_product_attention, enable_gqa=True),
}


def run_gqa(grid: Grid, rng) -> list[dict]:
    """Float32 forward of each GQA implementation on the same q (B, H, L, D) and k, v
    (B, Hkv, L, D), causal and not; ratios against jax_core and torch_core."""
    b, h, hkv, length, d = grid.gqa
    host = [rng.standard_normal((b, n, length, d), dtype=np.float32) for n in (h, hkv, hkv)]
    shape, rows = f"B={b},H={h},Hkv={hkv},L={length},D={d}", []
    for causal in (False, True):
        block = {}
        for impl, f in GQA_IMPLS.items():
            fw, fn = framework(impl), partial(f, is_causal=causal)
            arrays = [a.transpose(0, 2, 1, 3) for a in host] if impl == "jax_peer" else host
            if fw == "jax":
                args = [jax.block_until_ready(jnp.asarray(a)) for a in arrays]
                fn = fn if impl == "jax_core" else jax.jit(fn)
            else:
                args = [torch.from_numpy(a) for a in arrays]
            with torch.no_grad():
                m = measure(fn, args, grid.repeats)
            block[impl] = {"impl": impl, "framework": fw, "shape": shape, "causal": causal, **m}
            print(f"  gqa {shape} causal={causal} {impl:11} {m['median_ms']:9.2f} ms "
                  f"×{m['repeats']}", file=sys.stderr, flush=True)
        for r in block.values():
            for ours in OURS:
                r[f"{ours}_speedup"] = r["median_ms"] / block[ours]["median_ms"]
        rows += block.values()
    return rows
