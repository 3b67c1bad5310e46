"""A whole run: every section on one grid, the attention grid paced by its budget, into one
report (``run``: the dict written as DIR/latest.json) and that report as Markdown (``markdown``:
DIR/latest.md)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import numpy as np

from golden.bench.attention import (
    add_ratios,
    ceiling,
    predicted_backward_s,
    random_qkv,
    run_block,
    run_gqa,
    targets,
)
from golden.bench.cells import _f
from golden.bench.choice import choice_markdown, run_choice
from golden.bench.grid import Grid, Shape
from golden.bench.host import machine, machine_markdown
from golden.bench.long import long_targets, run_long
from golden.bench.modern import modern_markdown, run_modern
from golden.bench.modules import (
    DECODE_TARGET,
    decode_features_markdown,
    decode_target,
    latent_decode_markdown,
    run_decode,
    run_decode_features,
    run_latent_decode,
    run_modules,
)
from golden.bench.timing import (
    MIN_REPEATS,
    SLOW_CALL_S,
    SLOW_REPEATS,
    STEADY_S,
    _cpu_seconds,
    other_cpu,
)

__all__ = ["NOISY_PCT", "run", "markdown"]


NOISY_PCT = 10.0  # other processes using more of the cores than this: flag a target as unreliable


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
