"""JAX's "sparse" core against dense causal attention on a lent GPU (the device check's sparse
part): the same contenders and selection as ``attn-parity bench --only sparse`` (golden.bench.
sparse: jax_sparse, jax_dense = "blockwise"), plus "cudnn" as the GPU's own dense kernel where
it takes the call, float32 at precision HIGHEST, B = 1, D = 128, k = 2048, heads (H, Hkv) 1/1
and 16/1, L = 8k … 64k; forward and forward+backward (the gradient of sum(o) w.r.t. q, k, v);
median of 5 steady calls after a compiling one, each call ended by block_until_ready. Writes
JSON rows to argv[1] (default sparse_gpu.json) and prints them; a row that fails (memory,
refusal) records its error. Run from the repository root with PYTHONPATH=. (no install)."""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_attn
from golden.bench.sparse import causal_selection

K, D = 2048, 128


def timed(fn, args, repeats=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3), [t * 1e3 for t in times]


def call(impl, part):
    kw = dict(is_causal=True, precision=jax.lax.Precision.HIGHEST, implementation=impl)

    def f(q, k, v, indices):
        extra = dict(key_indices=indices) if impl == "sparse" else {}
        return jax_attn.scaled_dot_product_attention(q, k, v, **kw, **extra)
    if part == "forward+backward":
        return jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)))
    return jax.jit(f)


def main(path="sparse_gpu.json"):
    rng = np.random.default_rng(0)
    rows = []
    for heads in ((1, 1), (16, 1)):
        for length in (8192, 16384, 32768, 65536):
            q = jnp.asarray(rng.standard_normal((1, heads[0], length, D), dtype=np.float32))
            k, v = (jnp.asarray(rng.standard_normal((1, heads[1], length, D),
                                                    dtype=np.float32)) for _ in range(2))
            indices = jnp.asarray(causal_selection(rng, length, K)[None])
            for part in ("forward", "forward+backward"):
                for impl in ("sparse", "blockwise", "cudnn"):
                    row = dict(H=heads[0], Hkv=heads[1], L=length, D=D, k=K, part=part,
                               impl=impl, device=str(jax.devices()[0]))
                    try:
                        row["median_ms"], row["times_ms"] = timed(call(impl, part),
                                                                  (q, k, v, indices))
                    except Exception as e:  # noqa: BLE001  (recorded, the next row runs)
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(path, "w") as f:
                        json.dump(rows, f, indent=1)


def markdown(rows) -> list[str]:
    """The rows as docs/performance.md's table: per heads, L and part, sparse's and blockwise's
    medians and blockwise ÷ sparse (above 1: sparse faster); cuDNN's refusals left out."""
    at = {(r["H"], r["Hkv"], r["L"], r["part"], r["impl"]): r.get("median_ms") for r in rows}
    lines = ["| H/Hkv | L | part | sparse ms | blockwise ms | blockwise ÷ sparse |",
             "| ---: | ---: | --- | ---: | ---: | ---: |"]
    for (h, hkv, length, part, impl), ms in at.items():
        if impl != "sparse" or ms is None:
            continue
        dense = at.get((h, hkv, length, part, "blockwise"))
        ratio = "—" if dense is None else f"{dense / ms:.2f}"
        lines.append(f"| {h}/{hkv} | {length} | {part} | {ms:.1f} | "
                     f"{'—' if dense is None else f'{dense:.1f}'} | {ratio} |")
    return lines


if __name__ == "__main__":
    main(*sys.argv[1:])
