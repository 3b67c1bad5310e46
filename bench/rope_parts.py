"""Where a multi-axis RoPE's time goes in JAX (issue 41): the pieces of jax_attn.rotary_embedding
for the towers of ``python -m golden.bench --only positions``, each jitted alone.

Not wired into the package or the bench; run from the repository root with PYTHONPATH=$PWD:

    python bench/rope_parts.py
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python bench/rope_parts.py  # no YNN fusions

Per tower and encoding: ``rope q,k`` (the section's rope row: q and k rotated in one program),
``gathers`` (golden.specification.positions.rope_cos_sin: cos and sin of every axis from the
tables), ``mix`` (mix_axes: each pair's axis picked by the JAX twin's chain of selects, on the
gathered cos and sin; a one-hot product summed over the axes before 2026-11-27's change, when
XLA gave that multiply-reduce to its slow YNNPACK fusion) and, for comparison, ``select`` (the
same picks by jnp.choose: the same values, checked), and whether XLA put the mix in a YNNPACK
fusion (``__ynn_fusion`` in the compiled HLO). Median and min of 15 steady calls after one, in ms.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_attn
from jax_attn import rotary as jax_rotary
from golden.bench import FULL, PLAIN, position_encodings
from golden.specification import positions
from golden.specification.validate import rope_arguments, rope_settings


def timed(fn, *args, n=15) -> str:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return f"{statistics.median(times):.2f} (min {min(times):.2f})"


def parts(tower: str, rng) -> None:
    _, options, encodings = position_encodings(FULL)[tower]
    b, length = encodings[PLAIN][1].shape
    dh = options["head_dim"]
    q, k = (jnp.asarray(rng.standard_normal((b, n, length, dh), dtype=np.float32))
            for n in (options["num_heads"], options["num_kv_heads"]))
    for name, (rope, host) in encodings.items():
        settings = rope_settings(rope.get("rope_theta"), rope.get("rope_parameters"), 1.0, "exact")
        arguments, p = rope_arguments(settings), jnp.asarray(host, dtype=jnp.int32)
        tables = [jnp.asarray(t, jnp.float32) for t in positions.settings_tables(settings, dh,
                                                                                 length)]
        axes = positions.rope_axes(settings, dh)
        rope_qk = jax.jit(lambda q, k, p: [jax_attn.rotary_embedding(
            t, positions=p, max_position=length, **arguments) for t in (q, k)])
        gathers = jax.jit(lambda p: positions.rope_cos_sin(tables, p[..., None, :]))
        found = {"rope q,k": timed(rope_qk, q, k, p), "gathers": timed(gathers, p)}
        if axes is not None:
            cos_sin = jax.block_until_ready(gathers(p))  # (A, B, 1, L, rd/2) each
            mix = jax.jit(lambda c, s: [positions.mix_axes(v, axes, jax_rotary._select)
                                        for v in (c, s)])  # the JAX twin's selects
            select = jax.jit(lambda c, s: [jnp.choose(jnp.broadcast_to(
                jnp.asarray(axes), v.shape[1:]), list(v), mode="clip") for v in (c, s)])
            assert all(bool(jnp.array_equal(a, b)) for a, b in zip(mix(*cos_sin),
                                                                   select(*cos_sin)))
            hlo = mix.lower(*cos_sin).compile().as_text()
            found |= {"mix": timed(mix, *cos_sin), "select": timed(select, *cos_sin),
                      "mix in a YNN fusion": "__ynn_fusion" in hlo}
        print(f"{tower} {name}: " + "; ".join(f"{n} {v}" for n, v in found.items()), flush=True)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for tower in ("vision", "text"):
        parts(tower, rng)
