"""Timing a call: ``measure`` (a first call, then ``steady_repeats`` steady ones, the last with
its peak RSS growth), ``measure_long`` (a fixed number of calls of seconds each), the share of
the cores other processes kept busy meanwhile (``other_cpu``), and XLA's memory analysis of a
compiled program (``xla_memory``). Every section times through these."""

from __future__ import annotations

import os
import statistics
import time

import jax

__all__ = ["STEADY_S", "MIN_REPEATS", "SLOW_CALL_S", "SLOW_REPEATS", "other_cpu", "steady_repeats",
           "measure", "xla_memory", "measure_long", "peak_rss_call"]


STEADY_S = 0.5  # aim for about this much steady-state time per measurement (at least 3 calls)
MIN_REPEATS = 3
# A steady call of a second or more is measured SLOW_REPEATS times, not MIN_REPEATS: on a 2-core
# host without AVX-512 the grid's calls of 1-4 s (L = 2048 forward+backward, bfloat16 naive
# torch) took 44 s of its 300 s budget in their third calls, and such a call varies by about
# 10 % between runs, more than a third call narrows.
SLOW_CALL_S = 1.0
SLOW_REPEATS = 2


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


def peak_rss_call(fn, args):
    """(the growth of the process's peak resident memory over one call of fn in MiB, or None
    where the kernel's counter cannot be reset; the call's seconds, as ``_call`` times it; its
    result)."""
    reset = _reset_peak_rss()
    before = _status_kb("VmRSS") if reset else None
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    seconds = time.perf_counter() - start
    return (_status_kb("VmHWM") - before) / 1024 if reset else None, seconds, out


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
    rss, last, _ = peak_rss_call(fn, args)
    times.append(last)
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


def measure_long(fn, args, steady: int) -> dict:
    """A first call (compilation, warm-up), then ``steady`` calls, the last with its peak RSS
    growth: calls of seconds each, too slow for measure's three steady calls at 64k."""
    first = _call(fn, args)
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    times = [_call(fn, args) for _ in range(steady - 1)]
    rss, last, _ = peak_rss_call(fn, args)
    times.append(last)
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "min_ms": min(times) * 1e3, "repeats": len(times),
            "times_ms": [t * 1e3 for t in times], "first_call_ms": first * 1e3,
            "rss_peak_growth_mb": rss,
            "other_cpu_pct": other_cpu(cpu_start, time.perf_counter() - wall_start)}
