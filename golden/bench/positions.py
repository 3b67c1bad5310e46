"""Positions in more than one dimension: a vision tower's attention layer with axial 2-D RoPE
and a text tower's prefill with multimodal RoPE (MRoPE, chunked and interleaved), each against
the same module with 1-D RoPE, the twin ``GroupedQueryAttention`` modules holding the same
weights (``run_positions``, ``positions_markdown``; ``python -m golden.bench --only
positions``).

Every encoding is timed twice: the layer as its users call it (``module(x, positions=p)``,
forward, float32; torch under no_grad, JAX's call one ``nnx.jit`` program at precision
``PRECISION``), and the encoding alone (``rotary_embedding`` of the layer's q and k with the
module's settings and the module's table bound, JAX's jitted as one program), which says how
much of the layer's time the encoding takes, below the run-to-run noise of the layer itself.
The calls a ratio compares are interleaved round by round (``interleaved``).

Shape legend: B batch, L tokens, d model width, H query heads, Hkv key-value heads, Dh head
width; an image of S × S patches (vision) or tokens (text).
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import jax_attn
import torch_attn
from golden.bench.attention import framework
from golden.bench.cells import _f, _ms
from golden.bench.grid import Grid
from golden.bench.timing import STEADY_S, _call, _cpu_seconds, other_cpu, steady_repeats
from golden.specification.validate import rope_arguments

__all__ = ["PRECISION", "POSITION_IMPLS", "PARTS", "PLAIN", "image_positions",
           "text_positions", "position_encodings", "interleaved", "run_positions",
           "positions_markdown"]


PRECISION = jax.lax.Precision.HIGHEST  # the JAX module's, stated (its default too)
POSITION_IMPLS = ("torch_module", "jax_module")
PARTS = ("layer", "rope")  # the module's call; rotary_embedding of its q and k alone
PLAIN = "1-D"  # every tower's baseline encoding: rope_theta only, positions arange (B, L)
VISION_THETA, TEXT_THETA = 10000.0, 1e6  # Qwen2-VL's vision tower's and text tower's θ


def image_positions(side: int) -> np.ndarray:
    """(2, 1, S²) int64: each patch's row and column, the patches in row-major order."""
    rows, cols = np.divmod(np.arange(side * side), side)
    return np.stack([rows, cols])[:, None]


def text_positions(length: int, side: int) -> np.ndarray:
    """(3, 1, L) int64, as Qwen2-VL's get_rope_index builds them for text, one S × S image at
    one temporal position, text: the first (L − S²) // 2 tokens t = h = w = 0, 1, …; the
    image's tokens t = T0 (the next position), h = T0 + row, w = T0 + column; the text after it
    from max + 1 = T0 + S on, every axis alike."""
    before = (length - side * side) // 2
    after = length - before - side * side
    rows, cols = np.divmod(np.arange(side * side), side)
    text = [np.arange(before), before + side + np.arange(after)]
    axes = [np.full(side * side, before), before + rows, before + cols]  # t, h, w
    return np.stack([np.concatenate([text[0], a, text[1]]) for a in axes])[:, None]


def position_encodings(grid: Grid) -> dict:
    """{tower: (shape name, module keywords, {encoding: (RoPE keywords, positions)})}, the 1-D
    encoding first in each: its positions arange (B, L), passed as the others' are."""
    b, side, d, h, dh = grid.positions_vision
    vision = (f"B={b},L={side * side} ({side}×{side} patches),d={d},H={h},Dh={dh},non-causal",
              dict(d_in=d, num_heads=h, num_kv_heads=h, head_dim=dh, causal=False,
                   qkv_bias=True, out_bias=True), {
                  PLAIN: (dict(rope_theta=VISION_THETA), np.arange(side * side)[None]),
                  "axial": (dict(rope_parameters={"rope_type": "axial",
                                                  "rope_theta": VISION_THETA}),
                            image_positions(side))})
    b, length, d, h, hkv, dh, side, chunked, interleaved = grid.positions_text
    mrope = text_positions(length, side)
    text = (f"B={b},L={length} ({side}×{side} image inside),d={d},H={h},Hkv={hkv},Dh={dh},"
            f"causal", dict(d_in=d, num_heads=h, num_kv_heads=hkv, head_dim=dh), {
                PLAIN: (dict(rope_theta=TEXT_THETA), np.arange(length)[None]),
                f"MRoPE chunked {list(chunked)}": (dict(rope_parameters={
                    "rope_type": "default", "rope_theta": TEXT_THETA,
                    "mrope_section": list(chunked)}), mrope),
                f"MRoPE interleaved {list(interleaved)}": (dict(rope_parameters={
                    "rope_type": "default", "rope_theta": TEXT_THETA,
                    "mrope_section": list(interleaved), "mrope_interleaved": True}), mrope)})
    return {"vision": vision, "text": text}


def _twins(options: dict):
    """torch's GroupedQueryAttention in eval mode and its JAX twin at PRECISION holding the
    same weights."""
    torch_module = torch_attn.GroupedQueryAttention(**options).eval()
    jax_module = jax_attn.GroupedQueryAttention(**torch_module.config, rngs=nnx.Rngs(0),
                                                precision=PRECISION)
    jax_attn.load_params(jax_module, torch_attn.export_params(torch_module))
    jax_module.eval()
    return {"torch_module": torch_module, "jax_module": jax_module}


def _calls(module, impl: str, x, q, k, positions) -> dict:
    """{part: (f, args)}: the layer, module(x, positions=p); the encoding alone, q and k
    rotated as the module rotates them (its settings, the table bound L of a call without a
    cache), JAX's jitted."""
    length, settings = x.shape[1], rope_arguments(module.rotary)
    twin = jax_attn if framework(impl) == "jax" else torch_attn

    def rope(q, k, p):
        return [twin.rotary_embedding(t, interleaved=module.rope_interleaved, positions=p,
                                      max_position=length, **settings) for t in (q, k)]
    return {"layer": (lambda x, p: module(x, positions=p), [x, positions]),
            "rope": (jax.jit(rope) if twin is jax_attn else rope, [q, k, positions])}


def _arrays(impl: str, *host):
    if framework(impl) == "jax":
        return [jax.block_until_ready(jnp.asarray(a)) for a in host]
    return [torch.from_numpy(a) for a in host]


def interleaved(calls: dict, most: int) -> dict:
    """{key: measurement} of ``calls`` {key: (f, args)}: a first call of each (compiling,
    warming up; timed apart), then rounds of one call of each in turn, so that the machine's
    slow and fast spells fall on all of them (as the automatic choice's section does): as many
    rounds as steady_repeats gives the first round's mean call (about STEADY_S of steady calls
    each on average), at most ``most``. others %: over all the rounds."""
    first = {key: _call(fn, args) for key, (fn, args) in calls.items()}
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    times = {key: [_call(fn, args)] for key, (fn, args) in calls.items()}
    rounds = steady_repeats(statistics.mean(t[0] for t in times.values()), STEADY_S, most)
    for _ in range(rounds - 1):
        for key, (fn, args) in calls.items():
            times[key].append(_call(fn, args))
    others = other_cpu(cpu_start, time.perf_counter() - wall_start)
    return {key: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3,
                  "repeats": len(t), "most_repeats": most, "times_ms": [x * 1e3 for x in t],
                  "first_call_ms": first[key] * 1e3, "other_cpu_pct": others}
            for key, t in times.items()}


def run_positions(grid: Grid, rng) -> list[dict]:
    """Each tower's encodings (position_encodings), both twins, the layer and the rope alone, on
    one random float32 x (B, L, d) and q, k per tower, every encoding and twin of a tower's part
    interleaved round by round (``interleaved``); enc_ratio: time ÷ the 1-D encoding's, same
    tower, part and twin; torch_ratio: time ÷ torch_module's, same tower, encoding and part."""
    rows = []
    for tower, (shape, options, encodings) in position_encodings(grid).items():
        b, length = encodings[PLAIN][1].shape  # the 1-D positions (B, L)
        heads, kv, dh = options["num_heads"], options["num_kv_heads"], options["head_dim"]
        x = rng.standard_normal((b, length, options["d_in"]), dtype=np.float32)
        q, k = (rng.standard_normal((b, n, length, dh), dtype=np.float32) for n in (heads, kv))
        calls = {}
        for name, (rope, p) in encodings.items():
            for impl, module in _twins({**options, **rope}).items():
                for part, call in _calls(module, impl, *_arrays(impl, x, q, k, p)).items():
                    calls[part, name, impl] = call
        for part in PARTS:
            with torch.no_grad():
                measured = interleaved({key[1:]: c for key, c in calls.items()
                                        if key[0] == part}, grid.repeats)
            for (name, impl), m in measured.items():
                rows.append({"tower": tower, "shape": shape, "encoding": name, "part": part,
                             "impl": impl, "framework": framework(impl), **m})
                print(f"  positions {tower:6} {part:5} {name:30} {impl:12} "
                      f"{m['median_ms']:9.1f} ms ×{m['repeats']}", file=sys.stderr, flush=True)
    for r in rows:
        same = [s for s in rows if (s["tower"], s["part"]) == (r["tower"], r["part"])]
        plain = next(s for s in same if s["impl"] == r["impl"] and s["encoding"] == PLAIN)
        torch_row = next(s for s in same if s["encoding"] == r["encoding"]
                         and s["impl"] == "torch_module")
        r["enc_ratio"] = r["median_ms"] / plain["median_ms"]
        r["torch_ratio"] = r["median_ms"] / torch_row["median_ms"]
    return rows


def _cell(r: dict) -> str:
    """The median, and min–max of the steady calls, in ms."""
    return f"{_ms(r['median_ms'])} ({_ms(min(r['times_ms']))}–{_ms(max(r['times_ms']))})"


def positions_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "", "## Positions in more than one dimension: MRoPE and axial RoPE (float32, forward)",
        "",
        "- layer: the twin GroupedQueryAttention modules (same weights) called as users call "
        "them, module(x, positions=p), torch under no_grad, JAX's call one nnx.jit program at "
        f"precision {PRECISION.name}. rope: rotary_embedding of the layer's q and k alone with "
        "the module's settings (JAX's jitted as one program). 1-D: rope_theta only, positions "
        "arange (B, L); axial (2, B, L) rows and columns; MRoPE (3, B, L) as get_rope_index "
        "builds text, an image at one temporal position, text.",
        "- ms: median (min–max) of the n steady calls, every encoding and twin of a tower's "
        "part called in turn, round by round, after a first call each. ÷ 1-D: this row's "
        "median ÷ the 1-D encoding's, same tower, part and twin. JAX ÷ torch: jax_module's "
        "median ÷ torch_module's, same row. others %: the share of the cores other processes "
        "kept busy during the rounds.", "",
        "| tower | encoding | part | torch ms | n | ÷ 1-D | JAX ms | n | ÷ 1-D | JAX ÷ torch "
        "| others % |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pairs = [(r, next(s for s in rows if s["impl"] == "jax_module" and all(
        s[f] == r[f] for f in ("tower", "encoding", "part"))))
        for r in rows if r["impl"] == "torch_module"]
    pairs.sort(key=lambda p: (p[0]["tower"] != "vision", p[0]["part"]))  # stable: encodings
    for t, j in pairs:
        others = max((o for o in (t["other_cpu_pct"], j["other_cpu_pct"]) if o is not None),
                     default=None)
        lines.append(f"| {t['tower']} | {t['encoding']} | {t['part']} | {_cell(t)} "
                     f"| {t['repeats']} | {t['enc_ratio']:.2f} | {_cell(j)} | {j['repeats']} "
                     f"| {j['enc_ratio']:.2f} | {j['torch_ratio']:.2f} "
                     f"| {_f(others, '{:.0f}')} |")
    return lines + [""] + encoding_cost_lines(rows)


def encoding_cost_lines(rows: list[dict]) -> list[str]:
    """The encoding's cost in the layer: rope's extra time over the 1-D rope, and the whole
    rope, as % of the same twin's layer time with that encoding."""
    at = {(r["tower"], r["encoding"], r["part"], r["impl"]): r["median_ms"] for r in rows}
    lines = ["- extra % of layer: (rope − 1-D rope) ÷ this encoding's layer time; rope % of "
             "layer: rope ÷ the same layer time.", "",
             "| tower | encoding | torch: extra % of layer | rope % of layer | JAX: extra % of "
             "layer | rope % of layer |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for tower, name, part, impl in at:
        if part != "layer" or impl != "torch_module":
            continue
        cells = []
        for i in POSITION_IMPLS:
            layer, rope = at[tower, name, "layer", i], at[tower, name, "rope", i]
            cells += [f"{100 * (rope - at[tower, PLAIN, 'rope', i]) / layer:.1f}",
                      f"{100 * rope / layer:.1f}"]
        lines.append(f"| {tower} | {name} | " + " | ".join(cells) + " |")
    return lines
