"""The timing phase of ``attn-parity device-check``, in one process: every cell of a
``plan.TimingGrid``, the JAX core (``implementation=None`` and each named implementation the
registry does not refuse), ``jax.nn.dot_product_attention(implementation="cudnn")`` and torch's
``scaled_dot_product_attention`` under ``sdpa_kernel`` (flash, cuDNN). ``run_timing`` never
raises for a cell: a refusal, a memory skip, a cell past the budget and an error are rows with
their reason.

How a cell is timed (``measure``): JAX's program traced (``record()`` names what
``implementation=None`` ran) and compiled ahead of time, the compile timed apart; torch's first
call timed apart; then a warm call, and samples of k back-to-back calls ended by one
synchronisation (``jax.block_until_ready``, ``torch.cuda.synchronize``), k chosen so that a
sample lasts about SAMPLE_S (a launch's overhead is then a small part), as many samples as fit
the cell's steady time (at least SAMPLES_LEAST, 2 for a call of SLOW_S or more, at most
SAMPLES_MOST; fewer, down to one, where they would run past the budget); the cell's time is
the median sample ÷ k.

Shape legend: B batch, H heads, L sequence length, D head width; JAX's and torch's arrays are
(B, H, L, D), jax.nn's (B, L, H, D), transposed once outside the timing.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from functools import partial

from golden.device_check.plan import (
    FLOPS_CONVENTION,
    MEMORY_FRACTION,
    SLOW_COMPILE,
    Cell,
    TimingGrid,
    flops,
    gib,
    memory_bytes,
    memory_skip,
)

__all__ = ["SAMPLE_S", "INNER_MOST", "SAMPLES_LEAST", "SAMPLES_MOST", "SLOW_S", "CELL_OVERHEAD_S",
           "measure", "run_timing", "time_cell", "markdown"]

SAMPLE_S = 0.005  # a sample of k calls lasts about this long
INNER_MOST = 50  # k at most
SAMPLES_LEAST = 3
SAMPLES_MOST = 20
SLOW_S = 1.0  # a call this long or longer takes 2 samples, not 3
CELL_OVERHEAD_S = 1.5  # a cell's cost besides its steady calls (tracing, compiling, first call)


def _timed(call, sync) -> float:
    start = time.perf_counter()
    sync(call())
    return time.perf_counter() - start


def measure(call, sync, steady_s: float, deadline: float | None = None) -> dict:
    """A first call and a warm one, then samples of k back-to-back calls, each sample ended
    by ``sync(result)``; the median and least sample ÷ k, in ms. Fewer samples (one at least)
    where the least would run past ``deadline`` (a time.perf_counter() value)."""
    first = _timed(call, sync)
    warm = _timed(call, sync)
    inner = max(1, min(INNER_MOST, math.ceil(SAMPLE_S / max(warm, 1e-9))))
    least = 2 if warm >= SLOW_S else SAMPLES_LEAST
    count = max(least, min(SAMPLES_MOST, round(steady_s / max(warm * inner, 1e-9))))
    if deadline is not None:
        count = max(1, min(count, int((deadline - time.perf_counter()) / (warm * inner))))
    times = []
    for _ in range(count):
        start = time.perf_counter()
        for _ in range(inner):
            result = call()
        sync(result)
        times.append((time.perf_counter() - start) / inner)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "samples": count, "calls_per_sample": inner, "first_call_ms": first * 1e3,
            "warm_call_ms": warm * 1e3}


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


# ---- JAX ----------------------------------------------------------------------------------------

def _jax_inputs(grid: TimingGrid, length: int, seed: int) -> dict:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (grid.batch, grid.heads, length, grid.width)  # (B, H, L, D)
    qkv = tuple(jax.random.normal(k, shape, jnp.dtype(grid.dtype)) for k in keys)
    moved = tuple(jnp.swapaxes(x, 1, 2) for x in qkv)  # (B, L, H, D) for jax.nn
    return {"jax": jax.block_until_ready(qkv), "jax.nn": jax.block_until_ready(moved)}


def _jax_function(cell: Cell):
    """The jitted call: forward, or the gradient of sum(output) (in float32) w.r.t. q, k, v."""
    import jax
    import jax.numpy as jnp

    import jax_attn

    if cell.impl.framework == "jax":
        f = partial(jax_attn.scaled_dot_product_attention, is_causal=cell.causal,
                    implementation=cell.impl.name)
    else:
        f = partial(jax.nn.dot_product_attention, is_causal=cell.causal,
                    implementation=cell.impl.name)
    if cell.backward:
        return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))
    return jax.jit(f)


def _jax_refusal(cell: Cell, grid: TimingGrid, platform: str) -> str | None:
    """The registry's reason why a named implementation cannot run the cell (None: it can)."""
    if cell.impl.framework != "jax" or cell.impl.name is None:
        return None
    from golden.specification.implementations import Asked
    from jax_attn import IMPLEMENTATIONS

    asked = Asked(platform=platform, dtype=grid.dtype, lengths=(cell.length, cell.length),
                  widths=(grid.width, grid.width), heads=(grid.heads, grid.heads),
                  causal=cell.causal, gradients=cell.backward)
    return IMPLEMENTATIONS.refuses(cell.impl.name, asked)


def _jax_free() -> int | None:
    """Bytes JAX can still allocate on its first device (None where it does not say: a CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without the call
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def _jax_cell(cell, grid, inputs, row, steady_s, platform, deadline):
    import jax

    from golden.specification.implementations import names, record

    reason = _jax_refusal(cell, grid, platform)
    if reason:
        return {**row, "status": "refused", "reason": reason}
    slow = SLOW_COMPILE.get((cell.impl.name, cell.backward))
    if slow is not None and cell.length >= slow and platform == "gpu":
        return {**row, "status": "skipped",
                "reason": f"its compile at L ≥ {slow} takes minutes (SLOW_COMPILE)"}
    args = inputs[cell.impl.framework]
    try:
        with record() as ran:
            lowered = _jax_function(cell).lower(*args)  # traced: what None chose is recorded
    except ValueError as e:
        if "cannot run this call" in str(e):
            return {**row, "status": "refused", "reason": str(e)}
        raise
    row["ran"] = names(ran) or None
    kinds = [name for _, name in ran] or [cell.impl.name]
    needed = max(memory_bytes(kind, grid.batch, grid.heads, cell.length, grid.width,
                              backward=cell.backward) for kind in kinds)
    skip = _memory_row(row, needed, _jax_free())
    if skip:
        return skip
    start = time.perf_counter()
    compiled = lowered.compile()
    row["compile_s"] = time.perf_counter() - start
    return {**row, **measure(lambda: compiled(*args), jax.block_until_ready, steady_s,
                             deadline)}


def _memory_row(row, needed, free):
    """Fill in the row's memory figures; the skipped row when the cell does not fit, else None."""
    row["memory_estimate_gib"] = gib(needed)
    row["free_gib"] = None if free is None else gib(free)
    reason = memory_skip(needed, free)
    return {**row, "status": "skipped", "reason": reason} if reason else None


# ---- torch --------------------------------------------------------------------------------------

def _torch_inputs(torch, grid: TimingGrid, length: int, seed: int, device) -> tuple:
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (grid.batch, grid.heads, length, grid.width)  # (B, H, L, D)
    dtype = getattr(torch, grid.dtype)
    return tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype)
                 .requires_grad_(True) for _ in range(3))


def _torch_free(torch, device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}  # torch's SDPBackend names
# How torch says that the back end it was held to cannot take the call (its warnings say why).
NO_KERNEL = ("No available kernel", "No viable backend")


def _torch_call(torch, cell: Cell, qkv):
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, is_causal=cell.causal)
    if cell.backward:
        return lambda: torch.autograd.grad(sdpa(*qkv).float().sum(), qkv)

    def forward():
        with torch.no_grad():
            return sdpa(*qkv)
    return forward


def _torch_cell(torch, cell, grid, qkv, row, steady_s, device, deadline):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    needed = memory_bytes(cell.impl.name, grid.batch, grid.heads, cell.length, grid.width,
                          backward=cell.backward)
    skip = _memory_row(row, needed, _torch_free(torch, device))
    if skip:
        return skip
    backend = getattr(SDPBackend, BACKENDS[cell.impl.name])
    sync = (lambda result: torch.cuda.synchronize(device)) if device.type == "cuda" else (
        lambda result: None)
    try:
        with sdpa_kernel(backend), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                measured = measure(_torch_call(torch, cell, qkv), sync, steady_s, deadline)
            except RuntimeError as e:
                if not any(x in str(e) for x in NO_KERNEL):
                    raise
                why = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
                return {**row, "status": "refused", "reason": f"{_reason(e)} ({why})"[:1000]}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # give JAX's next cells the memory back
    compile_ms = max(0.0, measured["first_call_ms"] - measured["median_ms"])
    return {**row, **measured, "compile_s": compile_ms / 1e3}


def _torch(device_kind: str):
    """(torch, its device, None), or (None, None, the reason torch cannot run here)."""
    try:
        import torch
    except ImportError as e:
        return None, None, f"torch is not importable: {_reason(e)}"
    if device_kind == "gpu":
        if not torch.cuda.is_available():
            return None, None, "torch sees no CUDA device"
        return torch, torch.device("cuda", 0), None
    return torch, torch.device("cpu"), None


# ---- the grid -----------------------------------------------------------------------------------

def _row(cell: Cell, grid: TimingGrid) -> dict:
    return {"cell": cell.label, "L": cell.length, "causal": cell.causal, "pass": cell.pass_name,
            "impl": cell.impl.label, "framework": cell.impl.framework, "status": None,
            "reason": None, "ran": None, "median_ms": None, "min_ms": None, "samples": None,
            "calls_per_sample": None, "first_call_ms": None, "compile_s": None,
            "memory_estimate_gib": None, "free_gib": None,
            "flops": flops(grid.batch, grid.heads, cell.length, grid.width, causal=cell.causal,
                           backward=cell.backward), "tflops": None, "vs_none": None}


def time_cell(cell: Cell, grid: TimingGrid, inputs: dict, *, steady_s: float, platform: str,
              torch=None, device=None, no_torch: str = "torch is not loaded",
              deadline: float | None = None) -> dict:
    """One cell's row; every failure is the row's status and reason ("refused", "skipped",
    "error"), never raised (a KeyboardInterrupt aside). A torch cell needs ``torch`` and its
    ``device``; without them it is skipped, ``no_torch`` its reason."""
    row = _row(cell, grid)
    try:
        if cell.impl.framework == "torch":
            if torch is None:
                return {**row, "status": "skipped", "reason": no_torch}
            done = _torch_cell(torch, cell, grid, inputs["torch"], row, steady_s, device,
                               deadline)
        else:
            done = _jax_cell(cell, grid, inputs, row, steady_s, platform, deadline)
    except Exception as e:  # noqa: BLE001 - one cell never ends the run
        return {**row, "status": "error", "reason": _reason(e)}
    if done.get("status") is None:
        done["status"] = "timed"
        done["tflops"] = done["flops"] / (done["median_ms"] / 1e3) / 1e12
    return done


def _group_ratios(rows: list[dict]) -> None:
    """vs_none = implementation=None's time ÷ this row's, in each (L, causal, pass) group
    (> 1: faster than None)."""
    for r in rows:
        if r["status"] != "timed":
            continue
        none = next((x for x in rows if x["impl"] == "jax None" and x["status"] == "timed"
                     and (x["L"], x["causal"], x["pass"]) == (r["L"], r["causal"], r["pass"])),
                    None)
        r["vs_none"] = None if none is None else none["median_ms"] / r["median_ms"]


def run_timing(grid: TimingGrid, *, deadline: float, log=print, save=None, device="gpu",
               seed: int = 0) -> dict:
    """Every cell of ``grid`` in order until ``deadline`` (a time.perf_counter() value); cells
    after it are skipped with the reason. ``device``: "gpu" (torch on CUDA) or "cpu" (the
    tests' tiny grids). ``save(report)`` is called after every cell (the files stay current
    if the run is stopped). Returns the report: the grid, the conventions, the rows, counts."""
    import jax

    torch, torch_device, no_torch = _torch(device)
    platform = jax.default_backend()
    report = {"grid": {"shape": grid.shape, "batch": grid.batch, "heads": grid.heads,
                       "width": grid.width, "lengths": list(grid.lengths), "dtype": grid.dtype,
                       "steady_s": grid.steady_s},
              "flops_convention": FLOPS_CONVENTION, "memory_fraction": MEMORY_FRACTION,
              "vs_none": "implementation=None's time ÷ this row's (> 1: faster than None)",
              "platform": platform, "torch": None if torch is None else torch.__version__,
              "rows": []}
    if torch is None:
        log(f"  timing: torch cells skipped: {no_torch}")
    cells = grid.cells()
    inputs, length, failed = None, None, None
    for i, cell in enumerate(cells):
        now = time.perf_counter()
        if now > deadline:
            row = {**_row(cell, grid), "status": "skipped",
                   "reason": "past the run's budget (--budget)"}
        else:
            if cell.length != length:
                inputs, length = None, cell.length  # the last length's arrays freed first
                try:
                    inputs, failed = _inputs(grid, cell.length, seed, torch, torch_device), None
                except Exception as e:  # noqa: BLE001 - this length's cells say why
                    failed = f"making the inputs: {_reason(e)}"
            steady = min(grid.steady_s, max(0.0, (deadline - now) / (len(cells) - i)
                                             - CELL_OVERHEAD_S))
            row = {**_row(cell, grid), "status": "error", "reason": failed} if failed else (
                time_cell(cell, grid, inputs, steady_s=steady, platform=platform, torch=torch,
                          device=torch_device, no_torch=no_torch, deadline=deadline))
        report["rows"].append(row)
        _group_ratios(report["rows"])
        log(f"  [{i + 1}/{len(cells)}] {_line(row)}")
        if save is not None:
            save(report)
    report["counts"] = {s: sum(r["status"] == s for r in report["rows"])
                        for s in ("timed", "refused", "skipped", "error")}
    return report


def _inputs(grid, length, seed, torch, device) -> dict:
    inputs = _jax_inputs(grid, length, seed)
    if torch is not None:
        inputs["torch"] = _torch_inputs(torch, grid, length, seed, device)
    return inputs


def _line(row: dict) -> str:
    if row["status"] == "timed":
        ran = f" (ran {row['ran']})" if row["impl"] == "jax None" else ""
        return (f"{row['cell']:40} {row['median_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s, "
                f"compile {row['compile_s']:.2f} s{ran}")
    return f"{row['cell']:40} {row['status']}: {row['reason']}"


# ---- the table ----------------------------------------------------------------------------------

def _cell(text, most=160) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= most else text[:most - 1] + "…"


def markdown(report: dict, device_name: str = "") -> str:
    """timing.md: the conventions, then one row per cell."""
    g = report["grid"]
    lines = [f"# Attention timing on {device_name or report['platform']}", "",
             f"- Inputs (B, H, L, D) = ({g['batch']}, {g['heads']}, L, {g['width']}), "
             f"{g['dtype']}, self-attention (Lq = Lk = L); fwd+bwd: the gradient of "
             "sum(output) (float32) w.r.t. q, k, v.",
             f"- ms: median over samples of back-to-back calls ended by one synchronisation "
             f"(compile and first call excluded; `compile s`: JAX's ahead-of-time compile, "
             f"torch's first call − median).",
             f"- TFLOP/s: {report['flops_convention']}.",
             f"- None ÷ this: {report['vs_none']}.",
             f"- Skipped: a memory estimate above {report['memory_fraction']:.0%} of the free "
             f"device memory, or past the run's budget.", "",
             "| L | causal | pass | implementation | ms | TFLOP/s | None ÷ this | compile s "
             "| note |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in report["rows"]:
        timed = r["status"] == "timed"
        note = (f"ran {r['ran']}" if timed and r["impl"] == "jax None" and r["ran"] else
                "" if timed else f"{r['status']}: {r['reason']}")
        lines.append(
            f"| {r['L']} | {'yes' if r['causal'] else 'no'} | {r['pass']} | {r['impl']} | "
            f"{_num(r['median_ms'], '{:.3f}')} | {_num(r['tflops'], '{:.1f}')} | "
            f"{_num(r['vs_none'], '{:.2f}')} | {_num(r['compile_s'], '{:.2f}')} | "
            f"{_cell(note)} |")
    return "\n".join(lines) + "\n"


def _num(x, fmt) -> str:
    return "—" if x is None else fmt.format(x)
