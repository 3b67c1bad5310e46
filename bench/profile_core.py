"""Profile of the JAX core's CPU time (issue 27, item 1): timings, HLO statistics, prototypes.

Not wired into the package or the bench; run from the repository root with PYTHONPATH=$PWD:

    python bench/profile_core.py time [--rows NAME ...] [--repeats N]
    python bench/profile_core.py hlo --length L [--causal] [--dtype bfloat16] [--grad]
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/profile_core.py time

Every variant is timed in the same process as torch's fused kernel, median of ``--repeats``
steady calls after two warm-up calls (compilation excluded). Shapes B=4, H=8, D=64.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from jax_attn import functional
from jax_attn import scaled_dot_product_attention as core

B, H, D = 4, 8, 64
HIGHEST = jax.lax.Precision.HIGHEST


# ---- the variants -------------------------------------------------------------------------------

def naive(q, k, v, causal, precision=HIGHEST):
    """einsum-softmax-einsum over (B, H) at once; causal mask by jnp.where (the bench's)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=precision) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((lq, lk), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision=precision)


def proto_explicit(q, k, v, causal, precision=HIGHEST):
    """The explicit core's arithmetic (scores and softmax in at least float32, weights cast back
    to the input dtype before the second product) written once over (B, H), no vmap, no head
    chunks: what a fix of cause 1 would compile to."""
    compute = jnp.promote_types(q.dtype, jnp.float32)
    s = (1.0 / math.sqrt(q.shape[-1])) * jnp.einsum(
        "bhqd,bhkd->bhqk", q, k, precision=precision, preferred_element_type=compute)
    if causal:
        lq, lk = s.shape[-2:]
        allowed = jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
        s = jnp.where(allowed, s, jnp.finfo(compute).min)
    w = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jnp.einsum("bhqk,bhkv->bhqv", w, v, precision=precision,
                     preferred_element_type=compute)
    return out.astype(q.dtype)


def proto_causal_blocks(q, k, v, causal, block=256, precision=HIGHEST):
    """Causal attention by query blocks over (B, H): query block i only multiplies keys
    [0, (i + 1)·block) (a static Python loop, so each block has its own static shape), i.e.
    about half the products and exps of the full matrix. Non-causal: proto_explicit."""
    if not causal:
        return proto_explicit(q, k, v, False, precision)
    lq = q.shape[-2]
    outs = []
    for start in range(0, lq, block):
        stop = min(start + block, lq)
        outs.append(proto_explicit_offset(q[..., start:stop, :], k[..., :stop, :],
                                          v[..., :stop, :], start, precision))
    return jnp.concatenate(outs, axis=-2)


def proto_explicit_offset(q, k, v, offset, precision):
    """proto_explicit, causal, with the query rows at positions offset + i."""
    compute = jnp.promote_types(q.dtype, jnp.float32)
    s = (1.0 / math.sqrt(q.shape[-1])) * jnp.einsum(
        "bhqd,bhkd->bhqk", q, k, precision=precision, preferred_element_type=compute)
    lq, lk = s.shape[-2:]
    allowed = jnp.arange(lk)[None, :] <= offset + jnp.arange(lq)[:, None]
    s = jnp.where(allowed, s, jnp.finfo(compute).min)
    w = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bhkv->bhqv", w, v, precision=precision,
                      preferred_element_type=compute).astype(q.dtype)


def proto_chunked(q, k, v, causal, heads=2, block=256, precision=HIGHEST):
    """The (B·H) heads ``heads`` at a time (lax.map, so that a step's scores stay in cache, as
    the core's chunks do) with the whole step written over its heads at once (no per-head vmap,
    no size-1 group axis: XLA fuses the softmax into the second product), and causal by static
    query blocks (only the keys up to each block's last row)."""
    b, h, lq, d = q.shape
    flat = [x.reshape((b * h // heads, heads) + x.shape[2:]) for x in (q, k, v)]

    def step(args):
        qs, ks, vs = (x[None] for x in args)  # (1, heads, L, D)
        if causal:
            return proto_causal_blocks(qs, ks, vs, True, block, precision)[0]
        return proto_explicit(qs, ks, vs, False, precision)[0]

    out = jax.lax.map(step, tuple(flat))
    return out.reshape(b, h, lq, v.shape[-1])


def jax_functions(causal):
    """name -> a function (q, k, v) -> out of (B, H, L, D) arrays (the core's eager call is
    kept unwrapped; everything else is jitted here)."""
    c = bool(causal)
    fns = {
        "core_eager": partial(core, is_causal=c),  # as the bench and users call it
        "core_auto": jax.jit(partial(core, is_causal=c)),
        "core_explicit": jax.jit(partial(core, is_causal=c, implementation="explicit")),
        "core_blockwise": jax.jit(partial(core, is_causal=c, implementation="blockwise")),
        "naive": jax.jit(partial(naive, causal=c)),
        "naive_default": jax.jit(partial(naive, causal=c, precision=None)),
        "jax_nn": jax.jit(lambda q, k, v: jnp.swapaxes(jax.nn.dot_product_attention(
            jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
            is_causal=c, implementation="xla"), 1, 2)),
        "proto_explicit": jax.jit(partial(proto_explicit, causal=c)),
    }
    fns["proto_chunked"] = jax.jit(partial(proto_chunked, causal=c))
    if c:
        fns["proto_causal_blocks"] = jax.jit(partial(proto_causal_blocks, causal=True))
    return fns


def grad_of(fn):
    """jit(grad of sum(out) w.r.t. q, k, v) (the bench's training step)."""
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                            argnums=(0, 1, 2)))


# ---- timing -------------------------------------------------------------------------------------

CPU_PER_WALL = {}  # the last median_ms's process CPU time ÷ wall time (2 = both cores busy)


def median_ms(call, repeats):
    """Median wall time of ``repeats`` calls after two warm-up calls, in ms; the process's CPU
    time ÷ wall time over the timed calls goes to CPU_PER_WALL["last"]."""
    for _ in range(2):
        call()
    times = []
    cpu0 = time.process_time()
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    CPU_PER_WALL["last"] = (time.process_time() - cpu0) / sum(times)
    return 1e3 * statistics.median(times)


def inputs(length, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((B, H, length, D)).astype(np.float32) for _ in range(3)]
    jx = [jnp.asarray(a, dtype=dtype) for a in arrays]
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tx = [torch.tensor(a).to(tdt) for a in arrays]
    return jx, tx


def time_row(length, dtype, causal, train, repeats, skip=()):
    """{variant: ms} for one row, torch's fused SDPA included."""
    jx, tx = inputs(length, dtype)
    result = {}
    if train:
        tx = [t.clone().requires_grad_(True) for t in tx]

        def torch_call():
            out = F.scaled_dot_product_attention(*tx, is_causal=causal)
            out.float().sum().backward()
    else:
        def torch_call():
            with torch.no_grad():
                F.scaled_dot_product_attention(*tx, is_causal=causal)
    result["torch_fused"] = median_ms(torch_call, repeats)
    cpu = {"torch_fused": CPU_PER_WALL["last"]}
    for name, fn in jax_functions(causal).items():
        if name in skip or (train and name == "core_eager"):
            continue
        f = grad_of(fn) if train else fn
        result[name] = median_ms(lambda: jax.block_until_ready(f(*jx)), repeats)
        cpu[name] = CPU_PER_WALL["last"]
    return result, cpu


ROWS = {  # name -> (L, dtype, causal, train)
    f"L{n}{'_causal' if c else ''}{'_train' if t else ''}": (n, "float32", c, t)
    for n in (128, 512, 1024) for c in (False, True) for t in (False, True)
}
ROWS.update({f"L1024_bf16{'_causal' if c else ''}{'_train' if t else ''}": (1024, "bfloat16", c, t)
             for c in (False, True) for t in (False, True)})


def cmd_time(args):
    info = {"xla_flags": os.environ.get("XLA_FLAGS", ""),
            "aten": os.environ.get("ATEN_CPU_CAPABILITY", ""),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "jax": jax.__version__,
            "torch": torch.__version__}
    print(json.dumps(info), flush=True)
    for name in args.rows or ROWS:
        length, dtype, causal, train = ROWS[name]
        t0 = time.perf_counter()
        repeats = args.repeats * (6 if length <= 128 else 2 if length <= 512 else 1)
        skip = set(args.skip)
        if args.only:
            skip |= set(jax_functions(causal)) - set(args.only)
        row, cpu = time_row(length, dtype, causal, train, repeats, skip=skip)
        ref = row["torch_fused"]
        cells = " ".join(f"{k}={v:.2f}({ref / v:.2f}x)" for k, v in row.items())
        print(json.dumps({"row": name, "ms": row, "cpu_per_wall": cpu,
                          "wall_s": time.perf_counter() - t0}),
              flush=True)
        print("#", name, cells, file=sys.stderr, flush=True)


# ---- HLO ----------------------------------------------------------------------------------------

OPS = ("dot", "transpose", "copy", "convert", "while", "fusion", "exponential", "reduce",
       "iota", "compare", "select", "dynamic-slice", "dynamic-update-slice", "custom-call")


def hlo_stats(text):
    """Counts of the interesting ops in an optimized HLO module's text, and each dot's shape."""
    counts = collections.Counter()
    for line in text.splitlines():
        rhs = line.split(" = ", 1)[1] if " = " in line else ""
        m = re.search(r"\s([a-z][a-z\-]*)\(", rhs)  # the op: the first name( after the type
        if m and m.group(1) in OPS:
            counts[m.group(1)] += 1
    dots = [re.sub(r"\s+", " ", line.strip())[:220] for line in text.splitlines()
            if re.search(r"\s(dot|custom-call)\(", line)]
    return counts, dots


def cmd_hlo(args):
    jx, _ = inputs(args.length, args.dtype)
    names = args.names or ["core_auto", "naive", "proto_explicit"]
    fns = jax_functions(args.causal)
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        fn = fns[name]
        f = grad_of(fn) if args.grad else (fn if name != "core_eager" else jax.jit(fn))
        text = f.lower(*jx).compile().as_text()
        tag = f"{name}_L{args.length}_{args.dtype}{'_causal' if args.causal else ''}" + (
            "_grad" if args.grad else "")
        with open(os.path.join(args.out, tag + ".hlo.txt"), "w") as fh:
            fh.write(text)
        counts, dots = hlo_stats(text)
        print(f"== {tag}: {dict(sorted(counts.items()))}")
        for d in dots:
            print("   ", d)


def cmd_check(args):
    """Relative max error of the prototypes against the core (float32)."""
    jx, _ = inputs(args.length, "float32", seed=1)
    for causal in (False, True):
        fns = jax_functions(causal)
        ref = np.asarray(fns["core_explicit"](*jx), np.float64)
        for name in ("proto_explicit", "proto_causal_blocks", "proto_chunked", "naive",
                     "core_blockwise"):
            if name not in fns:
                continue
            got = np.asarray(fns[name](*jx), np.float64)
            rel = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
            print(f"L={args.length} causal={causal} {name}: max|diff|/max|ref| = {rel:.2e}")


def cmd_parts(args):
    """Per-op timings of one forward's pieces over (B, H) at once: QKᵀ, the softmax (exp and
    the reductions), the causal select, PV; in float32 and the input dtype; then torch's fused
    kernel and its two products (``torch_parts``)."""
    jx, _ = inputs(args.length, args.dtype)
    q, k, v = jx
    compute = jnp.promote_types(q.dtype, jnp.float32)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=compute)
    w = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    lq, lk = s.shape[-2:]
    parts = {
        "qk_dot": (jax.jit(lambda q, k: jnp.einsum(
            "bhqd,bhkd->bhqk", q, k, precision=HIGHEST, preferred_element_type=compute)), (q, k)),
        "qk_dot_per_head_vmap": (jax.jit(jax.vmap(jax.vmap(lambda q, k: jnp.einsum(
            "qd,kd->qk", q, k, precision=HIGHEST, preferred_element_type=compute)))), (q, k)),
        "softmax": (jax.jit(lambda s: jax.nn.softmax(s, axis=-1)), (s,)),
        "exp_only": (jax.jit(jnp.exp), (s,)),
        "max_sum_only": (jax.jit(lambda s: s.max(-1) + s.sum(-1)), (s,)),
        "causal_select": (jax.jit(lambda s: jnp.where(
            jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None], s, -1e30)), (s,)),
        "causal_select_softmax": (jax.jit(lambda s: jax.nn.softmax(jnp.where(
            jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None], s, -1e30), axis=-1)), (s,)),
        "pv_dot": (jax.jit(lambda w, v: jnp.einsum(
            "bhqk,bhkv->bhqv", w, v, precision=HIGHEST, preferred_element_type=compute)),
            (w, v)),
    }
    for name, (f, xs) in parts.items():
        ms = median_ms(lambda: jax.block_until_ready(f(*xs)), args.repeats)
        print(f"L={args.length} {args.dtype} {name}: {ms:.2f} ms", flush=True)
    for name, call in torch_parts(args.length, args.dtype).items():
        ms = median_ms(call, args.repeats)
        print(f"L={args.length} {args.dtype} {name}: {ms:.2f} ms", flush=True)


def torch_parts(length, dtype):
    """torch's fused kernel and its two products alone (torch.matmul over (B, H)), on the same
    inputs as ``parts``'s JAX pieces, timed in the same process."""
    _, (q, k, v) = inputs(length, dtype)
    with torch.no_grad():
        w = torch.softmax((q @ k.transpose(-2, -1)).float(), dim=-1).to(q.dtype)

    def no_grad(f):
        def call():
            with torch.no_grad():
                f()
        return call
    return {"torch_fused": no_grad(lambda: F.scaled_dot_product_attention(q, k, v)),
            "torch_qk_matmul": no_grad(lambda: q @ k.transpose(-2, -1)),
            "torch_pv_matmul": no_grad(lambda: w @ v)}


def cmd_table(args):
    """Markdown tables (ms, and torch fused ÷ variant) from ``time``'s JSON lines."""
    for path in args.files:
        with open(path) as fh:
            lines = [json.loads(x) for x in fh if x.startswith("{")]
        print(f"{path}: {json.dumps(lines[0])}\n")
        rows = [x for x in lines if "row" in x]
        names = list(dict.fromkeys(k for x in rows for k in x["ms"]))
        print("| row | " + " | ".join(names) + " |")
        print("| --- |" + " ---: |" * len(names))
        for x in rows:
            ref = x["ms"]["torch_fused"]
            cells = [f"{x['ms'][n]:.1f} ({ref / x['ms'][n]:.2f}×)" if n in x["ms"] else "–"
                     for n in names]
            print(f"| {x['row']} | " + " | ".join(cells) + " |")
        print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time")
    t.add_argument("--rows", nargs="*", choices=sorted(ROWS))
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--skip", nargs="*", default=[])
    t.add_argument("--only", nargs="*", default=None, help="time only these variants")
    h = sub.add_parser("hlo")
    h.add_argument("--length", type=int, default=512)
    h.add_argument("--dtype", default="float32")
    h.add_argument("--causal", action="store_true")
    h.add_argument("--grad", action="store_true")
    h.add_argument("--names", nargs="*")
    h.add_argument("--out", default="/tmp/profile27_hlo")
    c = sub.add_parser("check")
    c.add_argument("--length", type=int, default=512)
    p = sub.add_parser("parts")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=7)
    tb = sub.add_parser("table")
    tb.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    commands = {"table": cmd_table, "time": cmd_time, "hlo": cmd_hlo, "check": cmd_check,
                "parts": cmd_parts}
    commands[args.cmd](args)


if __name__ == "__main__":
    print(f"heads_per_step threshold: {functional.CPU_CHUNK_MIN_SCORES}", file=sys.stderr)
    main()
