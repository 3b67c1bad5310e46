"""Gated delta-rule linear attention (Qwen3-Next's, Qwen3.5's): our chunked cores against
transformers' own ``torch_chunk_gated_delta_rule``, forward and forward+backward, the decode step
against its ``torch_recurrent_gated_delta_rule``, and the peak memory of each against L
(``run_linear``, ``linear_markdown``; ``attn-parity bench --only linear``).

The contenders, each on the same float32 inputs: q and k L2-normalised (q also scaled by
Dk^−1/2 for ours, which take it so; Hugging Face's function scales inside), v, the log-decay g
≤ 0 one per head, β ∈ (0, 1):
    jax_chunked    jax_attn.delta_rule.gated_delta_rule(implementation="chunked"), one jitted
                   program at precision HIGHEST (the forward; the forward+backward is the jitted
                   gradient of sum(o) with respect to q, k, v, g and β)
    torch_chunked  torch_attn.recurrent.gated_delta_rule(implementation="chunked"), eager
    hf_chunked     transformers' torch_chunk_gated_delta_rule (chunks of 64), eager: the peer
and for the decode step (one token from a state (B, H, Dk, Dv)):
    jax_recurrent  gated_delta_rule(implementation="recurrent") at L = 1, jitted
    torch_recurrent, hf_recurrent (torch_recurrent_gated_delta_rule)
torch's calls run under no_grad for the forward; forward+backward is torch autograd's backward
of sum(o). The calls one row compares are interleaved round by round (``interleaved``).
peak MiB: the growth of the process's peak resident memory over one call (VmHWM after the
kernel's counter is reset), every contender alike; XLA's own figure for the JAX program (its
temporary buffers, from the compiled program's memory analysis) beside it. On a machine where
torch sees a CUDA GPU (the device check's), torch's tensors live on it, each torch call ends
with torch.cuda.synchronize(), and torch's peak is torch.cuda.max_memory_allocated's growth over
the call (JAX's there: XLA's figure alone).

Shape legend: B batch, H value heads (= key heads here), D = Dk = Dv head width, L tokens.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from golden.bench.cells import _f, _ms
from golden.bench.grid import Grid
from golden.bench.positions import interleaved
from golden.bench.timing import _call, peak_rss_call, xla_memory

__all__ = ["LINEAR_PARTS", "PEER", "linear_inputs", "linear_calls", "run_linear",
           "linear_markdown"]

LINEAR_PARTS = ("forward", "forward+backward", "decode")
PEER = {"forward": "hf_chunked", "forward+backward": "hf_chunked", "decode": "hf_recurrent"}
PRECISION = jax.lax.Precision.HIGHEST  # the JAX core's own, stated


def _hf():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    return hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule


def linear_inputs(rng, b: int, h: int, length: int, d: int) -> dict:
    """float32 (B, H, L, …) arrays: q, k unit vectors, v, g = −0.1·|N(0, 1)|, β = σ(N(0, 1)),
    and a state (B, H, D, D) for the decode step."""
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (unit(rng.standard_normal((b, h, length, d))) for _ in range(2))
    arrays = dict(q=q, k=k, v=rng.standard_normal((b, h, length, d)),
                  g=-0.1 * np.abs(rng.standard_normal((b, h, length))),
                  beta=1 / (1 + np.exp(-rng.standard_normal((b, h, length)))),
                  state=0.1 * rng.standard_normal((b, h, d, d)))
    return {name: a.astype(np.float32) for name, a in arrays.items()}


def _jax(part: str):
    """The jitted JAX call of ``part`` on (q·Dk^−1/2, k, v, g, β[, state])."""
    from jax_attn.delta_rule import gated_delta_rule
    if part == "forward":
        return jax.jit(lambda q, k, v, g, b: gated_delta_rule(
            q, k, v, g, b, implementation="chunked")[0])
    if part == "forward+backward":
        return jax.jit(jax.grad(lambda q, k, v, g, b: gated_delta_rule(
            q, k, v, g, b, implementation="chunked")[0].sum(), argnums=(0, 1, 2, 3, 4)))
    return jax.jit(lambda q, k, v, g, b, s: gated_delta_rule(
        q, k, v, g, b, initial_state=s, implementation="recurrent"))


@functools.cache
def _device() -> str:
    """Where torch's tensors go, asked once (every timed call's synchronisation reads it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if _device() == "cuda":
        torch.cuda.synchronize()


def _tensors(arrays) -> list:
    return [torch.from_numpy(a).to(_device()) for a in arrays]


def _torch(fn, backward: bool):
    """fn(*tensors) under no_grad, or the backward of sum(its output) through fresh leaves;
    either waits for a GPU to finish."""
    if not backward:
        def forward(*a):
            with torch.no_grad():
                out = fn(*a)
            _sync()
            return out
        return forward

    def forward_backward(*a):
        leaves = [t.detach().requires_grad_() for t in a]
        fn(*leaves).sum().backward()
        _sync()
        return [t.grad for t in leaves]
    return forward_backward


def linear_calls(part: str, arrays: dict) -> dict:
    """{contender: (f, args)} of ``part`` on ``arrays`` (linear_inputs'; decode reads the first
    token and the state)."""
    from torch_attn.recurrent import gated_delta_rule as ours
    hf_chunk, hf_recurrent = _hf()
    d = arrays["q"].shape[-1]
    token = slice(0, 1) if part == "decode" else slice(None)
    ours_in = [arrays["q"][:, :, token] * np.float32(d ** -0.5)] + [
        arrays[n][:, :, token] for n in ("k", "v", "g", "beta")]
    # Hugging Face's layout (B, L, H, …), q unscaled (its function scales by Dk^−1/2).
    hf_in = [np.ascontiguousarray(np.swapaxes(arrays[n][:, :, token], 1, 2))
             for n in ("q", "k", "v", "g", "beta")]
    if part == "decode":
        state = arrays["state"]
        return {
            "jax_recurrent": (_jax(part), [jnp.asarray(a) for a in ours_in + [state]]),
            "torch_recurrent": (_torch(lambda *a: ours(*a[:5], initial_state=a[5],
                                                       implementation="recurrent")[0], False),
                                _tensors(ours_in + [state])),
            "hf_recurrent": (_torch(lambda *a: hf_recurrent(*a[:5], initial_state=a[5],
                                                            output_final_state=True)[0], False),
                             _tensors(hf_in + [state]))}
    backward = part == "forward+backward"
    return {
        "jax_chunked": (_jax(part), [jnp.asarray(a) for a in ours_in]),
        "torch_chunked": (_torch(lambda *a: ours(*a, implementation="chunked")[0], backward),
                          _tensors(ours_in)),
        "hf_chunked": (_torch(lambda *a: hf_chunk(*a)[0], backward),
                       _tensors(hf_in))}


def _peak_mib(impl, fn, args) -> float | None:
    """The growth of the peak resident memory over one call of fn, in MiB (None: the kernel's
    counter cannot be reset here); on a GPU torch's allocator's peak growth (JAX's: None)."""
    if _device() == "cuda":
        if impl.startswith("jax"):
            return None
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _call(fn, args)
        return (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    return peak_rss_call(fn, args)[0]


def _cells(grid: Grid):
    """(part, B, H, L, D) of every row: per batch size the forward at each of its lengths, the
    forward+backward at those up to its longest backward, one decode step (grid.linear)."""
    h, d, batches = grid.linear
    for b, lengths, longest_backward in batches:
        for length in lengths:
            yield "forward", b, h, length, d
            if length <= longest_backward:
                yield "forward+backward", b, h, length, d
        yield "decode", b, h, 1, d


def _output(impl: str, out) -> np.ndarray:
    """A forward or decode call's output o as float64 (B, H, L, D) (Hugging Face's is (B, L, H,
    D); JAX's decode step returns (o, state))."""
    out = out[0] if isinstance(out, tuple) else out
    o = np.asarray(out.cpu() if isinstance(out, torch.Tensor) else out, dtype=np.float64)
    return np.swapaxes(o, 1, 2) if impl.startswith("hf") else o


def run_linear(grid: Grid, rng) -> list[dict]:
    """One row per contender and cell (``_cells``): the interleaved timing, the peak memory of
    one more call, XLA's temporary bytes for the JAX programs, peer_ratio = the peer's
    (``PEER``) median ÷ this row's (above 1: faster than transformers' function), and for the
    forward and decode rows diff_vs_peer = max |o − o_peer| ÷ max |o_peer| (the same function
    computed: float32's rounding only)."""
    rows = []
    for part, b, h, length, d in _cells(grid):
        arrays = linear_inputs(rng, b, h, max(length, 1), d)
        calls = linear_calls(part, arrays)
        measured = interleaved(calls, grid.repeats)
        outputs = {} if part == "forward+backward" else {
            impl: _output(impl, fn(*args)) for impl, (fn, args) in calls.items()}
        for impl, (fn, args) in calls.items():
            m = measured[impl]
            diff = None
            if outputs:
                peer = outputs[PEER[part]]
                diff = float(np.abs(outputs[impl] - peer).max() / np.abs(peer).max())
            row = {"part": part, "B": b, "H": h, "L": length, "D": d, "impl": impl, **m,
                   "peak_mib": _peak_mib(impl, fn, args), "xla_temp_mib": None,
                   "diff_vs_peer": diff}
            if impl.startswith("jax"):
                stats = xla_memory(fn, args)
                if stats is not None:
                    row["xla_temp_mib"] = stats["temp_size_in_bytes"] / 2 ** 20
            rows.append(row)
            print(f"  linear {part:16} B={b} L={length:6} {impl:16} {m['median_ms']:10.1f} ms "
                  f"×{m['repeats']}", file=sys.stderr, flush=True)
    for r in rows:
        peer = next(s for s in rows if s["impl"] == PEER[r["part"]] and all(
            s[f] == r[f] for f in ("part", "B", "H", "L", "D")))
        r["peer_ratio"] = peer["median_ms"] / r["median_ms"]
    return rows


def _growth(mib):
    """A peak's growth as the table writes it: a fall of the resident memory (the allocator
    returned pages during the call) is no growth."""
    return None if mib is None else max(mib, 0.0)


def linear_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "", "## Gated delta-rule linear attention (float32): our cores against transformers'",
        "",
        "- jax_chunked: jax_attn's chunked core, one jitted program (precision HIGHEST); "
        "torch_chunked: torch_attn's, eager; hf_chunked: transformers' "
        "torch_chunk_gated_delta_rule (the peer). decode: one token from a state, the "
        "recurrent cores against transformers' torch_recurrent_gated_delta_rule. "
        "forward+backward: the gradient of sum(o) with respect to q, k, v, g and β.",
        "- ms: median (min–max) of the steady calls, the row's contenders called in turn, "
        "round by round. ÷ peer: the peer's median ÷ this one's (above 1: faster). peak MiB: "
        "the growth of the process's peak resident memory over one call; XLA MiB: the JAX "
        "program's temporary buffers by XLA's memory analysis. others %: the share of the "
        "cores other processes kept busy. Δ peer: max |o − o_peer| ÷ max |o_peer| of the "
        "forward and decode rows (the same function in float32).", "",
        "| part | B | H | L | D | contender | ms | n | ÷ peer | peak MiB | XLA MiB | Δ peer "
        "| others % |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |"]
    for r in rows:
        span = f"{_ms(r['median_ms'])} ({_ms(min(r['times_ms']))}–{_ms(max(r['times_ms']))})"
        lines.append(
            f"| {r['part']} | {r['B']} | {r['H']} | {r['L']} | {r['D']} | {r['impl']} | {span} "
            f"| {r['repeats']} | {r['peer_ratio']:.2f} | {_f(_growth(r['peak_mib']), '{:.0f}')} "
            f"| {_f(r['xla_temp_mib'], '{:.0f}')} | {_f(r['diff_vs_peer'], '{:.1e}')} "
            f"| {_f(r['other_cpu_pct'], '{:.0f}')} |")
    return lines
