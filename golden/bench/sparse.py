"""A given selection (DeepSeek-V3.2's indexer's top-k): the cores' "sparse" implementation, which
gathers only each query row's k chosen keys, against dense causal attention, forward,
forward+backward and the decode step, JAX and torch, with the crossover length and the memory
against L (``run_sparse``, ``sparse_markdown``, ``crossovers``; ``attn-parity bench --only
sparse``, not part of the whole run).

Causal self-attention, float32, q, k, v (B, H, L, D) standard normal; the selection
(``causal_selection``, drawn once per L from a seed of the run's generator, never timed): row
i < k lists 0 … k − 1 (the causal rule leaves all j ≤ i of them), row i ≥ k lists k distinct
keys j ≤ i, one drawn uniformly from each of k equal strata of 0 … i (spread over the row's
past, as a scattered top-k; not uniform over the k-subsets, which the timing does not need).
The contenders of a cell:
    jax_sparse    jax_attn.scaled_dot_product_attention(implementation="sparse", key_indices)
    jax_dense     implementation="blockwise", no selection: the dense peer
    jax_masked    implementation="blockwise" with the selection (the boolean (L, L) mask it
                  stands for, built inside the program): the same function as jax_sparse,
                  run up to the grid's longest masked L (its (L, L) mask: 256 MiB at 16k,
                  4 GiB at 64k), past it skipped with that reason
    torch_sparse  torch_attn.scaled_dot_product_attention(implementation="sparse", key_indices)
    torch_dense   torch.nn.functional.scaled_dot_product_attention(is_causal=True), the kernel
                  the twin's "fused" calls (the twin refuses "fused" under autograd)
every JAX call one jitted program at precision HIGHEST (forward+backward: the jitted gradient of
sum(o) with respect to q, k and v), torch's eager (forward under no_grad; forward+backward
autograd's gradient of sum(o)). The decode step: the last row alone (Lq = 1, query_offset
L − 1, causal) against the L-token cache, the sparse ones with that row's k chosen keys, torch's
dense one non-causal (its causal rule aligns top-left; the last row sees every key anyway).

Budget (the grid's ``sparse`` budget_s, from the section's start): before the grid each
contender of each part and D is called once (after a first, compiling call) at L/8 and k/8
(work 1/64 of the first cell's); a cell's call is predicted from the same contender's last
measured L, or from that calibration, scaled as its work (``WORK``), and a contender whose
predicted calls (``calls_per_row``) would end the section past the budget is skipped, the
prediction in its row. The cells go by part (decode, forward, forward+backward), then L, then
D, so that the cheap rows of every length come first. A row's calls are interleaved round by
round with the cell's other contenders (golden.bench.positions.interleaved).

peak MiB: the growth of the process's peak resident memory over one more call (VmHWM after
the kernel's counter is reset; that call's result is the one compared); XLA MiB: the JAX
program's temporary buffers (its compiled memory analysis). ×2L: this row's memory ÷ the same
contender's at L/2 (L·k grows ×2 per doubling, L² ×4).

Shape legend: B batch, H query heads, Hkv key-value heads (H / Hkv query heads share a kv head
and its selection: Hkv = 1 is DeepSeek-V3.2's sparse attention in its absorbed, MQA form), L
tokens, D head width, k keys chosen per row.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_attn
import torch_attn
from golden.bench.cells import _f, _ms
from golden.bench.grid import Grid
from golden.bench.positions import interleaved
from golden.bench.timing import (
    STEADY_S, _call, peak_rss_call, steady_repeats, xla_memory)

__all__ = ["SPARSE_PARTS", "SPARSE_CONTENDERS", "DENSE", "SAME_SELECTION", "WORK", "calls_per_row",
           "causal_selection", "sparse_calls", "run_sparse", "crossovers", "sparse_markdown"]

SPARSE_PARTS = ("decode", "forward", "forward+backward")
SPARSE_CONTENDERS = ("jax_dense", "jax_sparse", "jax_masked", "torch_dense", "torch_sparse")
DENSE = {"jax": "jax_dense", "torch": "torch_dense"}  # each framework's dense peer
SAME_SELECTION = "jax_masked"  # the dense call of the same function the sparse rows match
PRECISION = jax.lax.Precision.HIGHEST  # the JAX core's default, stated
# A call's work as L^a · k^b: (a, b) per kind of contender and part.
WORK = {"sparse": {"forward": (1, 1), "forward+backward": (1, 1), "decode": (0, 1)},
        "dense": {"forward": (2, 0), "forward+backward": (2, 0), "decode": (1, 0)}}
WORK["masked"] = WORK["dense"]


def calls_per_row(seconds: float, most: int) -> int:
    """The calls a measured row makes of a call of ``seconds``: a first, the steady ones
    (steady_repeats of its own time: interleaved counts the cell's mean call), one for its
    memory and result."""
    return 2 + steady_repeats(seconds, STEADY_S, most)


def _kind(impl: str) -> str:
    return impl.split("_", 1)[1]


def causal_selection(rng, length: int, selected: int) -> np.ndarray:
    """int32 (L, k): row i < k is 0 … k − 1, row i ≥ k one key drawn uniformly from each of the
    k strata [⌊t(i + 1)/k⌋, ⌊(t + 1)(i + 1)/k⌋) of 0 … i, t = 0 … k − 1 (k distinct causal keys,
    increasing, spread over the row's past)."""
    if not 1 <= selected <= length:
        raise ValueError(f"selected should be a k in 1 … L = {length}, got {selected}")
    out = np.empty((length, selected), dtype=np.int32)
    out[:selected] = np.arange(selected, dtype=np.int32)
    step = np.arange(selected + 1, dtype=np.int64)
    for start in range(selected, length, 4096):  # rows by chunks: (rows, k) at a time
        n = np.arange(start, min(start + 4096, length), dtype=np.int64)[:, None] + 1  # i + 1
        bounds = step * n // selected  # (rows, k + 1), strictly increasing as n ≥ k
        width = bounds[:, 1:] - bounds[:, :-1]
        out[start:start + n.shape[0]] = bounds[:, :-1] + np.floor(
            rng.random(width.shape) * width).astype(np.int64)
    return out


def _jax(impl: str, part: str, length: int):
    """The jitted JAX call of ``part`` on (q, k, v[, key_indices])."""
    offset = length - 1 if part == "decode" else None
    kw = dict(is_causal=True, query_offset=offset, precision=PRECISION,
              implementation="sparse" if impl == "jax_sparse" else "blockwise")

    def f(q, k, v, *selection):
        indices = dict(key_indices=selection[0]) if selection else {}
        return jax_attn.scaled_dot_product_attention(q, k, v, **kw, **indices)
    if part == "forward+backward":
        return jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)))
    return jax.jit(f)


def _torch(impl: str, part: str, length: int):
    """torch's call of ``part`` on (q, k, v[, key_indices]): under no_grad, or autograd's
    gradient of sum(o) through fresh leaves."""
    if impl == "torch_sparse":
        offset = length - 1 if part == "decode" else None

        def f(q, k, v, indices):
            return torch_attn.scaled_dot_product_attention(
                q, k, v, is_causal=True, query_offset=offset, key_indices=indices,
                implementation="sparse")
    else:
        def f(q, k, v):  # enable_gqa: H / Hkv query heads on each kv head, not broadcast
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=part != "decode", enable_gqa=q.shape[1] != k.shape[1])
    if part != "forward+backward":
        def forward(*a):
            with torch.no_grad():
                return f(*a)
        return forward

    def forward_backward(q, k, v, *selection):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(f(*leaves, *selection).sum(), leaves)
    return forward_backward


def sparse_calls(part: str, arrays, selection, impls=SPARSE_CONTENDERS) -> dict:
    """{contender: (f, args)} of ``part`` on ``arrays`` (q, k, v float32 (B, H, L, D)) and
    ``selection`` (B, L, k; None where only the dense ones run); the decode step reads q's and
    the selection's last row."""
    q, k, v = arrays
    length = k.shape[-2]
    if part == "decode":
        q = q[..., -1:, :]
        selection = None if selection is None else selection[:, -1:, :]
    calls = {}
    for impl in impls:
        framework = impl.split("_")[0]
        dense = impl.endswith("dense")
        if framework == "jax":
            args = [jnp.asarray(x) for x in (q, k, v)] + (
                [] if dense else [jnp.asarray(selection)])
            calls[impl] = (_jax(impl, part, length), args)
        else:
            args = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)] + (
                [] if dense else [torch.from_numpy(selection.astype(np.int64))])
            calls[impl] = (_torch(impl, part, length), args)
    return calls


def _flat(out) -> np.ndarray:
    """A call's output, or its gradients, as one float64 vector."""
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return np.concatenate([np.asarray(p.detach() if isinstance(p, torch.Tensor) else p,
                                      dtype=np.float64).ravel() for p in parts])


def _inputs(rng, b, heads, length, d, selected, seed, drawn=None, needed=True):
    """Fresh q float32 (B, H, L, D), k, v (B, Hkv, L, D) from rng (``heads`` = (H, Hkv)); the selection (B, L, k) from ``seed`` (the
    same at every part and D of a length), taken from ``drawn`` {(L, seed): selection} when
    there (the last one drawn is kept: 5 s at 64k); None when not ``needed``."""
    q = rng.standard_normal((b, heads[0], length, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, heads[1], length, d), dtype=np.float32) for _ in range(2))
    if not needed:
        return (q, k, v), None
    if drawn is not None and (length, seed) in drawn:
        return (q, k, v), drawn[length, seed]
    draw = np.random.default_rng(seed)
    selection = np.stack([causal_selection(draw, length, selected) for _ in range(b)])
    if drawn is not None:
        drawn.clear()
        drawn[length, seed] = selection
    return (q, k, v), selection


def _calibrate(grid: Grid, rng) -> dict:
    """{(part, (H, Hkv, D), contender): (seconds of one steady call, L, k)} at L/8 and k/8 of
    the grid's first length (a first call apart)."""
    b, heads, dims, lengths, selected, _, _ = grid.sparse
    length, k = max(2, lengths[0] // 8), max(1, selected // 8)
    times = {}
    for h in heads:
        for d in dims:
            arrays, selection = _inputs(rng, b, h, length, d, k, rng.integers(2 ** 32))
            for part in SPARSE_PARTS:
                for impl, (fn, args) in sparse_calls(part, arrays, selection).items():
                    _call(fn, args)
                    times[part, h + (d,), impl] = (_call(fn, args), length, k)
    return times


def _predict(measured, part, shape, impl, length, selected) -> tuple[float, str]:
    """(seconds of one call at L, k; from what) scaled from ``measured``'s entry of the same
    (H, Hkv, D) ``shape``."""
    seconds, at, k = measured[part, shape, impl]
    a, b = WORK[_kind(impl)][part]
    return seconds * (length / at) ** a * (selected / k) ** b, f"L={at},k={k}"


def _cells(grid: Grid):
    _, heads, dims, lengths, _, _, _ = grid.sparse
    return [(part, length, h, d) for part in SPARSE_PARTS for length in lengths for h in heads
            for d in dims]


def run_sparse(grid: Grid, rng) -> list[dict]:
    """One row per cell (``_cells``) and contender: measured (the interleaved timing, peak MiB,
    XLA MiB, diff_vs_masked: max |x − x_masked| ÷ max |x_masked| of the output, or of the
    gradients in a forward+backward row, for the sparse rows where jax_masked ran) or skipped
    (``skipped`` the reason); dense_ratio = the framework's dense median ÷ this row's (above
    1: faster than dense), mem_x2 = this row's memory ÷ its own at L/2 (``_doubling``)."""
    start = time.perf_counter()
    b, _, _, lengths, selected, masked_max, budget = grid.sparse
    measured = _calibrate(grid, rng)
    seeds = dict(zip(lengths, rng.integers(2 ** 32, size=len(lengths))))  # one selection per L
    rows, drawn = [], {}
    for part, length, h, d in _cells(grid):
        head = {"part": part, "B": b, "H": h[0], "Hkv": h[1], "L": length, "D": d,
                "k": selected}
        run, skipped, spent = [], {}, time.perf_counter() - start
        for impl in SPARSE_CONTENDERS:
            seconds, source = _predict(measured, part, h + (d,), impl, length, selected)
            if impl == SAME_SELECTION and length > masked_max:
                skipped[impl] = (f"L > {masked_max}: its (L, L) boolean mask "
                                 f"({length ** 2 / 2 ** 20:.3g} MiB) past the grid's cap")
                continue
            cost = seconds * calls_per_row(seconds, grid.repeats)
            if spent + cost > budget:
                skipped[impl] = (f"budget: {cost:.3g} s predicted ({seconds:.3g} s a call, from "
                                 f"{source}) past the {budget:.0f} s budget at {spent:.0f} s")
            else:
                run.append(impl)
                spent += cost
        arrays, selection = _inputs(rng, b, h, length, d, selected, seeds[length], drawn,
                                    needed=any(not i.endswith("dense") for i in run))
        calls = sparse_calls(part, arrays, selection, run)
        times = interleaved(calls, grid.repeats) if calls else {}
        results = {}
        for impl in SPARSE_CONTENDERS:
            if impl in skipped:
                rows.append({**head, "impl": impl, "skipped": skipped[impl], "median_ms": None})
                print(f"  sparse {part:16} L={length:6} H={h[0]}/{h[1]} D={d:3} {impl:12} "
                      f"skipped: {skipped[impl]}", file=sys.stderr, flush=True)
                continue
            fn, args = calls[impl]
            m = times[impl]
            measured[part, h + (d,), impl] = (m["median_ms"] / 1e3, length, selected)
            peak, _, out = peak_rss_call(fn, args)
            if impl == SAME_SELECTION or _kind(impl) == "sparse":
                results[impl] = _flat(out)
            xla = xla_memory(fn, args) if impl.startswith("jax") else None
            rows.append({**head, "impl": impl, "skipped": None, **m, "peak_mib": peak,
                         "xla_temp_mib": None if xla is None else
                         xla["temp_size_in_bytes"] / 2 ** 20})
            print(f"  sparse {part:16} L={length:6} H={h[0]}/{h[1]} D={d:3} {impl:12} "
                  f"{m['median_ms']:10.1f} ms ×{m['repeats']}", file=sys.stderr, flush=True)
        for r in rows[-len(SPARSE_CONTENDERS):]:
            r["diff_vs_masked"] = None
            if _kind(r["impl"]) == "sparse" and r["impl"] in results and \
                    SAME_SELECTION in results:
                want = results[SAME_SELECTION]
                r["diff_vs_masked"] = float(np.abs(results[r["impl"]] - want).max()
                                            / np.abs(want).max())
    _ratios(rows)
    return rows


def _same(r, s, *fields) -> bool:
    return all(r[f] == s[f] for f in ("part", "B", "H", "Hkv", "D", "k") + fields)


def _ratios(rows) -> None:
    """dense_ratio and mem_x2 (``_doubling``) of every row, None where a term is missing."""
    for r in rows:
        r["dense_ratio"] = r["mem_x2"] = None
        if r["skipped"] is not None:
            continue
        dense = next(s for s in rows if _same(r, s, "L") and s["impl"] == DENSE[
            r["impl"].split("_")[0]])
        if dense["skipped"] is None:
            r["dense_ratio"] = dense["median_ms"] / r["median_ms"]
        r["mem_x2"] = _doubling(rows, r)


def _memory(r):
    """A row's memory figure: XLA's temporary MiB for JAX, the peak growth for torch."""
    return r["xla_temp_mib"] if r["impl"].startswith("jax") else r["peak_mib"]


def _doubling(rows, r):
    """This row's memory ÷ the same contender's at L/2 (None: no such row, or a figure ≤ 0)."""
    half = next((s for s in rows if _same(r, s) and s["impl"] == r["impl"]
                 and s["L"] * 2 == r["L"] and s["skipped"] is None), None)
    if half is None or not _memory(half) or _memory(r) is None or _memory(half) <= 0:
        return None
    return _memory(r) / _memory(half)


def crossovers(rows) -> list[dict]:
    """Per framework, part, heads (H, Hkv) and D: the smallest L of the grid where the sparse
    row's median is below the dense one's (``L`` None: none in the grid), and the lengths where
    both ran."""
    out = []
    keys = sorted({(r["impl"].split("_")[0], r["part"], r["H"], r["Hkv"], r["D"]) for r in rows},
                  key=lambda x: (x[0], SPARSE_PARTS.index(x[1])) + x[2:])
    for framework, part, h, hkv, d in keys:
        pairs = [(r, next(s for s in rows if _same(r, s, "L") and s["impl"] == DENSE[framework]))
                 for r in rows if r["impl"] == f"{framework}_sparse" and r["part"] == part
                 and (r["H"], r["Hkv"], r["D"]) == (h, hkv, d)]
        both = sorted(r["L"] for r, s in pairs if r["skipped"] is None and s["skipped"] is None)
        wins = [r["L"] for r, s in pairs if r["L"] in both and r["median_ms"] < s["median_ms"]]
        out.append({"framework": framework, "part": part, "H": h, "Hkv": hkv, "D": d,
                    "L": min(wins) if wins else None, "compared_at": both})
    return out


def sparse_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "", "## A given selection: sparse against dense causal attention (float32)", "",
        "- jax_sparse, torch_sparse: the cores' implementation=\"sparse\" with key_indices (B, "
        "L, k), each row's k chosen keys among j ≤ i (rows i < k: all of them); jax_dense: "
        "\"blockwise\", causal, no selection; jax_masked: \"blockwise\" with the selection as "
        "its (L, L) mask (the same function as the sparse rows); torch_dense: torch's "
        "scaled_dot_product_attention, causal. JAX jitted (precision HIGHEST), torch eager. "
        "decode: the last row against the L-token cache. forward+backward: the gradient of "
        "sum(o) with respect to q, k and v.",
        "- ms: median (min–max) of the steady calls, a cell's contenders called in turn, round "
        "by round. ÷ dense: the framework's dense median ÷ this one's (above 1: faster than "
        "dense). peak MiB: the process's peak resident memory growth over one call; XLA MiB: "
        "the JAX program's temporary buffers; ×2L: this row's memory (XLA's for JAX, the peak "
        "for torch) ÷ its own at L/2 (L·k: 2; L²: 4). Δ masked: max |x − x_masked| ÷ max "
        "|x_masked| of the output (forward+backward: the gradients). Skipped rows say why.", "",
        "| part | L | H/Hkv | D | k | contender | ms | n | ÷ dense | peak MiB | XLA MiB | ×2L "
        "| Δ masked | others % |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |"]
    for r in rows:
        lead = (f"| {r['part']} | {r['L']} | {r['H']}/{r['Hkv']} | {r['D']} | {r['k']} "
                f"| {r['impl']} |")
        if r["skipped"] is not None:
            lines.append(f"{lead} skipped: {r['skipped']} | | | | | | | |")
            continue
        span = f"{_ms(r['median_ms'])} ({_ms(min(r['times_ms']))}–{_ms(max(r['times_ms']))})"
        lines.append(
            f"{lead} {span} | {r['repeats']} | {_f(r['dense_ratio'])} "
            f"| {_f(r['peak_mib'], '{:.0f}')} | {_f(r['xla_temp_mib'], '{:.0f}')} "
            f"| {_f(r['mem_x2'])} | {_f(r['diff_vs_masked'], '{:.1e}')} "
            f"| {_f(r['other_cpu_pct'], '{:.0f}')} |")
    lines += ["", "- crossover: the smallest L where sparse's median is below dense's, same "
              "framework, part, heads and D (among the lengths where both ran).", "",
              "| framework | part | H/Hkv | D | crossover L | compared at L |",
              "| --- | --- | ---: | ---: | ---: | --- |"]
    for c in crossovers(rows):
        at = ", ".join(map(str, c["compared_at"])) or "none (skipped)"
        lines.append(f"| {c['framework']} | {c['part']} | {c['H']}/{c['Hkv']} | {c['D']} "
                     f"| {c['L'] if c['L'] is not None else 'none in the grid'} | {at} |")
    return lines
