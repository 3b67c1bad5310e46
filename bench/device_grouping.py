"""The chunked gated delta rule's chunk grouping on an accelerator (issue 43): all chunks side by
side (group None, what jax_attn.delta_rule.chunks_at_once picks off a CPU) against one chunk at
a time (group 1, the CPU's choice), forward and forward+backward, B 1, H 16, D 128, float32,
L 4096 and 16384; min of the timed calls after a compile. Writes JSON rows to argv[1].

    PYTHONPATH=. python bench/device_grouping.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn import delta_rule


def _inputs(length, heads=16, d=128, seed=0):
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((1, heads, length, d))) * d ** -0.5
    k = unit(rng.standard_normal((1, heads, length, d)))
    v = rng.standard_normal((1, heads, length, d))
    g = -0.1 * np.abs(rng.standard_normal((1, heads, length)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((1, heads, length))))
    state = np.zeros((1, heads, d, d))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state)]


def _timed(fn, args, calls=5):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def markdown(rows) -> list[str]:
    """The table docs/performance.md shows of ``rows`` (main's): each part and L, both
    groupings' min ms and one at a time ÷ all at once."""
    t = {(r["part"], r["L"], r["group"]): r["ms"] for r in rows if "ms" in r}
    lines = ["| part | L | all chunks at once (ms) | one chunk at a time (ms) | ratio |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for length in sorted({r["L"] for r in rows}):
        for part in ("forward", "forward+backward"):
            both, one = t[(part, length, None)], t[(part, length, 1)]
            lines.append(f"| {part} | {length} | {both:.2f} | {one:.2f} | {one / both:.1f} |")
    return lines


def main(path):
    rows = []
    for length in (4096, 16384):
        args = _inputs(length)
        outs = {}
        for group in (None, 1):
            def forward(*a, group=group):
                return delta_rule._core_jit(*a, implementation="chunked", chunk_size=64,
                                            group=group)[0]
            both = jax.jit(jax.grad(lambda *a, group=group: forward(*a, group=group).sum(),
                                    argnums=(0, 1, 2, 3, 4)))
            outs[group] = np.asarray(forward(*args))
            for part, fn in (("forward", jax.jit(forward)), ("forward+backward", both)):
                rows.append(dict(part=part, L=length, group=group, ms=_timed(fn, args),
                                 device=str(jax.devices()[0])))
                print(rows[-1], flush=True)
        diff = float(np.abs(outs[None] - outs[1]).max() / np.abs(outs[None]).max())
        rows.append(dict(part="agreement", L=length, rel_max_diff=diff))
        print(rows[-1], flush=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
