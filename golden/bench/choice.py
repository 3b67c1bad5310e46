"""The automatic choice: the JAX core with ``implementation=None`` beside each named
implementation at every float32 grid row, their calls interleaved, and which one None ran
(``run_choice``, ``choice_markdown``; ``python -m golden.bench --only choice``)."""

from __future__ import annotations

import statistics
import sys
from functools import partial

import jax
import jax.numpy as jnp

import jax_attn
from golden.bench.attention import random_qkv
from golden.bench.cells import _ms
from golden.bench.grid import Grid
from golden.bench.timing import MIN_REPEATS, _call
from golden.specification.implementations import record

__all__ = ["CHOICE_IMPLS", "CHOICE_ROUNDS", "CHOICE_NOISE", "choice_call", "run_choice",
           "choice_markdown"]


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
