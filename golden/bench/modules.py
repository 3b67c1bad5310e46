"""The attention modules, timed as their users call them: small modules called eagerly (ours
against Flax's and torch's own, ``run_modules``); KV-cache decoding with the twin
``GroupedQueryAttention`` modules, a prefill and one decode step, JAX against torch
(``run_decode``, and its target ``decode_target``); the decode step with each option of 2025–26
decoders (``run_decode_features``); and ``MultiHeadLatentAttention``'s decode step against
GQA's (``run_latent_decode``)."""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import jax_attn
import torch_attn
from golden.bench.attention import framework
from golden.bench.cells import _f
from golden.bench.grid import Grid
from golden.bench.timing import measure

__all__ = ["SHORT_CALL_REPEATS", "MODULE_X", "MODULES", "build_module", "run_modules",
           "DECODE_IMPLS", "DECODE_TARGET", "decode_modules", "donated_step", "decode_calls",
           "run_decode", "decode_features", "run_decode_features", "decode_features_markdown",
           "decode_target", "latent_config", "latent_models", "run_latent_decode",
           "latent_decode_markdown"]


SHORT_CALL_REPEATS = 100  # a decode step (< 1 ms) gets this many × the repeats, STEADY_S caps it


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
