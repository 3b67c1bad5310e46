"""Attention benchmark on CPU: the twins (``jax_core``, ``torch_core``) against each framework's own
attention (``*_peer``) and a plain matmul-softmax-matmul (``*_naive``), forward and
forward+backward (gradient of sum(output) w.r.t. q, k, v), causal and not; eager calls of
small attention modules (ours against Flax's and torch's own, ``*_module``); grouped-query
attention; and KV-cache decoding with the twin ``GroupedQueryAttention`` modules (a prefill and
one decode step, JAX against torch).

    attn-parity bench [--quick] [--out DIR] [--repeats N] [--budget S] [--only SECTION]
    (or python -m golden.bench ...)

Run it from the repository root: DIR defaults to bench/results under the current directory.
Writes DIR/latest.md (Markdown tables) and DIR/latest.json (every raw number), each atomically,
and prints the Markdown to stdout; progress goes to stderr. Nothing here sets environment
variables or thread counts: the run measures the machine as configured. To measure an older
instruction set on a newer CPU, set XLA_FLAGS=--xla_cpu_max_isa=AVX2, ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2 and NPY_DISABLE_CPU_FEATURES before the
run (ATEN_CPU_CAPABILITY caps only ATen's own kernels: torch's matrix products run in MKL and
oneDNN, which the other two cap; the run refuses the first without them: ``emulation_gap``);
every report (and --only section) opens with the CPU, its instruction set and the one XLA,
torch and NumPy each used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import jax_attn
import torch_attn
from golden.fixture import write_atomic
from golden.implementations import record

IMPLS = ("jax_core", "jax_peer", "jax_naive", "torch_core", "torch_peer", "torch_naive")
OURS = ("jax_core", "torch_core")
STEADY_S = 0.5  # aim for about this much steady-state time per measurement (at least 3 calls)
MIN_REPEATS = 3
# A steady call of a second or more is measured SLOW_REPEATS times, not MIN_REPEATS: on a 2-core
# host without AVX-512 the grid's calls of 1-4 s (L = 2048 forward+backward, bfloat16 naive
# torch) took 44 s of its 300 s budget in their third calls, and such a call varies by about
# 10 % between runs, more than a third call narrows.
SLOW_CALL_S = 1.0
SLOW_REPEATS = 2
SHORT_CALL_REPEATS = 100  # a decode step (< 1 ms) gets this many × the repeats, STEADY_S caps it
NOISY_PCT = 10.0  # other processes using more of the cores than this: flag a target as unreliable


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    Lq: int
    Lk: int
    D: int

    @property
    def name(self) -> str:
        length = f"L={self.Lq}" if self.Lq == self.Lk else f"Lq={self.Lq},Lk={self.Lk}"
        return f"B={self.B},H={self.H},{length},D={self.D}"

    def flops(self, causal: bool, backward: bool) -> float:
        """4·B·H·Lq·Lk·D forward, halved when causal; forward+backward is 3.5× forward."""
        forward = 4 * self.B * self.H * self.Lq * self.Lk * self.D / (2 if causal else 1)
        return forward * (3.5 if backward else 1.0)


@dataclass(frozen=True)
class Grid:
    shapes: tuple[Shape, ...]
    bf16_shape: Shape  # the one shape also run in bfloat16 (forward only); also the target shape
    matmul_n: int      # ceiling: (n, n) @ (n, n)
    repeats: int       # most steady calls per measurement
    budget_s: float    # the attention grid's wall time (from the run's start); see run()
    gqa: tuple = (4, 8, 2, 1024, 64)  # B, H, Hkv, L, D of the grouped-query rows
    # B, d_in, H, Hkv, Dh, max_length M, P tokens prefilled (and held by the decode step's cache)
    decode: tuple = (1, 512, 8, 2, 64, 4096, 2048)
    # long sequences, causal: (B, H, D), the lengths L, and the longest L the explicit ones run at
    long: tuple = ((1, 1, 64), (4096, 16384, 65536), 4096)
    # sinks and chunked attention, causal: B, H, L, D, attention_chunk_size
    modern: tuple = (1, 4, 4096, 64, 1024)


def _self(L, B=4, H=8, D=64):
    return Shape(B, H, L, L, D)


# Self-attention smallest first, then cross-attention; the costly L=2048 last, so that the
# budget check paces its forward+backward with everything else already measured.
FULL = Grid(shapes=(_self(128), _self(512), _self(1024), Shape(4, 8, 256, 1024, 64), _self(2048)),
            bf16_shape=_self(1024), matmul_n=2048, repeats=10, budget_s=300.0)
QUICK = Grid(shapes=(_self(64, B=1, H=2, D=16), Shape(1, 2, 32, 64, 16)),
             bf16_shape=_self(64, B=1, H=2, D=16), matmul_n=256, repeats=3, budget_s=60.0,
             gqa=(1, 4, 2, 64, 16), decode=(1, 32, 4, 2, 8, 64, 16),
             long=((1, 1, 16), (256, 512), 256), modern=(1, 2, 256, 16, 64))


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


# --- measuring ---------------------------------------------------------------------------------

def _call(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))  # waits for JAX; passes torch tensors through
    return time.perf_counter() - start


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, including hypervisor steal; of this process)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system


def other_cpu(since: tuple[float, float] | None, wall_s: float) -> float | None:
    """Percent of the machine's cores that other processes kept busy since ``since``; None for
    windows under 0.5 s, too short for the kernel's 10 ms accounting ticks."""
    if since is None or wall_s < 0.5:
        return None
    busy, own = _cpu_seconds()
    other = (busy - since[0]) - (own - since[1])
    return min(100.0, max(0.0, 100 * other / (wall_s * (os.cpu_count() or 1))))


def steady_repeats(first_s: float, steady_s: float, most: int) -> int:
    """How many steady calls a measurement takes, from its first steady call's time
    ``first_s`` (the call before it, compilation or warm-up, is timed apart): enough for about
    ``steady_s`` seconds, never fewer than MIN_REPEATS (SLOW_REPEATS for a call of SLOW_CALL_S
    or more), never more than ``most``. A call of a second or more thus costs SLOW_REPEATS calls
    whatever ``steady_s`` is; ``steady_s`` = 0 (a run short of budget) gives the least
    everywhere."""
    if most < MIN_REPEATS:
        raise ValueError(f"most should be at least MIN_REPEATS = {MIN_REPEATS}, got {most}")
    if first_s < 0 or steady_s < 0:
        raise ValueError(f"first_s and steady_s should be times ≥ 0 s, got {first_s}, {steady_s}")
    least = SLOW_REPEATS if first_s >= SLOW_CALL_S else MIN_REPEATS
    return max(least, min(most, round(steady_s / max(first_s, 1e-9))))


def measure(fn, args, repeats: int, steady_s: float = STEADY_S) -> dict:
    """First call, then steady_repeats(first steady call, steady_s, repeats) steady calls (the
    last with its peak RSS growth); the row records the rule's inputs next to the count."""
    first = _call(fn, args)
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    times = [_call(fn, args)]
    n = steady_repeats(times[0], steady_s, repeats)
    times += [_call(fn, args) for _ in range(n - 2)]
    rss = None
    if _reset_peak_rss():
        before = _status_kb("VmRSS")
        times.append(_call(fn, args))
        rss = (_status_kb("VmHWM") - before) / 1024
    else:
        times.append(_call(fn, args))
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "min_ms": min(times) * 1e3, "repeats": len(times),
            "steady_s": steady_s, "most_repeats": repeats,
            "times_ms": [t * 1e3 for t in times], "first_call_ms": first * 1e3,
            "compile_ms": (first - median) * 1e3, "rss_peak_growth_mb": rss,
            "other_cpu_pct": other_cpu(cpu_start, time.perf_counter() - wall_start)}


def xla_memory(jitted, args) -> dict | None:
    """XLA's memory analysis of the compiled program (JAX only): every *_in_bytes field. The
    compile is a cache hit after the timed calls, so this costs no second compilation."""
    stats = jitted.lower(*args).compile().memory_analysis()
    if stats is None:
        return None
    return {name: getattr(stats, name) for name in dir(stats) if name.endswith("_in_bytes")}


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


# --- module calls: small attention modules, called eagerly the way their users call them --------

MODULE_X = (2, 16, 64)  # (B, L, features) input of every module; 64 -> 64 features, 4 heads
MODULES = {  # impl: our module of the same framework, the denominator of its ratio
    "jax_module": "jax_module", "flax_module": "jax_module",
    "torch_module": "torch_module", "torch_peer_module": "torch_module",
}


def build_module(impl: str):
    """The callable to time, f(x), for x of shape MODULE_X; no dropout anywhere."""
    d, heads = MODULE_X[-1], 4
    if impl == "jax_module":
        module = jax_attn.MultiHeadAttention(d, d, num_heads=heads, rngs=nnx.Rngs(0))
        module.eval()
        return module
    if impl == "flax_module":
        module = nnx.MultiHeadAttention(num_heads=heads, in_features=d, qkv_features=d,
                                        out_features=d, decode=False, rngs=nnx.Rngs(0))
        return partial(nnx.jit(lambda m, x: m(x)), module)
    if impl == "torch_module":
        return torch_attn.MultiHeadAttention(d, d, num_heads=heads).eval()
    peer = torch.nn.MultiheadAttention(d, heads, batch_first=True).eval()
    return lambda x: peer(x, x, x, need_weights=False)[0]


def run_modules(grid: Grid, rng) -> list[dict]:
    """Every module on the same random float32 x; torch under torch.no_grad()."""
    host, rows = rng.standard_normal(MODULE_X, dtype=np.float32), []
    shape = "B={},L={},d={}".format(*MODULE_X)
    for impl, ours in MODULES.items():
        fw = framework(ours)
        x = jax.block_until_ready(jnp.asarray(host)) if fw == "jax" else torch.from_numpy(host)
        with torch.no_grad():
            m = measure(build_module(impl), [x], grid.repeats)
        rows.append({"impl": impl, "framework": fw, "shape": shape, **m})
        if fw == "torch":
            rows[-1]["compile_ms"] = None  # no compilation; first_call_ms keeps the warm-up cost
        print(f"  module {shape} {impl:17} {m['median_ms']:9.2f} ms ×{m['repeats']}",
              file=sys.stderr, flush=True)
    medians = {r["impl"]: r["median_ms"] for r in rows}
    for r in rows:
        r["ours_speedup"] = r["median_ms"] / medians[MODULES[r["impl"]]]
    return rows


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


# --- KV-cache decoding: GroupedQueryAttention, a prefill and one decode step ---------------------

DECODE_IMPLS = ("torch_module", "jax_module", "jax_donated")  # jax_donated: the decode step only
DECODE_TARGET = 1.5  # the JAX module's decode step within this factor of torch's


def decode_modules(grid: Grid):
    """torch's GroupedQueryAttention of ``grid.decode`` (RoPE θ = 10000, causal), in eval mode,
    and its JAX twin built from the same weights."""
    _, d_in, h, hkv, dh, _, _ = grid.decode
    torch_module = torch_attn.GroupedQueryAttention(d_in, h, hkv, head_dim=dh,
                                                    rope_theta=10000.0).eval()
    jax_module = jax_attn.build("grouped_query_attention", torch_module.config,
                                torch_attn.export_params(torch_module))
    jax_module.eval()
    return torch_module, jax_module


def donated_step(module, cache):
    """f(x) -> (output, new cache): one decode step through the caller's own ``nnx.jit`` with
    the cache's key and value donated, so the scatter writes in place. Each call feeds the new
    key and value back with the old lengths: every step writes the same position and sees the
    same tokens. Works on copies; ``cache`` stays valid."""
    def call(m, x, key, value, lengths):
        return m(x, cache=jax_attn.KVCache(key, value, lengths))

    step = nnx.jit(call, donate_argnums=(2, 3), graph=False)
    held = [jnp.copy(cache.key), jnp.copy(cache.value)]

    def f(x):
        out, new = step(module, x, *held, cache.lengths)
        held[:] = new.key, new.value
        return out, new
    return f


def decode_calls(grid: Grid, rng) -> dict:
    """{(phase, impl): (f, args)}, decode steps first. prefill: P random tokens (B, P, d_in) into
    an empty cache of max_length M; decode step: one token (B, 1, d_in) on the cache that the
    prefill filled (once, here, outside any timing), the same cache every call."""
    b, d_in, _, _, _, max_len, held = grid.decode
    prompt, token = (rng.standard_normal((b, n, d_in), dtype=np.float32) for n in (held, 1))
    torch_module, jax_module = decode_modules(grid)
    modules = {"torch_module": (torch_module, torch.from_numpy),
               "jax_module": (jax_module, lambda a: jax.block_until_ready(jnp.asarray(a)))}
    prefill, step, filled = {}, {}, {}
    for impl, (module, to_array) in modules.items():
        x_prompt, x_token = to_array(prompt), to_array(token)
        empty = module.init_cache(b, max_len)
        with torch.no_grad():
            filled[impl] = jax.block_until_ready(module(x_prompt, cache=empty)[1])
        prefill[impl] = partial(module, cache=empty), [x_prompt]
        step[impl] = partial(module, cache=filled[impl]), [x_token]
    step["jax_donated"] = donated_step(jax_module, filled["jax_module"]), step["jax_module"][1]
    return {**{("decode step", i): c for i, c in step.items()},
            **{("prefill", i): c for i, c in prefill.items()}}


def run_decode(grid: Grid, rng) -> list[dict]:
    """Each call of decode_calls timed (its result, output and new cache, waited for and
    discarded); torch under torch.no_grad(); torch_ratio: time ÷ torch_module's, same phase."""
    b, d_in, h, hkv, dh, max_len, held = grid.decode
    shape, rows = f"B={b},d={d_in},H={h},Hkv={hkv},Dh={dh},M={max_len},P={held}", []
    for (phase, impl), (fn, args) in decode_calls(grid, rng).items():
        repeats = grid.repeats * (SHORT_CALL_REPEATS if phase == "decode step" else 1)
        with torch.no_grad():
            m = measure(fn, args, repeats)
        rows.append({"phase": phase, "impl": impl, "framework": framework(impl), "shape": shape,
                     **m})
        if framework(impl) == "torch":
            rows[-1]["compile_ms"] = None  # no compilation; first_call_ms keeps the warm-up cost
        print(f"  decode {shape} {phase:11} {impl:12} {m['median_ms']:9.3f} ms "
              f"×{m['repeats']}", file=sys.stderr, flush=True)
    torch_ms = {r["phase"]: r["median_ms"] for r in rows if r["impl"] == "torch_module"}
    for r in rows:
        r["torch_ratio"] = r["median_ms"] / torch_ms[r["phase"]]
    return rows


# --- the decode step with each option of 2025–26 decoders ---------------------------------------

def decode_features(held: int) -> dict:
    """{feature: GroupedQueryAttention options} for a cache holding ``held`` tokens: each option
    alone (chunks and the window of held / 2 tokens, so that they cut what the step reads)."""
    half = max(held // 2, 1)
    return {
        "plain": {},
        "qk_norm (rms)": dict(qk_norm="rms"),
        "sinks": dict(sinks=True),
        "chunks": dict(attention_chunk_size=half),
        "sliding_window": dict(sliding_window=half),
        "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": half}),
        "yarn, partial 0.5": dict(partial_rotary_factor=0.5, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": half}),
        "temperature": dict(query_temperature={"beta": 0.1, "floor_scale": half, "shift": 1}),
        "output_gate": dict(output_gate=True),
    }


def run_decode_features(grid: Grid, rng) -> list[dict]:
    """One decode step (a token on a cache holding P tokens, as run_decode's) of the module with
    each option of decode_features, torch_module and jax_module; plain_ratio: time ÷ the plain
    module's in the same framework; torch_ratio: time ÷ torch_module's, same option."""
    b, d_in, h, hkv, dh, max_len, held = grid.decode
    shape = f"B={b},d={d_in},H={h},Hkv={hkv},Dh={dh},M={max_len},P={held}"
    prompt, token = (rng.standard_normal((b, n, d_in), dtype=np.float32) for n in (held, 1))
    rows, features = [], decode_features(held)
    # the plain module twice, its first measurement discarded: the process's first decode
    # steps measured here ran 1.5–2× slower (a warm-up the later options did not pay)
    for n, (feature, options) in enumerate([("plain", {})] + list(features.items())):
        torch_module = torch_attn.GroupedQueryAttention(d_in, h, hkv, head_dim=dh,
                                                        rope_theta=10000.0, **options).eval()
        jax_module = jax_attn.build("grouped_query_attention", torch_module.config,
                                    torch_attn.export_params(torch_module))
        jax_module.eval()
        for impl, module, to_array in (
                ("torch_module", torch_module, torch.from_numpy),
                ("jax_module", jax_module, lambda a: jax.block_until_ready(jnp.asarray(a)))):
            with torch.no_grad():
                filled = jax.block_until_ready(
                    module(to_array(prompt), cache=module.init_cache(b, max_len))[1])
                m = measure(partial(module, cache=filled), [to_array(token)],
                            grid.repeats * SHORT_CALL_REPEATS)
            print(f"  decode step {feature:18} {impl:12} {m['median_ms']:9.3f} ms"
                  + (" (warm-up, discarded)" if n == 0 else ""), file=sys.stderr, flush=True)
            if n:
                rows.append({"feature": feature, "impl": impl, "framework": framework(impl),
                             "shape": shape, **m})
    plain = {r["impl"]: r["median_ms"] for r in rows if r["feature"] == "plain"}
    torch_ms = {r["feature"]: r["median_ms"] for r in rows if r["impl"] == "torch_module"}
    for r in rows:
        r["plain_ratio"] = r["median_ms"] / plain[r["impl"]]
        r["torch_ratio"] = r["median_ms"] / torch_ms[r["feature"]]
    return rows


def decode_features_markdown(rows: list[dict]) -> list[str]:
    shape = rows[0]["shape"] if rows else ""
    lines = [
        "", f"## The decode step with each option of 2025–26 decoders ({shape}, float32)", "",
        "- One token on a cache holding P tokens, each option alone (chunks and window: P/2 "
        "tokens). ÷ plain: this row's time ÷ the plain module's, same framework (< 1.1: the "
        "option costs under 10 %). ÷ torch: jax_module's time ÷ torch_module's, same option.", "",
        "| option | impl | median ms | n | ÷ plain | ÷ torch | others % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    return lines + [f"| {r['feature']} | {r['impl']} | {r['median_ms']:.3f} | {r['repeats']} "
                    f"| {r['plain_ratio']:.2f} | {r['torch_ratio']:.2f} "
                    f"| {_f(r['other_cpu_pct'], '{:.0f}')} |" for r in rows]


def decode_target(rows: list[dict]) -> dict:
    """The decode-step target in TARGETS' form: torch time / JAX time ≥ 1 / DECODE_TARGET."""
    at = {r["impl"]: r for r in rows if r["phase"] == "decode step"}
    num, den = at["torch_module"], at["jax_module"]
    ratio, others = num["median_ms"] / den["median_ms"], [num["other_cpu_pct"],
                                                          den["other_cpu_pct"]]
    return {"name": "jax_module decode step vs torch_module (torch_module time / jax_module "
                    "time)", "shape": num["shape"], "ratio": ratio, "target": 1 / DECODE_TARGET,
            "met": ratio >= 1 / DECODE_TARGET,
            "other_cpu_pct": max((o for o in others if o is not None), default=None)}


# --- multi-head latent attention's decode step against GroupedQueryAttention's ------------------

def latent_config(grid: Grid) -> dict:
    """MultiHeadLatentAttention of ``grid.decode``'s width and heads in DeepSeek-V3's proportions
    (kv_lora_rank = 4 · Dn, Dr = Dn / 2, Dv = Dn, with Dn the GQA head width Dh), no q LoRA."""
    _, d_in, h, _, dh, _, _ = grid.decode
    return dict(d_in=d_in, num_heads=h, kv_lora_rank=4 * dh, qk_nope_head_dim=dh,
                qk_rope_head_dim=max(dh // 4 * 2, 2), v_head_dim=dh, rope_theta=10000.0)


def latent_models(grid: Grid) -> list:
    """[(model, torch module, call keywords, cache bytes per token in float32)]: GQA of
    grid.decode, multi-head attention (GQA with Hkv = H), and MLA plain and absorbed (one
    module)."""
    _, d_in, h, hkv, dh, _, _ = grid.decode
    mla = torch_attn.MultiHeadLatentAttention(**latent_config(grid)).eval()
    gqa, mha = (torch_attn.GroupedQueryAttention(d_in, h, n, head_dim=dh, rope_theta=10000.0)
                .eval() for n in (hkv, h))
    latent_bytes = mla.cache_bytes_per_token(torch.float32)
    return [(f"GQA (Hkv = {hkv})", gqa, {}, 2 * hkv * dh * 4),
            (f"MHA (Hkv = {h})", mha, {}, 2 * h * dh * 4),
            ("MLA plain", mla, {"absorb": False}, latent_bytes),
            ("MLA absorbed", mla, {"absorb": True}, latent_bytes)]


def run_latent_decode(grid: Grid, rng) -> list[dict]:
    """One decode step (a token on a cache holding P tokens, as run_decode's) of each of
    latent_models, torch_module and jax_module (built from the same weights); gqa_ratio: time ÷
    the GQA module's, same framework; bytes_ratio: cache bytes per token ÷ GQA's."""
    b, d_in, _, _, _, max_len, held = grid.decode
    c = latent_config(grid)
    shape = (f"B={b},d={d_in},H={c['num_heads']},M={max_len},P={held}; MLA r={c['kv_lora_rank']},"
             f"Dn={c['qk_nope_head_dim']},Dr={c['qk_rope_head_dim']},Dv={c['v_head_dim']}")
    prompt, token = (rng.standard_normal((b, n, d_in), dtype=np.float32) for n in (held, 1))
    models, rows = latent_models(grid), []
    # the first model twice, its first measurement discarded (run_decode_features' warm-up)
    for n, (model, torch_module, kw, per_token) in enumerate(models[:1] + models):
        jax_module = jax_attn.build(torch_module.variant, torch_module.config,
                                    torch_attn.export_params(torch_module))
        jax_module.eval()
        for impl, module, to_array in (
                ("torch_module", torch_module, torch.from_numpy),
                ("jax_module", jax_module, lambda a: jax.block_until_ready(jnp.asarray(a)))):
            with torch.no_grad():
                filled = jax.block_until_ready(
                    module(to_array(prompt), cache=module.init_cache(b, max_len), **kw)[1])
                m = measure(partial(module, cache=filled, **kw), [to_array(token)],
                            grid.repeats * SHORT_CALL_REPEATS)
            print(f"  decode step {model:16} {impl:12} {m['median_ms']:9.3f} ms"
                  + (" (warm-up, discarded)" if n == 0 else ""), file=sys.stderr, flush=True)
            if n:
                rows.append({"model": model, "impl": impl, "framework": framework(impl),
                             "shape": shape, "cache_bytes_per_token": per_token, **m})
    gqa = {r["impl"]: r for r in rows if r["model"] == models[0][0]}
    for r in rows:
        r["gqa_ratio"] = r["median_ms"] / gqa[r["impl"]]["median_ms"]
        r["bytes_ratio"] = r["cache_bytes_per_token"] / gqa[r["impl"]]["cache_bytes_per_token"]
    return rows


def latent_decode_markdown(rows: list[dict]) -> list[str]:
    shape = rows[0]["shape"] if rows else ""
    lines = [
        "", f"## Multi-head latent attention's decode step ({shape}, float32)", "",
        "- One token on a cache holding P tokens. Cache bytes per token and layer (float32); "
        "÷ GQA: this row's time, and its cache bytes, ÷ the GQA module's, same framework. MLA "
        "plain expands the latents through W_kv_b every step; absorbed folds W_kv_b into the "
        "query and the output and attends the latents as one key-value head. Both have Dk ≠ Dv "
        "(Dn + Dr against Dv; r + Dr against r), where torch's automatic core choice, \"fused\" "
        "(F.scaled_dot_product_attention), is far slower on CPU than with Dk = Dv.", "",
        "| model | impl | cache bytes/token | bytes ÷ GQA | median ms | n | ÷ GQA | others % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    return lines + [f"| {r['model']} | {r['impl']} | {r['cache_bytes_per_token']} "
                    f"| {r['bytes_ratio']:.2f} | {r['median_ms']:.3f} | {r['repeats']} "
                    f"| {r['gqa_ratio']:.2f} "
                    f"| {_f(r['other_cpu_pct'], '{:.0f}')} |" for r in rows]


# --- long sequences: the O(L) paths against torch's fused kernel, causal -----------------------

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


def measure_long(fn, args, steady: int) -> dict:
    """A first call (compilation, warm-up), then ``steady`` calls, the last with its peak RSS
    growth: calls of seconds each, too slow for measure's three steady calls at 64k."""
    first = _call(fn, args)
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    times = [_call(fn, args) for _ in range(steady - 1)]
    rss = None
    if _reset_peak_rss():
        before = _status_kb("VmRSS")
        times.append(_call(fn, args))
        rss = (_status_kb("VmHWM") - before) / 1024
    else:
        times.append(_call(fn, args))
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "min_ms": min(times) * 1e3, "repeats": len(times),
            "times_ms": [t * 1e3 for t in times], "first_call_ms": first * 1e3,
            "rss_peak_growth_mb": rss,
            "other_cpu_pct": other_cpu(cpu_start, time.perf_counter() - wall_start)}


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


# --- attention sinks (GPT-OSS) and chunked attention (Llama 4), causal ---------------------------

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
    from golden.decoder import alibi_slopes
    return (alibi_slopes(heads, "bloom")[:, None]
            * np.arange(-length, length + 1)).astype(np.float32)


def _alibi_materialised(q, k):
    """ALiBi's (H, Lq, Lk) float bias m_h · (j − i) formed in the call, as torch users (and
    HF's BLOOM) do; the causal entries −inf for torch_peer's float mask."""
    from golden.decoder import alibi_slopes
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


# --- the automatic choice: implementation=None against each named implementation, per pass -----

CHOICE_IMPLS = (None, "explicit", "blockwise")  # None: what users get, forward and backward
CHOICE_ROUNDS = 5  # steady calls of each, interleaved round by round (3 when a call takes > 1 s)
CHOICE_NOISE = 1.2  # None within this factor of the fastest counts as picking it (see markdown)


def choice_call(implementation, causal: bool, backward: bool):
    """The jitted JAX core, f(q, k, v), with ``implementation``; fwd+bwd: the gradient of
    sum(output) with respect to q, k, v (None's then explicit's forward and blockwise's
    backward, "explicit" JAX's derivative of its own forward)."""
    f = partial(jax_attn.scaled_dot_product_attention, is_causal=causal,
                implementation=implementation)
    if backward:
        return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))
    return jax.jit(f)


def run_choice(grid: Grid, rng) -> list[dict]:
    """Every float32 grid row, forward and forward+backward, causal and not: implementation=None
    and each named implementation, their calls interleaved round by round (so that the
    machine's slow and fast spells fall on all of them); which one None ran (record()), the
    fastest, and None's time ÷ the fastest's."""
    rows = []
    for shape in grid.shapes:
        host = random_qkv(shape, rng)
        args = [jax.block_until_ready(jnp.asarray(a)) for a in host]
        for backward in (False, True):
            for causal in (False, True):
                fns, first, ran = {}, {}, {}
                jax.clear_caches()  # so that None's first call traces (and records) it all
                for impl in CHOICE_IMPLS:
                    fns[impl] = choice_call(impl, causal, backward)
                    with record() as names:
                        first[impl] = _call(fns[impl], args)  # compiles: records the names
                    ran[impl] = "+".join(n for _, n in names)
                slow = max(_call(fn, args) for fn in fns.values()) > 1.0
                times = {impl: [] for impl in CHOICE_IMPLS}
                for _ in range(MIN_REPEATS if slow else CHOICE_ROUNDS):
                    for impl, fn in fns.items():
                        times[impl].append(_call(fn, args))
                medians = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
                fastest = min(medians, key=medians.get)
                row = {"shape": shape.name, "causal": causal,
                       "pass": "fwd+bwd" if backward else "fwd", "none_ran": ran[None],
                       "fastest": str(fastest), "none_over_fastest":
                           medians[None] / medians[fastest],
                       "median_ms": {str(i): m for i, m in medians.items()},
                       "times_ms": {str(i): [x * 1e3 for x in t] for i, t in times.items()},
                       "first_call_ms": {str(i): x * 1e3 for i, x in first.items()}}
                rows.append(row)
                print(f"  choice {shape.name} causal={causal} {row['pass']:7} None ran "
                      f"{row['none_ran']:18} " + " ".join(
                          f"{i}={m:.1f}" for i, m in row["median_ms"].items()),
                      file=sys.stderr, flush=True)
    return rows


def choice_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "", "## The automatic choice (float32, every grid row)", "",
        "- None: `implementation=None`, jitted, as it chooses (\"ran\": the implementations it "
        "recorded; in fwd+bwd explicit+blockwise is explicit's forward differentiated with "
        "blockwise's backward; its causal blockwise runs blocks of 512, the named one 1024). "
        "explicit, blockwise: the named implementations (explicit's "
        "fwd+bwd is JAX's derivative of its forward). Calls interleaved round by round, "
        f"{CHOICE_ROUNDS} steady calls each ({MIN_REPEATS} when a call takes over a second), "
        "after a compiling call and a warm one.",
        f"- None ÷ fastest: ≤ {CHOICE_NOISE} counts as picking the fastest (this machine's "
        "timings swing by more than that between runs: docs/performance.md).", "",
        "| shape | causal | pass | None ran | None ms | explicit ms | blockwise ms "
        "| fastest | None ÷ fastest |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    return lines + [
        f"| {r['shape']} | {'yes' if r['causal'] else 'no'} | {r['pass']} | {r['none_ran']} | "
        + " | ".join(_ms(r["median_ms"][i]) for i in ("None", "explicit", "blockwise"))
        + f" | {r['fastest']} | {r['none_over_fastest']:.2f} |" for r in rows]


def _ms(x: float) -> str:
    """Milliseconds to three significant figures or more (12.3, 1.23, 0.123; 1234)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


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


def run(grid: Grid) -> dict:
    """Every section on ``grid``. The attention grid is paced by ``grid.budget_s``: a
    forward+backward block whose prediction (from the shape's forward times, at MIN_REPEATS
    steady calls) would end the grid past the budget runs every row at the least steady calls
    (steady_s = 0: MIN_REPEATS, SLOW_REPEATS for a call of a second or more) instead of about
    STEADY_S each; no row is ever left out. The budget's notes say which blocks ran so and
    whether the grid ended within it. The ceilings come first (the rows' % of them), the module,
    GQA and decoding sections after the grid, outside its budget."""
    start, rng, rows, notes = time.perf_counter(), np.random.default_rng(), [], []
    info, cpu_start = machine(), _cpu_seconds()
    dtypes = ("float32", "bfloat16")
    ceilings = {(fw, dt): ceiling(fw, grid.matmul_n, dt, grid.repeats, rng)
                for fw in ("jax", "torch") for dt in dtypes}
    for shape in grid.shapes:
        host = random_qkv(shape, rng)  # fresh per shape, shared by every implementation
        for causal in (False, True):
            rows += run_block(shape, "float32", causal, False, host, grid, ceilings)
        if shape == grid.bf16_shape:
            for causal in (False, True):
                rows += run_block(shape, "bfloat16", causal, False, host, grid, ceilings)
        elapsed, predicted = time.perf_counter() - start, predicted_backward_s(rows, shape)
        steady_s = STEADY_S
        if elapsed + predicted > grid.budget_s:
            steady_s = 0.0
            notes.append(f"{shape.name} forward+backward at the least steady calls per row: "
                         f"predicted {predicted:.0f} s from its forward times, after "
                         f"{elapsed:.0f} s elapsed, past the {grid.budget_s:.0f} s budget")
            print("  " + notes[-1], file=sys.stderr, flush=True)
        for causal in (False, True):
            rows += run_block(shape, "float32", causal, True, host, grid, ceilings, steady_s)
    add_ratios(rows)
    grid_s = time.perf_counter() - start
    if grid_s > grid.budget_s:
        notes.append(f"the attention grid took {grid_s:.0f} s, past its {grid.budget_s:.0f} s "
                     f"budget, with every row measured")
    modules = run_modules(grid, rng)  # these sections after the grid, outside its budget
    gqa = run_gqa(grid, rng)
    decode = run_decode(grid, rng)
    choice = run_choice(grid, rng)  # fixed calls per row
    long = run_long(grid, rng)
    modern = run_modern(grid, rng)
    decode_options = run_decode_features(grid, rng)
    latent = run_latent_decode(grid, rng)
    wall_s = time.perf_counter() - start
    return {"machine": info, "other_cpu_pct": other_cpu(cpu_start, wall_s), "grid": asdict(grid),
            "ceilings": list(ceilings.values()), "results": rows, "modules": modules,
            "gqa": gqa, "decode": decode, "choice": choice, "long": long, "modern": modern,
            "decode_features": decode_options, "latent_decode": latent,
            "targets": (targets(rows, grid.bf16_shape) + [decode_target(decode)]
                        + long_targets(long)),
            "budget": {"budget_s": grid.budget_s, "grid_s": grid_s,
                       "within": grid_s <= grid.budget_s, "notes": notes},
            "wall_s": wall_s}


# --- reporting ---------------------------------------------------------------------------------

# XLA's names for x86 instruction sets (the values of --xla_cpu_max_isa), oldest first, each
# with the /proc/cpuinfo flag that says the host has it
XLA_ISAS = (("SSE4_2", "sse4_2"), ("AVX", "avx"), ("AVX2", "avx2"), ("AVX512", "avx512f"),
            ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"), ("AMX", "amx_tile"))
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "asimd", "sve", "sve2")


def cpu_flags() -> set[str]:
    """The first processor's flags (x86 ``flags``, Arm ``Features``) in /proc/cpuinfo; empty
    where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":")[0].strip() in
                         ("flags", "Features")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def xla_max_isa(xla_flags: str | None) -> str | None:
    """The value of --xla_cpu_max_isa in an XLA_FLAGS string (the last one wins), upper case;
    None if not set."""
    value = None
    for flag in (xla_flags or "").split():
        if flag.startswith("--xla_cpu_max_isa="):
            value = flag.split("=", 1)[1].upper()
    return value


def xla_isa(flags: set[str], max_isa: str | None) -> str | None:
    """The newest of XLA_ISAS that XLA's code generation may use: the host's newest (from its
    cpuinfo ``flags``) capped by --xla_cpu_max_isa; None off x86 or for a cap XLA_ISAS does not
    name (XLA_FLAGS, in the report too, then says what was asked)."""
    names = [name for name, _ in XLA_ISAS]
    have = [name for name, flag in XLA_ISAS if flag in flags]
    if not have:
        return None
    if max_isa is None:
        return have[-1]
    if max_isa not in names:
        return None
    return names[min(names.index(have[-1]), names.index(max_isa))]


def numpy_isas() -> tuple[list[str], list[str]]:
    """NumPy's (baseline, dispatched targets in use): the targets it was built for that this
    CPU has and NPY_DISABLE_CPU_FEATURES did not switch off, as np.show_runtime() lists them."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath as umath
    found = umath.__cpu_features__
    return list(umath.__cpu_baseline__), [t for t in umath.__cpu_dispatch__ if found.get(t)]


# What caps torch below the host's instruction set: ATen's vectorised kernels, MKL's BLAS (its
# float32 matmul, which torch's fused CPU attention calls) and oneDNN (its bfloat16 products).
# On an Intel Xeon with AMX (2026-11-26), ATEN_CPU_CAPABILITY=avx2 alone left the float32
# 2048² matmul at AVX-512 speed (62.8 ms; 130.7 ms with MKL_ENABLE_INSTRUCTIONS=AVX2) and made
# the bfloat16 fused kernel fail ("pack_vnni2 is only supported when avx512 is supported")
# until ONEDNN_MAX_CPU_ISA=AVX2 was set too (docs/performance.md).
TORCH_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def emulation_gap(flags: set[str], env) -> str | None:
    """Why an emulated run would measure torch at the wrong instruction set, or None: on a
    host with AVX-512 (cpuinfo ``flags``), ATEN_CPU_CAPABILITY set below it in ``env`` without
    MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA (TORCH_CAPS)."""
    aten = env.get("ATEN_CPU_CAPABILITY")
    if "avx512f" not in flags or aten is None or aten.lower().startswith("avx512"):
        return None
    missing = [name for name in TORCH_CAPS[1:] if not env.get(name)]
    if not missing:
        return None
    return (f"ATEN_CPU_CAPABILITY={aten} caps only ATen's own kernels on this AVX-512 CPU: "
            f"set {' and '.join(f'{name}=AVX2' for name in missing)} too (torch's matrix "
            f"products run in MKL and oneDNN; without them torch keeps its AVX-512 products, "
            f"and on a CPU with AMX its bfloat16 fused attention fails)")


def machine() -> dict:
    """The host and the instruction sets each library uses on it: the CPU's own (its cpuinfo
    flags, in XLA's names), XLA's code generation (capped by XLA_FLAGS=--xla_cpu_max_isa=...),
    torch's ATen kernels (torch.backends.cpu.get_cpu_capability(), capped by
    ATEN_CPU_CAPABILITY) and NumPy's dispatched loops (capped by NPY_DISABLE_CPU_FEATURES), with
    the environment variables as set."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags, xla_flags = cpu_flags(), os.environ.get("XLA_FLAGS")
    baseline, dispatched = numpy_isas()
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_isa": xla_isa(flags, None), "cpu_flags": sorted(flags & set(ISA_FLAGS)),
            "xla_isa": xla_isa(flags, xla_max_isa(xla_flags)),
            "torch_isa": torch.backends.cpu.get_cpu_capability(),
            "numpy_isa": (dispatched or baseline or [None])[-1], "numpy_baseline": baseline,
            "numpy_dispatch": dispatched,
            "XLA_FLAGS": xla_flags, **{name: os.environ.get(name) for name in TORCH_CAPS},
            "NPY_DISABLE_CPU_FEATURES": os.environ.get("NPY_DISABLE_CPU_FEATURES"),
            "torch": torch.__version__, "jax": jax.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "jax_backend": jax.default_backend(),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def machine_markdown(m: dict) -> str:
    """One paragraph: the CPU, its instruction set and each library's, the switches set."""
    switches = "; ".join(f"{k}={m[k]}" for k in ("XLA_FLAGS", *TORCH_CAPS,
                                                   "NPY_DISABLE_CPU_FEATURES",
                                                   "OPENBLAS_CORETYPE") if m.get(k) is not None)
    return (f"Machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}); "
            f"instruction set {_f(m['cpu_isa'], '{}')} (cpuinfo flags: "
            f"{' '.join(m['cpu_flags']) or '—'}); in use: XLA code generation "
            f"{_f(m['xla_isa'], '{}')}, torch {m['torch_isa']}, NumPy {_f(m['numpy_isa'], '{}')}; "
            f"{switches or 'no ISA switches set'}; torch {m['torch']}, jax {m['jax']} "
            f"({m['jax_backend']}), numpy {m['numpy']}, Python {m['python']}; {m['date']}.")


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


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def markdown(report: dict) -> str:
    m, b = report["machine"], report["budget"]
    lines = [
        "# Attention benchmark (CPU)", "",
        machine_markdown(m) + f" Wall time {report['wall_s']:.0f} s (attention grid "
        f"{b['grid_s']:.0f} s of its {b['budget_s']:.0f} s budget); other processes kept "
        f"{_f(report['other_cpu_pct'], '{:.0f}')}% of the cores busy during the run (per "
        "measurement: the others % column; high values mean noisy timings).", "",
        "## Matmul ceiling", "",
        "| framework | dtype | n | median ms | GFLOP/s |", "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {c['framework']} | {c['dtype']} | {c['n']} | {c['median_ms']:.2f} | "
              f"{c['gflop_s']:.1f} |" for c in report["ceilings"]]
    lines += [
        "", "## Attention", "",
        "- **jax_core× / torch_core×: time of this row ÷ time of jax_core / torch_core in the "
        "same block; > 1 means ours is faster than this row.**",
        "- FLOPs: forward 4·B·H·Lq·Lk·D, halved when causal (every implementation still "
        "computes the full score matrix); fwd+bwd (gradient of sum(output) w.r.t. q, k, v) = "
        "3.5 × forward. % ceiling: against the same framework's matmul in the same dtype.",
        f"- bfloat16: forward only, at {Shape(**report['grid']['bf16_shape']).name}.",
        f"- n: steady calls in the median: round({STEADY_S} s ÷ the first steady call), at least "
        f"{MIN_REPEATS} ({SLOW_REPEATS} for a call of {SLOW_CALL_S:g} s or more), at most "
        f"{report['grid']['repeats']}; the least for a block the budget section names. compile "
        "ms (JAX): first call − median (negative = noise).",
        "- peak RSS: growth of the process's resident memory during one steady call (VmHWM after "
        "a reset through /proc/self/clear_refs), every implementation; pages already resident "
        "(buffers reused from earlier calls) do not count.",
        "- XLA temp (JAX): `memory_analysis().temp_size_in_bytes` of the compiled program; the "
        "CPU runtime can allocate outside it (0 for some forwards whose RSS grows by the score "
        "matrix).",
        "- others %: share of the cores other processes kept busy during the steady calls "
        "(— under 0.5 s); above ~10% the row's timing is unreliable.", "",
        "| shape | dtype | causal | pass | impl | median ms | n | GFLOP/s | % ceiling "
        "| jax_core× | torch_core× | compile ms | peak RSS MB | XLA temp MB | others % |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for r in report["results"]:
        xla = r["xla_memory"]["temp_size_in_bytes"] / 2**20 if r["xla_memory"] else None
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['pass']} "
            f"| {r['impl']} | {r['median_ms']:.2f} | {r['repeats']} | {r['gflop_s']:.1f} "
            f"| {r['pct_ceiling']:.0f} | {r['jax_core_speedup']:.2f} "
            f"| {r['torch_core_speedup']:.2f} | {_f(r['compile_ms'], '{:.0f}')} "
            f"| {_f(r['rss_peak_growth_mb'], '{:.0f}')} | {_f(xla, '{:.0f}')} "
            f"| {_f(r['other_cpu_pct'], '{:.0f}')} |")
    lines += [
        "", f"## Module calls ({report['modules'][0]['shape']}, float32, forward)", "",
        "- ours×: time of this row ÷ time of our module in the same framework (jax_module for "
        "flax_module, torch_module for torch_peer_module); > 1 means ours is faster.",
        "- first call ms: includes compilation (JAX) or warm-up (torch).", "",
        "| impl | median ms | n | ours× | first call ms | others % |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {r['impl']} | {r['median_ms']:.3f} | {r['repeats']} | {r['ours_speedup']:.2f} "
              f"| {r['first_call_ms']:.0f} | {_f(r['other_cpu_pct'], '{:.0f}')} |"
              for r in report["modules"]]
    lines += [
        "", f"## Grouped-query attention ({report['gqa'][0]['shape']}, float32, forward)", "",
        "- jax_core× / torch_core×: time of this row ÷ time of ours; > 1 means ours is faster. "
        "torch_peer runs F.scaled_dot_product_attention(enable_gqa=True), jax_peer "
        "jax.nn.dot_product_attention on (B, L, H|Hkv, D).", "",
        "| causal | impl | median ms | n | jax_core× | torch_core× | first call ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {'yes' if r['causal'] else 'no'} | {r['impl']} | {r['median_ms']:.2f} "
              f"| {r['repeats']} | {r['jax_core_speedup']:.2f} | {r['torch_core_speedup']:.2f} "
              f"| {r['first_call_ms']:.0f} |" for r in report["gqa"]]
    d = report["decode"][0]
    lines += [
        "", f"## KV-cache decoding (GroupedQueryAttention, {d['shape']}, float32, RoPE, causal)",
        "",
        "- decode step: one token (B, 1, d) on a cache of max_length M holding P tokens (filled "
        "once by a prefill, outside the timing), called again and again on that same cache, "
        "its new cache discarded; prefill: P tokens into an empty cache. Each call returns "
        "(output, new cache), both waited for; torch under no_grad, JAX's module called eagerly "
        "(one compiled program per call). first call ms: JAX's prefill program was compiled by "
        "the fill, so only the decode steps' include compilation.",
        "- jax_donated: the decode step through the caller's own `nnx.jit(graph=False)` with the "
        "cache's key and value donated (`donate_argnums`), so the new token is written in place; "
        "the new key and value are fed back with the old lengths (the state stays fixed).",
        f"- ÷ torch: time of this row ÷ time of torch_module in the same phase (< 1: faster "
        f"than torch; target for jax_module's decode step: ≤ {DECODE_TARGET}).", "",
        "| phase | impl | median ms | n | ÷ torch | first call ms | others % |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {r['phase']} | {r['impl']} | {r['median_ms']:.3f} | {r['repeats']} "
              f"| {r['torch_ratio']:.2f} | {r['first_call_ms']:.0f} "
              f"| {_f(r['other_cpu_pct'], '{:.0f}')} |" for r in report["decode"]]
    lines += [
        "", "## Long sequences (causal, float32)", "",
        "- torch_peer: `F.scaled_dot_product_attention` (fused; autograd for fwd+bwd); "
        "jax_blockwise, torch_row_chunks: our cores' O(L)-memory implementations (FlashAttention-2 "
        "in JAX, chunks of query rows in torch); *_explicit: `implementation=\"explicit\"` (the "
        "weights formed), only up to the longest L the grid gives them. One first "
        "call (compilation, warm-up), then 2 steady calls (1 at L > 16k); torch's forward under "
        "no_grad. XLA temp MiB: the JAX program's temporary memory (XLA's memory analysis); "
        "torch's is measured in separate processes (docs/core.md), not here.",
        "- ÷ peer: torch_peer's time ÷ this row's (> 1: faster than torch's fused kernel).", "",
        "| L | pass | impl | median ms | n | ÷ peer | XLA temp MiB | first call ms |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {r['L']} | {r['pass']} | {r['impl']} | {r['median_ms']:.1f} | {r['repeats']} "
              f"| {r['peer_ratio']:.2f} | {_f(r['xla_temp_mb'], '{:.0f}')} "
              f"| {r['first_call_ms']:.0f} |" for r in report["long"]]
    lines += choice_markdown(report.get("choice", []))
    lines += modern_markdown(report["modern"])
    lines += decode_features_markdown(report.get("decode_features", []))
    lines += latent_decode_markdown(report.get("latent_decode", []))
    lines += ["", "## Targets (float32; attention non-causal at L=1024, decoding and long "
              "sequences causal)", ""]
    for t in report["targets"]:
        met = {None: "not measured", True: "met", False: "MISSED"}[t["met"]]
        noisy = t["other_cpu_pct"] is not None and t["other_cpu_pct"] > NOISY_PCT
        bound = "≤" if t.get("at_most") else "≥"
        lines.append(f"- {t['shape']}: {t['name']} = {_f(t['ratio'])} "
                     f"(target {bound} {t['target']:.2f}): {met}" + (
                         f" (unreliable: other processes kept {t['other_cpu_pct']:.0f}% of the "
                         "cores busy while it was measured)" if noisy else ""))
    lines += ["", "## Budget", "",
              f"- Every row measured. The attention grid took {b['grid_s']:.0f} s of its "
              f"{b['budget_s']:.0f} s budget" + ("." if b["within"] else " (over).")]
    lines += [f"- {note}" for note in b["notes"]]
    return "\n".join(lines) + "\n"


SECTIONS = {"modern": (run_modern, modern_markdown),  # --only: (run, markdown)
            "choice": (run_choice, choice_markdown),
            "decode_features": (run_decode_features, decode_features_markdown),
            "latent_decode": (run_latent_decode, latent_decode_markdown)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attn-parity bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny grid (for tests), seconds")
    parser.add_argument("--out", type=Path, default=Path("bench", "results"),
                        help="output directory (default: bench/results under the current "
                             "directory; run from the repository root)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="most steady calls per measurement (default 10, quick 3, at "
                             "least 3); slow cases use fewer, down to 3 (2 for a call of a "
                             "second or more)")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="the attention grid's budget in seconds (default 300, quick 60): "
                             "a forward+backward block predicted to end the grid past it runs "
                             "at the least steady calls per row (never skipped)")
    parser.add_argument("--only", choices=tuple(SECTIONS), default=None,
                        help="run one section alone and print it, writing DIR/SECTION.json "
                             "(latest.* untouched): modern = attention sinks and chunked "
                             "attention; choice = implementation=None against each named "
                             "implementation at every float32 grid row; decode_features "
                             "= the decode step with each option of GroupedQueryAttention; "
                             "latent_decode = MultiHeadLatentAttention's decode step (plain, "
                             "absorbed) against GroupedQueryAttention's")
    args = parser.parse_args(argv)
    gap = emulation_gap(cpu_flags(), os.environ)
    if gap is not None:
        parser.error(gap)
    grid = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < MIN_REPEATS:
            parser.error(f"--repeats should be at least {MIN_REPEATS}, got {args.repeats}")
        grid = replace(grid, repeats=args.repeats)
    if args.budget is not None:
        if not args.budget >= 0:
            parser.error(f"--budget should be a time ≥ 0 s, got {args.budget}")
        grid = replace(grid, budget_s=args.budget)
    if args.only is not None:
        run_section, section_markdown = SECTIONS[args.only]
        info, cpu_start, start = machine(), _cpu_seconds(), time.perf_counter()
        rows = run_section(grid, np.random.default_rng())
        section = {"machine": info, "grid": asdict(grid), args.only: rows,
                   "other_cpu_pct": other_cpu(cpu_start, time.perf_counter() - start)}
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / f"{args.only}.json",
                     (json.dumps(section, indent=1) + "\n").encode())
        print("\n".join([machine_markdown(info)] + section_markdown(rows)))
        return 0
    report = run(grid)
    text = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "latest.json", (json.dumps(report, indent=1) + "\n").encode())
    write_atomic(args.out / "latest.md", text.encode())
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
